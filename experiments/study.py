"""Run a study: the configurations of a spec in experiments/studies/, compared in one results file.

    python -m experiments run study experiments/studies/ecd_recipes.toml --out runs/ecd-recipes
    python -m experiments run ecd_recipes --out runs/ecd-recipes --results experiments/results/ecd_recipes.json

A study spec (TOML) names what every run trains (``[study]``: ``base`` flags of
``gossip.train``, ``data``, ``seed``, and ``keep``, what the results file keeps of each
run) and the runs compared (``[runs.NAME]``: ``label``, ``epochs``, ``flags`` on top
of the base). Each run trains ``gossip.train BASE FLAGS --data DATA --epochs EPOCHS
--seed SEED`` in this process, one ordinary run directory each under ``--out``, and is
recorded as a configuration of the results file (what ``python -m experiments verify``
witnesses). ``python -m experiments run NAME`` runs experiments/studies/NAME.toml.

What a run leaves in the results file (``keep``):

- ``curve``: its label, epochs, flags, the final test accuracy and the test accuracy at
  every evaluation (``{"data": DATA, "runs": {NAME: ...}}``);
- ``summary``: each run is ``python -m gossip.train`` in a process of its own, as a user
  runs it (``max_steps`` steps; ``--jobs`` at once), and keeps its command, its
  summary's figures, its wall clock and the load average before and after
  (``{NAME: ...}``).

``[study] results`` is the results file written when ``--results`` is not given.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from experiments import _cli
from experiments import _provenance
from experiments import tables

__all__ = ["Study", "StudyError", "load", "configs", "studies", "spec_path", "as_study_command", "main"]

REPO = _provenance.REPO
#: the folder of the study specs
STUDIES = REPO / "experiments" / "studies"
#: what a results file may keep of each run
KEEPS = ("curve", "summary")


class StudyError(ValueError):
    """A study spec that cannot be run: the message names the key and what is accepted."""


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    epochs: int | None  # "curve"
    flags: list[str]
    max_steps: int | None = None  # "summary"


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


def studies() -> list[str]:
    """The names of the study specs (``experiments/studies/NAME.toml``)."""
    return sorted(p.stem for p in STUDIES.glob("*.toml"))


def spec_path(name_or_path: str) -> Path:
    """A study's spec: a path, or the name of one in experiments/studies/."""
    p = Path(name_or_path)
    if p.suffix == ".toml":
        return p if p.is_absolute() or p.exists() else REPO / p
    return STUDIES / f"{name_or_path}.toml"


def _strs(v: object, where: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise StudyError(f"{where}: a list of strings (gossip.train flags), got {v!r}")
    return list(v)


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
    unknown = set(s) - {"base", "data", "seed", "keep", "results"}
    if unknown:
        raise StudyError(f"{path}: [study] {', '.join(sorted(unknown))}: unknown key; "
                         "known: base, data, seed, keep, results")
    keep = s.get("keep", "curve")
    if keep not in KEEPS:
        raise StudyError(f"{path}: [study] keep = {keep!r}; accepted: {', '.join(KEEPS)}")
    if not isinstance(s.get("seed", 0), int):
        raise StudyError(f"{path}: [study] seed must be an integer, got {s['seed']!r}")
    runs = {}
    for name, r in raw["runs"].items():
        where = f"{path}: [runs.{name}]"
        count = "epochs" if keep == "curve" else "max_steps"
        unknown = set(r) - {"label", count, "flags"}
        if unknown:
            raise StudyError(f"{where} {', '.join(sorted(unknown))}: unknown key; known: label, {count}, flags")
        if not isinstance(r.get(count), int) or r[count] < 1:
            raise StudyError(f"{where} {count} must be a positive integer, got {r.get(count)!r}")
        runs[name] = Run(name, str(r.get("label", name)), r.get("epochs"), _strs(r.get("flags", []), f"{where} flags"),
                         r.get("max_steps"))
    try:
        source = str(path.resolve().relative_to(REPO))
    except ValueError:
        source = str(path)
    return Study(path.stem, source, _strs(s.get("base", []), f"{path}: [study] base"), str(s.get("data", "mnist1d")),
                 int(s.get("seed", 0)), keep, runs, s.get("results"))


def run_args(study: Study, run: Run, *, data: str | None = None, epochs: int | None = None) -> list[str]:
    """The ``gossip.train`` arguments of one run (no run directory or progress flags); a
    ``summary`` run's flags are all of them."""
    if study.keep == "summary":
        return [*study.base, *run.flags]
    return [*study.base, *run.flags, "--data", data or study.data, "--epochs", str(epochs or run.epochs),
            "--seed", str(study.seed)]


def configs(study: Study, names: list[str] | None = None, *, data: str | None = None,
            epochs_scale: float = 1.0) -> list[list[str]]:
    """The configurations the study records, as a results file lists them (``configs``)."""
    from experiments import witness

    return [witness.normalise(run_args(study, study.runs[n], data=data, epochs=_scaled(study.runs[n], epochs_scale)))
            for n in (names or list(study.runs))]


def _scaled(run: Run, scale: float) -> int | None:
    return None if run.epochs is None else max(1, round(run.epochs * scale))


def as_study_command(cmd: str) -> str:
    """A recorded command of an experiment that became a study spec, as it runs now:
    ``python -m experiments.NAME ARGS`` becomes ``python -m experiments run NAME ARGS``."""
    names = set(studies())
    return re.sub(r"(?<![\w/.-])(python3?) -m experiments\.(\w+)(?![\w.])",
                  lambda m: f"{m.group(1)} -m experiments run {m.group(2)}" if m.group(2) in names else m.group(0), cmd)


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run study`` (and of ``run NAME`` for a study NAME)."""
    p.add_argument("spec", help=f"a study spec (TOML), or the name of one in experiments/studies/: {', '.join(studies())}")
    p.add_argument("--runs", default=None, help="comma list of the spec's runs (default all)")
    p.add_argument("--data", default=None, help="the data set of every run (default: the spec's)")
    p.add_argument("--epochs-scale", type=float, default=1.0,
                   help="curve: multiply every run's epochs (at least 1), for a quick look; 1 for the results file")
    p.add_argument("--steps", type=int, default=None, help="summary: every run's --max-steps (a reduced run)")
    p.add_argument("--data-dir", default=None, help="summary: train on this text (file or folder) instead")
    p.add_argument("--jobs", type=int, default=1, help="summary: runs at once, each in its own process (default 1)")
    p.add_argument("--out", default=None, help="directory for the run directories (default: runs/NAME)")
    p.add_argument("--results", type=Path, default=None,
                   help="results JSON (default: the spec's [study] results, if any)")


def main(argv: list[str] | None = None, name: str | None = None) -> int:
    """Run the study ``argv`` names (``name``: the study NAME of ``run NAME``, which comes
    before the options)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    full = ["python", "-m", "experiments", "run", *([name] if name else ["study"]), *argv]
    p, a = _cli.parse([name, *argv] if name else argv, options, __doc__, name or "study")
    try:
        study = load(spec_path(a.spec))
    except StudyError as e:
        p.error(str(e))
    names = list(study.runs) if a.runs is None else [n.strip() for n in a.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in study.runs]
    if bad or not names:
        p.error(f"--runs: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(study.runs)}")
    if not a.epochs_scale > 0:
        p.error(f"--epochs-scale must be > 0, got {a.epochs_scale:g}")
    wrong = [f for f, given in (("--epochs-scale", a.epochs_scale != 1.0), ("--data", a.data is not None))
             if given and study.keep == "summary"] + \
            [f for f, given in (("--steps", a.steps is not None), ("--data-dir", a.data_dir is not None),
                                ("--jobs", a.jobs != 1)) if given and study.keep == "curve"]
    if wrong:
        p.error(f"{', '.join(wrong)}: not an option of a {study.keep!r} study ({study.name})")
    if a.jobs < 1 or (a.steps is not None and a.steps < 1):
        p.error(f"--jobs and --steps must be at least 1, got --jobs {a.jobs} --steps {a.steps}")
    results = a.results or (REPO / study.results if study.results else None)
    a.out = a.out or str(Path("runs") / study.name.replace("_", "-"))
    if study.keep == "summary":
        return _summary(study, names, a, results, full)
    from experiments import race

    sources = _provenance.training_sources("gossip/tools/crossover.py", "experiments/study.py", study.source,
                                           "experiments/race.py", "experiments/_cli.py")
    prov = _provenance.start(sources, argv=full)
    out = Path(a.out)
    runs = {}
    for n in names:
        run = study.runs[n]
        epochs = _scaled(run, a.epochs_scale)
        run_dir = out / n
        print(f"{study.name}: {n} ({epochs} epochs) ...", flush=True)
        args = [*run_args(study, run, data=a.data, epochs=epochs), "--log-every", "1", "--no-progress",
                "--overwrite", "--out", str(run_dir)]
        _provenance.record_config(args)  # what `python -m experiments verify` witnesses
        rc, err = race.train_in_process(args)
        if rc != 0:
            last = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"{study.name}: {n} failed (exit {rc}): {last}", file=sys.stderr)
            return 1
        c = race.curve(run_dir)
        runs[n] = {"label": run.label, "epochs": epochs, "flags": [*study.base, *run.flags],
                   "final_test_acc": c["final_test_acc"],
                   "points": [{"epoch": pt["epoch"], "test_acc": pt["test_acc"]} for pt in c["points"]]}
    res = {"data": a.data or study.data, "runs": runs}
    if results:
        _provenance.write(results, res, prov)
    if study.keep == "curve":
        print(tables.ecd_recipes_table(res))
    return 0



def _summary(study: Study, names: list[str], a: argparse.Namespace, results: Path | None, full: list[str]) -> int:
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
        futures = {n: pool.submit(run_train, [*run_args(study, study.runs[n]), *data, "--max-steps", str(steps[n])],
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


if __name__ == "__main__":
    raise SystemExit(main())
