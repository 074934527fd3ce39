"""Checkpoints that are never left damaged and refuse to resume the wrong run.

File format (version 1)::

    GOSSIP-CHECKPOINT\\n                       magic line
    HSUM <sha256 of the header line>\\n          the header's own checksum
    {"format_version": 1, "sha256": ..., ...}\\n   one JSON header line
    <body>                                     torch.save(payload), exactly header["nbytes"] bytes

The header line may end in spaces before its newline: the body is streamed to the
file after a reserved line, and the header, whose length and checksum are known
only then, is written back into it. Files with and without the padding read alike.

The header holds the format version, the SHA-256 and length of the body, the world
size of the run, and (when a config is given) the config's fingerprint, the keys it
covers and their values. Reading checks, in order: magic, header, version, length,
checksum, world size, fingerprint; then the body is read with
``torch.load(weights_only=True)``, which can only rebuild tensors and plain
containers, never run code. Payloads therefore hold tensors (generator states are
uint8 tensors), dicts, lists, tuples, str, int, float, bool, bytes and None, and
``save_checkpoint`` rejects anything else up front.

Writing goes to a temporary file in the target's directory, flushed and fsync'ed,
then renamed over the target (``os.replace`` is atomic on POSIX and Windows), so a
crash leaves either the old file or the new one. A process killed mid-write may
leave a ``.<name>.*.tmp`` file behind; lookups ignore them.

Run directories hold one file per step and rank: ``ckpt-step{N}-rank{k}.pt``
(:func:`checkpoint_path`). Under torchrun each process writes its own rank; the
in-process simulation is one process (rank 0) holding all nodes. A step is
*complete* when the files of all ``num_ranks`` ranks exist; :func:`latest_step` and
:func:`latest_checkpoint` (given ``num_ranks``) only return complete steps, and
:func:`prune_checkpoints` keeps the last K complete steps and never deletes anything
newer than them. In a distributed run, barrier after saving and before looking, or
decide the step on one rank and broadcast it, so that all ranks resume from the same
step.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from gossip._atomic import write_atomically

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "checkpoint_info",
    "checkpoint_path",
    "config_fingerprint",
    "latest_checkpoint",
    "latest_step",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "save_checkpoint",
]

FORMAT_VERSION = 1
_MAGIC = b"GOSSIP-CHECKPOINT\n"
_HSUM = b"HSUM "
_MAX_HEADER = 1 << 20  # bytes; a longer first line means the file is not ours
_NAME = re.compile(r"^ckpt-step(\d+)-rank(\d+)\.pt$")

_TORCH_LEAVES = (torch.Tensor, torch.dtype, torch.device, torch.Size)
_PLAIN_LEAVES = (str, int, float, bool, bytes, type(None))


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, or from another run (one line)."""


# --------------------------------------------------------------------------- fingerprint


def _canonical(value: Any, where: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"config[{where!r}] = {value!r} cannot be fingerprinted ({exc}); use JSON values "
            f"(str, int, finite float, bool, None, lists, dicts with str keys)"
        ) from None


def _config_subset(config: Mapping[str, Any], keys: Iterable[str] | None) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping, got {type(config).__name__}")
    chosen = sorted(config) if keys is None else sorted(set(keys))
    missing = [k for k in chosen if k not in config]
    if missing:
        raise ValueError(f"fingerprint keys {', '.join(map(repr, missing))} are not in the config")
    subset = {}
    for k in chosen:
        if not isinstance(k, str):
            raise TypeError(f"config keys must be str, got {k!r}")
        # Round-trip through JSON so that tuples and lists compare equal later.
        subset[k] = json.loads(_canonical(config[k], k))
    return subset


def config_fingerprint(config: Mapping[str, Any], keys: Iterable[str] | None = None) -> str:
    """A stable hash of ``config`` restricted to ``keys`` (all keys when ``None``).

    The hash is the first 16 hex digits of SHA-256 over the canonical JSON of the
    selected entries (sorted keys, no whitespace), so it is the same on every machine
    and Python version, and independent of key order. Tuples and lists hash alike.
    Values must be JSON values; anything else raises ``ValueError`` naming the key.
    """
    subset = _config_subset(config, keys)
    return hashlib.sha256(_canonical(subset, "*").encode()).hexdigest()[:16]


def _config_diff(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    diffs = []
    for key in sorted(stored):
        if key not in current:
            diffs.append(f"{key} {stored[key]!r} != (absent)")
            continue
        try:
            now = json.loads(_canonical(current[key], key))
        except ValueError:
            now = current[key]
        if now != stored[key]:
            diffs.append(f"{key} {stored[key]!r} != {now!r}")
    return diffs


# --------------------------------------------------------------------------- payload check


def _check_payload(obj: Any, where: str) -> None:
    """Refuse, at save time, what ``torch.load(weights_only=True)`` would refuse at load time."""
    if isinstance(obj, _TORCH_LEAVES) or type(obj) in _PLAIN_LEAVES:
        return
    if type(obj) in (dict, OrderedDict):  # module state_dicts are OrderedDicts
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where} has a key {k!r} of type {type(k).__name__}; use str or int keys")
            _check_payload(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_payload(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; checkpoints hold only tensors, "
        f"dicts (plain or OrderedDict), lists, tuples, str, int, float, bool, bytes and None"
    )


# --------------------------------------------------------------------------- save / load


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_header(config: Mapping[str, Any] | None, keys: Iterable[str] | None, fingerprint: str | None,
                world_size: int | None) -> dict[str, Any]:
    """A new checkpoint's header, before the body's length and checksum are known."""
    header: dict[str, Any] = {"format_version": FORMAT_VERSION}
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        header["world_size"] = world_size
    if config is not None:
        subset = _config_subset(config, keys)
        header["fingerprint"] = config_fingerprint(subset)
        header["config"] = subset
        if fingerprint is not None and fingerprint != header["fingerprint"]:
            raise ValueError(
                f"fingerprint {fingerprint!r} does not match the config's fingerprint {header['fingerprint']!r}"
            )
    elif keys is not None:
        raise ValueError("fingerprint_keys was given without a config")
    elif fingerprint is not None:
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
        header["fingerprint"] = fingerprint
    return header


def save_checkpoint(
    path: str | os.PathLike,
    payload: Mapping[str, Any],
    *,
    config: Mapping[str, Any] | None = None,
    fingerprint_keys: Iterable[str] | None = None,
    fingerprint: str | None = None,
    world_size: int | None = None,
) -> Path:
    """Write ``payload`` to ``path`` atomically; return the path.

    ``config`` (with ``fingerprint_keys``, the entries that must match to resume; all
    when ``None``) is fingerprinted and its selected entries stored in the header, so
    :func:`load_checkpoint` can name what differs. Alternatively pass only the
    ``fingerprint`` (from :func:`config_fingerprint`); with both, they must agree.
    ``world_size`` is the number of nodes of the run. The parent directory is created
    if needed.
    """
    path = Path(path)
    if not isinstance(payload, Mapping) or not all(isinstance(k, str) for k in payload):
        raise TypeError("payload must be a dict with str keys")
    _check_payload(dict(payload), "payload")
    header = _new_header(config, fingerprint_keys, fingerprint, world_size)
    # The header names the body's length and checksum, known only once the body is
    # written: its line is reserved (room for any length), the body streamed into the
    # file through the checksum, then the header written into the reserved line, padded
    # with spaces (JSON allows them; readers of the format before streaming read it
    # unchanged). No in-memory copy of the body: for an (n, d) parameter matrix of a
    # large simulation that copy cost as much as the write.
    width = len(_header_line({**header, "nbytes": 10**20, "sha256": "0" * 64}))
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f: Any) -> None:
        f.write(_MAGIC)
        start = f.tell()
        f.write(b" " * (len(_HSUM) + 64 + 1 + width))
        body = _HashingWriter(f)
        try:
            with _no_zip_crc32():
                torch.save(dict(payload), body)
        except RuntimeError:
            if body.error is not None:  # torch wraps the file's OSError (a full disk): raise that
                raise body.error from None
            raise
        header["nbytes"], header["sha256"] = body.nbytes, body.sha256.hexdigest()
        line = _header_line(header)
        line = line[:-1] + b" " * (width - len(line)) + b"\n"
        f.seek(start)
        f.write(_HSUM + hashlib.sha256(line).hexdigest().encode() + b"\n")
        f.write(line)
        f.seek(0, os.SEEK_END)

    write_atomically(path, write)
    _fsync_dir(path.parent)
    return path


@contextlib.contextmanager
def _no_zip_crc32():
    """``torch.save`` without the CRC-32 its zip writer computes for every record.

    The header's SHA-256 already covers every byte of the body, and it is checked
    before ``torch.load`` reads it, which does not check the records' CRC-32. Computing
    it cost a third of the serialisation's CPU time (about 0.6 s for the 646 MB of an
    MLP simulated on 1,024 nodes). The body's bytes differ only in the records' CRC
    fields (zero); any ``torch.load`` reads it. Restores the previous setting."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # an older torch: it computes them
        yield
        return
    before = get()
    set_(False)
    try:
        yield
    finally:
        set_(before)


def _header_line(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n"


class _HashingWriter:
    """A write-only stream over ``f`` that keeps the SHA-256 and the length of what
    passes through it (``torch.save`` needs only ``write`` and ``flush``)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256, self.nbytes = f, hashlib.sha256(), 0
        #: the first OSError of the file (torch.save raises its own RuntimeError over it)
        self.error: OSError | None = None

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.sha256.update(view)
        self.nbytes += view.nbytes
        try:
            return self.f.write(view)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _read_header(f: Any, path: Path) -> dict[str, Any]:
    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"checkpoint '{path}' is damaged or not a gossip checkpoint: {reason}")

    magic = f.read(len(_MAGIC))
    if magic != _MAGIC:
        raise bad("it does not start with the gossip checkpoint marker")
    line = f.readline(_MAX_HEADER)
    if not line.endswith(b"\n"):
        raise bad("its header line is truncated")
    if line.startswith(_HSUM):  # the header's checksum (files written before it have none)
        want = line[len(_HSUM):].strip().decode("ascii", "replace")
        line = f.readline(_MAX_HEADER)
        if not line.endswith(b"\n"):
            raise bad("its header line is truncated")
        if hashlib.sha256(line).hexdigest() != want:
            raise CheckpointError(f"checkpoint '{path}' is damaged: its header does not match the header's checksum")
    try:
        header = json.loads(line)
    except ValueError as exc:
        raise bad(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("format_version"), int):
        raise bad("its header has no format_version")
    version = header["format_version"]
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format version {version}; this gossip reads version {FORMAT_VERSION}"
        )
    for key, kind in (("nbytes", int), ("sha256", str)):
        if not isinstance(header.get(key), kind):
            raise bad(f"its header has no {key}")
    return header


def checkpoint_info(path: str | os.PathLike) -> dict[str, Any]:
    """The header of the checkpoint at ``path`` (version, world size, fingerprint, config, ...).

    Reads only the header: the body is neither read nor verified.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _read_header(f, path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint '{path}' is a directory, not a checkpoint file") from None


def _read_verified(path: Path) -> tuple[dict[str, Any], bytes]:
    """The header and the body of the file at ``path``, the body's length and checksum
    checked against the header."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint '{path}' is a directory, not a checkpoint file") from None
    with f:
        header = _read_header(f, path)
        body = f.read(header["nbytes"] + 1)
    if len(body) != header["nbytes"]:
        raise CheckpointError(
            f"checkpoint '{path}' is damaged: its body has {len(body)} bytes, the header says {header['nbytes']}"
            + (" (truncated)" if len(body) < header["nbytes"] else "")
        )
    digest = hashlib.sha256(body).hexdigest()
    if digest != header["sha256"]:
        raise CheckpointError(
            f"checkpoint '{path}' is damaged: checksum mismatch (sha256 {digest[:16]}..., "
            f"header says {header['sha256'][:16]}...)"
        )
    return header, body


def _check_identity(path: Path, header: Mapping[str, Any], expect_fingerprint: str | None,
                    expect_world_size: int | None, expect_config: Mapping[str, Any] | None) -> None:
    """Refuse a checkpoint of another run: another world size, fingerprint or config."""
    stored_ws = header.get("world_size")
    if expect_world_size is not None and stored_ws != expect_world_size:
        raise CheckpointError(
            f"checkpoint '{path}' was written for world size {stored_ws}, this run has {expect_world_size}"
        )
    stored_fp, stored_cfg = header.get("fingerprint"), header.get("config")
    diffs = _config_diff(stored_cfg, expect_config) if expect_config is not None and stored_cfg else []
    mismatch = expect_fingerprint is not None and stored_fp != expect_fingerprint
    if mismatch and not diffs and expect_config is not None and stored_cfg is not None:
        # then the keys this run fingerprints and the checkpoint does not (an option set
        # now and unset then) differ: name them with their values
        diffs = [f"{k} (absent) != {expect_config[k]!r}" for k in sorted(expect_config) if k not in stored_cfg]
    if mismatch or diffs:
        detail = ", ".join(diffs) if diffs else f"fingerprint {stored_fp} != {expect_fingerprint}"
        raise CheckpointError(f"checkpoint '{path}' was written with a different config: {detail}")
    if expect_config is not None and stored_cfg is None and expect_fingerprint is None:
        raise CheckpointError(f"checkpoint '{path}' stores no config to compare with")


def load_checkpoint(
    path: str | os.PathLike,
    *,
    expect_fingerprint: str | None = None,
    expect_world_size: int | None = None,
    expect_config: Mapping[str, Any] | None = None,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """Read and verify the checkpoint at ``path``; return its payload.

    Raises :class:`CheckpointError` with one line when the file is missing, damaged
    (bad marker or header, truncated, checksum mismatch, body not loadable), of another
    format version, or written by another run: a world size other than
    ``expect_world_size``, a fingerprint other than ``expect_fingerprint``. When
    ``expect_config`` is given, the stored config entries are compared with it and the
    message names each one that differs (``lr 0.1 != 0.05``); it is also a check by
    itself when no fingerprint is given.
    """
    path = Path(path)
    header, body = _read_verified(path)
    _check_identity(path, header, expect_fingerprint, expect_world_size, expect_config)
    try:
        payload = torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint '{path}' is damaged: its body cannot be loaded ({type(exc).__name__}: {first})"
        ) from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint '{path}' is damaged: its body holds a {type(payload).__name__}, not a dict")
    return payload


# --------------------------------------------------------------------------- run directories


def _check_nonneg(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def checkpoint_path(run_dir: str | os.PathLike, step: int, rank: int = 0) -> Path:
    """``run_dir / f"ckpt-step{step}-rank{rank}.pt"``."""
    _check_nonneg("step", step)
    _check_nonneg("rank", rank)
    return Path(run_dir) / f"ckpt-step{step}-rank{rank}.pt"


def list_checkpoints(run_dir: str | os.PathLike) -> dict[int, dict[int, Path]]:
    """``{step: {rank: path}}`` for every checkpoint file in ``run_dir`` (empty if it does not exist)."""
    found: dict[int, dict[int, Path]] = {}
    directory = Path(run_dir)
    if not directory.is_dir():
        return found
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_file():
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = entry
    return found


def _complete_steps(found: Mapping[int, Mapping[int, Path]], num_ranks: int) -> list[int]:
    return sorted(s for s, ranks in found.items() if all(r in ranks for r in range(num_ranks)))


def latest_step(run_dir: str | os.PathLike, *, num_ranks: int = 1) -> int | None:
    """The highest step whose files exist for all ranks ``0..num_ranks-1``, or ``None``."""
    _check_nonneg("num_ranks", num_ranks, 1)
    steps = _complete_steps(list_checkpoints(run_dir), num_ranks)
    return steps[-1] if steps else None


def latest_checkpoint(run_dir: str | os.PathLike, *, rank: int = 0, num_ranks: int | None = None) -> Path | None:
    """The newest file of ``rank`` in ``run_dir``, or ``None``.

    With ``num_ranks``, only complete steps count (:func:`latest_step`), so every rank
    gets the same step. Without it, only this rank's own files are looked at: ranks
    may then disagree after a crash, which the caller must check.
    """
    _check_nonneg("rank", rank)
    if num_ranks is None:
        steps = sorted(s for s, ranks in list_checkpoints(run_dir).items() if rank in ranks)
        step = steps[-1] if steps else None
    else:
        _check_nonneg("num_ranks", num_ranks, 1)
        if rank >= num_ranks:
            raise ValueError(f"rank must be < num_ranks = {num_ranks}, got {rank}")
        step = latest_step(run_dir, num_ranks=num_ranks)
    return None if step is None else checkpoint_path(run_dir, step, rank)


def prune_checkpoints(
    run_dir: str | os.PathLike, keep_last: int, *, num_ranks: int = 1, rank: int | None = None
) -> list[Path]:
    """Delete checkpoints older than the last ``keep_last`` complete steps; return what was deleted.

    Only files of ``rank`` are touched when it is given (each process prunes its own);
    files of all ranks otherwise. Nothing is deleted until ``keep_last`` complete
    steps exist, and incomplete steps newer than the oldest kept one are left alone
    (another rank may still be writing them).
    """
    _check_nonneg("keep_last", keep_last, 1)
    _check_nonneg("num_ranks", num_ranks, 1)
    if rank is not None:
        _check_nonneg("rank", rank)
    found = list_checkpoints(run_dir)
    complete = _complete_steps(found, num_ranks)
    if len(complete) < keep_last:
        return []
    oldest_kept = complete[-keep_last]
    deleted = []
    for step in sorted(found):
        if step >= oldest_kept:
            break
        for r, p in sorted(found[step].items()):
            if rank is None or r == rank:
                try:
                    p.unlink()
                except FileNotFoundError:
                    continue
                deleted.append(p)
    return deleted

