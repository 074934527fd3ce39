"""The shape every algorithm has: a frozen Config, a State, and a step.

Two kinds of algorithm exist, told apart by :attr:`Algorithm.acts_on`:

``"model"``
    Decentralized algorithms (D-PSGD, DCD-PSGD, ECD-PSGD, naive compression). The
    local optimizer first takes its step from ``x_t`` using the local gradient; the
    difference is the local update ``u_t`` (``-gamma * g_t`` for plain SGD). The
    algorithm then replaces ``x_t`` by the paper's ``x_{t+1}``, in which ``u_t`` stands
    for ``-gamma * g_t``: ``step(X, U)``.
``"gradient"``
    Centralized algorithms (all-reduce SGD and the compressed all-reduce family).
    They rewrite the gradient before the local optimizer steps:
    ``reduce_gradients(G)``.

The contract with the caller: ``setup(X, layout)`` once (the :class:`ParamLayout`
of the model), then every step ``set_lr(lr)`` and ``step``/``reduce_gradients``;
the hooks ``on_step_end``, ``on_epoch_end``, ``set_event_sink``, ``attach``, ``report`` and
``wire_format`` are declared on :class:`Algorithm` with no-op defaults, so a caller
calls them on any algorithm without probing it. ``owns_momentum`` says whether the
algorithm applies momentum itself; ``decentralized`` whether it needs a graph (a model
algorithm may average over all nodes instead: local SGD, SlowMo, DiLoCo). Configs never carry shapes or offsets; the options
a caller may fill in from its own flags are :data:`COMMON_OPTIONS`.

Tensors are batched over the nodes a process hosts (see docs/internals.md): ``X``,
``U`` and ``G`` have shape ``(m, d)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Sequence

import torch

from gossip.comm.base import is_time_varying

__all__ = ["Algorithm", "ParamLayout", "Pending", "WireFormat", "COMMON_OPTIONS"]

#: options every algorithm's Config may take, which a caller (the training loop) fills
#: in from its own flags where the Config has them: nothing else is guessed
COMMON_OPTIONS: tuple[str, ...] = ("seed", "compressor", "momentum")


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How the flat ``(m, d)`` parameter rows are cut into the model's tensors.

    ``shapes``: each tensor's shape in ``parameters()`` order; ``names``: their names
    (``named_parameters()``). ``offsets``/``numels``/``blocks`` follow. Built once by
    :class:`gossip.runtime.GossipOptimizer` (or :meth:`from_models`) and handed to
    every algorithm's :meth:`Algorithm.setup`: the per-tensor blocks of the sign and
    error-feedback families and PowerSGD's matrices come from here, never from a
    Config.
    """

    shapes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            shapes = tuple(tuple(_size(s) for s in sh) for sh in self.shapes)
        except (TypeError, ValueError):
            raise TypeError(
                f"ParamLayout: `shapes` must be a sequence of shapes (sequences of ints), got {self.shapes!r}"
            ) from None
        if not shapes or any(s < 0 for sh in shapes for s in sh):
            raise ValueError(f"ParamLayout: `shapes` must be a non-empty sequence of non-negative shapes, got {shapes}")
        if sum(math.prod(sh) for sh in shapes) == 0:
            raise ValueError(f"ParamLayout: the tensors hold no values, shapes {shapes}")
        names = tuple(str(n) for n in self.names) or tuple(f"p{k}" for k in range(len(shapes)))
        if len(names) != len(shapes):
            raise ValueError(f"ParamLayout: {len(names)} names for {len(shapes)} shapes")
        if len(set(names)) != len(names):
            raise ValueError(f"ParamLayout: tensor names must be unique, {sorted({n for n in names if names.count(n) > 1})} repeat")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "names", names)

    @classmethod
    def from_shapes(cls, shapes: Sequence[Sequence[int]], names: Sequence[str] | None = None) -> ParamLayout:
        """Tensors of these shapes, in this order; unnamed ones are ``p0``, ``p1``, ..."""
        return cls(tuple(tuple(sh) for sh in shapes), tuple(names) if names is not None else ())

    @classmethod
    def from_models(cls, models: Any) -> ParamLayout:
        """The layout of a model's trainable ``named_parameters()``; a list of models must agree."""
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        if not models:
            raise ValueError("ParamLayout.from_models needs at least one model")
        # the parameters that take part: those that require gradients (frozen ones never do)
        named = [[(n, tuple(p.shape)) for n, p in m.named_parameters() if p.requires_grad] for m in models]
        if not named[0]:
            raise ValueError("ParamLayout.from_models: the model has no parameters")
        for r, other in enumerate(named[1:], start=1):
            if [sh for _, sh in other] != [sh for _, sh in named[0]]:
                raise ValueError(
                    f"ParamLayout.from_models: model {r} has parameter shapes {[sh for _, sh in other]}, "
                    f"model 0 has {[sh for _, sh in named[0]]}"
                )
        return cls(tuple(sh for _, sh in named[0]), tuple(n for n, _ in named[0]))

    @classmethod
    def whole(cls, d: int) -> ParamLayout:
        """One tensor of ``d`` values: what an algorithm assumes when given no layout."""
        return cls(((int(d),),), ("flat",))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(sh) for sh in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, off = [], 0
        for n in self.numels:
            out.append(off)
            off += n
        return tuple(out)

    @property
    def dim(self) -> int:
        return sum(self.numels)

    @property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """``(offset, numel)`` of each tensor in the flat vector."""
        return tuple(zip(self.offsets, self.numels))

    @property
    def block_starts(self) -> tuple[int, ...]:
        """Start offsets of the non-empty tensors: the blocks of the blockwise compressors."""
        return tuple(o for o, n in self.blocks if n > 0) or (0,)

    def check(self, d: int, algo: str) -> None:
        if self.dim != d:
            raise ValueError(f"{algo}: the layout's tensors hold {self.dim} values, the flat parameters {d}")

    def to_dict(self) -> dict[str, Any]:
        """For config.json: names, shapes, offsets into the flat vector and its size."""
        return {"names": list(self.names), "shapes": [list(sh) for sh in self.shapes],
                "offsets": list(self.offsets), "dim": self.dim}


def _size(s: Any) -> int:
    """One dimension of a shape: an int (not a bool, not a float)."""
    if isinstance(s, bool) or int(s) != s or isinstance(s, float):
        raise TypeError(s)
    return int(s)


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """What an algorithm sends per step, described by the algorithm itself.

    ``label``: the payload's format (``quant:bits=8``, ``blocksign``, ``powersgd:rank=2``,
    ``fp32``); ``bits_per_coord``: the nominal code bits per model coordinate (side
    information such as scales and the headers excluded: the run's ledger measures
    those, as ``bits_per_coord_measured``).
    """

    label: str
    bits_per_coord: float

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "bits_per_coord": self.bits_per_coord}


class Pending:
    """A reduction in flight: a communicator handle and what to do with its result.

    ``advance()`` posts the exchange's later stage when it has one (a sharded
    exchange's pull; it waits for the push); ``wait()`` completes the exchange and
    runs ``finish(result)`` (decoding into the gradient) on the calling thread, which
    returns the rewritten gradient. Nothing runs on a communication thread: the
    compressors' kernels and the ledger's clocks belong to the caller's.
    """

    __slots__ = ("handle", "finish", "_value")

    def __init__(self, handle: Any, finish: Any) -> None:
        self.handle, self.finish = handle, finish
        self._value: Any = None

    def advance(self) -> None:
        if self.handle is not None:
            self.handle.advance()

    def ready(self) -> bool:
        """Whether :meth:`advance` would return at once, out of step with the peers
        (:meth:`gossip.comm.Handle.ready`)."""
        return self.handle is None or self.handle.ready()

    @torch.no_grad()
    def wait(self) -> Any:
        if self._value is None:
            self._value = self.finish(self.handle.wait() if self.handle is not None else None)
        return self._value


class Algorithm:
    """Base class: holds the config, the communicator and the State.

    The contract with a caller (:class:`gossip.runtime.GossipOptimizer`, the training
    loop) is this class: every hook below is declared here with a no-op default, and
    a caller never probes an algorithm for anything else.
    """

    name: ClassVar[str] = ""
    #: the frozen dataclass of the algorithm's options (``algorithms.make_config``)
    Config: ClassVar[type | None] = None
    acts_on: ClassVar[str] = "model"
    #: one-line description shown by ``gossip.algorithms.available()``
    summary: ClassVar[str] = ""
    #: momentum of the CLI's local SGD optimizer when ``--momentum`` is unset and the
    #: algorithm has no momentum of its own
    local_momentum_default: ClassVar[float] = 0.9
    #: True where the algorithm exchanges with graph neighbours (it needs a topology and
    #: at least 2 nodes); False for the all-reduce algorithms, whatever they act on
    decentralized: ClassVar[bool] = True
    #: the CLI's local optimizer when ``--optimizer`` is unset (``"sgd"`` or ``"adamw"``)
    local_optimizer_default: ClassVar[str] = "sgd"
    #: True where the algorithm keeps replicas or estimates of fixed neighbours (DCD, ECD,
    #: CHOCO): it is refused a time-varying topology (``topologies.TimeVaryingTopology``)
    needs_static_graph: ClassVar[bool] = False
    #: why ``--robust clippedgossip`` cannot be composed with the algorithm's exchange,
    #: or None (the refusal's reason, in one line)
    robust_refusal: ClassVar[str | None] = None
    #: why ``--aggregator`` (a robust rule over all nodes' messages) cannot be applied to the
    #: algorithm's exchange, or None; the algorithms that take it have an ``aggregator`` option
    aggregator_refusal: ClassVar[str | None] = None
    #: the CLI's ``--topology`` when it is unset (SGP: its paper's directed one-peer
    #: exponential graph); the library takes whatever topology it is handed
    default_topology: ClassVar[str] = "ring"
    #: full copies of the flat parameters a node keeps, roughly: the model, its gradient,
    #: the local optimizer's momentum, the flat buffers and the algorithm's own State (the
    #: training loop's memory check before a simulation of many nodes in one process)
    state_copies: ClassVar[int] = 7
    #: True where MergeComp (``merge=``) can schedule the algorithm group by group: the
    #: error-feedback family whose Config MergeComp's own mirrors
    mergeable: ClassVar[bool] = False
    #: True where the algorithm runs under ``--fault-tolerance`` (gossip.train.fault_tolerance): its
    #: exchanges are all-reduces or all-gathers over the live replicas, or (decentralized)
    #: neighbour exchanges on a topology rebuilt over them, whose replica state ``setup``
    #: re-establishes from the models; a rank-owned sharded exchange is not carried
    fault_tolerant: ClassVar[bool] = False
    #: State fields that belong to this worker alone (error-feedback residuals): a worker
    #: that heals from a live peer takes everything else from the peer and starts these at
    #: zero, since the peer's residual is not its own and would be counted twice
    local_state: ClassVar[tuple[str, ...]] = ()
    #: True where the algorithm's exchange runs on any contiguous slice of the flat vector
    #: on its own, needing no tensor shapes (gossip.groups cuts it across a group's members,
    #: each exchanging its slice); False runs it from one member of the group, unsliced
    shards_flat: ClassVar[bool] = False
    #: True where the nodes step on their own, with no barrier (AD-PSGD): the caller
    #: orders the steps on an event clock (gossip.clock) instead of calling :meth:`step`
    asynchronous: ClassVar[bool] = False
    #: True where the algorithm passes its outgoing messages through an
    #: :class:`gossip.robust.Adversary` (:meth:`set_adversary`): the Byzantine nodes'
    #: rows are crafted after the message is formed, before it is encoded and sent
    byzantine_messages: ClassVar[bool] = False

    def __init__(self, config: Any, comm: Any) -> None:
        topo = comm.topology
        if self.needs_static_graph and is_time_varying(topo):
            raise ValueError(
                f"{self.name} keeps replicas of fixed neighbours and cannot run on the time-varying "
                f"topology {topo.name!r}; use a static one (ring, torus, expander, exponential, ...) "
                f"or an algorithm that accepts time-varying graphs (dpsgd, naive, sgp)"
            )
        self.config = config
        self.comm = comm
        self.state: Any = None
        self.layout: ParamLayout | None = None
        self._sink: Callable[[str], None] | None = None
        #: the run's attackers (None: every node honest); see :meth:`set_adversary`
        self.adversary: Any = None

    # --- momentum ------------------------------------------------------------------
    @classmethod
    def momentum_of(cls, config: Any) -> float:
        """The momentum the algorithm applies itself under ``config`` (0.0: none).

        Read from the Config alone, so a caller checks it against the local optimizer
        before building anything (:func:`gossip.runtime.check_momentum`); algorithms
        whose Config has a ``momentum`` they apply override this.
        """
        return 0.0

    @property
    def own_momentum(self) -> float:
        """:meth:`momentum_of` this algorithm's Config."""
        return self.momentum_of(self.config)

    @property
    def owns_momentum(self) -> bool:
        """True where the algorithm applies momentum itself: the local optimizer must then
        have none (GossipOptimizer refuses one that has), or momentum would compound."""
        return self.own_momentum > 0

    # --- lifecycle -----------------------------------------------------------------
    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        """Initialise the State from the starting point ``x_1`` (shape ``(m, d)``).

        ``layout`` cuts the rows into the model's tensors; None means one tensor of
        ``d`` values (:meth:`ParamLayout.whole`). Subclasses call :meth:`_take_layout`.
        """
        raise NotImplementedError

    def _take_layout(self, X: torch.Tensor, layout: ParamLayout | None) -> ParamLayout:
        layout = ParamLayout.whole(X.shape[1]) if layout is None else layout
        if not isinstance(layout, ParamLayout):
            raise TypeError(f"{self.name}: `layout` must be a ParamLayout, got {type(layout).__name__}")
        layout.check(X.shape[1], self.name)
        self.layout = layout
        return layout

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        """Model algorithms: turn ``x_t`` (updated in place) into ``x_{t+1}``."""
        raise NotImplementedError(f"{self.name} acts on gradients, not on models")

    def local_only(self, t: int) -> bool:
        """True where this algorithm's ``t``-th :meth:`step` (1, 2, ...) is the local
        optimizer's step alone, ``x <- x + u``, with no exchange (a periodic method's
        local steps). A pure function of the config and ``t``, the same on every node
        and answered before :meth:`setup`, so that a caller running the algorithm on a
        slice of the vector (gossip.groups) may apply that step to the other slices
        itself instead of gathering them. False (the default) promises nothing."""
        return False

    def reduce_gradients(self, G: torch.Tensor) -> None:
        """Gradient algorithms: rewrite ``G`` in place before the local optimizer."""
        raise NotImplementedError(f"{self.name} acts on models, not on gradients")

    def reduce_gradients_start(self, G: torch.Tensor) -> Pending:
        """:meth:`reduce_gradients` for callers that overlap the exchange with other work
        (DDP communication hooks): compress and post the exchange and return a
        :class:`Pending`; its ``wait()`` leaves the direction in ``G``. Algorithms whose
        exchange completes asynchronously override it; by default ``G`` is reduced
        here and the pending is already done."""
        self.reduce_gradients(G)
        return Pending(None, lambda _: G)

    # --- hooks a caller may call; each a no-op unless the algorithm needs it ----------
    def set_lr(self, lr: float) -> None:
        """The step size ``eta_t`` of the coming step (algorithms that rescale their
        error memories by ``eta_{t-1} / eta_t``); called before every step."""

    def on_step_end(self, step: int) -> None:
        """Optimizer step number ``step`` (1, 2, ...) has completed; ``GossipOptimizer``
        calls it after every step."""

    def on_epoch_end(self, epoch: int) -> None:
        """An epoch (a pass over each node's shard) has ended."""

    def finish(self, X: torch.Tensor, final: bool = True) -> None:
        """The last step has been taken (``GossipOptimizer.finish``): an algorithm whose
        exchanges outlive a step ends them and leaves each node's final model in ``X``
        (AD-PSGD under torchrun; DiLoCo's overlapped outer step applies the exchange in
        flight). ``final`` False: the run stops before its schedule's end, to be resumed
        (``--max-steps``); the state is then kept as the next step expects it. Nothing by
        default."""

    def set_event_sink(self, fn: Callable[[str], None] | None) -> None:
        """Where to print one-line events (e.g. MergeComp's decisions); None: nowhere."""
        self._sink = fn

    def set_adversary(self, adversary: Any) -> None:
        """Byzantine nodes (a :class:`gossip.robust.Adversary`) whose messages this
        algorithm's exchanges carry crafted; refused by algorithms that do not declare
        ``byzantine_messages``."""
        if adversary is not None and not self.byzantine_messages:
            raise ValueError(f"{self.name} does not carry crafted messages of Byzantine nodes")
        self.adversary = adversary

    def _say(self, line: str) -> None:
        if self._sink is not None:
            self._sink(line)

    def attach(self, models: Sequence[Any]) -> None:
        """The hosted models, for algorithms that work during backward (gradient hooks)."""

    def report(self) -> dict | None:
        """The algorithm's own account of the run (for summary.json), or None."""
        return None

    def summary_fields(self) -> dict[str, Any]:
        """Keys of summary.json the algorithm fills beside ``report``: ``merge`` is
        MergeComp's schedule (its report), None for every other algorithm."""
        return {"merge": None}

    def wire_format(self) -> WireFormat:
        """What goes on the wire each step; by default the payload compressor's spec."""
        c = self.payload_compressor
        d = self.layout.dim if self.layout is not None else 1
        if c is None or c.spec == "identity":
            return WireFormat("fp32", 32.0)
        return WireFormat(c.spec, c.code_bits(d))

    @property
    def payload_compressor(self) -> Any:
        """The compressor whose payloads go on the wire each step (None if none)."""
        return None

    @property
    def period(self) -> int:
        """Steps in one communication cycle: 1 where every step communicates, H for the
        algorithms that communicate every H steps (``local_steps``). Any ``period``
        consecutive steps carry the same traffic, so a measurement of bytes per step
        covers a multiple of it."""
        return 1

    # --- state ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.state is None:
            raise RuntimeError(f"{self.name}: call setup() before state_dict()")
        return {
            f.name: _clone(getattr(self.state, f.name)) for f in dataclasses.fields(self.state)
        }

    def load_state_dict(self, sd: dict) -> None:
        if self.state is None:
            raise RuntimeError(f"{self.name}: call setup() before load_state_dict()")
        names = {f.name for f in dataclasses.fields(self.state)}
        if set(sd) != names:
            raise ValueError(
                f"{self.name}: state has keys {sorted(sd)}, expected {sorted(names)}"
            )
        for k, v in sd.items():
            cur = getattr(self.state, k)
            if isinstance(cur, torch.Tensor):
                if not isinstance(v, torch.Tensor) or v.shape != cur.shape:
                    got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise ValueError(
                        f"{self.name}: state tensor {k!r} has shape {got}, expected {tuple(cur.shape)}"
                    )
                cur.copy_(v)
            else:
                setattr(self.state, k, v)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v
