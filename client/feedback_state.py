"""Every parameter's error-feedback momentum on one client, and under local steps its
inner optimizer's state, saved across restarts.

The momentum is the part of past gradients not yet sent (docs/architecture.md, "One
round"); a client that restarts without it silently drops that gradient, so it is saved with
each round as safetensors (never pickle): one float32 tensor per canonical name, and the
regions in the metadata so a state saved at another tier is refused instead of misapplied.
The inner optimizer's state (Adam's moments, its step count) goes in the same file, so the
two are saved, restored and rolled back together.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from matformer.client.errors import FeedbackStateMismatch
from matformer.modeling.atomic import built_aside
from matformer.modeling.checkpoint.training_state import join_tensors, split_tensors
from matformer.modeling.compression import Compressor, ErrorFeedback, Region
from matformer.modeling.errors import MatformerError
from matformer.modeling.optim import LocalOptimizer

FORMAT = "matformer-error-feedback-v1"
INNER = "inner"  # the key prefix of the inner optimizer's tensors


class FeedbackState:
    """Canonical name → ``ErrorFeedback`` for the parameters one client trains."""

    def __init__(
        self,
        compressor: Compressor | None,  # None with no regions: an inner optimizer only
        shapes: Mapping[str, tuple[int, ...]],
        regions: Mapping[str, Region],
    ) -> None:
        self.feedback: dict[str, ErrorFeedback] = {
            name: compressor.feedback(name, shapes[name], region)
            for name, region in regions.items()
        }

    def __getitem__(self, name: str) -> ErrorFeedback:
        return self.feedback[name]

    def regions(self) -> dict[str, Region]:
        return {name: state.region for name, state in self.feedback.items()}

    def save(self, path: str | Path, optimizer: LocalOptimizer | None = None) -> None:
        """Write the momenta, and ``optimizer``'s state under local steps, atomically (temp
        file, fsync, rename), so a crash mid-write leaves the previous round's state."""
        path = Path(path)
        tensors = {
            name: state.momentum.detach().contiguous().cpu()
            for name, state in self.feedback.items()
        }
        metadata = {"format": FORMAT, "regions": json.dumps(self.regions())}
        if optimizer is not None:
            skeleton, inner = split_tensors(optimizer.state_dict(), INNER)
            tensors |= {key: t.contiguous().cpu() for key, t in inner.items()}
            metadata["inner"] = json.dumps(skeleton)
        with built_aside(path) as staging:
            save_file(tensors, staging, metadata=metadata)

    def load(self, path: str | Path, optimizer: LocalOptimizer | None = None) -> None:
        """Restore what ``save`` wrote (into ``optimizer`` too, under local steps); refuses
        a state of other parameters or regions (another model or tier), or one saved with
        or without an inner optimizer where this client has the other, and leaves the
        current state untouched then."""
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise FeedbackStateMismatch(
                f"{path} is not an error-feedback state ({FORMAT}); delete it to start with "
                "zero momentum."
            )
        saved = {name: tuple(map(tuple, r)) for name, r in json.loads(metadata["regions"]).items()}
        own = self.regions()
        differ = sorted(n for n in saved.keys() | own.keys() if saved.get(n) != own.get(n))
        if differ:
            raise FeedbackStateMismatch(
                f"{path} was saved for other parameters or another tier (differs at "
                f"{', '.join(differ[:4])}); delete it to start with zero momentum."
            )
        if ("inner" in metadata) != (optimizer is not None):
            raise FeedbackStateMismatch(
                f"{path} was saved {'with' if 'inner' in metadata else 'without'} local "
                "steps' optimizer state and this run trains "
                f"{'with' if optimizer is not None else 'without'} them; delete it to start "
                "afresh.")
        tensors = load_file(str(path))
        if optimizer is not None:
            try:
                optimizer.load_state_dict(
                    join_tensors(json.loads(metadata["inner"]), tensors))
            except (KeyError, ValueError, MatformerError) as err:
                raise FeedbackStateMismatch(
                    f"{path} holds an inner optimizer state that does not fit this client's "
                    f"({err}); delete it to start afresh.") from None
        for name, state in self.feedback.items():
            state.momentum = tensors[name].to(state.momentum.device)
