"""All simulated nodes as one batched model: the vectorized simulation path.

The loop path of ``--simulate N`` builds N models and N optimizers and runs N forward
and backward passes per step, one after another: at a thousand nodes the Python
overhead of the loop, not the arithmetic, sets the pace. This module runs the same
N nodes as one model:

1. **Parameters.** :class:`StackedParams` keeps all N nodes' parameters in one
   ``(N, d)`` matrix, the algorithms' ``X``; each of the model's tensors is one leaf
   of shape ``(N, *shape)``, a zero-copy view into its columns of ``X``. Building it
   costs a fixed number of Python calls, whatever N is (one model is built, its
   parameters are broadcast into the N rows).
2. **Forward and backward.** ``torch.func.vmap`` over ``functional_call`` runs every
   node's forward on its own batch (``x`` of shape ``(N, B, ...)``) in one batched
   call; the N per-node losses are summed and differentiated once. Node i's loss
   depends on its own row only, so the gradient of the sum with respect to row i is
   node i's gradient.
3. **Local optimizer.** One optimizer steps the stacked leaves. An element-wise
   optimizer (SGD with or without momentum and weight decay, AdamW) is then exactly
   per-node; its state is saved split into N per-node state dicts, the format of the
   loop path, so checkpoints move between the paths (:func:`split_optimizer_state`,
   :func:`stack_optimizer_state`). Norms that must stay per node (gradient clipping)
   are :func:`clip_grad_norm_per_node`.
4. **Data.** :class:`BatchedLoader` gathers each node's batch into ``(N, B, ...)``
   from the nodes' own :class:`gossip.data.ShardLoader` orders: node i receives the
   rows it would receive in the loop path, in the same order.
5. **Evaluation.** :func:`node_accuracies` evaluates many nodes' models on the test
   set in batched calls.

The communication step is the algorithm's, unchanged: it already takes ``X`` as an
``(N, d)`` matrix. The two paths compute the same numbers up to floating-point
reassociation (batched matrix products sum in another order); docs/simulation.md
states the tolerance the tests hold them to.

A model that cannot be batched this way (BatchNorm's running statistics are updated
in place during the forward; dropout draws randomness per call) is reported by
:func:`why_not_vectorized` in one line, and the run falls back to the loop path.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from gossip import _batched, _fused
from gossip.algorithms.base import ParamLayout
from gossip.runtime import GossipOptimizer, ModelMoved, check_momentum, params_of

__all__ = [
    "BatchedLoader",
    "StackedParams",
    "VectorizedOptimizer",
    "batched_conv1d",
    "clip_grad_norm_per_node",
    "cross_entropy_rows",
    "eval_nodes",
    "node_accuracies",
    "per_node_optimizer_states",
    "split_optimizer_state",
    "stack_optimizer_state",
    "why_not_vectorized",
]

#: the nodes whose own test accuracy gives the "nodes min-max" range: all of them up to
#: this many, else this many evenly spaced (node 0 and node n-1 among them)
EVAL_NODES = 32

#: values per block of rows where a whole-matrix temporary is avoided (16 MiB of float32)
_BLOCK_VALUES = 1 << 22

#: values per chunk of rows in the fused SGD update (:meth:`VectorizedOptimizer.step`):
#: its arrays (gradient, momentum, parameters, update, a temporary: 5 MiB of float32)
#: stay in the cache between the update's element-wise passes. Four times fewer
#: chunks than with 1.3 MiB, whose Python overhead per chunk (slices, four calls) cost
#: more than the cache level gained: the update was 27 % faster in an interleaved A/B
#: at 1,024 MLP nodes on one thread
_CHUNK_VALUES = 1 << 18

#: values per slab of rows of the SGD update made on demand (:meth:`VectorizedOptimizer._lazy_step`):
#: a slab of the update and of X (16 MiB of float32 each) stays in the last-level cache
#: until the algorithm's update of those rows reads them
_SLAB_VALUES = 1 << 22


def _norm_layers(model: nn.Module) -> list[str]:
    return [name for name, mod in model.named_modules()
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats]


class StackedParams:
    """The parameters of ``n`` copies of ``model`` as one ``(n, d)`` matrix.

    ``data`` is the matrix (row i is node i's flat parameter vector, tensors in
    ``parameters()`` order, as :class:`gossip.runtime.FlatParams` lays them out);
    ``params`` maps each parameter's name to a leaf of shape ``(n, *shape)`` that is
    a view into ``data``, so an optimizer stepping the leaves writes ``X`` and an
    algorithm writing ``X`` moves the leaves. Every row starts as ``model``'s
    parameters (the common x_1).
    """

    def __init__(self, model: nn.Module, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"StackedParams: `n` must be a positive integer, got {n!r}")
        named = list(model.named_parameters())
        if not named:
            raise ValueError("the model has no parameters")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all parameters must share one dtype and device, got {sorted(map(str, dtypes))} "
                f"on {sorted(map(str, devices))}"
            )
        self.shapes = [tuple(p.shape) for _, p in named]
        self.layout = ParamLayout(tuple(self.shapes), tuple(name for name, _ in named))
        self.blocks: list[tuple[int, int]] = []
        off = 0
        for _, p in named:
            self.blocks.append((off, p.numel()))
            off += p.numel()
        self.dim = off
        (dtype,), (device,) = dtypes, devices
        with torch.no_grad():
            row = torch.cat([p.detach().reshape(-1) for _, p in named])
            self.data = row.unsqueeze(0).repeat(n, 1)  # one broadcast, not n copies in Python
        self.params: dict[str, nn.Parameter] = {}
        for (name, p), (o, k), shape in zip(named, self.blocks, self.shapes):
            leaf = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad)
            leaf.data = self.data[:, o:o + k].view(n, *shape)  # strided view: no copy
            self.params[name] = leaf

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def check(self) -> None:
        """Raise ``ModelMoved`` if a leaf no longer views its columns of ``data`` (it was
        replaced, moved or converted): its updates would be lost to the algorithms."""
        for (name, p), (o, _) in zip(self.params.items(), self.blocks):
            if p.data_ptr() != self.data[:, o:].data_ptr() or p.device != self.data.device:
                raise ModelMoved(f"the stacked parameter {name!r} no longer views the (n, d) matrix X")

    def leaves(self) -> list[nn.Parameter]:
        return list(self.params.values())

    def gather_grads(self) -> Tensor:
        """All nodes' gradients as one ``(n, d)`` tensor (zeros where None)."""
        G = torch.zeros_like(self.data)
        for p, (o, k) in zip(self.params.values(), self.blocks):
            if p.grad is not None:
                G[:, o:o + k].copy_(p.grad.reshape(self.rows, k))
        return G

    def scatter_grads(self, G: Tensor) -> None:
        for p, (o, k), shape in zip(self.params.values(), self.blocks, self.shapes):
            g = G[:, o:o + k].reshape(self.rows, *shape)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def views(self, rows: Tensor) -> dict[str, Tensor]:
        """``{name: (k, *shape)}`` views of a ``(k, d)`` matrix of rows (for evaluation)."""
        k = rows.shape[0]
        return {name: rows[:, o:o + n].view(k, *shape)
                for name, (o, n), shape in zip(self.params, self.blocks, self.shapes)}


# --------------------------------------------------------------------------------------
# optimizer state: stacked <-> one state dict per node (the loop path's format)
# --------------------------------------------------------------------------------------
def _is_stacked(value: Any, n: int, shape: tuple[int, ...]) -> bool:
    return isinstance(value, Tensor) and tuple(value.shape) == (n, *shape)


def _muon_adamw_parts(shapes: Sequence[tuple[int, ...]]) -> tuple[list, list]:
    """The per-node shapes of a MuonAdamW's two optimizers (Muon's matrices, AdamW's rest)."""
    return [s for s in shapes if len(s) == 2], [s for s in shapes if len(s) != 2]


def _is_muon_adamw(sd: dict) -> bool:
    return isinstance(sd, dict) and "muon" in sd and "adamw" in sd


def split_optimizer_state(sd: dict, n: int, shapes: Sequence[tuple[int, ...]]) -> list[dict]:
    """One optimizer state dict over stacked ``(n, *shape)`` parameters as ``n`` state
    dicts, node i's being what an optimizer of node i's own tensors would hold.

    Stacked state (momentum buffers, Adam's moments) is sliced (views: saving them
    together stores the stacked tensor once); anything else, such as Adam's step
    count, is shared by all nodes and copied into each (tensors cloned, so that a
    loop-path optimizer that loads them does not advance one shared counter n times).
    A MuLoCo ``MuonAdamW`` state (its Muon's and its AdamW's) is cut part by part.
    """
    if _is_muon_adamw(sd):
        mats, rest = _muon_adamw_parts(shapes)
        mu = split_optimizer_state(sd["muon"], n, mats)
        aw = split_optimizer_state(sd["adamw"], n, rest) if sd["adamw"] is not None else [None] * n
        extra = {k: v for k, v in sd.items() if k not in ("muon", "adamw")}
        return [{"muon": m, "adamw": a, **extra} for m, a in zip(mu, aw)]
    out = []
    for i in range(n):
        state = {}
        for idx, st in sd["state"].items():
            shape = shapes[int(idx)]
            state[idx] = {key: (v[i] if _is_stacked(v, n, shape) else (v.clone() if isinstance(v, Tensor) else v))
                          for key, v in st.items()}
        out.append({"state": state, "param_groups": [dict(g) for g in sd["param_groups"]]})
    return out


def stack_optimizer_state(sds: Sequence[dict], shapes: Sequence[tuple[int, ...]]) -> dict:
    """The inverse of :func:`split_optimizer_state`: ``n`` per-node state dicts (of the
    loop path or of :func:`split_optimizer_state`) as one dict over stacked parameters.
    Per-node tensors of a parameter's shape are stacked; the rest must agree across
    nodes (a step count), else ``ValueError`` names the entry."""
    if not sds:
        raise ValueError("stack_optimizer_state: no per-node state dicts")
    first = sds[0]
    if _is_muon_adamw(first):
        mats, rest = _muon_adamw_parts([tuple(s) for s in shapes])
        extra = {k: v for k, v in first.items() if k not in ("muon", "adamw")}
        return {"muon": stack_optimizer_state([sd["muon"] for sd in sds], mats),
                "adamw": None if first["adamw"] is None else stack_optimizer_state([sd["adamw"] for sd in sds], rest),
                **extra}
    state: dict = {}
    for idx, st in first["state"].items():
        shape = tuple(shapes[int(idx)])
        entry = {}
        for key, v in st.items():
            vals = [sd["state"][idx][key] for sd in sds]
            if isinstance(v, Tensor) and tuple(v.shape) == shape and v.dim() > 0:
                entry[key] = torch.stack(vals)
            else:
                if any((not torch.equal(torch.as_tensor(u), torch.as_tensor(v))) for u in vals[1:]):
                    raise ValueError(f"optimizer state {key!r} of parameter {idx} differs between nodes: "
                                     f"the batched optimizer keeps one for all")
                entry[key] = v.clone() if isinstance(v, Tensor) else v
        state[idx] = entry
    return {"state": state, "param_groups": [dict(g) for g in first["param_groups"]]}


def per_node_optimizer_states(saved: Any, flat: Any) -> list[dict]:
    """The ``optimizers`` entry of a :meth:`VectorizedOptimizer.state_dict` (one stacked
    state and the node count) or of a loop path's (already one state dict per node), as
    one state dict per node of ``flat`` (the loop path's flat parameters, whose tensor
    shapes cut the stacked state): what :class:`gossip.runtime.GossipOptimizer` loads."""
    if isinstance(saved, dict) and "stacked" in saved:
        return split_optimizer_state(saved["stacked"], int(saved["nodes"]), flat.shapes)
    return list(saved)


def clip_grad_norm_per_node(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for each node on its own: the gradient of node
    i (row i of every stacked leaf) is scaled by ``min(1, max_norm / ||g_i||)`` where
    ``||g_i||`` is the 2-norm over all of node i's tensors. Returns the ``(n,)`` norms."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise ValueError("clip_grad_norm_per_node: no parameter has a gradient")
    n = grads[0].shape[0]
    sq = sum(g.reshape(n, -1).pow(2).sum(1) for g in grads)
    norms = sq.sqrt()
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(n, *([1] * (g.dim() - 1))))
    return norms


# --------------------------------------------------------------------------------------
# the batched forward and backward
# --------------------------------------------------------------------------------------
class _NodeForward:
    """Every node's logits, ``(params, x) -> (n, B, classes)``: the batched kernels of
    :mod:`gossip._batched` (``torch.bmm`` per layer) where the model is made of layers
    they cover, else ``vmap`` over ``functional_call``. A kernel that meets an input it
    does not cover raises before computing anything; the call then runs under ``vmap``,
    and so does every later one. ``kernels`` says which one runs."""

    def __init__(self, model: nn.Module) -> None:
        self._fast = _batched.batched_forward(model)
        self._vmap = vmap(lambda params, x: functional_call(model, params, (x,)))
        self._vmap_shared = vmap(lambda params, x: functional_call(model, params, (x,)), in_dims=(0, None))

    @property
    def kernels(self) -> str:
        return "bmm" if self._fast is not None else "vmap"

    def __call__(self, params: dict[str, Tensor], x: Tensor, *, shared: bool = False,
                 grads: _batched.GradBuffers | None = None) -> Tensor:
        """``shared``: ``x`` is one batch ``(B, ...)`` that every row of ``params`` reads
        (evaluation), not one batch per node. ``grads``: where the bmm kernels' backward
        may write the gradients (:class:`gossip._batched.GradBuffers`)."""
        if self._fast is not None:
            try:
                k = next(iter(params.values())).shape[0]
                return self._fast(params, x.expand(k, *x.shape) if shared else x, grads)
            except _batched.Unsupported:
                self._fast = None
        return (self._vmap_shared if shared else self._vmap)(params, x)


def _cross_entropy_rows(z: Tensor, y: Tensor) -> Tensor:
    """``F.cross_entropy(z, y, reduction="none")`` for ``(rows, classes)`` logits.

    On the CPU the log-softmax runs over the transposed ``(classes, rows)`` matrix: the
    kernel over a short last dimension (10 classes) is about 8x slower than over the
    outer one, and at 1024 nodes of logistic regression it was a third of the step. The
    two kernels sum the classes in another order, so the losses agree to rounding (equal
    for 10 float32 classes on the machine it was measured on, within 4e-15 in float64)."""
    if z.device.type != "cpu" or z.dim() != 2 or y.dim() != 1 or y.dtype != torch.int64:
        return F.cross_entropy(z, y, reduction="none")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= z.shape[1]):
        return F.cross_entropy(z, y, reduction="none")  # its own message for a bad label
    logp = F.log_softmax(z.t().contiguous(), dim=0)
    return -logp.gather(0, y.unsqueeze(0)).squeeze(0)


def cross_entropy_rows(z: Tensor, y: Tensor) -> Tensor:
    """Per-row cross-entropy of ``(rows, classes)`` logits ``z`` and labels ``y``, as the
    vectorized path computes its losses (``F.cross_entropy(z, y, reduction="none")``,
    the classes-major form on the CPU)."""
    return _cross_entropy_rows(z, y)


def batched_conv1d(x: Tensor, w: Tensor, b: Tensor | None, stride: int, padding: int) -> Tensor:
    """Every node's 1-d convolution at once, as the vectorized path runs a Conv1d layer
    (im2col and one batched product per node): x (n, B, C, L), w (n, C_out, C, k), b
    (n, C_out) or None -> (n, B, C_out, L_out), differentiable."""
    return _batched.conv1d(x, w, b, stride, padding)


def why_not_vectorized(model: nn.Module, x: Tensor, y: Tensor,
                       loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> str | None:
    """Why ``model`` cannot run as one batched call over nodes (one line), or None.

    ``x``, ``y``: one small batch of the data (2 examples suffice). Checks that the
    model keeps no running statistics, then runs the batched loss and its backward for
    two nodes and compares each node's loss with the model's own forward.
    """
    norms = _norm_layers(model)
    if norms:
        return (f"the model keeps running statistics in BatchNorm layers ({', '.join(map(repr, norms[:3]))}), which a batched "
                "call cannot update per node")
    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameters"
    try:
        sp = StackedParams(model, 2)
        xs, ys = torch.stack([x, x.flip(0)]), torch.stack([y, y.flip(0)])
        losses = vmap(loss_fn)(_NodeForward(model)(sp.params, xs), ys)  # the forward the run will use
        losses.sum().backward()
        with torch.no_grad():
            own = torch.stack([loss_fn(model(xs[i]), ys[i]) for i in range(2)])
    except Exception as e:  # noqa: BLE001 - any failure of the trial means: run the loop path
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"its forward cannot run under torch.func.vmap ({type(e).__name__}: {first[:160]})"
    if losses.shape != (2,) or not torch.allclose(losses.detach(), own, rtol=1e-4, atol=1e-5):
        return (f"the batched forward disagrees with the model's own (losses {losses.detach().tolist()} "
                f"against {own.tolist()})")
    return None


def _plain_sgd(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is torch's SGD as is: nothing runs around its step (hooks, a
    scheduler's wrapper), no option whose arithmetic the fused update does not repeat."""
    if type(opt) is not torch.optim.SGD or "step" in vars(opt):  # a wrapper (an LR scheduler's counter)
        return False
    from torch.optim import optimizer as _optim

    for hooks in (getattr(opt, "_optimizer_step_pre_hooks", None), getattr(opt, "_optimizer_step_post_hooks", None),
                  getattr(_optim, "_global_optimizer_pre_hooks", None), getattr(_optim, "_global_optimizer_post_hooks", None)):
        if hooks:
            return False
    for g in opt.param_groups:
        if g.get("maximize") or g.get("differentiable") or g.get("fused"):
            return False
        if any(isinstance(g.get(key), Tensor) for key in ("lr", "weight_decay", "momentum", "dampening")):
            return False
    return True


class VectorizedOptimizer(GossipOptimizer):
    """:class:`gossip.runtime.GossipOptimizer` for ``n`` nodes held as one batched model.

    .. code-block:: python

        algo = gossip.algorithms.build("dpsgd", SimulatedCommunicator(ring(1024)))
        opt = VectorizedOptimizer(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), algo)
        for x, y in batches:                      # x: (n, B, ...), y: (n, B)
            opt.zero_grad()
            losses = opt.forward_backward(x, y)   # (n,) per-node losses
            opt.step()

    ``model`` is built once; its forward serves every node (through
    ``functional_call`` with the node's row of ``X``), its own parameters are only
    x_1. ``make_optimizer`` receives the stacked leaves; an element-wise optimizer
    (SGD, AdamW) then steps each node exactly as its own optimizer would.
    :meth:`state_dict` holds one optimizer state dict per node, as the loop path's, so
    either path resumes the other's checkpoints.

    :meth:`state_dict` keeps the local optimizer's state stacked (``{"stacked": ...,
    "nodes": n}``: a handful of tensors, where n per-node dicts would cost a checkpoint
    n times as many); :func:`per_node_optimizer_states` gives the loop path its per-node
    dicts, and :meth:`load_state_dict` takes either form.
    """

    def __init__(self, model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 algorithm: Any, *, loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> None:
        n = len(algorithm.comm.nodes)
        self.flat = StackedParams(model, n)
        opt = make_optimizer(self.flat.leaves())
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"make_optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
        check_momentum(algorithm.name, algorithm.own_momentum, [opt])
        self.models = [model]
        self.optimizers = [opt]
        self.algorithm = algorithm
        self.steps = 0
        self._xt: Tensor | None = None
        self._u: Tensor | None = None
        self._slab: Tensor | None = None
        self.layout = self.flat.layout
        self._loss_fn = loss_fn
        self._forward = _NodeForward(model)
        self._grads = _batched.GradBuffers()
        self._loss = vmap(loss_fn)
        with algorithm.comm.ledger.setup():
            algorithm.setup(self.flat.data, self.layout)
        algorithm.attach([])  # no per-node modules whose backward could be hooked

    @property
    def kernels(self) -> str:
        """The batched forward in use: ``"bmm"`` (:mod:`gossip._batched`'s kernels) or
        ``"vmap"`` (``torch.func.vmap`` over the model's own forward)."""
        return self._forward.kernels

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the stacked gradients. By default (None) the cheaper way for the kernels
        in use. With the bmm kernels the gradients become None and their tensors are
        kept: the next backward writes each new gradient into its parameter's old
        tensor, which autograd then takes as the gradient (no zeroing pass, no
        accumulating pass over the ``(n, d)`` values, no page faults of a fresh
        allocation; a reference kept to an old gradient sees it overwritten, as with
        ``set_to_none=False``). Under ``vmap`` they are zeroed in place (its gradients
        come in other layouts and are added into them). ``True`` or ``False``: the
        optimizer's own ``zero_grad`` with that choice."""
        if set_to_none is None and self.kernels == "bmm":
            for name, p in self.flat.params.items():
                if p.grad is not None:
                    self._grads.keep(name, p.grad)
                    p.grad = None
            return
        self.optimizers[0].zero_grad(set_to_none=bool(set_to_none))

    def forward_backward(self, x: Tensor, y: Tensor) -> Tensor:
        """Every node's loss on its own batch (``x[i]``, ``y[i]``) and its gradient, in
        one batched call; returns the detached ``(n,)`` losses."""
        n = self.flat.rows
        if x.shape[0] != n or y.shape[0] != n:
            raise ValueError(f"forward_backward: x and y must hold one batch per node ({n}), got leading "
                             f"dimensions {x.shape[0]} and {y.shape[0]}")
        logits = self._forward(self.flat.params, x, grads=self._grads)
        if self._loss_fn is F.cross_entropy and logits.dim() == 3 and y.dim() == 2:
            # one cross-entropy over all n x B rows, then each node's mean: the numbers
            # of vmap's (to rounding) without vmap's per-node fallback for this op
            losses = _cross_entropy_rows(logits.flatten(0, 1), y.flatten()).view(n, -1).mean(1)
        else:
            losses = self._loss(logits, y)
        losses.sum().backward()
        return losses.detach()

    def step(self) -> None:
        """The local optimizer's step, then the algorithm's, as
        :meth:`gossip.runtime.GossipOptimizer.step` does them.

        With a plain ``torch.optim.SGD`` (any momentum, dampening, Nesterov, weight
        decay; no step hooks, not wrapped by a scheduler) and an algorithm that acts on
        the model, the SGD update and the runtime's ``u = x_after - x`` are fused: in
        chunks of rows that stay in cache, the momentum is updated and ``u`` written
        from ``x + (-lr) d - x``, the same operations on the same values as the
        optimizer's step between a copy of ``X`` and its restore, so ``X`` itself is
        read, never written, before the algorithm's step. That is 5 passes over
        ``(n, d)`` values through memory instead of 15. An algorithm that declares
        ``prepares_update`` (D-PSGD) asks for ``u``'s rows as it adds them, and they are
        made then, a slab at a time (:meth:`_lazy_step`): ``u`` stays in cache and no
        ``(n, d)`` buffer holds it; on the CPU in float32 the fused kernel of
        :mod:`gossip._fused` makes each row's update and adds it in one pass, without
        storing ``u`` at all. Other optimizers take the generic step."""
        algo = self.algorithm
        opt = self.optimizers[0]
        if algo.acts_on == "gradient" or not _plain_sgd(opt):
            super().step()
            return
        self.flat.check()
        algo.set_lr(float(opt.param_groups[0]["lr"]))
        X = self.flat.data
        ledger = algo.comm.ledger
        with torch.no_grad():
            if getattr(algo, "prepares_update", False) and X.device.type == "cpu":
                self._lazy_step(opt, X, ledger)
            else:
                U = self._buffer("_u", tuple(X.shape), X)
                with ledger.phase("compute"):  # the local step, as GossipOptimizer.step charges it
                    self._sgd_update(opt, U)
                algo.step(X, U)
        self.steps += 1
        algo.on_step_end(self.steps)

    def _lazy_step(self, opt: torch.optim.SGD, X: Tensor, ledger: Any) -> None:
        """The algorithm's step with the SGD update made on demand (:class:`_LazyUpdate`):
        the algorithm asks for the update's rows just before it adds them, so that the
        update never goes through memory. Still charged to ``compute``."""
        prepare = _LazyUpdate(self, self._sgd_plan(opt), X, ledger)
        self.algorithm.step(X, None, prepare=prepare)
        if prepare.done < self.flat.rows:  # pragma: no cover - an algorithm that declares prepares_update prepares every row
            raise AssertionError(f"{self.algorithm.name}.step prepared {prepare.done} of {self.flat.rows} rows "
                                 f"of the update")

    def _buffer(self, name: str, shape: tuple[int, ...], X: Tensor) -> Tensor:
        """The update's buffer ``name`` (the whole update, or one slab of it), kept from
        step to step, made anew where its shape, dtype or device no longer fit."""
        u = getattr(self, name)
        if u is None or tuple(u.shape) != shape or u.dtype != X.dtype or u.device != X.device:
            u = torch.empty(shape, dtype=X.dtype, device=X.device)
            setattr(self, name, u)
        return u

    def _sgd_update(self, opt: torch.optim.SGD, U: Tensor) -> None:
        """``U`` <- what ``opt.step()`` would add to ``X`` (zero where a tensor has no
        gradient), the momentum buffers updated as ``opt.step()`` updates them; ``X``
        unchanged. The arithmetic of torch's SGD, element for element:
        ``d = g + wd x``; ``buf = d`` at the first step, else ``buf = m buf + (1 - damp) d``;
        ``d = buf`` (or ``d + m buf``, Nesterov); ``u = (x + (-lr) d) - x``."""
        self._sgd_rows(self._sgd_plan(opt), U, 0, self.flat.rows)

    def _sgd_plan(self, opt: torch.optim.SGD) -> tuple[list[tuple], list[tuple[int, int]]]:
        """The step's SGD update, ready to run on any rows (:meth:`_sgd_rows`): per
        tensor with a gradient its columns of ``X``, gradient and momentum as ``(n, k)``
        views, whether the momentum starts here (made now, filled by the first rows'
        update) and the group's options; and the columns of the tensors without one."""
        n = self.flat.rows
        where = {id(p): i for i, p in enumerate(self.flat.leaves())}
        plan, written = [], set()
        for group in opt.param_groups:
            opts = (float(group["lr"]), float(group["weight_decay"]), float(group["momentum"]),
                    float(group["dampening"]), bool(group["nesterov"]))
            for p in group["params"]:
                i = where.get(id(p))
                if p.grad is None or i is None:
                    continue
                o, k = self.flat.blocks[i]
                b, first = None, False
                if opts[2] != 0:
                    state = opt.state[p]
                    buf = state.get("momentum_buffer")
                    first = buf is None
                    if first or not buf.is_contiguous():
                        buf = torch.empty_like(p.grad, memory_format=torch.contiguous_format) if first \
                            else buf.contiguous()
                        state["momentum_buffer"] = buf
                    b = buf.view(n, k)
                # a view: the batched kernels' gradients are contiguous
                plan.append((o, k, p.grad.reshape(n, k), b, first, opts))
                written.add(i)
        return plan, [blk for i, blk in enumerate(self.flat.blocks) if i not in written]

    def _sgd_rows(self, plan: tuple[list[tuple], list[tuple[int, int]]], U: Tensor, a: int, e: int,
                  base: int = 0) -> None:
        """:meth:`_sgd_update` on the rows ``[a, e)`` of the momentum and ``X``, global row
        ``r``'s update into row ``r - base`` of ``U`` (``base = a``: ``U`` is a slab)."""
        _sgd_rows(self.flat.data, plan, U, a, e, base)

    # --- views for evaluation: every node is hosted here, so no collective is needed -----
    @torch.no_grad()
    def average(self) -> Tensor:
        """xbar, the average of all n nodes' parameters (shape (d,)): the numbers of the
        communicator's mean all-reduce (sum over the rows, then divided by n), without
        materialising its ``(n, d)`` result, n copies of xbar."""
        if self.comm.world_size != self.flat.rows:
            return super().average()
        self.flat.check()
        X = self.flat.data
        return (X.sum(dim=0, keepdim=True).to(X.dtype) / self.flat.rows)[0]

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """mean_i ||x_i - xbar||^2 over all n nodes, as the base class computes it, in
        blocks of rows through one reused buffer: the whole-matrix expression allocates
        two ``(n, d)`` temporaries (page faults cost more than its arithmetic)."""
        if self.comm.world_size != self.flat.rows:
            return super().consensus_distance()
        X = self.flat.data
        xbar = self.average()
        rows = max(1, _BLOCK_VALUES // max(1, X.shape[1]))
        buf = torch.empty(min(rows, X.shape[0]), X.shape[1], dtype=X.dtype, device=X.device)
        dist = torch.empty(X.shape[0], 1, dtype=torch.float64, device=X.device)
        for r in range(0, X.shape[0], rows):
            part = X[r:r + rows]
            diff = torch.sub(part, xbar, out=buf[:part.shape[0]])
            dist[r:r + part.shape[0]] = diff.pow_(2).sum(dim=1, keepdim=True)
        return float((dist.sum(dim=0, keepdim=True) / X.shape[0])[0, 0])

    def state_dict(self, *, copy: bool = True) -> dict:
        self.flat.check()
        return {
            "params": params_of(self.flat.data, copy),
            "algorithm": self.algorithm.state_dict(),
            "optimizers": {"stacked": self.optimizers[0].state_dict(), "nodes": self.flat.rows},
            "steps": self.steps,
        }

    def load_state_dict(self, sd: dict) -> None:
        params = sd["params"]
        if params.shape != self.flat.data.shape:
            raise ValueError(f"checkpoint parameters have shape {tuple(params.shape)}, "
                             f"this run has {tuple(self.flat.data.shape)}")
        saved = sd["optimizers"]
        stacked = isinstance(saved, dict) and "stacked" in saved
        count = int(saved["nodes"]) if stacked else len(saved)
        if count != self.flat.rows:
            raise ValueError(f"checkpoint holds {count} optimizer states, this run has {self.flat.rows} nodes")
        with torch.no_grad():
            self.flat.data.copy_(params)
        self.algorithm.load_state_dict(sd["algorithm"])
        self.optimizers[0].load_state_dict(saved["stacked"] if stacked else stack_optimizer_state(saved, self.flat.shapes))
        self.steps = int(sd.get("steps", 0))


def _sgd_rows(X: Tensor, plan: tuple[list[tuple], list[tuple[int, int]]], U: Tensor, a: int, e: int,
              base: int = 0) -> None:
    """The SGD update of :meth:`VectorizedOptimizer._sgd_update` on the rows ``[a, e)``
    of the momentum and ``X``, global row ``r``'s update into row ``r - base`` of ``U``:
    torch's operations, element for element those of ``torch.optim.SGD``."""
    tensors, unwritten = plan
    for o, k, g, b, first, (lr, wd, mom, damp, nesterov) in tensors:
        # a GPU takes whole tensors: chunks would only add kernel launches
        rows = max(1, _CHUNK_VALUES // k) if X.device.type == "cpu" else e - a
        for r in range(a, e, rows):
            s = slice(r, min(e, r + rows))
            x = X[s, o:o + k]
            d = g[s]
            if wd != 0:
                d = d.add(x, alpha=wd)
            if b is not None:
                bc = b[s]
                if first:
                    bc.copy_(d)
                else:
                    bc.mul_(mom).add_(d, alpha=1 - damp)
                d = d.add(bc, alpha=mom) if nesterov else bc
            torch.add(x, d, alpha=-lr, out=U[s.start - base: s.stop - base, o:o + k]).sub_(x)
    for o, k in unwritten:
        U[a - base: e - base, o:o + k].zero_()


class _LazyUpdate:
    """The SGD update of :class:`VectorizedOptimizer`, made as the algorithm asks for it.

    ``prepare(rows)`` (calling the object) returns the update's rows ``rows``; the
    algorithm asks for them in ascending order, each block once, just before it adds
    them. They are made a slab of :data:`_SLAB_VALUES` at a time into a buffer of one
    slab, reused, so that the update never goes through memory: the whole ``(n, d)``
    update would be written there and read back (the same operations on the same
    values: the same bits). A request for every row at once (a local step) gets the
    whole update.

    ``combine(rows, w, mixed)`` does a block's whole update, ``X[rows] <- w X[rows] +
    mixed + u(rows)``: in float32 on the CPU with the fused kernel of
    :mod:`gossip._fused` (one pass over the gradient, momentum and parameter rows;
    ``u`` is never stored), else as ``X[rows].mul_(w).add_(mixed).add_(prepare(rows))``;
    the same bits either way. Both are charged to ``compute``."""

    def __init__(self, owner: VectorizedOptimizer, plan: tuple[list[tuple], list[tuple[int, int]]], X: Tensor,
                 ledger: Any) -> None:
        self.owner, self.plan, self.X, self.ledger = owner, plan, X, ledger
        self.n, self.d = X.shape
        self.cap = max(1, _SLAB_VALUES // max(1, self.d))
        #: the slab's first row, and the rows made so far (all rows below ``done``)
        self.lo = self.done = 0
        self.slab: Tensor | None = None
        fused = _fused_args(X, plan)  # None off the CPU or float32: nothing to build there
        self.fused = fused if fused is not None and _fused_kernel() is not None else None

    def __call__(self, rows: slice) -> Tensor:
        n, cap = self.n, self.cap
        a, e = rows.start or 0, n if rows.stop is None else min(n, rows.stop)
        if a == 0 and e == n and self.done == 0 and n > cap:  # every row: the whole update
            U = self.owner._buffer("_u", (n, self.d), self.X)
            with self.ledger.phase("compute"):
                self.owner._sgd_rows(self.plan, U, 0, n)
            self.done = self.lo = n
            return U
        if a < self.lo or e - a > cap:  # pragma: no cover - DPSGD asks for ascending blocks within a slab
            raise AssertionError(f"prepare: rows [{a}, {e}) after rows up to {self.done} (slabs of {cap})")
        if e > self.done:
            if self.slab is None:
                self.slab = self.owner._buffer("_slab", (min(n, cap), self.d), self.X)
            slab, lo, done = self.slab, self.lo, self.done
            if e - lo > cap:  # start the slab at a: the rows of [a, done) made already move to its front
                if done > a:
                    slab[: done - a] = slab[a - lo: done - lo].clone()
                self.lo = lo = a
            end = min(n, lo + cap)
            with self.ledger.phase("compute"):
                self.owner._sgd_rows(self.plan, slab, done, end, base=lo)
            self.done = end
        return self.slab[a - self.lo: e - self.lo]

    def combine(self, rows: slice, w: Tensor, mixed: Tensor) -> None:
        X = self.X
        a, e = rows.start or 0, self.n if rows.stop is None else min(self.n, rows.stop)
        if self.fused is not None and a == self.done and e > a and _fused_rows_fit(w, mixed, e - a, self.d):
            segs, ptrs, pars, count = self.fused
            with self.ledger.phase("compute"):
                _fused_kernel().gossip_sgd_mix(X.data_ptr(), X.stride(0), a, e, mixed.data_ptr(), mixed.stride(0),
                                               w.data_ptr(), count, segs.data_ptr(), ptrs.data_ptr(),
                                               pars.data_ptr())
            self.done = self.lo = e
            return
        u = self(rows)
        X[rows].mul_(w).add_(mixed).add_(u)


@functools.cache
def _fused_kernel() -> Any:
    """The fused kernel of :mod:`gossip._fused` once it has given torch's bits on a probe
    of every kind of segment, else None (with a warning saying why: torch's build on
    this machine computes differently, and its operations are kept)."""
    lib = _fused.library()
    if lib is None:
        return None
    g = torch.Generator().manual_seed(0)
    n, d = 5, 243
    # values over many binades, so that one rounding more or less shows
    X = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-8, 8, (n, d), generator=g).float())
    grads = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-12, 4, (n, d), generator=g).float())
    moms = torch.randn(n, d, generator=g)
    mixed = torch.randn(n, d, generator=g)
    ws = torch.rand(n, 1, generator=g)
    blocks = [(0, 64, True, False, (0.1, 0.0, 0.9, 0.0, False)),  # the common case
              (64, 37, True, True, (0.05, 1e-3, 0.9, 0.0, True)),  # first step, Nesterov, decay
              (101, 41, True, False, (0.3, 5e-4, 0.7, 0.25, False)),  # dampening, decay
              (142, 50, False, False, (0.2, 1e-2, 0.0, 0.0, False))]  # no momentum
    outs = []
    for fuse in (False, True):
        x, m = X.clone(), moms.clone()
        plan = ([(o, k, grads[:, o:o + k].contiguous(), m[:, o:o + k].contiguous() if has else None, first, opts)
                 for o, k, has, first, opts in blocks], [(192, 51)])
        if fuse:
            segs, ptrs, pars, count = _fused_args(x, plan)
            lib.gossip_sgd_mix(x.data_ptr(), x.stride(0), 0, n, mixed.data_ptr(), d, ws.data_ptr(), count,
                               segs.data_ptr(), ptrs.data_ptr(), pars.data_ptr())
        else:
            U = torch.empty_like(x)
            _sgd_rows(x, plan, U, 0, n)
            x.mul_(ws).add_(mixed).add_(U)
        outs.append([x.view(torch.int32)] + [b.view(torch.int32) for *_, b, _, _ in plan[0] if b is not None])
    if not all(torch.equal(a, b) for a, b in zip(*outs)):
        warnings.warn("gossip: the fused D-PSGD kernel does not give torch's bits on this machine; the "
                      "simulation uses torch's operations", RuntimeWarning, stacklevel=2)
        return None
    return lib


def _fused_args(X: Tensor, plan: tuple[list[tuple], list[tuple[int, int]]]) -> tuple | None:
    """The SGD plan (:meth:`VectorizedOptimizer._sgd_plan`) as the fused kernel's segment
    arrays ``(seg, ptr, par, count)``; None where the kernel cannot take it (not float32
    on the CPU, a strided tensor)."""
    if X.device.type != "cpu" or X.dtype != torch.float32 or X.dim() != 2 or X.stride(1) != 1:
        return None
    f32 = torch.float32
    segs: list[int] = []
    ptrs: list[int] = []
    pars: list[float] = []
    tensors, unwritten = plan
    for o, k, g, b, first, (lr, wd, mom, damp, nesterov) in tensors:
        if g.dtype != f32 or not g.is_contiguous() or (b is not None and (b.dtype != f32 or not b.is_contiguous())):
            return None
        kind = _fused.HAS_GRAD | (_fused.DECAY if wd != 0 else 0)
        if b is not None:
            kind |= _fused.HAS_MOMENTUM | (_fused.FIRST if first else 0) | (_fused.NESTEROV if nesterov else 0)
        segs += [o, k, kind]
        ptrs += [g.data_ptr(), b.data_ptr() if b is not None else 0]
        pars += [-lr, wd, mom, 1 - damp]  # rounded to float32 as torch rounds a scalar for a float32 tensor
    for o, k in unwritten:
        segs += [o, k, 0]
        ptrs += [0, 0]
        pars += [0.0, 0.0, 0.0, 0.0]
    return (torch.tensor(segs, dtype=torch.int64), torch.tensor(ptrs, dtype=torch.int64),
            torch.tensor(pars, dtype=f32), len(segs) // 3)


def _fused_rows_fit(w: Tensor, mixed: Tensor, rows: int, d: int) -> bool:
    """Whether a block's self weights and weighted sum are laid out as the kernel reads
    them: float32 on the CPU, ``rows`` contiguous weights, rows of ``d`` unit-stride values."""
    return (w.dtype == torch.float32 and mixed.dtype == torch.float32 and w.device.type == "cpu"
            and mixed.device.type == "cpu" and w.numel() == rows and w.is_contiguous()
            and tuple(mixed.shape) == (rows, d) and mixed.stride(1) == 1)


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------
class BatchedLoader:
    """The next batch of every node at once, ``x`` shaped ``(n, B, ...)``, ``y`` ``(n, B)``.

    Node i's batch is the one its :class:`gossip.data.ShardLoader` would serve next,
    row for row: the loader's epoch order is read once per epoch
    (:meth:`ShardLoader.epoch_rows`) and the batches are gathered from it for all nodes
    with one indexing call per step. The loaders stay the state holders: call
    :meth:`sync` before reading their ``state_dict`` and :meth:`reload` after loading
    one. Needs ``drop_last`` loaders of one batch size on one data set.
    """

    def __init__(self, loaders: Sequence[Any], device: torch.device | str | None = None) -> None:
        if not loaders:
            raise ValueError("BatchedLoader needs at least one loader")
        first = loaders[0]
        for ld in loaders:
            if ld.x is not first.x or ld.y is not first.y:
                raise ValueError("BatchedLoader: every loader must read the same data set")
            if ld.batch_size != first.batch_size or not ld.drop_last or ld.transform is not None:
                raise ValueError("BatchedLoader: the loaders must share one batch size, drop_last=True and no transform")
        self.loaders = list(loaders)
        self.batch_size = first.batch_size
        self.device = torch.device(device) if device is not None else first.x.device
        # the data set once on the device the model runs on (a GPU gathers its own batches)
        self.x = first.x.to(self.device)
        self.y = first.y.to(self.device)
        self._steps = torch.tensor([ld.steps_per_epoch for ld in self.loaders], dtype=torch.int64)
        self._arange = torch.arange(self.batch_size, dtype=torch.int64)
        self.reload()

    def reload(self) -> None:
        """Read every loader's position and epoch order afresh (after a load_state_dict)."""
        n, width = len(self.loaders), int(self._steps.max()) * self.batch_size
        self._rows = torch.zeros(n, width, dtype=torch.int64)
        self._start = torch.tensor([ld.position for ld in self.loaders], dtype=torch.int64)
        for i, ld in enumerate(self.loaders):
            self._refill(i, ld)
        self._pos = self._start.clone()

    def _refill(self, i: int, ld: Any) -> None:
        rows = ld.epoch_rows()  # starts the loader's next epoch when its current one is done
        k = int(self._steps[i]) * self.batch_size
        self._rows[i, :k] = rows[:k]
        self._start[i] = ld.position

    def next_batch(self) -> tuple[Tensor, Tensor]:
        done = self._pos >= self._steps
        if bool(done.any()):
            self.sync()
            for i in torch.nonzero(done).flatten().tolist():
                self._refill(i, self.loaders[i])
                self._pos[i] = self._start[i]
        cols = self._pos.unsqueeze(1) * self.batch_size + self._arange
        rows = self._rows.gather(1, cols).flatten().to(self.device)
        self._pos += 1
        # index_select: several times faster than advanced indexing for this gather
        x = self.x.index_select(0, rows).view(len(self.loaders), self.batch_size, *self.x.shape[1:])
        return x, self.y.index_select(0, rows).view(len(self.loaders), self.batch_size)

    def sync(self) -> None:
        """Tell each loader how many batches were gathered for it since the last sync."""
        served = (self._pos - self._start).tolist()
        for ld, k in zip(self.loaders, served):
            if k:
                ld.skip(k)
        self._start = self._pos.clone()


# --------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------
def eval_nodes(n: int, limit: int = EVAL_NODES) -> Tensor:
    """The nodes whose own accuracy is evaluated: all when ``n <= limit``, else ``limit``
    nodes evenly spaced over 0..n-1 (the first and the last included)."""
    if n <= limit:
        return torch.arange(n)
    return torch.linspace(0, n - 1, limit).round().to(torch.int64).unique()


@torch.no_grad()
def node_accuracies(gopt: VectorizedOptimizer, x: Tensor, y: Tensor, rows: Tensor, *,
                    batch: int = 1000, node_chunk: int = 4) -> tuple[Tensor, Tensor]:
    """Test loss (mean cross-entropy) and accuracy of the models whose flat parameters
    are the rows of ``rows`` (``(k, d)``: e.g. ``X[eval_nodes(n)]``, or the average
    ``xbar[None]``), ``node_chunk`` models and ``batch`` examples per batched call.
    Returns two ``(k,)`` float64 tensors (on the CPU).

    Each model's figures are the same whatever ``node_chunk`` is (each node's
    examples are summed in the same batches). The default, 4, was 1.4-2.3x faster
    than 16 for the MLP and the CNN on one CPU thread (``experiments/sim_kernels.py``
    times 1, 4 and 16): more models per call make bigger activations, out of cache,
    and for convolutions more groups, which cost more per node."""
    model = gopt.models[0]
    was = model.training
    model.eval()
    forward = gopt._forward
    k = rows.shape[0]
    loss = torch.zeros(k, dtype=torch.float64)
    correct = torch.zeros(k, dtype=torch.float64)
    try:
        for c in range(0, k, node_chunk):
            part = rows[c:c + node_chunk]
            params = gopt.flat.views(part)
            for s in range(0, len(y), batch):
                out = forward(params, x[s:s + batch], shared=True)  # (k, b, classes)
                yb = y[s:s + batch]
                ce = F.cross_entropy(out.flatten(0, 1), yb.repeat(len(part)), reduction="none").view(len(part), -1)
                loss[c:c + len(part)] += ce.sum(1).double().cpu()
                correct[c:c + len(part)] += (out.argmax(-1) == yb).sum(1).double().cpu()
    finally:
        model.train(was)
    return loss / len(y), correct / len(y)
