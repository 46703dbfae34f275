"""kube-proxy's random choice among a service's endpoints: a pod's walk forks at each
`statistic` rule and every endpoint's path is followed. Where every path DNATs and none
assumed a fact, the verdict is the first path's (its evidence made once, not once per
endpoint: issue 14); where a path assumed a fact, or ended otherwise, every path counts,
as before. The dumps are constructed in kube-proxy 1.30's iptables layout (labelled: not
a real paste); a real one with a random choice is tests/data/realworld/
kube-proxy-ipt-*."""

from __future__ import annotations

import pytest

from agent.bundle import load_texts
from agent.diagnose import diagnose
from agent.netfilter.rules_text import RulesText, read_rules_text

LB = "203.0.113.10"
EPS = ("10.244.1.5", "10.244.2.6", "10.244.3.7")
HEAD = """*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-EXT-AAAA - [0:0]
:KUBE-SVC-AAAA - [0:0]
:KUBE-SEP-E1 - [0:0]
:KUBE-SEP-E2 - [0:0]
:KUBE-SEP-E3 - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -j MASQUERADE --random-fully
-A KUBE-SERVICES -d {lb}/32 -p tcp -m comment --comment "app/web:http loadbalancer IP" -m tcp --dport 80 -j KUBE-EXT-AAAA
{ext}-A KUBE-SVC-AAAA -m comment --comment "app/web:http -> {e1}:8080" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-E1
-A KUBE-SVC-AAAA -m comment --comment "app/web:http -> {e2}:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-E2
-A KUBE-SVC-AAAA -m comment --comment "app/web:http -> {e3}:8080" -j KUBE-SEP-E3
-A KUBE-SEP-E1 -s {e1}/32 -m comment --comment "app/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-E1 -p tcp -m comment --comment "app/web:http" -m tcp -j DNAT --to-destination {e1}:8080
-A KUBE-SEP-E2 -s {e2}/32 -m comment --comment "app/web:http" -j KUBE-MARK-MASQ
{sep2}-A KUBE-SEP-E3 -s {e3}/32 -m comment --comment "app/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-E3 -p tcp -m comment --comment "app/web:http" -m tcp -j DNAT --to-destination {e3}:8080
COMMIT
"""  # noqa: E501 (kube-proxy's rules as iptables-save prints them)
# kube-proxy 1.30's KUBE-EXT of an eTP=Cluster service with --cluster-cidr
EXT_CLUSTER = ('-A KUBE-EXT-AAAA -m comment --comment "masquerade traffic for app/web:http '
               'external destinations" -j KUBE-MARK-MASQ\n'
               '-A KUBE-EXT-AAAA -j KUBE-SVC-AAAA\n')
# ... with --detect-local-mode=InterfaceNamePrefix (AKS: pods' interfaces are azv*)
EXT_IFACE = ('-A KUBE-EXT-AAAA -i azv+ -m comment --comment "pod traffic for app/web:http '
             'external destinations" -j KUBE-SVC-AAAA\n'
             '-A KUBE-EXT-AAAA -m comment --comment "masquerade traffic for app/web:http '
             'external destinations" -j KUBE-MARK-MASQ\n'
             '-A KUBE-EXT-AAAA -j KUBE-SVC-AAAA\n')
DNAT2 = ('-A KUBE-SEP-E2 -p tcp -m comment --comment "app/web:http" -m tcp -j DNAT '
         '--to-destination {e2}:8080\n')
ADDR = """1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536
    inet 127.0.0.1/8 scope host lo
2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500
    inet 10.0.0.4/24 brd 10.0.0.255 scope global eth0
3: cni0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1450
    inet 10.244.1.1/24 brd 10.244.1.255 scope global cni0
"""


def _finding(ext: str = EXT_CLUSTER, addr: str = ADDR, drop: str = "",
             comment: tuple[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    """The pod-to-lb finding of LB; ``drop``: a chain whose declaration and rules are
    taken out of the dump (the jumps to it stay); ``comment``: (endpoint chain, the
    comment its DNAT rule gets)."""
    e1, e2, e3 = EPS
    dump = HEAD.format(lb=LB, ext=ext, sep2=DNAT2.format(e2=e2), e1=e1, e2=e2, e3=e3)
    if comment:
        sep, text = comment
        dump = "".join(line.replace('"app/web:http"', f'"{text}"')
                       if line.startswith(f"-A KUBE-SEP-{sep} -p tcp") else line
                       for line in dump.splitlines(keepends=True))
    if drop:
        dump = "".join(line for line in dump.splitlines(keepends=True)
                       if not line.startswith((f":{drop} ", f"-A {drop} ")))
    texts = [("iptables-save.txt", dump, "iptables")]
    if addr:
        texts.append(("addr.txt", addr, "ip addr"))
    v = diagnose(load_texts(texts, origin="bundle:t"), "node").to_dict("all")
    got = [f for f in v["findings"] if f["lb_ip"] == LB and f["id"].startswith("pod-to-lb")]
    assert len(got) == 1, [(f["id"], f["summary"]) for f in v["findings"]]
    return got[0]


def test_every_endpoint_dnats_the_first_path_is_shown() -> None:
    f = _finding()
    assert f["id"] == "pod-to-lb-captured"
    # the first path is the one past every random rule (the walk follows "not chosen"
    # first): the last endpoint's, as the merge of all three paths showed it
    assert f"rewrites the destination to {EPS[2]}:8080 (DNAT)" in f["summary"]
    assert "(decided without" not in f["summary"]
    assert not any("either way" in e for e in f["evidence"])
    assert any(e.startswith("nat KUBE-SEP-E3: ") for e in f["evidence"])
    assert not any(e.startswith(("nat KUBE-SEP-E1: ", "nat KUBE-SEP-E2: "))
                   for e in f["evidence"])


def test_paths_that_assumed_a_fact_all_count() -> None:
    # without `ip addr` the interface a pod's packet enters by is unknown and so is the
    # pod's address: the walk answers "-i azv+" both ways, on each answer takes each of
    # the three endpoints, and in each answers the endpoint's "-s ENDPOINT/32" both ways:
    # 12 paths, every one DNATs, each assumed
    f = _finding(ext=EXT_IFACE, addr="")
    assert f["id"] == "pod-to-lb-captured", f["summary"]
    assert "(decided without a fact the input lacks: every answer to it leads here)" in \
        f["summary"]
    # the note counts every path (a verdict made of the first path alone would say 1)
    notes = [e for e in f["evidence"] if e.startswith("either way (")]
    assert notes and all(e.startswith("either way (12 paths") for e in notes), notes
    assert "azv+" in notes[0]


def test_an_endpoint_path_that_ends_otherwise_counts() -> None:
    # the second endpoint's chain is not in the dump (a whole dump: not an excerpt): the
    # path that takes it cannot be walked, the two others DNAT; the verdict says so
    f = _finding(drop="KUBE-SEP-E2")
    assert f["id"] == "pod-to-lb-undetermined", f["summary"]
    assert "on some of the paths kube-proxy's random endpoint choice can take" in \
        f["summary"]
    assert "KUBE-SEP-E2 is neither a chain" in f["summary"]


@pytest.mark.parametrize("endpoint", ["E1", "E3"])
def test_a_comment_that_says_assumed_assumes_nothing(endpoint: str) -> None:
    # a rule's comment (or file name) holding ": assumed" is no assumption of the walk:
    # before, the text search of the merge took it for one, on the path shown (E3) or
    # another (E1), and said "decided without a fact the input lacks"
    f = _finding(comment=(endpoint, "app/web:http note: assumed stable"))
    assert f["id"] == "pod-to-lb-captured"
    assert "decided without" not in f["summary"], f["summary"]
    assert not any(e.startswith("either way") for e in f["evidence"]), f["evidence"]
    if endpoint == "E3":  # the path shown: its DNAT rule's line holds the comment
        assert any("note: assumed stable" in e for e in f["evidence"]), f["evidence"]


@pytest.mark.parametrize(("line", "chain", "policy"), [
    (":KUBE-X - [0:0]", "KUBE-X", None),
    (":INPUT ACCEPT [123:45678]", "INPUT", "ACCEPT"),
    (":KUBE-X -", "KUBE-X", None),
    (":KUBE-X\t-\t[0:0]", "KUBE-X", None),
    (":FORWARD DROP [0:0]   ", "FORWARD", "DROP"),
    ("12::KUBE-X - [0:0]", "KUBE-X", None),  # `grep -n` of a dump
])
def test_chain_declarations(line: str, chain: str, policy: str | None) -> None:
    into = RulesText()
    read_rules_text(f"*filter\n{line}\nCOMMIT\n", "t.txt", into)
    assert into.problems == []
    assert into.chains == {("filter", chain): policy}


@pytest.mark.parametrize("line", [
    ":", ": KUBE-X -", ":KUBE-X", ":KUBE-X - [0:0] more", ":KUBE-X - [a:0]", ":KUBE-X - [0:0",
    ":KUBE-X - 0:0",
])
def test_bad_chain_declarations_are_named_by_line(line: str) -> None:
    into = RulesText()
    read_rules_text(f"*filter\n{line}\nCOMMIT\n", "t.txt", into)
    assert into.chains == {}
    assert [(src, p.line, p.why.split(" ", 3)[:3]) for src, p in into.problems] == \
        [("t.txt", 2, ["bad", "chain", "declaration"])]


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
@pytest.mark.parametrize("n", [33, 300, 1200])
def test_a_service_of_many_endpoints_is_decided(mode: str, n: int) -> None:
    """kube-proxy forks a pod's packet once per endpoint (`statistic` rules, `numgen
    random mod N vmap`). The walkers stopped at 32 (iptables) and 256 (nftables) paths and
    called the rest unknown, so a Service of 33 (or 257) endpoints, an ingress controller
    or a big Deployment, made the node "at risk" with pod-to-lb-undetermined. Rules from
    the lab's generators (kube-proxy's layouts), the pods' addresses unknown as in a pasted
    dump (each endpoint chain's hairpin match then forks once more)."""
    from lab.kube_proxy_rules.common import LbService
    from lab.kube_proxy_rules.iptables import iptables_mode
    from lab.kube_proxy_rules.nftables import nftables_mode

    svc = LbService(namespace="app", name="big", cluster_ip="10.96.0.10", lb_ip=LB,
                    node_port=30080, remote_endpoints=tuple(
                        f"10.244.{i // 200}.{i % 200 + 2}" for i in range(n)))
    if mode == "iptables":
        name = "iptables-save.txt"
        text = iptables_mode([svc], cluster_cidr="10.244.0.0/16", node_ip="10.0.0.5")
    else:
        name = "nft-list-ruleset.txt"
        text = nftables_mode([svc], cluster_cidr="10.244.0.0/16", node_ip="10.0.0.5",
                             service_cidr="10.96.0.0/16")
    v = diagnose(load_texts([(name, text, "")], origin="bundle:t"), "n").to_dict("all")
    assert v["status"] == "healthy", v["findings"]
    assert {f["id"] for f in v["findings"] if f["lb_ip"] == LB} == {"pod-to-lb-captured"}
