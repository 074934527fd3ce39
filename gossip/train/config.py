"""The training run's typed configuration: one schema for flags, TOML files and config.json.

A :class:`TrainConfig` is seven frozen sections, each a keyword-only dataclass that
checks its own fields in ``__post_init__``: ``data`` (data set, partition, batch
size), ``model``, ``optim`` (local optimizer and schedule), ``algorithm`` (algorithm,
compressor, its own options, MergeComp), ``comm`` (graph, device, transport, hosting),
``run`` (length, seed, output, checkpoints, logging) and ``trust`` (Byzantine nodes and
defences). Every rule raises
:class:`ConfigError` with one line naming the value and what is accepted.

The sections are the single source. Each field is declared with :func:`option`,
whose :class:`Option` carries its help text, its flat key (the long flag's name, the
TOML file's top-level key and config.json's key, e.g. ``algo`` for
``algorithm.name``), its flag where that is not ``--<key>``, the choices or metavar
of ``--help``, and its :data:`ROLES` role for a resume's fingerprint and for the
ranks' agreement. :func:`build_parser` (``--help`` included), the TOML reader,
:meth:`TrainConfig.to_dict` (config.json), :data:`FLAT_KEYS`, :func:`fingerprint_keys`
and :func:`agree_keys` all derive from the sections, so adding a flag is one field in
one section (a section added to :data:`SECTIONS` is read the same way).

:func:`parse_args` builds the config from the command line and a TOML file given with
``--config``, flags overriding the file. The file may use the flat keys (``lr = 0.1``,
``batch-size = 64``) or tables named after the sections (``[optim] lr = 0.1``), so run
directories and files of every version read the same.

Options of the chosen algorithm's own Config (PowerSGD's ``rank``, sketched's ``p``)
come from repeated ``--algo-opt KEY=VALUE`` flags and an ``[algo_options]`` (or
``[algorithm.options]``) table of the file, merged key by key with the flags winning;
text values are read as the type of the Config field they set.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import tomllib
import types
import typing
from urllib.parse import urlsplit
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

__all__ = [
    "AGREE_KEYS",
    "lighthouse_address",
    "schema",
    "flag_of",
    "AlgorithmSection",
    "CommSection",
    "ConfigError",
    "DataSection",
    "FINGERPRINT_KEYS",
    "FLAT_KEYS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "ModelSection",
    "Option",
    "OptimSection",
    "ROLES",
    "RunSection",
    "SECTIONS",
    "SIMULATE_MODES",
    "TrainConfig",
    "agree_keys",
    "build_parser",
    "fingerprint_keys",
    "option",
    "parse_args",
]

LR_SCHEDULES = ("constant", "cosine", "step")
#: the local optimizers of ``--optimizer``
OPTIMIZERS = ("sgd", "adamw", "muon")
#: --muon-precision (gossip.algorithms.muloco.MUON_PRECISIONS, without importing torch here)
MUON_PRECISIONS = ("auto", "bfloat16", "float32", "float64")
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


class Registries(NamedTuple):
    """The names each registry accepts: what the sections check and ``--help`` lists."""

    algorithms: list[str]
    compressors: list[str]
    topologies: list[str]
    models: list[str]
    datasets: list[str]


def _registries() -> Registries:
    import topologies

    from gossip import algorithms, compress, data, models

    return Registries(algorithms=list(algorithms.available()), compressors=list(compress.available()),
                      topologies=list(topologies.available()), models=list(models.available_models()),
                      datasets=list(data.available_datasets()))


# --------------------------------------------------------------------------------------
# the schema: one option per field
# --------------------------------------------------------------------------------------
#: a field's part in a resume and in the ranks' agreement: ``fingerprint`` (a change makes
#: a checkpoint unusable; the ranks must agree), ``fingerprint-if-set`` (fingerprinted where
#: set, so that checkpoints written before it existed keep theirs), ``fingerprint-not-sgd``
#: (fingerprinted where the local optimizer is not SGD: checkpoints written before
#: ``--optimizer`` were all SGD), ``agree`` (the ranks must agree: the run's length and
#: cadence, its hosting) and ``None`` (may differ between hosts: paths, output, timeouts)
ROLES = ("fingerprint", "fingerprint-if-set", "fingerprint-not-sgd", "agree", None)


@dataclass(frozen=True)
class Option:
    """How one config field meets the user: the schema entry :func:`option` declares.

    ``key`` is the flat key (the long flag ``--<key>``, a TOML file's top-level key,
    config.json's key); unset, the field's own name. ``flag`` replaces ``--<key>``
    (``--algo-opt``); a bool field defaulting to True gets ``--no-<key>``. ``choices``
    and ``metavar`` may be functions of the :class:`Registries`. ``default_text`` says
    a default that depends on other fields. ``role`` is one of :data:`ROLES`.
    ``int_as_text``: a TOML integer is read as the text of the flag (``merge = 4``)."""

    help: str
    key: str | None = None
    flag: str | None = None
    metavar: str | Callable[[Registries], str] | None = None
    choices: tuple | Callable[[Registries], list] | None = None
    default_text: str | None = None
    role: str | None = None
    int_as_text: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Option role must be one of {ROLES}, got {self.role!r}")


def option(default: Any, help: str, **meta: Any) -> Any:
    """A section field with its :class:`Option` (``help``, then its keywords)."""
    return dataclasses.field(default=default, metadata={"option": Option(help=help, **meta)})


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

    name: str = option(
        "mnist1d",
        "data set, or your own as module.path:function, called as function(seed) and returning a "
        "gossip.data.Dataset or ((x_train, y_train), (x_test, y_test))",
        key="data", metavar=lambda r: "{" + ",".join(r.datasets) + "} or MODULE:FN", role="fingerprint",
    )
    data_dir: str | None = option(
        None,
        "directory of a local data set (cifar10: the python batches; wikitext2: wiki.train.raw, "
        "wiki.valid.raw, wiki.test.raw) or, for text, a UTF-8 file or folder (default: the Python "
        "standard library's sources)",
        metavar="DIR",
    )
    partition: str = option(
        "iid",
        "iid: random equal shards; sorted: contiguous slices of the label-sorted data (text: of the "
        "text)",
        choices=("iid", "sorted"), role="fingerprint",
    )
    batch_size: int = option(32, "mini-batch size per node", role="fingerprint")
    #: the data set's own options, sorted ``(key, value)`` pairs
    options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = option(
        (),
        "an option of the data set, repeatable, e.g. --data text --data-opt context=128 --data-opt "
        "test_fraction=0.1 --data-opt max_test_bytes=65536 (default: none; a TOML file gives them as "
        "a [data_options] table)",
        key="data_options", flag="--data-opt", metavar="KEY=VALUE", role="fingerprint-if-set",
    )

    def __post_init__(self) -> None:
        datas = _registries().datasets
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

    name: str | None = option(
        None,
        "model, or your own as module.path:function, called as function(input_shape, num_classes) and "
        "returning a torch.nn.Module",
        key="model", metavar=lambda r: "{" + ",".join(r.models) + "} or MODULE:FN",
        default_text="cnn1d for mnist1d, resnet20 for cifar10, logreg for synthetic, gpt for text and wikitext2, "
        "mlp for your own data",
    )
    #: the model's own options, sorted ``(key, value)`` pairs
    options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = option(
        (),
        "an option of the model, repeatable, e.g. --model gpt --model-opt layers=4 --model-opt "
        "width=128 --model-opt heads=4; an unknown key lists the accepted ones (default: none; a TOML "
        "file gives them as a [model_options] table)",
        key="model_options", flag="--model-opt", metavar="KEY=VALUE", role="fingerprint-if-set",
    )

    def __post_init__(self) -> None:
        mdls = _registries().models
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

    lr: float | None = option(
        None,
        "learning rate gamma of the local optimizer (unset: 0.05 for sgd, 0.001 for adamw and muon)",
        role="fingerprint",
    )
    lr_schedule: str = option(
        "constant",
        "constant, cosine (to 0 over the run) or step (x0.1 at 50%% and 75%%)",
        choices=LR_SCHEDULES, role="fingerprint",
    )
    momentum: float | None = option(
        None,
        "momentum of the local SGD optimizer (unset: 0.9 for allreduce and the decentralized "
        "algorithms, 0 for signsgd and for --aggregator cclip:...,beta=B whose workers send their "
        "momentum), or of the algorithm where it has its own (efsgd family, signum, "
        "powersgd; unset: its default)",
        role="fingerprint",
    )
    weight_decay: float = option(0.0, "weight decay of the local optimizer (AdamW's is decoupled)", role="fingerprint")
    optimizer: str | None = option(
        None,
        "the local optimizer (unset: adamw for diloco, sparseloco and noloco, muon for muloco, sgd "
        "for every other algorithm; muon: torch.optim.Muon on the 2-D weights, AdamW on the rest); an "
        "algorithm that applies its own momentum refuses adamw with --beta1 > 0",
        choices=OPTIMIZERS,
    )
    muon_precision: str | None = option(
        None,
        "dtype of Muon's Newton-Schulz iterations: auto (unset: bfloat16 on a GPU, as torch.optim.Muon; "
        "on a CPU, where bfloat16 products are emulated, the model's dtype, at least float32), bfloat16, "
        "float32 or float64; muon only",
        choices=MUON_PRECISIONS, role="fingerprint-if-set",
    )
    beta1: float | None = option(None, "AdamW's first-moment decay, its momentum (unset: 0.9); adamw only")
    beta2: float | None = option(None, "AdamW's second-moment decay (unset: 0.999); adamw only")

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.muon_precision is not None and self.muon_precision not in MUON_PRECISIONS:
            raise ConfigError(f"--muon-precision must be one of {', '.join(MUON_PRECISIONS)}, "
                              f"got {self.muon_precision!r}")
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

    name: str = option("ecd", "training algorithm", key="algo", choices=lambda r: r.algorithms, role="fingerprint")
    bits: int | None = option(
        None,
        "shorthand for --compressor quant:bits=BITS (algorithms with a compressor; default: the "
        "algorithm's, 8 bits for naive/dcd/ecd)",
        metavar="B",
    )
    compressor: str | None = option(
        None,
        "compressor spec, e.g. quant:bits=4,block=256, qsgd:levels=16, randk:p=0.1 (choco also: "
        "topk:p=0.01, sign)",
        metavar="SPEC",
    )
    merge: str | None = option(
        None,
        "MergeComp (Wang et al. 2021, arXiv:2103.15195) for efsgd/efblocksgd/efblocksgdm: layer (one "
        "group per tensor), whole (one group), N (N groups chosen by the cost model) or auto (Alg. "
        "2); groups are compressed and sent while backward goes on",
        metavar="MODE", role="fingerprint", int_as_text=True,
    )
    merge_max_groups: int = option(
        2,
        "Y of Alg. 2 for --merge auto: the most groups tried",
        metavar="Y", role="fingerprint",
    )
    merge_alpha: float = option(
        0.05,
        "alpha of Alg. 2 for --merge auto: stop when one more group gains less than this fraction",
        metavar="ALPHA", role="fingerprint",
    )
    #: options of the algorithm's own Config, kept as sorted ``(key, value)`` pairs so the
    #: config stays hashable; give a mapping, ``TrainConfig.to_dict`` gives one back
    options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = option(
        (),
        "an option of the algorithm's own Config, repeatable, read as that option's type (integer, "
        "number, true/false, none, text); e.g. --algo powersgd --algo-opt rank=4 --algo-opt "
        "approximator=best, --algo sketched --algo-opt p=0.01, --algo efmomentum --algo-opt "
        "nesterov=false; an unknown key lists the accepted ones; seed, compressor and momentum have "
        "their own flags (default: none; a TOML file gives them as an [algo_options] table)",
        key="algo_options", flag="--algo-opt", metavar="KEY=VALUE", role="fingerprint",
    )

    def __post_init__(self) -> None:
        algos = _registries().algorithms
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


def lighthouse_address(value: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` as torchft's clients take it (``http://...``).

    Raises:
        ValueError: naming what is accepted, for anything else.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"--fault-tolerance must be the Lighthouse's HOST:PORT, got {value!r}")
    text = value.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"--fault-tolerance must be the Lighthouse's HOST:PORT (or http://HOST:PORT), got {value!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class CommSection:
    """``[comm]``: the graph, the device and transport, and how nodes are hosted."""

    topology: str = option(
        "ring",
        "communication graph of the decentralized algorithms",
        choices=lambda r: r.topologies, default_text='onepeer-exp for sgp, matching for noloco, ring otherwise', role="fingerprint",
    )
    degree: int | None = option(None, "degree of the expander topology", metavar="D", role="fingerprint")
    rows: int | None = option(None, "rows of the torus (with --cols)", metavar="R", role="fingerprint")
    cols: int | None = option(None, "columns of the torus (with --rows)", metavar="C", role="fingerprint")
    weights: str | None = option(
        None,
        "mixing weights: uniform (regular graphs) or metropolis",
        choices=("uniform", "metropolis"), default_text='uniform when regular', role="fingerprint",
    )
    lazy: bool = option(False, "use the lazy matrix (I+W)/2", role="fingerprint")
    device: str = option(
        "auto",
        "auto (cuda if available), cpu (gloo) or cuda (NCCL)",
        choices=("auto", "cpu", "cuda"), role="agree",
    )
    timeout: float = option(300.0, "seconds to wait for a peer before failing with its rank", metavar="SECONDS")
    emulate_latency: float | None = option(
        None,
        "add this one-way latency (ms) to every message round inside the communicator, for networks "
        "where tc netem is unavailable (outputs say 'latency: emulated')",
        metavar="MS", role="agree",
    )
    simulate: int | None = option(
        None,
        "run N nodes in this one process instead of under torchrun",
        metavar="N", role="agree",
    )
    group_size: int | None = option(
        None,
        "ranks per group: full-precision gradient averaging inside each group of G consecutive ranks every "
        "step, the algorithm between the groups (each group one node of its topology, each member exchanging "
        "its 1/G slice); see docs/hierarchical.md",
        metavar="G", role="agree",
        default_text="1 with --simulate and on one host; under torchrun across several hosts, the processes of "
                     "one host (LOCAL_WORLD_SIZE); with --fault-tolerance, the processes of the replica group's "
                     "torchrun launch",
    )
    fault_tolerance: str | None = option(
        None,
        "keep training when workers die and rejoin: the torchft Lighthouse's HOST:PORT; each worker "
        "is started alone with REPLICA_GROUP_ID and NUM_REPLICA_GROUPS (see docs/fault-tolerance.md)",
        metavar="HOST:PORT",
    )
    min_replicas: int = option(
        1,
        "with --fault-tolerance: the fewest live workers a step may average over",
        metavar="K",
    )
    ft_verbose: bool = option(
        False,
        "with --fault-tolerance: also show torchft's own log (its Manager's INFO lines, several a step, and "
        "its checkpoint server's requests), which is quiet otherwise",
    )
    node_speed: str = option(
        "uniform",
        "each node's compute speed: uniform, slow:nodes=K,factor=F (the first K nodes F times slower), "
        "lognormal:sigma=S,seed=N (a multiplier per node) or trace:FILE (CSV of per-step, per-node compute "
        "seconds); the simulation models the time it costs (summary.json's modelled_time_s), under torchrun "
        "each rank sleeps for its extra time (see docs/heterogeneous.md)",
        metavar="SPEC", role="agree",
    )
    link: str = option(
        "1gbit,0ms",
        "the link summary.json's modelled_time_s is modelled on: RATE[,LATENCY] (tc's units: 10mbit, 1gbit; "
        "0, 5ms)",
        metavar="RATE[,LATENCY]",
    )
    compute_time: float | None = option(
        None,
        "modelled seconds of one local gradient at speed 1 (unset: the run's own measured mean); it orders "
        "the event clock of an asynchronous algorithm in the simulation",
        metavar="SECONDS", role="agree",
    )
    simulate_mode: str = option(
        "auto",
        "how --simulate N runs the nodes: auto (all nodes as one batched call where the model allows "
        "it, else one after another, saying why), vectorized (refuse a model that cannot be batched) "
        "or loop (one after another, bit-identical with torchrun)",
        choices=SIMULATE_MODES,
    )

    def __post_init__(self) -> None:
        topos = _registries().topologies
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
        for name in ("degree", "rows", "cols", "simulate", "group_size"):
            v = getattr(self, name)
            if v is not None and _bad_int(name, v, 1):
                raise ConfigError(f"{_flag(name)} must be a positive integer, got {v!r}")
        _check_number("timeout", self.timeout, strict=True)
        e = self.emulate_latency
        if e is not None and (isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or e < 0):
            raise ConfigError(f"--emulate-latency must be a finite number of milliseconds >= 0, got {e!r}")
        if e is not None and e > 60_000:
            raise ConfigError(f"--emulate-latency must be at most 60000 ms (one minute per message round), got {e!r}")
        if self.fault_tolerance is not None:
            try:
                lighthouse_address(self.fault_tolerance)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        from gossip import speeds as _speeds

        try:
            _speeds.parse(self.node_speed, None)
        except _speeds.SpeedError as err:
            raise ConfigError(str(err)) from None
        link_of(self.link)
        if self.compute_time is not None:
            _check_number("compute_time", self.compute_time, strict=True)
        if not isinstance(self.ft_verbose, bool):
            raise ConfigError(f"--ft-verbose must be true or false, got {self.ft_verbose!r}")
        if _bad_int("min_replicas", self.min_replicas, 1):
            raise ConfigError(f"--min-replicas must be a positive integer, got {self.min_replicas!r}")


def link_of(text: str):
    """``--link RATE[,LATENCY]`` as a :class:`gossip.clock.Link`; ConfigError (one line) otherwise."""
    from gossip.clock import parse_link

    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"--link must be RATE[,LATENCY] such as 1gbit,5ms, got {text!r}")
    try:
        return parse_link(text)
    except ValueError as e:
        raise ConfigError(f"--link {text!r}: {e} (expected RATE[,LATENCY] such as 1gbit,5ms)") from None


@dataclass(frozen=True, kw_only=True)
class RunSection:
    """``[run]``: length, seed, output directory, checkpoints, logging."""

    epochs: int = option(20, "passes over each node's shard", role="fingerprint")
    max_steps: int | None = option(
        None,
        "stop after this many steps (the schedule still spans --epochs; resume to go on)",
        metavar="N", role="agree",
    )
    seed: int = option(0, "seed of the model's x_1, the data order and the compressors' randomness", role="fingerprint")
    out: str | None = option(None, "output directory (default runs/<timestamp>-<algo>-<topology>)", metavar="DIR")
    checkpoint_every: int = option(
        0,
        "write a checkpoint every N steps (0: only at the end)",
        metavar="N", role="agree",
    )
    resume: str | None = option(
        None,
        "continue the run in this directory from its latest checkpoint; 'auto' continues the run in "
        "--out from its newest valid checkpoint if it has one and starts it otherwise (for torchrun "
        "--max-restarts)",
        metavar="DIR|auto",
    )
    log_every: int = option(10, "write a metrics record every N steps", metavar="N", role="agree")
    progress: bool = option(True, "hide the progress bar")
    node_eval: bool = option(
        True,
        "skip the evaluation of each node's own model at an epoch's end (the eval records then have no "
        "node_acc_*/node_bpb_* keys; the averaged model's figures and the consensus distance are the same): "
        "with 16 nodes simulated that evaluation is a fifth to a third of a short run's CPU time",
        role="agree",
    )
    tensorboard: bool = option(
        False,
        "also write the metrics as TensorBoard scalars to <out>/tensorboard (needs the optional "
        "extra: pip install 'gossip[tensorboard]')",
        role="agree",
    )
    overwrite: bool = option(
        False,
        "replace the run already in --out: the files a run writes (config, summary, metrics, error "
        "logs, checkpoints, TensorBoard events) are deleted first, nothing else; without it a "
        "non-empty --out is refused",
    )

    def __post_init__(self) -> None:
        for name, lo in (("epochs", 1), ("log_every", 1), ("checkpoint_every", 0), ("seed", 0)):
            v = getattr(self, name)
            if _bad_int(name, v, lo):
                raise ConfigError(f"{_flag(name)} must be an integer >= {lo}, got {v!r}")
        if self.max_steps is not None and _bad_int("max_steps", self.max_steps, 1):
            raise ConfigError(f"{_flag('max_steps')} must be a positive integer, got {self.max_steps!r}")
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


@dataclass(frozen=True, kw_only=True)
class TrustSection:
    """``[trust]``: Byzantine nodes, their attack, and the defences (docs/trust.md)."""

    byzantine: int = option(
        0,
        "number of Byzantine nodes, drawn from --seed (recorded in summary.json); they send --attack's "
        "messages instead of honest ones; must be below half the nodes",
        metavar="K", role="fingerprint-if-set",
    )
    attack: str | None = option(
        None,
        "what the --byzantine nodes send: signflip, scaled:factor=F, gaussian:sigma=S, alie[:z=Z], "
        "ipm:eps=E, labelflip, lazy[:every=E] (alie and ipm read the honest messages: --simulate only)",
        metavar="SPEC", role="fingerprint-if-set",
    )
    aggregator: str | None = option(
        None,
        "robust aggregation of the nodes' messages: allreduce's gradients, the pseudo-gradients of diloco, "
        "muloco and sparseloco, demo's momentum components (docs/trust.md): mean, median, trimmed:f=F, "
        "cclip[:tau=T,iters=L] (no tau: the median distance as the radius; beta=B: allreduce only) "
        "(default mean: the method's own exchange)",
        metavar="SPEC", role="fingerprint-if-set",
    )
    robust: str | None = option(
        None,
        "robust gossip for --algo dpsgd and noloco: clippedgossip (clip the farthest b=1 neighbours to the next one's "
        "distance), clippedgossip:b=B or clippedgossip:tau=T (a fixed radius)",
        metavar="SPEC", role="fingerprint-if-set",
    )

    def __post_init__(self) -> None:
        from gossip import robust as _robust

        if _bad_int("byzantine", self.byzantine, 0):
            raise ConfigError(f"--byzantine must be an integer >= 0, got {self.byzantine!r}")
        for flag, value, parse in (("--attack", self.attack, _robust.parse_attack),
                                   ("--aggregator", self.aggregator, _robust.parse_aggregator),
                                   ("--robust", self.robust, _robust.parse_robust)):
            if value is not None:
                try:
                    parse(value)
                except ValueError as e:
                    raise ConfigError(f"{flag}: {e}") from None
        if self.byzantine and self.attack is None:
            raise ConfigError(f"--byzantine {self.byzantine} needs --attack NAME (accepted: "
                              f"{', '.join(_robust.ATTACKS)})")
        if self.attack is not None and not self.byzantine:
            raise ConfigError(f"--attack {self.attack} needs --byzantine K >= 1 (how many nodes attack)")


#: the sections of a TrainConfig, in the order of ``to_dict`` and of ``--help``; a section
#: added here (a frozen, keyword-only dataclass of :func:`option` fields) is read from the
#: flags, the TOML file and config.json like the others
SECTIONS: dict[str, type] = {
    "data": DataSection,
    "model": ModelSection,
    "optim": OptimSection,
    "algorithm": AlgorithmSection,
    "comm": CommSection,
    "run": RunSection,
    "trust": TrustSection,
}


@functools.cache
def _type_hints(section: type) -> dict[str, Any]:
    """A section's field types, resolved once: ``typing.get_type_hints`` evaluates every
    annotation again at each call, most of the time of building the parser."""
    return typing.get_type_hints(section)


class _Entry(NamedTuple):
    section: str
    field: dataclasses.Field
    option: Option

    @property
    def key(self) -> str:
        return self.option.key or self.field.name

    @property
    def kinds(self) -> tuple:
        """The types the field's annotation allows (``int | None`` -> ``(int, NoneType)``)."""
        return _kinds(_type_hints(SECTIONS[self.section])[self.field.name])

    @property
    def is_table(self) -> bool:
        """A Mapping field (``--algo-opt KEY=VALUE`` and alike): a table of the TOML file,
        a repeatable flag."""
        return any(typing.get_origin(k) is Mapping for k in self.kinds)


def schema() -> Iterator[_Entry]:
    """Every field of every section with its Option, in the sections' declared order."""
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            opt = f.metadata.get("option")
            if opt is None:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with config.option(...)")
            yield _Entry(sec, f, opt)


class _FlatKeys(Mapping):
    """Every flat key -> (section, field), read from :data:`SECTIONS` when asked."""

    def _table(self) -> dict[str, tuple[str, str]]:
        return {e.key: (e.section, e.field.name) for e in schema()}

    def __getitem__(self, key: str) -> tuple[str, str]:
        return self._table()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"FLAT_KEYS({self._table()!r})"


#: every flat key (the long flags, the TOML file's top-level keys, config.json's keys) ->
#: its (section, field); derived from the sections' options
FLAT_KEYS: Mapping[str, tuple[str, str]] = _FlatKeys()


def _recorded(key: str | None = None, role: str | None = None):
    """Marks a TrainConfig property as a key of config.json (``key``, else its name) with
    its :data:`ROLES` role: the values a run derives from several fields."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")

    def mark(fn: Callable) -> property:
        fn.recorded = (key or fn.__name__, role)  # type: ignore[attr-defined]
        return property(fn)

    return mark


class TrainConfig:
    """The run's whole configuration: seven frozen, validated sections.

    ``TrainConfig(data=DataSection(...), optim={"lr": 0.1}, ...)`` takes sections (or
    mappings of their fields); :meth:`from_flat` takes the flat keys of the command
    line and of ``config.json`` (``algo``, ``lr``, ``batch_size`` ...). Each section
    checks its own fields in ``__post_init__``; the rules that tie sections together
    are checked here. Instances are immutable and compare by value.
    """

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
        (``onepeer-exp`` for sgp, ``matching`` for noloco, else ``ring``) where it is not given."""
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
        if self.local_optimizer == "muon":
            given = [f for f, v in (("--beta1", opt.beta1), ("--beta2", opt.beta2)) if v is not None]
            if opt.momentum is not None and "momentum" not in _algo_fields(alg.name):
                given.insert(0, "--momentum")
            if given:
                how = "--optimizer muon" if opt.optimizer else f"--algo {alg.name}'s default optimizer muon"
                raise ConfigError(f"{'/'.join(given)}: {how} keeps torch.optim.Muon's own momentum (0.95) and "
                                  f"AdamW's betas (0.9, 0.999) on the other parameters; give --optimizer sgd "
                                  f"(--momentum) or adamw (--beta1/--beta2) to set them")
        if opt.muon_precision is not None and self.local_optimizer != "muon":
            raise ConfigError(f"--muon-precision is Muon's; the local optimizer here is {self.local_optimizer} "
                              f"(give --optimizer muon, or --algo muloco)")
        if comm.simulate is not None and alg.decentralized and comm.simulate < 2:
            raise ConfigError(f"--simulate must be >= 2 for the decentralized --algo {alg.name}, got {comm.simulate}")
        if alg.merge is not None and alg.merge not in ("layer", "whole") and comm.simulate is not None and comm.simulate > 1:
            raise ConfigError(
                f"--merge {alg.merge} times the backward pass of one node per process: run it under torchrun "
                f"(or --simulate 1); --merge layer and whole work with --simulate {comm.simulate}"
            )
        if comm.fault_tolerance is not None:
            self._check_fault_tolerance()
        self._check_trust()
        if comm.group_size is not None and comm.group_size > 1:
            self._check_groups()

    def _check_groups(self) -> None:
        """``--group-size`` G > 1's rules across the sections (the world size's are the run's)."""
        alg, comm, g = self.algorithm, self.comm, self.comm.group_size
        if comm.simulate is not None and comm.simulate < g:
            raise ConfigError(f"--group-size {g} is larger than the world size {comm.simulate} (--simulate)")
        if comm.simulate is not None and comm.simulate % g:
            n = comm.simulate
            raise ConfigError(f"--group-size {g} does not divide the world size {n} (--simulate); accepted: "
                              f"{', '.join(str(k) for k in range(1, n + 1) if n % k == 0)}")
        if alg.merge is not None or alg.name == "mergecomp":
            raise ConfigError("--merge schedules the backward pass of one node per process; it does not run "
                              f"with --group-size {g}")
        if comm.emulate_latency:
            raise ConfigError(f"--emulate-latency does not run with --group-size {g} yet")
        if comm.simulate_mode == "vectorized":
            raise ConfigError(f"--simulate-mode vectorized does not run with --group-size {g}: the members' "
                              "gradients are averaged group by group (use auto or loop)")

    def _check_trust(self) -> None:
        """The trust options against the algorithm and the hosting (docs/trust.md)."""
        tr, alg, comm = self.trust, self.algorithm, self.comm
        from gossip import algorithms as _alg

        cls = _alg.algorithm_class(alg.name)
        if tr.aggregator is not None and "aggregator" not in _algo_fields(alg.name):
            takers = [n for n in _alg.available() if "aggregator" in _algo_fields(n)]
            why = (f": {cls.aggregator_refusal}" if cls.aggregator_refusal else
                   " is decentralized: use --robust clippedgossip with --algo dpsgd" if alg.decentralized
                   else " does not carry it yet")
            raise ConfigError(f"--aggregator is a robust rule over every node's message; --algo {alg.name}{why} "
                              f"(accepted: --algo {', '.join(takers)})")
        if tr.robust is not None and "robust" not in _algo_fields(alg.name):
            why = cls.robust_refusal
            raise ConfigError(f"--robust {tr.robust} runs with --algo dpsgd or noloco; --algo {alg.name}: "
                              + (why + "; use --algo dpsgd" if why else
                                 "not decentralized: use --aggregator with --algo allreduce" if not alg.decentralized
                                 else "not carried yet; use --algo dpsgd"))
        if tr.byzantine:
            if not cls.byzantine_messages:
                carried = [n for n in _alg.available() if _alg.algorithm_class(n).byzantine_messages]
                raise ConfigError(f"--byzantine with --algo {alg.name}: its messages do not carry an attacker's "
                                  f"crafted ones yet; accepted: --algo {', '.join(carried)}")
            n = comm.simulate
            if n is not None and 2 * tr.byzantine >= n:
                raise ConfigError(f"--byzantine {tr.byzantine} of --simulate {n} nodes: the attackers must be fewer "
                                  f"than half the nodes (K <= {(n - 1) // 2})")
            from gossip import robust as _robust

            if comm.simulate is None and _robust.parse_attack(tr.attack).omniscient:
                raise ConfigError(f"--attack {tr.attack} is omniscient (it reads every honest node's message) "
                                  f"and runs with --simulate N only; under torchrun use signflip, scaled, "
                                  f"gaussian, labelflip or lazy")
        if (tr.byzantine or tr.aggregator or tr.robust) and comm.fault_tolerance is not None:
            raise ConfigError("--byzantine, --aggregator and --robust do not combine with --fault-tolerance")
        if (tr.byzantine or tr.aggregator or tr.robust) and comm.group_size is not None and comm.group_size > 1:
            raise ConfigError(f"--byzantine, --aggregator and --robust do not run with --group-size {comm.group_size} "
                              f"yet: a group's members exchange slices of one message")

    def _check_fault_tolerance(self) -> None:
        """``--fault-tolerance``'s rules across the sections (the environment's, the number
        of replicas, are checked by the run: gossip.train.fault_tolerance)."""
        from gossip import algorithms as _alg

        alg, comm, run = self.algorithm, self.comm, self.run
        supported = [n for n in _alg.available() if _alg.algorithm_class(n).fault_tolerant]
        if alg.name not in supported:
            raise ConfigError(f"--fault-tolerance supports --algo {', '.join(supported)}, got --algo {alg.name} "
                              "(see docs/fault-tolerance.md)")
        if comm.simulate is not None:
            raise ConfigError("--fault-tolerance runs one worker per process: do not combine it with --simulate")
        if run.out is None and run.resume in (None, RESUME_AUTO):
            raise ConfigError("--fault-tolerance needs --out DIR: a restarted worker writes on in the same directory"
                              + (" (--resume auto continues the run in --out)" if run.resume == RESUME_AUTO else ""))
        if alg.decentralized and comm.min_replicas < 2:
            raise ConfigError(f"--algo {alg.name} is decentralized: --min-replicas must be at least 2 (a graph needs "
                              f"two live nodes), got {comm.min_replicas}")

    # --- derived: config.json records them after the flat keys ----------------------------
    @_recorded("lr")
    def learning_rate(self) -> float:
        """--lr, else the local optimizer's default (:data:`DEFAULT_LR`)."""
        return self.optim.lr if self.optim.lr is not None else DEFAULT_LR[self.local_optimizer]

    @_recorded(role="fingerprint")
    def compressor_spec(self) -> str | None:
        """What goes on the wire: --compressor, --bits, else the algorithm's own default."""
        return self.algorithm.compressor_spec

    @_recorded(role="fingerprint")
    def model_name(self) -> str:
        """--model, else the data set's own model."""
        if self.model.name is not None:
            return self.model.name
        from gossip import data  # the data set declares its model (imported here: config stays light)

        if _is_factory(self.data.name):
            return data.FALLBACK_MODEL  # the user's own data: a multi-layer perceptron unless --model says otherwise
        return data.default_model(self.data.name)

    @_recorded(role="fingerprint")
    def local_momentum(self) -> float:
        """Momentum of the local SGD optimizer: none where the algorithm has its own or
        the local optimizer is AdamW (its momentum is beta1)."""
        if "momentum" in _algo_fields(self.algorithm.name) or self.local_optimizer != "sgd":
            return 0.0
        if self.optim.momentum is not None:
            return self.optim.momentum
        if self.trust.aggregator is not None:
            from gossip import robust as _robust

            if _robust.parse_aggregator(self.trust.aggregator).params.get("beta", 0.0) > 0:
                return 0.0  # cclip's workers' momentum is the message: none again after the aggregate
        from gossip import algorithms as _alg

        return _alg.local_momentum_default(self.algorithm.name)

    @_recorded(role="fingerprint-not-sgd")
    def local_optimizer(self) -> str:
        """``sgd``, ``adamw`` or ``muon``: --optimizer, else the algorithm's default."""
        if self.optim.optimizer is not None:
            return self.optim.optimizer
        from gossip import algorithms as _alg

        return _alg.local_optimizer_default(self.algorithm.name)

    @_recorded(role="fingerprint-not-sgd")
    def betas(self) -> tuple[float, float] | None:
        """AdamW's (beta1, beta2); None for SGD."""
        if self.local_optimizer != "adamw":
            return None
        b1, b2 = self.optim.beta1, self.optim.beta2
        return (DEFAULT_BETAS[0] if b1 is None else b1, DEFAULT_BETAS[1] if b2 is None else b2)

    def flat(self) -> dict[str, Any]:
        """The flat keys and their values (no derived ones); tables as dicts."""
        return {e.key: (dict(v) if e.is_table else v)
                for e in schema() for v in [getattr(getattr(self, e.section), e.field.name)]}

    def to_dict(self) -> dict[str, Any]:
        """config.json's keys: the flat keys (in the order every release wrote them, keys
        added since in the sections' order), then the derived ones (:func:`_recorded`)."""
        flat = self.flat()
        d = {k: flat[k] for k in _RECORD_ORDER if k in flat}
        d.update((k, v) for k, v in flat.items() if k not in d)
        for key, prop, _ in _derived():
            value = prop.fget(self)
            d[key] = list(value) if isinstance(value, tuple) else value
        return d


def _derived() -> Iterator[tuple[str, property, str | None]]:
    """TrainConfig's recorded properties: (config.json key, property, role)."""
    for prop in vars(TrainConfig).values():
        if isinstance(prop, property) and hasattr(prop.fget, "recorded"):
            key, role = prop.fget.recorded
            yield key, prop, role


#: the order of config.json's keys as every release wrote them (a key added since
#: follows them, in the sections' order: adding a field does not touch this)
_RECORD_ORDER = (
    "algo", "bits", "compressor", "topology", "degree", "rows", "cols", "weights", "lazy", "model", "data",
    "data_dir", "partition", "epochs", "max_steps", "batch_size", "lr", "lr_schedule", "momentum",
    "weight_decay", "seed", "device", "out", "checkpoint_every", "resume", "timeout", "emulate_latency",
    "simulate", "log_every", "progress", "merge", "merge_max_groups", "merge_alpha", "algo_options",
    "tensorboard", "overwrite", "optimizer", "beta1", "beta2", "fault_tolerance", "min_replicas",
    "model_options", "data_options", "simulate_mode",
)


# --------------------------------------------------------------------------------------
# the roles: a resume's fingerprint and the ranks' agreement
# --------------------------------------------------------------------------------------
#: ``--resume auto``: continue the run in --out if it has a checkpoint, else start it
RESUME_AUTO = "auto"
#: what a run adds to its config.json record that a checkpoint must match where present:
#: the identity of a text corpus (checkpoints written before it existed keep their fingerprint)
RUN_FINGERPRINT_KEYS = ("corpus_sha256",)


def _keys_of(*roles: str) -> tuple[str, ...]:
    """config.json's keys (fields and derived ones) of the given roles."""
    return tuple(e.key for e in schema() if e.option.role in roles) + tuple(
        key for key, _, role in _derived() if role in roles)


def fingerprint_keys(config: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The config.json keys a checkpoint of this run is fingerprinted with: the
    ``fingerprint`` ones, the ``fingerprint-not-sgd`` ones where the local optimizer is
    not SGD, and the ``fingerprint-if-set`` ones (and :data:`RUN_FINGERPRINT_KEYS`)
    where set. Without ``config``, the keys every run is fingerprinted with."""
    keys = _keys_of("fingerprint")
    if config is None:
        return keys
    if config.get("local_optimizer", "sgd") != "sgd":
        keys += _keys_of("fingerprint-not-sgd")
    return keys + tuple(k for k in _keys_of("fingerprint-if-set") + RUN_FINGERPRINT_KEYS if config.get(k))


def agree_keys() -> tuple[str, ...]:
    """The config.json keys every rank must share: every fingerprinted one and the
    ``agree`` ones (paths such as --out and --data-dir may differ between hosts)."""
    return _keys_of("fingerprint", "agree", "fingerprint-not-sgd", "fingerprint-if-set")


#: config.json keys whose change makes a checkpoint unusable for an exact continuation
FINGERPRINT_KEYS = fingerprint_keys()
#: config.json keys every rank must share (:func:`agree_keys` of the built-in sections)
AGREE_KEYS = agree_keys()


# --------------------------------------------------------------------------------------
# the command line and the TOML file
# --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other user error of the CLI."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag_of(e: _Entry) -> str:
    """The command-line flag of a schema entry (:func:`schema`): its Option's own flag,
    else ``--no-NAME`` for a switch that is on by default, else ``--name-with-dashes``."""
    if e.option.flag is not None:
        return e.option.flag
    if e.field.default is True:  # a switch that is on unless given
        return "--no-" + e.key.replace("_", "-")
    return "--" + e.key.replace("_", "-")


def _argument(e: _Entry, reg: Registries) -> dict[str, Any]:
    """argparse's keywords for one field: from its type, default and Option."""
    o, default = e.option, e.field.default
    kw: dict[str, Any] = {"dest": e.key, "help": o.help}
    if e.is_table:
        return {**kw, "action": "append", "metavar": o.metavar}
    kinds = e.kinds
    if bool in kinds:  # a switch: --lazy sets True, --no-progress sets False
        return {**kw, "action": "store_false" if default is True else "store_true"}
    kind = next((k for k in (int, float) if k in kinds), None)
    if kind is not None:
        kw["type"] = kind
    if o.choices is not None:
        kw["choices"] = list(o.choices(reg) if callable(o.choices) else o.choices)
    if o.metavar is not None:
        kw["metavar"] = o.metavar(reg) if callable(o.metavar) else o.metavar
    said = o.default_text if o.default_text is not None else default
    kw["help"] += f" (default: {'unset' if said is None else said})"
    return kw


def build_parser() -> argparse.ArgumentParser:
    """The ``gossip.train`` argument parser, one flag per section field (grouped by
    section in ``--help``); the choices come from the registries."""
    reg = _registries()
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
    groups: dict[str, argparse._ArgumentGroup] = {}
    for e in schema():
        if e.section not in groups:
            doc = (SECTIONS[e.section].__doc__ or "").strip().splitlines()[0].replace("``", "")
            groups[e.section] = p.add_argument_group(f"[{e.section}]", re.sub(r"^\[\w+\]:\s*", "", doc) or None)
        groups[e.section].add_argument(flag_of(e), **_argument(e, reg))
    return p


def _check_toml_type(path: str, e: _Entry, value: Any) -> None:
    """A TOML value against its field's type: ``lazy = "false"`` is text, not a bool."""
    if e.is_table:
        if not isinstance(value, dict):
            raise ConfigError(f"--config {path!r}: {e.key} = {value!r} must be a table, e.g. [{e.key}]")
        return
    kinds = e.kinds
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
        raise ConfigError(f"--config {path!r}: {e.key} = {value!r} has the wrong type; expected {want}")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
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


def _load_toml(path: str) -> dict[str, Any]:
    """The file's values as flat keys: top-level keys as the flags name them, or tables
    named after the sections (``[optim] lr = 0.1``, ``[algorithm.options] rank = 2``)."""
    raw = _read_toml(path)
    entries = {e.key: e for e in schema()}
    by_field = {(e.section, e.field.name): e for e in entries.values()}
    out: dict[str, Any] = {}

    def put(e: _Entry, value: Any, where: str) -> None:
        if e.key in out:
            raise ConfigError(f"--config {path!r}: {where} sets {e.key!r} a second time")
        if e.option.int_as_text and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # merge = 4 (groups), as --merge 4
        _check_toml_type(path, e, value)
        out[e.key] = value

    for k, v in raw.items():
        key = k.replace("-", "_")
        if key in SECTIONS and isinstance(v, dict):  # a section table: its fields, or their flat keys
            for k2, v2 in v.items():
                fld = k2.replace("-", "_")
                e = by_field.get((key, fld)) or (entries[fld] if fld in entries and entries[fld].section == key
                                                 else None)
                if e is None:
                    fields = [f.name for f in dataclasses.fields(SECTIONS[key])]  # declared order
                    raise ConfigError(
                        f"--config {path!r}: unknown key {k2!r} in [{key}]; accepted: {', '.join(fields)}"
                    )
                put(e, v2, f"[{key}]")
            continue
        if key not in entries:
            accepted = sorted(entries) + [f"[{s}]" for s in SECTIONS]
            raise ConfigError(f"--config {path!r}: unknown key {k!r}; accepted: {', '.join(accepted)}")
        put(entries[key], v, "the file")
    return out


def _merge_tables(values: dict[str, Any], ns: dict[str, Any], cfg_path: str | None) -> None:
    """The repeated ``--algo-opt KEY=VALUE`` flags (and alike) merged into the file's
    table of the same key, key by key, the flags winning."""
    for e in schema():
        flags = ns.pop(e.key, None) if e.is_table else None
        if not flags:
            continue
        flag = e.option.flag
        example = (re.findall(re.escape(flag) + r" (\S+)", e.option.help) or ["KEY=VALUE"])[0].rstrip(";,")
        merged = values.get(e.key, {})
        if not isinstance(merged, Mapping):
            raise ConfigError(f"--config {cfg_path!r}: {e.key} must be a table, got {merged!r}")
        merged = {str(k).replace("-", "_"): v for k, v in merged.items()}
        for item in flags:
            key, eq, text = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} {example}")
            merged[key.strip().replace("-", "_")] = text
        values[e.key] = merged


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """A validated TrainConfig from the command-line flags and ``--config FILE``.

    Flags override the file (``--algo-opt`` key by key); a bad value raises ConfigError
    naming it."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    cfg_path = ns.pop("config", None)
    if cfg_path is not None:
        values.update(_load_toml(cfg_path))
    _merge_tables(values, ns, cfg_path)
    values.update(ns)
    try:
        return TrainConfig.from_flat(values)
    except TypeError as e:
        raise ConfigError(str(e)) from None
