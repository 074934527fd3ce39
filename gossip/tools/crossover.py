"""Will compression pay on my link? Measure here, model the link, find the crossover.

    python -m gossip.tools.crossover --model resnet20 --world-size 8 --topology ring
    python -m gossip.tools.crossover --params 11000000 --algos ecd@quant:bits=4,efsgd@topk:p=0.01 \\
        --bandwidth 10mbit,100mbit,1gbit,10gbit --latency 0,5ms,50ms --plot crossover.png

For each candidate (``ALGO`` or ``ALGO@COMPRESSOR``; default every registered
algorithm with its default compressor) it runs a few real steps of the algorithm on
this machine, all ``--world-size`` nodes simulated in this process through the same
``GossipOptimizer`` a training run uses, and reads from the ledger, per node and per
step:

- ``bytes``: what the node sends (setup traffic and size checks left out);
- ``codec``: the time spent compressing and decompressing (the ledger's ``compress``);
- ``compute``: forward and backward of the model on one batch (the same for every
  candidate: the median of their measurements is used for all);
- ``rounds``: the communication calls per step, by kind.

The link model: a node's step takes ``compute + codec + overhead * bytes * 8 /
bandwidth + latency * R``, where ``overhead`` (``--link-overhead``, default 1.05) is
the framing the transport adds to the payload (TCP/IPv4 over Ethernet: 1448 payload
bytes per 1514-byte frame, plus acknowledgements), and with R the sequential message rounds of the step's calls (a neighbour
exchange 1, a ring all-reduce 2(n-1), an all-gather n-1, each leg of a sharded
exchange n-1, a broadcast ceil(log2 n)). The bytes are the algorithms' own: the
two-way compressed ones (efsgd family, signsgd, signum, diloco with a non-linear
compressor) use the sharded exchange by default, about 2(n-1)/n x payload per node
whatever n; ``ALGO@COMPRESSOR`` candidates cannot ask for ``exchange=allgather``, so
the all-gathered figures are those of ``gossip.train --algo-opt exchange=allgather``.
Compute, compression and communication are not overlapped, and the bandwidth is that
of each node's link (a switch, not a shared bus). The **crossover bandwidth** against
a baseline (fp32 all-reduce, fp32 D-PSGD) is where the two step times are equal:
below it the candidate is faster when it sends fewer bytes.

Every simulated node is a model in this process, so the measurement takes time and
memory in proportion to the nodes (a sharded exchange's in their square): at most
``--measure-nodes`` nodes (default 16) are simulated. A larger ``--world-size`` is
modelled from that measurement: each call's bytes per node are scaled to ``n`` by its
accounting (a ring all-reduce or a broadcast 2(n-1)/n, an all-gather n-1 payloads, a
neighbour exchange the graph's mean degree at ``n``), and so are the rounds; the codec
time is scaled by each node's fan-in where it grows (an all-gather's n-1 payloads, a
graph whose degree grows), an upper bound since the encoding does not. A candidate
whose bytes at ``n`` depend on more than that (the sharded exchange: its shards and
their headers) is left out, with the reason. Up to :data:`MAX_WORLD_SIZE` nodes are
modelled (the graph is built at ``n`` to count each node's neighbours).

Unequal nodes (``--node-speed``, the specs of ``gossip.train --node-speed``): a
synchronous candidate's step waits for the slowest node, so its compute time is the
measured one times the largest multiplier (a trace: the mean over its lines of the
slowest node's seconds); an asynchronous one (adpsgd) is timed on the event clock
(:mod:`gossip.clock`): ``n`` gradients per step at each node's own speed, each active
node's exchange on the link, so its step time is not linear in 1/bandwidth and no
crossover bandwidth is given for it ("event clock" in the crossover tables).

**Two links** (``--group-size G --intra LINK --inter LINK``, a LINK written
``RATE@LATENCY``, e.g. ``--intra 100gbit@0.01ms --inter 100mbit@20ms``) model a run of
``gossip.train --group-size G`` (docs/hierarchical.md): the ``--world-size`` ranks in
groups of G, each candidate measured between the N/G groups. A rank's step takes
``compute + codec + intra + inter``, where ``intra`` is the full-precision ring
all-reduce of the gradient over the group every step (``2 (G-1)/G x 4d`` bytes,
``2 (G-1)`` rounds) plus, on the share of steps that exchange between groups (1 but
for the periodic methods' local steps), the all-gather of the slices (``(G-1) x 4d/G``
bytes, ``G-1`` rounds) or, for an algorithm that cannot be sliced, member 0's
broadcast (``4d``, ``ceil(log2 G)`` rounds), all at the intra link; and ``inter`` is
the candidate's bytes of a node of the N/G-node run, 1/G of them on each member's own
link when it is sliced (the codec time 1/G too), all of them on member 0's otherwise,
plus its rounds at the inter latency. Beside it, the flat run of all N ranks as nodes
over the inter link.

Timings are of this machine and its current load (the tool warns when the load
average is above 0.3). ``--json`` prints the whole table for notebooks; ``--plot``
draws step time against bandwidth with the crossovers marked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["Candidate", "Measured", "measure", "step_time", "crossover", "parse_rate", "parse_time", "tc_rate",
           "TC_RATE_UNITS", "main"]

BASELINES = ("allreduce", "dpsgd")
DEFAULT_BANDWIDTHS = "10mbit,100mbit,1gbit,10gbit"
DEFAULT_LATENCIES = "0,5ms,50ms"
#: the most nodes simulated to measure a candidate (``--measure-nodes``): each is a model in
#: this process; at 256 nodes the measurement of every algorithm takes many minutes
MEASURE_NODES = 16
#: the largest ``--world-size`` modelled: the graph is built at that size (1 to 4 s at 100,000)
MAX_WORLD_SIZE = 100_000
#: input shape and classes of the data each built-in model is made for
MODEL_INPUTS = {"cnn1d": ((1, 40), 10), "resnet20": ((3, 32, 32), 10), "mlp": ((32,), 10), "logreg": ((32,), 10)}
_MLP_INPUT = 256  # --params N: an MLP 256 -> h -> 10 with about N parameters


class CrossoverError(ValueError):
    """Bad input to the crossover tool: one line naming it and what is accepted."""


# ------------------------------------------------------------------------------ units
# read in one place, gossip.tools.units; here with this tool's error, naming the option
from gossip.tools.units import RATE_UNITS_TEXT, TC_RATE_UNITS, UnitError, fmt_rate, tc_rate  # noqa: E402
from gossip.tools import units as _units  # noqa: E402


def parse_rate(text: str) -> float:
    """``"100mbit"`` -> 1e8 bits per second (:func:`gossip.tools.units.tc_rate`); CrossoverError
    naming the bandwidth otherwise."""
    try:
        return _units.parse_rate(text)
    except UnitError as e:
        raise CrossoverError(str(e)) from None


def parse_time(text: str) -> float:
    """``"5ms"`` -> 0.005 seconds (us, ms, s; a bare number is seconds); CrossoverError
    naming the latency otherwise."""
    try:
        return _units.parse_time(text)
    except UnitError as e:
        raise CrossoverError(str(e)) from None


# ------------------------------------------------------------------------------ measuring
@dataclass(frozen=True)
class Candidate:
    """An algorithm to measure, with its compressor spec (None: its default).

    Written ``algo@compressor`` on the command line."""

    algo: str
    compressor: str | None = None

    @property
    def label(self) -> str:
        return self.algo if self.compressor is None else f"{self.algo}@{self.compressor}"

    @classmethod
    def parse(cls, text: str) -> Candidate:
        from gossip import algorithms

        algo, _, comp = text.strip().partition("@")
        if algo not in algorithms.available():
            raise CrossoverError(f"--algos {text!r}: unknown algorithm {algo!r}; known: {', '.join(algorithms.available())}")
        return cls(algo, comp or None)


@dataclass
class Measured:
    """Per node and per step, as this machine ran it."""

    label: str
    algo: str
    decentralized: bool
    wire: str
    bytes: float
    codec_s: float
    compute_s: float
    rounds: dict[str, float] = field(default_factory=dict)
    setup_bytes: float = 0.0
    #: bytes per node and step of each kind of call (``bytes`` is their sum)
    op_bytes: dict[str, float] = field(default_factory=dict)
    #: the nodes simulated to measure it; when fewer than the world size, the factors
    #: that scaled each call's bytes (and the codec time, ``"codec"``) to it
    measured_nodes: int = 0
    scaled: dict[str, float] = field(default_factory=dict)
    #: an asynchronous algorithm (adpsgd): its step is timed on the event clock
    asynchronous: bool = False
    #: the share of steps that exchange (1 but for a periodic method's local steps:
    #: ``Algorithm.local_only``) and whether the exchange runs on a slice of the vector
    #: (``Algorithm.shards_flat``): what a run in groups needs to know (two links)
    exchange_share: float = 1.0
    shards_flat: bool = True


def rounds_of(op: str, n: int) -> int:
    """Sequential message rounds of one call of ``op`` among ``n`` nodes."""
    return {"exchange": 1, "all_reduce": 2 * (n - 1), "all_gather": n - 1,
            # the two legs of a sharded exchange, each counted as an all-gather's rounds
            "shard_push": n - 1, "shard_pull": n - 1,
            "broadcast": max(1, math.ceil(math.log2(max(2, n))))}.get(op, 0)


def model_factory(model: str | None, params: int | None) -> tuple[Callable[[], Any], tuple[int, ...], int, str]:
    """A factory of identical models, their input shape, class count and name."""
    import torch
    from torch import nn

    from gossip import models

    if model is not None:
        if model not in MODEL_INPUTS:
            raise CrossoverError(f"--model {model!r}: expected one of {', '.join(MODEL_INPUTS)} (or --params N)")
        shape, classes = MODEL_INPUTS[model]
        return (lambda: models.build_model(model, input_shape=shape, num_classes=classes, seed=0)), shape, classes, model
    hidden = max(1, round((params - 10) / (_MLP_INPUT + 11)))

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(_MLP_INPUT, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    return mlp, (_MLP_INPUT,), 10, f"mlp {_MLP_INPUT}-{hidden}-10"


def _simulated_algorithm(cand: Candidate, world_size: int, topology: str, degree: int | None, seed: int):
    """A simulated communicator on the candidate's graph (none for a centralized one)
    and the candidate's algorithm over it."""
    import topologies
    from gossip import algorithms, comm

    topo = None
    if algorithms.is_decentralized(cand.algo):
        try:
            topo = topologies.build(topology, world_size, **({"degree": degree} if degree else {}))
        except (ValueError, TypeError) as e:
            raise CrossoverError(f"--topology {topology} with --world-size {world_size}: {e}") from None
    c = comm.SimulatedCommunicator(topo, world_size=world_size)
    opts: dict[str, Any] = {"seed": seed}
    if cand.compressor is not None:
        opts["compressor"] = cand.compressor
    try:
        return c, algorithms.build(cand.algo, c, **opts)
    except (ValueError, TypeError) as e:
        raise CrossoverError(f"--algos {cand.label}: {e}") from None


def measure(cand: Candidate, factory: Callable[[], Any], input_shape: Sequence[int], classes: int, *,
            world_size: int, topology: str, degree: int | None = None, batch_size: int = 32,
            steps: int = 3, seed: int = 0) -> Measured:
    """Run ``steps`` steps (after one warm-up step) of ``cand`` on ``world_size`` simulated nodes,
    rounded up to whole communication cycles (``Algorithm.period``)."""
    import torch
    import torch.nn.functional as F

    from gossip import algorithms
    from gossip.runtime import GossipOptimizer

    decentralized = algorithms.is_decentralized(cand.algo)
    c, algo = _simulated_algorithm(cand, world_size, topology, degree, seed)
    models = [factory() for _ in range(world_size)]
    sgd = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]  # no local momentum: every algorithm takes it
    gopt = GossipOptimizer(models, sgd, algo)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, *input_shape, generator=gen)
    y = torch.randint(0, classes, (batch_size,), generator=gen)
    ledger = c.ledger

    def one_step() -> None:
        gopt.zero_grad()
        with ledger.phase("compute"):
            for m in models:
                F.cross_entropy(m(x), y).backward()
        gopt.step()
        ledger.step()

    with ledger.warmup():  # compilation and first calls (of a whole cycle: its first exchange too)
        for _ in range(algo.period):
            one_step()
    # whole communication cycles (local SGD, DiLoCo: one all-reduce per local_steps steps)
    steps = -(-steps // algo.period) * algo.period
    before = ledger.as_dict()
    for _ in range(steps):
        one_step()
    d = ledger.since(before)
    per = world_size * steps
    sent = d["bytes"]["sent"] - d["ops"]["control"]["sent"]
    rounds = {op: v["calls"] / steps for op, v in d["ops"].items() if op != "control" and v["calls"]}
    op_bytes = {op: v["sent"] / per for op, v in d["ops"].items() if op != "control" and v["calls"]}
    wire = algo.wire_format().label
    period = max(1, algo.period)
    share = sum(not algo.local_only(t) for t in range(1, period + 1)) / period
    return Measured(
        label=cand.label, algo=cand.algo, decentralized=decentralized, wire=wire, bytes=sent / per,
        codec_s=d["time"]["compress"] / per, compute_s=d["time"]["compute"] / per, rounds=rounds,
        setup_bytes=before["setup"]["sent"] / world_size, op_bytes=op_bytes, measured_nodes=world_size,
        asynchronous=algo.asynchronous,
        exchange_share=share, shards_flat=bool(algo.shards_flat),
    )


def mean_degree(topology: str, n: int, degree: int | None = None) -> float:
    """Neighbours a node exchanges with per step, on the graph of ``n`` nodes."""
    import numpy as np
    import topologies

    try:
        graph = topologies.build(topology, n, **({"degree": degree} if degree else {}))
    except (ValueError, TypeError) as e:
        raise CrossoverError(f"--topology {topology} with --world-size {n}: {e}") from None
    return float(np.mean(graph.degrees))


def scale(m: Measured, n: int, degree_ratio: float = 1.0) -> Measured | str:
    """``m``, measured on ``m.measured_nodes`` nodes, modelled on ``n``: each call's bytes
    per node scaled by its accounting (``degree_ratio``: the graph's mean degree at ``n``
    over the measured one's), the codec time by the largest growth of a node's fan-in.
    A reason (text) instead where the bytes at ``n`` cannot be had this way."""
    k = m.measured_nodes
    if n == k:
        return m
    if m.asynchronous:
        return (f"an asynchronous algorithm is timed on the event clock of the nodes measured ({k}); give "
                f"--measure-nodes {n} to measure and time it at {n:,} nodes")
    ring = ((n - 1) / n) / ((k - 1) / k)  # a ring all-reduce 2(n-1)/n x payload, a broadcast (n-1)/n
    per_op = {"exchange": degree_ratio, "all_reduce": ring, "broadcast": ring, "all_gather": (n - 1) / (k - 1)}
    unknown = [op for op in m.op_bytes if op not in per_op]
    if unknown:
        how = ("the sharded exchange's bytes depend on how its shards and their headers fall at each n"
               if any(op.startswith("shard_") for op in unknown) else f"no scaling known for {', '.join(unknown)}")
        return (f"{how}, so they are not modelled beyond the {k} nodes measured (--measure-nodes N measures on N "
                f"nodes, in time that grows with N squared)")
    factors = {op: per_op[op] for op in m.op_bytes}
    fan_in = max([1.0] + [factors[op] for op in ("exchange", "all_gather") if op in factors])
    return dataclasses.replace(m, bytes=sum(b * factors[op] for op, b in m.op_bytes.items()),
                               op_bytes={op: b * factors[op] for op, b in m.op_bytes.items()},
                               codec_s=m.codec_s * fan_in, scaled={**factors, "codec": fan_in})


# ------------------------------------------------------------------------------ the model
def fixed_s(m: Measured, latency: float, n: int) -> float:
    """The part of a step that does not depend on the bandwidth."""
    return m.compute_s + m.codec_s + latency * sum(k * rounds_of(op, n) for op, k in m.rounds.items())


LINK_OVERHEAD = 1.05


def step_time(m: Measured, bandwidth: float, latency: float, n: int, overhead: float = LINK_OVERHEAD) -> float:
    """Modelled seconds per step on a link of ``bandwidth`` bit/s and ``latency`` s."""
    return fixed_s(m, latency, n) + overhead * 8.0 * m.bytes / bandwidth


def slowest_compute(compute_s: float, speeds) -> float:
    """A synchronous step's compute at ``speeds`` (a :class:`gossip.speeds.NodeSpeeds`):
    the slowest node's, on average over the steps."""
    if speeds.trace is not None:
        return float(speeds.trace.max(axis=1).mean())
    return compute_s * float(speeds.multipliers.max())


#: steps of ``n`` gradients an asynchronous candidate is timed over on the event clock
CLOCK_STEPS = 50


def event_step_time(m: Measured, bandwidth: float, latency: float, speeds, topology: str,
                    degree: int | None = None, overhead: float = LINK_OVERHEAD) -> float:
    """Modelled seconds per step (``n`` gradients) of an asynchronous candidate on the event
    clock: each node computes at its speed (its codec time added), each active node's
    exchange of ``m.bytes`` each way keeps both links busy."""
    import topologies
    from gossip import algorithms, clock, comm

    n = speeds.n
    topo = topologies.build(topology, n, **({"degree": degree} if degree else {}))
    algo = algorithms.build(m.algo, comm.SimulatedCommunicator(topo, world_size=n))
    ex = clock.Link(bandwidth, latency, overhead).transfer_s(m.bytes)
    c = clock.EventClock(speeds, m.compute_s + m.codec_s, ex, algo.active, algo.choose)
    for _ in range(CLOCK_STEPS * n):
        c.next()
    return c.now / CLOCK_STEPS


def crossover(m: Measured, base: Measured, latency: float, n: int, overhead: float = LINK_OVERHEAD) -> dict[str, Any]:
    """Where ``m`` and ``base`` take equal time: ``{"wins": "always"|"never"|"below"|"above",
    "bandwidth": bit/s or None}`` (``"event clock"`` for an asynchronous ``m``: no closed form)."""
    if m.asynchronous:
        return {"wins": "event clock", "bandwidth": None}
    sa, sb = overhead * 8.0 * m.bytes, overhead * 8.0 * base.bytes
    fa, fb = fixed_s(m, latency, n), fixed_s(base, latency, n)
    if sa < sb:
        return {"wins": "always", "bandwidth": None} if fa <= fb else {"wins": "below", "bandwidth": (sb - sa) / (fa - fb)}
    if fa < fb and sa > sb:
        return {"wins": "above", "bandwidth": (sa - sb) / (fb - fa)}
    return {"wins": "always" if fa < fb else "never", "bandwidth": None}


@dataclass(frozen=True)
class Link:
    """One link of the two-link model: ``rate`` bit/s, one-way ``latency`` s."""

    rate: float
    latency: float

    @classmethod
    def parse(cls, text: str, flag: str) -> Link:
        """``"100mbit@20ms"`` (a bare rate: no latency); CrossoverError naming ``flag``."""
        rate, _, lat = str(text).partition("@")
        try:
            return cls(_units.parse_rate(rate.strip()), _units.parse_time(lat.strip()) if lat.strip() else 0.0)
        except UnitError as e:
            raise CrossoverError(f"{flag} {text!r}: {e} (a link is RATE@LATENCY, e.g. 100mbit@20ms)") from None

    def __str__(self) -> str:
        return f"{fmt_rate(self.rate)} @ {1e3 * self.latency:g} ms"


def two_link_time(m: Measured, d: int, groups: int, group_size: int, intra: Link, inter: Link,
                  overhead: float = LINK_OVERHEAD) -> dict[str, float]:
    """A rank's modelled step in a run of ``groups`` groups of ``group_size`` ranks
    (``m``: the candidate between the groups, measured or scaled on ``groups`` nodes;
    ``d`` parameters): seconds per step (``step_s``; its ``intra_s``, ``inter_s`` and
    ``codec_s`` parts) and the bytes a rank sends per step at each level
    (``intra_bytes``, ``inter_bytes``: means over the members, as ``bytes_by_level``)."""
    from gossip.comm.base import ring_allreduce_bytes

    G, share = group_size, m.exchange_share
    allreduce = ring_allreduce_bytes(4 * d, G)  # the gradient, full precision, every step
    if m.shards_flat:  # each member exchanges its slice over its own link, then all-gather
        slice_bytes = 4 * -(-d // G)  # the longest slice
        gather_busiest = gather_mean = (G - 1) * slice_bytes
        gather_rounds, inter_busiest, codec = G - 1, m.bytes / G, m.codec_s / G
    else:  # member 0 exchanges the whole vector, then broadcasts it
        gather_busiest, gather_mean = 4 * d, 4 * d * (G - 1) / G
        gather_rounds, inter_busiest, codec = max(1, math.ceil(math.log2(G))), m.bytes, m.codec_s
    intra_s = (overhead * 8.0 * (allreduce + share * gather_busiest) / intra.rate
               + intra.latency * (2 * (G - 1) + share * gather_rounds))
    inter_s = (overhead * 8.0 * inter_busiest / inter.rate
               + inter.latency * sum(k * rounds_of(op, groups) for op, k in m.rounds.items()))
    return {"step_s": m.compute_s + codec + intra_s + inter_s, "intra_s": intra_s, "inter_s": inter_s,
            "codec_s": codec, "intra_bytes": allreduce + share * gather_mean, "inter_bytes": m.bytes / G}


def fmt_crossover(c: dict[str, Any]) -> str:
    if c["wins"] in ("below", "above"):
        return f"{c['wins']} {fmt_rate(c['bandwidth'])}"
    return c["wins"]


# ------------------------------------------------------------------------------ the CLI
class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``--params 1e6x``), not a usage block and a line."""

    def error(self, message: str):  # type: ignore[override]
        print(f"gossip.tools.crossover: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _count(text: str) -> int:
    """An integer count, in any notation that names one: ``1000000``, ``1e6``, ``1_000_000``."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m gossip.tools.crossover", description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", choices=list(MODEL_INPUTS), help="a built-in model (default: --params)")
    what.add_argument("--params", type=_count, help="an MLP with about this many parameters (default 1000000; "
                      "1e6 reads as 1000000)")
    p.add_argument("--world-size", type=int, default=8, help=f"nodes (default 8; at most {MAX_WORLD_SIZE:,})")
    p.add_argument("--topology", default="ring", help="graph of the gossip algorithms (default ring)")
    p.add_argument("--degree", type=int, help="degree, for expander and the like")
    p.add_argument("--algos", help="comma-separated ALGO or ALGO@COMPRESSOR (default: every algorithm); "
                   "allreduce and dpsgd (fp32) are always measured as the baselines")
    p.add_argument("--bandwidth", help=f"link rates (default {DEFAULT_BANDWIDTHS})")
    p.add_argument("--latency", help=f"one-way latencies (default {DEFAULT_LATENCIES})")
    p.add_argument("--group-size", type=int, metavar="G", help="with --intra and --inter: model a run in groups of G "
                   "ranks (gossip.train --group-size G), each candidate between the world-size / G groups "
                   "(docs/hierarchical.md)")
    p.add_argument("--intra", metavar="LINK", help="the link inside a group, RATE@LATENCY (e.g. 100gbit@0.01ms): "
                   "the gradient all-reduce and the slices' all-gather")
    p.add_argument("--inter", metavar="LINK", help="the link between groups, RATE@LATENCY (e.g. 100mbit@20ms): the "
                   "candidate's exchange, and the flat run of every rank as a node")
    p.add_argument("--link-overhead", type=float, default=LINK_OVERHEAD,
                   help=f"bytes on the wire per payload byte (default {LINK_OVERHEAD}: TCP/IP framing)")
    p.add_argument("--node-speed", default="uniform", metavar="SPEC",
                   help="the nodes' speeds, as gossip.train --node-speed takes them: uniform (default), "
                        "slow:nodes=K,factor=F, lognormal:sigma=S,seed=N or trace:FILE; a synchronous step waits for "
                        "the slowest node, an asynchronous algorithm is timed on the event clock")
    p.add_argument("--batch-size", type=int, default=32, help="per node, for the compute time (default 32)")
    p.add_argument("--measure-nodes", type=int, default=MEASURE_NODES, metavar="M",
                   help=f"simulate at most M nodes to measure (default {MEASURE_NODES}); a larger --world-size is "
                        "modelled from them, each call's bytes scaled to it (docs/crossover.md)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per candidate after one warm-up, rounded up to whole communication "
                   "cycles of the algorithms that communicate every H steps (default 3)")
    p.add_argument("--json", action="store_true", help="print the table as JSON instead")
    p.add_argument("--plot", metavar="FILE.png", help="draw step time against bandwidth, crossovers marked")
    p.add_argument("--benchmark", metavar="FILE", help="a benchmark.json of experiments/benchmark.py: print, for each "
                   "--bandwidth and --latency at --world-size, the methods that reached the target fastest there "
                   "(nearest benchmarked point, with their 95 %% intervals) before measuring")
    p.add_argument("--benchmark-only", action="store_true", help="with --benchmark: print its answer, measure nothing")
    return p


def _check(args: argparse.Namespace) -> None:
    for name, lo in (("world_size", 2), ("batch_size", 1), ("steps", 1), ("measure_nodes", 2)):
        if getattr(args, name) < lo:
            raise CrossoverError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {lo}")
    if args.world_size > MAX_WORLD_SIZE:
        raise CrossoverError(f"--world-size {args.world_size:,}: at most {MAX_WORLD_SIZE:,} nodes are modelled (the "
                             f"graph is built at that size to count each node's neighbours); at {MAX_WORLD_SIZE:,} a "
                             f"ring all-reduce already takes 2(n-1) = {2 * (MAX_WORLD_SIZE - 1):,} latencies a step")
    if not 1.0 <= args.link_overhead <= 10.0:
        raise CrossoverError(f"--link-overhead {args.link_overhead}: expected 1 to 10 wire bytes per payload byte")
    if args.params is not None and not 300 <= args.params <= 2_000_000_000:
        raise CrossoverError(f"--params {args.params}: expected 300 to 2e9 parameters")
    two = [f for f, v in (("--group-size", args.group_size), ("--intra", args.intra), ("--inter", args.inter))
           if v is not None]
    if two and len(two) < 3:
        missing = [f for f in ("--group-size", "--intra", "--inter") if f not in two]
        raise CrossoverError(f"{' and '.join(two)} without {' and '.join(missing)}: the two-link model needs "
                             "--group-size G, --intra LINK and --inter LINK together")
    if two:
        n, g = args.world_size, args.group_size
        if g < 2 or n % g or n // g < 2:
            raise CrossoverError(f"--group-size {g} with --world-size {n}: expected a divisor of the world size from 2 "
                                 f"to {n // 2}, so that there are at least 2 groups of at least 2 ranks")
        given = [f for f, v in (("--bandwidth", args.bandwidth), ("--latency", args.latency)) if v is not None]
        if args.node_speed != "uniform":
            given.append("--node-speed")
        if given:
            raise CrossoverError(f"{' and '.join(given)} with --intra/--inter: the two-link model takes its own "
                                 "links and equal nodes (give one or the other)")


def _node_speeds(args: argparse.Namespace):
    from gossip import speeds

    try:
        return speeds.parse(args.node_speed, args.world_size)
    except speeds.SpeedError as e:
        raise CrossoverError(str(e)) from None


def _row(m: Measured, base: dict[str, Measured], args: argparse.Namespace, node_speeds, bws, lats,
         n: int | None = None) -> dict[str, Any]:
    """A candidate's row: its measurement, its step time at each link, its crossovers
    (on ``n`` nodes: default the world size; with two links, the groups)."""
    n, ov = args.world_size if n is None else n, args.link_overhead
    return {
        **asdict(m),
        "step_s": [{"bandwidth": b, "latency": t,
                    "seconds": event_step_time(m, b, t, node_speeds, args.topology, args.degree, ov)
                    if m.asynchronous else step_time(m, b, t, n, ov)} for t in lats for b in bws],
        "crossover": {bl: [{"latency": t, **crossover(m, base[bl], t, n, ov)} for t in lats] for bl in BASELINES},
    }


def run(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    _check(args)
    node_speeds = _node_speeds(args)
    links, bws, lats = _links(args)
    cands = _candidates(args)
    factory, shape, classes, model_name = model_factory(args.model, args.params if args.model else (args.params or 1_000_000))
    load = _load(say)
    world = n = args.world_size
    if links is not None:  # the candidates run between the groups
        n = world // args.group_size
        say(f"two links: {world} ranks in {n} groups of {args.group_size}; intra {links[0]}, inter {links[1]}")
    k_nodes = min(n, args.measure_nodes)
    degree_ratio = 1.0
    if k_nodes < n:
        say(f"measuring on {k_nodes} simulated nodes, modelling {n:,}: each call's bytes scaled to {n:,} nodes")
        degree_ratio = (mean_degree(args.topology, n, args.degree) /
                        mean_degree(args.topology, k_nodes, args.degree))
    measured: list[Measured] = []
    left_out: dict[str, str] = {}
    flat: dict[str, Measured | str] = {}  # two links: the flat run of every rank as a node
    for k, cand in enumerate(cands, 1):
        say(f"[{k}/{len(cands)}] measuring {cand.label} ...")
        try:
            m = measure(cand, factory, shape, classes, world_size=k_nodes, topology=args.topology,
                        degree=args.degree, batch_size=args.batch_size, steps=args.steps)
        except CrossoverError as e:
            if args.algos:  # asked for by name: its refusal is the answer
                raise
            got = str(e)  # every algorithm: one that refuses the graph (adpsgd off a bipartite one) is left out
        else:
            got = scale(m, n, degree_ratio if m.decentralized else 1.0)
            if links is not None:
                flat[cand.label] = _flat_of(m, args, world, k_nodes)
        if isinstance(got, str):
            left_out[cand.label] = got
            say(f"  {cand.label} left out at {n:,} nodes: {got}")
        else:
            measured.append(got)
    # the model and batch are the same for every candidate: one compute time for all (the
    # median of the candidates' measurements), so that noise in it moves no crossover
    compute = statistics.median(m.compute_s for m in measured)
    for m in measured:
        m.compute_s = compute if m.asynchronous else slowest_compute(compute, node_speeds)
    ov = args.link_overhead
    base = {m.label: m for m in measured if m.label in BASELINES}
    import torch

    rows = [_row(m, base, args, node_speeds, bws, lats, n) for m in measured]
    d = sum(p.numel() for p in factory().parameters())
    extra = {} if links is None else _two_links(rows, measured, flat, d, n, args, links)
    return {
        "machine": {"threads": torch.get_num_threads(), "load_average": load},
        "model": model_name,
        "params": d, "world_size": n, "measured_nodes": k_nodes,
        "topology": args.topology, "node_speed": args.node_speed, "bandwidths": bws, "latencies": lats, "link_overhead": ov, "rows": rows,
        "left_out": left_out, **extra,
    }


def _load(say: Callable[[str], None]) -> float:
    """The 1-minute load average, with a warning where it is above 0.3."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.3:
        say(f"warning: load average {load:.2f} > 0.3: timings of a busy machine overstate the codec costs")
    return load


def _candidates(args: argparse.Namespace) -> list[Candidate]:
    """``--algos`` (default: every algorithm), the baselines first."""
    from gossip import algorithms

    names = args.algos.split(",") if args.algos else list(algorithms.available())
    cands = [Candidate.parse(t) for t in names if t.strip()]
    for b in reversed(BASELINES):
        if not any(c.algo == b and c.compressor is None for c in cands):
            cands.insert(0, Candidate(b))
    return cands


def _links(args: argparse.Namespace) -> tuple[tuple[Link, Link] | None, list[float], list[float]]:
    """The two links (None without them), the bandwidths and the latencies of the grid
    (with two links, the inter link's)."""
    if args.intra is not None:
        links = (Link.parse(args.intra, "--intra"), Link.parse(args.inter, "--inter"))
        return links, [links[1].rate], [links[1].latency]
    return (None, [parse_rate(b) for b in (args.bandwidth or DEFAULT_BANDWIDTHS).split(",")],
            [parse_time(t) for t in (args.latency or DEFAULT_LATENCIES).split(",")])


def _two_links(rows: list[dict], measured: list[Measured], flat: dict, d: int, groups: int,
               args: argparse.Namespace, links: tuple[Link, Link]) -> dict[str, Any]:
    """Each row's ``two_link`` (in place), and the result's ``two_links``."""
    for r, m in zip(rows, measured):
        r["two_link"] = _two_link_row(m, flat[m.label], d, groups, args.world_size, args.group_size, links,
                                      args.link_overhead, m.compute_s)
    return {"two_links": {"group_size": args.group_size, "groups": groups, "ranks": args.world_size,
                          "intra": asdict(links[0]), "inter": asdict(links[1])}}


def _flat_of(m: Measured, args: argparse.Namespace, world: int, k_nodes: int) -> Measured | str:
    """Two links: the candidate measured on ``k_nodes`` as the flat run of all ``world``
    ranks as nodes (:func:`scale`; a reason where it cannot be had)."""
    ratio = (mean_degree(args.topology, world, args.degree) / mean_degree(args.topology, k_nodes, args.degree)
             if m.decentralized else 1.0)
    return scale(m, world, ratio)


def _two_link_row(m: Measured, flat: Measured | str, d: int, groups: int, world: int, group_size: int,
                  links: tuple[Link, Link], ov: float, compute: float) -> dict[str, Any]:
    """A row's ``two_link``: :func:`two_link_time`, and the flat run's step on the inter link."""
    if isinstance(flat, str):
        return {**two_link_time(m, d, groups, group_size, *links, overhead=ov), "flat_s": None, "flat_bytes": None,
                "flat_left_out": flat}
    flat = dataclasses.replace(flat, compute_s=compute)
    return {**two_link_time(m, d, groups, group_size, *links, overhead=ov),
            "flat_s": step_time(flat, links[1].rate, links[1].latency, world, ov), "flat_bytes": flat.bytes}


def render(res: dict[str, Any]) -> str:
    bws, lats, n = res["bandwidths"], res["latencies"], res["world_size"]
    speed = res.get("node_speed", "uniform")
    out = [f"{res['model']}, {res['params']:,} params, {n:,} nodes, gossip on {res['topology']}"
           + (f", node speeds {speed}" if speed != "uniform" else "") + "; "
           f"{res['machine']['threads']} thread(s), load {res['machine']['load_average']:.2f}"]
    k = res.get("measured_nodes", n)
    if k < n:
        grown = [f"{r['label']} x{r['scaled']['codec']:.3g}" for r in res["rows"] if r["scaled"].get("codec", 1) > 1]
        out.append(f"measured on {k} simulated nodes; each call's bytes per node scaled to {n:,} (docs/crossover.md)"
                   + (f"; codec time scaled by the fan-in, an upper bound: {', '.join(grown)}" if grown else ""))
    for label, why in (res.get("left_out") or {}).items():
        out.append(f"left out at {n:,} nodes: {label}: {why}")
    out.append("")
    w = max(len(r["label"]) for r in res["rows"])
    fp32 = {r["label"]: r["bytes"] for r in res["rows"]}.get("allreduce") or 1.0
    out.append(f"{'algorithm':<{w}}  {'wire':<16} {'bytes/step/node':>15} {'vs fp32 AR':>10} {'codec ms':>9} "
               f"{'compute ms':>10}  rounds")
    for r in res["rows"]:
        rounds = " ".join(f"{op}x{k:g}" for op, k in r["rounds"].items()) or "-"
        out.append(f"{r['label']:<{w}}  {r['wire'][:16]:<16} {r['bytes']:>15,.0f} {r['bytes'] / fp32:>10.3f} "
                   f"{1e3 * r['codec_s']:>9.2f} {1e3 * r['compute_s']:>10.2f}  {rounds}")
    if res.get("two_links"):
        return "\n".join(out + _render_two_links(res, w))
    for t in lats:
        out += ["", f"modelled step time (ms) at latency {1e3 * t:g} ms"]
        out.append(f"{'algorithm':<{w}}  " + " ".join(f"{fmt_rate(b):>13}" for b in bws))
        for r in res["rows"]:
            vals = [s["seconds"] for s in r["step_s"] if s["latency"] == t]
            out.append(f"{r['label']:<{w}}  " + " ".join(f"{1e3 * v:>13.2f}" for v in vals))
    for bl in BASELINES:
        out += ["", f"crossover against fp32 {bl}: the candidate is faster ... (per latency)"]
        out.append(f"{'algorithm':<{w}}  " + " ".join(f"{f'{1e3 * t:g} ms':>22}" for t in lats))
        for r in res["rows"]:
            if r["label"] == bl:
                continue
            out.append(f"{r['label']:<{w}}  " + " ".join(f"{fmt_crossover(c):>22}" for c in r["crossover"][bl]))
    return "\n".join(out)


def _render_two_links(res: dict[str, Any], w: int) -> list[str]:
    tl = res["two_links"]
    intra, inter = Link(**tl["intra"]), Link(**tl["inter"])
    out = ["", f"two links: {tl['ranks']:,} ranks in {tl['groups']:,} groups of {tl['group_size']} (the rows above: "
           f"a node of the {tl['groups']:,}-node run between groups); intra {intra}, inter {inter}",
           f"{'algorithm':<{w}}  {'sliced':>6} {'intra B/rank':>12} {'inter B/rank':>12} {'intra ms':>9} "
           f"{'inter ms':>9} {'step ms':>9} {'flat ms':>9}"]
    for r in res["rows"]:
        t = r["two_link"]
        flat = "-" if t["flat_s"] is None else f"{1e3 * t['flat_s']:.2f}"
        out.append(f"{r['label']:<{w}}  {'yes' if r['shards_flat'] else 'no':>6} {t['intra_bytes']:>12,.0f} "
                   f"{t['inter_bytes']:>12,.0f} {1e3 * t['intra_s']:>9.2f} {1e3 * t['inter_s']:>9.2f} "
                   f"{1e3 * t['step_s']:>9.2f} {flat:>9}")
    out.append(f"(step: compute + codec + intra + inter per rank; flat: every one of the {tl['ranks']:,} ranks a node "
               f"on the inter link; '-' where it cannot be modelled from the nodes measured)")
    return out


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lats, n = res["latencies"], res["world_size"]
    fig, axes = plt.subplots(1, len(lats), figsize=(5 * len(lats), 4), squeeze=False, sharey=True)
    grid = np.logspace(math.log10(min(res["bandwidths"]) / 2), math.log10(max(res["bandwidths"]) * 2), 200)
    for ax, t in zip(axes[0], lats):
        for r in res["rows"]:
            m = Measured(**{k: r[k] for k in Measured.__dataclass_fields__})
            ov = res["link_overhead"]
            if m.asynchronous:  # the event clock's points: no closed form between them
                pts = [s for s in r["step_s"] if s["latency"] == t]
                ax.plot([s["bandwidth"] for s in pts], [1e3 * s["seconds"] for s in pts], "o--", label=r["label"])
                continue
            ax.plot(grid, [1e3 * step_time(m, b, t, n, ov) for b in grid], label=r["label"],
                    lw=2 if r["label"] in BASELINES else 1)
            c = r["crossover"]["allreduce"][lats.index(t)]
            if c["bandwidth"] is not None and grid[0] <= c["bandwidth"] <= grid[-1]:
                ax.plot([c["bandwidth"]], [1e3 * step_time(m, c["bandwidth"], t, n, ov)], "kx")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bandwidth (bit/s)")
        ax.set_title(f"latency {1e3 * t:g} ms (x: crossover vs fp32 all-reduce)", fontsize=9)
    axes[0][0].set_ylabel("modelled step time (ms)")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _leaderboard_error() -> type[Exception]:
    from gossip.tools.leaderboard import LeaderboardError

    return LeaderboardError


def _benchmark_answer(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The benchmark's measured answer at each requested link (see gossip.tools.leaderboard)."""
    from gossip.tools import leaderboard

    res = leaderboard.load(args.benchmark)
    params = args.params
    if args.model is not None:
        factory = model_factory(args.model, None)[0]
        params = sum(p.numel() for p in factory().parameters())
    out = []
    for b in (parse_rate(x) for x in (args.bandwidth or DEFAULT_BANDWIDTHS).split(",")):
        for t in (parse_time(x) for x in (args.latency or DEFAULT_LATENCIES).split(",")):
            ans = leaderboard.answer(res, b, t, args.world_size, params)
            say(leaderboard.render(ans, b, t, args.world_size))
            out.append({"bandwidth": b, "latency": t, "answer": ans})
    return out


def _check_plot(path: str) -> None:
    """--plot's file: a format matplotlib writes, in a directory that exists, checked
    before the measurements (not after minutes of them)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    p = Path(path)
    formats = Figure().canvas.get_supported_filetypes()
    ext = p.suffix.lower().lstrip(".")
    if ext not in formats:
        raise CrossoverError(f"--plot {path!r}: {'.' + ext if ext else 'no'} extension; matplotlib writes "
                             f"{', '.join('.' + f for f in sorted(formats))}")
    if not p.parent.is_dir():
        raise CrossoverError(f"--plot {path!r}: no such directory {str(p.parent)!r}")
    if p.is_dir():
        raise CrossoverError(f"--plot {path!r} is a directory; give a file name such as crossover.png")


class _StdoutFailed(Exception):
    """Standard output could not be written (a closed pipe, a full disk): not a file's error."""


def _print(text: str) -> None:
    """``text`` to stdout, flushed now so that a closed pipe or a full disk is met here."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as e:
        raise _StdoutFailed(e.strerror or str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gossip.tools.crossover``: measure, model and print (or ``--json``/``--plot``); the exit code."""
    args = _parser().parse_args(argv)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else _print
    try:
        if args.plot:
            try:
                import matplotlib  # noqa: F401  (fail before the measurements, not after)
            except ImportError as e:
                print(f"gossip.tools.crossover: error: --plot needs matplotlib ({e}); pip install matplotlib",
                      file=sys.stderr)
                return 2
            _check_plot(args.plot)
        measured_answer = None
        if args.benchmark:
            measured_answer = _benchmark_answer(args, say)
        elif args.benchmark_only:
            raise CrossoverError("--benchmark-only needs --benchmark FILE")
        if args.benchmark_only:
            if args.json:
                _print(json.dumps({"benchmark": measured_answer}, indent=1))
            return 0
        res = run(args, say)
        if measured_answer is not None:
            res["benchmark"] = measured_answer
        _print(json.dumps(res, indent=1) if args.json else render(res))
        if args.plot:
            try:
                plot(res, args.plot)
            except OSError as e:
                raise CrossoverError(f"--plot {args.plot!r}: cannot write it ({e.strerror or e})") from None
            say(f"plot: {args.plot}")
    except (CrossoverError, UnitError, _leaderboard_error()) as e:
        print(f"gossip.tools.crossover: error: {e}", file=sys.stderr)
        return 2
    except _StdoutFailed as e:  # stdout closed (a pipe into `head`) or full (/dev/full, a full disk)
        _quiet_stdout()
        print(f"gossip.tools.crossover: error: cannot write the results to standard output ({e})", file=sys.stderr)
        return 1
    return 0


def _quiet_stdout() -> None:
    """After stdout failed: point it at /dev/null, so that the interpreter's own flush at
    exit does not print a second error (Python's advice for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
