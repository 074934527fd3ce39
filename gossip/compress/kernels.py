"""The element-wise kernels behind the compressors, for benchmarks and tools.

The compressors call these; a micro-benchmark times them, or parts of them, on their
own (experiments/quant_parts.py, bench_checksum.py, cold_start.py). Each runs compiled
(torch.compile) or eager as the backend says (``set_backend``, the environment
variable ``GOSSIP_COMPRESS_BACKEND``; docs/compress.md). Nothing here is needed to
use a compressor.
"""

from ._kernels import (
    LANES_MIN_NUMEL,
    Kernel,
    checksum,
    checksum_expression,
    element_index,
    get_backend,
    lane_width,
    lanes_forced,
    lanes_pay,
    make_minmax,
    make_planar_lanes,
    one_loop,
    ramp,
    round_half,
    run,
    scales,
    seed_args,
    set_backend,
    variant,
    watch_compiled,
)
from ._random import STREAM_ROUND, hash24, seeds32, stream_seeds
from .wire import checksum_weights

__all__ = [
    "Kernel",
    "run",
    "get_backend",
    "set_backend",
    "watch_compiled",
    "variant",
    "lane_width",
    "lanes_pay",
    "lanes_forced",
    "one_loop",
    "LANES_MIN_NUMEL",
    "make_minmax",
    "make_planar_lanes",
    "scales",
    "seed_args",
    "ramp",
    "element_index",
    "round_half",
    "STREAM_ROUND",
    "stream_seeds",
    "seeds32",
    "hash24",
    "checksum",
    "checksum_expression",
    "checksum_weights",
]
