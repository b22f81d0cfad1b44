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
    model: nn.Module, state: Mapping[str, Tensor], strict: bool = True, assign: bool = False
) -> None:
    """Load tensors keyed by canonical names into ``model``, whatever its implementations.

    ``assign``: the model takes the tensors themselves rather than copies into its own (a
    model built on the meta device has none to copy into); a parameter that two names share
    (a tied head) is one parameter again afterwards."""
    to_own = {canonical: own for own, canonical in canonical_names(model).items()}
    unknown = [name for name in state if name not in to_own]
    if strict and unknown:
        raise KeyError(f"tensors with no place in this model: {', '.join(sorted(unknown)[:8])}")
    own_state = {to_own[name]: value for name, value in state.items() if name in to_own}
    if assign:
        own_state = _as_parameters(model, own_state)
    model.load_state_dict(own_state, strict=strict, assign=assign)


def _as_parameters(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with each tensor bound for a parameter made that parameter: one per
    parameter of ``model`` however many names it has, holding the tensor of its last name
    (the one a copying load would leave in it)."""
    own = {name: p for name, p in model.state_dict(keep_vars=True).items()
           if isinstance(p, nn.Parameter) and name in state}
    value = {id(p): state[name] for name, p in own.items()}  # a later name overwrites
    made = {id(p): nn.Parameter(value[id(p)], requires_grad=p.requires_grad)
            for p in own.values()}
    return {**state, **{name: made[id(p)] for name, p in own.items()}}
