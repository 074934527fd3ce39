"""Per-thread scratch buffers reused across calls, so that steady-state encoding
and decoding allocate nothing (a fresh allocation faults its pages in, which costs
as much as the work on them).

``buffer(name, n, dtype, device)`` returns a flat tensor of ``n`` elements, the
prefix of a buffer kept for this thread under ``name``; it grows when a larger one
is asked for. A caller must finish with a buffer before asking for the same name
again. The buffers are small (the chunked kernels size them, a few hundred KiB).
"""

from __future__ import annotations

import threading

import torch

__all__: list[str] = []

_local = threading.local()


def buffer(name: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (name, dtype, torch.device(device))
    b = bufs.get(key)
    if b is None or b.numel() < n:
        b = bufs[key] = torch.empty(max(n, 1), dtype=dtype, device=device)
    return b[:n]
