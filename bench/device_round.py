"""A round's close and a member's apply of its update on a device, against the CPU in the
same run, with the replicas' hashes compared.

The coordinator's close (``server.update_steps.close_round``: aggregate every parameter's
results, compress the broadcast, step the master) and a tier-0 member's apply of the update
it downloads (``RoundUpdate.cut`` then ``apply``, as ``client.replica.Replica`` applies it)
run twice on the same inputs: once with every tensor on the CPU, once with the master, the
results and the member's weights on ``--device``. The results are the first round's results
of random gradients, one simulated member per tier of ``--tiers``, encoded as members encode
them (``scale.Submissions``: DCT, chunk 64, top 32, bfloat16 values). Each timing is the
median of ``--repeats`` closes (or applies) from the same state, after one untimed.

The point of the hashes: every replica must hold the master's bits. ``close hash`` compares
the device's new master with what a CPU member gets by applying that close's own update to
the old weights (``close_bits_vs_cpu`` says whether the device's sums also rounded as the
CPU's did, which no replica needs); ``apply hash``
compares a member's weights after applying the update on the device with the CPU master's
tier-0 hash. "equal" is the only good answer; anything else is a replica that would
resynchronise every round.

    python bench/device_round.py --device cuda                 # 162M parameters (150m shape)
    python bench/device_round.py --device cuda --json runs/device_round.json
    python bench/device_round.py --smoke                       # tiny, CPU against CPU: it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from harness import parse, print_table, sync
from scale import SHAPES, Submissions, model_config
from torch import Tensor

from matformer.modeling import AutoregressiveModel, canonical_state_dict
from matformer.modeling.compression import (
    CompressionConfig,
    RoundUpdate,
    SparseResult,
    UpdateConfig,
    region_slices,
    tier_hashes,
    tier_regions,
    universal_shapes,
)
from matformer.modeling.devices import resolve_device
from matformer.modeling.errors import DeviceUnavailable
from matformer.server.sections.training import DEFAULT_BROADCAST_TOPK
from matformer.server.update_steps import close_round

SMOKE = dict(shape="tiny", repeats=1, threads=1)
SIZES = {**SHAPES, "tiny": {"hidden_size": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                            "intermediate_size": 256, "vocab_size": 260}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = CompressionConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SIZES), default="150m",
                        help="150m: 162M parameters, hidden 768, 12 layers, FFN 3072, vocab 32000")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the second close and apply run (default: cuda if present)")
    parser.add_argument("--tiers", default="0,1,2", help="one simulated member per tier")
    parser.add_argument("--rule", choices=["sign", "sgd"], default="sign")
    parser.add_argument("--broadcast-topk", type=int, default=DEFAULT_BROADCAST_TOPK,
                        help="[update] broadcast_topk (0: the exact aggregate)")
    parser.add_argument("--repeats", type=int, default=3, help="timed closes and applies each")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: every core this process may use)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parse(parser, SMOKE, argv)
    for key, value in SIZES[args.shape].items():
        setattr(args, key, value)
    # what scale.Submissions and scale.model_config read
    args.seq_len = 128
    args.encoding, args.chunk = defaults.encoding, defaults.chunk
    args.topk, args.value_dtype = defaults.topk, defaults.value_dtype
    return args


def timed(work: Callable[[], Any], device: torch.device, repeats: int) -> tuple[Any, float]:
    """``work()``'s last result and the median of its wall times over ``repeats`` runs, after
    one untimed run (the first pays for allocations, kernels loaded and caches filled)."""
    seconds, result = [], work()
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = work()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return result, statistics.median(seconds)


def on(device: torch.device, result: SparseResult) -> SparseResult:
    return dataclasses.replace(result, chunks=result.chunks.to(device),
                               indices=result.indices.to(device),
                               values=result.values.to(device))


def cpu(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {name: tensor.cpu() for name, tensor in state.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except DeviceUnavailable as error:
        raise SystemExit(str(error)) from None
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    config = model_config(args)
    shapes = universal_shapes(config)
    tiers = sorted({int(t) for t in args.tiers.split(",")})
    regions = {tier: tier_regions(shapes, config, tier) for tier in tiers}
    torch.manual_seed(0)
    master = {name: t.detach().clone() for name, t in
              canonical_state_dict(AutoregressiveModel(config)).items()}
    submissions = Submissions(args)
    by_name: dict[str, list[SparseResult]] = {}
    for index, tier in enumerate(tiers):
        for result in submissions.results(index, tier):
            by_name.setdefault(result.name, []).append(result)
    update = UpdateConfig(rule=args.rule, lr=1e-3, broadcast_topk=args.broadcast_topk,
                          chunk=args.chunk)
    rule = update.build()
    parameters = sum(t.numel() for t in master.values())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} | {parameters / 1e6:,.1f}M parameters ({args.shape}) | "
          f"{len(tiers)} members at tiers {tiers} | {args.rule}, broadcast top "
          f"{args.broadcast_topk} | {device} ({where}) against the cpu, "
          f"{torch.get_num_threads()} threads")

    # the CPU: the reference every replica must match
    (new_master, steps, _), cpu_close = timed(lambda: close_round(rule, master, by_name),
                                              torch.device("cpu"), args.repeats)
    want = tier_hashes(new_master, regions)
    record = RoundUpdate(round=0, update=update, steps=steps, hashes=want)
    member = {name: master[name][region_slices(r)].clone() for name, r in regions[0].items()}
    download = record.cut(0, regions[0])
    applied, cpu_apply = timed(lambda: download.apply(member, regions[0]),
                               torch.device("cpu"), args.repeats)
    figures: dict[str, Any] = {
        "shape": args.shape, "parameters": parameters, "tiers": tiers, "rule": args.rule,
        "broadcast_topk": args.broadcast_topk, "device": str(device), "device_name": where,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu_close_s": cpu_close, "cpu_apply_s": cpu_apply,
        "cpu_apply_hash": _verdict(tier_hashes(applied, {0: regions[0]})[0], want[0]),
    }

    # the device: the same close and apply, every tensor there
    try:
        moved = {name: t.to(device) for name, t in master.items()}
        results = {name: [on(device, r) for r in rs] for name, rs in by_name.items()}
        sync(device)
        (device_master, device_steps, _), device_close = timed(
            lambda: close_round(rule, moved, results), device, args.repeats)
        got = tier_hashes(cpu(device_master), regions)
        # what replicas need of a close on the device: its update, applied to the old
        # weights on a CPU member, gives the device master's bits. Its sums may round
        # otherwise than the CPU's (another reduction order): reported, no fault.
        device_record = RoundUpdate(
            round=0, update=update, hashes=got,
            steps={name: _on_cpu(step) for name, step in device_steps.items()})
        followed = device_record.cut(0, regions[0]).apply(
            {name: t.clone() for name, t in member.items()}, regions[0])
        figures |= {"device_close_s": device_close,
                    "close_hash": _verdict(tier_hashes(followed, {0: regions[0]})[0], got[0]),
                    "close_bits_vs_cpu": _verdict(got, want),
                    "close_speedup": cpu_close / device_close}
    except Exception as error:  # reported, and the apply still measured
        figures["device_close_error"] = _error(error)
    try:
        weights = {name: t.to(device) for name, t in member.items()}
        applied, device_apply = timed(lambda: download.apply(weights, regions[0]),
                                      device, args.repeats)
        figures |= {"device_apply_s": device_apply,
                    "apply_hash": _verdict(tier_hashes(cpu(applied), {0: regions[0]})[0],
                                           want[0]),
                    "apply_speedup": cpu_apply / device_apply}
    except Exception as error:
        figures["device_apply_error"] = _error(error)

    _report(figures)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")
    return figures


def _on_cpu(step: Any) -> Any:
    """A step's tensors on the CPU, as a member receives them off the wire."""
    return dataclasses.replace(step, **{
        f.name: getattr(step, f.name).cpu() for f in dataclasses.fields(step)
        if isinstance(getattr(step, f.name), Tensor)})


def _verdict(got: Any, want: Any) -> str:
    return "equal" if got == want else "DIFFERENT"


def _error(error: Exception) -> str:
    """The error's last frames, enough to find the line that assumed the CPU."""
    return "".join(traceback.format_exception(error)[-3:]).strip()


def _report(f: dict[str, Any]) -> None:
    rows = []
    for step in ("close", "apply"):
        if f"device_{step}_error" in f:
            rows.append([step, f"{f[f'cpu_{step}_s']:.3f}", "failed", "-", "-"])
            continue
        rows.append([step, f"{f[f'cpu_{step}_s']:.3f}", f"{f[f'device_{step}_s']:.3f}",
                     f"{f[f'{step}_speedup']:.1f}x", f[f"{step}_hash"]])
    print()
    print_table(["step", "cpu s", f"{f['device']} s", "cpu / device", "replica hash"], rows)
    if "close_bits_vs_cpu" in f:
        print(f"close hash: the device master against its own update applied on a CPU member; "
              f"its bits against the CPU's close: {f['close_bits_vs_cpu']}")
    for step in ("close", "apply"):
        if f"device_{step}_error" in f:
            print(f"\nthe {step} failed on {f['device']}:\n{f[f'device_{step}_error']}")


if __name__ == "__main__":
    main()
