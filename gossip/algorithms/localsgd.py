"""Communicate less often: local SGD, SlowMo and DiLoCo.

All three let every node take ``H = local_steps`` steps of its local optimizer on its
own, then synchronise the nodes with one all-reduce (over all nodes: no graph). Node
i, round start x_s (the model every node held after the last synchronisation), local
update u_i (the local optimizer's step, ``-gamma * g_i`` for plain SGD), mean over the
n nodes written xbar:

* local SGD:  x_i <- x_i + u_i every step; after every H-th step x_i <- xbar.
* SlowMo (Wang et al., ICLR 2020, arXiv:1910.00643, Alg. 1), step size eta (the
  current learning rate): after every H-th step,
  v <- beta v + (x_s - xbar) / eta,  x <- x_s - alpha eta v.
* DiLoCo (Douillard et al. 2023, arXiv:2311.08105, Alg. 1): after every H-th step
  the outer gradient Delta = x_s - mean_i x_i (each node sends Delta_i = x_s - x_i,
  compressed with any compressor of the registry, optionally with error feedback),
  then an outer Nesterov SGD step  b <- mu b + Delta,  x <- x_s - lr_out (Delta + mu b).
  With ``fragments=F`` (Streaming DiLoCo, 2025) the model is cut into F fragments
  that are synchronised at staggered steps: fragment f after every step t with
  t = o_f (mod H),
  o_f = ((f + 1) H // F) mod H; every fragment still synchronises once per H steps.
  Streaming DiLoCo's overlap (Douillard et al. 2025, arXiv:2501.18512; torchft's
  ``fragment_sync_delay``/``fragment_update_alpha``): with tau > 0 a fragment's
  pseudo-gradient is taken and its exchange posted tau steps before o_f; the inner
  steps go on meanwhile, and at o_f the outer step gives theta' from theta and the
  exchanged mean, and the fragment becomes (1 - alpha) theta' + alpha x_i (x_i: the
  local values, tau steps further on), theta <- theta'. Fragments are cut by size, or
  at the modules named in ``fragment_modules``.
  The overlapped outer step (``outer_delay=1``; Kale et al. 2025, "Eager Updates For
  Overlapped Communication and Computation in DiLoCo", arXiv:2502.12996, their eager
  variant): the exchange of round k's pseudo-gradients is posted at the end of round
  k and waited at the end of round k+1, the inner steps of round k+1 running while it
  is in flight. Node i's outer step at the end of round k uses, instead of the mean
  Delta^k it does not have yet, the eager estimate
  Delta~_i^k = Delta^{k-1} + (Delta_i^k - Delta_i^{k-1}) / n: the mean of round k-1
  with node i's own share replaced by its fresh pseudo-gradient (Delta^0 = Delta_i^0 =
  0). Each node takes its own outer step, so theta and b are per node and the replicas
  differ slightly between rounds.

They act on the model (``acts_on = "model"``): the local optimizer steps first, its
state (momentum buffers, AdamW's moments) stays each node's own and is neither
averaged nor reset at a synchronisation. Nothing is sent on the other steps.

Bytes per node per H steps (ledger): one ring all-reduce of the fp32 model,
2 (n - 1) / n x 4 d. DiLoCo with a linear compressor (identity, randomk,
randomblock) all-reduces its kept fp32 values; with any other compressor it uses
the sharded two-way exchange by default (``exchange="sharded"``: node j averages the
4-bit messages of its shard, compresses the mean again with error feedback of its
own, as SparseLoCo and torchft's quantized all-reduce do, and all-gathers it), about
2 (n - 1) / n x payload_nbytes(d) whatever n: for ``quant:bits=4`` an eighth of the
fp32 all-reduce plus headers and scales. ``exchange="allgather"`` all-gathers the
payloads, (n - 1) x payload_nbytes(d), as every run before the option did (a State
without an ``exchange`` entry resumes that way).

Simulation and torchrun: the sharded and the all-gathered paths decode and average the
same payloads in the same order everywhere, so they are bit-identical between the two; an all-reduce
is, like ``allreduce``'s, equal only to rounding beyond 2 nodes (the backend's ring
adds in another order, see docs/comm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from gossip import compress as _compress
from gossip._checks import check_float
from gossip.algorithms._centralized import ErrorFeedback, check_fraction, check_spec
from gossip.algorithms._common import check_int, node_keys, shared_key, step_tag
from gossip.algorithms._robust import ShardedRule, check_aggregator
from gossip.algorithms._sharded import ExchangeMixin, ShardPlan, check_exchange
from gossip.algorithms.base import Algorithm, ParamLayout, WireFormat
from gossip.compress import wire as _wire

__all__ = [
    "PeriodicBase",
    "DiLoCo",
    "DiLoCoConfig",
    "DiLoCoState",
    "LocalSGD",
    "LocalSGDConfig",
    "LocalState",
    "SlowMo",
    "SlowMoConfig",
    "SlowMoState",
]

_PSEUDO_STREAM = 7
_SERVER_STREAM = 1 << 32  # + fragment start: the shard owners' second compression


def _check_positive(name: str, value: Any) -> None:
    try:
        check_float(f"Arg `{name}`", value, lo=0.0, lo_open=True)
    except ValueError:
        raise ValueError(f"Arg `{name}` must be a finite number > 0, got {value!r}") from None


# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LocalSGDConfig:
    """``local_steps``: H, the local steps between two averages (1: average every step)."""

    local_steps: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("local_steps", self.local_steps, minimum=1)
        check_int("seed", self.seed, minimum=0)


@dataclass(frozen=True, kw_only=True)
class SlowMoConfig:
    """``slow_lr``: alpha; ``slow_momentum``: beta (papers' defaults alpha = 1, beta = 0.7)."""

    local_steps: int = 12
    slow_lr: float = 1.0
    slow_momentum: float = 0.7
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("local_steps", self.local_steps, minimum=1)
        _check_positive("slow_lr", self.slow_lr)
        check_fraction("slow_momentum", self.slow_momentum)
        check_int("seed", self.seed, minimum=0)


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """DiLoCo's outer step and pseudo-gradient exchange.

    ``outer_lr`` 0.7 and ``outer_momentum`` 0.9 (Nesterov) are the paper's; ``compressor``
    compresses each node's pseudo-gradient (``identity``: exact); ``error_feedback``
    keeps what compression dropped for the next round; ``fragments`` F > 1 is the
    streaming variant (F <= local_steps, so every fragment has its own step).

    Streaming DiLoCo's overlap, with torchft's names: ``fragment_sync_delay`` tau (0: no
    overlap) inner steps run while a fragment's exchange is in flight, tau below the
    fragment period local_steps // F; ``fragment_update_alpha`` alpha in [0, 1] mixes
    the local values into the synchronised ones (0: take the outer step's result).
    ``fragment_modules`` (e.g. ``"layers.2,head"``): the fragments start at these
    modules' first parameters instead of being cut by size; F = their count + 1.

    ``outer_delay`` 1 overlaps a whole round with the exchange (the eager updates of
    Kale et al. 2025, arXiv:2502.12996): round k's exchange is waited at the end of
    round k+1, and the outer step uses the eager estimate meanwhile; 0 (default): the
    synchronous outer step. Not with ``fragment_sync_delay`` (one overlap or the other).

    ``aggregator`` (``--aggregator``): the rule over the nodes' pseudo-gradients in place of
    their mean (``median``, ``trimmed:f=F``, ``cclip:tau=T``; :mod:`gossip.robust`); not
    with ``outer_delay`` 1, whose eager estimate is a correction of the mean.
    """

    local_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compressor: str = "identity"
    error_feedback: bool = False
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    fragment_modules: str = ""
    seed: int = 0
    exchange: str | None = None
    outer_delay: int = 0
    aggregator: str = "mean"

    @property
    def fragment_count(self) -> int:
        """F: ``fragments``, or the number of ``fragment_modules`` + 1."""
        mods = _module_list(self.fragment_modules)
        return len(mods) + 1 if mods else self.fragments

    def __post_init__(self) -> None:
        check_exchange(self.exchange, "diloco")
        check_int("local_steps", self.local_steps, minimum=1)
        _check_positive("outer_lr", self.outer_lr)
        check_fraction("outer_momentum", self.outer_momentum)
        check_spec(self.compressor, "diloco")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"Arg `error_feedback` must be a bool, got {self.error_feedback!r}")
        check_int("fragments", self.fragments, minimum=1)
        if self.fragments > self.local_steps:
            raise ValueError(
                f"Arg `fragments` must be <= local_steps ({self.local_steps}) so that every fragment "
                f"synchronises at a step of its own, got {self.fragments}"
            )
        if not isinstance(self.fragment_modules, str):
            raise TypeError(f"Arg `fragment_modules` must be a comma-separated string of module names, "
                            f"got {self.fragment_modules!r}")
        F = self.fragment_count
        if self.fragment_modules and self.fragments not in (1, F):
            raise ValueError(f"Arg `fragments` ({self.fragments}) disagrees with the {F} fragments that "
                             f"`fragment_modules` {self.fragment_modules!r} makes; give one of them")
        if F > self.local_steps:
            raise ValueError(f"Arg `fragment_modules` makes {F} fragments, more than local_steps "
                             f"({self.local_steps}): every fragment needs a step of its own")
        check_int("fragment_sync_delay", self.fragment_sync_delay, minimum=0)
        period = self.local_steps // F
        if self.fragment_sync_delay >= period:
            raise ValueError(
                f"Arg `fragment_sync_delay` (tau) must be below the fragment period local_steps // fragments "
                f"= {self.local_steps} // {F} = {period}, got {self.fragment_sync_delay}"
            )
        try:
            check_float("Arg `fragment_update_alpha`", self.fragment_update_alpha, lo=0.0, hi=1.0)
        except ValueError:
            raise ValueError(f"Arg `fragment_update_alpha` (alpha) must be in [0, 1], got "
                             f"{self.fragment_update_alpha}") from None
        check_int("seed", self.seed, minimum=0)
        check_outer_delay(self.outer_delay)
        if self.outer_delay and self.fragment_sync_delay:
            raise ValueError(f"Arg `outer_delay` (1: the exchange overlaps the whole next round) and "
                             f"`fragment_sync_delay` ({self.fragment_sync_delay}: it overlaps tau inner steps) "
                             f"are two overlaps of the same exchange; give one of them")
        if not check_aggregator(self.aggregator, "diloco").is_mean and self.outer_delay:
            raise ValueError(f"Arg `aggregator` {self.aggregator} with `outer_delay` 1: the eager estimate swaps the "
                             f"node's 1/n share of the exchanged mean for its fresh pseudo-gradient, and a robust rule "
                             f"has no such share; use outer_delay=0 (or the mean)")


def check_outer_delay(value: Any) -> None:
    """``outer_delay`` is 0 (synchronous outer step) or 1 (eager, one round in flight)."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1):
        raise ValueError(f"Arg `outer_delay` must be 0 (synchronous outer step) or 1 (the exchange of round k "
                         f"applied at the end of round k+1, eager updates), got {value!r}")


def _module_list(spec: str) -> list[str]:
    return [m.strip() for m in spec.split(",") if m.strip()] if isinstance(spec, str) else []


# --------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------
@dataclass
class LocalState:
    """``t``: local steps taken; the step in the round is ``t % local_steps``."""

    t: int


@dataclass
class SlowMoState:
    """``start`` (m, d): x_s, the round's start; ``slow`` (m, d): the slow momentum v
    (identical on every node)."""

    t: int
    start: torch.Tensor
    slow: torch.Tensor


@dataclass
class DiLoCoState:
    """``start`` (m, d): each coordinate's value at its fragment's last synchronisation
    (theta of the round); ``momentum`` (m, d): the outer Nesterov buffer b; ``error``
    (m, d): the error-feedback memory (empty without ``error_feedback``). Random keys
    are a pure function of (seed, node, t), so no generator state is kept.
    ``in_flight``: the fragments whose exchange is posted and not yet applied
    (``fragment_sync_delay`` > 0, or ``outer_delay``: the previous round's); ``pending``
    (m, d): their exchanged means, filled when a checkpoint settles them (empty without
    overlap). ``last_delta`` (m, d): with ``outer_delay``, each node's own
    pseudo-gradient of the previous round, Delta_i^{k-1} of the eager estimate (empty
    otherwise)."""

    t: int
    start: torch.Tensor
    momentum: torch.Tensor
    error: torch.Tensor
    in_flight: tuple = ()
    pending: torch.Tensor | None = None
    #: (1, d) the shard owners' error feedback of the second compression (sharded
    #: exchange; each node's own shard of it), empty otherwise
    server_error: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    exchange: str = "allgather"
    shards: int = 1
    last_delta: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    #: (1, d) centered clipping's previous aggregate of each fragment (``aggregator``
    #: ``cclip``; an owner of a compressed shard keeps its own shard of it), empty otherwise
    center: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


# --------------------------------------------------------------------------------------
# Algorithms
# --------------------------------------------------------------------------------------
class PeriodicBase(Algorithm):
    """The base of the periodic family (local SGD, SlowMo, DiLoCo, and SparseLoCo
    elsewhere): local steps, then an all-reduce every ``local_steps`` steps."""

    shards_flat = True

    decentralized = False

    def __init__(self, config: Any, comm: Any) -> None:
        super().__init__(config, comm)
        self.lr = 1.0

    def set_lr(self, lr: float) -> None:
        check_float("Arg `lr`", lr, lo=0.0, lo_open=True)
        self.lr = float(lr)

    def wire_format(self) -> WireFormat:
        return WireFormat("fp32", 32.0)

    @property
    def period(self) -> int:
        return self.config.local_steps

    def local_only(self, t: int) -> bool:
        """Every step but the ``local_steps``-th is ``x <- x + u`` alone."""
        return t % self.config.local_steps != 0

    def _local(self, X: torch.Tensor, U: torch.Tensor) -> bool:
        """Step I: the local optimizer's step; True when the round ends here."""
        X.add_(U)
        self.state.t += 1
        return self.state.t % self.config.local_steps == 0

    def _average(self, X: torch.Tensor) -> torch.Tensor:
        with self.comm.ledger.phase("communicate"):
            return self.comm.all_reduce(X, op="mean")


class LocalSGD(PeriodicBase):
    """Local SGD: H local steps, then the exact average of the models.

    Step I:   x_i <- x_i + u_i.
    Step II:  after every H-th step, x_i <- mean_j x_j (one all-reduce).
    """

    fault_tolerant = True

    name = "localsgd"
    Config = LocalSGDConfig
    state_copies = 5
    summary = "local SGD: H local steps, then an exact average of the models (all-reduce)"

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        self._take_layout(X, layout)
        self.state = LocalState(t=0)

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        if self._local(X, U):  # Step I
            X.copy_(self._average(X))  # Step II


class SlowMo(PeriodicBase):
    """SlowMo (Wang et al., ICLR 2020, Alg. 1) with an exact average as the base.

    Step I:   x_i <- x_i + u_i.
    Step II:  after every H-th step, xbar = mean_j x_j (one all-reduce);
    Step III: v <- beta v + (x_s - xbar) / eta, x_i <- x_s - alpha eta v, x_s <- x_i.
    eta is the step size of the round's last step. alpha = 1, beta = 0 is local SGD.
    """

    fault_tolerant = True

    name = "slowmo"
    Config = SlowMoConfig
    state_copies = 7
    summary = "SlowMo: local steps, exact average, then a slow-momentum step on the round's change"

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        self._take_layout(X, layout)
        self.state = SlowMoState(t=0, start=X.detach().clone(), slow=torch.zeros_like(X))

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        if not self._local(X, U):  # Step I
            return
        st, cfg, eta = self.state, self.config, self.lr
        xbar = self._average(X)  # Step II
        with self.comm.ledger.phase("compute"):  # Step III
            st.slow.mul_(cfg.slow_momentum).add_((st.start - xbar) / eta)
            X.copy_(st.start - (cfg.slow_lr * eta) * st.slow)
            st.start.copy_(X)


class DiLoCo(ExchangeMixin, PeriodicBase):
    """DiLoCo (Douillard et al. 2023, Alg. 1); Streaming DiLoCo with ``fragments`` > 1.

    For each fragment f (the whole model when F = 1), after every step t with
    t = o_f (mod H):

    Step I:   Delta_i = theta - x_i on the fragment (theta: ``start``);
    Step II:  send C(Delta_i + e_i) (e_i <- what C dropped, with ``error_feedback``):
              an all-reduce of the kept fp32 values for a linear compressor; otherwise
              the sharded exchange (default): node j averages the decoded messages
              of its shard, compresses the mean again with error feedback of its
              own (e~_j <- what the second compression dropped) and all-gathers it,
              so Delta = the decoded replies; or, with ``exchange=allgather``, an
              all-gather of the packed payloads and Delta = the mean of the decoded
              messages. Either way Delta is the same on every node;
    Step III: outer Nesterov SGD, as torch.optim.SGD(nesterov=True):
              b <- mu b + Delta, x_i <- theta - lr_out (Delta + mu b), theta <- x_i.
    Every other step is the inner optimizer's alone.

    With ``outer_delay=1`` Step II's exchange is waited one round later, and Step III
    uses node i's eager estimate Delta^{k-1} + (Delta_i^k - Delta_i^{k-1}) / n in place
    of Delta (the pseudo-gradient Delta_i^k uncompressed, whatever the compressor). At
    the schedule's end (:meth:`finish`) the last round's exchange is waited and applied
    as a round without inner steps would: Delta^K - Delta_i^K / n.

    Untrusted nodes (:mod:`gossip.robust`). A Byzantine node's pseudo-gradient Delta_i is
    crafted (:class:`~gossip.robust.Adversary`) after Step I; compression and error
    feedback treat it as an honest one's. With a robust ``aggregator`` the mean of Step
    II becomes that rule, per shard (:class:`~gossip.algorithms._robust.ShardedRule`):
    with ``identity`` the fp32 pseudo-gradients go through the sharded layout in place of
    the ring all-reduce (the same bytes); with a compressor of the sharded exchange each
    owner applies the rule to its shard's decoded messages before compressing the
    aggregate again (the same bytes); with ``exchange=allgather`` every node applies it to
    every node's decoded message (the same bytes). The other linear compressors
    (``randomk``, ``randomblock``) are refused: their kept values are all-reduced.
    """

    fault_tolerant = True
    byzantine_messages = True

    name = "diloco"
    Config = DiLoCoConfig
    state_copies = 9
    summary = "DiLoCo: H inner (AdamW) steps, then an outer Nesterov step on the averaged pseudo-gradient"
    local_optimizer_default = "adamw"

    _new_state_fields = ("server_error",)

    def __init__(self, config: DiLoCoConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.compressor = _compress.build(config.compressor)
        self.fragments: list[tuple[int, int]] = []
        self.linear = False
        self.plans: dict[int, ShardPlan] = {}  # fragment start -> its shard plan (sharded exchange)
        self.aggregator = check_aggregator(config.aggregator, self.name)
        #: fragment start -> its robust rule (a robust ``aggregator``); empty for the mean
        self.rules: dict[int, ShardedRule] = {}
        if not self.aggregator.is_mean:
            self.aggregator.check_nodes(int(comm.world_size), "Arg `aggregator`")
            self.fault_tolerant = False  # the shard owners' rule is not carried over a changing quorum

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    @property
    def shards_flat(self) -> bool:  # type: ignore[override]
        """Streaming DiLoCo's fragments are cut in the model's tensors: not sliceable."""
        return self.config.fragment_count == 1

    def local_only(self, t: int) -> bool:  # type: ignore[override]
        """Streaming (fragments, or an overlapped exchange applied steps after it was
        posted) promises nothing; otherwise the periodic rule."""
        if self.config.fragment_count != 1 or self.config.fragment_sync_delay:
            return False
        return super().local_only(t)

    def wire_format(self) -> WireFormat:
        c = self.compressor
        if c.spec == "identity":
            return WireFormat("fp32", 32.0)
        d = self.layout.dim if self.layout is not None else 1
        return WireFormat(c.spec, c.code_bits(d))

    @property
    def collective(self) -> str:
        """``"all_reduce"`` of the kept fp32 values (linear compressors with a plain value
        body: identity, randomk, randomblock), ``"sharded"`` (two-way compression) or
        ``"all_gather"`` of the payloads."""
        if self.linear:
            return "all_reduce"
        return "sharded" if self.exchange == "sharded" else "all_gather"

    def offsets(self) -> list[int]:
        """o_f: fragment f synchronises after every step t with t % local_steps == o_f."""
        H, F = self.config.local_steps, len(self.fragments) or self.config.fragment_count
        return [((f + 1) * H // F) % H for f in range(F)]

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        layout = self._take_layout(X, layout)
        cfg = self.config
        mods = _module_list(cfg.fragment_modules)
        self.fragments = _module_fragments(layout, mods) if mods else _fragments(layout, cfg.fragments)
        c = self.compressor
        for a, b in self.fragments:
            c.payload_nbytes(b - a)  # a bad size fails here, not mid-run
        segs = c.layout(self.fragments[0][1] - self.fragments[0][0]).segments
        self.linear = c.linear and len(segs) == 1 and segs[0][:2] == ("values", torch.float32)
        self.exchange, self.plans = "allgather", {}
        if not self.linear:  # a linear compressor's values are all-reduced, whatever `exchange`
            for a, b in self.fragments:  # each fragment is sharded on its own
                self._choose_exchange(c, b - a)
                if self.plan is None:
                    self.plans = {}
                    break
                self.plans[a] = self.plan
        err = torch.zeros_like(X) if cfg.error_feedback else X.new_zeros(0)
        pending = torch.zeros_like(X) if cfg.fragment_sync_delay or cfg.outer_delay else X.new_zeros(0)
        server = X.new_zeros(1, X.shape[1]) if self.plans else X.new_zeros(0)
        last = torch.zeros_like(X) if cfg.outer_delay else X.new_zeros(0)
        self._posted: dict[int, tuple] = {}
        self.state = DiLoCoState(t=0, start=X.detach().clone(), momentum=torch.zeros_like(X), error=err,
                                 in_flight=(), pending=pending, server_error=server, **self._exchange_state(),
                                 last_delta=last)
        self.rules = {}
        if not self.aggregator.is_mean:
            agg, c = self.aggregator, self.compressor
            if self.linear and c.spec != "identity":
                raise ValueError(f"{self.name}: aggregator={agg.spec} with compressor {c.spec}: "
                                 f"the nodes all-reduce the values it keeps, which a robust rule cannot reduce; give "
                                 f"compressor identity (fp32) or a quantizer (quant:bits=B), whose messages carry "
                                 f"every coordinate")
            if agg.name == "cclip":
                self.state.center = torch.zeros(1, X.shape[1], dtype=torch.float32, device=X.device)
            self._robust_rules()

    def _robust_rules(self) -> None:
        """One :class:`ShardedRule` per fragment, cut as its exchange cuts it: the shard
        plan's bounds, else evenly; centered clipping's centre is the State's."""
        agg, n, center = self.aggregator, int(self.comm.world_size), self.state.center
        self.rules = {}
        for a, b in self.fragments:
            mine = center[0, a:b] if center.numel() else None
            plan = self.plans.get(a)
            if plan is not None:
                self.rules[a] = ShardedRule(agg, plan.bounds, mine)
            else:
                self.rules[a] = ShardedRule.even(agg, b - a, n, what=f"{self.name} fragment [{a}, {b})", center=mine)

    def _switch_exchange(self, exchange: str) -> None:
        self.exchange, self.plan, self.plans = exchange, None, {}
        self.state.exchange = exchange
        self.state.server_error = self.state.server_error.new_zeros(0)
        if self.rules:  # now all-gathered: the rule's shards are cut evenly
            self._robust_rules()

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        st, H, tau = self.state, self.config.local_steps, self.config.fragment_sync_delay
        self._local(X, U)
        phase = st.t % H
        for f, o in enumerate(self.offsets()):
            if o != phase:
                continue
            if self.config.outer_delay:
                self._eager(X, f)
            elif tau == 0:
                self._post(X, f)
                self._apply(X, f, self._collect(f))
            elif f in st.in_flight:  # posted tau steps ago
                self._apply(X, f, self._result(f))
                st.in_flight = tuple(g for g in st.in_flight if g != f)
        if tau:
            for f, o in enumerate(self.offsets()):
                if (o - tau) % H == phase:  # Steps I-II now, Step III tau steps later
                    self._post(X, f)
                    st.in_flight = (*st.in_flight, f)

    def _eager(self, X: torch.Tensor, f: int) -> None:
        """``outer_delay=1`` on fragment ``f`` at the end of round k: wait for round k-1's
        exchange (posted one round ago, in flight since), post round k's, and take the
        outer step on the eager estimate Delta^{k-1} + (Delta_i^k - Delta_i^{k-1}) / n."""
        st = self.state
        a, b = self.fragments[f]
        stale = self._result(f) if f in st.in_flight else None  # Delta^{k-1}, the same on every node
        with self.comm.ledger.phase("compute"):
            fresh = st.start[:, a:b] - X[:, a:b]  # Delta_i^k, this node's own
        self._post(X, f)  # Steps I-II of round k; waited at the end of round k+1
        if f not in st.in_flight:
            st.in_flight = (*st.in_flight, f)
        with self.comm.ledger.phase("compute"):
            own = st.last_delta[:, a:b]
            outer = (fresh - own) / self.comm.world_size
            if stale is not None:
                outer = stale + outer
            own.copy_(fresh)
        self._apply(X, f, outer)  # Step III, each node on its own estimate

    @torch.no_grad()
    def finish(self, X: torch.Tensor, final: bool = True) -> None:
        """``outer_delay=1`` at the schedule's end: the last round K's exchange is in
        flight, and each node has applied only its own share Delta_i^K / n of its mean.
        Wait for it and take the outer step of a round without inner steps (Delta_i^{K+1}
        = 0 in the eager estimate): Delta^K - Delta_i^K / n, so that training ends on
        every round's mean (without outer momentum the replicas then agree). Not when
        the run stops short of its schedule to be resumed (``final`` False): the exchange
        stays in flight, and the checkpoint settles it. The inner steps taken since round
        K's end are kept: the step moves theta and every node's values alike."""
        st = self.state
        if not (final and self.config.outer_delay) or st is None or not st.in_flight:
            return
        for f in st.in_flight:
            a, b = self.fragments[f]
            stale = self._result(f)  # Delta^K, the same on every node
            with self.comm.ledger.phase("compute"):
                own = st.last_delta[:, a:b]
                theta = st.start[:, a:b]
                new = self._outer_step(f, stale - own / self.comm.world_size)
                X[:, a:b] += new - theta
                theta.copy_(new)
                own.zero_()  # nothing of this node's is applied ahead of the mean now
        st.in_flight = ()

    def _post(self, X: torch.Tensor, f: int) -> None:
        """Steps I-II of fragment ``f``: encode its pseudo-gradient and post the exchange."""
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        a, b = self.fragments[f]
        m = X.shape[0]
        tag = step_tag(st.t)
        with ledger.phase("compute"):
            delta = st.start[:, a:b] - X[:, a:b]  # Step I
            if self.adversary is not None:  # the Byzantine nodes' pseudo-gradients, crafted
                delta = self.adversary.craft(delta, self.comm.nodes, st.t // cfg.local_steps, stream=f"delta{a}")
        c = self.compressor
        with ledger.phase("compress"):  # Step II
            if self.linear:  # positions (if any) from a key every node shares
                keys = torch.full((m,), shared_key(cfg.seed, st.t, _PSEUDO_STREAM + a), dtype=torch.int64)
            else:
                keys = node_keys(cfg.seed, self.comm.nodes, st.t, _PSEUDO_STREAM)
            plan = self.plans.get(a)
            codec = plan if plan is not None else c  # sharded: one message per shard owner
            if cfg.error_feedback:
                _, payload, _ = ErrorFeedback(codec)(delta, st.error[:, a:b], rescale=1.0, keys=keys, tag=tag)
            else:
                payload = codec.encode(delta, keys, tag=tag)
        with ledger.phase("communicate"):
            if plan is not None:
                handle = self.comm.sharded_exchange_async(
                    payload, plan.nbytes, plan.nbytes, self._server(plan, a, b, st.t, tag, X.dtype))
            elif self.linear:
                values = c.layout(b - a).views(payload)["values"]
                if self.rules:  # identity: the fp32 pseudo-gradients through the sharded layout
                    handle = self.rules[a].post(self.comm, values)
                else:
                    handle = self.comm.all_reduce_async(values.contiguous(), op="mean")
            else:
                handle = self.comm.all_gather_async(payload)
        self._posted[f] = (handle, payload, keys, tag)

    def _collect(self, f: int) -> torch.Tensor:
        """Wait for fragment ``f``'s exchange; the mean of the decoded messages (1, n)."""
        handle, payload, keys, tag = self._posted.pop(f)
        a, b = self.fragments[f]
        n, c, ledger = b - a, self.compressor, self.comm.ledger
        with ledger.phase("communicate"):
            got = handle.wait()
        with ledger.phase("compress"):
            plan = self.plans.get(a)
            if plan is not None:  # every owner's reply: the mean of its shard, compressed again
                return plan.decode(got.view(1, -1), tag=tag).to(self.state.start.dtype)
            if self.linear:
                if self.rules:  # identity: the rule's aggregate is Delta
                    return self.rules[a].finish(got, payload.device).view(1, -1).to(self.state.start.dtype)
                # the mean values in our own payload's frame (same compressor and key), decoded
                agg = payload[:1].clone()
                c.layout(n).views(agg)["values"].copy_(got[:1])
                _wire.write_header(agg, c.cid, _wire.params_hash(c.spec), n, keys[:1], tag)
                return c.decode(agg, n, tag=tag).to(self.state.start.dtype)
            if self.rules:  # every node's decoded message is here: the rule on all of them
                return self.rules[a].local(c.decode(got, n, tag=tag)).view(1, -1).to(self.state.start.dtype)
            return c.decode(got, n, tag=tag).to(self.state.start.dtype).mean(0, keepdim=True)

    def _server(self, plan: ShardPlan, a: int, b: int, t: int, tag: int, dtype: torch.dtype) -> Any:
        """The owner's step for fragment [a, b) posted at step ``t`` (it may run steps
        later, with ``fragment_sync_delay``): the mean of its shard's messages,
        compressed again with its own error feedback (the second compression). With a
        robust ``aggregator``, that rule in place of the mean."""
        cfg, rule = self.config, self.rules.get(a)

        def serve(j: int, Q: torch.Tensor) -> torch.Tensor:
            if rule is not None:
                mean = rule.serve(j, plan.decode_shard(j, Q, tag)).to(dtype).view(1, -1)
            else:
                mean = plan.decode_shard(j, Q, tag).to(dtype).mean(0, keepdim=True)
            skey = node_keys(cfg.seed, torch.tensor([j]), t, _SERVER_STREAM + a)
            memory = self.state.server_error[:, a:b][:, plan.shard_slice(j)]
            _, reply, _ = ErrorFeedback(plan.shard_codec(j))(mean, memory, rescale=1.0, keys=skey, tag=tag)
            return reply[0]

        return serve

    def _result(self, f: int) -> torch.Tensor:
        """Fragment ``f``'s exchanged mean: from the wire, or settled in the State."""
        if f in self._posted:
            return self._collect(f)
        a, b = self.fragments[f]
        return self.state.pending[:1, a:b].clone()

    def _apply(self, X: torch.Tensor, f: int, outer: torch.Tensor) -> None:
        """Step III on fragment ``f``: outer Nesterov step from theta, then the mix with
        the local values (``fragment_update_alpha``), theta <- the outer step's result."""
        a, b = self.fragments[f]
        theta = self.state.start[:, a:b]
        with self.comm.ledger.phase("compute"):
            new = self._outer_step(f, outer)
            alpha = self.config.fragment_update_alpha
            X[:, a:b] = new.lerp(X[:, a:b], alpha) if alpha > 0 else new
            theta.copy_(new)

    def _outer_step(self, f: int, outer: torch.Tensor) -> torch.Tensor:
        """The outer Nesterov step on fragment ``f``: b <- mu b + Delta (in place); theta's
        new value theta - lr_out (Delta + mu b)."""
        st, cfg = self.state, self.config
        a, b = self.fragments[f]
        mom = st.momentum[:, a:b]
        mu = cfg.outer_momentum
        mom.mul_(mu).add_(outer)
        direction = outer + mu * mom if mu > 0 else outer
        return st.start[:, a:b] - cfg.outer_lr * direction

    def _settle(self) -> None:
        """Complete the exchanges in flight into ``pending`` (before a checkpoint)."""
        for f in list(self._posted):
            a, b = self.fragments[f]
            self.state.pending[:, a:b] = self._collect(f)

    def state_dict(self) -> dict:
        """Without overlap the State is DiLoCo's of before the overlap existed (no
        ``in_flight``/``pending``), so such checkpoints and these load alike."""
        cfg = self.config
        if self.state is None or not (cfg.fragment_sync_delay or cfg.outer_delay):
            sd = super().state_dict()
            sd.pop("in_flight", None)
            sd.pop("pending", None)
            sd.pop("last_delta", None)
            return _without_center(sd)
        self._settle()
        sd = super().state_dict()
        if not cfg.outer_delay:  # streaming's overlap: its State of before outer_delay existed
            sd.pop("last_delta", None)
        return _without_center(sd)

    def load_state_dict(self, sd: dict) -> None:
        cfg = self.config
        if self.state is not None and "in_flight" not in sd and not (cfg.fragment_sync_delay or cfg.outer_delay):
            sd = {**sd, "in_flight": (), "pending": self.state.pending}
        if self.state is not None and "last_delta" not in sd and not cfg.outer_delay:
            sd = {**sd, "last_delta": self.state.last_delta}
        if self.state is not None and "center" not in sd and not self.state.center.numel():
            sd = {**sd, "center": self.state.center}
        super().load_state_dict(sd)
        self._posted = {}

    def report(self) -> dict | None:
        if len(self.fragments) <= 1 and not self.config.fragment_sync_delay and not self.config.outer_delay:
            return None
        out = {"fragments": [{"start": a, "stop": b, "sync_step_mod_h": o}
                             for (a, b), o in zip(self.fragments, self.offsets())],
               "local_steps": self.config.local_steps,
               "fragment_sync_delay": self.config.fragment_sync_delay,
               "fragment_update_alpha": self.config.fragment_update_alpha}
        if self.config.outer_delay:  # absent otherwise: reports of before the option are unchanged
            out["outer_delay"] = self.config.outer_delay
        return out


def _without_center(sd: dict) -> dict:
    """A State without centered clipping's centre saves as it did before the option existed."""
    if isinstance(sd.get("center"), torch.Tensor) and not sd["center"].numel():
        sd.pop("center")
    return sd


def _module_fragments(layout: ParamLayout, modules: list[str]) -> list[tuple[int, int]]:
    """Fragments starting at the first parameter of each named module (``parameters()``
    order): ``["b"]`` cuts the model before ``b.weight``."""
    starts = []
    for mod in modules:
        hit = [i for i, nm in enumerate(layout.names) if nm == mod or nm.startswith(mod + ".")]
        if not hit:
            raise ValueError(f"diloco: `fragment_modules` names {mod!r}, which is no module of the model "
                             f"(parameters: {', '.join(layout.names)})")
        starts.append(hit[0])
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(f"diloco: `fragment_modules` {','.join(modules)} must name modules in parameters() "
                         f"order, after the first, each starting a new fragment")
    offs = [layout.offsets[i] for i in starts]
    bounds = [0, *offs, layout.dim]
    return [(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]


def _fragments(layout: ParamLayout, F: int) -> list[tuple[int, int]]:
    """F fragments of consecutive tensors (``parameters()`` order): fragment f ends at the
    first tensor boundary where the running count of values reaches (f + 1) d / F,
    leaving at least one tensor to each later fragment."""
    blocks = [(o, k) for o, k in layout.blocks if k > 0]
    if F > len(blocks):
        raise ValueError(f"diloco: `fragments` {F} exceeds the model's {len(blocks)} non-empty tensors")
    d, cuts, start, i = layout.dim, [], 0, 0
    for f in range(F - 1):
        target = (f + 1) * d / F
        i += 1  # at least one tensor
        while i < len(blocks) - (F - 1 - f) and blocks[i - 1][0] + blocks[i - 1][1] < target:
            i += 1
        end = blocks[i - 1][0] + blocks[i - 1][1]
        cuts.append((start, end))
        start = end
    cuts.append((start, d))
    return cuts
