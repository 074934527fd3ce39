"""Encoding from two threads at once gives the bytes each gives alone.

A DDP hook's exchange may encode in a worker thread while the main thread encodes
(gossip.ddp overlaps communication with backward): the kernels' reusable scratch
buffers must be per thread, or one thread's partial sums land in the other's payload.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gossip import compress as gc
from gossip.compress import _kernels


@pytest.fixture(autouse=True)
def eager():
    # the scratch buffers are the eager forms' (the compiled forms keep none)
    old = _kernels.set_backend("eager")
    yield
    _kernels.set_backend(old)


@pytest.mark.parametrize("spec", ["quant:bits=8", "sign"])
def test_concurrent_encodes_give_each_threads_own_bytes(spec):
    c = gc.build(spec)
    d = 1 << 17  # payload rows far above one checksum chunk (16 Ki words)
    inputs = [torch.randn(2, d, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    keys = torch.tensor([3, 4])
    want = [c.encode(X, keys, tag=7) for X in inputs]
    assert not torch.equal(want[0], want[1])
    rounds = 40
    start = threading.Barrier(2)
    got: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            start.wait()
            got[i] = [c.encode(inputs[i], keys, tag=7) for _ in range(rounds)]
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        bad = [r for r, P in enumerate(got[i]) if not torch.equal(P, want[i])]
        assert not bad, f"thread {i}: payloads of rounds {bad} differ from the same encode alone"
        # and they decode: the checksum in each header matches its body
        c.decode(got[i][-1], d, tag=7)


def test_checksum_kernel_from_two_threads():
    # the kernel itself, with payloads of the same row count (the old buffer's key)
    m, n = 2, 1 << 16
    words = [torch.randint(-(1 << 31), 1 << 31, (m, n), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(s)) for s in range(2)]
    w = torch.arange(n, dtype=torch.int32).mul_(2).add_(1)
    want = [_kernels._checksum(x, w) for x in words]
    start = threading.Barrier(2)
    got: list[list[torch.Tensor]] = [[], []]

    def work(i: int) -> None:
        start.wait()
        got[i] = [_kernels.checksum(words[i], w) for _ in range(100)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(got[i]) == 100
        assert all(torch.equal(c, want[i]) for c in got[i]), f"thread {i}: a checksum differs"
