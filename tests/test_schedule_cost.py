"""Partitions, the linear cost model and the partition search of Wang et al. 2021 (arXiv:2103.15195)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from gossip.schedule import CostModel, Linear, Partition, alg2, best_partition, fit_linear, parse_merge


# ---------------------------------------------------------------- partitions
def test_partition_constructors_cover_every_tensor_once_in_order():
    assert Partition.layer(4).sizes == (1, 1, 1, 1)
    assert Partition.whole(4).sizes == (4,)
    p = Partition.from_bounds([0, 2, 3], 6)
    assert p.sizes == (2, 1, 3)
    assert p.bounds == ((0, 2), (2, 3), (3, 6))
    assert p.group_of() == (0, 0, 1, 2, 2, 2)
    assert p.numels([5, 1, 7, 2, 2, 3]) == (6, 7, 7)
    # the bounds tile 0..N without gap or overlap, in order
    flat = [i for a, b in p.bounds for i in range(a, b)]
    assert flat == list(range(6))


@pytest.mark.parametrize("bad", [(), (0, 2), (2, -1)])
def test_partition_refuses_empty_groups(bad):
    with pytest.raises(ValueError, match="sizes"):
        Partition(bad)


@pytest.mark.parametrize("bounds", [[1, 2], [0, 2, 2], [0, 6]])
def test_partition_from_bounds_refuses_bad_starts(bounds):
    with pytest.raises(ValueError, match="group starts"):
        Partition.from_bounds(bounds, 6)


@pytest.mark.parametrize("value,want", [("layer", "layer"), ("WHOLE", "whole"), ("auto", "auto"), ("3", 3), (2, 2)])
def test_parse_merge_accepts(value, want):
    assert parse_merge(value) == want


@pytest.mark.parametrize("value", ["", "0", "-1", "x", "2.5", 0, True, None, "layers"])
def test_parse_merge_refuses_with_one_line(value):
    with pytest.raises(ValueError) as e:
        parse_merge(value)
    msg = str(e.value)
    assert "\n" not in msg and "layer, whole, auto or a number of groups" in msg


# ---------------------------------------------------------------- the linear fit
def test_fit_linear_recovers_an_exact_line():
    x = [10, 100, 1000, 5000]
    f = fit_linear(x, [2e-4 + 3e-8 * v for v in x])
    assert f.base == pytest.approx(2e-4, rel=1e-9) and f.per_value == pytest.approx(3e-8, rel=1e-9)


def test_fit_linear_keeps_coefficients_non_negative():
    assert fit_linear([1, 2, 3], [3.0, 2.0, 1.0]) == Linear(2.0, 0.0)  # falling: flat at the mean
    f = fit_linear([1, 2, 3], [1.0, 3.0, 5.0])  # intercept -1 clamped, slope refitted through 0
    assert f.base == 0.0 and f.per_value == pytest.approx((1 + 6 + 15) / 14)
    assert fit_linear([4], [0.5]) == Linear(0.5, 0.0)
    with pytest.raises(ValueError):
        fit_linear([], [])


# ---------------------------------------------------------------- the search
def _model(numels, compute, head=0.0, enc=(0.0, 0.0), dec=(0.0, 0.0), comm=(0.0, 1.0)):
    return CostModel(tuple(numels), tuple(compute), head, Linear(*enc), Linear(*dec), Linear(*comm))


def _comm_end(model: CostModel, part: Partition) -> float:
    """End of the last communication, written out plainly."""
    t, e = model.head, 0.0
    for (a, b), x in zip(part.bounds, part.numels(model.numels)):
        t += sum(model.compute[a:b]) + model.encode(x)
        e = max(t, e) + model.comm(x)
    return e


def _all_partitions(n: int, y: int):
    for cuts in itertools.combinations(range(1, n), y - 1):
        yield Partition.from_bounds([0, *cuts], n)


def test_hand_computed_example():
    """Four tensors of 1 value, 1 s of backward before each, g(x) = 1.5 + x, free
    compression. Whole: 4 + 5.5 = 9.5. Two groups: (1, 3) ends at 8.5, (2, 2) at 9,
    (3, 1) at 10. Three groups: 9.5 at best. Alg. 2 stops at y = 2 with (1, 3)."""
    m = _model([1, 1, 1, 1], [1, 1, 1, 1], comm=(1.5, 1.0))
    assert m.predict(Partition.whole(4)) == pytest.approx(9.5)
    assert [m.predict(Partition(s)) for s in [(1, 3), (2, 2), (3, 1)]] == pytest.approx([8.5, 9.0, 10.0])
    assert best_partition(m, 2).sizes == (1, 3)
    assert m.predict(best_partition(m, 3)) == pytest.approx(9.5)
    y, seen = alg2(lambda q: m.predict(best_partition(m, q)), 4, 0.05)
    assert y == 2 and seen == pytest.approx({1: 9.5, 2: 8.5, 3: 9.5})
    # without a start-up cost layer-wise is best (5), but F_min is 8, 6, 6, 5 for
    # y = 1..4: Alg. 2 is a heuristic and stops on the plateau at y = 3
    free = _model([1, 1, 1, 1], [1, 1, 1, 1], comm=(0.0, 1.0))
    fmin = [free.predict(best_partition(free, q)) for q in (1, 2, 3, 4)]
    assert fmin == pytest.approx([8.0, 6.0, 6.0, 5.0])
    assert alg2(lambda q: fmin[q - 1], 4, 0.01)[0] == 3


@pytest.mark.parametrize("seed", range(6))
def test_best_partition_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    n = 8
    m = _model(
        rng.integers(1, 1000, n), rng.uniform(0, 1e-3, n), head=rng.uniform(0, 1e-3),
        enc=(rng.uniform(0, 5e-4), rng.uniform(0, 1e-6)), dec=(rng.uniform(0, 5e-4), rng.uniform(0, 1e-6)),
        comm=(rng.uniform(0, 2e-3), rng.uniform(0, 3e-6)),
    )
    for y in range(1, n + 1):
        got = best_partition(m, y)
        assert got.groups == y and got.tensors == n
        best = min(_comm_end(m, p) for p in _all_partitions(n, y))
        assert _comm_end(m, got) == pytest.approx(best, rel=1e-12, abs=1e-15)
        if m.decode.base == m.decode.per_value == 0:  # pragma: no cover - random draws are > 0
            assert m.predict(got) == pytest.approx(min(m.predict(p) for p in _all_partitions(n, y)))


def test_without_decoding_the_search_minimises_the_prediction():
    rng = np.random.default_rng(11)
    n = 9
    m = _model(rng.integers(1, 500, n), rng.uniform(0, 1e-3, n), head=1e-3, enc=(2e-4, 1e-7), comm=(1e-3, 2e-6))
    for y in range(1, n + 1):
        assert m.predict(best_partition(m, y)) == pytest.approx(min(m.predict(p) for p in _all_partitions(n, y)))


def test_prediction_is_equation_7():
    """F = A + sum h + sum g - overlap. With every gradient ready at once and free
    encoding nothing overlaps the communications, which run back to back; only the
    decoding of a group hides under the next group's communication (here shorter),
    so F = A + sum g + h_dec(last group)."""
    m = _model([10, 20, 30], [0, 0, 0], head=1.0, enc=(0.0, 0.0), dec=(0.2, 0.02), comm=(0.5, 0.05))
    for sizes in [(3,), (1, 2), (2, 1), (1, 1, 1)]:
        part = Partition(sizes)
        xs = part.numels(m.numels)
        plain = m.head + sum(m.comm(x) for x in xs) + m.decode(xs[-1])
        assert m.predict(part) == pytest.approx(plain)
    # and with nothing to overlap at all (one group), F is the plain sum of eq. (7)
    m2 = _model([10, 20, 30], [0.1, 0.2, 0.3], head=1.0, enc=(0.1, 0.01), dec=(0.2, 0.02), comm=(0.5, 0.05))
    whole = m2.head + sum(m2.compute) + m2.compress(60) + m2.comm(60)
    assert m2.predict(Partition.whole(3)) == pytest.approx(whole)


def test_best_partition_and_alg2_refuse_bad_arguments():
    m = _model([1, 1], [0, 0])
    for bad in (0, 3, 1.5, True):
        with pytest.raises(ValueError, match="groups"):
            best_partition(m, bad)
    with pytest.raises(ValueError, match="alpha"):
        alg2(lambda y: 1.0, 2, 0.0)
    with pytest.raises(ValueError, match="max_groups"):
        alg2(lambda y: 1.0, 0, 0.1)


def test_alg2_stops_where_the_paper_says():
    # worse at y = 2: keep y = 1
    assert alg2(lambda y: {1: 1.0, 2: 1.1}[y], 3, 0.05)[0] == 1
    # better, but by less than alpha: take y = 2 and stop (y = 3 never evaluated)
    calls = []

    def f(y):
        calls.append(y)
        return {1: 1.0, 2: 0.99, 3: 0.5}[y]

    assert alg2(f, 3, 0.05)[0] == 2 and calls == [1, 2]
    # better by more than alpha each time: go on to Y
    assert alg2(lambda y: 1.0 / y, 4, 0.05)[0] == 4
    # Y = 2: X_2 unless it is worse (alpha then has no effect)
    assert alg2(lambda y: {1: 1.0, 2: 0.999}[y], 2, 0.5)[0] == 2
    assert math.isclose(alg2(lambda y: 2.0, 2, 0.5)[1][2], 2.0)
