"""An orderly teardown: no native thread of the process group outlives the run.

The hazard (the intermittent worker abort "terminate called without an active
exception", SIGABRT, after a successful run): gloo's worker thread drops a finished
collective's work, and with it the tensor, a moment after Python has stopped waiting. If
Python no longer references that tensor, the drop frees a Python object and needs the
GIL; a worker thread still alive while the interpreter finalizes is then ended by
CPython with ``pthread_exit`` inside a C++ destructor and the process aborts (backtrace:
``ProcessGroupGloo::runLoop`` > ``~AsyncAllreduceWork`` > ``TensorImpl::decref_pyobject``
> ``gil_scoped_acquire`` > ``take_gil`` > ``pthread_exit`` > ``std::terminate``). The
threads outlive ``destroy_process_group`` whenever something else references the group:
``torch.distributed.nn.functional``'s default arguments do when it is imported after the
group exists (torch._dynamo imports it on a first compiled call). ``gossip.comm.shutdown``
drops that reference, so the group's threads are joined before it returns.
"""

from __future__ import annotations

import re
import sys

from tests.conftest import child_env, run_process, torchrun, why

GLOO_THREADS = """
import os
def gloo_threads():
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sum(n in ("pt_gloo_runloop", "gloo_tcp_loop") for n in names)
"""

# A user's own script: init_process_group without gossip's early import, the module
# imported after the group (its defaults bind it), a collective whose tensor only gloo's
# worker holds when the group is torn down (the peer joins it late).
IN_FLIGHT = GLOO_THREADS + """
import time, torch, torch.distributed as dist
from gossip import comm
dist.init_process_group("gloo")
import torch.distributed.nn.functional  # what torch._dynamo does on a first compiled call
rank = dist.get_rank()
t = torch.ones(1 << 10)
if rank == 0:
    w = dist.all_reduce(t, async_op=True)
    del t, w  # gloo's worker thread holds the last reference to the tensor
else:
    time.sleep(1.0)
    dist.all_reduce(t)
during = gloo_threads()
comm.shutdown()
comm.shutdown()  # idempotent
print(f"rank {rank}: {during} {gloo_threads()}", flush=True)
"""

# One process, two groups: the plain destroy_process_group leaves the threads of a group
# that torch.distributed.nn.functional holds (torch 2.13: "destroy_process_group: 3 3");
# gossip.comm.shutdown joins them.
ONE_PROCESS = GLOO_THREADS + """
import importlib, tempfile, torch, torch.distributed as dist
import torch.distributed.nn.functional as F
from gossip import comm
d = tempfile.mkdtemp()
for k, end in enumerate((dist.destroy_process_group, comm.shutdown)):
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, str(k)), 1), rank=0, world_size=1)
    importlib.reload(F)  # as if imported now, after the group exists: its defaults bind it
    dist.all_reduce(torch.ones(4))
    during = gloo_threads()
    end()
    print(f"{end.__name__}: {during} {gloo_threads()}", flush=True)
"""


def test_shutdown_joins_threads_of_a_group_torch_still_references(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(ONE_PROCESS)
    r = run_process([sys.executable, str(script)], timeout=120, cwd=tmp_path, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    found = dict((name, (int(a), int(b))) for name, a, b in re.findall(r"(\w+): (\d+) (\d+)", r.stdout))
    assert set(found) == {"destroy_process_group", "shutdown"}, r.stdout
    during, after = found["shutdown"]
    assert during > 0 and after == 0, r.stdout  # gloo's threads were there, and are joined


def test_shutdown_with_a_collective_in_flight_joins_and_exits_cleanly(tmp_path):
    script = tmp_path / "in_flight.py"
    script.write_text(IN_FLIGHT)
    r = torchrun(2, str(script), timeout=180, cwd=tmp_path)
    assert r.returncode == 0, why(r)
    assert "terminate called" not in r.stderr, why(r)
    found = re.findall(r"rank (\d+): (\d+) (\d+)", r.stdout)
    assert sorted(f[0] for f in found) == ["0", "1"], r.stdout
    for rank, during, after in found:
        assert int(during) > 0 and int(after) == 0, f"rank {rank}: gloo threads {during} -> {after}"
