"""[policy]: the round policy (``server/policies/``) that turns a round's results into its
step, by ``name``, and in ``[policy.options]`` the keys that policy declares (its
``Options``): ``trim`` for ``trimmed_mean``; ``beta1``, ``beta2``, ``eps`` for
``outer_adamw``; ``mean``, the default, takes none and reads ``[update] vote`` and
``momentum``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matformer.modeling.settings import (
    check_declared,
    read_table,
    reject_unknown,
    section_schema,
    table_of,
)
from matformer.server.errors import WrongType
from matformer.server.policies import POLICIES, RoundPolicy, policy_class
from matformer.server.policies.mean import TokenMean

DEFAULT_POLICY = TokenMean.name  # the policy when [policy] names none


@dataclass(kw_only=True, slots=True)
class PolicySection:
    """The round policy and its own keys."""

    name: str = DEFAULT_POLICY
    options: Any = field(default=None)  # the policy's Options; None: its defaults

    def __post_init__(self) -> None:
        kind = policy_class(self.name)
        if self.options is None:
            self.options = kind.Options()
        elif not isinstance(self.options, kind.Options):
            raise WrongType(f"[policy] options of {self.name!r} must be its "
                            f"{kind.Options.__name__}, got {type(self.options).__name__}.")
        check_declared(self.options, "policy")

    @classmethod
    def read(cls, table: Any, base: Path) -> PolicySection:
        """From run.toml's ``[policy]`` table: ``name``, and the chosen policy's keys in
        ``[policy.options]``."""
        if not isinstance(table, dict):
            raise WrongType(f"[policy] must be a table, got {type(table).__name__}.")
        reject_unknown("[policy]", table, ["name", "options"])
        name = table.get("name", DEFAULT_POLICY)
        if not isinstance(name, str):
            raise WrongType(f"[policy] name must be a string, one of {', '.join(POLICIES)}.")
        kind = policy_class(name)
        options = read_table(kind.Options, table.get("options", {}), "policy.options", base)
        return cls(name=name, options=options)

    def table(self) -> dict[str, Any]:
        return {"name": self.name, "options": table_of(self.options)}

    def build(self, update: Any, *, peer_clip: float) -> RoundPolicy:
        """The run's policy, built once."""
        return policy_class(self.name).build(self.options, update, peer_clip=peer_clip)


def policy_schema() -> dict[str, Any]:
    """``[policy]``'s JSON schema: one shape per registered policy, told apart by ``name``
    (which only the default may leave out), with its own ``options``."""
    shapes = []
    for name, kind in POLICIES.items():
        options = section_schema(kind.Options)
        options["description"] = f"the keys {name} declares ({kind.Options.__name__})"
        shape = {"type": "object", "additionalProperties": False, "required": ["name"],
                 "properties": {"name": {"const": name, "description": (
                     f"the round policy of server/policies/"
                     f"{kind.__module__.rsplit('.', 1)[-1]}.py")}, "options": options}}
        if name == DEFAULT_POLICY:  # the one [policy] may leave out
            shape["required"], options["default"] = [], {}
            shape["properties"]["name"]["default"] = name
        shapes.append(shape)
    return {"description": " ".join((__doc__ or "").split()), "anyOf": shapes}
