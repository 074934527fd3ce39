"""Names to builders: the only place where a topology name becomes an object.

The CLI (``python -m topologies``) and ``gossip.train --topology`` resolve names here
and nowhere else. :class:`Registry`, the mechanism, is generic: every family of named
parts of the gossip runtime (algorithms, compressors, models, data sets) is one too. It
lives here because topologies is the package below them all and imports nothing of
theirs.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Collection, Generic, Iterator, Mapping, TypeVar

from .classic import complete, ring, star
from .errors import TopologyError
from .expander import expander
from .exponential import exponential
from .lattice import hypercube, torus
from .timevarying import TimeVaryingTopology, matching, onepeer_exp
from .topology import Topology

__all__ = ["Registry", "build", "available", "describe", "parameters", "register"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names in registration order, each with its entry (a class or a builder) and a
    one-line summary; an unknown name is one line naming it and the known ones.

    ``kind``: what the names name ("algorithm", "compressor", ...); ``error``: the
    exception class of an unknown name; ``known``: the word before the list of names in
    that message; ``sort``: list the names sorted (else in registration order).
    :meth:`register` is the one way in, :meth:`available` (name -> summary) the one list.
    """

    def __init__(self, kind: str, *, error: Callable[[str], Exception] = ValueError, known: str = "known",
                 sort: bool = False) -> None:
        self.kind = kind
        self._error = error
        self._known = known
        self._sort = sort
        self._entries: dict[str, T] = {}
        self._summaries: dict[str, str] = {}

    def register(self, name: str, entry: T, summary: str = "") -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"register: a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise self._error(f"register: {self.kind} named {name!r} is already registered")
        self._entries[name] = entry
        self._summaries[name] = summary
        return entry

    def unregister(self, name: str) -> None:
        """Forget ``name`` (no error if it is unknown): for tests that register a part."""
        self._entries.pop(name, None)
        self._summaries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries) if self._sort else list(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: Any) -> T:
        """The entry of ``name``, or the one-line error naming the known ones."""
        if name not in self:
            raise self._error(f"unknown {self.kind} {name!r}; {self._known}: {', '.join(self.names())}")
        return self._entries[name]

    def summary(self, name: Any) -> str:
        self.get(name)
        return self._summaries[name]

    def available(self) -> dict[str, str]:
        """Names and their one-line summaries."""
        return {n: self._summaries[n] for n in self.names()}

    def parameters(self, name: Any) -> list[str]:
        """The keyword-only parameters of the builder ``name``: the options it takes."""
        sig = inspect.signature(self.get(name))
        return [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]

    def builder(self, name: Any, options: Mapping[str, Any], *, fixed: Collection[str] = ()) -> T:
        """The builder ``name``, after refusing in one line any of ``options`` it does not
        take; ``fixed``: its keyword parameters the caller passes itself."""
        accepted = [p for p in self.parameters(name) if p not in fixed]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise self._error(f"{self.kind} {name!r} does not take option(s) {', '.join(unknown)}; "
                              f"accepted: {', '.join(accepted) if accepted else 'none'}")
        return self.get(name)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


_REGISTRY: Registry[Callable[..., Topology]] = Registry(
    "topology", error=TopologyError, known="known topologies", sort=True
)


def register(name: str, builder: Callable[..., Topology | TimeVaryingTopology], description: str) -> None:
    """Make ``builder(n, *, weights=None, lazy=False, **params)`` buildable as ``name``.

    ``description`` is the one line ``python -m topologies --list`` shows.
    """
    if not isinstance(name, str) or not name.replace("-", "_").isidentifier() or name != name.lower():
        raise TopologyError(f"register: name must be a lower-case identifier (hyphens allowed), got {name!r}")
    _REGISTRY.register(name, builder, description)


def available() -> dict[str, str]:
    """The registered topology names, sorted, with their one-line descriptions."""
    return _REGISTRY.available()


def describe(name: str) -> str:
    """The one-line description of a registered topology."""
    return _REGISTRY.summary(_lookup(name))


def _lookup(name: object) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _REGISTRY:
        _REGISTRY.get(name)  # raises the one-line TopologyError naming the known ones
    return key  # type: ignore[return-value]


def parameters(name: str) -> list[str]:
    """The keyword parameters the ``name`` builder accepts (``weights`` and ``lazy`` included)."""
    return _REGISTRY.parameters(_lookup(name))


def build(
    name: str,
    n: int,
    *,
    weights: str | None = None,
    lazy: bool = False,
    seed: int | None = None,
    **params: Any,
) -> Topology | TimeVaryingTopology:
    """The topology ``name`` on ``n`` nodes (a :class:`TimeVaryingTopology` for
    ``onepeer-exp`` and ``matching``).

    ``weights`` (``'uniform'`` | ``'metropolis'`` | ``None`` for the default rule) and
    ``lazy`` apply to every topology. ``seed`` is used by random topologies and ignored
    by deterministic ones, so a caller may pass its run seed whatever the name. Other
    parameters (``degree`` for the expander, ``rows`` and ``cols`` for the torus) must
    be ones the builder accepts.
    """
    key = _lookup(name)
    builder = _REGISTRY.get(key)
    accepted = _REGISTRY.parameters(key)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        takes = [p for p in accepted if p != "seed"] + (["seed"] if "seed" in accepted else [])
        raise TopologyError(
            f"{key}: unknown parameter {', '.join(map(repr, unknown))}; "
            f"{key} accepts {', '.join(takes)}"
        )
    if "seed" in accepted:
        params["seed"] = seed
    return builder(n, weights=weights, lazy=lazy, **params)


register("ring", ring, "cycle, node i linked to i-1 and i+1 (degree 2), n >= 3")
register(
    "torus",
    torus,
    "2-D periodic grid rows x cols = n (degree 4, sides >= 3; most square unless rows/cols given)",
)
register(
    "expander",
    expander,
    "random d-regular graph redrawn until connected (degree d=4 by default, seed 0 by default)",
)
register("complete", complete, "every pair linked (degree n-1); uniform weights average in one step")
register("exponential", exponential, "static exponential graph, i linked to i +- 2^k (mod n) for 2^k < n")
register("hypercube", hypercube, "log2(n)-dimensional hypercube, i linked to i XOR 2^k; n a power of 2")
register("star", star, "node 0 linked to every other node (irregular: Metropolis weights by default)")
register(
    "onepeer-exp",
    onepeer_exp,
    "time-varying: at step t node i sends to i + 2^(t mod ceil(log2 n)) (degree 1; exact average per period for n = 2^k)",
)
register("matching", matching, "time-varying: a random perfect matching per step, seeded by (seed, t); n even")
