"""The capability probe: what a client reports when it joins (``Capabilities`` in the protocol).

Device kind and name, the memory training may use, and the training tokens per second
measured on a short warm-up with the actual model at the tier it will train. The coordinator
picks the tier from the memory and sizes each round's work from the speed
(docs/architecture.md, "One round").
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
from matformer.modeling.devices import Precision
from matformer.modeling.matformer import Tier
from matformer.modeling.models import AutoregressiveModel


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).name
    if device.type == "mps":
        return platform.processor() or "Apple GPU"
    for line in _read_lines("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def memory_bytes(device: torch.device) -> int:
    """CUDA: the device's total memory. CPU and MPS (unified memory): the RAM available now,
    ``MemAvailable`` of /proc/meminfo (free plus reclaimable cache), else free physical pages
    from ``os.sysconf``. Available, not total: other processes share a CPU host."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    for line in _read_lines("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in KiB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_tokens_per_second(
    model: AutoregressiveModel,
    tier: Tier | None = None,
    *,
    sequence_length: int = 256,
    batch_tokens: int = 4096,
    steps: int = 3,
    seed: int = 0,
    precision: str = "fp32",
) -> float:
    """Training tokens/s of ``model`` at ``tier``: forward/backward on random ids in batches
    of ``batch_tokens`` under ``precision``, timed over ``steps`` after one untimed step
    (allocation, kernel selection). The weights are not changed; the gradients are cleared
    afterwards."""
    device = next(model.parameters()).device
    autocast = Precision(precision, device)
    length = min(sequence_length, model.config.max_position_embeddings, batch_tokens)
    rows = max(1, batch_tokens // length)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=generator)
    examples = [row.to(device) for row in ids]
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=batch_tokens).build())
    runner.accumulate(examples, tier=tier, precision=autocast)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        runner.accumulate(examples, tier=tier, precision=autocast)
    _synchronize(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return steps * rows * length / seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []
