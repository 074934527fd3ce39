"""The Compressor contract: registry and specs, sizes, wire format, errors, reproducibility."""

import re

import pytest
import torch

import gossip.compress as gc
from gossip.compress import HEADER_NBYTES, PayloadError, _kernels

ALL = sorted(gc.available())
SPECS = ALL + [
    "quant:bits=4,block=256", "quant:bits=3,block=10", "quant:bits=16", "qsgd:levels=3,block=7",
    "ternary:block=9", "blocksign:offsets=0/10/50", "blocksign:block=16", "randk:k=3",
    "topk:k=5", "randomk:p=0.3", "randomblock:k=7",
]
BIASED = [s for s in SPECS if not gc.build(s).unbiased]


@pytest.fixture(autouse=True)
def _eager():
    old = _kernels.set_backend("eager")
    yield
    _kernels.set_backend(old)


def _X(m=6, d=103, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, d, generator=g)


def _keys(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 63), (1 << 63) - 1, (m,), generator=g, dtype=torch.int64)


# ---------------------------------------------------------------------------------- registry


def test_available_lists_every_compressor_with_a_description():
    av = gc.available()
    assert set(av) == {"quant", "qsgd", "randk", "ternary", "sign", "blocksign", "topk", "randomk",
                       "randomblock", "identity", "fp16"}
    assert all(isinstance(v, str) and v for v in av.values())


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trip_and_declarations(spec):
    c = gc.build(spec)
    assert gc.build(c.spec) == c and c.spec.startswith(c.name)
    assert isinstance(c.unbiased, bool) and isinstance(c.linear, bool)
    assert gc.build(c) is c


def test_declared_flags():
    flags = {n: (gc.build(n).unbiased, gc.build(n).linear) for n in ALL}
    assert flags["identity"] == (True, True)
    assert flags["fp16"] == (False, False)
    for n in ("quant", "qsgd", "randk", "ternary"):
        assert flags[n][0]
    for n in ("sign", "blocksign", "topk", "randomk", "randomblock"):
        assert not flags[n][0]
    assert flags["randomk"][1] and flags["randomblock"][1]


def test_build_examples_from_the_issue():
    assert gc.build("quant:bits=8").config.bits == 8
    c = gc.build("quant:bits=4,block=256")
    assert (c.config.bits, c.config.block) == (4, 256)
    assert gc.build("qsgd:levels=16").config.levels == 16
    assert gc.build("randk:p=0.1").config.p == 0.1
    assert gc.build("topk:k=1000").config.k == 1000
    assert gc.build("blocksign").config.offsets is None
    assert gc.build("blocksign", offsets=[0, 10, 20]).config.offsets == (0, 10, 20)
    assert gc.build(" QUANT : bits = 2 ").config.bits == 2


@pytest.mark.parametrize("spec,pattern", [
    ("nope", r"unknown compressor 'nope'; available: blocksign, fp16, identity, qsgd, quant"),
    ("quant:bits=0", r"quant: parameter `bits` must be an integer in 1\.\.16, got 0"),
    ("quant:bits=17", r"quant: parameter `bits` must be an integer in 1\.\.16, got 17"),
    ("quant:bits=eight", r"quant: parameter `bits` must be an integer, got 'eight'"),
    ("quant:bits=2.5", r"quant: parameter `bits` must be an integer, got '2.5'"),
    ("quant:block=0", r"quant: parameter `block` must be a positive integer"),
    ("quant:bitz=3", r"quant: unknown parameter 'bitz'; accepted: bits, block"),
    ("quant:bits", r"quant: malformed parameter 'bits'; write name=value \(accepted: bits, block\)"),
    ("quant:bits=3,bits=4", r"quant: parameter 'bits' given twice"),
    ("randk:p=0", r"randk: parameter `p` must be a number in \(0, 1\], got 0.0"),
    ("randk:p=1.5", r"randk: parameter `p` must be a number in \(0, 1\], got 1.5"),
    ("randk:p=-0.1", r"randk: parameter `p` must be a number in \(0, 1\]"),
    ("randk:p=abc", r"randk: parameter `p` must be a number, got 'abc'"),
    ("randk:p=0.1,k=3", r"randk: give `p` or `k`, not both"),
    ("topk:k=0", r"topk: parameter `k` must be an integer >= 1, got 0"),
    ("topk:k=-5", r"topk: parameter `k` must be an integer >= 1, got -5"),
    ("qsgd:levels=0", r"qsgd: parameter `levels` must be an integer in 1\.\.32767"),
    ("qsgd:levels=40000", r"qsgd: parameter `levels` must be an integer in 1\.\.32767"),
    ("blocksign:offsets=5/10", r"blocksign: parameter `offsets` must start at 0 and increase strictly"),
    ("blocksign:offsets=0/10/10", r"blocksign: parameter `offsets` must start at 0 and increase strictly"),
    ("blocksign:offsets=0/x", r"blocksign: parameter `offsets` must be a list of integers like 0/100/300"),
    ("blocksign:offsets=0/10,block=4", r"blocksign: give `offsets` or `block`, not both"),
    ("sign:block=4", r"sign: unknown parameter 'block'; accepted: none"),
    ("identity:x=1", r"identity: unknown parameter 'x'; accepted: none"),
])
def test_bad_specs(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        gc.build(spec)


def test_bad_build_arguments():
    with pytest.raises(ValueError, match=r"build: spec must be a string like 'quant:bits=8', got int"):
        gc.build(8)
    with pytest.raises(ValueError, match=r"quant: unknown parameter 'bitz'; accepted: bits, block"):
        gc.build("quant", bitz=3)
    with pytest.raises(ValueError, match=r"cannot modify an existing Compressor"):
        gc.build(gc.build("quant"), bits=3)


# ---------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("d", [1, 7, 64, 103, 1000])
def test_payload_sizes_are_exact(spec, d):
    c = gc.build(spec)
    try:
        n = c.payload_nbytes(d)
    except ValueError as e:  # k > numel, or offsets beyond numel
        assert re.search(r"exceeds numel|must be below numel", str(e))
        return
    P = c.encode(_X(3, d), _keys(3))
    assert P.dtype == torch.uint8 and P.shape == (3, n)
    assert n % 8 == 0 and n >= HEADER_NBYTES
    ideal = c.ideal_nbytes(d)
    assert 0 < ideal <= n - HEADER_NBYTES
    assert n - HEADER_NBYTES - ideal < 8 + 4 * 4  # padding and alignment only


def test_ideal_sizes():
    d = 1000
    assert gc.build("quant:bits=8").ideal_nbytes(d) == d + 8
    assert gc.build("quant:bits=4,block=100").ideal_nbytes(d) == d / 2 + 10 * 8
    assert gc.build("qsgd:levels=16").ideal_nbytes(d) == d * 6 / 8 + 4
    assert gc.build("ternary").ideal_nbytes(d) == d / 4 + 4
    assert gc.build("sign").ideal_nbytes(d) == d / 8 + 4
    assert gc.build("blocksign:offsets=0/10/500").ideal_nbytes(d) == d / 8 + 12
    assert gc.build("randk:p=0.1").ideal_nbytes(d) == 400
    assert gc.build("topk:k=10").ideal_nbytes(d) == 80
    assert gc.build("identity").ideal_nbytes(d) == 4000
    assert gc.build("fp16").ideal_nbytes(d) == 2000
    assert gc.build("quant:bits=8").payload_nbytes(d) == 32 + 1008  # 2 scales + 1000 codes


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("spec", SPECS)
def test_row_alone_equals_row_in_batch(spec):
    c = gc.build(spec)
    X, keys = _X(), _keys(6)
    P = c.encode(X, keys, tag=9)
    for r in range(6):
        assert torch.equal(c.encode(X[r:r + 1], keys[r:r + 1], tag=9)[0], P[r])
    Y = c.decode(P, 103, tag=9)
    assert Y.dtype == torch.float32 and Y.shape == X.shape
    for r in (0, 5):
        assert torch.equal(c.decode(P[r:r + 1], 103)[0], Y[r])


@pytest.mark.parametrize("spec", SPECS)
def test_same_key_same_bytes_and_generator_reproducibility(spec):
    c = gc.build(spec)
    x = _X(1, 200)[0]
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    p1, p2 = c.compress(x, g1), c.compress(x, g2)
    assert torch.equal(p1, p2) and p1.shape == (c.payload_nbytes(200),)
    p3 = c.compress(x, g1)  # the generator moved on: a new key
    assert not torch.equal(p1[16:24], p3[16:24])
    y = c.decompress(p1)
    assert y.shape == (200,) and torch.equal(y, c.decode(p1.view(1, -1), 200)[0])


def test_global_rng_is_not_used():
    c = gc.build("quant:bits=4")
    x = _X(1, 100)
    torch.manual_seed(0)
    a = c.encode(x, torch.tensor([3]))
    torch.manual_seed(123)
    torch.rand(10)
    b = c.encode(x, torch.tensor([3]))
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["identity", "quant:bits=16", "sign", "blocksign:offsets=0/3/40", "topk:k=103"])
def test_deterministic_round_trips(spec):
    c = gc.build(spec)
    X = _X(4, 103)
    Y = c.decode(c.encode(X, _keys(4)), 103)
    if c.name != "quant":  # deterministic: the key does not matter
        assert torch.equal(Y, c.decode(c.encode(X, _keys(4, seed=9)), 103))
    if spec in ("identity", "topk:k=103"):
        assert torch.equal(Y, X)
    elif spec.startswith("quant"):
        assert float((Y - X).abs().max()) <= float((X.amax(1) - X.amin(1)).max()) / 65535 * 1.0001
    else:
        assert torch.equal(Y < 0, X < 0) and bool((Y != 0).all())


def test_fp16_and_exact_values():
    c = gc.build("fp16")
    X = _X(3, 50)
    assert torch.equal(c.decode(c.encode(X, _keys(3)), 50), X.half().float())
    q = gc.build("quant:bits=2")
    X = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # on the grid: exact
    assert torch.equal(q.decode(q.encode(X, _keys(1)), 4), X)
    s = gc.build("sign")
    assert torch.equal(s.decode(s.encode(torch.tensor([[2.0, -4.0, 0.0, 6.0]]), _keys(1)), 4),
                       torch.tensor([[3.0, -3.0, 3.0, 3.0]]))


def test_blocksign_scales_per_block():
    c = gc.build("blocksign", offsets=(0, 2))
    Y = c.decode(c.encode(torch.tensor([[1.0, -3.0, 10.0, -20.0, 30.0]]), _keys(1)), 5)
    assert torch.equal(Y, torch.tensor([[2.0, -2.0, 20.0, -20.0, 20.0]]))


def test_sparse_selection():
    X = torch.tensor([[0.5, -3.0, 0.1, 2.0, -2.0, 0.0]])
    t = gc.build("topk:k=2")
    assert torch.equal(t.decode(t.encode(X, _keys(1)), 6), torch.tensor([[0, -3.0, 0, 2.0, 0, 0]]))
    t3 = gc.build("topk:k=3")  # |2.0| == |-2.0|: the lower index wins
    assert torch.equal(t3.decode(t3.encode(X, _keys(1)), 6), torch.tensor([[0, -3.0, 0, 2.0, 0, 0]]) +
                       torch.tensor([[0, 0, 0, 0, -2.0, 0]]))
    rb = gc.build("randomblock:k=3")
    Y = rb.decode(rb.encode(torch.arange(1.0, 11.0).view(1, -1), _keys(1)), 10)
    nz = Y[0].nonzero().view(-1)
    assert nz.numel() == 3 and int(nz[2] - nz[0]) == 2 and torch.equal(Y[0, nz], nz.float() + 1)
    rk = gc.build("randk:k=4")
    Y = rk.decode(rk.encode(torch.ones(1, 10), _keys(1)), 10)
    assert torch.equal(Y.sort().values, torch.tensor([[0.0] * 6 + [2.5] * 4]))


def test_shared_key_sparsifiers_are_linear():
    """With one key for all rows, summing the value bodies then decoding = summing the decodings."""
    for spec in ("randomk:k=5", "randomblock:k=5", "identity"):
        c = gc.build(spec)
        X = _X(3, 40)
        key = torch.tensor([77, 77, 77])
        P = c.encode(X, key)
        summed = P[:1].clone()
        c.layout(40).views(summed)["values"].copy_(c.layout(40).views(P)["values"].sum(0, keepdim=True))
        summed = _reseal(c, summed, 40, key[:1])
        assert torch.equal(c.decode(summed, 40), c.decode(P, 40).sum(0, keepdim=True))


def _reseal(c, P, d, keys):
    """Rewrite the header and checksum after editing a body (what an all-reduce would do)."""
    from gossip.compress import wire

    wire.write_header(P, c.cid, c._phash, d, keys, 0)
    return P


@pytest.mark.parametrize("spec", BIASED)
def test_error_feedback_identity(spec):
    """residual = x - C(x) is what an error-feedback wrapper keeps: residual + C(x) == x."""
    c = gc.build(spec)
    X = _X(4, 103) * 3
    Y = c.decode(c.encode(X, _keys(4)), 103)
    res = X.double() - Y.double()  # exact in float64 for fp32 operands
    assert torch.equal(res + Y.double(), X.double())
    if spec.startswith(("topk", "randomk", "randomblock")):  # sparse: exact even in fp32
        assert torch.equal((X - Y) + Y, X)
        assert bool(((Y == 0) | (Y == X)).all())
    assert float((res ** 2).sum()) < float((X.double() ** 2).sum())  # a contraction


# ---------------------------------------------------------------------------------- bad payloads


def _payload(spec="quant:bits=8", m=5, d=100, tag=4):
    c = gc.build(spec)
    return c, c.encode(_X(m, d), _keys(m), tag=tag)


def test_payload_errors_name_row_and_field():
    c, P = _payload()
    with pytest.raises(PayloadError, match=r"payload row 0: compressor mismatch: expected 'qsgd' \(id 4\), got 'quant' \(id 3\)"):
        gc.build("qsgd").decode(P, 100)
    with pytest.raises(PayloadError, match=r"payload row 0: parameters mismatch: expected 'quant:bits=4'"):
        gc.build("quant:bits=4").decode(P, 100)
    with pytest.raises(PayloadError, match=r"payload row 0: parameters mismatch: expected 'quant:bits=8,block=10'"):
        gc.build("quant:bits=8,block=10").decode(P, 100)
    with pytest.raises(PayloadError, match=r"payload row 0: numel mismatch: expected 101, got 100"):
        c.decode(P, 101)
    with pytest.raises(PayloadError, match=r"payload row 0: tag mismatch: expected 5, got 4"):
        c.decode(P, 100, tag=5)
    c.decode(P, 100, tag=4)
    c.decode(P, 100)  # tag=None accepts any tag
    with pytest.raises(PayloadError, match=r"payload row 0: size mismatch: expected 144 bytes for numel=100"):
        c.decode(P[:, :-8], 100)
    with pytest.raises(PayloadError, match=r"size mismatch"):
        c.decode(P[:, :24], 100)
    bad = P.clone()
    bad[3, 0] ^= 1
    with pytest.raises(PayloadError, match=r"payload row 3: format mismatch: not a gossip.compress payload"):
        c.decode(bad, 100)
    bad = P.clone()
    bad[2, 2] = 9
    with pytest.raises(PayloadError, match=r"payload row 2: format version mismatch: expected 5, got 9"):
        c.decode(bad, 100)
    bad[2, 2] = 1  # version 1: quant's earlier code layout and rounding digits
    with pytest.raises(PayloadError, match=r"payload row 2: format version mismatch: expected 5, got 1"):
        c.decode(bad, 100)
    bad[2, 2] = 2  # version 2: randk's and randomk's earlier coordinates
    with pytest.raises(PayloadError, match=r"payload row 2: format version mismatch: expected 5, got 2"):
        c.decode(bad, 100)
    bad[2, 2] = 3  # version 3: quant's earlier rounding digits
    with pytest.raises(PayloadError, match=r"payload row 2: format version mismatch: expected 5, got 3"):
        c.decode(bad, 100)
    bad[2, 2] = 4  # version 4: sparseloco's earlier quantizer
    with pytest.raises(PayloadError, match=r"payload row 2: format version mismatch: expected 5, got 4"):
        c.decode(bad, 100)
    bad = P.clone()
    bad[4, 100] ^= 0x10
    with pytest.raises(PayloadError, match=r"payload row 4: checksum mismatch: stored 0x[0-9a-f]{8}, computed"):
        c.decode(bad, 100)
    assert issubclass(PayloadError, ValueError)
    try:
        c.decode(bad, 100)
    except PayloadError as e:
        assert (e.row, e.what) == (4, "checksum")


def test_intact_payloads_skip_only_the_checksum():
    """``decode(intact=True)``: the caller vouches for the bytes (its own unmodified
    payloads), so the checksum is not recomputed; every other header field still is."""
    c, P = _payload()
    Q = P.clone()
    Q[0, -1] ^= 0x01  # a body byte: only the checksum would see it
    with pytest.raises(PayloadError, match=r"payload row 0: checksum mismatch"):
        c.decode(Q, 100)
    c.decode(Q, 100, intact=True)
    with pytest.raises(PayloadError, match=r"payload row 0: tag mismatch: expected 5, got 4"):
        c.decode(P, 100, tag=5, intact=True)
    with pytest.raises(PayloadError, match=r"payload row 0: numel mismatch: expected 101, got 100"):
        c.decode(P, 101, intact=True)


@pytest.mark.parametrize("spec", ["quant:bits=8", "topk:k=10", "randk:p=0.1", "sign", "identity"])
def test_every_single_damaged_byte_is_detected(spec):
    c, P = _payload(spec, m=1, d=50)
    for pos in range(P.shape[1]):
        for flip in (0x01, 0x80, 0xFF):
            bad = P.clone()
            bad[0, pos] ^= flip
            with pytest.raises(PayloadError):
                c.decode(bad, 50)


@pytest.mark.parametrize("m,words", [(1, 9), (3, 1000), (2, 70_001), (40, 257)])
def test_checksum_is_the_documented_sum_modulo_2_32(m, words):
    """sum_j (2 j + 1) w_j mod 2**32 over each row's little-endian uint32 words, the
    checksum word itself (word 7) taken as 0: computed here with Python integers, on
    words at the extremes (every product and the sums wrap) and at random."""
    from gossip.compress import wire

    g = torch.Generator().manual_seed(m * words)
    P = torch.randint(0, 256, (m, 4 * words), dtype=torch.uint8, generator=g)
    P[0, : 4 * min(words, 40)] = 0xFF  # words of 2**32 - 1
    P[-1, -4:] = torch.tensor([0, 0, 0, 0x80], dtype=torch.uint8)  # 2**31 at the end
    want = []
    for row in P.tolist():
        ws = [int.from_bytes(bytes(row[4 * j: 4 * j + 4]), "little") for j in range(words)]
        want.append(sum((2 * j + 1) * x for j, x in enumerate(ws) if j != 7) % (1 << 32))
    assert wire.checksum(P).tolist() == want


def test_swapped_words_are_detected():
    c, P = _payload(m=1, d=64)
    w = P.view(torch.int32).clone()
    w[0, [10, 11]] = w[0, [11, 10]]
    if not torch.equal(w, P.view(torch.int32)):
        with pytest.raises(PayloadError, match="checksum"):
            c.decode(w.view(torch.uint8), 64)


def test_decompress_checks_the_header():
    c, P = _payload(m=1, d=30)
    y = c.decompress(P[0])
    assert y.shape == (30,)
    with pytest.raises(PayloadError, match="compressor mismatch"):
        gc.build("sign").decompress(P[0])
    with pytest.raises(PayloadError, match="size mismatch"):
        c.decompress(P[0, :20])
    with pytest.raises(ValueError, match="payload must be a 1-D uint8 tensor"):
        c.decompress(P)


def test_decode_argument_errors():
    c, P = _payload()
    with pytest.raises(ValueError, match=r"quant.decode: payloads must be a 2-D uint8 tensor \(m, nbytes\), got torch.int32"):
        c.decode(P.view(torch.int32), 100)
    with pytest.raises(ValueError, match=r"quant: numel must be a positive int, got 0"):
        c.decode(P, 0)
    with pytest.raises(ValueError, match=r"tag must be None or an int in \[0, 2\*\*32\), got -1"):
        c.decode(P, 100, tag=-1)
    assert c.decode(P[:0], 100).shape == (0, 100)


# ---------------------------------------------------------------------------------- bad input


def test_encode_rejects_bad_input():
    c = gc.build("quant:bits=8")
    k = _keys(2)
    with pytest.raises(ValueError, match=r"quant.encode: X must be a floating-point tensor, got dtype torch.int64"):
        c.encode(torch.ones(2, 5, dtype=torch.int64), k)
    with pytest.raises(ValueError, match=r"quant.encode: X must have shape \(m, d\), got shape \(5,\)"):
        c.encode(torch.ones(5), k)
    with pytest.raises(ValueError, match=r"quant.encode: X must be a torch.Tensor, got list"):
        c.encode([[1.0]], k)
    with pytest.raises(ValueError, match=r"keys must be an int64 tensor of shape \(2,\), got torch.int32 of shape \(2,\)"):
        c.encode(torch.ones(2, 5), k.int())
    with pytest.raises(ValueError, match=r"keys must be an int64 tensor of shape \(2,\), got torch.int64 of shape \(3,\)"):
        c.encode(torch.ones(2, 5), _keys(3))
    with pytest.raises(ValueError, match=r"tag must be an int in \[0, 2\*\*32\), got 4294967296"):
        c.encode(torch.ones(2, 5), k, tag=1 << 32)
    with pytest.raises(ValueError, match=r"compress: generator must be a torch.Generator, got int"):
        c.compress(torch.ones(5), 3)
    with pytest.raises(ValueError, match=r"compress: x must be a flat \(1-D\) tensor, got shape \(1, 5\)"):
        c.compress(torch.ones(1, 5), torch.Generator())


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_rejects_non_finite(spec, bad):
    c = gc.build(spec)
    X = _X(3, 103)
    X[1, 17] = bad
    with pytest.raises(ValueError, match=r"encode: row 1 of the input has 1 non-finite value\(s\) \(NaN or inf\)"):
        c.encode(X, _keys(3))


@pytest.mark.parametrize("m, d", [(7, 103), (5, 1000), (3, 4096)])
def test_identity_in_blocks_of_rows_writes_the_same_bytes(monkeypatch, m, d):
    """identity's encoding of many rows on the CPU (the simulation's), a block of rows
    at a time with the checksum's body share taken from the copy: the bytes of the
    one-pass encoding, which decode to the values; a non-finite row still refused."""
    from gossip.compress import baseline

    c = gc.build("identity")
    X = _X(m, d)
    monkeypatch.setattr(baseline, "_FUSED_VALUES", 1 << 40)
    whole = c.encode(X, _keys(m), tag=9)
    monkeypatch.setattr(baseline, "_FUSED_VALUES", 2 * d)  # blocks of 2 rows, the last shorter
    assert torch.equal(c.encode(X, _keys(m), tag=9), whole)
    assert torch.equal(c.decode(whole, d, tag=9), X)
    X[m - 1, d // 2] = float("nan")
    with pytest.raises(ValueError, match=rf"identity.encode: row {m - 1} of the input has 1 non-finite"):
        c.encode(X, _keys(m))


def test_range_overflow_and_fp16_range():
    X = torch.tensor([[-3e38, 3e38, 0.0]])
    with pytest.raises(ValueError, match=r"row 0 of the input is finite but too large"):
        gc.build("quant:bits=8").encode(X, _keys(1))
    with pytest.raises(ValueError, match=r"fp16.encode: row 0 has values beyond the fp16 range"):
        gc.build("fp16").encode(torch.tensor([[1e5]]), _keys(1))


def test_k_larger_than_numel():
    with pytest.raises(ValueError, match=r"topk: k=1000 exceeds numel=100 \(k must be <= numel\)"):
        gc.build("topk:k=1000").encode(_X(1, 100), _keys(1))
    with pytest.raises(ValueError, match=r"randomk: k=11 exceeds numel=10"):
        gc.build("randomk:k=11").payload_nbytes(10)
    with pytest.raises(ValueError, match=r"blocksign: the last block offset 50 must be below numel=50"):
        gc.build("blocksign:offsets=0/50").encode(_X(1, 50), _keys(1))


def test_input_that_requires_grad():
    c = gc.build("quant:bits=8")
    X = _X(2, 20).requires_grad_()
    P = c.encode(X, _keys(2))
    assert not P.requires_grad and torch.equal(P, c.encode(X.detach(), _keys(2)))


def test_other_float_dtypes_are_accepted():
    c = gc.build("quant:bits=8")
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        X = _X(2, 20).to(dt)
        P = c.encode(X, _keys(2))
        assert torch.equal(P, c.encode(X.float(), _keys(2)))


# ------------------------------------------------------------------ error guarantees
def _error_ratios(c, X, K, seed=0):
    """||C(x) - x||^2 / ||x||^2 for each row of X under K keys: (rows, K) float64."""
    m, d = X.shape
    Xr = X.repeat_interleave(K, dim=0)
    out = c.decode(c.encode(Xr, _keys(m * K, seed)), d).to(torch.float64)
    err = ((out - Xr.to(torch.float64)) ** 2).sum(1) / (Xr.to(torch.float64) ** 2).sum(1)
    return err.view(m, K)


def _hard_rows(d):
    """Gaussian rows and the worst cases of the declared bounds: a single non-zero value
    (sign, random block), values of one magnitude (top-k), (1, -1, 0, ...) (quant)."""
    g = torch.Generator().manual_seed(5)
    one_hot = torch.zeros(2, d)
    one_hot[0, 0], one_hot[1, d - 1] = 1.0, -3.0
    pm = torch.zeros(1, d)
    pm[0, 0], pm[0, 1] = 1.0, -1.0
    return torch.cat([torch.randn(3, d, generator=g), one_hot, pm, torch.ones(1, d)])


@pytest.mark.parametrize("spec", SPECS)
def test_declared_error_guarantees_hold_on_random_and_worst_case_vectors(spec):
    """omega: E||C(x) - x||^2 <= omega ||x||^2 (unbiased); delta: <= (1 - delta) ||x||^2.
    Estimated over K keys per vector; the tolerance is 5 standard errors of the mean plus
    float rounding. A contraction's ratio lies in [0, 1], so at the bound b its variance
    can be b (1 - b) even where K draws happen to agree (a rare kept value)."""
    c = gc.build(spec)
    d = 103
    om, de = c.omega(d), c.delta(d)
    assert (om is not None) == c.unbiased and (de is not None) == c.contractive, spec
    assert om is None or om >= 0
    assert de is None or 0 < de <= 1
    if om is None and de is None:
        return  # fp16 declares no guarantee
    K = 200
    R = _error_ratios(c, _hard_rows(d), K=K)
    mean, var = R.mean(1), R.var(1)
    random = bool((var > 0).any())  # top-k, sign, identity: the same error under every key
    if om is not None:
        assert bool((mean <= om + 5 * (var / K).sqrt() + 1e-5).all()), (spec, om, mean.tolist())
    if de is not None:
        b = 1 - de
        var = var.clamp(min=b * (1 - b)) if random else var
        assert bool((mean <= b + 5 * (var / K).sqrt() + 1e-5).all()), (spec, b, mean.tolist())


@pytest.mark.parametrize("spec,row,expect", [
    ("topk:k=5", "ones", lambda c, d: 1 - c.delta(d)),          # equal magnitudes: exactly 1 - k/d
    ("randomk:k=5", "gauss", lambda c, d: 1 - c.delta(d)),      # exactly 1 - k/d in expectation
    ("randomblock:k=7", "first", lambda c, d: 1 - c.delta(d)),  # the first value is kept 1 in d-k+1 times
    ("sign", "first", lambda c, d: 1 - c.delta(d)),             # one non-zero value: 1 - 1/d
    ("randk:k=5", "gauss", lambda c, d: c.omega(d)),            # exactly d/k - 1
    ("quant:bits=2", "pm", lambda c, d: c.omega(d) * (d - 2) / d),
])
def test_declared_guarantees_are_reached(spec, row, expect):
    """The declarations are the guarantees, not loose bounds: each is met on its worst case."""
    c = gc.build(spec)
    d = 103
    rows = {"ones": torch.ones(1, d), "gauss": torch.randn(1, d, generator=torch.Generator().manual_seed(1)),
            "first": torch.nn.functional.one_hot(torch.tensor([0]), d).float(),
            "pm": torch.cat([torch.tensor([[1.0, -1.0]]), torch.zeros(1, d - 2)], dim=1)}
    R = _error_ratios(c, rows[row], K=4000)
    mean, se = float(R.mean()), float(R.std()) / 4000**0.5
    assert abs(mean - expect(c, d)) <= 5 * se + 1e-5, (spec, mean, expect(c, d), se)


def test_bench_checksum_runs_and_writes_its_figures(tmp_path, capsys):
    """experiments/bench_checksum.py, tiny: each form's sums are checked against the
    kernel's before timing, and every printed ratio is in the results file."""
    import importlib
    import json

    mod = importlib.import_module("experiments.bench_checksum")
    assert mod.main(["--small", "--reps", "1", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "c.json").read_text())
    assert "python -m experiments.bench_checksum --small --reps 1" in r["provenance"]["command"]
    rows = r["results"]["rows"]
    assert [(x["rows"], x["words"]) for x in rows] == [(4, 300), (1, 5000)]
    for x in rows:
        assert min(x["memcpy_ms"], x["mv_ms"], x["compiled_ms"], x["chunked_ms"]) > 0
        assert f"({x['compiled_over_mv']:.2f}x mv)" in out and f"({x['chunked_over_mv']:.2f}x mv)" in out
    with pytest.raises(SystemExit):
        mod.main(["--reps", "0"])
    assert "--reps must be at least 1, got 0" in capsys.readouterr().err


def test_quant_parts_runs_and_writes_its_figures(tmp_path, capsys):
    """experiments/quant_parts.py, tiny: the one-loop and one-call forms give the same
    payloads as the kernels, and the printed round-trip ratios are the file's."""
    import importlib
    import json

    mod = importlib.import_module("experiments.quant_parts")
    assert mod.main(["--numel", "65536", "--reps", "1", "--json", str(tmp_path / "q.json")]) == 0
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "q.json").read_text())
    assert "python -m experiments.quant_parts --numel 65536 --reps 1" in r["provenance"]["command"]
    res = r["results"]
    assert res["same_bytes"] and res["same_bytes_4"]
    assert all(v > 0 for v in res["seconds"].values())
    assert "round trip / memcpy: " + ", ".join(f"{k} bits {v:.3f}" for k, v in res["roundtrip_ratios"].items()) in out
    with pytest.raises(SystemExit):
        mod.main(["--reps", "0"])
    assert "--numel and --reps must be at least 1, got 16777216 and 0" in capsys.readouterr().err
