"""A user's model for the ``--fault-tolerance`` tests (``--model tests._ftmodel:mlp``).

While the file named by ``GOSSIP_TEST_SLOW`` exists, every training forward pass sleeps
0.25 s: the test slows the survivors down while a restarted worker rejoins, so that the
run cannot end before the rejoin however slow the machine is, and removes the file once
the rejoin is seen (an event, not a step count).
"""

from __future__ import annotations

import math
import os
import time

import torch
from torch import nn


class _SlowWhenAsked(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._flag = os.environ.get("GOSSIP_TEST_SLOW")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self._flag and os.path.exists(self._flag):
            time.sleep(0.25)
        return self.inner(x)


def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    d = math.prod(input_shape)
    return _SlowWhenAsked(nn.Sequential(nn.Flatten(), nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, num_classes)))
