"""Witnesses: short deterministic re-runs that certify a training result by behaviour.

A results file made of training runs lists, in its provenance, the ``configs`` it ran:
the ``gossip.train`` arguments of each distinct configuration (a torchrun run of N
ranks as ``--simulate N``). A *witness* of a configuration is a short run of it,
recorded once while the result is known to be fresh, and re-run by
``python -m experiments verify`` at any later commit. Where every witness of a file
is bit-identical, the code still computes what the figures were made with, and the
file is certified for that commit without re-running it.

One witness, of a configuration with arguments ``ARGS``:

1. ``gossip.train ARGS --max-steps S --log-every 1 --checkpoint-every K`` in a fresh
   run directory, in this process, one thread, eager compression kernels. ``S`` covers
   the first outer synchronisation of a periodic method (its largest period plus 2,
   at least 4 steps); ``K = S // 2``. The schedule spans the configuration's epochs,
   as in the real run, so the learning rates are the real run's first ``S``.
2. The run directory is copied, cut back to step ``K`` (its checkpoint), and resumed
   to ``S``: the resume path (checkpoint load, loader positions, algorithm state).
3. The trace: for every step, a hash of every node's record (loss, learning rate,
   bytes sent and received, setup bytes); node 0's loss in clear (for the message);
   a hash of the evaluation records and of the summary less its times; a hash of the
   saved optimizer state (parameters and the algorithm's state) at ``K`` and ``S``;
   and for the resumed leg, its per-step losses and its final state's hash. The
   resumed leg's byte counts are left out: a fix to how a resume counts bytes must
   not stale results whose runs never resumed.

What a witness cannot see (docs/provenance.md): a code path its ``S`` steps do not
reach (a step schedule's decays at 50 % and 75 % of the run, a second epoch's
shuffle, a divergence, ``--node-eval`` at the end of a long run, what ``finish`` does at
the schedule's end only, such as diloco's ``outer_delay=1`` applying its last exchange), the compiled
kernels (it runs the eager ones, bit-identical to the compiled by test), other
thread counts, the torchrun transport (a torchrun configuration is witnessed as its
simulation), and a learning rate or seed other than the ones listed.

Traces are machine-specific: floating-point sums differ between CPU kinds. Each is
stored under the machine kind that made it (CPU model, torch version); a machine
with no trace of its own says so and certifies nothing (see :func:`machine_kind`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import json
import math
import os
import shutil
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["WitnessError", "normalise", "plan", "run", "run_any", "compare", "compare_any", "machine_kind", "key", "STRIP"]

#: flags a witness sets itself (with the number of values each takes): the run
#: directory, progress, the steps and the checkpoints; stripped from a listed config
STRIP = {"--out": 1, "--overwrite": 0, "--no-progress": 0, "--resume": 1, "--max-steps": 1,
         "--checkpoint-every": 1, "--log-every": 1}
#: summary entries that are times, machine facts or paths, not behaviour
_SUMMARY_SKIP = {"time_split_s", "warmup_s", "wall_time_s", "mode", "hosts", "procs_per_host", "report", "merge",
                 "memory", "run_dir", "peak_memory_gib", "modelled_time_s"}
#: record fields that are times
_TIME_SUFFIXES = ("_s",)
_TIME_KEYS = {"time", "elapsed", "date"}


class WitnessError(RuntimeError):
    """A witness could not run: the configuration fails at this code (one line)."""


def normalise(argv: Sequence[str]) -> list[str]:
    """``argv`` less the flags a witness sets itself (:data:`STRIP`), ``--flag=value``
    forms included."""
    out: list[str] = []
    it = iter(list(argv))
    for a in it:
        name = a.split("=", 1)[0]
        if name in STRIP:
            if "=" not in a:
                for _ in range(STRIP[name]):
                    next(it, None)
            continue
        out.append(str(a))
    return out


def key(argv: Sequence[str]) -> str:
    """A short stable name of a configuration: the hash of its normalised arguments."""
    return hashlib.sha256(json.dumps(normalise(argv)).encode()).hexdigest()[:16]


def machine_kind() -> str:
    """The kind of machine a trace is bit-identical on: CPU model, the vector
    instructions torch dispatches to, and torch's version."""
    import platform

    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:  # the vector instructions torch's kernels dispatch to: AVX2 and AVX-512 sum in other orders
        isa = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        isa = "unknown ISA"
    return f"{cpu or platform.machine()} | {isa} | torch {torch.__version__}"


def _h(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, allow_nan=True).encode()).hexdigest()[:16]


def _periods(cfg: Any) -> list[int]:
    """Every period of the algorithm as built for this configuration (its Config's
    ``local_steps``, a streaming delay, a warm-up length): steps the witness must pass."""
    import dataclasses

    from gossip.train import assembly
    from gossip import comm as gcomm

    n = cfg.to_dict().get("simulate") or 1
    try:
        topo = assembly.build_topology(cfg, n)
        algo = assembly.build_algorithm(cfg, gcomm.SimulatedCommunicator(topo, world_size=n, device="cpu"))
    except Exception as e:  # the run itself says why, in its own words
        raise WitnessError(f"the configuration cannot be built: {e}") from None
    out = []
    for conf in (v for v in vars(algo).values() if dataclasses.is_dataclass(v) and not isinstance(v, type)):
        for name, v in dataclasses.asdict(conf).items():
            if isinstance(v, int) and not isinstance(v, bool) and (
                    name in ("local_steps", "fragment_sync_delay") or name.endswith(("_iter", "_period"))
                    or name.startswith("warmup")):
                out.append(v)
    return out


def plan(argv: Sequence[str], *, cap: int = 120) -> tuple[int, int]:
    """``(S, K)``: the witness's steps and its resume point, for the configuration ``argv``."""
    from gossip.train.config import parse_args

    cfg = parse_args([*normalise(argv), "--no-progress"])
    s = min(max([4, *(p + 2 for p in _periods(cfg))]), cap)
    return s, max(1, s // 2)


def _clean(rec: dict) -> dict:
    return {k: v for k, v in rec.items()
            if k not in _TIME_KEYS and not any(k.endswith(s) for s in _TIME_SUFFIXES)}


def _records(run_dir: Path) -> tuple[dict[int, list], list]:
    """Per step: every node's cleaned train record (rank order); and the eval records."""
    steps: dict[int, list] = {}
    evals: list = []
    files = sorted(run_dir.glob("metrics-rank*.jsonl"), key=lambda p: int(p.stem.split("rank")[-1]))
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("kind")
            if kind == "train":
                steps.setdefault(int(rec["step"]), []).append(_clean(rec))
            elif kind == "eval":
                evals.append(_clean(rec))
    return steps, evals


def _state_hash(path: Path) -> str:
    """The hash of the saved optimizer state (parameters and the algorithm's state)."""
    import torch

    from gossip.checkpoint import load_checkpoint

    payload = load_checkpoint(path)
    h = hashlib.sha256()

    def walk(x: Any, where: str) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{where}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{where}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")
        else:
            h.update(f"{where}={x!r}".encode())

    walk(payload.get("optimizer"), "optimizer")
    walk(payload.get("loaders"), "loaders")
    return h.hexdigest()[:16]


def _alias_experiment(name: str) -> None:
    """Make the bare module name ``name`` import ``experiments.name`` when that is one
    of the experiments' modules and nothing else answers to the name."""
    if "." in name or name in sys.modules or not (Path(__file__).parent / f"{name}.py").is_file():
        return
    if importlib.util.find_spec(name) is None:
        sys.modules[name] = importlib.import_module(f"experiments.{name}")


def _train(args: list[str]) -> None:
    from gossip import train

    # the experiments' own data and model factories (``--data bench_data:NAME``,
    # ``--data sgp_overlap:make``) are named by their module's bare name, as the runs
    # found them (their scripts put experiments/ on the children's path): that name
    # resolves to the package's module
    for flag, value in zip(args, args[1:]):
        if flag in ("--data", "--model") and ":" in value:
            _alias_experiment(value.split(":", 1)[0])

    buf = io.StringIO()
    with redirect_stdout(buf), redirect_stderr(buf):
        rc = train.main(args)
    if rc != 0:
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        raise WitnessError(f"gossip.train {' '.join(args)} exited {rc}: {lines[-1] if lines else ''}")


def _ckpt(run_dir: Path, step: int) -> Path:
    from gossip.checkpoint import checkpoint_path

    return checkpoint_path(run_dir, step, 0)


def run(argv: Sequence[str], *, workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Run the witness of the configuration ``argv``; its trace (see the module's
    docstring). Raises :class:`WitnessError` if the configuration fails."""
    import torch

    torch.set_num_threads(1)
    base = normalise(argv)
    s, k = plan(base)
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="witness-")) if own else Path(workdir)
    try:
        a, b = root / "a", root / "b"
        _train([*base, "--max-steps", str(s), "--log-every", "1", "--checkpoint-every", str(k),
                "--out", str(a), "--no-progress"])
        steps, evals = _records(a)
        summary = json.loads((a / "summary.json").read_text())
        summary = {kk: v for kk, v in summary.items() if kk not in _SUMMARY_SKIP}
        trace: dict[str, Any] = {
            "steps": s, "resume_at": k,
            "rows": [_h(steps.get(i, [])) for i in range(1, s + 1)],
            "loss0": [(steps.get(i) or [{}])[0].get("loss") for i in range(1, s + 1)],
            "lr0": [(steps.get(i) or [{}])[0].get("lr") for i in range(1, s + 1)],
            "bytes0": [(steps.get(i) or [{}])[0].get("bytes_sent") for i in range(1, s + 1)],
            "evals": _h(evals), "summary": _h(summary),
            "state": {str(k): _state_hash(_ckpt(a, k)), str(s): _state_hash(_ckpt(a, s))},
        }
        # Step 2: the resume, from a copy cut back to step K
        shutil.copytree(a, b)
        (b / "summary.json").unlink()
        for p in b.glob("ckpt-step*"):
            if not p.name.startswith(f"ckpt-step{k}-"):
                p.unlink()
        _train([*base, "--max-steps", str(s), "--log-every", "1", "--checkpoint-every", str(k),
                "--resume", str(b), "--no-progress"])
        rsteps, _ = _records(b)
        trace["resumed"] = {
            "loss": _h([[r.get("loss") for r in rsteps.get(i, [])] for i in range(k + 1, s + 1)]),
            "state": _state_hash(_ckpt(b, s)),
        }
        return trace
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


def _fmt(v: Any) -> str:
    return "none" if v is None else (repr(v) if not isinstance(v, float) or math.isfinite(v) else str(v))


def compare(recorded: dict[str, Any], now: dict[str, Any]) -> str | None:
    """None when the two traces are bit-identical; else where they first differ, in
    words (``step 7: node 0 loss 2.301 != 2.298``)."""
    if recorded.get("steps") != now.get("steps") or recorded.get("resume_at") != now.get("resume_at"):
        return (f"the witness's plan changed ({recorded.get('steps')} steps, resume at {recorded.get('resume_at')} "
                f"-> {now.get('steps')}, {now.get('resume_at')})")
    for i, (r, n) in enumerate(zip(recorded["rows"], now["rows"]), start=1):
        if r != n:
            what = "another node's record"
            for name, label in (("loss0", "node 0 loss"), ("lr0", "learning rate"), ("bytes0", "node 0 bytes sent")):
                a, b = (recorded.get(name) or [None] * i)[i - 1], (now.get(name) or [None] * i)[i - 1]
                if a != b:
                    what = f"{label} {_fmt(a)} != {_fmt(b)}"
                    break
            return f"step {i}: {what}"
    k, s = str(recorded["resume_at"]), str(recorded["steps"])
    if recorded["state"].get(k) != now["state"].get(k):
        return f"step {k}: the saved state (parameters or algorithm state) differs"
    if recorded["state"].get(s) != now["state"].get(s):
        return f"step {s}: the saved state (parameters or algorithm state) differs"
    if recorded["evals"] != now["evals"]:
        return f"step {s}: the evaluation differs"
    if recorded["summary"] != now["summary"]:
        return f"step {s}: the summary differs"
    if recorded["resumed"] != now["resumed"]:
        return f"after the resume at step {k}: the resumed run differs from the recorded one"
    return None


def run_any(config: Sequence[str], *, workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The trace of a listed configuration: a ``gossip.train`` configuration (:func:`run`),
    or ``["@module:function", "<JSON keyword arguments>"]``, an experiment's own witness
    of a result made with the library directly (a JSON-able dict with a ``rows`` list)."""
    config = list(config)
    if config and str(config[0]).startswith("@"):
        import importlib

        import torch

        torch.set_num_threads(1)
        mod, _, fn = config[0][1:].partition(":")
        kwargs = json.loads(config[1]) if len(config) > 1 else {}
        try:
            out = getattr(importlib.import_module(mod), fn)(**kwargs)
        except Exception as e:  # the experiment's own code failed at this commit
            raise WitnessError(f"{config[0]}: {type(e).__name__}: {e}") from None
        rows = list(out.get("rows", []))
        return {"kind": "call", "rows": [_h(r) for r in rows], "rest": _h({k: v for k, v in out.items() if k != "rows"})}
    return run(config, workdir=workdir)


def compare_any(recorded: dict[str, Any], now: dict[str, Any]) -> str | None:
    """:func:`compare` for either kind of trace."""
    if recorded.get("kind") == "call" or now.get("kind") == "call":
        if recorded.get("kind") != now.get("kind"):
            return "the witness's kind changed"
        for i, (r, n) in enumerate(zip(recorded["rows"], now["rows"]), start=1):
            if r != n:
                return f"row {i} differs"
        if len(recorded["rows"]) != len(now["rows"]):
            return f"{len(recorded['rows'])} rows recorded, {len(now['rows'])} now"
        return None if recorded.get("rest") == now.get("rest") else "the trace's other figures differ"
    return compare(recorded, now)
