"""``python -m experiments``: one entry point for the results and what makes them.

    python -m experiments list              # every study and benchmark, with the results it writes
    python -m experiments run NAME [OPTIONS]   # run one by its module name (run NAME --help: its options)
    python -m experiments stale [--json]    # results not certified at HEAD, and why
    python -m experiments verify [FILE...]  # re-run the training results' witnesses at HEAD
    python -m experiments render [--check]  # re-render the README's and docs' tables
    python -m experiments results [--budget MINUTES] [--load-wait MINUTES]   # re-run what verify left stale (make results)

docs/provenance.md says what each state means and what a witness cannot see.
"""

from __future__ import annotations

import argparse
import json
import sys


def _stale(args: argparse.Namespace) -> int:
    from experiments import freshness, render

    statuses = freshness.all_statuses()
    bad = [s for s in statuses if s.state != "certified"]
    pending = render.pending_tables()
    if args.json:
        print(json.dumps([s.to_dict() for s in (statuses if args.all else bad)], indent=1))
        return 0
    for s in (statuses if args.all else bad):
        print(s.line)
    for name, files in pending.items():
        t = render.TABLES[name]
        print(f"{t.results}: not yet measured (the table {name} in {', '.join(files)} is hand-written); run: {t.command}")
    by = {}
    for s in statuses:
        by[s.state] = by.get(s.state, 0) + 1
    print(", ".join(f"{n} {k}" for k, n in sorted(by.items())) + f" of {len(statuses)} results files")
    return 0


def runnable() -> list[str]:
    """The studies and benchmarks ``run`` starts: the modules of this package that
    declare their options (``options(p)``) beside their ``main``, and the study specs
    of experiments/studies/ (run by experiments/study.py)."""
    from pathlib import Path

    from experiments import study

    here = Path(__file__).resolve().parent
    return sorted({f.stem for f in here.glob("*.py")
                   if not f.name.startswith("_") and "\ndef options(" in f.read_text() and "\ndef main(" in f.read_text()}
                  | set(study.studies()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every study and benchmark, with the results files it writes")
    p = sub.add_parser("run", help="run a study or benchmark by its module name (run NAME --help: its options)")
    p.add_argument("name", help="the module name, as `list` prints it without .py (e.g. bench_compress)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its options")
    p = sub.add_parser("stale", help="results not certified at HEAD, and why")
    p.add_argument("--json", action="store_true", help="as JSON: one object per results file")
    p.add_argument("--all", action="store_true", help="every results file, certified ones too")
    p = sub.add_parser("verify", help="re-run the witnesses of the training results at HEAD")
    p.add_argument("files", nargs="*", help="results files (path, file name or stem; default: all)")
    p.add_argument("--jobs", type=int, default=None, help="processes (default: 2, or 1 on one core)")
    p.add_argument("--dry-run", action="store_true", help="compare only; write nothing")
    p = sub.add_parser("render", help="re-render the tables between their markers")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its render")
    p = sub.add_parser("results", help="re-run the results verify left stale, CPU first, within a budget")
    p.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                   help="stop starting new runs once this many minutes have passed (default: no limit)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time; run nothing")
    p.add_argument("--load-wait", type=float, default=None, metavar="MINUTES",
                   help="before each timing result, wait at most this long for the 1-minute load to fall "
                        "below 0.3; past it, run anyway, marked as taken under load (default: 10; 0: no wait)")
    args = ap.parse_args(argv)
    if args.cmd == "stale":
        return _stale(args)
    if args.cmd == "verify":
        if args.jobs is not None and args.jobs < 1:
            ap.error(f"--jobs must be a positive integer, got {args.jobs}")
        from experiments import certify

        return certify.verify(args.files or None, jobs=args.jobs, dry_run=args.dry_run)
    if args.cmd == "render":
        from experiments import render

        return render.main(["--check"] if args.check else [])
    if args.cmd == "results":
        if args.budget is not None and args.budget <= 0:
            ap.error(f"--budget must be a positive number of minutes, got {args.budget}")
        if args.load_wait is not None and not args.load_wait >= 0:
            ap.error(f"--load-wait must be a number of minutes, 0 or more, got {args.load_wait}")
        from experiments import rerun

        wait = rerun.LOAD_WAIT_MIN if args.load_wait is None else args.load_wait
        return rerun.main(budget_min=args.budget, dry_run=args.dry_run, load_wait_min=wait)
    if args.cmd == "run":
        names = runnable()
        if args.name not in names:
            ap.error(f"run: unknown study or benchmark {args.name!r}; known: {', '.join(names)}")
        import importlib
        from pathlib import Path

        if (Path(__file__).resolve().parent / f"{args.name}.py").exists():
            rc = importlib.import_module(f"experiments.{args.name}").main(args.args)
        else:  # a study spec, experiments/studies/NAME.toml
            from experiments import study

            rc = study.main(args.args, name=args.name)
        return int(rc or 0)
    if args.cmd == "list":
        from experiments import rerun

        return rerun.list_all()
    return 2


if __name__ == "__main__":
    sys.exit(main())
