"""The lab: generated kube-proxy state is what the kernel and the iptables/ipset tools
accept and print back, and every scenario really builds (and really goes away).

Tests marked ``netns`` need root and build network namespaces; the rest are pure.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import kube_proxy_rules as kpr
from lab.kube_proxy_rules import LbService
from lab.netns import Netns, netns
from lab.node import BACKENDS, build_lab, ping
from lab.scenarios import SCENARIOS, Scenario

_HAVE_TOOLS = all(shutil.which(t) for t in ("ip", "ipset", "iptables-legacy-restore",
                                             "iptables-nft-restore"))
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not _HAVE_TOOLS,
                                reason="needs root, ip, ipset and both iptables backends")
lab_test = [pytest.mark.netns, needs_root]

# A mix that reaches every branch of the generators: eTP=Local with and without a local
# endpoint, eTP=Cluster, no endpoints at all, an external IP, a ClusterIP service.
SVCS = (
    LbService(namespace="demo", name="web", node_port=30080, cluster_ip="10.96.100.10",
              lb_ip="10.0.1.10", etp="Local", local_endpoints=("172.16.1.10",),
              remote_endpoints=("172.16.2.10", "172.16.3.10"), health_check_node_port=32000),
    LbService(namespace="demo", name="nolocal", node_port=30081, cluster_ip="10.96.100.11",
              lb_ip="10.0.1.11", etp="Local", remote_endpoints=("172.16.2.11",),
              health_check_node_port=32001, external_ips=("10.0.5.5",)),
    LbService(namespace="demo", name="cluster", node_port=30082, cluster_ip="10.96.100.12",
              lb_ip="10.0.1.12", local_endpoints=("172.16.1.12",),
              remote_endpoints=("172.16.2.12",)),
    LbService(namespace="demo", name="noep", node_port=30083, cluster_ip="10.96.100.13",
              lb_ip="10.0.1.13"),
    LbService(namespace="default", name="kubernetes", port_name="https", port=443,
              target_port=6443, cluster_ip="10.96.0.1", remote_endpoints=("10.0.0.2",)),
)
CIDR = "172.16.0.0/16"
NODE = "10.0.0.10"

# kubelet's KUBE-MARK-DROP, which the old generation's restore input jumps to.
_KUBELET_MARK_DROP = ("*nat\n:KUBE-MARK-DROP - [0:0]\n"
                      "-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000\nCOMMIT\n")


def _tables(text: str) -> dict[str, list[str]]:
    """table -> chain and rule lines, without comments or counters."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = out.setdefault(line[1:], [])
        else:
            current.append(line)
    return out


def _ns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# --- pure -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [
    # pkg/proxy/iptables/proxier_test.go (TestParseIPTablesData, TestSortIPTablesRules)
    ("ns1/svc1:p80", "XPGD46QRK7WJZT7O"),
    ("ns2/svc2:p80", "GNZBNJ2PO5MGZ6GT"),
    ("ns3/svc3:p80", "X27LE4BHSL4DOUIK"),
    ("ns4/svc4:p80", "4SW47YFZTEDKD3PK"),
    ("ns5/svc5:p80", "NUKIZ6OKUXPJNT4C"),
])
def test_chain_hash_matches_kube_proxy(name: str, expected: str) -> None:
    assert kpr.chain_hash(name, "TCP") == expected
    assert kpr.chain_hash(name, "tcp") == expected


@pytest.mark.parametrize(("name", "endpoint", "expected"), [
    ("ns1/svc1:p80", "10.180.0.1:80", "SXIVWICOYRO3J4NJ"),
    ("ns2/svc2:p80", "10.180.0.2:80", "RS4RBKLTHTF2IUXJ"),
    ("ns4/svc4:p80", "10.180.0.4:80", "UKSFD7AGPMPPLUHC"),
    ("ns4/svc4:p80", "10.180.0.5:80", "C6EBXVWJJZMIWKLZ"),
])
def test_endpoint_chain_hash_matches_kube_proxy(name: str, endpoint: str,
                                                expected: str) -> None:
    assert kpr.endpoint_chain_hash(name, "tcp", endpoint) == expected


def test_generations_use_their_chain_names() -> None:
    new = kpr.iptables_mode(SVCS, generation="new", cluster_cidr=CIDR, node_ip=NODE)
    old = kpr.iptables_mode(SVCS, generation="old", cluster_cidr=CIDR, node_ip=NODE)
    assert ":KUBE-EXT-" in new and ":KUBE-SVL-" in new
    assert ":KUBE-XLB-" not in new and ":KUBE-FW-" not in new
    assert ":KUBE-XLB-" in old and ":KUBE-FW-" in old and ":KUBE-EXT-" not in old
    assert '"pod traffic for demo/web:http external destinations"' in new
    assert '"demo/nolocal:http has no local endpoints" -m tcp --dport 80 -j DROP' in new
    assert "Redirect pods trying to reach external loadbalancer VIP to clusterIP" in old
    assert '"demo/nolocal:http has no local endpoints" -j KUBE-MARK-DROP' in old
    no_cidr = kpr.iptables_mode(SVCS, generation="new", cluster_cidr=None, node_ip=NODE)
    assert "pod traffic for" not in no_cidr and CIDR not in no_cidr


def test_restore_input_is_kube_proxys_form() -> None:
    text = kpr.kube_proxy_restore_input(SVCS, generation="new", cluster_cidr=CIDR,
                                        node_ip=NODE)
    assert not text.startswith("#") and "/32" not in text
    assert "-A KUBE-MARK-MASQ -j MARK --or-mark 0x004000" in text
    assert not re.search(r"^-A (PREROUTING|OUTPUT|POSTROUTING|INPUT|FORWARD) ", text, re.M)
    assert re.search(r"^:KUBE-SERVICES - \[0:0\]$", text, re.M)
    assert ("-A KUBE-SERVICES -m comment --comment \"demo/web:http loadbalancer IP\" "
            "-m tcp -p tcp -d 10.0.1.10 --dport 80 -j KUBE-EXT-") in text


def test_synthetic_is_deterministic_and_complete() -> None:
    for mode in ("iptables", "ipvs", "nftables"):
        a, b = kpr.synthetic(50, mode, seed=7), kpr.synthetic(50, mode, seed=7)
        assert a == b
        assert {"route-local.txt", "addr.txt", "sysctl.txt", "services.json"} <= set(a)
        assert {"iptables-save.txt", "ipset.txt", "ipvsadm.txt"} <= set(a) \
            if mode != "nftables" else "nft-transaction.txt" in a
    ipvs = kpr.synthetic(50, "ipvs")
    assert ipvs["ipvsadm.txt"].count("-A -t ") == 150  # cluster IP, LB IP, NodePort each
    assert "dev kube-ipvs0" in ipvs["route-local.txt"]


def test_scenarios_expect_every_vip() -> None:
    known = {"lb-ip-local", "pod-to-lb-not-masqueraded", "pod-to-lb-captured",
             "pod-to-lb-masqueraded", "etp-local-no-local-endpoint"}
    for sc in SCENARIOS.values():
        assert set(sc.expect) == set(sc.lb_ips) | set(sc.ingress_ips), sc.name
        for ids in sc.expect.values():
            assert ids and ids <= known, sc.name


# --- generated text against the real tools --------------------------------------------


def _restore_test(ns: Netns, backend: str, text: str, *extra: str) -> None:
    proc = ns.run(f"iptables-{backend}-restore", "--test", *extra, input=text, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.netns
@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_accepts_everything_generated(backend: str) -> None:
    texts = [kpr.iptables_mode(SVCS, generation=g, cluster_cidr=c, node_ip=NODE)
             for g in ("new", "old") for c in (CIDR, None)]
    texts += [kpr.merge_restore(texts[0], kpr.ip_masq_agent(["10.0.0.0/8"]),
                                kpr.cni_masquerade("172.16.1.0/24")),
              kpr.ip_masq_agent(["172.16.0.0/16"], masq_link_local=True),
              kpr.synthetic(200, "iptables")["iptables-save.txt"]]
    with netns("lbt") as ns:
        for text in texts:
            _restore_test(ns, backend, text)
        _restore_test(ns, backend, kpr.kube_proxy_restore_input(
            SVCS, generation="new", cluster_cidr=CIDR, node_ip=NODE), "--noflush")
    with netns("lbt") as ns:  # the IPVS rules match sets, which must exist
        ipvs = kpr.synthetic(200, "ipvs")
        ns.run("ipset", "restore", input=ipvs["ipset.txt"])
        _restore_test(ns, backend, ipvs["iptables-save.txt"])
        state = kpr.ipvs_mode(SVCS, bind_lb_ip=False, cluster_cidr=None, node_ip=NODE)
        ns.run("ipset", "flush")
        ns.run("ipset", "destroy")
        ns.run("ipset", "restore", input=state.ipset_restore)
        _restore_test(ns, backend, state.iptables_restore)
    with netns("lbt") as ns:  # old kube-proxy jumps to kubelet's KUBE-MARK-DROP
        ns.run(f"iptables-{backend}-restore", input=_KUBELET_MARK_DROP)
        _restore_test(ns, backend, kpr.kube_proxy_restore_input(
            SVCS, generation="old", cluster_cidr=CIDR, node_ip=NODE), "--noflush")


@pytest.mark.netns
@needs_root
def test_nftables_synthetic_is_what_the_kernel_takes_and_diagnosed_as_iptables(
        tmp_path: Path) -> None:
    """The benchmark's nftables-mode state: `nft -f` loads it into a namespace; read back
    from the kernel (`nft list ruleset`, what the agent reads live, and `nft -j list
    table ip kube-proxy`) and as the transaction text, it gives the same verdict, and the
    same findings per LB IP as the iptables-mode state of the same Services."""
    from agent.bundle import load_bundle
    from agent.diagnose import diagnose

    files = kpr.synthetic(120, "nftables")
    with netns("lbt") as ns:
        ns.run("nft", "-f", "-", input=files["nft-transaction.txt"])
        dumped = ns.run("nft", "-j", "list", "table", "ip", "kube-proxy").stdout
        listed = ns.run("nft", "list", "ruleset").stdout

    def findings(bundle: dict[str, str], name: str) -> dict[str, list[str]]:
        d = tmp_path / name
        d.mkdir()
        for fname, text in bundle.items():
            (d / fname).write_text(text)
        v = diagnose(load_bundle(d), "n").to_dict("all")
        out: dict[str, list[str]] = {}
        for f in v["findings"]:
            out.setdefault(f["lb_ip"] or "", []).append(f["id"])
        return {ip: sorted(ids) for ip, ids in out.items()}

    rest = {k: v for k, v in files.items() if k != "nft-transaction.txt"}
    as_text = findings(files, "text")
    assert len(as_text) == 120 and all("pod-to-lb-captured" in ids for ids in as_text.values())
    assert sum("etp-local-no-local-endpoint" in ids for ids in as_text.values()) > 10
    assert findings({**rest, "nft-kube-proxy.json": dumped}, "kernel") == as_text
    assert findings({**rest, "nft-ruleset.txt": listed}, "listed") == as_text
    assert findings(kpr.synthetic(120, "iptables"), "iptables") == as_text


@pytest.mark.netns
@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_save_rendering_is_what_iptables_save_prints(backend: str) -> None:
    """Load each rendering, save it back: identical per table (the order of the tables
    themselves varies with the backend)."""
    cases = [(kpr.iptables_mode(SVCS, generation=g, cluster_cidr=CIDR, node_ip=NODE), "")
             for g in ("new", "old")]
    state = kpr.ipvs_mode(SVCS, bind_lb_ip=True, cluster_cidr=CIDR, node_ip=NODE)
    cases.append((kpr.merge_restore(state.iptables_restore, kpr.ip_masq_agent(["10.0.0.0/8"])),
                  state.ipset_restore))
    for text, sets in cases:
        with netns("lbt") as ns:
            if sets:
                ns.run("ipset", "restore", input=sets)
            ns.run(f"iptables-{backend}-restore", input=text)
            saved = ns.run(f"iptables-{backend}-save").stdout
        assert _tables(saved) == _tables(text)


@pytest.mark.netns
@needs_root
def test_ipset_text_is_what_ipset_save_prints() -> None:
    text = kpr.synthetic(200, "ipvs")["ipset.txt"]
    with netns("lbt") as ns:
        ns.run("ipset", "restore", input=text)
        saved = ns.run("ipset", "save").stdout
    # hash sets list members in hash order and get a fresh initval
    def norm(t: str) -> set[str]:
        return {re.sub(r" initval 0x[0-9a-f]+", "", line) for line in t.splitlines()}
    assert norm(saved) == norm(text)


# --- the lab itself -------------------------------------------------------------------


@pytest.mark.netns
@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_lab_builds_and_goes_away(name: str, backend: str) -> None:
    sc = SCENARIOS[name]
    with build_lab(sc, backend) as lab:
        names = {lab.node.name, lab.vpc.name, lab.client_pod.name}
        assert names <= _ns_names()

        saved = lab.iptables_save()
        assert ":KUBE-SERVICES - " in saved and ":KUBE-POSTROUTING - " in saved
        assert "-j KUBE-POSTROUTING" in saved
        if sc.ip_masq_agent:
            assert ":IP-MASQ-AGENT - " in saved
        other = "nft" if backend == "legacy" else "legacy"
        if other == "legacy":
            # reading /proc, not iptables-legacy-save: that would create the table
            names_file = lab.node.run("cat", "/proc/net/ip_tables_names").stdout
            assert names_file.split() == []
        else:
            assert "KUBE-" not in lab.node.run("iptables-nft-save").stdout

        sets = lab.node.run("ipset", "save").stdout
        if sc.mode == "ipvs":
            for s in ("KUBE-CLUSTER-IP", "KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-LOCAL",
                      "KUBE-NODE-PORT-TCP", "KUBE-LOOP-BACK", "KUBE-IPVS-IPS"):
                assert f"create {s} " in sets
            assert f"add KUBE-LOAD-BALANCER {sc.lb_ips[0]},tcp:80" in sets
        else:
            assert sets.strip() == ""

        local = lab.node.run("ip", "route", "show", "table", "local").stdout
        for vip in sc.lb_ips:
            bound = sc.mode == "ipvs" and sc.bind_lb_ip
            assert (f"local {vip} dev kube-ipvs0 " in local) == bound, vip
        if sc.mode == "ipvs":
            assert "local 10.96.0.1 dev kube-ipvs0 " in local
            assert "kube-ipvs0: <" in lab.node.run("ip", "link", "show", "kube-ipvs0").stdout
        assert {"services.json", "node.json", "ingresses.json"} <= {
            p.name for p in lab.kube_dir.iterdir()}
        assert ping(lab.client_pod, sc.pod_gateway)
        kube_dir = lab.kube_dir
    assert not names & _ns_names()
    assert not kube_dir.exists()


@pytest.mark.netns
@needs_root
def test_lab_cleans_up_on_error() -> None:
    before = _ns_names()
    with pytest.raises(RuntimeError, match="boom"), build_lab(SCENARIOS["ipvs-lb-bound"]):
        raise RuntimeError("boom")
    assert _ns_names() == before


# The "CLB": accepts on every VIP in the VPC namespace and reports who connected;
# when its stdin closes it drains the accept queue and exits.
_CLB = r"""
import select, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 80)); s.listen(64); s.setblocking(False)
print("ready", flush=True)
done = False
while not done:
    r, _, _ = select.select([s, sys.stdin], [], [], 10)
    done = sys.stdin in r or not r
    while True:
        try:
            c, peer = s.accept()
        except BlockingIOError:
            break
        print(c.getsockname()[0], peer[0], flush=True); c.close()
"""
_CLIENT = r"""
import socket, sys
for vip in sys.argv[1:]:
    try:
        socket.create_connection((vip, 80), timeout=0.6).close()
    except OSError:
        pass
"""


@pytest.mark.netns
@needs_root
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_kernel_agrees_with_expectations(name: str) -> None:
    """Connect from the client pod to every VIP, with a listener standing in for the CLB
    on the VPC side: the source it sees (pod IP, node IP, or no connection at all)
    must be the one the scenario's expectation names."""
    sc: Scenario = SCENARIOS[name]
    vips = sorted(sc.expect)
    backend = BACKENDS[sorted(SCENARIOS).index(name) % 2]  # both, without doubling the time
    with build_lab(sc, backend) as lab:
        lab.vpc.run("ip", "-batch", "-", input="".join(
            f"address add {v}/32 dev lo\n" for v in vips))
        clb = lab.vpc.popen([sys.executable, "-c", _CLB], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
        try:
            assert clb.stdout is not None and clb.stdout.readline().strip() == "ready"
            lab.client_pod.run(sys.executable, "-c", _CLIENT, *vips, timeout=10)
            out, _ = clb.communicate(timeout=10)
            counted = lab.node.run(f"iptables-{backend}-save", "-c", "-t", "nat").stdout
        finally:
            if clb.poll() is None:
                clb.kill()
                clb.wait()
    seen = dict(line.split() for line in out.splitlines())
    for vip in vips:
        src = seen.get(vip)
        got = {sc.client_pod_ip: "pod-to-lb-not-masqueraded", sc.node_ip: "pod-to-lb-masqueraded",
               None: "pod-to-lb-captured"}[src]
        assert got in sc.expect[vip], (vip, src)
        if got == "pod-to-lb-captured" and sc.mode == "iptables":
            # not a silent loss: kube-proxy's "loadbalancer IP" rule took the SYN
            hit = re.search(rf"^\[([1-9]\d*):\d+\] -A KUBE-SERVICES -d {re.escape(vip)}/32 .*"
                            r"loadbalancer IP", counted, re.M)
            assert hit, vip


def test_real_ipvs_needs_ip_vs_and_dummy_loaded(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """Creating a dummy device would load ``dummy`` (and its dummy0 in the root
    namespace): the lab builds real IPVS only where both modules are already loaded."""
    from lab import node

    monkeypatch.delenv(node.IPVS_KIND_ENV, raising=False)
    ip_vs, dummy = tmp_path / "ip_vs", tmp_path / "dummy"
    monkeypatch.setattr(node, "PROC_IP_VS", str(ip_vs))
    monkeypatch.setattr(node, "SYS_MODULE_DUMMY", str(dummy))
    assert node.ipvs_kind() == node.STANDIN
    ip_vs.write_text("")
    assert node.ipvs_kind() == node.STANDIN  # ip_vs alone (an LVS or Swarm host)
    dummy.mkdir()
    assert node.ipvs_kind() == node.REAL
    monkeypatch.setenv(node.IPVS_KIND_ENV, node.STANDIN)
    assert node.ipvs_kind() == node.STANDIN
    monkeypatch.setenv(node.IPVS_KIND_ENV, "yes")
    with pytest.raises(ValueError, match="LOOPBACK_AGENT_LAB_IPVS"):
        node.ipvs_kind()


_HOLD_NAMESPACES = """
import sys, time
sys.path.insert(0, sys.argv[1])
from lab import netns
made = [netns.create("lbterm") for _ in range(20)]
with netns.netns("lbterm") as b:
    print(*(n.name for n in made), b.name, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.netns
@needs_root
def test_a_terminated_run_leaves_no_namespace(sig: signal.Signals) -> None:
    # a run stopped by `timeout`, a closed terminal or a cancelled CI job: before, SIGTERM
    # and SIGHUP killed it where it stood, and the namespaces it made stayed behind. A
    # second signal while they are deleted (timeout signals the whole group) cuts nothing
    # short, and the process still dies of the signal
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_NAMESPACES,
                             str(Path(__file__).resolve().parents[1])],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    names = proc.stdout.readline().split()
    try:
        assert len(names) == 21 and set(names) <= set(_namespaces())
        proc.send_signal(sig)
        time.sleep(0.02)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == -sig
        assert not set(names) & set(_namespaces())
    finally:
        proc.kill()
        proc.wait()
        for n in set(names) & set(_namespaces()):  # (what the old code left)
            subprocess.run(["ip", "netns", "del", n], check=False)


_HELD_TEST = """
import time
from pathlib import Path
from lab import netns

def test_holds_a_namespace():
    with netns.netns("lbtermp") as ns:
        print("holding", ns.name, flush=True)
        time.sleep(60)

def test_after():
    Path(__file__).with_name("after-ran").touch()
"""


@pytest.mark.netns
@needs_root
def test_a_terminated_pytest_run_stops_and_cleans_up(tmp_path: Path) -> None:
    # this suite's conftest: SIGTERM stops the session as Ctrl-C does (each test's clean-up
    # runs, no further test starts); before, it killed pytest where it stood
    (tmp_path / "test_held.py").write_text(_HELD_TEST)
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "tests.conftest",
                             "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
                             str(tmp_path / "test_held.py")],
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": repo})
    assert proc.stdout is not None
    line = ""
    while not line.startswith("holding"):  # (pytest's own lines come first)
        line = proc.stdout.readline()
        assert line, "the held test never started"
    name = line.split()[1]
    try:
        assert name in _namespaces()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 2, out  # pytest's "interrupted"
        assert "KeyboardInterrupt" in out
        assert name not in _namespaces()
        assert not (tmp_path / "after-ran").exists()
    finally:
        proc.kill()
        proc.wait()
        if name in _namespaces():  # (what the old code left)
            subprocess.run(["ip", "netns", "del", name], check=False)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
