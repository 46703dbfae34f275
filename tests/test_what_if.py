"""`check --what-if nftables` (issue 34, item 1): the verdict this node would have with
kube-proxy in nftables mode, predicted from its Services and the endpoints its rules
serve today, and what changes per LB address.

The prediction is checked against the real thing: for every IPv4 cluster of the mode
contract (tests/test_mode_contract.py: eTP Cluster/Local, local endpoint or not, two ports,
loadBalancerSourceRanges, ipMode: Proxy, no --cluster-cidr, three Services), predicted
from its iptables-mode, IPVS-mode and TKE IPVS-mode bundles, the findings per LB
address:port equal the diagnosis of its nftables-mode bundle. Live, a lab node in
iptables mode is predicted, then switched to nftables mode the way kube-proxy switches
(its iptables chains gone, its nftables table loaded into the kernel, as its proxier
writes it), and diagnosed again: the prediction equals what the switched node shows. The
IPVS side of that runs in the VM (tests/guest), where IPVS is real.
"""

from __future__ import annotations

import json
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
from agent.predict.what_if import kube_proxy_chain, what_if
from lab.kube_proxy_rules.nftables import nftables_mode
from lab.netns import Netns
from lab.node import build_lab
from lab.scenarios import SCENARIOS
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


@pytest.mark.parametrize("source", ["iptables", "ipvs", "ipvs-tke"])
@pytest.mark.parametrize("cluster", V4, ids=[c.id for c in V4])
def test_the_prediction_equals_the_nftables_node(cluster: contract.Cluster,
                                                 source: str) -> None:
    real = diagnose(snapshot(contract.bundle(cluster, "nftables"), "nft"), "n")
    w = what_if(snapshot(contract.bundle(cluster, source), source), "n", "nftables")
    assert w.predicted.kube_proxy_mode == "nftables"
    assert ids(w.predicted) == ids(real)
    assert w.predicted.status == real.status
    # and what changes is today's against it, address by address
    today = ids(w.today)
    for c in w.changes:
        assert set(c.today) == today.get((c.lb_ip, c.port), set())
        assert set(c.predicted) == ids(real).get((c.lb_ip, c.port), set())
    assert len(w.changes) + w.same == len(today.keys() | ids(real).keys())


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


def test_what_it_cannot_predict_is_said(tmp_path: Path) -> None:
    cluster = next(c for c in V4 if c.id == "v4-cluster-local-ep")
    files = contract.bundle(cluster, "ipvs")
    del files["services.json"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    r = _agent("check", "--from", str(tmp_path), "--what-if", "nftables")
    assert r.returncode == 65, r.stdout
    assert "--what-if nftables: the Service objects are not in the input" in r.stderr
    nft = tmp_path / "nft"
    nft.mkdir()
    for name, text in contract.bundle(cluster, "nftables").items():
        (nft / name).write_text(text)
    r = _agent("check", "--from", str(nft), "--what-if", "nftables")
    assert r.returncode == 65 and "already runs in nftables mode" in r.stderr
    r = _agent("check", "--from", str(nft), "--what-if", "ipvs")
    assert r.returncode == 64 and "invalid choice" in r.stderr


def _agent(*args: str) -> Any:
    import subprocess

    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, timeout=120)


# -- live: a lab node predicted, then switched ---------------------------------------------


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


@pytest.mark.netns
@pytest.mark.parametrize("name", ["iptables-new-etp-local", "ip-masq-agent-ingress"])
def test_live_a_node_predicted_then_switched(name: str) -> None:
    scenario = SCENARIOS[name]
    with build_lab(scenario, "nft") as lab:
        kube = str(lab.kube_dir)
        before = capture(lab.node)
        r = lab.node.run(sys.executable, "-m", "agent", "check", "--what-if", "nftables",
                         "--json", "--all", "--node-name", "n", "--kube-json", kube,
                         check=False, timeout=120)
        assert capture(lab.node) == before  # (a prediction changes nothing either)
        assert r.returncode in (0, 1, 3), r.stderr
        predicted = json.loads(r.stdout)["predicted"]
        switch_to_nftables(lab.node, scenario, "nft")
        r = lab.node.run(sys.executable, "-m", "agent", "check", "--json", "--all",
                         "--node-name", "n", "--kube-json", kube, check=False, timeout=120)
        switched = json.loads(r.stdout)
        assert switched["kube_proxy_mode"] == "nftables", switched["context"]
        assert ids(predicted) == ids(switched)
        assert predicted["status"] == switched["status"]


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
