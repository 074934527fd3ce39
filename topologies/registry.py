"""Names to builders: the only place where a topology name becomes an object.

The CLI (``python -m topologies``) and ``gossip.train --topology`` resolve names here
and nowhere else.
"""

from __future__ import annotations

from gossip._registry import Registry  # torch-free: gossip's package init is lazy

import inspect
from typing import Any, Callable

from .classic import complete, ring, star
from .errors import TopologyError
from .expander import expander
from .exponential import exponential
from .lattice import hypercube, torus
from .timevarying import TimeVaryingTopology, matching, onepeer_exp
from .topology import Topology

__all__ = ["build", "available", "describe", "register"]

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


def available() -> list[str]:
    """The registered topology names, sorted."""
    return _REGISTRY.names()


def describe(name: str) -> str:
    """The one-line description of a registered topology."""
    return _REGISTRY.summary(_lookup(name))


def _lookup(name: object) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _REGISTRY:
        _REGISTRY.get(name)  # raises the one-line TopologyError naming the known ones
    return key  # type: ignore[return-value]


def _parameters(builder: Callable[..., Topology]) -> list[str]:
    sig = inspect.signature(builder)
    return [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]


def parameters(name: str) -> list[str]:
    """The keyword parameters the ``name`` builder accepts (``weights`` and ``lazy`` included)."""
    return _parameters(_REGISTRY.get(_lookup(name)))


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
    accepted = _parameters(builder)
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
