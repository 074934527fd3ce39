"""The contract between an algorithm and its caller: Config, State, step, and hooks.

Two kinds of algorithm exist, told apart by :attr:`Algorithm.acts_on`:

``"model"``
    Decentralized algorithms (D-PSGD, DCD-PSGD, ECD-PSGD, naive compression). The
    local optimizer first takes its step from ``x_t`` using the local gradient; the
    difference is the local update ``u_t`` (``-gamma * g_t`` for plain SGD). The
    algorithm then replaces ``x_t`` by the paper's ``x_{t+1}``, in which ``u_t`` stands
    for ``-gamma * g_t``: ``step(X, U)``.
``"gradient"``
    Centralized algorithms (all-reduce SGD and the compressed all-reduce family). They
    rewrite the gradient before the local optimizer steps: ``reduce_gradients(G)``.

Tensors are batched over the nodes a process hosts (see docs/internals.md): ``X``,
``U`` and ``G`` have shape ``(m, d)``.

What a caller may rely on, and nothing more (:class:`Algorithm`):

1. ``setup(X, layout)`` once, before anything else: ``layout`` is the
   :class:`ParamLayout` of the flat vector (tensor names, shapes, offsets, blocks),
   built once from the models; no Config carries shapes or offsets;
2. every step, ``set_lr(lr)`` with the step size the local optimizer will use, then
   ``step(X, U)`` or ``reduce_gradients(G)``, then ``on_step_end(step)``;
3. ``on_epoch_end(epoch)`` after an epoch's last step (callers without epochs skip it);
4. ``attach(models)`` after ``setup`` when the caller owns the models' backward pass
   (schedulers that communicate during backward register their hooks there);
5. ``set_event_sink(fn)``: where the algorithm's one-line decisions go;
6. ``report()``: the algorithm's own account of the run, or None;
7. ``wire_format()``: what the algorithm sends (:class:`WireFormat`); runs record this,
   never a CLI string;
8. ``owns_momentum``: True when the algorithm applies momentum itself; the caller must
   then give the local optimizer none (``GossipOptimizer`` refuses one that has some);
9. ``state_dict()`` / ``load_state_dict(sd)`` for an exact continuation.

Every hook has a documented no-op default here, so callers never probe with
``hasattr``. :data:`COMMON_OPTIONS` are the Config options a caller may hold for every
algorithm (a training run's seed, compressor and momentum); ``gossip.algorithms.build``
passes each where the algorithm's Config takes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

__all__ = ["Algorithm", "COMMON_OPTIONS", "ParamLayout", "WireFormat", "code_bits"]

#: Config options a caller may hold for every algorithm; each is passed where the
#: algorithm's Config takes it (``gossip.algorithms.build(..., common=...)``)
COMMON_OPTIONS: tuple[str, ...] = ("seed", "compressor", "momentum")


# --------------------------------------------------------------------------------------
# the parameter layout
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamLayout:
    """How the flat parameter vector of one node is cut into the model's tensors.

    ``names`` and ``shapes`` are given (in ``parameters()`` order); ``offsets`` (start of
    each tensor in the flat vector), ``numels`` and ``dim`` (their sum) follow. ``blocks``
    are the ``(offset, numel)`` pairs the blockwise families use (blockwise sign: one
    scale per tensor; PowerSGD: which tensors are matrices). Build it with
    :meth:`from_models` or :meth:`from_shapes`; :meth:`whole` is one block of ``d``
    values, what ``setup(X)`` assumes without a layout.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] = field(init=False)
    numels: tuple[int, ...] = field(init=False)
    dim: int = field(init=False)

    def __post_init__(self) -> None:
        try:
            shapes = tuple(tuple(int(s) for s in sh) for sh in self.shapes)
            bad = any(isinstance(s, bool) or int(s) != s for sh in self.shapes for s in sh)
        except (TypeError, ValueError):
            shapes, bad = (), True
        if bad:
            raise TypeError(f"ParamLayout: `shapes` must be a sequence of shapes (sequences of ints), got {self.shapes!r}")
        if not shapes:
            raise ValueError("ParamLayout: `shapes` must hold at least one tensor shape, got none")
        if any(s < 0 for sh in shapes for s in sh):
            raise ValueError(f"ParamLayout: sizes must be non-negative, got shapes {shapes}")
        names = tuple(self.names)
        if len(names) != len(shapes) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"ParamLayout: `names` must be {len(shapes)} non-empty strings, one per shape, got {self.names!r}"
            )
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ParamLayout: tensor names must be unique, {dup} repeat")
        numels = tuple(math.prod(sh) for sh in shapes)
        offsets, o = [], 0
        for n in numels:
            offsets.append(o)
            o += n
        if o == 0:
            raise ValueError(f"ParamLayout: the tensors hold no values, shapes {shapes}")
        for k, v in (("names", names), ("shapes", shapes), ("offsets", tuple(offsets)), ("numels", numels), ("dim", o)):
            object.__setattr__(self, k, v)

    # --- builders ------------------------------------------------------------------------
    @classmethod
    def from_shapes(cls, shapes: Sequence[Sequence[int]], names: Sequence[str] | None = None) -> ParamLayout:
        """Tensors of these shapes in this order; unnamed ones are ``p0``, ``p1``, ..."""
        shapes = list(shapes)
        return cls(tuple(names) if names is not None else tuple(f"p{i}" for i in range(len(shapes))),
                   tuple(tuple(sh) for sh in shapes))

    @classmethod
    def from_models(cls, models: torch.nn.Module | Sequence[torch.nn.Module]) -> ParamLayout:
        """The layout of a model's ``named_parameters()``; several models must agree."""
        models = [models] if isinstance(models, torch.nn.Module) else list(models)
        if not models:
            raise ValueError("ParamLayout.from_models needs at least one model")
        named = [[(n, tuple(p.shape)) for n, p in mdl.named_parameters()] for mdl in models]
        if not named[0]:
            raise ValueError("the model has no parameters")
        for r, nm in enumerate(named[1:], start=1):
            if [s for _, s in nm] != [s for _, s in named[0]]:
                raise ValueError(
                    f"model {r} has parameter shapes {[s for _, s in nm]}, model 0 has {[s for _, s in named[0]]}"
                )
        return cls(tuple(n for n, _ in named[0]), tuple(s for _, s in named[0]))

    @classmethod
    def whole(cls, dim: int) -> ParamLayout:
        """One 1-D tensor of ``dim`` values: the layout assumed when none is given."""
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"ParamLayout.whole: `dim` must be a positive int, got {dim!r}")
        return cls(("flat",), ((dim,),))

    # --- views -----------------------------------------------------------------------------
    @property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """``(offset, numel)`` of every tensor, in flat order."""
        return tuple(zip(self.offsets, self.numels))

    @property
    def block_starts(self) -> tuple[int, ...]:
        """Start offsets of the non-empty tensors (a blockwise compressor's ``offsets``)."""
        return tuple(o for o, n in self.blocks if n > 0)

    def __len__(self) -> int:
        return len(self.shapes)

    def to_dict(self) -> dict[str, Any]:
        """For config.json: names, shapes, offsets and dim."""
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "offsets": list(self.offsets), "dim": self.dim}


# --------------------------------------------------------------------------------------
# what goes on the wire
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WireFormat:
    """What an algorithm sends each step, described by the algorithm itself.

    ``label``: a compressor spec (``"quant:bits=8"``, ``"topk:p=0.01"``), ``"fp32"`` for
    full precision, or the algorithm's own scheme (``"blocksign"``, ``"powersgd:rank=2"``,
    ``"sketched:k=..,rows=5,cols=.."``). ``bits_per_coord``: the nominal bits per
    coordinate of the model, per message: the code width (8 for ``quant:bits=8``, 1 for a
    sign), or for schemes that send fewer values than coordinates, the bits of what is
    sent spread over the coordinates (PowerSGD: 32 (P + Q + uncompressed) / d). Side
    information fixed per tensor or message (scales, headers, padding) is left out;
    the run's ``bits_per_coord_measured`` (ledger bytes) includes it. ``detail``: one
    human line on what is sent.
    """

    label: str
    bits_per_coord: float
    detail: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"WireFormat: `label` must be a non-empty string, got {self.label!r}")
        b = self.bits_per_coord
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0:
            raise ValueError(f"WireFormat: `bits_per_coord` must be a finite number >= 0, got {b!r}")
        object.__setattr__(self, "bits_per_coord", float(b))

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "bits_per_coord": self.bits_per_coord, "detail": self.detail}

    @classmethod
    def of_compressor(cls, compressor: Any, numel: int, detail: str = "") -> WireFormat:
        """A compressor's payloads over ``numel`` coordinates (``identity`` is ``fp32``)."""
        label = "fp32" if compressor.spec == "identity" else compressor.spec
        return cls(label, code_bits(compressor, numel), detail)


def code_bits(compressor: Any, numel: int) -> float:
    """Nominal bits per coordinate of ``compressor`` on ``numel`` values.

    What one more coordinate costs (``8 * (ideal(2n) - ideal(n)) / n``, from the
    compressor's ``ideal_nbytes``: code bits, plus the scales of a fixed block size), so
    a scale per message or tensor is left out and ``quant:bits=8`` gives exactly 8. A
    sparsifier with a fixed count (``topk:k=20``), whose cost does not grow with ``n``,
    gives what it sends spread over the ``n`` coordinates instead.
    """
    n = max(1, int(numel))
    a, b = compressor.ideal_nbytes(n), compressor.ideal_nbytes(2 * n)
    slope = 8.0 * (b - a) / n
    return slope if slope > 0 else 8.0 * a / n


# --------------------------------------------------------------------------------------
# the algorithm
# --------------------------------------------------------------------------------------
class Algorithm:
    """Base class: holds the config, the communicator, the layout and the State.

    Subclasses implement :meth:`_setup` (the State from ``x_1``) and ``step`` or
    ``reduce_gradients``; they override the hooks they need. Everything else a caller
    may call is declared here with its default.
    """

    name: ClassVar[str] = ""
    acts_on: ClassVar[str] = "model"
    #: one-line description shown by ``gossip.algorithms.available()``
    summary: ClassVar[str] = ""
    #: momentum of the CLI's local SGD optimizer when ``--momentum`` is unset and the
    #: algorithm has no momentum of its own
    local_momentum_default: ClassVar[float] = 0.9
    #: True when the algorithm applies momentum itself (an instance property where it
    #: depends on the Config): a second momentum in the local optimizer would compound
    #: with it, so ``GossipOptimizer`` refuses a local optimizer with momentum != 0
    owns_momentum: bool = False

    def __init__(self, config: Any, comm: Any) -> None:
        self.config = config
        self.comm = comm
        self.state: Any = None
        self.layout: ParamLayout | None = None
        self._event_sink: Callable[[str], None] | None = None

    # --- lifecycle -----------------------------------------------------------------
    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        """Initialise the State from the starting point ``x_1`` (shape ``(m, d)``).

        ``layout`` cuts the flat vector into the model's tensors; None means one block
        of all ``d`` values (:meth:`ParamLayout.whole`): blockwise schemes then have one
        block, and PowerSGD has no matrix to compress.
        """
        if not isinstance(X, torch.Tensor) or X.dim() != 2 or X.shape[1] < 1:
            got = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
            raise ValueError(f"{self.name}: setup() takes the (m, d) parameter buffer, got {got}")
        d = int(X.shape[1])
        if layout is None:
            layout = ParamLayout.whole(d)
        elif not isinstance(layout, ParamLayout):
            raise TypeError(f"{self.name}: `layout` must be a ParamLayout or None, got {type(layout).__name__}")
        elif layout.dim != d:
            raise ValueError(f"{self.name}: the layout holds {layout.dim} values, the flat buffer has {d}")
        self.layout = layout
        self._setup(X, layout)

    def _setup(self, X: torch.Tensor, layout: ParamLayout) -> None:
        raise NotImplementedError

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        """Model algorithms: turn ``x_t`` (updated in place) into ``x_{t+1}``."""
        raise NotImplementedError(f"{self.name} acts on gradients, not on models")

    def reduce_gradients(self, G: torch.Tensor) -> None:
        """Gradient algorithms: rewrite ``G`` in place before the local optimizer."""
        raise NotImplementedError(f"{self.name} acts on models, not on gradients")

    # --- hooks: every one a caller may call, with its default -------------------------
    def set_lr(self, lr: float) -> None:
        """The step size the local optimizer uses in the coming step. Default: ignored
        (algorithms that rescale error memories by ``eta_{t-1} / eta_t`` keep it)."""

    def on_step_end(self, step: int) -> None:
        """After optimizer step number ``step`` (1, 2, ...) has completed. Default: nothing."""

    def on_epoch_end(self, epoch: int) -> None:
        """After the last step of epoch ``epoch`` (1, 2, ...). Default: nothing."""

    def attach(self, models: Sequence[torch.nn.Module]) -> None:
        """The hosted models, after :meth:`setup`, for work during backward (gradient
        hooks that overlap communication with back-propagation). Default: nothing."""

    def set_event_sink(self, fn: Callable[[str], None] | None) -> None:
        """Where the algorithm's one-line decisions go (None: nowhere). Use :meth:`_emit`."""
        self._event_sink = fn

    def _emit(self, line: str) -> None:
        if self._event_sink is not None:
            self._event_sink(line)

    def report(self) -> dict | None:
        """The algorithm's own account of the run (for summaries), or None. Default: None."""
        return None

    def wire_format(self) -> WireFormat:
        """What the algorithm sends each step. Default: its payload compressor over the
        layout's coordinates, or full precision (``fp32``) without one."""
        c = self.payload_compressor
        d = self.layout.dim if self.layout is not None else 1 << 20
        if c is None:
            return WireFormat("fp32", 32.0, "full-precision values")
        return WireFormat.of_compressor(c, d)

    @property
    def payload_compressor(self) -> Any:
        """The compressor whose payloads go on the wire each step (None if none)."""
        return None

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
