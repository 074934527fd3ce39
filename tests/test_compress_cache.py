"""auto's rule knows the compile cache: a kernel whose compiled form inductor's cache holds
compiles at its first call; with an empty cache the first calls stay eager (a fast first
step). The rule is tested with a fake cache, the record of the cache on a temporary
folder, and once end to end with real compiles in child processes."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from gossip.compress import _kernels
from tests.conftest import REPO, child_env, run_process

CPU = torch.device("cpu")


class FakeCache:
    """A compile cache that holds the kernels named in ``held`` and counts the questions."""

    def __init__(self, *held):
        self.held = set(held)
        self.asked: list[str] = []
        self.noted: list[str] = []

    def holds(self, name):
        self.asked.append(name)
        return name in self.held

    def note(self, name):
        self.noted.append(name)
        self.held.add(name)


@pytest.fixture
def auto(monkeypatch):
    old = _kernels.set_backend("auto")
    yield monkeypatch
    _kernels.set_backend(old)


def _probe(name):
    return _kernels.Kernel(name, lambda x: x)


def test_a_kernel_held_by_the_cache_compiles_at_its_first_call(auto):
    cache = FakeCache("warm")
    auto.setattr(_kernels, "compile_cache", cache)
    big = _kernels.MIN_COMPILED_NUMEL
    warm, cold = _probe("warm"), _probe("cold")
    assert _kernels._want_compiled(warm, big, CPU)
    assert warm.budget_spent and _kernels._want_compiled(warm, 1, CPU)  # for good, small calls too
    # not held: the eager budget, as with no cache at all
    assert not _kernels._want_compiled(cold, big, CPU)
    assert cold.eager_numel == big and not cold.budget_spent
    assert cache.asked == ["warm", "cold"]
    # asked once per kernel and process, at its first call that could compile
    cache.held.add("cold")
    assert not _kernels._want_compiled(cold, big, CPU)
    assert cache.asked == ["warm", "cold"]


def test_the_cache_is_not_asked_where_nothing_would_compile(auto):
    cache = FakeCache("k")
    auto.setattr(_kernels, "compile_cache", cache)
    k = _probe("k")
    assert not _kernels._want_compiled(k, _kernels.MIN_COMPILED_NUMEL - 1, CPU)  # small calls stay eager
    assert not _kernels._want_compiled(k, 1 << 30, torch.device("meta"))  # eager off the CPU
    _kernels.set_backend("eager")
    assert not _kernels._want_compiled(k, 1 << 30, CPU)
    _kernels.set_backend("compile")
    assert _kernels._want_compiled(k, 1, CPU)  # compiled anyway
    assert cache.asked == []
    _kernels.set_backend("auto")
    k.failed = True  # a kernel whose compiled form failed stays eager
    assert not _kernels._want_compiled(k, 1 << 30, CPU) and cache.asked == []


def test_an_empty_cache_keeps_the_first_calls_eager_however_large(auto):
    auto.setattr(_kernels, "compile_cache", FakeCache())
    k = _probe("large")
    assert not _kernels._want_compiled(k, _kernels.EAGER_BUDGET_NUMEL - 1, CPU)  # a very large first step: eager
    assert _kernels._want_compiled(k, 1, CPU) is False  # small calls do not count
    assert _kernels._want_compiled(k, 1, CPU) is False
    assert _kernels._want_compiled(k, _kernels.MIN_COMPILED_NUMEL, CPU)  # the budget is spent: compiled


def test_followers_share_their_deciders_warm_start(auto):
    """Kernels that run on another's decision (quant's lane kernels, the one-loop kernel
    on a CPU where the lanes do not pay) compile when it does, and their verified compile
    marks it as held."""
    auto.setattr(_kernels, "compile_cache", FakeCache("decider"))
    d, f = _probe("decider"), _probe("follower")
    assert _kernels._want_compiled(d, _kernels.MIN_COMPILED_NUMEL, CPU)
    _kernels._follow(f, d)
    assert f.budget_spent and f.deciders == {d}
    assert _kernels._want_compiled(f, _kernels.MIN_COMPILED_NUMEL, CPU)


def _fake_compile(monkeypatch, k, counts, result=None):
    """k compiles to its eager form (or to ``result``), and inductor's counters move by
    ``counts`` = ((stores or hits, bypasses) before, after)."""
    monkeypatch.setattr(k, "compiled", lambda: (result or k.eager))
    seq = iter(counts)
    monkeypatch.setattr(_kernels, "_fx_cache_counts", lambda: next(seq))


def test_a_verified_compile_that_inductor_stored_is_noted_with_its_deciders(auto):
    cache = FakeCache()
    auto.setattr(_kernels, "compile_cache", cache)
    d = _probe("decider")
    k = _kernels.Kernel("k", lambda x: x + 1)
    _kernels._follow(k, d)
    _fake_compile(auto, k, [(3, 0), (4, 0)])
    _kernels.set_backend("compile")
    assert torch.equal(_kernels.run(k, 3, torch.zeros(3)), torch.ones(3))
    assert k.verified and sorted(cache.noted) == ["decider", "k"]


@pytest.mark.parametrize("counts,why", [([(3, 0), (3, 1)], "inductor bypassed its cache"),
                                        ([(3, 0), (3, 0)], "no cache event")])
def test_nothing_is_noted_when_inductor_did_not_cache_the_graph(auto, counts, why):
    cache = FakeCache()
    auto.setattr(_kernels, "compile_cache", cache)
    k = _kernels.Kernel("k", lambda x: x + 1)
    _fake_compile(auto, k, counts)
    _kernels.set_backend("compile")
    _kernels.run(k, 3, torch.zeros(3))
    assert k.verified and cache.noted == [], why


def test_a_miscompiled_kernel_is_not_noted(auto):
    cache = FakeCache()
    auto.setattr(_kernels, "compile_cache", cache)
    k = _kernels.Kernel("k", lambda x: x + 1)
    _fake_compile(auto, k, [(3, 0), (4, 0)], result=lambda x: x + 2)
    _kernels.set_backend("compile")
    with pytest.warns(RuntimeWarning, match="differ from the eager form"):
        _kernels.run(k, 3, torch.zeros(3))
    assert k.failed and cache.noted == []


def test_the_record_lives_in_inductors_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))
    for v in ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_COMPILE_FORCE_DISABLE_CACHES",
              "TORCHINDUCTOR_FX_GRAPH_CACHE"):
        monkeypatch.delenv(v, raising=False)
    c = _kernels.MarkerCache()
    assert not c.holds("k")
    c.note("k")
    assert c.holds("k") and not c.holds("other")
    assert c.folder().parent.parent == tmp_path / "a"  # inside inductor's folder: cleared with it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "b"))  # a fresh inductor cache holds nothing
    assert not c.holds("k")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # inductor's cache off: nothing is held
    assert not c.holds("k")
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE")
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    assert not c.holds("k")
    c2 = _kernels.MarkerCache()
    c2.note("k2")  # and nothing is written
    monkeypatch.delenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES")
    assert not c2.holds("k2")


def test_a_record_that_cannot_be_written_is_left_alone(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker))  # a file: no folder can be made in it
    c = _kernels.MarkerCache()
    c.note("k")
    assert not c.holds("k")


def test_the_cache_folder_is_inductors(monkeypatch, tmp_path):
    from torch._inductor.runtime import cache_dir_utils

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert _kernels.inductor_cache_dir() == os.path.abspath(cache_dir_utils.default_cache_dir())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "x"))
    assert _kernels.inductor_cache_dir() == str(tmp_path / "x")


def test_the_record_names_the_torch_version_and_the_kernels_sources():
    tag = _kernels._sources_tag()
    assert len(tag) == 16 and _kernels.MarkerCache().folder().name == tag


_CHILD = r"""
import json, sys, time
import torch
import gossip.compress as gc
from gossip.compress import _kernels
torch.set_num_threads(1)
c = gc.build("quant:bits=8")
x = torch.randn(1, 1 << 17, generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter()
P = c.encode(x, torch.tensor([1]))
dt = time.perf_counter() - t0
compiled = sorted(k.name for k in _kernels._VARIANTS.values() if k.verified)
print(json.dumps({"compiled": compiled, "seconds": dt}))
"""


@pytest.mark.slow
def test_a_warm_cache_compiles_at_the_first_call_end_to_end(tmp_path):
    """A process that compiled quant's kernels leaves the cache warm: the next process in
    auto mode runs them compiled from its first call; a fresh cache folder does not."""
    def child(cache, backend):
        env = child_env(extra={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "GOSSIP_COMPRESS_BACKEND": backend})
        for v in ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_COMPILE_FORCE_DISABLE_CACHES",
                  "TORCHINDUCTOR_FX_GRAPH_CACHE"):
            env.pop(v, None)
        r = run_process([sys.executable, "-c", _CHILD], timeout=600, cwd=REPO, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    primed = child("a", "compile")
    assert primed["compiled"]
    warm = child("a", "auto")
    assert warm["compiled"] == primed["compiled"]  # the same kernels, compiled at the first call
    # an empty cache folder (while another is warm): the first call is eager
    assert child("b", "auto")["compiled"] == []


def test_the_cold_start_table_has_a_row_per_cache_state():
    from experiments import tables

    rows = [{"compressor": "quant:bits=8", "cache": "empty", "backend": "auto", "first_s": 0.81, "second_s": 0.12,
             "compiled_first": False},
            {"compressor": "quant:bits=8", "cache": "empty", "backend": "compile", "first_s": 13.9, "second_s": 0.05,
             "compiled_first": True},
            {"compressor": "quant:bits=8", "cache": "warm", "backend": "auto", "first_s": 2.1, "second_s": 0.05,
             "compiled_first": True}]
    res = {"numel": 1 << 23, "threads": 1, "backend": "auto", "inductor_cache": "per row", "torch": "2.x",
           "target_first_s": 5.0, "rows": rows}
    lines = tables.cold_start_table(res).splitlines()
    assert lines[2] == ("| compressor (8,388,608 values, 1 thread) | inductor cache | backend | compiled in the first "
                        "call | first encode+decode | second | first under 5 s |")
    assert lines[3] == "|---|---|---|---|---|---|---|"
    assert lines[4] == "| quant:bits=8 | empty | `auto` | no | 0.81 s | 0.12 s | yes |"
    assert lines[5] == "| quant:bits=8 | empty | `compile` | yes | 13.90 s | 0.05 s | **no** |"
    assert lines[6] == "| quant:bits=8 | warm | `auto` | yes | 2.10 s | 0.05 s | yes |"


def test_cold_start_measures_each_cache_state_in_a_child_process(tmp_path, monkeypatch, capsys):
    from experiments import _provenance, cold_start

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the children get a folder of their own
    path = tmp_path / "cold.json"
    assert cold_start.main(["quant:bits=8", "identity", "--numel", "4096", "--caches", "empty",
                            "--results", str(path)]) == 0
    res, _ = _provenance.read(path)
    assert res["inductor_cache"] == "per row"
    assert [(r["compressor"], r["cache"], r["backend"], r["compiled_first"]) for r in res["rows"]] == [
        ("quant:bits=8", "empty", "auto", False), ("identity", "empty", "auto", False)]
    assert not (tmp_path / "mine").exists()
    out = capsys.readouterr().out
    assert "| quant:bits=8 | empty | `auto` | no |" in out
    with pytest.raises(SystemExit) as e:
        cold_start.main(["identity", "--caches", "hot"])
    assert e.value.code == 2 and "--caches takes empty, warm or empty,warm, got 'hot'" in capsys.readouterr().err
