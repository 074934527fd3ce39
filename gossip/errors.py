"""The errors several parts share, in one module that imports nothing of gossip's.

- :class:`NonFiniteError`: a compressor met NaN/inf, or values whose scale overflows
  (fp32 scales, the fp16 range). The training loop turns it into "diverged" by its
  type, never by matching message text.
- :class:`PayloadError`: a payload that does not match what the receiver expects, or
  is damaged (compressors raise it; communicators re-raise it naming the sender).
- :class:`PeerError` and its kinds: a peer did not take part in a communication as
  expected. Every peer error names the peer(s) involved in ``.peers`` (global node
  ids, ascending) so that a failed run says *which* rank stopped answering or sent a
  bad payload.

``gossip.comm`` and ``gossip.compress`` both import from here, so neither depends on
the other; the old import paths (``gossip.comm.errors``, ``gossip.compress.PayloadError``)
still work.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import TextIO

#: a word of a message longer than this is cut (a 50 MB TOML value, a pasted file)
_LONGEST_WORD = 120
_LONG_WORD = re.compile(r"[^\s'\";,]{%d,}" % (_LONGEST_WORD + 1))  # quotes and separators kept


def one_line(message: object) -> str:
    """``message`` as one line a terminal can show: whitespace runs (newlines included)
    become one space, and each word longer than 120 characters keeps its first 60, then
    ``...`` and its length; a long value that a message repeats is cut each time."""
    text = " ".join(str(message).split())

    def cut(m: re.Match) -> str:
        w = m.group(0)
        return f"{w[:60]}...[{len(w):,} characters]"

    return _LONG_WORD.sub(cut, text)


def say_line(line: str, stream: TextIO | None = None) -> None:
    """Write ``line`` and its newline to ``stream`` (standard error by default) in one
    write, then flush.

    Processes that share a stream (torchrun's ranks, torchft's replicas) would run their
    lines together with ``print``: unbuffered (``python -u``, ``PYTHONUNBUFFERED``) it
    writes a text and its newline apart, and another process's line can land between."""
    stream = sys.stderr if stream is None else stream
    stream.write(line + "\n")
    stream.flush()

__all__ = [
    "one_line",
    "say_line",
    "NonFiniteError",
    "DataError",
    "PayloadError",
    "PeerError",
    "PeerTimeoutError",
    "PeerPayloadError",
    "PeerConnectionError",
    "format_peers",
]


class DataError(ValueError):
    """A data set that is missing, incomplete or not in the expected format (one line)."""


class NonFiniteError(ValueError):
    """Input a compressor cannot encode: NaN or inf, or a scale that overflows."""


class PayloadError(ValueError):
    """A payload that does not match what the receiver expects, or is damaged."""

    def __init__(self, row: int, what: str, detail: str):
        self.row = row
        self.what = what
        super().__init__(f"payload row {row}: {what} mismatch: {detail}")

    def __reduce__(self):  # keep row and what when pickled across processes
        return (type(self), (self.row, self.what, str(self).split(" mismatch: ", 1)[-1]))


class PeerError(RuntimeError):
    """A peer did not take part in a communication as expected.

    ``peers`` are the global ids of the peers at fault (or, where the backend cannot
    tell them apart, of every peer the operation waited for); ``op`` names the
    operation (``"neighbor_exchange"``, ``"all_reduce"``, ...).
    """

    def __init__(self, message: str, peers: Iterable[int] = (), op: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.peers: tuple[int, ...] = tuple(sorted(int(p) for p in peers))
        self.op = op
        #: the backend's own text (gloo's, NCCL's): for a log file, not for the one line
        self.detail = detail

    def __reduce__(self):  # keep peers, op and detail when pickled across processes
        return (type(self), (self.args[0] if self.args else "", self.peers, self.op, self.detail))


class PeerTimeoutError(PeerError, TimeoutError):
    """An exchange or collective did not complete within the communicator's timeout."""


class PeerPayloadError(PeerError, ValueError):
    """A payload received from a peer could not be decoded (wrong format, size or step)."""


class PeerConnectionError(PeerError, ConnectionError):
    """The backend reported a broken connection to a peer (it crashed or exited)."""


def format_peers(peers: Iterable[int]) -> str:
    """'rank 3' or 'ranks [1, 3]'."""
    ps = sorted(int(p) for p in peers)
    if not ps:
        return "no peer"
    return f"rank {ps[0]}" if len(ps) == 1 else f"ranks {ps}"


class RunError(RuntimeError):
    """A failure of a training run the user can act on (bad data dir, damaged
    checkpoint, dead peer): one line, exit status 2."""

    exit_code = 2


class Diverged(RunError):
    """Training produced a non-finite loss or model: an outcome, recorded in summary.json."""

    exit_code = 1


class Finished(RunError):
    """--resume of a run that already ended: nothing to do, nothing changed. Exit 0
    under ``--resume auto`` (a restart of a finished job), 2 for an explicit ``--resume``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
