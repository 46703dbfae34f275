"""Parsers of node-tool and kubectl output (agent.parse).

The ipset, ip addr/route and sysctl samples in tests/data/parse/ are real output, made
by tests/data/parse/generate.sh inside a throwaway network namespace. The ipvsadm
samples are hand-written: the kernel the samples were made on has no IP_VS, so ipvsadm
cannot list anything there.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.errors import InputError
from agent.parse import (
    load_json,
    parse_addresses,
    parse_ingresses,
    parse_ipsets,
    parse_ipvsadm,
    parse_local_routes,
    parse_node,
    parse_services,
    parse_sysctls,
)
from agent.snapshot import (
    Address,
    IngressBackend,
    IpSet,
    IpvsRealServer,
    IpvsVirtualServer,
    LoadBalancerIngress,
    ServicePort,
)

DATA = Path(__file__).parent / "data" / "parse"


def sample(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def raises_at(source: str, line: int | None) -> Any:
    """pytest.raises for an InputError whose text starts with SOURCE:LINE: ."""
    where = f"{source}:{line}: " if line is not None else f"{source}: "
    return pytest.raises(InputError, match="^" + where.replace(".", r"\."))


# --- ipset ---------------------------------------------------------------------------------


def test_ipset_save_and_list_agree() -> None:
    saved = parse_ipsets(sample("ipset-save.txt"))
    listed = parse_ipsets(sample("ipset-list.txt"))
    assert saved == listed
    assert [s.name for s in saved] == sorted(s.name for s in saved)


def test_ipset_members_canonical() -> None:
    sets = {s.name: s for s in parse_ipsets(sample("ipset-list.txt"))}
    assert sets["KUBE-CLUSTER-IP"] == IpSet(
        "KUBE-CLUSTER-IP", "hash:ip,port",
        ("10.96.0.1,tcp:443", "10.96.0.10,tcp:53", "10.96.0.10,udp:53"))
    assert sets["KUBE-LOAD-BALANCER-LOCAL"].members == ("203.0.113.10,tcp:80",)
    # bitmap:port members are printed as bare port numbers by both save and list.
    assert sets["KUBE-NODE-PORT-TCP"] == IpSet("KUBE-NODE-PORT-TCP", "bitmap:port",
                                                ("30080", "31443"))
    assert sets["KUBE-LOOP-BACK"].members == ("10.244.1.5,tcp:8080,10.244.1.5",)
    assert sets["KUBE-LOAD-BALANCER-SOURCE-CIDR"].members == (
        "203.0.113.10,tcp:80,198.51.100.0/24",)
    assert sets["KUBE-NET"].members == ("10.0.0.0/8 nomatch", "10.244.0.0/16")
    # timeout / counters / comment are dropped, nomatch is kept wherever it appears.
    assert sets["TEST-IPS"].members == ("10.0.0.7", "10.0.0.8")
    assert sets["TEST-NOMATCH-OPTS"].members == ("192.0.2.0/24 nomatch",)
    assert sets["TEST-EMPTY"] == IpSet("TEST-EMPTY", "hash:ip", ())
    assert sets["TEST-V6"].members == ("fd00::1,tcp:80",)


def test_ipset_empty_file_is_no_sets() -> None:
    assert parse_ipsets("") == ()
    assert parse_ipsets("\n\n") == ()


def test_ipset_comment_with_option_words() -> None:
    text = ('create S hash:ip family inet comment\n'
            'add S 10.0.0.1 comment "nomatch timeout"\n')
    assert parse_ipsets(text)[0].members == ("10.0.0.1",)


@pytest.mark.parametrize(("text", "line"), [
    ("create\n", 1),
    ("create S hash:ip\nadd T 10.0.0.1\n", 2),
    ("create S hash:ip\nadd S 10.0.0.300\n", 2),
    ("create S hash:ip,port\nadd S 10.0.0.1\n", 2),
    ("create S hash:ip\ncreate S hash:ip\n", 2),
    ("create S hash:ip\nflush S\n", 2),
    ("create S nosuchtype\n", 1),
    ("Name: S\nType: hash:ip\nHeader: family inet\n", 1),
    ("Name: S\nType: hash:ip\nMembers:\n10.0.0.1\n\nbogus\n", 6),
    ("Name: S\nMembers:\n", 2),
    ("Name: S\nType: hash:ip\nNumber of entries: 2\nMembers:\n10.0.0.1\n", 5),
    ("hello world\n", 1),
])
def test_ipset_errors(text: str, line: int) -> None:
    with raises_at("ipset.txt", line):
        parse_ipsets(text)


def test_ipset_list_truncated_in_members() -> None:
    lines = sample("ipset-list.txt").splitlines()
    # KUBE-CLUSTER-IP (the first set) announces 3 entries; keep only the first one.
    cut = lines.index("Members:") + 2
    with raises_at("ipset.txt", cut):
        parse_ipsets("\n".join(lines[:cut]) + "\n")


def test_ipset_save_truncated_mid_member() -> None:
    text = sample("ipset-save.txt")
    cut = text.index("10.244.1.5,tcp:8080,10.244.1.5") + len("10.244.1.5,tcp:8")
    line = text[:cut].count("\n") + 1
    with raises_at("ipset.txt", line):
        parse_ipsets(text[:cut])


def test_ipset_runs_of_plain_members_read_as_line_by_line() -> None:
    """A set's run of plain "add SET MEMBER" lines is read by one match; the same lines
    with a space after each (the line-by-line loop's) read the same, and a bad member
    after a run is named by its line."""
    text = ("create KUBE-LOAD-BALANCER hash:ip,port family inet\n"
            "add KUBE-LOAD-BALANCER 10.0.32.2,tcp:80\n"
            "add KUBE-LOAD-BALANCER 10.0.32.1,udp:53\n"
            "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535\n"
            "add KUBE-NODE-PORT-TCP 30001\n"
            "add KUBE-LOAD-BALANCER 10.0.32.3,tcp:80 timeout 5\n"
            "add KUBE-LOAD-BALANCER 10.0.32.4,tcp:80\n"
            "add KUBE-NODE-PORT-TCP 30000")
    fast = parse_ipsets(text)
    assert fast == parse_ipsets(text.replace("\n", " \n"))
    assert fast == (
        IpSet("KUBE-LOAD-BALANCER", "hash:ip,port",
              ("10.0.32.1,udp:53", "10.0.32.2,tcp:80", "10.0.32.3,tcp:80",
               "10.0.32.4,tcp:80")),
        IpSet("KUBE-NODE-PORT-TCP", "bitmap:port", ("30000", "30001")))
    with raises_at("ipset.txt", 4):
        parse_ipsets(text.replace("10.0.32.1,udp:53\n", "10.0.32.1,udp:53\nadd X 1\n"))
    with raises_at("ipset.txt", 3):
        parse_ipsets(text.replace("10.0.32.1,udp:53", "10.0.32.1"))


# --- ipvsadm -------------------------------------------------------------------------------


def test_ipvsadm_list_and_save_agree() -> None:
    listed = parse_ipvsadm(sample("ipvsadm-Ln.txt"))
    saved = parse_ipvsadm(sample("ipvsadm-S.txt"))
    assert listed == saved
    keys = [(v.protocol, v.address, v.port) for v in listed]
    assert keys == sorted(keys)
    by_key = {(v.protocol, v.address, v.port): v for v in listed}
    assert by_key["TCP", "10.0.0.10", 30080].real_servers == (
        IpvsRealServer("10.244.1.5", 8080, "Masq", 1),
        IpvsRealServer("10.244.2.7", 8080, "Masq", 1))
    assert by_key["TCP", "10.0.0.10", 30443].real_servers == ()
    assert by_key["TCP", "198.51.100.7", 80] == IpvsVirtualServer(
        "TCP", "198.51.100.7", 80, "wrr",
        (IpvsRealServer("192.0.2.20", 80, "Route", 5),
         IpvsRealServer("192.0.2.21", 80, "Tunnel", 2)))
    assert by_key["UDP", "10.96.0.10", 53].real_servers[0].address == "10.244.1.3"
    assert by_key["TCP", "fd00::10", 80].real_servers == (
        IpvsRealServer("fd00:244::5", 8080, "Masq", 1),)
    # The FWM service (and its real server) is skipped.
    assert all(v.port != 100 for v in listed)
    assert len(listed) == 8


def test_ipvsadm_headers_only_is_empty() -> None:
    assert parse_ipvsadm(sample("ipvsadm-empty.txt")) == ()
    assert parse_ipvsadm("") == ()


def test_ipvsadm_local_forward_and_sctp() -> None:
    text = ("SCTP 10.0.0.5:9999 sh\n"
            "  -> 10.0.0.10:9999   Local 1 0 0\n")
    assert parse_ipvsadm(text) == (
        IpvsVirtualServer("SCTP", "10.0.0.5", 9999, "sh",
                          (IpvsRealServer("10.0.0.10", 9999, "Local", 1),)),)
    saved = ("-A --sctp-service 10.0.0.5:9999 -s sh\n"
             "-a --sctp-service 10.0.0.5:9999 -r 10.0.0.10 -g\n")
    assert parse_ipvsadm(saved)[0].real_servers == (
        IpvsRealServer("10.0.0.10", 9999, "Route", 1),)


@pytest.mark.parametrize(("text", "line"), [
    ("TCP  kubernetes:https rr\n", 1),
    ("  -> 10.0.0.1:80 Masq 1 0 0\n", 1),
    ("TCP  10.0.0.1:80 rr\n  -> 10.0.0.2:80 Bogus 1 0 0\n", 2),
    ("TCP  10.0.0.1:80 rr\n  -> 10.0.0.2:80 Masq\n", 2),
    ("TCP  10.0.0.1:99999 rr\n", 1),
    ("TCP  [fd00::1:80 rr\n", 1),
    ("-a -t 10.0.0.1:80 -r 10.0.0.2:80 -m -w 1\n", 1),
    ("-A -t 10.0.0.1:80 -s rr\n-a -t 10.0.0.1:80 -m -w 1\n", 2),
    ("-A -s rr\n", 1),
    ("-A -t 10.0.0.1:80 -s\n", 1),
    ("-X -t 10.0.0.1:80\n", 1),
    ("IP Virtual Server version 1.2.1 (size=4096)\nwhat is this\n", 2),
])
def test_ipvsadm_errors(text: str, line: int) -> None:
    with raises_at("ipvsadm.txt", line):
        parse_ipvsadm(text)


def test_ipvsadm_save_dump_read_whole_as_line_by_line() -> None:
    """kube-proxy's `ipvsadm -S -n` dump is read one service block at a time
    (_whole_save); a blank line, a service listed twice or a real server away from its
    service sends the text through the line-by-line loop: the same servers, and an error
    still names its line."""
    text = ("-A -t 10.0.0.1:80 -s rr\n"
            "-a -t 10.0.0.1:80 -r 10.244.1.9:8080 -m -w 1\n"
            "-a -t 10.0.0.1:80 -r 10.244.1.10:8080 -m -w 2\n"
            "-A -t 10.0.0.3:80 -s rr\n"
            "-a -t 10.0.0.3:80 -r 10.244.1.9:8080 -m -w 1\n"
            "-a -t 10.0.0.3:80 -r 10.244.1.10:8080 -m -w 2\n"
            "-A -u [fd00::1]:53 -s wlc\n"
            "-a -u [fd00::1]:53 -r [fd00::0:5]:53 -m -w 1\n"
            "-A -t 10.0.0.2:080 -s sh\n"
            "-a -t 10.0.0.2:080 -r 10.244.1.9 -g -w 1\n"
            "-A -t 10.0.0.4:81 -s sh\n"
            "-a -t 10.0.0.4:81 -r 10.244.1.9 -g -w 1\n"
            "-A -t 10.0.0.5:80 -s lc\n")
    whole = parse_ipvsadm(text)
    assert whole == parse_ipvsadm(text.replace("\n-A -u", "\n\n-A -u"))
    from agent.parse.ipvsadm_text import _whole_save
    persistent = text.replace("-s sh\n-a -t 10.0.0.4", "-s sh -p 10800\n-a -t 10.0.0.4")
    assert _whole_save(persistent) is not None and parse_ipvsadm(persistent) == whole
    assert [(v.address, v.port, v.scheduler, len(v.real_servers)) for v in whole] == [
        ("10.0.0.1", 80, "rr", 2), ("10.0.0.2", 80, "sh", 1), ("10.0.0.3", 80, "rr", 2),
        ("10.0.0.4", 81, "sh", 1), ("10.0.0.5", 80, "lc", 0), ("fd00::1", 53, "wlc", 1)]
    assert whole[0].real_servers == (IpvsRealServer("10.244.1.10", 8080, "Masq", 2),
                                     IpvsRealServer("10.244.1.9", 8080, "Masq", 1))
    assert whole[1].real_servers == (IpvsRealServer("10.244.1.9", 80, "Route", 1),)
    assert whole[3].real_servers == (IpvsRealServer("10.244.1.9", 81, "Route", 1),)
    assert whole[5].real_servers == (IpvsRealServer("fd00::5", 53, "Masq", 1),)
    # the same service twice (its real servers add up), a real server after another
    # service's block
    again = parse_ipvsadm(text + "-a -t 10.0.0.1:80 -r 10.244.1.11:8080 -m -w 1\n"
                          "-A -t 10.0.0.5:80 -s rr\n"
                          "-a -t 10.0.0.5:80 -r 10.244.1.12:8080 -m -w 1\n")
    assert [(v.address, v.scheduler, len(v.real_servers)) for v in again][:5:4] == [
        ("10.0.0.1", "rr", 3), ("10.0.0.5", "rr", 1)]
    with raises_at("ipvsadm.txt", 3):
        parse_ipvsadm(text.replace("-r 10.244.1.10:8080", "-r 10.244.1.300:8080", 1))
    with raises_at("ipvsadm.txt", 2):
        parse_ipvsadm("-A -t 10.0.0.1:80 -s rr\n-a -t 10.0.0.9:80 -r 10.244.1.9:80 -m -w 1\n")


def test_ipvsadm_listing_read_whole_as_line_by_line() -> None:
    """`ipvsadm -Ln` (what `bundle` saves) is read one service block at a time
    (_whole_listing); a blank line, a --stats header or a service listed twice sends it
    through the line-by-line loop: the same servers, and an error still names its line."""
    head = ("IP Virtual Server version 1.2.1 (size=4096)\n"
            "Prot LocalAddress:Port Scheduler Flags\n"
            "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n")
    body = ("TCP  10.0.0.10:30080 rr\n"
            "  -> 10.244.1.5:8080              Masq    1      0          0         \n"
            "  -> 10.244.1.10:8080             Masq    1      0          0         \n"
            "TCP  203.0.113.10:80 rr\n"
            "  -> 10.244.1.5:8080              Masq    1      0          0         \n"
            "  -> 10.244.1.10:8080             Masq    1      4          0         \n"
            "TCP  10.0.0.10:30443 rr\n"
            "TCP  198.51.100.7:80 wrr persistent 10800\n"
            "  -> 192.0.2.21:80                Tunnel  2      0          0         \n"
            "UDP  [fd00::10]:53 rr\n"
            "  -> [fd00:244::0:5]:53           Masq    1      0          0         \n")
    from agent.parse.ipvsadm_text import _whole_listing
    assert _whole_listing(head + body) is not None and _whole_listing(body) is not None
    whole = parse_ipvsadm(head + body)
    assert whole == parse_ipvsadm(body) == parse_ipvsadm(
        head + body.replace("\nTCP  10.0.0.10:30443", "\n\nTCP  10.0.0.10:30443"))
    assert [(v.address, v.port, v.scheduler, v.real_servers[:1]) for v in whole] == [
        ("10.0.0.10", 30080, "rr", (IpvsRealServer("10.244.1.10", 8080, "Masq", 1),)),
        ("10.0.0.10", 30443, "rr", ()),
        ("198.51.100.7", 80, "wrr", (IpvsRealServer("192.0.2.21", 80, "Tunnel", 2),)),
        ("203.0.113.10", 80, "rr", (IpvsRealServer("10.244.1.10", 8080, "Masq", 1),)),
        ("fd00::10", 53, "rr", (IpvsRealServer("fd00:244::5", 53, "Masq", 1),))]
    # the first scheduler of a service listed twice, its real servers added up
    twice = parse_ipvsadm(head + body + "TCP  10.0.0.10:30443 sh\n"
                          "  -> 10.244.1.7:8443              Masq    1      0          0\n")
    assert twice[1] == IpvsVirtualServer("TCP", "10.0.0.10", 30443, "rr",
                                         (IpvsRealServer("10.244.1.7", 8443, "Masq", 1),))
    stats = head.replace("Scheduler Flags", "Conns   InPkts  OutPkts  InBytes OutBytes")
    assert parse_ipvsadm(stats + "TCP  10.0.0.10:30080 1 2 3 4 5\n")[0].scheduler == "?"
    with raises_at("ipvsadm.txt", 6):
        parse_ipvsadm(head + body.replace("10.244.1.10:8080", "10.244.1.300:8080", 1))
    with raises_at("ipvsadm.txt", 4):  # (a real server before any service)
        parse_ipvsadm(head + body.split("\n", 1)[1])
    # a real server is told by its address, method and weight, not its counters: the
    # same endpoints under a Service's NodePort and LB IP are one object
    assert whole[0].real_servers is whole[3].real_servers


def test_ipvsadm_listing_whole_read_equals_line_loop_on_random_listings() -> None:
    """_whole_listing gives what the line-by-line loop gives, or None (then the loop
    reads the text), for listings made to hit its edges: counters and flags after the
    weight, services twice, real servers before any service, blank and stray lines, bad
    addresses and ports, IPv6, several spacings."""
    from agent.parse.ipvsadm_text import _BY_PLACE, _services, _whole_listing

    rnd = random.Random(31)

    def pick(good: list[str], bad: list[str], clean: bool) -> str:
        return rnd.choice(good if clean or rnd.random() < 0.8 else bad)

    lines = []
    for _ in range(3000):
        clean = rnd.random() < 0.5  # (half the listings as ipvsadm prints them)
        text = "IP Virtual Server version 1.2.1 (size=4096)\n" if rnd.random() < 0.5 else ""
        for k in range(rnd.randrange(8)):
            r = 0.0 if k == 0 and clean else rnd.random()
            place = (pick(["10.0.0.10", "203.0.113.10", "[fd00::10]", "[fd00:0::10]"],
                          ["10.0.0.300", "01.2.3.4", "fd00::10"], clean)
                     + ":" + pick(["80", "8080", "65535"], ["65536", "x", ""], clean))
            if r < 0.35:
                text += (f"{pick(['TCP', 'UDP', 'SCTP'], ['FWM', 'tcp'], clean)}  {place} "
                         f"{pick(['rr', 'wrr', 'sh'], ['Rr', '-'], clean)}"
                         f"{rnd.choice(['', ' persistent 50', ' '])}\n")
            elif r < 0.9 or clean:
                text += (f"  -> {place}{' ' * rnd.randrange(1, 4)}"
                         + pick(["Masq", "Route", "Tunnel", "Local", "Bypass"], ["Nat"], clean)
                         + " " * rnd.randrange(1, 4) + pick(["1", "0", "10"], ["-1", "x"], clean)
                         + rnd.choice(["", "      0          0", " 3 4 ", " "]) + "\n")
            else:
                text += rnd.choice(["\n", "  -> RemoteAddress:Port Forward Weight\n", "junk\n",
                                    "\t0\n", "TCP\t 10.0.0.10:80 rr\n", "TCP  10.0.0.10:80 rr\r\n",
                                    "  ->\u00a010.0.0.10:80 Masq 1\n", "UDP  10.0.0.10:53 rr\x85\n",
                                    "Prot LocalAddress:Port  Conns  InPkts\n"])
        lines.append(text)
    read_whole = 0
    for text in lines:
        whole = _whole_listing(text)
        if whole is None:
            continue
        read_whole += 1
        loop = _services(text, "ipvsadm.txt")
        assert whole == {key: (s.scheduler, tuple(sorted(s.reals, key=_BY_PLACE)))
                         for key, s in loop.items()}, text
    assert read_whole > 1000  # (the clean half: not only the loop's texts)


def test_kube_ipvs0_lines_read_by_regex_as_by_the_loop() -> None:
    """The kernel's local routes and kube-ipvs0's plain address lines are read by one
    regex pass; the same text with those lines in another spacing (the general loop's)
    reads the same, and an error after them still names its line."""
    routes = ("broadcast 10.0.0.255 dev eth0 proto kernel scope link src 10.0.0.10 \n"
              "local 10.0.0.10 dev eth0 proto kernel scope host src 10.0.0.10\n"
              "local 10.0.32.1 dev kube-ipvs0 proto kernel scope host src 10.0.32.1 \n"
              "local 127.0.0.0/8 dev lo proto kernel scope host src 127.0.0.1\n"
              "local fd00::5 dev kube-ipvs0 proto kernel metric 0 pref medium\n"
              "local 10.0.32.2 dev src proto kernel scope host src 10.0.32.2\n")
    with raises_at("route-local.txt", 6):
        parse_local_routes(routes)
    routes = routes.replace("dev src", "dev kube-ipvs0")
    fast = parse_local_routes(routes)
    slow = parse_local_routes(routes.replace(" proto", "  proto"))
    assert fast == tuple(dataclasses.replace(r, line=r.line.replace("  proto", " proto"))
                         for r in slow)
    assert [r.line for r in fast if r.dst == "10.0.32.1"] == [
        "local 10.0.32.1 dev kube-ipvs0 proto kernel scope host src 10.0.32.1"]
    with raises_at("route-local.txt", 7):
        parse_local_routes(routes + "local 10.0.32.300 dev kube-ipvs0\n")
    addrs = ("4: kube-ipvs0: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN\n"
             "    link/ether 6a:00:00:00:00:04 brd ff:ff:ff:ff:ff:ff\n"
             "    inet 10.96.0.10/32 scope global kube-ipvs0\n"
             "       valid_lft forever preferred_lft forever\n"
             "    inet 10.0.32.1/32 scope global kube-ipvs0\n"
             "    inet6 fd00::5/128 scope global\n"
             "       valid_lft forever preferred_lft forever\n"
             "5: eth0: <BROADCAST,UP> mtu 1500\n"
             "    inet 10.0.0.10/24 scope global eth0\n")
    fast = parse_addresses(addrs)
    assert fast == parse_addresses(addrs.replace(" scope", "  scope"))
    assert [(a.ifname, a.address, a.prefixlen, a.link_up) for a in fast] == [
        ("eth0", "10.0.0.10", 24, True), ("kube-ipvs0", "10.0.32.1", 32, False),
        ("kube-ipvs0", "10.96.0.10", 32, False), ("kube-ipvs0", "fd00::5", 128, False)]
    with raises_at("addr.txt", 10):
        parse_addresses(addrs + "garbage\n")
    with raises_at("addr.txt", 1):
        parse_addresses(addrs[addrs.index("    inet 10.96"):])


# --- local routes --------------------------------------------------------------------------


def test_local_routes_text_and_json_agree() -> None:
    text = parse_local_routes(sample("route-local.txt"))
    js = parse_local_routes(sample("route-local.json"))
    assert text == js
    by_dst = {r.dst: r for r in text}
    vip = by_dst["203.0.113.10"]
    assert (vip.type, vip.dev, vip.src) == ("local", "kube-ipvs0", "203.0.113.10")
    assert vip.line == "local 203.0.113.10 dev kube-ipvs0 proto kernel scope host src 203.0.113.10"
    assert by_dst["127.0.0.0/8"].dev == "lo"
    assert by_dst["10.0.0.255"].type == "broadcast"
    keys = [(r.type, r.dst, r.dev) for r in text]
    assert keys == sorted(keys)


def test_local_routes_ipv6_and_flags() -> None:
    text = ("local ::1 dev lo table local proto kernel metric 0 pref medium\n"
            "local 10.0.0.5 dev eth0 proto kernel scope host src 10.0.0.5 linkdown\n")
    routes = parse_local_routes(text)
    assert [(r.dst, r.dev, r.src) for r in routes] == [("10.0.0.5", "eth0", "10.0.0.5"),
                                                      ("::1", "lo", None)]


@pytest.mark.parametrize(("text", "line"), [
    ("", None),
    ("\n  \n", None),
    ("local 10.0.0.5 dev eth0\nlocal banana dev eth0\n", 2),
    ("local 10.0.0.5 dev eth0 src 10.0.0.x\n", 1),
    ("local 10.0.0.5 dev\n", 1),
    ("local\n", 1),
    ("[]", None),
    ("[{\"type\": \"local\"}]", 1),
    ("[{\"type\": \"local\", \"dst\": 5}]", 1),
    ("[\n{\"type\": \"local\",\n \"dst\": \"10.0.0.5\"", 3),
])
def test_local_routes_errors(text: str, line: int | None) -> None:
    with raises_at("route-local.txt", line):
        parse_local_routes(text)


# --- addresses -----------------------------------------------------------------------------


def test_addresses_text_and_json_agree() -> None:
    text = parse_addresses(sample("addr.txt"))
    js = parse_addresses(sample("addr.json"))
    assert text == js
    ipvs = [a for a in text if a.ifname == "kube-ipvs0"]
    # kube-ipvs0 is DOWN (no UP flag) but holds the VIPs as /32 (/128).
    assert ipvs == [Address("kube-ipvs0", "10.96.0.1", 32, "global", False),
                    Address("kube-ipvs0", "203.0.113.10", 32, "global", False),
                    Address("kube-ipvs0", "fd00::5", 128, "global", False)]
    names = {a.ifname for a in text}
    assert names == {"lo", "kube-ipvs0", "eth0", "veth1", "eth0.100"}  # no "@peer"
    assert Address("lo", "127.0.0.1", 8, "host", True) in text
    assert Address("eth0", "10.0.0.11", 24, "global", True) in text  # labelled eth0:vip
    assert Address("veth1", "10.1.1.1", 32, "global", True) in text  # peer address
    assert any(a.scope == "link" and a.address.startswith("fe80:") for a in text)
    keys = [(a.ifname, 6 if ":" in a.address else 4, a.address) for a in text]
    assert keys == sorted(keys)


@pytest.mark.parametrize("local", ["10.0.0.1", "0.0.0.0", "255.255.255.255", "010.0.0.1",
                                   "10.0.0.256", "1.2.3", "1.2.3.4.5", "fd00::1",
                                   "FD00:0::1", "::ffff:1.2.3.4", "1.2.3.4 ", "\u0661.2.3.4"])
@pytest.mark.parametrize("plen", [0, 24, 32, 33, 128, 129])
def test_json_address_read_as_ipaddress_reads_it(local: str, plen: int) -> None:
    """`ip -j addr`'s plain IPv4 addresses are taken without ipaddress: what is taken,
    refused or canonicalised is what ipaddress says."""
    import ipaddress
    import json

    doc = json.dumps([{"ifname": "kube-ipvs0", "flags": [], "addr_info": [
        {"family": "inet", "local": local, "prefixlen": plen, "scope": "global"}]}])
    try:
        ip = ipaddress.ip_address(local)
    except ValueError:
        ip = None
    if ip is None or plen > ip.max_prefixlen:
        with pytest.raises(InputError, match="bad address"):
            parse_addresses(doc, "addr.json")
    else:
        assert parse_addresses(doc, "addr.json") == (
            Address("kube-ipvs0", str(ip), plen, "global", False),)


@pytest.mark.parametrize(("text", "line"), [
    ("", None),
    ("    inet 10.0.0.1/24 scope global eth0\n", 1),
    ("2: eth0: <UP> mtu 1500\n    inet 10.0.0.1/99 scope global eth0\n", 2),
    ("2: eth0: <UP> mtu 1500\n    inet fd00::1/64 scope global eth0\n", 2),
    ("2: eth0: <UP> mtu 1500\n    inet 10.0.0.\n", 2),
    ("2: eth0: <BROADCAST,MUL", 1),
    ("Device \"eth9\" does not exist.\n", 1),
    ("[]", None),
    ('[{"ifname": "eth0", "flags": ["UP"], "addr_info": [{"local": "x", "prefixlen": 8}]}]', 1),
    ('[{"ifname": "eth0", "addr_info": 5}]', 1),
    ('[{"ifname": "eth0"', 1),
])
def test_addresses_errors(text: str, line: int | None) -> None:
    with raises_at("addr.txt", line):
        parse_addresses(text)


# --- sysctl --------------------------------------------------------------------------------


def test_sysctls_real_sample() -> None:
    values = parse_sysctls(sample("sysctl.txt"))
    assert values["net.ipv4.ip_forward"] == "1"
    assert values["net.ipv4.conf.eth0.rp_filter"] == "1"
    assert values["net.ipv4.conf.kube-ipvs0.accept_local"] == "1"
    assert values["net.ipv4.conf.all.log_martians"] == "1"
    # eth0.100 is printed by sysctl as eth0/100, and kept that way.
    assert values["net.ipv4.conf.eth0/100.route_localnet"] == "1"
    assert all(k == "net.ipv4.ip_forward" or k.rsplit(".", 1)[1] in
               {"accept_local", "rp_filter", "route_localnet", "log_martians"}
               for k in values)
    assert "net.ipv4.ip_forward_update_priority" not in values


def test_sysctls_skip_noise() -> None:
    text = ("sysctl: permission denied on key 'fs.protected_fifos'\n"
            "net.ipv4.conf.eth0.rp_filter = 2\n"
            "\x00\x01 garbage\n"
            "net.ipv4.tcp_rmem = 4096\t131072\t6291456\n"
            "net.ipv4.conf.lo.accept_local=1\n")
    assert parse_sysctls(text) == {"net.ipv4.conf.eth0.rp_filter": "2",
                                   "net.ipv4.conf.lo.accept_local": "1"}


@pytest.mark.parametrize("text", ["", "sysctl: permission denied on key 'x'\n", "\x7fELF\x02"])
def test_sysctls_nothing_usable(text: str) -> None:
    with raises_at("sysctl.txt", None):
        parse_sysctls(text)


# --- kubectl JSON --------------------------------------------------------------------------


def kube(name: str) -> dict[str, Any]:
    return load_json(sample(name), name)


def test_services() -> None:
    services = {s.key: s for s in parse_services(kube("services.json"), "services.json")}
    assert list(services) == sorted(services)
    web = services["shop/web"]
    assert web.type == "LoadBalancer"
    assert web.cluster_ip == "10.96.12.34"
    assert web.external_traffic_policy == "Local"
    assert web.lb_ingress == (LoadBalancerIngress(ip="203.0.113.10", ip_mode="VIP"),)
    assert web.annotations["service.cloud.tencent.com/prevent-loopback"] == "true"
    assert web.ports == (ServicePort(80, "TCP", 30080, "http"),
                         ServicePort(443, "TCP", 30443, "https"))
    api = services["shop/api"]
    assert api.external_ips == ("198.51.100.9",)
    assert api.lb_ingress == (LoadBalancerIngress(hostname="api.example.com"),
                              LoadBalancerIngress(ip="203.0.113.11", ip_mode="Proxy"))
    assert api.ports == (ServicePort(53, "UDP", 31053, None),)
    assert services["shop/db"].cluster_ip is None  # headless
    assert services["default/kubernetes"].type == "ClusterIP"


def test_single_service_object() -> None:
    doc = {"kind": "Service", "metadata": {"name": "a", "namespace": "n"},
           "spec": {"ports": [{"port": 80}]}}
    (svc,) = parse_services(doc, "svc.json")
    assert (svc.key, svc.ports) == ("n/a", (ServicePort(80),))


def test_node() -> None:
    node = parse_node(kube("node.json"), "node.json")
    assert node.name == "node-1"
    assert node.pod_cidrs == ("10.244.1.0/24", "fd00:244:1::/64")
    assert node.internal_ips == ("10.0.0.10", "2001:db8::10")
    old = {"kind": "Node", "metadata": {"name": "n"}, "spec": {"podCIDR": "10.244.2.0/24"}}
    assert parse_node(old, "node.json").pod_cidrs == ("10.244.2.0/24",)


def test_ingresses() -> None:
    ings = {i.key: i for i in parse_ingresses(kube("ingresses.json"), "ingresses.json")}
    shop = ings["shop/shop"]
    assert shop.ips == ("203.0.113.20",)
    assert shop.tls is True
    assert shop.backends == (IngressBackend("shop/api", 53, None),
                             IngressBackend("shop/web", None, "http"),
                             IngressBackend("shop/web", 80, None))
    assert ings["blog/blog"].tls is False
    assert ings["blog/blog"].backends == (IngressBackend("blog/blog", 8080, None),)


def test_ingress_old_api() -> None:
    doc = {"kind": "Ingress", "metadata": {"name": "i", "namespace": "n"},
           "spec": {"backend": {"serviceName": "s", "servicePort": 80},
                    "rules": [{"http": {"paths": [
                        {"backend": {"serviceName": "t", "servicePort": "web"}}]}}]}}
    (ing,) = parse_ingresses(doc, "ingresses.json")
    assert ing.backends == (IngressBackend("n/s", 80, None), IngressBackend("n/t", None, "web"))


def test_load_json_errors() -> None:
    with raises_at("services.json", 3):
        load_json('{\n  "kind": "List",\n  "items": [,]\n}', "services.json")
    with raises_at("services.json", 1):
        load_json("[1, 2]", "services.json")
    with raises_at("services.json", 1):
        load_json("", "services.json")
    with pytest.raises(InputError, match=r"^services\.json"):
        load_json("[" * 100000, "services.json")


@pytest.mark.parametrize(("parser", "doc", "needle"), [
    (parse_services, {"kind": "List", "items": {}}, "items: expected a list"),
    (parse_services, {"kind": "List", "items": [{"kind": "Pod"}]}, "expected a Service"),
    (parse_services, {"kind": "Pod"}, "expected a Service"),
    (parse_services, {"kind": "PodList", "items": [{}]}, "expected a ServiceList or List"),
    (parse_services, {"items": [{"metadata": {}}]}, "metadata.name: missing"),
    (parse_services, {"items": [{"metadata": {"name": "a"}, "spec": {"ports": [{}]}}]},
     "items[0].spec.ports[0].port: missing"),
    (parse_services, {"items": [{"metadata": {"name": "a"}, "spec": {"ports": [{"port": "80"}]}}]},
     "expected an integer"),
    (parse_services, {"items": [{"metadata": {"name": "a"}, "spec": []}]}, "spec: expected"),
    (parse_node, {"kind": "NodeList", "items": []}, "expected one Node, found 0"),
    (parse_node, {"kind": "Service", "metadata": {"name": "a"}}, "expected a Node"),
    (parse_node, {"kind": "Node", "metadata": {"name": "a"}, "status": {"addresses": [1]}},
     "addresses[0]: expected an object"),
    (parse_ingresses, {"kind": "List", "items": [{"kind": "Service"}]}, "expected a Ingress"),
    (parse_ingresses, {"kind": "Ingress", "metadata": {"name": "i"},
                       "spec": {"rules": [{"http": {"paths": [{"backend": 5}]}}]}},
     "rules[0].http.paths[0].backend: expected an object"),
])
def test_kube_shape_errors(parser: Callable[[dict[str, Any], str], Any],
                           doc: dict[str, Any], needle: str) -> None:
    with pytest.raises(InputError) as err:
        parser(doc, "x.json")
    assert str(err.value).startswith("x.json: ")
    assert needle in str(err.value)


# --- fuzz: nothing but InputError for bad input ---------------------------------------------

TEXT_PARSERS: list[tuple[Callable[[str, str], Any], list[str]]] = [
    (parse_ipsets, ["ipset-save.txt", "ipset-list.txt"]),
    (parse_ipvsadm, ["ipvsadm-Ln.txt", "ipvsadm-S.txt"]),
    (parse_local_routes, ["route-local.txt", "route-local.json"]),
    (parse_addresses, ["addr.txt", "addr.json"]),
    (parse_sysctls, ["sysctl.txt"]),
]


def _kube_services(text: str, source: str) -> Any:
    return parse_services(load_json(text, source), source)


def _kube_node(text: str, source: str) -> Any:
    return parse_node(load_json(text, source), source)


def _kube_ingresses(text: str, source: str) -> Any:
    return parse_ingresses(load_json(text, source), source)


TEXT_PARSERS += [
    (_kube_services, ["services.json"]),
    (_kube_node, ["node.json"]),
    (_kube_ingresses, ["ingresses.json"]),
]


def _fuzz_inputs(base: str, rng: random.Random) -> list[str]:
    inputs = ["", "\n", "\x00" * 10, "[", "{", "\ufeff", "x" * 1_000_000,
              "a " * 200_000 + "\n", base.replace("\n", "\r")]
    for _ in range(30):
        inputs.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
                      .decode("latin-1"))
    for _ in range(60):  # truncated anywhere
        inputs.append(base[: rng.randrange(len(base))])
    for _ in range(60):  # one character replaced, or a line dropped/duplicated
        i = rng.randrange(len(base))
        inputs.append(base[:i] + rng.choice(":,/[]{}\"' \n-x0.") + base[i + 1:])
        lines = base.splitlines()
        j = rng.randrange(len(lines))
        inputs.append("\n".join(lines[:j] + lines[j + 1:]))
        inputs.append("\n".join([*lines[:j], lines[j], *lines[j:]]))
    return inputs


@pytest.mark.parametrize(("parser", "names"), TEXT_PARSERS,
                         ids=[p.__name__ for p, _ in TEXT_PARSERS])
def test_fuzz_only_input_errors(parser: Callable[[str, str], Any], names: list[str]) -> None:
    rng = random.Random(1234)
    for name in names:
        for text in _fuzz_inputs(sample(name), rng):
            try:
                parser(text, "fuzz.txt")
            except InputError as e:
                assert str(e).startswith("fuzz.txt")
                assert e.line is None or e.line >= 1
            # Any other exception fails the test with its traceback.


# --- live: the real tools in a throwaway namespace -----------------------------------------

needs_tools = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "ipset", "sysctl")),
    reason="needs root, ip, ipset and sysctl")


@pytest.mark.netns
@needs_tools
def test_live_tools_in_netns() -> None:
    from lab.netns import netns

    with netns("lbparse") as ns:
        ns.sh("""
            ipset create T-PORTS hash:ip,port
            ipset add T-PORTS 10.0.0.5,tcp:80
            ipset add T-PORTS 10.0.0.5,udp:53
            ipset create T-NP bitmap:port range 0-65535
            ipset add T-NP 30080
            ipset create T-NET hash:net
            ipset add T-NET 10.0.0.0/8 nomatch
            ip link add kube-ipvs0 type bridge
            ip addr add 10.0.0.5/32 dev kube-ipvs0
        """)
        save = parse_ipsets(ns.run("ipset", "save").stdout)
        listed = parse_ipsets(ns.run("ipset", "list").stdout)
        assert save == listed == (
            IpSet("T-NET", "hash:net", ("10.0.0.0/8 nomatch",)),
            IpSet("T-NP", "bitmap:port", ("30080",)),
            IpSet("T-PORTS", "hash:ip,port", ("10.0.0.5,tcp:80", "10.0.0.5,udp:53")),
        )
        text = parse_addresses(ns.run("ip", "addr", "show").stdout)
        assert text == parse_addresses(ns.run("ip", "-j", "addr", "show").stdout)
        assert Address("kube-ipvs0", "10.0.0.5", 32, "global", False) in text
        routes = parse_local_routes(ns.run("ip", "route", "show", "table", "local").stdout)
        assert routes == parse_local_routes(
            ns.run("ip", "-j", "route", "show", "table", "local").stdout)
        assert any(r.dst == "10.0.0.5" and r.dev == "kube-ipvs0" for r in routes)
        sysctls = parse_sysctls(ns.run("sysctl", "net.ipv4").stdout)
        assert "net.ipv4.conf.kube-ipvs0.accept_local" in sysctls
