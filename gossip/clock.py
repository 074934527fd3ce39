"""Modelled time: a link model, the synchronous step's time, and an event clock.

The link (:class:`Link`): a message of ``b`` bytes takes ``overhead * 8 * b /
bandwidth`` seconds plus ``latency`` per sequential message round (``rounds_of``: a
neighbour exchange 1, a ring all-reduce 2(n - 1), an all-gather n - 1, each leg of a
sharded exchange n - 1, a broadcast ceil(log2 n)), as the crossover tool and the
benchmark model it.

A **synchronous** step (every algorithm but the asynchronous ones) ends for everyone
when its slowest participant has computed and the exchange is done:
``max_i compute_i(t) + exchange(t)`` (:func:`sync_time`). Node speeds change the time
only, never the numbers: the same run at any speeds computes the same models.

The **event clock** (:class:`EventClock`) runs an asynchronous pairwise gossip in
modelled time: each node computes at its own speed; when an *active* node has computed,
it averages with one *passive* neighbour, reading that neighbour's model as it is at
that moment, over a link that is busy for ``bytes / bandwidth + latency`` (a node's
link carries one exchange at a time; a second one waits for it). A passive node never
waits: it computes on, and its model is averaged in by the active nodes that come to
it. Events are taken in the order of modelled time (ties by node id), so the same
speeds and seed give the same order, and the same numbers, on every run.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from gossip.speeds import NodeSpeeds

__all__ = ["LINK_OVERHEAD", "DEFAULT_LINK", "Link", "Event", "EventClock", "parse_link", "rounds_of", "sync_time"]

#: bytes on the wire per payload byte: TCP/IPv4 over Ethernet (1448 payload bytes per
#: 1514-byte frame, plus acknowledgements)
LINK_OVERHEAD = 1.05
#: the link ``summary.json``'s ``modelled_time_s`` is modelled on unless ``--link`` says otherwise
DEFAULT_LINK = "1gbit,0ms"


def rounds_of(op: str, n: int) -> int:
    """Sequential message rounds of one call of ``op`` among ``n`` nodes."""
    return {"exchange": 1, "all_reduce": 2 * (n - 1), "all_gather": n - 1,
            # the two legs of a sharded exchange, each counted as an all-gather's rounds
            "shard_push": n - 1, "shard_pull": n - 1,
            "broadcast": max(1, math.ceil(math.log2(max(2, n))))}.get(op, 0)


@dataclass(frozen=True)
class Link:
    """Each node's link: ``bandwidth`` bit/s, one-way ``latency`` s, ``overhead`` wire
    bytes per payload byte."""

    bandwidth: float
    latency: float = 0.0
    overhead: float = LINK_OVERHEAD

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"Link: bandwidth must be a finite number of bit/s > 0, got {self.bandwidth!r}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"Link: latency must be a finite number of seconds >= 0, got {self.latency!r}")
        if not (math.isfinite(self.overhead) and self.overhead >= 1):
            raise ValueError(f"Link: overhead must be a finite number >= 1, got {self.overhead!r}")

    def transfer_s(self, nbytes: float, rounds: float = 1.0) -> float:
        """Seconds to move ``nbytes`` payload bytes in ``rounds`` sequential rounds."""
        return self.overhead * 8.0 * nbytes / self.bandwidth + self.latency * rounds


#: tc's rate units (tc(8), "RATES"): ``bit`` units are bits per second, ``bps`` units BYTES per
#: second; SI prefixes are powers of 1000, IEC ones (ki, mi, gi, ti) of 1024 (the same table
#: as gossip.tools.units, which the training run does not import; a test keeps them equal)
_RATE_UNITS = {
    **{p + "bit": 1000.0 ** i for i, p in enumerate(("", "k", "m", "g", "t"))},
    **{p + "bit": 1024.0 ** i for i, p in enumerate(("ki", "mi", "gi", "ti"), 1)},
    **{p + "bps": 8 * 1000.0 ** i for i, p in enumerate(("", "k", "m", "g", "t"))},
    **{p + "bps": 8 * 1024.0 ** i for i, p in enumerate(("ki", "mi", "gi", "ti"), 1)},
}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)"


def parse_link(text: str) -> Link:
    """``"RATE[,LATENCY]"`` (``"1gbit,5ms"``: tc's rate units, a latency in us, ms or s, a
    bare number of seconds) as a :class:`Link`; ValueError saying what is accepted otherwise."""
    rate, _, lat = str(text).partition(",")
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", rate.strip(), re.I)
    if m is None or m.group(2).lower() not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"rate {rate.strip()!r}: expected a positive rate in tc's units such as 10mbit, 1gbit or "
                         f"100mbps (bytes per second)")
    t = re.fullmatch(_NUMBER + r"\s*(us|ms|s)?", lat.strip() or "0", re.I)
    if t is None:
        raise ValueError(f"latency {lat.strip()!r}: expected a time such as 0, 500us, 5ms or 0.05s")
    return Link(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()],
                float(t.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[(t.group(2) or "s").lower()])


def sync_time(speeds, steps: int, base: float, exchange_s: float) -> float:
    """Modelled seconds of ``steps`` synchronous steps: at each, the slowest node's
    compute (``speeds``: a :class:`gossip.speeds.NodeSpeeds`; ``base`` the time of a
    node at speed 1) plus ``exchange_s`` (the link's time of all steps' messages, in all)."""
    if speeds.trace is not None:
        per = speeds.trace.max(axis=1)
        full, rest = divmod(steps, len(per))
        compute = full * float(per.sum()) + float(per[:rest].sum())
    else:
        compute = steps * base * float(speeds.multipliers.max())
    return compute + exchange_s


@dataclass(frozen=True)
class Event:
    """One node's step on the event clock: ``node`` has computed its ``step``-th local
    gradient (0-based) and, if ``partner`` is not None, averages with it at ``time``
    (the moment the partner's model is read); the step ends at ``end``."""

    node: int
    step: int
    partner: int | None
    time: float
    end: float


class EventClock:
    """Asynchronous pairwise gossip in modelled time (see the module's docstring).

    Args:
        speeds: a :class:`gossip.speeds.NodeSpeeds` of the ``n`` nodes.
        base: compute seconds of a node at speed 1 (ignored by a trace).
        exchange_s: seconds one pairwise exchange keeps both links busy.
        active: (n,) which nodes start exchanges.
        choose: ``choose(i, k)``, the passive partner of active node ``i`` at its
            ``k``-th step (0-based): the algorithm's own draw, a pure function, so that
            the clock and the algorithm agree.
    """

    def __init__(self, speeds: NodeSpeeds, base: float, exchange_s: float, active: Sequence[bool],
                 choose: Callable[[int, int], int]) -> None:
        n = speeds.n
        if len(active) != n:
            raise ValueError(f"EventClock: active must have one entry per node ({n}), got {len(active)}")
        self.speeds, self.base, self.exchange_s = speeds, float(base), float(exchange_s)
        self.n = n
        self.active = [bool(a) for a in active]
        self.choose = choose
        self.steps = [0] * n           # local gradients each node has finished
        self.link_free = [0.0] * n     # when each node's link is free again
        self.end = [0.0] * n           # when each node's latest step ended
        self._chosen: dict[int, int] = {}  # an active node's partner, drawn once per step
        self._heap: list[tuple[float, int]] = []
        for i in range(n):
            heapq.heappush(self._heap, (self._compute(i, 0.0), i))

    def _compute(self, i: int, start: float) -> float:
        return start + float(self.speeds.times(self.steps[i], self.base)[i])

    @property
    def now(self) -> float:
        """The end of the latest step of any node: the modelled time so far."""
        return max(self.end)

    def next(self) -> Event:
        """The next step to take, in modelled time, and the node's next compute scheduled."""
        while True:
            t, i = heapq.heappop(self._heap)
            if not self.active[i]:
                ev = Event(i, self.steps[i], None, t, t)
                break
            j = self._chosen.get(i)
            if j is None:
                j = self._chosen[i] = int(self.choose(i, self.steps[i]))
            start = max(t, self.link_free[i], self.link_free[j])
            if start > t:  # a link is busy: wait for it, letting what happens meanwhile happen first
                heapq.heappush(self._heap, (start, i))
                continue
            end = start + self.exchange_s
            self.link_free[i] = self.link_free[j] = end
            del self._chosen[i]
            ev = Event(i, self.steps[i], j, start, end)
            break
        self.steps[i] += 1
        self.end[i] = ev.end
        heapq.heappush(self._heap, (self._compute(i, ev.end), i))
        return ev

    def state_dict(self) -> dict:
        """The clock's whole state as plain values (to save it beside a checkpoint)."""
        return {"steps": list(self.steps), "link_free": list(self.link_free), "end": list(self.end),
                "chosen": dict(self._chosen), "heap": list(self._heap)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` saved (the same speeds and partners)."""
        self.steps, self.link_free, self.end = list(sd["steps"]), list(sd["link_free"]), list(sd["end"])
        self._chosen = {int(k): int(v) for k, v in sd["chosen"].items()}
        self._heap = [(float(t), int(i)) for t, i in sd["heap"]]
        heapq.heapify(self._heap)
