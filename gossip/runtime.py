"""Glue between a user's models and optimizers and an algorithm.

:class:`FlatParams` makes every hosted model's parameters views into one flat
``(m, d)`` buffer, so the algorithms see one row per node and one message per
neighbour per step; its :class:`~gossip.algorithms.ParamLayout` says which tensor
lies where. :class:`GossipOptimizer` wraps the user's local optimizer(s):

.. code-block:: python

    algo = gossip.algorithms.build("ecd", comm, compressor="quant:bits=8")
    opt = GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), algo)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

In the in-process simulation pass one model and one optimizer per hosted node.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from gossip.algorithms.base import Algorithm, ParamLayout

__all__ = ["FlatParams", "GossipOptimizer"]


class FlatParams:
    """One contiguous ``(m, d)`` buffer holding the parameters of ``m`` identical models.

    After construction each model parameter is a view into its row, so in-place
    updates by any optimizer land in the buffer and writes to the buffer are seen by
    the models. ``layout`` names every tensor with its shape and offset, in
    ``parameters()`` order; ``shapes`` and ``blocks`` ((offset, numel) of each tensor)
    are its views.
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        if not models:
            raise ValueError("FlatParams needs at least one model")
        self.layout = ParamLayout.from_models(list(models))  # checks that the models agree
        plists = [[p for p in mdl.parameters()] for mdl in models]
        dtypes = {p.dtype for pl in plists for p in pl}
        devices = {p.device for pl in plists for p in pl}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all parameters must share one dtype and device, got {sorted(map(str, dtypes))} "
                f"on {sorted(map(str, devices))}"
            )
        self.dim = self.layout.dim
        (dtype,), (device,) = dtypes, devices
        self.data = torch.empty(len(models), self.dim, dtype=dtype, device=device)
        self._params = plists
        with torch.no_grad():
            for r, pl in enumerate(plists):
                for p, (o, n) in zip(pl, self.blocks):
                    self.data[r, o : o + n].copy_(p.detach().reshape(-1))
                    p.data = self.data[r, o : o + n].view(p.shape)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return list(self.layout.shapes)

    @property
    def blocks(self) -> list[tuple[int, int]]:
        return list(self.layout.blocks)

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


class GossipOptimizer:
    """Runs the local optimizer(s), then the algorithm's communication step.

    Construction builds the :class:`FlatParams` of the models, hands the algorithm
    ``setup(x_1, layout)`` and ``attach(models)``. It refuses, with one line, a local
    optimizer with momentum when the algorithm owns momentum
    (``algorithm.owns_momentum``: PowerSGD, efblocksgdm, signum, efmomentum, Sketched-SGD,
    efsgd with momentum): the two would compound. Give the local optimizer
    ``momentum=0`` or set the algorithm's own ``momentum``.

    Every :meth:`step` first tells the algorithm the step size of the local optimizer's
    first param group (``set_lr``), so learning-rate schedulers reach the algorithms
    that rescale their error memories by it, and ends with ``on_step_end(step)``.
    """

    def __init__(
        self,
        models: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        algorithm: Algorithm,
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
        _check_one_momentum(algorithm, optimizers)
        self.models = models
        self.optimizers = optimizers
        self.algorithm = algorithm
        self.flat = FlatParams(models)
        self.steps = 0
        with algorithm.comm.ledger.setup():  # x_1 exchanges are one-off, not step traffic
            algorithm.setup(self.flat.data, self.flat.layout)
        algorithm.attach(models)  # schedulers that work during backward (MergeComp)

    @property
    def layout(self) -> ParamLayout:
        return self.flat.layout

    @property
    def comm(self) -> Any:
        return self.algorithm.comm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        algo = self.algorithm
        algo.set_lr(float(self.optimizers[0].param_groups[0]["lr"]))
        if algo.acts_on == "gradient":
            G = self.flat.gather_grads()
            algo.reduce_gradients(G)
            self.flat.scatter_grads(G)
            for opt in self.optimizers:
                opt.step()
        else:
            X = self.flat.data
            with torch.no_grad():
                x_t = X.clone()
                for opt in self.optimizers:
                    opt.step()
                U = X - x_t
                X.copy_(x_t)
                algo.step(X, U)
        self.steps += 1
        algo.on_step_end(self.steps)

    # --- views for evaluation --------------------------------------------------------
    @torch.no_grad()
    def average(self) -> torch.Tensor:
        """xbar, the average of all n nodes' parameters (shape (d,)); a collective."""
        return self.comm.all_reduce(self.flat.data, op="mean", record=False)[0]

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """mean_i ||x_i - xbar||^2 over all n nodes; a collective."""
        X = self.flat.data
        xbar = self.comm.all_reduce(X, op="mean", record=False)
        dist = ((X - xbar) ** 2).sum(dim=1, keepdim=True).to(torch.float64)
        return float(self.comm.all_reduce(dist, op="mean", record=False)[0, 0])

    def state_dict(self) -> dict:
        return {
            "params": self.flat.data.detach().clone(),
            "algorithm": self.algorithm.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
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


def _check_one_momentum(algorithm: Algorithm, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """One line when the algorithm owns momentum and a local optimizer has some too."""
    if not algorithm.owns_momentum:
        return
    for opt in optimizers:
        for g in opt.param_groups:
            mu = g.get("momentum", 0.0)
            betas = g.get("betas")
            if mu:
                what = f"momentum={mu:g}"
            elif betas is not None and betas[0]:  # Adam and alike: beta1 is a momentum
                what = f"betas[0]={betas[0]:g}"
            else:
                continue
            raise ValueError(
                f"{algorithm.name} applies its own momentum and the local "
                f"{type(opt).__name__} has {what}: they would compound; give the local optimizer "
                f"momentum=0, and set the algorithm's momentum option instead"
            )
