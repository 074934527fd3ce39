"""The training run behind ``gossip.train``: build, train, evaluate, log, checkpoint.

One code path serves both modes: under torchrun a process hosts its own rank
(``m = 1``); with ``--simulate N`` one process hosts all N nodes (``m = N``). Either way
the hosted nodes' parameters are the rows of one ``(m, d)`` buffer and every node
trains on its own shard.

:class:`Run` tells the training story and leaves each job to one component:
:mod:`gossip.train.assembly` builds the parts from the config, :mod:`gossip.train.agreement`
makes the ranks agree before anything is written, :mod:`gossip.train.communicators` makes
the communicators (and a run in groups' parts), :mod:`gossip.train.hooks` holds the run's
extension points (how it is built, starts and evaluates: the plain run's),
:class:`gossip.train.checkpoint.CheckpointManager` saves and resumes,
:class:`gossip.train.metrics.RunLog` records and prints, :mod:`gossip.train.evaluation`
evaluates and :mod:`gossip.train.timing` steps an asynchronous algorithm on the event
clock and models the run's time. Files written to the run directory (see
docs/run-directory.md): ``config.json`` at the start, ``metrics-rank<k>.jsonl`` (one
per node), checkpoints, and ``summary.json`` at the end.
"""

from __future__ import annotations

import contextlib
import errno
import math
import socket
import time
from pathlib import Path
from typing import Any

import torch

from gossip import checkpoint, rundir
from gossip.train import assembly, communicators, evaluation, metrics, timing
from gossip.train.assembly import Env
from gossip.train.checkpoint import CheckpointRecord, Progress
from gossip.train.communicators import RunGroups
from gossip.train.config import FINGERPRINT_KEYS, RESUME_AUTO, TrainConfig, fingerprint_keys
from gossip.train.hooks import Build, Evaluation, RunHooks, Start
from gossip.train.stopping import stop_if_terminated
from gossip.errors import Diverged, Finished, NonFiniteError, RunError

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
    assembly.check_resume_dir(cfg)
    try:
        dataset, data_error = assembly.build_dataset(cfg), None
    except RunError as e:
        if not env.distributed:
            raise
        dataset, data_error = None, str(e)  # said on every rank once they have met, not a hang

    from gossip import comm as gcomm

    runner: Run | None = None
    try:
        comm = communicators.communicator(cfg, env, topo, device, dataset, data_error, size)
        groups = communicators.build_groups(cfg, env, topo, device, comm, size) if size > 1 else None
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
        self.first_step = 0

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
                stop_if_terminated()  # a SIGTERM whose exception was lost where it was raised
                before = self.progress.step
                self.step()
                step = self.progress.step
                if step == before:  # no step committed (a fault-tolerant replica's discarded step)
                    continue
                if step == self.stop:  # exchanges that outlive a step end before the last evaluation
                    self.gopt.finish(final=step == self.total)  # --max-steps short of it: resumable
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
        self.first_step = self.progress.step  # this process's first step is its warm-up
        if self.algo.asynchronous and not self.env.distributed:  # under torchrun: real time, no barrier
            self.clock = timing.AsyncClock(self, saved=getattr(self.ckpt, "restored_clock", None) if resumed else None)

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
        warm = ledger.warmup() if p.step == self.first_step else contextlib.nullcontext()
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
            return self.clock.step()
        self.gopt.zero_grad()
        losses = []
        if self.groups is not None:  # each group's members' gradients, averaged inside the group
            losses = self.groups.gradients(self)
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

    def _sleep_extra(self, step: int, took: float) -> None:
        """Under torchrun, a slower node than this machine: sleep for the time its
        compute takes beyond what this rank measured (a trace's seconds, or its
        multiplier times the measurement)."""
        want = float(self.speeds.times(step, took)[self.env.rank])
        if want > took:
            time.sleep(want - took)

    def modelled_time(self) -> float | None:
        """Modelled seconds of the run on ``--link`` at the nodes' speeds
        (:func:`gossip.train.timing.modelled_time`)."""
        return timing.modelled_time(self)

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
            print(assembly.memory_line(self.copies, self.env.world_size, self.dim, self.mem0, self.device), flush=True)
        print(f"run directory: {self.out}", flush=True)
        return summary
