"""Known kube-proxy bugs (issue 33): the catalogue (agent/diagnose/data/known_bugs.json),
its detectors, and kube-proxy's version as the input shows it (its log, its rules' shape).

kubernetes#75262 is tested likewise on its reporter's `ipvsadm` line and `ip route get`.
kubernetes#131765 is tested on the map its reporter posted (verbatim, in the realworld
corpus) with the Service the issue describes (constructed: its name and port are in the
map element's comment, its externalIP in the element, externalTrafficPolicy: Local in the
issue's text), and with kube-proxy's startup log lines in the form its logs print them
(`server.go:...] "Version info" version="v1.32.13"`, `"Using nftables Proxier"`; the
lines here constructed in that form) for versions before and after the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from agent.diagnose.kube_proxy_version import (
    IPT_EXT,
    IPT_XLB,
    NFT_BEFORE_132456,
    NFT_SINCE_132456,
    KubeProxyVersion,
)
from agent.diagnose.rules.known_bugs import catalogue

CASE = Path(__file__).parent / "data" / "realworld" / \
    "k8s-issue-131765-nft-list-map-no-endpoint-services-excerpt"
SERVICE = json.dumps({"kind": "List", "items": [{
    "kind": "Service",
    "metadata": {"namespace": "sys-ingress-priv", "name": "internal-ingress-controller-v2"},
    "spec": {"type": "LoadBalancer", "clusterIP": "10.2.0.10", "externalIPs": ["10.88.1.2"],
             "externalTrafficPolicy": "Local",
             "ports": [{"name": "web", "port": 80, "protocol": "TCP", "nodePort": 31080}]},
    "status": {"loadBalancer": {}}}]})


def log(version: str) -> str:
    return ('I0320 14:32:47.011506       1 server_linux.go:292] "Using nftables Proxier"\n'
            f'I0320 14:32:47.079907       1 server.go:497] "Version info" version="{version}"\n')


def verdict(*extra: tuple[str, str]) -> dict:  # type: ignore[type-arg]
    files = [("paste.txt", (CASE / "paste.txt").read_text()), ("services.json", SERVICE),
             *extra]
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


def bugs(v: dict) -> list[dict]:  # type: ignore[type-arg]
    return [f for f in v["findings"] if f["id"] == "kube-proxy-known-bug"]


def test_the_catalogue_reads_and_names_a_detector_for_each_bug() -> None:
    from agent.diagnose.rules.consistency import LOOP_BACK_MISSING
    from agent.diagnose.rules.known_bugs import DETECTORS

    found = catalogue()
    assert [b.id for b in found] == ["kubernetes#131765", "kubernetes#75262",
                                    "kubernetes#117621", "kubernetes#80297",
                                    "kubernetes#134884", "kubernetes#90236"]
    for b in found:
        assert b.issue.startswith("https://github.com/")
        # a detector here, or the rule that reports the state
        assert (b.detector in DETECTORS) != (b.reported_by == LOOP_BACK_MISSING), b.id
    assert (found[0].fixed, found[0].backports) == ((1, 34, 0), ((1, 33, 6),))
    assert (found[1].fixed, found[1].backports) == ((1, 21, 0), ())


def test_131765_on_the_reporters_map_says_the_fix_when_the_version_is_unknown() -> None:
    v = verdict()
    (f,) = bugs(v)
    assert (f["lb_ip"], f["port"], f["service"]) == (
        "10.88.1.2", 80, "sys-ingress-priv/internal-ingress-controller-v2")
    assert "kubernetes#131765" in f["summary"] and "own version is not in the input" \
        in f["summary"]
    assert "v1.33.6" in f["remedy"] and "v1.34.0" in f["remedy"]
    assert any("no-endpoint-services has 10.88.1.2 . tcp . 80 : drop" in e
               for e in f["evidence"])
    assert f["data"]["bug"] == "kubernetes#131765"


@pytest.mark.parametrize("version,affected", [
    ("v1.33.2", True), ("v1.32.13", True), ("v1.33.6", False), ("v1.34.1", False),
])
def test_131765_follows_the_version_kube_proxy_logs(version: str, affected: bool) -> None:
    v = verdict(("kube-proxy.log", log(version)))
    assert v["context"]["kube_proxy_version"].startswith(version + " (kube-proxy's log")
    found = bugs(v)
    assert bool(found) == affected, found
    if found:
        assert f"kube-proxy ({version}" in found[0]["summary"]


def test_versions_from_rule_shapes_decide_a_fix_only_where_every_version_agrees() -> None:
    fix, backports = (1, 34, 0), ((1, 33, 6),)
    assert KubeProxyVersion(None, NFT_BEFORE_132456, "").before(fix, backports) is True
    assert KubeProxyVersion(None, NFT_SINCE_132456, "").before(fix, backports) is False
    # a fix in 1.30.0: the old nft shape spans 1.29-1.33.5, so it cannot tell
    assert KubeProxyVersion(None, NFT_BEFORE_132456, "").before((1, 30, 0)) is None
    assert KubeProxyVersion(None, IPT_XLB, "").before((1, 24, 0)) is True
    assert KubeProxyVersion(None, IPT_EXT, "").before((1, 24, 0)) is False
    assert KubeProxyVersion(None, IPT_EXT, "").before((1, 28, 0)) is None
    # a backport older than the shape's own change in that line: versions between have both
    assert KubeProxyVersion(None, NFT_BEFORE_132456, "").before(
        (1, 34, 0), ((1, 33, 2),)) is None
    assert KubeProxyVersion((1, 33, 3), None, "").before((1, 34, 0), ((1, 33, 2),)) is False


def test_another_components_version_line_is_not_kube_proxys() -> None:
    v = verdict(("scheduler.log", 'I0101 00:00:00.000000       1 server.go:154] '
                                  '"Version info" version="v1.35.0"\n'))
    assert "kube_proxy_version" not in v["context"]
    assert bugs(v)  # still said, with the version unknown


IPVS_CASE = Path(__file__).parent / "data" / "realworld" / \
    "k8s-issue-75262-ipvs-etp-local-empty-vs-route-get"
# the Service the issue describes (constructed): a LoadBalancer IP 10.1.109.187:443 with
# externalTrafficPolicy: Local, its endpoints on other nodes
IPVS_SERVICE = json.dumps({"kind": "List", "items": [{
    "kind": "Service", "metadata": {"namespace": "default", "name": "ingress"},
    "spec": {"type": "LoadBalancer", "clusterIP": "10.2.0.20",
             "externalTrafficPolicy": "Local",
             "ports": [{"name": "https", "port": 443, "protocol": "TCP", "nodePort": 30443}]},
    "status": {"loadBalancer": {"ingress": [{"ip": "10.1.109.187"}]}}}]})


def ipvs_verdict(*extra: tuple[str, str]) -> dict:  # type: ignore[type-arg]
    files = [("paste.txt", (IPVS_CASE / "paste.txt").read_text()),
             ("services.json", IPVS_SERVICE), *extra]
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


@pytest.mark.parametrize("version,affected", [
    (None, True), ("v1.14.0", True), ("v1.20.15", True), ("v1.21.0", False),
])
def test_75262_on_the_reporters_ipvsadm_and_route_get(version: str | None,
                                                       affected: bool) -> None:
    """The issue's own output: `TCP 10.1.109.187:443 rr` (no real server) and `ip ro get`
    saying the address is local."""
    extra = [("kube-proxy.log", log(version).replace("nftables", "ipvs"))] if version else []
    v = ipvs_verdict(*extra)
    assert v["kube_proxy_mode"] == "ipvs"
    found = [f for f in bugs(v) if f["data"]["bug"] == "kubernetes#75262"]
    assert bool(found) == affected, v["findings"]
    if found:
        (f,) = found
        assert (f["lb_ip"], f["port"]) == ("10.1.109.187", 443)
        assert any("has no real servers" in e for e in f["evidence"])
        assert any("local 10.1.109.187 dev lo table local" in e for e in f["evidence"])


# -- kubernetes#117621: KUBE-IPVS-FILTER rejects health checks to a bound LB address -----

BUGS = Path(__file__).parent / "data" / "known_bugs"
# constructed beside the posted chains: an externalTrafficPolicy=Local LoadBalancer Service
# (the issue's GCP case: its health checks go to the LB address) and the address in
# KUBE-IPVS-IPS, as kube-proxy puts every address it binds on kube-ipvs0
LB = "34.90.1.10"
HC_SERVICE = json.dumps({"kind": "List", "items": [{
    "kind": "Service", "metadata": {"namespace": "web", "name": "front"},
    "spec": {"type": "LoadBalancer", "clusterIP": "10.96.40.10",
             "externalTrafficPolicy": "Local", "healthCheckNodePort": 32001,
             "ports": [{"port": 443, "protocol": "TCP", "nodePort": 30443}]},
    "status": {"loadBalancer": {"ingress": [{"ip": LB}]}}}]})
HC_SETS = (f"create KUBE-IPVS-IPS hash:ip family inet hashsize 1024 maxelem 65536\n"
           f"add KUBE-IPVS-IPS 10.96.40.10\nadd KUBE-IPVS-IPS {LB}\n"
           "create KUBE-HEALTH-CHECK-NODE-PORT bitmap:port range 0-65535\n"
           "add KUBE-HEALTH-CHECK-NODE-PORT 32001\n")


def hc_verdict(chain_file: str, *extra: tuple[str, str]) -> dict:  # type: ignore[type-arg]
    files = [("iptables-filter.txt", (BUGS / chain_file).read_text()),
             ("ipset.txt", HC_SETS), ("services.json", HC_SERVICE), *extra]
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


def test_117621_the_posted_chain_rejects_the_health_checks() -> None:
    got = [f for f in bugs(hc_verdict("k8s-117621-kube-ipvs-filter-v1.26.3.txt"))
           if f["data"]["bug"] == "kubernetes#117621"]
    assert [(f["lb_ip"], f["port"], f["service"]) for f in got] == [(LB, 443, "web/front")]
    ev = "\n".join(got[0]["evidence"])
    assert "--match-set KUBE-IPVS-IPS dst -j REJECT" in ev
    assert "iptables-filter.txt:4" in ev  # the posted line, by file and line
    assert f"{LB} is in ipset KUBE-IPVS-IPS" in ev
    assert "v1.26.5" in got[0]["remedy"] and "older than v1.28.0" in got[0]["summary"]


def test_117621_the_fixed_chain_and_fixed_versions_say_nothing() -> None:
    # the chain as the fix writes it (posted in the fix's pull request)
    fixed = hc_verdict("k8s-117723-kube-ipvs-filter-fixed.txt")
    assert [f for f in bugs(fixed) if f["data"]["bug"] == "kubernetes#117621"] == []
    # the posted chain under a kube-proxy whose version has the fix: not this bug
    for version in ("v1.26.5", "v1.27.2", "v1.28.0"):
        log_lines = ('I0504 10:00:00.000000       1 server_others.go:255] "Using ipvs Proxier"\n'
                     f'I0504 10:00:00.000001       1 server.go:497] "Version info" '
                     f'version="{version}"\n')
        v = hc_verdict("k8s-117621-kube-ipvs-filter-v1.26.3.txt", ("kube-proxy.log", log_lines))
        assert [f for f in bugs(v) if f["data"]["bug"] == "kubernetes#117621"] == [], version
    # and under one without it: said with the version
    log_lines = ('I0426 10:00:00.000000       1 server_others.go:255] "Using ipvs Proxier"\n'
                 'I0426 10:00:00.000001       1 server.go:497] "Version info" version="v1.26.3"\n')
    v = hc_verdict("k8s-117621-kube-ipvs-filter-v1.26.3.txt", ("kube-proxy.log", log_lines))
    got = [f for f in bugs(v) if f["data"]["bug"] == "kubernetes#117621"]
    assert len(got) == 1 and "v1.26.3" in got[0]["summary"]


def test_the_nodes_reported_kube_proxy_version_is_a_hint_never_a_fix() -> None:
    # status.nodeInfo.kubeProxyVersion as a Node object carries it (the kubelet writes its
    # own version there; a TKE node's, posted publicly, reads "v1.22.5-tke.1"): said in the
    # context, and a fixed-looking value does not hide the bug
    node = json.dumps({"kind": "Node", "metadata": {"name": "node-a"},
                       "spec": {"podCIDR": "10.2.128.0/24"},
                       "status": {"addresses": [{"type": "InternalIP",
                                                 "address": "10.88.0.5"}],
                                  "nodeInfo": {"kubeProxyVersion": "v1.34.2"}}})
    v = verdict(("node.json", node))
    assert "the Node's status.nodeInfo.kubeProxyVersion says v1.34.2" in \
        v["context"]["kube_proxy_version"]
    (f,) = bugs(v)
    assert "own version is not in the input" in f["summary"]
    # kube-proxy's own word (its log) wins, and the hint is not said beside it
    w = verdict(("node.json", node), ("kube-proxy.log", log("v1.34.2")))
    assert bugs(w) == [] and "nodeInfo" not in w["context"]["kube_proxy_version"]


# -- kubernetes#80297: an address of another family stops kube-proxy's sync --------------

def bundle(*files: tuple[str, str]) -> dict:  # type: ignore[type-arg]
    snap = load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")
    return diagnose(snap, "n").to_dict("all")


def of(v: dict, bug: str) -> list[dict]:  # type: ignore[type-arg]
    return [f for f in v["findings"] if (f.get("data") or {}).get("bug") == bug]


LOG_80297 = (BUGS / "k8s-80297-kube-proxy-log.txt").read_text()


@pytest.mark.parametrize("version,affected", [
    (None, True), ("v1.12.6", True), ("v1.16.7", True), ("v1.16.8", False),
    ("v1.17.3", True), ("v1.17.4", False), ("v1.18.0", False),
])
def test_80297_on_the_reporters_log(version: str | None, affected: bool) -> None:
    """The three lines posted, alone (kube-proxy names the address, its port and the
    IPv4 ipset it failed to add it to), with a version line of kube-proxy's startup form
    (constructed) before and after the fix."""
    text = LOG_80297 if version is None else \
        'I0718 12:00:00.000001       1 server.go:497] "Version info" ' \
        f'version="{version}"\n' + LOG_80297
    v = bundle(("kube-proxy.log", text), ("ipvsadm.txt", "TCP  10.0.0.9:80 rr\n"))
    assert v["kube_proxy_mode"] == "ipvs"
    got = of(v, "kubernetes#80297")
    assert bool(got) == affected, v["findings"]
    if got:
        (f,) = got
        assert (f["lb_ip"], f["port"], f["protocol"]) == ("2400:3200:1500::1cb", 80, "TCP")
        ev = "\n".join(f["evidence"])
        assert "adds the IPv6 address 2400:3200:1500::1cb to an ipset of the other" in ev
        # each posted line once (the second names the address twice)
        assert ev.count("kube-proxy's log: E0718") == 3
        assert "v1.17.4" in f["summary"] or version is not None


SVC_V6_INGRESS = json.dumps({"kind": "List", "items": [{
    "kind": "Service", "metadata": {"namespace": "default", "name": "netdia"},
    "spec": {"type": "LoadBalancer", "clusterIP": "10.96.7.7",
             "ports": [{"port": 80, "protocol": "TCP", "nodePort": 30080}]},
    "status": {"loadBalancer": {"ingress": [{"ip": "2400:3200:1500::1cb"}]}}}]})


def node(*cidrs: str) -> str:
    return json.dumps({"kind": "Node", "metadata": {"name": "n"},
                       "spec": {"podCIDRs": list(cidrs)},
                       "status": {"addresses": [{"type": "InternalIP",
                                                 "address": "10.0.0.10"}]}})


def test_80297_from_the_service_and_the_nodes_families() -> None:
    """Constructed: the issue's Service (an IPv6 ingress address on an IPv4 cluster) and
    a Node object; no log. A dual-stack node serves the address: not this bug; a failure
    kube-proxy logs for an address of its own family is not this bug either."""
    ipvs = ("ipvsadm.txt", "TCP  10.96.7.7:80 rr\n")
    v = bundle(ipvs, ("services.json", SVC_V6_INGRESS), ("node.json", node("10.2.1.0/24")))
    (f,) = of(v, "kubernetes#80297")
    assert f["service"] == "default/netdia" and f["port"] == 80
    assert any("this node serves IPv4 only (its Node's spec.podCIDRs: 10.2.1.0/24)" in e
               for e in f["evidence"])
    dual = bundle(ipvs, ("services.json", SVC_V6_INGRESS),
                  ("node.json", node("10.2.1.0/24", "fd00:2:1::/64")))
    assert of(dual, "kubernetes#80297") == []
    own = ('E0718 12:11:12.851157       1 ipset.go:152] Failed to add entry: 10.0.0.77,tcp:80 '
           'to ip set: KUBE-LOAD-BALANCER, error: exit status 1\n')
    w = bundle(ipvs, ("kube-proxy.log", own), ("node.json", node("10.2.1.0/24")))
    assert of(w, "kubernetes#80297") == []
    # a dual-stack node whose Node object says IPv4 only (no podCIDRs from its IPAM) but
    # whose kube-proxy has IPv6 ipsets: kube-proxy serves IPv6 here
    six = "create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536\n"
    w = bundle(ipvs, ("services.json", SVC_V6_INGRESS), ("ipset.txt", six),
               ("node.json", node("10.2.1.0/24")))
    assert of(w, "kubernetes#80297") == []
    # a Node whose kubelet is v1.30.4: kube-proxy is at least v1.27 beside it (the version
    # skew policy), long after the fix: said nothing; the kubelet at v1.19: still open
    for kubelet, fires in (("v1.30.4", False), ("v1.19.16", True)):
        n = json.loads(node("10.2.1.0/24"))
        n["status"]["nodeInfo"] = {"kubeProxyVersion": kubelet}
        w = bundle(ipvs, ("services.json", SVC_V6_INGRESS), ("node.json", json.dumps(n)))
        assert bool(of(w, "kubernetes#80297")) == fires, kubelet
        if fires:
            assert "kube-proxy is at least v1.16 beside it" in \
                w["context"]["kube_proxy_version"]


def test_kube_proxys_failed_syncs_are_kept_from_any_paste_once_each_and_bounded() -> None:
    """The log lines are found in a paste of any name, only kube-proxy's (klog's file of
    its proxier or ipset helper: a kubelet line about kube-proxy's Pod is not), each
    message once however often the log repeats it (so the cause is not crowded out by a
    line repeated every sync), and at most MAX_ERRORS messages."""
    from agent.probes.kube_proxy import MAX_ERRORS

    kubelet = ('E0718 12:00:00.000000       1 kubelet.go:10] "Failed to sync pod" '
               'pod="kube-system/kube-proxy-abcde"\n')
    noise = ('E0718 12:11:12.800000       1 proxier.go:1500] Failed to ensure that nat chain '
             'KUBE-POSTROUTING exists\n')
    snap = load_texts([("paste.txt", kubelet + noise * 25 + LOG_80297 * 30, "")],
                      origin="bundle:t")
    assert snap.kube_proxy is not None
    errors = snap.kube_proxy.errors
    assert len(errors) == 4 and all("kubelet.go" not in e for e in errors)
    assert errors[0].startswith("E0718 12:11:12.800000") and "proxier.go:1499]" in errors[1]
    many = "".join(f"E0718 12:00:00.{i:06d}       1 proxier.go:9] Failed to sync rule {i}\n"
                   for i in range(3 * MAX_ERRORS))
    snap = load_texts([("paste.txt", many, "")], origin="bundle:t")
    assert snap.kube_proxy is not None and len(snap.kube_proxy.errors) == MAX_ERRORS
    # and a kubelet's line alone says nothing of kube-proxy
    alone = load_texts([("paste.txt", kubelet, ""), ("ipvsadm.txt", "TCP  10.0.0.9:80 rr\n",
                                                      "")], origin="bundle:t")
    assert alone.kube_proxy is None


# -- kubernetes#90236: NodePorts on 127.0.0.1 and [::1] (IPVS mode) -----------------------

def test_90236_on_the_posted_ipvsadm_listing() -> None:
    posted = (BUGS / "k8s-96879-ipvsadm-localhost-nodeports.txt").read_text()
    v = bundle(("ipvsadm.txt", posted))
    got = of(v, "kubernetes#90236")
    assert sorted((f["lb_ip"], f["port"]) for f in got) == [("127.0.0.1", 31201),
                                                            ("::1", 31201)]
    assert all("no kube-proxy release fixes it" in "\n".join(f["evidence"]) for f in got)
    # the node's other addresses' virtual servers (the ones that answer) are not named
    without = "\n".join(ln for ln in posted.splitlines()
                        if "127.0.0.1:" not in ln and "[::1]:" not in ln)
    assert of(bundle(("ipvsadm.txt", without)), "kubernetes#90236") == []
    # a loopback virtual server that is no NodePort (constructed: a DNS cache's on
    # 127.0.0.2:53, a port outside the NodePort range) is not this
    other = "TCP  127.0.0.2:53 rr\nTCP  127.0.0.1:6443 rr\n"
    assert of(bundle(("ipvsadm.txt", other)), "kubernetes#90236") == []
    # with the Services given, their nodePorts decide (31201 is none of theirs here)
    assert of(bundle(("ipvsadm.txt", posted), ("services.json", SVC_V6_INGRESS)),
              "kubernetes#90236") == []


# -- kubernetes#134884: KUBE-LOOP-BACK without a local endpoint ---------------------------

WEAVE_SETS = (BUGS / "weave-3452-ipset-save-kube-loop-back.txt").read_text()
# constructed beside the posted sets: the virtual servers their entries belong to
# (CoreDNS on 10.32.0.3/.4, a web pod on 10.32.0.2, the API server) and a Node whose pod
# network holds them (weave's default range)
WEAVE_IPVS = """IP Virtual Server version 1.2.1 (size=4096)
Prot LocalAddress:Port Scheduler Flags
  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn
TCP  10.96.0.1:443 rr
  -> 185.113.124.205:6443         Masq    1      0          0
TCP  10.96.0.10:53 rr
  -> 10.32.0.3:53                 Masq    1      0          0
  -> 10.32.0.4:53                 Masq    1      0          0
TCP  10.96.140.192:80 rr
  -> 10.32.0.2:80                 Masq    1      0          0
UDP  10.96.0.10:53 rr
  -> 10.32.0.3:53                 Masq    1      0          0
  -> 10.32.0.4:53                 Masq    1      0          0
"""


def test_134884_is_reported_by_the_loop_back_check_and_cites_the_catalogue() -> None:
    (bug,) = [b for b in catalogue() if b.id == "kubernetes#134884"]
    assert bug.detector is None and bug.reported_by == "loop-back-set-missing-endpoint"
    files = [("ipvsadm.txt", WEAVE_IPVS), ("node.json", node("10.32.0.0/12"))]
    healthy = bundle(("ipset.txt", WEAVE_SETS), *files)
    assert [f for f in healthy["findings"] if f["id"] == bug.reported_by] == []
    lost = WEAVE_SETS.replace("add KUBE-LOOP-BACK 10.32.0.2,tcp:80,10.32.0.2\n", "")
    (f,) = [f for f in bundle(("ipset.txt", lost), *files)["findings"]
            if f["id"] == bug.reported_by]
    assert f["data"] == {"kind": "known-bug", "bug": "kubernetes#134884",
                         "issue": "https://github.com/kubernetes/kubernetes/issues/134884"}
    assert "ipset KUBE-LOOP-BACK has no member 10.32.0.2,tcp:80,10.32.0.2" in f["evidence"]


def test_75262_names_115931_beside_it() -> None:
    (f,) = [f for f in bugs(ipvs_verdict()) if f["data"]["bug"] == "kubernetes#75262"]
    assert any(e.startswith("related: kubernetes#115931") and "hostNetwork" in e
               for e in f["evidence"])
