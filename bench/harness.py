"""What the benchmarks share: the smoke pass, shape options, the timed step, step memory.

Every benchmark takes ``--smoke`` (``parse``): the same run at tiny sizes, seconds long, so
that CI runs each one (tests/test_bench_smoke.py) and none rots unseen; its figures say
nothing about speed or quality.

A *step* is forward → loss → backward → optimizer update → gradients freed, the unit a
training loop repeats. Timings interleave the contenders in blocks (A B, then B A, ...) so
that machine noise (other processes, clock boosts, thermal limits) hits each of them alike.
On CPU each block's share of CPU time per thread is recorded too: far below 100%, other
processes took cores during that block, and the run warns.

Step memory is the peak of tensor memory during one step above what was held just before
it (weights and optimizer state): activations saved for backward, gradients and
temporaries. On CUDA it is ``torch.cuda.max_memory_allocated`` after a reset. On CPU, torch
keeps no allocation statistics, and a process's peak RSS only ever grows, so a later step
could never show a smaller peak; instead the step runs once under ``torch.profiler`` with
``profile_memory=True``, which records every allocation and free made by torch's CPU
allocator, and the running total of those records gives the peak. It counts tensor storage
only (no allocator slack, no oneDNN scratch space), like ``max_memory_allocated`` on CUDA.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from matformer.modeling import ModelConfig
from matformer.modeling.devices import Precision
from matformer.modeling.optim import LocalOptimizer

Step = Callable[[], None]

# Below this share of CPU time per thread, other processes were running during the timing.
CPU_SHARE_FLOOR = 0.85

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Dense datasheet peaks in TFLOP/s, first matching name wins: (substring of the CUDA device
# name, bf16/fp16 tensor cores, fp32 without TF32, which is torch's default for fp32 matmuls).
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0, 51.2),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.4, 66.9),
    ("H200", 989.4, 66.9),
    ("A100", 312.0, 19.5),
)


# ``add_shape_args``'s options at a size that trains in milliseconds, a few steps.
# One thread: a smoke pass is too small to share, and CI runs beside other work.
SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, layers=2, heads=4, kv_heads=2,
                   intermediate_size=256, seq_len=32, batch_size=2, steps=2, repeats=2, warmup=1,
                   threads=1)


def parse(parser: argparse.ArgumentParser, smoke: dict[str, Any],
          argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser``'s options plus ``--smoke``, which makes ``smoke`` the defaults: the
    benchmark's own path at tiny sizes. Options given on the command line still win."""
    parser.add_argument("--smoke", action="store_true",
                        help="a pass of seconds at tiny sizes, as CI runs it: "
                             + ", ".join(f"{k}={v}" for k, v in smoke.items()))
    args = parser.parse_args(argv)
    unknown = set(smoke) - set(vars(args))
    if unknown:
        raise ValueError(f"smoke settings name no option of this benchmark: {sorted(unknown)}")
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


def add_device_args(group: argparse._ArgumentGroup, dtype_help: str | None = None) -> None:
    """``--dtype``, ``--device`` and ``--threads``, which ``setup`` reads."""
    group.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help=dtype_help)
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    group.add_argument("--threads", type=int, default=None,
                       help="CPU threads for torch (default: every core this process may use)")


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """Model shape, batch, device and timing options shared by every benchmark."""
    shape = parser.add_argument_group("model and batch")
    shape.add_argument("--vocab-size", type=int, default=32000)
    shape.add_argument("--hidden-size", type=int, default=512)
    shape.add_argument("--layers", type=int, default=8)
    shape.add_argument("--heads", type=int, default=8)
    shape.add_argument("--kv-heads", type=int, default=4)
    shape.add_argument("--intermediate-size", type=int, default=2048)
    shape.add_argument("--seq-len", type=int, default=256)
    shape.add_argument("--batch-size", type=int, default=4)
    run = parser.add_argument_group("run")
    add_device_args(run, dtype_help="dtype of weights, activations and optimizer state")
    run.add_argument("--steps", type=int, default=12,
                     help="timed steps per contender, split over --repeats blocks")
    run.add_argument("--repeats", type=int, default=6,
                     help="interleaved blocks per contender; each yields one paired ratio")
    run.add_argument("--warmup", type=int, default=2,
                     help="untimed steps per contender before timing")
    run.add_argument("--lr", type=float, default=1e-4)
    run.add_argument("--seed", type=int, default=0)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.seq_len,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        mask_token_id=None,
    )


def setup(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Seed, thread count, and the device and dtype the run asked for."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device; use cpu.")
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return device, DTYPES[args.dtype]


def random_batch(args: argparse.Namespace, device: torch.device) -> Tensor:
    """Token ids (B, T) drawn uniformly from the vocabulary."""
    return torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), device=device)


def describe(args: argparse.Namespace, device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"cpu, {torch.get_num_threads()} threads"
    )
    return (
        f"torch {torch.__version__} | {where} | {args.dtype} | batch {args.batch_size} x "
        f"seq {args.seq_len} | hidden {args.hidden_size}, {args.layers} layers, heads "
        f"{args.heads}/{args.kv_heads} kv, ffn {args.intermediate_size}, vocab {args.vocab_size}"
    )


def train_step(loss: Callable[[], Tensor], optimizer: LocalOptimizer) -> Step:
    """One training step; gradients are freed at its end so steps start from the same state."""

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def precision_step(
    loss: Callable[[], Tensor], optimizer: LocalOptimizer, precision: Precision,
    parameters: Sequence[nn.Parameter],
) -> Step:
    """``train_step`` under a mixed precision: the forward (and loss) under autocast with the
    weights left float32; under fp16 the loss is multiplied by the loss scale before backward
    and the gradients divided by it before the update, and a step whose gradients overflowed
    is recomputed at half the scale (``modeling.devices.LossScale``). fp32 is ``train_step``."""
    if precision.name == "fp32":
        return train_step(loss, optimizer)

    def step() -> None:
        while True:
            with precision.autocast():
                value = loss()
            if precision.loss_scale is not None:
                value = value * precision.scale
            value.backward()
            if precision.unscale(parameters):
                break
            optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def step_flops(model: nn.Module, config: ModelConfig, tokens: int, seq_len: int,
               ffn_width: int | None = None) -> float:
    """Model FLOPs of one training step, PaLM's count: 6 per token per weight of every
    ``nn.Linear`` (2 forward, 4 backward; the embedding lookup is no product, a tied LM head
    counts once as a Linear), plus 12·L·H·D·T per token for the attention scores and their
    weighted sum, counted without the causal mask's savings as PaLM counts them. With
    ``ffn_width`` (a MatFormer tier's), the FFN's three projections count that many neurons
    per layer instead of the model's full ``intermediate_size``."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if ffn_width is not None:  # gate, up and down: hidden x width each, in every layer
        weights -= (3 * config.hidden_size * (config.intermediate_size - ffn_width)
                    * config.num_hidden_layers)
    attention = (12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
                 * seq_len)
    return float((6 * weights + attention) * tokens)


def peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[str, float | None]:
    """The device's name and its datasheet peak TFLOP/s for matmuls in ``dtype`` (None when
    the device is not in PEAK_TFLOPS)."""
    name = torch.cuda.get_device_name(device)
    for key, half, single in PEAK_TFLOPS:
        if key in name:
            return name, single if dtype == torch.float32 else half
    return name, None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(slots=True)
class Timing:
    """Seconds per step of one contender, grouped by interleaved block."""

    blocks: list[list[float]] = field(default_factory=list)
    # Per block: CPU time used / (wall time x torch threads); well below 1 when others ran.
    cpu_shares: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(t for block in self.blocks for t in block)

    def block_medians(self) -> list[float]:
        return [statistics.median(block) for block in self.blocks]

    def cpu_use(self, device: torch.device) -> str:
        """The lowest block's CPU share as a table cell; on CUDA the host mostly waits."""
        return f"{min(self.cpu_shares):.0%}" if device.type == "cpu" else "-"


def time_interleaved(
    steps: dict[str, Step], device: torch.device, *, timed: int, repeats: int, warmup: int
) -> dict[str, Timing]:
    """Per-step wall times of each contender, run in alternating blocks after warmup."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync(device)
    per_block = math.ceil(timed / repeats)
    timings = {name: Timing() for name in steps}
    order = list(steps)
    for repeat in range(repeats):
        # Reverse the order every other block so neither contender always runs first.
        for name in order if repeat % 2 == 0 else order[::-1]:
            block = []
            cpu_start = time.process_time()
            for _ in range(per_block):
                start = time.perf_counter()
                steps[name]()
                sync(device)
                block.append(time.perf_counter() - start)
            cpu = time.process_time() - cpu_start
            timings[name].blocks.append(block)
            timings[name].cpu_shares.append(cpu / (sum(block) * torch.get_num_threads()))
    return timings


def contention_warning(timings: dict[str, Timing], device: torch.device) -> str | None:
    """A warning when other processes took CPU time from timed blocks, else None."""
    shares = [share for timing in timings.values() for share in timing.cpu_shares]
    hit = sum(share < CPU_SHARE_FLOOR for share in shares)
    if device.type != "cpu" or not hit:
        return None
    return (
        f"warning: in {hit} of {len(shares)} timed blocks other processes took CPU time "
        f"(cpu use down to {min(shares):.0%}); medians absorb a few such blocks, but if many "
        "are hit, rerun on an idle machine or with --threads below the free cores."
    )


def step_peak_bytes(step: Step, device: torch.device) -> int:
    """Peak tensor bytes allocated during one step above those held before it."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step()
    # Each "[memory]" record is one allocation (+bytes) or free (-bytes), in time order.
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(records, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:>{w}}}" for w in widths)
    print(line.format(*headers))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"
