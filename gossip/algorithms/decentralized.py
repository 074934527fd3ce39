"""Decentralized gossip algorithms of Tang et al. (2018), Tang et al. 2018 (arXiv:1803.06443).

Node i, neighbours N(i), mixing weights W_ij, local update u_i (``-gamma * g_i`` for
plain SGD, the local optimizer's step otherwise), compressor C:

* D-PSGD:  x_i <- sum_j W_ij x_j + u_i
* naive:   x_i <- W_ii x_i + sum_{j != i} W_ij C(x_j) + u_i       (Tang et al. 2018, arXiv:1803.06443, Fig. 1)
* DCD-PSGD (Alg. 1) and ECD-PSGD (Alg. 2): see the classes.

All four run on a batch of hosted nodes (one row each), so the same code serves one
rank under torchrun and a thousand nodes in the in-process simulation.

Time-varying graphs (``onepeer-exp``, ``matching``): D-PSGD and naive keep nothing
about their neighbours, so step t simply mixes with ``W(t - 1)`` (the communicator's
``step``), rows as they are: on the directed one-peer graph node i takes
``(x_i + x_{i-k})/2``, which keeps the average because the columns sum to 1 too. DCD
and ECD keep replicas of fixed neighbours (``needs_static_graph``) and are refused
such a graph in one line.

Replicas. DCD and ECD need sum_j W_ij xhat_j, a weighted sum over the replicas (or
estimates) a node holds of its neighbours. The sum is linear in the replicas, so each
node keeps it as one running vector ``mix`` of size d instead of deg replicas of size
d; ``track_replicas=True`` additionally keeps the per-neighbour replicas (deg x d per
node) so tests can check the paper's invariants and ``replica_drift()`` can compare
the running vector with the sum it stands for.

How the local optimizer composes with gossip: the local optimizer steps from x_t with
the local gradient and its own state (momentum buffers, weight decay); the gossip step
then uses u_t = (optimizer's x) - x_t in place of -gamma g_t. With plain SGD this is
the paper's update; with momentum it is the usual "local momentum" variant of D-PSGD.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gossip import compress as _compress
from gossip.algorithms._common import check_int, node_keys, step_tag
from gossip.algorithms.base import Algorithm
from gossip.comm.base import is_time_varying

__all__ = [
    "GossipBase",
    "DPSGD",
    "DPSGDConfig",
    "Naive",
    "NaiveConfig",
    "DCD",
    "DCDConfig",
    "ECD",
    "ECDConfig",
    "GossipState",
]


# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------
def _check_spec(spec: str, *, need_unbiased: bool, algo: str) -> None:
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"Arg `compressor` must be a compressor spec string, got {spec!r}")
    c = _compress.build(spec)  # raises a ValueError naming what is accepted
    if need_unbiased and not c.unbiased:
        raise ValueError(
            f"Arg `compressor` of {algo} must be unbiased (Tang et al. 2018, arXiv:1803.06443, Assumption 1.6), "
            f"got {spec!r}; unbiased compressors: "
            + ", ".join(n for n in _unbiased_names())
            + "; for a biased (contractive) compressor use algo 'choco' (CHOCO-SGD)"
        )


def _unbiased_names() -> list[str]:
    out = []
    for name in _compress.available():
        try:
            if _compress.build(name).unbiased:
                out.append(name)
        except (ValueError, TypeError):
            continue
    return out


@dataclass(frozen=True, kw_only=True)
class DPSGDConfig:
    """D-PSGD: full-precision models are exchanged (``precision`` = wire format);
    ``local_steps`` H > 1 gossips only after every H-th step (local steps between)."""

    precision: str = "fp32"
    local_steps: int = 1
    seed: int = 0
    #: ``clippedgossip`` (He, Karimireddy and Jaggi, arXiv:2202.01545): each node clips
    #: its neighbours' differences to its own model before mixing (:mod:`gossip.robust`)
    robust: str | None = None

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "fp16"):
            raise ValueError(
                f"Arg `precision` must be 'fp32' or 'fp16', got {self.precision!r}"
            )
        check_int("local_steps", self.local_steps, minimum=1)
        check_int("seed", self.seed, minimum=0)
        if self.robust is not None:
            from gossip.robust import parse_robust

            try:
                parse_robust(self.robust)
            except ValueError as e:
                raise ValueError(f"Arg `robust`: {e}") from None

    @property
    def compressor(self) -> str:
        return "identity" if self.precision == "fp32" else "fp16"


@dataclass(frozen=True, kw_only=True)
class NaiveConfig:
    """D-PSGD that sends C(x_j) instead of x_j: the failing baseline of Tang et al. 2018 (arXiv:1803.06443)."""

    compressor: str = "quant:bits=8"
    seed: int = 0

    def __post_init__(self) -> None:
        _check_spec(self.compressor, need_unbiased=True, algo="naive")
        check_int("seed", self.seed, minimum=0)


@dataclass(frozen=True, kw_only=True)
class _ReplicaConfig:
    """The options DCD and ECD share: an unbiased compressor, the seed of its random
    keys, and whether to keep each neighbour's replica (``track_replicas``)."""

    #: the algorithm the messages name
    algo: ClassVar[str] = ""

    compressor: str = "quant:bits=8"
    seed: int = 0
    track_replicas: bool = False

    def __post_init__(self) -> None:
        _check_spec(self.compressor, need_unbiased=True, algo=self.algo)
        check_int("seed", self.seed, minimum=0)
        if not isinstance(self.track_replicas, bool):
            raise TypeError(f"Arg `track_replicas` must be a bool, got {self.track_replicas!r}")


@dataclass(frozen=True, kw_only=True)
class DCDConfig(_ReplicaConfig):
    """DCD-PSGD: compressed differences of successive models."""

    algo: ClassVar[str] = "dcd"


@dataclass(frozen=True, kw_only=True)
class ECDConfig(_ReplicaConfig):
    """ECD-PSGD: compressed extrapolations, estimates of neighbours' models."""

    algo: ClassVar[str] = "ecd"


# --------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------
@dataclass
class GossipState:
    """Everything a gossip algorithm's next step reads.

    ``t`` is the paper's iteration counter (1 at the first step). ``mix`` is the running
    weighted sum of replicas (DCD, ECD; empty for D-PSGD and naive). ``replicas`` holds,
    for each hosted node, its replicas of its padded neighbours, shape (m, D, d), when
    ``track_replicas`` is on (empty otherwise). ``self_estimate`` is ECD's estimate of
    the node's own model (tracked mode only). Random keys are a pure function of
    (seed, node, t), so no generator state needs saving.
    """

    t: int
    mix: torch.Tensor
    replicas: torch.Tensor
    self_estimate: torch.Tensor


# --------------------------------------------------------------------------------------
# Algorithms
# --------------------------------------------------------------------------------------
_TAKES_INTACT: dict[type, bool] = {}


def _takes_intact(compressor: Any) -> bool:
    """Whether ``compressor.decode`` takes ``intact`` (a stand-in's may not)."""
    kind = type(compressor)
    known = _TAKES_INTACT.get(kind)
    if known is None:
        try:
            known = "intact" in inspect.signature(compressor.decode).parameters
        except (TypeError, ValueError):
            known = False
        _TAKES_INTACT[kind] = known
    return known


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        and a.dtype == b.dtype and a.device == b.device
    )


class GossipBase(Algorithm):
    """The base of the gossip family (D-PSGD, naive, DCD, ECD, and CHOCO-SGD and NoLoCo
    elsewhere): self weights, compressing, exchanging, mixing."""

    shards_flat = True

    uses_mix: ClassVar[bool] = False
    #: ECD holds an estimate of its own model, distinct from the model itself
    has_self_estimate: ClassVar[bool] = False

    def __init__(self, config: Any, comm: Any) -> None:
        super().__init__(config, comm)
        topo = comm.topology
        if topo is None:
            raise ValueError(f"{self.name} needs a communicator with a topology")
        if comm.world_size < 2:
            raise ValueError(
                f"{self.name} is decentralized and needs at least 2 nodes, got world size "
                f"{comm.world_size}; use algo 'allreduce' for a single process"
            )
        self.compressor = _compress.build(config.compressor)
        #: scratch tensors reused across steps (payloads, decodes, sums): not State, they
        #: hold nothing a later step reads (see _buf)
        self._bufs: dict[str, torch.Tensor] = {}
        self._self_w_cache: dict[tuple, torch.Tensor] = {}
        nodes = comm.nodes.cpu()
        self._nodes = nodes
        #: a time-varying topology: W(t) changes every step (the base class has refused
        #: it to algorithms that need a static graph)
        self._tv = is_time_varying(topo)
        if self._tv:
            self._self_w64 = torch.zeros(len(nodes), 1, dtype=torch.float64)
            self._pad_idx = torch.zeros(len(nodes), 0, dtype=torch.int64)
            self._pad_w64 = torch.zeros(len(nodes), 0, dtype=torch.float64)
            return
        self._self_w64 = torch.tensor(
            [float(topo.self_weight(int(i))) for i in nodes], dtype=torch.float64
        ).unsqueeze(1)
        idx, w = topo.padded_neighbors()
        self._pad_idx = torch.as_tensor(idx, dtype=torch.int64)[nodes]
        self._pad_w64 = torch.as_tensor(w, dtype=torch.float64)[nodes]

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    def _self_w(self, like: torch.Tensor, t: int | None = None) -> torch.Tensor:
        """``W_ii`` of the hosted nodes; of ``W(t - 1)`` (the graph of paper step ``t``)
        on a time-varying topology."""
        if self._tv:
            if t is None:
                raise ValueError(f"{self.name}: a time-varying topology needs the step of W(t)")
            sw = self.comm.topology.at(t - 1).self_weights[self._nodes.numpy()]
            return torch.as_tensor(sw, dtype=like.dtype, device=like.device).unsqueeze(1)
        key = (like.dtype, like.device)
        w = self._self_w_cache.get(key)
        if w is None:
            w = self._self_w_cache[key] = self._self_w64.to(dtype=like.dtype, device=like.device)
        return w

    def _buf(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch tensor kept across steps (allocated again only when the shape,
        dtype or device changes): the steady state allocates nothing of size d."""
        b = self._bufs.get(name)
        if b is None or tuple(b.shape) != tuple(shape) or b.dtype != dtype or b.device != device:
            b = self._bufs[name] = torch.empty(shape, dtype=dtype, device=device)
        return b

    def _exchange_kw(self, t: int) -> dict:
        """The communicator's ``step``: paper step t (1, 2, ...) uses W(t - 1)."""
        return {"step": t - 1} if self._tv else {}

    # one encode -> exchange -> (own decode, weighted sum of neighbours' decodes)
    def _gossip(
        self, Z: torch.Tensor, t: int, compressor: Any, *, want_own: bool,
        finish: Any = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, Any, torch.Tensor]:
        """Encode ``Z`` (m, d), exchange, decode. Returns (own decode or None, weighted
        sum of the neighbours' decodes, the Received, the payloads). ``finish``: as
        :meth:`gossip.comm.Received.weighted_sum`'s, each block of the weighted sum
        handed over in cache (the returned sum then holds the last block only).

        Every result lives in a buffer reused by the next call (the payloads, the
        decodes, the sum) or, with ``identity``, is a view into the payloads: use them
        within the step. With ``identity`` the values are copied once, into the payload
        (the bytes the transport sends); decoding reads them where they lie.
        """
        ledger = self.comm.ledger
        m, d = Z.shape
        dev = Z.device
        tag = step_tag(t)
        f32 = torch.float32
        with ledger.phase("compress"):
            keys = node_keys(self.config.seed, self.comm.nodes, t)
            P = self._buf("payload", (m, compressor.payload_nbytes(d)), torch.uint8, dev)
            compressor.encode(Z, keys, tag=tag, out=P)
            written = P._version
            own = None
            if want_own:
                own = compressor.decode(P, d, tag=tag, out=self._buf("own", (m, d), f32, dev), share=True)
                own = own.to(Z.dtype)
        with ledger.phase("communicate"):
            rec = self.comm.neighbor_exchange(P, **self._exchange_kw(t))
        def decode(Q: torch.Tensor) -> torch.Tensor:
            # In the simulation the received batch is our own batch of payloads: reuse
            # the decode of it instead of decoding the same bytes twice.
            if own is not None and _same_tensor(Q, P):
                return own
            D = self._buf("received", (Q.shape[0], d), f32, dev)
            # the simulation's received batch is the payloads encoded above, untouched
            # since (same tensor, same version): nothing between could damage them
            # (a stand-in compressor whose decode has no such option decodes as always)
            kw = {"intact": True} if Q is P and Q._version == written and _takes_intact(compressor) else {}
            with ledger.phase("compress"):
                return compressor.decode(Q, d, tag=tag, out=D, share=True, **kw).to(Z.dtype)

        # "compress" is encoding and decoding only; the weighted sum is the mixing
        # step's arithmetic, like the update of x that follows it
        mixed = rec.weighted_sum(decode, out=self._buf("mixed", (m, d), Z.dtype, dev),
                                 scratch=self._buf("scratch", (m, d), Z.dtype, dev), finish=finish)
        return own, mixed, rec, P

    def _exact_mix(self, X: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """sum_j W_ij x_j over full-precision models: the starting replicas."""
        own, mixed, rec, _ = self._gossip(X, 0, _compress.build("identity"), want_own=False)
        return self._self_w(X) * X + mixed, rec  # a new tensor: mixed is a reused buffer

    def _received_rows(self, rec: Any, d: int, tag: int, compressor: Any, dtype) -> torch.Tensor:
        """Decoded payloads of each hosted node's padded neighbours: (m, D, d)."""
        senders = torch.as_tensor(rec.senders, dtype=torch.int64)
        D = compressor.decode(rec.payloads, d, tag=tag).to(dtype)
        # map each padded neighbour id to its row in the received batch
        pos = torch.full((self.comm.world_size,), -1, dtype=torch.int64)
        pos[senders] = torch.arange(len(senders))
        rows = pos[self._pad_idx]
        out = torch.zeros(self._pad_idx.shape + (d,), dtype=dtype)
        valid = (rows >= 0) & (self._pad_w64 > 0)  # padding slots stay zero
        out[valid] = D[rows[valid]]
        return out

    def setup(self, X: torch.Tensor, layout: Any = None) -> None:
        m, d = X.shape
        self._take_layout(X, layout)
        empty = X.new_zeros(0)
        mix = empty
        rec = None
        if self.uses_mix:
            mix, rec = self._exact_mix(X)
        replicas = empty
        self_est = empty
        if getattr(self.config, "track_replicas", False):
            ident = _compress.build("identity")
            if rec is None:
                _, _, rec, _ = self._gossip(X, 0, ident, want_own=False)
            replicas = self._received_rows(rec, d, step_tag(0), ident, X.dtype)
            if self.has_self_estimate:
                self_est = X.detach().clone()
        self.state = GossipState(t=1, mix=mix, replicas=replicas, self_estimate=self_est)

    # --- checks available in tracked mode ------------------------------------------
    def replica_sum(self, X: torch.Tensor) -> torch.Tensor:
        """sum_j W_ij xhat_j recomputed from the tracked per-neighbour replicas."""
        s = self.state
        if s.replicas.numel() == 0:
            raise RuntimeError(f"{self.name}: construct with track_replicas=True to check replicas")
        own = s.self_estimate if s.self_estimate.numel() else X
        w = self._pad_w64.to(X.dtype).unsqueeze(-1)
        return self._self_w(X) * own + (w * s.replicas).sum(dim=1)

    def replica_drift(self, X: torch.Tensor) -> float:
        """max |running mix - sum over tracked replicas|: rounding drift of the running sum."""
        return float((self.state.mix - self.replica_sum(X)).abs().max())


class DPSGD(GossipBase):
    """D-PSGD (Lian et al. 2017; Tang et al. 2018 (arXiv:1803.06443) Sec. 3).

    Step I:   send x_i to every neighbour, receive x_j.
    Step II:  x_i <- W_ii x_i + sum_{j != i} W_ij x_j + u_i.
    With ``local_steps`` H > 1, steps t with t % H != 0 are local (x_i <- x_i + u_i,
    nothing sent) and steps I-II run at t = H, 2H, ...; H = 1 is D-PSGD.
    """

    name = "dpsgd"
    fault_tolerant = True
    byzantine_messages = True
    Config = DPSGDConfig
    state_copies = 5
    summary = "D-PSGD: exchange full-precision models with neighbours"

    def __init__(self, config: DPSGDConfig, comm: Any) -> None:
        super().__init__(config, comm)
        from gossip.robust import parse_robust

        self.robust = parse_robust(config.robust) if config.robust is not None else None
        if self.robust is not None:
            self.fault_tolerant = False  # a rebuilt graph's radius rule is not carried
        #: each hosted node's clipping radius tau_i of the last ClippedGossip step
        self.last_tau: torch.Tensor | None = None

    @property
    def period(self) -> int:
        return self.config.local_steps

    #: ``step`` takes ``prepare``: the update ``U`` may be made on demand, rows by rows
    prepares_update = True

    def step(self, X: torch.Tensor, U: torch.Tensor, prepare: Any = None) -> None:
        """``prepare(rows)``, where given, returns the update's rows ``rows`` (``U`` is then
        None): it is asked for each block of rows once, in ascending order, just before
        the block is updated, so that the vectorized optimizer makes its SGD update a
        slab at a time, still in cache when it is added. ``prepare.combine(rows, w, mixed)``,
        where it has one, does a block's whole update, ``X[rows] <- w X[rows] + mixed +
        u(rows)`` with the same roundings, and makes ``u`` itself."""
        if prepare is None:
            prepare = U.__getitem__
        t = self.state.t
        if t % self.config.local_steps:  # a local step: no gossip
            X.add_(prepare(slice(0, None)))
            self.state.t = t + 1
            return
        if self.robust is not None or self.adversary is not None:
            self._step_untrusted(X, prepare(slice(0, None)), t)
            self.state.t = t + 1
            return
        # Step I, and step II in place as each block of rows' weighted sum is complete
        # (still in cache): the same roundings as W_ii * x + mixed + u. Many hosted rows
        # on the CPU (the simulation) are summed in blocks of rows; X is only written
        # after every payload was encoded, and the sum reads the payloads, not X.
        w = self._self_w(X, t)
        # the vectorized optimizer's update may make u and add it in one pass (the same bits)
        combine = getattr(prepare, "combine", None)

        def finish(s: slice, mixed: torch.Tensor) -> None:
            if combine is not None:
                combine(s, w[s], mixed)
                return
            u = prepare(s)  # before X[s] changes: the update reads the rows' x
            X[s].mul_(w[s]).add_(mixed).add_(u)

        self._gossip(X, t, self.compressor, want_own=False, finish=finish)
        self.state.t = t + 1


    def _step_untrusted(self, X: torch.Tensor, U: torch.Tensor, t: int) -> None:
        """A gossip step among nodes that may lie. The Byzantine nodes' messages are
        crafted (:class:`gossip.robust.Adversary`) after they are formed; their own
        models follow the honest update.

        Without ``robust``: D-PSGD's Steps I-II with those messages.
        With ``robust=clippedgossip`` (arXiv:2202.01545, Alg. 1):

        Step I:   the half step y_i = x_i + u_i (the local optimizer's);
        Step II:  send y_i to every neighbour, receive y_j;
        Step III: x_i <- y_i + sum_{j != i} W_ij CLIP(y_j - y_i, tau_i), with tau_i the
                  fixed radius or the adaptive one (clip the b farthest neighbours to
                  the distance of the next).
        """
        from gossip.robust import clipped_mix

        adv = self.adversary
        k = t // self.config.local_steps  # the exchange's index: an attack's clock counts exchanges
        if self.robust is None:
            Z = X if adv is None else adv.craft(X, self.comm.nodes, k)
            _, mixed, _, _ = self._gossip(Z, t, self.compressor, want_own=False)
            X.mul_(self._self_w(X, t)).add_(mixed).add_(U)
            return
        Y = X + U  # Step I
        Z = Y if adv is None else adv.craft(Y, self.comm.nodes, k)
        ledger = self.comm.ledger
        d = X.shape[1]
        tag = step_tag(t)
        with ledger.phase("compress"):  # Step II
            keys = node_keys(self.config.seed, self.comm.nodes, t)
            P = self.compressor.encode(Z, keys, tag=tag)
        with ledger.phase("communicate"):
            rec = self.comm.neighbor_exchange(P, **self._exchange_kw(t))
        with ledger.phase("compress"):
            D = rec.decode(lambda Q: self.compressor.decode(Q, d, tag=tag)).to(X.dtype)
        new, taus = clipped_mix(Y, D, rec.index, rec.weights, rec.degrees, self.robust)  # Step III
        X.copy_(new)
        self.last_tau = taus


class Naive(GossipBase):
    """D-PSGD with naively compressed models (Tang et al. 2018, arXiv:1803.06443, Sec. 4, Fig. 1).

    Step I:   send C(x_i) to every neighbour, receive C(x_j).
    Step II:  x_i <- W_ii x_i + sum_{j != i} W_ij C(x_j) + u_i.
    The compression error is never corrected and accumulates: the baseline that fails.
    """

    name = "naive"
    fault_tolerant = True
    Config = NaiveConfig
    state_copies = 5
    summary = "D-PSGD sending compressed models (Tang et al. 2018, arXiv:1803.06443, Fig. 1 baseline; does not converge)"

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        t = self.state.t
        _, mixed, _, _ = self._gossip(X, t, self.compressor, want_own=False)
        X.mul_(self._self_w(X, t)).add_(mixed).add_(U)
        self.state.t = t + 1


class DCD(GossipBase):
    """DCD-PSGD, Tang et al. 2018 (arXiv:1803.06443) Algorithm 1 (difference compression).

    Every neighbour of node j keeps a replica xhat_j, equal to x_1 at the start, and
    ``mix_i = W_ii x_i + sum_{j != i} W_ij xhat_j``.

    Step 1:  x_i^{t+1/2} = mix_i + u_i                  (= sum_j W_ij xhat_j - gamma g_i)
    Step 2:  z_i = x_i^{t+1/2} - x_i^t;  x_i^{t+1} = x_i^t + C(z_i)
    Step 3:  send C(z_i); every holder sets xhat_i += C(z_i), so
             mix_i += W_ii C(z_i) + sum_{j != i} W_ij C(z_j).
    Replicas of node i equal x_i exactly on every holder: both are updated by adding
    the same decoded C(z_i).
    """

    name = "dcd"
    fault_tolerant = True
    Config = DCDConfig
    state_copies = 8
    summary = "DCD-PSGD (Tang et al. 2018, arXiv:1803.06443, Alg. 1): exchange compressed model differences"
    robust_refusal = (
        "its neighbours' replicas add up every message received, so a clipped difference of one "
        "step does not bound what a Byzantine node has moved its replica by; ClippedGossip's "
        'guarantee (arXiv:2202.01545) is for exact models')
    uses_mix = True
    needs_static_graph = True

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        s = self.state
        t = s.t
        # Step 1 and 2, in a reused buffer: z = (mix + u) - x
        Z = torch.add(s.mix, U, out=self._buf("z", X.shape, X.dtype, X.device)).sub_(X)
        own, mixed, rec, _ = self._gossip(Z, t, self.compressor, want_own=True)
        X.add_(own)
        # Step 3: mix += W_ii C(z_i) + mixed (Z is free again: it holds the sum)
        s.mix.add_(torch.mul(own, self._self_w(X), out=Z).add_(mixed))
        if s.replicas.numel():
            s.replicas.add_(
                self._received_rows(rec, X.shape[1], step_tag(t), self.compressor, X.dtype)
            )
        s.t = t + 1


class ECD(GossipBase):
    """ECD-PSGD, Tang et al. 2018 (arXiv:1803.06443) Algorithm 2 (extrapolation compression), t = 1, 2, ...

    Every holder of node j (j itself included) keeps an estimate xtilde_j, equal to
    x_1 at the start, and ``mix_i = sum_j W_ij xtilde_j`` (self included, as in the
    paper's matrix form).

    Step 1:  x_i^{t+1} = mix_i + u_i                    (= sum_j W_ij xtilde_j - gamma g_i)
    Step 2:  z_i = (1 - t/2) x_i^t + (t/2) x_i^{t+1}
    Step 3:  send C(z_i); every holder sets xtilde_i = (1 - 2/t) xtilde_i + (2/t) C(z_i), so
             mix_i = (1 - 2/t) mix_i + (2/t) sum_j W_ij C(z_j).
    At t = 1 the first coefficient is -1: xtilde_2 = 2 C(z_1) - x_1.
    """

    name = "ecd"
    fault_tolerant = True
    Config = ECDConfig
    state_copies = 9
    summary = "ECD-PSGD (Tang et al. 2018, arXiv:1803.06443, Alg. 2): exchange compressed extrapolations"
    robust_refusal = (
        "its neighbours' estimates extrapolate every message received, so a clipped difference of "
        "one step does not bound what a Byzantine node has moved its estimate by; ClippedGossip's "
        'guarantee (arXiv:2202.01545) is for exact models')
    uses_mix = True
    needs_static_graph = True
    has_self_estimate = True

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        s = self.state
        t = s.t
        # Step 1 (into a reused buffer)
        nxt = torch.add(s.mix, U, out=self._buf("next", X.shape, X.dtype, X.device))
        # Step 2: z = (1 - t/2) x + (t/2) x^{t+1}, the same roundings in reused buffers
        Z = torch.mul(X, 1.0 - t / 2.0, out=self._buf("z", X.shape, X.dtype, X.device))
        Z.add_(torch.mul(nxt, t / 2.0, out=self._buf("z2", X.shape, X.dtype, X.device)))
        own, mixed, rec, _ = self._gossip(Z, t, self.compressor, want_own=True)
        # Step 3 (Z is free again)
        a, b = 1.0 - 2.0 / t, 2.0 / t
        s.mix.mul_(a).add_(torch.mul(own, self._self_w(X), out=Z).add_(mixed).mul_(b))
        if s.replicas.numel():
            got = self._received_rows(rec, X.shape[1], step_tag(t), self.compressor, X.dtype)
            s.replicas.mul_(a).add_(b * got)
            s.self_estimate.mul_(a).add_(b * own)
        X.copy_(nxt)
        s.t = t + 1
