"""The one place where compressor names and spec strings become objects.

A spec is ``name`` or ``name:param=value,param=value``; list values (block
offsets) are written with ``/`` between items, e.g. ``blocksign:offsets=0/100/300``.
"""

from __future__ import annotations

import dataclasses
import typing

from gossip._registry import Registry

from .base import NAMES_BY_ID, Compressor

__all__ = ["build", "available", "register"]

_REGISTRY: Registry[type[Compressor]] = Registry("compressor", known="available", sort=True)


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make a compressor reachable by ``build(cls.name)``."""
    if cls.name in _REGISTRY or cls.cid in NAMES_BY_ID:
        raise ValueError(f"compressor name {cls.name!r} or id {cls.cid} registered twice")
    if not 0 < cls.cid < 256:
        raise ValueError(f"compressor id must be in 1..255, got {cls.cid}")
    _REGISTRY.register(cls.name, cls, cls.description)
    NAMES_BY_ID[cls.cid] = cls.name
    cls.Config._compressor_name = cls.name
    return cls


def _name_of_id(cid: int) -> str:
    return NAMES_BY_ID.get(cid, "unknown")


def available() -> dict[str, str]:
    """Registered compressors: name -> one-line description (with accepted parameters)."""
    _load()
    return {n: _REGISTRY.get(n).description + _params_hint(_REGISTRY.get(n)) for n in _REGISTRY.names()}


def _params_hint(cls) -> str:
    names = [f.name for f in dataclasses.fields(cls.Config)]
    return f" [params: {', '.join(names)}]" if names else " [no params]"


def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls.Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls.Config)}


def _parse_value(comp: str, name: str, text: str, typ):
    origin_args = typing.get_args(typ)
    base = typ
    if origin_args and type(None) in origin_args:  # Optional[X]
        base = next(a for a in origin_args if a is not type(None))
    try:
        if typing.get_origin(base) is tuple:
            items = [s for s in text.replace(" ", "").split("/") if s]
            if not items:
                raise ValueError
            return tuple(_int(s) for s in items)
        if base is int:
            return _int(text)
        if base is float:
            v = float(text)
            return v
        if base is bool:
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        return base(text)
    except ValueError:
        kind = {int: "an integer", float: "a number", bool: "true or false"}.get(base, "a list of integers like 0/100/300")
        raise ValueError(f"{comp}: parameter `{name}` must be {kind}, got {text!r}") from None


def _int(s: str) -> int:
    s = s.strip()
    try:
        return int(s)
    except ValueError:
        f = float(s)  # accept 1e6 for counts, but not 2.5
        if not f.is_integer():
            raise
        return int(f)


def build(spec: str | Compressor, **params) -> Compressor:
    """Build a compressor from a spec such as ``"quant:bits=4,block=256"``.

    Keyword arguments override or add parameters (``build("blocksign", offsets=(0, 10))``).
    A Compressor is returned as is (with no keyword arguments).
    """
    _load()
    if isinstance(spec, Compressor):
        if params:
            raise ValueError("build: keyword parameters cannot modify an existing Compressor")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"build: spec must be a string like 'quant:bits=8', got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    cls = _REGISTRY.get(name)
    types = _field_types(cls)
    accepted = ", ".join(types) or "none"
    values: dict = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, text = item.partition("=")
            key = key.strip()
            if not eq or not key or not text.strip():
                raise ValueError(f"{name}: malformed parameter {item.strip()!r}; write name=value (accepted: {accepted})")
            if key not in types:
                raise ValueError(f"{name}: unknown parameter {key!r}; accepted: {accepted}")
            if key in values:
                raise ValueError(f"{name}: parameter {key!r} given twice")
            values[key] = _parse_value(name, key, text.strip(), types[key])
    for key in params:
        if key not in types:
            raise ValueError(f"{name}: unknown parameter {key!r}; accepted: {accepted}")
    values.update(params)
    return cls(**values)


def _load() -> None:
    # importing the families registers them
    from . import baseline, qsgd, quant, sign, sparse, ternary  # noqa: F401
