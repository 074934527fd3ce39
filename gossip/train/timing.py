"""The run's time in the model of its nodes and link: an asynchronous algorithm's steps
on the event clock (:class:`AsyncClock`), and the modelled seconds of a run
(:func:`modelled_time`), summary.json's ``modelled_time_s``.

Both read the nodes' speeds (``--node-speed``, :mod:`gossip.speeds`), ``--compute-time``
and the link (``--link``) the :class:`gossip.train.loop.Run` was built with; the order of
the events is :class:`gossip.clock.EventClock`'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gossip import clock
from gossip.errors import Diverged

__all__ = ["AsyncClock", "event_clock", "exchange_s", "modelled_time", "own_time"]

#: a :class:`gossip.train.loop.Run`: what the clock steps and times
RunLike = Any


def exchange_s(run: RunLike) -> float:
    """Modelled seconds of one pairwise exchange on the link: the model's payload."""
    c = run.algo.payload_compressor
    return run.link.transfer_s(c.payload_nbytes(run.dim))


def event_clock(run: RunLike, base: float, exchange: float) -> clock.EventClock:
    """The event clock of ``run``'s nodes: ``base`` seconds of compute at speed 1, ``exchange``
    seconds per pairwise exchange, partners drawn by the algorithm."""
    return clock.EventClock(run.speeds, base, exchange, run.algo.active, run.algo.choose)


class AsyncClock:
    """The steps of an asynchronous algorithm on the event clock, and its updates in
    flight. Made when the run begins: every node starts computing its first gradient at
    x_1, on a clock ordered by --compute-time and the link (unset: by the nodes' speeds
    alone). ``events``: the clock; ``taken``: the node steps taken so far."""

    def __init__(self, run: RunLike, saved: dict | None = None) -> None:
        self.run = run
        ct = run.cfg.comm.compute_time
        self.events = event_clock(run, 1.0 if ct is None else ct, 0.0 if ct is None else exchange_s(run))
        if saved is not None:  # a resume: the clock and the updates in flight as they were saved
            self.load_state_dict(saved)
            return
        self.taken = 0
        self.pending = [self.node_update(i) for i in range(len(run.nodes))]
        self.last_loss = [v for _, v in self.pending]

    def state_dict(self) -> dict:
        """The clock, the node steps taken, each node's update in flight and its loss:
        what a checkpoint saves so that a resume continues the run exactly."""
        return {"events": self.events.state_dict(), "taken": self.taken,
                "pending": torch.stack([u for u, _ in self.pending]), "pending_loss": [v for _, v in self.pending],
                "last_loss": list(self.last_loss)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        n = len(self.run.nodes)
        U = sd["pending"]
        if not isinstance(U, torch.Tensor) or U.shape[0] != n or len(sd["pending_loss"]) != n:
            raise ValueError(f"the saved event clock holds updates of {getattr(U, 'shape', ['?'])[0]} nodes, "
                             f"this run has {n}")
        self.events.load_state_dict(sd["events"])
        self.taken = int(sd["taken"])
        X = self.run.gopt.flat.data
        self.pending = [(U[i].to(X.device, X.dtype), float(v)) for i, v in enumerate(sd["pending_loss"])]
        self.last_loss = [float(v) for v in sd["last_loss"]]

    def node_update(self, i: int) -> tuple[torch.Tensor, float]:
        """Node ``i`` reads its model, computes a gradient on its next batch and its local
        optimizer's step from there: the update (applied when its step ends) and the loss."""
        run = self.run
        X, m_, opt = run.gopt.flat.data, run.models[i], run.opts[i]
        with run.ledger.phase("compute"):
            opt.zero_grad(set_to_none=True)
            xb, yb = run.loaders[i].next_batch()
            loss = run.loss(m_(xb), yb)
            loss.backward()
            with torch.no_grad():
                x_t = X[i].clone()
                opt.step()
                u = X[i] - x_t
                X[i].copy_(x_t)
        return u, float(loss.detach())

    def step(self) -> list[float]:
        """One step of the run on the event clock: as many node steps as there are nodes
        (the same number of gradients as a synchronous step), in modelled time. Each
        averages with its partner (active nodes), applies the update computed at the
        model it read when it started, and starts its next gradient. A node's loss is
        the mean of the gradients it applied in this step (its last one if none)."""
        run = self.run
        X = run.gopt.flat.data
        got: list[list[float]] = [[] for _ in run.nodes]
        for _ in range(len(run.nodes)):
            ev = self.events.next()
            i = ev.node
            if ev.partner is not None:
                run.algo.average_pair(X, i, ev.partner)
            u, loss = self.pending[i]
            with torch.no_grad():
                X[i] += u
            got[i].append(loss)
            self.taken += 1
            self.pending[i] = self.node_update(i)
        losses = []
        for i, g in enumerate(got):
            if g:
                self.last_loss[i] = sum(g) / len(g)
            losses.append(self.last_loss[i])
        bad = [i for i, v in zip(run.nodes, losses) if not math.isfinite(v)]
        if bad:
            raise Diverged(f"training diverged at step {run.progress.step + 1}: non-finite loss on node(s) {bad}")
        return losses


def own_time(speeds: Any, r: int, steps: int, base: float) -> float:
    """Modelled compute seconds of node ``r``'s first ``steps`` steps at its speed."""
    if speeds.trace is not None:
        per = speeds.trace[:, r]
        full, rest = divmod(steps, len(per))
        return full * float(per.sum()) + float(per[:rest].sum())
    return steps * base * float(speeds.multipliers[r])


def modelled_time(run: RunLike) -> float | None:
    """Modelled seconds of the run on ``--link`` at the nodes' speeds: each synchronous
    step the slowest node's compute plus the step's messages and codec time; an
    asynchronous run's steps on the event clock (under torchrun, where each rank takes
    the run's steps on its own: the rank that ends last, active ranks paying a round
    trip of the model per step). A node's compute at speed 1 is
    ``--compute-time``, else this process's measured mean (warm-up left out)."""
    steps = run.progress.step
    if steps == 0:
        return None
    led, m = run.ledger, len(run.nodes)
    times = led.times
    ct = run.cfg.comm.compute_time
    if ct is None:
        done = max(1, steps - run.first_step - 1)  # the first step's compute is warm-up
        per_node = times.get("compute", 0.0) / (m * done)
        # under torchrun the rank's measurement holds its own slowness: back to speed 1
        own = 1.0 if run.speeds.trace is not None or not run.env.distributed else \
            float(run.speeds.multipliers[run.env.rank])
        ct = per_node / own
    codec = times.get("compress", 0.0) / m
    if run.clock is not None:
        if run.cfg.comm.compute_time is not None:
            return run.clock.events.now + codec
        replay = event_clock(run, ct, exchange_s(run))  # the same events, timed with the measurement
        for _ in range(run.clock.taken):
            replay.next()
        return replay.now + codec
    n = run.env.world_size
    if run.algo.asynchronous:  # under torchrun: every rank its own steps, no barrier; the last one ends the run
        return max(own_time(run.speeds, r, steps, ct) + (steps * 2 * exchange_s(run) if run.algo.active[r] else 0.0)
                   for r in range(n)) + codec
    ops = led.as_dict()["ops"]
    rounds = sum(v["calls"] * clock.rounds_of(op, n) for op, v in ops.items() if op != "control")
    link_s = run.link.transfer_s(led.step_bytes_sent / m, rounds)
    return clock.sync_time(run.speeds, steps, ct, link_s) + codec
