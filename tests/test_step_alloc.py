"""Once warm, a gossip algorithm's step allocates nothing in proportion to the model.

The payloads, the decodes, the weighted sum of the neighbours and the steps'
temporaries live in buffers the algorithm keeps across steps; ``identity`` decodes
as a view of its payload. Counted with the profiler's CPU memory events (every
allocation during the step, freed or not), as in tests/test_compress_alloc.py.
"""

import pytest
import torch

import topologies
from gossip import algorithms, comm
from gossip.compress import _kernels
from tests.test_compress_alloc import _allocated_bytes

N, D = 4, 1 << 14  # 4 nodes on a ring in one process, 16384 parameters each


@pytest.fixture
def compiled():
    """quant's kernels in compiled form from the first call (its eager forms allocate
    temporaries; ``auto`` runs a model this small eager)."""
    old = _kernels.set_backend("compile")
    yield
    _kernels.set_backend(old)


def _steady_state_bytes(name: str, extra: dict) -> tuple[int, int]:
    c = comm.SimulatedCommunicator(topologies.build("ring", N))
    alg = algorithms.build(name, c, **extra)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g)
    U = torch.empty(N, D)
    alg.setup(X)

    def step():
        U.normal_(generator=g).mul_(1e-3)
        alg.step(X, U)

    for _ in range(3):  # warm-up: buffers are made, kernels compiled and verified
        step()
    before = X.clone()
    got = _allocated_bytes(lambda: [step() for _ in range(3)])
    assert not torch.equal(X, before)  # the steps did run
    return got, X.numel() * X.element_size()


# The bound: the small per-step tensors (random keys, self weights, header words,
# per-row checksums and scales, index columns), a few KiB per step whatever d is,
# against 256 KiB for one copy of the 4 models. 1/16 of one copy over 3 steps
# leaves room for those and fails on any (m, d) temporary.
_CASES = [
    ("dpsgd", {}),
    ("naive", {"compressor": "identity"}),
    ("dcd", {"compressor": "identity"}),
    ("ecd", {"compressor": "identity"}),
    ("choco", {"compressor": "identity"}),
    ("sgp", {}),
    ("sgp", {"overlap": 1}),
]


@pytest.mark.parametrize("name,extra", _CASES, ids=[f"{n}-identity{'-overlap' if e.get('overlap') else ''}"
                                                     for n, e in _CASES])
def test_identity_steps_allocate_nothing_of_model_size(name, extra):
    got, model = _steady_state_bytes(name, extra)
    assert got < model // 16, (name, got, model)


@pytest.mark.parametrize("name", ["dcd", "ecd", "choco"])
def test_quant8_steps_allocate_nothing_of_model_size(name, compiled):
    got, model = _steady_state_bytes(name, {"compressor": "quant:bits=8"})
    assert got < model // 16, (name, got, model)
