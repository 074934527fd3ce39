"""Where the time of quant's 8-bit and 4-bit round trips goes, and the bound of the 8-bit design.

    python -m experiments run quant_parts [--numel 16777216] [--reps 9]

One thread, one row of standard normal fp32 values, minimum of interleaved repeats;
every figure is also given as a fraction of a memcpy of the same tensor timed in the
same run. It times the whole ``quant:bits=8`` and ``quant:bits=4`` encode and decode
(``out=`` buffers, the compiled kernels, as ``bench_compress.py``), the 8-bit encode
also with the one-loop kernel that rows not splitting into lanes take (``one-loop``:
the element indices built by inductor's vector ``arange``, min/max fused in the same
call; the form every size takes where the vector code is narrower than 512 bits) and
with the lane kernels (``lanes``: min/max, then the rounding of rows whose indices add a
loaded ramp; the form 512-bit vector code takes), the 4-bit encode also with
the one-call planar kernel (``one-call``: min/max, rounding and packing in one call, the
planes assembled into a column word; the form every size took before the 4-bit lane
kernels), and, compiled the same way as the one-loop kernel, the 8-bit encoder's parts:

- ``min/max``: the block's range, one read of the input;
- ``round``: scaling, the 24-bit counter hash of every element's index, the rounding
  and the store of the codes, with the tie flag reduced (the encoder's second loop);
- ``round, digit given``: the same with the hash replaced by a constant digit, so the
  difference is the hash's cost;
- ``round, no tie flag`` and ``round, digit given, no tie flag``: the same without the
  reduction that tells whether any element needs a second digit;
- ``checksum``: the payload's integrity sum, which the encoder writes and the decoder
  checks (so a round trip pays it twice); not compiled, an integer matrix-vector
  product (``experiments/bench_checksum.py`` compares the forms).

and the 4-bit encoder's parts, its own compiled kernels called as the encoder calls them:

- ``4-bit min/max``: the blocks' offset, range and inverse step (``quant_minmax``);
- ``4-bit round+pack``: rounding and packing byte by byte (``quant_planar_lanes``), the
  scales given;
- ``4-bit round+pack, digit given``: the same kernel with the hash replaced by a constant
  digit (the difference is the hash's cost);
- ``4-bit checksum``: the 4-bit payload's integrity sum.

Then the one-loop design's bound, ``min/max + round + decode`` at the measured speeds,
and the round trips of every form, as fractions of memcpy (the speed target is 1/4).
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import torch

from experiments._timing import min_interleaved

import gossip.compress as gc
from gossip.compress import kernels as K
from gossip.compress import wire
from experiments import _cli



def _parts4(x3: torch.Tensor, keys: torch.Tensor) -> dict:
    """The 4-bit encoder's two compiled calls on their own (min/max; rounding and packing,
    also with the hash replaced by a constant digit), called as quant_planar_encode calls
    them; empty when the row's columns do not split into lane rows."""
    n = x3.shape[-1]
    N = n // 8
    C = K.lane_width(N) if n % 8 == 0 else 0
    if not C or n < K.LANES_MIN_NUMEL:
        print(f"(no 4-bit parts: {n} values do not take the 4-bit lane kernels)")
        return {}
    km = K.variant("quant_minmax", K.make_minmax, (15,))
    kl = K.variant("quant_planar_lanes", K.make_planar_lanes, (4,))
    a, _, s = K.scales(x3, 15.0, 0)
    seeds = K.stream_seeds(keys, K.STREAM_ROUND)
    s2 = K.seed_args(seeds, 0)[0]
    bases = [K.seed_args(seeds, q * 2 * N)[1] for q in range(4)]  # each byte row's first hash input
    x6 = x3.view(1, 1, 4, 2, N // C, C)
    out5 = torch.empty(1, 1, 4, N // C, C, dtype=torch.uint8)
    rest = (a.view(1, 1, 1, 1), s.view(1, 1, 1, 1), s2)
    ramp = K.ramp(C, x3.device)
    # the same kernel code, its hash replaced by a constant digit; the digit still reads the
    # index (i & 0), so the kernel keeps its loop shape (without the ramp's load inductor
    # merged the lane rows and split the kernel into loops over buffers of the input's size)
    f = K.make_planar_lanes(4)
    given = types.FunctionType(f.__code__, {**f.__globals__, "R_": types.SimpleNamespace(
                                   hash24=lambda i, s1, s2: (i & 0) | 5_000_000)},
                               f.__name__, f.__defaults__, f.__closure__)
    given = torch.compile(given, dynamic=True, fullgraph=True)

    def round_pack(fn):
        """The encoder's 4 calls, one per byte row (as quant_planar_encode makes them)."""
        with torch.no_grad():
            return max(int(fn(x6[:, :, q], *rest, bases[q], ramp, out5[:, :, q])) for q in range(4))

    return {"4-bit min/max": lambda: K.run(km, n, x3),
            "4-bit round+pack": lambda: round_pack(lambda *a: K.run(kl, n // 4, *a)),
            "4-bit round+pack, digit given": lambda: round_pack(given)}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run quant_parts``."""
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", metavar="PATH", help="also write the figures, with their provenance, as JSON")


def main(argv=None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "quant_parts")
    if args.numel < 1 or args.reps < 1:
        p.error(f"--numel and --reps must be at least 1, got {args.numel} and {args.reps}")
    from experiments import _provenance

    prov = _provenance.start(["gossip/compress", "experiments/quant_parts.py", "experiments/_timing.py"],
                             argv=None if argv is None else ["experiments/quant_parts.py", *argv])
    torch.set_num_threads(1)
    K.set_backend("compile")  # the steady state (auto runs the first 2**30 elements eager)
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, 1 thread, {args.numel} elements; load average (1 min) {load:.2f}"
          + ("  WARNING: above 0.3, figures are not the machine's own" if load > 0.3 else ""))

    n = args.numel
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(0))
    x3 = x.view(1, 1, n)
    dst = torch.empty_like(x)
    c = gc.build("quant:bits=8")
    c4 = gc.build("quant:bits=4")
    keys = torch.tensor([12345])
    P = c.encode(x, keys)
    P4 = c4.encode(x, keys)
    Y = torch.empty_like(x)

    def one_loop(c, P):
        """Encode with the one-loop kernels (no row splits into lanes)."""
        with K.one_loop():
            c.encode(x, keys, out=P)

    def lanes(c, P):
        """Encode with the 8-bit lane kernels, on any CPU (``K.lanes_pay`` keeps them to
        512-bit vector code)."""
        with K.lanes_forced(True):
            c.encode(x, keys, out=P)

    Q = P.clone()
    one_loop(c, Q)  # compiles the one-loop kernel; the same bytes
    same = torch.equal(Q, P)
    Q8 = P.clone()
    lanes(c, Q8)  # compiles the lane kernels; the same bytes
    same = same and torch.equal(Q8, P)
    Q4 = P4.clone()
    one_loop(c4, Q4)  # the one-call planar kernel; the same bytes
    same4 = torch.equal(Q4, P4)
    codes = torch.empty(1, 1, n, dtype=torch.uint8)
    L = float(c.levels)
    a, _, s = K.scales(x3, L, 0)
    s1, s2 = (v.view(1, 1, 1) for v in K.seeds32(torch.tensor([7])))
    base = torch.tensor(0, dtype=torch.int32)
    u0 = torch.full((1, 1, 1), 5_000_000, dtype=torch.int32)

    def round_(x, a, s, s1, s2, base, out, hashed: bool, flag: bool):
        u = K.hash24(K.element_index(x, base), s1, s2) if hashed else u0
        lvl, tie = K.round_half(x, a, s, u, 255.0, 0)
        out.copy_(lvl)
        return tie.amax() if flag else None

    compiled = {}
    for hashed in (True, False):
        for flag in (True, False):
            f = torch.compile(lambda *t, h=hashed, g=flag: round_(*t, hashed=h, flag=g), dynamic=False)
            compiled[(hashed, flag)] = f
    minmax = torch.compile(lambda x: (x.amin(dim=-1), x.amax(dim=-1)), dynamic=False)

    parts4 = _parts4(x3, keys)

    fns = {
        "memcpy": lambda: dst.copy_(x),
        "encode": lambda: c.encode(x, keys, out=P),
        "decode": lambda: c.decode(P, n, out=Y),
        "encode, one-loop": lambda: one_loop(c, P),
        "encode, lanes": lambda: lanes(c, Q8),
        "4-bit encode": lambda: c4.encode(x, keys, out=P4),
        "4-bit decode": lambda: c4.decode(P4, n, out=Y),
        "4-bit encode, one-call": lambda: one_loop(c4, Q4),
        **parts4,
        "4-bit checksum": lambda: wire.checksum(P4),
        "min/max": lambda: minmax(x3),
        "round": lambda: compiled[(True, True)](x3, a, s, s1, s2, base, codes),
        "round, digit given": lambda: compiled[(False, True)](x3, a, s, s1, s2, base, codes),
        "round, no tie flag": lambda: compiled[(True, False)](x3, a, s, s1, s2, base, codes),
        "round, digit given, no tie flag": lambda: compiled[(False, False)](x3, a, s, s1, s2, base, codes),
        "checksum": lambda: wire.checksum(P),
    }
    for f in fns.values():  # compile and fault every buffer in
        f()
    t = min_interleaved(fns, args.reps)
    mem = t["memcpy"]
    print(f"{'part':34s} {'ms':>8s} {'/ memcpy':>9s}")
    for k, v in t.items():
        print(f"{k:34s} {v * 1e3:8.2f} {v / mem:9.2f}")
    gbs = x.numel() * 4 / mem / 1e9
    rt = t["encode"] + t["decode"]
    bound = t["min/max"] + t["round"] + t["decode"]
    print(f"memcpy {gbs:.2f} GB/s; round trip encode+decode {rt * 1e3:.2f} ms = {mem / rt:.3f} of memcpy speed; "
          f"in the one-loop kernel the hash costs {(t['round'] - t['round, digit given']) * 1e3:.2f} ms, the tie flag "
          f"{(t['round'] - t['round, no tie flag']) * 1e3:.2f} ms, the two checksums "
          f"{2 * t['checksum'] * 1e3:.2f} ms = {2 * t['checksum'] / rt:.1%} of the round trip")
    print(f"bound of the one-loop design (min/max + round + decode): {bound * 1e3:.2f} ms = {mem / bound:.3f} of memcpy speed")
    if parts4:
        rest = t["4-bit encode"] - t["4-bit min/max"] - t["4-bit round+pack"]
        print(f"4-bit encode {t['4-bit encode'] * 1e3:.2f} ms = min/max {t['4-bit min/max'] * 1e3:.2f} + round+pack "
              f"{t['4-bit round+pack'] * 1e3:.2f} (of which the hash {(t['4-bit round+pack'] - t['4-bit round+pack, digit given']) * 1e3:.2f}) "
              f"+ the rest {rest * 1e3:.2f} (header, scales, checksum {t['4-bit checksum'] * 1e3:.2f})")
    ratios = {"8": mem / rt, "8, one-loop": mem / (t["encode, one-loop"] + t["decode"]),
              "8, lanes": mem / (t["encode, lanes"] + t["decode"]),
              "4": mem / (t["4-bit encode"] + t["4-bit decode"]),
              "4, one-call": mem / (t["4-bit encode, one-call"] + t["4-bit decode"])}
    print("round trip / memcpy: " + ", ".join(f"{k} bits {v:.3f}" for k, v in ratios.items())
          + f" (the 8-bit forms' payloads {'identical' if same else 'DIFFER'}, the two 4-bit forms' "
          + f"{'identical' if same4 else 'DIFFER'})")
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.2f}")
    if args.json:
        _provenance.write(args.json, {"numel": n, "reps": args.reps, "stat": "min", "seconds": t,
                                      "memcpy_gbps": gbs, "roundtrip_ratio": mem / rt,
                                      "design_bound_ratio": mem / bound, "roundtrip_ratios": ratios,
                                      "same_bytes": same, "same_bytes_4": same4}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
