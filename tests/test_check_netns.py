"""`check` on real node shapes built in network namespaces, for both iptables backends:
the expected findings come out, the live verdict equals `check --from` on the bundle
saved from the same namespace, and the agent changes nothing on the node."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from agent.cli import schema_text
from lab.netns import Netns
from lab.node import build_lab
from lab.scenarios import SCENARIOS
from tests.nodestate import capture

pytestmark = pytest.mark.netns

BACKENDS = ("legacy", "nft")
SCHEMA = json.loads(schema_text())
LOOP_IDS = {"lb-ip-local", "pod-to-lb-not-masqueraded"}


def agent_in(ns: Netns, *args: str) -> subprocess.CompletedProcess[str]:
    return ns.run(sys.executable, "-m", "agent", *args, check=False, timeout=120)


def agent_here(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, timeout=120)


def ids_by_ip(verdict: dict[str, Any]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in verdict["findings"]:
        if f["lb_ip"]:
            out.setdefault(f["lb_ip"], set()).add(f["id"])
    return out


_SOURCE = re.compile(r"\((?:iptables-save\.txt|iptables-(?:legacy|nft)-save):(\d+)\)")


def comparable(verdict: dict[str, Any]) -> dict[str, Any]:
    """The verdict minus what legitimately differs between a live run and a bundle:
    the time, the origin, and the name (not the line) of the file a rule came from."""
    v = json.loads(_SOURCE.sub(r"(rules:\1)", json.dumps(verdict)))
    v.pop("time")
    v["context"].pop("origin")
    v["context"].pop("iptables_backend")
    # unknowns name different sources (a live probe vs a missing bundle file)
    v["unknowns"] = sorted(u["source"] for u in v["unknowns"]
                           if u["source"] not in ("ipvs", "ipvsadm.txt", "kube-proxy",
                                                  "kube-proxy metrics", "kubernetes API",
                                                  "services.json",
                                                  "node.json", "ingresses.json"))
    return v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_live_check_finds_what_the_scenario_expects(name: str, backend: str,
                                                    tmp_path: Path) -> None:
    scenario = SCENARIOS[name]
    with build_lab(scenario, backend) as lab:
        kube = str(lab.kube_dir)
        live = agent_in(lab.node, "check", "--json", "--all", "--node-name", "lab-node",
                        "--kube-json", kube)
        assert live.returncode in (0, 1), live.stderr
        verdict = json.loads(live.stdout)
        jsonschema.validate(verdict, SCHEMA)
        got = ids_by_ip(verdict)
        for ip, expected in scenario.expect.items():
            assert expected <= got.get(ip, set()), (ip, got, verdict)
        at_risk = any(LOOP_IDS & ids for ids in scenario.expect.values())
        assert verdict["status"] == ("at-risk" if at_risk else "healthy"), verdict
        assert live.returncode == (1 if at_risk else 0)
        assert verdict["kube_proxy_mode"] == scenario.mode
        assert verdict["context"]["iptables_backend"] == backend

        # the same verdict from a bundle saved in the same namespace
        bundle = tmp_path / "bundle"
        saved = agent_in(lab.node, "bundle", str(bundle), "--no-kube-api")
        assert saved.returncode == 0, saved.stderr
        for f in ("services.json", "node.json", "ingresses.json"):
            if (lab.kube_dir / f).exists():
                shutil.copy(lab.kube_dir / f, bundle / f)
        offline = agent_here("check", "--from", str(bundle), "--json", "--all",
                             "--node-name", "lab-node")
        assert offline.returncode == live.returncode, offline.stderr
        assert comparable(json.loads(offline.stdout)) == comparable(verdict)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bytes_that_are_not_utf8_on_the_node_cost_nothing(backend: str,
                                                          tmp_path: Path) -> None:
    """A rule's comment, a set's comment and an interface name in Latin-1 (the kernel
    keeps the bytes given; any tool on the node may write them). Before: the dump's
    strict decoding failed and the node's every rule was lost ("nat rules: probe
    failed: 'utf-8' codec can't decode byte 0xe9"), the interface's name (bytes from
    netlink) made `snapshot` an internal error, and the bundle lost sysctl.txt."""
    scenario = SCENARIOS["iptables-new-etp-local"]
    with build_lab(scenario, backend) as lab:
        lab.node.sh(f"""c=$(printf 'caf\\351')
            iptables-{backend} -t mangle -A OUTPUT -m comment --comment "$c" -j RETURN
            ipset create lbt-latin1 hash:ip comment
            ipset add lbt-latin1 192.0.2.1 comment "$c"
            ip link add "br$c" type bridge
            ip addr add 198.51.100.1/32 dev "br$c"
            ip link set "br$c" up""")
        assert b"caf\xe9" in subprocess.run(
            ["ip", "netns", "exec", lab.node.name, f"iptables-{backend}-save"],
            capture_output=True, check=True).stdout
        kube = str(lab.kube_dir)
        live = agent_in(lab.node, "check", "--json", "--all", "--node-name", "lab-node",
                        "--kube-json", kube)
        assert live.returncode in (0, 1), live.stderr
        verdict = json.loads(live.stdout)
        assert not [u for u in verdict["unknowns"] if "failed" in u["reason"]], verdict
        assert verdict["kube_proxy_mode"] == scenario.mode
        got = ids_by_ip(verdict)
        for ip, expected in scenario.expect.items():
            assert expected <= got.get(ip, set()), (ip, got)
        bundle = tmp_path / "bundle"
        assert agent_in(lab.node, "bundle", str(bundle), "--no-kube-api").returncode == 0
        assert "caf\ufffd" in (bundle / "iptables-save.txt").read_text()
        assert "caf\ufffd" in (bundle / "ipset.txt").read_text()
        assert "net.ipv4.conf.brcaf\ufffd.rp_filter" in (bundle / "sysctl.txt").read_text()
        snap = agent_in(lab.node, "snapshot", "--no-kube-api")
        assert snap.returncode == 0, snap.stderr
        assert '"ifname": "brcaf\\ufffd"' in snap.stdout
        for f in ("services.json", "node.json", "ingresses.json"):
            if (lab.kube_dir / f).exists():
                shutil.copy(lab.kube_dir / f, bundle / f)
        offline = agent_here("check", "--from", str(bundle), "--json", "--all", "--node-name",
                             "lab-node")
        assert offline.returncode == live.returncode, offline.stderr
        assert "not UTF-8" not in offline.stderr and "bad JSON" not in offline.stderr
        assert comparable(json.loads(offline.stdout)) == comparable(verdict)


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_bundle_snapshot_change_nothing_on_the_node(backend: str, tmp_path: Path) -> None:
    scenario = SCENARIOS["tke-ipvs-etp-local"]
    with build_lab(scenario, backend) as lab:
        before = capture(lab.node)
        assert agent_in(lab.node, "check", "--no-kube-api").returncode in (0, 1)
        assert agent_in(lab.node, "check", "--json", "--all", "--no-kube-api").returncode in (0, 1)
        assert agent_in(lab.node, "bundle", str(tmp_path / "b"), "--no-kube-api").returncode == 0
        snap = agent_in(lab.node, "snapshot", "--no-kube-api")
        assert snap.returncode == 0, snap.stderr
        after = capture(lab.node)
        for key in before:
            assert before[key] == after[key], f"{key} changed"
        if backend == "nft":
            # no legacy table existed, and reading must not have created one
            assert after["ip_tables_names"].strip() == ""


def test_snapshot_round_trip_gives_the_same_verdict(tmp_path: Path) -> None:
    scenario = SCENARIOS["ipvs-lb-bound"]
    with build_lab(scenario, "nft") as lab:
        snap = agent_in(lab.node, "snapshot", "--no-kube-api", "--kube-json",
                        str(lab.kube_dir), "--node-name", "lab-node")
        assert snap.returncode == 0, snap.stderr
        (tmp_path / "node.json").write_text(snap.stdout)
        live = agent_in(lab.node, "check", "--json", "--all", "--kube-json", str(lab.kube_dir),
                        "--node-name", "lab-node")
    again = agent_here("check", "--snapshot", str(tmp_path / "node.json"), "--json", "--all")
    assert again.returncode == live.returncode
    a, b = json.loads(again.stdout), json.loads(live.stdout)
    for v in (a, b):
        v.pop("time")
        v["context"].pop("origin")
    assert a == b


def test_unreadable_probes_become_unknowns_not_tracebacks() -> None:
    """No iptables binaries on PATH: the nat probe says why, the verdict says it cannot
    decide (not "healthy"), and everything else is still read."""
    scenario = SCENARIOS["tke-ipvs-etp-local"]
    with build_lab(scenario, "nft") as lab:
        r = lab.node.run("env", "PATH=/nonexistent", sys.executable, "-m", "agent", "check",
                         "--json", "--all", "--no-kube-api", "--kube-json", str(lab.kube_dir),
                         check=False)
    assert "Traceback" not in r.stderr
    assert r.returncode == 3, r.stderr  # unknown: nothing at risk found, nothing ruled out
    v = json.loads(r.stdout)
    reasons = {u["source"]: u["reason"] for u in v["unknowns"]}
    assert "iptables" in reasons["nat rules"]
    assert {f["id"] for f in v["findings"]} == {"pod-to-lb-undetermined"}
    assert v["context"]["uplink"] == "eth0"  # addresses still came through netlink


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_load_balancers_walk_meets_a_forward_drop_as_the_kernel_does(
        backend: str) -> None:
    """demo/web, externalTrafficPolicy=Local, two endpoints on this node, 172.16.1.10 and
    .11 (the client pod takes both addresses and serves 8080). The load balancer's SYN to
    NodeIP:30080, DNATed to either, crosses filter FORWARD, whose walk is shared among
    endpoints no rule there tells apart (TableWalker.walk). With a FORWARD rule dropping
    another address, the kernel answers every connection and the agent says nothing of
    the policy; dropping one endpoint (either: a walk shared between the two would say
    both dropped for one of them), the kernel still answers some (kube-proxy's random
    choice) and the agent says the NodePort is served; dropping both, every connection
    times out and the agent says the health checks fail here. The checks change nothing
    on the node."""
    import dataclasses

    from lab.clb import connect, serve
    from lab.scenarios import KUBERNETES, LB_IP, web

    two = dataclasses.replace(web("Local"), local_endpoints=("172.16.1.10", "172.16.1.11"))
    scenario = dataclasses.replace(SCENARIOS["iptables-new-no-cluster-cidr"],
                                   services=(KUBERNETES, two))
    with build_lab(scenario, backend) as lab:
        kube = str(lab.kube_dir)
        for ep in two.local_endpoints:
            lab.client_pod.run("ip", "addr", "add", f"{ep}/24", "dev", "eth0")
        with serve(lab.client_pod, [8080]):
            seen = {}
            for dropped in (("172.16.1.99",), ("172.16.1.10",), ("172.16.1.11",),
                            ("172.16.1.10", "172.16.1.11")):
                for addr in dropped:
                    lab.node.run(f"iptables-{backend}", "-A", "FORWARD", "-d", addr,
                                 "-j", "DROP")
                # (16 connections: each endpoint is chosen by one in two)
                reached = {connect(lab.vpc, scenario.node_ip, 30080, timeout=0.5).outcome
                           for _ in range(16)}
                before = capture(lab.node)
                live = agent_in(lab.node, "check", "--json", "--all", "--node-name",
                                "lab-node", "--kube-json", kube)
                assert capture(lab.node) == before
                assert live.returncode in (0, 1), live.stderr
                seen[dropped] = (reached, ids_by_ip(json.loads(live.stdout))[LB_IP])
                for addr in dropped:
                    lab.node.run(f"iptables-{backend}", "-D", "FORWARD", "-d", addr,
                                 "-j", "DROP")
    etp = "etp-local-no-local-endpoint"
    other, both = ("172.16.1.99",), ("172.16.1.10", "172.16.1.11")
    assert seen[other][0] == {"connected"} and etp not in seen[other][1], seen
    for one in (("172.16.1.10",), ("172.16.1.11",)):
        assert seen[one][0] == {"connected", "timeout"} and etp not in seen[one][1], seen
    assert seen[both][0] == {"timeout"} and etp in seen[both][1], seen
