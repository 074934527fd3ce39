"""Which method for my link? The benchmark's measured answer, for ``gossip.tools.crossover``.

``experiments/benchmark.py`` writes ``benchmark.json``: per workload, node count and
link (bandwidth x latency), every method's time to its target over several seeds, with
a 95 % interval. :func:`answer` reads it for a user's link and node count: it picks
the nearest benchmarked link and node count (in log scale; latency 0 counts as 0.1 ms),
ranks the methods that reached the target with every seed by their mean time there,
and says how far the user's model size is from the benchmarked model's. The crossover
tool prints it next to its own model of the step (``--benchmark FILE``).
:func:`verdict_table` is the README's summary of the same file: per workload, node count
and bandwidth, the fastest method at each latency and its margin over the second.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gossip.tools.units import fmt_rate, parse_rate, parse_time

__all__ = ["LeaderboardError", "load", "answer", "render", "fmt_metric", "verdict_table", "field_label"]


class LeaderboardError(ValueError):
    """A benchmark results file that cannot be read or used; one line."""


def load(path: str | Path) -> dict[str, Any]:
    """A ``benchmark.json`` written by ``experiments/benchmark.py``; one line if it is not one."""
    path = Path(path)
    try:
        res = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LeaderboardError(f"--benchmark {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise LeaderboardError(f"--benchmark {path}: not a benchmark results file ({e})") from None
    if isinstance(res, dict) and isinstance(res.get("results"), dict) and "provenance" in res:
        res = res["results"]  # written with its provenance record
    if not isinstance(res, dict) or not isinstance(res.get("workloads"), dict) or not isinstance(res.get("links"), list):
        raise LeaderboardError(f"--benchmark {path}: not a benchmark results file (no 'workloads' and 'links')")
    return res


def _log(x: float, floor: float) -> float:
    return math.log(max(x, floor))


def _nearest_link(links: list[str], bandwidth: float, latency: float) -> str:
    def dist(key: str) -> float:
        b, _, lat = key.partition("@")
        return abs(_log(parse_rate(b), 1.0) - _log(bandwidth, 1.0)) + \
            abs(_log(parse_time(lat), 1e-4) - _log(latency, 1e-4))

    try:
        return min(links, key=dist)
    except ValueError as e:  # a link label the results file should not hold
        raise LeaderboardError(f"--benchmark: a link of the results is not BANDWIDTH@LATENCY ({e})") from None


def answer(res: dict[str, Any], bandwidth: float, latency: float, nodes: int, params: int | None = None,
           top: int = 3) -> list[dict[str, Any]]:
    """Per workload: the nearest benchmarked link and node count, and the ``top`` methods
    that reached the target fastest there (mean and 95 % interval of the time)."""
    if not res["links"]:
        raise LeaderboardError("--benchmark: the results hold no link")
    link = _nearest_link(res["links"], bandwidth, latency)
    out = []
    for wname, w in res["workloads"].items():
        if not w["nodes"]:
            continue
        n = min(w["nodes"], key=lambda k: abs(math.log(int(k)) - math.log(nodes)))
        ranked = []
        for name, m in w["nodes"][n]["methods"].items():
            st = m.get("links", {}).get(link)
            if st and st["all_reached"]:
                ranked.append({"method": name, "wire": m.get("wire"), "time_s": st["time_s"],
                               "bytes": st["bytes"], "lr": m.get("lr")})
        ranked.sort(key=lambda r: r["time_s"]["mean"])
        bp = w.get("params")
        out.append({"workload": wname, "link": link, "nodes": int(n), "target": w["target"], "metric": w["metric"],
                    "params": bp, "size_ratio": (params / bp) if params and bp else None, "methods": ranked[:top],
                    "reached": len(ranked), "ranked_of": len(w["nodes"][n]["methods"])})
    return out


def render(ans: list[dict[str, Any]], bandwidth: float, latency: float, nodes: int) -> str:
    """The answers of :func:`answer` as the text ``gossip.tools.crossover`` prints.

    Per workload: the nearest benchmarked point and its methods ranked by mean time,
    with their 95 % intervals."""
    lines = [f"measured in the benchmark, for {fmt_rate(bandwidth)}, latency {1e3 * latency:g} ms, {nodes} nodes:"]
    for a in ans:
        size = "" if a["size_ratio"] is None else (
            f"; your model is {a['size_ratio']:.3g}x its {a['params']:,} parameters"
            + (" (far from it: bytes scale with size, compute does not in the same way)"
               if not 0.1 <= a["size_ratio"] <= 10 else ""))
        lines.append(f"  {a['workload']} at the nearest benchmarked point ({a['link']}, {a['nodes']} nodes), "
                     f"time to {a['metric']} {a['target']:g}{size}:")
        if not a["methods"]:
            lines.append("    no method reached the target with every seed there")
        for i, m in enumerate(a["methods"], 1):
            t = m["time_s"]
            ci = "" if t["lo"] is None else f" [{max(0.0, t['lo']):.3g}, {t['hi']:.3g}]"
            lines.append(f"    {i}. {m['method']} ({m['wire']}): {t['mean']:.3g} s{ci}")
        lines.append(f"    ({a['reached']} of {a['ranked_of']} methods reached it with every seed)")
    return "\n".join(lines)


def fmt_metric(metric: str, x: float | None) -> str:
    """A workload's metric as the reports print it: accuracy in %, bits per byte, loss."""
    if x is None:
        return "-"
    if "acc" in metric:
        return f"{x:.2%}"
    return f"{x:.3f} bpb" if metric.endswith("bpb") else f"{x:.4g}"


def _fmt_s(x: float) -> str:
    return f"{x:.3g} s" if x < 1000 else f"{x:.0f} s"


def field_label(n: str, nd: dict[str, Any]) -> str:
    """A node count of a benchmark's results, with the part of the field its verdicts
    cover while that is not all of it ("64 (9 of 26 methods)": the methods whose final
    runs have all finished); results made before the field was recorded give the node
    count alone."""
    field = nd.get("field")
    if not field or len(field["complete"]) >= len(field["planned"]):
        return str(n)
    return f"{n} ({len(field['complete'])} of {len(field['planned'])} methods)"


def verdict_table(res: dict[str, Any]) -> str:
    """The verdicts of a benchmark's results as a compact Markdown table: one row per
    workload, node count and bandwidth, one column per latency; a cell names the
    fastest method to the target, its mean time and its margin over the second, marked
    \u2713 where the lead is beyond both 95 % intervals."""
    bws: list[str] = []
    lats: list[str] = []
    for key in res["links"]:
        b, _, lat = key.partition("@")
        bws += [b] if b not in bws else []
        lats += [lat] if lat not in lats else []
    head = ["workload (target)", "nodes", "bandwidth", *[f"latency {lat}" for lat in lats]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wname, w in res["workloads"].items():
        target = f"{wname} ({fmt_metric(w['metric'], w['target'])})"
        for n, nd in w["nodes"].items():
            for b in bws:
                cells = []
                for lat in lats:
                    v = nd["verdicts"].get(f"{b}@{lat}") or {"winner": None}
                    if v["winner"] is None:
                        cells.append("none reached it")
                        continue
                    cell = f"**{v['winner']}** {_fmt_s(v['time_s'])}"
                    if v.get("second"):
                        cell += f", {_fmt_s(v['margin_s'])} before {v['second']}" + (" \u2713" if v["separated"] else "")
                    cells.append(cell)
                rows.append("| " + " | ".join([target, field_label(n, nd), b, *cells]) + " |")
    return "\n".join(rows)
