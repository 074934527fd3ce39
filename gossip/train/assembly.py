"""The parts of a training run, built from its config: one function per part.

:func:`detect_env` says how the run is hosted (torchrun, or ``--simulate N`` in one
process); :func:`build_topology`, :func:`build_dataset`, :func:`build_model`,
:func:`build_algorithm` and :func:`local_optimizer` build the parts
:class:`gossip.train.loop.Run` trains with, each turning a refusal into one
:class:`~gossip.errors.RunError` line that names the flag. :func:`check_memory` refuses
a simulation that cannot fit before the nodes are built, :func:`check_resume_dir` a
``--resume`` that names no run directory, and :func:`simulation_path` says whether
``--simulate N`` runs the nodes as one batched model or one after another.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import topologies
from topologies import available_memory  # one reading of MemAvailable for both checks
from gossip import algorithms, data, factories, models, vectorized
from gossip.groups import GroupPlan
from gossip.train.config import RESUME_AUTO, TrainConfig
from gossip.errors import RunError

__all__ = [
    "Env", "build_adversary", "build_algorithm", "build_dataset", "build_model", "build_topology", "check_memory",
    "check_resume_dir", "choose_device", "detect_env", "group_size", "hosts_of", "local_optimizer", "lr_at", "lr_schedule", "memory_line",
    "path_line", "peak_memory",
    "simulation_path", "state_copies",
]


@dataclass
class Env:
    """How the run is hosted: its world size, whether under torchrun, this process's rank."""

    world_size: int
    distributed: bool
    rank: int  # this process's rank (0 in the simulation)

    @property
    def mode(self) -> str:
        return "torchrun" if self.distributed else "simulate"


def detect_env(cfg: TrainConfig) -> Env:
    """The run's :class:`Env`, from ``--simulate`` and torchrun's environment variables."""
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if cfg.comm.simulate is not None:
        if under_torchrun and int(os.environ["WORLD_SIZE"]) > 1:
            raise RunError("--simulate runs all nodes in one process: do not combine it with torchrun")
        return Env(world_size=cfg.comm.simulate, distributed=False, rank=0)
    if under_torchrun:
        return Env(int(os.environ["WORLD_SIZE"]), True, int(os.environ["RANK"]))
    return Env(world_size=1, distributed=False, rank=0)


def hosts_of(env: Env) -> dict:
    """``hosts`` and ``procs_per_host`` as torchrun launched the run (its LOCAL_WORLD_SIZE
    processes on each of WORLD_SIZE / LOCAL_WORLD_SIZE hosts); 1 and 1 in one process."""
    if not env.distributed:
        return {"hosts": 1, "procs_per_host": 1}
    per_host = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return {"hosts": max(1, env.world_size // per_host), "procs_per_host": per_host}


def group_size(cfg: TrainConfig, env: Env) -> int:
    """``--group-size``, checked against the world (and, under torchrun, the hosts); unset:
    1 with ``--simulate`` and on one host, and under torchrun across several hosts the
    processes of one host (``LOCAL_WORLD_SIZE``), so that a one-host run stays flat."""
    g, n = cfg.comm.group_size, env.world_size
    per_host = hosts_of(env)["procs_per_host"]
    if g is None:
        if env.distributed and n > per_host > 1 and n % per_host == 0:
            return per_host
        return 1
    try:
        plan = GroupPlan(n, g)
    except ValueError as e:
        raise RunError(f"--group-size {g}: {e}") from None
    if env.distributed and g > 1 and n > per_host and g % per_host and per_host % g:
        raise RunError(f"--group-size {g} splits a group across hosts of {per_host} processes "
                       f"(LOCAL_WORLD_SIZE): give a divisor of {per_host} (groups inside a host) or a multiple "
                       f"of it (whole hosts per group)")
    return plan.group_size


def build_topology(cfg: TrainConfig, n: int):
    """The graph of a decentralized algorithm on ``n`` nodes (None for a centralized one);
    a random graph draws from the run's seed. Pure: fails alike on every rank."""
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


def build_algorithm(cfg: TrainConfig, comm) -> algorithms.Algorithm:
    """The registry builds it from the run's values of ``gossip.algorithms.COMMON_OPTIONS``
    (``--seed``, ``--compressor``/``--bits``, ``--momentum``: the algorithm's own momentum
    where its Config has one; the registry decides where each applies), the user's
    ``--algo-opt`` and MergeComp's flags. The loop reads no Config field."""
    a = cfg.algorithm
    ours = {"seed": cfg.run.seed, "compressor": a.compressor_spec, "momentum": cfg.optim.momentum}
    common = {k: ours[k] for k in algorithms.COMMON_OPTIONS}  # the registry passes each where it applies
    opts: dict[str, Any] = dict(a.options)
    tr = cfg.trust
    if tr.aggregator is not None:  # the config has checked that the algorithm takes it
        opts["aggregator"] = tr.aggregator
    if tr.robust is not None:
        opts["robust"] = tr.robust
    if a.merge is not None:  # MergeComp: a schedule of the efsgd family, built by the registry
        opts.update(merge=a.merge, merge_max_groups=a.merge_max_groups, merge_alpha=a.merge_alpha)
    try:
        return algorithms.build(a.name, comm, common=common, **opts)
    except (ValueError, TypeError) as e:
        flag = f"--merge {a.merge}" if a.merge is not None and "merge" in str(e) else f"--algo {a.name}"
        raise RunError(f"{flag}: {e}") from None


def build_adversary(cfg: TrainConfig, n: int, dataset=None):
    """The run's Byzantine nodes (a :class:`gossip.robust.Adversary`), or None where
    every node is honest; the attackers are drawn from ``--seed``, alike on every rank."""
    from gossip import robust

    tr = cfg.trust
    if not tr.byzantine:
        return None
    try:
        attackers = robust.choose_attackers(n, tr.byzantine, cfg.run.seed)
        attack = robust.parse_attack(tr.attack)
    except ValueError as e:
        raise RunError(str(e)) from None
    if attack.name == "labelflip" and dataset is not None and getattr(dataset, "task", None) != data.CLASSIFICATION:
        raise RunError(f"--attack labelflip flips class labels; --data {cfg.data.name} is not a classification "
                       f"data set")
    return robust.Adversary(attack, attackers, n, seed=cfg.run.seed)


def build_dataset(cfg: TrainConfig):
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


def build_model(cfg: TrainConfig, dataset, device: torch.device) -> torch.nn.Module:
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


def state_copies(cfg: TrainConfig) -> int:
    """How many d-float copies of its parameters one node of the run's algorithm holds."""
    return algorithms.algorithm_class(cfg.algorithm.name).state_copies


def peak_memory(device: torch.device) -> int | None:
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


def memory_line(copies: int, m: int, d: int, before: int | None, device: torch.device) -> str:
    """The simulation's memory check, stated: the peak it expected (what the process held
    before the nodes were built, the data set included, plus the nodes' state), the peak
    measured."""
    state = 4 * d * copies * m  # the hosted nodes' parameter state, roughly
    peak = peak_memory(device)
    what = "CUDA allocator peak" if device.type == "cuda" else "maximum resident set of this process"
    measured = f"{peak / 2**30:.2f} GiB ({what})" if peak is not None else "unknown on this platform"
    base = before or 0
    return (f"memory: expected peak about {(base + state) / 2**30:.2f} GiB (before the nodes {base / 2**30:.2f} GiB, "
            f"plus {m} nodes x {d:,} parameters x {copies} copies "
            f"{state / 2**30:.2f} GiB); measured peak {measured}")


def check_memory(copies: int, m: int, d: int, device: torch.device) -> None:
    """Refuse, in one line, a simulation of ``m`` nodes of ``d`` parameters and ``copies``
    copies of them each that cannot fit in this machine's memory."""
    if device.type != "cpu" or m < 2:
        return
    need, have = 4 * d * copies * m, available_memory()
    if have is not None and need > have:
        fit = max(1, have // (4 * d * copies))
        raise RunError(
            f"--simulate {m}: {m} nodes x {d:,} parameters x about {copies} copies need about "
            f"{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB are available; about {fit} nodes would fit "
            f"(or run under torchrun on several machines)"
        )


def simulation_path(cfg: TrainConfig, env: Env, model: torch.nn.Module, dataset,
                     device: torch.device) -> tuple[str | None, str]:
    """Which path ``--simulate N`` takes, and why: ``("vectorized", "")``, ``("loop",
    reason)``, or ``(None, "")`` under torchrun. ``--simulate-mode vectorized`` refuses
    a model that cannot be batched instead of falling back."""
    mode = cfg.comm.simulate_mode
    if env.distributed or cfg.comm.simulate is None:
        return None, ""
    from gossip import algorithms

    if algorithms.algorithm_class(cfg.algorithm.name).asynchronous:
        if mode == "vectorized":
            raise RunError(f"--simulate-mode vectorized: --algo {cfg.algorithm.name} steps one node at a time on "
                           f"the event clock; use --simulate-mode auto or loop")
        return "loop", f"--algo {cfg.algorithm.name} steps one node at a time on the event clock"
    if mode == "loop":
        return "loop", "--simulate-mode loop"
    if group_size(cfg, env) > 1:
        return "loop", f"--group-size {group_size(cfg, env)}: the members' gradients are averaged group by group"
    if env.world_size < 2:
        why = "one node: nothing to batch"
    elif getattr(dataset, "task", "classification") != "classification":
        # before the trial below, which would try the classification loss on the labels
        # per position and report that failure instead of this reason
        why = f"the data set's task is {dataset.task!r}; the batched path serves classification"
    else:
        x = dataset.x_train[:2].to(device)
        y = dataset.y_train[:2].to(device)
        why = vectorized.why_not_vectorized(model, x, y) or ""
        if not why and dataset.y_train.dim() != 1:
            why = "the data has a label per position (a sequence task); the batched path takes one label per example"
        if not why and not all(p.requires_grad for p in model.parameters()):
            why = "the model has frozen parameters, which the batched model does not leave out of X yet"
    if not why:
        return "vectorized", ""
    if mode == "vectorized":
        raise RunError(f"--simulate-mode vectorized: --model {cfg.model_name} cannot run batched: {why}; "
                       f"use --simulate-mode auto or loop")
    return "loop", why


def path_line(n: int, path: str, why: str) -> str:
    """The line that says which path ``--simulate N`` takes, and why."""
    if path == "vectorized":
        return f"gossip.train: simulation path: vectorized ({n} nodes as one batched model)"
    return f"gossip.train: simulation path: loop ({n} nodes one after another: {why})"


def choose_device(cfg: TrainConfig, env: Env) -> torch.device:
    """``--device``: the CPU, or this rank's CUDA device (``LOCAL_RANK`` under torchrun)."""
    want = cfg.comm.device
    if want == "cpu":
        return torch.device("cpu")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RunError("--device cuda: no CUDA device is available; use --device cpu or auto")
        local = int(os.environ.get("LOCAL_RANK", "0")) if env.distributed else 0
        return torch.device("cuda", local)
    return torch.device("cpu")


def local_optimizer(cfg: TrainConfig, model: torch.nn.Module | None, params=None) -> torch.optim.Optimizer:
    """--optimizer: SGD with the local momentum, or AdamW with --beta1/--beta2 (decoupled
    weight decay); --lr and --weight-decay for both. ``params``, where given instead of
    ``model``: the vectorized path's stacked leaves (SGD and AdamW are element-wise;
    Muon orthogonalises each node's matrices on their own, batched)."""
    params = model.parameters() if params is None else params
    if cfg.local_optimizer == "muon":
        from gossip.algorithms.muloco import MuonAdamW, muon_optimizer

        precision = cfg.optim.muon_precision or "auto"
        try:
            if model is None:
                return MuonAdamW(params, lr=cfg.learning_rate, weight_decay=cfg.optim.weight_decay,
                                 precision=precision, stacked=True)
            return muon_optimizer(model, lr=cfg.learning_rate, weight_decay=cfg.optim.weight_decay,
                                  precision=precision)
        except ValueError as e:
            raise RunError(f"--optimizer {e}") from None
    if cfg.local_optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=cfg.betas,
                                 weight_decay=cfg.optim.weight_decay)
    return torch.optim.SGD(params, lr=cfg.learning_rate, momentum=cfg.local_momentum,
                           weight_decay=cfg.optim.weight_decay)


def lr_schedule(cfg: TrainConfig, total: int) -> Callable[[int], float]:
    """``--lr`` under ``--lr-schedule`` over a run of ``total`` steps: step -> learning rate
    (cosine: to 0 over the run; step: x0.1 at 50% and at 75%)."""
    lr, schedule = cfg.learning_rate, cfg.optim.lr_schedule
    if schedule == "cosine":
        return lambda step: 0.5 * lr * (1.0 + math.cos(math.pi * step / max(1, total)))
    if schedule == "step":
        return lambda step: lr * (0.1 ** ((step >= 0.5 * total) + (step >= 0.75 * total)))
    return lambda step: lr


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """The learning rate of step ``step`` of ``total`` under ``--lr-schedule``."""
    return lr_schedule(cfg, total)(step)


def check_resume_dir(cfg: TrainConfig) -> None:
    """Refuse, in one line, a ``--resume`` that names no run directory (``auto`` aside)."""
    if cfg.run.resume in (None, RESUME_AUTO):
        return
    try:
        is_dir = Path(cfg.run.resume).is_dir()
    except OSError as e:  # a name too long for the file system, a loop of links
        raise RunError(f"--resume {cfg.run.resume!r}: {e.strerror or e}") from None
    if not is_dir:
        raise RunError(f"--resume {cfg.run.resume!r}: no such run directory")
