"""The training run's typed configuration: flags, TOML files and validation.

``TrainConfig`` is a frozen dataclass; :func:`parse_args` builds it from the command
line, from a TOML file given with ``--config`` (same keys as the long flags, with
underscores or dashes), flags overriding the file. Every rule is checked in
``__post_init__`` and raises :class:`ConfigError` with one line naming the value and
what is accepted.

Options of the chosen algorithm's own Config (PowerSGD's ``rank``, sketched's ``p``)
come from repeated ``--algo-opt KEY=VALUE`` flags and an ``[algo_options]`` table of the
file, merged key by key with the flags winning; text values are read as the type of
the Config field they set.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigError", "TrainConfig", "build_parser", "parse_args", "LR_SCHEDULES"]

LR_SCHEDULES = ("constant", "cosine", "step")
#: the algorithms ``--merge`` can schedule (papers/004 over papers/000's error feedback)
MERGE_ALGOS = ("efsgd", "efblocksgd", "efblocksgdm")


def _is_decentralized(name: str) -> bool:
    from gossip import algorithms as _alg

    return _alg.is_decentralized(name)


def _algo_fields(name: str) -> set[str]:
    from gossip import algorithms as _alg

    return {f.name for f in dataclasses.fields(_alg.config_class(name))}


class ConfigError(ValueError):
    """A user error in the run's configuration (one line, no traceback)."""


#: algorithm Config fields the training loop sets itself, and where the user sets them
LOOP_SET_OPTIONS = {
    "seed": "give --seed instead",
    "compressor": "give --compressor (or --bits) instead",
    "momentum": "give --momentum instead",
    "shapes": "it comes from the model",
    "offsets": "it comes from the model",
}
_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def _kinds(hint: Any) -> tuple:
    """The types a Config field's annotation allows: ``int | None`` -> ``(int, NoneType)``."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return typing.get_args(hint) if union else (hint,)


def _coerce_option(algo: str, key: str, text: str, hint: Any) -> Any:
    """``text`` read as the type of the Config field ``key`` (``int | None`` and alike)."""
    kinds = _kinds(hint)
    low = text.strip().lower()
    if type(None) in kinds and low in ("none", "null"):
        return None
    if bool in kinds and low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                pass
    if str in kinds:
        return text
    wanted = [w for k, w in _WORDS.items() if k in kinds] + (["none"] if type(None) in kinds else [])
    if not wanted:
        raise ConfigError(f"--algo-opt {key}: --algo {algo} cannot take it as text (it is {hint})")
    raise ConfigError(f"--algo-opt {key}={text}: {key} of --algo {algo} takes {' or '.join(wanted)}")


def _registries() -> tuple[dict, dict, list, list, list]:
    import topologies

    from gossip import algorithms, compress, data, models

    return (
        algorithms.available(),
        compress.available(),
        list(topologies.available()),
        list(models.available_models()),
        list(data.available_datasets()),
    )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    algo: str = "ecd"
    bits: int | None = None
    compressor: str | None = None
    topology: str = "ring"
    degree: int | None = None
    rows: int | None = None
    cols: int | None = None
    weights: str | None = None
    lazy: bool = False
    model: str | None = None
    data: str = "mnist1d"
    data_dir: str | None = None
    partition: str = "iid"
    epochs: int = 20
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    lr_schedule: str = "constant"
    momentum: float | None = None
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"
    out: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    timeout: float = 300.0
    emulate_latency: float | None = None
    simulate: int | None = None
    log_every: int = 10
    progress: bool = True
    merge: str | None = None
    merge_max_groups: int = 2
    merge_alpha: float = 0.05
    #: options of the algorithm's own Config, kept as sorted ``(key, value)`` pairs so the
    #: config stays hashable; give a mapping, ``to_dict`` gives one back
    algo_options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        algos, comps, topos, mdls, datas = _registries()
        bad = ConfigError
        if self.algo not in algos:
            raise bad(f"unknown --algo {self.algo!r}; accepted: {', '.join(algos)}")
        if self.topology not in topos:
            raise bad(f"unknown --topology {self.topology!r}; accepted: {', '.join(topos)}")
        if self.model is not None and self.model not in mdls:
            raise bad(f"unknown --model {self.model!r}; accepted: {', '.join(mdls)}")
        if self.data not in datas:
            raise bad(f"unknown --data {self.data!r}; accepted: {', '.join(datas)}")
        if self.partition not in ("iid", "sorted"):
            raise bad(f"--partition must be 'iid' or 'sorted', got {self.partition!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise bad(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.weights is not None and self.weights not in ("uniform", "metropolis"):
            raise bad(f"--weights must be 'uniform' or 'metropolis', got {self.weights!r}")
        for name, lo in (("epochs", 1), ("batch_size", 1), ("log_every", 1), ("checkpoint_every", 0), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise bad(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
        for name in ("degree", "rows", "cols", "simulate", "max_steps"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(f"--{name} must be a positive integer, got {v!r}")
        for name, lo, strict in (("lr", 0.0, True), ("momentum", 0.0, False), ("weight_decay", 0.0, False), ("timeout", 0.0, True)):
            v = getattr(self, name)
            if v is None and name == "momentum":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or (strict and v == lo):
                rule = "> 0" if strict else ">= 0"
                raise bad(f"--{name.replace('_', '-')} must be a finite number {rule}, got {v!r}")
        if self.emulate_latency is not None and (
            isinstance(self.emulate_latency, bool) or not isinstance(self.emulate_latency, (int, float))
            or not math.isfinite(self.emulate_latency) or self.emulate_latency < 0
        ):
            raise bad(f"--emulate-latency must be a finite number of milliseconds >= 0, got {self.emulate_latency!r}")
        if self.momentum is not None and self.momentum >= 1.0:
            raise bad(f"--momentum must be in [0, 1), got {self.momentum!r}")
        from gossip import algorithms as _alg

        decentral = _alg.is_decentralized(self.algo)
        takes = _algo_fields(self.algo)
        if self.bits is not None:
            if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
                raise bad(f"--bits must be an integer from 1 to 16, got {self.bits!r}")
            if self.compressor is not None:
                raise bad("give either --bits or --compressor, not both (--bits B means --compressor quant:bits=B)")
        if (self.bits is not None or self.compressor is not None) and "compressor" not in takes:
            with_c = ", ".join(a for a in algos if "compressor" in _algo_fields(a))
            raise bad(f"--algo {self.algo} takes no --bits/--compressor; algorithms with a compressor: {with_c}")
        if self.compressor is not None:
            from gossip import compress

            try:
                compress.build(self.compressor)
            except (ValueError, TypeError) as e:
                raise bad(f"--compressor {self.compressor!r}: {e}") from None
        if self.merge is not None:
            self._check_merge()
        if self.simulate is not None and decentral and self.simulate < 2:
            raise bad(f"--simulate must be >= 2 for the decentralized --algo {self.algo}, got {self.simulate}")
        self._check_algo_options()

    def _check_algo_options(self) -> None:
        """Keys must be fields of the algorithm's Config the loop leaves to the user;
        text is read as the field's type. The values themselves are the Config's to check."""
        from gossip import algorithms as _alg

        raw = self.algo_options
        if not isinstance(raw, Mapping):
            try:
                raw = dict(raw)
            except (TypeError, ValueError):
                raise ConfigError(f"algo_options must be a table of KEY = VALUE, got {raw!r}") from None
        cfg_cls = _alg.config_class(self.algo)
        hints = typing.get_type_hints(cfg_cls)
        settable = [f.name for f in dataclasses.fields(cfg_cls) if f.name not in LOOP_SET_OPTIONS]
        opts = {}
        for k, v in raw.items():
            key = str(k).replace("-", "_")
            if key in LOOP_SET_OPTIONS:
                raise ConfigError(f"--algo-opt {key}: the training loop sets it; {LOOP_SET_OPTIONS[key]}")
            if key not in settable:
                accepted = f"; accepted: {', '.join(settable)}" if settable else ", which has none to set"
                raise ConfigError(f"--algo-opt {key}: not an option of --algo {self.algo}{accepted}")
            kinds = _kinds(hints[key])
            if isinstance(v, str):
                v = _coerce_option(self.algo, key, v, hints[key])
            elif isinstance(v, int) and not isinstance(v, bool) and float in kinds and int not in kinds:
                v = float(v)  # TOML's p = 1 for a float field
            elif v is not None and not isinstance(v, (bool, int, float)):
                raise ConfigError(f"--algo-opt {key}: a value must be a number, true/false or text, got {v!r}")
            opts[key] = v
        object.__setattr__(self, "algo_options", tuple(sorted(opts.items())))

    def _check_merge(self) -> None:
        from gossip.schedule import parse_merge

        bad = ConfigError
        try:
            mode = parse_merge(self.merge)
        except ValueError as e:
            raise bad(str(e)) from None
        object.__setattr__(self, "merge", str(mode))
        if self.algo not in MERGE_ALGOS:
            raise bad(f"--merge schedules the error-feedback algorithms {', '.join(MERGE_ALGOS)}; got --algo {self.algo}")
        v = self.merge_max_groups
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(f"--merge-max-groups must be an integer >= 1, got {v!r}")
        a = self.merge_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < 1:
            raise bad(f"--merge-alpha must be a number in (0, 1), got {a!r}")
        if mode not in ("layer", "whole") and self.simulate is not None and self.simulate > 1:
            raise bad(
                f"--merge {mode} times the backward pass of one node per process: run it under torchrun "
                f"(or --simulate 1); --merge layer and whole work with --simulate {self.simulate}"
            )

    # --- derived ---------------------------------------------------------------------
    @property
    def compressor_spec(self) -> str | None:
        """What goes on the wire: --compressor, --bits, else the algorithm's own default."""
        if self.compressor is not None:
            return self.compressor
        if self.bits is not None:
            return f"quant:bits={self.bits}"
        from gossip import algorithms as _alg

        fields = {f.name: f for f in dataclasses.fields(_alg.config_class(self.algo))}
        if "compressor" in fields:
            return fields["compressor"].default
        cfg_cls = _alg.config_class(self.algo)
        spec = getattr(cfg_cls, "compressor", None)  # e.g. a property of blocksign algorithms
        return spec if isinstance(spec, str) else None

    @property
    def local_momentum(self) -> float:
        """Momentum of the local SGD optimizer: none where the algorithm owns it."""
        if self.algorithm_momentum:
            return 0.0
        if self.momentum is not None:
            return self.momentum
        # a compressed centralized algorithm (signsgd) defines the whole direction itself
        plain = self.algo == "allreduce" or _is_decentralized(self.algo)
        return 0.9 if plain else 0.0

    @property
    def algorithm_momentum(self) -> bool:
        """True when the algorithm owns the momentum (the local optimizer then has none)."""
        return "momentum" in _algo_fields(self.algo)

    @property
    def model_name(self) -> str:
        if self.model is not None:
            return self.model
        return {"cifar10": "resnet20", "synthetic": "logreg"}.get(self.data, "cnn1d")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compressor_spec"] = self.compressor_spec
        d["model_name"] = self.model_name
        d["local_momentum"] = self.local_momentum
        d["algo_options"] = dict(self.algo_options)
        return d


_HELP = {
    "algo": "training algorithm",
    "bits": "shorthand for --compressor quant:bits=BITS (algorithms with a compressor; default: the algorithm's, 8 bits for naive/dcd/ecd)",
    "compressor": "compressor spec, e.g. quant:bits=4,block=256, qsgd:levels=16, randk:p=0.1",
    "topology": "communication graph of the decentralized algorithms",
    "degree": "degree of the expander topology",
    "rows": "rows of the torus (with --cols)",
    "cols": "columns of the torus (with --rows)",
    "weights": "mixing weights: uniform (regular graphs) or metropolis (default: uniform when regular)",
    "lazy": "use the lazy matrix (I+W)/2",
    "model": "model (default: cnn1d for mnist1d, resnet20 for cifar10, logreg for synthetic)",
    "data": "data set",
    "data_dir": "directory of a local data set (cifar10: the python batches)",
    "partition": "iid: random equal shards; sorted: contiguous slices of the label-sorted data",
    "epochs": "passes over each node's shard",
    "max_steps": "stop after this many steps (the schedule still spans --epochs; resume to go on)",
    "batch_size": "mini-batch size per node",
    "lr": "learning rate gamma of the local optimizer",
    "lr_schedule": "constant, cosine (to 0 over the run) or step (x0.1 at 50%% and 75%%)",
    "momentum": "momentum of the local SGD optimizer (unset: 0.9 for allreduce and the decentralized algorithms, "
    "0 for signsgd), or of the algorithm where it has its own (efsgd family, signum, powersgd; unset: its default)",
    "weight_decay": "weight decay of the local SGD optimizer",
    "seed": "seed of the model's x_1, the data order and the compressors' randomness",
    "device": "auto (cuda if available), cpu (gloo) or cuda (NCCL)",
    "out": "output directory (default runs/<timestamp>-<algo>-<topology>)",
    "checkpoint_every": "write a checkpoint every N steps (0: only at the end)",
    "resume": "continue the run in this directory from its latest checkpoint",
    "timeout": "seconds to wait for a peer before failing with its rank",
    "simulate": "run N nodes in this one process instead of under torchrun",
    "emulate_latency": "add this one-way latency (ms) to every message round inside the communicator, "
    "for networks where tc netem is unavailable (outputs say 'latency: emulated')",
    "log_every": "write a metrics record every N steps",
    "progress": "show a progress bar on rank 0",
    "merge": "MergeComp (papers/004) for efsgd/efblocksgd/efblocksgdm: layer (one group per tensor), whole "
    "(one group), N (N groups chosen by the cost model) or auto (Alg. 2); groups are compressed and sent "
    "while backward goes on",
    "merge_max_groups": "Y of Alg. 2 for --merge auto: the most groups tried",
    "merge_alpha": "alpha of Alg. 2 for --merge auto: stop when one more group gains less than this fraction",
    "algo_options": "an option of the algorithm's own Config, repeatable, read as that option's type "
    "(integer, number, true/false, none, text); e.g. --algo powersgd --algo-opt rank=4 "
    "--algo-opt approximator=best, --algo sketched --algo-opt p=0.01, --algo efmomentum --algo-opt "
    "nesterov=false; an unknown key lists the accepted ones; seed, compressor and momentum have their "
    "own flags (default: none; a TOML file gives them as an [algo_options] table)",
}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other user error of the CLI."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    algos, comps, topos, mdls, datas = _registries()
    defaults = TrainConfig.__dataclass_fields__
    p = _Parser(
        prog="gossip.train",
        description=(
            "Train with decentralized gossip (dpsgd, naive, dcd, ecd) or all-reduce, under "
            "torchrun (one rank per process) or in one process with --simulate N."
        ),
        epilog="Example: torchrun --nproc_per_node 8 -m gossip.train --algo ecd --bits 8 --topology ring",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with the same keys as the flags; flags override it")

    def add(name: str, **kw: Any) -> None:
        dflt = defaults[name].default
        kw.setdefault("help", _HELP[name])
        kw["help"] += f" (default: {'unset' if dflt is None else dflt})"
        p.add_argument("--" + name.replace("_", "-"), dest=name, **kw)

    add("algo", choices=list(algos))
    add("bits", type=int, metavar="B")
    add("compressor", metavar="SPEC")
    add("topology", choices=topos)
    add("degree", type=int, metavar="D")
    add("rows", type=int, metavar="R")
    add("cols", type=int, metavar="C")
    add("weights", choices=["uniform", "metropolis"])
    add("lazy", action="store_true")
    add("model", choices=mdls)
    add("data", choices=datas)
    add("data_dir", metavar="DIR")
    add("partition", choices=["iid", "sorted"])
    add("epochs", type=int)
    add("max_steps", type=int, metavar="N")
    add("batch_size", type=int)
    add("lr", type=float)
    add("lr_schedule", choices=list(LR_SCHEDULES))
    add("momentum", type=float)
    add("weight_decay", type=float)
    add("seed", type=int)
    add("device", choices=["auto", "cpu", "cuda"])
    add("out", metavar="DIR")
    add("checkpoint_every", type=int, metavar="N")
    add("resume", metavar="DIR")
    add("timeout", type=float, metavar="SECONDS")
    add("simulate", type=int, metavar="N")
    add("emulate_latency", type=float, metavar="MS")
    add("log_every", type=int, metavar="N")
    add("merge", metavar="MODE")
    add("merge_max_groups", type=int, metavar="Y")
    add("merge_alpha", type=float, metavar="ALPHA")
    p.add_argument(
        "--algo-opt", dest="algo_options", action="append", metavar="KEY=VALUE", help=_HELP["algo_options"]
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    return p


def _load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path!r} is not valid TOML: {e}") from None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    out = {}
    for k, v in raw.items():
        key = k.replace("-", "_")
        if key not in known:
            raise ConfigError(
                f"--config {path!r}: unknown key {k!r}; accepted: {', '.join(sorted(known))}"
            )
        out[key] = v
    return out


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    cfg_path = ns.pop("config", None)
    if cfg_path is not None:
        values.update(_load_toml(cfg_path))
    flags = ns.pop("algo_options", [])
    if flags:
        merged = values.get("algo_options", {})
        if not isinstance(merged, Mapping):
            raise ConfigError(f"--config {cfg_path!r}: algo_options must be a table, got {merged!r}")
        merged = {str(k).replace("-", "_"): v for k, v in merged.items()}
        for item in flags:
            key, eq, text = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"--algo-opt {item!r}: expected KEY=VALUE, e.g. --algo-opt rank=4")
            merged[key.strip().replace("-", "_")] = text
        values["algo_options"] = merged
    values.update(ns)
    try:
        return TrainConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None
