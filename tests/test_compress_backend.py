"""The torch.compile fast path gives the same bytes as the eager fallback, and degrades safely."""

import sys
import warnings

import pytest
import torch

import gossip.compress as gc
from gossip.compress import _kernels
from tests.conftest import requires_cuda


def _every_kernel() -> list:
    todo = [v for v in vars(_kernels).values() if isinstance(v, _kernels.Kernel)]
    todo += list(_kernels._VARIANTS.values())
    seen: dict[int, object] = {}
    while todo:
        k = todo.pop()
        if id(k) not in seen:
            seen[id(k)] = k
            todo += list(k._variants.values())
    return list(seen.values())


@pytest.fixture(autouse=True, scope="module")
def _kernels_no_earlier_file_compiled():
    """This file checks that the kernels compile and match their eager forms, so it
    starts from kernels that no earlier test file in this process compiled: a kernel that
    met torch.compile's recompile limit there (many call sites, one process) stays eager
    for the rest of the process, and would fail these checks for a reason of its own."""
    torch._dynamo.reset()
    for k in _every_kernel():
        k._compiled, k.failed, k.failure, k.verified = None, False, None, False
    yield


@pytest.fixture
def backend():
    old = _kernels.get_backend()
    yield _kernels.set_backend
    _kernels.set_backend(old)


def _both(backend, c, X, keys):
    backend("eager")
    Pe = c.encode(X, keys, tag=1)
    De = c.decode(Pe, X.shape[1], tag=1)
    backend("compile")
    Pc = c.encode(X, keys, tag=1)
    Dc = c.decode(Pc, X.shape[1], tag=1)
    return Pe, Pc, De, Dc


_COMPILE_PROBE: list[str | None] = []


def _compile_unusable() -> str | None:
    """Why torch.compile cannot build a kernel on this machine (no C++ compiler, an
    unsupported platform), or None if it can; probed once with a trivial function."""
    if not _COMPILE_PROBE:
        try:
            torch.compile(lambda x: x * 2 + 1, dynamic=True, fullgraph=True)(torch.arange(8.0))
            _COMPILE_PROBE.append(None)
        except Exception as e:  # the compiler's own error, whatever its type
            _COMPILE_PROBE.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return _COMPILE_PROBE[0]


def require_compiled(kernels) -> None:
    """After a compiled run: a kernel that gave up its compiled form must have done so
    because this machine cannot compile at all (then skip, saying so). A miscompilation
    (compiled results differ from eager) or a compile failure on a machine that can
    compile fails the test, naming the kernel and the reason."""
    failed = [k for k in kernels if k.failed]
    miscompiled = [k.name for k in failed if k.failure == _kernels.MISCOMPILED]
    if miscompiled:
        pytest.fail(f"miscompiled: the compiled form of {', '.join(miscompiled)} differs from the eager form")
    if failed:
        why = _compile_unusable()
        if why is None:
            pytest.fail("torch.compile works here, yet these kernels fell back to eager: "
                        + "; ".join(f"{k.name} ({k.failure})" for k in failed))
        pytest.skip(f"torch.compile is not usable here ({why})")


def _all_kernels():
    return [*_kernels._VARIANTS.values(), *_kernels._PLANAR.values(), _kernels.PRIORITIES,
            _kernels.MAGNITUDE_KEYS, _kernels.AFFINE, *_kernels.AFFINE._variants.values()]


def test_compiled_quant_matches_eager(backend):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 5000, generator=g) * torch.rand(3, 1, generator=g) * 10
    X[1, :50] = 0.0
    keys = torch.tensor([1, -2, 1 << 50])
    for spec in ("quant:bits=8",):
        c = gc.build(spec)
        Pe, Pc, De, Dc = _both(backend, c, X, keys)
        require_compiled(_all_kernels())
        assert torch.equal(Pe, Pc), spec
        assert torch.equal(De, Dc), spec


# Compiling costs seconds per kernel (about 23 s for these and the tie-count test on a
# quiet 2-core machine with a cold inductor cache): part of the default suite, since
# the compiled form is what `auto` runs for large tensors.
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["quant:bits=8,block=333", "quant:bits=4,block=100", "qsgd:levels=16",
                                  "ternary:block=64", "quant:bits=12", "randk:p=0.1", "topk:k=77"])
def test_compiled_other_quantizers_match_eager(backend, spec):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(2, 3001, generator=g)
    Pe, Pc, De, Dc = _both(backend, gc.build(spec), X, torch.tensor([5, 6]))
    require_compiled(_all_kernels())
    assert torch.equal(Pe, Pc) and torch.equal(De, Dc)


def test_failed_compile_falls_back_with_one_warning(backend, monkeypatch):
    k = _kernels.Kernel("always_broken", lambda x: x + 1)

    def broken(*a, **kw):
        raise RuntimeError("no C++ compiler\nmore details")

    monkeypatch.setattr(torch, "compile", broken)
    backend("compile")
    x = torch.zeros(3)
    with pytest.warns(RuntimeWarning, match=r"compiled kernel 'always_broken' unavailable \(RuntimeError: no C\+\+ compiler\); using the eager fallback"):
        assert torch.equal(_kernels.run(k, 3, x), torch.ones(3))
    assert k.failed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_kernels.run(k, 3, x), torch.ones(3))  # no second warning


def test_backend_selection(backend, monkeypatch):
    monkeypatch.setattr(_kernels, "compile_cache", _EmptyCache())  # tests/test_compress_cache.py: a warm one
    k = _kernels.Kernel("probe", lambda x: x)
    cpu = torch.device("cpu")
    backend("eager")
    assert not _kernels._want_compiled(k, 1 << 30, cpu)
    backend("compile")
    assert _kernels._want_compiled(k, 1, cpu)
    backend("auto")
    assert not _kernels._want_compiled(k, _kernels.MIN_COMPILED_NUMEL - 1, cpu)
    big = _kernels.Kernel("probe-big", lambda x: x)  # a large call is eager at first too: a fast first step
    assert not _kernels._want_compiled(big, 1 << 23, cpu)
    assert not hasattr(_kernels, "COMPILE_NOW_NUMEL")
    assert not _kernels._want_compiled(k, 1 << 30, torch.device("meta"))
    # in between: eager until the kernel's eager calls have processed EAGER_BUDGET_NUMEL
    # elements (small calls do not count), then compiled for good
    mid = _kernels.MIN_COMPILED_NUMEL
    calls = -(-_kernels.EAGER_BUDGET_NUMEL // mid)
    k2 = _kernels.Kernel("probe2", lambda x: x)
    got = [_kernels._want_compiled(k2, mid, cpu) for _ in range(calls)]
    assert got == [False] * (calls - 1) + [True]
    assert _kernels._want_compiled(k2, mid, cpu) and _kernels._want_compiled(k2, 1, cpu)
    with pytest.raises(ValueError, match=r"backend must be one of auto, compile, eager, got 'fast'"):
        _kernels.set_backend("fast")


@requires_cuda
@pytest.mark.parametrize("spec", ["quant:bits=8", "quant:bits=3,block=50", "qsgd:levels=7", "ternary", "randk:p=0.2",
                                  "topk:k=9", "sign", "blocksign:block=40", "randomblock:k=11", "fp16"])
def test_cuda_gives_the_cpu_bytes(spec):
    c = gc.build(spec)
    g = torch.Generator().manual_seed(2)
    X = torch.randn(4, 777, generator=g)
    keys = torch.tensor([1, 2, 3, 4])
    P = c.encode(X, keys)
    Pg = c.encode(X.cuda(), keys.cuda())
    assert Pg.is_cuda
    Y = c.decode(P, 777)
    Yg = c.decode(Pg, 777)
    assert Yg.is_cuda
    if c.name in ("qsgd", "sign", "blocksign"):
        # their scales are sums; CUDA's prefix sum adds in another order (last-bit differences)
        assert float((Yg.cpu() - Y).norm() / Y.norm()) < 1e-3
    else:
        assert torch.equal(Pg.cpu(), P)
        assert torch.equal(Yg.cpu(), Y)


@pytest.mark.slow
def test_compiled_quant_tie_count_path(backend, monkeypatch):
    """When the fused quant kernel reports ties, a second pass locates them: same bytes.
    (The shape of test_compiled_quant_matches_eager's input: the kernel compiled there serves.)"""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(3, 5000, generator=g)
    keys = torch.tensor([8, 9, 1 << 45])
    c = gc.build("quant:bits=8")
    backend("eager")
    Pe = c.encode(X, keys)
    backend("compile")
    real = _kernels.run

    def fake(k, numel, *args):
        res = real(k, numel, *args)
        if k.name.startswith("scale_and_round"):
            a, R, s, cnt = res
            return a, R, s, cnt + 1  # pretend there was a tie
        return res

    monkeypatch.setattr(_kernels, "run", fake)
    Pc = c.encode(X, keys)
    require_compiled(_all_kernels())
    assert torch.equal(Pe, Pc)


def test_a_miscompiled_kernel_is_caught_on_first_use(backend, monkeypatch):
    """The first compiled call is compared with the eager form; a difference disables it."""
    def eager(x, out):
        out.copy_(x * 2)
        return x + 1

    def wrong(x, out):
        out.copy_(x * 3)
        return x + 1

    k = _kernels.Kernel("miscompiled", eager)
    monkeypatch.setattr(k, "compiled", lambda: wrong)
    backend("compile")
    x, out = torch.arange(4.0), torch.zeros(4)
    with pytest.warns(RuntimeWarning, match=r"'miscompiled' unavailable \(its results differ from the eager form\)"):
        r = _kernels.run(k, 4, x, out)
    assert torch.equal(r, x + 1) and torch.equal(out, x * 2) and k.failed
    k2 = _kernels.Kernel("fine", eager)
    monkeypatch.setattr(k2, "compiled", lambda: eager)
    out2 = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _kernels.run(k2, 4, x, out2)
    assert k2.verified and not k2.failed and torch.equal(out2, x * 2)


def _twice(x):
    return x * 2


def test_a_kernel_at_the_recompile_limit_renews_its_code_then_falls_back_with_a_reason(backend, monkeypatch):
    """A kernel whose code object met torch.compile's recompile limit (calls of many
    shapes in a long process) does not stay eager unnoticed: it warns once and continues
    compiled on a fresh code object; past RECOMPILE_RENEWALS it falls back to the eager
    form, and its failure names the recompile limit."""
    if _compile_unusable():
        pytest.skip(f"torch.compile is not usable here ({_compile_unusable()})")
    with torch._dynamo.config.patch(recompile_limit=1):  # a second graph of one code object is refused
        _renewals(backend, monkeypatch)
    assert torch._dynamo.config.recompile_limit > 1  # restored for the later tests


def _renewals(backend, monkeypatch):
    backend("compile")
    k = _kernels.Kernel("renewed_probe", _twice)
    x32, x64 = torch.arange(4.0), torch.arange(4.0, dtype=torch.float64)  # another dtype: another graph
    assert torch.equal(_kernels.run(k, 4, x32), x32 * 2) and k.verified and k.recompiles == 0
    with pytest.warns(RuntimeWarning, match=r"'renewed_probe' met torch.compile's recompile limit \(1 graphs"):
        assert torch.equal(_kernels.run(k, 4, x64), x64 * 2)
    assert k.recompiles == 1 and not k.failed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per kernel, not per renewal
        assert torch.equal(_kernels.run(k, 4, x32), x32 * 2)
    assert k.recompiles == 2 and not k.failed
    monkeypatch.setattr(_kernels, "RECOMPILE_RENEWALS", 2)
    with pytest.warns(RuntimeWarning, match=r"'renewed_probe' unavailable \(torch.compile's recompile limit, met 3 times"):
        assert torch.equal(_kernels.run(k, 4, x64), x64 * 2)  # the eager form's result
    assert k.failed and k.recompiles == 2


def test_a_miscompilation_fails_the_compiled_tests_instead_of_skipping(backend, monkeypatch):
    """The compiled-vs-eager tests must fail, not skip, when a kernel was disabled for
    a miscompilation; a machine without a working compiler skips with its reason."""
    k = _kernels.Kernel("miscompiled_probe", lambda x: x + 1)
    monkeypatch.setattr(k, "compiled", lambda: (lambda x: x + 2))
    backend("compile")
    with pytest.warns(RuntimeWarning, match="differ from the eager form"):
        _kernels.run(k, 3, torch.zeros(3))
    assert k.failed and k.failure == _kernels.MISCOMPILED
    with pytest.raises(pytest.fail.Exception, match=r"miscompiled: the compiled form of miscompiled_probe differs"):
        require_compiled([k])
    # a compile error on a machine that can compile is a failure too, not a skip
    broken = _kernels.Kernel("broken_probe", lambda x: x)
    broken.failed, broken.failure = True, "RuntimeError: boom"
    monkeypatch.setattr(sys.modules[__name__], "_COMPILE_PROBE", [None])
    with pytest.raises(pytest.fail.Exception, match=r"torch.compile works here, yet .*broken_probe \(RuntimeError: boom\)"):
        require_compiled([broken])
    # only where torch.compile itself cannot build anything is it a skip, with that reason
    monkeypatch.setattr(sys.modules[__name__], "_COMPILE_PROBE", ["InvalidCxxCompiler: no working C++ compiler"])
    with pytest.raises(pytest.skip.Exception, match=r"torch.compile is not usable here \(InvalidCxxCompiler"):
        require_compiled([broken])


def _dcd_run() -> torch.Tensor:
    import topologies
    from gossip import algorithms, comm

    c = comm.SimulatedCommunicator(topologies.build("ring", 4))
    alg = algorithms.build("dcd", c, compressor="quant:bits=8")
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4, _LANE_D, generator=g)  # the lane tests' rows: the kernels compiled here serve them
    alg.setup(X)
    for _ in range(6):
        alg.step(X, torch.randn(X.shape, generator=g) * 1e-2)
    return X


class _EmptyCache:
    def holds(self, name):
        return False

    def note(self, name):
        pass


def test_switching_from_eager_to_compiled_mid_run_keeps_the_bits(backend, monkeypatch):
    """auto runs a kernel eager until its eager budget is spent, then compiled, so a run
    (and a resumed run, which switches at another step) mixes the two forms: the
    trajectory must be the all-eager one, bit for bit."""
    backend("eager")
    ref = _dcd_run()
    backend("auto")
    monkeypatch.setattr(_kernels, "compile_cache", _EmptyCache())  # a cache that holds them would compile at once
    monkeypatch.setattr(_kernels, "MIN_COMPILED_NUMEL", 1)
    monkeypatch.setattr(_kernels, "EAGER_BUDGET_NUMEL", 3 * 4 * _LANE_D)  # encode switches at step 3
    monkeypatch.setattr(_kernels, "LANES_MIN_NUMEL", 1)  # the lane kernels' pair switches too
    monkeypatch.setattr(_kernels, "LANES", True)  # on any CPU
    kernels = [*_kernels._VARIANTS.values(), *_kernels.AFFINE._variants.values()]
    for k in kernels:  # fresh budgets for the kernels earlier tests used (their compiled code stays)
        monkeypatch.setattr(k, "budget_spent", False)
        monkeypatch.setattr(k, "eager_numel", 0)
        monkeypatch.setattr(k, "cache_checked", False)
    got = _dcd_run()
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    # rows of 3 x 4096 values take the lane kernels (min/max, then rounding), which switch together
    for k in (_kernels._VARIANTS[("quant_round_lanes", (255, torch.uint8))],
              _kernels._VARIANTS[("quant_minmax", (255,))]):
        assert k.budget_spent and k.verified and not k.failed, k.name  # it did switch, and ran compiled


def test_lane_width_rows_of_a_power_of_two_from_256_to_4096():
    assert _kernels.lane_width(1 << 24) == 4096 and _kernels.lane_width(3 * 512) == 512
    assert _kernels.lane_width(256) == 256 and _kernels.lane_width(4096 * 3 + 2048) == 2048
    assert _kernels.lane_width(4001) == 0 and _kernels.lane_width(128 * 7) == 0  # the one-loop kernels


# rows of 3 x 4096 values: the lane kernels at 8 bits (rows of 4096) and at 2 and 4 bits
# (columns of 1536 = 3 x 512 codes: min/max, then rounding and packing one byte row per
# call; the planar decode); with blocks of 128 or 1024 (columns of 16 or 128, too short
# for lane rows) the one-call planar encode
_LANE_D = 3 * 4096


@pytest.fixture
def lanes(monkeypatch):
    """The lane kernels for these small inputs too (they take calls of 2**18 values or
    more), whatever this CPU's vector width (they serve 512-bit vector code only)."""
    monkeypatch.setattr(_kernels, "LANES_MIN_NUMEL", 1)
    monkeypatch.setattr(_kernels, "LANES", True)


def _lane_kernels(spec: str):
    bits = int(spec.split("bits=")[1].split(",")[0])
    L = (1 << bits) - 1
    if bits == 8:
        return [_kernels._VARIANTS[("quant_round_lanes", (255, torch.uint8))],
                _kernels._VARIANTS[("quant_minmax", (255,))]]
    if "block=" in spec:
        return [_kernels._PLANAR[("encode", bits)], _kernels._PLANAR[("decode", bits)]]
    return [_kernels._VARIANTS[("quant_planar_lanes", (bits,))], _kernels._VARIANTS[("quant_minmax", (L,))],
            _kernels._PLANAR[("decode", bits)]]


@pytest.mark.parametrize("spec", ["quant:bits=8", "quant:bits=4", "quant:bits=2", "quant:bits=4,block=128"])
def test_compiled_lane_kernels_match_eager(backend, lanes, spec):
    g = torch.Generator().manual_seed(4)
    X = torch.randn(3, _LANE_D, generator=g) * torch.tensor([[1.0], [1e-3], [50.0]])
    X[1, 100:5000] = 0.0
    X[2] = 0.25  # a constant row: range 0
    c = gc.build(spec)
    Pe, Pc, De, Dc = _both(backend, c, X, torch.tensor([11, -12, 1 << 40]))
    require_compiled(_all_kernels())
    assert all(k.verified for k in _lane_kernels(spec))  # this shape took these kernels
    assert torch.equal(Pe, Pc) and torch.equal(De, Dc)


def test_where_the_lane_kernels_do_not_pay_the_one_loop_kernel_gives_the_same_bytes(backend, monkeypatch):
    """A CPU whose vector code is narrower than 512 bits (AVX2) takes the one-loop 8-bit
    kernel for inputs the lane kernels fit: none of the lane kernels runs, and the
    bytes are the eager ones (hence the lane kernels' too, by the test above)."""
    monkeypatch.setattr(_kernels, "LANES_MIN_NUMEL", 1)
    monkeypatch.setattr(_kernels, "LANES", False)
    ran = []
    real_run = _kernels.run

    def spy(k, numel, *args):
        ran.append(k.name)
        return real_run(k, numel, *args)

    monkeypatch.setattr(_kernels, "run", spy)
    g = torch.Generator().manual_seed(6)
    X = torch.randn(3, _LANE_D, generator=g)
    Pe, Pc, De, Dc = _both(backend, gc.build("quant:bits=8"), X, torch.tensor([3, 4, 5]))
    require_compiled(_all_kernels())
    assert torch.equal(Pe, Pc) and torch.equal(De, Dc)
    assert not [n for n in ran if "lanes" in n or "minmax" in n], ran
    assert any(n.startswith("scale_and_round") for n in ran), ran


def test_the_lane_kernels_serve_512_bit_vector_code_only(monkeypatch):
    monkeypatch.setattr(_kernels, "LANES", None)
    assert _kernels.lanes_pay() is (_kernels._vector_bits() >= 512)
    monkeypatch.setattr(_kernels, "_vector_bits", lambda: 256)  # AVX2
    assert _kernels.lanes_pay() is False
    monkeypatch.setattr(_kernels, "_vector_bits", lambda: 512)  # AVX-512
    assert _kernels.lanes_pay() is True
    monkeypatch.setattr(_kernels, "LANES", False)
    assert _kernels.lanes_pay() is False


@pytest.mark.parametrize("spec", ["quant:bits=8", "quant:bits=4", "quant:bits=4,block=1024"])
def test_compiled_lane_kernels_find_and_resolve_real_ties(backend, lanes, monkeypatch, spec):
    """Inputs built so that some elements are ties (the first 24-bit digit equals
    floor(frac(t) * 2**24)): the compiled kernels must flag them, and the bytes must be
    the eager ones (which resolve ties with the further digits). The ties lie among the
    first elements, in the first block of 1024 too (its min 0 and range L are set)."""
    from gossip.compress import _random as R

    bits = int(spec.split("bits=")[1].split(",")[0])
    L = (1 << bits) - 1
    g = torch.Generator().manual_seed(5)
    keys = torch.tensor([21, 22, 23])
    X = torch.rand(3, _LANE_D, generator=g) * L
    X[:, 0], X[:, 1] = 0.0, float(L)  # min 0 and range L: t = x exactly (the step's inverse is 1)
    u = _kernels.block_digits(R.stream_seeds(keys, R.STREAM_ROUND), 1, _LANE_D, 0)[:, 0]
    placed = []
    for r in (0, 2):
        for i in (u[r, 2:] < (1 << 23)).nonzero()[:3, 0].tolist():  # ties need t < 0.5
            X[r, i + 2] = (float(u[r, i + 2]) + 0.5) * 2.0**-24  # F = u + 0.5: exact in fp32
            placed.append(i + 2)
    assert len(placed) == 6 and max(placed) < 1024  # in the first block of 1024 too
    placed = len(placed)
    seen = {"eager": 0, "compile": 0}
    real = _kernels.tie_levels

    def spy(xs, *a, **kw):  # every path resolves its ties here (the eager one chunk by chunk)
        seen[_kernels.get_backend()] += xs.numel()
        return real(xs, *a, **kw)

    monkeypatch.setattr(_kernels, "tie_levels", spy)
    c = gc.build(spec)
    Pe, Pc, De, Dc = _both(backend, c, X, keys)
    require_compiled(_all_kernels())
    assert all(k.verified for k in _lane_kernels(spec))
    assert seen == {"eager": placed, "compile": placed}, seen  # both found the six ties
    assert torch.equal(Pe, Pc) and torch.equal(De, Dc)

