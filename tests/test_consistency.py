"""Where the node's sources disagree (issue 33, item 3): kube-ipvs0 addresses, Services,
kube-proxy's rules, its ipsets, IPVS virtual servers and KUBE-LOOP-BACK.

The inputs are the lab's generated bundles (constructed: kube-proxy's shapes for a few
Services) made stale by hand, one source at a time, as a kube-proxy whose sync stopped
half way leaves them; each case also runs unchanged (no finding: the check cannot fire on
a consistent node) and with the source it needs left out (no finding: what is not in the
input is not absent). The live namespace tests are in test_consistency_netns.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from agent.diagnose.rules.consistency import (
    LOOP_BACK_MISSING,
    NO_RULE,
    PER_ID,
    SET_WITHOUT_VS,
    STALE_ADDRESS,
    VS_WITHOUT_SET,
)
from lab.kube_proxy_rules.synthetic import synthetic

IDS = {STALE_ADDRESS, NO_RULE, SET_WITHOUT_VS, VS_WITHOUT_SET, LOOP_BACK_MISSING}


def verdict(files: dict[str, str]) -> dict[str, Any]:
    snap = load_texts([(k, v, name_format(k)) for k, v in sorted(files.items())],
                      origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


def found(files: dict[str, str]) -> list[dict[str, Any]]:
    return [f for f in verdict(files)["findings"] if f["id"] in IDS]


@pytest.mark.parametrize("mode", ["iptables", "ipvs", "nftables"])
def test_a_consistent_node_has_none(mode: str) -> None:
    assert found(synthetic(30, mode, seed=3)) == []


# -- kube-ipvs0 ---------------------------------------------------------------------------


def stale_address(b: dict[str, str], ip: str) -> dict[str, str]:
    b = dict(b)
    b["addr.txt"] = re.sub(r"(\n\d+: kube-ipvs0:[^\n]*\n(?:    [^\n]*\n)*)",
                           lambda m: m.group(1) + f"    inet {ip}/32 scope global kube-ipvs0\n"
                           "       valid_lft forever preferred_lft forever\n",
                           b["addr.txt"], count=1)
    assert f"inet {ip}/32" in b["addr.txt"]
    b["route-local.txt"] += f"local {ip} dev kube-ipvs0 proto kernel scope host src {ip}\n"
    return b


def test_an_address_left_on_kube_ipvs0_after_its_service_went() -> None:
    b = stale_address(synthetic(6, "ipvs", seed=1), "10.0.99.7")
    got = found(b)
    assert [(f["id"], f["lb_ip"]) for f in got] == [(STALE_ADDRESS, "10.0.99.7")]
    ev = "\n".join(got[0]["evidence"])
    assert "address 10.0.99.7/32 on kube-ipvs0" in ev
    assert "local 10.0.99.7 dev kube-ipvs0" in ev
    assert "the 6 Services'" in ev and "IPVS virtual servers" in ev


def test_a_stale_address_is_judged_by_the_sources_given() -> None:
    b = stale_address(synthetic(6, "ipvs", seed=1), "10.0.99.7")
    # without Services, IPVS still says nothing serves it
    no_svc = {k: v for k, v in b.items() if k != "services.json"}
    got = found(no_svc)
    assert [f["lb_ip"] for f in got] == ["10.0.99.7"]
    assert "Services'" not in "\n".join(got[0]["evidence"])
    # with neither, an address on kube-ipvs0 is not known to be stale
    neither = {k: v for k, v in no_svc.items() if k != "ipvsadm.txt"}
    assert [f for f in found(neither) if f["id"] == STALE_ADDRESS] == []


def test_an_address_a_service_names_is_not_stale() -> None:
    b = synthetic(6, "ipvs", seed=1)
    svc = json.loads(b["services.json"])
    lb = svc["items"][2]["status"]["loadBalancer"]["ingress"][0]["ip"]
    # the IPVS virtual servers of that address gone (a half-synced kube-proxy): the
    # Service still names the address, so it is not stale
    b["ipvsadm.txt"] = _without_virtual_servers(b["ipvsadm.txt"], lb)
    assert STALE_ADDRESS not in {f["id"] for f in found(b)}


def _without_virtual_servers(text: str, ip: str) -> str:
    return without_lines(text, f" {ip}:")


# -- a Service's address kube-proxy never wrote ------------------------------------------


def lb_of(b: dict[str, str], i: int) -> tuple[str, str, int]:
    item = json.loads(b["services.json"])["items"][i]
    return (f"{item['metadata']['namespace']}/{item['metadata']['name']}",
            item["status"]["loadBalancer"]["ingress"][0]["ip"], item["spec"]["ports"][0]["port"])


def without_lines(text: str, needle: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if needle not in line)


def test_iptables_a_service_kube_proxy_has_not_synced() -> None:
    b = synthetic(8, "iptables", seed=2)
    name, ip, port = lb_of(b, 5)
    b["iptables-save.txt"] = without_lines(b["iptables-save.txt"], f"-d {ip}/32")
    got = found(b)
    assert [(f["id"], f["lb_ip"], f["port"], f["service"]) for f in got] == \
        [(NO_RULE, ip, port, name)]
    assert "iptables rules" in got[0]["summary"]
    # the walk says the same address is not captured: the two agree
    ids = {f["id"] for f in verdict(b)["findings"] if f["lb_ip"] == ip}
    assert "pod-to-lb-not-masqueraded" in ids


def test_a_service_kube_proxy_leaves_alone_or_by_design() -> None:
    b = synthetic(8, "iptables", seed=2)
    _, ip, _ = lb_of(b, 5)
    b["iptables-save.txt"] = without_lines(b["iptables-save.txt"], f"-d {ip}/32")
    doc = json.loads(b["services.json"])
    proxied = json.loads(json.dumps(doc))
    proxied["items"][5]["metadata"]["labels"] = {
        "service.kubernetes.io/service-proxy-name": "other-proxy"}
    assert found({**b, "services.json": json.dumps(proxied)}) == []
    ip_mode = json.loads(json.dumps(doc))
    ip_mode["items"][5]["status"]["loadBalancer"]["ingress"][0]["ipMode"] = "Proxy"
    assert found({**b, "services.json": json.dumps(ip_mode)}) == []


def test_an_excerpt_proves_no_rule_missing() -> None:
    # a pasted `iptables-save | grep` shows a few rules: the others are not absent
    b = synthetic(8, "iptables", seed=2)
    _, ip, _ = lb_of(b, 1)
    excerpt = "".join(line for line in b["iptables-save.txt"].splitlines(keepends=True)
                      if ip in line)
    paste = {"paste.txt": "$ iptables-save | grep " + ip + "\n" + excerpt,
             "services.json": b["services.json"]}
    assert [f for f in found(paste) if f["id"] == NO_RULE] == []


def test_nftables_a_service_kube_proxy_has_not_synced() -> None:
    b = synthetic(8, "nftables", seed=2)
    name, ip, port = lb_of(b, 3)
    key = f"{ip} . tcp . {port}"
    assert key in b["nft-transaction.txt"]
    b["nft-transaction.txt"] = without_lines(b["nft-transaction.txt"], key)
    got = found(b)
    assert [(f["id"], f["lb_ip"], f["service"]) for f in got] == [(NO_RULE, ip, name)]
    assert "nftables maps" in got[0]["summary"]


# -- IPVS: sets, virtual servers, KUBE-LOOP-BACK -----------------------------------------


def test_ipvs_a_set_entry_without_its_virtual_server() -> None:
    b = synthetic(6, "ipvs", seed=1)
    _, ip, port = lb_of(b, 4)
    b["ipvsadm.txt"] = _without_virtual_servers(b["ipvsadm.txt"], ip)
    got = found(b)
    assert [(f["id"], f["lb_ip"], f["port"]) for f in got] == [(SET_WITHOUT_VS, ip, port)]
    assert f"ipset KUBE-LOAD-BALANCER member {ip},tcp:{port}" in got[0]["evidence"]


def test_ipvs_a_virtual_server_without_its_set_entry() -> None:
    b = synthetic(6, "ipvs", seed=1)
    name, ip, _ = lb_of(b, 2)
    b["ipset.txt"] = "".join(line for line in b["ipset.txt"].splitlines(keepends=True)
                             if not re.match(rf"add KUBE-LOAD-BALANCER\S* {re.escape(ip)},",
                                             line))
    got = found(b)
    assert [(f["id"], f["lb_ip"], f["service"]) for f in got] == [(VS_WITHOUT_SET, ip, name)]


def test_ipvs_a_local_endpoint_missing_from_loop_back() -> None:
    b = synthetic(6, "ipvs", seed=1)
    entry = re.search(r"^add KUBE-LOOP-BACK (\S+)$", b["ipset.txt"], re.M)
    assert entry
    ep = entry.group(1).split(",")[0]
    b["ipset.txt"] = b["ipset.txt"].replace(entry.group(0) + "\n", "")
    got = found(b)
    assert [f["id"] for f in got] == [LOOP_BACK_MISSING]
    assert got[0]["summary"].startswith(f"Endpoint {ep}:")
    assert f"ipset KUBE-LOOP-BACK has no member {entry.group(1)}" in got[0]["evidence"]
    # the set not in the input: nothing said
    no_set = {**b, "ipset.txt": re.sub(r"^(create|add) KUBE-LOOP-BACK .*\n", "",
                                       b["ipset.txt"], flags=re.M)}
    assert found(no_set) == []


def test_many_disagreements_are_counted_not_listed() -> None:
    b = synthetic(PER_ID + 40, "ipvs", seed=4)
    b["ipvsadm.txt"] = ""  # IPVS read, and empty: every set entry lacks its server
    got = [f for f in found(b) if f["id"] == SET_WITHOUT_VS]
    assert len(got) == PER_ID
    assert sum("and 40 more entries like it" in f["summary"] for f in got) == 1


# -- what a healthy node or an excerpt must not be said to have (the review's cases) -------


def test_no_stale_address_outside_ipvs_mode_or_without_its_virtual_servers() -> None:
    b = stale_address(synthetic(6, "ipvs", seed=1), "10.0.99.7")
    assert [f["id"] for f in found({k: v for k, v in b.items() if k != "ipvsadm.txt"})] == []
    # iptables mode with a kube-ipvs0 left behind by an earlier IPVS mode: not stale
    # (kube-proxy's log says its mode: an address on kube-ipvs0 alone would say IPVS)
    it = synthetic(6, "iptables", seed=1)
    it["addr.txt"] = b["addr.txt"]
    it["kube-proxy.log"] = ('I0320 14:32:47.011506       1 server_others.go:212] '
                            '"Using iptables Proxier"\n')
    v = verdict(it)
    assert v["kube_proxy_mode"] == "iptables", v["context"]
    assert [f for f in v["findings"] if f["id"] == STALE_ADDRESS] == []


def test_an_nftables_service_without_endpoints_is_written_elsewhere() -> None:
    # kube-proxy puts the address of a port without endpoints in @no-endpoint-services
    # only (agent/predict/nftables.py writes it so): not an unsynced Service
    b = synthetic(8, "nftables", seed=2)
    _, ip, port = lb_of(b, 3)
    key = f"{ip} . tcp . {port}"
    lines = [ln for ln in b["nft-transaction.txt"].splitlines(keepends=True)
             if key not in ln]
    lines.append(f"add element ip kube-proxy no-endpoint-services {{ {key} : goto "
                 "reject-chain }\n")
    assert found({**b, "nft-transaction.txt": "".join(lines)}) == []


def test_an_ipset_excerpt_proves_no_lb_address_missing() -> None:
    b = synthetic(6, "ipvs", seed=1)
    only_cluster = "".join(ln for ln in b["ipset.txt"].splitlines(keepends=True)
                           if "KUBE-CLUSTER-IP" in ln)
    assert [f for f in found({**b, "ipset.txt": only_cluster}) if f["id"] == NO_RULE] == []


def test_an_lb_address_of_the_services_other_family_is_not_unsynced() -> None:
    # kube-proxy drops an LB address whose family the Service does not have
    b = synthetic(6, "iptables", seed=1)
    doc = json.loads(b["services.json"])
    doc["items"][0]["status"]["loadBalancer"]["ingress"].append({"ip": "2001:db8:77::1"})
    assert [f for f in found({**b, "services.json": json.dumps(doc)})
            if f["id"] == NO_RULE] == []


def test_loop_back_needs_the_nodes_own_pod_cidr_and_skips_draining_endpoints() -> None:
    b = synthetic(6, "ipvs", seed=1)
    entry = re.search(r"^add KUBE-LOOP-BACK (\S+)$", b["ipset.txt"], re.M)
    assert entry
    ep = entry.group(1).split(",")[0]
    cut = {**b, "ipset.txt": b["ipset.txt"].replace(entry.group(0) + "\n", "")}
    assert [f["id"] for f in found(cut)] == [LOOP_BACK_MISSING]
    # without the Node object, whose pods are this node's is a guess: nothing said
    assert found({k: v for k, v in cut.items() if k != "node.json"}) == []
    # the endpoint draining (weight 0): kube-proxy keeps it while its connections end
    drained = re.sub(rf"(-r {re.escape(ep)}:\d+ -m) -w 1", r"\1 -w 0", cut["ipvsadm.txt"])
    assert drained != cut["ipvsadm.txt"]
    assert found({**cut, "ipvsadm.txt": drained}) == []
