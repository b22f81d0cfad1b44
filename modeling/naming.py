"""Canonical parameter names (docs/architecture.md, "Names, tiers, regions").

A registered implementation may name its tensors as it likes and declare ``params_names``
(own name → canonical name); checkpoints and the wire only ever carry canonical names.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Map every state-dict key of ``model`` to its canonical name."""
    renames: dict[str, Mapping[str, str]] = {}
    for prefix, module in model.named_modules():
        impl = getattr(type(module), "matformer_implementation", None)
        if impl is not None and impl.params_names:
            renames[prefix] = impl.params_names
    names = {}
    for key in model.state_dict(keep_vars=True):
        names[key] = key
        owner, _, local = key.rpartition(".")
        # the tensor may live deeper than the module that declares its name
        while True:
            mapping = renames.get(owner)
            if mapping is not None and local in mapping:
                names[key] = f"{owner}.{mapping[local]}" if owner else mapping[local]
                break
            if not owner:
                break
            owner, _, head = owner.rpartition(".")
            local = f"{head}.{local}"
    return names


def canonical_state_dict(model: nn.Module, state: Mapping[str, Tensor] | None = None
                         ) -> dict[str, Tensor]:
    """The model's tensors under canonical names (``state``: the model's own ``state_dict``
    in another form, the whole weights gathered from FSDP shards, say)."""
    names = canonical_names(model)
    return {names[key]: value for key, value in (state or model.state_dict()).items()}


def load_canonical_state_dict(
    model: nn.Module, state: Mapping[str, Tensor], strict: bool = True
) -> None:
    """Load tensors keyed by canonical names into ``model``, whatever its implementations."""
    to_own = {canonical: own for own, canonical in canonical_names(model).items()}
    unknown = [name for name in state if name not in to_own]
    if strict and unknown:
        raise KeyError(f"tensors with no place in this model: {', '.join(sorted(unknown)[:8])}")
    model.load_state_dict(
        {to_own[name]: value for name, value in state.items() if name in to_own}, strict=strict
    )
