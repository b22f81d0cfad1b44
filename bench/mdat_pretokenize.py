"""How many MB of text per second does MDAT pretokenize, with 1 and 2 processes?

Imports the stdlib docstrings ``--copies`` times into a temporary container, trains a small
byte-level BPE on them, then pretokenizes the whole submdat with three strategies (bytes cut
every 128 tokens, bytes packed by sentences, BPE cut every 128 tokens), each with 1 and 2
processes, ``--repeats`` times under fresh strategy names. MB/s counts the UTF-8 bytes of the
texts over the wall time of `Mdat.pretokenize`, worker start and committed writes included.

    python bench/mdat_pretokenize.py
    python bench/mdat_pretokenize.py --smoke   # 200 docstrings, once: it runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import parse

from matformer.modeling.corpus import python_docs
from matformer.modeling.mdat import Mdat
from matformer.modeling.tokenizers import train_tokenizer

SMOKE = dict(documents=200, copies=1, repeats=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=4, help="copies of the docstrings")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--documents", type=int, default=None,
                        help="docstrings in one copy (default: all)")
    args = parse(parser, SMOKE)
    counts = [int(n) for n in args.processes.split(",")]

    docs = list(python_docs(limit=args.documents))
    with tempfile.TemporaryDirectory() as tmp, Mdat.create(Path(tmp) / "c") as mdat:
        info = mdat.add_records("docs", ({"text": d} for _ in range(args.copies) for d in docs))
        megabytes = info.raw_bytes / 1e6
        bpe = train_tokenizer(mdat.submdat("docs"), Path(tmp) / "bpe.json", vocab_size=4096)
        strategies: dict[str, dict[str, Any]] = {
            "bytes, fixed_chunks": {},
            "bytes, sentence_chunks": {"splitter_class": "sentence_chunks"},
            "bpe-4096, fixed_chunks": {"tokenizer_type": "huggingface",
                                       "tokenizer_name": str(bpe)},
        }
        print(f"{info.documents:,} documents, {megabytes:.1f} MB of text; "
              f"{os.cpu_count()} CPUs\n")
        print(f"{'strategy':<24} " + " ".join(f"{f'{n} proc MB/s':>12}" for n in counts))
        for index, (label, fields) in enumerate(strategies.items()):
            rates: dict[int, list[float]] = {n: [] for n in counts}
            for repeat in range(args.repeats):
                for n in counts:
                    name = f"s{index}_p{n}_r{repeat}"
                    mdat.add_strategy({"strategy_name": name, "chunk_size": 128, **fields})
                    start = time.perf_counter()
                    mdat.pretokenize(name, processes=n)
                    rates[n].append(megabytes / (time.perf_counter() - start))
            print(f"{label:<24} " + " ".join(
                f"{statistics.median(rates[n]):>12.1f}" for n in counts))


if __name__ == "__main__":
    main()
