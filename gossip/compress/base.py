"""The Compressor base class: validation, header, checksum, batched and single APIs.

A compressor subclass supplies its frozen ``Config``, its body ``layout(numel)``,
``ideal_nbytes(numel)``, ``_encode(X, keys, views)`` (fill the body views; it may
return the body's :func:`gossip.compress.wire.body_checksum`, taken as it wrote) and
``_decode(views, numel, keys)`` (rebuild ``X``). Everything else, the
header, the checks, the single-tensor convenience API, lives here once.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from gossip.errors import NonFiniteError, PayloadError

from . import wire
from .wire import HEADER_NBYTES, Layout

#: compressor id -> name, filled by ``registry.register`` (kept here, not in the
#: registry, so that this module never imports the registry: no import cycle)
NAMES_BY_ID: dict[int, str] = {}


def name_of_id(cid: int) -> str:
    return NAMES_BY_ID.get(int(cid), "unknown")

__all__ = ["Compressor", "Config"]

_U32 = 1 << 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Base of the compressors' frozen, validated parameter sets."""

    def _fail(self, name: str, rule: str) -> None:
        raise ValueError(f"{_owner_name(self)}: parameter `{name}` {rule}, got {getattr(self, name)!r}")


def _owner_name(cfg) -> str:
    return getattr(type(cfg), "_compressor_name", type(cfg).__name__)


def _fmt(v) -> str:
    if isinstance(v, tuple):
        return "/".join(str(int(e)) for e in v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


class Compressor:
    """Base class; see docs/compress.md and docs/internals.md for the contract."""

    name: ClassVar[str]
    cid: ClassVar[int]
    description: ClassVar[str]
    unbiased: ClassVar[bool]
    linear: ClassVar[bool]
    #: True where the compressor is a delta-contraction for some delta > 0 (see :meth:`delta`)
    contractive: ClassVar[bool] = False
    Config: ClassVar[type]

    def __init__(self, config: Config | None = None, **params):
        if config is not None and params:
            raise ValueError(f"{self.name}: give either a config or parameters, not both")
        if config is None:
            config = self.Config(**params)
        elif not isinstance(config, self.Config):
            raise TypeError(f"{self.name}: config must be a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config
        self._phash = wire.params_hash(self.spec)
        w0 = wire.MAGIC_WORD0 | (self.cid << 24) | (self._phash << 32)
        self._word0 = w0 - (1 << 64) if w0 >= (1 << 63) else w0  # header bytes 0..7 as int64
        self._layouts: dict = {}

    # ---- description -------------------------------------------------------------
    @property
    def spec(self) -> str:
        """Canonical spec string; ``build(c.spec)`` gives an equal compressor."""
        parts = []
        for f in dataclasses.fields(self.config):
            v = getattr(self.config, f.name)
            if v is not None:
                parts.append(f"{f.name}={_fmt(v)}")
        return self.name + (":" + ",".join(parts) if parts else "")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec!r}>"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config == other.config

    def __hash__(self) -> int:
        return hash((type(self), self.config))

    # ---- sizes ---------------------------------------------------------------------
    def layout(self, numel: int) -> Layout:
        raise NotImplementedError

    def payload_nbytes(self, numel: int) -> int:
        """Exact bytes of one payload for ``numel`` elements, header included."""
        return self._layout(self._check_numel(numel)).nbytes

    def _layout(self, numel: int) -> Layout:
        lay = self._layouts.get(numel)
        if lay is None:
            if len(self._layouts) > 64:
                self._layouts.clear()
            lay = self._layouts[numel] = self.layout(numel)
        return lay

    def ideal_nbytes(self, numel: int) -> float:
        """Code bits plus scales for ``numel`` elements, in bytes; no header, no padding."""
        raise NotImplementedError

    def code_bits(self, numel: int) -> float:
        """Nominal code bits per value on ``numel`` values, side information (scales,
        headers) left out: what an algorithm's ``wire_format`` reports. By default the
        ideal size (codes and indices) per value; a compressor with a fixed code width
        (fp32, fp16, signs, a b-bit quantizer) says so by overriding this."""
        d = max(1, int(numel))
        return round(8.0 * self.ideal_nbytes(d) / d, 4)

    # ---- error guarantees (what CHOCO-SGD and the unbiased-only algorithms check) -------
    def omega(self, numel: int) -> float | None:
        """Variance factor of an unbiased compressor: ``E||C(x) - x||^2 <= omega ||x||^2``
        for every ``x`` of ``numel`` values; None where the compressor is not unbiased."""
        return None

    def delta(self, numel: int) -> float | None:
        """Contraction factor: ``E||C(x) - x||^2 <= (1 - delta) ||x||^2`` for every ``x``
        of ``numel`` values, ``0 < delta <= 1``; None where ``contractive`` is False."""
        return None

    def _check_numel(self, numel) -> int:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"{self.name}: numel must be a positive int, got {numel!r}")
        return numel

    # ---- batched core ----------------------------------------------------------------
    def encode(self, X: torch.Tensor, keys: torch.Tensor, tag: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode each row of ``X`` (m, d) with its int64 key into payload rows (m, nbytes) uint8.

        ``out``: a contiguous uint8 tensor (m, nbytes) to write the payloads into (a
        buffer reused across steps: no allocation, no page faults); it is returned.
        """
        X = self._check_input(X)
        m, d = X.shape
        keys = self._check_keys(keys, m, X.device)
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < _U32:
            raise ValueError(f"{self.name}.encode: tag must be an int in [0, 2**32), got {tag!r}")
        layout = self._layout(self._check_numel(d))
        if out is None:
            P = torch.empty(m, layout.nbytes, dtype=torch.uint8, device=X.device)
        else:
            P = _check_out(self.name + ".encode", out, (m, layout.nbytes), torch.uint8, X.device)
        for a, b in layout.gaps():  # zero padding so the checksum is well defined
            P[:, a:b] = 0
        if m:
            body = self._encode(X, keys, layout.views(P))
            wire.write_header(P, self.cid, self._phash, d, keys, tag, body=body)
        return P

    def decode(self, P: torch.Tensor, numel: int, tag: int | None = None,
               out: torch.Tensor | None = None, *, share: bool = False, intact: bool = False) -> torch.Tensor:
        """Decode payload rows (m, nbytes) uint8 into (m, numel) float32; raises PayloadError.

        ``out``: a contiguous float32 tensor (m, numel) to write the values into (a buffer
        reused across steps); it is returned. Without it the result is a new tensor.
        ``share=True``: where the payload holds the values as they are (``identity``), the
        result is a read-only-by-convention view into ``P`` instead (nothing is copied;
        valid while ``P`` is unchanged) and ``out`` is left alone; other compressors
        decode as without it.
        ``intact=True``: the caller vouches that ``P`` is the very tensor this process's
        ``encode`` wrote, unmodified since (the simulation's own payloads, whose version
        counter has not moved): the checksums, which detect damage between an encoder
        and a decoder, are not recomputed; every other header field is still checked.
        """
        P, numel = self._decode_args(P, numel, tag)
        m = P.shape[0]
        if out is not None:
            out = _check_out(self.name + ".decode", out, (m, numel), torch.float32, P.device)
        if m == 0:
            return torch.empty(0, numel, dtype=torch.float32, device=P.device) if out is None else out
        layout = self._layout(numel)
        expected = layout.nbytes
        if P.shape[1] < HEADER_NBYTES or P.shape[1] % 8:
            raise PayloadError(0, "size", f"expected {expected} bytes for numel={numel}, got {P.shape[1]}")
        h = P.view(torch.int64)[:, :4]
        if P.shape[1] == expected:
            # fast path: every field of every row in one combined test
            ok = (h[:, 0] == self._word0) & (h[:, 1] == numel)
            if tag is not None:
                ok &= (h[:, 3] & 0xFFFFFFFF) == tag
            if not intact:
                c = wire.checksum(P)
                ok &= c == ((h[:, 3] >> 32) & 0xFFFFFFFF)
            if bool(ok.all()):
                if share:
                    S = self._decode_shared(layout.views(P), numel)
                    if S is not None:
                        return S
                if out is None:
                    return self._decode(layout.views(P), numel, h[:, 2])
                self._decode_into(layout.views(P), numel, h[:, 2], out)
                return out
        self._refuse(P, numel, tag, expected)  # something is wrong: say what

    def _decode_args(self, P: torch.Tensor, numel: int, tag: int | None) -> tuple[torch.Tensor, int]:
        """``decode``'s arguments checked; the payloads contiguous and 8-byte aligned."""
        if not isinstance(P, torch.Tensor) or P.dtype != torch.uint8 or P.dim() != 2:
            raise ValueError(
                f"{self.name}.decode: payloads must be a 2-D uint8 tensor (m, nbytes), got "
                + (f"{P.dtype} of shape {tuple(P.shape)}" if isinstance(P, torch.Tensor) else type(P).__name__)
            )
        numel = self._check_numel(numel)
        if tag is not None and (isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < _U32):
            raise ValueError(f"{self.name}.decode: tag must be None or an int in [0, 2**32), got {tag!r}")
        P = P.contiguous()
        if P.storage_offset() % 8:  # header fields are read through an int64 view
            P = P.clone()
        return P, numel

    def _refuse(self, P: torch.Tensor, numel: int, tag: int | None, expected: int) -> None:
        """Raise the PayloadError of the first failing check, in a fixed order."""
        f = wire.header_fields(P)
        self._check_header(f, expected_numel=numel)
        if P.shape[1] != expected:
            raise PayloadError(0, "size", f"expected {expected} bytes for numel={numel} ({self.spec}), got {P.shape[1]}")
        if tag is not None:
            _first_bad(f["tag"] != tag, "tag", lambda r: f"expected {tag}, got {int(f['tag'][r])}")
        c = wire.checksum(P)
        _first_bad(
            c != f["checksum"], "checksum",
            lambda r: f"stored 0x{int(f['checksum'][r]):08x}, computed 0x{int(c[r]):08x} (damaged payload)",
        )
        raise AssertionError("unreachable: a check failed but none reported")  # pragma: no cover

    def _decode_shared(self, views: dict, numel: int) -> torch.Tensor | None:
        """The decoded values as a view of the payload, where the body holds them as
        they are (fp32); None (the default) where decoding has work to do."""
        return None

    def _decode(self, views: dict, numel: int, keys: torch.Tensor) -> torch.Tensor:
        """Decode into a new (m, numel) float32 tensor. A compressor overrides this or
        :meth:`_decode_into` (each default calls the other): the one that writes into a
        given tensor where it can."""
        v0 = next(iter(views.values()))
        out = torch.empty(v0.shape[0], numel, dtype=torch.float32, device=v0.device)
        self._decode_into(views, numel, keys, out)
        return out

    def _decode_into(self, views: dict, numel: int, keys: torch.Tensor, out: torch.Tensor) -> None:
        """Decode into ``out`` (m, numel) float32; compressors with a faster way override this."""
        out.copy_(self._decode(views, numel, keys))

    def _check_header(self, h: dict, expected_numel: int | None) -> None:
        word0 = wire.MAGIC_WORD0 | (self.cid << 24)
        ok = (h["word0"] == word0) & (h["phash"] == self._phash)
        if expected_numel is not None:
            ok &= h["numel"] == expected_numel
        if bool(ok.all()):  # the common case: one check for all rows and fields
            return
        _first_bad(h["magic"] != (wire.MAGIC[0] | (wire.MAGIC[1] << 8)), "format",
                   lambda r: "not a gossip.compress payload (bad magic bytes)")
        _first_bad(h["version"] != wire.FORMAT_VERSION, "format version",
                   lambda r: f"expected {wire.FORMAT_VERSION}, got {int(h['version'][r])}")
        _first_bad(h["cid"] != self.cid, "compressor",
                   lambda r: f"expected {self.name!r} (id {self.cid}), got {name_of_id(int(h['cid'][r]))!r} (id {int(h['cid'][r])})")
        _first_bad(h["phash"] != self._phash, "parameters",
                   lambda r: f"expected {self.spec!r} (hash 0x{self._phash:08x}), got hash 0x{int(h['phash'][r]):08x}")
        if expected_numel is not None:
            _first_bad(h["numel"] != expected_numel, "numel",
                       lambda r: f"expected {expected_numel}, got {int(h['numel'][r])}")

    # ---- single-tensor convenience (the compressor contract, docs/internals.md) -----------
    def compress(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Compress a flat tensor, drawing its key from ``generator``; returns the payload (nbytes,)."""
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"{self.name}.compress: generator must be a torch.Generator, got {type(generator).__name__}")
        if not isinstance(x, torch.Tensor) or x.dim() != 1:
            raise ValueError(
                f"{self.name}.compress: x must be a flat (1-D) tensor, got "
                + (f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__)
            )
        key = torch.randint(-(1 << 63), (1 << 63) - 1, (1,), generator=generator, dtype=torch.int64,
                            device=generator.device)
        return self.encode(x.view(1, -1), key)[0]

    def decompress(self, payload: torch.Tensor) -> torch.Tensor:
        """Decompress one payload (nbytes,) uint8; numel comes from its header."""
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"{self.name}.decompress: payload must be a 1-D uint8 tensor")
        P = payload.view(1, -1)
        if P.shape[1] < HEADER_NBYTES or P.shape[1] % 8:
            raise PayloadError(0, "size", f"a payload is a multiple of 8 bytes and at least {HEADER_NBYTES}, got {P.shape[1]}")
        P = P.contiguous() if P.storage_offset() % 8 == 0 else P.clone()
        h = wire.header_fields(P)
        self._check_header(h, expected_numel=None)
        numel = int(h["numel"][0])
        if numel < 1:
            raise PayloadError(0, "numel", f"header holds an invalid numel {numel}")
        return self.decode(P, numel)[0]

    # ---- helpers for subclasses ------------------------------------------------------
    def _check_input(self, X) -> torch.Tensor:
        if not isinstance(X, torch.Tensor):
            raise ValueError(f"{self.name}.encode: X must be a torch.Tensor, got {type(X).__name__}")
        if not X.is_floating_point():
            raise ValueError(f"{self.name}.encode: X must be a floating-point tensor, got dtype {X.dtype}")
        if X.dim() != 2:
            raise ValueError(f"{self.name}.encode: X must have shape (m, d), got shape {tuple(X.shape)}")
        X = X.detach()  # compressing is never differentiated
        if X.dtype != torch.float32:
            X = X.to(torch.float32)
        return X.contiguous()

    def _check_keys(self, keys, m: int, device) -> torch.Tensor:
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.shape != (m,):
            got = f"{keys.dtype} of shape {tuple(keys.shape)}" if isinstance(keys, torch.Tensor) else type(keys).__name__
            raise ValueError(f"{self.name}.encode: keys must be an int64 tensor of shape ({m},), got {got}")
        return keys.to(device)

    def _check_finite(self, X: torch.Tensor, stat: torch.Tensor | None = None) -> None:
        """Reject non-finite input. ``stat`` is a per-row reduction the caller computed
        anyway (non-finite if any input is); without one, a row sum is used."""
        if stat is None:
            stat = X.sum(dim=1)
        if bool(torch.isfinite(stat).all()):
            return
        bad = ~torch.isfinite(X).all(dim=1)
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            n = int((~torch.isfinite(X[r])).sum())
            raise NonFiniteError(
                f"{self.name}.encode: row {r} of the input has {n} non-finite value(s) (NaN or inf); "
                "compressors accept finite floating-point input only"
            )
        # finite input whose statistic overflowed fp32
        r = int((~torch.isfinite(stat)).nonzero()[0, 0])
        raise NonFiniteError(
            f"{self.name}.encode: row {r} of the input is finite but too large: its scale overflows float32"
        )


def _check_out(what: str, out, shape: tuple, dtype, device) -> torch.Tensor:
    if (not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != shape
            or out.device != torch.device(device) or not out.is_contiguous() or out.storage_offset() % 8):
        got = (f"{out.dtype} of shape {tuple(out.shape)} on {out.device}"
               + ("" if out.is_contiguous() else ", not contiguous")
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"{what}: out must be a contiguous, 8-byte aligned {dtype} tensor of shape {shape} "
                         f"on {torch.device(device)}, got {got}")
    return out


def _first_bad(bad: torch.Tensor, what: str, detail) -> None:
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise PayloadError(r, what, detail(r))
