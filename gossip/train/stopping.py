"""How a run is stopped by SIGTERM: torchrun's agent sends it to every worker when one
fails (and a scheduler when it preempts a job).

:func:`gossip.train.main` installs :func:`on_sigterm`, which raises :class:`Terminated`
in the main thread, so the run unwinds as on Ctrl-C: files closed, the process group
torn down, checkpoints intact. Python runs a handler in whatever code the main thread
is in at that moment, and some code drops the exception: a finalizer (Python reports
the exception and drops it) or C code that clears errors. So the handler also records
the signal, and the loop calls :func:`stop_if_terminated` before each step: the run
stops all the same. Imports nothing: the loop and the package both use it.
"""

from __future__ import annotations

__all__ = ["Terminated", "on_sigterm", "reset", "stop_if_terminated"]


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread by :func:`on_sigterm`, or by
    :func:`stop_if_terminated` where the handler's own exception was dropped."""


#: whether SIGTERM arrived since the last :func:`reset` (each :func:`gossip.train.main`)
_terminated = False


def reset() -> None:
    """Forget an earlier SIGTERM: a new run begins."""
    global _terminated
    _terminated = False


def on_sigterm(signum, frame) -> None:
    """The SIGTERM handler: record the signal, and raise :class:`Terminated`."""
    global _terminated
    _terminated = True
    raise Terminated()


def stop_if_terminated() -> None:
    """Raise :class:`Terminated` if SIGTERM arrived and its exception did not reach the
    loop; the loop calls it before each step."""
    if _terminated:
        raise Terminated()
