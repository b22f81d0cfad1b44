"""Round policies (``base.RoundPolicy``): one file each, registered here by name, the name
``[policy] name`` takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from matformer.server.errors import InvalidValue
from matformer.server.policies.base import NoOptions, RoundPolicy
from matformer.server.policies.mean import TokenMean
from matformer.server.policies.outer_adamw import OuterAdamW
from matformer.server.policies.trimmed_mean import TrimmedMean

POLICIES: dict[str, type[RoundPolicy]] = {p.name: p for p in (
    TokenMean,
    TrimmedMean,
    OuterAdamW,
)}


def policy_class(name: str) -> type[RoundPolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise InvalidValue(f"[policy] name {name!r} is not one of {', '.join(POLICIES)}; "
                           "each is a file under server/policies/.") from None


def policy_from_record(record: Mapping[str, Any]) -> RoundPolicy:
    """The policy a logged round was closed with (``RoundPolicy.record``); a round logged
    before policies had names was closed by the mean."""
    return policy_class(record.get("policy", TokenMean.name)).from_record(record)


__all__ = ["POLICIES", "NoOptions", "RoundPolicy", "policy_class", "policy_from_record"]
