"""An orderly teardown: no native thread of the process group outlives the run.

The cause of the intermittent worker abort ("terminate called without an active
exception", SIGABRT at interpreter exit): ``torch.distributed.nn.functional``, which
torch._dynamo imports on the first compiled call, binds ``group.WORLD`` when it is
imported; imported after the process group exists, it keeps gloo's threads alive past
``destroy_process_group``. ``gossip.comm.init_from_env`` imports it first, and
``gossip.comm.shutdown`` destroys the group; this test counts the process's threads.
"""

from __future__ import annotations

import re
import sys

from tests.conftest import run_process

SCRIPT = """
import os, torch
from gossip import comm

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
comm.init_from_env(backend="gloo")
t = torch.ones(1)
torch.distributed.all_reduce(t)
during = threads()
import torch.distributed.nn.functional  # what torch._dynamo does on a first compiled call
comm.shutdown()
comm.shutdown()  # idempotent
print(f"rank {os.environ['RANK']}: {before} {during} {threads()}", flush=True)
"""


def test_shutdown_joins_the_process_groups_threads(tmp_path):
    script = tmp_path / "teardown.py"
    script.write_text(SCRIPT)
    r = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     str(script)], timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # the two ranks print at once: their lines may run into each other, so match, not split
    found = re.findall(r"rank (\d+): (\d+) (\d+) (\d+)", r.stdout)
    assert sorted(f[0] for f in found) == ["0", "1"], r.stdout
    for rank, *counts in found:
        before, during, after = map(int, counts)
        ln = f"rank {rank}: {before} {during} {after}"
        assert during > before, ln  # gloo's threads were there
        assert after == before, ln  # and are gone
