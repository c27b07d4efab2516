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


def _builtins() -> Dict[str, "ModelFamily"]:
    # the package's __init__ imports (and so registers) the built-in families; a no-op once loaded
    importlib.import_module("megatron_psrl.model.families")
    return _FAMILIES


def register_family(family: "ModelFamily", replace: bool = False) -> "ModelFamily":
    """Add ``family`` under its ``model_type`` (``replace``: over an existing one) and return it."""
    if family.model_type in _FAMILIES and not replace:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    _FAMILIES[family.model_type] = family
    return family


def unregister_family(model_type: str) -> "ModelFamily":
    """Remove and return the family of ``model_type`` (tests registering a toy family)."""
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
    """Every registered family, in registration order."""
    return tuple(_builtins().values())


def supported_model_types() -> Tuple[str, ...]:
    """The ``model_type`` of every registered family, in registration order."""
    return tuple(_builtins())


def moe_model_types() -> Tuple[str, ...]:
    """The ``model_type`` of every registered mixture-of-experts family."""
    return tuple(t for t, f in _builtins().items() if f.is_moe)
