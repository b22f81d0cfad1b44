"""``RoundPolicy``: how one round's results become the step every replica applies, in one
object built once from the run's config (docs/architecture.md, "Round policies").

    policy = build_policy(config.policy, config.update, peer_clip=config.faults.peer_clip)
    inputs = policy.inputs(by_name)                       # the peer clip: what is logged
    master, steps, carried = policy.close(rule, master, inputs, carried)
    policy.record()                                        # → the update log's "outer"
    policy_from_record(record)                             # a resume closes logged rounds again

A policy is one file under ``server/policies/``: a subclass with a ``name``, its own
``Options`` (a dataclass of ``setting()`` declarations: the keys of ``[policy.options]``),
``close`` and, when it keeps more than its options, ``record``; registering it is one line
in ``__init__.py``. The arithmetic it shares with the others stays where it is: aggregation
(``server.aggregation``), the step and broadcast (``server.update_steps``), the rule's apply
(``modeling``). Replicas never see the policy: they apply the steps it makes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import Tensor

from matformer.modeling.compression import SparseResult, Step, UpdateRule
from matformer.modeling.settings import read_table, table_of
from matformer.server.limits import clip_to_peers
from matformer.server.update_steps import Carried

Results = Mapping[str, Sequence[SparseResult]]


@dataclass(kw_only=True, slots=True, frozen=True)
class NoOptions:
    """A policy that takes no keys in ``[policy.options]``."""


class RoundPolicy(ABC):
    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    # whether a relay may hand it one sum of its members' results in place of the results
    # (a sum is enough for a mean; a median or a trimmed mean must see each result)
    takes_partials: bool = True

    def __init__(self, options: Any, *, peer_clip: float = 0.0) -> None:
        self.options = options
        self.peer_clip = peer_clip  # [faults] peer_clip: each result's magnitude, bounded

    @classmethod
    def build(cls, options: Any, update: Any, *, peer_clip: float) -> RoundPolicy:
        """The policy of a run: its ``[policy]`` options, the run's ``[update]`` section
        (for a policy that reads it) and ``[faults] peer_clip``."""
        return cls(options, peer_clip=peer_clip)

    def inputs(self, by_name: Results) -> dict[str, list[SparseResult]]:
        """The results as the close takes them (and the update log keeps them): each
        parameter's clipped to its peers."""
        return {name: clip_to_peers(results, self.peer_clip)
                for name, results in by_name.items()}

    @abstractmethod
    def close(self, rule: UpdateRule, master: Mapping[str, Tensor], by_name: Results,
              carried: Carried | None = None
              ) -> tuple[dict[str, Tensor], dict[str, Step], Carried]:
        """The new master (names without results unchanged), each name's step, and what
        the next round's close needs (``Carried``). Inputs are not changed; the same
        inputs give the same bits."""

    def carries_state(self, broadcast_topk: int) -> bool:
        """Whether a close hands state to the next (``Carried``), which a resume rebuilds
        from the logged inputs: the broadcast's residual, and whatever the policy keeps."""
        return bool(broadcast_topk)

    def record(self) -> dict[str, Any]:
        """What a resume needs to close a logged round the same way again (JSON)."""
        return {"policy": self.name, **self.options_record()}

    def options_record(self) -> dict[str, Any]:
        return table_of(self.options)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RoundPolicy:
        """Inverse of ``record`` (the peer clip is not in it: the logged inputs are after
        it)."""
        options = {k: v for k, v in record.items() if k != "policy"}
        return cls(read_table(cls.Options, options, "policy", Path(".")))

    def describe(self) -> str:
        """The policy and its options in one line (a refused relay is told it)."""
        options = ", ".join(f"{k} {v}" for k, v in self.options_record().items())
        return self.name + (f" ({options})" if options else "")

