"""The method registry: every compression method plugs into the same spine.

A method is registered under a name with :func:`register_method`. Its ``apply`` function takes a
built timm VisionTransformer and the method's record from ``arch.json`` (``{"name": ...,
"config": {...}, ...decisions}``) and returns the patched model, keeping the timm state-dict
keys (new parameters get new names). :func:`nascompress.io.load` rebuilds any saved model by
building the timm model and applying each recorded method in order before loading weights
strictly, so a method must be able to rebuild its exact shapes from its record alone.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from torch import nn

ApplyFn = Callable[[nn.Module, dict[str, Any]], nn.Module]

_METHODS: dict[str, ApplyFn] = {}
# Modules that register methods; imported lazily so that importing nascompress stays cheap.
_METHOD_MODULES = ("dcs", "evit", "dynamicvit", "sparsifiner", "mgvit")


def register_method(name: str) -> Callable[[ApplyFn], ApplyFn]:
    """Decorator: register ``apply(model, record) -> model`` under ``name``."""

    def deco(fn: ApplyFn) -> ApplyFn:
        if name in _METHODS and _METHODS[name] is not fn:
            raise ValueError(f"method {name!r} is already registered by {_METHODS[name].__module__}")
        _METHODS[name] = fn
        return fn

    return deco


def _import_all() -> None:
    for mod in _METHOD_MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise


def get_method(name: str) -> ApplyFn:
    if name not in _METHODS:
        _import_all()
    if name not in _METHODS:
        raise KeyError(f"Unknown method {name!r}; available: {sorted(_METHODS)}")
    return _METHODS[name]


def available_methods() -> list[str]:
    _import_all()
    return sorted(_METHODS)


def apply_methods(model: nn.Module, records: list[dict[str, Any]]) -> nn.Module:
    """Apply every recorded method to ``model`` in order."""
    for rec in records:
        model = get_method(rec["name"])(model, rec)
    return model
