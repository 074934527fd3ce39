"""Steady state allocates nothing in proportion to the model: encode and decode write
into buffers the caller keeps (``out=``), and the kernels keep no large temporaries."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gossip.compress as gc
from gossip.compress import _kernels


@pytest.fixture
def compiled():
    """The compiled kernels from the first call (``auto`` would run this size eager
    first: the eager forms allocate temporaries, the compiled ones do not)."""
    old = _kernels.set_backend("compile")
    yield
    _kernels.set_backend(old)


def _allocated_bytes(fn) -> int:
    """Bytes allocated on the CPU while ``fn`` runs (every allocation, freed or not)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


# quant:bits=4 at 2 x 2**17 values: the 4-bit lane kernels (the one-call planar encode
# returned a column word of half the payload's size)
@pytest.mark.parametrize("spec", ["quant:bits=8", "quant:bits=4", "identity"])
def test_steady_state_encode_decode_allocate_nothing_large(spec, compiled):
    d = 1 << 17
    c = gc.build(spec)
    X = torch.randn(2, d, generator=torch.Generator().manual_seed(0))
    keys = torch.tensor([3, 4])
    P = torch.empty(2, c.payload_nbytes(d), dtype=torch.uint8)
    Y = torch.empty(2, d)
    for _ in range(2):  # warm-up: first calls compile and verify the kernels
        c.encode(X, keys, tag=7, out=P)
        c.decode(P, d, tag=7, out=Y)
    ref = c.decode(c.encode(X, keys, tag=7), d, tag=7)
    assert torch.equal(Y, ref)  # the buffers hold what the allocating calls return

    def step():
        c.encode(X, keys, tag=7, out=P)
        c.decode(P, d, tag=7, out=Y)

    got = _allocated_bytes(step)
    # small tensors (scales, seeds, header words) only: far below one payload
    assert got < P.numel() // 16, (spec, got)


def _steady_state_bytes(spec, d, m=2):
    c = gc.build(spec)
    X = torch.randn(m, d, generator=torch.Generator().manual_seed(1))
    keys = torch.arange(3, 3 + m)
    P = torch.empty(m, c.payload_nbytes(d), dtype=torch.uint8)
    Y = torch.empty(m, d)
    for _ in range(2):  # warm-up: the per-thread scratch buffers are allocated here
        c.encode(X, keys, tag=7, out=P)
        c.decode(P, d, tag=7, out=Y)
    assert torch.equal(Y, c.decode(c.encode(X, keys, tag=7), d, tag=7))

    def step():
        c.encode(X, keys, tag=7, out=P)
        c.decode(P, d, tag=7, out=Y)

    return _allocated_bytes(step), P, X


def test_sign_steady_state_allocates_nothing_large():
    # chunked encode and table decode work in per-thread scratch buffers
    got, P, X = _steady_state_bytes("sign", 1 << 18)
    assert got < P.numel() // 16, got


@pytest.mark.parametrize("spec", ["randk:p=0.001", "topk:p=0.001"])
def test_sparse_steady_state_allocates_nothing_of_the_models_size(spec):
    # the draws (randk) and candidates (topk) are O(k) temporaries; nothing of size d
    # (a d-byte mask alone would be X.nbytes / 4)
    got, P, X = _steady_state_bytes(spec, 1 << 18)
    assert got < X.numel() * 4 // 8, (spec, got)


def test_out_buffers_are_checked():
    c = gc.build("quant:bits=8")
    X = torch.randn(2, 100)
    keys = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"quant.encode: out must be a contiguous, 8-byte aligned torch.uint8 tensor of shape \(2, 144\)"):
        c.encode(X, keys, out=torch.empty(2, 100, dtype=torch.uint8))
    P = c.encode(X, keys)
    with pytest.raises(ValueError, match=r"quant.decode: out must be .* torch.float32 tensor of shape \(2, 100\)"):
        c.decode(P, 100, out=torch.empty(2, 100, dtype=torch.float64))
    assert c.decode(P, 100, out=torch.empty(2, 100)).shape == (2, 100)
