"""Reading what people paste (agent/bundle, agent/netfilter/rules_text, listing): each
format and inference on a real excerpt from tests/data/realworld/ (its source is in that
case's case.json), plus the hostile shapes (a FIFO, stdin)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

from agent.bundle import load_bundle, load_texts
from agent.bundle import sections as fmt
from agent.bundle.sections import command_format, split_sections
from agent.diagnose import diagnose
from agent.errors import InputError
from agent.netfilter.listing import listing_to_rules
from agent.netfilter.rules_text import RulesText, read_rules_text, settle
from agent.snapshot import NodeSnapshot

REAL = Path(__file__).parent / "data" / "realworld"


def real(case: str, name: str = "paste.txt") -> str:
    return (REAL / case / name).read_text()


def load(text: str, name: str = "paste.txt") -> NodeSnapshot:
    return load_texts([(name, text, fmt.UNKNOWN)], origin="bundle:test")


def test_prompts_split_a_paste_into_its_commands() -> None:
    text = real("k8s-issue-89869-ipvs-lb-local-ipset")
    secs = split_sections(text, "paste.txt")
    assert [s.format for s in secs[:2]] == [fmt.IPTABLES, fmt.IPSET]
    assert secs[0].command == "iptables -t nat -S | grep LOAD-BALANCER"
    assert secs[0].hint["table"] == "nat" and secs[1].hint["set"] == "KUBE-LOAD-BALANCER-LOCAL"


def test_command_formats() -> None:
    assert command_format("iptables -t nat -S KUBE-SERVICES") == (
        fmt.IPTABLES, {"table": "nat", "chain": "KUBE-SERVICES"})
    assert command_format("sudo iptables -nvL -t nat")[0] == fmt.IPTABLES_LIST
    assert command_format("iptables -S")[1]["table"] == "filter"  # -S alone lists filter
    assert command_format("ip r s t local") == (fmt.ROUTE, {"route_table": "local"})
    assert command_format("ip a show kube-ipvs0 | grep -A2 1.2.3.4") == (
        fmt.ADDR, {"dev": "kube-ipvs0"})
    assert command_format("kubectl get svc -A -o wide")[0] == fmt.SVC_TABLE
    assert command_format("kubectl get svc foo -oyaml")[0] == fmt.KUBE


def test_iptables_s_excerpt_takes_the_commands_table() -> None:
    snap = load(real("k8s-issue-89869-ipvs-lb-local-ipset"))
    assert snap.netfilter is not None
    nat = snap.netfilter.table("nat")
    assert nat is not None and len(nat.chain("KUBE-LOAD-BALANCER").rules) == 2
    # ipset list of one set, and the mode from the sets and the chain
    assert set(snap.ipset("KUBE-LOAD-BALANCER-LOCAL").members) == {"172.23.133.0,tcp:80",
                                                                  "172.23.133.0,tcp:443"}
    v = diagnose(snap, "n").to_dict("all")
    assert v["kube_proxy_mode"] == "ipvs"
    assert {r["ip"] for r in v["lb_ips"]} == {"172.23.133.0"}


def test_numbered_and_terminal_wrapped_rules_are_unwrapped() -> None:
    """An editor's line numbers and a terminal's wrapping (two rules on one line, a chain
    name broken by padding), as pasted in kubernetes/kubernetes#44516."""
    into = RulesText()
    read_rules_text(real("k8s-issue-44516-externalip-numbered-wrapped-iptables-save"),
                    "paste.txt", into)
    texts = [r.rule.text for r in into.loose]
    assert any(t.endswith("-j KUBE-SVC-FKYB3VE56PGE3NL6") and "physdev" in t for t in texts)
    assert len([t for t in texts if "10.200.0.246/32" in t]) >= 4
    assert not [p for _, p in into.problems if "KUBE-" in p.why and "SVC-" in p.why]
    nf = settle(into)
    assert nf.table("nat") is not None and not into.rules
    assert into.inferred == {"nat": len(into.loose)}


def test_headerless_tables_are_inferred_and_said() -> None:
    text = (  # from kube-proxy's own output shapes: a grep mixing the nat and filter tables
        '-A KUBE-SERVICES -d 10.0.0.9/32 -p tcp -m comment --comment "ns/a:http has no '
        'endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable\n'
        '-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment "default/kubernetes:'
        'https cluster IP" -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y\n'
        '-A KUBE-SVC-NPX46M4PTMTKRN6Y -j KUBE-SEP-X\n'
        '-A KUBE-SEP-X -p tcp -m tcp -j DNAT --to-destination 10.0.0.1:6443\n')
    snap = load(text)
    assert snap.netfilter is not None
    assert [r.text.split()[-2] for r in snap.netfilter.table("filter").chain(
        "KUBE-SERVICES").rules] == ["--reject-with"]
    assert len(snap.netfilter.table("nat").chain("KUBE-SERVICES").rules) == 1
    reason = next(u.reason for u in snap.unknowns if u.source == "iptables")
    assert "4 rules had no table header" in reason and "3 to nat" in reason


def test_s_v_counters_and_backslash_continuation() -> None:
    # constructed from the shapes `iptables -S -v` and a wrapped shell paste print
    text = ("-P PREROUTING ACCEPT -c 10 600\n"
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -c 5 300 \\\n"
            "    -j KUBE-SERVICES\n")
    into = RulesText()
    read_rules_text(text, "t", into, table="nat")
    assert [r.text for r in into.rules[("nat", "PREROUTING")]] == [
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES']
    assert into.chains[("nat", "PREROUTING")] == "ACCEPT" and not into.problems


def test_listing_rows_become_rules_and_unreadable_rows_stay_undecided() -> None:
    # `iptables -t nat -L -n -v` as kube-proxy's rules print there (columns as iptables
    # 1.8 prints them)
    rows = [
        "Chain KUBE-SERVICES (2 references)",
        " pkts bytes target     prot opt in     out     source               destination",
        "    0     0 KUBE-MARK-MASQ  tcp  --  *      *      !10.244.0.0/16        10.96.0.1"
        "            /* default/kubernetes:https cluster IP */ tcp dpt:443",
        "    0     0 KUBE-SVC-NPX46M4PTMTKRN6Y  tcp  --  *      *       0.0.0.0/0            "
        "10.96.0.1            /* default/kubernetes:https cluster IP */ tcp dpt:443",
        "    0     0 KUBE-NODEPORTS  all  --  *      *       0.0.0.0/0            0.0.0.0/0"
        "            /* kubernetes service nodeports */ ADDRTYPE match dst-type LOCAL",
        "    0     0 KUBE-FOO  all  --  *      *       0.0.0.0/0            0.0.0.0/0"
        "            u32 0x0&0x1=0x1",
    ]
    pairs, problems = listing_to_rules(list(enumerate(rows, 1)))
    texts = [t for _, t in pairs]
    assert texts[0] == "-N KUBE-SERVICES"
    assert texts[1] == ('-A KUBE-SERVICES ! -s 10.244.0.0/16 -d 10.96.0.1 -p tcp -m comment '
                        '--comment "default/kubernetes:https cluster IP" -m tcp --dport 443 '
                        '-j KUBE-MARK-MASQ')
    assert texts[3].endswith("-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS")
    assert "-m listing --unreadable row -j KUBE-FOO" in texts[4]
    assert problems == [(6, "match text not understood: 'u32 0x0&0x1=0x1'")]


def test_svc_table_without_header_and_yaml_without_metadata() -> None:
    snap = load(real("k8s-issue-113105-kubectl-get-svc-text-no-header"))
    assert snap.services is not None
    assert {(s.name, s.lb_ingress[0].ip) for s in snap.services} == {
        ("service-a", "10.253.32.102"), ("service-b", "10.253.32.101")}
    snap = load(real("k8s-issue-121909-svc-yaml-externalips-etp-local"))
    (svc,) = snap.services or ()
    assert svc.external_traffic_policy == "Local" and svc.external_ips == ("10.3.49.15",
                                                                           "10.3.49.16")


def test_excerpt_inside_an_interface_and_typeless_routes() -> None:
    snap = load(real("k8s-issue-79783-tke-ipvs-lb-ip-on-kube-ipvs0"))
    assert [(a.ifname, a.address) for a in snap.addresses or ()] == [("kube-ipvs0",
                                                                      "170.106.134.124")]
    assert [r.dst for r in snap.local_routes or ()] == ["170.106.134.124"]
    typeless = load("$ ip route show table local type local\n"
                    "10.0.0.5 dev kube-ipvs0 proto kernel scope host src 10.0.0.5\n")
    assert [(r.type, r.dev) for r in typeless.local_routes or ()] == [("local", "kube-ipvs0")]
    brief = load("$ ip -br a\nlo UNKNOWN 127.0.0.1/8 ::1/128\n"
                 "kube-ipvs0 DOWN 10.96.0.1/32 203.0.113.7/32\n")
    assert ("kube-ipvs0", "203.0.113.7", False) in {
        (a.ifname, a.address, a.link_up) for a in brief.addresses or ()}


def test_unreadable_lines_are_named_and_the_rest_used() -> None:
    text = ("# ipset save\ncreate KUBE-LOAD-BALANCER hash:ip,port\n"
            "add KUBE-LOAD-BALANCER 203.0.113.7,tcp:80\n"
            "add KUBE-LOAD-BALANCER 203.0.113.999,tcp:80\n"
            "add KUBE-LOAD-BALANCER 203.0.113.8,tcp:443\n")
    snap = load(text)
    assert snap.ipset("KUBE-LOAD-BALANCER").members == ("203.0.113.7,tcp:80",
                                                       "203.0.113.8,tcp:443")
    assert any(u.reason.startswith("paste.txt:4: ") for u in snap.unknowns)


def test_both_answers_agree_decides_and_names_the_assumption() -> None:
    """IPVS mode, the LB IP's locality not given: bound -> served in the node; not bound
    -> KUBE-LOAD-BALANCER masquerades it (no -LOCAL entry). Either way no loop."""
    text = real("k8s-issue-89869-ipvs-lb-local-ipset").replace(
        "Members:\n172.23.133.0,tcp:80\n172.23.133.0,tcp:443", "Members:")
    text += ("\n# ipset list KUBE-LOAD-BALANCER\nName: KUBE-LOAD-BALANCER\nType: hash:ip,port\n"
             "Members:\n172.23.133.0,tcp:80\n"
             "# iptables -t nat -S\n-A PREROUTING -j KUBE-SERVICES\n"
             "-A KUBE-SERVICES -m set --match-set KUBE-LOAD-BALANCER dst,dst -j "
             "KUBE-LOAD-BALANCER\n-A POSTROUTING -j KUBE-POSTROUTING\n"
             "-A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE\n"
             "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n"
             "$ ip addr\n2: eth0: <BROADCAST,UP> mtu 1500\n"
             "    inet 10.0.0.10/24 scope global eth0\n"
             "3: cni0: <BROADCAST,UP> mtu 1500\n    inet 10.244.1.1/24 scope global cni0\n")
    snap = load(text)
    # ip addr without kube-ipvs0 says the LB IP is not local: decided, masqueraded
    v = diagnose(snap, "n").to_dict("all")
    assert {f["id"] for f in v["findings"]} == {"pod-to-lb-masqueraded"}
    # without ip addr (the pod CIDR given as with --pod-cidr): both answers agree (served
    # locally, or masqueraded): still decided
    v = diagnose(replace(snap, addresses=None, given={"pod_cidr": "10.244.1.0/24"}),
                 "n").to_dict("all")
    assert v["context"]["given_by_user"] == {"pod_cidr": "10.244.1.0/24"}
    (f,) = v["findings"]
    assert f["id"] in ("pod-to-lb-captured", "pod-to-lb-masqueraded")
    assert any("either way" in e and "ip addr show kube-ipvs0" in e for e in f["evidence"])


def test_answers_differ_is_undetermined_naming_the_fact() -> None:
    """The same node with the LB IP in KUBE-LOAD-BALANCER-LOCAL (RETURN: no masquerade):
    bound -> served here, not bound -> leaves with the pod's address. Undecided."""
    text = real("k8s-issue-89869-ipvs-lb-local-ipset")
    text += ("\n# ipset list KUBE-LOAD-BALANCER\nName: KUBE-LOAD-BALANCER\nType: hash:ip,port\n"
             "Members:\n172.23.133.0,tcp:80\n"
             "# iptables -t nat -S\n-A PREROUTING -j KUBE-SERVICES\n"
             "-A KUBE-SERVICES -m set --match-set KUBE-LOAD-BALANCER dst,dst -j "
             "KUBE-LOAD-BALANCER\n-A KUBE-SERVICES ! -s 10.244.0.0/16 -m set --match-set "
             "KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ\n")
    v = diagnose(load(text), "n").to_dict("all")
    und = [f for f in v["findings"] if f["id"] == "pod-to-lb-undetermined" and f["port"] == 80]
    assert und and "ip addr show kube-ipvs0" in und[0]["summary"]
    assert v["status"] == "unknown"
    assert v["context"]["pod_network"] == "10.244.0.0/16"  # named by the rule itself


def test_from_stdin_and_a_fifo_in_the_directory(tmp_path: Path) -> None:
    paste = real("k8s-issue-79783-tke-ipvs-lb-ip-on-kube-ipvs0")
    r = subprocess.run([sys.executable, "-m", "agent", "check", "--from", "-", "--json",
                        "--mode", "ipvs"], input=paste, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert '"given_by_user": {\n      "mode": "ipvs"' in r.stdout
    # a FIFO nobody writes to must not hang the reader (it is skipped and named)
    (tmp_path / "paste.txt").write_text(paste)
    os.mkfifo(tmp_path / "fifo")
    done = threading.Event()
    result: list[NodeSnapshot] = []
    t = threading.Thread(target=lambda: (result.append(load_bundle(tmp_path)), done.set()),
                         daemon=True)
    t.start()
    assert done.wait(10), "reading a directory with a FIFO hung"
    assert any(u.source == "fifo" and "not a regular file" in u.reason
               for u in result[0].unknowns)


def test_pod_network_from_the_main_tables_cni_route() -> None:
    """No addresses, no Node: the bridge CNI's connected route in `ip route` names this
    node's pod subnet and the bridge pods enter through (the route's shape as flannel and
    bridge CNIs install it; the LB rule is kube-proxy's, constructed)."""
    snap = load("$ ip route\n"
                "default via 10.0.0.1 dev eth0 proto dhcp src 10.0.0.10 metric 100\n"
                "10.244.1.0/24 dev cni0 proto kernel scope link src 10.244.1.1\n"
                "$ iptables -t nat -S KUBE-SERVICES\n"
                '-A KUBE-SERVICES -d 203.0.113.7/32 -p tcp -m comment --comment "a/b:http '
                'loadbalancer IP" -m tcp --dport 80 -j KUBE-EXT-X\n')
    v = diagnose(snap, "n").to_dict("all")
    assert v["context"]["pod_network"] == "10.244.1.0/24"
    assert v["context"]["pod_interface"] == "cni0"
    assert v["context"]["pod_ip"] == "10.244.1.2"  # not the bridge's own 10.244.1.1
    # KUBE-EXT-X is not in the excerpt: undecided, naming the command, never healthy
    (f,) = [f for f in v["findings"] if f["lb_ip"] == "203.0.113.7"]
    assert f["id"] == "pod-to-lb-undetermined" and "iptables -t nat -S KUBE-EXT-X" in f["summary"]


def test_a_named_symlink_is_read_but_devices_and_fifos_are_refused(tmp_path: Path) -> None:
    paste = tmp_path / "paste.txt"
    paste.write_text(real("k8s-issue-79783-tke-ipvs-lb-ip-on-kube-ipvs0"))
    (tmp_path / "link.txt").symlink_to(paste)
    assert load_bundle(tmp_path / "link.txt").local_routes is not None
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    for name in ("zero", "fifo"):
        try:
            load_bundle(tmp_path / name)
        except InputError as e:
            assert "not a regular file" in str(e)
        else:
            raise AssertionError(f"{name} was read")
    # inside a directory, a symlink is never followed (its target's content could leak)
    d = tmp_path / "d"
    d.mkdir()
    (d / "passwd").symlink_to("/etc/passwd")
    (d / "paste.txt").write_text(paste.read_text())
    snap = load_bundle(d)
    assert any(u.source == "passwd" and "not a regular file" in u.reason for u in snap.unknowns)


def test_bare_commands_split_and_an_unseen_endpoint_chain_is_kube_proxys() -> None:
    """Commands pasted without their prompt start a section; an excerpt whose walk reaches
    a KUBE-SVC chain it does not show is decided as kube-proxy writes that chain (a DNAT
    to an endpoint: served in the cluster), and the assumption is named. Constructed in
    the shape of a walkthrough's `egrep CHAIN /tmp/iptables` blocks."""
    snap = load("egrep '203.0.113.7' /tmp/iptables\n"
                '-A KUBE-SERVICES -d 203.0.113.7/32 -p tcp -m comment --comment "default/web '
                'loadbalancer IP" -m tcp --dport 80 -j KUBE-EXT-2CMXP7HKUVJN7L6M\n'
                "egrep 'KUBE-EXT-2CMXP7HKUVJN7L6M' /tmp/iptables\n"
                '-A KUBE-EXT-2CMXP7HKUVJN7L6M -s 10.244.0.0/16 -m comment --comment "pod '
                'traffic for default/web external destinations" -j KUBE-SVC-2CMXP7HKUVJN7L6M\n'
                "-A KUBE-EXT-2CMXP7HKUVJN7L6M -j KUBE-SVL-2CMXP7HKUVJN7L6M\n")
    assert not [u for u in snap.unknowns if "egrep" in u.reason]
    v = diagnose(snap, "n").to_dict("all")
    (f,) = v["findings"]
    assert f["id"] == "pod-to-lb-captured" and v["status"] == "healthy"
    assert any("KUBE-SVC-2CMXP7HKUVJN7L6M: assumed to DNAT" in e for e in f["evidence"])


def test_alias_prompt_and_rows_without_their_header_take_the_commands_chain() -> None:
    # `$ ipt KUBE-SERVICES` is the author's alias for `iptables -t nat -nvL CHAIN`; the
    # rows under it have no Chain or column header and '...' elisions around them
    text = real("tkng-kind-metallb-iptables-nvL-alias-ipt-kube-fw")
    secs = split_sections(text, "paste.txt")
    assert [s.command for s in secs if s.command] == [
        "kubectl get svc web", "ipt KUBE-SERVICES", "ipt KUBE-FW-LOLE4ISW44XBNF3G",
        "ipt KUBE-SVC-LOLE4ISW44XBNF3G"]
    snap = load(text)
    nat = snap.netfilter.table("nat") if snap.netfilter else None
    assert nat is not None
    lb = [r.text for r in nat.chain("KUBE-SERVICES").rules if "loadbalancer IP" in r.text]
    assert lb and "-d 198.51.100.0" in lb[0] and lb[0].endswith("-j KUBE-FW-LOLE4ISW44XBNF3G")
    assert not [u for u in snap.unknowns if "paste.txt:" in u.reason]  # '...' is no problem


def test_a_listing_without_its_command_keeps_each_chain_in_one_table() -> None:
    # the IPVS-mode KUBE-SERVICES of the same page, pasted without the prompt: its ACCEPT
    # rows belong with the rest of the chain (nat), not to filter by their target
    text = real("tkng-kind-metallb-ipvs-nvL-alias-ipset-ipvsadm")
    start = text.index("Chain KUBE-SERVICES")
    ipvs_chain = text[start:text.index("\n\n", start)] + "\n"  # without its prompt
    snap = load(ipvs_chain)
    assert snap.netfilter is not None
    nat = snap.netfilter.table("nat")
    assert nat is not None and len(nat.chain("KUBE-SERVICES").rules) == 5
    assert snap.netfilter.table("filter") is None
    assert any("placed by their chains and targets (5 to nat)" in u.reason
               for u in snap.unknowns)


def test_kubectl_before_1_5_prints_no_type_column() -> None:
    text = real("praqma-gke-1.2-svc-no-type-column-iptables-save-lb")
    snap = load(text)
    lbs = {s.name: [i.ip for i in s.lb_ingress] for s in snap.services or ()}
    assert lbs["nginx"] == ["146.148.10.228"] and lbs["kubernetes"] == []


def test_a_bare_trailing_prompt_ends_the_paste_quietly() -> None:
    text = real("k8s-issue-79783-tke-ipvs-lb-ip-on-kube-ipvs0") + "[root@VM_0_13_centos ~]# \n"
    snap = load(text)
    assert not [u for u in snap.unknowns if "paste.txt:" in u.reason]


def test_a_readers_bug_costs_its_section_not_the_verdict(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from agent.bundle import load as load_mod

    def broken(s, ev):  # type: ignore[no-untyped-def]
        raise KeyError("TYPE")

    monkeypatch.setitem(load_mod._READERS, fmt.SVC_TABLE, broken)
    snap = load(real("praqma-gke-1.2-svc-no-type-column-iptables-save-lb"))
    assert snap.netfilter is not None  # the other sections were read
    assert any("internal error KeyError" in u.reason for u in snap.unknowns)
    v = diagnose(snap, "n").to_dict("all")  # a verdict all the same, from the rules
    assert {"146.148.10.228", "130.211.80.214"} <= {r["ip"] for r in v["lb_ips"]}


def test_an_address_on_kube_ipvs0_in_the_nodes_subnet_is_an_lb_ip() -> None:
    # constructed: the kube-ipvs0 listing of the blog post in SOURCES (ipvs section of
    # "kube-proxy iptables 模式解析") with the node's eth0 line its ipvsadm output implies
    # (NodePort virtual server 10.12.32.121:30470); 10.12.32.160 is MetalLB-like, private
    text = ("2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP group "
            "default qlen 1000\n") + """    inet 10.12.32.121/24 brd 10.12.32.255 scope global eth0
       valid_lft forever preferred_lft forever
20: kube-ipvs0: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN group default
    link/ether b6:f2:fa:28:da:1c brd ff:ff:ff:ff:ff:ff
    inet 10.96.0.1/32 scope global kube-ipvs0
       valid_lft forever preferred_lft forever
    inet 10.106.147.222/32 scope global kube-ipvs0
       valid_lft forever preferred_lft forever
    inet 10.12.32.160/32 scope global kube-ipvs0
       valid_lft forever preferred_lft forever
"""
    v = diagnose(load(text), "n").to_dict("all")
    assert {r["ip"] for r in v["lb_ips"]} == {"10.12.32.160"}  # ClusterIPs stay out
    assert ("lb-ip-local", "10.12.32.160") in {(f["id"], f["lb_ip"]) for f in v["findings"]}


def test_a_rules_only_nodeport_walk_stands_in_for_the_nodes_address() -> None:
    from agent.diagnose import prepare
    from agent.diagnose.iptables_backend import iptables_paths

    snap = load(real("k8s-1.26era-iptables-overall-multiple-services", "iptables-save.txt"))
    v = diagnose(snap, "n").to_dict("all")
    etp = [f for f in v["findings"] if f["id"] == "etp-local-no-local-endpoint"]
    assert {f["lb_ip"] for f in etp} == {"1.2.3.4", "192.168.99.22"}
    # kube-proxy's own "has no local endpoints" rule states it; the NodePort walk the LB's
    # traffic takes agrees, with a stand-in for the node's address the dump lacks
    prep = prepare(snap)
    target = next(t for t in prep.all_targets if t.ip == "1.2.3.4")
    served = iptables_paths(prep.facts).outside_to_lb(target)
    ev = " ".join(served.evidence)
    assert served.served is False
    assert "stands for it" in ev and "has no local endpoints" in ev and "--dport 3001" in ev


CONSTRUCTED = Path(__file__).parent / "data" / "constructed"  # see its README


def _verdict_of(case: str) -> dict:  # type: ignore[type-arg]
    return diagnose(load_bundle(CONSTRUCTED / case), "n").to_dict("all")


def _ids(v: dict) -> set[tuple[str, str | None]]:  # type: ignore[type-arg]
    return {(f["id"], f["lb_ip"]) for f in v["findings"]}


def test_xlb_without_a_pod_rule_marks_for_drop_and_the_pod_leaves_unmasqueraded() -> None:
    v = _verdict_of("full-xlb-mark-drop-no-cluster-cidr")
    assert ("pod-to-lb-not-masqueraded", "203.0.113.50") in _ids(v)


def test_an_unseen_fw_or_xlb_chain_is_never_taken_as_captured() -> None:
    # the same node as above, only KUBE-SERVICES pasted: KUBE-FW may end in a loop
    v = _verdict_of("excerpt-fw-chain-unseen-no-cluster-cidr")
    assert v["status"] != "healthy"
    assert ("pod-to-lb-undetermined", "203.0.113.50") in _ids(v)
    undecided = next(f for f in v["findings"] if f["id"] == "pod-to-lb-undetermined")
    assert "iptables -t nat -S KUBE-FW-AAAAAAAAAAAAAAAA" in undecided["summary"]


def test_a_built_in_chain_an_excerpt_does_not_show_decides_no_loop() -> None:
    # nat POSTROUTING is not in the excerpt: a CNI's masquerade there is unseen
    v = _verdict_of("excerpt-postrouting-unseen")
    assert not [f for f in v["findings"] if f["id"] == "pod-to-lb-not-masqueraded"]
    assert v["status"] != "healthy"


def test_nodeport_addresses_do_not_fake_a_missing_local_endpoint() -> None:
    v = _verdict_of("etp-local-endpoint-nodeport-addresses")
    assert not [f for f in v["findings"] if f["id"] == "etp-local-no-local-endpoint"]


def test_internal_traffic_policy_local_is_not_external() -> None:
    v = _verdict_of("itp-local-filter-rule")
    assert not [f for f in v["findings"] if f["id"] == "etp-local-no-local-endpoint"]


def test_kube_proxys_own_words_settle_its_mode_and_pod_cidr() -> None:
    # kube-proxy's startup log as `kubectl logs` prints it (the FLAG lines are verbatim
    # from kubernetes/kubernetes#92033; the "Using ipvs Proxier." line is kube-proxy's own
    # message of that era), a `ps` line, and its ConfigMap
    log = ('I0610 22:03:26.540358       1 flags.go:33] FLAG: --proxy-mode=""\n'
           'I0610 22:03:26.540375       1 flags.go:33] FLAG: --proxy-port-range=""\n'
           "I0610 22:03:26.673838       1 server_others.go:259] Using ipvs Proxier.\n")
    snap = load(log + real("k8s-issue-79783-tke-ipvs-lb-ip-on-kube-ipvs0"))
    assert snap.kube_proxy is not None and snap.kube_proxy.mode == "ipvs"
    ps = ("root      2317  2290  0 Nov24 ?        00:41:10 /usr/local/bin/kube-proxy "
          "--proxy-mode=iptables --cluster-cidr=10.244.0.0/16 --hostname-override=n1\n")
    v = diagnose(load(ps + real("k8s-1.26era-iptables-lb-etp-local-ext-svl",
                                "iptables-save.txt")), "n").to_dict("all")
    assert v["kube_proxy_mode"] == "iptables" and "as the input shows it" in \
        v["context"]["kube_proxy_mode_from"]
    cm = """apiVersion: v1
data:
  config.conf: |-
    apiVersion: kubeproxy.config.k8s.io/v1alpha1
    clusterCIDR: 10.244.0.0/16
    kind: KubeProxyConfiguration
    mode: "ipvs"
kind: ConfigMap
metadata:
  name: kube-proxy
  namespace: kube-system
"""
    snap = load(cm, "kube-proxy-cm.yaml")
    assert snap.kube_proxy is not None
    assert (snap.kube_proxy.mode, snap.kube_proxy.cluster_cidr) == ("ipvs", "10.244.0.0/16")


def test_a_bad_cluster_cidr_in_kube_proxys_flags_is_named_not_used() -> None:
    ps = ("root      2317  2290  0 Nov24 ?        00:41:10 /usr/local/bin/kube-proxy "
          "--proxy-mode=iptables --cluster-cidr=garbage/99\n")
    snap = load(ps + real("k8s-1.26era-iptables-lb-etp-local-ext-svl", "iptables-save.txt"))
    assert snap.kube_proxy is not None and snap.kube_proxy.cluster_cidr is None
    assert any("'garbage/99' is not a CIDR" in u.reason for u in snap.unknowns)
