"""Module specs: a layer is described by data and built by one function.

A ``ModuleSpec`` names a module class, the keyword params to build it with, and a
``submodules`` dataclass whose fields are themselves specs (or classes). A new layer variant
is a new spec, never a new branch in the core (the Megatron Core idea).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


class Identity(nn.Module):
    """Default for a submodule a spec leaves out: returns its first input unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


@dataclass(slots=True)
class ModuleSpec:
    """What to build: ``module(**params, submodules=submodules, **build kwargs)``."""

    module: type
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def build_module(spec: ModuleSpec | type, **kwargs: Any) -> nn.Module:
    """Build a module from a spec or a bare class.

    ``kwargs`` (usually the model config) are shared by every module of a model; ``params``
    are specific to this spec and win on conflict. ``submodules`` is passed only when the
    spec has one, so leaf modules need not accept it.
    """
    if isinstance(spec, type):
        return spec(**kwargs)
    args = {**kwargs, **spec.params}
    if spec.submodules is not None:
        args["submodules"] = spec.submodules
    return spec.module(**args)
