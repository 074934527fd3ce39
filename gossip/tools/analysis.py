"""Load the logs of training runs and network sweeps into pandas, and plot them.

The notebooks in ``notebooks/`` and ``experiments/reproduce_tang2018.py`` are thin
callers of this module; everything they show can be had from Python:

.. code-block:: python

    from gossip.tools import analysis as ga

    runs, metrics = ga.load_runs("runs/")        # every run directory under runs/
    ga.final_table(runs)                         # final loss, accuracy, bytes, time
    ga.plot_train_loss(metrics, x="epoch")       # one line per run
    ga.plot_convergence(metrics)                 # the six panels of convergence.ipynb
    sweep = ga.load_sweep("runs/netsweep")       # experiments/sweep_network.py results
    ga.plot_sweep(sweep)                         # Tang et al. 2018 (arXiv:1803.06443) Fig. 3 style

A *run directory* is what ``python -m gossip.train --out DIR`` writes: ``config.json``,
one ``metrics-rank<k>.jsonl`` per node, and ``summary.json`` once the run has finished
(a run still going, or one that was killed, loads without it). Anything else raises
:class:`AnalysisError` with one line naming the path and what was expected.

Tables
------
``runs``: one row per run. ``run`` (its path relative to the directory given to
:func:`load_runs`), ``label`` (``algo/compressor/topology``, e.g.
``ecd/quant:bits=8/ring``, ``dpsgd/fp32/ring``, ``allreduce/fp32/-``; when two runs
would share a label, the config keys that tell them apart are appended, e.g.
``... n=16``), ``path``, ``complete`` (``summary.json`` exists), the main config keys
and the summary's figures (for an incomplete run, the last evaluation's).
``compressor`` and ``bits`` say what the run sent, as its algorithm described it
(``wire_source`` ``algorithm``); run directories written before runs recorded that
(schema 1) give the CLI's compressor spec instead, and ``wire_source`` says so
(``config (schema 1)``): their sign algorithms read ``fp32``, although they sent 1 bit.
``setup_traffic`` says how the per-step bytes were counted: ``apart`` (schema 3 on:
the one-off exchange of x_1 is in ``setup_bytes_per_node``, not in the per-step
figures) or ``folded in`` (older runs: step traffic includes it, which inflates the
per-step bytes and the D-PSGD ratio of short runs).
File names and keys come from :mod:`gossip.rundir`.

``metrics``: one row per record of the ``metrics-rank<k>.jsonl`` files, with ``run``,
``label``, ``rank`` and ``kind`` (``train`` or ``eval``) and the record's fields.
Evaluation records are identical in every rank's file (they are global figures), so
only the lowest rank's are kept. :func:`train_curves` averages the train records over
the ranks (the nodes' mean loss, bytes per node); :func:`eval_curves` selects the
evaluation records.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

try:
    import pandas as pd
except ImportError:  # an optional extra: say how to get it, in one line
    raise ImportError("gossip.tools.analysis needs pandas: pip install 'gossip[analysis]' "
                      "(pandas and matplotlib)") from None

from gossip import rundir

__all__ = [
    "AnalysisError",
    "Run",
    "Runs",
    "consensus_contraction",
    "eval_curves",
    "final_table",
    "find_runs",
    "find_sweeps",
    "is_run_dir",
    "load_run",
    "load_runs",
    "load_sweep",
    "plot_consensus",
    "plot_contraction",
    "plot_convergence",
    "plot_curves",
    "plot_loss_vs_bytes",
    "plot_spectral_gaps",
    "plot_sweep",
    "plot_test_accuracy",
    "plot_test_bpb",
    "plot_test_metric",
    "plot_train_loss",
    "run_label",
    "spectral_gaps",
    "train_curves",
]

_SWEEP_FILES = ("results.json", "results.csv")

#: config keys copied into the runs table, in this order
_RUN_CONFIG_KEYS = (
    "algo", "compressor_spec", "bits", "topology", "world_size", "partition", "model_name", "data",
    "batch_size", "lr", "lr_schedule", "momentum", "weight_decay", "epochs", "seed", "mode", "params",
)
#: summary keys copied into the runs table
_RUN_SUMMARY_KEYS = (
    "steps", "final_train_loss", "final_test_loss", "final_test_acc", "final_test_bpb", "final_test_ppl",
    "consensus_distance", "bytes_sent_per_node_per_step", "bytes_ratio_to_dpsgd", "setup_bytes_per_node", "bits_per_coord_measured",
    "wall_time_s", "warmup_s",
)
#: config keys that may tell two runs with the same label apart, with their short names
_DISAMBIGUATE = (
    ("algo_options", ""),  # shown as its own key=value pairs (choco's gamma, powersgd's rank)
    ("world_size", "n"), ("partition", "partition"), ("data", "data"), ("model_name", "model"),
    ("lr", "lr"), ("momentum", "momentum"), ("batch_size", "batch"), ("epochs", "epochs"),
    ("lr_schedule", "schedule"), ("weight_decay", "wd"), ("weights", "weights"), ("lazy", "lazy"),
    ("degree", "degree"), ("seed", "seed"),
)
def _is_centralized(algo: Any) -> bool:
    """True for the all-reduce family, whose runs have no topology. An algorithm this
    version does not know (a newer run's) counts as centralized only if it is allreduce."""
    from gossip import algorithms

    try:
        return not algorithms.is_decentralized(str(algo))
    except ValueError:
        return algo == "allreduce"


#: a consensus distance below this is rounding error: the nodes hold one model
_EXACT = 1e-9

#: x axes understood by the plotting helpers: column of the train/eval curves, axis label
_X_AXES = {
    "epoch": ("epoch", "epoch"),
    "step": ("step", "step"),
    "time": ("time", "wall time (s)"),
    "bytes": ("bytes_sent", "bytes sent per node"),
}


class AnalysisError(ValueError):
    """A path that holds no run (or no sweep results), or a damaged one: one line."""


class Run(NamedTuple):
    """One run directory, loaded."""

    name: str
    path: Path
    config: dict
    summary: dict | None
    metrics: pd.DataFrame
    label: str

    @property
    def complete(self) -> bool:
        return self.summary is not None


class Runs(NamedTuple):
    """Every run under a directory: ``runs, metrics = load_runs(dir)``."""

    runs: pd.DataFrame
    metrics: pd.DataFrame


# --------------------------------------------------------------------------------------
# loading runs
# --------------------------------------------------------------------------------------
def _metrics_files(path: Path) -> dict[int, Path]:
    return rundir.metrics_files(path)


def is_run_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds ``config.json`` and at least one ``metrics-rank<k>.jsonl``."""
    return rundir.is_run_dir(path)


def _read_json(path: Path, what: str) -> dict:
    try:
        return rundir.read_json(path, what)
    except rundir.RunDirError as e:
        raise AnalysisError(str(e)) from None


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return rundir.read_metrics(path)
    except rundir.RunDirError as e:
        raise AnalysisError(str(e)) from None


def run_label(config: dict, summary: dict | None = None) -> str:
    """``algo/compressor/topology`` of a run, from its config (and summary)."""
    src = {**config, **{k: v for k, v in (summary or {}).items() if v is not None}}
    algo = str(src.get("algo", "?"))
    comp = rundir.wire_of(config, summary)["label"]
    if _is_centralized(algo):
        topo = "-"
    else:
        topo = str(src.get("topology") or "-")
    return f"{algo}/{comp}/{topo}"


def _frame(records: list[dict], run: str, label: str, rank: int) -> pd.DataFrame:
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return df
    df.insert(0, "run", run)
    df.insert(1, "label", label)
    df.insert(2, "rank", rank)
    if "kind" not in df.columns:
        df["kind"] = "train"
    return df


def load_run(path: str | os.PathLike, *, name: str | None = None) -> Run:
    """Load one run directory (config, summary if the run finished, every rank's metrics)."""
    p = Path(path)
    if not p.exists():
        raise AnalysisError(f"{p}: no such directory")
    if not p.is_dir():
        raise AnalysisError(f"{p}: not a run directory (it is a file); give the directory python -m gossip.train --out wrote")
    if not rundir.config_path(p).is_file():
        raise AnalysisError(
            f"{p}: not a run directory (no config.json); a run directory holds config.json and "
            f"metrics-rank<k>.jsonl written by python -m gossip.train"
        )
    files = _metrics_files(p)
    if not files:
        raise AnalysisError(f"{p}: not a run directory (config.json but no metrics-rank<k>.jsonl)")
    config = _read_json(rundir.config_path(p), rundir.CONFIG)
    spath = rundir.summary_path(p)
    summary = _read_json(spath, rundir.SUMMARY) if spath.is_file() else None
    rundir.warn_future_schema(p, config, summary)
    name = name if name is not None else p.name
    label = run_label(config, summary)
    frames, eval_seen = [], False
    for rank, f in files.items():
        recs = _read_jsonl(f)
        if eval_seen:  # evaluation records repeat in every rank's file: keep the lowest rank's
            recs = [r for r in recs if r.get("kind", "train") != "eval"]
        eval_seen = eval_seen or any(r.get("kind") == "eval" for r in recs)
        fr = _frame(recs, name, label, rank)
        if not fr.empty:
            frames.append(fr)
    metrics = pd.concat(frames, ignore_index=True) if frames else _empty_metrics()
    if not metrics.empty:
        metrics = metrics.sort_values(["kind", "step", "rank"], kind="stable", ignore_index=True)
    return Run(name=name, path=p, config=config, summary=summary, metrics=metrics, label=label)


def _empty_metrics() -> pd.DataFrame:
    return pd.DataFrame(columns=["run", "label", "rank", "kind", "step", "epoch", "time"])


def find_runs(root: str | os.PathLike) -> list[Path]:
    """Run directories at or under ``root``, sorted by path (a run's subfolders are not searched)."""
    root = Path(root)
    if not root.exists():
        raise AnalysisError(f"{root}: no such directory")
    if not root.is_dir():
        raise AnalysisError(f"{root}: not a directory of runs (it is a file)")
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        d = Path(dirpath)
        if is_run_dir(d):
            found.append(d)
            dirnames[:] = []
        else:
            dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
    return sorted(found)


def _run_row(run: Run) -> dict[str, Any]:
    cfg, summ = run.config, run.summary or {}
    row: dict[str, Any] = {"run": run.name, "label": run.label, "path": str(run.path), "complete": run.complete}
    for k in _RUN_CONFIG_KEYS:
        row[k] = cfg.get(k)
    # the task the run's data set declared; runs written before it was recorded classified
    row["task"] = cfg.get("task") or summ.get("task") or "classification"
    wire = rundir.wire_of(cfg, run.summary)
    row["compressor"] = wire["label"]
    row["bits"] = wire["bits_per_coord"]
    row["wire_source"] = wire["source"]
    row["setup_traffic"] = rundir.setup_traffic_of(cfg, run.summary)
    row["topology"] = None if _is_centralized(cfg.get("algo")) else cfg.get("topology")
    for k in _RUN_SUMMARY_KEYS:
        row[k] = summ.get(k)
    m = run.metrics
    ev = m[m["kind"] == "eval"] if "kind" in m.columns else m.iloc[0:0]
    tr = m[m["kind"] == "train"] if "kind" in m.columns else m.iloc[0:0]
    if not run.complete:  # the latest figures written so far
        if not ev.empty:
            last = ev.sort_values("step").iloc[-1]
            for src, dst in (("train_loss", "final_train_loss"), ("test_loss", "final_test_loss"),
                             ("test_acc", "final_test_acc"), ("test_bpb", "final_test_bpb"),
                             ("test_ppl", "final_test_ppl"), ("consensus_distance", "consensus_distance")):
                if src in last:
                    row[dst] = last[src]
        if not tr.empty:
            row["steps"] = int(tr["step"].max())
            last_t = tr[tr["step"] == tr["step"].max()]
            row["wall_time_s"] = float(last_t["time"].max())
            if "bytes_sent" in last_t:
                row["bytes_sent_per_node_per_step"] = float(last_t["bytes_sent"].mean()) / max(1, row["steps"])
    row["epochs_done"] = float(ev["epoch"].max()) if not ev.empty else (float(tr["epoch"].max()) if not tr.empty else 0.0)
    return row


def _disambiguate(loaded: list[Run]) -> list[Run]:
    """Append the config keys that differ to labels shared by several runs."""
    by_label: dict[str, list[int]] = {}
    for i, r in enumerate(loaded):
        by_label.setdefault(r.label, []).append(i)
    out = list(loaded)
    for label, idx in by_label.items():
        if len(idx) < 2:
            continue
        # the fewest keys, in _DISAMBIGUATE's order, that tell the runs apart
        values = {i: {k: json.dumps(loaded[i].config.get(k), sort_keys=True) for k, _ in _DISAMBIGUATE} for i in idx}
        keys: list[tuple[str, str]] = []
        for k, short in _DISAMBIGUATE:
            before = len({tuple(values[i][kk] for kk, _ in keys) for i in idx})
            after = len({tuple(values[i][kk] for kk, _ in keys + [(k, short)]) for i in idx})
            if after > before:
                keys.append((k, short))
            if after == len(idx):
                break
        new = {}
        for i in idx:
            extra = " ".join(f"{short}={_fmt_value(loaded[i].config.get(k))}" if short
                             else _fmt_options(loaded[i].config.get(k)) for k, short in keys)
            new[i] = f"{label} {extra}".strip()
        counts: dict[str, int] = {}
        for lab in new.values():
            counts[lab] = counts.get(lab, 0) + 1
        new = {i: (f"{lab} [{loaded[i].name}]" if counts[lab] > 1 else lab) for i, lab in new.items()}  # repeats
        for i in idx:
            r = out[i]
            m = r.metrics.copy()
            if not m.empty:
                m["label"] = new[i]
            out[i] = r._replace(label=new[i], metrics=m)
    return out


def _fmt_options(v: Any) -> str:
    """An algorithm's options as ``key=value`` pairs (``defaults`` where none were given)."""
    if not v:
        return "defaults"
    if isinstance(v, dict):
        return ",".join(f"{k}={_fmt_value(v[k])}" for k in sorted(v))
    return _fmt_value(v)


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def load_runs(root: str | os.PathLike) -> Runs:
    """Every run at or under ``root``: ``(runs, metrics)`` tables (see the module docstring)."""
    root = Path(root)
    paths = find_runs(root)
    if not paths:
        raise AnalysisError(
            f"{root}: no run directories found (a run directory holds config.json and "
            f"metrics-rank<k>.jsonl written by python -m gossip.train --out DIR)"
        )
    loaded = []
    for p in paths:
        name = p.relative_to(root).as_posix() if p != root else p.name
        loaded.append(load_run(p, name=name))
    loaded = _disambiguate(loaded)
    runs = pd.DataFrame([_run_row(r) for r in loaded])
    frames = [r.metrics for r in loaded if not r.metrics.empty]
    metrics = pd.concat(frames, ignore_index=True) if frames else _empty_metrics()
    return Runs(runs=runs, metrics=metrics)


# --------------------------------------------------------------------------------------
# curves and tables
# --------------------------------------------------------------------------------------
def _as_metrics(obj: Any) -> pd.DataFrame:
    if isinstance(obj, Runs):
        return obj.metrics
    if isinstance(obj, Run):
        return obj.metrics
    if isinstance(obj, pd.DataFrame):
        return obj
    raise TypeError(f"expected a metrics DataFrame, a Runs or a Run, got {type(obj).__name__}")


def train_curves(metrics: pd.DataFrame | Runs | Run) -> pd.DataFrame:
    """Train records averaged over the ranks: one row per (run, step).

    ``loss`` and the byte counters are means over the nodes (bytes are per node),
    ``time`` is the slowest rank's.
    """
    m = _as_metrics(metrics)
    if m.empty or "kind" not in m.columns:
        return pd.DataFrame(columns=["run", "label", "step", "epoch", "time", "loss", "bytes_sent"])
    tr = m[m["kind"] == "train"]
    agg: dict[str, str] = {"epoch": "first", "time": "max"}
    for col in ("loss", "lr", "bytes_sent", "bytes_recv", "compute_s", "compress_s", "comm_s"):
        if col in tr.columns:
            agg[col] = "mean"
    out = tr.groupby(["run", "label", "step"], sort=False, as_index=False).agg(agg)
    return out.sort_values(["run", "step"], kind="stable", ignore_index=True)


def eval_curves(metrics: pd.DataFrame | Runs | Run) -> pd.DataFrame:
    """The evaluation records (one per run and epoch), with ``bytes_sent`` per node when known."""
    m = _as_metrics(metrics)
    if m.empty or "kind" not in m.columns:
        return pd.DataFrame(columns=["run", "label", "step", "epoch", "time"])
    ev = m[m["kind"] == "eval"]
    empty = [c for c in ev.columns if c not in ("run", "label", "rank", "kind", "step", "epoch", "time")
             and ev[c].isna().all()]
    ev = ev.drop(columns=empty)  # the train records' fields
    tr = train_curves(m)
    if "bytes_sent" in tr.columns and not ev.empty:
        ev = ev.merge(tr[["run", "step", "bytes_sent"]], on=["run", "step"], how="left")
    return ev.sort_values(["run", "step"], kind="stable", ignore_index=True)


def _task_columns(df: pd.DataFrame) -> list[str]:
    """The figures that judge the runs' tasks: accuracy for classifiers, bits per byte and
    perplexity for language models (both where the runs mix them)."""
    tasks = set(df["task"]) if "task" in df.columns else {"classification"}
    cols = ["final_test_acc"] if "classification" in tasks or not tasks else []
    return cols + (["final_test_bpb", "final_test_ppl"] if "lm" in tasks else [])


def final_table(runs: pd.DataFrame | Runs, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """The runs' final figures, one row per run, indexed by label. The test figures are
    those of the runs' tasks: accuracy for classification, bits per byte and perplexity
    for language modelling (final_test_loss is per example, or per token)."""
    df = runs.runs if isinstance(runs, Runs) else runs
    cols = list(columns) if columns is not None else [
        "label", "world_size", "partition", "epochs_done", "steps", "final_train_loss", "final_test_loss",
        *_task_columns(df), "consensus_distance", "bytes_sent_per_node_per_step", "bytes_ratio_to_dpsgd",
        "wall_time_s", "complete",
    ]
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise AnalysisError(f"final_table: unknown column(s) {missing}; known: {', '.join(df.columns)}")
    return df[cols].set_index("label") if "label" in cols else df[cols]


# --------------------------------------------------------------------------------------
# plotting: one line per run
# --------------------------------------------------------------------------------------
def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(6.4, 4.2))
    return ax


def _styles(labels: Iterable[str]) -> dict[str, dict]:
    """A stable colour and line style per label (tab10, then dashed, then dotted)."""
    import matplotlib

    colors = matplotlib.colormaps["tab10"].colors
    dashes = ["-", "--", ":", "-."]
    return {
        lab: {"color": colors[i % len(colors)], "linestyle": dashes[(i // len(colors)) % len(dashes)]}
        for i, lab in enumerate(sorted(dict.fromkeys(labels)))
    }


def plot_curves(
    df: pd.DataFrame,
    x: str,
    y: str,
    *,
    ax=None,
    logy: bool = False,
    logx: bool = False,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
    marker: str | None = None,
    legend: bool = True,
    styles: dict[str, dict] | None = None,
):
    """One line of ``y`` against ``x`` per run of ``df`` (rows with a run and label column).

    ``styles`` maps a label to line keywords (colour, line style); by default each label
    gets a colour from its rank among the sorted labels of ``df``.
    """
    ax = _axes(ax)
    if df.empty or x not in df.columns or y not in df.columns:
        ax.text(0.5, 0.5, f"no {y} records", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title or "")
        return ax
    styles = styles if styles is not None else _styles(df["label"])
    for (run, label), g in df.groupby(["run", "label"], sort=False):
        g = g[np.isfinite(g[x].astype(float)) & g[y].notna()].sort_values(x)
        if g.empty:
            continue
        yv = g[y].astype(float).to_numpy()
        if logy:
            yv = np.where(yv > 0, yv, np.nan)
        ax.plot(g[x].to_numpy(dtype=float), yv, label=label, marker=marker, markersize=3,
                **styles.get(label, {}))
    if logy:
        ax.set_yscale("log")
        _plain_log_ticks(ax)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return ax


def _run_styles(metrics) -> dict[str, dict]:
    """Styles from every label of the metrics, so that a run keeps its colour in every panel
    (even where it has no points, e.g. no evaluation before it blew up)."""
    m = _as_metrics(metrics)
    return _styles(m["label"]) if "label" in m.columns else {}


def _plain_log_ticks(ax) -> None:
    """Plain numbers (0.8, 1.5) instead of 10^x on a log axis spanning less than two decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 100:
        fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
        subs = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if hi / lo < 10 else (1.0, 2.0, 5.0)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _x_axis(x: str) -> tuple[str, str]:
    if x not in _X_AXES:
        raise AnalysisError(f"x must be one of {', '.join(_X_AXES)}, got {x!r}")
    return _X_AXES[x]


def plot_train_loss(metrics, x: str = "epoch", *, ax=None, logy: bool = True, **kw):
    """Training loss (nodes' mean, over the steps since the previous record) against
    ``x`` = ``epoch``, ``step``, ``time`` (wall seconds) or ``bytes`` (sent per node)."""
    col, xl = _x_axis(x)
    kw.setdefault("styles", _run_styles(metrics))
    return plot_curves(train_curves(metrics), col, "loss", ax=ax, logy=logy, logx=(x == "bytes"), xlabel=xl,
                       ylabel="training loss", title=kw.pop("title", f"training loss against {xl}"), **kw)


def plot_loss_vs_bytes(metrics, *, ax=None, **kw):
    """Training loss against the bytes each node has sent: what a bit buys."""
    return plot_train_loss(metrics, x="bytes", ax=ax, title=kw.pop("title", "training loss against bytes sent per node"), **kw)


def plot_test_accuracy(metrics, x: str = "epoch", *, ax=None, **kw):
    """Test accuracy of the averaged model against ``x`` (one point per evaluation)."""
    col, xl = _x_axis(x)
    kw.setdefault("styles", _run_styles(metrics))
    return plot_curves(eval_curves(metrics), col, "test_acc", ax=ax, logx=(x == "bytes"), xlabel=xl,
                       ylabel="test accuracy (averaged model)", marker="o",
                       title=kw.pop("title", "test accuracy"), **kw)


def plot_test_bpb(metrics, x: str = "epoch", *, ax=None, **kw):
    """Held-out bits per byte of the averaged model against ``x`` (language models)."""
    col, xl = _x_axis(x)
    kw.setdefault("styles", _run_styles(metrics))
    return plot_curves(eval_curves(metrics), col, "test_bpb", ax=ax, logx=(x == "bytes"), xlabel=xl,
                       ylabel="test bits per byte (averaged model)", marker="o",
                       title=kw.pop("title", "test bits per byte"), **kw)


def plot_test_metric(metrics, x: str = "epoch", *, ax=None, **kw):
    """The test figure of the runs' task: accuracy (classification) or bits per byte
    (language models, or where no run reports accuracy)."""
    ev = eval_curves(metrics)
    if "test_acc" in ev.columns and ev["test_acc"].notna().any():
        return plot_test_accuracy(metrics, x, ax=ax, **kw)
    if "test_bpb" in ev.columns:
        return plot_test_bpb(metrics, x, ax=ax, **kw)
    return plot_test_accuracy(metrics, x, ax=ax, **kw)


def plot_consensus(metrics, x: str = "step", *, ax=None, **kw):
    """Consensus distance (spread of the nodes' models around their mean) against ``x``.

    All-reduce keeps one model, so its distance is 0 up to rounding; such runs (by label,
    or with every distance below 1e-9) are left out of the log scale.
    """
    col, xl = _x_axis(x)
    ev = eval_curves(metrics)
    kw.setdefault("styles", _run_styles(metrics))
    title = "consensus distance"
    if not ev.empty and "consensus_distance" in ev.columns:
        # all-reduce (by label, or relabelled: by a distance that is only rounding error)
        exact = ev.groupby("run")["consensus_distance"].transform(lambda v: bool((v.abs() < _EXACT).all()))
        central = ev["label"].map(lambda lab: _is_centralized(str(lab).split("/")[0])) | exact.astype(bool)
        if central.any():
            ev = ev[~central]
            title += " (all-reduce: 0, not drawn)"
    return plot_curves(ev, col, "consensus_distance", ax=ax, logy=True, xlabel=xl,
                       ylabel="consensus distance", marker="o", title=kw.pop("title", title), **kw)


def plot_convergence(metrics, *, title: str | None = None):
    """Six panels: loss against epochs, wall time and bytes; test accuracy (bits per byte
    for language models); consensus distance against steps; test loss. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    plot_train_loss(metrics, "epoch", ax=axes[0, 0], legend=False)
    plot_train_loss(metrics, "time", ax=axes[0, 1], legend=False)
    plot_loss_vs_bytes(metrics, ax=axes[0, 2], legend=False)
    plot_test_metric(metrics, ax=axes[1, 0], legend=False)
    plot_consensus(metrics, ax=axes[1, 1], legend=False)
    plot_curves(eval_curves(metrics), "epoch", "test_loss", ax=axes[1, 2], logy=True, marker="o",
                ylabel="test loss (averaged model)", title="test loss", legend=False, styles=_run_styles(metrics))
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ncol = max(1, min(len(labels), 4 if max((len(lab) for lab in labels), default=0) <= 32 else 2))
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.01 + 0.028 * math.ceil(len(labels) / ncol), 1, 1))
    return fig


# --------------------------------------------------------------------------------------
# topologies: spectral gap and consensus contraction
# --------------------------------------------------------------------------------------
def spectral_gaps(
    ns: Iterable[int],
    names: Sequence[str] = ("ring", "torus", "expander"),
    **params: dict,
) -> pd.DataFrame:
    """``topology, n, lambda2, rho, spectral_gap`` for each name and size that builds.

    ``params`` maps a topology name to its builder's keyword arguments, e.g.
    ``expander={"degree": 4, "seed": 0}``. Sizes a topology refuses (a torus of a
    prime) are left out.
    """
    import topologies

    ns = [int(n) for n in ns]
    rows = []
    for name in names:
        kw = dict(params.get(name, {}))
        for n in ns:
            try:
                t = topologies.build(name, int(n), **kw)
            except (ValueError, TypeError):
                continue
            # a time-varying graph has no lambda_2 of its own; its rho is that of one period's
            # product (or the expected one, for random matchings): see topologies.timevarying
            rows.append({"topology": name, "n": int(n), "degree": float(np.mean(t.degrees)),
                         "lambda2": float("nan") if t.time_varying else t.lambda2,
                         "rho": t.rho, "spectral_gap": t.spectral_gap})
    return pd.DataFrame(rows, columns=["topology", "n", "degree", "lambda2", "rho", "spectral_gap"])


def plot_spectral_gaps(gaps: pd.DataFrame, *, ax=None):
    """Spectral gap 1 - rho against n, log-log, one line per topology."""
    ax = _axes(ax)
    for name, g in gaps.groupby("topology", sort=False):
        g = g.sort_values("n")
        ax.plot(g["n"], g["spectral_gap"], marker="o", markersize=3, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("n (nodes)")
    ax.set_ylabel("spectral gap 1 - rho")
    ax.set_title("spectral gap against n", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def consensus_contraction(topology, steps: int = 100, *, dim: int = 16, seed: int = 0) -> pd.DataFrame:
    """Run gossip ``X <- W X`` from a random start and measure how fast it contracts.

    ``topology`` is a :class:`topologies.Topology`. Returns ``t``, ``measured`` =
    ||X_t - mean||_F / ||X_0 - mean||_F (the mean over nodes is preserved by a doubly
    stochastic W) and ``rho_t`` = rho^t, the bound it must stay under.

    A :class:`topologies.TimeVaryingTopology` applies ``W(t)`` at step ``t``; its
    ``rho_t`` is ``rho^floor(t / period)`` for a periodic graph (``rho`` of one period's
    product: a bound at the end of each period) and ``rho^(t/2)`` for random matchings
    (``rho`` bounds the expected squared distance, so this is the bound on its root,
    which one run's curve follows only on average).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise AnalysisError(f"steps must be a positive integer, got {steps!r}")
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((topology.n, dim))
    X -= X.mean(axis=0, keepdims=True)  # the mean is a fixed point; only the rest contracts
    x0 = np.linalg.norm(X)
    meas = [1.0]
    for k in range(steps):
        W = topology.at(k).to_sparse() if topology.time_varying else topology.matrix
        X = W @ X
        meas.append(float(np.linalg.norm(X - X.mean(axis=0, keepdims=True)) / x0))
    t = np.arange(steps + 1)
    if not topology.time_varying:
        expo = t.astype(float)
    elif topology.period is not None:
        expo = np.floor(t / topology.period)
    else:
        expo = t / 2.0
    return pd.DataFrame({"t": t, "measured": meas, "rho_t": topology.rho ** expo,
                         "topology": topology.name, "n": topology.n, "rho": topology.rho})


def plot_contraction(curves: pd.DataFrame | Sequence[pd.DataFrame], *, ax=None):
    """Measured contraction (solid) against rho^t (dashed), one colour per topology."""
    ax = _axes(ax)
    df = pd.concat(list(curves), ignore_index=True) if not isinstance(curves, pd.DataFrame) else curves
    import matplotlib

    colors = matplotlib.colormaps["tab10"].colors
    for i, ((name, n), g) in enumerate(df.groupby(["topology", "n"], sort=False)):
        c = colors[i % len(colors)]
        rho = float(g["rho"].iloc[0])
        ax.plot(g["t"], g["measured"].where(g["measured"] > 0), color=c, label=f"{name} n={n}: measured")
        ax.plot(g["t"], g["rho_t"].where(g["rho_t"] > 0), color=c, linestyle="--", label=f"rho^t, rho={rho:.4f}")
    ax.set_yscale("log")
    ax.set_xlabel("gossip steps t")
    ax.set_ylabel("||X_t - mean|| / ||X_0 - mean||")
    ax.set_title("consensus contraction of x <- W x", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return ax


# --------------------------------------------------------------------------------------
# network sweeps (experiments/sweep_network.py)
# --------------------------------------------------------------------------------------
def find_sweeps(root: str | os.PathLike) -> list[Path]:
    """Directories at or under ``root`` holding ``results.csv`` or ``results.json``."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if any(f in filenames for f in _SWEEP_FILES):
            found.append(Path(dirpath))
        dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
    return sorted(found)


def _to_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1", "yes")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return False
    return bool(v)


def load_sweep(path: str | os.PathLike) -> pd.DataFrame:
    """The rows of a network sweep (``results.json`` preferred, else ``results.csv``).

    ``path`` is the sweep's output directory or one of the two files. Rows that failed
    are kept with ``ok == False``; the plot leaves them out.
    """
    p = Path(path)
    if p.is_dir():
        files = [p / f for f in _SWEEP_FILES if (p / f).is_file()]
        if not files:
            raise AnalysisError(
                f"{p}: no sweep results (results.json or results.csv written by experiments/sweep_network.py)"
            )
        p = files[0]
    elif not p.is_file():
        raise AnalysisError(f"{p}: no such file or directory")
    if p.suffix == ".json":
        try:
            obj = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise AnalysisError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        rows = obj.get("rows") if isinstance(obj, dict) else obj
        if not isinstance(rows, list):
            raise AnalysisError(f"{p}: expected a list of rows or an object with 'rows'")
        df = pd.DataFrame.from_records(rows)
    elif p.suffix == ".csv":
        try:
            df = pd.read_csv(p)
        except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
            raise AnalysisError(f"{p}: not a readable CSV table ({str(e).splitlines()[0]})") from None
    else:
        raise AnalysisError(f"{p}: expected results.json or results.csv")
    need = ("algo", "bandwidth_mbit", "latency_ms", "epoch_s")
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise AnalysisError(f"{p}: not sweep results (missing column(s) {', '.join(missing)})")
    df["ok"] = df["ok"].map(_to_bool) if "ok" in df.columns else True
    if "bits" not in df.columns:
        df["bits"] = None
    return df


def _sweep_name(algo: str, bits: Any) -> str:
    names = {"allreduce": "all-reduce (32 bits)", "dpsgd": "D-PSGD (32 bits)"}
    if algo in names:
        return names[algo]
    has_bits = bits is not None and not (isinstance(bits, float) and math.isnan(bits))
    return f"{algo.upper() if algo in ('dcd', 'ecd') else algo} ({int(bits)} bits)" if has_bits else algo


def plot_sweep(sweep: pd.DataFrame, *, nodes: int | None = None, y: str = "epoch_s"):
    """Tang et al. 2018 (arXiv:1803.06443) Fig. 3: epoch time against 5/bandwidth at the lowest and highest
    latency, and against latency at the highest and lowest bandwidth. Returns the figure."""
    import matplotlib.pyplot as plt

    ok = sweep[sweep["ok"]] if "ok" in sweep.columns else sweep
    if ok.empty:
        raise AnalysisError("the sweep has no successful rows to plot")
    if "nodes" in ok.columns:
        counts = sorted(ok["nodes"].unique())
        nodes = int(counts[-1]) if nodes is None else nodes
        ok = ok[ok["nodes"] == nodes]
        if ok.empty:
            raise AnalysisError(f"the sweep has no rows with nodes={nodes}; it has {counts}")
    ok = ok.assign(_line=[_sweep_name(a, b) for a, b in zip(ok["algo"], ok["bits"])])
    bws = sorted(ok["bandwidth_mbit"].unique())
    lats = sorted(ok["latency_ms"].unique())
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0, 0], "latency_ms", lats[0], "bandwidth_mbit", f"(a) bandwidth, latency = {lats[0]:g} ms"),
        (axes[0, 1], "latency_ms", lats[-1], "bandwidth_mbit", f"(b) bandwidth, latency = {lats[-1]:g} ms"),
        (axes[1, 0], "bandwidth_mbit", bws[-1], "latency_ms", f"(c) latency, bandwidth = {bws[-1]:g} Mbit/s"),
        (axes[1, 1], "bandwidth_mbit", bws[0], "latency_ms", f"(d) latency, bandwidth = {bws[0]:g} Mbit/s"),
    ]
    styles = _styles(ok["_line"])
    for ax, fixed, value, xkey, title in panels:
        sel = ok[ok[fixed] == value]
        for line, g in sel.groupby("_line", sort=True):
            xs = 5.0 / g[xkey].astype(float) if xkey == "bandwidth_mbit" else g[xkey].astype(float)
            order = np.argsort(xs.to_numpy())
            ax.plot(xs.to_numpy()[order], g[y].to_numpy(dtype=float)[order], marker="o", label=line, **styles[line])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("5 / bandwidth (5 / Mbit/s)" if xkey == "bandwidth_mbit" else "latency (ms)")
        ax.set_ylabel("epoch time (s)" if y == "epoch_s" else y)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    modes = sorted(str(m) for m in ok["latency_mode"].unique()) if "latency_mode" in ok.columns else []
    fig.suptitle(f"epoch time under shaped networks, {nodes} nodes" + (f"; latency: {'/'.join(modes)}" if modes else ""),
                 fontsize=11)
    fig.tight_layout()
    return fig
