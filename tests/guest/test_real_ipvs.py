"""Tests that need a kernel with IP_VS and dummy: they run inside the VM that
tests/test_vm_ipvs.py boots on a stock Debian kernel (tests/conftest.py leaves them out
anywhere else, and the host test fails if the VM cannot run them)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from lab import netns as _netns
from lab.clb import Cluster, pod_connect, sysctls
from lab.netns import Netns
from lab.node import IPVS_STANDIN_TABLE, REAL, ipvs_kind
from lab.scenarios import LB_IP
from tests.test_check_netns import agent_here, agent_in

pytestmark = pytest.mark.netns

# ipvsadm -Ln rows: "TCP  10.96.0.1:443 rr", "FWM  7 rr", "  -> 10.0.0.2:6443  Masq  1 ..."
_VIRTUAL = re.compile(r"^(TCP|UDP|SCTP)\s+\[?([^\]\s]+?)\]?:(\d+)\s+(\S+)")
_FWM = re.compile(r"^FWM\s+(\d+)\s+(\S+)")
_REAL = re.compile(r"^\s+->\s+\[?([^\]\s]+?)\]?:(\d+)\s+(\w+)\s+(\d+)\s")


def ipvsadm_listing(ns: Netns) -> list[tuple[Any, ...]]:
    """``ipvsadm -Ln`` read independently of the agent's parser: one tuple per virtual
    server, (protocol, address, port, scheduler, sorted real servers)."""
    out: list[tuple[Any, ...]] = []
    for line in ns.run("ipvsadm", "-Ln").stdout.splitlines():
        if m := _VIRTUAL.match(line):
            out.append((m[1], m[2], int(m[3]), m[4], []))
        elif m := _FWM.match(line):
            out.append(("FWM", m[1], 0, m[2], []))
        elif m := _REAL.match(line):
            out[-1][4].append((m[1], int(m[2]), m[3], int(m[4])))
    return sorted((p, a, port, s, tuple(sorted(r))) for p, a, port, s, r in out)


def probe_listing(ns: Netns) -> list[tuple[Any, ...]]:
    """The live IPVS probe (pyroute2) as the agent's snapshot records it."""
    r = agent_in(ns, "snapshot", "--no-kube-api")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert not [u for u in snap["unknowns"] if u["source"] == "ipvs"], snap["unknowns"]
    return sorted((v["protocol"], v["address"], v["port"], v["scheduler"],
                   tuple(sorted((x["address"], x["port"], x["forward"], x["weight"])
                                for x in v["real_servers"])))
                  for v in snap["ipvs"])


_IPVSADM_SETUP = """\
-A -t 10.96.0.1:443 -s rr
-a -t 10.96.0.1:443 -r 10.0.0.2:6443 -m -w 1
-A -t 10.0.1.10:80 -s wrr
-a -t 10.0.1.10:80 -r 172.16.1.10:8080 -m -w 3
-a -t 10.0.1.10:80 -r 172.16.2.10:8080 -g -w 2
-a -t 10.0.1.10:80 -r 172.16.3.10:8080 -i -w 1
-A -u 10.96.0.10:53 -s rr
-a -u 10.96.0.10:53 -r 172.16.1.20:53 -m -w 1
-A -t 10.0.0.10:30080 -s rr
-A -t [fd00::10]:80 -s rr
-a -t [fd00::10]:80 -r [fd00:1::10]:8080 -m -w 1
-A -f 7 -s rr
-a -f 7 -r 172.16.1.30:0 -g -w 1
"""


def test_the_ipvs_probe_lists_what_ipvsadm_lists() -> None:
    """Every virtual server and real server, with forwarding method, weight and
    scheduler; TCP, UDP, IPv6, a firewall-mark service and one without real servers."""
    with _netns.netns("lbi") as ns:
        ns.run("ipvsadm", "-R", input=_IPVSADM_SETUP)
        expected = ipvsadm_listing(ns)
        assert len(expected) == 6 and {"Masq", "Route", "Tunnel"} <= {
            r[2] for v in expected for r in v[4]}
        assert probe_listing(ns) == expected


_FWD = r"""
import json
from pyroute2 import IPVS
from pyroute2.ipvs import IPVSDest, IPVSService
rows = []
with IPVS() as s:
    for sm in s.service("dump"):
        for dm in s.dest("dump", service=IPVSService.from_message(sm)):
            raw = dict(dm.get_attr("IPVS_CMD_ATTR_DEST")["attrs"])
            rows.append([raw["IPVS_DEST_ATTR_ADDR"], raw["IPVS_DEST_ATTR_FWD_METHOD"] & 7,
                         IPVSDest.from_message(dm).get("fwd_method")])
print(json.dumps(rows))
"""


def test_forwarding_method_comes_from_the_raw_attribute() -> None:
    """pyroute2's parsed key keeps IPVSDest's default fwd_method (3, Route) whatever the
    kernel said; the raw IPVS_DEST_ATTR_FWD_METHOD is what ipvsadm shows."""
    names = {0: "Masq", 2: "Tunnel", 3: "Route"}
    with _netns.netns("lbi") as ns:
        ns.run("ipvsadm", "-R", input="-A -t 10.0.1.10:80 -s rr\n"
               "-a -t 10.0.1.10:80 -r 172.16.1.11:80 -m\n"
               "-a -t 10.0.1.10:80 -r 172.16.1.12:80 -g\n"  # Route and Tunnel keep the port,
               "-a -t 10.0.1.10:80 -r 172.16.1.13:80 -i\n")  # so one per address
        shown = {r[0]: r[2] for v in ipvsadm_listing(ns) for r in v[4]}
        rows = json.loads(ns.run(sys.executable, "-c", _FWD).stdout)
    raw = {addr: names[fwd] for addr, fwd, _ in rows}
    assert raw == shown == {"172.16.1.11": "Masq", "172.16.1.12": "Route",
                            "172.16.1.13": "Tunnel"}
    parsed = {addr: names.get(p, p) for addr, _, p in rows}
    print("pyroute2 parsed fwd_method:", parsed)  # shown with -rA in the VM's output
    assert parsed != shown  # the reason the probe reads the raw attribute


def test_the_lab_runs_on_real_ipvs(etp_local: Cluster, tmp_path: Path) -> None:
    """The TKE variant on real IPVS: kube-ipvs0 is a dummy device, the virtual servers
    are kube-proxy's, no stand-in exists, and the pod's looping connection goes through
    the NodePort's real virtual server."""
    c = etp_local
    assert ipvs_kind() == REAL
    assert "dummy" in c.node.run("ip", "-d", "link", "show", "kube-ipvs0").stdout
    assert IPVS_STANDIN_TABLE not in c.node.run("nft", "list", "tables").stdout
    listing = ipvsadm_listing(c.node)
    assert ("TCP", LB_IP, 80, "rr", (("172.16.1.10", 8080, "Masq", 1),)) in listing
    assert LB_IP not in c.node.run("ip", "-4", "addr", "show", "kube-ipvs0").stdout

    def nodeport_conns() -> int:
        stats = c.node.run("ipvsadm", "-Ln", "--stats", "-t",
                           f"{c.scenario.node_ip}:30080").stdout
        row = next(line for line in stats.splitlines() if line.startswith("TCP"))
        return int(row.split()[2])  # Conns

    c.clb.use_real_server(c.scenario.node_ip)  # the CLB sends it back to this node
    before = nodeport_conns()
    with sysctls(c.node, {"net.ipv4.conf.all.rp_filter": 0, "net.ipv4.conf.eth0.rp_filter": 0}):
        pod_connect(c, LB_IP, 80)  # rp_filter 0: the SYN gets past routing to IPVS
    assert nodeport_conns() > before

    # a bundle saved here carries the real ipvsadm listing, and reads back the same
    bundle = tmp_path / "b"
    assert agent_in(c.node, "bundle", str(bundle), "--no-kube-api").returncode == 0
    saved = (bundle / "ipvsadm.txt").read_text()
    assert f"TCP  {c.scenario.node_ip}:30080 rr" in saved
    back = agent_here("snapshot", "--from", str(bundle))
    assert back.returncode == 0, back.stderr
    assert {(v["address"], v["port"]) for v in json.loads(back.stdout)["ipvs"]} == {
        (v[1], v[2]) for v in listing}


def test_ipvs_sources_that_disagree_on_real_ipvs() -> None:
    """Issue 33, item 3, with real virtual servers: a local endpoint taken out of
    KUBE-LOOP-BACK and an LB address's virtual server deleted (a kube-proxy sync that
    stopped half way) are found, and the agent changes nothing."""
    from agent.diagnose.rules.consistency import (
        LOOP_BACK_MISSING,
        SET_WITHOUT_VS,
        STALE_ADDRESS,
    )
    from lab.node import build_lab
    from lab.scenarios import SCENARIOS
    from tests.nodestate import capture

    def findings(ns: Netns, kube: str) -> list[dict[str, Any]]:
        r = agent_in(ns, "check", "--json", "--all", "--node-name", "n", "--kube-json", kube)
        assert r.returncode in (0, 1, 3), r.stderr
        return [f for f in json.loads(r.stdout)["findings"]
                if f["id"] in (LOOP_BACK_MISSING, SET_WITHOUT_VS, STALE_ADDRESS)]

    with build_lab(SCENARIOS["ipvs-lb-bound"], "legacy") as lab:
        assert ipvs_kind() == REAL
        kube = str(lab.kube_dir)
        assert findings(lab.node, kube) == []
        lab.node.run("ipset", "del", "KUBE-LOOP-BACK", "172.16.1.10,tcp:8080,172.16.1.10")
        lab.node.run("ipvsadm", "-D", "-t", "10.0.1.10:80")
        # a Service that went while kube-proxy was not syncing: its address stays bound
        lab.node.run("ip", "address", "add", "10.0.1.77/32", "dev", "kube-ipvs0")
        before = capture(lab.node)
        got = findings(lab.node, kube)
        assert capture(lab.node) == before
        by_id = {f["id"]: f for f in got}
        assert len(got) == 3, got
        assert by_id[STALE_ADDRESS]["lb_ip"] == "10.0.1.77"
        assert (by_id[SET_WITHOUT_VS]["lb_ip"], by_id[SET_WITHOUT_VS]["port"]) == \
            ("10.0.1.10", 80)
        loop = by_id[LOOP_BACK_MISSING]
        assert loop["summary"].startswith("Endpoint 172.16.1.10:8080 is on this node")
        assert "ipset KUBE-LOOP-BACK has no member 172.16.1.10,tcp:8080,172.16.1.10" in \
            loop["evidence"]


def test_what_if_nftables_on_real_ipvs() -> None:
    """Issue 34: an IPVS-mode node (TKE's, the LB address not bound: its pods' traffic
    loops today) predicted in nftables mode, then switched as kube-proxy switches: the
    prediction equals what the switched node shows."""
    from lab.node import build_lab
    from lab.scenarios import SCENARIOS
    from tests.test_what_if import ids, switch_to_nftables

    scenario = SCENARIOS["tke-ipvs-etp-local"]
    with build_lab(scenario, "legacy") as lab:
        assert ipvs_kind() == REAL
        kube = str(lab.kube_dir)
        r = agent_in(lab.node, "check", "--what-if", "nftables", "--json", "--all",
                     "--node-name", "n", "--kube-json", kube)
        assert r.returncode in (0, 1, 3), r.stderr
        doc = json.loads(r.stdout)
        assert doc["today"]["status"] == "at-risk"
        assert not [n for n in doc["notes"] if n.startswith("not read")], doc["notes"]
        switch_to_nftables(lab.node, scenario, "legacy")
        r = agent_in(lab.node, "check", "--json", "--all", "--node-name", "n",
                     "--kube-json", kube)
        switched = json.loads(r.stdout)
        assert switched["kube_proxy_mode"] == "nftables"
        assert ids(doc["predicted"]) == ids(switched)
        assert doc["predicted"]["status"] == switched["status"]


def test_localhost_node_port_hangs_and_is_named_on_real_ipvs() -> None:
    """kubernetes#90236 (its IPVS side, #96879): a virtual server on 127.0.0.1:NodePort (the
    lab Service's nodePort 30080), as kube-proxy wrote one before kubernetes#101023. The
    kernel decides: the node's own connect to it gets no answer (DNATed off lo: martian);
    the agent names that virtual server, and only it."""
    from lab.clb import TIMEOUT, connect
    from lab.node import build_lab
    from lab.scenarios import SCENARIOS

    def bug_findings(ns: Netns, kube: str) -> list[dict[str, Any]]:
        r = agent_in(ns, "check", "--json", "--all", "--node-name", "n", "--kube-json", kube)
        assert r.returncode in (0, 1, 3), r.stderr
        return [f for f in json.loads(r.stdout)["findings"]
                if (f.get("data") or {}).get("bug") == "kubernetes#90236"]

    with build_lab(SCENARIOS["ipvs-lb-bound"], "legacy") as lab:
        assert ipvs_kind() == REAL
        kube = str(lab.kube_dir)
        assert bug_findings(lab.node, kube) == []
        lab.node.run("ipvsadm", "-A", "-t", "127.0.0.1:30080", "-s", "rr")
        lab.node.run("ipvsadm", "-a", "-t", "127.0.0.1:30080", "-r", "172.16.1.10:8080", "-m")
        assert connect(lab.node, "127.0.0.1", 30080, timeout=2).outcome == TIMEOUT
        (f,) = bug_findings(lab.node, kube)
        assert (f["lb_ip"], f["port"]) == ("127.0.0.1", 30080)
        assert "IPVS virtual server TCP 127.0.0.1:30080 (1 real server)" in f["evidence"]


@pytest.mark.parametrize("name", ["tke-ipvs-etp-local", "ipvs-lb-bound"])
def test_what_if_iptables_on_real_ipvs(name: str) -> None:
    """Issue 34, IPVS -> iptables: an IPVS-mode node (its endpoints read from the real
    servers of its virtual servers) predicted in iptables mode equals the diagnosis of an
    iptables-mode lab node built for the same cluster; the prediction names the IPVS
    state kube-proxy itself leaves behind on such a switch."""
    import dataclasses

    from lab.node import build_lab
    from lab.scenarios import SCENARIOS
    from tests.test_what_if import ids

    scenario = SCENARIOS[name]
    with build_lab(scenario, "legacy") as lab:
        assert ipvs_kind() == REAL
        r = agent_in(lab.node, "check", "--what-if", "iptables", "--json", "--all",
                     "--node-name", "n", "--kube-json", str(lab.kube_dir))
        assert r.returncode in (0, 1, 3), r.stderr
        doc = json.loads(r.stdout)
    assert doc["today"]["kube_proxy_mode"] == "ipvs"
    assert doc["predicted"]["kube_proxy_mode"] == "iptables"
    assert not [n for n in doc["notes"] if n.startswith("not read")], doc["notes"]
    assert any("switched cleanly" in n for n in doc["notes"])
    iptables = dataclasses.replace(scenario, name=f"{name}-iptables", mode="iptables")
    with build_lab(iptables, "legacy") as lab:
        r = agent_in(lab.node, "check", "--json", "--all", "--node-name", "n",
                     "--kube-json", str(lab.kube_dir))
        real = json.loads(r.stdout)
    assert real["kube_proxy_mode"] == "iptables"
    assert ids(doc["predicted"]) == ids(real)
    assert doc["predicted"]["status"] == real["status"]
