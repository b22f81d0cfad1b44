"""The component registry: category → variant → named implementation.

An implementation is chosen per (category, variant) in this order:

1. the environment variable ``MATFORMER_<CATEGORY>_<VARIANT>=<name>``;
2. ``registry.set_preferences({category: {variant: name}})``;
3. the name the model config asks for (for example ``attn_impl``);
4. the available implementation with the highest priority.

An implementation is available when every module in ``requires`` can be imported and its
optional ``is_available()`` (or ``_is_available()``, as the founding document spells it)
says yes, called on the class with no arguments. A chosen name that is not available falls
back to the next rule, and the fallback is reported once, in one line, through ``logging``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import RegistryError, did_you_mean

AVAILABILITY_CHECKS = ("is_available", "_is_available")

log = logging.getLogger("matformer.registry")

MODULES_PATH_ENV = "MATFORMER_MODULES_PATH"


@dataclass(frozen=True, slots=True)
class Implementation:
    """One registered implementation of a (category, variant)."""

    category: str
    variant: str
    name: str
    cls: type
    requires: tuple[str, ...] = ()
    priority: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # Own tensor name → canonical suffix, e.g. {"w_gate.weight": "gate_proj.weight"}.
    params_names: Mapping[str, str] = field(default_factory=dict)

    def unavailable_reason(self) -> str | None:
        """Why this implementation cannot run here, or None when it can."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            return f"requires {', '.join(missing)} (not installed)"
        for name in AVAILABILITY_CHECKS:
            check = getattr(self.cls, name, None)
            if check is None:
                continue
            try:
                ok = check()
            except Exception as err:  # a check that cannot run says no
                return f"its {name}() check raised {type(err).__name__}: {err}"
            if not ok:
                return f"its {name}() check failed on this machine"
        return None


def _own_parameters(cls: type) -> set[str]:
    """The names ``cls``'s constructor takes (not its ``**kwargs``)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return set()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _env_key(category: str, variant: str) -> str:
    return f"MATFORMER_{category}_{variant}".upper().replace("-", "_")


def _unknown(kind: str, name: str, known: Iterable[str]) -> RegistryError:
    known = sorted(known)
    listing = ", ".join(known) or "none"
    return RegistryError(f"unknown {kind} {name!r}; {did_you_mean(name, known)}registered: "
                         f"{listing}.")


class Registry:
    """Holds every implementation and picks one per (category, variant)."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, dict[str, Implementation]]] = {}
        self._preferences: dict[tuple[str, str], str] = {}
        self._reported: set[tuple[str, str, str, str]] = set()
        self._loaded_files: set[Path] = set()

    def register(
        self,
        category: str,
        variant: str,
        name: str,
        *,
        requires: Iterable[str] = (),
        priority: int = 0,
        metadata: Mapping[str, Any] | None = None,
        params_names: Mapping[str, str] | None = None,
    ) -> Callable[[type], type]:
        """Class decorator adding an implementation; re-registering a name replaces it."""

        def decorate(cls: type) -> type:
            impl = Implementation(
                category, variant, name, cls, tuple(requires), priority,
                dict(metadata or {}), dict(params_names or {}),
            )
            self._entries.setdefault(category, {}).setdefault(variant, {})[name] = impl
            cls.matformer_implementation = impl
            return cls

        return decorate

    def set_preferences(self, preferences: Mapping[str, Mapping[str, str]]) -> None:
        """Prefer ``{category: {variant: name}}``; names are checked now, availability at use."""
        for category, variants in preferences.items():
            for variant, name in variants.items():
                self.implementations(category, variant)  # raises on unknown names
                self._lookup(category, variant, name)
                self._preferences[(category, variant)] = name

    def clear_preferences(self) -> None:
        self._preferences.clear()

    def categories(self) -> list[str]:
        return sorted(self._entries)

    def variants(self, category: str) -> list[str]:
        if category not in self._entries:
            raise _unknown("registry category", category, self._entries)
        return sorted(self._entries[category])

    def implementations(self, category: str, variant: str) -> list[Implementation]:
        """All implementations of a variant, highest priority first."""
        if variant not in self._entries.get(category, {}):
            known = self.variants(category)
            raise _unknown(f"{category} variant", variant, known)
        impls = self._entries[category][variant].values()
        return sorted(impls, key=lambda impl: -impl.priority)

    def _lookup(self, category: str, variant: str, name: str) -> Implementation:
        impls = self._entries[category][variant]
        if name not in impls:
            raise _unknown(f"implementation of {category}/{variant}", name, impls)
        return impls[name]

    def select(self, category: str, variant: str, requested: str | None = None) -> Implementation:
        """The implementation to use for (category, variant); see the module docstring."""
        candidates = self.implementations(category, variant)
        choices = [
            ("environment", os.environ.get(_env_key(category, variant))),
            ("preferences", self._preferences.get((category, variant))),
            ("config", requested),
        ]
        for source, name in choices:
            if not name:
                continue
            impl = self._lookup(category, variant, name)
            reason = impl.unavailable_reason()
            if reason is None:
                return impl
            fallback = self._best_available(candidates, category, variant)
            self._report_fallback(impl, reason, fallback, source)
            return fallback
        return self._best_available(candidates, category, variant)

    def get(self, category: str, variant: str, requested: str | None = None) -> type:
        """The class of the selected implementation."""
        return self.select(category, variant, requested).cls

    def create(self, category: str, variant: str, *args: Any, **kwargs: Any) -> Any:
        """Instantiate the selected implementation with the given arguments.

        A model component (one built from a ``config``) may be given the config's fields
        instead, as seed 000 writes ``create("mlp", "swiglu", hidden_size=768, ffn_factor=4)``:
        the keywords that are not the constructor's own build a `ModelConfig` (defaults for
        the rest, unknown ones refused by name)."""
        cls = self.get(category, variant)
        own = _own_parameters(cls)
        if not args and "config" not in kwargs and "config" in own:
            fields = {key: value for key, value in kwargs.items() if key not in own}
            kwargs = {key: value for key, value in kwargs.items() if key in own}
            kwargs["config"] = ModelConfig.from_dict(fields)
        return cls(*args, **kwargs)

    def _best_available(
        self, candidates: list[Implementation], category: str, variant: str
    ) -> Implementation:
        reasons = []
        for impl in candidates:
            reason = impl.unavailable_reason()
            if reason is None:
                return impl
            reasons.append(f"{impl.name}: {reason}")
        raise RegistryError(
            f"no implementation of {category}/{variant} can run here ({'; '.join(reasons)}). "
            "Install a requirement or register an implementation that needs nothing extra."
        )

    def _report_fallback(
        self, wanted: Implementation, reason: str, used: Implementation, source: str
    ) -> None:
        key = (wanted.category, wanted.variant, wanted.name, used.name)
        if key in self._reported:
            return
        self._reported.add(key)
        log.warning(
            "matformer: %s/%s implementation %r (from %s) unavailable: %s; using %r instead",
            wanted.category, wanted.variant, wanted.name, source, reason, used.name,
        )

    def load_modules(self, where: str | os.PathLike[str] | list[str] | None = None) -> list[str]:
        """Import every ``.py`` file in the folder ``where`` (default:
        ``$MATFORMER_MODULES_PATH``), or each file of a list (a checkpoint's packed modules).

        Their ``@registry.register(...)`` decorators run on import, so user components
        become selectable by name without editing this package. Each file loads once.
        """
        where = where or os.environ.get(MODULES_PATH_ENV)
        if not where:
            return []
        if isinstance(where, list):
            files = [Path(name).expanduser().resolve() for name in where]
            missing = [str(file) for file in files if not file.is_file()]
            if missing:
                raise RegistryError(
                    f"external module file(s) {', '.join(missing)} do not exist; a checkpoint "
                    "keeps them beside its config.json: copy them with it.")
        else:
            path = Path(where).expanduser().resolve()
            if not path.is_dir():
                raise RegistryError(
                    f"external modules folder {str(path)!r} does not exist; fix the config's "
                    f"'external_modules_path' or ${MODULES_PATH_ENV}."
                )
            files = sorted(path.glob("*.py"))
        loaded = []
        for file in files:
            if file in self._loaded_files:
                continue
            module_name = f"matformer_external.{file.parent.name}.{file.stem}"
            # named as Python source: a hub snapshot's file is a link to a blob without .py
            loader = importlib.machinery.SourceFileLoader(module_name, str(file))
            spec = importlib.util.spec_from_file_location(module_name, file, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            self._loaded_files.add(file)
            loaded.append(str(file))
        return loaded


registry = Registry()
