"""``python -m experiments verify``: re-run the witnesses of every training result at HEAD.

For each results file whose provenance lists ``configs`` (experiments/witness.py):

- the witnesses recorded for this machine kind are re-run (each distinct
  configuration once, in parallel processes, one thread each, eager kernels);
- every witness bit-identical: the file is **certified** for HEAD, and its provenance
  records ``verified: {commit, date, machine, witnesses}``;
- a witness differs: the file is **stale**; its provenance records ``witness_failed``
  with the configuration and the first step that differs, and the command names them;
- no witness recorded for this machine kind, or recorded for an earlier run of the
  file: they are recorded now if the file is certified by its sources (none changed
  since it was made or last verified), else the file cannot be checked here and
  says so.

Nothing is written from a tree with uncommitted changes to the code (the certificate
names a commit); ``--dry-run`` compares without writing. Netns and GPU results are
verified the same way (their witnesses run on the CPU); where one differs, the line
says which machine its re-run needs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from experiments import _provenance as P
from experiments import freshness

__all__ = ["STORE", "store_path", "load_store", "verify"]

REPO = P.REPO
#: where the recorded traces live, one file per results file
STORE = "experiments/witnesses"
#: the code whose uncommitted changes make a certificate meaningless
_CODE = ("gossip", "topologies", "experiments")


def store_path(rel: str) -> Path:
    """The witness store of the results file ``rel``."""
    return REPO / STORE / (rel.removesuffix(".json").replace("/", "--").removeprefix("experiments--results--") + ".json")


def load_store(rel: str) -> dict[str, Any]:
    p = store_path(rel)
    if not p.exists():
        return {"results": rel, "machines": {}}
    return json.loads(p.read_text())


def _write_json(path: Path, data: Any, like: str | None = None) -> None:
    from experiments.render import dumps_like

    text = dumps_like(data, like) if like is not None else json.dumps(data, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _init_worker() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GOSSIP_COMPRESS_BACKEND"] = "eager"  # what every trace was recorded with


def _work(config: list[str]) -> tuple[str, dict | None, str | None, float]:
    from experiments import witness

    t = time.perf_counter()
    try:
        return witness.key(config), witness.run_any(config), None, time.perf_counter() - t
    except witness.WitnessError as e:
        return witness.key(config), None, str(e), time.perf_counter() - t


def _dirty_code() -> list[str]:
    out = P.git("status", "--porcelain", "--untracked-files=no", "--", *_CODE) or ""
    return [ln[3:] for ln in out.splitlines() if ln.strip() and STORE not in ln and "/results/" not in ln]


def verify(paths: list[str] | None = None, *, jobs: int | None = None, dry_run: bool = False,
           say: Callable[[str], None] = print) -> int:
    """Verify the training results (all, or those named); 0 when every one checked is
    certified, 1 when one is stale or cannot be checked here."""
    from experiments import witness

    t0 = time.perf_counter()
    commit, _ = P.git_commit()
    dirty = _dirty_code()
    write = not dry_run and not dirty and commit is not None
    if dirty and not dry_run:
        say(f"verify: uncommitted changes to {', '.join(dirty[:4])}{' ...' if len(dirty) > 4 else ''}: "
            "comparing only, nothing recorded (commit first)")
    kind = witness.machine_kind()
    files = []
    for p in freshness.result_paths():
        rel = freshness.rel(p)
        if paths and rel not in paths and p.name not in paths and Path(rel).stem not in paths:
            continue
        try:
            _, prov = P.read(p)
        except ValueError:
            continue
        if prov.get("configs"):
            files.append((rel, p, prov))
    if paths and not files:
        say(f"verify: no training results among {', '.join(paths)} (a training result lists its configs)")
        return 2
    plan: dict[str, dict[str, Any]] = {}  # rel -> {"mode": check|record|skip, ...}
    todo: dict[str, list[str]] = {}
    for rel, p, prov in files:
        store = load_store(rel)
        mine = store["machines"].get(kind)
        keys = [witness.key(c) for c in prov["configs"]]
        current = mine is not None and mine.get("for") == prov.get("date") and all(k in mine["traces"] for k in keys)
        if current:
            plan[rel] = {"mode": "check"}
        else:
            st = freshness.status(rel, {k: v for k, v in prov.items() if k != "witness_failed"})
            if st.state == "certified":
                plan[rel] = {"mode": "record"}
            else:
                others = ", ".join(sorted(store["machines"])) or "none"
                plan[rel] = {"mode": "skip", "why": f"no witness recorded on this machine kind ({kind}; recorded on: "
                                                    f"{others}) and its sources changed since it was certified"}
                continue
        for c, k in zip(prov["configs"], keys):
            todo.setdefault(k, c)
    n = len(todo)
    say(f"verify: {len(files)} training results, {n} distinct witnesses on {kind}"
        + (f", {jobs or min(2, os.cpu_count() or 1)} processes" if n else ""))
    traces: dict[str, dict] = {}
    errors: dict[str, str] = {}
    if n:
        import multiprocessing as mp

        workers = max(1, jobs or min(2, os.cpu_count() or 1))
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker) as ex:
            futs = [ex.submit(_work, c) for c in todo.values()]
            for i, f in enumerate(as_completed(futs), 1):
                k, tr, err, secs = f.result()
                if tr is not None:
                    traces[k] = tr
                else:
                    errors[k] = err or "failed"
                if i % 10 == 0 or i == n:
                    say(f"verify: {i}/{n} witnesses run ({time.perf_counter() - t0:.0f} s)")
    date = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    bad = 0
    for rel, p, prov in files:
        mode = plan[rel]["mode"]
        st_need = freshness.needs(prov)
        if mode == "skip":
            say(f"{rel}: cannot be checked here: {plan[rel]['why']}")
            bad += 1
            continue
        keys = [witness.key(c) for c in prov["configs"]]
        store = load_store(rel)
        failed = None
        err = next(((c, errors[k]) for c, k in zip(prov["configs"], keys) if k in errors), None)
        if err is not None:
            failed = {"config": err[0], "where": f"the witness fails to run: {err[1]}"}
        elif mode == "check":
            mine = store["machines"][kind]["traces"]
            for c, k in zip(prov["configs"], keys):
                where = witness.compare_any(mine[k], traces[k])
                if where is not None:
                    failed = {"config": c, "where": where}
                    break
        text = p.read_text()
        data = json.loads(text)
        new = dict(data["provenance"])
        if failed is None:
            new.pop("witness_failed", None)
            new["verified"] = {"commit": commit, "date": date, "machine": kind, "witnesses": len(keys)}
            if mode == "record":
                store["machines"][kind] = {"for": prov.get("date"), "recorded": {"commit": commit, "date": date},
                                           "traces": {k: traces[k] for k in keys}}
                say(f"{rel}: certified at {str(commit)[:10]} by its sources; {len(keys)} witnesses recorded")
            else:
                say(f"{rel}: certified at {str(commit)[:10]} ({len(keys)} witnesses identical)")
        else:
            bad += 1
            new["witness_failed"] = {"commit": commit, "date": date, **failed}
            need = {"netns": "; a re-run needs the netns cluster", "gpu": "; a re-run needs a GPU"}.get(st_need, "")
            say(f"{rel}: stale: `{' '.join(failed['config'])}` {failed['where']}{need}")
        if write:
            data["provenance"] = new
            _write_json(p, data, text)
            if failed is None and mode == "record":
                _write_json(store_path(rel), store)
    say(f"verify: {len(files) - bad} certified, {bad} not, in {time.perf_counter() - t0:.0f} s"
        + ("" if write else " (nothing written)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(verify(sys.argv[1:] or None))
