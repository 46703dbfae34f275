"""kube-proxy's --detect-local-mode=InterfaceNamePrefix (AKS writes `-i azv+`) on a paste
that does not show which interface pods' packets enter by: the walk follows both answers
and says so; where the answers end differently it says both; a NodePort "served" only on
an assumed answer is not taken as served. The dumps are constructed in kube-proxy
1.30's iptables layout (the real AKS paste is tests/data/realworld/
aks-notes-describe-svc-etp-local-vip-iptables-i-azv)."""

from __future__ import annotations

from agent.bundle import load_texts
from agent.diagnose import diagnose, prepare
from agent.diagnose.iptables_backend import iptables_paths
from agent.diagnose.lb_ip import LbTarget

LB = "4.225.209.242"
HEAD = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
{filter_rules}COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-EXT-EEQNXCJLUUVUU2YK - [0:0]
:KUBE-SVC-EEQNXCJLUUVUU2YK - [0:0]
:KUBE-SVL-EEQNXCJLUUVUU2YK - [0:0]
:KUBE-SEP-GG5PHKGFOOREI2Y5 - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -j MASQUERADE --random-fully
-A KUBE-SERVICES -d {lb}/32 -p tcp -m comment --comment "app/nginx:http loadbalancer IP" -m tcp --dport 80 -j KUBE-EXT-EEQNXCJLUUVUU2YK
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -p tcp -m comment --comment "app/nginx:http" -m tcp --dport 31806 -j KUBE-EXT-EEQNXCJLUUVUU2YK
-A KUBE-EXT-EEQNXCJLUUVUU2YK -i azv+ -m comment --comment "pod traffic for app/nginx:http external destinations" -j KUBE-SVC-EEQNXCJLUUVUU2YK
-A KUBE-EXT-EEQNXCJLUUVUU2YK -m comment --comment "masquerade LOCAL traffic for app/nginx:http external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-EEQNXCJLUUVUU2YK -m comment --comment "route LOCAL traffic for app/nginx:http external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-EEQNXCJLUUVUU2YK
-A KUBE-EXT-EEQNXCJLUUVUU2YK -j KUBE-SVL-EEQNXCJLUUVUU2YK
-A KUBE-SVC-EEQNXCJLUUVUU2YK -m comment --comment "app/nginx:http -> 10.244.0.203:8080" -j KUBE-SEP-GG5PHKGFOOREI2Y5
-A KUBE-SEP-GG5PHKGFOOREI2Y5 -s 10.244.0.203/32 -m comment --comment "app/nginx:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-GG5PHKGFOOREI2Y5 -p tcp -m comment --comment "app/nginx:http" -m tcp -j DNAT --to-destination 10.244.0.203:8080
{svl_rules}COMMIT
"""  # noqa: E501 (kube-proxy's rules as iptables-save prints them)
# this node has no endpoint: kube-proxy's "has no local endpoints" drop, an empty KUBE-SVL
NO_LOCAL = ('-A KUBE-EXTERNAL-SERVICES -d {lb}/32 -p tcp -m comment --comment '
            '"app/nginx:http has no local endpoints" -m tcp --dport 80 -j DROP\n'
            '-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "app/nginx:http has no '
            'local endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 31806 -j DROP\n')


def _snapshot(filter_rules: str = "", svl_rules: str = "", addr: str = ""):  # type: ignore[no-untyped-def]
    dump = HEAD.format(filter_rules=filter_rules.format(lb=LB), svl_rules=svl_rules, lb=LB)
    texts = [("iptables-save.txt", dump, "iptables")]
    if addr:
        texts.append(("addr.txt", addr, "ip addr"))
    return load_texts(texts, origin="bundle:t")


def _finding(snap, fid: str) -> dict:  # type: ignore[no-untyped-def]
    v = diagnose(snap, "node").to_dict("all")
    got = [f for f in v["findings"] if f["id"] == fid and f.get("port") == 80]
    assert got, [(f["id"], f["summary"]) for f in v["findings"]]
    return got[0]


def test_answers_that_end_differently_are_both_said_and_neither_claimed() -> None:
    # pod traffic (-i azv+) is captured by KUBE-SVC; other traffic, with no local endpoint,
    # is dropped in filter: no loop either way, but "every answer leads here" is false
    f = _finding(_snapshot(NO_LOCAL), "pod-to-lb-dropped")
    assert "or, depending on a fact the input lacks, captured" in f["summary"]
    assert "no loop either way" in f["summary"]
    assert "every answer to it leads here" not in f["summary"]
    assert any(e.startswith("the other answer: ") for e in f["evidence"])


def test_the_interface_is_the_fact_named_not_the_chain_that_asked_it() -> None:
    # a branch that leaves unmasqueraded (KUBE-SVL without a rule) against one captured:
    # undecided; the fact to get is the pods' interface, not "what KUBE-EXT-... does"
    f = _finding(_snapshot(), "pod-to-lb-undetermined")
    assert "whether the pod's packet enters by an interface azv+ names" in f["summary"]
    assert "what KUBE-EXT-EEQNXCJLUUVUU2YK does" not in f["summary"]


def _outside(snap):  # type: ignore[no-untyped-def]
    facts = prepare(snap).facts
    target = LbTarget(LB, 80, "TCP", "loadbalancer", "app/nginx", ("test",), etp="Local",
                      node_port=31806)
    return facts, iptables_paths(facts).outside_to_lb(target)


def test_a_nodeport_served_only_on_an_assumed_interface_is_not_served() -> None:
    # without `ip addr` the uplink the load balancer's packet comes by is unknown (the
    # node's address is a stand-in); on the answer "an azv interface" it would be served
    facts, out = _outside(_snapshot(NO_LOCAL))
    assert facts.uplink is None
    assert out.served is None, out
    assert "an interface of the load balancer's packet" in out.how and "-i azv+" in out.how


def test_a_known_uplink_is_no_pod_interface() -> None:
    facts, out = _outside(_snapshot(NO_LOCAL, addr=(
        "2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500\n"
        "    inet 10.224.0.4/16 scope global eth0\n")))
    assert facts.uplink == "eth0"
    assert out.served is False, out  # no local endpoint: kube-proxy drops it here
