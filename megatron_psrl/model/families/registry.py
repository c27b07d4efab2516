"""The registry of model families, keyed by Hugging Face ``model_type``.

Registration order is kept: it is the order the supported types are listed in (error messages,
``SUPPORTED_MODEL_TYPES``). The built-in families register when
:mod:`megatron_psrl.model.families` is imported; every lookup here imports it first, so asking
this module directly also sees them.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

from megatron_psrl.errors import UnsupportedModelError

# (The registry sits below the families and the architecture, which both use it: it imports
# neither, so a family is typed ``Any`` here, a ``model.families.base.ModelFamily``.)
ModelFamily = Any

_FAMILIES: Dict[str, ModelFamily] = {}
_ALIASES: Dict[str, str] = {}
"""Another ``model_type`` a family's bundle serves -> the bundle's own ``model_type`` (Kimi K2's
``kimi_k2`` is DeepSeek-V3's architecture)."""


def _builtins() -> Dict[str, "ModelFamily"]:
    # the package's __init__ imports (and so registers) the built-in families; a no-op once loaded
    importlib.import_module("megatron_psrl.model.families")
    return _FAMILIES


def register_family(family: "ModelFamily", replace: bool = False, aliases: Tuple[str, ...] = ()) -> "ModelFamily":
    """Add ``family`` under its ``model_type`` and every one of ``aliases`` (other ``model_type``
    values of the same architecture; ``replace``: over existing ones) and return it."""
    for model_type in (family.model_type, *aliases):
        if model_type in _FAMILIES and not replace:
            raise ValueError(f"model family {model_type!r} is already registered")
    _FAMILIES[family.model_type] = family
    for alias in aliases:
        _FAMILIES[alias] = family
        _ALIASES[alias] = family.model_type
    return family


def unregister_family(model_type: str) -> "ModelFamily":
    """Remove and return the family of ``model_type`` with its aliases (tests registering a toy family)."""
    for alias in [a for a, owner in _ALIASES.items() if owner == model_type]:
        _FAMILIES.pop(alias)
        _ALIASES.pop(alias)
    return _FAMILIES.pop(model_type)


def get_family(model_type: str) -> "ModelFamily":
    """The family of ``model_type``; :class:`UnsupportedModelError` listing the supported ones."""
    families = _builtins()
    if model_type not in families:
        raise UnsupportedModelError(
            f"unsupported model type {model_type!r}; supported: {', '.join(supported_model_types())}")
    return families[model_type]


def family_of(arch) -> "ModelFamily":
    """The family of a :class:`~megatron_psrl.model.architecture.ModelArchitecture`."""
    return get_family(arch.model_type)


def registered_families() -> Tuple["ModelFamily", ...]:
    """Every registered family, in registration order (once: not again for its aliases)."""
    return tuple(f for t, f in _builtins().items() if t not in _ALIASES)


def supported_model_types() -> Tuple[str, ...]:
    """Every ``model_type`` a registered family serves (its own and its aliases), in registration order."""
    return tuple(_builtins())


def moe_model_types() -> Tuple[str, ...]:
    """The ``model_type`` of every registered mixture-of-experts family."""
    return tuple(t for t, f in _builtins().items() if f.is_moe)
