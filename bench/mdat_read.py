"""How fast do MDAT and saetta read sequences, against a plain numpy memmap of the same tokens?

Builds the default container (stdlib docstrings, byte tokens, chunk_size 128) in a temporary
folder, shuffles it and exports the shuffled sequences to a saetta folder. The baseline
("memmap") is the least code that reads those variable-length sequences: the saetta tokens
copied to another ``.npy``, opened with ``np.load(mmap_mode="r")``, viewed as an ndarray
(``np.asarray``) and sliced with offsets held in memory. The "np.memmap" row slices the
``np.memmap`` object itself, which runs numpy's Python-level memmap hooks on every slice.
Every contender reads the same sequences and copies each one out, as a data loader would.

- random: sequence ``order[i]`` for random ``i``; MDAT via ``reader[order[i]]`` (two binary
  searches and a slice), saetta and the baseline via their position ``i``;
- sequential: every sequence in saetta order; MDAT via ``reader[order[i]]``.

Contenders run in interleaved repetitions; the ratio is the median of per-repetition ratios.

    python bench/mdat_read.py
    python bench/mdat_read.py --smoke          # 100 docstrings, 1,000 reads: it runs
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from harness import parse

from matformer.modeling.mdat import SaettaReader, build_default_mdat, export_saetta

BASELINE = "memmap"
SMOKE = dict(limit=100, reads=1000, repeats=1)


def timed(read: Callable[[], int]) -> float:
    """Sequences per second of one call of ``read`` (which returns how many it read)."""
    start = time.perf_counter()
    count = read()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="docstrings (default: all)")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--reads", type=int, default=100_000, help="random reads per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    args = parse(parser, SMOKE)

    with tempfile.TemporaryDirectory() as tmp:
        mdat = build_default_mdat(Path(tmp) / "mdat", args.limit)
        reader = mdat.sequences("bytes128", args.max_seq_len)
        order = mdat.shuffle(None, "bytes128", args.max_seq_len, seed=0)
        saetta = SaettaReader(export_saetta(reader, order, Path(tmp) / "saetta"))
        np.save(Path(tmp) / "plain.npy", np.load(Path(tmp) / "saetta" / "tokens.npy"))
        memmap = np.load(Path(tmp) / "plain.npy", mmap_mode="r")
        plain = np.asarray(memmap)  # an ndarray over the same map: slices skip np.memmap's hooks
        offsets = np.load(Path(tmp) / "saetta" / "offsets.npy").astype(np.int64)
        bounds = offsets.tolist()
        positions = np.random.default_rng(0).integers(0, len(saetta), args.reads)
        ids = order[positions]
        print(f"{len(reader):,} sequences of <= {args.max_seq_len} tokens, "
              f"{len(plain):,} tokens; {args.reads:,} random reads per repetition\n")

        def loop(read: Callable[[int], np.ndarray], over: np.ndarray) -> Callable[[], int]:
            def run() -> int:
                for i in over.tolist():
                    read(i).copy()
                return len(over)
            return run

        def sequential(tokens: np.ndarray) -> Callable[[], int]:
            def run() -> int:
                for start, stop in itertools.pairwise(bounds):
                    tokens[start:stop].copy()
                return len(bounds) - 1
            return run

        def saetta_sequential() -> int:
            for sequence in saetta:
                sequence.copy()
            return len(saetta)

        contenders = {
            ("random", BASELINE): loop(lambda i: plain[offsets[i]:offsets[i + 1]], positions),
            ("random", "np.memmap"): loop(lambda i: memmap[offsets[i]:offsets[i + 1]], positions),
            ("random", "saetta"): loop(saetta.__getitem__, positions),
            ("random", "mdat"): loop(reader.__getitem__, ids),
            ("sequential", BASELINE): sequential(plain),
            ("sequential", "np.memmap"): sequential(memmap),
            ("sequential", "saetta"): saetta_sequential,
            ("sequential", "mdat"): loop(reader.__getitem__, np.asarray(order)),
        }
        rates: dict[tuple[str, str], list[float]] = {key: [] for key in contenders}
        for repeat in range(args.repeats + 1):  # the first repetition warms up
            for key, run in contenders.items():
                rate = timed(run)
                if repeat:
                    rates[key].append(rate)
        mdat.close()

    print(f"{'access':<11} {'reader':<16} {'seq/s':>11}  {'vs memmap':>9}")
    for (access, name), values in rates.items():
        base = rates[(access, BASELINE)]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"{access:<11} {name:<16} {statistics.median(values):>11,.0f}  {ratio:>8.2f}x")


if __name__ == "__main__":
    main()
