#!/usr/bin/env python3
"""Time training steps under tc-shaped bandwidth and latency (Tang et al. 2018, arXiv:1803.06443, Fig. 3).

    python -m experiments.sweep_network --nodes 8 --algos allreduce,dpsgd,dcd:8,ecd:8 \\
        --bandwidth 1400mbit,200mbit,50mbit,20mbit,5mbit --latency 0.13ms,5ms,20ms \\
        --steps 50 --out runs/sweep

Every cell (algorithm x bandwidth x latency) runs ``python -m gossip.train`` on a
virtual cluster (experiments/vcluster.py: one network namespace per rank, links shaped
with tc) or, with ``--hosts FILE``, on real hosts over ssh (see docs/network.md). From
the run's own files (``metrics-rank<k>.jsonl`` with ``--log-every 1``, ``summary.json``)
it takes the median time per step after ``--warmup`` steps, the epoch time it implies,
the ledger's bytes per node per step, and next to them the bytes each host's interface
really sent (its tx counter), per step.

Out: ``results.csv``, ``results.json``, ``results.md`` (a table with the ratios to
all-reduce), ``fig3.png`` (epoch time against 5/bandwidth at the lowest and highest
latency, and against latency at the highest and lowest bandwidth, one line per
algorithm) and ``cells/<cell>/`` with each run's files; with ``--results FILE`` also
FILE, the rows with the provenance record of ``experiments/_provenance.py``
(``experiments/results/sweep_network.json`` is rendered into docs/network.md by
``make results-tables``). A cell already measured is
skipped on a re-run unless ``--force``, provided it was measured at the same code
(its ``cell.json`` records the commit and the sources' ids): a cell measured at other
code is measured again, and the run says so, so that the results' provenance never
stands for figures of another commit; ``--plot-only`` redraws from the CSV.

Latency is shaped with netem where the kernel has it; otherwise it is emulated in the
communicator (``gossip.train --emulate-latency MS``) and every row, table and figure
says ``latency: emulated``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments import _provenance
from experiments import vcluster
from experiments.vcluster import VClusterError, format_rate, parse_rate, parse_time

HERE = Path(__file__).resolve().parent

__all__ = ["Cell", "measure_run", "parse_algos", "plot_fig3", "write_results", "main"]

COLUMNS = [
    "algo", "bits", "nodes", "bandwidth_mbit", "latency_ms", "latency_mode", "shaping", "tcp_cc",
    "step_s", "step_s_p90", "epoch_s", "steps_per_epoch", "steps_measured",
    "bytes_per_step", "iface_bytes_per_step", "iface_over_ledger", "iface_bytes_per_step_run", "iface_window",
    "comm_s_per_step", "compute_s_per_step", "params", "model", "data", "wall_s", "ok", "error", "cell",
]
LABELS = {
    "allreduce": "Centralized all-reduce (32 bits)",
    "dpsgd": "Decentralized D-PSGD (32 bits)",
    "naive": "Naive compressed gossip ({bits} bits)",
    "dcd": "DCD-PSGD ({bits} bits)",
    "ecd": "ECD-PSGD ({bits} bits)",
    "dpsgd-onepeer": "D-PSGD, one-peer exponential graph (32 bits)",
    "dpsgd-matching": "D-PSGD, a random perfect matching per step (32 bits)",
    "sgp": "SGP, one-peer exponential graph (32 bits)",
    "sgp-overlap": "Overlapped SGP, one-peer exponential graph (32 bits)",
    "choco-top1": "CHOCO-SGD, top-1% (0.64 bits)",
    "choco-sign": "CHOCO-SGD, scaled sign (1 bit)",
}
COMPRESSED = ("naive", "dcd", "ecd")
#: sweep names that stand for an algorithm run with flags of their own (given after the
#: sweep's --topology, so theirs wins)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "dpsgd-onepeer": ("dpsgd", ["--topology", "onepeer-exp"]),
    "dpsgd-matching": ("dpsgd", ["--topology", "matching"]),
    "sgp": ("sgp", ["--topology", "onepeer-exp"]),
    "sgp-overlap": ("sgp", ["--topology", "onepeer-exp", "--algo-opt", "overlap=1"]),
    # on the sweep's own (static) graph, at the default consensus step gamma = 0.1
    "choco-top1": ("choco", ["--compressor", "topk:p=0.01"]),
    "choco-sign": ("choco", ["--compressor", "sign"]),
}
#: bits per coordinate on the wire of the compressed variants (headers left out): top-k
#: sends an int32 index and an fp32 value per kept coordinate
VARIANT_BITS: dict[str, float] = {"choco-top1": 0.01 * 64, "choco-sign": 1.0}


class SweepError(ValueError):
    """A user error in the sweep's arguments (one line)."""


# ---------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    algo: str
    bits: int | None
    nodes: int
    rate_bps: int
    latency_s: float

    @property
    def bandwidth_mbit(self) -> float:
        return self.rate_bps / 1e6

    @property
    def latency_ms(self) -> float:
        return round(self.latency_s * 1e3, 6)

    @property
    def algo_spec(self) -> str:
        return self.algo if self.bits is None else f"{self.algo}:{self.bits}"

    @property
    def key(self) -> str:
        lat = f"{self.latency_ms:g}".replace(".", "p")
        return f"{self.algo}{self.bits or ''}-n{self.nodes}-bw{format_rate(self.rate_bps)}-lat{lat}ms"

    def label(self) -> str:
        return LABELS.get(self.algo, self.algo).format(bits=self.bits)


def parse_algos(text: str) -> list[tuple[str, int | None]]:
    """``"allreduce,dpsgd,dcd:8,ecd:8"`` -> [("allreduce", None), ..., ("ecd", 8)]."""
    out = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        name, _, bits = item.partition(":")
        if name not in LABELS:
            raise SweepError(f"unknown algorithm {name!r} in --algos; accepted: {', '.join(LABELS)} "
                             "(compressed ones as name:bits, e.g. dcd:8)")
        if name in COMPRESSED:
            b = bits or "8"
            if not b.isdigit() or not 1 <= int(b) <= 16:
                raise SweepError(f"bad bits {bits!r} in --algos item {item!r}: expected 1 to 16, e.g. dcd:8")
            out.append((name, int(b)))
        else:
            if bits:
                raise SweepError(f"--algos item {item!r}: {name} sends fp32 and takes no :bits")
            out.append((name, None))
    if not out:
        raise SweepError("--algos is empty; e.g. --algos allreduce,dpsgd,dcd:8,ecd:8")
    return out


def _split(text: str, parse: Callable[[str], Any], flag: str) -> list[Any]:
    vals = [t.strip() for t in text.split(",") if t.strip()]
    if not vals:
        raise SweepError(f"{flag} is empty")
    try:
        return [parse(v) for v in vals]
    except VClusterError as e:
        raise SweepError(f"{flag}: {e}") from None


# ---------------------------------------------------------------------------- measuring
def _records(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if rec.get("kind") == "train":
            out.append(rec)
    return sorted(out, key=lambda r: r["step"])


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure_run(run_dir: Path, warmup: int, steps: int | None = None) -> dict[str, Any]:
    """Step time and bytes from one run directory's ``metrics-rank<k>.jsonl`` files.

    Per rank, the step times are the differences of the ``time`` field of consecutive
    records (logged every step) after the first ``warmup`` steps, up to ``steps``;
    ``step_s`` is the median over ranks of each rank's median. Bytes are the ledger's
    ``bytes_sent`` over the same window, per step, averaged over ranks. ``steps_run``
    is the number of steps the whole run made (the interface counters cover all).
    """
    files = sorted(run_dir.glob("metrics-rank*.jsonl"))
    if not files:
        raise RuntimeError(f"no metrics-rank*.jsonl in {run_dir}")
    medians, p90s, bytes_ps, comm_ps, comp_ps, spe, last_steps, timed = [], [], [], [], [], None, [], []
    for f in files:
        recs = _records(f)
        if recs:
            last_steps.append(recs[-1]["step"])  # the whole run, for the interface counters
        if steps is not None:
            recs = [r for r in recs if r["step"] <= steps]
        window = [r for r in recs if r["step"] >= warmup]  # the record at `warmup` is the start
        if len(window) < 2:
            raise RuntimeError(f"{f.name}: {len(recs)} step record(s), need more than --warmup {warmup} + 1")
        steps_gone = window[-1]["step"] - window[0]["step"]
        dts = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(window, window[1:])]
        medians.append(statistics.median(dts))
        p90s.append(_quantile(dts, 0.9))
        bytes_ps.append((window[-1]["bytes_sent"] - window[0]["bytes_sent"]) / steps_gone)
        if "comm_s" in window[0]:
            comm_ps.append((window[-1]["comm_s"] - window[0]["comm_s"]) / steps_gone)
        if "compute_s" in window[0]:
            comp_ps.append((window[-1]["compute_s"] - window[0]["compute_s"]) / steps_gone)
        ep = recs[-1].get("epoch")
        if ep:
            spe = round(recs[-1]["step"] / ep)
        timed.append(window[-1]["step"])
    return {
        "step_s": statistics.median(medians),
        "step_s_p90": statistics.median(p90s),
        "steps_measured": min(timed) - warmup,
        "steps_run": max(last_steps),
        "bytes_per_step": statistics.fmean(bytes_ps),
        "comm_s_per_step": statistics.fmean(comm_ps) if comm_ps else None,
        "compute_s_per_step": statistics.fmean(comp_ps) if comp_ps else None,
        "steps_per_epoch_from_records": spe,
    }


# ---------------------------------------------------------------------------- launchers
@dataclass
class RankRun:
    ok: bool
    returncode: int | None
    tx_bytes: int  # the host's interface over the whole run
    window_tx_per_step: float | None = None  # over the timed steps only, where known


class _StepWindow:
    """Reads the interface counters when rank 0's metrics reach two steps.

    ``gossip.train`` appends one record per step (``--log-every 1``, line-buffered), so
    polling that file tells when a step is done; the counters read at the records of
    step ``first`` and step ``last`` give the bytes each host sent during the timed
    steps alone, without start-up, rendezvous and evaluation traffic.
    """

    def __init__(self, path: Path, first: int, last: int, counters: Callable[[], list[dict]]) -> None:
        self.path, self.first, self.last, self.counters = path, first, last, counters
        self._pos = 0
        self._buf = ""
        self.marks: dict[str, tuple[int, list[int]]] = {}

    def __call__(self) -> None:
        if "last" in self.marks:
            return
        try:
            with open(self.path) as fh:
                fh.seek(self._pos)
                chunk = fh.read()
                self._pos = fh.tell()
        except OSError:
            return
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        step = None
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "train":
                step = rec["step"]
        if step is None:
            return
        for name, bound in (("first", self.first), ("last", self.last)):
            if name not in self.marks and step >= bound:
                self.marks[name] = (step, [c["tx_bytes"] for c in self.counters()])

    def per_step(self) -> list[float] | None:
        if "first" not in self.marks or "last" not in self.marks:
            return None
        (s0, a), (s1, b) = self.marks["first"], self.marks["last"]
        return None if s1 <= s0 else [(y - x) / (s1 - s0) for x, y in zip(a, b)]


class _VClusterLauncher:
    """Cells on a virtual cluster that is built once and re-shaped per network condition."""

    def __init__(self, nodes: int, prefix: str, subnet: str, *, shape_ingress: bool = True,
                 tcp_cc: Sequence[str] | None = None) -> None:
        self.vc = vcluster.VirtualCluster(nodes, prefix=prefix, subnet=subnet, shape_ingress=shape_ingress,
                                          tcp_cc=tcp_cc)
        self.shaping = "both" if shape_ingress else "egress"

    @property
    def tcp_cc(self) -> str | None:
        return self.vc.tcp_cc_used

    def __enter__(self) -> _VClusterLauncher:
        self.vc.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.vc.__exit__(*exc)

    def shape(self, rate_bps: int, latency_s: float) -> str:
        self.vc.shape(rate=rate_bps, delay=latency_s if latency_s > 0 else None)
        return "netem" if self.vc.latency_mode == "netem" else "emulated"

    def run(self, cmd: list[str], cell_dir: Path, run_dir: Path, timeout: float,
            window: tuple[int, int] | None = None) -> tuple[list[RankRun], float, str]:
        probe = None
        if window is not None:
            probe = _StepWindow(run_dir / "metrics-rank0.jsonl", window[0], window[1], self.vc.counters)
        res = self.vc.run(cmd, timeout=timeout, outdir=cell_dir, cwd=os.getcwd(), monitor=probe)
        per_step = probe.per_step() if probe is not None else None
        err = ""
        if not res.ok:
            bad = res.failed[0]
            state = "timed out" if bad.timed_out else f"exit {bad.returncode}"
            err = f"rank {bad.rank} {state}: {res.tail(bad.rank, 2)}".strip()
        return [RankRun(r.ok, r.returncode, r.tx_bytes, per_step[k] if per_step else None)
                for k, r in enumerate(res.ranks)], res.wall_s, err


class _SSHLauncher:
    """Cells on real hosts over ssh; the hosts are prepared as docs/network.md says.

    hosts file: one line per rank, ``SSH_TARGET IFACE [ADDRESS]`` (``#`` comments);
    rank 0's address (default: its ssh host name) is MASTER_ADDR.
    """

    def __init__(self, hosts_file: Path, repo: str, python: str, port: int, dry_run: bool) -> None:
        self.hosts: list[tuple[str, str, str]] = []
        for line in hosts_file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) not in (2, 3):
                raise SweepError(f"--hosts {hosts_file}: bad line {line!r}: expected SSH_TARGET IFACE [ADDRESS]")
            target, iface = parts[0], parts[1]
            addr = parts[2] if len(parts) == 3 else target.rsplit("@", 1)[-1]
            self.hosts.append((target, iface, addr))
        if len(self.hosts) < 2:
            raise SweepError(f"--hosts {hosts_file}: needs at least 2 hosts, found {len(self.hosts)}")
        self.repo, self.python, self.port, self.dry_run = repo, python, port, dry_run
        self.shaping = "egress"
        self.tcp_cc = None  # the hosts' own
        self.tc = f"sudo {shlex.quote(repo)}/experiments/tc_shape.sh"

    def __enter__(self) -> _SSHLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        for target, iface, _ in self.hosts:  # always leave the hosts unshaped
            self._ssh(target, f"{self.tc} clear --dev {shlex.quote(iface)}", check=False)

    def _ssh(self, target: str, command: str, check: bool = True, timeout: float = 60) -> str:
        argv = ["ssh", "-o", "BatchMode=yes", target, command]
        if self.dry_run:
            print("+ " + shlex.join(argv))
            return ""
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"ssh {target}: `{command}` failed: {p.stderr.strip()}")
        return p.stdout

    def shape(self, rate_bps: int, latency_s: float) -> str:
        probe = self._ssh(self.hosts[0][0], f"{self.tc} probe")
        netem = "netem=yes" in probe or self.dry_run
        for target, iface, _ in self.hosts:
            args = f"--rate {rate_bps}bit"
            if netem and latency_s > 0:
                args += f" --delay {round(latency_s * 1e6)}us"
            self._ssh(target, f"{self.tc} apply --dev {shlex.quote(iface)} {args}")
        return "netem" if netem else "emulated"

    def _tx(self) -> list[int]:
        out = []
        for target, iface, _ in self.hosts:
            text = self._ssh(target, f"cat /sys/class/net/{shlex.quote(iface)}/statistics/tx_bytes")
            out.append(int(text.strip() or 0))
        return out

    def run(self, cmd: list[str], cell_dir: Path, run_dir: Path, timeout: float,
            window: tuple[int, int] | None = None) -> tuple[list[RankRun], float, str]:
        n = len(self.hosts)
        before = self._tx()
        procs = []
        t0 = time.perf_counter()
        cell_dir.mkdir(parents=True, exist_ok=True)
        for k, (target, iface, _) in enumerate(self.hosts):
            env = {"RANK": k, "LOCAL_RANK": 0, "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": 1,
                   "MASTER_ADDR": self.hosts[0][2], "MASTER_PORT": self.port,
                   "GLOO_SOCKET_IFNAME": iface, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            remote = (f"cd {shlex.quote(self.repo)} && env "
                      + " ".join(f"{k_}={shlex.quote(str(v))}" for k_, v in env.items()) + " "
                      + shlex.join([self.python, *cmd[1:]]))
            argv = ["ssh", "-o", "BatchMode=yes", target, remote]
            if self.dry_run:
                print("+ " + shlex.join(argv))
                continue
            fo = open(cell_dir / f"rank{k}.out", "w")
            fe = open(cell_dir / f"rank{k}.err", "w")
            procs.append((subprocess.Popen(argv, stdout=fo, stderr=fe), fo, fe))
        codes = []
        for p, fo, fe in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0))))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)
            fo.close()
            fe.close()
        wall = time.perf_counter() - t0
        after = self._tx()
        # each rank wrote its metrics on its own host: fetch them next to rank 0's
        run_dir.mkdir(parents=True, exist_ok=True)
        for k, (target, _, _) in enumerate(self.hosts):
            names = [f"metrics-rank{k}.jsonl"] + (["summary.json", "config.json"] if k == 0 else [])
            for name in names:
                src = f"{target}:{shlex.quote(str(run_dir))}/{name}"
                if self.dry_run:
                    print("+ " + shlex.join(["scp", "-q", src, str(run_dir)]))
                else:
                    subprocess.run(["scp", "-q", src, str(run_dir)], capture_output=True, timeout=60)
        if self.dry_run:
            return [RankRun(False, None, 0) for _ in self.hosts], 0.0, "dry run"
        ranks = [RankRun(c == 0, c, a - b) for c, a, b in zip(codes, after, before)]
        err = "" if all(r.ok for r in ranks) else f"rank(s) {[k for k, r in enumerate(ranks) if not r.ok]} failed"
        return ranks, wall, err


# ---------------------------------------------------------------------------- training command
def _train_help(python: str) -> str:
    p = subprocess.run([python, "-m", "gossip.train", "--help"], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise SweepError(f"`{python} -m gossip.train --help` failed: {tail}")
    return p.stdout


def _calibrate(args: argparse.Namespace, out: Path) -> int:
    """Steps per epoch of one node for this data/model/batch/nodes (one simulated epoch).

    Cached in ``calibration.json``; the simulation (``--simulate N``) needs no network.
    """
    key = f"{args.data}|{args.model}|{args.batch_size}|{args.nodes}"
    path = out / "calibration.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key in cache:
        return int(cache[key])
    run = out / "calibration"
    cmd = [args.python, "-m", "gossip.train", "--simulate", str(args.nodes), "--algo", "allreduce",
           "--data", args.data, "--batch-size", str(args.batch_size), "--epochs", "1",
           "--out", str(run), "--no-progress", "--log-every", "1000000"]
    if args.model:
        cmd += ["--model", args.model]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = run / "summary.json"
    if p.returncode != 0 or not summary.exists():
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise SweepError(f"calibration run failed ({shlex.join(cmd)}): {tail}")
    spe = int(json.loads(summary.read_text())["steps"])
    cache[key] = spe
    path.write_text(json.dumps(cache, indent=2) + "\n")
    return spe


def _train_cmd(args: argparse.Namespace, cell: Cell, run_dir: Path, epochs: int, latency_mode: str,
               has_max_steps: bool) -> list[str]:
    algo, own = VARIANTS.get(cell.algo, (cell.algo, []))
    flags = ["--algo", algo, "--topology", args.topology, *own, "--data", args.data,
             "--batch-size", str(args.batch_size), "--epochs", str(epochs), "--lr", str(args.lr),
             "--seed", str(args.seed), "--out", str(run_dir), "--log-every", "1", "--no-progress",
             "--timeout", str(args.peer_timeout)]
    if cell.bits is not None:
        flags += ["--bits", str(cell.bits)]
    if args.model:
        flags += ["--model", args.model]
    if has_max_steps:
        flags += ["--max-steps", str(args.steps)]
    flags += shlex.split(args.train_args or "")
    if latency_mode == "emulated" and cell.latency_s > 0:
        flags += ["--emulate-latency", f"{cell.latency_s * 1e3:g}"]
    return [args.python, "-m", "gossip.train", *flags]


def record_cells(out: Path, rows: list[dict]) -> None:
    """Record each cell's ``gossip.train`` arguments (its ``command.txt`` under ``out``) in
    the provenance (:func:`_provenance.record_config`), its ranks as ``--simulate N``:
    what ``python -m experiments verify`` witnesses. Cells that differ only by the link's
    rate (shaped outside gossip.train) are one configuration."""
    for row in rows:
        path = Path(out) / "cells" / str(row["cell"]) / "command.txt"
        if path.is_file():
            cmd = shlex.split(path.read_text())
            i = cmd.index("gossip.train")
            _provenance.record_config(cmd[i + 1:], ranks=int(row["nodes"]))


# ---------------------------------------------------------------------------- outputs
def _row_key(row: dict) -> tuple:
    return (row["algo"], row["bits"], row["nodes"], row["bandwidth_mbit"], row["latency_ms"])


def write_results(rows: list[dict], out: Path, meta: dict[str, Any]) -> None:
    """``results.csv``, ``results.json`` and ``results.md`` (the table with ratios)."""
    rows = sorted(rows, key=lambda r: (-r["bandwidth_mbit"], r["latency_ms"], r["algo"], r["bits"] or 0))
    with open(out / "results.csv.tmp", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    os.replace(out / "results.csv.tmp", out / "results.csv")
    (out / "results.json.tmp").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    os.replace(out / "results.json.tmp", out / "results.json")
    (out / "results.md").write_text(results_table(rows, meta))


def ideal_bytes_ratio(algo: str, bits: int | None, n: int) -> float | None:
    """Bytes per node per step relative to ring all-reduce, ring topology, no headers.

    All-reduce: 2(n-1)/n models of 32 bits; ring gossip: 2 models of ``bits`` bits.
    """
    if n < 2:
        return None
    ar = 2 * (n - 1) / n
    if algo == "allreduce":
        return 1.0
    if algo == "dpsgd":
        return 2 / ar
    if algo in VARIANT_BITS:  # the sweep's graph (ring): 2 payloads
        return 2 * VARIANT_BITS[algo] / 32 / ar
    if algo in VARIANTS:  # one-peer graphs: one model sent per step
        return 1 / ar
    if algo in COMPRESSED and bits:
        return 2 * bits / 32 / ar
    return None


def results_table(rows: list[dict], meta: dict[str, Any]) -> str:
    lines = [
        "# Network sweep", "",
        f"Command: `{meta.get('command', '')}`", "",
        f"Latency: {', '.join(sorted({r['latency_mode'] for r in rows})) or '-'} "
        "(emulated = netem missing; the communicator waits the latency per message round).", "",
        "| algo | bw (Mbit/s) | latency (ms) | mode | step (s) | epoch (s) | bytes/step (ledger) | "
        "bytes/step (iface) | time / all-reduce | bytes / all-reduce | ideal bytes / all-reduce |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ar = {(r["nodes"], r["bandwidth_mbit"], r["latency_ms"]): r for r in rows if r["algo"] == "allreduce" and r["ok"]}
    for r in rows:
        name = r["algo"] + (f":{r['bits']}" if r["bits"] else "")
        if not r["ok"]:
            lines.append(f"| {name} | {r['bandwidth_mbit']:g} | {r['latency_ms']:g} | {r['latency_mode']} | "
                         f"failed: {r.get('error', '')[:60]} | | | | | | |")
            continue
        base = ar.get((r["nodes"], r["bandwidth_mbit"], r["latency_ms"]))
        t_ratio = f"{r['step_s'] / base['step_s']:.3f}" if base else "-"
        b_ratio = f"{r['bytes_per_step'] / base['bytes_per_step']:.3f}" if base and base["bytes_per_step"] else "-"
        ideal = ideal_bytes_ratio(r["algo"], r["bits"], r["nodes"])
        iface = f"{r['iface_bytes_per_step']:,.0f}" if r.get("iface_bytes_per_step") is not None else "-"
        lines.append(
            f"| {name} | {r['bandwidth_mbit']:g} | {r['latency_ms']:g} | {r['latency_mode']} | "
            f"{r['step_s']:.4f} | {r['epoch_s']:.2f} | {r['bytes_per_step']:,.0f} | {iface} | "
            f"{t_ratio} | {b_ratio} | {'-' if ideal is None else f'{ideal:.3f}'} |"
        )
    return "\n".join(lines) + "\n"




def plot_fig3(rows: list[dict], path: Path) -> Path | None:
    """The four panels of Tang et al.'s Fig. 3 (arXiv:1803.06443), drawn by
    ``gossip.tools.analysis.plot_sweep`` as for a sweep read back later; None when no cell
    was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from gossip.tools import analysis

    ok = [r for r in rows if r["ok"]]
    if not ok:
        return None
    fig = analysis.plot_sweep(pd.DataFrame.from_records(ok))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sweep_network.py",
        description="Time gossip.train steps per algorithm under tc-shaped bandwidth and latency "
                    "(Tang et al. 2018, arXiv:1803.06443, Fig. 3) on a virtual cluster of network namespaces or on real hosts.",
    )
    p.add_argument("--nodes", type=int, default=8, help="ranks per cell (default 8; the host count with --hosts)")
    p.add_argument("--algos", default="allreduce,dpsgd,dcd:8,ecd:8", help="comma list, name or name:bits")
    p.add_argument("--bandwidth", default="1400mbit,200mbit,50mbit,20mbit,5mbit", help="comma list of rates")
    p.add_argument("--latency", default="0.13ms,5ms,20ms", help="comma list of one-way latencies")
    p.add_argument("--steps", type=int, default=50, help="training steps per cell (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (default 5)")
    p.add_argument("--out", required=True, metavar="DIR", help="results directory")
    p.add_argument("--force", action="store_true", help="re-measure cells already in DIR")
    p.add_argument("--plot-only", action="store_true", help="only redraw the figure and tables from DIR")
    p.add_argument("--data", default="mnist1d", help="gossip.train --data (default mnist1d)")
    p.add_argument("--model", default="mlp", help="gossip.train --model (default mlp)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topology", default="ring")
    p.add_argument("--train-args", default="", metavar="ARGS", help="more gossip.train flags, one quoted string")
    p.add_argument("--cell-timeout", type=float, default=900.0, metavar="S", help="seconds per cell (default 900)")
    p.add_argument("--peer-timeout", type=float, default=120.0, metavar="S", help="gossip.train --timeout")
    p.add_argument("--python", default=sys.executable, help="python that runs gossip.train (default: this one)")
    p.add_argument("--prefix", default="gsw", help="virtual cluster name prefix (default gsw)")
    p.add_argument("--subnet", default=vcluster.DEFAULT_SUBNET, help="virtual cluster subnet")
    p.add_argument("--tcp-cc", default="cubic,reno", metavar="NAMES",
                   help="virtual cluster: TCP congestion control, the first allowed of a comma list "
                        "(default cubic,reno; '' keeps the kernel's)")
    p.add_argument("--egress-only", action="store_true",
                   help="virtual cluster: shape only what each host sends (default: both directions)")
    p.add_argument("--hosts", type=Path, metavar="FILE", help="real hosts: lines 'SSH_TARGET IFACE [ADDRESS]'")
    p.add_argument("--remote-repo", default=os.getcwd(), help="checkout path on the hosts (default: this cwd)")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT on real hosts")
    p.add_argument("--dry-run", action="store_true", help="with --hosts: print the ssh commands, run nothing")
    p.add_argument("--results", type=Path, metavar="FILE",
                   help="also write results.json here (experiments/results/sweep_network.json: docs/network.md's table)")
    return p


def _load_rows(out: Path) -> list[dict]:
    rows = []
    for f in sorted((out / "cells").glob("*/cell.json")):
        try:
            rows.append(json.loads(f.read_text()))
        except json.JSONDecodeError:
            continue
    return rows


def _other_code(row: dict, code: dict | None) -> str | None:
    """Why a cell measured earlier cannot stand for the code run now (None if it can):
    it was measured at other sources (or from uncommitted changes to them, or before
    cells recorded their code), which the results' provenance would misstate."""
    if code is None:
        return None
    was = row.get("code")
    if not was:
        return "measured before cells recorded their code"
    now, then = code.get("source_ids") or {}, was.get("source_ids") or {}
    changed = [s for s in sorted(set(now) | set(then)) if now.get(s) != then.get(s)]
    if changed:
        return f"measured at commit {str(was.get('commit'))[:10]}, changed since: {', '.join(changed)}"
    if was.get("diff_sha256") != code.get("diff_sha256"):  # the same commit, other uncommitted changes
        return (f"measured with other uncommitted changes (then: {', '.join(was.get('dirty_sources') or []) or 'none'}; "
                f"now: {', '.join(code.get('dirty_sources') or []) or 'none'})")
    return None


def _code(prov: _provenance.Provenance) -> dict:
    """The code a cell is measured at: the commit, its sources' ids, and a hash of
    their uncommitted changes (the same commit with other changes is other code)."""
    diff = subprocess.run(["git", "diff", "HEAD", "--", *prov.sources], cwd=_provenance.REPO,
                          capture_output=True).stdout if prov.dirty_sources else b""
    return {"commit": prov.commit, "source_ids": prov.source_ids, "dirty_sources": prov.dirty_sources,
            "diff_sha256": hashlib.sha256(diff).hexdigest() if diff else None}


def run_sweep(args: argparse.Namespace, out: Path, log: Callable[[str], None],
              code: dict | None = None) -> list[dict]:
    """Measure every cell not yet in ``out``; a cell measured there before is taken as
    it is only if it was measured at the same code (``code``: the commit, the sources'
    ids and their uncommitted changes, from the run's provenance), else measured again."""
    algos = parse_algos(args.algos)
    rates = _split(args.bandwidth, parse_rate, "--bandwidth")
    lats = _split(args.latency, lambda v: parse_time(v, "latency"), "--latency")
    if args.hosts is None and (args.nodes < 2 or args.nodes > 64):
        raise SweepError(f"--nodes must be from 2 to 64, got {args.nodes}")
    if args.steps < 2 or not 0 <= args.warmup < args.steps - 1:
        raise SweepError(f"need --steps >= 2 and 0 <= --warmup < --steps - 1, got steps {args.steps}, warmup {args.warmup}")
    help_text = _train_help(args.python)
    has_max_steps = "--max-steps" in help_text
    if "--emulate-latency" not in help_text:
        raise SweepError(f"`{args.python} -m gossip.train` has no --emulate-latency flag; this sweep needs it "
                         "where netem is missing (update the checkout)")
    spe = _calibrate(args, out)
    # whole epochs that reach --steps; --max-steps (where the CLI has it) stops right there
    epochs = max(1, math.ceil(args.steps / spe))
    launcher: Any
    if args.hosts is not None:
        launcher = _SSHLauncher(args.hosts, args.remote_repo, args.python, args.port, args.dry_run)
        nodes = len(launcher.hosts)
    else:
        launcher = _VClusterLauncher(args.nodes, args.prefix, args.subnet, shape_ingress=not args.egress_only,
                                     tcp_cc=[c for c in args.tcp_cc.split(",") if c] or None)
        nodes = args.nodes
    done = {}
    for r in _load_rows(out):
        if not r.get("ok"):
            continue
        why = _other_code(r, code)
        if why is None:
            done[r["cell"]] = r
        elif not args.force:
            log(f"cell {r['cell']}: {why}; measuring it again")
    rows: dict[str, dict] = {}
    with launcher:
        for rate in rates:
            for lat in lats:
                cells = [Cell(a, b, nodes, rate, lat) for a, b in algos]
                todo = [c for c in cells if args.force or c.key not in done]
                for c in cells:
                    if c not in todo:
                        rows[c.key] = done[c.key]
                if not todo:
                    continue
                mode = launcher.shape(rate, lat)
                for c in todo:
                    log(f"cell {c.key}: {format_rate(rate)}, {c.latency_ms:g} ms ({mode}) ...")
                    row = _run_cell(args, launcher, c, out, epochs, spe, mode, has_max_steps, code)
                    rows[c.key] = row
                    if row["ok"]:
                        log(f"cell {c.key}: step {row['step_s']:.4f} s, epoch {row['epoch_s']:.2f} s, "
                            f"{row['bytes_per_step']:,.0f} B/step (iface {row['iface_bytes_per_step']:,.0f})")
                    else:
                        log(f"cell {c.key}: FAILED: {row['error']}")
    return list(rows.values())


def _run_cell(args, launcher, cell: Cell, out: Path, epochs: int, spe: int, mode: str,
              has_max_steps: bool, code: dict | None = None) -> dict[str, Any]:
    cell_dir = out / "cells" / cell.key
    run_dir = cell_dir / "run"
    if cell_dir.exists():
        for f in list(run_dir.glob("*")) if run_dir.exists() else []:
            if f.is_file():
                f.unlink()
    cell_dir.mkdir(parents=True, exist_ok=True)
    cmd = _train_cmd(args, cell, run_dir, epochs, mode, has_max_steps)
    (cell_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    row: dict[str, Any] = {
        "algo": cell.algo, "bits": cell.bits, "nodes": cell.nodes, "bandwidth_mbit": cell.bandwidth_mbit,
        "latency_ms": cell.latency_ms, "latency_mode": mode, "cell": cell.key, "model": args.model,
        "data": args.data, "ok": False, "error": "",
        "shaping": getattr(launcher, "shaping", None), "tcp_cc": getattr(launcher, "tcp_cc", None),
        "code": code,  # what a later run checks before it takes this cell as measured
    }
    ranks, wall, err = launcher.run(cmd, cell_dir, run_dir, args.cell_timeout, window=(args.warmup, args.steps))
    row["wall_s"] = wall
    try:
        m = measure_run(run_dir, args.warmup, args.steps)
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        row["error"] = err or str(e)
    else:
        spe_run = m.pop("steps_per_epoch_from_records") or spe
        summary = run_dir / "summary.json"
        params = None
        if summary.exists():
            params = json.loads(summary.read_text()).get("params")
        steps_run = m.pop("steps_run")
        tx = [r.tx_bytes for r in ranks]
        iface_run = statistics.fmean(tx) / steps_run if steps_run and any(tx) else None
        win = [r.window_tx_per_step for r in ranks]
        iface = statistics.fmean(win) if win and all(w is not None for w in win) else iface_run
        row.update(m)
        row.update({
            "steps_per_epoch": spe_run, "epoch_s": m["step_s"] * spe_run, "params": params,
            "iface_bytes_per_step": iface, "iface_bytes_per_step_run": iface_run,
            "iface_window": iface is not iface_run,
            "iface_over_ledger": (iface / m["bytes_per_step"]) if iface and m["bytes_per_step"] else None,
            "ok": not err and m["steps_measured"] >= min(args.steps - args.warmup, 1),
            "error": err,
        })
    (cell_dir / "cell.json").write_text(json.dumps(row, indent=2) + "\n")
    return row


#: the code a sweep's figures measure (for `python -m experiments.render --stale`)
#: the code the figures measure: training runs (gossip less experiments/_provenance.py's
#: NOT_TRAINED; gossip.tools.analysis only draws the figure) on the virtual cluster
SOURCES = _provenance.training_sources("experiments/sweep_network.py", "experiments/vcluster.py")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    log = lambda msg: print(f"sweep: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    cmdline = shlex.join(["python", "-m", "experiments.sweep_network", *(argv if argv is not None else sys.argv[1:])])
    # the record of this invocation (a --plot-only redraw records its own); the cells' own
    # times and loads are in each cell's cell.json
    prov = _provenance.start(SOURCES, argv=shlex.split(cmdline), measure_memcpy=not args.dry_run)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if args.plot_only:
            rows = _load_rows(out)
            if not rows:
                raise SweepError(f"--plot-only: no measured cells in {out}/cells")
            code = _code(prov)
            other = [(r["cell"], why) for r in rows if r.get("ok") and (why := _other_code(r, code))]
            if args.results and other:
                raise SweepError(f"--results with --plot-only: {len(other)} of the cells in {out}/cells were not "
                                 f"measured at this checkout's code (cell {other[0][0]}: {other[0][1]}); "
                                 "re-measure them (the same command without --plot-only) or leave out --results")
        else:
            rows = run_sweep(args, out, log, code=_code(prov))
        if args.dry_run:
            return 0
        record_cells(out, rows)
        meta = {"command": prov.command, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "cpus": os.cpu_count(), "warmup": args.warmup, "steps": args.steps, "algos": args.algos,
                "provenance": prov.finish()}
        write_results(rows, out, meta)
        if args.results:  # the same figures, with the provenance record where experiments/render.py reads it
            args.results.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.results.with_name(args.results.name + ".tmp")
            tmp.write_text(json.dumps({"meta": {k: v for k, v in meta.items() if k != "provenance"},
                                       "rows": json.loads((out / "results.json").read_text())["rows"],
                                       "provenance": meta["provenance"]}, indent=2) + "\n")
            os.replace(tmp, args.results)
        fig = plot_fig3(rows, out / "fig3.png")
        log(f"{sum(r['ok'] for r in rows)}/{len(rows)} cells measured; results in {out}/results.csv, "
            f"results.json, results.md{', fig3.png' if fig else ''}")
        return 0 if all(r["ok"] for r in rows) else 1
    except (SweepError, VClusterError) as e:
        print(f"sweep_network.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sweep_network.py: interrupted; the cells measured so far are kept", file=sys.stderr)
        return 130
    except vcluster.Terminated as e:
        print(f"sweep_network.py: {e}; the cells measured so far are kept", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
