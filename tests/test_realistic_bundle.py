"""The real-shaped bundles of the benchmark (issue 31, lab/kube_proxy_rules/realistic.py):
read and diagnosed like a node's own bundle, in each kube-proxy mode, with and without
services.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.bundle import load_bundle
from agent.diagnose import diagnose
from lab.kube_proxy_rules.realistic import (
    MODES,
    kubectl_json,
    realistic,
    realistic_services,
    service_object,
    services_json_text,
)

N = 50
SERVICES = realistic_services(N, seed=7)
LB_IPS = {s.first.lb_ip for s in SERVICES}
# what a bundle that reads cleanly may still say it lacks: ipvsadm.txt where IPVS is not
# loaded (`bundle` skips it), kube-proxy's flags (no bundle file holds them)
ALLOWED_UNKNOWNS = {"ipvs", "kube-proxy"}


def _verdict(tmp_path: Path, mode: str, with_services: bool):  # type: ignore[no-untyped-def]
    d = tmp_path / f"{mode}-{with_services}"
    d.mkdir()
    for name, text in realistic(N, mode, seed=7, with_services=with_services,
                                services=SERVICES).items():
        (d / name).write_text(text)
    snap = load_bundle(d)
    return snap, diagnose(snap, "n")


@pytest.mark.parametrize("mode", MODES)
def test_read_and_diagnosed_with_and_without_services(tmp_path: Path, mode: str) -> None:
    found = {}
    for with_services in (True, False):
        snap, verdict = _verdict(tmp_path, mode, with_services)
        assert verdict.kube_proxy_mode == mode
        # every file read: no line or file refused, nothing the reader could not use
        assert {u.source for u in verdict.unknowns} <= ALLOWED_UNKNOWNS, verdict.unknowns
        if mode != "ipvs":
            assert [u.reason for u in verdict.unknowns if u.source == "ipvs"] == [
                "not given (`ipvsadm -Ln` output would show it)"]
        assert (snap.services is not None) == with_services
        found[with_services] = {r.ip for r in verdict.lb_ips}
    assert found[True] == found[False] == LB_IPS


def test_ipvs_half_the_vips_bound() -> None:
    bundle = realistic(N, "ipvs", seed=7, services=SERVICES)
    addrs = {a["local"] for link in json.loads(bundle["addr.txt"])
             if link["ifname"] == "kube-ipvs0" for a in link["addr_info"]}
    bound = {s.first.lb_ip for s in SERVICES if s.bound}
    assert 0 < len(bound) < N
    assert LB_IPS & addrs == bound
    assert {s.first.cluster_ip for s in SERVICES} <= addrs
    local = {line.split()[1] for line in bundle["route-local.txt"].splitlines()
             if line.endswith("dev kube-ipvs0 proto kernel scope host src "
                              f"{line.split()[1]} ")}
    assert local == addrs
    ipvs_ips = {line.split()[2] for line in bundle["ipset.txt"].splitlines()
                if line.startswith("add KUBE-IPVS-IPS ")}
    assert ipvs_ips == addrs
    assert bundle["ipvsadm.txt"].startswith("IP Virtual Server version")  # -Ln, not -S


def test_services_json_as_kubectl_prints_it() -> None:
    services = realistic_services(400, seed=3)
    text = services_json_text(services)
    doc = {"apiVersion": "v1", "items": [service_object(s) for s in services],
           "kind": "List", "metadata": {"resourceVersion": ""}}
    assert text == kubectl_json(doc)  # 4-space indent, keys sorted
    assert 1500 <= len(text) / len(services) <= 1900  # ~1.7 KB a Service
    items = json.loads(text)["items"]
    assert {i["spec"]["type"] for i in items} == {"LoadBalancer"}
    local = sum(i["spec"]["externalTrafficPolicy"] == "Local" for i in items) / len(items)
    two_ports = sum(len(i["spec"]["ports"]) == 2 for i in items) / len(items)
    vip = sum("ipMode" in i["status"]["loadBalancer"]["ingress"][0] for i in items) / len(items)
    assert 0.2 < local < 0.4 and 0.05 < two_ports < 0.15 and 0.35 < vip < 0.65
    assert all("healthCheckNodePort" in i["spec"] for i in items
               if i["spec"]["externalTrafficPolicy"] == "Local")
    assert all(2 <= len(s.first.local_endpoints) + len(s.first.remote_endpoints) <= 5
               for s in services)


def test_deterministic() -> None:
    assert realistic(20, "nftables", seed=1) == realistic(20, "nftables", seed=1)
    assert realistic(20, "ipvs", seed=1) != realistic(20, "ipvs", seed=2)
