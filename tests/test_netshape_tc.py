"""experiments/tc_shape.sh: value checks, refusals, apply/clear on a namespace's veth.

Value checks and refusals need no rights (they fail before tc is touched). Applying
and clearing run on a veth pair inside a network namespace the test creates, never
on the machine's own interfaces; they need root and are skipped with the reason
elsewhere.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest

from tests.conftest import REPO

TC_SHAPE = REPO / "experiments" / "tc_shape.sh"
BASH = shutil.which("bash") or "/bin/bash"


def tc_shape(*args: str, env: dict | None = None, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), BASH, str(TC_SHAPE), *args], capture_output=True, text=True,
                          timeout=60, env=env)


def _one_line(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.mark.parametrize("args, match", [
    (["--rate", "5mb"], "bad --rate '5mb': expected a positive number and a unit bit, kbit, mbit or gbit (e.g. 5mbit, 1.4gbit, 200kbit)"),
    (["--rate", "1.4gbits"], "bad --rate '1.4gbits'"),
    (["--rate", "0mbit"], "bad --rate '0mbit'"),
    (["--rate", "fast"], "bad --rate 'fast'"),
    (["--delay", "20"], "bad --delay '20': expected a non-negative number and a unit us, ms or s (e.g. 20ms, 0.13ms, 130us)"),
    (["--delay", "-5ms"], "bad --delay '-5ms'"),
    (["--jitter", "2 ms"], "bad --jitter '2 ms'"),
    (["--loss", "101"], "bad --loss '101': expected a percentage from 0 to 100"),
    (["--jitter", "1ms"], "--jitter 1ms needs a --delay"),
])
def test_bad_values_one_line(args, match):
    # --dry-run: checked without rights and without touching any interface
    p = tc_shape("apply", "--dev", "eth0", "--dry-run", *args)
    assert p.returncode == 2
    assert match in _one_line(p)


def test_usage_errors():
    p = tc_shape("shape", "--dev", "eth0")
    assert p.returncode == 2 and "unknown action 'shape'" in p.stderr
    p = tc_shape("apply", "--rate", "5mbit")
    assert p.returncode == 2 and "apply needs --dev DEV" in _one_line(p)
    p = tc_shape("apply", "--dev", "eth0", "--dry-run")
    assert p.returncode == 2 and "at least one of --rate" in _one_line(p)


def test_dry_run_prints_the_netem_and_tbf_commands():
    p = tc_shape("apply", "--dev", "eth0", "--rate", "1.4gbit", "--delay", "0.13ms", "--jitter", "10us",
                 "--loss", "0.1%", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "+ tc qdisc del dev eth0 root" in p.stdout
    assert ("+ tc qdisc add dev eth0 root handle 1: netem delay 130us 10us distribution normal "
            "loss 0.1% rate 1400000000bit") in p.stdout
    p = tc_shape("apply", "--dev", "v0", "--netns", "somens", "--rate", "5mbit", "--dry-run")
    assert "+ tc -n somens qdisc add dev v0 root handle 1: tbf rate 5000000bit burst 16384 limit 1250000" in p.stdout


def test_refuses_without_tc(tmp_path):
    # a PATH with neither tc nor ip
    p = tc_shape("apply", "--dev", "eth0", "--rate", "5mbit", env={"PATH": str(tmp_path)})
    assert p.returncode == 3
    assert _one_line(p) == "tc_shape.sh: tc not found in PATH; install iproute2 (it provides tc and ip)"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="dropping rights needs root and setpriv (util-linux) to run as nobody")
def test_refuses_without_rights():
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
              "--bounding-set=-all"]
    p = tc_shape("clear", "--dev", "lo", prefix=nobody)
    if p.stderr.startswith("setpriv:"):
        pytest.skip(f"cannot switch to nobody here: {p.stderr.strip()}")
    if p.returncode == 126 or "Permission denied" in p.stderr:
        pytest.skip(f"nobody cannot run the script from this checkout: {p.stderr.strip()}")
    assert p.returncode == 3
    assert "needs root or CAP_NET_ADMIN" in _one_line(p) and "uid 65534" in p.stderr


def _rights_reason() -> str | None:
    if os.geteuid() != 0:
        return f"running as uid {os.geteuid()}, shaping needs root"
    for tool in ("tc", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` not installed (iproute2)"
    return None


@pytest.fixture
def veth():
    """A veth pair inside a fresh namespace: (netns, dev)."""
    reason = _rights_reason()
    if reason:
        pytest.skip(f"applying qdiscs needs root and iproute2: {reason}")
    ns = "t" + secrets.token_hex(3)[:5] + "-tc"
    p = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {p.stderr.strip()}")
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "va", "up"], check=True)
        yield ns, "va"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _root_qdisc(ns: str, dev: str) -> str:
    out = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    return next(line for line in out.splitlines() if " root " in line)


def _has_netem() -> bool:
    p = tc_shape("probe")
    return "netem=yes" in p.stdout


def test_apply_show_clear(veth):
    ns, dev = veth
    p = tc_shape("apply", "--netns", ns, "--dev", dev, "--rate", "20mbit")
    assert p.returncode == 0, p.stderr
    assert _root_qdisc(ns, dev).startswith("qdisc tbf 1: root") and "rate 20Mbit" in _root_qdisc(ns, dev)
    p = tc_shape("show", "--netns", ns, "--dev", dev)
    assert p.returncode == 0 and "tbf" in p.stdout
    for _ in range(2):  # clearing twice is fine
        p = tc_shape("clear", "--netns", ns, "--dev", dev)
        assert p.returncode == 0, p.stderr
        assert "tbf" not in _root_qdisc(ns, dev) and "netem" not in _root_qdisc(ns, dev)


def test_delay_uses_netem_or_says_it_falls_back(veth):
    ns, dev = veth
    p = tc_shape("apply", "--netns", ns, "--dev", dev, "--rate", "20mbit", "--delay", "20ms")
    assert p.returncode == 0, p.stderr
    if _has_netem():
        assert "netem" in _root_qdisc(ns, dev) and "delay 20" in _root_qdisc(ns, dev)
        assert p.stderr == ""
    else:
        line = _one_line(p)
        assert "netem is not available" in line and "with tbf" in line and "NOT applied" in line
        assert "tbf" in _root_qdisc(ns, dev)
        # delay alone cannot be shaped at all: say so, exit 4, leave the default qdisc
        p = tc_shape("apply", "--netns", ns, "--dev", dev, "--delay", "20ms")
        assert p.returncode == 4 and "nothing applied" in _one_line(p)
        assert "tbf" not in _root_qdisc(ns, dev)


def test_missing_interface(veth):
    ns, _ = veth
    p = tc_shape("apply", "--netns", ns, "--dev", "nosuch0", "--rate", "5mbit")
    assert p.returncode == 2 and f"no interface 'nosuch0' in network namespace '{ns}'" in _one_line(p)
