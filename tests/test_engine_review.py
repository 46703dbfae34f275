"""What the independent review of the one-engine change (issue 31) found, each a test that
failed on the change as first written. The inputs are constructed (labelled: an IPVS
`-S` paste as a ticket shows it, the lab's nftables generator), not real pastes."""

from __future__ import annotations

import json
import time

from agent.bundle import load_texts
from agent.diagnose import diagnose
from lab.kube_proxy_rules.common import LbService
from lab.kube_proxy_rules.nftables import nftables_mode
from tests.test_endpoint_paths import ADDR

LB = "203.0.113.10"


def _verdict(*files: tuple[str, str]) -> dict[str, object]:
    return diagnose(load_texts([(n, t, "") for n, t in files], origin="bundle:t"),
                    "n").to_dict("all")


def test_remembered_chain_walks_stay_within_the_path_bound() -> None:
    """A chain walk reused from the memo added its paths again without charging them:
    chains jumping twice each to the next, a random RETURN at the bottom, grew without
    bound (6 levels: a MemoryError after 3 GB); 17 jumps after one fork, 131,072 paths."""
    levels = 6
    dump = ("*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n"
            + "".join(f":L{k} - [0:0]\n" for k in range(levels + 1))
            + "-A PREROUTING -j KUBE-SERVICES\n"
            f"-A KUBE-SERVICES -d {LB}/32 -p tcp -m comment --comment \"app/web:http "
            "loadbalancer IP\" -m tcp --dport 80 -j L0\n"
            + "".join(f"-A L{k} -j L{k + 1}\n-A L{k} -j L{k + 1}\n" for k in range(levels))
            + f"-A L{levels} -m statistic --mode random --probability 0.5 -j RETURN\nCOMMIT\n")
    start = time.process_time()
    v = _verdict(("iptables-save.txt", dump), ("addr.txt", ADDR))
    assert time.process_time() - start < 30
    ids = {f["id"] for f in v["findings"]}  # type: ignore[index]
    assert "pod-to-lb-not-masqueraded" in ids and "diagnosis-incomplete" not in ids


def test_an_excerpt_without_filter_input_still_serves_a_local_address() -> None:
    """The local delivery walks filter INPUT; an excerpt that shows a filter chain but not
    INPUT made an IPVS-served external IP undetermined (at risk). INPUT only lets a local
    packet in or drops it: no loop either way, and the verdict says so."""
    paste = f"""$ ip -br addr
lo               UNKNOWN        127.0.0.1/8
eth0             UP             10.0.0.5/24
cni0             UP             10.244.1.1/24
kube-ipvs0       DOWN           10.96.0.10/32 {LB}/32
$ iptables -t nat -S KUBE-SERVICES
-N KUBE-SERVICES
-A KUBE-SERVICES -m comment --comment "Kubernetes service external ip + port for masquerade and filter purpose" -m set --match-set KUBE-EXTERNAL-IP dst,dst -j KUBE-EXTERNAL-IP
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-SERVICES -m set --match-set KUBE-EXTERNAL-IP dst,dst -j ACCEPT
$ iptables -t nat -S KUBE-EXTERNAL-IP
-N KUBE-EXTERNAL-IP
-A KUBE-EXTERNAL-IP -j KUBE-MARK-MASQ
$ iptables -t filter -S KUBE-FORWARD
-N KUBE-FORWARD
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
"""  # noqa: E501 (kube-proxy's comments, verbatim)
    ipset = (f"create KUBE-EXTERNAL-IP hash:ip,port family inet hashsize 1024 maxelem 65536\n"
             f"add KUBE-EXTERNAL-IP {LB},tcp:80\n"
             "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536\n"
             "add KUBE-CLUSTER-IP 10.96.0.10,tcp:80\n")
    svc = json.dumps({"kind": "List", "items": [{
        "kind": "Service", "metadata": {"namespace": "app", "name": "web"},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "externalIPs": [LB],
                 "ports": [{"port": 80, "protocol": "TCP"}]}}]})
    v = _verdict(("paste.txt", paste), ("ipset-save.txt", ipset), ("services.json", svc))
    (f,) = [f for f in v["findings"] if f["lb_ip"] == LB]  # type: ignore[index]
    assert v["status"] == "healthy" and f["id"] == "pod-to-lb-captured", f
    assert "no loop either way" in f["summary"]


def test_a_nodeport_served_on_one_assumed_answer_only_is_undecided() -> None:
    """The load balancer's packet to an eTP=Local NodePort meets a CNI rule the input
    cannot decide (`ct mark 0x1 drop`): served on one answer, dropped on the other. The
    engine said "served" (iptables mode's old rule: only an interface made it undecided);
    it is undecided, and the unknown says which fact (nftables mode said so before)."""
    svc = LbService(namespace="app", name="web", cluster_ip="10.96.0.10", lb_ip=LB,
                    node_port=30080, etp="Local", local_endpoints=("10.244.1.5",),
                    remote_endpoints=("10.244.2.6",), health_check_node_port=31000)
    text = nftables_mode([svc], cluster_cidr="10.244.0.0/16", node_ip="10.0.0.4",
                         service_cidr="10.96.0.0/16") + (
        "\nadd table ip cni\nadd chain ip cni pre { type filter hook prerouting priority "
        "-150 ; }\nadd rule ip cni pre ct mark 0x1 drop\n")
    v = _verdict(("nft-list-ruleset.txt", text), ("addr.txt", ADDR))
    said = [u["reason"] for u in v["unknowns"]  # type: ignore[union-attr]
            if u["source"] == "etp-local-no-local-endpoint"]
    assert said and "it depends on a fact the input does not show" in said[0], said
    assert "`ct mark 0x1`" in said[0]
