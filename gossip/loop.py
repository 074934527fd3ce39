"""The training run behind ``gossip.train``: build, train, evaluate, log, checkpoint.

One code path serves both modes: under torchrun a process hosts its own rank
(``m = 1``); with ``--simulate N`` one process hosts all N nodes (``m = N``). Either way
the hosted nodes' parameters are the rows of one ``(m, d)`` buffer and every node
trains on its own shard.

Files written to the run directory (see docs/run-directory.md):
``config.json`` at the start, ``metrics-rank<k>.jsonl`` (one per node), checkpoints,
and ``summary.json`` at the end.
"""

from __future__ import annotations

import contextlib
import errno
import json
import datetime as _dt
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import topologies
from topologies import available_memory  # one reading of MemAvailable for both checks
from gossip import algorithms, checkpoint, compress, data, evaluation, factories, models, rundir, vectorized
from gossip.errors import NonFiniteError
from gossip.config import TrainConfig
from gossip.runtime import GossipOptimizer

__all__ = ["CheckpointRecord", "Diverged", "Finished", "FINGERPRINT_KEYS", "Progress", "Run", "RunError", "fingerprint_keys", "run"]


class RunError(RuntimeError):
    """A failure the user can act on (bad data dir, damaged checkpoint, dead peer)."""

    exit_code = 2


class Diverged(RunError):
    """Training produced a non-finite loss or model: an outcome, recorded in summary.json."""

    exit_code = 1


class Finished(RunError):
    """--resume of a run that already ended: nothing to do, nothing changed. Exit 0
    under ``--resume auto`` (a restart of a finished job), 2 for an explicit ``--resume``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


#: config keys whose change makes a checkpoint unusable for an exact continuation
AUTO = "auto"  # --resume auto
FINGERPRINT_KEYS = (
    "algo", "compressor_spec", "topology", "degree", "rows", "cols", "weights", "lazy",
    "model_name", "data", "partition", "epochs", "batch_size", "lr", "lr_schedule",
    "momentum", "local_momentum", "weight_decay", "seed", "merge", "merge_max_groups", "merge_alpha",
    "algo_options",
)
#: fingerprinted too where the local optimizer is not SGD: checkpoints written before
#: ``--optimizer`` existed (all SGD) keep the fingerprint they were written with
OPTIMIZER_FINGERPRINT_KEYS = ("local_optimizer", "betas")


#: fingerprinted too where set: the model's and data set's options, and the identity of
#: a text corpus (checkpoints written before they existed keep their fingerprint)
OPTIONAL_FINGERPRINT_KEYS = ("model_options", "data_options", "corpus_sha256")


def fingerprint_keys(config: dict) -> tuple[str, ...]:
    """The config keys a checkpoint of this run is fingerprinted with."""
    keys = FINGERPRINT_KEYS
    if config.get("local_optimizer", "sgd") != "sgd":
        keys += OPTIMIZER_FINGERPRINT_KEYS
    return keys + tuple(k for k in OPTIONAL_FINGERPRINT_KEYS if config.get(k))


# --------------------------------------------------------------------------------------
# set-up
# --------------------------------------------------------------------------------------
@dataclass
class _Env:
    world_size: int
    distributed: bool
    rank: int  # this process's rank (0 in the simulation)

    @property
    def mode(self) -> str:
        return "torchrun" if self.distributed else "simulate"


def _detect_env(cfg: TrainConfig) -> _Env:
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if cfg.comm.simulate is not None:
        if under_torchrun and int(os.environ["WORLD_SIZE"]) > 1:
            raise RunError("--simulate runs all nodes in one process: do not combine it with torchrun")
        return _Env(world_size=cfg.comm.simulate, distributed=False, rank=0)
    if under_torchrun:
        return _Env(int(os.environ["WORLD_SIZE"]), True, int(os.environ["RANK"]))
    return _Env(world_size=1, distributed=False, rank=0)


def _hosts(env: _Env) -> dict:
    """``hosts`` and ``procs_per_host`` as torchrun launched the run (its LOCAL_WORLD_SIZE
    processes on each of WORLD_SIZE / LOCAL_WORLD_SIZE hosts); 1 and 1 in one process."""
    if not env.distributed:
        return {"hosts": 1, "procs_per_host": 1}
    per_host = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return {"hosts": max(1, env.world_size // per_host), "procs_per_host": per_host}


def _build_topology(cfg: TrainConfig, n: int):
    c, algo = cfg.comm, cfg.algorithm.name
    if not algorithms.is_decentralized(algo):
        return None
    if n < 2:
        raise RunError(
            f"--algo {algo} is decentralized and needs at least 2 nodes, got 1 process; "
            f"run under torchrun --nproc_per_node N or with --simulate N (or use --algo allreduce)"
        )
    params: dict[str, Any] = {}
    for key in ("degree", "rows", "cols", "weights"):
        if getattr(c, key) is not None:
            params[key] = getattr(c, key)
    if c.lazy:
        params["lazy"] = True
    if c.topology in ("expander", "matching"):  # random graphs: the run's seed
        params.setdefault("seed", cfg.run.seed)
    try:
        return topologies.build(c.topology, n, **params)
    except (ValueError, TypeError) as e:
        raise RunError(f"--topology {c.topology} with world size {n}: {e}") from None


def _build_algorithm(cfg: TrainConfig, comm) -> algorithms.Algorithm:
    """The registry builds it from the run's values of ``gossip.algorithms.COMMON_OPTIONS``
    (``--seed``, ``--compressor``/``--bits``, ``--momentum``: the algorithm's own momentum
    where its Config has one; the registry decides where each applies), the user's
    ``--algo-opt`` and MergeComp's flags. The loop reads no Config field."""
    a = cfg.algorithm
    ours = {"seed": cfg.run.seed, "compressor": a.compressor_spec, "momentum": cfg.optim.momentum}
    common = {k: ours[k] for k in algorithms.COMMON_OPTIONS}  # the registry passes each where it applies
    opts: dict[str, Any] = dict(a.options)
    if a.merge is not None:  # MergeComp: a schedule of the efsgd family, built by the registry
        opts.update(merge=a.merge, merge_max_groups=a.merge_max_groups, merge_alpha=a.merge_alpha)
    try:
        return algorithms.build(a.name, comm, common=common, **opts)
    except (ValueError, TypeError) as e:
        flag = f"--merge {a.merge}" if a.merge is not None and "merge" in str(e) else f"--algo {a.name}"
        raise RunError(f"{flag}: {e}") from None


def _build_dataset(cfg: TrainConfig):
    """A registered data set, or the user's own (``--data module:function``)."""
    try:
        if factories.is_factory(cfg.data.name):
            return factories.dataset_from(cfg.data.name, seed=cfg.run.seed)
        return data.build_dataset(cfg.data.name, data_dir=cfg.data.data_dir, seed=cfg.run.seed,
                                  **dict(cfg.data.options))
    except (data.DataError, factories.FactoryError) as e:
        raise RunError(str(e)) from None
    except (ValueError, TypeError) as e:  # an option the data set refuses
        raise RunError(f"--data {cfg.data.name}: {e}") from None


_TASK_WORDS = {data.CLASSIFICATION: "classification", data.LANGUAGE_MODEL: "language"}


def _build_model(cfg: TrainConfig, dataset, device: torch.device) -> torch.nn.Module:
    """A registered model, or the user's own (``--model module:function``), on ``device``."""
    name = cfg.model_name
    try:
        if factories.is_factory(name):
            model = factories.model_from(name, dataset.input_shape, dataset.num_classes).to(device)
            factories.check_model_output(model, name, dataset.input_shape, dataset.num_classes, device,
                                         task=dataset.task)
            return model
        if models.model_task(name) != dataset.task:
            fits = [m for m in models.available_models() if models.model_task(m) == dataset.task]
            raise RunError(f"--model {name} is a {_TASK_WORDS[models.model_task(name)]} model and --data "
                           f"{cfg.data.name} is a {_TASK_WORDS[dataset.task]} data set; models for it: "
                           f"{', '.join(fits)} (or your own as module.path:function)")
        return models.build_model(name, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                                  **dict(cfg.model.options)).to(device)
    except factories.FactoryError as e:
        raise RunError(str(e)) from None
    except (ValueError, TypeError) as e:
        raise RunError(f"--model {name} does not fit --data {cfg.data.name}: {e}") from None


def _expected_state_bytes(cfg: TrainConfig, m: int, d: int) -> int:
    """The hosted nodes' parameter state, roughly: m x d x the algorithm's ``state_copies`` floats."""
    return 4 * d * _state_copies(cfg) * m


def _state_copies(cfg: TrainConfig) -> int:
    return algorithms.algorithm_class(cfg.algorithm.name).state_copies


def _peak_memory(device: torch.device) -> int | None:
    """The peak memory this process has used so far: CUDA's allocator peak on a GPU, the
    maximum resident set (ru_maxrss, which counts the interpreter, torch and the data
    set too) on the CPU; None where the platform does not say."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        import sys as _sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if _sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):
        return None


def _memory_line(cfg: TrainConfig, m: int, d: int, before: int | None, device: torch.device) -> str:
    """The simulation's memory check, stated: the peak it expected (what the process held
    before the nodes were built, the data set included, plus the nodes' state), the peak
    measured."""
    state = _expected_state_bytes(cfg, m, d)
    peak = _peak_memory(device)
    what = "CUDA allocator peak" if device.type == "cuda" else "maximum resident set of this process"
    measured = f"{peak / 2**30:.2f} GiB ({what})" if peak is not None else "unknown on this platform"
    base = before or 0
    return (f"memory: expected peak about {(base + state) / 2**30:.2f} GiB (before the nodes {base / 2**30:.2f} GiB, "
            f"plus {m} nodes x {d:,} parameters x {_state_copies(cfg)} copies "
            f"{state / 2**30:.2f} GiB); measured peak {measured}")


def _check_memory(cfg: TrainConfig, m: int, d: int, device: torch.device) -> None:
    """Refuse, in one line, a simulation that cannot fit in this machine's memory."""
    if device.type != "cpu" or m < 2:
        return
    copies = _state_copies(cfg)
    need, have = _expected_state_bytes(cfg, m, d), available_memory()
    if have is not None and need > have:
        fit = max(1, have // (4 * d * copies))
        raise RunError(
            f"--simulate {m}: {m} nodes x {d:,} parameters x about {copies} copies need about "
            f"{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB are available; about {fit} nodes would fit "
            f"(or run under torchrun on several machines)"
        )


def _simulation_path(cfg: TrainConfig, env: _Env, model: torch.nn.Module, dataset,
                     device: torch.device) -> tuple[str | None, str]:
    """Which path ``--simulate N`` takes, and why: ``("vectorized", "")``, ``("loop",
    reason)``, or ``(None, "")`` under torchrun. ``--simulate-mode vectorized`` refuses
    a model that cannot be batched instead of falling back."""
    mode = cfg.comm.simulate_mode
    if env.distributed or cfg.comm.simulate is None:
        return None, ""
    if mode == "loop":
        return "loop", "--simulate-mode loop"
    if env.world_size < 2:
        why = "one node: nothing to batch"
    else:
        x = dataset.x_train[:2].to(device)
        y = dataset.y_train[:2].to(device)
        why = vectorized.why_not_vectorized(model, x, y) or ""
        if not why and getattr(dataset, "task", "classification") != "classification":
            why = f"the data set's task is {dataset.task!r}; the batched path serves classification"
        if not why and dataset.y_train.dim() != 1:
            why = "the data has a label per position (a sequence task); the batched path takes one label per example"
        if not why and not all(p.requires_grad for p in model.parameters()):
            why = "the model has frozen parameters, which the batched model does not leave out of X yet"
        if not why and cfg.local_optimizer == "muon":
            why = "--optimizer muon orthogonalises each node's matrices on their own, which is not batched yet"
    if not why:
        return "vectorized", ""
    if mode == "vectorized":
        raise RunError(f"--simulate-mode vectorized: --model {cfg.model_name} cannot run batched: {why}; "
                       f"use --simulate-mode auto or loop")
    return "loop", why


def _path_line(n: int, path: str, why: str) -> str:
    if path == "vectorized":
        return f"gossip.train: simulation path: vectorized ({n} nodes as one batched model)"
    return f"gossip.train: simulation path: loop ({n} nodes one after another: {why})"


def _device(cfg: TrainConfig, env: _Env) -> torch.device:
    want = cfg.comm.device
    if want == "cpu":
        return torch.device("cpu")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RunError("--device cuda: no CUDA device is available; use --device cpu or auto")
        local = int(os.environ.get("LOCAL_RANK", "0")) if env.distributed else 0
        return torch.device("cuda", local)
    return torch.device("cpu")


def _local_optimizer(cfg: TrainConfig, model: torch.nn.Module | None, params=None) -> torch.optim.Optimizer:
    """--optimizer: SGD with the local momentum, or AdamW with --beta1/--beta2 (decoupled
    weight decay); --lr and --weight-decay for both. ``params``, where given instead of
    ``model``: the vectorized path's stacked leaves (SGD and AdamW are element-wise;
    Muon, which needs the model, takes the loop path)."""
    params = model.parameters() if params is None else params
    if cfg.local_optimizer == "muon":
        from gossip.algorithms.muloco import muon_optimizer

        try:
            return muon_optimizer(model, lr=cfg.learning_rate, weight_decay=cfg.optim.weight_decay)
        except ValueError as e:
            raise RunError(f"--optimizer {e}") from None
    if cfg.local_optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=cfg.betas,
                                 weight_decay=cfg.optim.weight_decay)
    return torch.optim.SGD(params, lr=cfg.learning_rate, momentum=cfg.local_momentum,
                           weight_decay=cfg.optim.weight_decay)


def _lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    lr, schedule = cfg.learning_rate, cfg.optim.lr_schedule
    if schedule == "cosine":
        return 0.5 * lr * (1.0 + math.cos(math.pi * step / max(1, total)))
    if schedule == "step":
        return lr * (0.1 ** ((step >= 0.5 * total) + (step >= 0.75 * total)))
    return lr


def _default_out(cfg: TrainConfig) -> str:
    """``runs/<time>-<algo>-<topology>-<pid>``, created here so that two runs started in
    the same second on this host never share it (rank 0 chooses; the ranks agree)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    algo = cfg.algorithm.name
    topo = cfg.comm.topology if algorithms.is_decentralized(algo) else "allreduce"
    name = f"{algo}-{topo}" if topo != algo else algo
    for k in range(1000):
        out = Path("runs") / (f"{stamp}-{name}-{os.getpid()}" + (f"-{k}" if k else ""))
        try:
            out.mkdir(parents=True, exist_ok=False)
            return str(out)
        except FileExistsError:
            continue
        except OSError as e:
            raise RunError(f"cannot create the run directory {str(out)!r} ({e.strerror}); give --out DIR") from None
    raise RunError("cannot find a free default run directory under runs/; give --out DIR")


def _prepare_out(cfg: TrainConfig, out: Path, is_main: bool) -> str | None:
    """Make ``out`` ready for this run, or say in one line why not (None: ready).

    A run directory that already holds files is refused unless the run continues it
    (``--resume``) or replaces it (``--overwrite``: rank 0 deletes the previous run's
    own files first, as :func:`gossip.rundir.run_files` lists them, and leaves any
    other file alone; a ``config.json`` or ``summary.json`` that is not a run's is
    refused). Nothing is written before every rank has agreed.
    """
    try:
        return _check_out(cfg, out)
    except OSError as e:  # a name too long for the file system, a directory we may not list
        return f"--out {str(out)!r}: {e.strerror or e}" + (": give a shorter --out" if e.errno == errno.ENAMETOOLONG else "")


def _check_out(cfg: TrainConfig, out: Path) -> str | None:
    if out.exists() and not out.is_dir():
        return f"--out {str(out)!r} is a file, not a directory"
    if cfg.run.resume is None and out.is_dir() and any(out.iterdir()):
        if not cfg.run.overwrite:
            kept = ", ".join(sorted(p.name for p in out.iterdir())[:4])
            return (f"--out {str(out)!r} already holds a run ({kept}, ...); give --resume {str(out)!r} to "
                    f"continue it, --overwrite to replace it, or another --out")
        foreign = rundir.run_files(out)[1]
        if foreign:
            return (f"--overwrite: {str(foreign[0])!r} is not a gossip run's file and is left alone; "
                    f"move it or give another --out")
    return None


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------
def run(cfg: TrainConfig) -> dict | None:
    """Train as configured; returns the summary on rank 0 (None elsewhere)."""
    if cfg.comm.fault_tolerance is not None:  # one torchft replica per process: its own loop
        from gossip.fault_tolerance import run_fault_tolerant

        return run_fault_tolerant(cfg)
    env = _detect_env(cfg)
    topo = _build_topology(cfg, env.world_size)  # pure: fails the same way on every rank
    device = _device(cfg, env)
    if cfg.run.resume not in (None, AUTO):
        try:
            is_dir = Path(cfg.run.resume).is_dir()
        except OSError as e:  # a name too long for the file system, a loop of links
            raise RunError(f"--resume {cfg.run.resume!r}: {e.strerror or e}") from None
        if not is_dir:
            raise RunError(f"--resume {cfg.run.resume!r}: no such run directory")
    try:
        dataset, data_error = _build_dataset(cfg), None
    except RunError as e:
        if not env.distributed:
            raise
        dataset, data_error = None, str(e)  # said on every rank once they have met, not a hang

    from gossip import comm as gcomm

    runner: Run | None = None
    try:
        if env.distributed:
            _init_group(cfg, env, device)
            _agree_config(cfg, env, dataset, data_error)  # before anything is exchanged or written
            comm = gcomm.DistCommunicator(topo, device=device, timeout=cfg.comm.timeout)
        else:
            comm = gcomm.SimulatedCommunicator(topo, world_size=env.world_size, device=device)
        if cfg.comm.emulate_latency:
            from gossip.comm.latency import LatencyCommunicator

            comm = LatencyCommunicator(comm, cfg.comm.emulate_latency / 1000.0)
        runner = Run(cfg, env, topo, device, dataset, comm)
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


#: config keys every rank must share: the fingerprinted ones and the run's length and cadence
#: (paths such as --out and --data-dir may differ between hosts)
AGREE_KEYS = FINGERPRINT_KEYS + (
    "max_steps", "checkpoint_every", "log_every", "emulate_latency", "device", "simulate", "tensorboard",
) + OPTIMIZER_FINGERPRINT_KEYS + ("model_options", "data_options")


#: bytes of one array hashed in full; a larger one is hashed in evenly spaced rows of
#: about this many bytes in all (and its shape, which every row count changes)
_DIGEST_BYTES = 64 * 2**20
#: the data set's arrays the ranks compare, and what the message calls them
_DATA_PARTS = {"x_train": "training inputs", "y_train": "training labels",
               "x_test": "test inputs", "y_test": "test labels"}


def _array_digest(t: torch.Tensor) -> str:
    """``shape dtype sha256[:16]`` of an array; above :data:`_DIGEST_BYTES`, of evenly
    spaced rows (marked ``sampled``): cheap for large sets, and a file of other images
    changes the digest unless it differs from the others only in rows never sampled."""
    import hashlib

    t = t.detach().cpu().contiguous()
    rows = max(1, t.shape[0]) if t.dim() else 1
    stride = max(1, math.ceil(t.numel() * t.element_size() / _DIGEST_BYTES))
    part = t[::stride].contiguous() if stride > 1 and t.dim() else t
    h = hashlib.sha256(part.view(torch.uint8).numpy().tobytes() if part.numel() else b"")
    return (f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} sha256 {h.hexdigest()[:16]}"
            + (f" (every {stride}th of {rows} rows)" if stride > 1 else ""))


def data_identity(dataset) -> dict[str, str]:
    """What every rank must hold alike: a digest of each of the data set's arrays."""
    return {k: _array_digest(getattr(dataset, k)) for k in _DATA_PARTS
            if isinstance(getattr(dataset, k, None), torch.Tensor)}


def _agree_config(cfg: TrainConfig, env: _Env, dataset=None, data_error: str | None = None) -> None:
    """Every rank compares the run-defining config, and a digest of its data set, with
    every other; on a mismatch all ranks stop with one line naming the differing keys
    (or arrays) and a rank holding each value."""
    import torch.distributed as dist

    flat = cfg.to_dict()
    mine = {k: flat.get(k) for k in AGREE_KEYS}
    mine["resume_auto"] = cfg.run.resume == AUTO
    data_keys = data_identity(dataset) if dataset is not None else {}
    mine.update({f"data:{k}": v for k, v in data_keys.items()})
    everyone: list[dict] = [None] * env.world_size  # type: ignore[list-item]
    mine["data_error"] = data_error
    dist.all_gather_object(everyone, mine)
    failed = [(r, theirs["data_error"]) for r, theirs in enumerate(everyone) if theirs.get("data_error")]
    if failed:  # a rank that could not load its data stops every rank, named
        raise RunError(f"rank {failed[0][0]} cannot load its data: {failed[0][1]}")
    del mine["data_error"]
    diffs, data_diffs = [], []
    for key in mine:
        holders: dict[str, int] = {}
        for r, theirs in enumerate(everyone):
            holders.setdefault(json.dumps(theirs.get(key), sort_keys=True, default=str), r)
        if len(holders) > 1:
            if key.startswith("data:"):
                data_diffs.append(f"{_DATA_PARTS[key[5:]]}: " + ", ".join(
                    f"{json.loads(v)} on rank {r}" for v, r in holders.items()))
            else:
                diffs.append(f"{key}: " + ", ".join(f"{v} on rank {r}" for v, r in holders.items()))
    if diffs:
        raise RunError(f"the ranks were started with different configs; {'; '.join(diffs)}")
    if data_diffs:
        odd = sorted({r for key in data_keys for r, theirs in enumerate(everyone)
                      if theirs.get(f"data:{key}") != everyone[0].get(f"data:{key}")})
        raise RunError(
            f"rank(s) {odd} hold other data than rank 0 (--data {cfg.data.name}"
            f"{' --data-dir ' + repr(cfg.data.data_dir) if cfg.data.data_dir else ''}): {'; '.join(data_diffs)}; "
            f"give every rank the same data"
        )


def _init_group(cfg: TrainConfig, env: _Env, device: torch.device) -> None:
    """The process group; a rank that does not arrive is one line, not a store traceback."""
    import torch.distributed as dist

    from gossip import comm as gcomm

    try:
        gcomm.init_from_env(backend="nccl" if device.type == "cuda" else "gloo", timeout=cfg.comm.timeout,
                            device=device)
    except (dist.DistStoreError, dist.DistNetworkError) as e:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(
            f"rank {env.rank}: not all {env.world_size} ranks arrived at {where} within --timeout "
            f"{cfg.comm.timeout:g} s ({first}); start every rank, check MASTER_ADDR/MASTER_PORT, or raise --timeout"
        ) from None


def _agree_out_dir(cfg: TrainConfig, env: _Env) -> Path:
    resume = None if cfg.run.resume == AUTO else cfg.run.resume
    out, err = resume or cfg.run.out, None
    if out is None and env.rank == 0:
        try:
            out = _default_out(cfg)
        except RunError as e:
            err = str(e)
    if env.distributed:  # rank 0's choice for all, or its error for all
        import torch.distributed as dist

        box = [out, err]
        dist.broadcast_object_list(box, src=0)
        out, err = box
    if err is not None:
        raise RunError(err)
    return Path(out)


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

    def to_payload(self) -> dict:
        p = self.progress
        return {
            "losses": {"epoch_losses": p.epoch_losses, "log_losses": p.log_losses},
            "step": p.step,
            "elapsed_s": float(p.elapsed_s),
            "optimizer": self.optimizer,
            "loaders": self.loaders,
            "ledger": self.ledger,
            "nodes": self.nodes,
            "config": self.config,
        }

    @classmethod
    def from_payload(cls, payload: dict, where: str) -> CheckpointRecord:
        missing = sorted({"step", "elapsed_s", "optimizer", "loaders", "ledger", "nodes", "config"} - set(payload))
        if missing:
            raise checkpoint.CheckpointError(f"checkpoint '{where}' is damaged: it lacks {', '.join(missing)}")
        losses = payload.get("losses") or {}
        hosted = len(payload["nodes"])
        progress = Progress(
            step=int(payload["step"]), elapsed_s=float(payload["elapsed_s"]),
            log_losses=losses.get("log_losses") or [[] for _ in range(hosted)],
            epoch_losses=losses.get("epoch_losses") or [[] for _ in range(hosted)],
        )
        return cls(progress, payload["optimizer"], list(payload["loaders"]), payload["ledger"],
                   list(payload["nodes"]), payload["config"])


class Run:
    """One training run: built from its parts, then stepped, evaluated, checkpointed.

    ``train()`` is the whole of it: :meth:`resume` (with ``--resume``), then
    :meth:`step` until the end, :meth:`end_epoch` after each epoch's last step,
    :meth:`checkpoint` every ``--checkpoint-every`` steps, and :meth:`finish`.
    """

    def __init__(self, cfg: TrainConfig, env: _Env, topo, device, dataset, comm) -> None:
        self.cfg, self.env, self.topo, self.device, self.dataset, self.comm = cfg, env, topo, device, dataset, comm
        self._mem0 = _peak_memory(device)  # for the memory line at the end: what the nodes add to it
        self.nodes = [int(i) for i in comm.nodes]
        self.is_main = env.rank == 0
        self.out = _agree_out_dir(cfg, env)
        self.cfg_dict = cfg.to_dict()
        if dataset.corpus is not None and dataset.corpus.get("sha256"):
            self.cfg_dict["corpus_sha256"] = dataset.corpus["sha256"]
        self.fp_keys = fingerprint_keys(self.cfg_dict)
        self.fingerprint = checkpoint.config_fingerprint(self.cfg_dict, self.fp_keys)
        # Step 1: the algorithm, then identical x_1 on every node with its local optimizer
        self.algo = _build_algorithm(cfg, comm)
        torch.manual_seed(cfg.run.seed)
        first = _build_model(cfg, dataset, device)
        # before m copies exist: will they fit?
        _check_memory(cfg, len(self.nodes), sum(p.numel() for p in first.parameters() if p.requires_grad), device)
        #: the simulation's path: "vectorized" (all nodes one batched model) or "loop"; None under torchrun
        self.sim_path, self.sim_why = _simulation_path(cfg, env, first, dataset, device)
        try:  # the algorithm's setup meets the model here (its layout, the local momentum)
            if self.sim_path == "vectorized":
                self.gopt = vectorized.VectorizedOptimizer(first, lambda ps: _local_optimizer(cfg, None, ps), self.algo)
                self.models, self.opts = self.gopt.models, self.gopt.optimizers
            else:
                self.models = [first]
                for _ in self.nodes[1:]:
                    torch.manual_seed(cfg.run.seed)
                    self.models.append(_build_model(cfg, dataset, device))
                self.opts = [_local_optimizer(cfg, m) for m in self.models]
                self.gopt = GossipOptimizer(self.models, self.opts, self.algo)
        except (ValueError, TypeError) as e:
            raise RunError(str(e) if str(e).startswith("--") else f"--algo {cfg.algorithm.name}: {e}") from None
        self.dim = self.gopt.flat.dim
        # Step 2: each node's shard of the training data
        try:
            shards = data.partition_dataset(dataset, env.world_size, scheme=cfg.data.partition, seed=cfg.run.seed)
        except ValueError as e:
            raise RunError(f"--partition {cfg.data.partition} over {env.world_size} nodes: {e}; "
                           "use fewer nodes or more data") from None
        try:
            self.loaders = [
                data.ShardLoader(dataset.x_train, dataset.y_train, shards[i], cfg.data.batch_size,
                                 seed=cfg.run.seed, node=i, device=device)
                for i in self.nodes
            ]
        except ValueError as e:
            raise RunError(f"--batch-size {cfg.data.batch_size}: {e}") from None
        # the vectorized path gathers every node's batch in one call, from the same loaders
        self.batches = vectorized.BatchedLoader(self.loaders, device) if self.sim_path == "vectorized" else None
        self._claim_out()  # nothing is written before every check above has passed
        self.task = dataset.task
        self.loss = evaluation.loss_fn(dataset.task)
        self.steps_per_epoch = self.loaders[0].steps_per_epoch
        self.total = cfg.run.epochs * self.steps_per_epoch  # the schedule spans the whole run
        self.stop = self.total if cfg.run.max_steps is None else min(self.total, cfg.run.max_steps)
        self.ledger = comm.ledger
        self.progress = Progress.fresh(len(self.nodes))
        # full-precision D-PSGD's bytes per node per step on this topology, for the ratio
        self.dpsgd_bytes = _dpsgd_bytes(topo if topo is not None else _reference_topology(cfg, env.world_size), self.dim)
        self.last_eval: dict[str, Any] = {}
        self.bar = None
        self.metrics: list[rundir.MetricsWriter] = []
        self.tb: rundir.TensorBoardWriter | None = None
        self._t0 = 0.0
        self._first_step = 0

    def _claim_out(self) -> None:
        """Refuse a run directory that holds another run (all ranks agree), then create it."""
        err = _prepare_out(self.cfg, self.out, self.is_main)
        if self.env.distributed:  # every rank fails together instead of one writing alone
            flags = self.comm.all_gather(torch.tensor([[float(err is None)]], dtype=torch.float64), record=False)
            if err is None and bool((flags[:, 0] < 1).any()):
                bad = [int(i) for i in torch.nonzero(flags[:, 0] < 1).flatten()]
                err = f"--out {str(self.out)!r} cannot be used on rank(s) {bad}"
        if err is not None:
            raise RunError(err)
        if self.cfg.run.overwrite and self.is_main and self.out.is_dir():
            try:
                rundir.remove_run_files(self.out)
            except (rundir.RunDirError, OSError) as e:
                raise RunError(f"--overwrite {str(self.out)!r}: {getattr(e, 'strerror', None) or e}") from None
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"--out {str(self.out)!r}: cannot create the run directory ({e.strerror})") from None
        if self.env.distributed:  # nobody writes before rank 0 has cleared
            self.comm.all_gather(torch.zeros(1, 1, dtype=torch.float64), record=False)

    # --- the whole run -----------------------------------------------------------------
    def train(self) -> dict | None:
        cfg = self.cfg
        self.algo.set_event_sink(self._say if self.is_main else None)  # MergeComp's decisions
        resumed = False
        if cfg.run.resume is not None:
            done = self._finished()
            if done is not None:
                return done
            resumed = self.resume(auto=cfg.run.resume == AUTO)
        if self.is_main and self.progress.step == 0:
            rundir.write_json(rundir.config_path(self.out), self._config_record())
        keep = self.progress.step if resumed else None
        self.metrics = [rundir.MetricsWriter(rundir.metrics_path(self.out, i), keep_until=keep) for i in self.nodes]
        if cfg.run.tensorboard and self.is_main:
            try:
                self.tb = rundir.TensorBoardWriter(self.out, resume_step=keep)
            except rundir.RunDirError as e:
                raise RunError(str(e)) from None
        if self.is_main:
            print(_header(cfg, self.env, self.dim, self.algo), flush=True)
            if self.sim_path is not None:
                print(_path_line(self.env.world_size, self.sim_path, self.sim_why), flush=True)
        self.bar = _progress(cfg, self.is_main, self.stop, self.progress.step)
        self._t0 = time.perf_counter() - self.progress.elapsed_s  # wall time across resumes
        self._first_step = self.progress.step  # this process's first step is its warm-up
        try:
            while self.progress.step < self.stop:
                self.step()
                step = self.progress.step
                if step % self.steps_per_epoch == 0 or step == self.stop:
                    self.end_epoch()
                if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0 and step < self.stop:
                    self.checkpoint()
        except Diverged as e:
            if self.is_main:
                rundir.write_json(rundir.summary_path(self.out), self._diverged_record(e))
            raise
        finally:
            if self.bar is not None:
                self.bar.close()
            for m_ in self.metrics:
                m_.close()
            if self.tb is not None:
                self.tb.close()
        self.checkpoint()
        return self.finish()

    def _finished(self) -> dict | None:
        """--resume of a run that already ended: change nothing.

        The steps its summary.json records (the largest any rank sees: rank 0 wrote it)
        are compared with where this run would stop. A finished run is refused in one
        line (:class:`Finished`: exit 0 under ``--resume auto``, so that ``torchrun
        --max-restarts`` ends cleanly); a summary of fewer steps is a shorter run that
        this one continues (a larger ``--max-steps``), unless it has no checkpoint to
        continue from, which ``--resume auto`` must not start afresh over. A run whose
        final checkpoint was deleted replays its last steps from the newest one left."""
        path = rundir.summary_path(self.out)
        steps, diverged = -1.0, 0.0
        if path.exists():
            try:
                summary = rundir.read_json(path, "the run's summary")
                steps = float(summary["steps"]) if isinstance(summary.get("steps"), int) else 0.0
                diverged = float(bool(summary.get("diverged")))
            except rundir.RunDirError:
                steps = 0.0  # present but unreadable: still a summary nobody may replace
        found = checkpoint.list_checkpoints(self.out)
        ckpts, newest = float(len(found)), float(max(found, default=-1))
        other = float(steps >= 0 and self._other_config())
        if self.env.distributed:  # every rank decides alike
            seen = self.comm.all_gather(torch.tensor([[steps, diverged, ckpts, other, newest]], dtype=torch.float64),
                                        record=False)
            steps, diverged, ckpts, other, newest = (float(v) for v in seen.max(dim=0).values)
        if steps < 0 or diverged:
            return None
        # another config: the resume says how it differs; a newest checkpoint older than the
        # summary (its final checkpoint deleted) asks to replay the run's last steps from it
        if steps >= self.stop and not other and (not ckpts or newest >= steps):
            msg = (f"the run in {str(self.out)!r} is finished (step {int(steps)} of {self.stop}); nothing was "
                   f"changed. Its summary is {str(path)!r}; to train longer, resume it with a larger --max-steps "
                   f"(its schedule spans {self.total} steps) or start a new run with more --epochs")
            raise Finished(msg, exit_code=0 if self.cfg.run.resume == AUTO else 2)
        if not ckpts:
            raise RunError(f"--resume: {str(path)!r} holds the summary of a run that ended at step {int(steps)} "
                           f"and there is no checkpoint to continue it from; nothing was changed: give another "
                           f"--out, or --overwrite to replace that run")
        return None

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

    def _say(self, line: str) -> None:
        (self.bar.write(line) if self.bar is not None else print(line, flush=True))

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
        lr = _lr_at(self.cfg, p.step, self.total)
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
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}", refresh=False)
        if p.step % self.cfg.run.log_every == 0 or p.step == self.stop:
            self._log_train(lr)

    def _local_step(self) -> list[float]:
        p, ledger = self.progress, self.ledger
        self.gopt.zero_grad()
        losses = []
        with ledger.phase("compute"):
            if self.batches is not None:  # vectorized: every node's forward and backward in one call
                xb, yb = self.batches.next_batch()
                losses = self.gopt.forward_backward(xb, yb).tolist()
            else:
                for m_, ld in zip(self.models, self.loaders):
                    xb, yb = ld.next_batch()
                    loss = self.loss(m_(xb), yb)
                    loss.backward()
                    losses.append(float(loss.detach()))
        bad = [i for i, v in zip(self.nodes, losses) if not math.isfinite(v)]
        if bad:
            raise Diverged(f"training diverged at step {p.step + 1}: non-finite loss on node(s) {bad}")
        try:
            self.gopt.step()
        except NonFiniteError as e:  # by type: a compressor met NaN/inf or an overflowing scale
            raise Diverged(f"training diverged at step {p.step + 1}: {e}") from None
        return losses

    def _log_train(self, lr: float) -> None:
        p = self.progress
        snap = self.ledger.as_dict(detail=True)
        recs = []
        for r, m_ in enumerate(self.metrics):
            recs.append({
                "kind": "train", "step": p.step, "epoch": p.step / self.steps_per_epoch, "time": self._elapsed(),
                "loss": sum(p.log_losses[r]) / len(p.log_losses[r]), "lr": lr,
                **_node_ledger(snap, r, len(self.nodes)),
            })
            m_.write(recs[-1])
            p.log_losses[r] = []
        if self.cfg.run.tensorboard:  # every rank: the mean over all nodes is a collective
            keys = [k for k, v in recs[0].items() if isinstance(v, (int, float)) and k not in ("kind", "step")]
            t = torch.tensor([[float(rec[k]) for k in keys] for rec in recs], dtype=torch.float64)
            mean = self.comm.all_reduce(t, op="mean", record=False)[0]
            if self.tb is not None:
                self.tb.write({"kind": "train", "step": p.step, **dict(zip(keys, mean.tolist()))})

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0

    # --- one epoch's end ---------------------------------------------------------------
    def end_epoch(self) -> None:
        """Evaluate the averaged model, log it, print the epoch line."""
        p, spe = self.progress, self.steps_per_epoch
        if self.sim_path == "vectorized":  # batched over the nodes (classification only takes this path)
            ev = _evaluate_vectorized(self.gopt, self.dataset, self.device)
        else:
            ev = evaluation.evaluate(self.gopt, self.models, self.dataset, self.device, self.comm)
        # mean training loss of the nodes over the epoch's steps
        ev["train_loss"] = _mean_over_nodes(self.comm, [sum(v) / max(1, len(v)) for v in p.epoch_losses])
        p.epoch_losses = [[] for _ in self.nodes]
        for m_ in self.metrics:
            m_.write({"kind": "eval", "step": p.step, "epoch": p.step / spe, "time": self._elapsed(), **ev})
        if self.tb is not None:
            self.tb.write({"kind": "eval", "step": p.step, **ev})
        self.last_eval = ev
        if self.is_main:
            self._say(_epoch_line(p.step / spe, self.cfg.run.epochs, ev, self.ledger, self.dpsgd_bytes, p.step,
                                  self.task))
        self.algo.on_epoch_end(p.step // spe)

    # --- checkpoints ---------------------------------------------------------------------
    def checkpoint(self) -> None:
        """This rank's checkpoint of the current step (atomic: temporary file, rename)."""
        self.progress.elapsed_s = self._elapsed()
        if self.batches is not None:  # the loaders hold the data positions a checkpoint saves
            self.batches.sync()
        record = CheckpointRecord(
            progress=self.progress, optimizer=self.gopt.state_dict(),
            loaders=[ld.state_dict() for ld in self.loaders], ledger=self.ledger.state_dict(),
            nodes=self.nodes, config=self.cfg_dict,
        )
        checkpoint.save_checkpoint(
            checkpoint.checkpoint_path(self.out, self.progress.step, self.env.rank), record.to_payload(),
            config=self.cfg_dict, fingerprint_keys=self.fp_keys, fingerprint=self.fingerprint,
            world_size=self.env.world_size,
        )

    def resume(self, auto: bool = False) -> bool:
        """Restore every part from the newest checkpoint step that every rank can load
        (older steps are tried when a newer one is damaged); all ranks agree or all fail.
        ``auto``: a directory without any checkpoint starts fresh. Returns whether it resumed."""
        env = self.env
        other = self._written_in_other_mode()
        if env.distributed:  # every rank refuses alike (rank 0 may be the only one to see config.json)
            seen = self.comm.all_gather(torch.tensor([[float(other is not None)]], dtype=torch.float64), record=False)
            if other is None and bool((seen[:, 0] > 0).any()):
                other = f"--resume {str(self.out)!r}: rank(s) {torch.nonzero(seen[:, 0] > 0).flatten().tolist()} " \
                        f"see a run written in the other mode (simulation or torchrun)"
        if other is not None:
            raise RunError(other)
        steps = checkpoint.list_checkpoints(self.out)
        complete = sorted((s for s, r in steps.items()
                           if all(k in r for k in range(env.world_size if env.distributed else 1))), reverse=True)
        if env.distributed:  # the same candidates on every rank (a rank may see other files)
            mine = torch.tensor([[float(len(complete)), float(complete[0] if complete else -1)]], dtype=torch.float64)
            seen = self.comm.all_gather(mine, record=False)
            if len(set(map(tuple, seen.tolist()))) != 1:
                raise RunError(f"--resume: ranks see different checkpoints in {str(self.out)!r} "
                               f"(newest complete step per rank: {[int(v) for v in seen[:, 1].tolist()]})")
        if not complete:
            if auto:
                return False
            raise RunError(f"--resume {str(self.out)!r}: no checkpoint found in that directory")
        errors: list[str] = []
        for step in complete:
            err = self._load(checkpoint.checkpoint_path(self.out, step, env.rank))
            ok = torch.tensor([[float(err is None)]], dtype=torch.float64)
            flags = self.comm.all_gather(ok, record=False) if env.distributed else ok
            if bool((flags[:, 0] > 0).all()):
                if errors and self.is_main:
                    self._say(f"gossip.train: resumed from step {step}: newer checkpoints could not be loaded ({errors[0]})")
                return True
            bad = [int(i) for i in torch.nonzero(flags[:, 0] < 1).flatten()]
            errors.append(err or f"the checkpoint of rank(s) {bad} at step {step} could not be loaded")
            if not auto:  # an explicit --resume takes the newest step or says why not
                raise RunError(errors[0] if err is not None else f"--resume: {errors[0]}")
        raise RunError(f"--resume auto: no checkpoint step in {str(self.out)!r} loads on every rank ({errors[0]})")

    def _load(self, path: Path) -> str | None:
        """Load and restore every part from one checkpoint file; the error, or None. A
        later candidate overwrites whatever a failed one restored."""
        try:
            self._check_optimizer(path)
            self._check_corpus(path)
            payload = checkpoint.load_checkpoint(
                path, expect_config={k: self.cfg_dict[k] for k in self.fp_keys},
                expect_fingerprint=self.fingerprint, expect_world_size=self.env.world_size,
            )
            record = CheckpointRecord.from_payload(payload, str(path))
            if list(record.nodes) != list(self.nodes) or len(record.loaders) != len(self.loaders):
                raise checkpoint.CheckpointError(
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
        except (checkpoint.CheckpointError, ValueError, KeyError) as e:
            return str(e)
        self.progress = record.progress
        return None

    def _check_corpus(self, path: Path) -> None:
        """A checkpoint of a run on another text corpus (another --data-dir, an edited file,
        another Python's standard library) is refused by name, not by a fingerprint."""
        stored = (checkpoint.checkpoint_info(path).get("config") or {}).get("corpus_sha256")
        mine = self.cfg_dict.get("corpus_sha256")
        if stored != mine and (stored or mine):
            corpus = (self.dataset.corpus or {}).get("corpus", self.cfg.data.name)
            raise checkpoint.CheckpointError(
                f"checkpoint '{path}' was trained on another corpus (sha256 {str(stored)[:12]}...), this run "
                f"reads {corpus} (sha256 {str(mine)[:12]}...); resume with the same --data and --data-dir"
            )

    def _check_optimizer(self, path: Path) -> None:
        """A checkpoint without ``local_optimizer`` in its config was written by an SGD run
        (of a version before --optimizer, or fingerprinted as one): say so by name,
        where the fingerprint alone would only differ."""
        stored = checkpoint.checkpoint_info(path).get("config") or {}
        mine = self.cfg_dict["local_optimizer"]
        if "local_optimizer" not in stored and mine != "sgd":
            raise checkpoint.CheckpointError(
                f"checkpoint '{path}' was written with a different config: local_optimizer 'sgd' != {mine!r}"
            )

    # --- the end -------------------------------------------------------------------------
    def finish(self) -> dict | None:
        """summary.json on rank 0; returns it there (None elsewhere)."""
        p, snap, n = self.progress, self.ledger.as_dict(), self.env.world_size
        hosted = 1 if self.env.distributed else n
        per_step = _global_mean(self.comm, _bytes_per_node_step(snap, n, p.step, self.env), self.env)
        setup = _global_mean(self.comm, snap["setup"]["sent"] / hosted, self.env)
        total = _global_mean(self.comm, snap["bytes"]["sent"] / hosted, self.env)
        wire = self.algo.wire_format()
        summary = {
            **self._identity(),
            "model": self.cfg.model_name,
            "data": self.cfg.data.name,
            "params": self.dim,
            "epochs": self.cfg.run.epochs,
            "steps": p.step,
            "final_train_loss": self.last_eval.get("train_loss"),
            "final_test_loss": self.last_eval.get("test_loss"),
            "final_test_acc": self.last_eval.get("test_acc"),
            **self._task_summary(),
            "consensus_distance": self.last_eval.get("consensus_distance"),
            "bytes_sent_per_node_per_step": per_step,
            "bytes_ratio_to_dpsgd": (per_step / self.dpsgd_bytes) if self.dpsgd_bytes else None,
            "setup_bytes_per_node": setup if snap["setup"]["known"] else None,
            "bytes_sent_per_node_total": total,
            "bits_per_coord": wire.bits_per_coord,
            "bits_per_coord_measured": _measured_bits(self.comm, snap, self.dim, self.env),
            "time_split_s": {k: snap["time"].get(k, 0.0) for k in ("compute", "compress", "communicate", "wait")},
            "warmup_s": snap["time"].get("warmup", 0.0),
            "wall_time_s": self._elapsed(),
            "mode": self.env.mode,
            "diverged": False,
            "latency_ms": self.cfg.comm.emulate_latency,
            "latency_mode": "emulated" if self.cfg.comm.emulate_latency else None,
            "report": self.algo.report(),
        }
        summary.update(self.algo.summary_fields())
        if self.is_main:
            rundir.write_json(rundir.summary_path(self.out), summary)
            if self.sim_path is not None and n > 1:
                print(_memory_line(self.cfg, n, self.dim, self._mem0, self.device), flush=True)
            print(f"run directory: {self.out}", flush=True)
            return summary
        return None

    def _task_summary(self) -> dict:
        """The task, and for a language model its held-out bits per byte and perplexity
        (its final_test_loss is in nats per token; it has no accuracy)."""
        if self.task == data.CLASSIFICATION:
            return {"task": self.task}
        return {"task": self.task, "final_test_bpb": self.last_eval.get("test_bpb"),
                "final_test_ppl": self.last_eval.get("test_ppl")}

    def _identity(self) -> dict:
        """The keys that say what ran, first in config.json's extras and every summary."""
        wire = self.algo.wire_format()
        return {
            "schema": rundir.SCHEMA_VERSION,
            "algo": self.cfg.algorithm.name,
            "topology": self.cfg.comm.topology if self.topo is not None else None,
            "world_size": self.env.world_size,
            **_hosts(self.env),
            "compressor": wire.label,
            "bits": wire.bits_per_coord,
            "wire": wire.to_dict(),
        }

    def _config_record(self) -> dict:
        wire = self.algo.wire_format()
        return {
            **self.cfg_dict, "schema": rundir.SCHEMA_VERSION, "world_size": self.env.world_size,
            "params": self.dim, "mode": self.env.mode, "hostname": socket.gethostname(),
            "torch": torch.__version__, "wire": wire.to_dict(),
            "compressor_payload_bytes": _payload_bytes(self.algo, self.dim),
            "layout": self.gopt.layout.to_dict(), "task": self.task,
            **({"corpus": dict(self.dataset.corpus)} if self.dataset.corpus is not None else {}),
        }

    def _diverged_record(self, e: Exception) -> dict:
        return {
            **self._identity(), "epochs": self.cfg.run.epochs, "steps": self.progress.step, "diverged": True,
            "reason": str(e), "final_train_loss": None, "final_test_loss": None, "final_test_acc": None,
            **{k: None for k in self._task_summary() if k != "task"}, "task": self.task,
            "consensus_distance": None, "wall_time_s": self._elapsed(),
        }


# --------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------
@torch.no_grad()
def _evaluate_vectorized(gopt, dataset, device) -> dict:
    """The vectorized path's evaluation (classification): xbar's test loss and accuracy,
    and the nodes' own accuracies over ``vectorized.eval_nodes(n)`` (every node up to
    ``vectorized.EVAL_NODES``, else that many evenly spaced; docs/simulation.md), in
    batched calls. The keys of ``evaluation.METRICS`` for classification."""
    x_test = dataset.x_test.to(device)
    y_test = dataset.y_test.to(device)
    X = gopt.flat.data
    xbar = gopt.average()
    loss, acc = vectorized.node_accuracies(gopt, x_test, y_test, xbar.unsqueeze(0))
    every = vectorized.node_accuracies(gopt, x_test, y_test, X[vectorized.eval_nodes(X.shape[0]).to(X.device)])[1]
    return {
        "test_loss": float(loss[0]),
        "test_acc": float(acc[0]),
        "node_acc_min": float(every.min()),
        "node_acc_max": float(every.max()),
        "node_acc_mean": float(every.mean()),
        "consensus_distance": gopt.consensus_distance(),
    }


def _mean_over_nodes(comm, values: list[float]) -> float:
    t = torch.tensor([[v] for v in values], dtype=torch.float64)
    return float(comm.all_reduce(t, op="mean", record=False)[0, 0])


def _global_mean(comm, value: float, env: _Env) -> float:
    if not env.distributed:
        return value
    t = torch.tensor([[value]], dtype=torch.float64)
    return float(comm.all_reduce(t, op="mean", record=False)[0, 0])


# --------------------------------------------------------------------------------------
# accounting and printing
# --------------------------------------------------------------------------------------
def _node_ledger(snap: dict, r: int, hosted: int) -> dict:
    """Cumulative bytes of hosted row r and its share of the time, from a detailed snapshot."""
    setup = snap["setup"]["per_node"]
    sent = snap["per_node"]["sent"][r] - setup["sent"][r]
    recv = snap["per_node"]["received"][r] - setup["received"][r]
    t = snap["time"]
    return {
        "bytes_sent": sent, "bytes_recv": recv,
        "setup_bytes_sent": setup["sent"][r], "setup_bytes_recv": setup["received"][r],
        "warmup_s": t.get("warmup", 0.0) / hosted,
        "compute_s": t.get("compute", 0.0) / hosted,
        "compress_s": t.get("compress", 0.0) / hosted,
        # all time on the network: posting and transfers plus waiting for the peers
        "comm_s": (t.get("communicate", 0.0) + t.get("wait", 0.0)) / hosted,
        "wait_s": t.get("wait", 0.0) / hosted,
    }


def _bytes_per_node_step(snap: dict, n: int, steps: int, env: _Env) -> float:
    if steps == 0:
        return 0.0
    hosted = 1 if env.distributed else n
    return (snap["bytes"]["sent"] - snap["setup"]["sent"]) / hosted / steps


def _reference_topology(cfg: TrainConfig, n: int):
    """For a centralized run, the configured graph (or a ring) on n nodes, for the byte ratio."""
    for name in (cfg.comm.topology, "ring", "complete"):
        try:
            return topologies.build(name, n)
        except (ValueError, TypeError):
            continue
    return None


def _dpsgd_bytes(topo, dim: int) -> float:
    """Bytes per node per step of full-precision D-PSGD on this topology (0 if none)."""
    if topo is None:
        return 0.0
    return float(topo.degrees.mean()) * compress.build("identity").payload_nbytes(dim)


def _measured_bits(comm, snap: dict, dim: int, env: _Env) -> float | None:
    """Bits per coordinate per message as the ledger saw them: bytes sent / coordinates /
    messages, all ranks pooled (control messages, e.g. size checks, left out)."""
    msgs = snap.get("messages")
    if not msgs or dim == 0:
        return None
    setup = snap["setup"]
    # payload messages of the steps: control traffic and setup traffic (counted once) left out
    sent = snap["bytes"]["sent"] - snap["ops"]["control"]["sent"] - (setup["sent"] - setup["control"]["sent"])
    count = msgs["sent"] - msgs["control"] - (setup["messages"] - setup["control"]["messages"])
    if env.distributed:
        t = comm.all_reduce(torch.tensor([[float(sent), float(count)]], dtype=torch.float64), op="mean", record=False)
        sent, count = float(t[0, 0]), float(t[0, 1])
    return 8.0 * sent / (dim * count) if count else None


def _payload_bytes(algo, dim: int) -> int | None:
    c = algo.payload_compressor
    return None if c is None else int(c.payload_nbytes(dim))


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1024 or unit == "GB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.1f} GB"


def _header(cfg: TrainConfig, env: _Env, dim: int, algo) -> str:
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


def _epoch_line(epoch: float, epochs, ev, ledger, dpsgd_bytes, step, task: str = data.CLASSIFICATION) -> str:
    snap = ledger.as_dict()
    hosted = len(ledger.nodes)
    per_step = (snap["bytes"]["sent"] - snap["setup"]["sent"]) / hosted / max(1, step)
    ratio = f" ({per_step / dpsgd_bytes:.3f}x D-PSGD)" if dpsgd_bytes else ""
    t = snap["time"]
    return (
        f"epoch {(f'{epoch:.0f}' if epoch == int(epoch) else f'{epoch:.2f}'):>3}/{epochs}  train {ev['train_loss']:.4f}  test {ev['test_loss']:.4f}  "
        + (f"acc {ev['test_acc']:.2%} [nodes {ev['node_acc_min']:.2%}-{ev['node_acc_max']:.2%}]  "
           if task == data.CLASSIFICATION else
           f"bpb {ev['test_bpb']:.3f} ppl {ev['test_ppl']:.3g} [nodes {ev['node_bpb_min']:.3f}-{ev['node_bpb_max']:.3f}]  ")
        + f"consensus {ev['consensus_distance']:.3g}  sent/node/step {_fmt_bytes(per_step)}{ratio}  "
        f"time compute {t.get('compute', 0):.1f}s compress {t.get('compress', 0):.1f}s "
        f"comm {t.get('communicate', 0):.1f}s wait {t.get('wait', 0):.1f}s"
        + (f" warm-up {t['warmup']:.1f}s" if t.get("warmup") else "")
    )


def _progress(cfg, is_main, total, start):
    if not (cfg.run.progress and is_main):
        return None
    from tqdm.auto import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, CI), the epoch lines remain
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, leave=False, disable=None)
