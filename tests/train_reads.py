"""Run under ``torchrun``: matformer-train with every sequence each rank reads written down.

    torchrun --standalone --nproc-per-node 2 tests/train_reads.py OUT matformer-train args...

Each rank writes ``OUT.RANK``: the ids its reader was asked for, one entry per read (what
tests/test_train_workers.py compares with one process's reads).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from matformer.client.standalone import main
from matformer.modeling.mdat.sequences import SequenceReader

if __name__ == "__main__":
    out, argv, read = sys.argv[1], sys.argv[2:], []
    given = SequenceReader.__getitem__

    def counted(self: SequenceReader, index: int) -> np.ndarray:
        read.append(int(index))
        return given(self, index)

    SequenceReader.__getitem__ = counted
    main(argv)
    Path(f"{out}.{os.environ['RANK']}").write_text(json.dumps(read))
