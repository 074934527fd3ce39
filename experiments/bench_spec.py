"""The benchmark's spec (``experiments/benchmark*.toml``), read and checked whole before any trial.

:func:`load_spec` checks every field of the file before anything runs: its type and
range, the methods' algorithms and the workloads' models against gossip.train's
registries, the rates and latencies in tc's units, a batch that every node's share of
the data can fill, and that no method's ``flags`` set what the workload fixes for
every method (epochs, batch size, node count, data, model: the equal budget of the
protocol) or what the protocol sets (learning rate, seeds, device, output). A bad
field is refused in one line naming the file and the field's path::

    spec.toml: methods.signum.flags: --epochs sets the workload's budget (workloads.NAME.epochs, ...) ...

Nothing here imports torch or the training code, so a bad spec is refused in a fraction
of a second. :func:`check_trials` then parses every trial's arguments with
gossip.train's own parser (which imports torch) before the first trial starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from experiments import bench_data
from gossip.train import config as _config
from gossip.tools import units

__all__ = ["ALGORITHMS", "MODELS", "METRICS", "Method", "Spec", "SpecError", "Workload", "check_trials",
           "load_spec", "option_text"]


class SpecError(ValueError):
    """A benchmark spec that cannot be run; one line naming the key."""


#: the metrics a workload may be judged on, per task, and whether higher is better
METRICS = {"classification": {"test_acc": True, "test_loss": False},
           "lm": {"test_bpb": False, "test_loss": False}}
#: gossip.train's algorithms and built-in models (with their task), copied here so that a
#: spec is checked without importing torch; tests/test_benchmark_spec.py holds them equal
#: to gossip.algorithms.available() and gossip.models.available_models()
ALGORITHMS = ("allreduce", "dpsgd", "naive", "dcd", "ecd", "choco", "sgp", "efsgd", "efblocksgd", "efblocksgdm",
              "signsgd", "signum", "powersgd", "efmomentum", "sketched", "truetopk", "localtopk", "localsgd",
              "slowmo", "diloco", "demo", "sparseloco", "noloco", "muloco", "adpsgd")
MODELS = {"cnn1d": "classification", "mlp": "classification", "logreg": "classification",
          "resnet20": "classification", "gpt": "lm", "lstm": "lm"}
#: a workload's or method's name: it names run directories (``:`` becomes ``-`` there)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]*$")
_SEED_MAX = 2 ** 63  # gossip.train --seed: torch's generators take 64-bit seeds


@dataclass(frozen=True)
class Workload:
    name: str
    data: str  # base of bench_data: mnist1d, synthetic, text or synthtext
    model: str
    samples_per_node: int  # training samples (text: windows of context + 1 bytes) per node
    epochs: int
    tune_epochs: int
    batch_size: int
    target: float
    metric: str = "test_acc"
    recipe: tuple[str, ...] = ()
    nodes: tuple[int, ...] = (4,)
    context: int | None = None  # text bases only: bytes of context per window
    #: a run "holds" the target when its final metric is within this of the target (the
    #: metric's own units: 0.005 is half a point of accuracy)
    hold_tolerance: float = 0.005
    #: the model's size knob: gossip.train's ``--model-opt KEY=VALUE``, after the recipe
    model_options: tuple[tuple[str, Any], ...] = ()

    @property
    def model_flags(self) -> tuple[str, ...]:
        return tuple(x for k, v in self.model_options for x in ("--model-opt", f"{k}={option_text(v)}"))

    @property
    def task(self) -> str:
        return "lm" if self.data in bench_data.TEXT_BASES else "classification"

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.task][self.metric]


@dataclass(frozen=True)
class Method:
    name: str
    flags: tuple[str, ...]
    lr: float
    #: node counts this method is run at (default: every node count of the workload);
    #: methods whose per-node bytes grow with n leave out 64
    max_nodes: int | None = None
    source: str = ""
    #: options set away from the algorithm's paper default, each with its reason:
    #: ``(key, value, reason)``, run as ``--algo-opt KEY=VALUE`` after the flags
    overrides: tuple[tuple[str, Any, str], ...] = ()

    @property
    def run_flags(self) -> tuple[str, ...]:
        """The flags a trial runs: the method's own, then one ``--algo-opt`` per override."""
        return (*self.flags, *(x for k, v, _ in self.overrides for x in ("--algo-opt", f"{k}={option_text(v)}")))


@dataclass(frozen=True)
class Spec:
    workloads: tuple[Workload, ...]
    methods: tuple[Method, ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    tune_seed: int = 0
    lr_factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    bandwidths: tuple[str, ...] = ("10mbit", "100mbit", "1gbit")
    latencies: tuple[str, ...] = ("0", "10ms", "50ms")
    source: str = ""
    #: where every trial computes: the same for every method and session (``cpu``)
    device: str = "cpu"
    #: node-speed settings (``gossip.train --node-speed`` specs) the verdicts are also given
    #: for: a synchronous step waits for the slowest node, so each is modelled from the same
    #: trials with their compute time times the setting's largest multiplier at each node count
    stragglers: tuple[str, ...] = ()
    #: times the tuner may extend a grid whose pick is its smallest or largest rate, each
    #: time by a factor of 2 in that direction (0: never)
    grid_extensions: int = 3
    raw: dict = field(default_factory=dict, compare=False)


def option_text(v: Any) -> str:
    """A TOML value as gossip.train's ``KEY=VALUE`` flags write it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# ----------------------------------------------------------------------------- the flags
def _train_flags() -> dict[str, str]:
    """Every long flag of gossip.train -> its config key (``--batch-size`` -> ``batch_size``),
    from gossip.train.config's schema (no torch), and ``--config``."""
    flags = {_config.flag_of(e): e.key for e in _config.schema()}
    return {**flags, "--config": "config", "--help": "help"}


_BUDGET = "sets the workload's budget ({}), the same for every method: a method may not change it"
_DATA = "sets the workload's data ({}), the same for every method"
_DRIVER = "is the benchmark's to set (every trial gets its own)"
#: config keys a method's flags may not set, and why: the workload's budget and data, the
#: protocol's learning rate and seeds, the spec's device, and what the driver sets itself
_NOT_A_METHODS: dict[str, str] = {
    "epochs": _BUDGET.format("workloads.NAME.epochs and tune_epochs"),
    "max_steps": _BUDGET.format("workloads.NAME.epochs and tune_epochs"),
    "batch_size": _BUDGET.format("workloads.NAME.batch_size"),
    "simulate": _BUDGET.format("workloads.NAME.nodes"),
    "data": _DATA.format("workloads.NAME.data, samples_per_node and context"),
    "data_dir": _DATA.format("workloads.NAME.data"),
    "data_options": _DATA.format("workloads.NAME.data and context"),
    "partition": _DATA.format("workloads.NAME.recipe"),
    "model": "sets the workload's model (workloads.NAME.model), the same for every method",
    "model_options": "sets the workload's model (workloads.NAME.recipe), the same for every method",
    "lr": "is the tuning's: the grid is methods.NAME.lr x lr_factors",
    "seed": "is the protocol's: seeds and tune_seed",
    "device": "is the spec's: device",
    "emulate_latency": "delays the trial's steps; the links are modelled from links.latency",
    "fault_tolerance": "runs the trial as torchft workers; the benchmark simulates every node in one process",
    "min_replicas": "is fault tolerance's; the benchmark simulates every node in one process",
    "config": "reads a file that may set any flag, the budget's included: give the flags themselves",
    "algo_options": "sets an option away from the algorithm's paper default: give it in methods.NAME.overrides "
                    "as KEY = {value = V, reason = \"why\"}, so that the report shows it with its reason",
    "help": "prints the help and runs nothing",
    **{k: _DRIVER for k in ("out", "resume", "overwrite", "log_every", "checkpoint_every", "progress",
                            "node_eval", "tensorboard")},
}
#: what a workload's recipe may not set besides: the workload's own fields, and the methods'
_NOT_A_RECIPES: dict[str, str] = {
    **{k: v for k, v in _NOT_A_METHODS.items() if k not in ("partition", "model_options")},
    "epochs": "is the workload's epochs and tune_epochs: set those",
    "max_steps": "would cut the horizons that the workload's epochs and tune_epochs set",
    "batch_size": "is the workload's batch_size: set that",
    "simulate": "is the workload's nodes: set those",
    "data": "is the workload's data: set that",
    "model": "is the workload's model: set that",
    **{e.key: "is a method's (methods.NAME.flags)" for e in _config.schema() if e.section == "algorithm"},
}
_NUMBER = re.compile(r"^-\d|^-\.\d")


def _resolve(token: str, flags: dict[str, str]) -> str | None:
    """The flag argparse would read ``token`` as (its exact name, or the one flag it is a
    prefix of); None if it is no flag or an ambiguous prefix."""
    if token in flags:
        return token
    hits = [f for f in flags if f.startswith(token)]
    return hits[0] if len(hits) == 1 else None


def _check_flags(r: _Reader, flags: Sequence[str], where: str,
                 refused: dict[str, str]) -> dict[str, list[str | None]]:
    """A list of gossip.train flags: each flag known, none of ``refused``. Returns
    {flag: [its values]} (a flag given as ``--flag=value`` or followed by a value)."""
    known = _train_flags()
    seen: dict[str, list[str | None]] = {}
    for i, tok in enumerate(flags):
        if not tok.startswith("-") or _NUMBER.match(tok):
            continue  # a value
        name, eq, value = tok.partition("=")
        flag = _resolve(name, known) if name.startswith("--") and len(name) > 2 else None
        if flag is None:
            near = [f for f in known if name.startswith("--") and f.startswith(name)]
            why = (f"ambiguous: it abbreviates {', '.join(near)}" if len(near) > 1 else
                   "not a flag of gossip.train (python -m gossip.train --help lists them)")
            raise r.fail(where, f"{name}: {why}")
        key = known[flag]
        if key in refused:
            said = flag if flag == name else f"{name} (read as {flag})"
            raise r.fail(where, f"{said} {refused[key]}")
        nxt = flags[i + 1] if i + 1 < len(flags) else None
        if not eq and nxt is not None and (not nxt.startswith("-") or _NUMBER.match(nxt)):
            value = nxt
        seen.setdefault(flag, []).append(value if (eq or value) else None)
    return seen


# ----------------------------------------------------------------------------- reading
class _Reader:
    """Typed reads of the file's values, each refusal one line naming the field's path."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, why: str) -> SpecError:
        return SpecError(f"{self.path}: {where}: {why}")

    def keys(self, table: dict, where: str, accepted: Sequence[str]) -> None:
        bad = [k for k in table if k not in accepted]
        if bad:
            raise self.fail(where, f"unknown key {bad[0]!r}; accepted: {', '.join(accepted)}")

    def table(self, v: Any, where: str, example: str) -> dict:
        if not isinstance(v, dict):
            raise self.fail(where, f"{v!r} is not a table; expected {example}")
        return v

    def integer(self, v: Any, where: str, lo: int, hi: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(where, f"{v!r} is not an integer; expected an integer >= {lo}")
        if v < lo or (hi is not None and v >= hi):
            raise self.fail(where, f"{v} is out of range; expected an integer >= {lo}"
                                   + ("" if hi is None else f" and below {hi:,}"))
        return v

    def number(self, v: Any, where: str, *, positive: bool = True) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(where, f"{v!r} is not a finite number")
        if positive and not v > 0:
            raise self.fail(where, f"{v!r} must be positive")
        return float(v)

    def text(self, v: Any, where: str) -> str:
        if not isinstance(v, str):
            raise self.fail(where, f"{v!r} is not text; expected a string")
        return v

    def array(self, v: Any, where: str, item: Callable[[Any, str], Any], *, example: str, unique: bool = True,
              empty: bool = False) -> tuple:
        """A list of values, each read by ``item``; with ``unique``, no two read the same."""
        if not isinstance(v, list):
            raise self.fail(where, f"{v!r} is not a list; expected a list such as {example}")
        if not v and not empty:
            raise self.fail(where, f"is empty; expected a list such as {example}")
        items = tuple(item(x, f"{where}[{i}]") for i, x in enumerate(v))
        for i, x in enumerate(items):
            if unique and x in items[:i]:
                same = v[items.index(x)]
                raise self.fail(where, f"lists {v[i]!r} twice" if same == v[i] else
                                f"{v[i]!r} is {same!r} again")
        return items


_TOP = ("seeds", "tune_seed", "lr_factors", "grid_extensions", "device", "links", "stragglers", "workloads",
        "methods")
_WORKLOAD_KEYS = ("data", "model", "samples_per_node", "epochs", "tune_epochs", "batch_size", "target", "metric",
                  "recipe", "nodes", "context", "hold_tolerance", "model_options")
_METHOD_KEYS = ("flags", "lr", "max_nodes", "source", "overrides")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _option_value(r: _Reader, v: Any, where: str) -> Any:
    if isinstance(v, bool) or isinstance(v, int) or isinstance(v, str):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return v
    raise r.fail(where, f"{v!r}: expected a number, true/false or text")


def _overrides(r: _Reader, t: Any, where: str) -> tuple[tuple[str, Any, str], ...]:
    """``overrides = {KEY = {value = V, reason = "why"}, ...}``: every override states its reason."""
    example = 'KEY = {value = V, reason = "why the paper\'s default does not fit"}'
    t = r.table(t, where, f"a table such as {{{example}}}")
    out = []
    for key, o in t.items():
        w = f"{where}.{key}"
        if not _KEY.match(key):
            raise r.fail(w, f"{key!r} is not an option name (letters, digits and _)")
        if not isinstance(o, dict):
            raise r.fail(w, f"{o!r}: an override is a table with its value and its reason: {example}")
        r.keys(o, w, ("value", "reason"))
        if "value" not in o:
            raise r.fail(w, f"no value: {example}")
        reason = o.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise r.fail(w, "no reason: an option set away from the paper's default states why, "
                            f"e.g. {key} = {{value = {option_text(o['value'])}, reason = \"...\"}}")
        out.append((key, _option_value(r, o["value"], f"{w}.value"), reason.strip()))
    return tuple(out)


def _rate(r: _Reader, v: Any, where: str) -> float:
    if not isinstance(v, str):
        raise r.fail(where, f"{v!r} is not text; expected a rate as tc writes it, e.g. \"10mbit\"")
    try:
        return units.tc_rate(v)
    except ValueError as e:
        raise r.fail(where, f"{v!r}: {e}") from None


def _latency(r: _Reader, v: Any, where: str) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
        return 0.0
    if not isinstance(v, str):
        raise r.fail(where, f"{v!r} is not text; expected a time such as \"0\", \"500us\", \"10ms\" or \"0.05s\"")
    try:
        t = units.parse_time(v)
    except units.UnitError:
        t = math.inf
    if not math.isfinite(t):
        raise r.fail(where, f"{v!r}: expected a time >= 0 such as \"0\", \"500us\", \"10ms\" or \"0.05s\"")
    if t > 0 and not re.search(r"[a-z]\s*$", v.strip(), re.I):
        raise r.fail(where, f"{v!r} has no unit (tc reads a bare time as microseconds, the model as seconds): "
                            f"give us, ms or s, e.g. \"{v.strip()}ms\"")
    return t


def _workload(r: _Reader, name: str, t: Any) -> Workload:
    where = f"workloads.{name}"
    if not _NAME.match(name):
        raise r.fail(where, "a workload's name names its run directories: letters, digits and . _ : + - only")
    if not isinstance(t, dict):
        raise r.fail(where, f"{t!r} is not a table; expected [workloads.{name}] with its keys")
    r.keys(t, where, _WORKLOAD_KEYS)
    for key in ("model", "samples_per_node", "epochs", "tune_epochs", "target", "nodes"):
        if key not in t:
            raise r.fail(where, f"missing key {key!r}")
    data = t.get("data", "mnist1d")
    if data not in bench_data.BASES:
        raise r.fail(f"{where}.data", f"{data!r}: expected one of {', '.join(bench_data.BASES)}")
    text = data in bench_data.TEXT_BASES
    task = "lm" if text else "classification"
    context = t.get("context")
    if text:
        if context is None:
            raise r.fail(f"{where}.context", "missing: a text workload needs a positive integer context")
        r.integer(context, f"{where}.context", 1)
    elif context is not None:
        raise r.fail(f"{where}.context", f"{context!r}: only the text data {', '.join(bench_data.TEXT_BASES)} "
                                         f"take a context")
    model = r.text(t["model"], f"{where}.model")
    if ":" not in model:  # module:function, the user's own model, is gossip.train's to check
        if model not in MODELS:
            raise r.fail(f"{where}.model", f"{model!r} is not a model of gossip.train; accepted: "
                                           f"{', '.join(MODELS)}, or module.path:function (your own)")
        if MODELS[model] != task:
            raise r.fail(f"{where}.model", f"{model!r} is a {MODELS[model]} model; the data {data!r} is a {task} "
                                           f"task: use one of {', '.join(m for m, k in MODELS.items() if k == task)}")
    metric = t.get("metric", "test_bpb" if text else "test_acc")
    if not isinstance(metric, str) or metric not in METRICS[task]:
        raise r.fail(f"{where}.metric", f"{metric!r}: a {task} workload is judged on one of {', '.join(METRICS[task])}")
    spn = r.integer(t["samples_per_node"], f"{where}.samples_per_node", 1)
    epochs = r.integer(t["epochs"], f"{where}.epochs", 1)
    tune_epochs = r.integer(t["tune_epochs"], f"{where}.tune_epochs", 1)
    if tune_epochs > epochs:
        raise r.fail(f"{where}.tune_epochs", f"{tune_epochs} must lie in [1, epochs = {epochs}]")
    batch = r.integer(t.get("batch_size", 32), f"{where}.batch_size", 1)
    target = r.number(t["target"], f"{where}.target", positive=False)
    if metric == "test_acc" and not 0 < target <= 1:
        raise r.fail(f"{where}.target", f"{target:g}: test_acc is a fraction, expected a target in (0, 1], "
                                        f"e.g. 0.9")
    if metric != "test_acc" and not target > 0:
        raise r.fail(f"{where}.target", f"{target:g}: a {metric} target must be positive")
    nodes = r.array(t["nodes"], f"{where}.nodes", lambda v, w: r.integer(v, w, 1), example="[4, 16]")
    recipe = r.array(t.get("recipe", []), f"{where}.recipe", r.text, example='["--lr-schedule", "step"]',
                     unique=False, empty=True)
    _check_flags(r, recipe, f"{where}.recipe", _NOT_A_RECIPES)
    for n in nodes:  # every node's shard must fill a batch, in the tuning trials (less the carve) and the final
        for role, stage in (("val", "tuning"), ("test", "final")):
            shard = bench_data.train_size(data, spn * n, role) // n
            if batch > shard:
                less = " less the validation carve" if shard < spn else ""
                raise r.fail(f"{where}.batch_size", f"{batch} is more than the {shard} training samples of each "
                                                    f"node in a {stage} trial at {n} nodes (samples_per_node "
                                                    f"{spn}{less}): no batch would ever be served")
    tol = r.number(t.get("hold_tolerance", 0.005), f"{where}.hold_tolerance", positive=False)
    if tol < 0:
        raise r.fail(f"{where}.hold_tolerance", f"{tol:g} must be >= 0 (the metric's units, e.g. 0.005)")
    mopts = r.table(t.get("model_options", {}), f"{where}.model_options", "a table such as {layers = 2, width = 64}")
    for k, v in mopts.items():
        if not _KEY.match(k):
            raise r.fail(f"{where}.model_options", f"{k!r} is not an option name (letters, digits and _)")
        _option_value(r, v, f"{where}.model_options.{k}")
    return Workload(name=name, data=data, model=model, samples_per_node=spn, epochs=epochs, tune_epochs=tune_epochs,
                    batch_size=batch, target=target, metric=metric, recipe=recipe, nodes=nodes, context=context,
                    hold_tolerance=tol, model_options=tuple(mopts.items()))


def _method(r: _Reader, name: str, t: Any, node_counts: set[int]) -> Method:
    where = f"methods.{name}"
    if not _NAME.match(name):
        raise r.fail(where, "a method's name names its run directories: letters, digits and . _ : + - only")
    if not isinstance(t, dict):
        raise r.fail(where, f"{t!r} is not a table; expected [methods.{name}] with flags and lr")
    r.keys(t, where, _METHOD_KEYS)
    for key in ("flags", "lr"):
        if key not in t:
            raise r.fail(where, f"missing key {key!r}")
    flags = r.array(t["flags"], f"{where}.flags", r.text, example='["--algo", "ecd", "--bits", "8"]', unique=False)
    seen = _check_flags(r, flags, f"{where}.flags", _NOT_A_METHODS)
    algos = seen.get("--algo", [])
    if not algos:
        raise r.fail(f"{where}.flags", "no --algo: a method names its algorithm, e.g. [\"--algo\", \"ecd\"]")
    if len(algos) > 1:
        raise r.fail(f"{where}.flags", f"gives --algo {len(algos)} times; a method is one algorithm")
    if algos[0] not in ALGORITHMS:
        raise r.fail(f"{where}.flags", f"--algo {algos[0]!r} is not an algorithm of gossip.train; accepted: "
                                       f"{', '.join(ALGORITHMS)}")
    lr = r.number(t["lr"], f"{where}.lr")
    max_nodes = t.get("max_nodes")
    if max_nodes is not None:
        r.integer(max_nodes, f"{where}.max_nodes", 1)
        if node_counts and max_nodes < min(node_counts):
            raise r.fail(f"{where}.max_nodes", f"{max_nodes} leaves the method out at every node count of the "
                                               f"workloads ({', '.join(map(str, sorted(node_counts)))})")
    overrides = _overrides(r, t.get("overrides", {}), f"{where}.overrides")
    return Method(name=name, flags=flags, lr=lr, max_nodes=max_nodes, source=r.text(t.get("source", ""),
                                                                                   f"{where}.source"),
                  overrides=overrides)


def _straggler(r: _Reader, v: Any, where: str) -> str:
    """A node-speed setting of the spec: a multiplier spec (a trace's seconds are not
    a multiplier of the trials' measured compute)."""
    from gossip import speeds

    if not isinstance(v, str) or v.strip().startswith("trace"):
        raise r.fail(where, f"{v!r}: expected a node-speed spec of multipliers, slow:nodes=K,factor=F or "
                            f"lognormal:sigma=S,seed=N")
    try:
        speeds.parse(v, None)
    except speeds.SpeedError as e:
        raise r.fail(where, str(e)) from None
    return v.strip()


def load_spec(path: str | Path) -> Spec:
    """Read and check a TOML spec (see ``experiments/benchmark.toml``): every field, before
    anything runs; SpecError naming the file and the field otherwise."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecError(f"--spec {path}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"--spec {path}: not valid TOML ({e})") from None
    r = _Reader(path)
    r.keys(raw, "the top level", _TOP)
    for key in ("workloads", "methods"):
        if not raw.get(key):
            raise r.fail(key, f"no [{key}.NAME] table")
    wls = [_workload(r, name, t) for name, t in r.table(raw["workloads"], "workloads", "[workloads.NAME]").items()]
    methods = [_method(r, name, t, {n for w in wls for n in w.nodes})
               for name, t in r.table(raw["methods"], "methods", "[methods.NAME]").items()]
    dirs: dict[str, str] = {}
    for m in methods:  # Trial.group writes ``:`` as ``-``: two names must not share a directory
        d = m.name.replace(":", "-")
        if d in dirs:
            raise r.fail(f"methods.{m.name}", f"its run directories ({d}) are those of methods.{dirs[d]}: rename one")
        dirs[d] = m.name
    seed = lambda v, w: r.integer(v, w, 0, _SEED_MAX)  # noqa: E731
    seeds = r.array(raw.get("seeds", [0, 1, 2]), "seeds", seed, example="[0, 1, 2]")
    tune_seed = seed(raw.get("tune_seed", 0), "tune_seed")
    factors = r.array(raw.get("lr_factors", [0.25, 0.5, 1.0, 2.0, 4.0]), "lr_factors", r.number,
                      example="[0.5, 1.0, 2.0]")
    links = r.table(raw.get("links", {}), "links", "[links] with bandwidth and latency lists")
    r.keys(links, "links", ("bandwidth", "latency"))
    bandwidths = links.get("bandwidth", list(Spec.bandwidths))
    r.array(bandwidths, "links.bandwidth", lambda v, w: _rate(r, v, w), example='["10mbit", "1gbit"]')
    latencies = links.get("latency", list(Spec.latencies))
    r.array(latencies, "links.latency", lambda v, w: _latency(r, v, w), example='["0", "10ms"]')
    extensions = r.integer(raw.get("grid_extensions", 3), "grid_extensions", 0, 11)
    device = raw.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise r.fail("device", f"{device!r}: expected 'cpu' or 'cuda'")
    stragglers = r.array(raw.get("stragglers", []), "stragglers", lambda v, w: _straggler(r, v, w),
                         example='["slow:nodes=1,factor=4", "lognormal:sigma=0.5,seed=0"]', empty=True)
    return Spec(workloads=tuple(wls), methods=tuple(methods), seeds=seeds, tune_seed=tune_seed, lr_factors=factors,
                bandwidths=tuple(bandwidths), latencies=tuple(str(x) for x in latencies), source=str(path),
                device=device, stragglers=tuple(stragglers), grid_extensions=extensions, raw=raw)


# ----------------------------------------------------------------------------- the trials
def check_trials(spec: Spec, argvs: Callable[[Workload, int, Method], Iterable[list[str]]]) -> None:
    """Each method's arguments at each workload and node count, as its trials run them
    (``argvs``: one list of gossip.train arguments per stage), parsed by gossip.train's
    own parser and its graph built at that node count: what gossip.train would refuse
    is refused now, before the first trial, naming the method. This one imports torch
    (gossip's registries), so it comes after :func:`load_spec`."""
    import contextlib
    import io

    from gossip.train import assembly
    from gossip.errors import RunError

    for wl in spec.workloads:
        for n in wl.nodes:
            for m in spec.methods:
                if m.max_nodes is not None and n > m.max_nodes:
                    continue
                where = f"{spec.source}: methods.{m.name}.flags (workloads.{wl.name} at {n} nodes)"
                for argv in argvs(wl, n, m):
                    err = io.StringIO()
                    try:
                        with contextlib.redirect_stderr(err):
                            cfg = _config.parse_args(argv)
                        assembly.build_topology(cfg, n)
                    except SystemExit:  # argparse's usage error, written to stderr
                        why = (err.getvalue().strip().splitlines() or ["refused"])[-1]
                        raise SpecError(f"{where}: {why.removeprefix('gossip.train: error: ')}") from None
                    except (_config.ConfigError, RunError, ValueError) as e:
                        raise SpecError(f"{where}: {e}") from None
