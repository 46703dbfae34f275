"""kube-proxy nftables mode on a dual-stack node, real kernel: its `ip kube-proxy` table
(the TestOverallNFTablesRules transaction, tests/data/realworld/k8s-nftables-overall-...)
and the `ip6 kube-proxy` table its IPv6 proxier writes for the same Services
(lab.nft_node.ipv6_of: constructed, kube-proxy's tests state no IPv6 LoadBalancer
ruleset) loaded with `nft -f` into a node namespace made here. Real IPv6 SYNs show what
the kernel does with the IPv6 LB IPs; live `check` and `check --from` of the bundle saved
on the node must say the same, for both families. Also kube-proxy's v1.29-alpha ruleset
(a real paste of the corpus the agent first misread) on a kernel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from lab.netns import Netns
from lab.nft_node import SERVER6, connect, ipv6_of, nft_node, serve

pytestmark = pytest.mark.netns

OVERALL = (Path(__file__).parent / "data" / "realworld" /
           "k8s-nftables-overall-rules-lb-etp-local-sourceranges" / "nft-transaction.txt")
LB_LOCAL = "2001:db8:1234::4"  # ns2/svc2: eTP=Local, no local endpoint, NodePort 3001
EXT_CLUSTER = "2001:db8:99::33"  # ns4/svc4: external IP, eTP=Cluster
LB_RANGES = "2001:db8:5678::8"  # ns5/svc5: eTP=Cluster, source range 2001:db8:203::/64
UNSYNCED = "2001:db8:9999::9"  # a Service kube-proxy's tables do not serve (yet)


def unsynced_service(tmp_path: Path) -> Path:
    """A kube dir with one IPv6 LoadBalancer Service whose ingress IP no table serves:
    the pod's SYN leaves the node with the pod's address."""
    kube = tmp_path / "kube"
    kube.mkdir()
    (kube / "services.json").write_text(json.dumps({"kind": "List", "items": [{
        "kind": "Service", "metadata": {"namespace": "ns9", "name": "new6"},
        "spec": {"type": "LoadBalancer", "clusterIP": "fd00:10:96::99",
                 "ipFamilies": ["IPv6"], "ipFamilyPolicy": "SingleStack",
                 "ports": [{"port": 80, "protocol": "TCP", "nodePort": 3009}]},
        "status": {"loadBalancer": {"ingress": [{"ip": UNSYNCED}]}}}]}))
    return kube


def agent(ns: Netns | None, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "agent", *args]
    if ns is not None:
        return ns.run(*cmd, check=False, timeout=120)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def ids_by_ip(v: dict[str, Any]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in v["findings"]:
        if f["lb_ip"]:
            out.setdefault(f["lb_ip"], set()).add(f["id"])
    return out


def test_dual_stack_nftables_node_ipv6_lb_ips(tmp_path: Path) -> None:
    script = OVERALL.read_text()
    kube = unsynced_service(tmp_path)
    with nft_node(script, ipv6_of(script)) as ns, ExitStack() as stack:
        node, pod, client = ns["node"], ns["pod"], ns["client"]
        # the unsynced Service's "load balancer": its address answering in the client
        client.run("ip", "-6", "addr", "add", f"{UNSYNCED}/128", "dev", "lo", "nodad")
        serve(stack, client, UNSYNCED, SERVER6)
        probes = {
            # eTP=Local LB IP: DNATed on the node, the pod's address kept (captured)
            "pod lb-local": (pod, LB_LOCAL, 80, None),
            # eTP=Cluster external IP: DNATed and masqueraded to the node's ep0 address
            "pod ext-cluster": (pod, EXT_CLUSTER, 80, None),
            # LoadBalancerSourceRanges: the pod is out of range, dropped before DNAT
            "pod lb-ranges": (pod, LB_RANGES, 80, None),
            # the load balancer -> NodePort 3001 on the node's IPv6 address: no local
            # endpoint (eTP=Local), dropped; 3002 (Cluster) served
            "client :3001": (client, "2001:db8::1", 3001, None),
            "client :3002": (client, "2001:db8::1", 3002, None),
            "in-range lb-ranges": (client, LB_RANGES, 80, "2001:db8:203::2"),
            "out-of-range lb-ranges": (client, LB_RANGES, 80, "2001:db8:203:1::130"),
            # not in any table: leaves the node with the pod's own address
            "pod unsynced": (pod, UNSYNCED, 80, None),
        }
        with ThreadPoolExecutor(len(probes)) as pool:  # the drops wait 4 s each: at once
            futures = {k: pool.submit(connect, *args) for k, args in probes.items()}
            kernel = {k: f.result() for k, f in futures.items()}
        assert kernel["pod lb-local"] == "peer=fd00:10::5 local=fd00:10:180::2", kernel
        assert kernel["pod ext-cluster"] in ("peer=fd00:99::1 local=fd00:10:180::4",
                                             "peer=fd00:99::1 local=fd00:10:180::5"), kernel
        assert kernel["pod lb-ranges"] == "timeout", kernel
        assert kernel["client :3001"] == "timeout", kernel
        assert kernel["client :3002"] == "peer=fd00:99::1 local=fd00:10:180::3", kernel
        assert kernel["in-range lb-ranges"] == "peer=fd00:99::1 local=fd00:10:180::3", kernel
        assert kernel["out-of-range lb-ranges"] == "timeout", kernel
        assert kernel["pod unsynced"] == f"peer=fd00:10::5 local={UNSYNCED}", kernel
        # IPv4 beside it is unchanged
        assert connect(pod, "1.2.3.4", 80) == "peer=10.0.1.5 local=10.180.0.2"

        live = agent(node, "check", "--json", "--all", "--no-kube-api", "--kube-json", str(kube),
                     "--node-name", "nft-node")
        assert live.stdout, live.stderr
        v = json.loads(live.stdout)
        bundle = tmp_path / "bundle"
        saved = agent(node, "bundle", str(bundle), "--no-kube-api")
        assert saved.returncode == 0, saved.stderr
        (tmp_path / "paste").mkdir()
        (tmp_path / "paste" / "nft.txt").write_text(
            "# nft list table ip6 kube-proxy\n" + node.run("nft", "list", "table", "ip6",
                                                           "kube-proxy").stdout)
        # an IPv6 LB IP the node holds (a VIP bound on it): lb-ip-local (from the IPv6
        # local table, read live); an external IP bound likewise is not an LB's VIP
        node.run("ip", "-6", "addr", "add", f"{LB_RANGES}/128", "dev", "lo", "nodad")
        node.run("ip", "-6", "addr", "add", f"{EXT_CLUSTER}/128", "dev", "lo", "nodad")
        bound = json.loads(agent(node, "check", "--json", "--all", "--no-kube-api").stdout)
        stack.close()
    assert v["kube_proxy_mode"] == "nftables", v
    got = ids_by_ip(v)
    want6 = {LB_LOCAL: {"pod-to-lb-captured", "etp-local-no-local-endpoint"},
             "2001:db8:99::22": {"pod-to-lb-captured", "etp-local-no-local-endpoint"},
             EXT_CLUSTER: {"pod-to-lb-captured"},
             LB_RANGES: {"pod-to-lb-dropped"},
             # (and said to be a Service kube-proxy has not synced)
             UNSYNCED: {"pod-to-lb-not-masqueraded", "lb-ip-without-kube-proxy-rule"}}
    for ip, ids in want6.items():
        assert got.get(ip) == ids, (ip, got)
    # IPv4 as before: the same Services, the same answers
    assert got["1.2.3.4"] == want6[LB_LOCAL] and got["5.6.7.8"] == {"pod-to-lb-dropped"}
    assert v["status"] == "at-risk", v
    loop = next(f for f in v["findings"]
                if f["lb_ip"] == UNSYNCED and f["id"] == "pod-to-lb-not-masqueraded")
    # IPv6 has no rp_filter: the SYN coming back reaches the pod (no IPv4 sysctl decides)
    assert any("IPv6 has no rp_filter" in e for e in loop["evidence"]), loop["evidence"]
    assert not any("rp_filter drops" in e or "sysctl" in e for e in loop["evidence"]), \
        loop["evidence"]
    # the evidence quotes the ip6 table's rules walked
    cap = next(f for f in v["findings"] if f["id"] == "pod-to-lb-captured"
               and f["lb_ip"] == LB_LOCAL)
    assert any("nft ip6 kube-proxy" in e and "dnat to [fd00:10:180::2]:80" in e
               for e in cap["evidence"]), cap["evidence"]
    # the IPv6 pod network from the node (cni0's subnet), not an IPv4 stand-in
    assert "in cni0" in cap["evidence"][0] and "fd00:10::" in cap["evidence"][0], cap
    drop = next(f for f in v["findings"] if f["lb_ip"] == LB_RANGES)
    assert any("2001:db8:203::/64" in e and "drop" in e for e in drop["evidence"]), drop
    # check --from the bundle saved on the same node: the same verdict
    (bundle / "services.json").write_text((kube / "services.json").read_text())
    offline = agent(None, "check", "--from", str(bundle), "--json", "--all", "--node-name",
                    "nft-node")
    w = json.loads(offline.stdout)
    assert ids_by_ip(w) == got and w["status"] == v["status"], (ids_by_ip(w), got)
    # a pasted `nft list table ip6 kube-proxy` alone (no addresses, no Services): the
    # same findings for the IPv6 LB IPs it serves
    pasted = json.loads(agent(None, "check", "--from", str(tmp_path / "paste"), "--json",
                              "--all").stdout)
    assert pasted["kube_proxy_mode"] == "nftables"
    assert ids_by_ip(pasted) == {ip: ids for ip, ids in want6.items() if ip != UNSYNCED}
    cap6 = next(f for f in pasted["findings"] if f["lb_ip"] == LB_LOCAL
                and f["id"] == "pod-to-lb-captured")
    assert f"Pods reaching [{LB_LOCAL}]:80/TCP" in cap6["summary"], cap6["summary"]
    # the bound VIPs: the pod's SYN to the external IP is taken in by the node itself
    b = ids_by_ip(bound)
    assert b[LB_RANGES] == {"lb-ip-local", "pod-to-lb-dropped"}, b
    assert b[EXT_CLUSTER] == {"pod-to-lb-captured"}, b


ALPHA = (Path(__file__).parent / "data" / "realworld" /
         "k8s-nftables-1.29alpha-overall-firewall-set-lbsourceranges" / "nft-transaction.txt")


def test_kube_proxy_1_29_alpha_source_ranges_on_a_kernel(tmp_path: Path) -> None:
    """kube-proxy's v1.29-alpha ruleset (a `firewall` set checked in filter-input and
    -forward; @service-ips sends the LB IP to a firewall- chain): the agent first missed
    its LB IP. The kernel drops a pod's SYN to 5.6.7.8 (out of the source range) and
    DNATs one to 1.2.3.4; the live check says the same."""
    with nft_node(ALPHA.read_text()) as ns:
        pod = ns["pod"]
        with ThreadPoolExecutor(2) as pool:
            ranged = pool.submit(connect, pod, "5.6.7.8", 80)
            local = pool.submit(connect, pod, "1.2.3.4", 80)
            kernel = {"5.6.7.8": ranged.result(), "1.2.3.4": local.result()}
        live = agent(ns["node"], "check", "--json", "--all", "--no-kube-api")
    assert kernel == {"5.6.7.8": "timeout", "1.2.3.4": "peer=10.0.1.5 local=10.180.0.2"}
    got = ids_by_ip(json.loads(live.stdout))
    assert got["5.6.7.8"] == {"pod-to-lb-dropped"}, got
    assert "pod-to-lb-captured" in got["1.2.3.4"], got
