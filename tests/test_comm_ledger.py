"""Ledger: byte accounting per peer and in total, phase timing, export and restore."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gossip.comm.ledger as ledger_mod
from gossip.comm import OPS, PHASES, Ledger


class _Clock:
    """A perf_counter stand-in the test advances by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(ledger_mod, "perf_counter", c)
    return c


def test_record_counts_sent_received_per_peer_and_total() -> None:
    led = Ledger([1], world_size=4)
    led.record(1, [0, 2], 100)  # 1 -> 0, 1 -> 2
    led.record([0, 2], 1, [30, 40])  # received
    led.record(0, 2, 999)  # foreign: ignored
    led.count("exchange")
    assert led.bytes_sent == 200 and led.bytes_received == 70
    assert led.sent_by(1) == 200 and led.received_by(1) == 70
    assert led.sent_to(0) == 100 and led.sent_to(2) == 100 and led.sent_to(3) == 0
    assert led.received_from(0) == 30 and led.received_from(2) == 40
    assert led.traffic() == {(1, 0): 100, (1, 2): 100, (0, 1): 30, (2, 1): 40}
    d = led.as_dict()
    assert d["ops"]["exchange"] == {"calls": 1, "sent": 200, "received": 70}
    assert d["bytes"] == {"sent": 200, "received": 70}


def test_vectorised_record_equals_one_message_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    n = 7
    src, dst = rng.integers(0, n, 200), rng.integers(0, n, 200)
    nb = rng.integers(0, 1000, 200)
    monkeypatch.setattr(ledger_mod, "_CONSOLIDATE_AT", 16)  # exercise folding
    bulk, single = Ledger(range(0, n, 2), n), Ledger(range(0, n, 2), n)
    bulk.record(src, dst, nb, op="all_gather")
    for s, d, b in zip(src, dst, nb):
        single.record(int(s), int(d), int(b), op="all_gather")
    assert bulk.traffic() == single.traffic()
    assert bulk.as_dict(detail=True) == single.as_dict(detail=True)
    hosted = np.isin(src, range(0, n, 2))
    assert bulk.bytes_sent == int(nb[hosted].sum())


def test_phases_nest_without_double_counting(clock: _Clock) -> None:
    led = Ledger()
    with led.phase("compute"):
        clock.t += 1.0
        with led.phase("communicate"):
            clock.t += 2.0
            with led.phase("communicate"):  # re-entrant, e.g. a communicator inside a block
                clock.t += 0.5
        clock.t += 0.25
        assert led.times["compute"] == pytest.approx(1.25)  # open phase counted so far
    led.add_time("compress", 4.0)
    assert led.times == pytest.approx({"compute": 1.25, "compress": 4.0, "communicate": 2.5, "wait": 0.0,
                                       "warmup": 0.0})


def test_warmup_takes_the_time_of_every_phase_inside_it(clock: _Clock) -> None:
    led = Ledger()
    with led.phase("compress"):
        clock.t += 1.0
        with led.warmup():  # e.g. the first call compiles
            clock.t += 5.0
            with led.phase("communicate"):
                clock.t += 2.0
            led.add_time("compute", 0.5)
        clock.t += 0.25
    assert led.times == pytest.approx({"compute": 0.0, "compress": 1.25, "communicate": 0.0, "wait": 0.0,
                                       "warmup": 7.5})


def test_setup_traffic_is_counted_in_the_total_and_kept_apart(clock: _Clock) -> None:
    led = Ledger([0, 1], 3)
    with led.setup():
        with led.phase("communicate"):
            clock.t += 3.0
            led.record([0, 1, 2], [1, 2, 0], 100)  # x_1 to each neighbour once
    led.record([0, 1], [1, 0], 10)
    led.step()
    assert led.bytes_sent == 220 and led.setup_bytes_sent == 200 and led.step_bytes_sent == 20
    assert led.setup_bytes_received == 200 and led.times["warmup"] == pytest.approx(3.0)
    # per node: node 0 sent 100 in setup and 10 in the step, received 100 (from 2) and 10 (from 1)
    assert (led.setup_bytes_sent_by(0), led.step_bytes_sent_by(0), led.step_bytes_received_by(0)) == (100, 10, 10)
    assert led.setup_bytes_received_by(1) == 100 and led.step_bytes_received_by(1) == 10
    assert sum(led.step_bytes_sent_by(i) for i in led.nodes) == led.step_bytes_sent
    with pytest.raises(ValueError, match="node 2 is not hosted here"):
        led.step_bytes_sent_by(2)
    d = led.as_dict(detail=True)
    assert d["setup"] == {"sent": 200, "received": 200, "messages": 2, "known": True,
                          "control": {"sent": 0, "messages": 0}, "per_node": {"sent": [100, 100], "received": [100, 100]}}
    back = Ledger([0, 1], 3)
    back.load_state_dict(json.loads(json.dumps(led.state_dict())))
    assert back.as_dict(detail=True) == d
    old = led.state_dict()
    del old["setup"]  # a state written before setup traffic was kept apart
    back.load_state_dict(old)
    assert not back.setup_known and back.setup_bytes_sent == 0 and back.step_bytes_sent == 220


def test_reset_zeroes_and_keeps_an_open_phase_running(clock: _Clock) -> None:
    led = Ledger([0], 2)
    led.record(0, 1, 10)
    led.step(3)
    with led.phase("compute"):
        clock.t += 1.0
        led.reset()
        clock.t += 0.5
    assert led.bytes_sent == 0 and led.steps == 0 and led.traffic() == {}
    assert led.times["compute"] == pytest.approx(0.5)


def test_export_is_json_and_state_round_trips(clock: _Clock) -> None:
    led = Ledger([0, 2], 3)
    led.record([0, 2], [1, 1], 8)
    led.record(1, [0, 2], 5, op="broadcast")
    led.count("broadcast")
    led.step(2)
    led.add_time("communicate", 0.75)
    summary = json.loads(json.dumps(led.as_dict(detail=True)))
    assert summary["per_node"] == {"node": [0, 2], "sent": [8, 8], "received": [5, 5]}
    assert summary["per_peer"]["bytes"] == [8, 5, 5, 8]  # keys (0,1) (1,0) (1,2) (2,1)
    state = json.loads(json.dumps(led.state_dict()))
    back = Ledger([0, 2], 3)
    back.load_state_dict(state)
    assert back.as_dict(detail=True) == led.as_dict(detail=True)
    assert back.traffic() == led.traffic() and back.steps == 2


def test_snapshot_and_since_give_the_difference() -> None:
    led = Ledger([0], 2)
    led.record(0, 1, 10)
    snap = led.snapshot()
    led.record(0, 1, 7)
    led.record(1, 0, 3)
    led.step()
    delta = led.since(snap)
    assert delta["bytes"] == {"sent": 7, "received": 3} and delta["steps"] == 1
    assert snap["bytes"]["sent"] == 10  # the snapshot did not move


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda L: L.phase("idle"), r"unknown phase 'idle'; known phases are \['compute'"),
        (lambda L: L.add_time("compute", -1), r"`seconds` must be finite and >= 0, got -1"),
        (lambda L: L.add_time("compute", float("nan")), r"`seconds` must be finite"),
        (lambda L: L.record(0, 1, 5, op="gossip"), r"unknown op 'gossip'; known ops are"),
        (lambda L: L.record(0, 1, -5), r"`nbytes` must be >= 0, got -5"),
        (lambda L: L.record(0, 9, 5), r"node ids must lie in \[0, 4\), got 9"),
        (lambda L: L.sent_by(3), r"node 3 is not hosted here"),
        (lambda L: L.sent_to(7), r"`peer` must lie in \[0, 4\), got 7"),
        (lambda L: L.load_state_dict({"format": "other"}), r"expected format"),
        (lambda L: L.load_state_dict(Ledger([1], 4).state_dict()), r"state is for nodes \[1\]"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(Ledger([0], 4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes": []}, r"`nodes` must name at least one hosted node"),
        ({"nodes": [1, 1]}, r"`nodes` must be distinct non-negative ids, got \[1, 1\]"),
        ({"nodes": [3], "world_size": 3}, r"`world_size` must exceed every hosted node id"),
        ({"phases": ["a", "a"]}, r"`phases` must be distinct names"),
    ],
)
def test_constructor_validates(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Ledger(**kwargs)


def test_defaults_are_the_documented_names() -> None:
    led = Ledger()
    assert led.phases == PHASES == ("compute", "compress", "communicate", "wait")
    assert set(led.calls) == set(OPS) and led.nodes == (0,) and led.world_size == 1


def test_a_state_from_before_the_wait_phase_loads(clock: _Clock) -> None:
    led = Ledger()
    with led.phase("communicate"):
        clock.t += 2.0
    sd = led.state_dict()
    sd["phases"] = ["compute", "compress", "communicate"]  # as written before "wait" was kept apart
    del sd["times"]["wait"]
    new = Ledger()
    new.load_state_dict(sd)
    assert new.times["communicate"] == pytest.approx(2.0) and new.times["wait"] == 0.0
    sd["phases"] = ["compute", "communicate"]
    with pytest.raises(ValueError, match=r"state has phases \['compute', 'communicate'\]"):
        new.load_state_dict(sd)


def test_node_traffic_of_all_nodes_in_one_pass_equals_the_per_node_figures(clock: _Clock) -> None:
    from gossip import rundir

    led = Ledger([1, 3, 4], 6)  # three of six nodes hosted, in the order the records list them
    with led.setup():
        with led.phase("communicate"):
            clock.t += 2.0
            led.record([1, 3, 4, 5], [3, 4, 5, 1], [7, 8, 9, 10])
    with led.phase("compute"):
        clock.t += 1.5
    led.record([1, 1, 4, 0], [3, 0, 1, 4], [100, 30, 20, 5])
    led.step()
    order = [4, 1, 3]
    many = rundir.nodes_traffic(led, order)
    for node, rec in zip(order, many):
        # the figures a record held when each node was asked on its own
        assert rec == {
            "bytes_sent": led.step_bytes_sent_by(node), "bytes_recv": led.step_bytes_received_by(node),
            "setup_bytes_sent": led.setup_bytes_sent_by(node), "setup_bytes_recv": led.setup_bytes_received_by(node),
            "warmup_s": 2.0 / 3, "compute_s": 1.5 / 3, "compress_s": 0.0, "comm_s": 0.0, "wait_s": 0.0,
        }
        assert rundir.node_traffic(led, node) == rec
        assert all(type(rec[k]) is int for k in ("bytes_sent", "bytes_recv", "setup_bytes_sent", "setup_bytes_recv"))
    assert [r["bytes_sent"] for r in many] == [20, 130, 0] and [r["setup_bytes_recv"] for r in many] == [8, 10, 7]
    with pytest.raises(ValueError, match="node 5 is not hosted here"):
        rundir.nodes_traffic(led, [1, 5])
    with pytest.raises(ValueError, match="node 9 is not hosted here"):
        led.node_bytes([9])
