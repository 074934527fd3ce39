"""The training run behind ``gossip.train``: build, train, evaluate, log, checkpoint.

One code path serves both modes: under torchrun a process hosts its own rank
(``m = 1``); with ``--simulate N`` one process hosts all N nodes (``m = N``). Either way
the hosted nodes' parameters are the rows of one ``(m, d)`` buffer and every node
trains on its own shard.

:class:`Run` tells the training story and leaves each job to one component:
:mod:`gossip.train.assembly` builds the parts from the config, :mod:`gossip.train.agreement`
makes the ranks agree before anything is written, :class:`gossip.train.checkpoint.CheckpointManager`
saves and resumes, :class:`gossip.train.metrics.RunLog` records and prints, and
:mod:`gossip.train.evaluation` evaluates. Files written to the run directory (see
docs/run-directory.md): ``config.json`` at the start, ``metrics-rank<k>.jsonl`` (one
per node), checkpoints, and ``summary.json`` at the end.
"""

from __future__ import annotations

import contextlib
import errno
import math
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gossip import algorithms, checkpoint, clock, data, rundir, speeds, vectorized
from gossip.train import agreement, assembly, evaluation, metrics
from gossip.train.assembly import Env
from gossip.train.checkpoint import CheckpointManager, CheckpointRecord, Checkpoints, Progress
from gossip.train.config import FINGERPRINT_KEYS, RESUME_AUTO, TrainConfig, fingerprint_keys, link_of
from gossip.errors import Diverged, Finished, NonFiniteError, RunError
from gossip.runtime import GossipOptimizer

__all__ = ["Build", "CheckpointRecord", "Diverged", "Evaluation", "Finished", "FINGERPRINT_KEYS", "Progress", "Run", "RunError",
           "RunHooks", "Start", "fingerprint_keys", "run"]



# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------
def run(cfg: TrainConfig) -> dict | None:
    """Train as configured; returns the summary on rank 0 (None elsewhere). A
    fault-tolerant run (``--fault-tolerance``) is :func:`gossip.train.run`'s: the
    fault-tolerant loop sits on top of this one, which never imports it."""
    if cfg.comm.fault_tolerance is not None:
        raise RunError("--fault-tolerance runs through gossip.train.run (or python -m gossip.train), "
                       "which hands it to gossip.train.fault_tolerance; gossip.train.loop.run runs the other modes")
    env = assembly.detect_env(cfg)
    size = assembly.group_size(cfg, env)  # pure, as the topology: fails alike on every rank
    if size > 1 and env.world_size // size < 2 and assembly.algorithms.is_decentralized(cfg.algorithm.name):
        raise RunError(f"--group-size {size} makes one group of all {env.world_size} ranks; --algo "
                       f"{cfg.algorithm.name} is decentralized and needs at least 2 groups")
    topo = assembly.build_topology(cfg, env.world_size // size)  # pure: fails the same way on every rank
    device = assembly.choose_device(cfg, env)
    _check_resume_dir(cfg)
    try:
        dataset, data_error = assembly.build_dataset(cfg), None
    except RunError as e:
        if not env.distributed:
            raise
        dataset, data_error = None, str(e)  # said on every rank once they have met, not a hang

    from gossip import comm as gcomm

    runner: Run | None = None
    try:
        comm = _communicator(cfg, env, topo, device, dataset, data_error, size)
        groups = _groups(cfg, env, topo, device, comm, size) if size > 1 else None
        runner = Run(cfg, env, topo, device, dataset, comm, groups=groups)
        return runner.train()
    except gcomm.PeerError as e:
        log = runner.log_failure(e) if runner is not None else None
        raise RunError(str(e) + (f"; details in {log}" if log is not None else "")) from None
    except RunError:  # the user's to act on, whole in its one line; a refused resume writes nothing
        raise
    except rundir.RunDirError as e:  # a file of the run directory that cannot be read
        raise RunError(str(e)) from None
    except OSError as e:
        if e.filename is None:  # not a file's: the detail to the rank's log, as for any failure
            if runner is not None:
                runner.log_failure(e)
            raise
        log = runner.log_failure(e) if runner is not None else None
        raise RunError(_os_error_line(e, runner) + (f"; details in {log}" if log is not None else "")) from None
    except BaseException as e:  # an interrupt, SIGTERM, a bug: the detail to the rank's log
        if runner is not None:
            runner.log_failure(e)
        raise
    finally:
        if env.distributed:
            gcomm.shutdown()  # gloo's threads joined before the interpreter exits


def _check_resume_dir(cfg: TrainConfig) -> None:
    if cfg.run.resume in (None, RESUME_AUTO):
        return
    try:
        is_dir = Path(cfg.run.resume).is_dir()
    except OSError as e:  # a name too long for the file system, a loop of links
        raise RunError(f"--resume {cfg.run.resume!r}: {e.strerror or e}") from None
    if not is_dir:
        raise RunError(f"--resume {cfg.run.resume!r}: no such run directory")


def _communicator(cfg: TrainConfig, env: Env, topo, device, dataset, data_error: str | None, size: int = 1):
    """The process group and a communicator over it (the ranks agree on the config and
    the data before anything is exchanged or written), or the simulated one. In groups
    of ``size`` > 1: under torchrun one over all ranks (no graph: the groups' graph is
    the inter-group communicator's), in the simulation one row per group on the groups' graph."""
    from gossip import comm as gcomm

    if env.distributed:
        agreement.init_group(cfg, env, device)
        agreement.agree_config(cfg, env, dataset, data_error)
        comm = gcomm.DistCommunicator(topo if size == 1 else None, device=device, timeout=cfg.comm.timeout)
    else:
        comm = gcomm.SimulatedCommunicator(topo, world_size=env.world_size // size, device=device)
    if cfg.comm.emulate_latency:
        from gossip.comm.latency import LatencyCommunicator

        comm = LatencyCommunicator(comm, cfg.comm.emulate_latency / 1000.0)
    return comm


class RunGroups:
    """A run in groups (``--group-size`` G > 1): the algorithm between the groups
    (:class:`gossip.groups.Grouped`), the communicator inside the group(s) and the
    ledger of the traffic between groups. ``members``: the ranks (data shards) of each
    hosted row (a group in the simulation; the rank itself under torchrun); ``ranks``:
    how many ranks this process holds (N in the simulation, 1 under torchrun)."""

    def __init__(self, size: int, algo, intra, inter_ledger, members: list[list[int]], ranks: int) -> None:
        self.size, self.algo, self.intra, self.inter_ledger = size, algo, intra, inter_ledger
        self.members, self.ranks = members, ranks

    def checkpointed(self, ledger) -> "LevelLedgers":
        """What a checkpoint keeps of the traffic: the run's ``ledger`` and the levels'
        (inside the group; between groups where that is not the run's, under torchrun)."""
        levels = {"intra": self.intra.ledger}
        if self.inter_ledger is not ledger:
            levels["inter"] = self.inter_ledger
        return LevelLedgers(ledger, levels)

    def bytes_by_level(self, steps: int) -> dict[str, float]:
        """Bytes one rank sent per step inside its group and between groups (this process's ranks)."""
        per = max(1, steps) * self.ranks
        return {"intra": self.intra.ledger.step_bytes_sent / per, "inter": self.inter_ledger.step_bytes_sent / per}


class LevelLedgers:
    """The run's ledger with those of a run in groups' levels, saved and restored
    together (a checkpoint's ``ledger``: the run's state, plus ``levels``)."""

    def __init__(self, run, levels: dict) -> None:
        self.run, self.levels = run, levels

    def state_dict(self) -> dict:
        return {**self.run.state_dict(), "levels": {k: v.state_dict() for k, v in self.levels.items()}}

    def load_state_dict(self, sd: dict) -> None:
        sd = dict(sd)
        levels = sd.pop("levels", {})
        self.run.load_state_dict(sd)
        for k, ledger in self.levels.items():
            if k in levels:
                ledger.load_state_dict(levels[k])


def _groups(cfg: TrainConfig, env: Env, topo, device, comm, size: int) -> RunGroups:
    """The parts of a run in groups of ``size``: under torchrun the group's and the
    inter-group process groups (every rank creates all of them), in the simulation one
    communicator per slice, each on the groups' graph, recording into the run's ledger."""
    from gossip import comm as gcomm
    from gossip.groups import GroupPlan, Grouped, SliceLedger, init_groups

    plan = GroupPlan(env.world_size, size)
    n = plan.groups
    if env.distributed:
        dg = init_groups(size)
        inter = dg.inter_comm(topo, timeout=cfg.comm.timeout, device=device)
        template = assembly.build_algorithm(cfg, inter)
        runs = ({dg.member: inter} if template.shards_flat else ({0: inter} if dg.member == 0 else {}))
        intra = dg.intra_comm(timeout=cfg.comm.timeout, device=device)
        members, ranks, inter_ledger = [[env.rank]], 1, inter.ledger
    else:
        template = assembly.build_algorithm(cfg, gcomm.SimulatedCommunicator(topo, world_size=n, device=device))
        runs = {j: gcomm.SimulatedCommunicator(topo, world_size=n, device=device,
                                               ledger=SliceLedger(comm.ledger, j))
                for j in range(size if template.shards_flat else 1)}
        intra = gcomm.SimulatedCommunicator(world_size=size, device=device)
        members, ranks, inter_ledger = [plan.group_ranks(k) for k in range(n)], env.world_size, comm.ledger
    try:
        algo = Grouped(lambda c: assembly.build_algorithm(cfg, c), comm, inter=runs, intra=intra, group_size=size,
                       sharded=template.shards_flat, template=template)
    except ValueError as e:
        raise RunError(f"--group-size {size}: {e}") from None
    return RunGroups(size, algo, intra, inter_ledger, members, ranks)


#: what to do about a file system's refusal, by errno
_OS_HINTS = {"ENOSPC": "free some space", "EDQUOT": "free some space (disk quota)",
             "EACCES": "make the run directory writable", "EPERM": "make the run directory writable",
             "EROFS": "the file system is read-only: give another --out",
             "ENAMETOOLONG": "give a shorter --out"}


def _os_error_line(e: OSError, runner: Run | None) -> str:
    """One line for a refusal of the file system: the file, the cause, what was kept."""
    name = errno.errorcode.get(e.errno or 0, "")
    line = f"{e.filename}: {e.strerror or e}" + (f" ({name})" if name else "")
    if runner is not None:
        kept = sorted(checkpoint.list_checkpoints(runner.out)) if runner.out.is_dir() else []
        line += (f"; the run stopped at step {runner.progress.step}; "
                 + (f"its checkpoints (newest: step {kept[-1]}) are intact" if kept else "no checkpoint was written"))
        hint = _OS_HINTS.get(name)
        if hint:
            line += f": {hint}" + (f", then --resume {str(runner.out)!r}" if kept else "")
    elif _OS_HINTS.get(name):
        line += f": {_OS_HINTS[name]}"
    return line


# --------------------------------------------------------------------------------------
# the run's extension points: the plain run's, which a fault-tolerant replica replaces
# --------------------------------------------------------------------------------------
class Build:
    """How the run is made: its parts (:meth:`parts`: the run directory, the algorithm,
    the hosted nodes, their optimizers and loaders, ``nodes``, ``ledger``, ``hosts``),
    then, once the schedule is known, its records (:meth:`log`) and its checkpoints
    (:meth:`checkpoints`: an object with ``check_finished``, ``resume`` and ``save``, as
    :class:`~gossip.train.checkpoint.CheckpointManager`). The plain run's ranks agreed on
    the config before they were built, so it claims its run directory here."""

    def parts(self, run: Run) -> None:
        run._build_parts()

    def log(self, run: Run) -> metrics.RunLog:
        return metrics.RunLog(run.cfg, run.env, run.comm, run.out, run.steps_per_epoch)

    def checkpoints(self, run: Run) -> Checkpoints:
        return CheckpointManager(
            run.out, run.env, run.comm, run.cfg, run.cfg_dict, gopt=run.gopt, loaders=run.loaders,
            batches=run.batches, ledger=run.ledger if run.groups is None else run.groups.checkpointed(run.ledger),
            corpus=(run.dataset.corpus or {}).get("corpus", run.cfg.data.name), say=run.log.say)


class Start:
    """How the run starts once its checkpoint is restored (:meth:`open`), and what it
    releases however it ends (:meth:`close`). The plain run's ranks have agreed already:
    ``config.json`` on rank 0 of a fresh run, the metrics files (a resumed run's records
    after its step dropped), the header line and the progress bar, at once."""

    def open(self, run: Run, resumed: bool) -> None:
        cfg = run.cfg
        if run.is_main and run.progress.step == 0:
            rundir.write_json(rundir.config_path(run.out), metrics.config_record(
                run.facts(), cfg_dict=run.cfg_dict, layout=run.gopt.layout, corpus=run.dataset.corpus))
        run.log.open(keep=run.progress.step if resumed else None)
        run.log.say(metrics.header(cfg, run.env, run.dim, run.algo))
        if run.sim_path is not None:
            run.log.say(assembly.path_line(run.env.world_size, run.sim_path, run.sim_why))
        run.log.start_bar(run.progress.step, run.stop)

    def close(self, run: Run) -> None:
        """Nothing to release: the process group is :func:`run`'s."""


class Evaluation:
    """How the run evaluates at an epoch's end: the figures of the epoch line and the
    eval record, with ``train_loss`` (the nodes' mean training loss over the epoch).
    The plain run's: the averaged model (and each node's, with ``--node-eval``) on the
    test set, and the train loss averaged over every node (collectives under torchrun)."""

    def evaluate(self, run: Run) -> dict[str, float]:
        if run.sim_path == "vectorized":  # batched over the nodes (classification only takes this path)
            ev = evaluation.evaluate_vectorized(run.gopt, run.dataset, run.device, nodes=run.cfg.run.node_eval)
        else:
            ev = evaluation.evaluate(run.gopt, run.models, run.dataset, run.device, run.comm,
                                     nodes=run.cfg.run.node_eval)
        # mean training loss of the nodes over the epoch's steps
        ev["train_loss"] = evaluation.mean_over_nodes(
            run.comm, [sum(v) / max(1, len(v)) for v in run.progress.epoch_losses])
        return ev


@dataclass
class RunHooks:
    """The run's extension points, each an object the run owns: how it is built
    (:class:`Build`, which also makes its log and its checkpoints), how it starts and
    ends (:class:`Start`), how it evaluates (:class:`Evaluation`). The defaults are the
    plain run's; :mod:`gossip.train.fault_tolerance` supplies a replica's."""

    build: Build = field(default_factory=Build)
    start: Start = field(default_factory=Start)
    evaluation: Evaluation = field(default_factory=Evaluation)


class Run:
    """One training run: built from its parts, then stepped, evaluated, checkpointed.

    ``train()`` is the whole of it: a resume (with ``--resume``), then :meth:`step`
    until the end, :meth:`end_epoch` after each epoch's last step, a checkpoint every
    ``--checkpoint-every`` steps, and :meth:`finish`. The jobs are the components':
    ``self.ckpt`` (:class:`~gossip.train.checkpoint.CheckpointManager`) saves and resumes,
    ``self.log`` (:class:`~gossip.train.metrics.RunLog`) records and prints. How the run
    is built, starts, evaluates and checkpoints are its :class:`RunHooks` (``hooks``;
    the plain run's by default): a subclass that steps another way (a fault-tolerant
    replica) overrides :meth:`step` and :meth:`finish` and supplies its own hooks.
    """

    def __init__(self, cfg: TrainConfig, env: Env, topo, device, dataset, comm, *, groups: RunGroups | None = None,
                 hooks: RunHooks | None = None) -> None:
        self.cfg, self.env, self.topo, self.device, self.dataset, self.comm = cfg, env, topo, device, dataset, comm
        self.groups = groups
        self.hooks = hooks if hooks is not None else RunHooks()
        self.hooks.build.parts(self)
        self.task = dataset.task
        self.loss = evaluation.loss_fn(dataset.task)
        self.steps_per_epoch = self.loaders[0].steps_per_epoch
        self.total = cfg.run.epochs * self.steps_per_epoch  # the schedule spans the whole run
        self.stop = self.total if cfg.run.max_steps is None else min(self.total, cfg.run.max_steps)
        self.lr_at = assembly.lr_schedule(cfg, self.total)
        self.progress = Progress.fresh(len(self.nodes))
        # full-precision D-PSGD's bytes per node per step on this topology, for the ratio
        self.dpsgd_bytes = metrics.dpsgd_bytes(cfg, topo, env.world_size // (groups.size if groups else 1), self.dim)
        self.last_eval: dict[str, Any] = {}
        self.log = self.hooks.build.log(self)
        self.ckpt = self.hooks.build.checkpoints(self)
        self._t0 = 0.0
        self._first_step = 0

    def _build_parts(self) -> None:
        """The plain run's parts (:meth:`Build.parts`): the run directory, the algorithm,
        the hosted nodes and their loaders, checked in this order, then the directory claimed."""
        cfg, env, comm, dataset, groups = self.cfg, self.env, self.comm, self.dataset, self.groups
        self._mem0 = assembly.peak_memory(self.device)  # for the memory line at the end: what the nodes add to it
        self.nodes = [int(i) for i in comm.nodes]
        self.is_main = env.rank == 0
        self.out = agreement.agree_out_dir(cfg, env)
        self.cfg_dict = cfg.to_dict()
        if dataset.corpus is not None and dataset.corpus.get("sha256"):
            self.cfg_dict["corpus_sha256"] = dataset.corpus["sha256"]
        # the nodes' speeds and the link the run's time is modelled on
        try:
            self.speeds = speeds.parse(cfg.comm.node_speed, env.world_size)
        except speeds.SpeedError as e:
            raise RunError(str(e)) from None
        self.link = link_of(cfg.comm.link)
        # Step 1: the algorithm, then identical x_1 on every node with its local optimizer
        self.algo = assembly.build_algorithm(cfg, comm) if groups is None else groups.algo
        if groups is not None and algorithms.algorithm_class(cfg.algorithm.name).asynchronous:
            raise RunError(f"--algo {cfg.algorithm.name} steps one node at a time on the event clock: it does not "
                           f"run in groups (give --group-size 1)")
        if self.algo.asynchronous:
            if env.distributed:
                raise RunError(f"--algo {cfg.algorithm.name} runs in the simulation (--simulate N) on the event "
                               f"clock; under torchrun it is not available yet")
            if cfg.run.resume is not None:
                raise RunError(f"--resume: --algo {cfg.algorithm.name}'s event clock and the updates in flight are "
                               f"not in its checkpoints, so a resume cannot continue it exactly; start it again")
        #: the event clock of an asynchronous algorithm (made in begin), and its updates in flight
        self.clock: clock.EventClock | None = None
        #: the Byzantine nodes and their attack (None: every node honest)
        self.adversary = assembly.build_adversary(cfg, env.world_size, dataset)
        if self.adversary is not None:
            self.algo.set_adversary(self.adversary)
        self.copies = assembly.state_copies(cfg)  # of the parameters, per node: for the memory check
        self._build_nodes()
        self.dim = self.gopt.flat.dim
        # Step 2: each node's shard of the training data
        self._build_loaders()
        agreement.claim_out(cfg, self.out, env.distributed, self.is_main, comm)  # after every check above
        self.ledger = comm.ledger
        self.hosts = assembly.hosts_of(env)

    def _build_nodes(self) -> None:
        """The hosted nodes' models (one batched model on the vectorized path), their local
        optimizers and the optimizer that couples them with the algorithm."""
        cfg, device = self.cfg, self.device
        torch.manual_seed(cfg.run.seed)
        first = assembly.build_model(cfg, self.dataset, device)
        # before m copies exist: will they fit?
        assembly.check_memory(self.copies, len(self.nodes),
                              sum(p.numel() for p in first.parameters() if p.requires_grad), device)
        #: the simulation's path: "vectorized" (all nodes one batched model) or "loop"; None under torchrun
        self.sim_path, self.sim_why = assembly.simulation_path(cfg, self.env, first, self.dataset, device)
        try:  # the algorithm's setup meets the model here (its layout, the local momentum)
            if self.sim_path == "vectorized":
                self.gopt = vectorized.VectorizedOptimizer(
                    first, lambda ps: assembly.local_optimizer(cfg, None, ps), self.algo)
                self.models, self.opts = self.gopt.models, self.gopt.optimizers
                return
            self.models = [first]
            for _ in self.nodes[1:]:
                torch.manual_seed(cfg.run.seed)
                self.models.append(assembly.build_model(cfg, self.dataset, device))
            self.opts = [assembly.local_optimizer(cfg, m) for m in self.models]
            self.gopt = GossipOptimizer(self.models, self.opts, self.algo)
        except (ValueError, TypeError) as e:
            raise RunError(str(e) if str(e).startswith("--") else f"--algo {cfg.algorithm.name}: {e}") from None

    def _build_loaders(self) -> None:
        cfg, env, dataset = self.cfg, self.env, self.dataset
        try:
            shards = data.partition_dataset(dataset, env.world_size, scheme=cfg.data.partition, seed=cfg.run.seed)
        except ValueError as e:
            raise RunError(f"--partition {cfg.data.partition} over {env.world_size} nodes: {e}; "
                           "use fewer nodes or more data") from None
        ranks = self.nodes if self.groups is None else [r for rs in self.groups.members for r in rs]
        try:
            self.loaders = [data.ShardLoader(dataset.x_train, dataset.y_train, shards[i], cfg.data.batch_size,
                                             seed=cfg.run.seed, node=i, device=self.device) for i in ranks]
        except ValueError as e:
            raise RunError(f"--batch-size {cfg.data.batch_size}: {e}") from None
        # the vectorized path gathers every node's batch in one call, from the same loaders
        self.batches = vectorized.BatchedLoader(self.loaders, self.device) if self.sim_path == "vectorized" else None

    # --- the whole run -----------------------------------------------------------------
    def train(self) -> dict | None:
        """The run from its first (or resumed) step to its summary: :meth:`begin`, then
        :meth:`step` until the end (:meth:`end_epoch` after an epoch's last step, a
        :meth:`checkpoint` every ``--checkpoint-every`` steps), the last checkpoint and
        :meth:`finish`."""
        try:
            return self._train()
        finally:
            self.hooks.start.close(self)

    def _train(self) -> dict | None:
        cfg = self.cfg
        self.begin()
        try:
            while self.progress.step < self.stop:
                before = self.progress.step
                self.step()
                step = self.progress.step
                if step == before:  # no step committed (a fault-tolerant replica's discarded step)
                    continue
                if step % self.steps_per_epoch == 0 or step == self.stop:
                    self.end_epoch()
                if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0 and step < self.stop:
                    self.checkpoint()
        except Diverged as e:
            if self.is_main:
                rundir.write_json(rundir.summary_path(self.out), metrics.diverged_record(
                    self.facts(), e, steps=self.progress.step, wall_time_s=self.elapsed()))
            raise
        finally:
            self.log.close()
        self.checkpoint()
        return self.finish()

    def begin(self) -> None:
        """Before the first step: the resume (with ``--resume``, by ``self.ckpt``), the
        run's :class:`Start` (config.json, the metrics files, the header line and the
        progress bar), the clock."""
        cfg = self.cfg
        self.algo.set_event_sink(self.log.say if self.is_main else None)  # MergeComp's decisions
        resumed = False
        if cfg.run.resume is not None:
            self.ckpt.check_finished(self.stop, self.total)
            restored = self.ckpt.resume(auto=cfg.run.resume == RESUME_AUTO)
            resumed = restored is not None
            self.progress = restored or self.progress
        self.hooks.start.open(self, resumed)
        self._t0 = time.perf_counter() - self.progress.elapsed_s  # wall time across resumes
        self._first_step = self.progress.step  # this process's first step is its warm-up
        if self.algo.asynchronous:
            self._start_clock()

    def log_failure(self, exc: BaseException) -> Path | None:
        """Append the full detail of what stopped this rank to ``error-rank<k>.log`` in
        the run directory (the rank prints one line); its path, or None if it cannot be
        written (the run directory is gone or read-only: the line still says what failed)."""
        import traceback

        path = rundir.error_log_path(self.out, self.env.rank)
        lines = [f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {self.env.rank} of {self.env.world_size} "
                 f"on {socket.gethostname()}, at step {self.progress.step}: {type(exc).__name__}: {exc}"]
        detail = getattr(exc, "detail", "")
        if detail:
            lines.append(f"backend: {detail}")
        lines.append("".join(traceback.format_exception(exc)).rstrip())
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n\n")
        except OSError:
            return None
        return path

    # --- one step ----------------------------------------------------------------------
    def step(self) -> None:
        """Local gradients of every hosted node, then the optimizer and algorithm step."""
        p, ledger = self.progress, self.ledger
        lr = self.lr_at(p.step)
        for o in self.opts:
            for g in o.param_groups:
                g["lr"] = lr
        warm = ledger.warmup() if p.step == self._first_step else contextlib.nullcontext()
        with warm:  # this process's first step: compilation and first calls
            losses = self._local_step()
        ledger.step()
        p.step += 1
        for r, v in enumerate(losses):
            p.log_losses[r].append(v)
            p.epoch_losses[r].append(v)
        self.log.step(losses)
        if p.step % self.cfg.run.log_every == 0 or p.step == self.stop:
            self.log.train(p.step, p.log_losses, lr, self.elapsed(), ledger)
            p.log_losses = [[] for _ in self.nodes]

    def _local_step(self) -> list[float]:
        p, ledger = self.progress, self.ledger
        if self.clock is not None:
            return self._async_step()
        self.gopt.zero_grad()
        losses = []
        if self.groups is not None:  # each group's members' gradients, averaged inside the group
            losses = self._group_gradients()
        else:
            with ledger.phase("compute"):
                t0 = time.perf_counter()
                if self.batches is not None:  # vectorized: every node's forward and backward in one call
                    xb, yb = self.batches.next_batch()
                    if self.adversary is not None:  # labelflip: the attackers train on flipped labels
                        yb = self.adversary.flip_labels(yb, self.comm.nodes, self.dataset.num_classes)
                    losses = self.gopt.forward_backward(xb, yb).tolist()
                else:
                    for i, m_, ld in zip(self.nodes, self.models, self.loaders):
                        xb, yb = ld.next_batch()
                        if self.adversary is not None:
                            yb = self.adversary.flip_labels(yb, torch.tensor([i]), self.dataset.num_classes)
                        loss = self.loss(m_(xb), yb)
                        loss.backward()
                        losses.append(float(loss.detach()))
                if self.env.distributed and not self.speeds.uniform:
                    self._sleep_extra(p.step, time.perf_counter() - t0)
        bad = [i for i, v in zip(self.nodes, losses) if not math.isfinite(v)]
        if bad:
            raise Diverged(f"training diverged at step {p.step + 1}: non-finite loss on node(s) {bad}")
        try:
            self.gopt.step()
        except NonFiniteError as e:  # by type: a compressor met NaN/inf or an overflowing scale
            raise Diverged(f"training diverged at step {p.step + 1}: {e}") from None
        return losses

    def _group_gradients(self) -> list[float]:
        """Inside each hosted group: every member's forward and backward on its own shard,
        then the full-precision all-reduce of their gradients over the group (the mean),
        as DDP inside a group does; one loss per hosted row (the mean of its members')."""
        groups, ledger = self.groups, self.ledger
        layout = self.gopt.flat
        grads, losses = [], []
        loaders = iter(self.loaders)
        with ledger.phase("compute"):
            for m_, members in zip(self.models, groups.members):
                mine = []
                for _ in members:
                    ld = next(loaders)
                    m_.zero_grad(set_to_none=True)
                    xb, yb = ld.next_batch()
                    loss = self.loss(m_(xb), yb)
                    loss.backward()
                    mine.append(float(loss.detach()))
                    grads.append(torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                                            for p in (p for p in m_.parameters() if p.requires_grad)]))
                losses.append(sum(mine) / len(mine))
        # (hosted members, hosted groups, d): member-major, as the intra communicator hosts the members
        G = torch.stack(grads).view(len(self.models), -1, layout.dim).transpose(0, 1).contiguous()
        with ledger.phase("communicate"):
            G = groups.intra.all_reduce(G, op="sum")
        layout.scatter_grads(G[0].div_(groups.size))
        return losses

    def _sleep_extra(self, step: int, took: float) -> None:
        """Under torchrun, a slower node than this machine: sleep for the time its
        compute takes beyond what this rank measured (a trace's seconds, or its
        multiplier times the measurement)."""
        want = float(self.speeds.times(step, took)[self.env.rank])
        if want > took:
            time.sleep(want - took)

    # --- the event clock of an asynchronous algorithm -------------------------------------
    def _exchange_s(self) -> float:
        """Modelled seconds of one pairwise exchange on the link: the model's payload."""
        c = self.algo.payload_compressor
        return self.link.transfer_s(c.payload_nbytes(self.dim))

    def _event_clock(self, base: float, exchange_s: float) -> clock.EventClock:
        return clock.EventClock(self.speeds, base, exchange_s, self.algo.active, self.algo.choose)

    def _start_clock(self) -> None:
        """Every node starts computing its first gradient at x_1, on a clock ordered by
        --compute-time and the link (unset: by the nodes' speeds alone)."""
        ct = self.cfg.comm.compute_time
        self.clock = self._event_clock(1.0 if ct is None else ct, 0.0 if ct is None else self._exchange_s())
        self._events = 0
        self._pending = [self._node_update(i) for i in range(len(self.nodes))]
        self._last_loss = [v for _, v in self._pending]

    def _node_update(self, i: int) -> tuple[torch.Tensor, float]:
        """Node ``i`` reads its model, computes a gradient on its next batch and its local
        optimizer's step from there: the update (applied when its step ends) and the loss."""
        X, m_, opt = self.gopt.flat.data, self.models[i], self.opts[i]
        with self.ledger.phase("compute"):
            opt.zero_grad(set_to_none=True)
            xb, yb = self.loaders[i].next_batch()
            loss = self.loss(m_(xb), yb)
            loss.backward()
            with torch.no_grad():
                x_t = X[i].clone()
                opt.step()
                u = X[i] - x_t
                X[i].copy_(x_t)
        return u, float(loss.detach())

    def _async_step(self) -> list[float]:
        """One step of the run on the event clock: as many node steps as there are nodes
        (the same number of gradients as a synchronous step), in modelled time. Each
        averages with its partner (active nodes), applies the update computed at the
        model it read when it started, and starts its next gradient. A node's loss is
        the mean of the gradients it applied in this step (its last one if none)."""
        X = self.gopt.flat.data
        got: list[list[float]] = [[] for _ in self.nodes]
        for _ in range(len(self.nodes)):
            ev = self.clock.next()
            i = ev.node
            if ev.partner is not None:
                self.algo.average_pair(X, i, ev.partner)
            u, loss = self._pending[i]
            with torch.no_grad():
                X[i] += u
            got[i].append(loss)
            self._events += 1
            self._pending[i] = self._node_update(i)
        losses = []
        for i, g in enumerate(got):
            if g:
                self._last_loss[i] = sum(g) / len(g)
            losses.append(self._last_loss[i])
        bad = [i for i, v in zip(self.nodes, losses) if not math.isfinite(v)]
        if bad:
            raise Diverged(f"training diverged at step {self.progress.step + 1}: non-finite loss on node(s) {bad}")
        return losses

    def modelled_time(self) -> float | None:
        """Modelled seconds of the run on ``--link`` at the nodes' speeds: each synchronous
        step the slowest node's compute plus the step's messages and codec time; an
        asynchronous run's steps on the event clock. A node's compute at speed 1 is
        ``--compute-time``, else this process's measured mean (warm-up left out)."""
        steps = self.progress.step
        if steps == 0:
            return None
        led, m = self.ledger, len(self.nodes)
        times = led.times
        ct = self.cfg.comm.compute_time
        if ct is None:
            done = max(1, steps - self._first_step - 1)  # the first step's compute is warm-up
            per_node = times.get("compute", 0.0) / (m * done)
            # under torchrun the rank's measurement holds its own slowness: back to speed 1
            own = 1.0 if self.speeds.trace is not None or not self.env.distributed else \
                float(self.speeds.multipliers[self.env.rank])
            ct = per_node / own
        codec = times.get("compress", 0.0) / m
        if self.clock is not None:
            if self.cfg.comm.compute_time is not None:
                return self.clock.now + codec
            replay = self._event_clock(ct, self._exchange_s())  # the same events, timed with the measurement
            for _ in range(self._events):
                replay.next()
            return replay.now + codec
        n = self.env.world_size
        ops = led.as_dict()["ops"]
        rounds = sum(v["calls"] * clock.rounds_of(op, n) for op, v in ops.items() if op != "control")
        link_s = self.link.transfer_s(led.step_bytes_sent / m, rounds)
        return clock.sync_time(self.speeds, steps, ct, link_s) + codec

    def facts(self) -> metrics.RunFacts:
        """What config.json and summary.json say about this run."""
        return metrics.RunFacts(
            cfg=self.cfg, algo=self.algo, world_size=self.env.world_size, mode=self.env.mode,
            hosts=self.hosts, dim=self.dim, task=self.task,
            topology=self.cfg.comm.topology if self.topo is not None else None, pooled=self.env.distributed)

    def elapsed(self) -> float:
        """Wall time of the run so far, across resumes."""
        return time.perf_counter() - self._t0

    # --- one epoch's end ---------------------------------------------------------------
    def end_epoch(self) -> None:
        """Evaluate the averaged model, log it, print the epoch line."""
        p, spe = self.progress, self.steps_per_epoch
        ev = self.hooks.evaluation.evaluate(self)
        p.epoch_losses = [[] for _ in self.nodes]
        self.log.eval(p.step, ev, self.elapsed())
        self.last_eval = ev
        levels = None if self.groups is None else self.groups.bytes_by_level(p.step)
        self.log.say(metrics.epoch_line(p.step / spe, self.cfg.run.epochs, ev, self.ledger, self.dpsgd_bytes, p.step,
                                        self.task, levels=levels))
        self.algo.on_epoch_end(p.step // spe)

    def checkpoint(self) -> None:
        """This rank's checkpoint of the current step (atomic: temporary file, rename)."""
        self.progress.elapsed_s = self.elapsed()
        self.ckpt.save(self.progress)

    # --- the end -------------------------------------------------------------------------
    def finish(self) -> dict | None:
        """summary.json on rank 0; returns it there (None elsewhere)."""
        summary = metrics.summary_record(  # a collective: every rank
            self.facts(), steps=self.progress.step, ledger=self.ledger, comm=self.comm, last_eval=self.last_eval,
            dpsgd_bytes=self.dpsgd_bytes, wall_time_s=self.elapsed(), groups=self.groups,
            modelled_time_s=self.modelled_time())
        if not self.is_main:
            return None
        if self.adversary is not None or self.cfg.trust.aggregator or self.cfg.trust.robust:
            summary["trust"] = {**(self.adversary.describe() if self.adversary is not None else
                                   {"attack": None, "attackers": []}),
                                "aggregator": self.cfg.trust.aggregator, "robust": self.cfg.trust.robust}
        rundir.write_json(rundir.summary_path(self.out), summary)
        if self.sim_path is not None and self.env.world_size > 1:
            print(assembly.memory_line(self.copies, self.env.world_size, self.dim, self._mem0, self.device), flush=True)
        print(f"run directory: {self.out}", flush=True)
        return summary
