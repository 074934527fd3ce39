"""Communicators: who talks to whom, what it cost.

Two implementations of one batched interface (docs/internals.md, docs/comm.md):

- :class:`DistCommunicator` hosts one node per process over torch.distributed
  (``batch_isend_irecv`` to the topology neighbours; NCCL on CUDA, gloo on CPU);
- :class:`SimulatedCommunicator` hosts all ``n`` nodes in one process, for tests and
  large-``n`` studies, and gives bit-identical neighbour sums.

Both record bytes and time in a :class:`Ledger`. Communicators know nothing of
compressors or algorithms: payloads are opaque bytes and decoding is a callable.
"""

from .base import Communicator, Handle, Received
from .distributed import DistCommunicator, init_from_env, shutdown
from gossip.errors import PeerConnectionError, PeerError, PeerPayloadError, PeerTimeoutError
from .latency import LatencyCommunicator, latency_rounds
from .ledger import OPS, PHASES, Ledger
from .simulated import SimulatedCommunicator

__all__ = [
    "Communicator",
    "DistCommunicator",
    "SimulatedCommunicator",
    "init_from_env",
    "shutdown",
    "Received",
    "Handle",
    "Ledger",
    "LatencyCommunicator",
    "latency_rounds",
    "PHASES",
    "OPS",
    "PeerError",
    "PeerTimeoutError",
    "PeerPayloadError",
    "PeerConnectionError",
]
