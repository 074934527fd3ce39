"""What a training run records and prints: metrics, TensorBoard, the epoch lines and
the records of config.json and summary.json.

:class:`RunLog` owns the per-node ``metrics-rank<k>.jsonl`` writers, the TensorBoard
writer (rank 0, ``--tensorboard``), the progress bar and the lines rank 0 prints;
:func:`config_record`, :func:`summary_record` and :func:`diverged_record` build the
run directory's two JSON files (their keys: :mod:`gossip.rundir`) from the values a
run hands them (:class:`RunFacts` and keyword arguments), so that every kind of run,
the fault-tolerant one included, writes the same records. The byte figures
come from the run's :class:`~gossip.comm.Ledger` through :mod:`gossip.rundir`'s
accounting functions; the ones that pool every rank are means over the ranks.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import topologies
from gossip import algorithms, compress, data, rundir
from gossip.train import evaluation
from gossip.train.config import TrainConfig
from gossip.errors import RunError

#: hosted nodes up to which each node's metrics file stays open for the whole run
#: without looking at the open-file limit
OPEN_WRITERS_MAX = 64
#: descriptors left to everything else (torch, data, sockets) when the metrics files
#: of a larger simulation are kept open
FD_RESERVE = 256


def keep_files_open(nodes: int) -> bool:
    """Whether ``nodes`` metrics files can stay open for the whole run: yes up to
    :data:`OPEN_WRITERS_MAX`, and beyond while the open-file limit leaves
    :data:`FD_RESERVE` descriptors free, after raising the soft limit towards the hard
    one if needed (allowed to any process). Where even the hard limit is too low (1,024
    soft on many systems; a simulation of a thousand nodes stopped with "Too many open
    files"), each node's file is opened for each record instead: slower, the same records."""
    if nodes <= OPEN_WRITERS_MAX:
        return True
    try:
        import resource
    except ImportError:  # no POSIX limits (Windows): as before
        return True
    need = nodes + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return True
    if hard != resource.RLIM_INFINITY and hard < need:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (ValueError, OSError):
        return False
    return True

__all__ = ["RunFacts", "RunLog", "config_record", "diverged_record", "dpsgd_bytes", "epoch_line", "header", "summary_record"]


class RunLog:
    """The run's metrics records, TensorBoard scalars, progress bar and printed lines.

    ``open`` and ``start_bar`` start them (on a resume, records after the restored step are dropped),
    ``step``/``train``/``eval`` log, ``say`` prints a line past the bar on rank 0,
    ``close`` ends them."""

    def __init__(self, cfg: TrainConfig, env, comm, out: Path, steps_per_epoch: int,
                 nodes: list[int] | None = None) -> None:
        self.cfg, self.env, self.comm, self.out = cfg, env, comm, Path(out)
        #: the hosted nodes whose files this log writes: the communicator's, unless given
        #: (a fault-tolerant replica writes under its replica id, whatever its rank in the quorum)
        self.nodes = [int(i) for i in (comm.nodes if nodes is None else nodes)]
        self.is_main = env.rank == 0
        self.steps_per_epoch = steps_per_epoch
        self.bar = None
        self.writers: list[rundir.MetricsWriter] = []
        self.tb: rundir.TensorBoardWriter | None = None

    def open(self, keep: int | None) -> None:
        """The writers of the hosted nodes (``keep``: the resumed step, records after it
        dropped) and TensorBoard's on rank 0."""
        keep_open = keep_files_open(len(self.nodes))
        if not keep_open:
            self.say(f"metrics: {len(self.nodes)} nodes' files are more than this process may keep open "
                     f"(ulimit -n); each is opened for each record, which is slower")
        self.writers = [rundir.MetricsWriter(rundir.metrics_path(self.out, i), keep_until=keep, keep_open=keep_open)
                        for i in self.nodes]
        if self.cfg.run.tensorboard and self.is_main:
            try:
                self.tb = rundir.TensorBoardWriter(self.out, resume_step=keep)
            except rundir.RunDirError as e:
                raise RunError(str(e)) from None

    def start_bar(self, start: int, stop: int) -> None:
        """The progress bar on rank 0 (``--no-progress``: none), from ``start`` to ``stop``."""
        if self.cfg.run.progress and self.is_main:
            from tqdm.auto import tqdm

            # disable=None: no bar when stderr is not a terminal (logs, CI), the epoch lines remain
            self.bar = tqdm(total=stop, initial=start, unit="step", dynamic_ncols=True, leave=False, disable=None)

    def say(self, line: str) -> None:
        """Print ``line`` (rank 0 only), past the progress bar."""
        if self.is_main:
            (self.bar.write(line) if self.bar is not None else print(line, flush=True))

    def step(self, losses: list[float]) -> None:
        """One step done: the bar moves on and shows the hosted nodes' mean loss."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}", refresh=False)

    def train(self, step: int, losses: list[list[float]], lr: float, elapsed: float, ledger) -> None:
        """A ``train`` record per hosted node (its mean loss over ``losses``, the bytes and
        time so far), and their mean over every node to TensorBoard."""
        recs = []
        for w, ls, traffic in zip(self.writers, losses, rundir.nodes_traffic(ledger, self.nodes)):
            recs.append({"kind": "train", "step": step, "epoch": step / self.steps_per_epoch, "time": elapsed,
                         "loss": sum(ls) / len(ls), "lr": lr, **traffic})
            w.write(recs[-1])
        if self.cfg.run.tensorboard:  # every rank: the mean over all nodes is a collective
            keys = [k for k, v in recs[0].items() if isinstance(v, (int, float)) and k not in ("kind", "step")]
            t = torch.tensor([[float(rec[k]) for k in keys] for rec in recs], dtype=torch.float64)
            mean = self.comm.all_reduce(t, op="mean", record=False)[0]
            if self.tb is not None:
                self.tb.write({"kind": "train", "step": step, **dict(zip(keys, mean.tolist()))})

    def eval(self, step: int, ev: dict, elapsed: float) -> None:
        """An ``eval`` record of every hosted node, and to TensorBoard."""
        for w in self.writers:
            w.write({"kind": "eval", "step": step, "epoch": step / self.steps_per_epoch, "time": elapsed, **ev})
        if self.tb is not None:
            self.tb.write({"kind": "eval", "step": step, **ev})

    def record(self, rec: dict) -> None:
        """A record of its own (a fault-tolerant replica's step, quorum, heal and end
        records) to the file of every hosted node."""
        for w in self.writers:
            w.write(rec)

    def close(self) -> None:
        """Close the bar and every writer."""
        if self.bar is not None:
            self.bar.close()
        for w in self.writers:
            w.close()
        if self.tb is not None:
            self.tb.close()


def dpsgd_bytes(cfg: TrainConfig, topo, n: int, dim: int) -> float:
    """Bytes per node per step of full-precision D-PSGD on the run's graph (for a
    centralized run, the configured graph or a ring on ``n`` nodes): the ratio's base."""
    if topo is None:
        topo = _reference_topology(cfg, n)
    if topo is None:
        return 0.0
    return float(topo.degrees.mean()) * compress.build("identity").payload_nbytes(dim)


def _reference_topology(cfg: TrainConfig, n: int):
    for name in (cfg.comm.topology, "ring", "complete"):
        try:
            return topologies.build(name, n)
        except (ValueError, TypeError):
            continue
    return None


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1024 or unit == "GB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.1f} GB"


def header(cfg: TrainConfig, env, dim: int, algo) -> str:
    """The run's first line: algorithm, wire format, graph, model, data and hosting."""
    n = env.world_size
    mode = f"torchrun, {n} ranks" if env.distributed else f"simulation, {n} nodes in one process"
    a = cfg.algorithm
    wire = algo.wire_format()
    lat = f" latency: emulated {cfg.comm.emulate_latency:g} ms per message round" if cfg.comm.emulate_latency else ""
    extra = f"({','.join(f'{k}={v}' for k, v in a.options)})" if a.options else ""
    return (
        f"gossip.train: algo={a.name}{extra} wire={wire.label} ({wire.bits_per_coord:g} bits/coord) topology="
        f"{cfg.comm.topology if algorithms.is_decentralized(a.name) else '-'} model={cfg.model_name} "
        f"({dim:,} params) data={cfg.data.name}/{cfg.data.partition} [{mode}]{lat}"
    )


def epoch_line(epoch: float, epochs, ev, ledger, dpsgd, step, task: str = data.CLASSIFICATION,
               levels: dict | None = None) -> str:
    """The line printed after an epoch: losses, accuracy (or bits per byte), consensus
    (where ``ev`` has it: not under ``--fault-tolerance``, whose replicas evaluate their own
    model), bytes per node per step against D-PSGD's, and the time split so far. ``levels``:
    a run in groups' bytes per rank per step inside its group and between groups, which
    the line shows both of (their sum is the rank's)."""
    per_step = rundir.step_bytes_per_node(ledger, max(1, step))
    ratio = f" ({per_step / dpsgd:.3f}x D-PSGD)" if dpsgd else ""
    if levels is not None:
        per_step = levels["intra"] + levels["inter"]
        ratio = f" (intra {_fmt_bytes(levels['intra'])}, inter {_fmt_bytes(levels['inter'])})"
    t = ledger.times
    return (
        f"epoch {(f'{epoch:.0f}' if epoch == int(epoch) else f'{epoch:.2f}'):>3}/{epochs}  train {ev['train_loss']:.4f}  test {ev['test_loss']:.4f}  "
        + (f"acc {ev['test_acc']:.2%}" + (f" [nodes {ev['node_acc_min']:.2%}-{ev['node_acc_max']:.2%}]"
                                           if "node_acc_min" in ev else "") + "  "
           if task == data.CLASSIFICATION else
           f"bpb {ev['test_bpb']:.3f} ppl {ev['test_ppl']:.3g}"
           + (f" [nodes {ev['node_bpb_min']:.3f}-{ev['node_bpb_max']:.3f}]" if "node_bpb_min" in ev else "") + "  ")
        + (f"consensus {ev['consensus_distance']:.3g}  " if "consensus_distance" in ev else "")
        + f"sent/node/step {_fmt_bytes(per_step)}{ratio}  "
        f"time compute {t.get('compute', 0):.1f}s compress {t.get('compress', 0):.1f}s "
        f"comm {t.get('communicate', 0):.1f}s wait {t.get('wait', 0):.1f}s"
        + (f" warm-up {t['warmup']:.1f}s" if t.get("warmup") else "")
    )


@dataclass(frozen=True)
class RunFacts:
    """What the records of config.json and summary.json say about a run, given by the run
    (:class:`gossip.train.loop.Run`, :class:`gossip.train.fault_tolerance.FaultTolerantRun`) rather
    than read off it.

    ``algo`` is the built algorithm (its wire format, payload compressor, report and
    summary fields); ``topology`` the configured graph's name where the run has one;
    ``pooled``: whether the byte figures are means over the ranks (a collective on
    every rank); ``hosts``: :func:`gossip.train.assembly.hosts_of`'s ``hosts`` and
    ``procs_per_host``."""

    cfg: TrainConfig
    algo: Any
    world_size: int
    mode: str
    hosts: dict
    dim: int
    task: str
    topology: str | None
    pooled: bool = False


def _identity(facts: RunFacts) -> dict:
    """The keys that say what ran, first in config.json's extras and every summary."""
    wire = facts.algo.wire_format()
    return {
        "schema": rundir.SCHEMA_VERSION,
        "algo": facts.cfg.algorithm.name,
        "topology": facts.topology,
        "world_size": facts.world_size,
        **facts.hosts,
        "compressor": wire.label,
        "bits": wire.bits_per_coord,
        "wire": wire.to_dict(),
    }


def _task_summary(facts: RunFacts, last_eval: dict) -> dict:
    """The task, and for a language model its held-out bits per byte and perplexity
    (its final_test_loss is in nats per token; it has no accuracy)."""
    if facts.task == data.CLASSIFICATION:
        return {"task": facts.task}
    return {"task": facts.task, "final_test_bpb": last_eval.get("test_bpb"),
            "final_test_ppl": last_eval.get("test_ppl")}


def config_record(facts: RunFacts, *, cfg_dict: dict, layout, corpus: dict | None) -> dict:
    """config.json: the config's flat keys (``cfg_dict``), then what the run found (world
    size, parameters, mode, host, torch, wire format, ``layout``, task, ``corpus``)."""
    wire, c = facts.algo.wire_format(), facts.algo.payload_compressor
    return {
        **cfg_dict, "schema": rundir.SCHEMA_VERSION, "world_size": facts.world_size,
        "params": facts.dim, "mode": facts.mode, "hostname": socket.gethostname(),
        "torch": torch.__version__, "wire": wire.to_dict(),
        "compressor_payload_bytes": None if c is None else int(c.payload_nbytes(facts.dim)),
        "layout": layout.to_dict(), "task": facts.task,
        **({"corpus": dict(corpus)} if corpus is not None else {}),
    }


def _measured_bits(facts: RunFacts, ledger, comm) -> float | None:
    """Bits per coordinate per message as the ledger saw them: bytes sent / coordinates /
    messages, all ranks pooled (control messages, e.g. size checks, left out)."""
    traffic = rundir.payload_traffic(ledger)
    if traffic is None or facts.dim == 0:
        return None
    sent, count = traffic
    if facts.pooled:
        t = comm.all_reduce(torch.tensor([[sent, count]], dtype=torch.float64), op="mean", record=False)
        sent, count = float(t[0, 0]), float(t[0, 1])
    return 8.0 * sent / (facts.dim * count) if count else None


def summary_record(facts: RunFacts, *, steps: int, ledger, comm, last_eval: dict, dpsgd_bytes: float,
                   wall_time_s: float, groups: Any = None, modelled_time_s: float | None = None) -> dict:
    """summary.json of a run that ended at ``steps``: final figures (``last_eval``), bytes
    (``ledger``), wire, time split (with ``facts.pooled`` its byte figures are means over
    the ranks: a collective over ``comm``, called on every rank)."""
    hosted, dist, cfg = len(ledger.nodes), facts.pooled, facts.cfg
    per_step = evaluation.global_mean(comm, rundir.step_bytes_per_node(ledger, steps), dist)
    setup = evaluation.global_mean(comm, ledger.setup_bytes_sent / hosted, dist)
    total = evaluation.global_mean(comm, ledger.bytes_sent / hosted, dist)
    times, ev = ledger.times, last_eval
    summary = {
        **_identity(facts), "model": cfg.model_name, "data": cfg.data.name, "params": facts.dim,
        "epochs": cfg.run.epochs, "steps": steps, "final_train_loss": ev.get("train_loss"),
        "final_test_loss": ev.get("test_loss"), "final_test_acc": ev.get("test_acc"), **_task_summary(facts, ev),
        "consensus_distance": ev.get("consensus_distance"),
        "bytes_sent_per_node_per_step": per_step,
        "bytes_ratio_to_dpsgd": (per_step / dpsgd_bytes) if dpsgd_bytes else None,
        "setup_bytes_per_node": setup if ledger.setup_known else None,
        "bytes_sent_per_node_total": total,
        "bits_per_coord": facts.algo.wire_format().bits_per_coord,
        "bits_per_coord_measured": _measured_bits(facts, ledger, comm),
        "time_split_s": {k: times.get(k, 0.0) for k in ("compute", "compress", "communicate", "wait")},
        "warmup_s": times.get("warmup", 0.0), "wall_time_s": wall_time_s, "modelled_time_s": modelled_time_s,
        "mode": facts.mode,
        "diverged": False, "latency_ms": cfg.comm.emulate_latency,
        "latency_mode": "emulated" if cfg.comm.emulate_latency else None, "report": facts.algo.report(),
    }
    summary.update(facts.algo.summary_fields())
    if groups is not None:  # a run in groups: a rank's bytes are those inside its group and between groups
        levels = {k: evaluation.global_mean(comm, v, dist) for k, v in groups.bytes_by_level(steps).items()}
        summary.update(group_size=groups.size, groups=facts.world_size // groups.size,
                       sharded=bool(facts.algo.sharded), bytes_by_level=levels,
                       bytes_sent_per_node_per_step=levels["intra"] + levels["inter"], bytes_ratio_to_dpsgd=None)
    return summary


def diverged_record(facts: RunFacts, e: Exception, *, steps: int, wall_time_s: float) -> dict:
    """summary.json of a run that diverged at ``steps``: what ran, where it stopped and why."""
    return {
        **_identity(facts), "epochs": facts.cfg.run.epochs, "steps": steps, "diverged": True,
        "reason": str(e), "final_train_loss": None, "final_test_loss": None, "final_test_acc": None,
        **{k: None for k in _task_summary(facts, {}) if k != "task"}, "task": facts.task,
        "consensus_distance": None, "wall_time_s": wall_time_s,
    }
