"""Run a study: the configurations of a spec in experiments/studies/, compared in one results file.

    python -m experiments run study experiments/studies/ecd_recipes.toml --out runs/ecd-recipes
    python -m experiments run ecd_recipes --out runs/ecd-recipes --results experiments/results/ecd_recipes.json

A study spec (TOML) names what every run trains (``[study]``: ``base`` flags of
``gossip.train``, ``data``, ``seed``, ``params``, and ``keep``, what the results file
keeps of each run) and the runs compared (``[runs.NAME]``: ``label``, ``flags`` on top
of the base, and what its kind needs). Each run trains ``gossip.train BASE FLAGS ...``,
one ordinary run directory each under ``--out``, and is recorded as a configuration of
the results file (what ``python -m experiments verify`` witnesses).
``python -m experiments run NAME`` runs experiments/studies/NAME.toml.

What a run leaves in the results file (``keep``):

- ``curve``: its label, epochs (``[runs.NAME] epochs``), flags, the final test accuracy
  and the test accuracy at every evaluation (``{"data": DATA, "runs": {NAME: ...}}``);
  each run trains ``BASE FLAGS --data DATA --epochs EPOCHS --seed SEED`` in this process;
- ``summary``: each run is ``python -m gossip.train BASE FLAGS`` in a process of its own,
  as a user runs it (``[runs.NAME] max_steps`` steps; ``--jobs`` at once), and keeps its
  command, its summary's figures, its wall clock and the load average before and after
  (``{NAME: ...}``);
- ``rows``: each run trains ``BASE FLAGS`` (``--max-steps`` and ``--data`` appended when
  given) in this process, or ``--jobs`` at once in worker processes of one thread each,
  and keeps one row: its ``[runs.NAME] row`` table (e.g. ``{method = "signum", exchange
  = "sharded"}``), final and best test accuracy (with the best's epoch), bytes per node
  per step, steps and wall clock (``{PARAMS..., "max_steps", "data", "runs": {NAME:
  flags}, "rows": [...]}``);
- ``modelled``: each run trains ``BASE FLAGS`` in this process and keeps its curve: at
  every evaluation the test accuracy, node 0's bytes (the setup exchange included) and
  compute and codec seconds, and the wall-clock time modelled at each ``--bandwidth``
  and ``--latency`` as experiments/race.py models it (``{PARAMS..., "bandwidths",
  "results": {NAME: ...}, ...}``, also ``OUT/compare.json``, with ``OUT/compare.md`` and
  ``OUT/compare.png``); its table function takes the runs and the bandwidths.
- ``tuned``: every run gets the same tuning budget, then one final run (the protocol
  of experiments/benchmark.py, fixed before any result is read): its learning rate on
  the grid ``[study] lr_factors`` (``--lr-factors``) times its ``[runs.NAME] lr``, each
  trial ``{tune_epochs}`` epochs on the training set less the validation carve of
  experiments/bench_data.py and evaluated on that carve; the rate of the best
  validation accuracy is selected (ties to the smaller rate, a failed or diverged trial
  last); the final run trains ``{epochs}`` epochs on the whole training set, evaluated
  on the test split. Each trial trains ``BASE FLAGS --lr LR --seed SEED`` (``{data}``
  is the stage's data set of ``{samples}`` samples; the parameters ``epochs``,
  ``tune_epochs``, ``samples`` and ``seed`` are declared) in this process, or ``--jobs``
  at once in worker processes; a trial whose run directory holds the record of a
  finished trial of the same flags (``trial.json``) is not redone. Keeps each run's
  grid, selected rate, final and best test accuracy, wire, bytes per step and in total,
  its curve and, with ``[study] baseline``, its bytes and accuracy against that run's
  (``{PARAMS..., "lr_factors", "data": {"tune", "final"}, "base", "methods", "results":
  {NAME: ...}}``, also ``OUT/results.json`` and ``OUT/results.md``).

``[study] params`` declares the study's parameters with their defaults (``{nodes = 16,
epochs = 30}``): each is an option of the command line (``--nodes``), and ``{nodes}`` in
``base`` or ``flags`` stands for its value. ``[study] results`` is the results file
written when ``--results`` is not given (a ``rows`` study: ``OUT/results.json``), and
``[study] table`` the function of experiments/tables.py (``NAME_table``) that draws the
results file's table: printed, and written to ``OUT/results.md`` by a ``rows`` or
``tuned`` study.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from experiments import _cli
from experiments import _provenance
from experiments import tables

__all__ = ["Study", "StudyError", "load", "configs", "studies", "spec_path", "as_study_command", "run_args",
           "run_row", "tuned_args", "run_trial", "trial_done", "select_lr", "describe", "options", "main"]

REPO = _provenance.REPO
#: the folder of the study specs
STUDIES = REPO / "experiments" / "studies"
#: what a results file may keep of each run
KEEPS = ("curve", "summary", "rows", "modelled", "tuned")
#: the options of the command line every study has, and those of each kind (a parameter may not take their names)
COMMON_OPTIONS = ("spec", "runs", "methods", "out", "results", "json")
KEEP_OPTIONS = {"curve": ("data", "epochs_scale"), "summary": ("steps", "data_dir", "jobs"),
                "rows": ("max_steps", "data", "jobs"), "modelled": ("bandwidth", "latency"),
                "tuned": ("lr_factors", "data", "jobs", "max_steps")}
#: what a run of each kind says besides its label and flags
RUN_KEYS = {"curve": ("epochs",), "summary": ("max_steps",), "rows": ("row",), "modelled": (), "tuned": ("lr",)}
#: the parameters a ``tuned`` study declares (its final and tuning horizons, the samples
#: of its data set, the seed); ``{data}`` in its flags is the data set of each stage
TUNED_PARAMS = ("epochs", "tune_epochs", "samples", "seed")
#: the learning-rate grid of a ``tuned`` study, times each run's base rate, unless it says
LR_FACTORS = (0.3, 1.0, 3.0)
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class StudyError(ValueError):
    """A study spec that cannot be run: the message names the key and what is accepted."""


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    epochs: int | None  # "curve"
    flags: list[str]
    max_steps: int | None = None  # "summary"
    row: dict[str, str] = field(default_factory=dict)  # "rows"
    lr: float | None = None  # "tuned": the base learning rate its grid multiplies


@dataclass(frozen=True)
class Study:
    name: str
    source: str  # the spec's path relative to the repository
    base: list[str]
    data: str
    seed: int
    keep: str
    runs: dict[str, Run] = field(default_factory=dict)
    results: str | None = None
    params: dict[str, int | float | str] = field(default_factory=dict)
    table: str | None = None
    lr_factors: tuple[float, ...] = LR_FACTORS  # "tuned"
    baseline: str | None = None  # "tuned": the run the others' bytes and accuracy are held against


def studies() -> list[str]:
    """The names of the study specs (``experiments/studies/NAME.toml``)."""
    return sorted(p.stem for p in STUDIES.glob("*.toml"))


def spec_path(name_or_path: str) -> Path:
    """A study's spec: a path, or the name of one in experiments/studies/."""
    p = Path(name_or_path)
    if p.suffix == ".toml":
        return p if p.is_absolute() or p.exists() else REPO / p
    return STUDIES / f"{name_or_path}.toml"


def describe(path: str | Path) -> str:
    """A spec's one-line description: the first sentence of its opening comment."""
    lines = []
    for ln in Path(path).read_text(encoding="utf-8").splitlines():
        if not ln.startswith("#"):
            break
        text = ln.lstrip("#").strip()
        if not text:
            break
        lines.append(text)
    text = " ".join(lines)
    m = re.match(r"(.+?[.?!])(\s|$)", text)
    return (m.group(1) if m else text) or "a study spec"


def _strs(v: object, where: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise StudyError(f"{where}: a list of strings (gossip.train flags), got {v!r}")
    return list(v)


def _params(v: object, keep: str, where: str) -> dict[str, int | float | str]:
    if not isinstance(v, dict):
        raise StudyError(f"{where} params: a table of name = default value, got {v!r}")
    taken = set(COMMON_OPTIONS) | set(KEEP_OPTIONS[keep])
    for k, x in v.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]*", k) or k in taken:
            raise StudyError(f"{where} params: {k!r} cannot name a parameter (lower-case letters, digits and _; "
                             f"not one of the {keep!r} study's options: {', '.join(sorted(taken))})")
        if isinstance(x, bool) or not isinstance(x, (int, float, str)):
            raise StudyError(f"{where} params: {k} = {x!r}; accepted: an integer, a number or a string")
    return dict(v)


def load(path: str | Path) -> Study:
    """The study spec at ``path``; StudyError names what is wrong."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise StudyError(f"{path}: cannot read it ({e.strerror}); known studies: {', '.join(studies())}") from None
    except tomllib.TOMLDecodeError as e:
        raise StudyError(f"{path}: not TOML: {e}") from None
    extra = set(raw) - {"study", "runs"}
    if extra or "study" not in raw or not raw.get("runs"):
        raise StudyError(f"{path}: a study has a [study] table and [runs.NAME] tables, and nothing else"
                         + (f" (found {', '.join(sorted(extra))})" if extra else ""))
    s = raw["study"]
    known = ("base", "data", "seed", "keep", "results", "params", "table", "lr_factors", "baseline")
    unknown = set(s) - set(known)
    if unknown:
        raise StudyError(f"{path}: [study] {', '.join(sorted(unknown))}: unknown key; known: {', '.join(known)}")
    keep = s.get("keep", "curve")
    if keep not in KEEPS:
        raise StudyError(f"{path}: [study] keep = {keep!r}; accepted: {', '.join(KEEPS)}")
    if not isinstance(s.get("seed", 0), int):
        raise StudyError(f"{path}: [study] seed must be an integer, got {s['seed']!r}")
    params = _params(s.get("params", {}), keep, f"{path}: [study]")
    if keep != "tuned" and ({"lr_factors", "baseline"} & set(s)):
        raise StudyError(f"{path}: [study] {', '.join(sorted({'lr_factors', 'baseline'} & set(s)))}: only a "
                         f"'tuned' study has it (keep = {keep!r})")
    lacking = [k for k in TUNED_PARAMS if k not in params] if keep == "tuned" else []
    if lacking:
        raise StudyError(f"{path}: [study] params: a 'tuned' study declares {', '.join(TUNED_PARAMS)} "
                         f"(missing: {', '.join(lacking)})")
    factors = s.get("lr_factors", list(LR_FACTORS))
    if not isinstance(factors, list) or not factors or any(
            isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < float("inf") for f in factors):
        raise StudyError(f"{path}: [study] lr_factors: a list of positive numbers, got {factors!r}")
    table = s.get("table")
    if table is not None and not callable(getattr(tables, f"{table}_table", None)):
        known_tables = sorted(n[:-len("_table")] for n in tables.__all__ if n.endswith("_table"))
        raise StudyError(f"{path}: [study] table = {table!r}: not a table of experiments/tables.py; "
                         f"known: {', '.join(known_tables)}")
    base = _strs(s.get("base", []), f"{path}: [study] base")
    runs = {}
    for name, r in raw["runs"].items():
        where = f"{path}: [runs.{name}]"
        own = RUN_KEYS[keep]
        unknown = set(r) - {"label", "flags", *own}
        if unknown:
            raise StudyError(f"{where} {', '.join(sorted(unknown))}: unknown key; known: {', '.join(('label', 'flags', *own))}")
        for count in set(own) & {"epochs", "max_steps"}:
            if not isinstance(r.get(count), int) or r[count] < 1:
                raise StudyError(f"{where} {count} must be a positive integer, got {r.get(count)!r}")
        if "lr" in own and (isinstance(r.get("lr"), bool) or not isinstance(r.get("lr"), (int, float))
                            or not r["lr"] > 0):
            raise StudyError(f"{where} lr must be a positive number (the base rate its grid multiplies), "
                             f"got {r.get('lr')!r}")
        row = r.get("row", {})
        if not isinstance(row, dict) or not all(isinstance(v, str) for v in row.values()):
            raise StudyError(f"{where} row: a table of strings (what its row of the results file says), got {row!r}")
        flags = _strs(r.get("flags", []), f"{where} flags")
        filled = set(params) | ({"data"} if keep == "tuned" else set())
        missing = sorted({m for f in [*base, *flags] for m in _PLACEHOLDER.findall(f)} - filled)
        if missing:
            raise StudyError(f"{where}: {', '.join('{' + m + '}' for m in missing)} in its flags: not a parameter "
                             f"of [study] params ({', '.join(params) or 'none declared'})")
        runs[name] = Run(name, str(r.get("label", name)), r.get("epochs"), flags, r.get("max_steps"), dict(row),
                         None if r.get("lr") is None else float(r["lr"]))
    baseline = s.get("baseline")
    if baseline is not None and baseline not in runs:
        raise StudyError(f"{path}: [study] baseline = {baseline!r}: not one of its runs ({', '.join(runs)})")
    try:
        source = str(path.resolve().relative_to(REPO))
    except ValueError:
        source = str(path)
    return Study(path.stem, source, base, str(s.get("data", "mnist1d")), int(s.get("seed", 0)), keep, runs,
                 s.get("results"), params, table, tuple(float(f) for f in factors), baseline)


def _fill(args: list[str], params: dict) -> list[str]:
    """``args`` with ``{NAME}`` replaced by the value of the parameter NAME."""
    def value(m: re.Match) -> str:
        v = params[m.group(1)]
        return f"{v:g}" if isinstance(v, float) else str(v)

    return [_PLACEHOLDER.sub(value, a) for a in args]


def run_args(study: Study, run: Run, *, data: str | None = None, epochs: int | None = None,
             params: dict | None = None) -> list[str]:
    """The ``gossip.train`` arguments of one run (no run directory or progress flags), its
    parameters filled in (``params`` over the spec's defaults). A ``curve`` run adds
    ``--data``, ``--epochs`` and ``--seed``; a ``rows`` run ``--data`` where ``data`` is
    given; a ``summary`` run's flags are all of them."""
    args = _fill([*study.base, *run.flags], {**study.params, **(params or {})})
    if study.keep == "curve":
        return [*args, "--data", data or study.data, "--epochs", str(epochs or run.epochs), "--seed", str(study.seed)]
    if study.keep == "rows" and data:
        return [*args, "--data", data]
    return args


def configs(study: Study, names: list[str] | None = None, *, data: str | None = None,
            epochs_scale: float = 1.0, params: dict | None = None, lrs: dict | None = None) -> list[list[str]]:
    """The configurations the study records, as a results file lists them (``configs``);
    of a ``tuned`` study, each run's final run at its selected rate (``lrs``: name ->
    rate, None where every tuning trial failed), not the tuning trials."""
    from experiments import witness

    names = names or list(study.runs)
    if study.keep == "tuned":
        return [witness.normalise(tuned_args(study, study.runs[n], "final", lrs[n], data=data, params=params))
                for n in names if (lrs or {}).get(n) is not None]
    return [witness.normalise(run_args(study, study.runs[n], data=data, epochs=_scaled(study.runs[n], epochs_scale),
                                       params=params))
            for n in names]


def tuned_args(study: Study, run: Run, stage: str, lr: float, *, data: str | None = None,
               params: dict | None = None) -> list[str]:
    """The ``gossip.train`` arguments of one trial of a ``tuned`` study (no run directory
    or progress flags): ``BASE FLAGS --lr LR --seed SEED``, its parameters filled in;
    ``{data}`` is the data set of experiments/bench_data.py the stage trains on (the
    validation carve of ``data`` to tune, its test split for the final run) and
    ``{epochs}`` the stage's (``tune_epochs`` to tune)."""
    from experiments import bench_data

    p = {**study.params, **(params or {})}
    role = "val" if stage == "tune" else "test"
    p["data"] = bench_data.dataset_name(data or study.data, int(p["samples"]), role)
    if stage == "tune":
        p["epochs"] = p["tune_epochs"]
    return [*_fill([*study.base, *run.flags], p), "--lr", f"{lr:g}", "--seed", str(p["seed"])]


def _scaled(run: Run, scale: float) -> int | None:
    return None if run.epochs is None else max(1, round(run.epochs * scale))


def as_study_command(cmd: str) -> str:
    """A recorded command of an experiment that became a study spec, as it runs now:
    ``python -m experiments.NAME ARGS`` becomes ``python -m experiments run NAME ARGS``."""
    names = set(studies())
    return re.sub(r"(?<![\w/.-])(python3?) -m experiments\.(\w+)(?![\w.])",
                  lambda m: f"{m.group(1)} -m experiments run {m.group(2)}" if m.group(2) in names else m.group(0), cmd)


def options(p: argparse.ArgumentParser, study: Study | None = None) -> None:
    """The options of ``python -m experiments run study SPEC`` (and of ``run NAME`` for a
    study NAME): those of every study, of its kind, and its parameters."""
    p.add_argument("spec", help=f"a study spec (TOML), or the name of one in experiments/studies/: {', '.join(studies())}")
    p.add_argument("--runs", "--methods", dest="runs", default=None,
                   help="comma list of the spec's runs (default all)" + (f": {', '.join(study.runs)}" if study else ""))
    p.add_argument("--out", default=None, help="directory for the run directories (default: runs/NAME)")
    p.add_argument("--results", "--json", dest="results", type=Path, default=None,
                   help="results JSON (default: the spec's [study] results; a rows study: OUT/results.json)")
    keep = study.keep if study else None
    if keep in (None, "curve"):
        p.add_argument("--data", default=None, help="curve: the data set of every run (default: the spec's)")
        p.add_argument("--epochs-scale", type=float, default=1.0,
                       help="curve: multiply every run's epochs (at least 1), for a quick look; 1 for the results file")
    if keep in (None, "summary"):
        p.add_argument("--steps", type=int, default=None, help="summary: every run's --max-steps (a reduced run)")
        p.add_argument("--data-dir", default=None, help="summary: train on this text (file or folder) instead")
    if keep in (None, "summary", "rows"):
        p.add_argument("--jobs", type=int, default=1, help="summary, rows: runs at once, each in its own process "
                       "(rows: one thread each unless OMP_NUM_THREADS says otherwise; default 1: in this process)")
    if keep == "rows":
        p.add_argument("--max-steps", type=int, default=None, help="stop every run after this many steps (a smoke run)")
        p.add_argument("--data", default=None, help="gossip.train's --data for every run (default: none given, "
                       f"its own; the results file names {study.data})")
    if keep == "tuned":
        factors = ",".join(f"{f:g}" for f in study.lr_factors)
        p.add_argument("--lr-factors", default=factors, help=f"tuned: the learning-rate grid, times each run's base "
                       f"rate, a comma list (default {factors})")
        p.add_argument("--data", default=None, help="tuned: the base data set of experiments/bench_data.py "
                       f"(mnist1d, synthetic; default {study.data}): tuned on its validation carve, the final runs "
                       "on its test split")
        p.add_argument("--jobs", type=int, default=1, help="tuned: trials at once, each in its own process of one "
                       "thread unless OMP_NUM_THREADS says otherwise (default 1: in this process)")
        p.add_argument("--max-steps", type=int, default=None, help="tuned: stop every trial after this many steps "
                       "(a smoke run)")
    if keep == "modelled":
        p.add_argument("--bandwidth", default="10mbit",
                       help="modelled: link rates, a comma list; the first one is plotted (default 10mbit)")
        p.add_argument("--latency", default="0", help="modelled: one-way latency (default 0)")
    for k, v in (study.params if study else {}).items():
        p.add_argument(f"--{k.replace('_', '-')}", dest=k, type=type(v), default=v,
                       help=f"the spec's {{{k}}} (default {v})")



def _train_one(study_name: str, name: str, args: list[str]) -> bool:
    """Train one run of a study in this process, recorded as a configuration of its
    results file (what ``python -m experiments verify`` witnesses); a failure is one
    line on stderr and False."""
    _provenance.record_config(args)
    from experiments import training

    rc, err = training.train_in_process(args)
    if rc != 0:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        print(f"{study_name}: {name} failed (exit {rc}): {last}", file=sys.stderr)
        return False
    return True

def main(argv: list[str] | None = None, name: str | None = None) -> int:
    """Run the study ``argv`` names (``name``: the study NAME of ``run NAME``, which comes
    before the options; else the spec is the first argument)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    full = ["python", "-m", "experiments", "run", *([name] if name else ["study"]), *argv]
    spec = name or (argv[0] if argv and not argv[0].startswith("-") else None)
    study, why = None, None
    if spec is not None:
        try:
            study = load(spec_path(spec))
        except StudyError as e:
            why = str(e)
    p = _cli.parser(lambda q: options(q, study), __doc__, name or "study")
    if why:
        p.error(why)
    a = p.parse_args([name, *argv] if name else argv)
    if study is None:  # `run study --help`-like: the parser has said what is wrong
        p.error("the spec must come first: python -m experiments run study SPEC [options]")
    names = list(study.runs) if a.runs is None else [n.strip() for n in a.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in study.runs]
    if bad or not names:
        p.error(f"--runs: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(study.runs)}")
    if study.keep == "curve" and not a.epochs_scale > 0:
        p.error(f"--epochs-scale must be > 0, got {a.epochs_scale:g}")
    low = [f"--{k.replace('_', '-')} {v}" for k in ("jobs", "steps", "max_steps")
           if (v := getattr(a, k, None)) is not None and v < 1]
    if low:
        p.error(f"must be at least 1: {', '.join(low)}")
    results = a.results or (REPO / study.results if study.results else None)
    a.out = a.out or str(Path("runs") / study.name.replace("_", "-"))
    params = {k: getattr(a, k) for k in study.params}
    if study.keep == "summary":
        return _summary(study, names, a, results, full, params)
    if study.keep == "rows":
        return _rows(study, names, a, results or Path(a.out) / "results.json", full, params)
    if study.keep == "tuned":
        try:
            factors = [float(f) for f in a.lr_factors.split(",") if f.strip()]
        except ValueError:
            factors = []
        if not factors or any(not 0 < f < float("inf") for f in factors):
            p.error(f"--lr-factors: give positive numbers separated by commas, got {a.lr_factors!r}")
        low = [f"--{k.replace('_', '-')} {params[k]}" for k in ("epochs", "tune_epochs") if params[k] < 1]
        if low:
            p.error(f"must be at least 1: {', '.join(low)}")
        return _tuned(study, names, a, results or Path(a.out) / "results.json", full, params, factors)
    if study.keep == "modelled":
        from gossip.tools import crossover

        try:
            links = [b.strip() for b in a.bandwidth.split(",") if b.strip()]
            link = ([crossover.parse_rate(b) for b in links], crossover.parse_time(a.latency))
        except crossover.CrossoverError as e:
            p.error(str(e))
        if not links:
            p.error("--bandwidth is empty; e.g. --bandwidth 10mbit")
        return _modelled(study, names, a, results, full, params, links, *link)
    return _curve(study, names, a, results, full, params)


def _curve(study: Study, names: list[str], a: argparse.Namespace, results: Path | None, full: list[str],
           params: dict) -> int:
    """A ``curve`` study: each run in this process, its test accuracy at every evaluation."""
    from experiments import race

    sources = _provenance.training_sources("gossip/tools/crossover.py", "experiments/study.py", study.source,
                                           "experiments/race.py", "experiments/training.py", "experiments/_cli.py")
    prov = _provenance.start(sources, argv=full)
    out = Path(a.out)
    runs = {}
    for n in names:
        run = study.runs[n]
        epochs = _scaled(run, a.epochs_scale)
        run_dir = out / n
        print(f"{study.name}: {n} ({epochs} epochs) ...", flush=True)
        args = [*run_args(study, run, data=a.data, epochs=epochs, params=params), "--log-every", "1", "--no-progress",
                "--overwrite", "--out", str(run_dir)]
        if not _train_one(study.name, n, args):
            return 1
        c = race.curve(run_dir)
        runs[n] = {"label": run.label, "epochs": epochs, "flags": _fill([*study.base, *run.flags], {**study.params, **params}),
                   "final_test_acc": c["final_test_acc"],
                   "points": [{"epoch": pt["epoch"], "test_acc": pt["test_acc"]} for pt in c["points"]]}
    res = {"data": a.data or study.data, "runs": runs}
    if results:
        _provenance.write(results, res, prov)
    if study.table:
        print(getattr(tables, f"{study.table}_table")(res))
    return 0


def run_row(name: str, tags: dict, args: list[str], run_dir: str) -> dict:
    """Train one run of a ``rows`` study in this process and read its row back:
    ``tags``, then its figures (experiments/training.py's ``summary_row``) and wall clock.
    A run that diverged (its summary.json says so) is a row too: no accuracy,
    ``diverged`` and the step it stopped at. RuntimeError with the run's last error line
    if it fails otherwise."""
    from experiments import training
    from gossip import rundir

    t0 = time.perf_counter()
    rc, err = training.train_in_process(args)
    if rc != 0:
        path = rundir.summary_path(Path(run_dir))
        s = rundir.read_json(path) if path.exists() else {}
        if s.get("diverged"):
            return {**tags, "final_test_acc": None, "best_test_acc": None, "best_epoch": None,
                    "bytes_per_node_per_step": s.get("bytes_sent_per_node_per_step"), "steps": s.get("steps"),
                    "diverged": True, "wall_s": round(time.perf_counter() - t0, 1)}
        last = err.strip().splitlines()[-1] if err.strip() else ""
        raise RuntimeError(f"{name} failed (exit {rc}): {last}")
    return {**tags, **training.summary_row(run_dir), "wall_s": round(time.perf_counter() - t0, 1)}


def _rows(study: Study, names: list[str], a: argparse.Namespace, results: Path, full: list[str], params: dict) -> int:
    """A ``rows`` study: one row per run, ``--jobs`` runs at once in worker processes."""
    from experiments import training

    sources = _provenance.training_sources("experiments/study.py", study.source, "experiments/training.py",
                                           "experiments/_cli.py")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(sources, argv=full)
    todo = []  # (name, row tags, gossip.train arguments, run directory)
    for n in names:
        run = study.runs[n]
        run_dir = out / n.replace(":", "-")
        args = [*run_args(study, run, params=params), "--no-progress", "--overwrite", "--out", str(run_dir)]
        if a.max_steps is not None:
            args += ["--max-steps", str(a.max_steps)]
        if a.data is not None:
            args += ["--data", a.data]
        _provenance.record_config(args)  # what `python -m experiments verify` witnesses
        todo.append((n, run.row or {"run": n}, args, str(run_dir)))
    try:
        rows = training.run_all(run_row, todo, a.jobs, on_row=lambda r: print(json.dumps(r), flush=True))
    except RuntimeError as e:
        print(f"{study.name}: {e}", file=sys.stderr)
        return 1
    allp = {**study.params, **params}
    res = {**allp, "max_steps": a.max_steps, "data": a.data or study.data,
           "runs": {n: _fill([*study.base, *study.runs[n].flags], allp) for n in names}, "rows": rows}
    path = _provenance.write(results, res, prov)
    if study.table:
        table = getattr(tables, f"{study.table}_table")(res)
        (out / "results.md").write_text(table + "\n")
        print(table)
    print(f"{study.name}: wrote {path}")
    return 0


def _summary(study: Study, names: list[str], a: argparse.Namespace, results: Path | None, full: list[str],
             params: dict) -> int:
    """A ``summary`` study: each run a ``python -m gossip.train`` process, ``--jobs`` at once."""
    from concurrent.futures import ThreadPoolExecutor

    from experiments._lmruns import run_train

    sources = _provenance.training_sources("experiments/study.py", study.source, "experiments/_lmruns.py")
    prov = _provenance.start(sources, argv=full)
    steps = {n: a.steps or study.runs[n].max_steps for n in names}
    for n in names:
        print(f"{study.name}: {n}, {steps[n]} steps ...", flush=True)
    # each run is a process of its own; --jobs 2 runs two at once (on a shared machine each
    # then waits for the other, which its wall clock and load record)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        data = ["--data-dir", a.data_dir] if a.data_dir else []
        futures = {n: pool.submit(run_train, [*run_args(study, study.runs[n], params=params), *data, "--max-steps", str(steps[n])],
                                  Path(a.out) / n) for n in names}
        res = {n: f.result() for n, f in futures.items()}
    for n, rec in res.items():
        rec["reduced"] = a.steps is not None
        rec["jobs"] = a.jobs
        if rec["exit"] != 0:
            print(f"{study.name}: {n} failed: {rec['error']}", flush=True)
            continue
        print(f"{study.name}: {n}: {rec['params']:,} params, {rec['steps']} steps, held-out "
              f"{rec['final_test_bpb']:.3f} bits per byte (perplexity per byte {rec['final_test_ppl']:.2f}) in "
              f"{rec['wall_s']:.0f} s wall clock, load average {rec['load_average'][0]:.1f} -> "
              f"{rec['load_average'][1]:.1f}", flush=True)
    if results:
        _provenance.write(results, res, prov)  # the command, commit, machine and load are in the provenance
        print(f"{study.name}: wrote {results}")
    return 0 if all(r["exit"] == 0 for r in res.values()) else 1



#: a trial's record in its run directory: a ``tuned`` study never redoes a finished trial
TRIAL = "trial.json"


def trial_done(run_dir: str | Path, args: list[str]) -> dict | None:
    """The record of a finished trial of exactly ``args`` in ``run_dir`` (it ran, or it
    failed), else None: an interrupted one is run again."""
    from gossip import rundir

    try:
        rec = rundir.read_json(Path(run_dir) / TRIAL)
    except Exception:  # noqa: BLE001 - absent or unreadable: not finished
        return None
    return rec if rec.get("args") == args and rec.get("status") in ("ok", "failed") else None


def run_trial(name: str, stage: str, lr: float, args: list[str], run_dir: str | Path) -> dict:
    """One trial of a ``tuned`` study in this process: its record, also written to
    ``RUN_DIR/trial.json`` (status, CPU and wall seconds, the last error line, and the
    final test accuracy of the averaged model as ``score``)."""
    import math

    from experiments import training
    from gossip import rundir

    run_dir = Path(run_dir)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rc, err = training.train_in_process(args)
    stopped = rc != 0 and "stopped by SIG" in err
    rec = {"method": name, "stage": stage, "lr": lr, "args": args,
           "status": "ok" if rc == 0 else "interrupted" if stopped else "failed",
           "cpu_s": round(time.process_time() - cpu0, 2), "wall_s": round(time.perf_counter() - wall0, 2),
           "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1], "score": None}
    if rc == 0:
        score = rundir.read_json(rundir.summary_path(run_dir)).get("final_test_acc")
        rec["score"] = score if score is not None and math.isfinite(score) else None
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(run_dir / TRIAL, rec)
    return rec


def select_lr(grid: list[dict]) -> float | None:
    """The selected rate of a tuning grid: the best validation accuracy, ties to the
    smaller rate; a failed or diverged trial (``val_acc`` None) ranks last."""
    ok = [g for g in grid if g["val_acc"] is not None]
    return max(ok, key=lambda g: (g["val_acc"], -g["lr"]))["lr"] if ok else None


def _tuned(study: Study, names: list[str], a: argparse.Namespace, results: Path, full: list[str], params: dict,
           factors: list[float]) -> int:
    """A ``tuned`` study: each run's learning rate tuned on the same grid and budget on
    the validation carve, then its final run at the selected rate on the test split."""
    from experiments import bench_data, race, training

    sources = _provenance.training_sources("gossip/tools/crossover.py", "experiments/study.py", study.source,
                                           "experiments/bench_data.py", "experiments/race.py",
                                           "experiments/training.py", "experiments/_cli.py")
    prov = _provenance.start(sources, argv=full)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    allp = {**study.params, **params}
    data = a.data or study.data
    val, test = (bench_data.dataset_name(data, int(allp["samples"]), role) for role in ("val", "test"))

    def trial(n: str, stage: str, lr: float) -> tuple:
        run_dir = out / n / (f"tune-lr{lr:g}" if stage == "tune" else "final")
        args = [*tuned_args(study, study.runs[n], stage, lr, data=data, params=params),
                *(["--max-steps", str(a.max_steps)] if a.max_steps is not None else []),
                "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
        return n, stage, lr, args, run_dir

    def run(todo: list[tuple]) -> None:
        todo = [t for t in todo if trial_done(t[4], t[3]) is None]
        count = iter(range(1, len(todo) + 1))

        def note(rec: dict) -> None:
            print(f"{study.name}: {rec['stage']} [{next(count)}/{len(todo)}] {rec['method']} lr={rec['lr']:g}: "
                  f"{rec['status']}" + (f" val/test acc {rec['score']:.4f}" if rec["score"] is not None else "")
                  + f" in {rec['wall_s']:.0f} s" + (f" ({rec['error']})" if rec["error"] else ""), flush=True)

        training.run_all(run_trial, todo, a.jobs, on_row=note)

    # 1. the tuning grid of every run; 2. the selection on the validation carve
    tune = [trial(n, "tune", round(study.runs[n].lr * f, 10)) for n in names for f in factors]
    run(tune)
    grids: dict[str, list[dict]] = {n: [] for n in names}
    for t in tune:
        rec = trial_done(t[4], t[3])
        grids[t[0]].append({"lr": t[2], "val_acc": rec["score"] if rec else None,
                            "cpu_s": rec["cpu_s"] if rec else None})
    chosen = {n: select_lr(grids[n]) for n in names}
    # 3. the final runs at the selected rates: what `python -m experiments verify` witnesses
    final = {n: trial(n, "final", chosen[n]) for n in names if chosen[n] is not None}
    for t in final.values():
        _provenance.record_config(t[3])
    run(list(final.values()))

    res = {}
    for n in names:
        r = {"grid": grids[n], "lr": chosen[n], "status": "every tuning trial failed" if chosen[n] is None else None}
        if n in final:
            t = final[n]
            rec = trial_done(t[4], t[3])
            r["status"] = rec["status"]
            r["final_cpu_s"] = rec["cpu_s"]
            if rec["status"] == "ok":
                c = race.curve(t[4])
                last = c["points"][-1] if c["points"] else None
                r.update(final_test_acc=c["final_test_acc"], wire=c["wire"], steps=c["steps"],
                         best_test_acc=max((pt["test_acc"] for pt in c["points"]), default=c["final_test_acc"]),
                         bytes_per_step=last["bytes"] / last["step"] if last else None,
                         bytes_total=last["bytes"] if last else None, points=c["points"])
            else:
                r["error"] = rec["error"]
        res[n] = r
    base = res.get(study.baseline) if study.baseline else None
    for r in res.values():
        if base is not None and base.get("bytes_per_step") and r.get("bytes_per_step") is not None:
            r[f"bytes_vs_{study.baseline}"] = r["bytes_per_step"] / base["bytes_per_step"]
            r[f"acc_minus_{study.baseline}"] = r["final_test_acc"] - base["final_test_acc"]
    doc = {**allp, "lr_factors": factors, "data": {"tune": val, "final": test},
           "base": _fill(study.base, {**allp, "data": test}),
           "methods": {n: {"flags": _fill(study.runs[n].flags, allp), "base_lr": study.runs[n].lr} for n in names},
           "results": res, "provenance": prov.finish()}
    p = doc["provenance"]
    text = json.dumps(doc, indent=1) + "\n"
    for path in [out / "results.json"] + ([Path(results)] if Path(results) != out / "results.json" else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    md = getattr(tables, f"{study.table}_table")(res) if study.table else ""
    (out / "results.md").write_text(
        f"{md}\n\nMade with `{p['command']}` at commit {(p['commit'] or '?')[:10]}"
        f"{' (dirty tree)' if p['dirty'] else ''} on {p['date']} (grid {a.lr_factors} x base rate at "
        f"{allp['tune_epochs']} epochs on the validation carve, {allp['epochs']} epochs final; load average "
        f"{p['load_before'][0]} at the start, {p['load_after'][0]} at the end, {p['machine']['cores']} cores).\n")
    print(md)
    print(f"{study.name}: wrote {out / 'results.md'}, {out / 'results.json'}"
          + (f", {results}" if Path(results) != out / "results.json" else ""))
    bad = {n: r.get("error") or r["status"] for n, r in res.items() if r.get("final_test_acc") is None}
    for n, why in bad.items():
        print(f"{study.name}: error: {n} has no final result: {why}", file=sys.stderr)
    return 1 if bad else 0


def _setup_bytes(run_dir: Path) -> int:
    """Node 0's setup traffic (dcd, ecd and choco send x_1 once in full precision)."""
    from gossip import rundir

    recs = rundir.read_metrics(rundir.metrics_path(run_dir, 0))
    return next((int(r["setup_bytes_sent"]) for r in recs if r["kind"] == "train"), 0)


def _modelled(study: Study, names: list[str], a: argparse.Namespace, results: Path | None, full: list[str],
              params: dict, links: list[str], bandwidths: list[float], latency: float) -> int:
    """A ``modelled`` study: each run in this process; at every evaluation its test
    accuracy, node 0's bytes (the setup exchange included) and the wall-clock time
    modelled at each bandwidth as experiments/race.py models it (gossip.tools.crossover's
    link model: compute + codec + 1.05 * 8 * bytes / B + latency * message rounds).
    Writes ``OUT/compare.json`` (and ``--results``), ``OUT/compare.md`` and, with
    matplotlib, ``OUT/compare.png``."""
    import os

    from experiments import race

    sources = _provenance.training_sources("gossip/tools/crossover.py", "experiments/study.py", study.source,
                                           "experiments/race.py", "experiments/training.py", "experiments/_cli.py")
    prov = _provenance.start(sources, argv=full)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    allp = {**study.params, **params}
    res = {}
    load = [os.getloadavg()[0]]  # compute times are measured on this machine: say how busy it was
    for n in names:
        print(f"{study.name}: {n} ...", flush=True)
        run_dir = out / n.replace(":", "-")
        args = [*run_args(study, study.runs[n], params=params), "--log-every", "1", "--no-progress", "--overwrite",
                "--out", str(run_dir)]
        if not _train_one(study.name, n, args):
            return 1
        c = race.curve(run_dir)
        c["setup_bytes"] = _setup_bytes(run_dir)
        for pt in c["points"]:  # the starting exchange of dcd, ecd and choco counts too
            pt["bytes"] += c["setup_bytes"]
            pt["time_s"] = [race.modelled_time(pt, c["calls_per_step"], c["world_size"], b, latency) for b in bandwidths]
        c["topology"] = args[args.index("--topology") + 1] if "--topology" in args else None
        last = c["points"][-1] if c["points"] else None
        c["bytes_per_step"] = (last["bytes"] - c["setup_bytes"]) / last["step"] if last else None
        c["run_dir"] = run_dir.name
        res[n] = c
    load.append(os.getloadavg()[0])
    base = _fill(study.base, allp)
    doc = {**allp, "partition": base[base.index("--partition") + 1] if "--partition" in base else "iid",
           "bandwidths": links, "latency_s": latency, "base": base,
           "runs": {n: _fill(study.runs[n].flags, allp) for n in names}, "results": res, "mode": "simulated-time",
           "load_average": load, "cpu_count": os.cpu_count(), "provenance": prov.finish()}
    text = json.dumps(doc, indent=1) + "\n"
    for path in [out / "compare.json"] + ([Path(results)] if results else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    md = getattr(tables, f"{study.table}_table")(res, links) if study.table else ""
    (out / "compare.md").write_text(
        f"{md}\n\nMade with `{doc['provenance']['command']}` (simulated time; load average {load[0]:.1f} at the "
        f"start, {load[1]:.1f} at the end, on {os.cpu_count()} cores).\n")
    drew = _plot_modelled(res, links[0], out / "compare.png")
    print(md)
    print(f"{study.name}: wrote {out / 'compare.md'}, {out / 'compare.json'}" + (f", {out / 'compare.png'}" if drew else "")
          + (f", {results}" if results else ""))
    return 0


def _plot_modelled(results: dict, bw_label: str, path: Path) -> bool:
    """Test accuracy against bytes sent per node and against the modelled time at
    ``bw_label``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, r in results.items():
        acc = [p["test_acc"] for p in r["points"]]
        axes[0].plot([p["bytes"] / 2**20 for p in r["points"]], acc, marker=".", label=name)
        axes[1].plot([p["time_s"][0] for p in r["points"]], acc, marker=".", label=name)
    axes[0].set(xscale="log", xlabel="MB sent per node (2^20 bytes)", ylabel="test accuracy (averaged model)",
                title="accuracy against bytes sent")
    axes[1].set(xscale="log", xlabel=f"simulated wall-clock time at {bw_label} (s)", ylabel="test accuracy",
                title=f"accuracy against simulated time, {bw_label}")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
