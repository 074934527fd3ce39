#!/usr/bin/env python3
"""A virtual cluster on one Linux machine: N hosts as network namespaces, shaped links.

Each host is a network namespace ``<prefix>-h<i>`` with one veth interface
``<prefix>h<i>`` (address ``<subnet>.<i+1>``); the other end of each veth,
``<prefix>b<i>``, is a port of a bridge that lives in its own namespace
``<prefix>-br``. Nothing is created in the machine's own (root) namespace, and the
hosts have no route anywhere but the subnet, so their traffic stays among them.

Shaping (experiments/tc_shape.sh does the tc work):

- the rate is shaped on *both* ends of each host's link: the host's veth shapes what
  it sends (egress), the bridge-side veth shapes what it receives (its ingress seen
  from the host). Egress alone bounds every symmetric pattern (ring all-reduce, ring
  gossip: a host can only receive what others send at their rate), but not incast:
  n-1 hosts sending to one at once would reach it at (n-1) x rate. A real NIC of a
  given rate limits both directions, so both are shaped (``shape_ingress=False``
  shapes egress only);
- the delay (one-way, per packet) is shaped with netem on the host's egress where
  the kernel has netem; where it does not (``latency_mode == "emulated"``) nothing
  delays the packets and the training command must emulate the latency itself
  (``gossip.train --emulate-latency MS`` wraps its communicator in
  ``gossip.comm.latency.LatencyCommunicator``). Every output says which.

As a library::

    with VirtualCluster(4, rate="20mbit", delay="5ms", prefix="gsp") as vc:
        res = vc.run(["python", "-m", "gossip.train", "--algo", "dcd", "--bits", "8"],
                     env={"OMP_NUM_THREADS": "1"}, timeout=600)
        print(res.ok, [r.tx_bytes for r in res.ranks], vc.latency_mode)

As a CLI::

    python -m experiments.vcluster --nodes 4 --rate 20mbit -- python -m gossip.train --algo dcd --bits 8
    python -m experiments.vcluster --cleanup --prefix gsp    # remove what a crashed run left
    python -m experiments.vcluster --probe                   # which qdiscs this kernel has
    python -m experiments.vcluster torchrun --hosts 2 --nproc-per-node 2 --rate 100mbit -- \
        -m gossip.train --algo ecd --bits 8 --topology ring

By default each rank runs inside its namespace with torchrun's variables (RANK,
LOCAL_RANK=0, WORLD_SIZE, LOCAL_WORLD_SIZE=1, MASTER_ADDR = host 0, MASTER_PORT) set
by the cluster. ``torchrun`` (``VirtualCluster.run_torchrun``) launches as across
real machines instead: one ``torchrun`` per host (``--nnodes H --nproc-per-node P``
and a c10d rendezvous on host 0, or ``--node-rank``/``--master-addr``), its elastic
agent starting the workers and giving them their variables; it reports which ranks
ran on which host, each host's interface and loopback bytes (what crossed hosts and
what stayed inside one) and, for a ``gossip.train`` run, the ledgers' bytes between
hosts and within each. Either way GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name the
host's veth. Teardown is idempotent and runs on normal exit, on errors, on Ctrl-C and
on SIGTERM/SIGHUP. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc``
(iproute2).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "VirtualCluster",
    "VClusterError",
    "Terminated",
    "Host",
    "RankResult",
    "RunResult",
    "parse_rate",
    "parse_time",
    "format_rate",
    "probe_qdiscs",
    "cleanup",
    "check_rights",
    "ledger_traffic",
    "torchrun_program",
]

HERE = Path(__file__).resolve().parent
from gossip.tools.units import tc_rate  # noqa: E402

TC_SHAPE = HERE / "tc_shape.sh"
DEFAULT_PREFIX = "gsp"
DEFAULT_SUBNET = "10.213.77.0/24"
DEFAULT_PORT = 29500
RDZV_PORTS = {"c10d": 29400, "static": 29500}  # torchrun's own defaults
# set by torchrun for its workers: never passed down to a torchrun from outside
_TORCHRUN_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
})

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class VClusterError(RuntimeError):
    """A user-facing failure of the virtual cluster: one line, no traceback needed."""


class Terminated(BaseException):
    """SIGTERM/SIGHUP turned into an exception so that ``finally`` blocks run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signum = signum


# ---------------------------------------------------------------------------- values
def parse_rate(value: str | int | float | None) -> int | None:
    """``"5mbit"`` -> 5_000_000 bits/s, ``"5mbps"`` -> 40_000_000: tc's units, read as tc
    reads them (:func:`gossip.tools.units.tc_rate`, the one reader of the project's rates;
    its ``bps`` units are bytes per second). A number is bits per second; None stays None.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bps = float(value)
    elif isinstance(value, str):
        try:
            bps = tc_rate(value.strip())
        except ValueError as e:
            raise VClusterError(f"bad rate {value!r}: {e}") from None
    else:
        bps = 0.0
    if bps >= 8 and bps != float("inf"):
        return int(round(bps))
    raise VClusterError(f"bad rate {value!r}: expected at least 8 bit (one byte) per second, e.g. 5mbit or 1.4gbit")


def parse_time(value: str | int | float | None, what: str = "delay") -> float | None:
    """``"20ms"`` -> 0.02 seconds; ``"0.13ms"``, ``"130us"``, ``"1s"``. None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value >= 0 and value == value and value != float("inf"):
            return float(value)
    elif isinstance(value, str):
        m = _TIME_RE.match(value.strip().lower())
        if m:
            return float(m.group(1)) * _TIME_UNITS[m.group(2)]
    raise VClusterError(
        f"bad {what} {value!r}: expected a non-negative number and a unit us, ms or s "
        "(e.g. 20ms, 0.13ms, 130us)"
    )


def format_rate(bps: int | None) -> str:
    """5_000_000 -> ``"5mbit"`` (exact, in tc's units)."""
    if bps is None:
        return "unshaped"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % scale == 0:
            return f"{bps // scale}{unit}"
    return f"{bps}bit"


def _fmt_time(seconds: float) -> str:
    us = round(seconds * 1e6)
    return f"{us // 1000}ms" if us % 1000 == 0 else f"{us}us"


# ---------------------------------------------------------------------------- system
def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        detail = (p.stderr or p.stdout).strip().splitlines()
        raise VClusterError(f"`{' '.join(cmd)}` failed: {detail[-1] if detail else f'exit {p.returncode}'}")
    return p


def _cap_eff() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_rights() -> None:
    """Raise :class:`VClusterError` (one line) unless this process can build the cluster."""
    if not sys.platform.startswith("linux"):
        raise VClusterError(f"the virtual cluster needs Linux network namespaces; this is {sys.platform}")
    for tool in ("ip", "tc", "bash"):
        if shutil.which(tool) is None:
            raise VClusterError(f"`{tool}` not found in PATH; install iproute2 (ip, tc) and bash")
    caps = _cap_eff()
    missing = [name for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN")) if not (caps >> bit) & 1]
    if missing:
        raise VClusterError(
            f"needs root ({' and '.join(missing)} missing, uid {os.geteuid()}) to create network "
            "namespaces and shape links; re-run with sudo"
        )


_PROBE: dict[str, bool] | None = None


def probe_qdiscs(refresh: bool = False) -> dict[str, bool]:
    """``{"netem": bool, "tbf": bool, "htb": bool}``: which qdiscs this kernel has.

    Asks ``tc_shape.sh probe`` (tests them in a throw-away namespace); cached.
    """
    global _PROBE
    if _PROBE is None or refresh:
        p = _run(["bash", str(TC_SHAPE), "probe"], check=False)
        if p.returncode != 0:
            raise VClusterError(f"tc_shape.sh probe failed: {(p.stderr or p.stdout).strip()}")
        found = dict(item.split("=", 1) for item in p.stdout.split())
        _PROBE = {k: found.get(k) == "yes" for k in ("netem", "tbf", "htb")}
    return dict(_PROBE)


def _netns_list() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _ours(names: Sequence[str], prefix: str) -> list[str]:
    pat = re.compile(rf"^{re.escape(prefix)}-(br|h\d+)$")
    return [n for n in names if pat.match(n)]


def _root_links(prefix: str) -> list[str]:
    p = _run(["ip", "-o", "link", "show"], check=False)
    pat = re.compile(rf"^{re.escape(prefix)}[bh]\d+$")
    names = [line.split(":")[1].strip().split("@")[0] for line in p.stdout.splitlines() if ":" in line]
    return [n for n in names if pat.match(n)]


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL the processes still inside one of our namespaces (started by our ranks)."""
    p = _run(["ip", "netns", "pids", ns], check=False)
    for tok in p.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def cleanup(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove the namespaces named ``<prefix>-br`` / ``<prefix>-h<i>`` (and their links).

    Idempotent; returns the namespaces removed. Only names following the cluster's
    own pattern are touched.
    """
    _check_prefix(prefix)
    removed = []
    hosts_first = sorted(_ours(_netns_list(), prefix), key=lambda n: n.endswith("-br"))
    for ns in hosts_first:
        _kill_netns_pids(ns)
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed


def torchrun_program() -> list[str]:
    """``torchrun`` (the one next to this interpreter, whose directory
    :meth:`VirtualCluster.torchrun_env` puts first on PATH), else ``python -m
    torch.distributed.run``: the same program, for an interpreter without its scripts."""
    exe = Path(sys.executable).with_name("torchrun")
    if exe.is_file() and os.access(exe, os.X_OK):
        return ["torchrun"]
    return [sys.executable, "-m", "torch.distributed.run"]


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of every process (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    return kids


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _torchrun_workers(agent: int, kids: Mapping[int, list[int]]) -> list[dict[str, int]]:
    """The workers an elastic agent started: its first descendants with a ``RANK``."""
    found, todo = [], list(kids.get(agent, []))
    while todo:
        pid = todo.pop()
        e = _environ(pid)
        if "RANK" in e and "TORCHELASTIC_RUN_ID" in e:
            try:
                found.append({"rank": int(e["RANK"]), "local_rank": int(e.get("LOCAL_RANK", -1)),
                              "group_rank": int(e.get("GROUP_RANK", -1)), "world_size": int(e["WORLD_SIZE"])})
            except (KeyError, ValueError):
                pass
        else:
            todo += kids.get(pid, [])
    return sorted(found, key=lambda w: w["rank"])


def ledger_traffic(run_dir: str | os.PathLike, workers: Sequence[Sequence[int]]) -> list[dict[str, int]]:
    """Per host, what the ledgers of a ``gossip.train`` run recorded its ranks sending:
    ``inter`` to ranks on other hosts, ``intra`` to ranks on the same host.

    Read from each rank's checkpoint of the last step all ranks have (the run writes
    one at its end); ``workers[h]`` are the global ranks of host ``h``.
    """
    from gossip import checkpoint  # only this needs torch

    host_of = {r: h for h, ranks in enumerate(workers) for r in ranks}
    world = len(host_of)
    out = [{"inter": 0, "intra": 0} for _ in workers]
    for r, h in sorted(host_of.items()):
        path = checkpoint.latest_checkpoint(run_dir, rank=r, num_ranks=world)
        if path is None:
            raise VClusterError(f"{run_dir}: no checkpoint of rank {r} to read its ledger from")
        state = checkpoint.load_checkpoint(path)["ledger"]
        n = int(state["world_size"])
        for key, nbytes in zip(state["pair_keys"], state["pair_bytes"]):
            src, dst = divmod(int(key), n)
            if src == r:
                out[h]["intra" if host_of.get(dst) == h else "inter"] += int(nbytes)
    return out


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise VClusterError(
            f"bad prefix {prefix!r}: expected 1-8 lowercase letters or digits starting with a letter "
            "(interface names are limited to 15 characters)"
        )


# ---------------------------------------------------------------------------- results
@dataclasses.dataclass(frozen=True)
class Host:
    rank: int
    netns: str
    ifname: str  # the host's interface, inside netns
    peer: str  # the bridge-side end, inside the bridge namespace
    addr: str


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: Path
    stderr: Path
    timed_out: bool = False
    killed: bool = False  # stopped by the cluster (timeout, another rank failed, Ctrl-C)
    tx_bytes: int = 0  # bytes the host's interface sent during the run (L2 frames)
    rx_bytes: int = 0
    tx_packets: int = 0
    lo_bytes: int = 0  # bytes its loopback carried: between processes of the same host

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclasses.dataclass
class RunResult:
    ranks: list[RankResult]
    wall_s: float
    outdir: Path
    latency_mode: str
    timed_out: bool = False
    # run_torchrun only: per host, the global ranks of the workers torchrun started
    # there (read from the environment of the processes in its namespace)
    workers: list[list[int]] | None = None

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def failed(self) -> list[RankResult]:
        return [r for r in self.ranks if not r.ok]

    def tail(self, rank: int, lines: int = 5) -> str:
        """The last lines of a rank's stderr (for error messages)."""
        try:
            text = self.ranks[rank].stderr.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------------- cluster
class VirtualCluster:
    """``n`` hosts in network namespaces joined by a bridge, with shaped links.

    Args:
        n: number of hosts (1..250).
        rate: link rate per host and direction (``"20mbit"`` or bits/s); None: unshaped.
        delay: one-way latency per packet (``"5ms"`` or seconds) on each host's egress.
            Shaped with netem where the kernel has it; otherwise ``latency_mode`` is
            ``"emulated"`` and the command must emulate it (see the module doc).
        jitter, loss: netem's jitter (a time) and loss (percent); dropped with a
            warning where netem is missing.
        prefix: names of the namespaces and links (1-8 lowercase letters or digits).
        subnet: a private IPv4 network with room for ``n`` hosts.
        master_port: MASTER_PORT of the ranks (the namespaces are private, so any
            port is free).
        shape_ingress: also shape what each host receives (default True).
        tcp_cc: TCP congestion control of the hosts: a name or a sequence of names, the
            first one the kernel allows in a namespace is used (e.g. ``("cubic",
            "reno")``); None keeps the kernel's default. ``tcp_cc_used`` says which.
        log: where the cluster's one-line notices go (default: stderr).
    """

    def __init__(
        self,
        n: int,
        *,
        rate: str | int | None = None,
        delay: str | float | None = None,
        jitter: str | float | None = None,
        loss: float | str | None = None,
        prefix: str = DEFAULT_PREFIX,
        subnet: str = DEFAULT_SUBNET,
        master_port: int = DEFAULT_PORT,
        shape_ingress: bool = True,
        tcp_cc: str | Sequence[str] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 250:
            raise VClusterError(f"bad number of hosts {n!r}: expected an integer from 1 to 250")
        _check_prefix(prefix)
        try:
            net = ipaddress.ip_network(subnet, strict=True)
        except ValueError as e:
            raise VClusterError(f"bad subnet {subnet!r}: {e} (expected e.g. 10.213.77.0/24)") from None
        if net.version != 4 or not net.is_private:
            raise VClusterError(f"bad subnet {subnet!r}: expected a private IPv4 network such as 10.213.77.0/24")
        if net.num_addresses - 2 < n:
            raise VClusterError(f"subnet {subnet} has room for {max(0, net.num_addresses - 2)} hosts, {n} requested")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1024 <= master_port <= 65535:
            raise VClusterError(f"bad master port {master_port!r}: expected an integer from 1024 to 65535")
        self.n = n
        self.prefix = prefix
        self.subnet = str(net)
        self.master_port = master_port
        self.shape_ingress = bool(shape_ingress)
        names = [tcp_cc] if isinstance(tcp_cc, str) else list(tcp_cc or [])
        if any(not isinstance(c, str) or not re.match(r"^[a-z0-9_]{1,16}$", c) for c in names):
            raise VClusterError(f"bad TCP congestion control {tcp_cc!r}: expected names such as cubic, reno, bbr")
        self.tcp_cc = names
        self.tcp_cc_used: str | None = None
        self._log = log or (lambda msg: print(f"vcluster: {msg}", file=sys.stderr, flush=True))
        self.bridge_netns = f"{prefix}-br"
        self.hosts = [
            Host(i, f"{prefix}-h{i}", f"{prefix}h{i}", f"{prefix}b{i}", str(net[i + 1])) for i in range(n)
        ]
        self.rate_bps: int | None = None
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.loss_pct = 0.0
        self.latency_mode = "none"
        self._set_shape(rate, delay, jitter, loss)
        self._created: list[str] = []
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._up = False
        self._old_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ properties
    @property
    def master_addr(self) -> str:
        return self.hosts[0].addr

    @property
    def emulated_latency_s(self) -> float:
        """The latency the ranks must add themselves (0 unless ``latency_mode == "emulated"``)."""
        return self.delay_s if self.latency_mode == "emulated" else 0.0

    def describe(self) -> str:
        """One line: hosts, rate, latency and how it is realised."""
        rate = format_rate(self.rate_bps)
        lat = _fmt_time(self.delay_s)
        if self.latency_mode == "netem":
            how = f"latency: netem {lat} one-way"
        elif self.latency_mode == "emulated":
            how = f"latency: emulated {lat} (netem missing; the communicator must wait it)"
        elif self.latency_mode == "pending":
            how = f"latency: {lat} (netem or emulated: decided when the cluster is up)"
        else:
            how = "latency: unshaped"
        rate_how = "unshaped" if self.rate_bps is None else (
            f"{rate} per host each way" if self.shape_ingress else f"{rate} per host egress")
        cc = f", tcp {self.tcp_cc_used}" if self.tcp_cc_used else ""
        return f"{self.n} hosts {self.subnet} prefix {self.prefix}: rate {rate_how}, {how}{cc}"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> VirtualCluster:
        self._install_signal_handlers()
        try:
            self.up()
        except BaseException:
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            self._restore_signal_handlers()

    def up(self) -> None:
        """Create the namespaces, bridge and links, and shape them. Tears down on failure."""
        if self._up:
            return
        check_rights()
        existing = _ours(_netns_list(), self.prefix) + _root_links(self.prefix)
        if existing:
            shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
            raise VClusterError(
                f"namespaces or links with prefix '{self.prefix}' already exist ({shown}): another "
                f"virtual cluster is running or a crashed one left them; remove them with "
                f"`python -m experiments.vcluster --cleanup --prefix {self.prefix}` or choose another --prefix"
            )
        self._up = True
        try:
            self._build()
            self.shape()
        except BaseException:
            self.down()
            raise

    def _netns_add(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # no IPv6: router solicitations and neighbour discovery would add to the counters
        for key in ("all", "default"):
            _run(["ip", "netns", "exec", ns, "sh", "-c",
                  f"echo 1 > /proc/sys/net/ipv6/conf/{key}/disable_ipv6"], check=False)

    def _build(self) -> None:
        br = self.bridge_netns
        self._netns_add(br)
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        plen = ipaddress.ip_network(self.subnet).prefixlen
        for h in self.hosts:
            self._netns_add(h.netns)
            _run(["ip", "-n", h.netns, "link", "add", h.ifname, "type", "veth", "peer", "name", h.peer, "netns", br])
            _run(["ip", "-n", br, "link", "set", h.peer, "master", "br0"])
            _run(["ip", "-n", br, "link", "set", h.peer, "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/{plen}", "dev", h.ifname])
            _run(["ip", "-n", h.netns, "link", "set", h.ifname, "up"])
        self._set_tcp_cc()

    def _set_tcp_cc(self) -> None:
        key = "/proc/sys/net/ipv4/tcp_congestion_control"
        for h in self.hosts:
            for name in self.tcp_cc:
                p = _run(["ip", "netns", "exec", h.netns, "sh", "-c", f"echo {name} > {key}"], check=False)
                if p.returncode == 0:
                    break
            else:
                if self.tcp_cc:
                    allowed = _run(["ip", "netns", "exec", h.netns, "cat",
                                    "/proc/sys/net/ipv4/tcp_allowed_congestion_control"], check=False).stdout.strip()
                    raise VClusterError(
                        f"none of the TCP congestion controls {', '.join(self.tcp_cc)} is allowed in a "
                        f"namespace here (allowed: {allowed or 'unknown'})"
                    )
        self.tcp_cc_used = _run(["ip", "netns", "exec", self.hosts[0].netns, "cat", key], check=False).stdout.strip() or None

    def _set_shape(self, rate: Any, delay: Any, jitter: Any, loss: Any) -> None:
        self.rate_bps = parse_rate(rate)
        self.delay_s = parse_time(delay, "delay") or 0.0
        self.jitter_s = parse_time(jitter, "jitter") or 0.0
        if loss is None:
            self.loss_pct = 0.0
        else:
            try:
                self.loss_pct = float(str(loss).rstrip("%"))
            except ValueError:
                self.loss_pct = -1.0
            if not 0.0 <= self.loss_pct <= 100.0:
                raise VClusterError(f"bad loss {loss!r}: expected a percentage from 0 to 100 (e.g. 0.1)")
        if self.jitter_s and not self.delay_s:
            raise VClusterError("a jitter needs a delay (netem varies the delay by the jitter)")
        if self.delay_s or self.jitter_s or self.loss_pct:
            self.latency_mode = "pending"  # decided by the probe when the links are shaped
        else:
            self.latency_mode = "none"

    def shape(self, rate: Any = "keep", delay: Any = "keep", jitter: Any = "keep", loss: Any = "keep") -> None:
        """(Re)apply the shaping on every link; ``"keep"`` keeps a value as it is.

        Re-shaping a running cluster is how a sweep moves from cell to cell without
        rebuilding it.
        """
        if rate != "keep" or delay != "keep" or jitter != "keep" or loss != "keep":
            self._set_shape(
                self.rate_bps if rate == "keep" else rate,
                self.delay_s if delay == "keep" else delay,
                self.jitter_s if jitter == "keep" else jitter,
                self.loss_pct if loss == "keep" else loss,
            )
        netem = False
        if self.latency_mode != "none":
            netem = probe_qdiscs()["netem"]
            self.latency_mode = "netem" if netem else "emulated"
            if not netem and (self.jitter_s or self.loss_pct):
                self._log("netem missing: jitter and loss cannot be shaped or emulated; ignored")
        if not self._up:
            return
        for h in self.hosts:
            args = []
            if self.rate_bps is not None:
                args += ["--rate", f"{self.rate_bps}bit"]
            if netem:
                args += ["--delay", f"{round(self.delay_s * 1e6)}us"]
                if self.jitter_s:
                    args += ["--jitter", f"{round(self.jitter_s * 1e6)}us"]
                if self.loss_pct:
                    args += ["--loss", f"{self.loss_pct:g}"]
            self._tc(h.netns, h.ifname, args)
            self._tc(self.bridge_netns, h.peer,
                     ["--rate", f"{self.rate_bps}bit"] if self.rate_bps is not None and self.shape_ingress else [])

    def _tc(self, ns: str, dev: str, args: list[str]) -> None:
        cmd = ["bash", str(TC_SHAPE), "apply" if args else "clear", "--netns", ns, "--dev", dev, *args]
        p = _run(cmd, check=False)
        if p.returncode != 0:
            raise VClusterError(f"shaping {dev} in {ns} failed: {(p.stderr or p.stdout).strip()}")

    def down(self) -> None:
        """Stop every rank and remove every namespace this cluster made. Idempotent."""
        # a second Ctrl-C or a SIGTERM must not cut the teardown short
        in_main = threading.current_thread() is threading.main_thread()
        old = {}
        if in_main:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            with self._lock:
                self._stop_all()
                for ns in reversed(self._created):  # hosts first, the bridge last
                    _kill_netns_pids(ns)
                    _run(["ip", "netns", "del", ns], check=False)
                self._created.clear()
                self._up = False
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            raise Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError):
                pass
        self._old_handlers.clear()

    # ------------------------------------------------------------------ counters
    def counters(self) -> list[dict[str, int]]:
        """Per host: ``tx_bytes``/``rx_bytes`` (and packets) of its interface, cumulative,
        and ``lo_bytes``: what its loopback carried (traffic between two processes of
        the same host, which never reaches the interface)."""
        out = []
        for h in self.hosts:
            p = _run(["ip", "-n", h.netns, "-j", "-s", "link", "show"])
            links = {link["ifname"]: link["stats64"] for link in json.loads(p.stdout)}
            st = links[h.ifname]
            out.append({
                "tx_bytes": int(st["tx"]["bytes"]), "rx_bytes": int(st["rx"]["bytes"]),
                "tx_packets": int(st["tx"]["packets"]), "rx_packets": int(st["rx"]["packets"]),
                "lo_bytes": int(links["lo"]["tx"]["bytes"]) if "lo" in links else 0,
            })
        return out

    # ------------------------------------------------------------------ running
    def rank_env(self, rank: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of rank ``rank``: ours, ``env`` on top, torchrun's variables."""
        h = self.hosts[rank]
        e = dict(os.environ)
        e.setdefault("OMP_NUM_THREADS", "1")  # n ranks share this machine's cores
        if env:
            e.update({k: str(v) for k, v in env.items()})
        e.update({
            "RANK": str(rank), "LOCAL_RANK": "0", "GROUP_RANK": str(rank),
            "WORLD_SIZE": str(self.n), "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            "GLOO_SOCKET_IFNAME": h.ifname, "NCCL_SOCKET_IFNAME": h.ifname,
            "GOSSIP_LATENCY_MODE": self.latency_mode,
            "GOSSIP_EMULATE_LATENCY_MS": f"{self.emulated_latency_s * 1e3:g}",
        })
        return e

    def torchrun_env(self, host: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of host ``host``'s torchrun: ours, ``env`` on top, its interface.

        torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR ...) are taken out, not set:
        the elastic agent gives its workers theirs. GLOO_SOCKET_IFNAME and
        NCCL_SOCKET_IFNAME name the host's interface, as on a real host with several.
        """
        h = self.hosts[host]
        e = dict(os.environ)
        e.setdefault("OMP_NUM_THREADS", "1")  # the hosts share this machine's cores
        if env:
            e.update({k: str(v) for k, v in env.items()})
        e = {k: v for k, v in e.items() if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
        here = str(Path(sys.executable).parent)  # this interpreter's torchrun and python come first
        e["PATH"] = os.pathsep.join([here, *[d for d in e.get("PATH", "").split(os.pathsep) if d and d != here]])
        e.update({
            "GLOO_SOCKET_IFNAME": h.ifname, "NCCL_SOCKET_IFNAME": h.ifname,
            "GOSSIP_LATENCY_MODE": self.latency_mode,
            "GOSSIP_EMULATE_LATENCY_MS": f"{self.emulated_latency_s * 1e3:g}",
        })
        return e

    def torchrun_argv(self, host: int, nproc_per_node: int, command: Sequence[str], *, rdzv: str = "c10d",
                      port: int | None = None, run_id: str | None = None,
                      options: Sequence[str] = ()) -> list[str]:
        """The torchrun line of host ``host``, as it would be typed on a real host.

        ``rdzv="c10d"`` (torchrun's elastic rendezvous)::

            torchrun --nnodes H --nproc-per-node P --rdzv-backend c10d
                     --rdzv-endpoint <host 0>:<port> --rdzv-id ID --local-addr <this host>
                     [--rdzv-conf is_host=1 on host 0] COMMAND

        The agent whose machine the endpoint names hosts the rendezvous store; torchrun
        tells by comparing the endpoint with the hostname and the addresses it resolves
        to. Here every namespace has the machine's hostname, resolving to a loopback
        address (as on many real hosts), so host 0 is told with ``is_host=1``; and
        ``--local-addr`` is the address the others reach a host at, where torchrun would
        publish that hostname. ``rdzv="static"``: ``--node-rank K --master-addr <host 0>
        --master-port <port>`` instead. ``port`` defaults to torchrun's (29400 for c10d,
        29500 static); ``options`` are more of torchrun's own (``["--max-restarts",
        "3"]``); ``command`` is what follows them (``-m gossip.train ...`` or ``train.py
        ...``).
        """
        if rdzv not in RDZV_PORTS:
            raise VClusterError(f"bad rendezvous {rdzv!r}: expected one of {', '.join(RDZV_PORTS)}")
        if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or not 1 <= nproc_per_node <= 64:
            raise VClusterError(f"bad number of processes per host {nproc_per_node!r}: expected an integer from 1 to 64")
        port = RDZV_PORTS[rdzv] if port is None else port
        if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
            raise VClusterError(f"bad rendezvous port {port!r}: expected an integer from 1024 to 65535")
        argv = [*torchrun_program(), "--nnodes", str(self.n), "--nproc-per-node", str(nproc_per_node)]
        if rdzv == "c10d":
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.master_addr}:{port}",
                     "--rdzv-id", run_id or f"vcluster-{self.prefix}", "--local-addr", self.hosts[host].addr]
            if host == 0:
                argv += ["--rdzv-conf", "is_host=1"]
        else:
            argv += ["--node-rank", str(host), "--master-addr", self.master_addr, "--master-port", str(port)]
        return [*argv, *map(str, options), *map(str, command)]

    def run_torchrun(
        self,
        command: Sequence[str],
        nproc_per_node: int,
        *,
        rdzv: str = "c10d",
        port: int | None = None,
        run_id: str | None = None,
        options: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        outdir: str | os.PathLike | None = None,
        cwd: str | os.PathLike | None = None,
        fail_grace: float = 30.0,
        monitor: Callable[[], None] | None = None,
    ) -> RunResult:
        """Launch ``command`` as across real machines: one torchrun per host.

        Host k runs :meth:`torchrun_argv` in its namespace with :meth:`torchrun_env`;
        the elastic agents meet at the rendezvous and each starts ``nproc_per_node``
        workers with the variables torchrun gives them. Returns one result per host
        (outputs ``host<k>.out``/``host<k>.err``: the agent's and its workers'), its
        interface and loopback counters, and ``workers``: the global ranks each host
        ran, read from the environment of the processes torchrun started.
        """
        cmds = [self.torchrun_argv(k, nproc_per_node, command, rdzv=rdzv, port=port, run_id=run_id, options=options)
                for k in range(self.n)]
        envs = [self.torchrun_env(k, env) for k in range(self.n)]
        seen: list[list[dict[str, int]]] = [[] for _ in range(self.n)]
        last = [0.0]

        def watch(agents: list[subprocess.Popen]) -> None:
            if monitor is not None:
                monitor()
            now = time.monotonic()
            if now - last[0] < 0.5:
                return
            last[0] = now
            kids = _children()
            for k, agent in enumerate(agents):
                found = _torchrun_workers(agent.pid, kids)
                if len(found) == nproc_per_node:  # a complete set (the latest, after a restart)
                    seen[k] = found

        def extra() -> dict:
            return {"launch": "torchrun", "rdzv": rdzv, "nproc_per_node": nproc_per_node,
                    "torchrun": [" ".join(c) for c in cmds], "workers": seen}

        res = self._run(cmds, envs, timeout, outdir=outdir, cwd=cwd, fail_grace=fail_grace, monitor=None,
                        watch=watch, name="host", extra=extra)
        res.workers = [[w["rank"] for w in found] for found in seen] if all(seen) else None
        return res

    def popen(self, rank: int, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: Any = None, stderr: Any = None, cwd: str | os.PathLike | None = None,
              torchrun_env: bool = True) -> subprocess.Popen:
        """Start ``cmd`` inside host ``rank``'s namespace (its own process group).

        The cluster stops it on teardown if it is still running.
        """
        e = self.rank_env(rank, env) if torchrun_env else {**os.environ, **(env or {})}
        return self._spawn(rank, cmd, e, stdout=stdout, stderr=stderr, cwd=cwd)

    def _spawn(self, host: int, cmd: Sequence[str], env: Mapping[str, str], *, stdout: Any = None,
               stderr: Any = None, cwd: str | os.PathLike | None = None) -> subprocess.Popen:
        """``cmd`` in host ``host``'s namespace with exactly the environment ``env``."""
        if not self._up:
            raise VClusterError("the virtual cluster is not up (use it as a context manager or call up())")
        h = self.hosts[host]
        p = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, *[str(c) for c in cmd]],
            env=dict(env), stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True,
        )
        with self._lock:
            self._procs[p.pid] = p
        return p

    def _stop(self, p: subprocess.Popen, grace: float = 2.0) -> bool:
        """SIGTERM the process group, SIGKILL after ``grace``; True if it had to be stopped."""
        if p.poll() is not None:
            return False
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return True

    def _stop_all(self) -> None:
        for p in list(self._procs.values()):
            self._stop(p)
        self._procs.clear()

    def run(
        self,
        cmd_per_rank: Sequence[str] | Sequence[Sequence[str]] | Callable[[int], Sequence[str]],
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        *,
        outdir: str | os.PathLike | None = None,
        cwd: str | os.PathLike | None = None,
        fail_grace: float = 30.0,
        monitor: Callable[[], None] | None = None,
    ) -> RunResult:
        """Run one command per rank, each in its namespace; wait for all of them.

        Args:
            cmd_per_rank: one argv for every rank (``{rank}`` in an argument is replaced
                by the rank), a list of ``n`` argvs, or a callable ``rank -> argv``.
            env: extra environment for every rank (torchrun's variables are set last).
            timeout: seconds for the whole run; then every rank is stopped.
            outdir: where ``rank<k>.out``/``rank<k>.err`` go (default: a new temporary
                directory); a ``cluster.json`` describing the cluster is written there.
            fail_grace: seconds the other ranks get to finish after one fails (they
                should fail on their own through their peer timeouts) before they
                are stopped.
            monitor: called about every 50 ms while the ranks run (e.g. to read
                ``counters()`` when a rank's log reaches a step).
        """
        return self._run(self._commands(cmd_per_rank), [self.rank_env(k, env) for k in range(self.n)],
                         timeout, outdir=outdir, cwd=cwd, fail_grace=fail_grace, monitor=monitor, name="rank")

    def _run(self, cmds: list[list[str]], envs: list[dict[str, str]], timeout: float | None, *,
             outdir: str | os.PathLike | None, cwd: str | os.PathLike | None, fail_grace: float,
             monitor: Callable[[], None] | None, name: str, extra: Callable[[], dict] | None = None,
             watch: Callable[[list[subprocess.Popen]], None] | None = None) -> RunResult:
        """One command per host with its whole environment; outputs ``<name><k>.out/.err``."""
        out = Path(outdir) if outdir is not None else Path(tempfile.mkdtemp(prefix=f"vcluster-{self.prefix}-"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "cluster.json").write_text(json.dumps(self.info(), indent=2) + "\n")
        before = self.counters()
        results = [RankResult(k, None, out / f"{name}{k}.out", out / f"{name}{k}.err") for k in range(self.n)]
        procs: list[subprocess.Popen] = []
        files = []
        t0 = time.perf_counter()
        timed_out = False
        try:
            for k, cmd in enumerate(cmds):
                fo = open(results[k].stdout, "w")
                fe = open(results[k].stderr, "w")
                files += [fo, fe]
                fo.write(f"# vcluster {name} {k}/{self.n} netns {self.hosts[k].netns} addr "
                         f"{self.hosts[k].addr}: {self.describe()}\n")
                fo.flush()
                procs.append(self._spawn(k, cmd, envs[k], stdout=fo, stderr=fe, cwd=cwd))
            first_fail: float | None = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.perf_counter()
                if timeout is not None and now - t0 > timeout:
                    timed_out = True
                    for k, p in enumerate(procs):
                        if p.poll() is None:
                            results[k].timed_out = results[k].killed = self._stop(p)
                    break
                if first_fail is None and any(c not in (None, 0) for c in codes):
                    first_fail = now
                if first_fail is not None and now - first_fail > fail_grace:
                    for k, p in enumerate(procs):
                        if p.poll() is None:
                            results[k].killed = self._stop(p)
                    break
                if monitor is not None:
                    monitor()
                if watch is not None:
                    watch(procs)
                time.sleep(0.05)
        except BaseException:
            for k, p in enumerate(procs):
                results[k].killed = self._stop(p)
            raise
        finally:
            for f in files:
                f.close()
            with self._lock:
                for p in procs:
                    self._procs.pop(p.pid, None)
        wall = time.perf_counter() - t0
        after = self.counters()
        for k, p in enumerate(procs):
            results[k].returncode = p.returncode
            results[k].tx_bytes = after[k]["tx_bytes"] - before[k]["tx_bytes"]
            results[k].rx_bytes = after[k]["rx_bytes"] - before[k]["rx_bytes"]
            results[k].tx_packets = after[k]["tx_packets"] - before[k]["tx_packets"]
            results[k].lo_bytes = after[k]["lo_bytes"] - before[k]["lo_bytes"]
        res = RunResult(results, wall, out, self.latency_mode, timed_out)
        summary = {**self.info(), "wall_s": wall, "timed_out": timed_out, **(extra() if extra else {}),
                   "ranks" if name == "rank" else "per_host": [
            {name: r.rank, "returncode": r.returncode, "timed_out": r.timed_out, "killed": r.killed,
             "tx_bytes": r.tx_bytes, "rx_bytes": r.rx_bytes, "tx_packets": r.tx_packets, "lo_bytes": r.lo_bytes}
            for r in results]}
        (out / "cluster.json").write_text(json.dumps(summary, indent=2) + "\n")
        return res

    def _commands(self, spec: Any) -> list[list[str]]:
        if callable(spec):
            cmds = [list(map(str, spec(k))) for k in range(self.n)]
        elif spec and all(isinstance(c, str) for c in spec):
            cmds = [[str(c).replace("{rank}", str(k)) for c in spec] for k in range(self.n)]
        else:
            cmds = [list(map(str, c)) for c in spec]
        if len(cmds) != self.n or any(not c for c in cmds):
            raise VClusterError(f"need one non-empty command per rank ({self.n}), got {len(cmds)}")
        return cmds

    def info(self) -> dict[str, Any]:
        return {
            "nodes": self.n, "prefix": self.prefix, "subnet": self.subnet,
            "rate_bps": self.rate_bps, "rate": format_rate(self.rate_bps),
            "delay_ms": self.delay_s * 1e3, "jitter_ms": self.jitter_s * 1e3, "loss_pct": self.loss_pct,
            "latency_mode": self.latency_mode, "shape_ingress": self.shape_ingress,
            "tcp_cc": self.tcp_cc_used,
            "hosts": [dataclasses.asdict(h) for h in self.hosts],
            "description": self.describe(),
        }

    def __repr__(self) -> str:
        return f"VirtualCluster({self.describe()}, up={self._up})"


# ---------------------------------------------------------------------------- CLI
def _cluster_args(p: argparse.ArgumentParser) -> None:
    """The options that build and shape the cluster, shared by both commands."""
    p.add_argument("--rate", "--bandwidth", metavar="R", help="link rate per host and direction, e.g. 20mbit, 1.4gbit")
    p.add_argument("--delay", "--latency", metavar="D", help="one-way latency, e.g. 20ms, 0.13ms")
    p.add_argument("--jitter", metavar="J", help="netem jitter, e.g. 1ms (needs netem)")
    p.add_argument("--loss", metavar="P", help="netem loss in percent, e.g. 0.1 (needs netem)")
    p.add_argument("--no-ingress", action="store_true", help="shape only what each host sends")
    p.add_argument("--tcp-cc", metavar="NAMES",
                   help="TCP congestion control in the hosts: the first allowed of a comma list, "
                        "e.g. cubic,reno (default: the kernel's)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"name prefix (default {DEFAULT_PREFIX})")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"private IPv4 subnet (default {DEFAULT_SUBNET})")
    p.add_argument("--timeout", type=float, metavar="S", help="stop everything after S seconds")
    p.add_argument("--no-latency-flag", action="store_true",
                   help="do not append --emulate-latency MS to a gossip.train command when emulating")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vcluster.py",
        description="Run one command per rank on N network namespaces joined by a bridge, with "
                    "tc-shaped links (rate with tbf; delay with netem or, where netem is missing, "
                    "emulated by the command itself). `vcluster.py torchrun --help`: one torchrun "
                    "per host instead, as across real machines.",
        epilog="example: python -m experiments.vcluster --nodes 4 --rate 20mbit -- "
               "python -m gossip.train --algo dcd --bits 8 --data mnist1d --epochs 1",
    )
    p.add_argument("--nodes", type=int, default=2, metavar="N", help="number of hosts (default 2)")
    _cluster_args(p)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"MASTER_PORT (default {DEFAULT_PORT})")
    p.add_argument("--out", metavar="DIR", help="directory for rank<k>.out/.err and cluster.json")
    p.add_argument("--cleanup", action="store_true", help="remove the namespaces of --prefix and exit")
    p.add_argument("--probe", action="store_true", help="print which qdiscs this kernel has and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    return p


def _torchrun_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vcluster.py torchrun",
        description="Launch as across real machines: one torchrun per host, its elastic agent "
                    "starting --nproc-per-node workers, the agents meeting at a rendezvous on host 0. "
                    "Prints each host's interface and loopback bytes and, for a gossip.train run, "
                    "what the ledgers recorded between hosts and within each.",
        epilog="example: python -m experiments.vcluster torchrun --hosts 2 --nproc-per-node 2 "
               "--rate 100mbit -- -m gossip.train --algo ecd --bits 8 --topology ring",
    )
    p.add_argument("--hosts", type=int, default=2, metavar="H", help="number of hosts (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="P",
                   help="processes per host, torchrun's --nproc-per-node (default 1)")
    p.add_argument("--rdzv", choices=sorted(RDZV_PORTS), default="c10d",
                   help="c10d: --rdzv-backend c10d --rdzv-endpoint <host 0>:PORT (default); "
                        "static: --node-rank K --master-addr <host 0> --master-port PORT")
    p.add_argument("--rdzv-port", type=int, metavar="PORT",
                   help="rendezvous port (default: torchrun's, 29400 for c10d, 29500 for static)")
    p.add_argument("--rdzv-id", metavar="ID", help="torchrun's --rdzv-id (default vcluster-PREFIX)")
    p.add_argument("--max-restarts", type=int, metavar="N",
                   help="torchrun's --max-restarts: how often the agents restart failed workers")
    _cluster_args(p)
    p.add_argument("--out", metavar="DIR", help="directory for host<k>.out/.err and cluster.json")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then what follows torchrun's options: -m MODULE ... or SCRIPT ...")
    return p


def _emulating_command(cmd: list[str], ms: str) -> tuple[list[str], str] | None:
    """``PY -m gossip.train ...`` with ``--emulate-latency MS`` appended; None for other commands."""
    if "--emulate-latency" in cmd:
        return None
    for i in range(len(cmd) - 1):
        if cmd[i] == "-m" and cmd[i + 1] == "gossip.train":
            return [*cmd, "--emulate-latency", ms], f"appended --emulate-latency {ms} to the command"
    return None


def _say(msg: str) -> None:
    print(f"vcluster: {msg}", file=sys.stderr, flush=True)


def _cluster_from(args: argparse.Namespace, n: int, **kw: Any) -> VirtualCluster:
    return VirtualCluster(
        n, rate=args.rate, delay=args.delay, jitter=args.jitter, loss=args.loss,
        prefix=args.prefix, subnet=args.subnet, shape_ingress=not args.no_ingress,
        tcp_cc=[c for c in (args.tcp_cc or "").split(",") if c] or None, **kw,
    )


def _latency_notice(vc: VirtualCluster, cmd: list[str], args: argparse.Namespace) -> list[str]:
    """Where latency is emulated: the command with --emulate-latency, and a notice."""
    if vc.latency_mode != "emulated":
        return cmd
    ms = f"{vc.emulated_latency_s * 1e3:g}"
    new = None if args.no_latency_flag else _emulating_command(cmd, ms)
    if new is not None:
        cmd, how = new
        _say(f"latency: emulated; {how}")
    else:
        _say(f"latency: emulated; the command must wait {ms} ms per message round "
             f"itself (GOSSIP_EMULATE_LATENCY_MS={ms} is set)")
    return cmd


def _exit_code(res: RunResult) -> int:
    if res.timed_out:
        return 124
    bad = res.failed
    return 0 if not bad else (bad[0].returncode if bad[0].returncode and bad[0].returncode > 0 else 1)


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.command)
    return cmd[1:] if cmd[:1] == ["--"] else cmd


def _main_ranks(args: argparse.Namespace) -> int:
    cmd = _command(args)
    if args.cleanup:
        check_rights()
        removed = cleanup(args.prefix)
        print(f"vcluster: removed {len(removed)} namespace(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    if args.probe:
        check_rights()
        print(" ".join(f"{k}={'yes' if v else 'no'}" for k, v in probe_qdiscs().items()))
        return 0
    if not cmd:
        raise VClusterError("no command: put it after --, e.g. -- python -m gossip.train --algo dcd")
    vc = _cluster_from(args, args.nodes, master_port=args.port)
    with vc:
        _say(vc.describe())
        cmd = _latency_notice(vc, cmd, args)
        res = vc.run(cmd, timeout=args.timeout, outdir=args.out)
    for r in res.ranks:
        state = "timed out" if r.timed_out else ("stopped" if r.killed else f"exit {r.returncode}")
        print(f"vcluster: rank {r.rank}: {state}, sent {r.tx_bytes} B, received {r.rx_bytes} B "
              f"(interface), output {r.stdout}", file=sys.stderr)
    print(f"vcluster: {res.wall_s:.1f} s, latency: {res.latency_mode}, outputs in {res.outdir}", file=sys.stderr)
    return _exit_code(res)


def _run_dir(cmd: list[str], res: RunResult) -> Path | None:
    """The run directory of a gossip.train command: its --out, else what rank 0 printed."""
    for i, a in enumerate(cmd):
        if a == "--out" and i + 1 < len(cmd):
            return Path(cmd[i + 1])
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1])
    for r in res.ranks:
        try:
            for line in r.stdout.read_text(errors="replace").splitlines():
                if line.startswith("run directory: "):
                    return Path(line[len("run directory: "):].strip())
        except OSError:
            pass
    return None


def _main_torchrun(args: argparse.Namespace) -> int:
    cmd = _command(args)
    if not cmd:
        raise VClusterError("no command: put what follows torchrun's options after --, "
                            "e.g. -- -m gossip.train --algo ecd --bits 8")
    vc = _cluster_from(args, args.hosts)
    with vc:
        _say(vc.describe())
        cmd = _latency_notice(vc, cmd, args)
        options = [] if args.max_restarts is None else ["--max-restarts", str(args.max_restarts)]
        for k in range(vc.n):  # fail on bad values before anything starts
            argv = vc.torchrun_argv(k, args.nproc_per_node, cmd, rdzv=args.rdzv, port=args.rdzv_port,
                                    run_id=args.rdzv_id, options=options)
            _say(f"host {k} ({vc.hosts[k].netns}, GLOO_SOCKET_IFNAME={vc.hosts[k].ifname}): {' '.join(argv)}")
        res = vc.run_torchrun(cmd, args.nproc_per_node, rdzv=args.rdzv, port=args.rdzv_port, run_id=args.rdzv_id,
                              options=options, timeout=args.timeout, outdir=args.out)
    for r in res.ranks:
        state = "timed out" if r.timed_out else ("stopped" if r.killed else f"exit {r.returncode}")
        ranks = f"ranks {res.workers[r.rank]}" if res.workers else "ranks unknown"
        _say(f"host {r.rank}: {state}, {ranks}, interface sent {r.tx_bytes} B received {r.rx_bytes} B, "
             f"loopback {r.lo_bytes} B, output {r.stdout}")
    run_dir = _run_dir(cmd, res) if "gossip.train" in cmd else None
    if res.ok and res.workers and run_dir is not None and run_dir.is_dir():
        ledger = ledger_traffic(run_dir, res.workers)
        _say(f"ledger of {run_dir} (bytes its ranks recorded sending) against the counters:")
        for k, (r, led) in enumerate(zip(res.ranks, ledger)):
            ratio = f"x{r.tx_bytes / led['inter']:.4f}" if led["inter"] else "-"
            _say(f"host {k}: to other hosts {led['inter']} B (ledger), its interface sent {r.tx_bytes} B ({ratio}); "
                 f"within the host {led['intra']} B (ledger), its loopback carried {r.lo_bytes} B")
        _say("(the interfaces also carry start-up: rendezvous, store, gloo's connections; the evaluations' "
             "all-reduces, which the ledger leaves out; TCP/IP headers and acks. Two run lengths within one "
             "epoch differ by the steps' traffic alone)")
        info = json.loads((res.outdir / "cluster.json").read_text())
        info["ledger"] = {"run_dir": str(run_dir), "per_host": ledger}
        (res.outdir / "cluster.json").write_text(json.dumps(info, indent=2) + "\n")
    _say(f"{res.wall_s:.1f} s, latency: {res.latency_mode}, outputs in {res.outdir}")
    return _exit_code(res)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["torchrun"]:
            return _main_torchrun(_torchrun_parser().parse_args(argv[1:]))
        return _main_ranks(_parser().parse_args(argv))
    except VClusterError as e:
        print(f"vcluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vcluster: interrupted; torn down", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"vcluster: {e}; torn down", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
