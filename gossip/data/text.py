"""Text as bytes for next-token language modelling: the ``text`` and ``wikitext2`` data sets.

A corpus is read as UTF-8 and modelled as its bytes (vocabulary 256), so no tokenizer
is trained or shipped and bits per byte compare across corpora and models.

1. **Reading.** :func:`read_text` takes one file or a folder (every regular,
   non-hidden file below it, in sorted order of relative path, joined with a newline
   where a file does not end in one). Each file must be valid UTF-8 (a byte-order mark
   is dropped); line endings are normalised to ``\\n`` (CRLF and lone CR), so the same
   text gives the same bytes whichever system wrote it. An empty file alone, a file
   that is not UTF-8, or text too short for one training and one held-out window is a
   :class:`gossip.data.DataError` of one line naming the file and what is needed.
2. **The default corpus** (``--data text`` without ``--data-dir``):
   :func:`stdlib_corpus`, the ``.py`` sources of the running interpreter's standard
   library (``site-packages``, ``dist-packages`` and ``__pycache__`` left out, files
   that are not UTF-8 skipped), in sorted order of relative path: about 30 MB of real
   text on CPython 3.11 with its test suite, present wherever Python is, the same
   bytes on every machine with the same Python build. Its SHA-256 is the corpus's
   identity, recorded in the run's ``config.json``.
3. **Windows.** :func:`windows` cuts a byte stream into windows of ``context + 1``
   bytes with stride ``context`` (consecutive windows share one byte), as strided
   views: inputs are bytes ``0..context-1`` of a window, targets bytes ``1..context``,
   and nothing is copied. The held-out test set is the *tail* of the corpus
   (``test_fraction`` of it, at most ``max_test_bytes``), so it is text the model has
   never seen rather than windows interleaved with the training ones.
4. **WikiText-2** (``--data wikitext2 --data-dir DIR``): the raw release
   (``wiki.train.raw``, ``wiki.valid.raw``, ``wiki.test.raw``) of Merity et al.,
   "Pointer Sentinel Mixture Models" (arXiv:1609.07843), the corpus of the PowerSGD
   paper's LSTM experiment (Vogels et al., arXiv:1905.13727, Table 3); trained on
   ``wiki.train.raw`` and tested on ``wiki.test.raw``, both as bytes.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gossip.errors import DataError

__all__ = [
    "DEFAULT_CONTEXT",
    "DEFAULT_MAX_TEST_BYTES",
    "DEFAULT_TEST_FRACTION",
    "VOCAB_SIZE",
    "WIKITEXT2_FILES",
    "read_text",
    "stdlib_corpus",
    "windows",
]

VOCAB_SIZE = 256
DEFAULT_CONTEXT = 128
DEFAULT_TEST_FRACTION = 0.1
#: the held-out tail of a large corpus is capped: every evaluation runs the averaged
#: model and each node's own over all of it
DEFAULT_MAX_TEST_BYTES = 1 << 16
WIKITEXT2_FILES = ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _error(message: str) -> Exception:
    return DataError(message)


def _decode(raw: bytes, path: Path) -> bytes | None:
    """``raw`` as normalised UTF-8 bytes, or None if it is not UTF-8."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n").encode("utf-8")


def _utf8_error(raw: bytes, path: Path) -> Exception:
    try:
        raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return _error(f"text file '{path}' is not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                      f"expected UTF-8 text")
    return _error(f"text file '{path}' is not UTF-8")


def _files_below(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)),
                  key=lambda p: p.relative_to(folder).as_posix())


def _join(parts: list[bytes]) -> bytes:
    out = bytearray()
    for b in parts:
        if out and not out.endswith(b"\n"):
            out += b"\n"
        out += b
    return bytes(out)


def read_text(path: str | Path, *, min_bytes: int = 1) -> bytes:
    """The UTF-8 text of one file or of every file below a folder, as normalised bytes."""
    path = Path(path).expanduser()
    if not path.exists():
        raise _error(f"text path '{path}' does not exist; expected a UTF-8 text file or a folder of them")
    if path.is_file():
        raw = path.read_bytes()
        if not raw:
            raise _error(f"text file '{path}' is empty; expected UTF-8 text of at least {min_bytes} bytes")
        data = _decode(raw, path)
        if data is None:
            raise _utf8_error(raw, path)
        if len(data) < min_bytes:
            raise _error(f"text file '{path}' holds {len(data)} bytes; at least {min_bytes} are needed")
        return data
    files = _files_below(path)
    if not files:
        raise _error(f"text folder '{path}' holds no files; expected UTF-8 text files")
    parts = []
    for f in files:
        raw = f.read_bytes()
        data = _decode(raw, f)
        if data is None:
            raise _utf8_error(raw, f)
        if data:
            parts.append(data)
    text = _join(parts)
    if len(text) < min_bytes:
        raise _error(f"text folder '{path}' holds {len(text)} bytes in {len(files)} file(s); "
                     f"at least {min_bytes} are needed")
    return text


def stdlib_corpus() -> tuple[bytes, dict[str, Any]]:
    """The default corpus: the standard library's ``.py`` sources, and its identity."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py")
                    if p.is_file() and not _STDLIB_SKIP.intersection(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    parts, skipped = [], 0
    for f in files:
        data = _decode(f.read_bytes(), f)
        if data is None:  # the test suite's deliberately mis-encoded modules
            skipped += 1
        elif data:
            parts.append(data)
    text = _join(parts)
    if not text:
        raise _error(f"the default text corpus is empty: no .py sources under '{root}'; give --data-dir")
    import sys

    return text, {"corpus": "python-stdlib", "python": sys.version.split()[0], "files": len(parts),
                  "skipped_not_utf8": skipped}


def corpus_identity(name: str, train: bytes, test: bytes, **extra: Any) -> dict[str, Any]:
    h = hashlib.sha256()
    h.update(len(train).to_bytes(8, "little"))
    h.update(train)
    h.update(test)
    return {"corpus": name, "sha256": h.hexdigest(), "train_bytes": len(train), "test_bytes": len(test), **extra}


def windows(stream: bytes | Tensor, context: int) -> tuple[Tensor, Tensor]:
    """``(x, y)``: uint8 views ``(N, context)`` of the windows of ``stream``, y shifted by one."""
    t = stream if isinstance(stream, Tensor) else torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    if t.numel() < context + 1:
        raise ValueError(f"a stream of {t.numel()} bytes holds no window of {context + 1} bytes")
    w = t.unfold(0, context + 1, context)
    return w[:, :-1], w[:, 1:]


def split_tail(text: bytes, *, test_fraction: float, max_test_bytes: int, context: int,
               where: str) -> tuple[bytes, bytes]:
    """``text`` cut into a training head and a held-out tail, each at least one window."""
    need = 2 * (context + 1)
    if len(text) < need:
        raise _error(f"{where} holds {len(text)} bytes; at least {need} are needed (one training and one "
                     f"held-out window of context {context} + 1 bytes); give more text or a smaller context")
    n_test = min(max(context + 1, int(len(text) * test_fraction)), max_test_bytes, len(text) - (context + 1))
    n_test = max(n_test, context + 1)
    return text[:-n_test], text[-n_test:]
