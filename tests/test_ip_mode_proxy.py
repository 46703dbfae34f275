"""status.loadBalancer.ingress[].ipMode: Proxy (Kubernetes 1.30+): kube-proxy's service
tracker skips such an address in every mode (pkg/proxy/serviceport.go: `if
!proxyutil.IsVIPMode(ing) { continue }`), so no rule serves it, IPVS does not bind it, and
pods' traffic goes to the load balancer by design. Whether that loops depends on the load
balancer (a proxy opens its own connection to the node), which a node cannot show: the
agent says so (pod-to-lb-undetermined), neither healthy nor a loop. The same address as a
VIP-mode ingress is a loop (control)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose

REAL = Path(__file__).parent / "data" / "realworld"
NFT = REAL / "k8s-nftables-overall-rules-lb-etp-local-sourceranges" / "nft-transaction.txt"
IPT = REAL / "k8s-1.26era-iptables-overall-multiple-services" / "iptables-save.txt"
TKE = Path(__file__).parent / "data" / "bundles" / "tke-etp-local"  # IPVS mode
# constructed: the node of kube-proxy's test conventions (192.168.0.2 on eth0, pods on
# cni0 10.0.1.0/24 inside the cluster CIDR 10.0.0.0/8), as `ip addr` and the local table
ADDR = """1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN group default
    inet 127.0.0.1/8 scope host lo
2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP group default
    inet 192.168.0.2/24 brd 192.168.0.255 scope global eth0
3: cni0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP group default
    inet 10.0.1.1/24 brd 10.0.1.255 scope global cni0
"""
LOCAL = """local 127.0.0.0/8 dev lo proto kernel scope host src 127.0.0.1
local 127.0.0.1 dev lo proto kernel scope host src 127.0.0.1
local 192.168.0.2 dev eth0 proto kernel scope host src 192.168.0.2
local 10.0.1.1 dev cni0 proto kernel scope host src 10.0.1.1
"""


def services(ip: str, ip_mode: str | None) -> str:
    ing: dict[str, str] = {"ip": ip}
    if ip_mode:
        ing["ipMode"] = ip_mode
    return json.dumps({"kind": "List", "items": [{
        "kind": "Service", "metadata": {"namespace": "ns9", "name": "proxied"},
        "spec": {"type": "LoadBalancer", "clusterIP": "172.30.0.99",
                 "ports": [{"port": 80, "protocol": "TCP", "nodePort": 3009}]},
        "status": {"loadBalancer": {"ingress": [ing]}}}]})


def verdict(rules: list[tuple[str, str]], ip: str, ip_mode: str | None) -> dict:
    node = [("addr.txt", ADDR), ("route-local.txt", LOCAL)]
    files = [*rules, *(f for f in node if f[0] not in {n for n, _ in rules}),
             ("services.json", services(ip, ip_mode))]
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


@pytest.mark.parametrize("mode,rules,ip", [
    ("nftables", [NFT], "9.9.9.9"), ("iptables", [IPT], "9.9.9.9"),
    # the TKE node's ip-masq-agent masquerades all but 10.0.0.0/8 and 172.16.0.0/12: an
    # address inside them leaves unmasqueraded
    ("ipvs", [TKE / n for n in ("iptables-save.txt", "ipset.txt", "addr.txt",
                                "route-local.txt", "sysctl.txt")], "10.0.9.9"),
], ids=["nftables", "iptables", "ipvs"])
def test_ip_mode_proxy_is_neither_healthy_nor_a_loop(mode: str, rules: list[Path],
                                                     ip: str) -> None:
    texts = [(p.name, p.read_text()) for p in rules]
    v = verdict(texts, ip, "Proxy")
    assert v["kube_proxy_mode"] == mode
    mine = [f for f in v["findings"] if f["lb_ip"] == ip]
    assert [f["id"] for f in mine] == ["pod-to-lb-undetermined"], mine
    f = mine[0]
    assert f["severity"] == "warning" and "ipMode: Proxy" in f["summary"]
    assert any("ipMode: Proxy" in e for e in f["evidence"])
    assert "ns9.svc.cluster.local" in f["remedy"]
    # undecided: neither healthy nor at risk (the TKE bundle's own 10.0.1.100 is at risk)
    assert v["status"] == ("at-risk" if mode == "ipvs" else "unknown")
    # the control: the same address as a VIP-mode ingress that no rule serves loops (and
    # is said to be a Service kube-proxy has not synced: ipMode: Proxy is not)
    w = verdict(texts, ip, None)
    assert sorted(g["id"] for g in w["findings"] if g["lb_ip"] == ip) == [
        "lb-ip-without-kube-proxy-rule", "pod-to-lb-not-masqueraded"], w["findings"]
