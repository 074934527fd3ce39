"""Glue between a user's models and optimizers and an algorithm.

:class:`FlatParams` makes every hosted model's parameters views into one flat
``(m, d)`` buffer, so the algorithms see one row per node and one message per
neighbour per step. :class:`GossipOptimizer` wraps the user's local optimizer(s):

.. code-block:: python

    algo = gossip.algorithms.build("ecd", comm, compressor="quant:bits=8")
    opt = GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), algo)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

In the in-process simulation pass one model and one optimizer per hosted node.

The parameter layout (each tensor's name, shape and place in the flat vector) is
built here from the models and given to the algorithm's ``setup``: no algorithm
needs shapes or offsets from its caller. An algorithm that applies momentum itself
(``owns_momentum``: powersgd, efblocksgdm, signum, efmomentum, ...) refuses a local
optimizer that has momentum too, at construction, in one line: the two would
compound.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from gossip.algorithms.base import ParamLayout

__all__ = ["FlatParams", "GossipOptimizer", "ModelMoved", "MomentumConflict", "check_momentum", "sync_start",
           "trainable_parameters"]


class MomentumConflict(ValueError):
    """The algorithm owns momentum and the local optimizer has momentum too."""


class ModelMoved(ValueError):
    """A parameter was moved, converted or replaced after the optimizer was built."""


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the parameters that take part: those that require
    gradients, as DDP reduces only those. Frozen ones are never gossiped or counted."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _check_distinct(objs: Sequence[Any], what: str, kind: str) -> None:
    """Refuse one object passed for several nodes (``[model] * n``): the nodes would share
    it, each step writing over the others'."""
    seen: dict[int, int] = {}
    for r, obj in enumerate(objs):
        first = seen.setdefault(id(obj), r)
        if first != r:
            fix = ("copy.deepcopy the model for every node, or build one per node" if what == "model"
                   else "build one per node, over that node's model's parameters")
            raise ValueError(f"{what}s {first} and {r} are one object (the same {kind} passed for two nodes): "
                             f"each node needs {'an' if what[0] in 'aeiou' else 'a'} {what} of its own; {fix}")


def _where(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} on {t.device}"


class FlatParams:
    """One contiguous ``(m, d)`` buffer holding the trainable parameters of ``m``
    identical models.

    After construction each trainable parameter (``requires_grad=True``) is a view into
    its row, so in-place updates by any optimizer land in the buffer and writes to the
    buffer are seen by the models. Frozen parameters stay where they are: no algorithm
    sees, sends or counts them, so they stay bit-identical on every node. ``blocks``
    gives (offset, numel) of each trainable tensor, in ``parameters()`` order (used by
    blockwise compressors). :meth:`check` refuses models that were moved, converted or
    (un)frozen since.
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        if not models:
            raise ValueError("FlatParams needs at least one model")
        _check_distinct(models, "model", "nn.Module")
        named = [trainable_parameters(mdl) for mdl in models]
        owner: dict[int, tuple[int, str]] = {}  # a tensor shared by two models' parameters
        for r, nl in enumerate(named):
            for n, p in nl:
                first = owner.setdefault(id(p), (r, n))
                if first[0] != r:
                    raise ValueError(
                        f"model {r}'s parameter {n!r} is one tensor with model {first[0]}'s {first[1]!r}: the nodes "
                        f"share it, and each node needs a copy of its own (copy.deepcopy the model for every node, "
                        f"or build one per node)")
        plists = [[p for _, p in nl] for nl in named]
        ref = [tuple(p.shape) for p in plists[0]]
        if not ref:
            frozen = any(True for _ in models[0].parameters())
            raise ValueError("the model has no parameters that require gradients" if frozen
                             else "the model has no parameters")
        for r, nl in enumerate(named[1:], start=1):
            if [(n, tuple(p.shape)) for n, p in nl] != [(n, sh) for (n, _), sh in zip(named[0], ref)]:
                raise ValueError(f"model {r} has trainable parameters {[(n, tuple(p.shape)) for n, p in nl]}, "
                                 f"model 0 has {[(n, sh) for (n, _), sh in zip(named[0], ref)]}")
        dtypes = {p.dtype for pl in plists for p in pl}
        devices = {p.device for pl in plists for p in pl}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all parameters must share one dtype and device, got {sorted(map(str, dtypes))} "
                f"on {sorted(map(str, devices))}"
            )
        self.shapes = ref
        self.layout = ParamLayout(tuple(ref), tuple(n for n, _ in named[0]))
        numels = [p.numel() for p in plists[0]]
        self.blocks: list[tuple[int, int]] = []
        off = 0
        for n in numels:
            self.blocks.append((off, n))
            off += n
        self.dim = off
        (dtype,), (device,) = dtypes, devices
        self.data = torch.empty(len(models), self.dim, dtype=dtype, device=device)
        self._params = plists
        with torch.no_grad():
            for r, pl in enumerate(plists):
                for p, (o, n) in zip(pl, self.blocks):
                    self.data[r, o : o + n].copy_(p.detach().reshape(-1))
                    p.data = self.data[r, o : o + n].view(p.shape)
        # what check() watches besides the trainable ones: the frozen, which must stay frozen
        self._frozen = [[(n, p) for n, p in mdl.named_parameters() if not p.requires_grad] for mdl in models]

    def check(self) -> None:
        """Raise :class:`ModelMoved` (one line) if a model changed since construction: a
        parameter of another dtype, device or storage (``model.double()``, ``.to(...)``,
        ``p.data = ...``) is no longer in the flat buffer, and a parameter frozen or
        unfrozen since would be half in, half out of the exchange."""
        fix = ("build the GossipOptimizer (and the local optimizer) after moving, converting or "
               "freezing the model")
        ptr, size = self.data.data_ptr(), self.data.element_size()
        names = self.layout.names
        for r, pl in enumerate(self._params):
            for k, (p, (o, _)) in enumerate(zip(pl, self.blocks)):
                if p.dtype != self.data.dtype or p.device != self.data.device:
                    raise ModelMoved(f"parameter {names[k]!r} of model {r} is now {_where(p)}, it was "
                                     f"{_where(self.data)} when the optimizer was built: {fix}")
                if p.data_ptr() != ptr + (r * self.dim + o) * size:
                    raise ModelMoved(f"parameter {names[k]!r} of model {r} was replaced (its storage changed) "
                                     f"after the optimizer was built, so the exchange no longer reaches it: {fix}")
                if not p.requires_grad:
                    raise ModelMoved(f"parameter {names[k]!r} of model {r} was frozen after the optimizer was "
                                     f"built: {fix}")
            for n, p in self._frozen[r]:
                if p.requires_grad:
                    raise ModelMoved(f"model {r}: parameter {n!r} was unfrozen after the optimizer was built: {fix}")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def gather_grads(self) -> torch.Tensor:
        """The hosted nodes' gradients as one ``(m, d)`` tensor (zeros where None)."""
        G = torch.zeros_like(self.data)
        for r, pl in enumerate(self._params):
            for p, (o, n) in zip(pl, self.blocks):
                if p.grad is not None:
                    G[r, o : o + n].copy_(p.grad.reshape(-1))
        return G

    def scatter_grads(self, G: torch.Tensor) -> None:
        for r, pl in enumerate(self._params):
            for p, (o, n) in zip(pl, self.blocks):
                g = G[r, o : o + n].view(p.shape)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)


def check_momentum(name: str, momentum: float, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise :class:`MomentumConflict` (one line) where the algorithm ``name`` applies
    ``momentum`` itself (> 0: ``Algorithm.momentum_of(config)``) and a local optimizer
    has momentum too (SGD's ``momentum``, Adam's ``beta1``): the two would compound."""
    if not momentum > 0:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            mom = group.get("momentum", 0.0) or group.get("betas", (0.0,))[0]
            if mom and "betas" in group:  # Adam's first-moment decay is its momentum
                raise MomentumConflict(
                    f"{name} applies its own momentum ({momentum:g}) and the local "
                    f"{type(opt).__name__} has momentum {mom:g} (beta1): they would compound; give the local "
                    f"optimizer betas=(0, beta2) (--beta1 0), use SGD with momentum=0, or set the algorithm's "
                    f"momentum to 0"
                )
            if mom:
                raise MomentumConflict(
                    f"{name} applies its own momentum ({momentum:g}) and the local "
                    f"{type(opt).__name__} has momentum {mom:g}: they would compound; give the local optimizer "
                    f"momentum=0, or set the algorithm's momentum instead"
                )


def _other_state(model: nn.Module) -> list[torch.Tensor]:
    """A model's state outside the flat buffer: its frozen parameters and its buffers."""
    return [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@torch.no_grad()
def sync_start(models: Sequence[nn.Module], X: torch.Tensor, comm: Any) -> bool:
    """Make every node's weights node 0's, as DDP does at construction: ``X`` (the hosted
    nodes' flat trainable parameters, one row each) and each model's frozen parameters
    and buffers. The nodes are compared bit for bit first (a 16-byte digest per node,
    gathered outside the ledger; rows compared directly where one process hosts every
    node); only where any differs is node 0's state broadcast (setup traffic). Returns
    whether it was."""
    n, m = int(comm.world_size), len(models)
    if n <= 1:
        return False
    others = [_other_state(mdl) for mdl in models]
    if m == n:  # every node here: compare the rows themselves
        ref = [_bytes(t) for t in [X[0], *others[0]]]
        same = all(torch.equal(_bytes(a), b) for r in range(1, m) for a, b in zip([X[r], *others[r]], ref))
    else:
        import hashlib

        import numpy as np

        digests = []
        for r in range(m):
            h = hashlib.blake2b(digest_size=16)
            for t in [X[r], *others[r]]:
                h.update(_bytes(t).cpu().numpy().tobytes())
            digests.append(np.frombuffer(h.digest(), dtype=np.int64))
        mine = torch.as_tensor(np.stack(digests), device=X.device)
        everyone = comm.all_gather(mine, record=False)
        same = bool((everyone == everyone[:1]).all())
    if same:
        return False
    with comm.ledger.setup():  # a one-off before the first step, as the x_1 exchanges
        X.copy_(comm.broadcast(X, 0))
        if others[0]:
            rows = torch.stack([torch.cat([_bytes(t).to(X.device) for t in st]) for st in others])
            got = comm.broadcast(rows, 0)
            for r, st in enumerate(others):
                offset = 0
                for t in st:
                    k = t.numel() * t.element_size()
                    t.copy_(got[r, offset:offset + k].clone().view(t.dtype).reshape(t.shape))
                    offset += k
    return True


def params_of(data: torch.Tensor, copy: bool) -> torch.Tensor:
    """The parameter matrix for a state dict: a copy, or (``copy=False``) the matrix
    itself where it owns its storage exactly (a view would save its whole storage)."""
    data = data.detach()
    own = data.is_contiguous() and data.storage_offset() == 0 \
        and data.untyped_storage().nbytes() == data.numel() * data.element_size()
    return data if not copy and own else data.clone()


class GossipOptimizer:
    """Runs the local optimizer(s), then the algorithm's communication step.

    Construction builds the :class:`FlatParams` and their ``ParamLayout`` and calls the
    algorithm's ``setup(x_1, layout)`` and ``attach(models)``. It raises
    :class:`MomentumConflict` (one line) when the algorithm owns momentum
    (``owns_momentum``) and a local optimizer has some too: give the local optimizer
    ``momentum=0`` and set the algorithm's own ``momentum`` instead. Only the parameters
    that require gradients take part (as in DDP); frozen ones are never exchanged.
    :meth:`step`, :meth:`average`, :meth:`consensus_distance` and :meth:`state_dict`
    raise :class:`ModelMoved` when a model was moved, converted or (un)frozen after
    construction: build the optimizer after. Every :meth:`step`
    calls ``set_lr`` with the local optimizer's first param group's ``lr`` (so a
    scheduler reaches algorithms that rescale their memories), the local and the
    algorithm's step, then ``on_step_end(steps)``.

    The nodes start equal, as DDP's replicas do (``init_sync=True``): construction
    compares every node's parameters (frozen ones included) and buffers, bit for bit
    (one 16-byte digest per node, gathered outside the ledger), and where any node's
    differ from node 0's, node 0's are broadcast to every node before the algorithm's
    ``setup`` (setup traffic in the ledger); :attr:`init_broadcast` says whether that
    happened. Nodes built alike (the same seed) exchange nothing but the digests.
    ``init_sync=False`` keeps each node's own weights, for a study that starts the
    nodes apart on purpose.
    """

    def __init__(
        self,
        models: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        algorithm: Any,
        *,
        init_sync: bool = True,
    ) -> None:
        models = [models] if isinstance(models, nn.Module) else list(models)
        optimizers = (
            [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        )
        m = len(algorithm.comm.nodes)
        if len(models) != m or len(optimizers) != m:
            raise ValueError(
                f"the communicator hosts {m} node(s): pass {m} model(s) and optimizer(s), "
                f"got {len(models)} and {len(optimizers)}"
            )
        _check_distinct(models, "model", "nn.Module")
        _check_distinct(optimizers, "optimizer", "torch.optim.Optimizer")
        check_momentum(algorithm.name, algorithm.own_momentum, optimizers)
        self.models = models
        self.optimizers = optimizers
        self.algorithm = algorithm
        self.flat = FlatParams(models)
        self.steps = 0  # optimizer steps taken (on_step_end's count)
        self._xt: torch.Tensor | None = None  # step scratch: x_t and u_t (see step)
        self._u: torch.Tensor | None = None
        self.layout: ParamLayout = self.flat.layout
        #: whether construction broadcast node 0's weights because the nodes differed
        self.init_broadcast = sync_start(models, self.flat.data, algorithm.comm) if init_sync else False
        with algorithm.comm.ledger.setup():  # x_1 exchanges are one-off, not step traffic
            algorithm.setup(self.flat.data, self.layout)
        algorithm.attach(models)  # schedulers that work during backward (MergeComp)

    @property
    def comm(self) -> Any:
        return self.algorithm.comm

    def finish(self, final: bool = True) -> None:
        """After the last step: end the exchanges that outlive a step and take each node's
        final model (``adpsgd`` under torchrun, whose passive ranks answer their
        neighbours until these have finished too; ``diloco`` and ``muloco`` with
        ``outer_delay=1``, whose last round's exchange is still in flight); a no-op for
        the other algorithms. Call it on every rank before evaluating or saving the final
        model. ``final=False`` when training stops early and will be resumed from a
        checkpoint taken after this call: the exchanges end, the state stays resumable."""
        with torch.no_grad():
            self.algorithm.finish(self.flat.data, final=final)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        algo = self.algorithm
        self.flat.check()  # a model moved or converted since would be silently left out
        # the step size the local optimizer is about to use (a user's scheduler included)
        algo.set_lr(float(self.optimizers[0].param_groups[0]["lr"]))
        # the local optimizer's step is the node's computation: charged to "compute" with
        # the forward and backward passes (the time model of the race and the benchmark
        # reads it; Muon's step costs several times a small model's backward)
        compute = algo.comm.ledger.phase("compute")
        if algo.acts_on == "gradient":
            G = self.flat.gather_grads()
            algo.reduce_gradients(G)
            self.flat.scatter_grads(G)
            with compute:
                for opt in self.optimizers:
                    opt.step()
        else:
            X = self.flat.data
            with torch.no_grad():
                with compute:
                    # x_t and u_t in two buffers kept across steps (no allocation of size d)
                    if self._xt is None or self._xt.shape != X.shape or self._xt.dtype != X.dtype \
                            or self._xt.device != X.device:
                        self._xt, self._u = torch.empty_like(X), torch.empty_like(X)
                    x_t = self._xt.copy_(X)
                    for opt in self.optimizers:
                        opt.step()
                    U = torch.sub(X, x_t, out=self._u)
                    X.copy_(x_t)
                algo.step(X, U)
        self.steps += 1
        algo.on_step_end(self.steps)

    # --- views for evaluation --------------------------------------------------------
    @torch.no_grad()
    def average(self) -> torch.Tensor:
        """xbar, the average of all n nodes' parameters (shape (d,)); a collective."""
        self.flat.check()
        return self.comm.all_reduce(self.flat.data, op="mean", record=False)[0]

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """mean_i ||x_i - xbar||^2 over all n nodes; a collective."""
        self.flat.check()
        X = self.flat.data
        xbar = self.comm.all_reduce(X, op="mean", record=False)
        dist = ((X - xbar) ** 2).sum(dim=1, keepdim=True).to(torch.float64)
        return float(self.comm.all_reduce(dist, op="mean", record=False)[0, 0])

    def state_dict(self, *, copy: bool = True) -> dict:
        """Everything a resume needs: the parameters, the algorithm's state, the local
        optimizers' states and the step count. ``copy=False`` gives the parameter
        matrix itself, not a copy: for a caller that serialises the dict at once (a
        checkpoint), which then saves the (n, d) matrix without first copying it."""
        self.flat.check()  # else it would save the weights the model left behind
        return {
            "params": params_of(self.flat.data, copy),
            "algorithm": self.algorithm.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "steps": self.steps,
        }

    def load_state_dict(self, sd: dict) -> None:
        params = sd["params"]
        if params.shape != self.flat.data.shape:
            raise ValueError(
                f"checkpoint parameters have shape {tuple(params.shape)}, "
                f"this run has {tuple(self.flat.data.shape)}"
            )
        with torch.no_grad():
            self.flat.data.copy_(params)
        self.algorithm.load_state_dict(sd["algorithm"])
        for opt, osd in zip(self.optimizers, sd["optimizers"]):
            opt.load_state_dict(osd)
        self.steps = int(sd.get("steps", 0))  # absent from checkpoints written before it was kept
