"""The ipMode audit and the cloud's own remedy (issue 34, items 2 and 3).

The nodes are the mode contract's (tests/test_mode_contract.py: kube-proxy's own rule
shapes for one LoadBalancer Service, constructed); what each test adds to them is what
the providers' documentation names, quoted in agent/diagnose/data/load_balancers.json:
the PROXY protocol annotations (hcloud CCM's load balancer annotations, the DigitalOcean
CCM's annotations.md, cloud-provider-openstack's loadbalancer.openstack.org/proxy-protocol,
linode CCM's annotations.md, scaleway CCM's loadbalancer-annotations.md) and the Node's
spec.providerID forms (aws:///zone/id, gce://project/zone/name, hcloud://id).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from agent.diagnose.cloud import providers
from agent.diagnose.rules.ip_mode import IGNORED, NO_IP_MODE
from tests import test_mode_contract as contract

LOCAL_REMOTE = next(c for c in contract.CLUSTERS if c.id == "v4-local-remote-ep")
CLUSTER_LOCAL = next(c for c in contract.CLUSTERS if c.id == "v4-cluster-local-ep")


def verdict(files: dict[str, str]) -> dict[str, Any]:
    snap = load_texts([(k, t, name_format(k)) for k, t in files.items()], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


def with_service(files: dict[str, str], annotations: dict[str, str] | None = None,
                 ip_mode: str | None = None) -> dict[str, str]:
    doc = json.loads(files["services.json"])
    item = doc["items"][0]
    if annotations:
        item["metadata"]["annotations"] = annotations
    if ip_mode:
        for ing in item["status"]["loadBalancer"]["ingress"]:
            ing["ipMode"] = ip_mode
    return {**files, "services.json": json.dumps(doc)}


def with_provider_id(files: dict[str, str], provider_id: str) -> dict[str, str]:
    node = json.loads(files["node.json"])
    node["spec"]["providerID"] = provider_id
    return {**files, "node.json": json.dumps(node)}


def of(v: dict[str, Any], fid: str) -> list[dict[str, Any]]:
    return [f for f in v["findings"] if f["id"] == fid]


# (provider, the annotation its docs name, a value that turns it on)
PROXY_PROTOCOL = [
    ("hetzner", "load-balancer.hetzner.cloud/uses-proxyprotocol", "true"),
    ("digitalocean", "service.beta.kubernetes.io/do-loadbalancer-enable-proxy-protocol",
     "true"),
    ("openstack", "loadbalancer.openstack.org/proxy-protocol", "v2"),
    ("linode", "service.beta.kubernetes.io/linode-loadbalancer-default-proxy-protocol", "v2"),
    ("scaleway", "service.beta.kubernetes.io/scw-loadbalancer-proxy-protocol-v2", "*"),
]


@pytest.mark.parametrize("provider,key,value", PROXY_PROTOCOL,
                         ids=[p for p, _, _ in PROXY_PROTOCOL])
def test_proxy_protocol_without_ip_mode(provider: str, key: str, value: str) -> None:
    base = contract.bundle(CLUSTER_LOCAL, "iptables")
    v = verdict(with_service(base, {key: value}))
    (f,) = of(v, NO_IP_MODE)
    name = next(p.name for p in providers() if p.id == provider)
    assert f["lb_ip"] == contract.lb_ip(CLUSTER_LOCAL, 0) and f["port"] == 80
    assert f"the Service's annotation {key}: {value}" in f["evidence"]
    assert f["remedy"].startswith(name + ":")
    # the Service in Proxy mode, or the protocol off: nothing to say
    assert of(verdict(with_service(base, {key: value}, "Proxy")), NO_IP_MODE) == []
    off = "none" if provider == "linode" else "false"
    assert of(verdict(with_service(base, {key: off})), NO_IP_MODE) == []


def test_the_controller_release_that_sets_ip_mode_is_named() -> None:
    base = contract.bundle(CLUSTER_LOCAL, "iptables")
    (f,) = of(verdict(with_service(base, {"load-balancer.hetzner.cloud/uses-proxyprotocol":
                                          "true"})), NO_IP_MODE)
    assert "hcloud-cloud-controller-manager v1.21.0 and later" in f["remedy"]
    assert "hetznercloud/hcloud-cloud-controller-manager#783" in f["remedy"]


def test_ip_mode_proxy_ignored_by_the_datapath() -> None:
    # kube-proxy (an older one, or a datapath that ignores the field) wrote its VIP-mode
    # rules and bound the address on kube-ipvs0, while the Service says ipMode: Proxy
    base = contract.bundle(CLUSTER_LOCAL, "ipvs")
    v = verdict(with_service(base, ip_mode="Proxy"))
    (f,) = of(v, IGNORED)
    assert "binds the address" in f["summary"]
    assert any(e.startswith("routing: 10.0.32.10 is a local address here") for e in f["evidence"])
    assert "Cilium 1.18.1" in f["remedy"]
    # captured by iptables mode's rules (no address bound): still ignored
    v = verdict(with_service(contract.bundle(CLUSTER_LOCAL, "iptables"), ip_mode="Proxy"))
    (f,) = of(v, IGNORED)
    assert "captures pods' traffic" in f["summary"]
    # and honoured: kube-proxy writes no rule for the address (the contract's own case)
    honoured = next(c for c in contract.CLUSTERS if c.id == "v4-ip-mode-proxy-cluster-local-ep")
    assert of(verdict(contract.bundle(honoured, "ipvs")), IGNORED) == []
    assert of(verdict(contract.bundle(honoured, "iptables")), IGNORED) == []


@pytest.mark.parametrize("provider_id,words", [
    ("aws:///eu-west-1a/i-0a1b2c3d4e5f60718", "preserve_client_ip.enabled=false"),
    ("gce://my-project/europe-west1-b/gke-pool-1-abcd", "captures by design"),
    ("hcloud://4711", "hcloud-cloud-controller-manager v1.21.0"),
])
def test_the_clouds_own_remedy(provider_id: str, words: str) -> None:
    # TKE's IPVS mode, eTP=Local without a local endpoint: the pods' packet leaves
    # unmasqueraded (the loop); the remedy names the node's own cloud's knob
    base = contract.bundle(LOCAL_REMOTE, "ipvs-tke")
    v = verdict(with_provider_id(base, provider_id))
    (f,) = [f for f in v["findings"] if f["id"] == "pod-to-lb-not-masqueraded"]
    assert words in f["remedy"]
    assert f"the Node's spec.providerID {provider_id}" in f["remedy"]
    assert "svc.cluster.local" in f["remedy"]  # the generic way stays said
    (g,) = [f for f in verdict(base)["findings"] if f["id"] == "pod-to-lb-not-masqueraded"]
    assert "providerID" not in g["remedy"]  # no provider: the generic remedy


def test_the_services_own_annotations_win_over_the_node() -> None:
    base = with_provider_id(contract.bundle(LOCAL_REMOTE, "ipvs-tke"),
                            "aws:///eu-west-1a/i-0a1b2c3d4e5f60718")
    v = verdict(with_service(base, {"metallb.io/address-pool": "pool-a"}))
    (f,) = [f for f in v["findings"] if f["id"] == "pod-to-lb-not-masqueraded"]
    assert f["remedy"].startswith("MetalLB (the Service's annotation metallb.io/address-pool)")


def test_the_readme_table_names_every_provider() -> None:
    from tests import docs

    readme = docs.text()
    for p in providers():
        assert f"| {p.name} |" in readme, p.name


def test_the_services_load_balancer_class_names_its_provider() -> None:
    # kube-vip's class (kube-vip.io/kube-vip-class) on a node whose providerID is AWS's
    base = with_provider_id(contract.bundle(LOCAL_REMOTE, "ipvs-tke"),
                            "aws:///eu-west-1a/i-0a1b2c3d4e5f60718")
    doc = json.loads(base["services.json"])
    doc["items"][0]["spec"]["loadBalancerClass"] = "kube-vip.io/kube-vip-class"
    v = verdict({**base, "services.json": json.dumps(doc)})
    (f,) = [f for f in v["findings"] if f["id"] == "pod-to-lb-not-masqueraded"]
    assert f["remedy"].startswith(
        "kube-vip (the Service's loadBalancerClass kube-vip.io/kube-vip-class)")


def test_proxy_protocol_where_pods_go_through_the_load_balancer_is_fine() -> None:
    # TKE's IPVS mode leaves the pods' packet to the load balancer (not captured): the
    # PROXY header is added on the way, nothing to say
    base = contract.bundle(LOCAL_REMOTE, "ipvs-tke")
    v = verdict(with_service(base, {"load-balancer.hetzner.cloud/uses-proxyprotocol": "true"}))
    assert of(v, NO_IP_MODE) == []
