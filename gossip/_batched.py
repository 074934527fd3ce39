"""n copies of one model, each node with its own weights, as batched matrix products.

``torch.func.vmap`` over a model's forward batches each call by a generic rule. For
the layers the built-in classifiers are made of, that rule is slow on the CPU: a
convolution with per-node weights becomes one grouped convolution (``groups = n``),
which costs more per node the more nodes there are (1.5x a node's own convolution at
256 nodes, ``experiments/sim_kernels.py``). This module runs those layers for all
nodes as ``torch.bmm`` with a backward of its own:

1. **Linear**, ``y_i = x_i W_i^T + b_i`` for node i: one ``baddbmm``. Backward:
   ``dx_i = dy_i W_i``, ``dW_i = dy_i^T x_i`` (made in W's own ``(out, in)`` layout,
   so that autograd takes it as the gradient without a copy), ``db_i`` the sum of
   ``dy_i``'s rows.
2. **Conv1d** (zero padding, one group, no dilation) as im2col and ``bmm``. In a
   channels-last ``(B, L, C)`` input the window of output position l is one
   contiguous run of ``k C`` values (less the taps in the padding, which stay zero);
   the columns ``(B L_out, k C)`` times the node's weights ``(k C, C_out)`` are its
   output. The output is returned as a channels-first view of that channels-last
   product, which the next convolution reads as its channels-last input, without a
   transpose or a padded copy. Backward: ``dW`` from the columns (built again), the
   input's gradient by adding ``dcols`` back over the k taps (col2im), straight into
   the input's positions.
3. **The model's graph.** :func:`batched_forward` traces the model with ``torch.fx``
   and maps every call onto a batched kernel (the layers above, ReLU, flatten and unflatten). A
   model with any other call gets None, and the caller keeps ``vmap``. A kernel that
   meets an input it does not cover (a 1-D convolution's input of another rank)
   raises :class:`Unsupported` before computing anything, for the same fallback.

Each kernel computes each node's own layer, the sums of ``F.linear`` / ``F.conv1d``
in another order: the results agree with the node's own to rounding.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__: list[str] = []  # private: gossip.vectorized is the interface


class Unsupported(Exception):
    """A call the batched kernels do not cover: the caller runs ``vmap`` instead."""


class GradBuffers:
    """Gradient tensors kept from one step to the next, by parameter name, and the
    training forward's and backward's intermediate tensors.

    A kernel's backward writes a parameter's gradient into the tensor that parameter
    had as its gradient at the last step (handed over by ``keep`` when the gradients
    are cleared), and autograd takes it as the new gradient. A fresh ``(n, *shape)``
    tensor every step costs the page faults of its first writes: for the MLP's
    gradients at 1,024 nodes (320 MB) about 70 ms, more than writing them.

    The same holds for a layer's output and its input's gradient (each 34 MB for a
    hidden layer of the MLP at 1,024 nodes: above the size from which the C library
    returns freed memory to the system, so every fresh one is page-faulted again):
    :meth:`scratch` hands out one tensor per key, the same one at every step. A
    step's tensors are dead by the next step's forward (the backward has consumed the
    graph that held them), which is why only the training call passes a
    ``GradBuffers``; the evaluation's forward allocates."""

    def __init__(self) -> None:
        self._free: dict[str, Tensor] = {}
        self._scratch: dict[str, Tensor] = {}

    def keep(self, name: str, t: Tensor) -> None:
        self._free[name] = t

    def take(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        """The kept tensor of ``name`` if it fits (shape, dtype, device, contiguous), else None."""
        t = self._free.pop(name, None)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device \
                or not t.is_contiguous():
            return None
        return t

    def scratch(self, key: str, shape: tuple[int, ...], like: Tensor, zeros: bool = False) -> Tensor:
        """The tensor of ``key`` (``shape``, ``like``'s dtype and device), the same at
        every call with the same shape: its contents are the caller's to overwrite
        (``zeros``: filled with zeros when it is made, not at later calls)."""
        t = self._scratch.get(key)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device:
            t = self._scratch[key] = like.new_zeros(shape) if zeros else like.new_empty(shape)
        return t


def _weak(grads: GradBuffers | None) -> Callable[[], GradBuffers | None]:
    """What a kernel's autograd context keeps of ``grads``: a weak reference. A kept
    output (a :meth:`GradBuffers.scratch` tensor) holds its ``grad_fn`` and so the
    context; a strong reference back to the buffers would make a cycle through
    autograd's C++ graph that Python's collector cannot see, and every optimizer's
    buffers would outlive it."""
    if grads is None:
        return lambda: None
    return weakref.ref(grads)


def _take(grads: GradBuffers | None, name: str | None, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
    return grads.take(name, shape, like) if grads is not None and name is not None else None


def _scratch(grads: GradBuffers | None, key: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    return grads.scratch(key, shape, like) if grads is not None else like.new_empty(shape)


#: values per chunk of nodes of a linear layer's output (256 KiB of float32): one
#: chunk's output, its gradient and the ReLU's mask stay in a core's L2 cache between
#: the kernel's passes over them
_LINEAR_CHUNK_VALUES = 1 << 16


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
class _Linear(torch.autograd.Function):
    """x (n, R, in), W (n, out, in), b (n, out) or None -> (n, R, out), with a ReLU
    applied after it where ``relu``.

    On the CPU the nodes go through in chunks (:data:`_LINEAR_CHUNK_VALUES` output
    values each): per chunk the product, then the ReLU while the chunk's output is in
    cache; backward, per chunk, the ReLU's gradient, then the bias's, the weight's and
    the input's gradients from it while it is in cache. Each node's arithmetic is that
    of one ``baddbmm``, ``relu`` and ``threshold_backward`` over all nodes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, grads: GradBuffers | None,
                names: tuple[str, str], relu: bool = False) -> Tensor:
        n, R = x.shape[0], x.shape[1]
        out = w.shape[1]
        wt = w.transpose(1, 2)
        # the output of a hidden layer (it goes on to the next layer) is a tensor kept
        # from step to step; the model's output (the logits) is the caller's to keep
        y = _scratch(grads, names[0] + ":y", (n, R, out), x) if relu else x.new_empty(n, R, out)
        chunk = _chunk_rows(x, R * out, n, _LINEAR_CHUNK_VALUES)
        for r in range(0, n, chunk):
            s = slice(r, r + chunk)
            if b is None:
                torch.bmm(x[s], wt[s], out=y[s])
            else:
                torch.baddbmm(b[s].unsqueeze(1), x[s], wt[s], out=y[s])
            if relu:  # max(y, 0) while the chunk's output is in cache
                y[s].relu_()
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.has_bias = b is not None
        ctx.grads, ctx.names = _weak(grads), names
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x, w, y = ctx.saved_tensors
        grads = ctx.grads()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        n, R, out = gy.shape
        gx = gw = gb = None
        if need_x:
            gx = _scratch(grads, ctx.names[0] + ":gx", tuple(x.shape), gy)
        if need_w:  # dy^T x is (n, out, in): W's own layout, taken by autograd as is
            gw = _take(grads, ctx.names[0], tuple(w.shape), gy)
            if gw is None:
                gw = gy.new_empty(w.shape)
        if need_b:
            gb = _take(grads, ctx.names[1], (n, out), gy)
            if gb is None:
                gb = gy.new_empty(n, out)
        chunk = _chunk_rows(gy, R * out, n, _LINEAR_CHUNK_VALUES)
        for r in range(0, n, chunk):
            s = slice(r, r + chunk)
            gs = gy[s]
            if y is not None:  # the fused ReLU's gradient: dy where its output was > 0
                gs = torch.ops.aten.threshold_backward(gs, y[s], 0)
            if need_b:
                torch.sum(gs, 1, out=gb[s])
            if need_w:
                torch.bmm(gs.transpose(1, 2), x[s], out=gw[s])
            if need_x:
                torch.bmm(gs, w[s], out=gx[s])
        return gx, gw, gb, None, None, None


def _chunk_rows(like: Tensor, per_node: int, n: int, values: int) -> int:
    """Nodes per chunk: ``per_node`` values each within ``values`` on the CPU; all
    ``n`` on a GPU (chunks would only add kernel launches)."""
    if like.device.type != "cpu":
        return n
    return max(1, min(n, values // max(1, per_node)))


#: values of a convolution's columns per chunk of nodes (2 MiB of float32): one chunk's
#: padded input, columns and products stay in cache, where whole-batch columns (210 MB
#: for the CNN's second layer at 256 nodes) are written and read back through memory
_CONV_CHUNK_VALUES = 1 << 19


class _Conv1d(torch.autograd.Function):
    """x (n, B, C, L), W (n, C_out, C, k), b (n, C_out) or None -> (n, B, C_out, L_out).

    Nodes are processed in chunks (:data:`_CONV_CHUNK_VALUES`; one chunk on a GPU): per
    chunk, the padded input and its columns are built in buffers reused from chunk to
    chunk, and the backward builds them again from the saved input instead of keeping
    every node's columns."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, stride: int, padding: int,
                grads: GradBuffers | None, names: tuple[str, str], relu: bool = False) -> Tensor:
        n, B, C, L = x.shape
        cout, k = w.shape[1], w.shape[3]
        lout = (L + 2 * padding - k) // stride + 1
        # the weights in the columns' (tap, channel) order, (k C, C_out) per node: a
        # small copy (n k C C_out values) that makes every product's operands contiguous
        wt = _scratch(grads, names[0] + ":wt", (n, k * C, cout), w)
        wt.view(n, k, C, cout).copy_(w.permute(0, 3, 2, 1))
        # a hidden layer's output (its ReLU applied here) is a tensor kept from step to
        # step, as the linear layer's; an output without one is the caller's to keep
        y = _scratch(grads, names[0] + ":y", (n, B * lout, cout), x) if relu else x.new_empty(n, B * lout, cout)
        cols = _Columns(x, k, stride, padding, lout, grads, names[0])
        for s, c in cols.chunks():
            # one batched product per node of the chunk, its bias added by baddbmm
            if b is None:
                torch.bmm(c, wt[s], out=y[s])
            else:
                torch.baddbmm(b[s].unsqueeze(1), c, wt[s], out=y[s])
            if relu:  # max(y, 0) while the chunk's output is in cache
                y[s].relu_()
        ctx.save_for_backward(x, wt, y if relu else None)
        ctx.conv = (stride, padding, lout)
        ctx.has_bias = b is not None
        ctx.grads, ctx.names = _weak(grads), names
        return y.view(n, B, lout, cout).transpose(2, 3)

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x, wt, y = ctx.saved_tensors
        grads = ctx.grads()
        stride, padding, lout = ctx.conv
        n, B, C, L = x.shape
        cout = wt.shape[2]
        k = wt.shape[1] // C
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        g = gy.transpose(2, 3).reshape(n, B * lout, cout)  # a view where gy is channels-last
        gx = gw = gb = None
        if need_b:
            gb = _take(grads, ctx.names[1], (n, cout), g)
            if gb is None:
                gb = g.new_empty(n, cout)
        if need_w:
            gw = _take(grads, ctx.names[0], (n, cout, C, k), g)
            if gw is None:
                gw = g.new_empty(n, cout, C, k)
        if need_x:
            gxl = _scratch(grads, ctx.names[0] + ":gx", (n, B, L, C), g)  # channels-last, returned as a (n, B, C, L) view
            col2im = _col2im_plan(L, k, stride, padding, lout)
        chunk = _chunk_nodes(g, B * lout * k * C, n)
        cols = _Columns(x, k, stride, padding, lout, grads, ctx.names[0]) if need_w else None
        for s, c in cols.chunks() if cols is not None else ((slice(r, r + chunk), None) for r in range(0, n, chunk)):
            gs = g[s]
            if y is not None:  # the fused ReLU's gradient: dy where its output was > 0, in a chunk's buffer
                buf = _scratch(grads, ctx.names[0] + ":gs", (chunk, *gs.shape[1:]), gs)[:gs.shape[0]]
                gs = torch.ops.aten.threshold_backward.grad_input(gs, y[s], 0, grad_input=buf)
            if need_b:
                torch.sum(gs, 1, out=gb[s])
            if need_w:
                # dW = dy^T cols, in the columns' (tap, channel) order, then W's (channel, tap)
                gwc = _scratch(grads, ctx.names[0] + ":gwc", (chunk, cout, k * C), gs)[:gs.shape[0]]
                gw[s].copy_(torch.bmm(gs.transpose(1, 2), c, out=gwc).view(-1, cout, k, C).permute(0, 1, 3, 2))
            if need_x:
                gc = _scratch(grads, ctx.names[0] + ":gc", (chunk, B * lout, k * C), gs)[:gs.shape[0]]
                gc = torch.bmm(gs, wt[s].transpose(1, 2), out=gc).view(-1, B, lout, k, C)
                part = gxl[s]
                zero, plan = col2im
                if zero:
                    part.zero_()
                # col2im: tap j of output l came from position l * stride + j - padding
                for j, l0, l1, q0, add in plan:
                    src, dst = gc[:, :, l0:l1, j], part[:, :, q0:q0 + stride * (l1 - l0 - 1) + 1:stride]
                    dst.add_(src) if add else dst.copy_(src)
        if need_x:
            gx = gxl.transpose(2, 3)
        return gx, gw, gb, None, None, None, None, None


def conv1d(x: Tensor, w: Tensor, b: Tensor | None, stride: int, padding: int,
           grads: GradBuffers | None = None, names: tuple[str, str] = ("w", "b"), relu: bool = False) -> Tensor:
    """Every node's 1-d convolution at once, as the vectorized path runs it (im2col and
    one batched product per node): x (n, B, C, L), w (n, C_out, C, k), b (n, C_out) or
    None -> (n, B, C_out, L_out), differentiable; ``grads`` and ``names`` say where the
    backward may write the weights' gradients, ``relu`` applies a ReLU after."""
    return _Conv1d.apply(x, w, b, stride, padding, grads, names, relu)


def _chunk_nodes(like: Tensor, per_node: int, n: int) -> int:
    """Nodes per chunk: ``per_node`` values each within :data:`_CONV_CHUNK_VALUES` on
    the CPU; all ``n`` on a GPU (chunks would only add kernel launches)."""
    return _chunk_rows(like, per_node, n, _CONV_CHUNK_VALUES)


def _col2im_plan(L: int, k: int, stride: int, padding: int, lout: int) -> tuple[bool, list[tuple]]:
    """How the input's gradient is summed from the columns' gradient, straight into the
    input's own positions (the padding's are never written). Per tap j in order: the
    outputs [l0, l1) whose tap j lies inside the signal, from position q0 on, every
    ``stride``-th, and whether it is added (else copied: the first term of each of its
    positions). Taps run in order, so each position's sum is the same as adding every
    tap to zeros in order. ``zero`` is True when some position gets no term, or a tap
    covers positions both new and already written: the input's gradient then starts at
    zero and every tap is added. Returns (zero, [(j, l0, l1, q0, add), ...])."""
    seen = [False] * L
    plan, zero = [], False
    for j in range(k):
        ls = [r for r in range(lout) if 0 <= r * stride - padding + j < L]
        if not ls:
            continue
        qs = [r * stride - padding + j for r in ls]
        new = [not seen[q] for q in qs]
        zero = zero or (any(new) and not all(new))
        plan.append((j, ls[0], ls[-1] + 1, qs[0], not new[0]))
        for q in qs:
            seen[q] = True
    zero = zero or not all(seen)
    if zero:
        plan = [(j, l0, l1, q0, True) for j, l0, l1, q0, _ in plan]
    return zero, plan


class _Columns:
    """im2col of a batched 1-D convolution's input, chunk of nodes by chunk of nodes:
    node i's row (b, l) holds the k C values of its zero-padded, channels-last input
    from position l * stride - padding on (one contiguous run of the input where the
    window lies inside it).

    The columns are copied from the input itself, which is channels-last in memory
    whenever it is the previous convolution's output: the rows whose window lies
    inside the signal in one strided copy, each edge row (its window reaches into the
    padding) from its taps inside the signal, the taps outside left at the zeros the
    buffer was made with. No padded copy of the input is made."""

    def __init__(self, x: Tensor, k: int, stride: int, padding: int, lout: int,
                 grads: GradBuffers | None = None, name: str = "") -> None:
        self.x, self.k, self.stride, self.padding, self.lout = x, k, stride, padding, lout
        n, B, C, L = x.shape
        self.chunk = _chunk_nodes(x, B * lout * k * C, n)
        # the zeros of the edge rows' taps in the padding are written once, when the
        # buffer is made; a training call's buffer is kept for the layer's later calls
        # of the same geometry (forward and backward alike), which write the same places
        shape = (self.chunk, B, lout, k * C)
        if grads is None:
            self.cols = x.new_zeros(shape)
        else:
            self.cols = grads.scratch(f"{name}:cols{(L, stride, padding)}", shape, x, zeros=True)
        # rows [lo, hi) have every tap inside the signal; the others are edge rows
        self.lo = min(lout, -(-padding // stride))
        self.hi = max(self.lo, min(lout, (L - k + padding) // stride + 1))
        self.edges = []  # (row, first tap, taps) of each edge row's taps inside the signal
        for r in [*range(self.lo), *range(self.hi, lout)]:
            taps = [j for j in range(k) if 0 <= r * stride - padding + j < L]
            if taps:
                self.edges.append((r, taps[0], len(taps)))
        self.dense = None  # the input in channels-last order, where it is not already

    def _channels_last(self, part: Tensor) -> Tensor:
        xl = part.transpose(2, 3)
        if xl.is_contiguous():
            return xl
        if self.dense is None:
            self.dense = part.new_empty(self.chunk, *xl.shape[1:])
        dense = self.dense[:xl.shape[0]]
        dense.copy_(xl)
        return dense

    def chunks(self):
        """``(slice of nodes, their columns (c, B L_out, k C))`` per chunk; the columns
        live in a buffer that the next chunk overwrites."""
        x, k, stride, pad, lout = self.x, self.k, self.stride, self.padding, self.lout
        n, B, C, L = x.shape
        lo, hi = self.lo, self.hi
        for r in range(0, n, self.chunk):
            s = slice(r, r + self.chunk)
            xl = self._channels_last(x[s])  # (c, B, L, C), contiguous
            c = xl.shape[0]
            cols = self.cols[:c]
            if hi > lo:
                windows = xl.as_strided((c, B, hi - lo, k * C), (B * L * C, L * C, stride * C, 1),
                                        xl.storage_offset() + (lo * stride - pad) * C)
                cols[:, :, lo:hi].copy_(windows)
            for row, j0, taps in self.edges:
                q = row * stride - pad + j0
                cols[:, :, row, j0 * C:(j0 + taps) * C].copy_(xl[:, :, q:q + taps].flatten(2))
            yield s, cols.view(c, B * lout, k * C)


# --------------------------------------------------------------------------------------
# one kernel per kind of call
# --------------------------------------------------------------------------------------
#: ``(params, x, grads) -> y``: one call for all n nodes (``grads``: where the
#: backward may write the parameters' gradients, or None)
Kernel = Callable[[dict[str, Tensor], Tensor, "GradBuffers | None"], Tensor]


def _node_dim(dim: int) -> int:
    """A dimension of one node's tensor as a dimension of the batched (n, ...) tensor."""
    return dim + 1 if dim >= 0 else dim


def _linear(prefix: str, mod: nn.Linear, relu: bool = False) -> Kernel:
    bias = mod.bias is not None
    names = (prefix + "weight", prefix + "bias")

    def run(params: dict[str, Tensor], x: Tensor, grads: GradBuffers | None) -> Tensor:
        w = params[names[0]]
        b = params[names[1]] if bias else None
        if x.dim() < 2 or x.shape[-1] != w.shape[-1]:
            raise Unsupported(f"linear layer {prefix[:-1]!r} on an input of shape {tuple(x.shape)}")
        n = x.shape[0]
        if x.dim() == 2:  # one example per node
            return _Linear.apply(x.unsqueeze(1), w, b, grads, names, relu).squeeze(1)
        y = _Linear.apply(x.reshape(n, -1, x.shape[-1]), w, b, grads, names, relu)
        return y.view(*x.shape[:-1], w.shape[1])
    if not relu:  # a ReLU right after it is applied inside, chunk by chunk (see batched_forward)
        run.with_relu = lambda: _linear(prefix, mod, relu=True)  # type: ignore[attr-defined]
    return run


def _conv1d(prefix: str, mod: nn.Conv1d, relu: bool = False) -> Kernel | None:
    padding = mod.padding
    if padding == "valid":
        padding = (0,)
    if (mod.padding_mode != "zeros" or mod.groups != 1 or tuple(mod.dilation) != (1,)
            or isinstance(padding, str) or len(mod.stride) != 1 or len(padding) != 1):
        return None
    stride, pad = int(mod.stride[0]), int(padding[0])
    bias = mod.bias is not None
    names = (prefix + "weight", prefix + "bias")

    def run(params: dict[str, Tensor], x: Tensor, grads: GradBuffers | None) -> Tensor:
        w = params[names[0]]
        if x.dim() != 4 or x.shape[2] != w.shape[2] or x.shape[3] + 2 * pad < w.shape[3]:
            raise Unsupported(f"conv1d layer {prefix[:-1]!r} on an input of shape {tuple(x.shape)}")
        return _Conv1d.apply(x, w, params[names[1]] if bias else None, stride, pad, grads, names, relu)
    if not relu:  # a ReLU right after it is applied inside, chunk by chunk (see batched_forward)
        run.with_relu = lambda: _conv1d(prefix, mod, relu=True)  # type: ignore[attr-defined]
    return run


class _Flatten(torch.autograd.Function):
    """``x.flatten(start, end)`` in a training forward where it cannot be a view of
    ``x`` (a convolution's channels-first view of its channels-last output): the copy
    goes into a tensor kept from step to step (:meth:`GradBuffers.scratch`), and the
    gradient comes back in ``x``'s own layout, also kept, so that the convolution's
    backward reads it as a view instead of copying it into a fresh tensor. The same
    values as ``flatten``; only where they live differs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: tuple[int, ...], grads: GradBuffers, key: str) -> Tensor:
        y = grads.scratch(key + ":y", shape, x)
        y.view(x.shape).copy_(x)
        ctx.layout, ctx.grads, ctx.key = (tuple(x.shape), x.stride()), _weak(grads), key
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        shape, stride = ctx.layout
        order = sorted(range(len(shape)), key=lambda i: -stride[i])  # x's dimensions, outermost first
        base = _scratch(ctx.grads(), ctx.key + ":gx", tuple(shape[i] for i in order), gy)
        gx = base.permute([order.index(i) for i in range(len(shape))])
        gx.copy_(gy.reshape(shape))
        return gx, None, None, None


_FLATTENS = itertools.count()  # a key per flatten kernel for its kept tensors


def _flatten(start: int = 0, end: int = -1) -> Kernel:
    start, end = _node_dim(int(start)), _node_dim(int(end))
    key = f"flatten{next(_FLATTENS)}"

    def run(params: dict[str, Tensor], x: Tensor, grads: GradBuffers | None) -> Tensor:
        if grads is None or x.is_contiguous():
            return x.flatten(start, end)
        a, e = start % x.dim(), end % x.dim()
        if a >= e:
            return x.flatten(start, end)
        shape = _flat_shape(x, a, e)
        try:
            return x.view(shape)  # flattened dimensions that are one run in memory
        except RuntimeError:
            return _Flatten.apply(x, shape, grads, key)
    return run


def _flat_shape(x: Tensor, a: int, e: int) -> tuple[int, ...]:
    """``x``'s shape with dimensions ``a`` to ``e`` (inclusive) made one, as ``torch.flatten``."""
    return (*x.shape[:a], math.prod(x.shape[a:e + 1]), *x.shape[e + 1:])


def _relu(params: dict[str, Tensor], x: Tensor, grads: GradBuffers | None) -> Tensor:
    return torch.relu(x)


def _identity(params: dict[str, Tensor], x: Tensor, grads: GradBuffers | None) -> Tensor:
    return x


def _module_kernel(prefix: str, mod: nn.Module) -> Kernel | None:
    kind = type(mod)  # exact types: a subclass may have a forward of its own
    if kind is nn.Linear:
        return _linear(prefix, mod)
    if kind is nn.Conv1d:
        return _conv1d(prefix, mod)
    if kind is nn.ReLU:
        return _relu
    if kind is nn.Flatten:
        return _flatten(mod.start_dim, mod.end_dim)
    if kind is nn.Unflatten and isinstance(mod.dim, int):
        dim, sizes = _node_dim(mod.dim), tuple(mod.unflattened_size)
        return lambda params, x, grads: x.unflatten(dim, sizes)
    if kind is nn.Identity:
        return _identity
    return None


_RELUS = (torch.relu, F.relu)


def _call_kernel(target: Any, args: tuple, kwargs: dict, method: bool) -> Kernel | None:
    """The kernel of a function or method call on the running tensor (``args[0]``);
    the other arguments are constants (checked by the caller)."""
    rest = args[1:]
    if (method and target == "relu") or (not method and target in _RELUS):
        if rest or set(kwargs) - {"inplace"}:
            return None
        return _relu
    if (method and target == "flatten") or (not method and target is torch.flatten):
        names = ("start_dim", "end_dim")
        if len(rest) > 2 or set(kwargs) - set(names):
            return None
        given = dict(zip(names, rest), **kwargs)
        if not all(isinstance(v, int) for v in given.values()):
            return None
        return _flatten(given.get("start_dim", 0), given.get("end_dim", -1))
    return None


def _has_node(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_node(v) for v in value)
    if isinstance(value, dict):
        return any(_has_node(v) for v in value.values())
    return False


def _node_kernel(node: torch.fx.Node, model: nn.Module) -> Kernel | None:
    """The batched kernel of one call of the traced chain, or None where there is none."""
    if node.op == "call_module":
        if node.kwargs or len(node.args) != 1:
            return None
        return _module_kernel(node.target + ".", model.get_submodule(node.target))
    if node.op in ("call_function", "call_method"):
        return _call_kernel(node.target, tuple(node.args), dict(node.kwargs), node.op == "call_method")
    return None  # get_attr: a parameter used outside a supported layer


def batched_forward(model: nn.Module) -> Callable[..., Tensor] | None:
    """``(params, x, grads=None) -> logits`` for n nodes at once, or None where the
    model holds a call this module has no batched kernel for.

    ``params``: ``{name: (n, *shape)}`` (every node's tensors, the names of
    ``model.named_parameters()``); ``x``: ``(n, B, ...)``, node i's batch in row i;
    ``grads``: a :class:`GradBuffers` whose kept tensors the backward writes the
    gradients into, or None (fresh tensors).
    The model must be a chain: one input, each call taking the previous result and
    constants. The result may raise :class:`Unsupported` on an input shape it does not
    cover (nothing computed yet at that point)."""
    if any(True for _ in model.buffers()):
        return None  # state outside the parameters: vmap's functional_call handles it
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - any model fx cannot trace keeps vmap
        return None
    program: list[Kernel] = []
    current = None  # the node whose value the next call must take
    done = False
    for node in graph.nodes:
        if done:
            return None
        if node.op == "placeholder":
            if current is not None:
                return None  # a second input
            current = node
            continue
        if node.op == "output":
            if node.args[0] is not current:
                return None
            done = True
            continue
        if current is None or not node.args or node.args[0] is not current \
                or _has_node(node.args[1:]) or _has_node(node.kwargs):
            return None
        kernel = _node_kernel(node, model)
        if kernel is None:
            return None
        if kernel is _relu and program and hasattr(program[-1], "with_relu"):
            # a linear layer's or a convolution's only user (the graph is a chain): fused into it, where the
            # output and its gradient are in cache, instead of two more passes over them
            program[-1] = program[-1].with_relu()
        else:
            program.append(kernel)
        current = node
    if not done or not program:
        return None

    def forward(params: dict[str, Tensor], x: Tensor, grads: GradBuffers | None = None) -> Tensor:
        for kernel in program:
            x = kernel(params, x, grads)
        return x
    return forward
