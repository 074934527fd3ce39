"""Compressors for communication-efficient training: quantizers, sparsifiers, sign methods.

Every compressor has the batched core ``encode(X, keys, tag) -> P`` /
``decode(P, numel, tag) -> X`` and the single-tensor ``compress(x, generator)`` /
``decompress(payload)``; see docs/compress.md.
"""

from ._kernels import set_backend
from .base import Compressor, Config
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .registry import available, build, register
from gossip.errors import NonFiniteError, PayloadError

from .wire import HEADER_NBYTES

__all__ = [
    "Compressor",
    "Config",
    "PayloadError",
    "NonFiniteError",
    "HEADER_NBYTES",
    "available",
    "build",
    "register",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
    "set_backend",
]
