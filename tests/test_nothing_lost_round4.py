"""Nothing lost, nothing silently wrong, round 4: what a demanding user met.

- A resumed run's byte counts equal an uninterrupted run's: the payload size check is
  charged once per run, not once per process (every family under torchrun:
  tests/test_restarts.py).
"""

from __future__ import annotations

import torch

import topologies
from gossip import comm


# ----------------------------------------------------------------------- byte counts
def _exchange_twice(c: comm.SimulatedCommunicator) -> None:
    c.neighbor_exchange(torch.zeros(c.world_size, 40, dtype=torch.uint8))
    c.neighbor_exchange(torch.zeros(c.world_size, 40, dtype=torch.uint8))


def test_the_size_check_is_charged_once_per_run_across_a_resume():
    ring = topologies.build("ring", 4)
    whole = comm.SimulatedCommunicator(ring)
    _exchange_twice(whole)
    _exchange_twice(whole)
    first = comm.SimulatedCommunicator(ring)
    _exchange_twice(first)
    resumed = comm.SimulatedCommunicator(ring)  # a new process: it checks the sizes again
    resumed.ledger.load_state_dict(first.ledger.state_dict())
    _exchange_twice(resumed)
    assert resumed.ledger.as_dict()["ops"] == whole.ledger.as_dict()["ops"]
    assert resumed.ledger.bytes_sent == whole.ledger.bytes_sent == 4 * 2 * (4 * 40 + 16)
