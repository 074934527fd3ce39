"""The ledger: bytes on the wire per peer, wall time per phase, counters.

One ledger belongs to one communicator and records the traffic of the nodes that
communicator hosts (one rank under torchrun, all ``n`` nodes in the simulation).
A message is recorded once, as ``src -> dst, nbytes``; it counts as *sent* for a
hosted ``src`` and as *received* for a hosted ``dst``. The rules the communicators
follow for what a message is (payload bytes per neighbour, ring estimates for
collectives) are in docs/comm.md.

Time is split into phases (``compute``, ``compress``, ``communicate``, ``wait``). Phases
nest; time is charged to the innermost open phase only, so the phases never double
count and their sum is the wall time spent inside any phase. ``communicate`` is the
time spent posting messages and in transfers the caller drives itself; ``wait`` is the
time blocked until the peers' messages have arrived (a late peer, or a transfer still
under way): a communicator's handles charge their ``wait()`` to it.

Two one-off costs are kept apart from the per-step figures:

- ``with ledger.setup(): ...`` marks **setup traffic**, e.g. the exchange of x_1 when
  an algorithm initialises its replicas. Its messages count in the totals and also
  in ``setup_bytes_sent``/``setup_bytes_received``; per-step figures subtract them
  (``step_bytes_sent``).
- ``with ledger.warmup(): ...`` charges the time of every phase opened inside it to
  ``warmup`` instead: compilation and first-call costs (the training loop wraps each
  process's first step and the algorithm's setup in it).

A cost that a run pays once, whatever processes it takes (the size check of a payload
size), is charged under a key: ``if ledger.once(key): ledger.record(...)``. The keys
charged are part of the state, so a run resumed from a checkpoint in a new process,
which checks the size again, does not charge it twice: its byte counts equal an
uninterrupted run's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from time import perf_counter
from typing import Any

import numpy as np

__all__ = ["Ledger", "PHASES", "OPS", "WARMUP"]

PHASES: tuple[str, ...] = ("compute", "compress", "communicate", "wait")
"""The default phases wall time is split into."""

OPS: tuple[str, ...] = (
    "exchange", "all_reduce", "all_gather", "broadcast", "control", "shard_push", "shard_pull",
)
"""Operations traffic is recorded under; ``control`` is protocol traffic (size checks);
``shard_push`` and ``shard_pull`` are the two legs of a sharded exchange (each node's
compressed slices to their owners, the owners' re-compressed shards to everyone)."""

_FORMAT = "gossip.comm.Ledger/1"
WARMUP = "warmup"
"""Where time spent inside :meth:`Ledger.warmup` goes, whatever phase was open."""
# pending per-pair records are folded into the sorted table past this many entries
_CONSOLIDATE_AT = 1 << 20


class _Phase:
    """Context manager charging wall time to one phase of a ledger (re-entrant)."""

    __slots__ = ("_ledger", "_name")

    def __init__(self, ledger: Ledger, name: str) -> None:
        self._ledger = ledger
        self._name = name

    def __enter__(self) -> _Phase:
        led = self._ledger
        now = perf_counter()
        if led._stack:
            led._times[led._charged(led._stack[-1])] += now - led._mark
        led._stack.append(self._name)
        led._mark = now
        return self

    def __exit__(self, *exc: object) -> bool:
        led = self._ledger
        now = perf_counter()
        led._times[led._charged(led._stack.pop())] += now - led._mark
        led._mark = now
        return False


class _Counter:
    """Context manager that raises one of a ledger's nesting counters while open."""

    __slots__ = ("_ledger", "_attr")

    def __init__(self, ledger: Ledger, attr: str) -> None:
        self._ledger = ledger
        self._attr = attr

    def __enter__(self) -> _Counter:
        led = self._ledger
        if self._attr == "_warm" and led._stack:  # time so far belongs to the open phase
            now = perf_counter()
            led._times[led._charged(led._stack[-1])] += now - led._mark
            led._mark = now
        setattr(led, self._attr, getattr(led, self._attr) + 1)
        return self

    def __exit__(self, *exc: object) -> bool:
        led = self._ledger
        if self._attr == "_warm" and led._stack:
            now = perf_counter()
            led._times[led._charged(led._stack[-1])] += now - led._mark
            led._mark = now
        setattr(led, self._attr, getattr(led, self._attr) - 1)
        return False


class Ledger:
    """Bytes sent and received per peer and in total, time per phase, counters.

    Args:
        nodes: global ids of the hosted nodes (``(rank,)`` under torchrun,
            ``range(n)`` in the simulation).
        world_size: number of nodes in the run; defaults to ``max(nodes) + 1``.
        phases: names of the time phases (default ``PHASES``).

    All counters are exact integers (bytes) or floats (seconds); ``as_dict`` and
    ``state_dict`` return plain, JSON-serialisable Python values.
    """

    def __init__(
        self,
        nodes: Iterable[int] = (0,),
        world_size: int | None = None,
        *,
        phases: Iterable[str] = PHASES,
    ) -> None:
        ids = np.asarray(list(nodes), dtype=np.int64).ravel()
        if ids.size == 0:
            raise ValueError("Ledger: `nodes` must name at least one hosted node, got none")
        if (ids < 0).any() or len(np.unique(ids)) != ids.size:
            raise ValueError(
                f"Ledger: `nodes` must be distinct non-negative ids, got {ids.tolist()}"
            )
        n = int(ids.max()) + 1 if world_size is None else int(world_size)
        if n <= int(ids.max()):
            raise ValueError(
                f"Ledger: `world_size` must exceed every hosted node id, got world_size={n} "
                f"for nodes up to {int(ids.max())}"
            )
        names = tuple(phases)
        if not names or len(set(names)) != len(names) or WARMUP in names:
            raise ValueError(f"Ledger: `phases` must be distinct names other than {WARMUP!r}, got {names}")
        self._nodes = np.sort(ids)
        self._n = n
        self._pos = np.full(n, -1, dtype=np.int64)
        self._pos[self._nodes] = np.arange(self._nodes.size)
        self._phase_names = names
        self._phases = {p: _Phase(self, p) for p in names}
        self._stack: list[str] = []
        self._mark = perf_counter()
        self._warm = 0  # open warmup() blocks
        self._in_setup = 0  # open setup() blocks
        self.reset()

    # ---------------------------------------------------------------- bookkeeping
    def reset(self) -> None:
        """Zero every counter. Open phases keep running, from now."""
        m = self._nodes.size
        self._node_sent = np.zeros(m, dtype=np.int64)
        self._node_received = np.zeros(m, dtype=np.int64)
        self._ops: dict[str, list[int]] = {op: [0, 0, 0] for op in OPS}  # calls, sent, recv
        #: messages sent by the hosted nodes per op; None once restored from a state that
        #: predates message counting (the count is then unknown)
        self._msgs: dict[str, int] | None = {op: 0 for op in OPS}
        self._pair_keys = np.zeros(0, dtype=np.int64)
        self._pair_bytes = np.zeros(0, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_len = 0
        self._times = {p: 0.0 for p in (*self._phase_names, WARMUP)}
        self._steps = 0
        self._mark = perf_counter()
        #: setup traffic of the hosted nodes (per node: sent, received) and messages sent;
        #: unknown (False) once restored from a state that predates it: it is then
        #: folded into the totals
        self._setup_known = True
        self._setup_sent = np.zeros(m, dtype=np.int64)
        self._setup_received = np.zeros(m, dtype=np.int64)
        self._setup_msgs = 0
        self._setup_control = [0, 0]  # of which control traffic: bytes sent, messages
        self._once: set[str] = set()  # the keys of the one-off costs charged (see once())

    @property
    def nodes(self) -> tuple[int, ...]:
        """Global ids of the hosted nodes, ascending."""
        return tuple(int(i) for i in self._nodes)

    @property
    def world_size(self) -> int:
        return self._n

    @property
    def phases(self) -> tuple[str, ...]:
        return self._phase_names

    # ---------------------------------------------------------------- traffic
    def record(self, src: Any, dst: Any, nbytes: Any, *, op: str = "exchange") -> None:
        """Record messages ``src[k] -> dst[k]`` of ``nbytes[k]`` bytes (vectorised).

        Scalars broadcast. A message counts as sent if ``src`` is hosted and as
        received if ``dst`` is hosted; messages between two foreign nodes are ignored.
        """
        self._check_op(op)
        s, d, b = np.broadcast_arrays(
            np.asarray(src, dtype=np.int64).ravel(),
            np.asarray(dst, dtype=np.int64).ravel(),
            np.asarray(nbytes, dtype=np.int64).ravel(),
        )
        if s.size == 0:
            return
        if (b < 0).any():
            raise ValueError(f"Ledger.record: `nbytes` must be >= 0, got {int(b.min())}")
        lo, hi = min(int(s.min()), int(d.min())), max(int(s.max()), int(d.max()))
        if lo < 0 or hi >= self._n:
            raise ValueError(
                f"Ledger.record: node ids must lie in [0, {self._n}), got {lo if lo < 0 else hi}"
            )
        ps, pd = self._pos[s], self._pos[d]
        out, inc = ps >= 0, pd >= 0
        m = self._nodes.size
        entry = self._ops[op]
        if out.any():
            bo = b[out]
            if self._msgs is not None:
                self._msgs[op] += int(out.sum())
            self._node_sent += np.bincount(ps[out], weights=bo, minlength=m).astype(np.int64)
            entry[1] += int(bo.sum())
        if inc.any():
            bi = b[inc]
            self._node_received += np.bincount(pd[inc], weights=bi, minlength=m).astype(np.int64)
            entry[2] += int(bi.sum())
        if self._in_setup:
            if out.any():
                self._setup_sent += np.bincount(ps[out], weights=b[out], minlength=m).astype(np.int64)
                self._setup_msgs += int(out.sum())
                if op == "control":
                    self._setup_control[0] += int(b[out].sum())
                    self._setup_control[1] += int(out.sum())
            if inc.any():
                self._setup_received += np.bincount(pd[inc], weights=b[inc], minlength=m).astype(np.int64)
        keep = out | inc
        keys = (s * self._n + d)[keep]
        self._pending.append((keys, np.array(b[keep], dtype=np.int64)))
        self._pending_len += keys.size
        if self._pending_len >= _CONSOLIDATE_AT:
            self._consolidate()

    def once(self, key: str) -> bool:
        """Whether the one-off cost named ``key`` is still to be charged: True the first
        time over the run's life, then False. The keys are part of :meth:`state_dict`, so a
        resumed run does not charge again what its checkpoint's ledger already holds (a
        new process re-does the payload size check; the run paid for it once)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"Ledger.once: `key` must be a non-empty str, got {key!r}")
        if key in self._once:
            return False
        self._once.add(key)
        return True

    def count(self, op: str, calls: int = 1) -> None:
        """Count ``calls`` invocations of ``op`` (one exchange is one call, many messages)."""
        self._check_op(op)
        self._ops[op][0] += int(calls)

    def _consolidate(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([self._pair_keys] + [k for k, _ in self._pending])
        vals = np.concatenate([self._pair_bytes] + [v for _, v in self._pending])
        uniq, inv = np.unique(keys, return_inverse=True)
        sums = np.zeros(uniq.size, dtype=np.int64)
        np.add.at(sums, inv.ravel(), vals)
        self._pair_keys, self._pair_bytes = uniq, sums
        self._pending, self._pending_len = [], 0

    @property
    def bytes_sent(self) -> int:
        """Bytes sent by the hosted nodes, all operations."""
        return int(self._node_sent.sum())

    @property
    def bytes_received(self) -> int:
        """Bytes received by the hosted nodes, all operations."""
        return int(self._node_received.sum())

    def setup(self) -> _Counter:
        """``with ledger.setup(): ...``: the block's messages are setup traffic (one-off,
        before the first step), and its time goes to ``warmup``."""
        return _SetupBlock(self)

    @property
    def setup_known(self) -> bool:
        """False once restored from a state written before setup traffic was kept apart."""
        return self._setup_known

    @property
    def setup_bytes_sent(self) -> int:
        """Setup traffic sent by the hosted nodes (0 where it is unknown: see setup_known)."""
        return int(self._setup_sent.sum())

    @property
    def setup_bytes_received(self) -> int:
        return int(self._setup_received.sum())

    @property
    def step_bytes_sent(self) -> int:
        """Bytes sent by the hosted nodes in steps: the total less setup traffic."""
        return self.bytes_sent - self.setup_bytes_sent

    def sent_by(self, node: int) -> int:
        """Bytes sent by hosted node ``node``."""
        return int(self._node_sent[self._hosted(node)])

    def received_by(self, node: int) -> int:
        """Bytes received by hosted node ``node``."""
        return int(self._node_received[self._hosted(node)])

    def step_bytes_sent_by(self, node: int) -> int:
        """Bytes sent by hosted node ``node`` in steps: its total less its setup traffic."""
        pos = self._hosted(node)
        return int(self._node_sent[pos] - self._setup_sent[pos])

    def step_bytes_received_by(self, node: int) -> int:
        """Bytes received by hosted node ``node`` in steps: its total less its setup traffic."""
        pos = self._hosted(node)
        return int(self._node_received[pos] - self._setup_received[pos])

    def setup_bytes_sent_by(self, node: int) -> int:
        """Setup traffic sent by hosted node ``node``."""
        return int(self._setup_sent[self._hosted(node)])

    def setup_bytes_received_by(self, node: int) -> int:
        """Setup traffic received by hosted node ``node``."""
        return int(self._setup_received[self._hosted(node)])

    @property
    def num_nodes(self) -> int:
        """How many nodes this ledger hosts (``len(nodes)`` without building the tuple)."""
        return int(self._nodes.size)

    def node_bytes(self, nodes: Iterable[int] | None = None) -> dict[str, np.ndarray]:
        """Per-node byte counters of ``nodes`` (hosted ids; all hosted nodes, ascending,
        when None), in one pass: ``{"step_sent", "step_received", "setup_sent",
        "setup_received"}``, each an int64 array in the order of ``nodes``. Row k holds
        what ``step_bytes_sent_by(nodes[k])`` and its siblings return, for all nodes at
        the cost of one call rather than one call per node."""
        if nodes is None:
            pos = np.arange(self._nodes.size)
        else:
            ids = np.asarray(list(nodes), dtype=np.int64).ravel()
            bad = ids[(ids < 0) | (ids >= self._n)]
            if bad.size == 0:
                bad = ids[self._pos[ids] < 0]
            if bad.size:
                self._hosted(int(bad[0]))  # raises: names the id and the hosted nodes
            pos = self._pos[ids]
        sent, recv = self._node_sent[pos], self._node_received[pos]
        setup_sent, setup_recv = self._setup_sent[pos], self._setup_received[pos]
        return {"step_sent": sent - setup_sent, "step_received": recv - setup_recv,
                "setup_sent": setup_sent, "setup_received": setup_recv}

    def traffic(self) -> dict[tuple[int, int], int]:
        """``{(src, dst): bytes}`` over every recorded message touching a hosted node."""
        self._consolidate()
        src, dst = np.divmod(self._pair_keys, self._n)
        return {
            (int(a), int(b)): int(v)
            for a, b, v in zip(src.tolist(), dst.tolist(), self._pair_bytes.tolist())
        }

    def sent_to(self, peer: int, node: int | None = None) -> int:
        """Bytes sent to ``peer`` by hosted ``node`` (by all hosted nodes if None)."""
        return self._pair_total(self._from_nodes(node), int(peer), sent=True)

    def received_from(self, peer: int, node: int | None = None) -> int:
        """Bytes received from ``peer`` by hosted ``node`` (by all hosted nodes if None)."""
        return self._pair_total(self._from_nodes(node), int(peer), sent=False)

    def _from_nodes(self, node: int | None) -> np.ndarray:
        if node is None:
            return self._nodes
        self._hosted(node)
        return np.asarray([int(node)], dtype=np.int64)

    def _pair_total(self, nodes: np.ndarray, peer: int, *, sent: bool) -> int:
        if not 0 <= peer < self._n:
            raise ValueError(f"Ledger: `peer` must lie in [0, {self._n}), got {peer}")
        self._consolidate()
        keys = nodes * self._n + peer if sent else peer * self._n + nodes
        hit = np.isin(self._pair_keys, keys)
        return int(self._pair_bytes[hit].sum())

    def _hosted(self, node: int) -> int:
        node = int(node)
        if not 0 <= node < self._n or self._pos[node] < 0:
            raise ValueError(
                f"Ledger: node {node} is not hosted here; hosted nodes are {self.nodes[:8]}"
                + ("..." if len(self._nodes) > 8 else "")
            )
        return int(self._pos[node])

    def _check_op(self, op: str) -> None:
        if op not in self._ops:
            raise ValueError(f"Ledger: unknown op {op!r}; known ops are {list(OPS)}")

    # ---------------------------------------------------------------- time
    def phase(self, name: str) -> _Phase:
        """``with ledger.phase("compress"): ...`` charges the block's wall time to ``name``.

        Nested phases charge only the innermost one, so no time is counted twice.
        """
        try:
            return self._phases[name]
        except KeyError:
            raise ValueError(
                f"Ledger: unknown phase {name!r}; known phases are {list(self._phase_names)}"
            ) from None

    def warmup(self) -> _Counter:
        """``with ledger.warmup(): ...`` charges every phase's time inside to ``warmup``."""
        return _Counter(self, "_warm")

    def _charged(self, name: str) -> str:
        return WARMUP if self._warm else name

    def add_time(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` (measured elsewhere, e.g. with CUDA events) to phase ``name``."""
        self.phase(name)  # validates the name
        s = float(seconds)
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"Ledger.add_time: `seconds` must be finite and >= 0, got {seconds}")
        self._times[self._charged(name)] += s

    @property
    def times(self) -> dict[str, float]:
        """Seconds per phase, including the running part of an open phase."""
        t = dict(self._times)
        if self._stack:
            t[self._charged(self._stack[-1])] += perf_counter() - self._mark
        return t

    # ---------------------------------------------------------------- counters
    def step(self, steps: int = 1) -> None:
        """Count training steps (the algorithm or the training loop calls this)."""
        self._steps += int(steps)

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def messages_sent(self) -> int | None:
        """Messages sent by the hosted nodes (None if restored from an older state)."""
        return None if self._msgs is None else sum(self._msgs.values())

    @property
    def calls(self) -> dict[str, int]:
        """Number of calls per operation."""
        return {op: v[0] for op, v in self._ops.items()}

    # ---------------------------------------------------------------- export
    def as_dict(self, detail: bool = False) -> dict[str, Any]:
        """JSON-serialisable summary; ``detail=True`` adds per-node and per-peer tables."""
        out: dict[str, Any] = {
            "steps": self._steps,
            "bytes": {"sent": self.bytes_sent, "received": self.bytes_received},
            "ops": {
                op: {"calls": c, "sent": s, "received": r} for op, (c, s, r) in self._ops.items()
            },
            "time": self.times,
            "messages": None if self._msgs is None else {"sent": sum(self._msgs.values()), **self._msgs},
            "setup": {"sent": self.setup_bytes_sent, "received": self.setup_bytes_received,
                      "messages": self._setup_msgs, "known": self._setup_known,
                      "control": {"sent": self._setup_control[0], "messages": self._setup_control[1]}},
        }
        if detail:
            self._consolidate()
            src, dst = np.divmod(self._pair_keys, self._n)
            out["per_node"] = {
                "node": self._nodes.tolist(),
                "sent": self._node_sent.tolist(),
                "received": self._node_received.tolist(),
            }
            out["setup"]["per_node"] = {
                "sent": self._setup_sent.tolist(), "received": self._setup_received.tolist(),
            }
            out["per_peer"] = {
                "src": src.tolist(),
                "dst": dst.tolist(),
                "bytes": self._pair_bytes.tolist(),
            }
        return out

    def snapshot(self) -> dict[str, Any]:
        """The summary now (``as_dict()``), to subtract later with :meth:`since`."""
        return self.as_dict()

    def since(self, snapshot: Mapping[str, Any]) -> dict[str, Any]:
        """The summary minus an earlier :meth:`snapshot`: what happened in between."""
        return _subtract(self.as_dict(), snapshot)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore this ledger exactly, as plain Python values."""
        self._consolidate()
        return {
            "format": _FORMAT,
            "nodes": self._nodes.tolist(),
            "world_size": self._n,
            "phases": list(self._phase_names),
            "steps": self._steps,
            "times": self.times,
            "ops": {op: list(v) for op, v in self._ops.items()},
            "messages": None if self._msgs is None else dict(self._msgs),
            "setup": None if not self._setup_known else {
                "sent": self._setup_sent.tolist(), "received": self._setup_received.tolist(),
                "messages": self._setup_msgs, "control": list(self._setup_control),
            },
            "node_sent": self._node_sent.tolist(),
            "node_received": self._node_received.tolist(),
            "pair_keys": self._pair_keys.tolist(),
            "pair_bytes": self._pair_bytes.tolist(),
            "once": sorted(self._once),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the hosted nodes and world size must match."""
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Ledger.load_state_dict: expected format {_FORMAT!r}, got {got!r}")
        if list(state["nodes"]) != self._nodes.tolist() or int(state["world_size"]) != self._n:
            raise ValueError(
                "Ledger.load_state_dict: state is for nodes "
                f"{list(state['nodes'])[:8]} of {state['world_size']}, this ledger hosts "
                f"{self.nodes[:8]} of {self._n}"
            )
        # states written before ``wait`` was a phase of its own: it starts at 0
        older = [p for p in self._phase_names if p != "wait"]
        if list(state["phases"]) != list(self._phase_names) and list(state["phases"]) != older:
            raise ValueError(
                f"Ledger.load_state_dict: state has phases {list(state['phases'])}, "
                f"this ledger {list(self._phase_names)}"
            )
        self.reset()
        self._steps = int(state["steps"])
        self._times = {p: float(state["times"].get(p, 0.0)) for p in self._phase_names}
        self._times[WARMUP] = float(state["times"].get(WARMUP, 0.0))  # older states: none kept apart
        setup = state.get("setup")  # absent in states written before setup traffic was kept apart
        self._setup_known = setup is not None
        if setup is not None:
            self._setup_sent = np.asarray(setup["sent"], dtype=np.int64)
            self._setup_received = np.asarray(setup["received"], dtype=np.int64)
            self._setup_msgs = int(setup["messages"])
            self._setup_control = [int(x) for x in setup["control"]]
        for op, v in state["ops"].items():
            self._check_op(op)
            self._ops[op] = [int(x) for x in v]
        msgs = state.get("messages")  # absent in states written before messages were counted
        self._msgs = None if msgs is None else {op: int(msgs.get(op, 0)) for op in OPS}
        self._node_sent = np.asarray(state["node_sent"], dtype=np.int64)
        self._node_received = np.asarray(state["node_received"], dtype=np.int64)
        self._pair_keys = np.asarray(state["pair_keys"], dtype=np.int64)
        self._pair_bytes = np.asarray(state["pair_bytes"], dtype=np.int64)
        # absent in states written before one-off costs were keyed: a resume from one of
        # those charges its size checks again
        self._once = {str(k) for k in state.get("once", ())}

    def __repr__(self) -> str:
        return (
            f"Ledger(nodes={len(self._nodes)}/{self._n}, sent={self.bytes_sent}, "
            f"received={self.bytes_received}, steps={self._steps})"
        )


class _SetupBlock(_Counter):
    """Open while an algorithm initialises: traffic is setup traffic, time is warm-up."""

    __slots__ = ("_warm",)

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger, "_in_setup")
        self._warm = _Counter(ledger, "_warm")

    def __enter__(self) -> _SetupBlock:
        super().__enter__()
        self._warm.__enter__()
        return self

    def __exit__(self, *exc: object) -> bool:
        self._warm.__exit__(*exc)
        return super().__exit__(*exc)


def _subtract(now: Any, before: Any) -> Any:
    if isinstance(now, dict):
        return {k: _subtract(v, before.get(k, 0) if isinstance(before, Mapping) else 0)
                for k, v in now.items()}
    if isinstance(now, (int, float)) and isinstance(before, (int, float)):
        return now - before
    return now
