"""Everything this project can only check on a GPU, in one run of under 8 minutes.

    python -m experiments run gpu_check --out runs/gpu-check            # on a CUDA machine
    python -m experiments run gpu_check --dry-run                        # anywhere: list and validate the plan

Sections, each in a process of its own with its own time limit (a crash, a hang or a
failed import in one is recorded and the next one runs):

- ``env``: the device, its memory, CUDA and NCCL versions;
- ``cuda_tests``: the test suite's CUDA and NCCL tests (``pytest -k "cuda or nccl"``
  over the files that hold them), with each test's outcome;
- ``compress_speed``: every compressor of ``bench_compress.SPECS`` on the GPU,
  encode + decode of 16M values against a device memcpy of the same tensor
  (``dst.copy_(src)``), minimum of interleaved repeats, CUDA-synchronised;
- ``bytes_cpu_vs_cuda``: every registered compressor encodes the same rows with the
  same keys on CPU and on CUDA; are the payload bytes identical, and how far apart
  are the decoded values;
- ``simulate_cuda``: a short ``gossip.train --simulate 4 --device cuda`` run (ECD at 8
  bits on a ring, one epoch);
- ``simulate_paths``: ``experiments/sim_gpu_check.py --quick``: the loop and the
  vectorized simulation paths on CUDA agree (D-PSGD and DCD at 8 bits), and
  nodes x steps per second of both at 256 and 1,024 nodes (logreg, mlp);
- ``nccl``: a one-process NCCL group: the communicator's all-reduce, all-gather and
  broadcast on CUDA tensors; ``torchrun --nproc_per_node 1`` of the training CLI
  (all-reduce, ``--device cuda``) and of the DDP-hook example (efsgd, powersgd).

It writes ``OUT/gpu_check.json`` (every section's status, figures and errors, with a
provenance record: experiments/_provenance.py) and ``OUT/gpu_check.md`` (a summary).
The exit status is 0 when every section ran (whatever it found), 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable
from experiments import _cli

REPO = Path(__file__).resolve().parents[1]

__all__ = ["SECTIONS", "plan", "main"]

#: the whole check's budget in seconds (the issue asks for under 8 minutes)
BUDGET_S = 450
#: files holding the CUDA/NCCL tests
CUDA_TEST_FILES = ["tests/test_compress_backend.py", "tests/test_compress_bitpack.py", "tests/test_comm_dist.py"]
SOURCES = ["gossip", "experiments/gpu_check.py", "experiments/bench_compress.py", "experiments/bench_sim.py",
           "experiments/sim_gpu_check.py", "examples/ddp_hook.py"]
SPEED_NUMEL = 1 << 24
#: a section gets at least this long (within the budget), whatever its share
MIN_SECTION_S = 15.0


def _portable(text: str) -> str:
    """``text`` with the checkout's path and temporary folders written as ``REPO`` and
    ``TMP``: a results file names no path of the machine that made it."""
    text = text.replace(str(REPO) + "/", "").replace(str(REPO), "REPO")
    return re.sub(re.escape(tempfile.gettempdir()) + r"/tmp[\w.-]+", "TMP", text)


def _py() -> list[str]:
    return [sys.executable]


# ----------------------------------------------------------------------------- sections
def s_env(_: argparse.Namespace) -> dict[str, Any]:
    """the device, its memory, CUDA and NCCL versions"""
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                           "cuda": torch.version.cuda, "device_count": torch.cuda.device_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
    out["nccl_available"] = dist.is_available() and dist.is_nccl_available()
    if out["nccl_available"]:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def s_cuda_tests(args: argparse.Namespace) -> dict[str, Any]:
    """pytest -k "cuda or nccl" over the files with CUDA tests"""
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [*_py(), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "cuda or nccl",
               f"--junitxml={xml}", *CUDA_TEST_FILES]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.section_timeout)
        tests = []
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome, msg = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    el = case.find(tag)
                    if el is not None:
                        outcome, msg = ("failed" if tag != "skipped" else "skipped"), (el.get("message") or "")[:300]
                tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                              "seconds": float(case.get("time") or 0), "message": msg})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {"command": " ".join(cmd[2:]).replace(str(xml), "JUNIT"), "exit": r.returncode, **counts,
            "tests": tests, "tail": r.stdout[-2000:]}


def s_compress_speed(args: argparse.Namespace) -> dict[str, Any]:
    """bench_compress's compressors on CUDA against a device memcpy"""
    import torch

    import gossip.compress as gc
    from experiments.bench_compress import SPECS

    dev = torch.device("cuda")
    n = args.numel
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, generator=g).to(dev)
    keys = torch.tensor([12345], device=dev)
    dst = torch.empty_like(x)
    rows = []
    for spec in SPECS:
        try:
            c = gc.build(spec)
            P = c.encode(x, keys)
            y = c.decode(P, n)
            fns = {"copy": lambda: dst.copy_(x), "enc": lambda: c.encode(x, keys, out=P),
                   "dec": lambda: c.decode(P, n, out=y)}
            for fn in fns.values():  # warm-up: allocations, kernel caches
                fn()
            torch.cuda.synchronize()
            best = {k: float("inf") for k in fns}
            for _ in range(args.reps):  # interleaved, so that clock changes hit all three alike
                for k, fn in fns.items():
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    best[k] = min(best[k], time.perf_counter() - t)
            nbytes = 4.0 * n
            mem = nbytes / best["copy"] / 1e9
            rows.append({"compressor": spec, "numel": n, "memcpy_gbps": mem,
                         "encode_gbps": nbytes / best["enc"] / 1e9, "decode_gbps": nbytes / best["dec"] / 1e9,
                         "roundtrip_ratio": nbytes / (best["enc"] + best["dec"]) / 1e9 / mem,
                         "encode_ms": best["enc"] * 1e3, "decode_ms": best["dec"] * 1e3,
                         "memcpy_ms": best["copy"] * 1e3})
        except Exception as e:  # recorded per compressor; the others still run
            rows.append({"compressor": spec, "error": f"{type(e).__name__}: {e}"[:300]})
    return {"rows": rows, "reps": args.reps, "stat": "min"}


def _spec_for(name: str) -> str:
    import gossip.compress as gc

    return gc.build(name).spec


def s_bytes_cpu_vs_cuda(_: argparse.Namespace) -> dict[str, Any]:
    """every registered compressor: CPU and CUDA payload bytes identical?"""
    import torch

    import gossip.compress as gc

    g = torch.Generator().manual_seed(2)
    X = torch.randn(4, 100_003, generator=g) * torch.rand(4, 1, generator=g) * 10
    X[1, :50] = 0.0
    keys = torch.tensor([1, -2, 3, 1 << 40])
    rows = []
    for name in gc.available():
        spec = _spec_for(name)
        try:
            c = gc.build(spec)
            P, Pg = c.encode(X, keys), c.encode(X.cuda(), keys.cuda())
            Y, Yg = c.decode(P, X.shape[1]), c.decode(Pg, X.shape[1]).cpu()
            same = P.shape == Pg.shape and torch.equal(P, Pg.cpu())
            diff = (Yg - Y).abs()
            rows.append({"compressor": spec, "bytes_identical": bool(same),
                         "differing_bytes": int((P != Pg.cpu()).sum()) if P.shape == Pg.shape else None,
                         "decoded_identical": bool(torch.equal(Y, Yg)),
                         "decoded_max_abs_diff": float(diff.max()),
                         "decoded_rel_diff": float(diff.norm() / Y.norm()) if float(Y.norm()) > 0 else 0.0})
        except Exception as e:
            rows.append({"compressor": spec, "error": f"{type(e).__name__}: {e}"[:300]})
    return {"rows": rows, "all_bytes_identical": all(r.get("bytes_identical") for r in rows)}


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", str(e.stdout or "")[-2000:], str(e.stderr or "")[-2000:]
    return {"command": _portable(" ".join(cmd[1:] if cmd[0] == sys.executable else cmd)), "exit": rc,
            "seconds": round(time.perf_counter() - t, 1), "stdout_tail": _portable(out[-1500:]),
            # a torchrun rank's own error comes before the launcher's summary: keep both ends
            "stderr_head": _portable(err[:6000]), "stderr_tail": _portable(err[-1500:])}


def _train_cmd(out: str, *extra: str) -> list[str]:
    return [*_py(), "-m", "gossip.train", "--data", "mnist1d", "--model", "cnn1d", "--epochs", "1",
            "--batch-size", "32", "--lr", "0.05", "--seed", "0", "--no-progress", "--device", "cuda",
            "--out", out, "--overwrite", *extra]


#: the gossip.train runs of the sections that train: (flags on top of _train_cmd's, torchrun ranks)
TRAINED = {"simulate_cuda": [(("--simulate", "4", "--algo", "ecd", "--bits", "8", "--topology", "ring"), None)],
           "nccl": [(("--algo", "allreduce"), 1)]}


def _record_trained(name: str) -> None:
    """Record a section's training runs in the provenance, without ``--device cuda``: what
    ``python -m experiments verify`` witnesses on the CPU (not the CUDA or NCCL paths)."""
    from experiments import _provenance

    for extra, ranks in TRAINED.get(name, []):
        args = _train_cmd("OUT", *extra)[3:]
        i = args.index("--device")
        _provenance.record_config(args[:i] + args[i + 2:], ranks=ranks)


def s_simulate_cuda(args: argparse.Namespace) -> dict[str, Any]:
    """gossip.train --simulate 4 --device cuda, ECD at 8 bits, one epoch"""
    with tempfile.TemporaryDirectory() as tmp:
        res = _run(_train_cmd(f"{tmp}/sim", *TRAINED["simulate_cuda"][0][0]), args.section_timeout - 5)
    res["ran_on_cuda"] = res["exit"] == 0
    return res


def s_simulate_paths(args: argparse.Namespace) -> dict[str, Any]:
    """sim_gpu_check --quick: both simulation paths on CUDA agree, and their speed"""
    with tempfile.TemporaryDirectory() as tmp:
        res = _run([*_py(), "-m", "experiments.sim_gpu_check", "--quick", "--out", tmp], args.section_timeout - 5)
        res["command"] = res["command"].replace(tmp, "OUT")
        paths, bench = Path(tmp) / "paths.json", Path(tmp) / "bench_sim_cuda.json"
        if paths.is_file():
            res["paths"] = json.loads(paths.read_text())["results"]
        if bench.is_file():
            doc = json.loads(bench.read_text())
            res["bench"] = [{k: r.get(k) for k in ("model", "nodes", "loop_node_steps_per_s",
                                                    "vectorized_node_steps_per_s", "ratio")} for r in doc["rows"]]
    return res


def _nccl_worker() -> dict[str, Any]:
    """In a torchrun rank (world 1): the communicator's collectives on CUDA over NCCL."""
    import torch
    import torch.distributed as dist

    from gossip import comm

    out: dict[str, Any] = {}
    dev = comm.init_from_env(backend="nccl", timeout=60)
    out["backend"] = dist.get_backend()
    c = comm.DistCommunicator(device=dev, timeout=60)
    x = torch.arange(6.0, device=dev).view(1, 6)
    for name, fn in [("all_reduce", lambda: c.all_reduce(x.clone())),
                     ("all_gather", lambda: c.all_gather(x.clone())),
                     ("broadcast", lambda: c.broadcast(x.clone(), 0))]:
        try:
            r = fn()
            out[name] = {"ok": bool(torch.equal(r.reshape(-1)[:6].cpu(), x.reshape(-1).cpu())),
                         "device": str(r.device)}
        except Exception as e:
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    dist.destroy_process_group()
    return out


def s_nccl(args: argparse.Namespace) -> dict[str, Any]:
    """one-process NCCL: communicator collectives, torchrun of the CLI and of the DDP hook"""
    torchrun = [*_py(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    per = max(20.0, (args.section_timeout - 10) / 4)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        r = _run([*torchrun, "-m", "experiments.gpu_check", "--nccl-worker", f"{tmp}/w.json"], per)
        if Path(f"{tmp}/w.json").exists():
            r["result"] = json.loads(Path(f"{tmp}/w.json").read_text())
        res["communicator_collectives"] = r
        res["train_allreduce"] = _run([*torchrun, "-m", "gossip.train",
                                       *_train_cmd(f"{tmp}/tr", *TRAINED["nccl"][0][0])[3:]], per)
        for algo, opt in (("efsgd", "compressor=quant:bits=8"), ("powersgd", "rank=2")):
            res[f"ddp_hook_{algo}"] = _run([*torchrun, "examples/ddp_hook.py", "--algo", algo, "--opt", opt], per)
    return res


SECTIONS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], float]] = {
    # name: (function, share of the budget)
    "env": (s_env, 0.05),
    "cuda_tests": (s_cuda_tests, 0.2),
    "compress_speed": (s_compress_speed, 0.1),
    "bytes_cpu_vs_cuda": (s_bytes_cpu_vs_cuda, 0.1),
    "simulate_cuda": (s_simulate_cuda, 0.1),
    "simulate_paths": (s_simulate_paths, 0.2),
    "nccl": (s_nccl, 0.25),
}


def plan(budget: float, only: list[str] | None = None) -> list[tuple[str, float]]:
    """``(section, seconds)`` in running order; ValueError for an unknown section."""
    names = only or list(SECTIONS)
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        raise ValueError(f"unknown section {', '.join(bad)}; sections: {', '.join(SECTIONS)}")
    return [(n, round(budget * SECTIONS[n][1], 1)) for n in names]


def _validate() -> list[str]:
    """What --dry-run checks on any machine: the test files, the compressors, the CLI
    flags the sections pass (parsed, not run), the example."""
    problems = []
    for f in CUDA_TEST_FILES + ["examples/ddp_hook.py"]:
        if not (REPO / f).is_file():
            problems.append(f"missing {f}")
    try:
        import gossip.compress as gc
        from experiments.bench_compress import SPECS

        for s in [*SPECS, *gc.available()]:
            gc.build(s)
    except Exception as e:
        problems.append(f"compressors: {type(e).__name__}: {e}")
    try:
        from gossip.train.config import parse_args

        for extra in (["--simulate", "4", "--algo", "ecd", "--bits", "8", "--topology", "ring"], ["--algo", "allreduce"]):
            parse_args(_train_cmd("runs/x", *extra)[3:])
    except SystemExit as e:
        problems.append(f"gossip.train rejects the section's flags (exit {e.code})")
    except Exception as e:
        problems.append(f"gossip.train flags: {type(e).__name__}: {e}")
    return problems


def _summary(doc: dict[str, Any]) -> str:
    lines = ["# GPU check", "", f"`{doc['provenance']['command']}` on {doc['sections'].get('env', {}).get('result', {}).get('device', '?')}", ""]
    for name, s in doc["sections"].items():
        line = f"- **{name}**: {s['status']} in {s['seconds']} s" + (f": {s['error']}" if s.get("error") else "")
        res = s.get("result") or {}
        if name == "cuda_tests" and res:
            line += f"; tests passed {res['passed']}, failed {res['failed']}, skipped {res['skipped']}"
            line += "".join(f"\n  - {t['outcome']}: {t['test']} {t['message'][:150]}" for t in res["tests"]
                            if t["outcome"] != "passed")
        subs = {name: res} if "exit" in res and name != "cuda_tests" else \
            {k: v for k, v in res.items() if isinstance(v, dict) and "exit" in v}
        for k, v in subs.items():
            line += f"\n  - {k}: exit {v['exit']} in {v.get('seconds', '?')} s"
            if v["exit"] != 0:
                line += f": {(v.get('stderr_tail') or '').strip().splitlines()[-1:] or ''}"
            if isinstance(v.get("result"), dict):
                line += f"; {json.dumps(v['result'])[:400]}"
        lines.append(line)
    sp = doc["sections"].get("compress_speed", {}).get("result", {}).get("rows", [])
    if sp:
        lines += ["", "| compressor | rt/mem | enc GB/s | dec GB/s | memcpy GB/s |", "|---|---|---|---|---|"]
        for r in sp:
            lines.append(f"| {r['compressor']} | " + (f"{r['roundtrip_ratio']:.3f} | {r['encode_gbps']:.1f} | "
                         f"{r['decode_gbps']:.1f} | {r['memcpy_gbps']:.0f} |" if "error" not in r else f"{r['error']} | | | |"))
    by = doc["sections"].get("bytes_cpu_vs_cuda", {}).get("result", {}).get("rows", [])
    if by:
        lines += ["", "| compressor | bytes identical | decoded identical | max abs diff |", "|---|---|---|---|"]
        for r in by:
            lines.append(f"| {r['compressor']} | " + (f"{r['bytes_identical']} | {r['decoded_identical']} | "
                         f"{r['decoded_max_abs_diff']:.3g} |" if "error" not in r else f"{r['error']} | | |"))
    return "\n".join(lines) + "\n"


def options(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run gpu_check``."""
    ap.add_argument("--out", default="runs/gpu-check", help="output folder (default runs/gpu-check)")
    ap.add_argument("--dry-run", action="store_true", help="list and validate the plan; run nothing")
    ap.add_argument("--only", help="comma-separated sections (default: all)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all sections (default {BUDGET_S})")
    ap.add_argument("--numel", type=int, default=SPEED_NUMEL, help="values per compressor in compress_speed")
    ap.add_argument("--reps", type=int, default=7, help="timed repeats in compress_speed (default 7)")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    ap.add_argument("--section-out", help=argparse.SUPPRESS)
    ap.add_argument("--section-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--nccl-worker", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    ap, args = _cli.parse(argv, options, __doc__, "gpu_check")
    if args.nccl_worker:
        Path(args.nccl_worker).write_text(json.dumps(_nccl_worker()))
        return 0
    if args.section:
        res = SECTIONS[args.section][0](args)
        Path(args.section_out).write_text(json.dumps(res, indent=1, default=str))
        return 0
    if not args.budget > 0 or args.numel < 1 or args.reps < 1:
        print("gpu_check: error: --budget must be > 0, --numel and --reps >= 1", file=sys.stderr)
        return 2
    try:
        steps = plan(args.budget, [s.strip() for s in args.only.split(",")] if args.only else None)
    except ValueError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for name, secs in steps:
            print(f"{name:<18} up to {secs:>5.0f} s  {SECTIONS[name][0].__doc__ or ''}".rstrip())
        print(f"total budget {args.budget:.0f} s; output {Path(args.out) / 'gpu_check.json'}")
        problems = _validate()
        for p in problems:
            print(f"gpu_check: plan problem: {p}", file=sys.stderr)
        print("plan valid" if not problems else f"{len(problems)} problem(s)")
        return 1 if problems else 0

    from experiments import _provenance

    prov = _provenance.start(SOURCES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections: dict[str, Any] = {}
    deadline = time.perf_counter() + args.budget
    for name, secs in steps:
        left = deadline - time.perf_counter()
        # at least MIN_SECTION_S each (a Python start-up and imports); the last takes what is left
        limit = min(max(secs, MIN_SECTION_S), left) if name != steps[-1][0] else left
        if limit < 5:
            sections[name] = {"status": "not run", "seconds": 0, "error": "the time budget was spent"}
            continue
        t = time.perf_counter()
        tmp = out / f".{name}.json"
        cmd = [*_py(), "-m", "experiments.gpu_check", "--section", name, "--section-out", str(tmp),
               "--section-timeout", str(limit), "--numel", str(args.numel), "--reps", str(args.reps)]
        print(f"[{name}] up to {limit:.0f} s", flush=True)
        try:
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit + 15)
            if r.returncode == 0 and tmp.exists():
                sections[name] = {"status": "ran", "result": json.loads(tmp.read_text())}
            else:
                sections[name] = {"status": "failed", "error": f"exit {r.returncode}",
                                  "stderr_tail": r.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            sections[name] = {"status": "failed", "error": f"timed out after {limit + 15:.0f} s"}
        except Exception:
            sections[name] = {"status": "failed", "error": traceback.format_exc()[-2000:]}
        tmp.unlink(missing_ok=True)
        if sections[name]["status"] == "ran":
            _record_trained(name)
        sections[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(f"[{name}] {sections[name]['status']} in {sections[name]['seconds']} s"
              + (f": {sections[name]['error']}" if sections[name].get("error") else ""), flush=True)
    doc = {"provenance": prov.finish(), "results": {"sections": sections}}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(_summary({"provenance": doc["provenance"], "sections": sections}))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if all(s["status"] == "ran" for s in sections.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
