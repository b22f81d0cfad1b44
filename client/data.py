"""Where a round's sequences come from: the coordinator, or a local copy of the run's MDAT.

    source = SequenceSource(connection, settings, local=Path("run.mdat"))  # local=None: server
    sequences = source.fetch(work.sequence_ids)                            # 1-D int64 tensors

A local copy (``--data``) saves the download; it must be the run's data, which its
fingerprint (of the run's strategy, sequence length and view) proves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from matformer.client.connection import Connection
from matformer.client.errors import DataMismatch
from matformer.modeling.mdat import Mdat, SequenceReader
from matformer.protocol.settings import RunSettings


class SequenceSource:
    def __init__(self, connection: Connection, settings: RunSettings,
                 local: Path | None = None) -> None:
        self.connection = connection
        self.reader = None if local is None else _open(local, settings)

    def fetch(self, ids: Sequence[int]) -> list[torch.Tensor]:
        """The token ids of ``ids``, in that order."""
        if self.reader is None:
            return self.connection.fetch_sequences(ids)
        return [torch.from_numpy(self.reader[i].astype(np.int64)) for i in ids]


def _open(path: Path, s: RunSettings) -> SequenceReader:
    reader = Mdat.open(path).sequences(s.data_strategy, s.sequence_length, s.data_view)
    if reader.fingerprint != s.data_fingerprint:
        raise DataMismatch(
            f"--data {path} ({s.data_strategy}, view {s.data_view or 'all'}) has fingerprint "
            f"{reader.fingerprint}, the run's data {s.data_fingerprint}; copy the run's MDAT, "
            "or leave out --data to fetch sequences from the coordinator.")
    return reader
