"""Baselines: ``identity`` (the fp32 values) and ``fp16`` (round to nearest half precision)."""

from __future__ import annotations

from gossip.errors import NonFiniteError

import dataclasses

import torch

from .base import Compressor, Config
from .registry import register
from . import wire
from .wire import Layout

__all__ = ["Identity", "FP16"]

#: values per block of rows of identity's encoding of many rows on the CPU: a block's
#: copy (512 KiB of float32) is still in a core's L2 cache when it is summed and checksummed
_FUSED_VALUES = 1 << 17


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NoParams(Config):
    pass


@register
class Identity(Compressor):
    """No compression: the fp32 values as they are (unbiased, linear, omega = 0)."""

    name = "identity"
    cid = 1
    description = "no compression: the fp32 values (unbiased, linear)"
    unbiased = True
    linear = True
    contractive = True
    Config = dataclasses.make_dataclass("IdentityConfig", [], bases=(_NoParams,), frozen=True, kw_only=True)

    def omega(self, numel: int) -> float:
        return 0.0

    def delta(self, numel: int) -> float:
        return 1.0

    def layout(self, numel: int) -> Layout:
        return Layout((("values", torch.float32, numel),))

    def ideal_nbytes(self, numel: int) -> float:
        return 4.0 * self._check_numel(numel)

    def code_bits(self, numel: int) -> float:
        return 32.0  # the values as they are

    def _encode(self, X, keys, v):
        m, d = X.shape
        if X.device.type != "cpu" or m < 2 or m * d <= _FUSED_VALUES or X.dtype != torch.float32:
            self._check_finite(X)
            v["values"].copy_(X)
            return None
        # Many rows on the CPU (the simulation): a block of rows at a time, the copy,
        # then the finiteness statistic and the checksum's body share read from the
        # copy while it is in cache (1 pass over the (m, d) values through memory, not 3)
        vals = v["values"]
        words = vals.view(torch.int32)
        stat = X.new_empty(m)
        body = torch.empty(m, dtype=torch.int32)
        rows = max(1, _FUSED_VALUES // d)
        for x, block, w, st, c in zip(X.split(rows), vals.split(rows), words.split(rows), stat.split(rows),
                                      body.split(rows)):
            block.copy_(x)
            torch.sum(block, 1, out=st)
            wire.body_checksum(w, out=c)
        self._check_finite(X, stat)
        return body

    def _decode(self, v, numel, keys):
        return v["values"].clone()

    def _decode_into(self, v, numel, keys, out):
        out.copy_(v["values"])

    def _decode_shared(self, v, numel):
        return v["values"]


@register
class FP16(Compressor):
    """Round to nearest fp16. Biased (deterministic rounding) and declared not linear:
    summing fp16 bodies rounds every partial sum to fp16 and can overflow, so an
    all-reduce of the bodies is not the sum of the decoded values. Not declared a
    contraction either: a vector of values below half the smallest fp16 subnormal
    rounds to zero, ``||C(x) - x|| = ||x||``, so no ``delta > 0`` holds for every x."""

    name = "fp16"
    cid = 2
    description = "values rounded to fp16 (biased: round to nearest; not linear: fp16 sums round)"
    unbiased = False
    linear = False
    Config = dataclasses.make_dataclass("FP16Config", [], bases=(_NoParams,), frozen=True, kw_only=True)

    def layout(self, numel: int) -> Layout:
        return Layout((("values", torch.float16, numel),))

    def ideal_nbytes(self, numel: int) -> float:
        return 2.0 * self._check_numel(numel)

    def code_bits(self, numel: int) -> float:
        return 16.0  # half precision

    def _encode(self, X, keys, v):
        self._check_finite(X)
        h = X.to(torch.float16)
        if not bool(torch.isfinite(h).all()):
            r = int((~torch.isfinite(h).all(dim=1)).nonzero()[0, 0])
            raise NonFiniteError(f"fp16.encode: row {r} has values beyond the fp16 range (|x| > 65504)")
        v["values"].copy_(h)

    def _decode(self, v, numel, keys):
        return v["values"].to(torch.float32)
