"""A training run's checkpoints: what a Run puts in one, when it saves, and how it
resumes (the file format is :mod:`gossip.checkpoint`'s).

:class:`CheckpointManager` saves the current step (one file per rank,
:func:`gossip.checkpoint.checkpoint_path`) and on ``--resume`` restores the newest step
every rank can load; :class:`CheckpointRecord` is the typed content of a checkpoint and
:class:`Progress` what advances between two. Every decision that ranks must share is
taken together through :mod:`gossip.train.agreement`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from gossip import rundir
from gossip.checkpoint import (CheckpointError, checkpoint_info, checkpoint_path, config_fingerprint,
                               list_checkpoints, load_checkpoint, save_checkpoint)
from gossip.errors import Finished, RunError
from gossip.train import agreement
from gossip.train.config import RESUME_AUTO
from gossip.train.config import fingerprint_keys as run_fingerprint_keys

__all__ = ["CheckpointManager", "CheckpointRecord", "Checkpoints", "Progress"]


@dataclass
class Progress:
    """Where the run stands: what a checkpoint restores besides the parts' own state."""

    step: int = 0
    elapsed_s: float = 0.0
    #: per hosted node, the losses since the last metrics record and since the epoch began
    log_losses: list[list[float]] = field(default_factory=list)
    epoch_losses: list[list[float]] = field(default_factory=list)

    @classmethod
    def fresh(cls, hosted: int) -> Progress:
        return cls(log_losses=[[] for _ in range(hosted)], epoch_losses=[[] for _ in range(hosted)])


@dataclass
class CheckpointRecord:
    """One rank's checkpoint payload (its keys are those of every earlier version)."""

    progress: Progress
    optimizer: dict
    loaders: list[dict]
    ledger: dict
    nodes: list[int]
    config: dict
    #: an asynchronous run's event clock and its updates in flight (the simulation's
    #: :class:`gossip.train.timing.AsyncClock`); None for the synchronous algorithms
    clock: dict | None = None

    def to_payload(self) -> dict:
        p = self.progress
        extra = {} if self.clock is None else {"clock": self.clock}
        return {**extra,
            "losses": {"epoch_losses": p.epoch_losses, "log_losses": p.log_losses},
            "step": p.step,
            "elapsed_s": float(p.elapsed_s),
            "optimizer": self.optimizer,
            "loaders": _stack_loader_states(self.loaders),
            "ledger": self.ledger,
            "nodes": self.nodes,
            "config": self.config,
        }

    @classmethod
    def from_payload(cls, payload: dict, where: str) -> CheckpointRecord:
        missing = sorted({"step", "elapsed_s", "optimizer", "loaders", "ledger", "nodes", "config"} - set(payload))
        if missing:
            raise CheckpointError(f"checkpoint '{where}' is damaged: it lacks {', '.join(missing)}")
        losses = payload.get("losses") or {}
        hosted = len(payload["nodes"])
        progress = Progress(
            step=int(payload["step"]), elapsed_s=float(payload["elapsed_s"]),
            log_losses=losses.get("log_losses") or [[] for _ in range(hosted)],
            epoch_losses=losses.get("epoch_losses") or [[] for _ in range(hosted)],
        )
        return cls(progress, payload["optimizer"], _unstack_loader_states(payload["loaders"], where), payload["ledger"],
                   list(payload["nodes"]), payload["config"], payload.get("clock"))


def _stack_loader_states(states: list[dict]) -> list[dict] | dict:
    """The hosted nodes' data-loader states as one entry per key: a tensor that every
    node has with the same shape and dtype (its generators' states) stacked into one
    ``(nodes, ...)`` tensor, any other value listed. A simulation of 1,024 nodes saved
    2,048 generator states as 2,048 tensors, each a record of its own in the file
    (0.35 s of pickling; 32,768 at 16,384 nodes). States of differing keys stay a list."""
    if len(states) < 2 or any(set(st) != set(states[0]) for st in states):
        return states
    tensors, values = {}, {}
    for key in states[0]:
        col = [st[key] for st in states]
        first = col[0]
        if isinstance(first, torch.Tensor) and all(
                isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
                and v.device == first.device for v in col):
            tensors[key] = torch.stack(col)
        else:
            values[key] = col
    return {"stacked_nodes": len(states), "tensors": tensors, "values": values}


def _unstack_loader_states(saved: Any, where: str) -> list[dict]:
    """The per-node list of :func:`_stack_loader_states`'s entry (or a list as saved
    before stacking)."""
    if isinstance(saved, (list, tuple)):
        return list(saved)
    try:
        n = int(saved["stacked_nodes"])
        tensors, values = dict(saved["tensors"]), dict(saved["values"])
        if any(t.shape[0] != n for t in tensors.values()) or any(len(v) != n for v in values.values()):
            raise ValueError("a column of another length")
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CheckpointError(f"checkpoint '{where}' is damaged: its data-loader states do not unpack ({e})") from None
    # each row a tensor of its own (clone): Generator.set_state takes a state's storage
    # from its start, so a row of the stacked tensor (a view at an offset) must not reach it
    return [{**{k: t[i].clone() for k, t in tensors.items()}, **{k: v[i] for k, v in values.items()}}
            for i in range(n)]




class Checkpoints(Protocol):
    """What a run's checkpoints do (its ``ckpt``, made by its build hook): refuse to
    resume a finished run, restore the newest step, save the current one.
    :class:`CheckpointManager` is every mode's but one; a fault-tolerant replica keeps
    its own file (:mod:`gossip.train.fault_tolerance`)."""

    def check_finished(self, stop: int, total: int) -> None: ...

    def resume(self, auto: bool = False) -> Progress | None: ...

    def save(self, progress: Progress) -> Path: ...


class CheckpointManager:
    """A training run's checkpoints: the current step saved, and on ``--resume`` the
    newest step every rank can load restored into the run's parts.

    It holds the parts a checkpoint covers (the optimizer with the algorithm's state,
    the data loaders, the ledger) and the run's config.json record, whose
    :func:`~gossip.train.config.fingerprint_keys` entries a checkpoint must match. Every
    decision that ranks must share (finished or not, which step, loaded or not) is
    taken together through :mod:`gossip.train.agreement`.
    """

    def __init__(self, out: Path, env, comm, cfg, cfg_dict: dict, *, gopt, loaders: list, batches, ledger,
                 corpus: str, say: Callable[[str], None], clock: Callable[[], Any] | None = None) -> None:
        self.out, self.env, self.comm, self.cfg, self.cfg_dict = Path(out), env, comm, cfg, cfg_dict
        #: the run's event clock, if any, when a checkpoint is saved (``clock()``), and the
        #: state a resume restored for it (None: none saved)
        self.clock, self.restored_clock = clock, None
        self.nodes = [int(i) for i in comm.nodes]
        self.gopt, self.loaders, self.batches, self.ledger = gopt, loaders, batches, ledger
        self.corpus, self.say = corpus, say
        self.fp_keys = run_fingerprint_keys(cfg_dict)
        self.fingerprint = config_fingerprint(cfg_dict, self.fp_keys)

    def save(self, progress: Progress) -> Path:
        """This rank's checkpoint of ``progress.step`` (atomic: temporary file, rename)."""
        if self.batches is not None:  # the loaders hold the data positions a checkpoint saves
            self.batches.sync()
        clock = self.clock() if self.clock is not None else None
        record = CheckpointRecord(
            progress=progress, optimizer=self.gopt.state_dict(copy=False),  # serialised at once: no copy of X
            loaders=[ld.state_dict() for ld in self.loaders], ledger=self.ledger.state_dict(),
            nodes=self.nodes, config=self.cfg_dict, clock=clock.state_dict() if clock is not None else None,
        )
        return save_checkpoint(
            checkpoint_path(self.out, progress.step, self.env.rank), record.to_payload(),
            config=self.cfg_dict, fingerprint_keys=self.fp_keys, fingerprint=self.fingerprint,
            world_size=self.env.world_size,
        )

    def check_finished(self, stop: int, total: int) -> None:
        """--resume of a run that already ended: change nothing.

        The steps its summary.json records (the largest any rank sees: rank 0 wrote it)
        are compared with ``stop``, where this run would stop. A finished run is refused
        in one line (:class:`~gossip.errors.Finished`: exit 0 under ``--resume auto``, so
        that ``torchrun --max-restarts`` ends cleanly); a summary of fewer steps is a
        shorter run that this one continues (a larger ``--max-steps``), unless it has no
        checkpoint to continue from, which ``--resume auto`` must not start afresh over.
        A run whose final checkpoint was deleted replays its last steps from the newest
        one left."""
        path = rundir.summary_path(self.out)
        steps, diverged = self._summary_steps(path)
        found = list_checkpoints(self.out)
        other = float(steps >= 0 and self._other_config())
        steps, diverged, ckpts, other, newest = agreement.gathered_max(
            self.comm, self.env.distributed, [steps, diverged, float(len(found)), other, float(max(found, default=-1))])
        if steps < 0 or diverged:
            return
        # another config: the resume says how it differs; a newest checkpoint older than the
        # summary (its final checkpoint deleted) asks to replay the run's last steps from it
        if steps >= stop and not other and (not ckpts or newest >= steps):
            msg = (f"the run in {str(self.out)!r} is finished (step {int(steps)} of {stop}); nothing was "
                   f"changed. Its summary is {str(path)!r}; to train longer, resume it with a larger --max-steps "
                   f"(its schedule spans {total} steps) or start a new run with more --epochs")
            raise Finished(msg, exit_code=0 if self.cfg.run.resume == RESUME_AUTO else 2)
        if not ckpts:
            raise RunError(f"--resume: {str(path)!r} holds the summary of a run that ended at step {int(steps)} "
                           f"and there is no checkpoint to continue it from; nothing was changed: give another "
                           f"--out, or --overwrite to replace that run")

    @staticmethod
    def _summary_steps(path: Path) -> tuple[float, float]:
        """The steps and the diverged flag summary.json records: -1 without one, 0 steps
        for one that is present but unreadable (still a summary nobody may replace)."""
        if not path.exists():
            return -1.0, 0.0
        try:
            summary = rundir.read_json(path, "the run's summary")
        except rundir.RunDirError:
            return 0.0, 0.0
        steps = float(summary["steps"]) if isinstance(summary.get("steps"), int) else 0.0
        return steps, float(bool(summary.get("diverged")))

    def resume(self, auto: bool = False) -> Progress | None:
        """Restore every part from the newest checkpoint step that every rank can load
        (older steps are tried when a newer one is damaged); all ranks agree or all fail.
        ``auto``: a directory without any checkpoint starts fresh (None). Returns the
        restored progress."""
        self._check_mode()
        complete = self._complete_steps()
        if not complete:
            if auto:
                return None
            raise RunError(f"--resume {str(self.out)!r}: no checkpoint found in that directory")
        errors: list[str] = []
        for step in complete:
            progress, err = self._load(checkpoint_path(self.out, step, self.env.rank))
            bad = agreement.failing_ranks(self.comm, self.env.distributed, err is None)
            if not bad:
                if errors:
                    self.say(f"gossip.train: resumed from step {step}: newer checkpoints could not be loaded "
                             f"({errors[0]})")
                return progress
            errors.append(err or f"the checkpoint of rank(s) {bad} at step {step} could not be loaded")
            if not auto:  # an explicit --resume takes the newest step or says why not
                raise RunError(errors[0] if err is not None else f"--resume: {errors[0]}")
        raise RunError(f"--resume auto: no checkpoint step in {str(self.out)!r} loads on every rank ({errors[0]})")

    def _check_mode(self) -> None:
        """Every rank refuses alike a run written in the other mode (rank 0 may be the
        only one to see config.json)."""
        other = self._written_in_other_mode()
        bad = agreement.failing_ranks(self.comm, self.env.distributed, other is None)
        if other is None and bad:
            other = f"--resume {str(self.out)!r}: rank(s) {bad} see a run written in the other mode " \
                    f"(simulation or torchrun)"
        if other is not None:
            raise RunError(other)

    def _complete_steps(self) -> list[int]:
        """The steps with a file of every rank, newest first: the same on every rank (a
        rank may see other files) or every rank stops."""
        env = self.env
        ranks = range(env.world_size if env.distributed else 1)
        complete = sorted((s for s, r in list_checkpoints(self.out).items() if all(k in r for k in ranks)),
                          reverse=True)
        seen = agreement.gathered(self.comm, env.distributed, [len(complete), complete[0] if complete else -1])
        if len(set(map(tuple, seen))) != 1:
            raise RunError(f"--resume: ranks see different checkpoints in {str(self.out)!r} "
                           f"(newest complete step per rank: {[int(v[1]) for v in seen]})")
        return complete

    def _load(self, path: Path) -> tuple[Progress | None, str | None]:
        """Load and restore every part from one checkpoint file: its progress, or the
        error. A later candidate overwrites whatever a failed one restored."""
        from gossip import vectorized  # the batched simulation's state layout

        try:
            self._check_optimizer(path)
            self._check_corpus(path)
            payload = load_checkpoint(
                path, expect_config={k: self.cfg_dict[k] for k in self.fp_keys},
                expect_fingerprint=self.fingerprint, expect_world_size=self.env.world_size,
            )
            record = CheckpointRecord.from_payload(payload, str(path))
            if list(record.nodes) != list(self.nodes) or len(record.loaders) != len(self.loaders):
                raise CheckpointError(
                    f"checkpoint '{path}' holds {len(record.loaders)} data-loader state(s) for nodes "
                    f"{list(record.nodes)[:8]}, this rank hosts {list(self.nodes)[:8]}: it is damaged or forged"
                )
            optimizer = record.optimizer
            if not isinstance(self.gopt, vectorized.VectorizedOptimizer):  # a vectorized run's stacked state
                optimizer = {**optimizer, "optimizers": vectorized.per_node_optimizer_states(
                    optimizer["optimizers"], self.gopt.flat)}
            self.gopt.load_state_dict(optimizer)
            self.gopt.steps = record.progress.step  # older checkpoints do not hold it
            for ld, s in zip(self.loaders, record.loaders):
                ld.load_state_dict(s)
            if self.batches is not None:
                self.batches.reload()
            self.ledger.load_state_dict(record.ledger)
            if self.clock is not None and record.clock is None:
                raise CheckpointError(f"checkpoint '{path}' holds no event clock (written before an asynchronous "
                                      f"run's clock was saved): this run cannot continue from it")
            self.restored_clock = record.clock
        except (CheckpointError, ValueError, KeyError) as e:
            return None, str(e)
        return record.progress, None

    def _check_corpus(self, path: Path) -> None:
        """A checkpoint of a run on another text corpus (another --data-dir, an edited file,
        another Python's standard library) is refused by name, not by a fingerprint."""
        stored = (checkpoint_info(path).get("config") or {}).get("corpus_sha256")
        mine = self.cfg_dict.get("corpus_sha256")
        if stored != mine and (stored or mine):
            raise CheckpointError(
                f"checkpoint '{path}' was trained on another corpus (sha256 {str(stored)[:12]}...), this run "
                f"reads {self.corpus} (sha256 {str(mine)[:12]}...); resume with the same --data and --data-dir"
            )

    def _check_optimizer(self, path: Path) -> None:
        """A checkpoint without ``local_optimizer`` in its config was written by an SGD run
        (of a version before --optimizer, or fingerprinted as one): say so by name,
        where the fingerprint alone would only differ."""
        stored = checkpoint_info(path).get("config") or {}
        mine = self.cfg_dict["local_optimizer"]
        if "local_optimizer" not in stored and mine != "sgd":
            raise CheckpointError(
                f"checkpoint '{path}' was written with a different config: local_optimizer 'sgd' != {mine!r}"
            )

    def _written_in_other_mode(self) -> str | None:
        """A run written with ``--simulate`` (one checkpoint file of every node) cannot be
        resumed under torchrun (a file per rank), nor the other way round: the line that
        says so and how to resume it, or None."""
        try:
            stored = rundir.read_json(rundir.config_path(self.out))
        except rundir.RunDirError:
            return None
        mode, n = stored.get("mode"), stored.get("world_size")
        if mode not in ("simulate", "torchrun") or mode == self.env.mode:
            return None
        how = (f"--simulate {n} in one process" if mode == "simulate"
               else f"under torchrun with {n} ranks in all, without --simulate")
        return (f"--resume {str(self.out)!r}: that run was written in the other mode ({mode}, {n} nodes), whose "
                f"checkpoints this {self.env.mode} run cannot read; resume it with {how}")

    def _other_config(self) -> bool:
        """Whether the run directory's config.json was written with another world size or
        other fingerprinted values than this run's (an unreadable one counts as the same)."""
        try:
            stored = rundir.read_json(rundir.config_path(self.out))
        except rundir.RunDirError:
            return False

        def canon(v: Any) -> str:
            return json.dumps(json.loads(json.dumps(v, default=str)), sort_keys=True)

        if stored.get("world_size", self.env.world_size) != self.env.world_size:
            return True
        return any(canon(stored.get(k)) != canon(self.cfg_dict.get(k)) for k in self.fp_keys if k in stored)
