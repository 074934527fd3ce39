"""Wire format shared by every compressor: a fixed 32-byte header and a body.

Header, little-endian, one per payload row::

    offset size field
    0      2    magic b"GZ"
    2      1    format version (FORMAT_VERSION)
    3      1    compressor id (registry number, e.g. 3 = quant)
    4      4    parameter hash: CRC-32 of the canonical spec, e.g. "quant:bits=8"
    8      8    numel (int64)
    16     8    row key (int64), the only source of the row's randomness
    24     4    tag (uint32), chosen by the caller (e.g. the step counter)
    28     4    checksum (uint32) of every other 32-bit word of the payload

The body follows at offset 32 and is padded with zero bytes to a multiple of 8,
so rows of a batch stay 8-byte aligned and typed views (fp32 scales, int32
indices) need no copy.

Checksum: with ``w_j`` the payload's little-endian uint32 words, ``w_7`` (the
checksum itself) taken as 0, ``sum_j (2 j + 1) * w_j mod 2**32``. Any single
damaged byte changes exactly one word by ``delta * 256**p`` with
``0 < |delta| < 256``, which is non-zero modulo 2**32, and the odd weight keeps
it non-zero, so every single-byte error is detected; the position weights also
catch swapped words. It costs one multiply-add pass over the payload bytes
(about 1/4 of a pass over the fp32 input for 8-bit codes).
"""

from __future__ import annotations

from gossip.errors import PayloadError  # noqa: F401  (re-exported: gossip.compress.wire.PayloadError)

import zlib
from dataclasses import dataclass

import torch

from . import _kernels

__all__ = ["PayloadError", "HEADER_NBYTES", "FORMAT_VERSION", "MAGIC_WORD0", "Layout"]

HEADER_NBYTES = 32
FORMAT_VERSION = 5  # 2: quant's codes in planes, first rounding digits from hash24;
# 3: randk/randomk coordinates are the first k distinct of uniform draws (k <= d/2);
# 4: quant/qsgd/ternary's first rounding digits from the cheaper hash24 (one xorshift
# between the two multiplies, the top bits folded into the low ones);
# 5: sparseloco's values by default through the authors' statistical quantizer (codes,
# then per tensor the mean and the bin means), no longer one max scale per chunk
MAGIC = b"GZ"
#: the first header word every payload starts with, less its compressor id (``| cid << 24``)
MAGIC_WORD0 = MAGIC[0] | (MAGIC[1] << 8) | (FORMAT_VERSION << 16)  # + (id << 24)
_CHECK_WORD = 7


def params_hash(spec: str) -> int:
    return zlib.crc32(spec.encode("utf-8")) & 0xFFFFFFFF


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


_ITEMSIZE = {torch.uint8: 1, torch.float16: 2, torch.int16: 2, torch.float32: 4, torch.int32: 4}


@dataclass(frozen=True)
class Layout:
    """Body segments of one payload row, each aligned to its item size.

    ``segments`` is a tuple of (name, dtype, count); the body starts at byte 32.
    """

    segments: tuple

    @property
    def offsets(self) -> dict:
        """name -> (byte offset in the row, dtype, count)."""
        return self._placed()[0]

    def _placed(self):
        off = HEADER_NBYTES
        out = {}
        for name, dtype, count in self.segments:
            size = _ITEMSIZE[dtype]
            off = (off + size - 1) // size * size
            out[name] = (off, dtype, count)
            off += size * count
        return out, off

    @property
    def nbytes(self) -> int:
        """Bytes of one payload row: header, body, zero padding to a multiple of 8."""
        return _pad8(self._placed()[1])

    def gaps(self) -> list:
        """Byte ranges of the body that hold no segment (alignment and tail padding)."""
        res, pos = [], HEADER_NBYTES
        for off, dtype, count in self.offsets.values():
            if off > pos:
                res.append((pos, off))
            pos = off + _ITEMSIZE[dtype] * count
        if pos < self.nbytes:
            res.append((pos, self.nbytes))
        return res

    def views(self, P: torch.Tensor) -> dict:
        """Typed (m, count) views of each segment of the payload rows ``P``."""
        res = {}
        for name, (off, dtype, count) in self.offsets.items():
            size = _ITEMSIZE[dtype]
            v = P if dtype == torch.uint8 else P.view(dtype)
            res[name] = v[:, off // size: off // size + count]
        return res


def _weights(nwords: int, device) -> torch.Tensor:
    # 2j + 1 modulo 2**32, as int32 (int32 products wrap modulo 2**32)
    w = torch.arange(nwords, dtype=torch.int64, device=device).mul_(2).add_(1)
    w = ((w + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)
    w[_CHECK_WORD] = 0  # the checksum word does not check itself
    return w.to(torch.int32)


_WEIGHT_CACHE: dict = {}


def _cached(key: tuple, make) -> torch.Tensor:
    """``_WEIGHT_CACHE[key]``, made by ``make()`` on a miss (the cache is emptied past 16)."""
    w = _WEIGHT_CACHE.get(key)
    if w is None:
        if len(_WEIGHT_CACHE) > 16:
            _WEIGHT_CACHE.clear()
        w = _WEIGHT_CACHE[key] = make()
    return w


def _weights_cached(nwords: int, device) -> torch.Tensor:
    return _cached((nwords, str(device)), lambda: _weights(nwords, device))


def checksum_weights(nwords: int, device) -> torch.Tensor:
    """The checksum weights of payload rows of ``nwords`` int32 words on ``device``
    (cached per size and device), as ``checksum`` uses them."""
    return _weights_cached(nwords, device)


def _checksum_words(words: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # int32 products wrap modulo 2**32; the int64 row sum is then exact modulo 2**32
    return (words * w).sum(dim=1, dtype=torch.int64) & 0xFFFFFFFF


def checksum(P: torch.Tensor) -> torch.Tensor:
    """Checksum of each payload row (see module docstring): int64 (m,) in [0, 2**32)."""

    words = P.view(torch.int32)
    w = _weights_cached(words.shape[1], P.device)
    return _kernels.checksum(words, w)


def body_checksum(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The body's share of the checksums of payload rows whose body words (int32,
    the words past the header) are ``words`` (m, k): ``sum_j (2 j + 1) * w_j`` over
    those words only, modulo 2**32: int32 (m,) on the CPU (into ``out`` if given),
    int64 elsewhere. A row's checksum is this plus the header words' share, modulo
    2**32, so an encoder can take the body's share while the body it has just written
    is in cache; :func:`write_header` adds the rest."""
    w = _body_weights_cached(words.shape[1], words.device)
    if words.device.type == "cpu":
        return torch.mv(words, w, out=out)  # int32 products and sums wrap modulo 2**32
    return _kernels.checksum(words, w)


def _body_weights_cached(nwords: int, device) -> torch.Tensor:
    first = HEADER_NBYTES // 4
    return _cached(("body", nwords, str(device)), lambda: _weights(first + nwords, device)[first:])


def write_header(P: torch.Tensor, cid: int, phash: int, numel: int, keys: torch.Tensor, tag: int,
                 body: torch.Tensor | None = None) -> None:
    """Fill the 32-byte headers of ``P`` (body already written) and the checksums.
    ``body``: the rows' :func:`body_checksum`, where the encoder took it; the body is
    then not read again."""
    # the row-independent words in one small tensor: magic/version/id, hash, numel, tag
    w0 = MAGIC_WORD0 | (cid << 24) | (phash << 32)
    const = torch.tensor([w0 - (1 << 64) if w0 >= (1 << 63) else w0, numel, 0, tag], dtype=torch.int64)
    h = P.view(torch.int64)[:, :4]
    h.copy_(const.to(P.device).expand_as(h))
    h[:, 2] = keys.to(device=P.device, dtype=torch.int64)
    if body is None:
        c = checksum(P)
    else:
        first = HEADER_NBYTES // 4
        head = P.view(torch.int32)[:, :first].contiguous()
        c = (_kernels.checksum(head, _weights_cached(P.shape[1] // 4, P.device)[:first])
             + body.to(torch.int64)) & 0xFFFFFFFF
    P.view(torch.int32)[:, _CHECK_WORD] = (c - ((c >> 31) << 32)).to(torch.int32)


def header_fields(P: torch.Tensor) -> dict:
    """Decoded header fields of every row (int64 tensors of shape (m,)).

    ``P`` must be a contiguous (m, nbytes) uint8 tensor with nbytes % 8 == 0.
    """
    h = P.view(torch.int64)[:, :4]
    w0 = h[:, 0] & 0xFFFFFFFF
    return {
        "word0": w0,
        "magic": w0 & 0xFFFF,
        "version": (w0 >> 16) & 0xFF,
        "cid": (w0 >> 24) & 0xFF,
        "phash": (h[:, 0] >> 32) & 0xFFFFFFFF,
        "numel": h[:, 1],
        "key": h[:, 2],
        "tag": h[:, 3] & 0xFFFFFFFF,
        "checksum": (h[:, 3] >> 32) & 0xFFFFFFFF,
    }
