"""The run directory's schema: file names, keys and versions, in one place.

``python -m gossip.train --out DIR`` writes, and :mod:`gossip.tools.analysis` reads:

``config.json``
    Written once at the start: the flat keys of :class:`gossip.train.config.TrainConfig`
    (``algo``, ``lr`` ...), the derived ``compressor_spec``/``model_name``/
    ``local_momentum``, and what the run found: ``world_size``, ``params``, ``mode``,
    ``hostname``, ``torch``, the parameter ``layout`` and the algorithm's ``wire``
    format (``label``, ``bits_per_coord``). ``schema`` is :data:`SCHEMA_VERSION`.
``metrics-rank<k>.jsonl``
    One per node, one JSON record per line: ``kind`` ``"train"`` (every ``log_every``
    steps: ``step``, ``epoch``, ``time``, ``loss``, ``lr``, cumulative ``bytes_sent``/
    ``bytes_recv`` of the steps, ``setup_bytes_sent``/``setup_bytes_recv``, the time
    split and ``warmup_s``) or ``"eval"`` (every epoch: the averaged model's
    ``test_loss``/``test_acc``, the nodes' accuracy range, ``consensus_distance``; for a
    language model ``test_bpb``/``test_ppl`` and the nodes' ``node_bpb_*`` instead of accuracy,
    ``train_loss``).
``summary.json``
    Written at the end (or when the run diverges, with ``diverged: true``): final
    figures, bytes per node per step (setup traffic left out), ``setup_bytes_per_node``
    and ``bytes_sent_per_node_total``, the wire format and the measured bits per
    coordinate, the time split of the steady steps and ``warmup_s`` (the algorithm's
    setup and each process's first step: compilation and first calls). ``hosts`` and
    ``procs_per_host`` say how torchrun laid the ranks out (WORLD_SIZE /
    LOCAL_WORLD_SIZE hosts of LOCAL_WORLD_SIZE processes; 1 and 1 for a run in one
    process; absent before they were recorded).
``ckpt-step<N>-rank<k>.pt``
    Checkpoints (:mod:`gossip.checkpoint` owns their format).
``error-rank<k>.log``
    Written by a rank whose run stopped on an error or an interrupt: the time, the
    rank, the step and the full detail (traceback and the backend's own text), which
    the one line the rank prints leaves out. Appended to across attempts.
``tensorboard/events.out.tfevents.*``
    With ``--tensorboard``: the metrics as TensorBoard scalars.

:func:`run_files` lists these files, and only these, in a directory: ``--overwrite``
deletes what it lists and nothing else (a ``config.json`` or ``summary.json`` that
is not a run's, other files, other folders stay).

Versions. Schema 1 (no ``schema`` key) is what the first releases wrote: no
``wire``/``layout`` in config.json, and ``compressor``/``bits`` in summary.json came
from the CLI's compressor spec (``null``/``32`` for the sign algorithms, which send 1
bit). :func:`wire_of` reads either and says which it got. Schema 2 added ``wire``,
``layout``, ``bits_per_coord_measured`` and ``report``. Schema 3 keeps setup traffic
and warm-up time apart: before it, the one-off exchange of x_1 was counted in the
per-step bytes and compilation in the compress time; :func:`setup_traffic_of` says
which a run did.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from gossip._atomic import write_atomically

__all__ = [
    "SCHEMA_VERSION",
    "CONFIG",
    "SUMMARY",
    "MetricsWriter",
    "config_path",
    "is_run_dir",
    "metrics_files",
    "metrics_path",
    "node_traffic",
    "nodes_traffic",
    "payload_traffic",
    "error_log_path",
    "read_json",
    "read_metrics",
    "remove_run_files",
    "run_files",
    "summary_path",
    "setup_traffic_of",
    "step_bytes_per_node",
    "tensorboard_dir",
    "TensorBoardWriter",
    "warn_future_schema",
    "wire_of",
    "write_json",
]

#: version of config.json/summary.json's keys; runs without a ``schema`` key are 1
SCHEMA_VERSION = 3
CONFIG = "config.json"
SUMMARY = "summary.json"
_METRICS = "metrics-rank{}.jsonl"
_ERROR_LOG = "error-rank{}.log"
_METRICS_RE = re.compile(r"^metrics-rank(\d+)\.jsonl$")
#: every file name a run writes at the top of its directory (the checkpoints' pattern is
#: gossip.checkpoint's, repeated here so that this list is whole; temporary files of an
#: interrupted atomic write start with a dot)
_RUN_FILE_RES = (
    re.compile(r"^metrics-rank\d+\.jsonl$"),
    re.compile(r"^error-rank\d+\.log$"),
    re.compile(r"^ckpt-step\d+-rank\d+\.pt$"),
    re.compile(r"^\.(config\.json|summary\.json|metrics-rank\d+\.jsonl|ckpt-step\d+-rank\d+\.pt)\..+\.tmp$"),
)
_TB_EVENTS_RE = re.compile(r"^events\.out\.tfevents\.")


class RunDirError(ValueError):
    """A file of a run directory that cannot be read: one line naming it."""


def config_path(run_dir: str | Path) -> Path:
    """``config.json`` of the run directory."""
    return Path(run_dir) / CONFIG


def summary_path(run_dir: str | Path) -> Path:
    """``summary.json`` of the run directory."""
    return Path(run_dir) / SUMMARY


def metrics_path(run_dir: str | Path, rank: int) -> Path:
    """The metrics file (JSON lines) of ``rank``."""
    return Path(run_dir) / _METRICS.format(int(rank))


def error_log_path(run_dir: str | Path, rank: int) -> Path:
    """The file that holds the full detail (traceback) of ``rank``'s failure."""
    return Path(run_dir) / _ERROR_LOG.format(rank)


def metrics_files(run_dir: str | Path) -> dict[int, Path]:
    """``{rank: path}`` of the metrics files, by rank."""
    files = {}
    for p in Path(run_dir).iterdir():
        m = _METRICS_RE.match(p.name)
        if m and p.is_file():
            files[int(m.group(1))] = p
    return dict(sorted(files.items()))


TENSORBOARD_DIR = "tensorboard"
#: metrics record keys -> TensorBoard scalar tags
_TB_TAGS = {
    "train": {"loss": "train/loss", "lr": "train/lr", "bytes_sent": "traffic/bytes_sent_per_node",
              "bytes_recv": "traffic/bytes_recv_per_node", "compute_s": "time/compute_s",
              "compress_s": "time/compress_s", "comm_s": "time/comm_s", "warmup_s": "time/warmup_s"},
    "eval": {"test_loss": "eval/test_loss", "test_acc": "eval/test_acc", "train_loss": "eval/train_loss",
             "consensus_distance": "eval/consensus_distance", "node_acc_min": "eval/node_acc_min",
             "node_acc_max": "eval/node_acc_max",
             # language models (gossip.train.evaluation): bits per byte and perplexity, no accuracy
             "test_bpb": "eval/test_bpb", "test_ppl": "eval/test_ppl", "node_bpb_min": "eval/node_bpb_min",
             "node_bpb_max": "eval/node_bpb_max"},
}


def tensorboard_dir(out: str | Path) -> Path:
    """The TensorBoard event directory of the run (``--tensorboard``)."""
    return Path(out) / TENSORBOARD_DIR


class TensorBoardWriter:
    """The metrics records as TensorBoard scalars under ``<out>/tensorboard``, at x =
    step. Train records are the mean over the nodes; eval records are global."""

    INSTALL = "pip install 'gossip[tensorboard]' (or pip install tensorboard)"

    def __init__(self, out: str | Path, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RunDirError(f"--tensorboard needs the tensorboard package ({e}); {self.INSTALL}") from None
        # a resumed run drops the events the interrupted one wrote past its checkpoint
        self._w = SummaryWriter(log_dir=str(tensorboard_dir(out)), purge_step=resume_step)

    def write(self, rec: dict) -> None:
        for key, tag in _TB_TAGS.get(rec.get("kind"), {}).items():
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._w.add_scalar(tag, v, global_step=int(rec["step"]))

    def close(self) -> None:
        self._w.close()


def _is_run_json(path: Path, keys: tuple[str, ...]) -> bool:
    """Whether ``path`` is a JSON object holding ``keys`` (a run's config or summary)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and all(k in obj for k in keys)


#: the keys by which a config.json / summary.json is recognised as a run's own
_RUN_JSON_KEYS = {CONFIG: ("algo", "world_size", "params"), SUMMARY: ("algo", "world_size", "steps")}


def run_files(run_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """``(ours, foreign)``: the files of ``run_dir`` that a run wrote (the one list of
    them: see the module's docstring), and the files that bear a run file's name
    (``config.json``, ``summary.json``) but are not a run's. TensorBoard's event files
    are listed one by one; the ``tensorboard`` folder itself never is."""
    d = Path(run_dir)
    ours: list[Path] = []
    foreign: list[Path] = []
    if not d.is_dir():
        return ours, foreign
    for p in sorted(d.iterdir()):
        if p.name in _RUN_JSON_KEYS:
            (ours if p.is_file() and _is_run_json(p, _RUN_JSON_KEYS[p.name]) else foreign).append(p)
        elif p.is_file() and not p.is_symlink() and any(r.match(p.name) for r in _RUN_FILE_RES):
            ours.append(p)
    tb = tensorboard_dir(d)
    if tb.is_dir() and not tb.is_symlink():
        ours += [p for p in sorted(tb.iterdir()) if p.is_file() and _TB_EVENTS_RE.match(p.name)]
    return ours, foreign


def remove_run_files(run_dir: str | Path) -> list[Path]:
    """Delete the files :func:`run_files` lists as a run's (``--overwrite``), then the
    ``tensorboard`` folder if that left it empty; nothing else. Returns what it removed.
    A file with a run file's name that is not a run's raises :class:`RunDirError` before
    anything is deleted."""
    ours, foreign = run_files(run_dir)
    if foreign:
        raise RunDirError(f"{foreign[0]} is not a gossip run's file; --overwrite replaces only a run's own files "
                          f"and leaves it alone: move it or give another --out")
    for p in ours:
        p.unlink()
    tb = tensorboard_dir(run_dir)
    if any(p.parent == tb for p in ours) and tb.is_dir() and not any(tb.iterdir()):
        tb.rmdir()
    return ours


def is_run_dir(path: str | Path) -> bool:
    """True when ``path`` holds ``config.json`` and at least one ``metrics-rank<k>.jsonl``."""
    p = Path(path)
    return p.is_dir() and config_path(p).is_file() and bool(metrics_files(p))


def write_json(path: Path, obj: Any) -> None:
    """Atomically (temporary file, then rename): a reader never sees half a file."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    write_atomically(Path(path), lambda f: f.write(text.encode()))


def read_json(path: Path, what: str | None = None) -> dict:
    """The JSON object in ``path``.

    Raises RunDirError in one line, naming ``what``, if the file is unreadable, not JSON
    or not an object."""
    what = what or Path(path).name
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path}: {what} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot read {what} ({e.strerror})") from None
    if not isinstance(obj, dict):
        raise RunDirError(f"{path}: {what} must hold a JSON object, got {type(obj).__name__}")
    return obj


def read_metrics(path: Path) -> list[dict]:
    """The records of one metrics file; a torn last line (a run being written) is skipped."""
    records, bad = [], 0
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise RunDirError(f"{path}: the metrics file is not UTF-8 text (byte {e.start}: {e.reason}); move it "
                          f"away to resume without its records") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot read the metrics file ({e.strerror or e})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    if bad:
        warnings.warn(f"{path}: skipped {bad} line(s) that are not JSON records", stacklevel=3)
    return records


class MetricsWriter:
    """Append-only JSONL writer of one node's records.

    ``keep_until=None`` starts the file afresh; ``keep_until=step`` (a resumed run)
    keeps the records up to that step and drops later ones, which the resumed run
    writes again.

    ``keep_open=False`` opens the file for each record and closes it again, so that
    the writer holds no file descriptor between records: a simulation of thousands of
    nodes has one writer per node, more than a process may have files open (1,024 by
    default on many systems). The records are the same either way.
    """

    def __init__(self, path: Path, keep_until: int | None = None, keep_open: bool = True) -> None:
        path = Path(path)
        if keep_until is not None and path.exists():
            kept = [json.dumps(r) for r in read_metrics(path) if r.get("step", 0) <= keep_until]
            write_atomically(path, lambda f: f.write("".join(k + "\n" for k in kept).encode()))
        elif keep_until is None and path.exists():
            path.unlink()
        self.path = path
        if keep_open:
            self._fh = open(path, "a", buffering=1)
        else:
            self._fh = None
            path.touch()  # the file exists from the start, as with an open writer

    def write(self, rec: dict) -> None:
        line = json.dumps(rec) + "\n"
        try:
            if self._fh is not None:
                self._fh.write(line)
            else:
                with open(self.path, "a") as f:
                    f.write(line)
        except OSError as e:  # a full disk, a directory made read-only: say which file
            raise type(e)(e.errno, e.strerror, str(self.path)) from e

    def close(self) -> None:
        if self._fh is None:
            return
        try:
            self._fh.close()
        except OSError:  # the line that failed to go out already raised from write()
            pass


def warn_future_schema(where: str | Path, config: dict, summary: dict | None = None) -> int | None:
    """Warn (once per run) where a run was written with a newer schema than
    :data:`SCHEMA_VERSION`: its keys may mean what this version does not know. Returns
    the newer schema, or None."""
    newest = None
    for src in (config, summary or {}):
        s = src.get("schema")
        if isinstance(s, int) and not isinstance(s, bool) and s > SCHEMA_VERSION and (newest is None or s > newest):
            newest = s
    if newest is not None:
        warnings.warn(f"{where}: written with run-directory schema {newest}, this version of gossip reads schemas "
                      f"1 to {SCHEMA_VERSION}: keys it does not know are left out and figures may be misread; "
                      f"upgrade gossip to read it", stacklevel=3)
    return newest


def setup_traffic_of(config: dict, summary: dict | None = None) -> str:
    """``"apart"`` where the run kept its one-off setup traffic out of the per-step bytes
    (schema 3 on), ``"folded in"`` for older runs, whose step 1 carried it."""
    schema = (summary or {}).get("schema", config.get("schema"))
    return "apart" if isinstance(schema, int) and schema >= 3 else "folded in"


def wire_of(config: dict, summary: dict | None = None) -> dict[str, Any]:
    """What a run sent: ``{"label", "bits_per_coord", "source"}``.

    ``source`` is ``"algorithm"`` where the run recorded its algorithm's own description
    (schema 2), else ``"config (schema 1)"``: the CLI's compressor spec, which is
    ``fp32`` for the algorithms that chose their compressor themselves.
    """
    for src in (summary or {}, config):
        wire = src.get("wire")
        if isinstance(wire, dict) and wire.get("label"):
            return {"label": wire["label"], "bits_per_coord": wire.get("bits_per_coord"), "source": "algorithm"}
    label = config.get("compressor_spec") or "fp32"
    bits = config.get("bits") if config.get("bits") is not None else (summary or {}).get("bits")
    return {"label": label, "bits_per_coord": bits, "source": "config (schema 1)"}


# --------------------------------------------------------------------------------------
# accounting: the byte and time figures of the records, read from the run's Ledger
# --------------------------------------------------------------------------------------
def node_traffic(ledger, node: int) -> dict[str, float]:
    """A metrics record's figures of hosted node ``node``: its cumulative bytes of the
    steps and of setup, and its share of the hosted nodes' time per phase."""
    return nodes_traffic(ledger, [node])[0]


def nodes_traffic(ledger, nodes) -> list[dict[str, float]]:
    """:func:`node_traffic` of each of the hosted ``nodes``, in their order, in one pass
    over the ledger (one call per node would cost O(n) each: O(n^2) for a simulated
    run's records at every log step)."""
    hosted, t = ledger.num_nodes, ledger.times
    shared = {
        "warmup_s": t.get("warmup", 0.0) / hosted,
        "compute_s": t.get("compute", 0.0) / hosted,
        "compress_s": t.get("compress", 0.0) / hosted,
        # all time on the network: posting and transfers plus waiting for the peers
        "comm_s": (t.get("communicate", 0.0) + t.get("wait", 0.0)) / hosted,
        "wait_s": t.get("wait", 0.0) / hosted,
    }
    b = ledger.node_bytes(nodes)
    cols = zip(b["step_sent"].tolist(), b["step_received"].tolist(), b["setup_sent"].tolist(),
               b["setup_received"].tolist())
    return [{"bytes_sent": s, "bytes_recv": r, "setup_bytes_sent": ss, "setup_bytes_recv": sr, **shared}
            for s, r, ss, sr in cols]


def step_bytes_per_node(ledger, steps: int) -> float:
    """Bytes a hosted node sent per step, on average over the hosted nodes (setup left out)."""
    return ledger.step_bytes_sent / len(ledger.nodes) / steps if steps else 0.0


def payload_traffic(ledger) -> tuple[float, float] | None:
    """Bytes and messages of the steps' payload (control and setup traffic left out),
    or None where the ledger was restored from a state that did not count messages."""
    snap = ledger.as_dict()
    msgs, setup = snap.get("messages"), snap["setup"]
    if not msgs:
        return None
    sent = ledger.bytes_sent - snap["ops"]["control"]["sent"] - (setup["sent"] - setup["control"]["sent"])
    count = msgs["sent"] - msgs["control"] - (setup["messages"] - setup["control"]["messages"])
    return float(sent), float(count)
