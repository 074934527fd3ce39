"""The studies' tables: pure functions from a results file's figures to Markdown.

experiments/render.py registers them (``TABLES``) and draws the README's and docs'
tables with them; a study that also prints its table, or writes one into its run
directory (``race.md``, ``compare.md``, ...), calls the same function, so a table is
drawn in one place. This module imports nothing of the project: every study and the
renderer can use it without an import circle.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["md", "pct", "tree_note", "fmt_bytes", "fmt_score", "METRIC_WORDS", "sgp_summary", "own_line",
           "bench_sim_table", "bench_sim_epoch_table", "sim_epoch_profile_table", "bench_topologies_table",
           "cold_start_table", "crossover_check_table", "ecd_recipes_table", "gossip_compare_table",
           "modern_compare_table", "netns_gap_table", "sgp_overlap_table", "sharded_accuracy_table", "sharded_bytes_table",
           "streaming_overlap_table", "adpsgd_torchrun_table", "adpsgd_netns_table", "diloco_eager_netns_table", "groups_netns_table", "trust_table", "trust_matrix", "race_table", "race_netns_table", "benchmark_netns_table",
           "benchmark_netns_section"]


def md(header: list[str], rows: list[list[str]], align: str = "---") -> str:
    """A Markdown table: the header, a rule of ``align`` per column, one line per row."""
    out = ["| " + " | ".join(header) + " |", "|" + f"{align}|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def pct(v: float | None) -> str:
    """A share as ``12.3 %``; ``-`` for none."""
    return "-" if v is None else f"{v:.1%}".replace("%", " %")


def tree_note(prov: dict) -> str:
    """What a provenance record says of uncommitted changes at the run, for the line
    after its commit: none (""), changes none of which lay in its sources (its figures
    are still those of the commit), the sources changed (they are not), or, for a record
    made before ``dirty_sources`` was kept, a dirty tree."""
    if not prov.get("dirty"):
        return ""
    ds = prov.get("dirty_sources")
    if ds is None:
        return " (dirty tree)"
    return f" (uncommitted changes to {', '.join(ds)})" if ds else " (uncommitted changes, none in its sources)"


def fmt_bytes(b: float | None) -> str:
    """A byte count in B, KB, MB or GB (powers of 1,024); ``-`` for none."""
    if b is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GB"


#: the race's figure, in words: test accuracy (up to the target) for a classifier,
#: held-out bits per byte (down to the target) for a language model
METRIC_WORDS = {"test_acc": "test accuracy", "test_bpb": "test bits per byte"}


def fmt_score(metric: str, v: float | None) -> str:
    """The race's figure: a percentage of test accuracy, or bits per byte."""
    return "-" if v is None else (f"{v:.2%}" if metric == "test_acc" else f"{v:.3f} bpb")


def own_line(row: dict, k: int = 5) -> str:
    """experiments/sim_epoch_profile.py: the ``k`` largest own times outside the steps, as one line."""
    return "; ".join(f"`{t['function']}` {t['own_s']:.2f} s ({t['calls']:,} calls)" for t in row["own"][:k])


def sgp_summary(rows: list[dict]) -> list[dict]:
    """experiments/sgp_overlap.py: per (rate, overlap), the step time (minimum over the
    repeats of each run's median step), its 90th percentile (minimum over repeats), and
    the median over repeats of the time waiting on the exchange and computing; overlap
    0's rows also carry max(compute, comm) and their sum, what overlap 1 can reach at
    best and what it starts from."""
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        for overlap in (0, 1):
            rs = [r for r in rows if r["rate"] == rate and r["overlap"] == overlap]
            if not rs:
                continue
            comm = statistics.median(r["comm_s_per_step"] for r in rs)
            comp = statistics.median(r["compute_s_per_step"] for r in rs)
            s = {"rate": rate, "overlap": overlap, "step_s": min(r["step_s"] for r in rs),
                 "step_s_p90": min(r["step_s_p90"] for r in rs), "comm_s_per_step": comm,
                 "compute_s_per_step": comp, "repeats": len(rs)}
            if overlap == 0:
                s.update(max_s=max(comp, comm), sum_s=comp + comm)
            out.append(s)
    return out


def _fmt_spec(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def _ms(seconds: Any) -> str:
    return f"{1e3 * seconds:.1f} ms" if isinstance(seconds, (int, float)) else "-"


def _why(err: str) -> str:
    return "refused (memory)" if "GiB" in err else ("not run" if err.startswith("not run") else err.split(";")[0][:40])


def bench_sim_table(rows: list[dict]) -> str:
    """experiments/bench_sim.py: both paths' node-steps per second and step times; where
    the rows carry a roofline (runs on the CPU), the ratio it bounds and the fraction of
    it reached."""
    roof = any("roofline_fraction" in r for r in rows)
    return md(["model", "params", "nodes", "loop node-steps/s", "vectorized node-steps/s", "ratio", "loop step",
                "vectorized step", *(["roofline step", "ratio bound", "of the bound"] if roof else [])],
               [[r["model"], _fmt_spec(r.get("params"), ","), f"{r['nodes']:,}",
                 _fmt_spec(r.get("loop_node_steps_per_s"), ",.0f") if "loop_error" not in r else _why(r["loop_error"]),
                 _fmt_spec(r.get("vectorized_node_steps_per_s"), ",.0f") if "vectorized_error" not in r
                 else _why(r["vectorized_error"]),
                 f"{_fmt_spec(r.get('ratio'), '.1f')}{'x' if 'ratio' in r else ''}", _ms(r.get("loop_step_s")),
                 _ms(r.get("vectorized_step_s")),
                 *([_ms((r.get("roofline") or {}).get("step_s")),
                    f"{_fmt_spec(r.get('roofline_ratio'), '.1f')}{'x' if 'roofline_ratio' in r else ''}",
                    _fmt_spec(r.get("roofline_fraction"), ".0%")] if roof else [])] for r in rows])


def bench_sim_epoch_table(epochs: list[dict]) -> str:
    """experiments/bench_sim.py: the one-epoch runs: wall time, the part in the steps, and the share outside them."""
    return md(["one epoch, vectorized", "nodes", "steps", "total", "in the steps", "set-up", "outside the steps"],
               [[e["model"], f"{e['nodes']:,}", str(e["steps"]), f"{e['total_s']:.2f} s", f"{e['steps_s']:.2f} s",
                 f"{e['setup_s']:.2f} s", f"{e['outside_share']:.0%}"] for e in epochs])


def sim_epoch_profile_table(rows: list[dict]) -> str:
    """experiments/sim_epoch_profile.py: a one-epoch run's wall time by phase, then the
    largest own times outside the steps."""
    phases = list(rows[0]["phases_s"]) if rows else []  # the phases in the order the run recorded them
    table = md(["model", "nodes", "steps", "total", *(p if p != "setup" else "set-up" for p in phases),
                 "outside the steps"],
                [[r["model"], f"{r['nodes']:,}", str(r["steps"]), f"{r['total_s']:.2f} s",
                  *(f"{r['phases_s'][p]:.2f} s" for p in phases), f"{r['outside_share']:.0%}"] for r in rows])
    own = [f"- {r['model']}, {r['nodes']:,} nodes: {own_line(r)}" for r in rows]
    return "\n".join([table, "", "The largest own times outside the steps (cProfile, which slows Python-bound code):",
                      "", *own])


def _med(xs: list[float]) -> str:
    m = statistics.median(xs)
    return f"{m:.2f} s" + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def bench_topologies_table(res: dict) -> str:
    """experiments/bench_topologies.py: per command its wall and CPU time, per graph the split."""
    rows = []
    for label, c in res["cli"].items():
        s = res["split"].get(label)
        rows.append([label, _med(c["wall_s"]), f"{statistics.median(c['user_s']):.2f} s",
                     _med(s["build_s"]) if s else "", _med(s["spectrum_s"]) if s else ""])
    return md([f"`python -m topologies ...`, n = {res['n']:,}", f"wall, median of {res['repeats']} (range)",
                "CPU (user), median", "build, median (range)", "spectrum, median (range)"], rows)


def cold_start_table(res: dict) -> str:
    """experiments/cold_start.py: each row's first and second encode+decode against the
    target, under a line saying how the processes started."""
    n, rows, target = res["numel"], res["rows"], res["target_first_s"]
    caches = "cache" in rows[0] if rows else False
    head = [f"compressor ({n:,} values, {res['threads']} thread{'s' if res['threads'] != 1 else ''})",
            *(["inductor cache", "backend", "compiled in the first call"] if caches else []),
            "first encode+decode", "second", f"first under {target:g} s"]
    body = [[r["compressor"], *([r["cache"], f"`{r['backend']}`", "yes" if r["compiled_first"] else "no"]
                                if caches else []),
             f"{r['first_s']:.2f} s", f"{r['second_s']:.2f} s", "yes" if r["first_s"] < target else "**no**"]
            for r in rows]
    if caches:
        intro = (f"Each row in a fresh process on a cache folder of its own (`--caches`), torch {res['torch']}; "
                 f"the target applies to the empty cache:")
    else:
        intro = f"Backend `{res['backend']}`, inductor cache {res['inductor_cache']} at the start, torch {res['torch']}:"
    return intro + "\n\n" + md(head, body)


def crossover_check_table(rows: list[dict]) -> str:
    """experiments/crossover_check.py: gossip.tools.crossover's predicted step beside the
    step measured on shaped links."""
    def iface(t: dict) -> str:
        v = t["iface_bytes_per_step"]
        return "-" if v is None or v != v else f"{v:,.0f}"

    return md(["algo", "bandwidth", "latency", "predicted step", "measured step", "predicted / measured",
                "bytes/step predicted", "ledger", "interface"],
               [[t["algo"], f"{t['bandwidth_mbit']:g} Mbit/s", f"{t['latency_ms']:g} ms ({t['latency_mode']})",
                 f"{1e3 * t['predicted_s']:.1f} ms", f"{1e3 * t['measured_s']:.1f} ms",
                 f"{t['predicted_over_measured']:.2f}", f"{t['bytes_predicted']:,.0f}", f"{t['bytes_measured']:,.0f}",
                 iface(t)] for t in rows])


def ecd_recipes_table(res: dict) -> str:
    """The study experiments/studies/ecd_recipes.toml: one row per recipe: epochs, the last epoch's accuracy,
    the best one (its epoch)."""
    body = []
    for r in res["runs"].values():
        best = max(r["points"], key=lambda p: p["test_acc"]) if r["points"] else None
        body.append([r["label"], str(r["epochs"]), pct(r["final_test_acc"]),
                     "-" if best is None else f"{pct(best['test_acc'])} ({best['epoch']:g})"])
    return md(["recipe (on top of `--algo ecd --bits 8 --topology ring`)", "epochs", "last", "best"], body)


def sharded_accuracy_table(res: dict) -> str:
    """The study experiments/studies/sharded_accuracy.toml: each method's sharded and all-gathered runs
    (and the fp32 all-reduce reference), final and best accuracy, the sharded form's
    difference in points, bytes per node per step and their ratio to all-reduce's."""
    rows = res["rows"]
    ref = next((r["bytes_per_node_per_step"] for r in rows if r["exchange"] == "fp32"), None)
    acc = {(r["method"], r["exchange"]): r["final_test_acc"] for r in rows}
    body = []
    for r in rows:
        other = acc.get((r["method"], "allgather")) if r["exchange"] == "sharded" else None
        diff = "-" if other is None else f"{100 * (r['final_test_acc'] - other):+.1f}"
        best = pct(r["best_test_acc"]) + ("" if r.get("best_epoch") is None else f" ({r['best_epoch']:g})")
        b = r["bytes_per_node_per_step"]
        body.append([r["method"], "fp32 all-reduce" if r["exchange"] == "fp32" else r["exchange"],
                     pct(r["final_test_acc"]), best, diff, f"{b:,.0f}", "-" if not ref else f"{b / ref:.3f}"])
    return md([f"method ({res['nodes']} nodes, {res['epochs']} epochs)", "exchange", "final test accuracy",
               "best (epoch)", "sharded - all-gathered (points)", "bytes/node/step", "vs fp32 all-reduce"], body)


#: the two-sided 95 % Student-t quantile for k samples (k - 1 degrees of freedom), k = 2..10
_T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}


def _mean_interval(xs: list[float], clip: bool = False) -> str:
    """``m %`` with its 95 % Student-t interval over the samples, in percent; ``clip``:
    the interval cut to [0, 100], an accuracy's range (a few seeds that part ways give
    a t-interval wider than it)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{100 * m:.1f} % (one seed)"
    h = _T95.get(len(xs), 1.96) * statistics.stdev(xs) / len(xs) ** 0.5
    lo, hi = (max(0.0, m - h), min(1.0, m + h)) if clip else (m - h, m + h)
    return f"{100 * m:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}]"


def trust_table(res: dict) -> str:
    """The study experiments/studies/trust.toml: per method, attack and defence, the final
    test accuracy over the seeds (mean and 95 % Student-t interval; a run that diverged
    has none and is counted apart), its difference in points to the clean run of the same
    method and defence-less protocol, and the bytes each node sent per step."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in res["rows"]:
        groups.setdefault((r["method"], r["attack"], r["defence"]), []).append(r)
    clean = {m: statistics.fmean(x["final_test_acc"] for x in rs if x.get("final_test_acc") is not None)
             for (m, a, d), rs in groups.items() if a == "none" and d == "none"
             and any(x.get("final_test_acc") is not None for x in rs)}
    body = []
    for (m, a, d), rs in groups.items():
        accs = [x["final_test_acc"] for x in rs if x.get("final_test_acc") is not None]
        div = len(rs) - len(accs)
        cell = _mean_interval(accs) if accs else "-"
        if div:
            cell += f"; diverged in {div} of {len(rs)}"
        gap = "-" if not accs or m not in clean else f"{100 * (statistics.fmean(accs) - clean[m]):+.1f}"
        b = [x["bytes_per_node_per_step"] for x in rs if x.get("bytes_per_node_per_step") is not None]
        body.append([f"`{m}`", a, d, str(len(rs)), cell, gap, "-" if not b else f"{statistics.fmean(b):,.0f}"])
    return md([f"method ({res['nodes']} nodes, {res['epochs']} epochs)", "attack", "defence", "seeds",
               "final test accuracy (mean [95 % interval])", "vs clean (points)", "bytes/node/step"], body)


def _trust_cell(rs: list[dict]) -> tuple[str, tuple[float, float]]:
    """One cell of :func:`trust_matrix`: the mean final accuracy (in %) over the seeds
    with its 95 % interval, and the diverged runs counted apart; with its sort key for
    the worst attack (the larger share of diverged runs first, then the lower mean)."""
    accs = [x["final_test_acc"] for x in rs if x.get("final_test_acc") is not None]
    div = len(rs) - len(accs)
    if not accs:
        return f"diverged {div}/{len(rs)}", (-1.0, 0.0)
    cell = _mean_interval(accs, clip=True).replace(" %", "").replace(" (one seed)", " (1 seed)")
    if div:
        cell += f", diverged {div}/{len(rs)}"
    return cell, (-div / len(rs), statistics.fmean(accs))


def trust_matrix(res: dict) -> str:
    """A trust study's results at a glance, as the benchmark's adversarial track shows
    them: one row per method and defence, one column per attack (``clean`` first), each
    cell the final test accuracy in % (mean over the seeds [95 % Student-t interval, cut to 0-100];
    runs that diverged counted apart), and the attack that hurt the row most (the most
    runs diverged, then the lowest mean)."""
    attacks: list[str] = []
    groups: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for r in res["rows"]:
        if r["attack"] not in attacks and r["attack"] != "none":
            attacks.append(r["attack"])
        groups.setdefault((r["method"], r["defence"]), {}).setdefault(r["attack"], []).append(r)
    body = []
    for (m, d), cells in groups.items():
        row = [f"`{m}`" + ("" if d == "none" else f" + {d}")]
        worst: tuple[tuple[float, float], str] | None = None
        for a in ["none", *attacks]:
            if a not in cells:
                row.append("-")
                continue
            text, key = _trust_cell(cells[a])
            row.append(text)
            if a != "none" and (worst is None or key < worst[0]):
                worst = (key, a)
        row.append("-" if worst is None else worst[1])
        body.append(row)
    seeds = len({r["seed"] for r in res["rows"]})
    k = res.get("byzantine", 1)
    head = (f"method + defence ({res['nodes']} nodes, {k} attacker{'s' if k != 1 else ''}, "
            f"{res['epochs']} epochs, {seeds} seeds)")
    return md([head, "clean", *attacks, "worst attack"], body)


def _pct0(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _pct2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def gossip_compare_table(results: dict, bw_labels: list[str]) -> str:
    """The study experiments/studies/gossip_compare.toml: the decentralized methods on sorted shards."""
    body = []
    for name, r in results.items():
        last = r["points"][-1] if r["points"] else None
        times = ["-" if last is None else f"{t:.3g} s" for t in (last["time_s"] if last else bw_labels)]
        best = max((p["test_acc"] for p in r["points"]), default=None)
        body.append([name, r["topology"], r["wire"]["label"], fmt_bytes(r["bytes_per_step"]),
                     fmt_bytes(last["bytes"] if last else None), *times,
                     "-" if best is None else f"{best:.2%}", f"{r['final_test_acc']:.2%}"])
    return md(["method", "graph", "wire", "bytes/node/step", "bytes/node total",
                *(f"time @ {b}" for b in bw_labels), "best acc", "final acc"], body)


def modern_compare_table(results: dict) -> str:
    """The study experiments/studies/modern_compare.toml: the tuned grid, final accuracy and bytes of each method."""
    body = []
    for name, r in results.items():
        ratio, margin = r.get("bytes_vs_allreduce"), r.get("acc_minus_allreduce")
        grid = ", ".join(f"{g['lr']:g}: {_pct2(g['val_acc'])}" for g in r["grid"])
        body.append([name, r["wire"]["label"] if r.get("wire") else "-", grid,
                     "-" if r["lr"] is None else f"{r['lr']:g}", fmt_bytes(r.get("bytes_per_step")),
                     "-" if ratio is None else f"{ratio:.4g}x", _pct2(r.get("final_test_acc")),
                     _pct2(r.get("best_test_acc")), "-" if margin is None else f"{100 * margin:+.2f} pt"])
    return md(["method", "wire", "lr grid: validation acc", "lr", "bytes/node/step", "vs allreduce bytes",
                "final acc", "best acc", "final - allreduce"], body)


def netns_gap_table(res: dict) -> str:
    """experiments/netns_gap.py: each measured time to target split into training and evaluations."""
    body = []
    for r in res["runs"]:
        body.append([
            r["bandwidth"], r["method"], f"{r['measured_s']:.1f} s", str(r["evaluations"]),
            f"{r['eval_s']:.1f} s ({r['eval_share']:.0%})",
            f"{r['eval_median_s']:.2f} s ({r['eval_wire_s']:.2f} s)", f"**{r['measured_less_eval_s']:.1f} s**",
            f"{r['compute_s']:.1f} s / " + ("-" if r["simulated_compute_s"] is None else
                                            f"{r['simulated_compute_s']:.1f} s"),
            f"{r['model_s']:.1f} s: {_pct0(r['model_error'])} → **{_pct0(r['model_error_less_eval'])}**",
            "-" if r["simulated_s"] is None else
            f"{r['simulated_s']:.1f} s: {_pct0(r['simulated_error'])} → **{_pct0(r['simulated_error_less_eval'])}**"])
    return md(["bandwidth", "method", "measured", "evaluations", "their time (share)",
                "median one (2 all-reduces at the link rate)", "measured less evaluations",
                "compute and codec to the target: ranks / simulated trial",
                "same run modelled: error → less evaluations", "simulated trial modelled: error → less evaluations"],
               body)


def _rate_text(rate: str) -> str:
    num = rate.lower().removesuffix("mbit")
    return f"{num} Mbit/s" if num != rate.lower() else rate


def sgp_overlap_table(res: dict) -> str:
    """experiments/sgp_overlap.py: SGP's step with and without overlap, per link rate."""
    body = [[_rate_text(s["rate"]), str(s["overlap"]), f"{s['step_s']:.3f} s", f"{s['step_s_p90']:.3f} s",
             f"{s['compute_s_per_step']:.3f} s", f"{s['comm_s_per_step']:.3f} s",
             f"{s['max_s']:.3f} s / {s['sum_s']:.3f} s" if s["overlap"] == 0 else ""]
            for s in sgp_summary(res["rows"])]
    return md(["link", "overlap", "step, min over repeats", "step p90", "compute", "waiting on the exchange",
                "max / sum of the two (overlap 0)"], body)


def sharded_bytes_table(res: dict) -> str:
    """experiments/sharded_bytes.py: per case the payload of the whole vector, the
    measured bytes at each n as a multiple of 2 (n - 1)/n x payload (/ H), and the
    all-gather's multiple at the largest n."""
    nodes, top = res["nodes"], max(res["nodes"])
    body = [[r["case"], f"{r['payload_bytes']:,}" + (f" / {r['steps']}" if r["steps"] > 1 else ""),
             *(f"{r['per_n'][str(n)]['vs_two_ring_legs']:.3f}x" for n in nodes), f"{top / 2:g}x"]
            for r in res["rows"]]
    return md(["bytes/node/step", "payload", *(f"n = {n}" for n in nodes), f"all-gather at n = {top} (computed)"],
               body)


def adpsgd_torchrun_table(res: dict) -> str:
    """experiments/adpsgd_torchrun.py: steps per second of the fast ranks and of the slow
    one, best of the repeats, for D-PSGD and AD-PSGD under torchrun."""
    rows = ["| algorithm | fast ranks (steps/s, best of repeats) | slow rank (steps/s) | fast vs dpsgd |",
            "|---|---|---|---|"]
    base = res["best_fast_steps_per_s"]["dpsgd"]
    for algo, runs in res["runs"].items():
        best = max(runs, key=lambda x: x["fast"])
        rows.append(f"| `{algo}` | {best['fast']:.1f} | {best['rates'][0]:.1f} | {best['fast'] / base:.2f}x |")
    return "\n".join(rows)


def adpsgd_netns_table(res: dict) -> str:
    """experiments/adpsgd_netns.py: each rank's steps per second (rank 0 first) in the
    run whose fast ranks were quickest, and the fast ranks' mean against dpsgd's at the
    same speeds, for D-PSGD and AD-PSGD with every rank at speed 1 and with rank 0
    slowed, on shaped links."""
    body = []
    for key, runs in res["runs"].items():
        algo, speed = key.split(" ")
        best = max(runs, key=lambda x: x["fast"])
        same = res["best_fast_steps_per_s"][f"dpsgd {speed}"]
        label = "all at speed 1" if speed == "uniform" else f"rank 0 {res['factor']:g}x slower"
        body.append([f"`{algo}`", label, ", ".join(f"{r:.1f}" for r in best["rates"]), f"{best['fast']:.1f}",
                     f"{best['fast'] / same:.2f}x"])
    return md(["algorithm", "speeds", "each rank (steps/s, rank 0 first)", "fast ranks' mean (best of repeats)",
               "vs dpsgd's"], body)


def groups_netns_table(res: dict) -> str:
    """experiments/groups_netns.py: per setting (flat, in groups), the fastest run's step
    time, per host what crossed the shaped link and what stayed on its loopback (the
    kernel's counters), and what the run reports each rank sending per step."""
    h = res["hosts"]
    body = []
    for name, runs in res["runs"].items():
        r = min(runs, key=lambda x: x["s_per_step"])
        label = "flat (`--group-size 1`)" if name == "flat" else f"groups (`--group-size {res['per_host']}`)"
        lv = r.get("bytes_by_level")
        reported = (fmt_bytes(r["bytes_per_rank_per_step"]) if not lv else
                    f"{fmt_bytes(lv['inter'])} between groups, {fmt_bytes(lv['intra'])} inside")
        body.append([label, f"{1000 * r['s_per_step']:.1f} ms", f"{1000 * r['wait_s_per_step']:.1f} ms",
                     fmt_bytes(sum(r["interface_sent"]) / h), fmt_bytes(sum(r["loopback"]) / h), reported])
    return md(["setting", "step time (fastest run)", "waiting on exchanges", "link: sent per host (interface)",
               "loopback per host", "a rank's bytes per step (summary.json)"], body)


def diloco_eager_netns_table(res: dict) -> str:
    """experiments/diloco_eager_netns.py: the step time of the synchronous and of the
    eager outer step on shaped links, with the wait on exchanges per step of each
    method's fastest run."""
    runs, waits = res["runs_s_per_step"], res["wait_s_per_step"]
    base = min(runs["diloco"])
    body = [[f"`{m}`", f"{1000 * min(v):.1f} ms", ", ".join(f"{1000 * x:.1f}" for x in v), f"{min(v) / base:.3f}",
             f"{1000 * waits[m][v.index(min(v))]:.1f} ms/step"] for m, v in runs.items()]
    return md(["method", "min step time", "runs (ms/step)", "vs diloco", "waiting on exchanges (fastest run)"], body)


def streaming_overlap_table(runs: dict[str, list[float]], waits: dict[str, list[float]] | None = None) -> str:
    """experiments/streaming_overlap.py: the step time per tau (tau "0" first), with the
    wait on exchanges per step of the fastest run of each tau where recorded."""
    base = min(runs["0"])
    body = []
    for t, v in runs.items():
        row = [t, f"{1000 * min(v):.1f} ms", ", ".join(f"{1000 * x:.1f}" for x in v), f"{min(v) / base:.3f}"]
        if waits:
            row.append(f"{1000 * waits[t][v.index(min(v))]:.1f} ms/step")
        body.append(row)
    return md(["tau", "min step time", "runs (ms/step)", "vs tau = 0",
                *(["waiting on exchanges (fastest run)"] if waits else [])], body)


def _target_text(results: dict, target: float) -> str:
    metric = next((r.get("metric") for r in results.values() if r.get("metric")), "test_acc")
    return f"{target:.0%}" if metric == "test_acc" else f"{target:g} bpb"


def race_table(results: dict, target: float, bw_labels: list[str]) -> str:
    """experiments/race.py (simulated mode): bytes and modelled time to the target."""
    body = []
    for name, r in results.items():
        t = r["to_target"]
        metric = r.get("metric", "test_acc")
        final = r["final_test_acc"] if metric == "test_acc" else r.get("final_score")
        body.append([name, r["wire"]["label"], "not reached" if t["epoch"] is None else f"{t['epoch']:.0f}",
                     fmt_bytes(t["bytes"]), *("-" if s is None else f"{s:.3g} s" for s in t["time_s"]),
                     fmt_score(metric, final)])
    return md(["method", "wire", f"epoch to {_target_text(results, target)}", "bytes/node to target",
                *(f"time to target @ {b}" for b in bw_labels), "final"], body)


def race_netns_table(results: dict, target: float, bw_labels: list[str]) -> str:
    """experiments/race.py --mode netns: one row per run: to target, measured and
    modelled; the first step; the end."""
    runs = [run for r in results.values() for run in r["runs"].values()]
    metric = next((run.get("metric") for run in runs if run.get("metric")), "test_acc")
    body = []
    for bw in bw_labels:
        for name, r in results.items():
            run = r["runs"].get(bw)
            if run is None:
                continue
            t, pts = run["to_target"], run["points"]
            if not pts:
                end = last = "failed" if not run["ok"] else "-"
            else:
                how = "stopped at target" if run["stopped_at_target"] else ("last epoch" if run["ok"] else "failed")
                end = f"{fmt_score(metric, run.get('last_score', run['last_test_acc']))} ({run['last_epoch']:.0f}, {how})"
                q = pts[-1]
                last = f"{q['time_s']:.1f} s / {q['model_s']:.1f} s ({_pct0(q['model_s'] / q['time_s'] - 1)})"
            reached = t["time_s"] is not None
            body.append([
                bw, name, run["wire"]["label"], f"{t['epoch']:.0f}" if reached else "not reached",
                fmt_bytes(t["bytes"]), f"{t['time_s']:.1f} s" if reached else "-",
                f"{t['model_s']:.1f} s ({_pct0(t['model_error'])})" if reached else "-",
                f"{t['warmup_s']:.1f} s" if reached else "-", _pct0(t.get("model_error_after_first_step")),
                end, last, f"{run['load_average'][0]:.1f}→{run['load_average'][1]:.1f}", run["date"][:16]])
    return md(["bandwidth", "method", "wire", f"epoch to {_target_text({'_': {'metric': metric}}, target)}",
                "bytes/node to target", "time to target, measured", "modelled (error)", "first step, measured",
                "model error, first step left out", f"{METRIC_WORDS[metric]} at the end (epoch)",
                "last evaluation: measured / modelled", "load start→end", "date (UTC)"], body)

def benchmark_netns_table(res: dict) -> str:
    """experiments/benchmark_netns.py: one row per run: measured time to target, the race
    model of the same run, and the benchmark's model of the simulated trial."""
    target, metric = res["target"], res["metric"]
    tgt = f"{target:.0%}" if metric == "test_acc" else f"{target:.3f} bpb"
    body = []
    for bw in res["bandwidths"]:
        for name, per_bw in res["runs"].items():
            run = per_bw.get(bw)
            if run is None:
                continue
            t = run["to_target"]
            reached = t["time_s"] is not None
            how = "stopped at target" if run["stopped_at_target"] else ("last epoch" if run["ok"] else "failed")
            end = "-" if not run["points"] else (
                f"{fmt_score(metric, run['last_score'])} (epoch {run['last_epoch']:.0f}, {how})")
            sim = run.get("simulated_time_s")
            body.append([
                bw, name, f"{run['lr']:g}", (run.get("wire") or {}).get("label", "?"),
                f"{t['epoch']:.0f}" if reached else "not reached", fmt_bytes(t["bytes"]),
                f"{t['time_s']:.1f} s" if reached else "-",
                f"{t['model_s']:.1f} s ({_pct0(t['model_error'])})" if reached else "-",
                "-" if sim is None else f"{sim:.1f} s" + (f" ({_pct0(run['simulated_error'])})" if reached else ""),
                f"{t['warmup_s']:.1f} s" if reached else "-", end,
                f"{run['load_average'][0]:.1f}→{run['load_average'][1]:.1f}", run["date"][:16]])
    return md(["bandwidth", "method", "lr", "wire", f"epoch to {tgt}", "bytes/node to target",
               "time to target, measured", "same run, modelled (error)", "simulated trial, modelled (error)",
               "first step", "end", "load start→end", "date (UTC)"], body)


def benchmark_netns_section(res: dict, prov: dict | None = None) -> str:
    """The report's section on the measured runs (Markdown)."""
    prov = prov or res.get("provenance") or {}
    m = prov.get("machine", {})
    errs = [r["simulated_error"] for per in res["runs"].values() for r in per.values()
            if r.get("simulated_error") is not None]
    lines = [
        f"## Measured in the netns cluster ({res['nodes']} nodes)",
        "",
        f"{res['workload']}, {res['nodes']} torchrun ranks in network namespaces, each host's link shaped with tc "
        f"to the bandwidth (no latency added); each method as its final trial of seed {res['seed']} ran "
        "(its tuned learning rate), stopped at the first evaluation at the target. \"Same run, modelled\": the "
        "race's model fed with this run's bytes and measured compute and codec time; \"simulated trial, "
        "modelled\": the benchmark's modelled time of the simulated trial at the same link (the error is "
        "modelled / measured - 1).",
        "",
        benchmark_netns_table(res),
        "",
        (f"Made by `{prov.get('command', '?')}` at commit `{(prov.get('commit') or '?')[:10]}`"
         f"{tree_note(prov)} on {(prov.get('date') or '?')[:16]}, "
         f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores), load {prov.get('load_before', '?')} before"
         + (f"; it resumed {len(res['sessions'])} earlier session(s) ("
            + ", ".join(f"`{x.get('command', '?')}` at `{(x.get('commit') or '?')[:10]}` on "
                        f"{(x.get('date') or '?')[:16]}" for x in res["sessions"]) + ")"
            if res.get("sessions") else "")
         + (f"; the simulated trials' model against the measured time: median "
            f"{sorted(errs)[len(errs) // 2]:+.0%}, range {min(errs):+.0%} to {max(errs):+.0%}" if errs else "")
         + "."),
    ]
    if res.get("interrupted"):
        lines += ["", f"This run was interrupted ({res['interrupted']}); the table holds the runs that finished."]
    unreached = res.get("unreached") or {}
    if unreached:
        lines += ["", "Not measured where the simulated trial did not reach the target at that link (the run "
                      "would give no time to target): " + "; ".join(f"{m} at {', '.join(b)}"
                                                                     for m, b in unreached.items()) + "."]
    missing = res.get("not_run") or []
    if missing:
        lines += ["", f"Not measured (not asked for with --methods in any session, or no finished final run of "
                      f"seed {res['seed']}): {', '.join(missing)}."]
    return "\n".join(lines)
