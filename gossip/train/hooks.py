"""The run's extension points, :class:`RunHooks`: how a :class:`gossip.train.loop.Run` is
built (:class:`Build`: its parts, its log, its checkpoints), how it starts and ends
(:class:`Start`) and how it evaluates (:class:`Evaluation`).

The classes here are the plain run's; a fault-tolerant replica
(:mod:`gossip.train.fault_tolerance`) subclasses each and supplies its own. A hook takes
the run and sets or reads its attributes; this module does not import the loop, which
imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gossip import algorithms, data, rundir, speeds, vectorized
from gossip.errors import RunError
from gossip.runtime import GossipOptimizer
from gossip.train import agreement, assembly, evaluation, metrics
from gossip.train.checkpoint import CheckpointManager, Checkpoints
from gossip.train.config import link_of

__all__ = ["Build", "Evaluation", "RunHooks", "Start"]

#: a :class:`gossip.train.loop.Run` (or a subclass): the hooks' argument
RunLike = Any


class Build:
    """How the run is made: its parts (:meth:`parts`: the run directory, the algorithm,
    the hosted nodes, their optimizers and loaders, ``nodes``, ``ledger``, ``hosts``),
    then, once the schedule is known, its records (:meth:`log`) and its checkpoints
    (:meth:`checkpoints`: an object with ``check_finished``, ``resume`` and ``save``, as
    :class:`~gossip.train.checkpoint.CheckpointManager`). The plain run's ranks agreed on
    the config before they were built, so it claims its run directory here."""

    def parts(self, run: RunLike) -> None:
        """The plain run's parts: the run directory, the algorithm, the hosted nodes and
        their loaders, checked in this order, then the directory claimed."""
        cfg, env, comm = run.cfg, run.env, run.comm
        run.mem0 = assembly.peak_memory(run.device)  # for the memory line at the end: what the nodes add to it
        run.nodes = [int(i) for i in comm.nodes]
        run.is_main = env.rank == 0
        run.out = agreement.agree_out_dir(cfg, env)
        try:
            self._checked_parts(run)
        except BaseException:
            agreement.drop_unclaimed_default(cfg, run.out, run.is_main)
            raise

    def _checked_parts(self, run: RunLike) -> None:
        """The checks and parts of :meth:`parts` once the run directory is chosen, then
        the directory claimed."""
        cfg, env, comm, dataset, groups = run.cfg, run.env, run.comm, run.dataset, run.groups
        run.cfg_dict = cfg.to_dict()
        if dataset.corpus is not None and dataset.corpus.get("sha256"):
            run.cfg_dict["corpus_sha256"] = dataset.corpus["sha256"]
        # the nodes' speeds and the link the run's time is modelled on
        try:
            run.speeds = speeds.parse(cfg.comm.node_speed, env.world_size)
        except speeds.SpeedError as e:
            raise RunError(str(e)) from None
        run.link = link_of(cfg.comm.link)
        # Step 1: the algorithm, then identical x_1 on every node with its local optimizer
        run.algo = assembly.build_algorithm(cfg, comm) if groups is None else groups.algo
        if groups is not None and algorithms.algorithm_class(cfg.algorithm.name).asynchronous:
            raise RunError(f"--algo {cfg.algorithm.name} steps one node at a time on the event clock: it does not "
                           f"run in groups (give --group-size 1)")
        if run.algo.asynchronous:
            if env.distributed and cfg.run.tensorboard:
                raise RunError(f"--tensorboard: its mean over the ranks is a collective at every logged step, a "
                               f"barrier --algo {cfg.algorithm.name} runs without under torchrun; drop "
                               f"--tensorboard (metrics-rank<k>.jsonl has every rank's records)")
            if env.distributed and cfg.comm.emulate_latency:
                raise RunError(f"--emulate-latency delays the communicator's rounds, and --algo "
                               f"{cfg.algorithm.name}'s pairwise exchanges under torchrun go around them; shape the "
                               f"links instead (tc on the netns cluster, experiments/vcluster.py)")
            if cfg.run.resume is not None and env.distributed:
                raise RunError(f"--resume: --algo {cfg.algorithm.name} under torchrun saves each rank at its own "
                               f"moment, with exchanges in flight, so a resume cannot continue the run; start it "
                               f"again (the simulation, --simulate N, resumes exactly)")
        #: the event clock of an asynchronous algorithm and its updates in flight
        #: (:class:`~gossip.train.timing.AsyncClock`, made in ``Run.begin``)
        run.clock = None
        #: the Byzantine nodes and their attack (None: every node honest)
        run.adversary = assembly.build_adversary(cfg, env.world_size, dataset)
        if run.adversary is not None:
            run.algo.set_adversary(run.adversary)
        run.copies = assembly.state_copies(cfg)  # of the parameters, per node: for the memory check
        self._nodes(run)
        run.dim = run.gopt.flat.dim
        # Step 2: each node's shard of the training data
        self._loaders(run)
        agreement.claim_out(cfg, run.out, env.distributed, run.is_main, comm)  # after every check above
        run.ledger = comm.ledger
        run.hosts = assembly.hosts_of(env)

    def _nodes(self, run: RunLike) -> None:
        """The hosted nodes' models (one batched model on the vectorized path), their local
        optimizers and the optimizer that couples them with the algorithm."""
        cfg, device = run.cfg, run.device
        torch.manual_seed(cfg.run.seed)
        first = assembly.build_model(cfg, run.dataset, device)
        # before m copies exist: will they fit?
        assembly.check_memory(run.copies, len(run.nodes),
                              sum(p.numel() for p in first.parameters() if p.requires_grad), device)
        #: the simulation's path: "vectorized" (all nodes one batched model) or "loop"; None under torchrun
        run.sim_path, run.sim_why = assembly.simulation_path(cfg, run.env, first, run.dataset, device)
        try:  # the algorithm's setup meets the model here (its layout, the local momentum)
            if run.sim_path == "vectorized":
                run.gopt = vectorized.VectorizedOptimizer(
                    first, lambda ps: assembly.local_optimizer(cfg, None, ps), run.algo)
                run.models, run.opts = run.gopt.models, run.gopt.optimizers
                return
            run.models = [first]
            for _ in run.nodes[1:]:
                torch.manual_seed(cfg.run.seed)
                run.models.append(assembly.build_model(cfg, run.dataset, device))
            run.opts = [assembly.local_optimizer(cfg, m) for m in run.models]
            run.gopt = GossipOptimizer(run.models, run.opts, run.algo)
        except (ValueError, TypeError) as e:
            raise RunError(str(e) if str(e).startswith("--") else f"--algo {cfg.algorithm.name}: {e}") from None

    def _loaders(self, run: RunLike) -> None:
        cfg, env, dataset = run.cfg, run.env, run.dataset
        try:
            shards = data.partition_dataset(dataset, env.world_size, scheme=cfg.data.partition, seed=cfg.run.seed)
        except ValueError as e:
            raise RunError(f"--partition {cfg.data.partition} over {env.world_size} nodes: {e}; "
                           "use fewer nodes or more data") from None
        ranks = run.nodes if run.groups is None else [r for rs in run.groups.members for r in rs]
        try:
            run.loaders = [data.ShardLoader(dataset.x_train, dataset.y_train, shards[i], cfg.data.batch_size,
                                            seed=cfg.run.seed, node=i, device=run.device) for i in ranks]
        except ValueError as e:
            raise RunError(f"--batch-size {cfg.data.batch_size}: {e}") from None
        # the vectorized path gathers every node's batch in one call, from the same loaders
        run.batches = vectorized.BatchedLoader(run.loaders, run.device) if run.sim_path == "vectorized" else None

    def log(self, run: RunLike) -> metrics.RunLog:
        return metrics.RunLog(run.cfg, run.env, run.comm, run.out, run.steps_per_epoch)

    def checkpoints(self, run: RunLike) -> Checkpoints:
        return CheckpointManager(
            run.out, run.env, run.comm, run.cfg, run.cfg_dict, gopt=run.gopt, loaders=run.loaders,
            batches=run.batches, ledger=run.ledger if run.groups is None else run.groups.checkpointed(run.ledger),
            corpus=(run.dataset.corpus or {}).get("corpus", run.cfg.data.name), say=run.log.say,
            clock=(lambda: run.clock) if run.algo.asynchronous and not run.env.distributed else None)


class Start:
    """How the run starts once its checkpoint is restored (:meth:`open`), and what it
    releases however it ends (:meth:`close`). The plain run's ranks have agreed already:
    ``config.json`` on rank 0 of a fresh run, the metrics files (a resumed run's records
    after its step dropped), the header line and the progress bar, at once."""

    def open(self, run: RunLike, resumed: bool) -> None:
        cfg = run.cfg
        if run.is_main and run.progress.step == 0:
            rundir.write_json(rundir.config_path(run.out), metrics.config_record(
                run.facts(), cfg_dict=run.cfg_dict, layout=run.gopt.layout, corpus=run.dataset.corpus))
        run.log.open(keep=run.progress.step if resumed else None)
        run.log.say(metrics.header(cfg, run.env, run.dim, run.algo))
        if run.sim_path is not None:
            run.log.say(assembly.path_line(run.env.world_size, run.sim_path, run.sim_why))
        run.log.start_bar(run.progress.step, run.stop)

    def close(self, run: RunLike) -> None:
        """Nothing to release: the process group is :func:`gossip.train.loop.run`'s."""


class Evaluation:
    """How the run evaluates at an epoch's end: the figures of the epoch line and the
    eval record, with ``train_loss`` (the nodes' mean training loss over the epoch).
    The plain run's: the averaged model (and each node's, with ``--node-eval``) on the
    test set, and the train loss averaged over every node (collectives under torchrun)."""

    def evaluate(self, run: RunLike) -> dict[str, float]:
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
