"""Stochastic Gradient Push (Assran, Loizou, Ballas, Rabbat, ICML 2019).

Push-sum over a column-stochastic mixing matrix ``P(t)``, here the topology's
``W(t)`` (every topology of ``topologies`` is doubly stochastic, so column-stochastic;
the default graph in the paper, and the one to pick, is the directed one-peer
exponential graph ``--topology onepeer-exp``, the CLI's default for sgp: keep half,
send half). Node i keeps a numerator ``x_i`` and a push-sum weight ``w_i`` (1 at the
start); the model its optimizer steps on is the de-biased ``z_i = x_i / w_i``.

Step t (t = 1, 2, ...; the graph of step t is ``P = W(t - 1)``), overlap 0:

1. ``x_i <- x_i + u_i``: the local update ``u_i`` (``-gamma grad F_i(z_i)`` for plain
   SGD) was taken at ``z_i``, and moves the numerator.
2. Send ``(x_i, w_i)`` to every out-neighbour ``j`` of ``P``, receive theirs.
3. ``x_i <- P_ii x_i + sum_j P_ij x_j`` and ``w_i <- P_ii w_i + sum_j P_ij w_j``. The
   message carries ``x_j`` itself and the receiver applies ``P_ij`` from its row of
   ``W(t - 1)``: the same numbers as the paper's ``p_ij x_j`` on the wire, in the
   same bytes, and the same summation code as D-PSGD (``Received.weighted_sum``).
4. ``z_i <- x_i / w_i``.

Overlap 1 (the paper's overlap SGP with a delay of one step): messages sent at step
t are received at step t + 1, so the sends of step t overlap the computation
(forward and backward) of step t + 1.

1. ``x_i <- x_i + u_i``.
2. Post the sends of ``(x_i, w_i)`` over ``W(t - 1)`` (non-blocking ``isend``/``irecv``
   under torchrun) and keep the handle.
3. Keep the own share: ``x_i <- P_ii x_i``, ``w_i <- P_ii w_i``.
4. Add the messages of step t - 1 (wait on that handle, or take them from the State
   after a checkpoint): ``x_i += sum_j P_ij(t - 2) x_j``, likewise ``w_i``.
5. ``z_i <- x_i / w_i``.

Mass is conserved: ``sum_i x_i`` plus what is in flight changes only by the local
updates, and ``sum_i w_i`` plus the weights in flight is ``n`` at every step. With
overlap the weights leave 1 (e.g. ``1/2`` after the first step of a one-peer graph);
``z`` corrects for it. With overlap 0 on a doubly-stochastic graph the weights stay 1
and SGP is D-PSGD in adapt-then-combine form, ``x <- W (x + u)``: the same as this
project's ``dpsgd`` step applied to ``x + u`` with a zero update, bit for bit.

Checkpoints. ``state_dict`` first completes the exchange in flight and stores the sum
of its messages (``inbox``) in the State, so a restored run continues bit-identically
and a checkpoint holds no reference to the communicator. ``report`` does the same, so
no exchange is left posted when a run ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gossip import compress as _compress
from gossip.algorithms._common import check_int, node_keys, step_tag
from gossip.algorithms.base import Algorithm
from gossip.comm.base import is_time_varying

__all__ = ["SGP", "SGPConfig", "SGPState"]


@dataclass(frozen=True, kw_only=True)
class SGPConfig:
    """``overlap``: 0 (exchange within the step) or 1 (messages arrive one step later)."""

    overlap: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.overlap, bool) or self.overlap not in (0, 1):
            raise ValueError(f"Arg `overlap` must be 0 or 1 (steps of delay of the messages), got {self.overlap!r}")
        check_int("seed", self.seed, minimum=0)


@dataclass
class SGPState:
    """``t``: the next step (1 at the start); ``numerator`` (m, d) and ``weight`` (m, 1):
    push-sum's ``x`` and ``w``; ``inbox`` (m, d + 1): with overlap, the weighted sum of
    the messages sent at step ``t - 1`` that step ``t`` adds (``has_inbox``), once they
    have been received; empty without overlap."""

    t: int
    numerator: torch.Tensor
    weight: torch.Tensor
    inbox: torch.Tensor
    has_inbox: bool


class SGP(Algorithm):
    """Stochastic Gradient Push, overlapped or not; see the module docstring."""

    shards_flat = True

    name = "sgp"
    Config = SGPConfig
    summary = "SGP: push-sum gossip with de-biased models; overlap=1 hides a step of communication"
    needs_static_graph: ClassVar[bool] = False
    default_topology: ClassVar[str] = "onepeer-exp"

    def __init__(self, config: SGPConfig, comm: Any) -> None:
        super().__init__(config, comm)
        topo = comm.topology
        if topo is None:
            raise ValueError("sgp needs a communicator with a topology")
        if comm.world_size < 2:
            raise ValueError(
                f"sgp is decentralized and needs at least 2 nodes, got world size {comm.world_size}; "
                f"use algo 'allreduce' for a single process"
            )
        self._tv = is_time_varying(topo)
        self._nodes = comm.nodes.cpu()
        self._ident = _compress.build("identity")
        self._pending: tuple[Any, int, int] | None = None  # (handle, step t, d + 1)
        #: scratch tensors kept across steps (payloads, the rows [x, w], sums): not State
        self._bufs: dict[str, torch.Tensor] = {}

    def _buf(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        b = self._bufs.get(name)
        if b is None or tuple(b.shape) != tuple(shape) or b.dtype != dtype or b.device != device:
            b = self._bufs[name] = torch.empty(shape, dtype=dtype, device=device)
        return b

    @property
    def payload_compressor(self) -> Any:
        return self._ident

    def setup(self, X: torch.Tensor, layout: Any = None) -> None:
        m, d = X.shape
        self._take_layout(X, layout)
        overlap = self.config.overlap == 1
        self._pending = None
        self.state = SGPState(
            t=1,
            numerator=X.detach().clone(),
            weight=X.new_ones(m, 1),
            inbox=X.new_zeros(m, d + 1) if overlap else X.new_zeros(0),
            has_inbox=False,
        )

    # --- pieces ----------------------------------------------------------------------
    def _self_w(self, like: torch.Tensor, t: int) -> torch.Tensor:
        """``P_ii`` of the graph of step ``t``, ``W(t - 1)``."""
        topo = self.comm.topology.at(t - 1) if self._tv else self.comm.topology
        sw = [float(topo.self_weight(int(i))) for i in self._nodes]
        return torch.tensor(sw, dtype=like.dtype, device=like.device).unsqueeze(1)

    def _post(self, Y: torch.Tensor, t: int) -> Any:
        """Encode the rows ``[x_i, w_i]`` and post their exchange over ``W(t - 1)``."""
        ledger = self.comm.ledger
        tag = step_tag(t)
        with ledger.phase("compress"):
            # two payload buffers, by the step's parity: with overlap the exchange of step
            # t is still in flight (its payload must stay as it is) when step t + 1 posts
            m, width = Y.shape
            P = self._buf(f"payload{t % 2}", (m, self._ident.payload_nbytes(width)), torch.uint8, Y.device)
            self._ident.encode(Y, node_keys(self.config.seed, self.comm.nodes, t), tag=tag, out=P)
        kw = {"step": t - 1} if self._tv else {}
        with ledger.phase("communicate"):
            return self.comm.neighbor_exchange_async(P, **kw)

    def _mixed(self, handle: Any, t: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``sum_j P_ij [x_j, w_j]`` of the messages of step ``t`` (waits for them)."""
        ledger = self.comm.ledger
        with ledger.phase("communicate"):
            rec = handle.wait()
        tag = step_tag(t)
        def decode(Q: torch.Tensor) -> torch.Tensor:
            with ledger.phase("compress"):  # identity: a view of the payloads, no copy
                return self._ident.decode(Q, width, tag=tag, share=True).to(dtype)

        m = rec.index.shape[0]
        dev = rec.payloads.device
        return rec.weighted_sum(decode, out=self._buf("mixed", (m, width), dtype, dev),
                                scratch=self._buf("scratch", (m, width), dtype, dev))

    def _settle(self) -> None:
        """Complete the exchange in flight and keep the sum of its messages in the State."""
        if self._pending is None:
            return
        handle, t, width = self._pending
        self._pending = None
        s = self.state
        s.inbox.copy_(self._mixed(handle, t, width, s.inbox.dtype))
        s.has_inbox = True

    # --- the step ----------------------------------------------------------------------
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        s = self.state
        t = s.t
        x, w = s.numerator, s.weight
        # Step 1: the local update, taken at z, moves the numerator
        x.add_(U)
        Y = torch.cat([x, w], dim=1, out=self._buf("y", (x.shape[0], x.shape[1] + 1), x.dtype, x.device))
        keep = self._self_w(x, t)
        if self.config.overlap == 0:
            # Steps 2-3: exchange, then mix numerators and weights alike (in place: the
            # same roundings as keep * Y + mixed; Y's bytes are in the payload already)
            mixed = self._mixed(self._post(Y, t), t, Y.shape[1], Y.dtype)
            Y.mul_(keep).add_(mixed)
            x.copy_(Y[:, :-1])
            w.copy_(Y[:, -1:])
        else:
            # Step 2: post this step's messages; they are added at step t + 1
            handle = self._post(Y, t)
            # Step 3: keep the own share
            x.mul_(keep)
            w.mul_(keep)
            # Step 4: add the messages of step t - 1
            self._settle()
            if s.has_inbox:
                x.add_(s.inbox[:, :-1])
                w.add_(s.inbox[:, -1:])
                s.inbox.zero_()
                s.has_inbox = False
            self._pending = (handle, t, Y.shape[1])
        # Step 5: the de-biased model the optimizer steps on next
        torch.div(x, w, out=X)
        s.t = t + 1

    # --- hooks ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self._settle()  # the messages in flight become part of the State
        return super().state_dict()

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self._pending = None

    def weights_in_flight(self) -> torch.Tensor:
        """``w_i`` plus the weight of the messages sent to i and not yet added, (m, 1):
        over all nodes these sum to ``n`` (completes the exchange in flight)."""
        self._settle()
        s = self.state
        inflight = s.inbox[:, -1:] if s.has_inbox else torch.zeros_like(s.weight)
        return s.weight + inflight

    def report(self) -> dict | None:
        if self.state is None:
            return None
        self._settle()  # nothing stays posted when a run ends
        w = self.state.weight
        return {"overlap": self.config.overlap, "push_sum_weight_min": float(w.min()),
                "push_sum_weight_max": float(w.max())}
