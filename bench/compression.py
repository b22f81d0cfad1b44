"""Bytes a client sends per round, compressed against dense fp32, at MatFormer tiers 0, 1, 2.

For a Llama-shaped model (universal shapes from a model built on the meta device, so no
weights are allocated), each tier's client encodes a random gradient (its first-round
momentum) for every parameter it covers, over the region its tier covers, and decodes it
again, as error feedback does each round.
Settings are ``CompressionConfig``'s defaults (DeMo: DCT, chunk 64, top 32 per chunk, values
bfloat16) unless flags override them.

Bytes count what a result carries: chunk ids and in-chunk positions at the smallest signed
integer dtype that holds them (int16 for a 64 x 64 chunk, int8 for a 64-long 1-D chunk) and
values at the configured dtype; the few dozen bytes of name, shape and region are left out.
Two more ratios show other choices: ids and positions as int64 (as ``SparseResult`` holds
them, and as ``protocol/`` sends tensors today), and values as fp32. Dense is the tier's
region in fp32. Encode and decode times are per round for the whole model, the fastest of
``--repeats`` after a warm-up (the machine is shared; ``cpu use`` below 85% means other
processes ran); ``aggregate`` is the coordinator combining one result per tier for every
parameter.

    python bench/compression.py
    python bench/compression.py --hidden-size 256 --layers 4 --topk 16 --value-dtype float32
    python bench/compression.py --smoke          # a 0.2M-parameter model, one round: it runs
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from harness import CPU_SHARE_FLOOR, parse, print_table
from torch import Tensor

from matformer.modeling import ModelConfig
from matformer.modeling.compression import (
    VALUE_DTYPES,
    CompressionConfig,
    Compressor,
    Region,
    SparseResult,
    decode,
    payload_bytes,
    region_shape,
    tier_regions,
    universal_shapes,
)
from matformer.server.aggregation import Aggregate, aggregate

SMOKE = dict(vocab_size=512, hidden_size=64, layers=2, heads=4, kv_heads=2,
             intermediate_size=256, repeats=1, threads=1)


def parse_args() -> argparse.Namespace:
    defaults = CompressionConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--vocab-size", type=int, default=32000)
    model.add_argument("--hidden-size", type=int, default=512)
    model.add_argument("--layers", type=int, default=8)
    model.add_argument("--heads", type=int, default=8)
    model.add_argument("--kv-heads", type=int, default=4)
    model.add_argument("--intermediate-size", type=int, default=2048)
    run = parser.add_argument_group("compression and run")
    run.add_argument("--tiers", default="0,1,2")
    run.add_argument("--encodings", default="topk,dct")
    run.add_argument("--chunk", type=int, default=defaults.chunk)
    run.add_argument("--topk", type=int, default=defaults.topk)
    run.add_argument("--value-dtype", choices=sorted(VALUE_DTYPES), default=defaults.value_dtype)
    run.add_argument("--repeats", type=int, default=2, help="timed rounds; the fastest is shown")
    run.add_argument("--threads", type=int, default=None)
    return parse(parser, SMOKE)


def _best_seconds(work: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Fastest wall time of ``repeats`` calls after one untimed warm-up, the CPU share of the
    timed calls (CPU time / wall time x threads), and the last output."""
    times, out = [], work()
    cpu_start = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        out = work()
        times.append(time.perf_counter() - start)
    share = (time.process_time() - cpu_start) / (sum(times) * torch.get_num_threads())
    return min(times), share, out


def _sizes(results: list[SparseResult]) -> tuple[int, int, int]:
    """Bytes as sent, with ids and positions as int64, and with values as fp32."""
    sent = as_int64 = as_fp32 = 0
    for result in results:
        values = result.values.numel() * result.values.element_size()
        indices = payload_bytes(result) - values
        sent += indices + values
        as_int64 += (result.chunks.numel() + result.indices.numel()) * 8 + values
        as_fp32 += indices + result.values.numel() * 4
    return sent, as_int64, as_fp32


def _encode_all(
    compressor: Compressor, grads: dict[str, Tensor], shapes: dict[str, tuple[int, ...]],
    regions: dict[str, Region],
) -> list[SparseResult]:
    return [
        compressor.encode(name, grad, shape=shapes[name], region=regions[name], tokens=1024)
        for name, grad in grads.items()
    ]


def _decode_all(results: list[SparseResult]) -> list[Tensor]:
    return [decode(result) for result in results]


def _aggregate_all(by_parameter: list[tuple[SparseResult, ...]]) -> list[Aggregate]:
    return [aggregate(results) for results in by_parameter]


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, mask_token_id=None,
    )
    shapes = universal_shapes(config)
    tiers = [int(t) for t in args.tiers.split(",")]
    encodings = args.encodings.split(",")
    print(
        f"torch {torch.__version__} | cpu, {torch.get_num_threads()} threads | hidden "
        f"{args.hidden_size}, {args.layers} layers, ffn {args.intermediate_size}, vocab "
        f"{args.vocab_size} | {sum(torch.Size(s).numel() for s in shapes.values()):,} params | "
        f"chunk {args.chunk}, top {args.topk}, values {args.value_dtype}"
    )
    rows, shares, sent_by = [], [], {}
    for tier in tiers:
        regions = tier_regions(shapes, config, tier)
        grads = {name: torch.randn(region_shape(region)) for name, region in regions.items()}
        dense = 4 * sum(grad.numel() for grad in grads.values())
        for encoding in encodings:
            compressor = CompressionConfig(
                encoding=encoding, chunk=args.chunk, topk=args.topk, value_dtype=args.value_dtype
            ).build()
            encode_s, encode_share, results = _best_seconds(
                partial(_encode_all, compressor, grads, shapes, regions), args.repeats
            )
            decode_s, decode_share, _ = _best_seconds(
                partial(_decode_all, results), args.repeats
            )
            sent_by[encoding, tier] = results
            shares += [encode_share, decode_share]
            sent, as_int64, as_fp32 = _sizes(results)
            rows.append([
                str(tier), str(args.intermediate_size >> tier), encoding,
                f"{dense / 2**20:,.1f}", f"{sent / 2**20:,.3f}", f"{dense / sent:,.1f}x",
                f"{dense / as_int64:,.1f}x", f"{dense / as_fp32:,.1f}x",
                f"{encode_s * 1e3:,.0f}", f"{decode_s * 1e3:,.0f}",
                f"{min(encode_share, decode_share):.0%}",
            ])
    print_table(
        ["tier", "ffn", "encoding", "dense MiB", "sent MiB", "ratio", "int64 idx",
         "fp32 values", "encode ms", "decode ms", "cpu use"],
        rows,
    )
    for encoding in encodings:
        by_parameter = list(zip(*(sent_by[encoding, tier] for tier in tiers), strict=True))
        seconds, share, _ = _best_seconds(partial(_aggregate_all, by_parameter), args.repeats)
        shares.append(share)
        print(f"aggregate {encoding}, one result per tier {tiers}: {seconds * 1e3:,.0f} ms/round "
              f"(cpu use {share:.0%})")
    if min(shares) < CPU_SHARE_FLOOR:
        print(f"warning: other processes took CPU time (cpu use down to {min(shares):.0%}); "
              "times are the fastest of --repeats, rerun on an idle machine to trust them.")


if __name__ == "__main__":
    main()
