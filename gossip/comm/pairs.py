"""Pairwise exchanges with no global barrier, over torch.distributed (gloo).

An asynchronous gossip (AD-PSGD) averages one pair of nodes at a time, whenever the
pair's *active* node has finished a gradient: the active node sends its model and
waits for its partner's, while the *passive* partner answers at once from a
background thread, whatever its own training loop is doing. No rank ever waits for a
rank it is not exchanging with.

:class:`PairChannel` is the transport of that protocol, on a process group of its own
(gloo, made collectively by :func:`PairChannel.create`; payloads go through CPU even
when the training runs on NCCL), so its messages never mix with the run's
collectives and only one thread per process uses the group:

- **active side** (main thread): :meth:`PairChannel.request` sends a 40-byte header
  (magic, kind, sender, the exchange's counter, payload bytes) and the payload to a passive
  peer and receives the peer's payload back; :meth:`PairChannel.bye` tells a passive
  peer that this active node will not send again.
- **passive side**: :meth:`PairChannel.serve` runs a thread that receives a header from
  any rank (gloo's receive from any source), checks it, receives the payload, calls
  ``answer(peer, k, payload) -> reply`` and sends the reply. It ends once every active
  neighbour has said bye; :meth:`PairChannel.join` waits for that and raises, on the
  main thread, whatever stopped the thread (a peer lost, a size that disagrees).

Why byes and no timeout: a gloo receive that times out closes the pair's connection,
so the serving thread cannot poll. It blocks in its receive and is ended by the
messages of its peers (or by a peer's closed connection); on the success path it is
always joined before the process group is destroyed, so it never outlives the
interpreter (the abort at exit a stray native thread causes).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from gossip.errors import PeerConnectionError, PeerError, PeerPayloadError, PeerTimeoutError

__all__ = ["PairChannel"]

_TAG_HEAD = 0x6720
_TAG_REQUEST = 0x6721
_TAG_REPLY = 0x6722
_MAGIC = 0x676F73736970  # "gossip"
_KIND_EXCHANGE, _KIND_BYE = 1, 0
#: how long a passive node's receive may wait for its next request: a request comes once
#: per gradient of an active neighbour, which may be far slower, or in an evaluation
_SERVE_WAIT = timedelta(days=1)


class PairChannel:
    """One rank's end of the pairwise protocol (see the module's docstring). ``timeout``:
    seconds an active node waits for one reply before :class:`PeerTimeoutError`."""

    def __init__(self, group: Any, rank: int, global_ranks: list[int], timeout: float) -> None:
        self.group, self.rank, self._global, self.timeout = group, rank, global_ranks, float(timeout)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def create(cls, group: Any = None, timeout: float = 300.0) -> PairChannel:
        """A channel on a new gloo group over the ranks of ``group`` (default: all); a
        collective, called by every rank of ``group`` in the same order."""
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        pg = dist.new_group(ranks=ranks, backend="gloo", timeout=_SERVE_WAIT)
        return cls(pg, dist.get_rank(pg), ranks, timeout)

    # --- active side ---------------------------------------------------------------------
    def request(self, peer: int, k: int, payload: torch.Tensor) -> torch.Tensor:
        """Send ``payload`` (uint8, one row) to passive ``peer`` as exchange ``k`` and
        return the peer's payload of the same size."""
        P = payload.reshape(-1).to("cpu", torch.uint8).contiguous()
        head = torch.tensor([_MAGIC, _KIND_EXCHANGE, self.rank, int(k), P.numel()], dtype=torch.int64)
        reply = torch.empty_like(P)
        g = self._global[peer]
        works = [dist.isend(head, g, self.group, _TAG_HEAD), dist.isend(P, g, self.group, _TAG_REQUEST),
                 dist.irecv(reply, g, self.group, _TAG_REPLY)]
        self._wait(works, peer, "adpsgd exchange")
        return reply.to(payload.device)

    def bye(self, peer: int) -> None:
        """Tell passive ``peer`` that this node sends no more requests."""
        head = torch.tensor([_MAGIC, _KIND_BYE, self.rank, 0, 0], dtype=torch.int64)
        self._wait([dist.isend(head, self._global[peer], self.group, _TAG_HEAD)], peer, "adpsgd bye")

    def _wait(self, works: list[Any], peer: int, what: str) -> None:
        for w in works:
            try:
                w.wait(timeout=timedelta(seconds=self.timeout))
            except RuntimeError as e:
                if "imed out" in str(e):
                    raise PeerTimeoutError(f"{what}: rank {self.rank} got no answer from rank {peer} within "
                                           f"{self.timeout:g} s", {peer}, what, str(e)) from None
                raise PeerConnectionError(f"{what}: rank {self.rank} lost the connection to rank {peer}, which "
                                          f"closed it (crashed or killed, or stopped after a failure of its own)",
                                          {peer}, what, str(e)) from None

    # --- passive side --------------------------------------------------------------------
    def serve(self, actives: list[int], nbytes: int,
              answer: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
        """Start answering the requests of ``actives`` (payloads of ``nbytes`` bytes) in a
        thread; ``answer(peer, k, payload)`` returns this node's reply and merges."""
        if self._thread is not None:
            raise RuntimeError("PairChannel.serve: already serving")
        self._thread = threading.Thread(target=self._serve, args=(set(actives), int(nbytes), answer),
                                        name=f"adpsgd-serve-{self.rank}", daemon=True)
        self._thread.start()

    def _serve(self, waiting: set[int], nbytes: int, answer: Callable) -> None:
        head = torch.empty(5, dtype=torch.int64)
        try:
            while waiting:
                dist.irecv(head, None, self.group, _TAG_HEAD).wait()  # from any rank: the header names it
                magic, kind, src, k, size = (int(v) for v in head)
                if magic != _MAGIC or src not in waiting:
                    raise PeerPayloadError(f"adpsgd: rank {self.rank} got a message it cannot read from rank {src} "
                                           f"(not an exchange of an active neighbour)", {src}, "adpsgd serve", "")
                if kind == _KIND_BYE:
                    waiting.discard(src)
                    continue
                if size != nbytes:
                    raise PeerPayloadError(f"adpsgd: rank {src} sends payloads of {size} bytes, rank {self.rank} "
                                           f"expects {nbytes} (the same model and compressor on every rank)",
                                           {src}, "adpsgd serve", "")
                P = torch.empty(nbytes, dtype=torch.uint8)
                dist.irecv(P, self._global[src], self.group, _TAG_REQUEST).wait()
                reply = answer(src, k, P).reshape(-1).to("cpu", torch.uint8).contiguous()
                dist.isend(reply, self._global[src], self.group, _TAG_REPLY).wait()
        except BaseException as e:  # handed to the main thread by join()
            self._error = e

    def join(self) -> None:
        """Wait until every active neighbour has said bye; raise what stopped the thread."""
        if self._thread is not None:
            self._thread.join()
        self.check()

    def check(self) -> None:
        """Raise, on the caller's thread, what stopped the serving thread (if anything)."""
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, RuntimeError) and not isinstance(e, PeerError):
                raise PeerConnectionError(f"adpsgd: rank {self.rank} lost the connection to an active neighbour "
                                          f"while serving its exchanges", set(), "adpsgd serve", str(e)) from None
            raise e
