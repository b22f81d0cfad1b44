"""Module specs: a layer is described by data and built by one function.

A ``ModuleSpec`` names a module class, the keyword params to build it with, and a
``submodules`` dataclass whose fields are themselves specs (or classes). A new layer variant
is a new spec, never a new branch in the core (the Megatron Core idea). As in Megatron, the
class may be given by its import path, ``"package.module.Class"`` or ``("package.module",
"Class")``, and is imported when the spec is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from matformer.modeling.errors import ConfigError, did_you_mean


class Identity(nn.Module):
    """Default for a submodule a spec leaves out: returns its first input unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


@dataclass(slots=True)
class ModuleSpec:
    """What to build: ``module(**params, submodules=submodules, **build kwargs)``."""

    module: type | str | tuple[str, str]  # the class, or its import path
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
    return module_class(spec.module)(**args)


def module_class(module: type | str | tuple[str, str]) -> type:
    """The class a spec names: itself, or the one its import path leads to."""
    if isinstance(module, type):
        return module
    if isinstance(module, tuple) and len(module) == 2:
        path, name = module
    elif isinstance(module, str) and "." in module.strip("."):
        path, _, name = module.rpartition(".")
    else:
        raise ConfigError(f"ModuleSpec module {module!r}: give a class, "
                          "'package.module.Class' or ('package.module', 'Class').")
    try:
        imported = importlib.import_module(path)
    except ImportError as err:
        raise ConfigError(f"ModuleSpec module {module!r}: cannot import {path!r} ({err}); "
                          "is its package installed, or its folder on PYTHONPATH?") from None
    found = getattr(imported, name, None)
    if found is None:
        public = [n for n in vars(imported) if not n.startswith("_")]
        raise ConfigError(f"ModuleSpec module {module!r}: {path} has no {name!r}; "
                          f"{did_you_mean(name, public)}check the class name.")
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ConfigError(f"ModuleSpec module {module!r} is {type(found).__name__} "
                          f"{found!r}, not a torch.nn.Module class.")
    return found
