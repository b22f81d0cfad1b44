"""What a checkpoint was trained on, written beside its weights (``matformer_data.json``):
the container, strategy, view, sequence length and shuffle seed. ``matformer-eval`` and
``matformer-generate`` read it, so that a model folder is evaluated on the tail its run held
out, and its text tokenized as in training, without repeating the run's options.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from matformer.modeling.errors import CheckpointError

RECORD_NAME = "matformer_data.json"


@dataclass(frozen=True, slots=True)
class TrainedOn:
    data: str  # the MDAT container's folder, absolute
    strategy: str
    view: str | None
    seq_len: int
    seed: int  # of the shuffle whose tail the run held out

    def files(self) -> dict[str, bytes]:
        """The record as ``save_pretrained``'s ``files`` take it."""
        return {RECORD_NAME: (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode()}

    @classmethod
    def read(cls, checkpoint: Path) -> TrainedOn | None:
        """The record in ``checkpoint``, or None when it has none."""
        path = Path(checkpoint) / RECORD_NAME
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"{path} is not a record of a run's data ({err}); delete "
                                  "it and name the data with --data.") from None
