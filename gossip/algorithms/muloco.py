"""MuLoCo (Thérien, Huang, Rish, Belilovsky 2025, "MuLoCo: Muon is a practical inner
optimizer for DiLoCo", arXiv:2505.23725).

DiLoCo whose inner optimizer is Muon (``torch.optim.Muon``: momentum, then the update
of every weight matrix orthogonalised by Newton-Schulz iterations) and whose
pseudo-gradients are compressed with error feedback. The outer step and the exchange
are DiLoCo's (:class:`gossip.algorithms.localsgd.DiLoCo`): per round

1. H inner Muon steps (:func:`muon_optimizer`: Muon on the 2-D weights, AdamW on the
   rest, one learning rate: Muon's is matched to AdamW's update RMS,
   ``adjust_lr_fn="match_rms_adamw"``);
2. Delta_i = theta - x_i, sent as C(Delta_i + e_i), e_i <- what C dropped
   (``compressor`` ``quant:bits=4`` and ``error_feedback`` on by default: 8x fewer bytes
   than DiLoCo's fp32 pseudo-gradient, the paper's headline);
3. outer Nesterov SGD on the mean of the decoded messages.

DiLoCo's options carry over, ``outer_delay=1`` included: the eager overlapped outer
step (Kale et al. 2025, arXiv:2502.12996) changes only the outer step, which MuLoCo
takes from DiLoCo unchanged, whatever the inner optimizer.

Muon is refused, in one line, for a model with no 2-D parameter (nothing for it to
orthogonalise). Tensors of more than two dimensions (convolutions) go to AdamW, as
``torch.optim.Muon`` takes only matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from gossip.algorithms.localsgd import DiLoCo, DiLoCoConfig

__all__ = ["MUON_PRECISIONS", "MuLoCo", "MuLoCoConfig", "MuonAdamW", "muon_optimizer", "newton_schulz"]

#: --muon-precision: the dtype of Muon's Newton-Schulz iterations. ``auto`` is
#: bfloat16 (torch.optim.Muon's own, and the Muon reference's) on a GPU; on a CPU the
#: parameters' dtype, at least float32 (float64 for a float64 model), since there bfloat16 matrix products are emulated: about 11x slower than float32 on an
#: AVX2 CPU for a 128 x 640 weight, which would charge MuLoCo for arithmetic no real
#: deployment pays
MUON_PRECISIONS = ("auto", "bfloat16", "float32", "float64")


@dataclass(frozen=True, kw_only=True)
class MuLoCoConfig(DiLoCoConfig):
    """DiLoCo's options; ``compressor`` ``quant:bits=4`` with ``error_feedback`` by default."""

    compressor: str = "quant:bits=4"
    error_feedback: bool = True


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's orthogonalisation of ``g`` (a matrix, or a stack ``(..., A, B)`` of them,
    each on its own): scaled to Frobenius norm 1, then ``steps`` quintic Newton-Schulz
    iterations ``X <- a X + (b G + c G^2) X`` with ``G = X X^T`` on the wide
    orientation, computed in ``dtype``. In bfloat16 on a matrix it is the arithmetic of
    ``torch.optim.Muon`` (Jordan et al.'s Muon), operation for operation."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm() if x.dim() == 2 else torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)).clamp(min=eps)
    for _ in range(steps):
        if x.dim() == 2:
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            gram = x @ x.mT
            x = torch.baddbmm(x.flatten(0, -3), torch.baddbmm(gram.flatten(0, -3), gram.flatten(0, -3),
                                                             gram.flatten(0, -3), beta=b, alpha=c),
                              x.flatten(0, -3), beta=a).view(x.shape)
    return x.mT if tall else x


def _resolve_precision(precision: str, like: torch.Tensor | None) -> torch.dtype:
    """The Newton-Schulz dtype: ``auto`` is bfloat16 on a GPU, and on a CPU the
    parameters' own dtype, at least float32."""
    if precision not in MUON_PRECISIONS:
        raise ValueError(f"muon: precision must be one of {', '.join(MUON_PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        if like is not None and like.device.type == "cuda":
            return torch.bfloat16
        return torch.float64 if like is not None and like.dtype == torch.float64 else torch.float32
    return getattr(torch, precision)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the 2-D parameters, AdamW on the others, as one optimizer.

    ``param_groups`` is the Muon groups followed by the AdamW group, so a scheduler (or
    :class:`gossip.runtime.GossipOptimizer`, which reads ``param_groups[0]["lr"]``)
    reaches both; ``state_dict`` holds both optimizers' states and the Newton-Schulz
    dtype.

    ``precision`` (:data:`MUON_PRECISIONS`) is the dtype of the Newton-Schulz
    iterations; ``auto`` takes bfloat16 on a GPU and on a CPU the parameters' dtype, at
    least float32. In bfloat16 the
    step is ``torch.optim.Muon``'s own; in float32 it is the same update (momentum,
    Nesterov, orthogonalisation, learning rate adjusted by ``match_rms_adamw``,
    decoupled weight decay) with the iterations in that dtype (:func:`newton_schulz`).
    A state dict saved before the dtype was recorded continues in bfloat16, as it was
    made.

    ``stacked=True`` takes the vectorized simulation's stacked tensors, ``(nodes,
    *shape)``: Muon on the stacks of matrices, each node's orthogonalised on its own (one
    batched Newton-Schulz iteration for all nodes), AdamW (element-wise) on the rest.
    Its state is the stack of the per-node optimizers' states
    (:func:`gossip.vectorized.split_optimizer_state` cuts it).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float = 1e-3, weight_decay: float = 0.0,
                 momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.999), precision: str = "auto",
                 stacked: bool = False) -> None:
        params = [p for p in params if p.requires_grad]
        lead = 1 if stacked else 0  # stacked: every tensor is (nodes, *its shape), each node's on its own
        mats = [p for p in params if p.dim() == 2 + lead]
        rest = [p for p in params if p.dim() != 2 + lead]
        if not mats:
            shapes = sorted({tuple(p.shape[lead:]) for p in params})
            raise ValueError(
                f"muon: the model has no 2-D parameter (shapes {shapes}), and Muon orthogonalises weight "
                f"matrices; use --optimizer adamw (or sgd)"
            )
        self.stacked = stacked
        self.ns_dtype = _resolve_precision(precision, mats[0])
        options = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw")
        if stacked:
            # torch.optim.Muon's groups, defaults and state (so each node's share is what its
            # own torch.optim.Muon holds), over stacks of matrices, which its constructor
            # refuses; :meth:`_muon_step` steps them
            defaults = torch.optim.Muon([torch.nn.Parameter(torch.zeros(1, 1))], **options).defaults
            self.muon = torch.optim.Muon.__new__(torch.optim.Muon)
            torch.optim.Optimizer.__init__(self.muon, mats, defaults)
        else:
            self.muon = torch.optim.Muon(mats, **options)
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay) if rest else None
        super().__init__(params, {"lr": lr})
        self.param_groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.ns_dtype == torch.bfloat16 and not self.stacked:
            self.muon.step()
        else:
            self._muon_step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    @torch.no_grad()
    def _muon_step(self) -> None:
        """``torch.optim.Muon``'s step on its own groups and state, with the
        Newton-Schulz iterations in ``self.ns_dtype``."""
        for group in self.muon.param_groups:
            lr, wd, mom = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.muon.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mom)
                update = grad.lerp(buf, mom) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                rows, cols = p.shape[-2:]
                fn = group["adjust_lr_fn"]
                ratio = (0.2 * math.sqrt(max(rows, cols)) if fn == "match_rms_adamw"
                         else math.sqrt(max(1, rows / cols)) if fn in (None, "original") else 1.0)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * ratio)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        if self.adamw is not None:
            self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None,
                "ns_dtype": str(self.ns_dtype).removeprefix("torch.")}

    def load_state_dict(self, state_dict: dict) -> None:
        if not {"muon", "adamw"} <= set(state_dict) <= {"muon", "adamw", "ns_dtype"}:
            raise ValueError(f"MuonAdamW: a state dict has keys 'muon' and 'adamw' (and 'ns_dtype'), "
                             f"got {sorted(state_dict)}")
        # saved before the dtype was recorded: torch.optim.Muon's bfloat16 made it
        self.ns_dtype = _resolve_precision(state_dict.get("ns_dtype", "bfloat16"), None)
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])


def muon_optimizer(model: torch.nn.Module, *, lr: float = 1e-3, weight_decay: float = 0.0,
                   momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.999),
                   precision: str = "auto") -> MuonAdamW:
    """MuLoCo's inner optimizer for ``model``: :class:`MuonAdamW` over its parameters.
    (The vectorized simulation builds one over all nodes' stacked tensors,
    ``MuonAdamW(leaves, stacked=True)``: each node's matrices are orthogonalised on
    their own, in one batched iteration.)"""
    return MuonAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, momentum=momentum, betas=betas,
                     precision=precision)


class MuLoCo(DiLoCo):
    """MuLoCo: DiLoCo's outer step over H inner Muon steps, compressed error-fed pseudo-gradients."""

    fault_tolerant = False  # its default exchange is compressed with error feedback

    name = "muloco"
    Config = MuLoCoConfig
    summary = "MuLoCo: H inner Muon steps, 4-bit error-fed pseudo-gradients, DiLoCo's outer Nesterov step"
    local_optimizer_default = "muon"
