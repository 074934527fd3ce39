"""Provenance for every results file the experiments write.

A figure is only as good as the record of how it was made. Every experiment that
writes results calls this module, so that each results file carries, next to its
figures:

- ``command``: the command line that made it (the script path relative to the
  repository, its arguments, and the environment variables that change results:
  ``OMP_NUM_THREADS``, ``GOSSIP_*``, ``TORCHINDUCTOR_CACHE_DIR``; a path-valued one
  is written ``PATH``);
- ``commit`` and ``dirty``: the git commit checked out and whether tracked files
  differed from it (a dirty tree's figures are not reproducible from the commit);
- ``date``: UTC, ISO 8601, when the run started, and ``seconds``, how long it took;
- ``machine``: CPU model, logical cores, and memcpy GB/s measured in this run (one
  thread, 64 MiB, minimum of 5 copies), so a speed figure can be set against the
  machine's memory speed;
- ``load_before`` and ``load_after``: the 1, 5 and 15 minute load averages; speed
  figures taken with the 1-minute load above :data:`QUIET_LOAD` are not the
  machine's own;
- ``torch`` and ``python``: versions;
- ``sources``: the repository paths (files or folders) whose code the figures
  measure. ``python -m experiments.render --stale`` lists the results whose sources
  changed in a commit after the one that made them.

Usage, in a script::

    prov = _provenance.start(sources=["gossip/compress", "experiments/bench_compress.py"])
    ...  # run, collect `results` (any JSON value)
    _provenance.write(path, results, prov)  # {"provenance": {...}, "results": results}

or, where the file has a layout of its own that other code reads (a dict), add the
record under the key ``"provenance"`` with :func:`Provenance.finish`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "QUIET_LOAD",
    "REPO",
    "Provenance",
    "start",
    "write",
    "read",
    "git_commit",
    "source_ids",
    "stale",
    "commits_since",
    "memcpy_gbps",
    "narrow",
    "inside",
    "NOT_TRAINED",
    "package_except",
    "training_sources",
    "record_config",
    "recorded_configs",
    "imported_sources",
    "as_module",
]

REPO = Path(__file__).resolve().parents[1]
"""The repository root (sources are recorded relative to it)."""

#: 1-minute load average below which a machine counts as quiet for speed figures
QUIET_LOAD = 0.3
#: provenance schema version, written into every record
SCHEMA = 1
#: environment variables that change what an experiment computes or how fast
_ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCHINDUCTOR_CACHE_DIR")
_ENV_PREFIX = "GOSSIP_"


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> tuple[str | None, bool | None]:
    """The checked-out commit and whether tracked files differ from it (``None`` for
    both outside a git checkout)."""
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def source_ids(sources: Sequence[str], rev: str = "HEAD") -> dict[str, str | None]:
    """The git object id (blob or tree) of each source path at ``rev``; ``None`` for a
    path git does not track there."""
    sources = list(sources)
    both = git("rev-parse", *(f"{rev}:{s}" for s in sources)) if sources else ""
    ids = (both or "").splitlines()
    if both is not None and len(ids) == len(sources):  # one call for all (a missing path fails it)
        return dict(zip(sources, ids))
    return {s: git("rev-parse", f"{rev}:{s}") for s in sources}


def stale(prov: dict[str, Any]) -> list[str]:
    """Why the figures of a results file with provenance ``prov`` are stale ([] if
    they are not): its sources differ at HEAD from when it was made, or it was made
    from uncommitted changes to them, or it records no state of its sources."""
    ids = prov.get("source_ids") or {}
    sources = prov.get("sources") or []
    if not sources or not ids:
        return ["it records no state of its sources"]
    why = []
    if prov.get("dirty_sources"):
        why.append(f"made with uncommitted changes to {', '.join(prov['dirty_sources'])}")
    now = source_ids(sources)
    changed = [s for s in sources if now.get(s) != ids.get(s)]
    if changed:
        why.append(f"changed since: {', '.join(changed)}")
    return why


#: the entries of the gossip package that a training run (``gossip.train``, simulated or
#: under torchrun, without fault tolerance or MergeComp) never imports: an experiment
#: made of such runs lists the rest (:func:`training_sources`), so that a change to the
#: DDP hooks, the tools (gossip/tools, and the deprecated modules left at their old
#: paths: analysis, crossover, leaderboard, units, textdata, and the application's
#: config, loop, assembly, agreement, metrics, evaluation, fault_tolerance) or the
#: fault-tolerant loop (gossip/train/fault_tolerance.py, gossip/train/_ftcomm.py) does
#: not mark its figures stale. An entry ``folder/name`` leaves out one entry of a folder.
#: tests/test_render.py runs a training step and checks that none of these is imported.
NOT_TRAINED = ("agreement.py", "analysis.py", "assembly.py", "config.py", "crossover.py", "ddp.py", "evaluation.py",
               "fault_tolerance.py", "leaderboard.py", "loop.py", "metrics.py", "schedule", "textdata.py", "tools",
               "train/_ftcomm.py", "train/fault_tolerance.py", "units.py")


def package_except(package: str, excluded: Sequence[str] = (), rev: str = "HEAD") -> list[str]:
    """The entries (files and folders) git tracks directly under the repository folder
    ``package`` at ``rev``, less the names in ``excluded``: the sources of an experiment
    that runs most of a package. A module added later is listed from the next run on.
    Outside a git checkout, the folder's entries on disk (caches left out)."""
    out = git("ls-tree", "--name-only", rev, f"{package.rstrip('/')}/")
    if out is None:
        names = sorted(f"{package}/{p.name}" for p in (REPO / package).iterdir()
                       if p.name != "__pycache__" and not p.name.endswith(".pyc"))
    else:
        names = [line for line in out.splitlines() if line]
    return [n for n in names if n.rsplit("/", 1)[-1] not in set(excluded)]


def training_sources(*also: str, rev: str = "HEAD") -> list[str]:
    """The sources of an experiment whose figures come from training runs: the gossip
    package less :data:`NOT_TRAINED`, the topologies package (the graphs), then
    ``also`` (the experiment's scripts and helpers, and any excluded module it imports
    itself, e.g. ``gossip/tools/crossover.py`` for a modelled time). A folder with an
    entry left out (``train/fault_tolerance.py``) is listed by its other entries."""
    inner: dict[str, list[str]] = {}
    for name in NOT_TRAINED:
        if "/" in name:
            folder, entry = name.split("/", 1)
            inner.setdefault(folder, []).append(entry)
    out: list[str] = []
    for path in package_except("gossip", [n for n in NOT_TRAINED if "/" not in n], rev):
        folder = path.rsplit("/", 1)[-1]
        out += package_except(path, inner[folder], rev) if folder in inner else [path]
    return [*out, "topologies", *also]


def inside(path: str, source: str) -> bool:
    """Whether repository path ``path`` is ``source`` or lies under the folder ``source``."""
    return path == source or path.startswith(source.rstrip("/") + "/")


def narrow(prov: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """The record ``prov`` with its sources narrowed to ``paths``, without re-running.

    A record keeps the git object id of each source at the commit that made it, so
    the ids of sub-paths can be looked up at that same commit: each path must lie in
    one of the recorded sources (narrowing never widens what was measured) and exist
    at the recorded commit, and the recorded ids must be that commit's (a record that
    says otherwise is refused). Recorded sources that no path lies in are dropped: say
    so only where the figures do not measure them. Uncommitted changes recorded
    under ``dirty_sources`` are kept where they lie in the new paths. The sources and
    ids before narrowing are kept under ``narrowed`` (one entry per narrowing).
    Raises ValueError with one line naming what was wrong.
    """
    commit = prov.get("commit")
    if not commit:
        raise ValueError("the record names no commit, so its sources cannot be looked up: re-run its command")
    if git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        raise ValueError(f"the recorded commit {commit[:10]} is not in this repository's history "
                         "(fetch it, or unshallow the clone)")
    sources, ids = list(prov.get("sources") or []), dict(prov.get("source_ids") or {})
    if not sources or not ids:
        raise ValueError("the record lists no sources with their ids: nothing to narrow, re-run its command")
    at = source_ids(sources, commit)
    wrong = [s for s in sources if at.get(s) != ids.get(s)]
    if wrong:
        raise ValueError(f"the recorded ids of {', '.join(wrong)} are not those at the recorded commit "
                         f"{commit[:10]}: the record is inconsistent, re-run its command")
    new: list[str] = []
    for p in paths:
        p = str(p).strip().rstrip("/")
        if not p or p.startswith("/") or ".." in p.split("/"):
            raise ValueError(f"paths must be relative to the repository, without '..', got {p!r}")
        if not any(inside(p, s) for s in sources):
            raise ValueError(f"{p} is not inside the recorded sources ({', '.join(sources)}): "
                             "narrowing can only name paths within them")
        if p not in new:
            new.append(p)
    if not new:
        raise ValueError("name at least one path to narrow the sources to")
    if sorted(new) == sorted(sources):
        raise ValueError(f"nothing to narrow: the paths are the recorded sources ({', '.join(sources)})")
    new_ids = source_ids(new, commit)
    missing = [p for p in new if new_ids[p] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} did not exist at the recorded commit {commit[:10]}")
    out = dict(prov)
    out["narrowed"] = [*(prov.get("narrowed") or []), {
        "date": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "sources": sources, "source_ids": ids}]
    out["sources"], out["source_ids"] = new, new_ids
    out["dirty_sources"] = [d for d in prov.get("dirty_sources") or [] if any(inside(d, p) for p in new)]
    return out


def commits_since(date: str, sources: Sequence[str]) -> list[str]:
    """Commits on HEAD's history dated after ``date`` that touched ``sources``, newest
    first, each as 'abbrev date subject'."""
    out = git("log", "--format=%h %ad %s", "--date=short", f"--since={date}", "--", *sources)
    return [line[:120] for line in (out or "").splitlines() if line]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memcpy_gbps(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Memory copy speed of this machine now, one thread: input bytes / time of
    ``dst.copy_(src)`` for a ``nbytes`` float32 tensor, minimum of ``reps`` copies."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in before timing
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best / 1e9


def _command(argv: Sequence[str] | None) -> str:
    """The command line as a reader would type it: ``python -m mod args`` for a module
    run, else ``python path args`` with the path relative to the repository."""
    given = argv is not None
    argv = list(sys.argv if argv is None else argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head: list[str] = ["python"]
    if given and argv and argv[0] == "python":
        head = []  # given in full by the caller
    elif not given and spec is not None and getattr(spec, "name", None):
        head, argv = ["python", "-m", spec.name.removesuffix(".__main__")], argv[1:]
    elif argv:
        p = Path(argv[0])
        try:
            argv[0] = str(p.resolve().relative_to(REPO))
        except (ValueError, OSError):
            argv[0] = p.name
        script = re.fullmatch(r"experiments/(\w+)\.py", argv[0])
        if script:  # an experiment runs as a module of the package
            head, argv = ["python", "-m", f"experiments.{script.group(1)}"], argv[1:]
    # a path in the environment is this machine's own (a cache folder): named, not spelled out
    env = [f"{k}={'PATH' if os.path.isabs(os.environ[k]) else os.environ[k]}" for k in sorted(os.environ)
           if k in _ENV_KEYS or k.startswith(_ENV_PREFIX)]
    return shlex.join([*env, *head, *map(portable, argv)])


def as_module(cmd: str) -> str:
    """A recorded command as this checkout runs it: the old form of an experiment,
    ``python experiments/NAME.py ...`` (a script started by its path), becomes
    ``python -m experiments.NAME ...``; any other command is returned as it is."""
    return re.sub(r"(?<![\w/.-])(python3?) experiments/(\w+)\.py(?![\w.])", r"\1 -m experiments.\2", cmd)


def portable(arg: str) -> str:
    """An absolute path in an argument as a reader can use it: relative to the repository
    when inside it, else ``OUT/<last part>`` (a folder of this machine's own, such as a
    scratch output directory)."""
    key, eq, val = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not os.path.isabs(val):
        return arg
    p = Path(val)
    try:
        rel = str(p.resolve().relative_to(REPO))
    except (ValueError, OSError):
        rel = f"OUT/{p.name}"
    return f"{key}{eq}{rel}"


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


@dataclass
class Provenance:
    """How a results file was made; see the module docstring for each field."""

    command: str
    commit: str | None
    dirty: bool | None
    date: str
    machine: dict[str, Any]
    load_before: list[float]
    torch: str
    python: str
    sources: list[str]
    #: each source's git object id at the commit (what the freshness check compares)
    source_ids: dict[str, str | None] = field(default_factory=dict)
    #: sources with uncommitted changes when the run started (not reproducible from the commit)
    dirty_sources: list[str] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    seconds: float | None = None
    schema: int = SCHEMA
    #: the training configurations the results were made of (gossip.train arguments, a
    #: torchrun run of N ranks as ``--simulate N``): what ``python -m experiments verify``
    #: witnesses (experiments/witness.py); empty for a result made of no training run
    configs: list[list[str]] = field(default_factory=list)
    #: the repository modules the process had imported when it finished, with their git
    #: blob ids: what a timing result measured (a change elsewhere leaves it certified)
    imported: dict[str, str | None] = field(default_factory=dict)
    _t0: float = field(default=0.0, repr=False)

    def finish(self) -> dict[str, Any]:
        """Record the load and duration at the end of the run, the training
        configurations it recorded (:func:`record_config`) and the repository modules it
        imported; the record as a dict."""
        if not self.load_after:
            self.load_after = _load()
            self.seconds = round(time.perf_counter() - self._t0, 1)
            self.configs = [*self.configs, *(c for c in recorded_configs() if c not in self.configs)]
            self.imported = imported_sources(self.commit or "HEAD")
        d = asdict(self)
        d.pop("_t0")
        if not d["configs"]:
            d.pop("configs")
        return d

    @property
    def quiet(self) -> bool:
        """Whether the 1-minute load stayed below :data:`QUIET_LOAD` before and after."""
        loads = [x[0] for x in (self.load_before, self.load_after) if x]
        return bool(loads) and max(loads) < QUIET_LOAD


_CONFIGS: list[list[str]] = []


def record_config(argv: Sequence[str], *, ranks: int | None = None) -> None:
    """Record that this experiment trained the configuration ``argv`` (``gossip.train``
    arguments). A torchrun run of ``ranks`` processes is recorded as its simulation,
    ``--simulate ranks``. The run directory, progress and checkpoint flags are dropped
    (experiments/witness.py sets its own); duplicates are recorded once."""
    from experiments import witness

    args = witness.normalise([str(a) for a in argv])
    if ranks is not None and "--simulate" not in args:
        args = [*args, "--simulate", str(int(ranks))]
    if args not in _CONFIGS:
        _CONFIGS.append(args)


def recorded_configs() -> list[list[str]]:
    """The configurations recorded since :func:`start`, in order."""
    return [list(c) for c in _CONFIGS]


def imported_sources(rev: str = "HEAD") -> dict[str, str | None]:
    """The repository's Python modules this process has imported (``sys.modules``,
    files under the repository only), each with its git blob id at ``rev``."""
    paths = set()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if not f:
            continue
        try:
            rel = Path(f).resolve().relative_to(REPO)
        except (ValueError, OSError):
            continue
        if rel.suffix == ".py" and not rel.parts[0].startswith("."):
            paths.add(str(rel))
    return source_ids(sorted(paths), rev) if paths else {}


def start(sources: Sequence[str], *, argv: Sequence[str] | None = None, measure_memcpy: bool = True) -> Provenance:
    """Begin a provenance record; call at the start of the run, before the work.

    ``sources`` are repository paths (files or folders) whose code the results
    measure; each must exist (a typo would make the freshness check blind).
    """
    sources = [str(s) for s in sources]
    if not sources:
        raise ValueError("sources must name at least one repository path the results measure")
    missing = [s for s in sources if not (REPO / s).exists()]
    if missing:
        raise ValueError(f"sources must be paths in the repository, these do not exist: {', '.join(missing)}")
    load_before = _load()  # before our own memcpy adds to it
    import torch

    _CONFIGS.clear()
    commit, dirty = git_commit()
    ids = source_ids(sources)
    changed = git("diff", "--name-only", "HEAD", "--", *sources)
    machine: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memcpy_gbps": round(memcpy_gbps(), 2) if measure_memcpy else None,
    }
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    return Provenance(
        command=_command(argv),
        commit=commit,
        dirty=dirty,
        date=datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        machine=machine,
        load_before=load_before,
        torch=torch.__version__,
        python=platform.python_version(),
        sources=sources,
        source_ids=ids,
        dirty_sources=sorted(line for line in (changed or "").splitlines() if line),
        _t0=time.perf_counter(),
    )


def write(path: str | os.PathLike, results: Any, prov: Provenance) -> Path:
    """Write ``{"provenance": ..., "results": results}`` to ``path`` as JSON, through a
    temporary file renamed into place (an interrupted write leaves the old file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"provenance": prov.finish(), "results": results}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(results, provenance)`` of a results file written by :func:`write` (or a dict
    with a ``"provenance"`` key: then results is the dict without it). Raises
    ValueError naming the file if it carries no provenance."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("provenance"), dict):
        raise ValueError(f"{path}: no provenance record (re-run the command that makes it)")
    prov = data["provenance"]
    if set(data) == {"provenance", "results"}:
        return data["results"], prov
    return {k: v for k, v in data.items() if k != "provenance"}, prov
