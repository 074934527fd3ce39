"""The training run's typed configuration: flags, TOML files and validation.

A :class:`TrainConfig` is six frozen sections, each a keyword-only dataclass that
checks its own fields in ``__post_init__``: ``data`` (data set, partition, batch
size), ``model``, ``optim`` (local optimizer and schedule), ``algorithm`` (algorithm,
compressor, its own options, MergeComp), ``comm`` (graph, device, transport, hosting)
and ``run`` (length, seed, output, checkpoints, logging). Every rule raises
:class:`ConfigError` with one line naming the value and what is accepted.

:func:`parse_args` builds it from the command line and a TOML file given with
``--config``, flags overriding the file. The file may use the flat keys of the long
flags (``lr = 0.1``, ``batch-size = 64``) or tables named after the sections
(``[optim] lr = 0.1``); ``config.json`` records the flat keys (:data:`FLAT_KEYS` maps
each to its section), so run directories of every version read the same.

Options of the chosen algorithm's own Config (PowerSGD's ``rank``, sketched's ``p``)
come from repeated ``--algo-opt KEY=VALUE`` flags and an ``[algo_options]`` (or
``[algorithm.options]``) table of the file, merged key by key with the flags winning;
text values are read as the type of the Config field they set.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AlgorithmSection",
    "CommSection",
    "ConfigError",
    "DataSection",
    "FLAT_KEYS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "ModelSection",
    "OptimSection",
    "RunSection",
    "SECTIONS",
    "SIMULATE_MODES",
    "TrainConfig",
    "build_parser",
    "parse_args",
]

LR_SCHEDULES = ("constant", "cosine", "step")
#: the local optimizers of ``--optimizer``
OPTIMIZERS = ("sgd", "adamw", "muon")
#: --simulate-mode: how the in-process simulation runs the nodes (docs/simulation.md)
SIMULATE_MODES = ("auto", "vectorized", "loop")
#: the learning rate of each local optimizer when ``--lr`` is unset
DEFAULT_LR = {"sgd": 0.05, "adamw": 0.001, "muon": 0.001}
#: AdamW's (beta1, beta2) when ``--beta1``/``--beta2`` are unset (torch's defaults)
DEFAULT_BETAS = (0.9, 0.999)


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


# --------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------
def _bad_int(name: str, v: Any, lo: int) -> bool:
    return isinstance(v, bool) or not isinstance(v, int) or v < lo


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_number(name: str, v: Any, *, strict: bool, allow_none: bool = False) -> None:
    """A finite number > 0 (``strict``) or >= 0, named by its flag."""
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (strict and v == 0):
        raise ConfigError(f"{_flag(name)} must be a finite number {'> 0' if strict else '>= 0'}, got {v!r}")


def _is_factory(name: object) -> bool:
    return isinstance(name, str) and ":" in name


class _AnyOption(tuple):
    """Accepts every key: a model's options are checked once the model is known."""

    def __contains__(self, key: object) -> bool:
        return True

    def __bool__(self) -> bool:
        return True


_ANY_OPTION = _AnyOption()


def _text_value(text: str) -> Any:
    """A --model-opt/--data-opt value: true/false, an integer, a number, else the text."""
    if text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _check_named_options(flag: str, what: str, raw: Any, accepted: tuple[str, ...] | None) -> tuple:
    """``options`` of a model or data set as sorted ``(key, value)`` pairs; keys checked
    against ``accepted`` (None: the user's own, which takes none), text read as a value."""
    if not isinstance(raw, Mapping):
        try:
            raw = dict(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag}: expected a table of KEY = VALUE, got {raw!r}") from None
    opts = {}
    for k, v in raw.items():
        key = str(k).replace("-", "_")
        if not accepted or key not in accepted:
            took = f"; accepted: {', '.join(accepted)}" if accepted else ", which takes none"
            raise ConfigError(f"{flag} {key}: not an option of {what}{took}")
        if isinstance(v, str):
            v = _text_value(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{flag} {key}={v!r}: must be a finite number")
        if not isinstance(v, (bool, int, float, str)):
            raise ConfigError(f"{flag} {key}: a value must be a number, true/false or text, got {v!r}")
        opts[key] = v
    return tuple(sorted(opts.items()))


@dataclass(frozen=True, kw_only=True)
class DataSection:
    """What each node trains on: ``[data]`` in a TOML file."""

    name: str = "mnist1d"
    data_dir: str | None = None
    partition: str = "iid"
    batch_size: int = 32
    #: the data set's own options (``--data-opt context=256``), sorted ``(key, value)`` pairs
    options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        datas = _registries()[4]
        if not isinstance(self.name, str) or (self.name not in datas and not _is_factory(self.name)):
            raise ConfigError(f"unknown --data {self.name!r}; accepted: {', '.join(datas)}, "
                              f"or module.path:function (your own data, see gossip.factories)")
        from gossip import data as _data

        accepted = None if _is_factory(self.name) else _data.dataset_options(self.name)
        object.__setattr__(self, "options", _check_named_options("--data-opt", f"--data {self.name}",
                                                                 self.options, accepted))
        if self.partition not in ("iid", "sorted"):
            raise ConfigError(f"--partition must be 'iid' or 'sorted', got {self.partition!r}")
        if _bad_int("batch_size", self.batch_size, 1):
            raise ConfigError(f"--batch-size must be an integer >= 1, got {self.batch_size!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """``[model]``: the model's name; unset picks the data set's own."""

    name: str | None = None
    #: the model's own options (``--model-opt layers=4``), sorted ``(key, value)`` pairs
    options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        mdls = _registries()[3]
        if self.name is not None and (not isinstance(self.name, str) or (self.name not in mdls and not _is_factory(self.name))):
            raise ConfigError(f"unknown --model {self.name!r}; accepted: {', '.join(mdls)}, "
                              f"or module.path:function (your own model, see gossip.factories)")
        # keys are checked against the model's by TrainConfig (the default model depends on --data)
        object.__setattr__(self, "options", _check_named_options("--model-opt", "the model", self.options,
                                                                 _ANY_OPTION))


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    """``[optim]``: the local optimizer and its schedule.

    ``optimizer`` unset is the algorithm's default (sgd; adamw for diloco); ``lr`` unset
    is :data:`DEFAULT_LR` of that optimizer; ``beta1``/``beta2`` are AdamW's (unset:
    0.9 and 0.999), ``momentum`` is SGD's."""

    lr: float | None = None
    lr_schedule: str = "constant"
    momentum: float | None = None
    weight_decay: float = 0.0
    optimizer: str | None = None
    beta1: float | None = None
    beta2: float | None = None

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _check_number("lr", self.lr, strict=True, allow_none=True)
        _check_number("weight_decay", self.weight_decay, strict=False)
        for name in ("momentum", "beta1", "beta2"):
            v = getattr(self, name)
            _check_number(name, v, strict=False, allow_none=True)
            if v is not None and v >= 1.0:
                raise ConfigError(f"--{name} must be in [0, 1), got {v!r}")


@dataclass(frozen=True, kw_only=True)
class AlgorithmSection:
    """``[algorithm]``: the algorithm, its compressor, its own options and MergeComp."""

    name: str = "ecd"
    bits: int | None = None
    compressor: str | None = None
    merge: str | None = None
    merge_max_groups: int = 2
    merge_alpha: float = 0.05
    #: options of the algorithm's own Config, kept as sorted ``(key, value)`` pairs so the
    #: config stays hashable; give a mapping, ``TrainConfig.to_dict`` gives one back
    options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        algos = _registries()[0]
        if self.name not in algos:
            raise ConfigError(f"unknown --algo {self.name!r}; accepted: {', '.join(algos)}")
        takes = _algo_fields(self.name)
        if self.bits is not None:
            if _bad_int("bits", self.bits, 1) or self.bits > 16:
                raise ConfigError(f"--bits must be an integer from 1 to 16, got {self.bits!r}")
            if self.compressor is not None:
                raise ConfigError(
                    "give either --bits or --compressor, not both (--bits B means --compressor quant:bits=B)"
                )
        if (self.bits is not None or self.compressor is not None) and "compressor" not in takes:
            with_c = ", ".join(a for a in algos if "compressor" in _algo_fields(a))
            raise ConfigError(
                f"--algo {self.name} takes no --bits/--compressor; algorithms with a compressor: {with_c}"
            )
        if self.compressor is not None:
            from gossip import compress

            try:
                compress.build(self.compressor)
            except (ValueError, TypeError) as e:
                # the compressor's message names the spec itself: say it once
                raise ConfigError(f"--compressor: {e}" if repr(self.compressor) in str(e)
                                  else f"--compressor {self.compressor!r}: {e}") from None
        if self.merge is not None:
            self._check_merge()
        self._check_merge_search()
        self._check_options()

    def _check_merge_search(self) -> None:
        """--merge-max-groups and --merge-alpha tune --merge auto's search and nothing else:
        given without it they are refused, not silently recorded (the resume fingerprint
        holds them, so a value with no effect would still refuse a resume)."""
        if self.merge == "auto":
            return
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in ("merge_max_groups", "merge_alpha"):
            if getattr(self, name) != defaults[name]:
                now = f"--merge {self.merge}" if self.merge is not None else "no --merge"
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)!r} tunes --merge auto's search "
                                  f"and has no effect with {now}: drop it, or give --merge auto")

    def _check_options(self) -> None:
        """Keys must be fields of the algorithm's Config the runtime leaves to the user;
        text is read as the field's type. The values themselves are the Config's to check."""
        from gossip import algorithms as _alg

        raw = self.options
        if not isinstance(raw, Mapping):
            try:
                raw = dict(raw)
            except (TypeError, ValueError):
                raise ConfigError(f"algo_options must be a table of KEY = VALUE, got {raw!r}") from None
        cfg_cls = _alg.config_class(self.name)
        hints = typing.get_type_hints(cfg_cls)
        settable = [f.name for f in dataclasses.fields(cfg_cls) if f.name not in LOOP_SET_OPTIONS]
        opts = {}
        for k, v in raw.items():
            key = str(k).replace("-", "_")
            if key in LOOP_SET_OPTIONS:
                raise ConfigError(f"--algo-opt {key}: the training loop sets it; {LOOP_SET_OPTIONS[key]}")
            if key not in settable:
                accepted = f"; accepted: {', '.join(settable)}" if settable else ", which has none to set"
                raise ConfigError(f"--algo-opt {key}: not an option of --algo {self.name}{accepted}")
            kinds = _kinds(hints[key])
            if isinstance(v, str):
                v = _coerce_option(self.name, key, v, hints[key])
            elif isinstance(v, int) and not isinstance(v, bool) and float in kinds and int not in kinds:
                v = float(v)  # TOML's p = 1 for a float field
            elif v is not None and not isinstance(v, (bool, int, float)):
                raise ConfigError(f"--algo-opt {key}: a value must be a number, true/false or text, got {v!r}")
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"--algo-opt {key}={v!r}: must be a finite number")
            opts[key] = v
        object.__setattr__(self, "options", tuple(sorted(opts.items())))

    def _check_merge(self) -> None:
        from gossip import algorithms as _alg
        from gossip.schedule import parse_merge

        try:
            mode = parse_merge(self.merge)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "merge", str(mode))
        if not _alg.algorithm_class(self.name).mergeable:
            raise ConfigError(
                f"--merge schedules the error-feedback algorithms {', '.join(_alg.mergeable())}; got --algo {self.name}"
            )
        if _bad_int("merge_max_groups", self.merge_max_groups, 1):
            raise ConfigError(f"--merge-max-groups must be an integer >= 1, got {self.merge_max_groups!r}")
        a = self.merge_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < 1:
            raise ConfigError(f"--merge-alpha must be a number in (0, 1), got {a!r}")

    @property
    def decentralized(self) -> bool:
        return _is_decentralized(self.name)

    @property
    def compressor_spec(self) -> str | None:
        """What goes on the wire: --compressor, --bits, else the Config's own default."""
        if self.compressor is not None:
            return self.compressor
        if self.bits is not None:
            return f"quant:bits={self.bits}"
        from gossip import algorithms as _alg

        cfg_cls = _alg.config_class(self.name)
        fields = {f.name: f for f in dataclasses.fields(cfg_cls)}
        if "compressor" in fields:
            return fields["compressor"].default
        return None


@dataclass(frozen=True, kw_only=True)
class CommSection:
    """``[comm]``: the graph, the device and transport, and how nodes are hosted."""

    topology: str = "ring"
    degree: int | None = None
    rows: int | None = None
    cols: int | None = None
    weights: str | None = None
    lazy: bool = False
    device: str = "auto"
    timeout: float = 300.0
    emulate_latency: float | None = None
    simulate: int | None = None
    fault_tolerance: str | None = None
    min_replicas: int = 1
    simulate_mode: str = "auto"

    def __post_init__(self) -> None:
        topos = _registries()[2]
        if self.simulate_mode not in SIMULATE_MODES:
            raise ConfigError(f"--simulate-mode must be one of {', '.join(SIMULATE_MODES)}, got {self.simulate_mode!r}")
        if self.topology not in topos:
            raise ConfigError(f"unknown --topology {self.topology!r}; accepted: {', '.join(topos)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.weights is not None and self.weights not in ("uniform", "metropolis"):
            raise ConfigError(f"--weights must be 'uniform' or 'metropolis', got {self.weights!r}")
        if not isinstance(self.lazy, bool):
            raise ConfigError(f"--lazy must be true or false, got {self.lazy!r}")
        for name in ("degree", "rows", "cols", "simulate"):
            v = getattr(self, name)
            if v is not None and _bad_int(name, v, 1):
                raise ConfigError(f"--{name} must be a positive integer, got {v!r}")
        _check_number("timeout", self.timeout, strict=True)
        e = self.emulate_latency
        if e is not None and (isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or e < 0):
            raise ConfigError(f"--emulate-latency must be a finite number of milliseconds >= 0, got {e!r}")
        if e is not None and e > 60_000:
            raise ConfigError(f"--emulate-latency must be at most 60000 ms (one minute per message round), got {e!r}")
        if self.fault_tolerance is not None:
            from gossip.fault_tolerance import lighthouse_address

            try:
                lighthouse_address(self.fault_tolerance)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if _bad_int("min_replicas", self.min_replicas, 1):
            raise ConfigError(f"--min-replicas must be a positive integer, got {self.min_replicas!r}")


@dataclass(frozen=True, kw_only=True)
class RunSection:
    """``[run]``: length, seed, output directory, checkpoints, logging."""

    epochs: int = 20
    max_steps: int | None = None
    seed: int = 0
    out: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    log_every: int = 10
    progress: bool = True
    tensorboard: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        for name, lo in (("epochs", 1), ("log_every", 1), ("checkpoint_every", 0), ("seed", 0)):
            v = getattr(self, name)
            if _bad_int(name, v, lo):
                raise ConfigError(f"{_flag(name)} must be an integer >= {lo}, got {v!r}")
        if self.max_steps is not None and _bad_int("max_steps", self.max_steps, 1):
            raise ConfigError(f"--max_steps must be a positive integer, got {self.max_steps!r}")
        if self.seed >= 2**63:
            raise ConfigError(f"--seed must be below 2**63 (torch's generators take 64-bit seeds), got {self.seed}")
        for name in ("out", "resume"):  # an unset shell variable must not mean "here"
            v = getattr(self, name)
            if isinstance(v, str) and not v.strip():
                raise ConfigError(f"--{name} must name a directory, got {v!r} (an unset variable?)")
        if self.resume == "auto" and self.out is None:
            raise ConfigError("--resume auto continues the run in --out: give --out DIR")
        if self.resume is not None and self.overwrite:
            raise ConfigError("--overwrite replaces a run and --resume continues one: give one of them")
        if (self.resume not in (None, "auto") and self.out is not None
                and os.path.abspath(self.out) != os.path.abspath(self.resume)):
            raise ConfigError(f"--resume {self.resume!r} continues the run in that directory; --out "
                              f"{self.out!r} names another: drop --out (or give --resume auto --out DIR)")


#: the sections of a TrainConfig, in the order of ``to_dict`` and of ``--help``
SECTIONS: dict[str, type] = {
    "data": DataSection,
    "model": ModelSection,
    "optim": OptimSection,
    "algorithm": AlgorithmSection,
    "comm": CommSection,
    "run": RunSection,
}
#: flat keys (the long flags, config.json's keys) whose section field has another name
_RENAMED = {
    "data": ("data", "name"),
    "model": ("model", "name"),
    "algo": ("algorithm", "name"),
    "algo_options": ("algorithm", "options"),
    "model_options": ("model", "options"),
    "data_options": ("data", "options"),
}
#: every flat key -> (section, field)
FLAT_KEYS: dict[str, tuple[str, str]] = {
    **{
        f.name: (sec, f.name)
        for sec, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if (sec, f.name) not in _RENAMED.values()
    },
    **_RENAMED,
}


class TrainConfig:
    """The run's whole configuration: six frozen, validated sections.

    ``TrainConfig(data=DataSection(...), optim={"lr": 0.1}, ...)`` takes sections (or
    mappings of their fields); :meth:`from_flat` takes the flat keys of the command
    line and of ``config.json`` (``algo``, ``lr``, ``batch_size`` ...). Each section
    checks its own fields in ``__post_init__``; the rules that tie sections together
    are checked here. Instances are immutable and compare by value.
    """

    __slots__ = tuple(SECTIONS)

    def __init__(self, **sections: Any) -> None:
        unknown = set(sections) - set(SECTIONS)
        if unknown:
            raise ConfigError(f"unknown config section(s) {sorted(unknown)}; sections: {', '.join(SECTIONS)}")
        sections = {**sections, "comm": self._default_topology(sections)}
        for name, cls in SECTIONS.items():
            value = sections.get(name, {})
            if isinstance(value, Mapping):
                fields = {f.name for f in dataclasses.fields(cls)}
                extra = sorted(set(value) - fields)
                if extra:
                    raise ConfigError(f"[{name}]: unknown key(s) {extra}; accepted: {', '.join(sorted(fields))}")
                value = cls(**value)
            elif not isinstance(value, cls):
                raise ConfigError(f"section {name!r} must be a {cls.__name__} or a table, got {type(value).__name__}")
            object.__setattr__(self, name, value)
        self._check_across()

    @staticmethod
    def _default_topology(sections: Mapping[str, Any]) -> Any:
        """The [comm] section with ``topology`` filled in from the algorithm's default
        (``onepeer-exp`` for sgp, else ``ring``) where it is not given."""
        comm = sections.get("comm", {})
        if not isinstance(comm, Mapping) or "topology" in comm:
            return comm
        alg = sections.get("algorithm", {})
        name = alg.get("name", AlgorithmSection.name) if isinstance(alg, Mapping) else getattr(alg, "name", None)
        from gossip import algorithms as _alg

        if not isinstance(name, str) or name not in _alg.available():
            return comm  # the algorithm section names the error
        return {**comm, "topology": _alg.default_topology(name)}

    @classmethod
    def from_flat(cls, values: Mapping[str, Any] | None = None, /, **flat: Any) -> TrainConfig:
        """From flat keys (``algo="dcd", lr=0.1``), as the flags and config.json name them."""
        merged = {**(values or {}), **flat}
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, v in merged.items():
            if key not in FLAT_KEYS:
                raise ConfigError(f"unknown config key {key!r}; accepted: {', '.join(sorted(FLAT_KEYS))}")
            sec, fld = FLAT_KEYS[key]
            sections[sec][fld] = v
        return cls(**sections)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainConfig) and all(getattr(self, n) == getattr(other, n) for n in SECTIONS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in SECTIONS))

    def __repr__(self) -> str:
        return "TrainConfig(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in SECTIONS) + ")"

    def replace(self, **flat: Any) -> TrainConfig:
        """A copy with some flat keys changed."""
        current = {k: v for k, v in self.flat().items()}
        return TrainConfig.from_flat(current, **flat)

    def _check_across(self) -> None:
        alg, comm, opt = self.algorithm, self.comm, self.optim
        if self.model.options:  # the model is known here (its default depends on --data)
            from gossip import models as _models

            name = self.model_name
            accepted = None if _is_factory(name) else _models.model_options(name)
            _check_named_options("--model-opt", f"--model {name}", self.model.options, accepted)
        which = "--optimizer adamw" if opt.optimizer else f"--algo {alg.name}'s default optimizer adamw"
        if self.local_optimizer == "adamw" and opt.momentum is not None and "momentum" not in _algo_fields(alg.name):
            raise ConfigError(f"--momentum is the SGD optimizer's; {which} has --beta1 (its momentum) and --beta2 instead")
        if self.local_optimizer == "sgd" and (opt.beta1 is not None or opt.beta2 is not None):
            raise ConfigError("--beta1/--beta2 are AdamW's; give --optimizer adamw with them (SGD has --momentum)")
        if comm.simulate is not None and alg.decentralized and comm.simulate < 2:
            raise ConfigError(f"--simulate must be >= 2 for the decentralized --algo {alg.name}, got {comm.simulate}")
        if alg.merge is not None and alg.merge not in ("layer", "whole") and comm.simulate is not None and comm.simulate > 1:
            raise ConfigError(
                f"--merge {alg.merge} times the backward pass of one node per process: run it under torchrun "
                f"(or --simulate 1); --merge layer and whole work with --simulate {comm.simulate}"
            )

    # --- derived ---------------------------------------------------------------------
    @property
    def local_momentum(self) -> float:
        """Momentum of the local SGD optimizer: none where the algorithm has its own or
        the local optimizer is AdamW (its momentum is beta1)."""
        if "momentum" in _algo_fields(self.algorithm.name) or self.local_optimizer != "sgd":
            return 0.0
        if self.optim.momentum is not None:
            return self.optim.momentum
        from gossip import algorithms as _alg

        return _alg.local_momentum_default(self.algorithm.name)

    @property
    def local_optimizer(self) -> str:
        """``sgd`` or ``adamw``: --optimizer, else the algorithm's default."""
        if self.optim.optimizer is not None:
            return self.optim.optimizer
        from gossip import algorithms as _alg

        return _alg.local_optimizer_default(self.algorithm.name)

    @property
    def learning_rate(self) -> float:
        """--lr, else the local optimizer's default (:data:`DEFAULT_LR`)."""
        return self.optim.lr if self.optim.lr is not None else DEFAULT_LR[self.local_optimizer]

    @property
    def betas(self) -> tuple[float, float] | None:
        """AdamW's (beta1, beta2); None for SGD."""
        if self.local_optimizer != "adamw":
            return None
        b1, b2 = self.optim.beta1, self.optim.beta2
        return (DEFAULT_BETAS[0] if b1 is None else b1, DEFAULT_BETAS[1] if b2 is None else b2)

    @property
    def model_name(self) -> str:
        if self.model.name is not None:
            return self.model.name
        if _is_factory(self.data.name):
            return "mlp"  # the user's own data: a multi-layer perceptron unless --model says otherwise
        return {"cifar10": "resnet20", "synthetic": "logreg", "text": "gpt", "wikitext2": "gpt"}.get(self.data.name,
                                                                                                     "cnn1d")

    def flat(self) -> dict[str, Any]:
        """The flat keys and their values (no derived ones)."""
        out = {}
        for key, (sec, fld) in FLAT_KEYS.items():
            out[key] = getattr(getattr(self, sec), fld)
        for key in _OPTION_TABLES:
            out[key] = dict(out[key])
        return out

    def to_dict(self) -> dict[str, Any]:
        """config.json's keys: the flat keys in the historical order, then derived ones."""
        flat = self.flat()
        d = {k: flat[k] for k in _FLAT_ORDER}
        d["lr"] = self.learning_rate  # the value the run uses (unset: the optimizer's default)
        d["compressor_spec"] = self.algorithm.compressor_spec
        d["model_name"] = self.model_name
        d["local_momentum"] = self.local_momentum
        d["local_optimizer"] = self.local_optimizer
        betas = self.betas
        d["betas"] = list(betas) if betas is not None else None
        return d


#: the order of config.json's keys (unchanged since the first release)
_FLAT_ORDER = (
    "algo", "bits", "compressor", "topology", "degree", "rows", "cols", "weights", "lazy", "model", "data",
    "data_dir", "partition", "epochs", "max_steps", "batch_size", "lr", "lr_schedule", "momentum",
    "weight_decay", "seed", "device", "out", "checkpoint_every", "resume", "timeout", "emulate_latency",
    "simulate", "log_every", "progress", "merge", "merge_max_groups", "merge_alpha", "algo_options",
    "tensorboard", "overwrite", "optimizer", "beta1", "beta2", "fault_tolerance", "min_replicas",
    "model_options", "data_options", "simulate_mode",
)
#: the flat keys that are tables of KEY = VALUE (flags --algo-opt, --model-opt, --data-opt)
_OPTION_TABLES = ("algo_options", "model_options", "data_options")
assert set(_FLAT_ORDER) == set(FLAT_KEYS), "every flat key has its place in config.json"


#: defaults that depend on other flags, as --help states them (TrainConfig fills them in)
_DEFAULT_TEXT = {
    "topology": "onepeer-exp for sgp, ring otherwise",
    "weights": "uniform when regular",
    "model": "cnn1d for mnist1d, resnet20 for cifar10, logreg for synthetic, gpt for text and wikitext2, "
    "mlp for your own data",
}


def _flat_default(key: str) -> Any:
    sec, fld = FLAT_KEYS[key]
    return SECTIONS[sec].__dataclass_fields__[fld].default


_HELP = {
    "algo": "training algorithm",
    "bits": "shorthand for --compressor quant:bits=BITS (algorithms with a compressor; default: the algorithm's, 8 bits for naive/dcd/ecd)",
    "compressor": "compressor spec, e.g. quant:bits=4,block=256, qsgd:levels=16, randk:p=0.1 (choco also: topk:p=0.01, sign)",
    "topology": "communication graph of the decentralized algorithms",
    "degree": "degree of the expander topology",
    "rows": "rows of the torus (with --cols)",
    "cols": "columns of the torus (with --rows)",
    "weights": "mixing weights: uniform (regular graphs) or metropolis",
    "lazy": "use the lazy matrix (I+W)/2",
    "model": "model, or your own as module.path:function, called as function(input_shape, num_classes) and "
    "returning a torch.nn.Module",
    "data": "data set, or your own as module.path:function, called as function(seed) and returning a "
    "gossip.data.Dataset or ((x_train, y_train), (x_test, y_test))",
    "data_dir": "directory of a local data set (cifar10: the python batches; wikitext2: wiki.train.raw, "
    "wiki.valid.raw, wiki.test.raw) or, for text, a UTF-8 file or folder (default: the Python standard "
    "library's sources)",
    "model_options": "an option of the model, repeatable, e.g. --model gpt --model-opt layers=4 --model-opt "
    "width=128 --model-opt heads=4; an unknown key lists the accepted ones (default: none; a TOML file "
    "gives them as a [model_options] table)",
    "data_options": "an option of the data set, repeatable, e.g. --data text --data-opt context=128 "
    "--data-opt test_fraction=0.1 --data-opt max_test_bytes=65536 (default: none; a TOML file gives them "
    "as a [data_options] table)",
    "partition": "iid: random equal shards; sorted: contiguous slices of the label-sorted data (text: of "
    "the text)",
    "epochs": "passes over each node's shard",
    "max_steps": "stop after this many steps (the schedule still spans --epochs; resume to go on)",
    "batch_size": "mini-batch size per node",
    "lr": "learning rate gamma of the local optimizer (unset: 0.05 for sgd, 0.001 for adamw)",
    "lr_schedule": "constant, cosine (to 0 over the run) or step (x0.1 at 50%% and 75%%)",
    "momentum": "momentum of the local SGD optimizer (unset: 0.9 for allreduce and the decentralized algorithms, "
    "0 for signsgd), or of the algorithm where it has its own (efsgd family, signum, powersgd; unset: its default)",
    "weight_decay": "weight decay of the local optimizer (AdamW's is decoupled)",
    "optimizer": "the local optimizer (unset: adamw for diloco, sparseloco and noloco, muon for muloco, sgd for "
    "every other algorithm; muon: torch.optim.Muon on the 2-D weights, AdamW on the rest); an "
    "algorithm that applies its own momentum refuses adamw with --beta1 > 0",
    "beta1": "AdamW's first-moment decay, its momentum (unset: 0.9); adamw only",
    "beta2": "AdamW's second-moment decay (unset: 0.999); adamw only",
    "seed": "seed of the model's x_1, the data order and the compressors' randomness",
    "device": "auto (cuda if available), cpu (gloo) or cuda (NCCL)",
    "out": "output directory (default runs/<timestamp>-<algo>-<topology>)",
    "checkpoint_every": "write a checkpoint every N steps (0: only at the end)",
    "resume": "continue the run in this directory from its latest checkpoint; 'auto' continues the run in --out "
    "from its newest valid checkpoint if it has one and starts it otherwise (for torchrun --max-restarts)",
    "timeout": "seconds to wait for a peer before failing with its rank",
    "simulate": "run N nodes in this one process instead of under torchrun",
    "fault_tolerance": "keep training when workers die and rejoin: the torchft Lighthouse's HOST:PORT; each "
    "worker is started alone with REPLICA_GROUP_ID and NUM_REPLICA_GROUPS (see docs/fault-tolerance.md)",
    "min_replicas": "with --fault-tolerance: the fewest live workers a step may average over",
    "simulate_mode": "how --simulate N runs the nodes: auto (all nodes as one batched call where the model "
    "allows it, else one after another, saying why), vectorized (refuse a model that cannot be batched) or "
    "loop (one after another, bit-identical with torchrun)",
    "emulate_latency": "add this one-way latency (ms) to every message round inside the communicator, "
    "for networks where tc netem is unavailable (outputs say 'latency: emulated')",
    "log_every": "write a metrics record every N steps",
    "progress": "show a progress bar on rank 0",
    "overwrite": "replace the run already in --out: the files a run writes (config, summary, metrics, error logs, "
    "checkpoints, TensorBoard events) are deleted first, nothing else; without it a non-empty --out is refused",
    "tensorboard": "also write the metrics as TensorBoard scalars to <out>/tensorboard "
    "(needs the optional extra: pip install 'gossip[tensorboard]')",
    "merge": "MergeComp (Wang et al. 2021, arXiv:2103.15195) for efsgd/efblocksgd/efblocksgdm: layer (one group per tensor), whole "
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
    """The ``gossip.train`` argument parser; the choices come from the registries."""
    algos, comps, topos, mdls, datas = _registries()
    p = _Parser(
        prog="gossip.train",
        description=(
            "Train with decentralized gossip (dpsgd, naive, dcd, ecd, choco) or all-reduce, under "
            "torchrun (one rank per process) or in one process with --simulate N."
        ),
        epilog="Example: torchrun --nproc_per_node 8 -m gossip.train --algo ecd --bits 8 --topology ring",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with the same keys as the flags; flags override it")

    def add(name: str, **kw: Any) -> None:
        dflt = _DEFAULT_TEXT.get(name, _flat_default(name))
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
    add("model", metavar="{" + ",".join(mdls) + "} or MODULE:FN")
    add("data", metavar="{" + ",".join(datas) + "} or MODULE:FN")
    add("data_dir", metavar="DIR")
    add("partition", choices=["iid", "sorted"])
    add("epochs", type=int)
    add("max_steps", type=int, metavar="N")
    add("batch_size", type=int)
    add("lr", type=float)
    add("lr_schedule", choices=list(LR_SCHEDULES))
    add("momentum", type=float)
    add("weight_decay", type=float)
    add("optimizer", choices=list(OPTIMIZERS))
    add("beta1", type=float)
    add("beta2", type=float)
    add("seed", type=int)
    add("device", choices=["auto", "cpu", "cuda"])
    add("out", metavar="DIR")
    add("checkpoint_every", type=int, metavar="N")
    add("resume", metavar="DIR|auto")
    add("timeout", type=float, metavar="SECONDS")
    add("simulate", type=int, metavar="N")
    add("simulate_mode", choices=list(SIMULATE_MODES))
    add("emulate_latency", type=float, metavar="MS")
    add("fault_tolerance", metavar="HOST:PORT")
    add("min_replicas", type=int, metavar="K")
    add("log_every", type=int, metavar="N")
    add("merge", metavar="MODE")
    add("merge_max_groups", type=int, metavar="Y")
    add("merge_alpha", type=float, metavar="ALPHA")
    p.add_argument(
        "--algo-opt", dest="algo_options", action="append", metavar="KEY=VALUE", help=_HELP["algo_options"]
    )
    p.add_argument(
        "--model-opt", dest="model_options", action="append", metavar="KEY=VALUE", help=_HELP["model_options"]
    )
    p.add_argument(
        "--data-opt", dest="data_options", action="append", metavar="KEY=VALUE", help=_HELP["data_options"]
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    p.add_argument("--tensorboard", action="store_true", help=_HELP["tensorboard"])
    p.add_argument("--overwrite", action="store_true", help=_HELP["overwrite"])
    return p


#: section field -> flat key, for TOML tables such as ``[optim]`` and ``[algorithm]``
_FIELD_TO_FLAT = {(sec, fld): key for key, (sec, fld) in FLAT_KEYS.items()}


def _check_toml_type(path: str, key: str, value: Any) -> None:
    """A TOML value against its field's type: ``lazy = "false"`` is text, not a bool."""
    if key in _OPTION_TABLES:
        if not isinstance(value, dict):
            raise ConfigError(f"--config {path!r}: {key} = {value!r} must be a table, e.g. [{key}]")
        return
    sec, fld = FLAT_KEYS[key]
    kinds = _kinds(typing.get_type_hints(SECTIONS[sec])[fld])
    ok = any(
        (k is bool and isinstance(value, bool))
        or (k is int and isinstance(value, int) and not isinstance(value, bool))
        or (k is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (k is str and isinstance(value, str))
        or (k not in (bool, int, float, str, type(None)) and isinstance(value, k))
        for k in kinds
    )
    if not ok:
        want = " or ".join(_WORDS.get(k, k.__name__) for k in kinds if k is not type(None))
        raise ConfigError(f"--config {path!r}: {key} = {value!r} has the wrong type; expected {want}")


def _load_toml(path: str) -> dict[str, Any]:
    """The file's values as flat keys: top-level keys as the flags name them, or tables
    named after the sections (``[optim] lr = 0.1``, ``[algorithm.options] rank = 2``)."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path!r} is a directory; expected a TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path!r} is not a text file; expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path!r} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per level of nesting
        raise ConfigError(f"--config {path!r}: arrays or tables nested too deeply to read; expected keys "
                          f"and [sections] of plain values") from None
    except OSError as e:
        raise ConfigError(f"--config {path!r}: cannot read it ({e.strerror})") from None
    out: dict[str, Any] = {}

    def put(key: str, value: Any, where: str) -> None:
        if key in out:
            raise ConfigError(f"--config {path!r}: {where} sets {key!r} a second time")
        if key == "merge" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # merge = 4 (groups), as --merge 4
        _check_toml_type(path, key, value)
        out[key] = value

    for k, v in raw.items():
        key = k.replace("-", "_")
        if key in SECTIONS and isinstance(v, dict):  # a section table
            for k2, v2 in v.items():
                fld = k2.replace("-", "_")
                flat = _FIELD_TO_FLAT.get((key, fld)) or (fld if FLAT_KEYS.get(fld, ("",))[0] == key else None)
                if flat is None:
                    fields = [f.name for f in dataclasses.fields(SECTIONS[key])]  # declared order
                    raise ConfigError(
                        f"--config {path!r}: unknown key {k2!r} in [{key}]; accepted: {', '.join(fields)}"
                    )
                put(flat, v2, f"[{key}]")
            continue
        if key not in FLAT_KEYS:
            accepted = sorted(FLAT_KEYS) + [f"[{s}]" for s in SECTIONS]
            raise ConfigError(f"--config {path!r}: unknown key {k!r}; accepted: {', '.join(accepted)}")
        put(key, v, "the file")
    return out


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """A validated TrainConfig from the command-line flags and ``--config FILE``.

    Flags override the file (``--algo-opt`` key by key); a bad value raises ConfigError
    naming it."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    cfg_path = ns.pop("config", None)
    if cfg_path is not None:
        values.update(_load_toml(cfg_path))
    for table, flag, example in (("algo_options", "--algo-opt", "rank=4"), ("model_options", "--model-opt", "layers=4"),
                                 ("data_options", "--data-opt", "context=128")):
        flags = ns.pop(table, None) or []
        if not flags:
            continue
        merged = values.get(table, {})
        if not isinstance(merged, Mapping):
            raise ConfigError(f"--config {cfg_path!r}: {table} must be a table, got {merged!r}")
        merged = {str(k).replace("-", "_"): v for k, v in merged.items()}
        for item in flags:
            key, eq, text = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} {example}")
            merged[key.strip().replace("-", "_")] = text
        values[table] = merged
    values.update(ns)
    try:
        return TrainConfig.from_flat(values)
    except TypeError as e:
        raise ConfigError(str(e)) from None


#: ``--resume auto``: continue the run in --out if it has a checkpoint, else start it
RESUME_AUTO = "auto"
#: config.json keys whose change makes a checkpoint unusable for an exact continuation
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
#: config keys every rank must share: the fingerprinted ones and the run's length and cadence
#: (paths such as --out and --data-dir may differ between hosts)
AGREE_KEYS = FINGERPRINT_KEYS + (
    "max_steps", "checkpoint_every", "log_every", "emulate_latency", "device", "simulate", "tensorboard",
) + OPTIMIZER_FINGERPRINT_KEYS + ("model_options", "data_options")


def fingerprint_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The config.json keys a checkpoint of this run is fingerprinted with."""
    keys = FINGERPRINT_KEYS
    if config.get("local_optimizer", "sgd") != "sgd":
        keys += OPTIMIZER_FINGERPRINT_KEYS
    return keys + tuple(k for k in OPTIONAL_FINGERPRINT_KEYS if config.get(k))
