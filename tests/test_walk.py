"""The rule walker on hand-written rule sets (iptables semantics, no Kubernetes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from agent.netfilter.assumption import AssumptionKind
from agent.netfilter.packet import MAX_PATHS, Packet
from agent.netfilter.rules import parse_rule, tokenize
from agent.netfilter.rules_text import parse_iptables_save
from agent.netfilter.walk import TableWalker
from agent.snapshot import Rule


@dataclass
class View:
    local: set[str] = field(default_factory=set)
    sets: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)

    def addr_type(self, addr: str) -> str | None:
        return "LOCAL" if addr in self.local else "UNICAST"

    def ipset_members(self, name: str) -> tuple[str, frozenset[str]] | None:
        return self.sets.get(name)


def nat(body: str, view: View | None = None) -> TableWalker:
    nf = parse_iptables_save("*nat\n" + body.strip() + "\nCOMMIT\n", source="t.txt")
    table = nf.table("nat")
    assert table is not None
    return TableWalker(table, view or View())


POD = Packet(src="172.16.1.2", dst="10.0.1.100", dport=80, in_iface="cni0")


def test_tokenize_keeps_quoted_comment_with_escaped_quote() -> None:
    toks = tokenize(r'-A X -m comment --comment "a \"b\" c" -j RETURN')
    assert toks == ["-A", "X", "-m", "comment", "--comment", 'a "b" c', "-j", "RETURN"]


def test_parse_rule_negations_and_target_options() -> None:
    r = parse_rule(Rule('-A P ! -s 10.0.0.0/8 -m set ! --match-set S dst,dst '
                        '-m addrtype ! --dst-type LOCAL -j MARK --set-xmark 0x4000/0x4000'))
    assert list(r.conds) == [
        ("src", True, ("10.0.0.0/8",)),
        ("set--match-set", True, ("S", "dst,dst")),
        ("addrtype--dst-type", True, ("LOCAL",)),
    ]
    assert r.target == "MARK" and r.target_opts == {"--set-xmark": "0x4000/0x4000"}


def test_jump_return_mark_and_policy() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
:A - [0:0]
:M - [0:0]
-A PREROUTING -j A
-A A -d 10.0.1.100/32 -p tcp -m tcp --dport 80 -j M
-A A -m mark --mark 0x4000/0x4000 -j RETURN
-A A -j DNAT --to-destination 1.1.1.1:1
-A M -j MARK --set-xmark 0x4000/0x4000
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "ACCEPT"
    assert res.packet.mark == 0x4000
    assert [s.action for s in res.steps][-1] == "ACCEPT"
    # another port: not marked, so the DNAT applies
    (res2,) = w.walk("PREROUTING", Packet("172.16.1.2", "10.0.1.100", dport=81, in_iface="cni0"))
    assert res2.verdict == "DNAT" and res2.packet.dst == "1.1.1.1" and res2.packet.dport == 1


def test_goto_returns_to_the_caller_of_the_calling_chain() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
:A - [0:0]
:G - [0:0]
-A PREROUTING -j A
-A PREROUTING -j DNAT --to-destination 2.2.2.2
-A A -g G
-A A -j DNAT --to-destination 9.9.9.9
-A G -j RETURN
""")
    (res,) = w.walk("PREROUTING", POD)
    # RETURN from G (reached by goto) returns from A to PREROUTING, skipping A's DNAT
    assert res.verdict == "DNAT" and res.packet.dst == "2.2.2.2"


def test_statistic_forks_into_every_endpoint() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -m statistic --mode random --probability 0.33 -j DNAT --to-destination 1.0.0.1:80
-A PREROUTING -m statistic --mode random --probability 0.5 -j DNAT --to-destination 1.0.0.2:80
-A PREROUTING -j DNAT --to-destination 1.0.0.3:80
""")
    results = w.walk("PREROUTING", POD)
    assert sorted(r.packet.dst for r in results) == ["1.0.0.1", "1.0.0.2", "1.0.0.3"]
    assert all(r.verdict == "DNAT" for r in results)


def test_unknown_match_names_the_rule_and_is_not_guessed() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -m physdev --physdev-in veth1 -j DNAT --to-destination 1.0.0.1
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "UNKNOWN"
    assert "physdev" in res.detail and "t.txt:3" in res.detail


def test_a_false_condition_beats_an_unknown_one() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -p udp -m physdev --physdev-in veth1 -j DROP
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "ACCEPT"


@pytest.mark.parametrize(("spec", "port", "hit"), [
    ("80,443", 80, True), ("8000:9000", 8080, True), ("8000:9000", 80, False),
    ("30000:32767", 30080, True),
])
def test_multiport(spec: str, port: int, hit: bool) -> None:
    w = nat(f"""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -p tcp -m multiport --dports {spec} -j DROP
""")
    (res,) = w.walk("PREROUTING", Packet("1.1.1.1", "2.2.2.2", dport=port))
    assert (res.verdict == "DROP") is hit


def test_ipset_dimensions_and_nomatch() -> None:
    view = View(sets={
        "LB": ("hash:ip,port", frozenset({"10.0.1.100,tcp:80"})),
        "NETS": ("hash:net", frozenset({"10.0.0.0/8", "10.0.1.0/24 nomatch"})),
        "LOOP": ("hash:ip,port,ip", frozenset({"10.0.1.100,tcp:80,172.16.1.2"})),
        "NP": ("bitmap:port", frozenset({"30080"})),
    })
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -m set --match-set LOOP dst,dst,src -j DNAT --to-destination 3.3.3.3
-A PREROUTING -m set --match-set NETS dst -j DNAT --to-destination 2.2.2.2
-A PREROUTING -m set --match-set LB dst,dst -j DNAT --to-destination 1.1.1.1
-A PREROUTING -m set --match-set NP dst -j DNAT --to-destination 4.4.4.4
""", view)
    assert w.walk("PREROUTING", POD)[0].packet.dst == "3.3.3.3"
    other = Packet("172.16.1.3", "10.0.1.100", dport=80, in_iface="cni0")
    # 10.0.1.100 is inside the nomatch 10.0.1.0/24, so NETS does not match; LB does
    assert w.walk("PREROUTING", other)[0].packet.dst == "1.1.1.1"
    assert w.walk("PREROUTING", Packet("1.1.1.1", "10.2.0.1", dport=1))[0].packet.dst == "2.2.2.2"
    assert w.walk("PREROUTING", Packet("1.1.1.1", "192.0.2.1", dport=30080))[0].packet.dst == \
        "4.4.4.4"


def test_missing_ipset_forks_and_names_the_assumption() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -m set --match-set NOPE dst,dst -j DROP
""")
    paths = w.walk("PREROUTING", POD)
    assert sorted(r.verdict for r in paths) == ["ACCEPT", "DROP"]
    for r in paths:
        (assumed,) = r.assumed
        assert (assumed.kind, assumed.subject) == (AssumptionKind.IPSET, "NOPE")
        assert "`ipset list NOPE`" in assumed.fact
        (step,) = [s for s in r.steps if s.assumptions]
        assert "ipset NOPE is not known" in step.text
    drop = next(r for r in paths if r.verdict == "DROP")
    assert drop.steps[0].text.startswith("assumed matching:")


def test_mark_arithmetic_or_and_xor_and_set_mark() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -j MARK --or-mark 0x4000
-A PREROUTING -j MARK --xor-mark 0x1
-A PREROUTING -j MARK --and-mark 0x4001
-A PREROUTING -j MARK --set-mark 0x8000/0x8000
-A PREROUTING -m mark --mark 0xc001 -j DROP
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "DROP"


def test_interface_wildcards_and_addrtype() -> None:
    view = View(local={"10.0.0.10"})
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -i cni+ -m addrtype --dst-type LOCAL -j DNAT --to-destination 5.5.5.5
-A PREROUTING ! -i cni+ -j DROP
""", view)
    local = Packet("172.16.1.2", "10.0.0.10", dport=30080, in_iface="cni0")
    assert w.walk("PREROUTING", local)[0].verdict == "DNAT"
    assert w.walk("PREROUTING", POD)[0].verdict == "ACCEPT"
    assert w.walk("PREROUTING", Packet("1.1.1.1", "2.2.2.2", in_iface="eth0"))[0].verdict == "DROP"


def test_an_unknown_interface_forks_and_names_the_assumption() -> None:
    # kube-proxy's --detect-local-mode InterfaceNamePrefix (AKS: `-i azv+`) on a packet
    # whose entry interface the input does not show: both answers, each said
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -i azv+ -j DNAT --to-destination 10.244.0.5:80
-A PREROUTING -o eth0 -j DROP
""")
    paths = w.walk("PREROUTING", Packet("10.244.1.2", "4.225.209.242", dport=80))
    assert sorted(r.verdict for r in paths) == ["ACCEPT", "DNAT", "DROP"]
    dnat = next(r for r in paths if r.verdict == "DNAT")
    (assumed,) = dnat.assumed
    assert (assumed.kind, assumed.subject) == (AssumptionKind.INTERFACE, "-i azv+")
    (step,) = [s for s in dnat.steps if s.assumptions]
    assert step.text.startswith("assumed matching: -A PREROUTING -i azv+") and \
        "interface -i azv+: the interface the packet enters by is not in the input" in step.text
    drop = next(r for r in paths if r.verdict == "DROP")
    assert [a.subject for a in drop.assumed] == ["-i azv+", "-o eth0"]
    assert [s.text.split(":")[0] for s in drop.steps if s.assumptions] == [
        "assumed NOT matching", "assumed matching"]
    assert "leaves by an interface eth0 names" in drop.assumed[1].fact
    # a known interface is matched, not assumed
    (known,) = w.walk("PREROUTING", Packet("10.244.1.2", "4.225.209.242", dport=80,
                                            in_iface="azv1234", out_iface="eth1"))
    assert known.verdict == "DNAT" and not known.assumed


def test_jump_loop_is_reported_not_hung() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
:A - [0:0]
:B - [0:0]
-A PREROUTING -j A
-A A -j B
-A B -j A
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "UNKNOWN" and "nested jumps" in res.detail


def test_undefined_target_is_unknown() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -j KUBE-NOT-THERE
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "UNKNOWN" and "KUBE-NOT-THERE" in res.detail


def test_insert_with_position_and_incompatible_tables() -> None:
    from agent.errors import InputError

    nf = parse_iptables_save("*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j DROP\n"
                             "-I PREROUTING 1 -p udp -j ACCEPT\n-I PREROUTING 2 -j RETURN\n"
                             "COMMIT\n")
    chain = nf.table("nat").chain("PREROUTING")  # type: ignore[union-attr]
    assert [r.text for r in chain.rules] == ["-A PREROUTING -p udp -j ACCEPT",
                                             "-A PREROUTING -j RETURN",
                                             "-A PREROUTING -j DROP"]
    with pytest.raises(InputError, match=r"t.txt:2: Table `nat' is incompatible"):
        parse_iptables_save("*nat\n# Table `nat' is incompatible, use 'nft' tool.\nCOMMIT\n",
                            source="t.txt")


def test_too_many_branches_end_in_unknown_not_silence() -> None:
    n = MAX_PATHS + 8  # random branches, one path each: past the bound
    body = "\n".join(f"-A PREROUTING -m statistic --mode random --probability 0.01 "
                     f"-j DNAT --to-destination 1.0.{i // 250}.{i % 250 + 1}:80"
                     for i in range(n))
    w = nat(":PREROUTING ACCEPT [0:0]\n" + body)
    verdicts = [r.verdict for r in w.walk("PREROUTING", POD)]
    assert "UNKNOWN" in verdicts and "ACCEPT" not in verdicts


def test_unparsable_rule_is_skipped_when_its_parsed_part_cannot_match() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -s 9.9.9.9/32 -m frobnicate --frob -j SET --add-set FOO src --exist
-A PREROUTING -p tcp -m tcp --tcp-flags SYN,RST SYN -j TCPMSS --clamp-mss-to-pmtu
-A PREROUTING -j DNAT --to-destination 1.1.1.1
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "DNAT"


def test_dst_inside_a_comment_does_not_hide_a_rule_from_the_index() -> None:
    rules = "\n".join(f"-A PREROUTING -d 10.9.0.{i}/32 -j ACCEPT" for i in range(20))
    w = nat(f""":PREROUTING ACCEPT [0:0]
{rules}
-A PREROUTING -m comment --comment "was -d 10.9.0.1 once" -j DROP
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "DROP"


def test_connmark_save_and_restore_use_xor_like_the_kernel() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -j CONNMARK --set-xmark 0x1/0x0
-A PREROUTING -j MARK --set-xmark 0x1/0x0
-A PREROUTING -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0x0
-A PREROUTING -m connmark --mark 0x0 -j DROP
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "DROP"  # ctmark 0x1 ^ mark 0x1 = 0


def test_leading_source_read_by_string_operations_as_the_regex_reads_it() -> None:
    # the walk skips a rule whose leading `[!] -s X` fails without parsing it; that test
    # reads the match by string operations, which must agree with the pattern it replaced
    import random
    import re

    from agent.netfilter.walk import leading_src

    pattern = re.compile(r'-A [^\s"]+ (! )?-s ([^\s"]+) ')
    pieces = ["-A", " ", "  ", "\t", "\xa0", '"', "!", "-s", "X", "KUBE-SEP-ABC", "! ",
              "1.2.3.4/32", "-s ", "-j", "\n", 'a"b', "-d", ""]
    rng = random.Random(7)
    for _ in range(4000):
        tail = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 9)))
        for text in (tail, "-A " + tail, "-A C " + tail, "-A C -s " + tail,
                     "-A C ! -s " + tail):
            m = pattern.match(text)
            want = None if m is None else (m.group(1) is not None, m.group(2))
            assert leading_src(text) == want, repr(text)


def test_a_leading_source_that_fails_skips_the_rule_and_one_that_passes_does_not() -> None:
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -s 10.0.0.0/8 -j DROP
-A PREROUTING ! -s 9.9.9.9/32 -j MARK --set-xmark 0x4000/0x4000
-A PREROUTING ! -s 172.16.0.0/16 -j DROP
-A PREROUTING -s 172.16.1.2/32 -m mark --mark 0x4000/0x4000 -j DNAT --to-destination 1.1.1.1
""")
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "DNAT" and res.packet.dst == "1.1.1.1"


def test_an_ipv6_dnat_is_said_with_its_address_bracketed() -> None:
    """kube-proxy's IPv6 endpoint DNAT (--to-destination [ff06::c1]:80, as its IPv6
    proxier writes it): the walk says where it went as [addr]:port, never addr:port
    (ff06::c1:80 is another address)."""
    w = nat("""
:PREROUTING ACCEPT [0:0]
-A PREROUTING -d fd00:ab34::20/128 -p tcp -m tcp --dport 80 -j DNAT --to-destination [ff06::c1]:80
""")
    (res,) = w.walk("PREROUTING", Packet(src="fd00:10::2", dst="fd00:ab34::20", dport=80))
    assert res.verdict == "DNAT" and (res.packet.dst, res.packet.dport) == ("ff06::c1", 80)
    assert res.detail == "DNAT to [ff06::c1]:80"


def test_a_graph_of_chains_costs_its_size_not_its_paths() -> None:
    """Chains that each jump twice to the next (a 1.6 KB paste of 16 levels: 2**16 rules
    on the one path) took over 60 s, and 1,500 fall-through jumps to a chain that returns
    ended in RecursionError. A chain is walked once per packet state; a path past
    MAX_STEPS rules ends UNKNOWN, said."""
    import time

    levels = 40
    body = "".join(f":L{k} - [0:0]\n" for k in range(levels + 1)) + "-A PREROUTING -j L0\n" + \
        "".join(f"-A L{k} -j L{k + 1}\n-A L{k} -j L{k + 1}\n" for k in range(levels))
    w = nat(":PREROUTING ACCEPT [0:0]\n" + body)
    start = time.process_time()
    (res,) = w.walk("PREROUTING", POD)
    assert res.verdict == "UNKNOWN" and "more than" in res.detail and "rules" in res.detail
    returns = ":R - [0:0]\n" + "-A PREROUTING -j R\n" * 20_000 + "-A R -j RETURN\n"
    (res,) = nat(":PREROUTING ACCEPT [0:0]\n" + returns).walk("PREROUTING", POD)
    assert res.verdict == "UNKNOWN", res.detail
    assert time.process_time() - start < 10  # (was: minutes, or RecursionError)
    # a short graph is walked whole: 2**5 jumps, every one followed
    short = "".join(f":L{k} - [0:0]\n" for k in range(6)) + "-A PREROUTING -j L0\n" + \
        "".join(f"-A L{k} -j L{k + 1}\n-A L{k} -j L{k + 1}\n" for k in range(5)) + \
        "-A L5 -j MARK --or-mark 0x1\n-A PREROUTING -m mark --mark 0x1 -j DROP\n"
    (res,) = nat(":PREROUTING ACCEPT [0:0]\n" + short).walk("PREROUTING", POD)
    assert res.verdict == "DROP" and sum(s.chain == "L5" for s in res.steps) == 2 ** 5


def test_a_hash_net_set_is_looked_up_by_prefix_length() -> None:
    """A 100k-prefix blocklist (hash:net) took 0.5 s per lookup: every member was parsed
    and tested. Now each prefix length the set holds is one masked lookup; ipset's
    semantics stay: the most specific "nomatch" entry excludes, IPv4 and IPv6 apart."""
    import time

    members = frozenset(
        [f"{10 + i // 65536}.{(i // 256) % 256}.{i % 256}.0/24" for i in range(100_000)]
        + ["203.0.113.0/24", "203.0.113.7 nomatch", "2001:db8::/32", "198.51.100.9"])
    w = nat(":PREROUTING ACCEPT [0:0]\n-A PREROUTING -m set --match-set BLOCK dst -j DROP",
            View(sets={"BLOCK": ("hash:net", members)}))
    start = time.process_time()
    for dst, want in (("10.1.2.3", "DROP"), ("11.134.159.200", "DROP"),
                      ("11.134.160.1", "ACCEPT"), ("203.0.113.5", "DROP"),
                      ("203.0.113.7", "ACCEPT"), ("198.51.100.9", "DROP"),
                      ("198.51.100.10", "ACCEPT"), ("2001:db8:1::5", "DROP"),
                      ("2001:db9::5", "ACCEPT")) * 50:
        (res,) = w.walk("PREROUTING", POD._replace(dst=dst))
        assert res.verdict == want, dst
    assert time.process_time() - start < 10  # (450 lookups: were about 4 minutes)


# Rules on the chains a DNATed packet crosses once per endpoint (constructed): each tells
# some endpoint addresses apart, or reads what the shared walk leaves out, or neither
_FILTER_BASE = (
    "*filter\n:FORWARD ACCEPT [0:0]\n:KUBE-FORWARD - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n"
    ":SIDE - [0:0]\n"
    "-A FORWARD -m conntrack --ctstate NEW -j KUBE-EXTERNAL-SERVICES\n"
    "{rule}\n"
    "-A FORWARD -j KUBE-FORWARD\n"
    "-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT\n"
    '-A KUBE-EXTERNAL-SERVICES -d 203.0.113.10/32 -p tcp -m comment --comment "ns/a:http '
    'has no local endpoints" -m tcp --dport 80 -j DROP\n'
    '-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "ns/a:http has no local '
    'endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30080 -j DROP\n'
    "-A SIDE -d 10.0.1.9/32 -j REJECT\nCOMMIT\n")
_FORWARD_RULES = [
    ("-A FORWARD -d 10.0.1.7/32 -j DROP", True),
    ("-A FORWARD ! -d 10.0.1.7 -j DROP", True),
    ("-A FORWARD -d 10.0.1.0/29 -j DROP", True),
    ("-A FORWARD -m iprange --dst-range 10.0.1.6-10.0.1.8 -j REJECT", True),
    ("-A FORWARD -m set --match-set blocked dst -j DROP", True),
    ("-A FORWARD -m conntrack --ctorigdst 203.0.113.10 -j DROP", True),
    ("-A FORWARD -m conntrack --ctorigdstport 80 -j DROP", True),
    ("-A FORWARD -m addrtype --dst-type LOCAL -j DROP", True),
    ("-A FORWARD -j SIDE", True),
    ("-A FORWARD -d 2001:db8::/32 -j DROP", True),  # (an IPv6 /32: a prefix, no host)
    ("-A FORWARD -d ::ffff:10.0.1.7/128 -j DROP", True),  # (::ffff:a00:107 by value)
    ("-A FORWARD -d fd00::7/128 -j DROP", True),
    ("-A FORWARD -p tcp -m tcp --dport 8080 -j DROP", False),
    ("-A FORWARD -m mark --mark 0x4000 -j DROP", False),
    ("-A FORWARD -m statistic --mode random --probability 0.5 -j DROP", False),
    ("-A FORWARD -m recent --rcheck --name x -j DROP", False),
    ("-A FORWARD -d 192.0.2.0/24 -j DROP", False),
    ("-A FORWARD -m conntrack --ctstate DNAT -j DROP", False),  # (an empty orig_dst: not)
]
# more than SMALL_CHAIN rules: the chain is indexed by each rule's "-d" text, also where
# the rest of the rule cannot be read
_BIG_FORWARD = "\n".join([f"-A FORWARD -p tcp -m tcp --dport {9000 + n} -j DROP"
                          for n in range(20)] + ["-A FORWARD -p tcp -m tcp junk -d "
                                                 "10.0.1.7 -j DROP"])
_NAT_BASE = ("*nat\n:POSTROUTING ACCEPT [0:0]\n:KUBE-POSTROUTING - [0:0]\n"
             "-A POSTROUTING -j KUBE-POSTROUTING\n{rule}\n"
             "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
             "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n"
             "-A KUBE-POSTROUTING -j MASQUERADE --random-fully\nCOMMIT\n")
_POSTROUTING_RULES = [
    ("-A POSTROUTING -d 10.0.1.7/32 -j SNAT --to-source 192.0.2.1", True),
    ("-A POSTROUTING -d fd00::7 -j ACCEPT", True),
    ("-A POSTROUTING -j DNAT --to-destination 10.0.1.5", True),
    ("-A POSTROUTING -s 10.0.1.0/24 ! -d 10.0.0.0/8 -j FLANNEL-POSTRTG", True),
    ("-A POSTROUTING -s 10.0.1.0/24 -j MASQUERADE", False),
]
# the endpoints a DNAT may give: IPv4 and IPv6 ones around what the rules name, and
# destinations that are no address (a NAT target's text as written)
_ENDPOINTS = [*(f"10.0.1.{n}" for n in range(5, 12)), "2001:db8::5", "2001:db9::5",
              "::ffff:a00:107", "::ffff:a00:108", "fd00::7", "fd00::8", "bogus",
              "10.0.1.x"]


class _SomeUnknown(View):
    """A view that does not know whether some addresses are local."""

    def addr_type(self, addr: str) -> str | None:
        return None if addr in ("10.0.1.11", "fd00::8") else super().addr_type(addr)


def _endpoint_packets() -> list[Packet]:
    """A pod's or a client's packet after kube-proxy's DNAT, to each of _ENDPOINTS (and,
    made up, one whose original destination is empty: not DNATed for conntrack)."""
    out = []
    for dst in _ENDPOINTS:
        for mark in (0, 0x4000):
            for orig, orig_port in (("203.0.113.10", 80), ("10.0.0.10", 30080), ("", 80)):
                out.append(Packet(src="198.51.100.7", dst=dst, dport=8080,
                                  in_iface="eth0", out_iface="cni0", mark=mark,
                                  orig_dst=orig, orig_dport=orig_port))
    return out


@pytest.mark.parametrize("kept,paths", [(4096, 8), (1, 1)], ids=["kept", "few-kept"])
@pytest.mark.parametrize("table,chain,rule,tells", [
    *(("filter", "FORWARD", r, t) for r, t in _FORWARD_RULES),
    ("filter", "FORWARD", _BIG_FORWARD, True),
    *(("nat", "POSTROUTING", r, t) for r, t in _POSTROUTING_RULES)])
def test_a_dnated_packets_walk_is_shared_only_where_no_rule_tells_it_apart(
        table: str, chain: str, rule: str, tells: bool, kept: int, paths: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A packet DNATed to an endpoint crosses filter FORWARD and nat POSTROUTING once per
    endpoint of every NodePort or LB IP walked; where no rule reachable there can tell one
    endpoint's address from another (an address, prefix, range, ipset, conntrack's
    original destination, the address type, a chain jumped to, a NAT, a CNI chain the
    input lacks, a rule the index offers to one address), the walk is made once and
    shared (TableWalker.walk). Every packet's paths are what a walk of its own gives,
    asked once and again, with room for every shared walk or for one; where a rule tells
    addresses apart, some two endpoints' own walks differ (the comparison can fail)."""
    import agent.netfilter.walk as walk

    monkeypatch.setattr(walk, "_SHARED_KEPT", kept)
    monkeypatch.setattr(walk, "_SHARED_PATHS", paths)
    text = (_FILTER_BASE if table == "filter" else _NAT_BASE).format(rule=rule)
    t = parse_iptables_save(text, source="t").table(table)
    assert t is not None
    view = _SomeUnknown(local={"10.0.1.10"},
                        sets={"blocked": ("hash:ip", frozenset({"10.0.1.7"}))})
    shared = TableWalker(t, view)
    packets = _endpoint_packets()
    for _ in range(2):  # (the second time from what the first kept)
        for pkt in packets:
            own = TableWalker(t, view)._walk(chain, pkt)
            assert shared.walk(chain, pkt) == own, (rule, pkt)
    if kept == 1:
        assert len(shared._shared) <= 1
        return

    def alike(p: Packet) -> Packet:
        return p._replace(dst="x", orig_dst="x", orig_dport=0)

    # each packet's own walk, less where it goes and went, by its mark and family; for a
    # rule that tells none apart, only endpoints whose walk can be shared are compared
    # (not a destination that is no address, nor one whose address type is unknown)
    plain = {*_ENDPOINTS[:6], *_ENDPOINTS[7:12]} - {"10.0.1.11", "fd00::8"}
    by_rest: dict[tuple[int, bool], set[str]] = {}
    for pkt in packets:
        if not tells and (pkt.dst not in plain or not pkt.orig_dst):
            continue
        walked = [(r.verdict, alike(r.packet), r.steps, r.detail)
                  for r in TableWalker(t, view)._walk(chain, pkt)]
        by_rest.setdefault((pkt.mark, ":" in pkt.dst), set()).add(repr(walked))
    differs = any(len(walks) > 1 for walks in by_rest.values())
    told = shared._told[chain]
    if tells:
        # (a NAT or a CNI chain the input lacks: never shared, whether or not it tells)
        assert differs or told is None, rule
        assert told is None or told.by_type or any(told.holds(a) for a in plain), rule
    else:
        assert told is not None and not any(told.holds(a) for a in plain), rule
        assert not differs, rule
        # walks shared: one per mark, family and address type (where a rule asks it),
        # not one per endpoint
        assert len(shared._shared) < len(packets) // 4


def test_a_big_chains_index_offers_each_packet_every_rule_that_may_match_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of more than SMALL_CHAIN rules is indexed by each rule's exact destination
    ("-d IP/32", "-d IPv6/128"): a packet is offered the rules of its own address and
    those naming none. An IPv6 "/32" is a prefix, not a host, and an IPv6 address written
    with a dotted tail is compared by value: both are offered to every packet. Walked
    indexed, each packet meets what a scan of every rule gives it."""
    import agent.netfilter.walk as walk

    rules = [f"-A FORWARD -p tcp -m tcp --dport {9000 + n} -j DROP" for n in range(20)]
    rules += ["-A FORWARD -d 2001:db8::/32 -j DROP",
              "-A FORWARD -d ::ffff:10.0.1.7/128 -j REJECT",
              "-A FORWARD -d 10.0.1.8/32 -j DROP",
              "-A FORWARD -d fd00::9/128 -j DROP",
              "-A FORWARD -d 10.1.0.0/16 -j REJECT"]
    t = parse_iptables_save("*filter\n:FORWARD ACCEPT [0:0]\n" + "\n".join(rules)
                            + "\nCOMMIT\n", source="t").table("filter")
    assert t is not None
    dsts = ["2001:db8::5", "2001:db9::5", "::ffff:a00:107", "::ffff:10.0.1.7", "10.0.1.7",
            "10.0.1.8", "fd00::9", "fd00::a", "10.1.2.3", "10.2.0.1"]
    packets = [Packet(src="198.51.100.7", dst=d, dport=8080) for d in dsts]
    indexed = [TableWalker(t, View()).walk("FORWARD", p) for p in packets]
    monkeypatch.setattr(walk, "SMALL_CHAIN", 10_000)
    scanned = [TableWalker(t, View()).walk("FORWARD", p) for p in packets]
    assert indexed == scanned
    assert [r[0].verdict for r in indexed] == [
        "DROP", "ACCEPT", "REJECT", "REJECT", "ACCEPT", "DROP", "DROP", "ACCEPT", "REJECT",
        "ACCEPT"]


def test_a_chain_naming_many_prefixes_is_walked_for_each_packet() -> None:
    """Each prefix a shared chain's rules name is tested against every packet
    (ToldApart.holds): past MAX_TOLD_SPANS the walks are not shared, and each packet's
    paths are still its own walk's."""
    from agent.netfilter.packet import MAX_TOLD_SPANS

    rules = "\n".join(f"-A FORWARD -d 10.{n}.0.0/16 -j DROP" for n in range(MAX_TOLD_SPANS + 1))
    t = parse_iptables_save(f"*filter\n:FORWARD ACCEPT [0:0]\n{rules}\nCOMMIT\n",
                            source="t").table("filter")
    assert t is not None
    shared = TableWalker(t, View())
    for dst in ("10.0.1.5", "10.64.0.9", "10.200.0.1", "192.0.2.4"):
        pkt = Packet(src="198.51.100.7", dst=dst, dport=8080, orig_dst="10.0.0.10",
                     orig_dport=30080)
        assert shared.walk("FORWARD", pkt) == TableWalker(t, View())._walk("FORWARD", pkt)
    assert shared._told["FORWARD"] is None and not shared._shared
    fewer = parse_iptables_save(f"*filter\n:FORWARD ACCEPT [0:0]\n"
                                f"{rules.rsplit(chr(10), 1)[0]}\nCOMMIT\n",
                                source="t").table("filter")
    assert fewer is not None
    w = TableWalker(fewer, View())
    w.walk("FORWARD", Packet(src="198.51.100.7", dst="192.0.2.4", dport=8080,
                             orig_dst="10.0.0.10", orig_dport=30080))
    assert w._told["FORWARD"] is not None and len(w._shared) == 1
