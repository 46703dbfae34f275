"""Corroboration samplers: parsing and "unavailable, because ..." without a kernel, and
real martian / reverse-path drops between lab namespaces with one.

The drops: the lab's VPC namespace owns the LB VIP (bound on the node's kube-ipvs0 in
``ipvs-lb-bound``) and an address of the node's pod CIDR, and sends UDP datagrams
from each to the node. From the VIP they are martian (a local source); from the pod
address they fail strict reverse-path filtering (the node reaches it through cni0).

The tracepoint test needs tracefs: the agent never mounts it, so the test runs the
tracer in a private mount namespace (``unshare --mount``) with tracefs mounted there;
it skips, saying why, without unshare, without the mount, or on a kernel whose
kfree_skb has no drop reasons. Where it runs it prints the reasons it found and what
each counted (Linux 6.18 here: IP_RPFILTER, IP_LOCAL_SOURCE and IP_INVALID_SOURCE all
exist; the VIP source counts as IP_LOCAL_SOURCE).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.capture.corroborate import (
    DROP_REASONS,
    Corroborators,
    DropReasonTracer,
    KernelLogWatcher,
    MartianSampler,
    NetstatSampler,
    by_source,
    corroborators,
    drop_reason_values,
    kmsg_text,
    parse_netstat,
    parse_rt_cache,
)
from agent.capture.model import CaptureResult, Corroboration
from lab.node import Lab, build_lab
from lab.scenarios import LB_IP, SCENARIOS

REPO = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="needs root and ip")

RT_CACHE = """\
entries  in_hit   in_slow_tot in_slow_mc in_no_route in_brd   in_martian_dst in_martian_src
00000005 00000000 000000e1    00000000   0000000f    00000000 00000000       0000000a
00000005 00000000 0000012d    00000000   00000011    00000000 00000000       00000001
"""

NETSTAT = """\
TcpExt: SyncookiesSent IPReversePathFilter TW
TcpExt: 0 7 10
IpExt: InNoRoutes InOctets
IpExt: 3 1000
"""

FORMAT = """\
name: kfree_skb
format:
	field:void * skbaddr;	offset:8;	size:8;	signed:0;
	field:enum skb_drop_reason reason;	offset:36;	size:4;	signed:0;

print fmt: "skbaddr=%p reason: %s", REC->skbaddr, __print_symbolic(REC->reason, \
{ 2, "NOT_SPECIFIED" }, { 16, "IP_RPFILTER" }, { 89, "IP_LOCAL_SOURCE" }, \
{ 90, "IP_INVALID_SOURCE" }, { 128, "MAX" })
"""


# --- pure -------------------------------------------------------------------------------


def test_rt_cache_sums_the_cpu_rows() -> None:
    sums = parse_rt_cache(RT_CACHE)
    assert sums["in_martian_src"] == 11 and sums["in_slow_tot"] == 0xE1 + 0x12D
    with pytest.raises(ValueError):
        parse_rt_cache("a b\n1\n")


def test_netstat_pairs_names_and_values() -> None:
    got = parse_netstat(NETSTAT)
    assert got["TcpExtIPReversePathFilter"] == 7 and got["IpExtInNoRoutes"] == 3


def test_counter_samplers_give_deltas(tmp_path: Path) -> None:
    rt, ns = tmp_path / "rt_cache", tmp_path / "netstat"
    rt.write_text(RT_CACHE)
    ns.write_text(NETSTAT)
    m, r = MartianSampler(str(rt)), NetstatSampler(str(ns))
    m.start()
    r.start()
    rt.write_text(RT_CACHE.replace("0000000a\n", "0000000f\n"))
    ns.write_text(NETSTAT.replace("0 7 10", "0 9 10"))
    cm, cr = m.finish(), r.finish()
    assert (cm.source, cm.available, cm.value) == ("in_martian_src", True, 5)
    assert "global" in cm.detail and "every network namespace" in cm.detail
    assert (cr.source, cr.available, cr.value) == ("TcpExtIPReversePathFilter", True, 2)
    assert "this network namespace only" in cr.detail


def test_counter_samplers_say_why_they_are_unavailable(tmp_path: Path) -> None:
    missing = MartianSampler(str(tmp_path / "nope"))
    missing.start()
    c = missing.finish()
    assert not c.available and c.value is None
    assert c.detail.startswith("unavailable, because ") and "cannot be read" in c.detail
    (tmp_path / "netstat").write_text("TcpExt: TW\nTcpExt: 1\n")
    old = NetstatSampler(str(tmp_path / "netstat"))
    old.start()
    assert "has no TcpExtIPReversePathFilter counter" in old.finish().detail
    assert "start() was not called" in MartianSampler().finish().detail


def test_kmsg_records_and_missing_device(tmp_path: Path) -> None:
    rec = b"4,4711,2735176977,-;IPv4: martian source 10.0.0.10 from 10.0.1.10, on dev eth0\n" \
          b" SUBSYSTEM=net\n"
    assert kmsg_text(rec) == "IPv4: martian source 10.0.0.10 from 10.0.1.10, on dev eth0"
    w = KernelLogWatcher(str(tmp_path / "kmsg"))
    w.start()
    c = w.finish()
    assert not c.available and c.detail.startswith("unavailable, because ")


def test_drop_reason_numbers_come_from_the_format_file() -> None:
    values = drop_reason_values(FORMAT)
    assert {r: values[r] for r in DROP_REASONS} == {
        "IP_INVALID_SOURCE": 90, "IP_LOCAL_SOURCE": 89, "IP_RPFILTER": 16}
    assert drop_reason_values(FORMAT.replace("reason;", "other;")) == {}


def _fake_tracefs(root: Path, fmt: str) -> None:
    (root / "instances").mkdir(parents=True)
    event = root / "events" / "skb" / "kfree_skb"
    event.mkdir(parents=True)
    (event / "format").write_text(fmt)


def test_tracer_unavailable_cases_leave_nothing_behind(tmp_path: Path) -> None:
    c = DropReasonTracer(roots=[str(tmp_path / "none")]).finish()
    assert not c.available and "start() was not called" in c.detail
    with DropReasonTracer(roots=[str(tmp_path / "none")]) as t:
        pass
    assert "tracefs is not mounted" in t.finish().detail
    old = tmp_path / "old"
    _fake_tracefs(old, FORMAT.replace("reason;", "other;"))
    with DropReasonTracer(roots=[str(old)]) as t:
        pass
    assert "no drop reason on this kernel" in t.finish().detail
    # A tracefs whose instance cannot be configured: reported, and the instance removed.
    broken = tmp_path / "broken"
    _fake_tracefs(broken, FORMAT)
    with DropReasonTracer(roots=[str(broken)]) as t:
        assert t.instance is None
    detail = t.finish().detail
    assert detail.startswith("unavailable, because cannot set up the tracefs instance"), detail
    assert list((broken / "instances").iterdir()) == []


class _Fixed:
    def __init__(self, source: str, fail: bool = False) -> None:
        self.source = source
        self.fail = fail

    def start(self) -> None:
        pass

    def finish(self) -> Corroboration:
        if self.fail:
            raise RuntimeError("broken")
        return Corroboration(self.source, True, 1, "fixed")


def test_corroborators_attach_results_and_survive_a_broken_sampler() -> None:
    with corroborators([_Fixed("in_martian_src"), _Fixed("kernel log", fail=True)]) as corr:
        assert isinstance(corr, Corroborators)
    result = corr.attach(CaptureResult(1.0, (30000, 32767)))
    got = by_source(result.corroboration)
    assert got["in_martian_src"].value == 1
    assert not got["kernel log"].available and "broken" in got["kernel log"].detail
    assert corr.finish() is corr.finish()  # idempotent


# --- real drops --------------------------------------------------------------------------

_SEND = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
for _ in range(int(sys.argv[3])):
    s.sendto(b"loopback-agent", (sys.argv[2], 9))
"""
N = 20
ROGUE_POD_IP = "172.16.1.50"  # in the node's pod CIDR, owned by the VPC namespace


def _send(lab: Lab, src: str, n: int = N) -> None:
    lab.vpc.run(sys.executable, "-c", _SEND, src, lab.scenario.node_ip, str(n))
    time.sleep(0.2)  # the node processes them asynchronously (softirq)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with build_lab(SCENARIOS["ipvs-lb-bound"], "nft") as lab:
        lab.vpc.run("ip", "-batch", "-", input=f"address add {LB_IP}/32 dev lo\n"
                                               f"address add {ROGUE_POD_IP}/32 dev lo\n")
        # with the default 0 the VPC's ARP requests would carry the VIP as sender: martian
        lab.vpc.run("sysctl", "-q", "-w", "net.ipv4.conf.all.arp_announce=2")
        lab.node.run("sysctl", "-q", "-w", "net.ipv4.conf.all.log_martians=1")
        yield lab


@pytest.fixture()
def node_proc_net(lab: Lab) -> Iterator[str]:
    """/proc/<pid>/net of a process inside the node's network namespace."""
    holder = lab.node.popen(["sleep", "120"])
    try:
        yield f"/proc/{holder.pid}/net"
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.netns
@needs_root
def test_martian_source_drops_are_counted_and_logged(lab: Lab, node_proc_net: str) -> None:
    samplers = [MartianSampler(), NetstatSampler(f"{node_proc_net}/netstat"),
                KernelLogWatcher(keep=50)]
    with corroborators(samplers) as corr:
        _send(lab, LB_IP)
    got = by_source(corr.finish())
    martian, rp, log = got["in_martian_src"], got["TcpExtIPReversePathFilter"], got["kernel log"]
    assert martian.available and martian.value is not None and martian.value >= N, martian
    assert rp.available and rp.value == 0, rp  # a local source, not a reverse-path failure
    assert log.available and log.value is not None and log.value >= 1, log
    assert f"martian source {lab.scenario.node_ip} from {LB_IP}, on dev eth0" in log.detail


@pytest.mark.netns
@needs_root
def test_rp_filter_drops_raise_the_namespace_counter(lab: Lab, node_proc_net: str) -> None:
    samplers = [MartianSampler(), NetstatSampler(f"{node_proc_net}/netstat"),
                NetstatSampler()]  # the last one reads the test's own namespace
    with corroborators(samplers) as corr:
        _send(lab, ROGUE_POD_IP)
    martian, node_rp, own_rp = corr.finish()
    assert node_rp.value is not None and node_rp.value >= N, node_rp
    assert own_rp.available and (own_rp.value or 0) < N, own_rp  # per namespace
    assert martian.value is not None and martian.value >= N, martian  # counted there too


# Runs in a private mount namespace with tracefs mounted there (the agent itself never
# mounts it): the tracer's own instance, traffic in between, then the global files.
_TRACER = r"""
import json, os, sys
from agent.capture.corroborate import DropReasonTracer, find_tracefs
root = find_tracefs()
event = os.path.join(root, "events", "skb", "kfree_skb")
def global_state():
    return {f: open(os.path.join(event, f)).read() for f in ("enable", "filter", "trigger")} | {
        "tracing_on": open(os.path.join(root, "tracing_on")).read()}
before = global_state()
try:
    with DropReasonTracer() as t:
        first = t.instance
        raise RuntimeError("boom")
except RuntimeError:
    pass
first_removed = first is not None and not os.path.exists(first)
t = DropReasonTracer()
t.start()
print(json.dumps({"instance": t.instance, "values": t.values,
                  "first_removed": first_removed}), flush=True)
sys.stdin.readline()
c = t.finish()
print(json.dumps({"available": c.available, "value": c.value, "detail": c.detail,
                  "counts": t.counts, "global_unchanged": global_state() == before,
                  "instances": os.listdir(os.path.join(root, "instances"))}), flush=True)
"""


@pytest.mark.netns
@needs_root
def test_drop_reason_tracepoint_counts_in_its_own_instance(lab: Lab) -> None:
    if not shutil.which("unshare"):
        pytest.skip("no unshare: cannot mount tracefs in a private mount namespace")
    mount = 'mount -t tracefs nodev /sys/kernel/tracing && exec "$0" -c "$1"'
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             mount, sys.executable, _TRACER], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        if not first:
            err = proc.communicate(timeout=10)[1]
            pytest.skip(f"tracefs could not be mounted here: {err.strip()}")
        setup = json.loads(first)
        assert setup["first_removed"], "the instance stayed after an exception"
        if setup["instance"] is None:
            proc.stdin.write("\n")
            proc.stdin.flush()
            detail = json.loads(proc.stdout.readline())["detail"]
            pytest.skip(f"kfree_skb drop reasons unavailable on this kernel: {detail}")
        assert os.path.basename(setup["instance"]).startswith("loopback-agent-")
        _send(lab, LB_IP)
        _send(lab, ROGUE_POD_IP)
        out, err = proc.communicate("\n", timeout=30)
    finally:
        if proc.poll() is None:
            # let it finish (and remove its instance) before resorting to SIGKILL
            try:
                proc.communicate("\n", timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
    result = json.loads(out)
    assert result["available"], result
    counts = result["counts"]
    # Which reasons this kernel has and what they counted (shown with -s / on failure).
    ran = f"kfree_skb drop reasons {setup['values']} counted {counts}"
    print(ran)
    assert counts.get("IP_LOCAL_SOURCE", 0) >= N, ran  # the VIP source
    assert counts.get("IP_RPFILTER", 0) >= N, ran
    assert result["value"] >= 2 * N and "host-wide" in result["detail"], ran
    assert result["global_unchanged"], "the global instance's kfree_skb files changed"
    assert not [i for i in result["instances"] if i.startswith(f"loopback-agent-{proc.pid}")]
    assert os.path.basename(setup["instance"]) not in result["instances"]
