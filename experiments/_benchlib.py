"""Helpers shared by the benchmark scripts: a spawned gloo world and a Markdown table."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["run_spawned_world", "markdown_table"]


def run_spawned_world(worker: Callable[..., None], world: int, *args: Any) -> list[dict]:
    """Start ``world`` processes running ``worker(rank, store_path, *args, out_path)``.

    Each worker creates its process group over a FileStore at ``store_path``; rank 0
    writes its result rows as JSON to ``out_path``, which are returned.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(
            worker, args=(os.path.join(tmp, "store"), *args, out), nprocs=world, start_method="spawn"
        )
        with open(out) as fh:
            return json.load(fh)


def markdown_table(rows: list[dict], cols: list[str]) -> str:
    """``rows`` as a Markdown table of the columns ``cols`` (floats to 4 significant digits)."""

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]

    def line(xs: list[str]) -> str:
        return "| " + " | ".join(x.ljust(w) for x, w in zip(xs, widths)) + " |"

    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
