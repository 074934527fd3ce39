"""SimulatedCommunicator: neighbour sums against a dense W @ D, byte accounting, collectives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossip.comm import PeerPayloadError, Received, SimulatedCommunicator
from tests._comm_topo import build
from tests.conftest import CorruptPayload, decode_f32, payloads, strict_decode

TOPOLOGIES = [("ring", 8), ("torus", 16), ("star", 6), ("complete", 5)]


def _dense(topo) -> np.ndarray:
    W = np.asarray(topo.matrix.todense() if hasattr(topo.matrix, "todense") else topo.matrix)
    return W - np.diag(np.diag(W))


def _sequential(topo, D: torch.Tensor) -> torch.Tensor:
    """The contract written out one node at a time: acc = w0*D0; acc += w1*D1; ..."""
    rows = []
    for i in range(topo.n):
        ids, ws = topo.neighbors(i)
        w = torch.as_tensor(ws, dtype=torch.float64).to(D.dtype)
        acc = w[0] * D[int(ids[0])]
        for k in range(1, len(ids)):
            acc += w[k] * D[int(ids[k])]
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("name, n", TOPOLOGIES)
def test_weighted_sum_matches_dense_reference_and_the_sequential_contract(name: str, n: int) -> None:
    topo = build(name, n)
    comm = SimulatedCommunicator(topo)
    P = payloads(n, 33)
    out = comm.neighbor_exchange(P).weighted_sum(decode_f32)
    D = decode_f32(P)
    ref = torch.as_tensor(_dense(topo) @ D.double().numpy())
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    # bit for bit against the per-node loop, signs of zero included
    assert torch.equal(out.view(torch.int32), _sequential(topo, D).view(torch.int32))


@pytest.mark.parametrize("name, n", [("ring", 8), ("torus", 16), ("complete", 5)])
def test_the_blocked_weighted_sum_keeps_the_sequential_contract(monkeypatch, name: str, n: int) -> None:
    """Many rows of full degree are summed one block of rows at a time (3 rows here, the
    last block shorter): the same bits as the per-node contract, as a rank's own sum
    gives them."""
    import gossip.comm.base as base

    d = 53
    monkeypatch.setattr(base, "_SUM_BLOCK_VALUES", 3 * d)
    topo = build(name, n)
    P = payloads(n, d)
    rec = SimulatedCommunicator(topo).neighbor_exchange(P)
    calls, blocked = [], Received._blocked_sum
    monkeypatch.setattr(Received, "_blocked_sum", staticmethod(lambda *a: calls.append(1) or blocked(*a)))
    out = rec.weighted_sum(decode_f32)
    assert calls and torch.equal(out.view(torch.int32), _sequential(topo, decode_f32(P)).view(torch.int32))


@pytest.mark.parametrize("block_rows", [None, 1, 3])
@pytest.mark.parametrize("name, n", [("ring", 8), ("torus", 16), ("star", 5)])
def test_finish_gets_every_block_of_the_sum_once_in_order(monkeypatch, name: str, n: int,
                                                           block_rows: int | None) -> None:
    """``weighted_sum(finish=...)`` hands over each block of rows' sum as it completes:
    the blocks cover the rows once, in ascending order, with the bits of the whole sum
    (blocks of 1 and 3 rows; None: the whole matrix at once, one block)."""
    import gossip.comm.base as base

    d = 53
    if block_rows:
        monkeypatch.setattr(base, "_SUM_BLOCK_VALUES", block_rows * d)
    topo = build(name, n)
    P = payloads(n, d)
    whole = SimulatedCommunicator(topo).neighbor_exchange(P).weighted_sum(decode_f32).clone()
    seen: list[tuple[slice, torch.Tensor]] = []
    SimulatedCommunicator(topo).neighbor_exchange(P).weighted_sum(
        decode_f32, finish=lambda s, block: seen.append((s, block.clone())))
    assert [s.start for s, _ in seen] == sorted(s.start for s, _ in seen)
    assert torch.cat([torch.arange(n)[s] for s, _ in seen]).tolist() == list(range(n))
    got = torch.cat([b for _, b in seen])
    assert torch.equal(got.view(torch.int32), whole.view(torch.int32))


def test_padding_never_touches_a_row() -> None:
    """Star leaves have one neighbour; their padding must not add 0.0 * D_self."""
    topo = build("star", 5)
    comm = SimulatedCommunicator(topo)
    X = torch.full((5, 4), -0.0)
    X[1:, 0] = float("inf")  # a leaf's own payload is its padding target
    out = comm.neighbor_exchange(X.view(torch.uint8)).weighted_sum(decode_f32)
    leaves = out[1:]
    assert torch.isfinite(leaves).all()
    assert torch.equal(leaves.view(torch.int32), torch.full((4, 4), -0.0).view(torch.int32))


def test_received_exposes_senders_and_raw_payloads() -> None:
    topo = build("star", 5)
    comm = SimulatedCommunicator(topo)
    P = payloads(5, 3)
    rec = comm.neighbor_exchange(P)
    assert isinstance(rec, Received)
    assert rec.nodes.tolist() == list(range(5)) and rec.senders.tolist() == list(range(5))
    assert rec.payloads.data_ptr() == P.data_ptr()  # no copy in the simulation
    for r in range(5):
        ids, rows = rec.neighbors(r)
        assert ids.tolist() == topo.neighbors(r)[0].tolist()
        assert torch.equal(rows, P[ids])
    assert rec.degrees.tolist() == [4, 1, 1, 1, 1]


@pytest.mark.parametrize("name, n", [("ring", 6), ("star", 5)])
def test_ledger_counts_payload_bytes_times_degree(name: str, n: int) -> None:
    topo = build(name, n)
    comm = SimulatedCommunicator(topo)
    P = payloads(n, 10)  # 40 bytes per payload
    for _ in range(3):
        comm.neighbor_exchange(P)
    comm.neighbor_exchange(P, record=False)
    led = comm.ledger
    deg = np.asarray(topo.degrees)
    # 3 recorded exchanges of 40 bytes, plus one 16-byte size check for the one size
    for i in range(n):
        assert led.sent_by(i) == led.received_by(i) == (3 * 40 + 16) * int(deg[i])
        for j in topo.neighbors(i)[0]:
            assert led.sent_to(int(j), node=i) == 136 and led.received_from(int(j), node=i) == 136
    ops = led.as_dict()["ops"]
    assert ops["exchange"]["sent"] == 3 * 40 * int(deg.sum())
    assert ops["control"] == {"calls": 1, "sent": 16 * int(deg.sum()), "received": 16 * int(deg.sum())}
    assert led.calls["exchange"] == 3
    assert set(led.traffic()) == {(i, int(j)) for i in range(n) for j in topo.neighbors(i)[0]}


def test_size_checks_are_charged_once_per_size_or_not_at_all() -> None:
    topo = build("ring", 4)
    comm = SimulatedCommunicator(topo)
    for nbytes in (8, 8, 12, 8):
        comm.neighbor_exchange(torch.zeros(4, nbytes, dtype=torch.uint8))
    assert comm.ledger.as_dict()["ops"]["control"]["sent"] == 2 * 16 * 8  # sizes 8 and 12
    quiet = SimulatedCommunicator(topo, check_sizes=False)
    quiet.neighbor_exchange(torch.zeros(4, 8, dtype=torch.uint8))
    assert quiet.ledger.bytes_sent == 8 * 8


def test_collectives_and_their_ring_accounting() -> None:
    n = 4
    comm = SimulatedCommunicator(build("ring", n))
    X = torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3)
    s = comm.all_reduce(X)
    assert s.shape == X.shape and torch.equal(s, X.sum(0, keepdim=True).expand_as(X))
    torch.testing.assert_close(comm.all_reduce(X, op="mean"), (X.sum(0) / n).expand_as(X))
    g = comm.all_gather(X)
    assert torch.equal(g, X) and g.data_ptr() != X.data_ptr()
    b = comm.broadcast(X, src=2)
    assert torch.equal(b, X[2:3].expand_as(X))
    led = comm.ledger
    B = 6 * 4  # bytes of one row
    ring = round(2 * (n - 1) * B / n)
    assert led.as_dict()["ops"]["all_reduce"] == {"calls": 2, "sent": 2 * n * ring, "received": 2 * n * ring}
    assert led.sent_to(1, node=0) == 2 * ring + (n - 1) * B  # ring successor: all_reduce + all_gather
    assert led.as_dict()["ops"]["all_gather"]["sent"] == n * (n - 1) * B
    assert led.sent_by(2) == 2 * ring + (n - 1) * B + (n - 1) * B  # root of the broadcast
    assert led.received_from(2, node=0) == B
    before = led.bytes_sent
    comm.all_reduce(X, record=False)
    assert led.bytes_sent == before


def test_async_variants_are_already_complete() -> None:
    comm = SimulatedCommunicator(build("ring", 3))
    h = comm.neighbor_exchange_async(payloads(3, 2))
    assert h.is_completed() and isinstance(h.wait(), Received)
    X = torch.ones(3, 2)
    assert torch.equal(comm.all_reduce_async(X).wait(), 3 * X)


def test_bad_payload_is_reported_naming_the_sender() -> None:
    comm = SimulatedCommunicator(build("ring", 6))
    P = torch.zeros(6, 8, dtype=torch.uint8)
    P[4, 0] = 0xFF
    with pytest.raises(PeerPayloadError, match=r"bad payload from rank 4 .*checksum mismatch") as ei:
        comm.neighbor_exchange(P).weighted_sum(strict_decode)
    assert ei.value.peers == (4,) and isinstance(ei.value.__cause__, CorruptPayload)


def test_decode_returning_the_wrong_shape_is_an_error() -> None:
    comm = SimulatedCommunicator(build("ring", 3))
    rec = comm.neighbor_exchange(torch.zeros(3, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"must return a tensor of shape \(k, d\) with k = 3"):
        rec.weighted_sum(lambda Q: Q.view(torch.float32)[:2])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: c.neighbor_exchange(torch.zeros(3, 8, dtype=torch.uint8)),
         r"`P` must have one row per hosted node, shape \(4, \.\.\.\), got \(3, 8\)"),
        (lambda c: c.neighbor_exchange(torch.zeros(4, 8)), r"`P` must be a 2-D uint8 tensor"),
        (lambda c: c.all_reduce(torch.zeros(4, 2), op="max"), r"`op` must be one of \['sum', 'mean'\]"),
        (lambda c: c.all_reduce(torch.zeros(4, 2, dtype=torch.int32), op="mean"),
         r"op='mean' needs a floating-point `X`, got dtype torch.int32"),
        (lambda c: c.broadcast(torch.zeros(4, 2), src=4), r"`src` must be a node id in \[0, 4\), got 4"),
        (lambda c: c.all_gather(torch.zeros(2, 2)), r"shape \(4, \.\.\.\), got \(2, 2\)"),
    ],
)
def test_bad_arguments_are_rejected(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(SimulatedCommunicator(build("ring", 4)))


def test_centralized_simulation_needs_no_topology() -> None:
    comm = SimulatedCommunicator(world_size=3)
    assert torch.equal(comm.all_reduce(torch.ones(3, 1)), torch.full((3, 1), 3.0))
    with pytest.raises(ValueError, match="has no topology"):
        comm.neighbor_exchange(torch.zeros(3, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pass a `topology` or, for a centralized run, `world_size`"):
        SimulatedCommunicator()
    with pytest.raises(ValueError, match="`world_size` must equal topology.n = 4, got 5"):
        SimulatedCommunicator(build("ring", 4), world_size=5)


def test_neighbour_rows_out_of_order_are_rejected() -> None:
    topo = build("ring", 4)
    idx, w = topo.padded_neighbors()
    shuffled = idx.copy()
    shuffled[2] = shuffled[2][::-1]

    class _Swapped:
        n, degrees = topo.n, topo.degrees

        def padded_neighbors(self):
            return shuffled, w

    with pytest.raises(ValueError, match=r"row 2 must list distinct neighbours other than 2 in ascending order, got \[3, 1\]"):
        SimulatedCommunicator(_Swapped())


def test_a_real_compressor_payload_error_names_the_sender() -> None:
    from gossip import compress

    assert "quant" in compress.available(), compress.available()  # a registry regression fails here
    q = compress.build("quant:bits=8")
    topo = build("ring", 5)
    comm = SimulatedCommunicator(topo)
    X = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    P = q.encode(X, torch.arange(5), tag=7)
    decode = lambda Q: q.decode(Q, 40, tag=7)  # noqa: E731
    out = comm.neighbor_exchange(P).weighted_sum(decode)
    ref = torch.as_tensor(_dense(topo)).float() @ q.decode(P, 40, tag=7)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    P[3, -1] ^= 0xFF
    with pytest.raises(PeerPayloadError, match=r"bad payload from rank 3 .*checksum") as ei:
        comm.neighbor_exchange(P).weighted_sum(decode)
    assert ei.value.peers == (3,) and isinstance(ei.value.__cause__, compress.PayloadError)


@pytest.mark.parametrize("algo", ["dpsgd", "naive"])
def test_payloads_changed_between_encoding_and_decoding_are_still_caught(monkeypatch, algo: str) -> None:
    """The simulation decodes its own payloads without recomputing their checksums only
    while they are untouched since the encoding (same tensor, same version counter): a
    byte changed in between is caught and its sender named, as over a wire."""
    from gossip import algorithms

    comm = SimulatedCommunicator(build("ring", 5))
    alg = algorithms.build(algo, comm)
    X = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    alg.setup(X)
    alg.step(X, torch.zeros_like(X))  # untouched: accepted
    exchange = comm.neighbor_exchange

    def damaging(P, **kw):
        P[2, -1] ^= 0x01
        return exchange(P, **kw)

    monkeypatch.setattr(comm, "neighbor_exchange", damaging)
    with pytest.raises(PeerPayloadError, match=r"bad payload from rank 2 .*checksum") as ei:
        alg.step(X, torch.zeros_like(X))
    assert ei.value.peers == (2,)


@pytest.mark.parametrize("n, nbytes, per_node", [(4, 5, 8), (3, 1, 1), (4, 24, 36), (1, 100, 0)])
def test_all_reduce_bytes_are_the_ring_share_rounded_half_up(n: int, nbytes: int, per_node: int) -> None:
    comm = SimulatedCommunicator(world_size=n)
    comm.all_reduce(torch.zeros(n, nbytes, dtype=torch.uint8))
    out = comm.all_reduce(torch.full((n, nbytes), 200, dtype=torch.uint8), record=False)
    assert out.dtype == torch.uint8 and int(out[0, 0]) == (200 * n) % 256  # wraps like gloo
    assert [comm.ledger.sent_by(i) for i in range(n)] == [per_node] * n


def test_dpsgd_updates_many_rows_in_blocks_with_the_same_bits(monkeypatch) -> None:
    """D-PSGD's in-place update of many hosted rows, each block of rows (2 here) as soon
    as its weighted sum is complete: the same X, bit for bit, as in one block."""
    import gossip.comm.base as base
    from gossip import algorithms

    g = torch.Generator().manual_seed(4)
    X0, U = torch.randn(8, 50, generator=g), 1e-2 * torch.randn(8, 50, generator=g)
    out = []
    for block in (None, 2 * 50):
        if block:
            monkeypatch.setattr(base, "_SUM_BLOCK_VALUES", block)
        alg = algorithms.build("dpsgd", SimulatedCommunicator(build("ring", 8)))
        X = X0.clone()
        alg.setup(X)
        for _ in range(3):
            alg.step(X, U)
        out.append(X)
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], X0)
