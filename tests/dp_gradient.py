"""Run under ``torchrun --nproc-per-node N``: one data-parallel step's gradient, saved.

    torchrun --standalone --nproc-per-node 2 tests/dp_gradient.py OUT.pt causal|masked [cuda]

Every rank builds the same tiny model and batch; rank 0 saves the summed gradient and the
losses (what tests/test_data_parallel.py compares with one process's).
"""

from __future__ import annotations

import sys

import torch
from support.models import tiny_config  # this script's folder is on sys.path, as pytest's rootdir

from matformer.modeling import build_model
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, pack_rows
from matformer.modeling.distributed import DataParallel
from matformer.modeling.training import StepOptions, TierSchedule, tier_gradients


def step(objective: str, parallel: DataParallel | None,
         device: torch.device | str = "cpu") -> dict:
    torch.manual_seed(0)
    model = build_model(tiny_config(is_causal=objective == "causal")).to(device)
    examples = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).to(device)
                for n in (17, 4, 9, 30, 2, 11, 23, 6, 31, 5)]
    rows = pack_rows([len(e) for e in examples], row_length=32)
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=32).build())
    losses = tier_gradients(runner, examples, TierSchedule(tiers=[0, 1]), step=5, rows=rows,
                            options=StepOptions(data_parallel=parallel, seed=7))
    return {"losses": losses,
            "grads": {n: p.grad.cpu().clone() for n, p in model.named_parameters()}}


if __name__ == "__main__":
    out, objective = sys.argv[1], sys.argv[2]
    device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
    parallel = DataParallel.from_environment(device)  # NCCL on CUDA, Gloo on CPU
    result = step(objective, parallel, parallel.device if parallel else device)
    if parallel is None or parallel.leader:
        torch.save(result, out)
    if parallel is not None:
        parallel.close()
