"""The run's checkpoints: ``<run dir>/checkpoints/round-N`` (universal, Hugging Face layout,
with the data's tokenizer and the manifest, and inside it ``tier<t>/``, the slice of every
allowed tier > 0), written so that each appears whole or not at all. Which rounds are kept
is the coordinator's call (it lists them in state.json); the store writes, reads and removes
folders.

    store = CheckpointStore(run_dir / "checkpoints", model_config, tiers=[0, 1, 2])
    store.write(10, master, carried)     # staging folder, fsync, renames: universal last
    store.ref(10).path                   # the universal folder; its manifest lists the slices
    store.keep_only({8, 10}, why="retired (keep_last)")
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from matformer.modeling.atomic import fsync_path, fsync_tree
from matformer.modeling.checkpoint import save_pretrained
from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.files import read_weights
from matformer.modeling.checkpoint.pretrained import load_state_into, save_model_files
from matformer.modeling.compression import Broadcast
from matformer.modeling.config import ModelConfig
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat.checkpoint_tokenizer import tokenizer_files
from matformer.modeling.models import build_model
from matformer.modeling.naming import canonical_state_dict, load_canonical_state_dict
from matformer.server.outer_state import load_carried, save_carried
from matformer.server.sections.model import DataSection
from matformer.server.shards import ShardedMaster
from matformer.server.update_steps import Carried

STAGING_PREFIX = ".staging-"  # a checkpoint being written: checkpoints/.staging-round-N/
log = logging.getLogger("matformer.server")


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    """Which checkpoint a joining client loads (its manifest lists every tier's files), then
    replays ``updates_since(round)`` on."""

    round: int  # rounds it contains
    path: Path  # the universal checkpoint's folder


class CheckpointStore:
    def __init__(self, root: Path, model_config: ModelConfig, tiers: Sequence[int],
                 data: DataSection | None = None,
                 mixes: Sequence[Sequence[int]] = ()) -> None:
        self.root = Path(root)
        self.model_config = model_config
        self.files = {}  # written beside every checkpoint's weights: the data's tokenizer
        if data is not None:
            with Mdat.open(data.path) as mdat:
                self.files = tokenizer_files(mdat.path, mdat.strategy(data.strategy),
                                             max_length=model_config.max_position_embeddings)
        self.sliced_tiers = [t for t in tiers if t > 0]  # exported inside the universal
        self.mixes = [list(layers) for layers in mixes]  # [tiers] layer_mixes, beside them

    def path(self, round_index: int) -> Path:
        """The universal checkpoint after ``round_index`` rounds."""
        return self.root / f"round-{round_index}"

    def ref(self, round_index: int) -> CheckpointRef:
        return CheckpointRef(round=round_index, path=self.path(round_index))

    def write(self, round_index: int, master: Mapping[str, Tensor],
              carried: Carried | None = None) -> None:
        """``master`` (canonical names) as a universal checkpoint plus the slices of every
        allowed tier and Mix'n'Match slice (so a client of any tier downloads only its
        slice) and the outer state ``carried`` after its round (``outer_state.py``; no
        manifest lists it, so no client downloads it), appearing whole or not at all: all of
        it is written in ``.staging-round-N/``, fsynced, then renamed into place. A sharded
        master's shards write its weights and outer state, one file each
        (``server/shards.py``)."""
        target = self.path(round_index)
        staging = target.parent / f"{STAGING_PREFIX}{target.name}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        folder = staging / target.name
        if isinstance(master, ShardedMaster):  # each shard writes its part, side by side
            folder.mkdir()
            with torch.device("meta"):
                save_model_files(build_model(self.model_config), folder, self.files)
            master.group.write(master, folder)
            export_tiers(folder, self.sliced_tiers, self.mixes,
                         slice_writer=functools.partial(master.group.write, master))
        else:
            model = build_model(self.model_config)
            load_canonical_state_dict(model, master)
            save_pretrained(model, folder, files=self.files)
            export_tiers(folder, self.sliced_tiers, self.mixes)
        if isinstance(master, ShardedMaster):
            master.group.write_carried(master, folder)
        else:
            save_carried(folder, carried or Carried())
        fsync_tree(staging)
        if target.exists():  # left by a crash before state.json recorded this checkpoint
            shutil.rmtree(target)
        (staging / target.name).rename(target)
        fsync_path(target.parent)
        staging.rmdir()

    def read(self, round_index: int) -> dict[str, Tensor]:
        """The universal checkpoint's weights by canonical name (a tied head restored).
        Raises FileNotFoundError when it is missing."""
        directory = self.path(round_index)
        if not directory.is_dir():
            raise FileNotFoundError(directory)
        model = build_model(self.model_config)
        load_state_into(model, read_weights(directory), directory)
        return {n: t.detach().clone() for n, t in canonical_state_dict(model).items()}

    def read_carried(self, round_index: int, broadcast: Broadcast | None = None
                     ) -> Carried | None:
        """The outer state saved with the checkpoint, for a run whose broadcast is
        ``broadcast``; None for one written without it."""
        return load_carried(self.path(round_index), broadcast)

    def keep_only(self, keep: Collection[int], *, why: str, level: int = logging.INFO) -> None:
        """Remove every folder but those of the rounds in ``keep``, and every staging
        folder, logging ``why``. Runs from before the slices moved inside their round's
        folder have them beside it (``round-N-tier1``): they go with their round."""
        if not self.root.is_dir():
            return
        kept = {f"round-{r}" for r in keep}
        for path in sorted(self.root.iterdir()):
            base = path.name.split("-tier")[0].split("-mix")[0]
            if path.name.startswith(STAGING_PREFIX) or (path.is_dir() and base not in kept):
                log.log(level, "removing %s: %s", path, why)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
