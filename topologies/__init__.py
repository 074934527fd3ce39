"""Gossip topologies: graphs, their mixing matrices and spectral figures.

Pure numpy/scipy/networkx; nothing here imports torch or touches a process group.

    >>> import topologies
    >>> topo = topologies.build("ring", 8)
    >>> topo.n, int(topo.degrees[0]), round(topo.lambda2, 6)
    (8, 2, 0.804738)

Builders (each returns a fresh, validated ``Topology``): ``ring``, ``torus``,
``expander``, ``complete``, ``exponential``, ``hypercube``, ``star``, and
``from_graph`` / ``from_adjacency`` for any other graph; the time-varying
``onepeer_exp`` and ``matching`` (``TimeVaryingTopology``: ``at(t)`` is ``W(t)``); ``Topology(W)`` takes a mixing
matrix as it is. ``build(name, n, **params)`` resolves a registered name;
``available()`` lists them. Weight rules live in ``topologies.weights``, the spectral
computation in ``topologies.spectral``. ``available_memory()`` is the memory a new
allocation may take (the builders refuse a graph that cannot fit; a caller sizing a
simulation asks the same). See docs/topologies.md.
"""

from ._checks import available_memory
from .classic import complete, ring, star
from .custom import from_adjacency, from_graph
from .errors import TopologyError
from .expander import expander
from .exponential import exponential
from .lattice import hypercube, torus
from .registry import available, build, describe, register
from .spectral import Spectrum
from .timevarying import TimeVaryingTopology, matching, onepeer_exp
from .topology import Topology

__all__ = [
    "Topology",
    "TimeVaryingTopology",
    "TopologyError",
    "Spectrum",
    "build",
    "available",
    "describe",
    "register",
    "available_memory",
    "ring",
    "torus",
    "expander",
    "complete",
    "exponential",
    "hypercube",
    "star",
    "from_graph",
    "from_adjacency",
    "onepeer_exp",
    "matching",
]
