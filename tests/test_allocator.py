"""gossip.allocator: glibc keeps freed memory for the next step, unless the user chose.

Each case runs in its own process (the setting is process-wide), which allocates and
frees a block of 64 MiB the way torch's CPU allocator does (``posix_memalign``) and
reads glibc's own counters (``mallinfo2``): whether the block came from ``mmap`` and
whether the heap gave it back to the OS at ``free``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import ctypes, ctypes.util, json, sys
from gossip.allocator import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallinfo2.restype = Mallinfo2
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
said = keep_freed_memory() if sys.argv[1] == "call" else "not called"
size = 64 << 20
p = ctypes.c_void_p()
assert libc.posix_memalign(ctypes.byref(p), 64, size) == 0
ctypes.memset(p, 1, size)
live = libc.mallinfo2()
libc.free(p)
freed = libc.mallinfo2()
print(json.dumps({"said": said, "mmapped_live": live.hblkhd, "heap_live": live.arena, "heap_freed": freed.arena}))
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="mallopt and mallinfo2 are glibc's")


def _probe(call: bool, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", PROBE, "call" if call else "skip"], env=environ,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@glibc
def test_a_large_block_comes_from_the_heap_and_stays_there_after_free():
    before = _probe(call=False)
    assert before["mmapped_live"] >= 64 << 20, "glibc's default serves a 64 MiB block by mmap"
    kept = _probe(call=True)
    assert kept["said"] == "kept"
    assert kept["mmapped_live"] < 64 << 20  # not mmapped: from the heap
    assert kept["heap_live"] >= 64 << 20
    # freed, it stays in the process for the next allocation (no trim back to the OS)
    assert kept["heap_freed"] >= 64 << 20


@glibc
@pytest.mark.parametrize("env, why", [
    ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"MALLOC_MMAP_MAX_": "65536"}, "MALLOC_MMAP_MAX_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}, "GLIBC_TUNABLES sets glibc.malloc"),
])
def test_the_users_own_malloc_tuning_is_left_alone(env, why):
    r = _probe(call=True, **env)
    assert r["said"] == f"left alone: {why}"
    assert r["mmapped_live"] >= 64 << 20  # glibc's behaviour, as the user asked


def test_a_preloaded_allocator_is_left_alone_and_the_answer_is_given_once():
    from gossip import allocator

    assert allocator._user_choice({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == \
        "LD_PRELOAD is set (another allocator may be loaded)"
    assert allocator._user_choice({"LD_PRELOAD": " "}) is None
    assert allocator._user_choice({}) is None
    first = allocator.keep_freed_memory()
    assert allocator.keep_freed_memory({"MALLOC_MMAP_MAX_": "1"}) == first  # once per process


def test_the_training_cli_keeps_freed_memory(monkeypatch):
    """gossip.train asks for it first: a flag argparse refuses comes after it."""
    from gossip import allocator, train

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or "kept")
    with pytest.raises(SystemExit):
        train.main(["--topology", "no-such-graph"])
    assert calls == [1]
