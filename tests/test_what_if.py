"""`check --what-if MODE` (issue 34, item 1): the verdict this node would have with
kube-proxy in nftables, iptables or IPVS mode, predicted from its Services and the
endpoints its rules serve today, and what changes per LB address.

The prediction is checked against the real thing, in every direction the lab builds. For
every IPv4 cluster of the mode contract (tests/test_mode_contract.py: eTP Cluster/Local,
local endpoint or not, two ports, loadBalancerSourceRanges, ipMode: Proxy, no
--cluster-cidr, three Services), predicted from its bundle in one mode (iptables; IPVS,
upstream's and TKE's; nftables, since kubernetes#132456 and before it), the findings per
LB address:port and the status equal the diagnosis of its bundle in the target mode
(nftables; iptables; IPVS, upstream's: the mode kube-proxy would run). Each target is
also checked from a bundle and from a paste through the CLI (the report and the JSON
name it), and refused where kube-proxy already runs in it.

Live, lab nodes in network namespaces (the kernel holds the rules the agent reads): a
node in iptables mode is predicted in nftables and IPVS mode; switched to nftables mode
the way kube-proxy switches (its iptables chains gone, its nftables table loaded into
the kernel, as its proxier writes it), it is diagnosed again and predicted in iptables
and IPVS mode. Each prediction equals the diagnosis of a lab node of the target mode
built for the same cluster: the iptables node itself before the switch; an IPVS-mode lab
node, whose virtual servers this kernel (no IP_VS) cannot hold: the lab's stand-in
(lab/node.py) serves them and the agent is given them as the `ipvsadm -S -n` text the
stand-in stands for, in a bundle saved from that node. A prediction made on an IPVS node
needs IPVS itself (the endpoints are its real servers): that runs in the VM
(tests/guest), where IPVS is real, to nftables and to iptables mode.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.cli import schema_text
from agent.diagnose import diagnose
from agent.diagnose.model import Verdict
from agent.predict.iptables import iptables_rules
from agent.predict.ipvs import ipvs_mode as agent_ipvs_mode
from agent.predict.what_if import _without_kube_proxy_tables, kube_proxy_chain, what_if
from agent.snapshot import NftDump
from lab.kube_proxy_rules.common import service_port
from lab.kube_proxy_rules.iptables import iptables_mode
from lab.kube_proxy_rules.ipvs import ipvs_mode
from lab.kube_proxy_rules.nftables import nftables_mode
from lab.kube_proxy_rules.realistic import nft_list_ruleset
from lab.netns import Netns
from lab.node import build_lab
from lab.scenarios import SCENARIOS, Scenario
from tests import test_mode_contract as contract
from tests.nodestate import capture

SCHEMA = json.loads(schema_text())


def ids(v: Verdict | dict[str, Any]) -> dict[tuple[str, int | None], set[str]]:
    findings = v["findings"] if isinstance(v, dict) else [f.to_dict() for f in v.findings]
    out: dict[tuple[str, int | None], set[str]] = {}
    for f in findings:
        if f["lb_ip"]:
            out.setdefault((f["lb_ip"], f["port"]), set()).add(f["id"])
    return out


def snapshot(files: dict[str, str], name: str) -> Any:
    return load_texts([(k, t, name_format(k)) for k, t in files.items()],
                      origin=f"bundle:{name}")


V4 = [c for c in contract.CLUSTERS if c.family == 4]
# (the contract's mode a bundle is written in, the target): every direction but a mode
# to itself; a target is the upstream proxier of that mode (IPVS binding the LB IPs)
DIRECTIONS = [(s, t) for t in ("nftables", "iptables", "ipvs")
              for s in ("iptables", "ipvs", "ipvs-tke", "nftables", "nftables-131765")
              if s.split("-")[0] != t]


@pytest.mark.parametrize(("source", "target"), DIRECTIONS,
                         ids=[f"{s}-to-{t}" for s, t in DIRECTIONS])
@pytest.mark.parametrize("cluster", V4, ids=[c.id for c in V4])
def test_the_prediction_equals_the_target_mode_node(cluster: contract.Cluster, source: str,
                                                    target: str) -> None:
    real = diagnose(snapshot(contract.bundle(cluster, target), target), "n")
    w = what_if(snapshot(contract.bundle(cluster, source), source), "n", target)
    assert w.target == target and w.predicted.kube_proxy_mode == target
    assert ids(w.predicted) == ids(real)
    assert w.predicted.status == real.status
    # and what changes is today's against it, address by address
    today = ids(w.today)
    for c in w.changes:
        assert set(c.today) == today.get((c.lb_ip, c.port), set())
        assert set(c.predicted) == ids(real).get((c.lb_ip, c.port), set())
    assert len(w.changes) + w.same == len(today.keys() | ids(real).keys())


def test_a_node_of_many_services_in_every_direction() -> None:
    """The benchmark's synthetic node (120 LoadBalancer Services, 2-3 endpoints each at
    random, some here, every second one eTP=Local), written in each mode: each prediction
    equals the diagnosis of the node written in the target mode."""
    from lab.kube_proxy_rules.synthetic import synthetic

    modes = ("iptables", "ipvs", "nftables")
    bundles = {m: synthetic(120, m, seed=4) for m in modes}
    real = {m: diagnose(snapshot(bundles[m], m), "n") for m in modes}
    for source in modes:
        for target in (m for m in modes if m != source):
            w = what_if(snapshot(bundles[source], source), "n", target)
            assert ids(w.predicted) == ids(real[target]), (source, target)
            assert w.predicted.status == real[target].status, (source, target)
            assert len(ids(w.predicted)) == 120


def test_the_lab_writes_with_the_agents_generators() -> None:
    """One implementation: the lab's iptables and IPVS states are the agent's own
    (agent.predict.iptables, agent.predict.ipvs) for the lab's service ports."""
    cluster = next(c for c in V4 if c.id == "v4-three-services")
    svcs = contract.services(cluster)
    ports = [service_port(s) for s in svcs]
    cidr, node = contract.CLUSTER_CIDR[4], contract.NODE_IP[4]
    assert iptables_mode(svcs, cluster_cidr=cidr, node_ip=node) == iptables_rules(
        ports, cluster_cidr=cidr, node_ip=node)
    assert ipvs_mode(svcs, bind_lb_ip=True, cluster_cidr=cidr, node_ip=node) == \
        agent_ipvs_mode(ports, bind_lb_ip=True, cluster_cidr=cidr, node_ips=(node,))


def test_the_report_and_the_json(tmp_path: Path) -> None:
    cluster = next(c for c in V4 if c.id == "v4-three-services")
    for name, text in contract.bundle(cluster, "ipvs-tke").items():
        (tmp_path / name).write_text(text)
    r = _agent("check", "--from", str(tmp_path), "--what-if", "nftables")
    # TKE's IPVS mode lets two of the pods' connections leave unmasqueraded (they loop);
    # nftables mode captures them all: the predicted verdict is healthy, its exit code 0
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "today (ipvs):  AT RISK" in out and "predicted (nftables):  HEALTHY" in out
    assert "10.0.32.11:80/TCP  (shop/loc)" in out
    assert "vanish: pod-to-lb-not-masqueraded" in out and "appear: pod-to-lb-captured" in out
    assert "never on 127.0.0.1" in out
    j = _agent("check", "--from", str(tmp_path), "--what-if", "nftables", "--json")
    doc = json.loads(j.stdout)
    assert doc["what_if"] == "nftables"
    jsonschema.validate(doc["today"], SCHEMA)
    jsonschema.validate(doc["predicted"], SCHEMA)
    assert doc["predicted"]["kube_proxy_mode"] == "nftables"
    assert doc["predicted"]["context"]["kube_proxy_mode_from"].startswith("predicted")
    assert {(c["lb_ip"], c["port"]) for c in doc["changes"]} == {
        ("10.0.32.10", 80), ("10.0.32.10", 443), ("10.0.32.11", 80), ("10.0.32.12", 80)}


# (source mode of the bundle or paste, target, what the report says of the target mode)
CLI_CASES = [
    ("nftables", "iptables", "127.0.0.1 included"),
    ("iptables", "ipvs", "binds every ClusterIP, external IP and LoadBalancer IP"),
    ("ipvs-tke", "nftables", "never on 127.0.0.1"),
    ("ipvs", "iptables", "switched cleanly"),
]


def _checked(doc: dict[str, Any], cluster: contract.Cluster, target: str) -> None:
    """The JSON form of a prediction against the target-mode bundle's diagnosis."""
    assert doc["what_if"] == target
    jsonschema.validate(doc["today"], SCHEMA)
    jsonschema.validate(doc["predicted"], SCHEMA)
    assert doc["predicted"]["kube_proxy_mode"] == target
    assert doc["predicted"]["context"]["kube_proxy_mode_from"] == \
        f"predicted: kube-proxy in {target} mode"
    real = diagnose(snapshot(contract.bundle(cluster, target), target), "n")
    assert ids(doc["predicted"]) == ids(real)
    assert doc["predicted"]["status"] == real.status


@pytest.mark.parametrize(("source", "target", "said"), CLI_CASES,
                         ids=[f"{s}-to-{t}" for s, t, _ in CLI_CASES])
def test_a_bundle_predicted_in_each_mode(source: str, target: str, said: str,
                                         tmp_path: Path) -> None:
    cluster = next(c for c in V4 if c.id == "v4-three-services")
    for name, text in contract.bundle(cluster, source).items():
        (tmp_path / name).write_text(text)
    r = _agent("check", "--from", str(tmp_path), "--what-if", target)
    assert r.returncode in (0, 1), r.stderr
    mode = "ipvs" if source.startswith("ipvs") else source
    assert f"WHAT IF kube-proxy ran in {target} mode here" in r.stdout
    assert f"today ({mode}):" in r.stdout and f"predicted ({target}):" in r.stdout
    assert said in " ".join(r.stdout.split()), r.stdout
    j = _agent("check", "--from", str(tmp_path), "--what-if", target, "--json", "--all")
    assert j.returncode == r.returncode, j.stderr
    doc = json.loads(j.stdout)
    _checked(doc, cluster, target)
    assert doc["today"]["kube_proxy_mode"] == mode
    if target == "ipvs":
        # upstream IPVS binds the LB IPs: lb-ip-local appears for each, and the pods'
        # traffic stays captured
        appear = {c["lb_ip"] for c in doc["changes"] if "lb-ip-local" in c["appear"]}
        assert appear == {"10.0.32.10", "10.0.32.11", "10.0.32.12"}
        assert any("strictARP" in n for n in doc["notes"])


# the commands whose outputs a bundle file holds, as a paste prompts them
_COMMANDS = {"iptables-save.txt": "iptables-save", "ipset.txt": "ipset save",
             "ipvsadm.txt": "ipvsadm -S -n", "addr.txt": "ip addr",
             "route-local.txt": "ip route show table local", "sysctl.txt": "sysctl -a",
             "services.json": "kubectl get svc -A -o json",
             "node.json": f"kubectl get node {contract.NODE} -o json",
             "nft-transaction.txt": "nft list ruleset"}


def paste_of(files: dict[str, str]) -> str:
    """A bundle's outputs pasted one after another after their prompts (nftables mode's
    transaction as `nft list ruleset` prints it)."""
    out = []
    for name, text in files.items():
        text = nft_list_ruleset(text) if name == "nft-transaction.txt" else text
        out.append(f"$ {_COMMANDS[name]}\n" + (text if text.endswith("\n") else text + "\n"))
    return "".join(out)


@pytest.mark.parametrize(("source", "target", "said"), CLI_CASES[:3],
                         ids=[f"{s}-to-{t}" for s, t, _ in CLI_CASES[:3]])
def test_a_paste_predicted_in_each_mode(source: str, target: str, said: str,
                                        tmp_path: Path) -> None:
    cluster = next(c for c in V4 if c.id == "v4-three-services")
    paste = tmp_path / "ticket.txt"
    paste.write_text(paste_of(contract.bundle(cluster, source)))
    r = _agent("check", "--from", str(paste), "--what-if", target)
    assert r.returncode in (0, 1), r.stderr
    assert f"predicted ({target}):" in r.stdout and said in " ".join(r.stdout.split())
    j = _agent("check", "--from", str(paste), "--what-if", target, "--json", "--all")
    doc = json.loads(j.stdout)
    _checked(doc, cluster, target)
    # the paste has no `ipvsadm` output: the IPVS prediction writes the virtual servers,
    # which are not unknown any more
    if target == "ipvs":
        assert not [u for u in doc["predicted"]["unknowns"] if u["source"] == "ipvs"]


def test_what_it_cannot_predict_is_said(tmp_path: Path) -> None:
    cluster = next(c for c in V4 if c.id == "v4-cluster-local-ep")
    files = contract.bundle(cluster, "ipvs")
    del files["services.json"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for target in ("nftables", "iptables"):
        r = _agent("check", "--from", str(tmp_path), "--what-if", target)
        assert r.returncode == 65, r.stdout
        assert f"--what-if {target}: the Service objects are not in the input" in r.stderr
    # a mode to itself: refused, saying why (exit 65, as for nftables)
    for mode, bundle_mode in (("nftables", "nftables"), ("iptables", "iptables"),
                              ("ipvs", "ipvs"), ("ipvs", "ipvs-tke")):
        d = tmp_path / bundle_mode
        d.mkdir(exist_ok=True)
        for name, text in contract.bundle(cluster, bundle_mode).items():
            (d / name).write_text(text)
        r = _agent("check", "--from", str(d), "--what-if", mode)
        assert r.returncode == 65, (mode, r.stdout)
        assert f"--what-if {mode}: kube-proxy already runs in {mode} mode here" in r.stderr
    r = _agent("check", "--from", str(tmp_path / "nftables"), "--what-if", "userspace")
    assert r.returncode == 64 and "invalid choice" in r.stderr


def test_check_help_lists_the_three_targets() -> None:
    r = _agent("check", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "--what-if MODE" in text
    assert "MODE (nftables, iptables or ipvs)" in text


def test_kube_proxys_nft_tables_go_and_the_others_stay() -> None:
    """What kube-proxy's cleanup of nftables mode deletes, from a listing, a transaction
    and `nft -j` JSON: its `ip`/`ip6 kube-proxy` tables, nothing else."""
    other = "table inet cni {\n\tchain postrouting {\n\t\ttype nat hook postrouting " \
            "priority srcnat; policy accept;\n\t\tmasquerade\n\t}\n}\n"
    cluster = next(c for c in V4 if c.id == "v4-cluster-local-ep")
    tx = contract.bundle(cluster, "nftables")["nft-transaction.txt"]
    listed = nft_list_ruleset(tx)
    got = _without_kube_proxy_tables(NftDump("text", listed + other, "x"))
    # (the lines taken out stay as empty ones: the others keep their line numbers)
    assert got is not None and got.text == "\n" * listed.count("\n") + other
    assert _without_kube_proxy_tables(NftDump("text", listed, "x")) is None
    assert _without_kube_proxy_tables(NftDump("text", tx, "x")) is None
    doc = {"nftables": [{"metainfo": {"version": "1.0.9"}},
                        {"table": {"family": "ip", "name": "kube-proxy", "handle": 1}},
                        {"chain": {"family": "ip", "table": "kube-proxy", "name": "x"}},
                        {"table": {"family": "inet", "name": "cni", "handle": 2}}]}
    got = _without_kube_proxy_tables(NftDump("json", json.dumps(doc), "x"))
    assert got is not None and json.loads(got.text)["nftables"] == [
        doc["nftables"][0], doc["nftables"][3]]


def _agent(*args: str) -> Any:
    import subprocess

    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, timeout=120)


# -- live: lab nodes predicted, switched, and built in the target mode ---------------------


def switch_to_nftables(ns: Netns, scenario: Any, backend: str) -> None:
    """What kube-proxy does when it starts in nftables mode: the other modes' rules go (its
    iptables chains and the rules that jump to them; IPVS's virtual servers, kube-ipvs0
    and the ipsets, where IPVS is real), and its table comes."""
    if scenario.mode == "ipvs":
        ns.run("ipvsadm", "-C")
        ns.run("ip", "link", "del", "kube-ipvs0")
    save = ns.run(f"iptables-{backend}-save").stdout
    kept = []
    for line in save.splitlines():
        words = line.split()
        if line.startswith(":") and kube_proxy_chain(line[1:].split()[0]):
            continue
        if line.startswith("-A") and (kube_proxy_chain(words[1]) or any(
                w in ("-j", "-g") and kube_proxy_chain(n) for w, n in pairwise(words))):
            continue
        kept.append(line)
    ns.run(f"iptables-{backend}-restore", input="\n".join(kept) + "\n")
    for name in ns.run("ipset", "list", "-n").stdout.split():
        if name.startswith("KUBE-"):
            ns.run("ipset", "destroy", name)
    text = nftables_mode(scenario.services, cluster_cidr=scenario.cluster_cidr,
                         node_ip=scenario.node_ip, service_cidr="10.96.0.0/12")
    ns.run("nft", "-f", "-", input=text)


def predict_live(ns: Netns, kube: str, target: str) -> dict[str, Any]:
    """`check --what-if TARGET --json` on the live node, which it must not change."""
    before = capture(ns)
    r = ns.run(sys.executable, "-m", "agent", "check", "--what-if", target, "--json", "--all",
               "--node-name", "n", "--kube-json", kube, check=False, timeout=120)
    assert capture(ns) == before  # (a prediction changes nothing either)
    assert r.returncode in (0, 1, 3), r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    assert doc["what_if"] == target and doc["predicted"]["kube_proxy_mode"] == target
    return doc


def check_live(ns: Netns, kube: str) -> dict[str, Any]:
    r = ns.run(sys.executable, "-m", "agent", "check", "--json", "--all", "--node-name", "n",
               "--kube-json", kube, check=False, timeout=120)
    assert r.returncode in (0, 1, 3), r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def ipvs_node_verdict(scenario: Scenario, backend: str, tmp_path: Path) -> dict[str, Any]:
    """The diagnosis of an IPVS-mode lab node of ``scenario``'s cluster (upstream's: the LB
    IPs bound): its kernel state saved as a bundle, with the virtual servers the lab's
    stand-in serves (this kernel has no IP_VS) as `ipvsadm -S -n` gives them."""
    ipvs = dataclasses.replace(scenario, name=f"{scenario.name}-ipvs", mode="ipvs",
                               bind_lb_ip=True)
    state = ipvs.ipvs_state()
    assert state is not None
    bundle = tmp_path / "ipvs-node"
    with build_lab(ipvs, backend) as lab:
        r = lab.node.run(sys.executable, "-m", "agent", "bundle", str(bundle), "--no-kube-api",
                         check=False, timeout=120)
        assert r.returncode == 0, r.stderr
        for f in ("services.json", "node.json", "ingresses.json"):
            shutil.copy(lab.kube_dir / f, bundle / f)
    (bundle / "ipvsadm.txt").write_text(state.ipvsadm_save)
    r = _agent("check", "--from", str(bundle), "--json", "--all", "--node-name", "n")
    assert r.returncode in (0, 1, 3), r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    assert doc["kube_proxy_mode"] == "ipvs", doc["context"]
    assert "lb-ip-local" in {f["id"] for f in doc["findings"]}
    return doc


def same(predicted: dict[str, Any], real: dict[str, Any], direction: str) -> None:
    assert ids(predicted) == ids(real), direction
    assert predicted["status"] == real["status"], direction


@pytest.mark.netns
@pytest.mark.parametrize("name", ["iptables-new-etp-local", "ip-masq-agent-ingress"])
def test_live_a_node_predicted_then_switched(name: str) -> None:
    scenario = SCENARIOS[name]
    with build_lab(scenario, "nft") as lab:
        kube = str(lab.kube_dir)
        predicted = predict_live(lab.node, kube, "nftables")["predicted"]
        switch_to_nftables(lab.node, scenario, "nft")
        switched = check_live(lab.node, kube)
        assert switched["kube_proxy_mode"] == "nftables", switched["context"]
        same(predicted, switched, "iptables -> nftables")


@pytest.mark.netns
@pytest.mark.parametrize("name", ["iptables-new-etp-local", "ip-masq-agent-ingress"])
def test_live_every_direction_the_lab_builds_here(name: str, tmp_path: Path) -> None:
    """iptables -> IPVS, nftables -> iptables and nftables -> IPVS on lab nodes: each
    prediction equals the diagnosis of the target mode's lab node of the same cluster."""
    scenario = SCENARIOS[name]
    ipvs_real = ipvs_node_verdict(scenario, "nft", tmp_path)
    with build_lab(scenario, "nft") as lab:
        kube = str(lab.kube_dir)
        iptables_real = check_live(lab.node, kube)
        assert iptables_real["kube_proxy_mode"] == "iptables"
        same(predict_live(lab.node, kube, "ipvs")["predicted"], ipvs_real, "iptables -> ipvs")
        switch_to_nftables(lab.node, scenario, "nft")
        assert check_live(lab.node, kube)["kube_proxy_mode"] == "nftables"
        doc = predict_live(lab.node, kube, "iptables")
        assert doc["today"]["kube_proxy_mode"] == "nftables"
        # the switched node kept ip-masq-agent's chain (not kube-proxy's): so does the
        # prediction, which walks it as the iptables node did
        same(doc["predicted"], iptables_real, "nftables -> iptables")
        same(predict_live(lab.node, kube, "ipvs")["predicted"], ipvs_real, "nftables -> ipvs")


@pytest.mark.netns
def test_an_nftables_node_read_from_the_kernels_json() -> None:
    """nftables mode's endpoints read from kube-proxy's table as a kernel dumps it (`nft
    -j list ruleset`, the table loaded by `nft -f` from the proxier's transaction): the
    predictions in iptables and IPVS mode equal those modes' diagnoses, nothing unread."""
    from lab.netns import netns

    cluster = next(c for c in V4 if c.id == "v4-three-services")
    files = contract.bundle(cluster, "nftables")
    with netns("lbt") as ns:
        ns.run("nft", "-f", "-", input=files.pop("nft-transaction.txt"))
        files["nft-kube-proxy.json"] = ns.run("nft", "-j", "list", "ruleset").stdout
    snap = snapshot(files, "nft-json")
    for target in ("iptables", "ipvs"):
        w = what_if(snap, "n", target)
        real = diagnose(snapshot(contract.bundle(cluster, target), target), "n")
        assert ids(w.predicted) == ids(real) and w.predicted.status == real.status, target
        assert not [n for n in w.notes if n.startswith("not read")], w.notes


def test_many_changes_are_counted_by_kind(tmp_path: Path) -> None:
    # a node of 40 Services (constructed: the lab's synthetic IPVS bundle): more changes
    # than the report lists one by one, so they are counted by what changes
    from lab.kube_proxy_rules.synthetic import synthetic

    for name, text in synthetic(40, "ipvs", seed=5).items():
        (tmp_path / name).write_text(text)
    r = _agent("check", "--from", str(tmp_path), "--what-if", "nftables")
    assert r.returncode in (0, 1, 3), r.stderr
    counted = [ln for ln in r.stdout.splitlines() if " x vanish: " in ln]
    assert counted, r.stdout
    total = int(r.stdout.split("Changes (")[1].split(" ")[0])
    assert sum(int(ln.split(" x ")[0]) for ln in counted) == total
    assert "more (--verbose lists them" in r.stdout



def test_a_prediction_keeps_what_other_components_wrote_beside_kube_proxy() -> None:
    """Constructed from a real shape (kube-router's network-policy sets are KUBE-SRC-*/
    KUBE-DST-*; the portmap CNI's hostport chains jump to KUBE-MARK-MASQ): only kube-proxy's
    own sets, chains and its jumps from the built-in chains go; another component's rule
    that jumps to KUBE-MARK-MASQ stays, and the chain with it, flushed, as kube-proxy's
    cleanup leaves a chain another rule refers to."""
    from agent.predict.what_if import _without_kube_proxy_state
    from agent.snapshot import IpSet

    dump = ("*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n"
            ":KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-HP-ABC - [0:0]\n"
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" "
            "-j KUBE-SERVICES\n"
            "-A PREROUTING -m addrtype --dst-type LOCAL -j KUBE-HP-ABC\n"
            "-A KUBE-HP-ABC -s 10.0.0.5/32 -j KUBE-MARK-MASQ\n"
            "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n"
            "COMMIT\n*filter\n:FORWARD ACCEPT [0:0]\n:KUBE-NWPLCY-ABC - [0:0]\n"
            "-A FORWARD -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n"
            "-A KUBE-NWPLCY-ABC -m set --match-set KUBE-SRC-XYZ src "
            "-m set --match-set KUBE-DST-QRS dst -j MARK --set-xmark 0x10000/0x10000\n"
            "COMMIT\n")
    snap = load_texts([("iptables-save.txt", dump, name_format("iptables-save.txt"))],
                      origin="bundle:t")
    snap = dataclasses.replace(snap, ipsets=(
        IpSet("KUBE-SRC-XYZ", "hash:ip", ("10.0.0.9",)),
        IpSet("KUBE-CLUSTER-IP", "hash:ip,port", ("10.96.0.1,tcp:443",))))
    out = _without_kube_proxy_state(snap, "nftables")
    assert [s.name for s in out.ipsets or ()] == ["KUBE-SRC-XYZ"]
    nf = out.netfilter
    assert nf is not None
    nat, filt = nf.table("nat"), nf.table("filter")
    assert nat is not None and filt is not None
    assert [c.name for c in nat.chains if c.name.startswith("KUBE-")] == \
        ["KUBE-HP-ABC", "KUBE-MARK-MASQ"]
    assert list(nat.chain("KUBE-MARK-MASQ").rules.texts) == []  # type: ignore[union-attr]
    assert list(nat.chain("PREROUTING").rules.texts) == [  # type: ignore[union-attr]
        "-A PREROUTING -m addrtype --dst-type LOCAL -j KUBE-HP-ABC"]
    assert list(filt.chain("FORWARD").rules.texts) == []  # type: ignore[union-attr]
    assert len(filt.chain("KUBE-NWPLCY-ABC").rules.texts) == 1  # type: ignore[union-attr]
