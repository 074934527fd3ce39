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

Muon is refused, in one line, for a model with no 2-D parameter (nothing for it to
orthogonalise). Tensors of more than two dimensions (convolutions) go to AdamW, as
``torch.optim.Muon`` takes only matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from gossip.algorithms.localsgd import DiLoCo, DiLoCoConfig

__all__ = ["MuLoCo", "MuLoCoConfig", "MuonAdamW", "muon_optimizer"]


@dataclass(frozen=True, kw_only=True)
class MuLoCoConfig(DiLoCoConfig):
    """DiLoCo's options; ``compressor`` ``quant:bits=4`` with ``error_feedback`` by default."""

    compressor: str = "quant:bits=4"
    error_feedback: bool = True


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the 2-D parameters, AdamW on the others, as one optimizer.

    ``param_groups`` is the Muon groups followed by the AdamW group, so a scheduler (or
    :class:`gossip.runtime.GossipOptimizer`, which reads ``param_groups[0]["lr"]``)
    reaches both; ``state_dict`` holds both optimizers' states.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float = 1e-3, weight_decay: float = 0.0,
                 momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        params = [p for p in params if p.requires_grad]
        mats = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() != 2]
        if not mats:
            shapes = sorted({tuple(p.shape) for p in params})
            raise ValueError(
                f"muon: the model has no 2-D parameter (shapes {shapes}), and Muon orthogonalises weight "
                f"matrices; use --optimizer adamw (or sgd)"
            )
        self.muon = torch.optim.Muon(mats, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay) if rest else None
        super().__init__(params, {"lr": lr})
        self.param_groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        if self.adamw is not None:
            self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(f"MuonAdamW: a state dict has keys 'muon' and 'adamw', got {sorted(state_dict)}")
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])


def muon_optimizer(model: torch.nn.Module, *, lr: float = 1e-3, weight_decay: float = 0.0,
                   momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.999)) -> MuonAdamW:
    """MuLoCo's inner optimizer for ``model``: :class:`MuonAdamW` over its parameters."""
    return MuonAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, momentum=momentum, betas=betas)


class MuLoCo(DiLoCo):
    """MuLoCo: DiLoCo's outer step over H inner Muon steps, compressed error-fed pseudo-gradients."""

    fault_tolerant = False  # its default exchange is compressed with error feedback

    name = "muloco"
    Config = MuLoCoConfig
    summary = "MuLoCo: H inner Muon steps, 4-bit error-fed pseudo-gradients, DiLoCo's outer Nesterov step"
    local_optimizer_default = "muon"
