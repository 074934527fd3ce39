"""The virtual cluster (experiments/vcluster.py): shaped rates, counters, teardown, refusals.

These build real network namespaces, so they need root (CAP_NET_ADMIN and
CAP_SYS_ADMIN), ``ip`` and ``tc``; elsewhere they are skipped with the reason. All
traffic stays between the namespaces a test creates, on a private subnet, and every
test uses its own name prefix so that parallel runs cannot collide.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, default_sigint

from experiments import vcluster as vcl  # noqa: E402

VCLUSTER = ["-m", "experiments.vcluster"]


def _netns_reason() -> str | None:
    """Why namespaces cannot be built here, or None if they can."""
    try:
        vcl.check_rights()
    except vcl.VClusterError as e:
        return str(e)
    name = f"tprobe{secrets.token_hex(3)}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"cannot create a network namespace here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


_REASON = _netns_reason()
needs_netns = pytest.mark.skipif(
    _REASON is not None, reason=f"virtual-cluster tests need network namespaces and tc: {_REASON}"
)


def _prefix() -> str:
    return "t" + secrets.token_hex(3)[:5]


def _ours(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


@pytest.fixture
def prefix():
    p = _prefix()
    yield p
    left = _ours(p)
    if left:  # never leave anything behind, even when a test fails
        vcl.cleanup(p)
    assert not left, f"namespaces left behind: {left}"


# A bounded sender/receiver pair: the receiver accepts up to SENDERS connections on
# its own address, reads exactly NBYTES from each and acknowledges; the sender
# connects (retrying while the receiver starts) and reports the time from its first
# byte to the receiver's acknowledgement; the receiver prints, per connection, the
# bytes and the times of the first and the last byte. Everything gives up after 20 s.
XFER = r"""
import socket, sys, threading, time
mode, addr, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
deadline = time.monotonic() + 20
if mode == "recv":
    senders = int(sys.argv[5])
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port)); srv.listen(senders); srv.settimeout(20)
    def serve(c):
        got, first = 0, None
        c.settimeout(20)
        while got < nbytes:
            b = c.recv(min(1 << 16, nbytes - got))
            if not b: break
            first = first or time.perf_counter()
            got += len(b)
        c.sendall(b"k"); c.close()
        print("received", got, first, time.perf_counter(), flush=True)
    ts = []
    for _ in range(senders):
        c, _ = srv.accept(); t = threading.Thread(target=serve, args=(c,)); t.start(); ts.append(t)
    for t in ts: t.join()
else:
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=1); break
        except OSError:
            if time.monotonic() > deadline: raise
            time.sleep(0.02)
    s.settimeout(20)
    buf = b"\x00" * (1 << 16); sent = 0; t0 = time.perf_counter()
    while sent < nbytes:
        k = min(len(buf), nbytes - sent); s.sendall(buf[:k]); sent += k
    assert s.recv(1) == b"k"
    print(sent, time.perf_counter() - t0, flush=True)
"""


def _xfer_cmds(tmp_path: Path, vc, plan: dict[int, list[str]]) -> list[list[str]]:
    script = tmp_path / "xfer.py"
    script.write_text(XFER)
    return [[sys.executable, str(script), *plan[k]] if k in plan else ["true"] for k in range(vc.n)]


def _receiver_span(res, rank: int) -> float:
    """Seconds from the first byte of any connection to the last byte of all of them."""
    rows = [ln.split() for ln in res.ranks[rank].stdout.read_text().splitlines() if ln.startswith("received")]
    return max(float(r[3]) for r in rows) - min(float(r[2]) for r in rows)


def _sender_seconds(res, rank: int) -> tuple[int, float]:
    lines = [ln for ln in res.ranks[rank].stdout.read_text().splitlines() if not ln.startswith("#")]
    sent, secs = lines[-1].split()
    return int(sent), float(secs)


# TCP/IPv4 over Ethernet with timestamps: 66 bytes of headers per 1448 of payload
OVERHEAD = 1514 / 1448


@needs_netns
def test_shaped_rate_and_counters(tmp_path, prefix):
    rate = 20_000_000  # bit/s
    nbytes = 1_500_000
    with vcl.VirtualCluster(3, rate="20mbit", prefix=prefix) as vc:
        assert vc.latency_mode == "none"
        h1 = vc.hosts[1].addr
        # one flow, host 0 -> host 1
        res = vc.run(_xfer_cmds(tmp_path, vc, {0: ["send", h1, "5000", str(nbytes)],
                                               1: ["recv", h1, "5000", str(nbytes), "1"]}),
                     timeout=30, outdir=tmp_path / "one")
        assert res.ok, res.tail(0) + res.tail(1)
        sent, secs = _sender_seconds(res, 0)
        assert sent == nbytes
        ideal = nbytes * 8 / rate * OVERHEAD  # 0.63 s on the wire
        assert 0.85 * ideal <= secs <= 1.6 * ideal + 0.3, (secs, ideal)
        # the interfaces counted what was sent, plus headers, handshakes and acks
        tx0, rx1 = res.ranks[0].tx_bytes, res.ranks[1].rx_bytes
        assert nbytes <= tx0 <= nbytes * 1.08 + 20_000, tx0
        assert nbytes <= rx1 <= nbytes * 1.08 + 20_000, rx1
        assert res.ranks[1].tx_bytes < 0.05 * nbytes  # acknowledgements only
        assert res.ranks[2].tx_bytes < 2_000 and res.ranks[2].rx_bytes < 2_000
        info = json.loads((tmp_path / "one" / "cluster.json").read_text())
        assert info["ranks"][0]["tx_bytes"] == tx0 and info["rate"] == "20mbit"

        # incast: hosts 1 and 2 send to host 0 at once; host 0's shaped ingress
        # (the bridge side of its link) holds both to one link rate together
        h0 = vc.hosts[0].addr
        res = vc.run(_xfer_cmds(tmp_path, vc, {0: ["recv", h0, "5001", str(nbytes // 2), "2"],
                                               1: ["send", h0, "5001", str(nbytes // 2)],
                                               2: ["send", h0, "5001", str(nbytes // 2)]}),
                     timeout=30, outdir=tmp_path / "incast")
        assert res.ok, res.tail(0) + res.tail(1) + res.tail(2)
        span = _receiver_span(res, 0)
        assert 0.85 * ideal <= span <= 1.6 * ideal + 0.3, (span, ideal)  # not 2x the link rate
        assert nbytes <= res.ranks[0].rx_bytes <= nbytes * 1.08 + 40_000
    assert _ours(prefix) == []


@needs_netns
def test_torchrun_environment_per_rank(tmp_path, prefix):
    show = "import os; print(*[os.environ[k] for k in ('RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','MASTER_ADDR','MASTER_PORT','GLOO_SOCKET_IFNAME')])"
    with vcl.VirtualCluster(2, prefix=prefix, subnet="10.213.78.0/24", master_port=29555,
                            tcp_cc=("nosuch", "reno")) as vc:
        res = vc.run([sys.executable, "-c", show], timeout=20, outdir=tmp_path)
        assert vc.tcp_cc_used == "reno"  # the first allowed one (reno is always built in)
    assert res.ok
    for k in range(2):
        last = res.ranks[k].stdout.read_text().splitlines()[-1].split()
        assert last == [str(k), "0", "2", "1", "10.213.78.1", "29555", f"{prefix}h{k}"]


@needs_netns
def test_refuses_unknown_congestion_control(prefix):
    with pytest.raises(vcl.VClusterError, match=r"none of the TCP congestion controls nosuch is allowed"):
        with vcl.VirtualCluster(2, prefix=prefix, tcp_cc="nosuch"):
            pass
    assert _ours(prefix) == []


@needs_netns
def test_teardown_when_a_rank_fails(tmp_path, prefix):
    with vcl.VirtualCluster(2, rate="50mbit", prefix=prefix) as vc:
        assert len(_ours(prefix)) == 3  # two hosts and the bridge
        cmds = [["sleep", "30"], [sys.executable, "-c", "import sys; sys.exit(3)"]]
        t0 = time.perf_counter()
        res = vc.run(cmds, timeout=20, outdir=tmp_path, fail_grace=0.5)
        assert time.perf_counter() - t0 < 10
    assert not res.ok
    assert res.ranks[1].returncode == 3 and res.ranks[0].killed
    assert _ours(prefix) == []


@needs_netns
def test_teardown_on_exception_and_idempotent(prefix):
    vc = vcl.VirtualCluster(2, prefix=prefix)
    with pytest.raises(RuntimeError, match="boom"):
        with vc:
            vc.popen(0, ["sleep", "30"])
            raise RuntimeError("boom")
    assert _ours(prefix) == []
    vc.down()  # a second teardown is harmless
    assert vcl.cleanup(prefix) == []


@needs_netns
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_cli_tears_down_on_signal(tmp_path, prefix, sig, code):
    p = subprocess.Popen(
        [sys.executable, *VCLUSTER, "--nodes", "2", "--prefix", prefix, "--out", str(tmp_path),
         "--", "sleep", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint, cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 15
        while not (tmp_path / "rank1.out").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_ours(prefix)) == 3
        p.send_signal(sig)
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    assert "torn down" in err
    assert _ours(prefix) == []


@needs_netns
def test_refuses_existing_prefix(prefix):
    subprocess.run(["ip", "netns", "add", f"{prefix}-h0"], check=True)
    try:
        with pytest.raises(vcl.VClusterError, match=r"already exist .*--cleanup --prefix " + prefix):
            with vcl.VirtualCluster(2, prefix=prefix):
                pass
        assert _ours(prefix) == [f"{prefix}-h0"]  # the refusal touched nothing
        p = subprocess.run([sys.executable, *VCLUSTER, "--nodes", "2", "--prefix", prefix, "--", "true"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        assert p.returncode == 2
        assert len(p.stderr.strip().splitlines()) == 1 and "already exist" in p.stderr
    finally:
        assert vcl.cleanup(prefix) == [f"{prefix}-h0"]


def test_refuses_without_rights(monkeypatch):
    monkeypatch.setattr(vcl, "_cap_eff", lambda: 0)
    with pytest.raises(vcl.VClusterError, match="needs root .*CAP_NET_ADMIN"):
        vcl.check_rights()
    monkeypatch.setattr(vcl.shutil, "which", lambda tool: None if tool == "tc" else "/bin/" + tool)
    with pytest.raises(vcl.VClusterError, match="`tc` not found"):
        vcl.check_rights()


@pytest.mark.parametrize("kw, match", [
    ({"rate": "5mb"}, r"bad rate '5mb': 'mb' does not say bits or bytes: write 5mbit for bits or 5mbps for bytes"),
    ({"rate": "0mbit"}, r"bad rate '0mbit'"),
    ({"delay": "20"}, r"bad delay '20': expected .*us, ms or s \(e.g. 20ms"),
    ({"delay": "-1ms"}, r"bad delay '-1ms'"),
    ({"jitter": "1ms"}, r"a jitter needs a delay"),
    ({"prefix": "Bad-Prefix"}, r"bad prefix 'Bad-Prefix'"),
    ({"subnet": "8.8.8.0/24"}, r"private IPv4"),
    ({"subnet": "10.1.2.0/30", "n": 4}, r"room for 2 hosts, 4 requested"),
])
def test_bad_values(kw, match):
    n = kw.pop("n", 2)
    with pytest.raises(vcl.VClusterError, match=match):
        vcl.VirtualCluster(n, **kw)


def test_value_parsing():
    assert vcl.parse_rate("5mbit") == 5_000_000
    assert vcl.parse_rate("1.4gbit") == 1_400_000_000
    assert vcl.parse_rate("200KBIT") == 200_000
    assert vcl.parse_rate("5mbps") == 40_000_000  # tc's bps units are bytes per second (gossip.tools.units.tc_rate)
    assert vcl.parse_rate("1kibit") == 1024
    assert vcl.format_rate(1_400_000_000) == "1400mbit"
    assert vcl.parse_time("0.13ms") == pytest.approx(0.13e-3)
    assert vcl.parse_time("130us") == pytest.approx(0.13e-3)
    assert vcl.parse_time("1s") == 1.0


def test_cli_bad_rate_is_one_line():
    p = subprocess.run([sys.executable, *VCLUSTER, "--nodes", "2", "--rate", "5mb", "--", "true"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "vcluster: error: bad rate '5mb': 'mb' does not say bits or bytes: write 5mbit for bits or 5mbps for bytes "
        "per second (expected a positive rate in tc's units: bit, kbit, mbit, gbit, tbit (bits per second), bps, "
        "kbps, mbps, gbps, tbps (BYTES per second, as tc reads them)")


def test_emulating_command():
    """Where netem is missing, a gossip.train command is made to emulate the latency."""
    assert vcl._emulating_command(["python", "worker.py"], "5") is None  # not gossip.train: env only
    cmd, how = vcl._emulating_command(["python", "-m", "gossip.train", "--algo", "dcd"], "20")
    assert cmd == ["python", "-m", "gossip.train", "--algo", "dcd", "--emulate-latency", "20"]
    assert vcl._emulating_command(cmd, "20") is None  # already there: left alone
