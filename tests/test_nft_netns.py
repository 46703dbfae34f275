"""kube-proxy nftables mode on a real kernel: kube-proxy's own ruleset (its
TestOverallNFTablesRules transaction, tests/data/realworld/k8s-nftables-overall-...) loaded
with `nft -f` into a node namespace the test makes, with a pod, an outside client and the
endpoints in namespaces of their own. Real SYNs show what the kernel does; the agent's
live `check` in the node namespace, `check --from` of the bundle it saves there and of a
pasted `nft list table` must say the same.
The node and its neighbours: lab.nft_node (all namespaces made there, the root
namespace untouched).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from agent.bundle import load_bundle
from agent.diagnose import prepare
from agent.diagnose.nft_paths import NftBackend
from agent.netfilter.packet import Packet
from lab.netns import Netns
from lab.nft_node import connect, nft_node, serve
from tests.nodestate import capture

pytestmark = pytest.mark.netns

CORPUS = Path(__file__).parent / "data" / "realworld"
# kube-proxy's current rule generation and the v1.29 one (NodePorts by 'fib daddr type
# local', one endpoints-check chain): the same services, the same kernel behaviour
CASES = ("k8s-nftables-overall-rules-lb-etp-local-sourceranges",
         "knftables-fakedump-k8s-1.29-nftables-fib-nodeports")

# the constructed Service 9.9.9.9 whose address kube-proxy's table does not hold is one it
# has not synced, and the verdict says so too
UNSYNCED = "lb-ip-without-kube-proxy-rule"


def agent(ns: Netns | None, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "agent", *args]
    if ns is not None:
        return ns.run(*cmd, check=False, timeout=120)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def unchanging(state: dict[str, str]) -> dict[str, str]:
    """The node's state without the countdown of session-affinity entries (the traffic
    above filled the affinity set; its "expires" drops by the second)."""
    return {k: re.sub(r" expires \S+", "", v) for k, v in state.items()}


def ids_by_ip(v: dict[str, Any]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in v["findings"]:
        if f["lb_ip"]:
            out.setdefault(f["lb_ip"], set()).add(f["id"])
    return out


@pytest.mark.parametrize("case", CASES)
def test_kernel_and_agent_agree_on_an_nftables_mode_node(case: str, tmp_path: Path) -> None:
    with nft_node((CORPUS / case / "nft-transaction.txt").read_text()) as ns:
        node, pod, client = ns["node"], ns["pod"], ns["client"]
        # what the kernel does
        kernel = {
            # pod -> LB IP of an eTP=Local service: DNATed on the node to 10.180.0.2, the
            # pod's own address kept (short-circuit pod traffic): captured
            "pod 1.2.3.4": connect(pod, "1.2.3.4", 80),
            "pod 192.168.99.33": connect(pod, "192.168.99.33", 80),  # eTP=Cluster
            # pod -> LB IP with loadBalancerSourceRanges: dropped before DNAT
            "pod 5.6.7.8": connect(pod, "5.6.7.8", 80),
            # the load balancer -> NodePort 3001 (eTP=Local, no local endpoint): dropped
            "client :3001": connect(client, "192.168.0.2", 3001),
            # NodePort 3002 (Cluster): served, masqueraded to the node's ep0 address
            "client :3002": connect(client, "192.168.0.2", 3002),
            # straight to the LB IP with loadBalancerSourceRanges: in the range served and
            # masqueraded, out of it dropped; eTP=Local LB IP from outside: dropped here
            "in-range 5.6.7.8": connect(client, "5.6.7.8", 80, "203.0.113.2"),
            "out-of-range 5.6.7.8": connect(client, "5.6.7.8", 80, "203.0.113.130"),
            "outside 1.2.3.4": connect(client, "1.2.3.4", 80, "203.0.113.2"),
        }
        assert kernel["pod 1.2.3.4"] == "peer=10.0.1.5 local=10.180.0.2", kernel
        # eTP=Cluster: the external chain marks every packet for masquerade, a pod's too
        assert kernel["pod 192.168.99.33"] in ("peer=10.99.0.1 local=10.180.0.4",
                                               "peer=10.99.0.1 local=10.180.0.5"), kernel
        assert kernel["pod 5.6.7.8"] == "timeout", kernel
        assert kernel["client :3001"] == "timeout", kernel
        assert kernel["client :3002"] == "peer=10.99.0.1 local=10.180.0.3", kernel
        assert kernel["in-range 5.6.7.8"] == "peer=10.99.0.1 local=10.180.0.3", kernel
        assert kernel["out-of-range 5.6.7.8"] == "timeout", kernel
        assert kernel["outside 1.2.3.4"] == "timeout", kernel

        before = unchanging(capture(node))
        live = agent(node, "check", "--json", "--all", "--no-kube-api", "--node-name", "nft-node")
        assert live.returncode == 0, live.stderr
        v = json.loads(live.stdout)
        bundle = tmp_path / "bundle"
        saved = agent(node, "bundle", str(bundle), "--no-kube-api")
        assert saved.returncode == 0, saved.stderr
        (tmp_path / "paste").mkdir()
        (tmp_path / "paste" / "nft.txt").write_text(
            "# nft list table ip kube-proxy\n" + node.run("nft", "list", "table", "ip",
                                                         "kube-proxy").stdout)
        after = unchanging(capture(node))
    assert before == after, "the agent changed the node"
    assert (bundle / "nft-ruleset.txt").exists()
    assert v["kube_proxy_mode"] == "nftables", v
    got = ids_by_ip(v)
    # the agent says what the kernel did
    assert "pod-to-lb-captured" in got["1.2.3.4"], got
    assert "pod-to-lb-captured" in got["192.168.99.33"], got
    assert "pod-to-lb-dropped" in got["5.6.7.8"], got
    assert "etp-local-no-local-endpoint" in got["1.2.3.4"], got
    assert not any("pod-to-lb-not-masqueraded" in ids or "pod-to-lb-undetermined" in ids
                   for ids in got.values()), got
    assert v["status"] == "healthy", v
    # the evidence quotes kube-proxy's nft rules
    cap = next(f for f in v["findings"] if f["id"] == "pod-to-lb-captured"
               and f["lb_ip"] == "1.2.3.4")
    assert any("dnat to 10.180.0.2:80" in e for e in cap["evidence"]), cap
    drop = next(f for f in v["findings"] if f["id"] == "pod-to-lb-dropped")
    assert any("203.0.113.0/25" in e and "drop" in e for e in drop["evidence"]), drop

    # the walker on the saved node state, for the outside clients (no finding asks it)
    facts = prepare(load_bundle(bundle)).facts
    walker = NftBackend(facts).walker

    def walked(src: str, dst: str) -> set[str]:
        out = set()
        for r in walker.walk_hook("prerouting", Packet(src=src, dst=dst, dport=80,
                                                          in_iface="eth0")):
            if r.verdict not in ("DNAT", "ACCEPT"):
                out.add(r.verdict)
                continue
            # not DNATed: 1.2.3.4 is no address of the node, it is forwarded (uplink)
            out_iface = "ep0" if r.verdict == "DNAT" else "eth0"
            for f in walker.walk_hook("forward", r.packet._replace(out_iface=out_iface)):
                post = walker.walk_hook("postrouting", f.packet) if f.verdict == "ACCEPT" \
                    else ()
                out |= {f.verdict} if f.verdict != "ACCEPT" else {
                    f"served {r.packet.dnat_to} {p.verdict}" for p in post}
        return out

    assert walked("203.0.113.2", "5.6.7.8") == {"served 10.180.0.3:80 MASQUERADE"}
    assert walked("203.0.113.130", "5.6.7.8") == {"DROP"}
    assert walked("203.0.113.2", "1.2.3.4") == {"DROP"}

    offline = agent(None, "check", "--from", str(bundle), "--json", "--all", "--node-name",
                    "nft-node")
    assert offline.returncode == live.returncode, offline.stderr
    w = json.loads(offline.stdout)
    assert w["kube_proxy_mode"] == "nftables"
    assert ids_by_ip(w) == got
    assert w["status"] == v["status"]
    # a pasted listing alone (no addresses): the same findings for the LB IPs
    pasted = agent(None, "check", "--from", str(tmp_path / "paste"), "--json", "--all")
    p = json.loads(pasted.stdout)
    assert p["kube_proxy_mode"] == "nftables", pasted.stderr
    assert ids_by_ip(p) == got, (ids_by_ip(p), got)


def unsynced_service(tmp_path: Path) -> Path:
    """A kube dir with one LoadBalancer Service, 9.9.9.9:80, that kube-proxy's table does
    not serve (not synced yet): its pod traffic leaves the node."""
    kube = tmp_path / "kube"
    kube.mkdir()
    (kube / "services.json").write_text(json.dumps({"kind": "List", "items": [{
        "kind": "Service", "metadata": {"namespace": "ns9", "name": "new"},
        "spec": {"type": "LoadBalancer", "clusterIP": "172.30.0.99",
                 "ports": [{"port": 80, "protocol": "TCP", "nodePort": 3009}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "9.9.9.9"}]}}}]}))
    return kube


def unsynced_lb(stack: ExitStack, client: Netns) -> None:
    """The "load balancer" of that Service: 9.9.9.9 answering in the client namespace."""
    client.run("ip", "addr", "add", "9.9.9.9/32", "dev", "lo")
    serve(stack, client, "9.9.9.9")


@pytest.mark.parametrize("cni_masquerade", [False, True], ids=["no-cni-rule", "cni-masq"])
def test_a_cnis_iptables_rule_beside_kube_proxys_nft_table(cni_masquerade: bool,
                                                           tmp_path: Path) -> None:
    """An LB IP kube-proxy's table does not serve (a Service it has not synced yet): the
    pod's SYN leaves the node; whether with the pod's address or the node's is decided by
    a CNI's iptables-nft MASQUERADE in nat POSTROUTING, beside kube-proxy's nft chains on
    the same hook. The kernel shows which; the agent must say the same."""
    kube = unsynced_service(tmp_path)
    with nft_node((CORPUS / CASES[0] / "nft-transaction.txt").read_text()) as ns, \
            ExitStack() as stack:
        node, pod, client = ns["node"], ns["pod"], ns["client"]
        unsynced_lb(stack, client)
        if cni_masquerade:
            node.run("iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-s", "10.0.1.0/24",
                     "!", "-d", "10.0.0.0/8", "-j", "MASQUERADE")
        seen = connect(pod, "9.9.9.9", 80)
        assert seen == ("peer=192.168.0.2 local=9.9.9.9" if cni_masquerade
                        else "peer=10.0.1.5 local=9.9.9.9"), seen
        live = agent(node, "check", "--json", "--all", "--no-kube-api", "--kube-json", str(kube),
                     "--node-name", "nft-node")
        bundle = tmp_path / "bundle"
        assert agent(node, "bundle", str(bundle), "--no-kube-api").returncode == 0
    v = json.loads(live.stdout)
    want = "pod-to-lb-masqueraded" if cni_masquerade else "pod-to-lb-not-masqueraded"
    assert ids_by_ip(v)["9.9.9.9"] == {want, UNSYNCED}, v
    assert "pod-to-lb-captured" in ids_by_ip(v)["1.2.3.4"]
    f = next(f for f in v["findings"]
             if f["lb_ip"] == "9.9.9.9" and f["id"].startswith("pod-to-lb"))
    if cni_masquerade:
        assert any(e.startswith("iptables nat POSTROUTING: -A POSTROUTING -s 10.0.1.0/24")
                   for e in f["evidence"]), f["evidence"]
    (bundle / "services.json").write_text((kube / "services.json").read_text())
    offline = json.loads(agent(None, "check", "--from", str(bundle), "--json", "--all",
                               "--node-name", "nft-node").stdout)
    assert ids_by_ip(offline) == ids_by_ip(v)


CONSTRUCTED = Path(__file__).parent / "data" / "constructed"


def _live_ids(node: Netns, tmp_path: Path, kube: Path | None = None) -> dict[str, set[str]]:
    args = ["check", "--json", "--all", "--no-kube-api", "--node-name", "nft-node"]
    if kube is not None:
        args += ["--kube-json", str(kube)]
    live = agent(node, *args)
    assert live.stdout, live.stderr
    return ids_by_ip(json.loads(live.stdout))


def test_constructed_firewalld_inet_table_beside_kube_proxy(tmp_path: Path) -> None:
    """tests/data/constructed/nft-inet-firewalld-ip6-rules: a firewalld-style inet table
    with ip6-only rules on the forward hook. The kernel lets the pod's IPv4 SYN to an LB
    IP kube-proxy does not serve leave with the pod's address; the agent must say
    not-masqueraded, not undetermined."""
    kube = unsynced_service(tmp_path)
    fw = (CONSTRUCTED / "nft-inet-firewalld-ip6-rules" / "nft-firewalld.txt").read_text()
    with nft_node((CORPUS / CASES[0] / "nft-transaction.txt").read_text()) as ns, \
            ExitStack() as stack:
        node, pod, client = ns["node"], ns["pod"], ns["client"]
        node.run("nft", "-f", "-", input=fw)
        unsynced_lb(stack, client)
        assert connect(pod, "9.9.9.9", 80) == "peer=10.0.1.5 local=9.9.9.9"
        got = _live_ids(node, tmp_path, kube)
    assert got["9.9.9.9"] == {"pod-to-lb-not-masqueraded", UNSYNCED}, got
    assert "pod-to-lb-captured" in got["1.2.3.4"], got


@pytest.mark.parametrize("case,kernel,want", [
    # no local-traffic detector (no cluster CIDR): no "short-circuit pod traffic" rule;
    # eTP=Local without a local endpoint: the external chain falls through, the packet is
    # forwarded and service-endpoints-check drops it
    ("nft-etp-local-no-detector-no-local-endpoint", "timeout", "pod-to-lb-dropped"),
    # the same with a local endpoint: 'goto local-...' DNATs it, the pod's address kept
    ("nft-etp-local-no-detector-local-endpoint", "peer=10.0.1.5 local=10.180.0.2",
     "pod-to-lb-captured"),
])
def test_constructed_etp_local_without_a_local_detector(case: str, kernel: str, want: str,
                                                        tmp_path: Path) -> None:
    with nft_node((CONSTRUCTED / case / "nft-transaction.txt").read_text()) as ns:
        assert connect(ns["pod"], "1.2.3.4", 80) == kernel
        got = _live_ids(ns["node"], tmp_path)
    assert want in got["1.2.3.4"] and not ({"pod-to-lb-not-masqueraded",
                                            "pod-to-lb-undetermined"} & got["1.2.3.4"]), got


def test_constructed_source_ranges_listed_as_a_range(tmp_path: Path) -> None:
    """nft lists loadBalancerSourceRanges 203.0.113.0/25 + 203.0.113.128/26 as
    { 203.0.113.0-203.0.113.191 }; the kernel serves 203.0.113.150, drops 203.0.113.200
    and the pod; the agent's walk of that listing says the same, without assuming."""
    listing = (CONSTRUCTED / "nft-sourceranges-merged-to-a-range" / "nft-list-table.txt")
    with nft_node((CORPUS / CASES[0] / "nft-transaction.txt").read_text()) as ns:
        node, pod, client = ns["node"], ns["pod"], ns["client"]
        node.run("nft", "delete", "table", "ip", "kube-proxy")
        node.run("nft", "-f", str(listing))
        for a in ("203.0.113.150", "203.0.113.200"):
            client.run("ip", "addr", "add", f"{a}/32", "dev", "eth0")
        kernel = {src: connect(client, "5.6.7.8", 80, src)
                  for src in ("203.0.113.150", "203.0.113.200")}
        kernel["pod"] = connect(pod, "5.6.7.8", 80)
        got = _live_ids(node, tmp_path)
        bundle = tmp_path / "bundle"
        assert agent(node, "bundle", str(bundle), "--no-kube-api").returncode == 0
    assert kernel == {"203.0.113.150": "peer=10.99.0.1 local=10.180.0.3",
                      "203.0.113.200": "timeout", "pod": "timeout"}, kernel
    assert got["5.6.7.8"] == {"pod-to-lb-dropped"}, got
    walker = NftBackend(prepare(load_bundle(bundle)).facts).walker
    for src, want in (("203.0.113.150", {("DNAT", False)}), ("203.0.113.200", {("DROP", False)})):
        res = walker.walk_hook("prerouting", Packet(src=src, dst="5.6.7.8", in_iface="eth0"))
        assert {(r.verdict, bool(r.assumed)) for r in res} == want, (src, res)


def test_constructed_cni_nft_masquerade_is_seen_live(tmp_path: Path) -> None:
    """tests/data/constructed/nft-cni-native-nft-masquerade: a CNI that masquerades in an
    nftables table of its own (flannel's nftables mode writes `table ip flannel-ipv4`),
    on the postrouting hook beside kube-proxy's. The kernel masquerades the pod's SYN to
    an LB IP kube-proxy does not serve; the live check read only `ip kube-proxy` and
    said pod-to-lb-not-masqueraded (a false loop)."""
    kube = unsynced_service(tmp_path)
    cni = (CONSTRUCTED / "nft-cni-native-nft-masquerade" / "nft-cni.txt").read_text()
    with nft_node((CORPUS / CASES[0] / "nft-transaction.txt").read_text()) as ns, \
            ExitStack() as stack:
        node, pod, client = ns["node"], ns["pod"], ns["client"]
        node.run("nft", "-f", "-", input=cni)
        unsynced_lb(stack, client)
        assert connect(pod, "9.9.9.9", 80) == "peer=192.168.0.2 local=9.9.9.9"
        got = _live_ids(node, tmp_path, kube)
        bundle = tmp_path / "bundle"
        assert agent(node, "bundle", str(bundle), "--no-kube-api").returncode == 0
    assert got["9.9.9.9"] == {"pod-to-lb-masqueraded", UNSYNCED}, got
    assert "pod-to-lb-captured" in got["1.2.3.4"], got
    (bundle / "services.json").write_text((kube / "services.json").read_text())
    offline = json.loads(agent(None, "check", "--from", str(bundle), "--json", "--all",
                               "--node-name", "nft-node").stdout)
    assert ids_by_ip(offline) == got


def test_constructed_notrack_before_kube_proxy(tmp_path: Path) -> None:
    """A `notrack` rule at raw priority for 192.168.99.33:80 (kube-proxy serves it, eTP
    Cluster): the kernel skips NAT for the untracked SYN, it leaves with the pod's
    address; the agent must say not-masqueraded, not captured."""
    raw = (CONSTRUCTED / "nft-notrack-before-kube-proxy" / "nft-raw.txt").read_text()
    with nft_node((CORPUS / CASES[0] / "nft-transaction.txt").read_text()) as ns, \
            ExitStack() as stack:
        node, pod, client = ns["node"], ns["pod"], ns["client"]
        node.run("nft", "-f", "-", input=raw)
        client.run("ip", "addr", "add", "192.168.99.33/32", "dev", "lo")
        serve(stack, client, "192.168.99.33")
        assert connect(pod, "192.168.99.33", 80) == "peer=10.0.1.5 local=192.168.99.33"
        got = _live_ids(node, tmp_path)
    assert got["192.168.99.33"] == {"pod-to-lb-not-masqueraded"}, got
    assert "pod-to-lb-captured" in got["1.2.3.4"], got


_BUDGET = r"""
import json
from agent.probes import nat_rules, nft_rules
from agent.probes.base import ProbeContext
out = {"sized_on": nat_rules.read_budget("nft", 10.0, family=0).sized_on}
r = nft_rules.collect(ProbeContext())
out["read"] = r.value is not None and not r.unknowns
# a budget this node's listing cannot meet: the floor alone (1 ms), no slack
nat_rules.BUDGET_SLACK, nft_rules.BUDGET_FLOOR = 0.0, 0.001
r = nft_rules.collect(ProbeContext(timeout=0.001))
out["stopped"] = [r.value is None, [u.reason for u in r.unknowns]]
print(json.dumps(out))
"""


def test_the_nft_read_is_budgeted_by_the_tables_size_and_says_so_when_stopped() -> None:
    """The nftables-mode read (`nft list ruleset`) had a fixed 10 s: a 10k-service node
    took 16 s to list here, and came out "unknown". Its budget now grows with the chains
    and sets of the ip and ip6 tables, counted by netlink (a kube-proxy state of 150
    Services, loaded with `nft -f` in a namespace made here), and a read stopped at its
    budget says what it was sized on."""
    from lab import kube_proxy_rules as kpr
    from lab.netns import netns

    text = kpr.synthetic(150, "nftables")["nft-transaction.txt"]
    objects = len(re.findall(r"^add (?:chain|set|map) ", text, re.M))
    with netns("lbnb") as ns:
        ns.run("nft", "-f", "-", input=text)
        r = ns.run(sys.executable, "-c", _BUDGET, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["sized_on"] == f"{objects:,} chains and sets in the nft ip and ip6 tables"
    assert out["read"]
    gone, reasons = out["stopped"]
    assert gone and reasons == ["nft list ruleset (nft backend) was stopped after 0.001 s, "
                                "its time "
                                f"budget for {objects:,} chains and sets in the nft ip and "
                                "ip6 tables"], reasons


@pytest.mark.parametrize("how", ["nft", "iptables-nft"])
def test_constructed_forward_drop_of_one_endpoint(how: str, tmp_path: Path) -> None:
    """A forward-hook rule that drops one endpoint's address (10.180.0.2, 1.2.3.4's), in an
    nftables table of its own or in iptables-nft's filter FORWARD: the kernel drops the
    pod's SYN to 1.2.3.4 after kube-proxy's DNAT and serves another LB IP's; the agent
    says the same. (The walk of a DNATed packet through the forward hook is shared among
    endpoints no rule tells apart, NftWalker.walk_hook; which are told apart is tested
    rule by rule in test_nft_review.)"""
    with nft_node((CORPUS / CASES[0] / "nft-transaction.txt").read_text()) as ns:
        node, pod = ns["node"], ns["pod"]
        if how == "nft":
            node.run("nft", "-f", "-", input="table ip block {\n chain dropped {\n  type filter "
                     "hook forward priority 10; policy accept;\n  ip daddr 10.180.0.2 drop\n"
                     " }\n}\n")
        else:
            node.run("iptables-nft", "-A", "FORWARD", "-d", "10.180.0.2", "-j", "DROP")
        assert connect(pod, "1.2.3.4", 80) == "timeout"
        served = connect(pod, "192.168.99.33", 80)
        before = unchanging(capture(node))
        got = _live_ids(node, tmp_path)
        assert unchanging(capture(node)) == before  # the check wrote nothing on the node
    assert served.startswith("peer=") and "local=10.180." in served, served
    assert "pod-to-lb-dropped" in got["1.2.3.4"] and \
        "pod-to-lb-captured" not in got["1.2.3.4"], got
    assert got["192.168.99.33"] == {"pod-to-lb-captured"}, got
