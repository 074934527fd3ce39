"""The shape every algorithm has: a frozen Config, a State, and a step.

Two kinds of algorithm exist, told apart by :attr:`Algorithm.acts_on`:

``"model"``
    Decentralized algorithms (D-PSGD, DCD-PSGD, ECD-PSGD, naive compression). The
    local optimizer first takes its step from ``x_t`` using the local gradient; the
    difference is the local update ``u_t`` (``-gamma * g_t`` for plain SGD). The
    algorithm then replaces ``x_t`` by the paper's ``x_{t+1}``, in which ``u_t`` stands
    for ``-gamma * g_t``: ``step(X, U)``.
``"gradient"``
    Centralized algorithms (all-reduce SGD and, later, the compressed all-reduce
    family). They rewrite the gradient before the local optimizer steps:
    ``reduce_gradients(G)``.

Tensors are batched over the nodes a process hosts (see docs/internals.md): ``X``,
``U`` and ``G`` have shape ``(m, d)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

__all__ = ["Algorithm"]


class Algorithm:
    """Base class: holds the config, the communicator and the State."""

    name: ClassVar[str] = ""
    acts_on: ClassVar[str] = "model"
    #: one-line description shown by ``gossip.algorithms.available()``
    summary: ClassVar[str] = ""
    #: momentum of the CLI's local SGD optimizer when ``--momentum`` is unset and the
    #: algorithm has no momentum of its own
    local_momentum_default: ClassVar[float] = 0.9

    def __init__(self, config: Any, comm: Any) -> None:
        self.config = config
        self.comm = comm
        self.state: Any = None

    # --- lifecycle -----------------------------------------------------------------
    def setup(self, X: torch.Tensor) -> None:
        """Initialise the State from the starting point ``x_1`` (shape ``(m, d)``)."""
        raise NotImplementedError

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        """Model algorithms: turn ``x_t`` (updated in place) into ``x_{t+1}``."""
        raise NotImplementedError(f"{self.name} acts on gradients, not on models")

    def reduce_gradients(self, G: torch.Tensor) -> None:
        """Gradient algorithms: rewrite ``G`` in place before the local optimizer."""
        raise NotImplementedError(f"{self.name} acts on models, not on gradients")

    @property
    def payload_compressor(self) -> Any:
        """The compressor whose payloads go on the wire each step (None if none)."""
        return None

    # TEMP stubs of the contract (replaced by the contract's own base class)
    def set_lr(self, lr): pass
    def on_epoch_end(self, epoch): pass
    def set_event_sink(self, fn): self._sink = fn
    def report(self): return getattr(self, "_report", lambda: None)()
    def attach(self, models): pass
    def wire_format(self):
        from types import SimpleNamespace as NS
        c = self.payload_compressor
        label, bits = (c.spec, 8.0) if c is not None and c.spec != "identity" else ("fp32", 32.0)
        return NS(label=label, bits_per_coord=bits, to_dict=lambda: {"label": label, "bits_per_coord": bits})

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
