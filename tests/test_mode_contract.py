"""The contract across kube-proxy modes (issue 31, item 4): the same cluster, written by
kube-proxy in iptables, IPVS or nftables mode, gets the same answer for a pod of this
node reaching each LB IP:port, unless kube-proxy itself treats that pod differently.

The answer is the pod-to-lb-* finding that decides each LB IP:port (captured,
masqueraded, not-masqueraded, dropped, undetermined) and so whether it loops, plus the
other findings about the address (etp-local-no-local-endpoint, lb-ip-local). The wording
(how the packet is served) differs per mode and is compared loosely: the same lead-in,
the same address. The reference is iptables mode.

The clusters (1-3 Services each) cover externalTrafficPolicy Cluster and Local, with and
without an endpoint on this node, two ports on one Service, loadBalancerSourceRanges
that hold the pods or not, ipMode: Proxy, IPv4 and IPv6 (a dual-stack node), and
kube-proxy without --cluster-cidr (no local traffic detector). Each is written in five
ways: iptables mode; IPVS mode with the LB VIP bound on kube-ipvs0 (upstream) and without
it (TKE's kube-proxy, ``bind_lb_ip=False``); nftables mode as kube-proxy writes it since
kubernetes#132456, and with the filter-chain layout that change replaced (the one of
kubernetes#131765). Each is diagnosed offline, from a bundle (file name -> text) put
together as lab.kube_proxy_rules.synthetic does.

Constructed inputs: the rules come from the agent's own generators of each mode
(agent.predict: nftables, iptables, ipvs, through the lab's adapters in
lab/kube_proxy_rules), which follow kube-proxy's own rule shapes: loadBalancerSourceRanges
in every mode, the IPv6 (`ip6 kube-proxy`) table of nftables mode, nftables mode without
a detector, the pre-#132456 nftables base chains. This module adds what no generator
writes: the IPv6 addresses of `ip addr` and the local table, and status.loadBalancer.
ingress[].ipMode: Proxy (no rule in any mode: pkg/proxy/serviceport.go skips the address
when !proxyutil.IsVIPMode(ing)).

Where the modes really differ, EXPECTED_DIFFERENCES says so, each with its reason and
the kube-proxy source that makes it. A disagreement kube-proxy does not explain (the
agent's iptables/IPVS walker and its nftables walker, or its per-mode rules, answering
differently) is a bug, never an entry there: WALKER_DISAGREEMENTS marks such a case
xfail(strict=True), failing only as described there.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from lab.kube_proxy_rules import (
    LbService,
    ip_addr_text,
    iptables_mode,
    ipvs_mode,
    node_json,
    route_local_text,
    services_json,
    sysctl_text,
)
from lab.kube_proxy_rules.nftables import nftables_mode

# --- the node -------------------------------------------------------------------------

NODE = "node-10-0-0-10"
NODE_IP = {4: "10.0.0.10", 6: "2001:db8:1::10"}
POD_CIDR = {4: "172.16.1.0/24", 6: "fd00:10:244:1::/64"}  # this node's pods
BRIDGE = {4: "172.16.1.1/24", 6: "fd00:10:244:1::1/64"}  # cni0
CLUSTER_CIDR = {4: "172.16.0.0/16", 6: "fd00:10:244::/56"}  # kube-proxy's --cluster-cidr
SERVICE_CIDR = {4: "10.96.0.0/12", 6: "fd00:96::/112"}
# loadBalancerSourceRanges: the pods' own (their packets pass) or others' (dropped)
RANGES = {("pods", 4): CLUSTER_CIDR[4], ("pods", 6): CLUSTER_CIDR[6],
          ("others", 4): "203.0.113.0/24", ("others", 6): "2001:db8:abcd::/48"}

POD_IDS = ("pod-to-lb-captured", "pod-to-lb-masqueraded", "pod-to-lb-not-masqueraded",
           "pod-to-lb-dropped", "pod-to-lb-undetermined")
LOOPS = "pod-to-lb-not-masqueraded"

MODES = ("iptables", "ipvs", "ipvs-tke", "nftables", "nftables-131765")
REFERENCE = "iptables"


# --- the clusters -----------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One LoadBalancer Service: its policy and where its endpoints run (one on another
    node always; one on this node with ``local_ep``)."""

    name: str
    etp: str = "Cluster"
    local_ep: bool = True
    ports: int = 1  # 2: http/80 and https/443 on one Service
    ranges: str = ""  # loadBalancerSourceRanges: "" none, "pods" or "others" (RANGES)
    ip_mode_proxy: bool = False  # status.loadBalancer.ingress[].ipMode: Proxy

    @property
    def vip(self) -> bool:
        """kube-proxy serves the address (VIP mode), in every mode."""
        return not self.ip_mode_proxy


@dataclass(frozen=True)
class Cluster:
    id: str
    family: int
    specs: tuple[Spec, ...]
    # kube-proxy knows its pods (--cluster-cidr: the "local traffic detector"); without
    # it, no rule tells a pod from an outside client
    detector: bool = True

    def cidr(self, family: int) -> str | None:
        return CLUSTER_CIDR[family] if self.detector else None


def _single(family: int, etp: str, local_ep: bool) -> Cluster:
    where = "local-ep" if local_ep else "remote-ep"
    return Cluster(f"v{family}-{etp.lower()}-{where}", family,
                   (Spec("web", etp=etp, local_ep=local_ep),))


CLUSTERS = (
    *(_single(fam, etp, loc) for fam in (4, 6) for etp in ("Cluster", "Local")
      for loc in (True, False)),
    *(Cluster(f"v{fam}-two-ports-{etp.lower()}", fam,
              (Spec("web", etp=etp, local_ep=etp == "Cluster", ports=2),))
      for fam in (4, 6) for etp in ("Cluster", "Local")),
    *(Cluster(f"v{fam}-source-ranges-{who}-{etp.lower()}", fam,
              (Spec("fw", etp=etp, local_ep=etp == "Local", ranges=who),))
      for fam in (4, 6) for who in ("pods", "others") for etp in ("Cluster", "Local")),
    *(Cluster(f"v4-ip-mode-proxy-{etp.lower()}-{'local' if loc else 'remote'}-ep", 4,
              (Spec("proxied", etp=etp, local_ep=loc, ip_mode_proxy=True),))
      for etp, loc in (("Cluster", True), ("Local", True), ("Local", False))),
    *(Cluster(f"v4-no-cluster-cidr-{etp.lower()}-{'local' if loc else 'remote'}-ep", 4,
              (Spec("web", etp=etp, local_ep=loc),), detector=False)
      for etp, loc in (("Cluster", False), ("Local", True), ("Local", False))),
    # three Services side by side: one answer must not leak into another's
    *(Cluster(f"v{fam}-three-services", fam, (
        Spec("web", etp="Cluster", local_ep=False, ports=2),
        Spec("loc", etp="Local", local_ep=False),
        Spec("fw", etp="Local", local_ep=True, ranges="pods"),
    )) for fam in (4, 6)),
)


def _addr(family: int, block: str, i: int) -> str:
    """The i-th address of a block: "lb", "cluster", "local" (pod here), "remote"."""
    if family == 4:
        return {"lb": "10.0.32.", "cluster": "10.96.0.", "local": "172.16.1.",
                "remote": "172.16.2."}[block] + str(10 + i)
    return {"lb": "2001:db8:ff::", "cluster": "fd00:96::", "local": "fd00:10:244:1::",
            "remote": "fd00:10:244:2::"}[block] + f"{10 + i:x}"


def lb_ip(cluster: Cluster, i: int) -> str:
    return _addr(cluster.family, "lb", i)


def services(cluster: Cluster) -> list[LbService]:
    """The LbService ports kube-proxy is given (an ipMode: Proxy address is not)."""
    out = []
    for i, s in enumerate(cluster.specs):
        for k in range(s.ports):
            out.append(LbService(
                namespace="shop", name=s.name, port_name=("http", "https")[k],
                port=(80, 443)[k], target_port=(8080, 8443)[k],
                node_port=30000 + 10 * i + k, cluster_ip=_addr(cluster.family, "cluster", i),
                lb_ip=None if s.ip_mode_proxy else lb_ip(cluster, i), etp=s.etp,
                local_endpoints=(_addr(cluster.family, "local", i),) if s.local_ep else (),
                remote_endpoints=(_addr(cluster.family, "remote", i),),
                health_check_node_port=32000 + i if s.etp == "Local" else None,
                source_ranges=(RANGES[s.ranges, cluster.family],) if s.ranges else ()))
    return out


# --- what each mode writes ----------------------------------------------------------------


def _ipvs_files(svcs: list[LbService], family: int, bind: bool, cidr: str | None
                ) -> tuple[str, str, str, tuple[str, ...]]:
    """(iptables rules, ipset save, ipvsadm -S, kube-ipvs0 addresses) of one family's
    IPVS proxier, as the agent predicts it (agent.predict.ipvs, through the lab's
    adapter): loadBalancerSourceRanges as pkg/proxy/ipvs/proxier.go writes them
    ("Capture load-balancer ingress": the LB IP:port in KUBE-LOAD-BALANCER-FW, each
    range in KUBE-LOAD-BALANCER-SOURCE-CIDR; no KUBE-LOAD-BALANCER-SOURCE-IP: the node's
    address is in no range here)."""
    state = ipvs_mode(svcs, bind_lb_ip=bind, cluster_cidr=cidr, node_ip=NODE_IP[family],
                      family=family)
    return (state.iptables_restore, state.ipset_save, state.ipvsadm_save,
            state.kube_ipvs0_addresses)


def _nft(svcs: list[LbService], family: int, before_132456: bool, detector: bool) -> str:
    """kube-proxy's nftables transaction, as the agent predicts it (agent.predict.nftables:
    source ranges, the IPv6 table, no local traffic detector, the filter chains before
    kubernetes#132456)."""
    return nftables_mode(svcs, cluster_cidr=CLUSTER_CIDR[family] if detector else None,
                         node_ip=NODE_IP[family], service_cidr=SERVICE_CIDR[family],
                         family=family, before_132456=before_132456)


def _node_files(family: int, kube_ipvs0: tuple[str, ...]) -> dict[str, str]:
    """addr.txt, route-local.txt, sysctl.txt and node.json of this node (dual-stack for
    an IPv6 cluster: its IPv4 side has no Service)."""
    fams = (4, 6) if family == 6 else (4,)
    ifaces: list[tuple[str, str, list[str]]] = [
        ("lo", "UP", ["127.0.0.1/8"]),
        ("eth0", "UP", [f"{NODE_IP[4]}/24"] + ([f"{NODE_IP[6]}/64"] if family == 6 else [])),
        ("cni0", "UP", [BRIDGE[f] for f in fams])]
    if kube_ipvs0:
        ifaces.append(("kube-ipvs0", "DOWN",
                       [a + ("/128" if ":" in a else "/32") for a in kube_ipvs0]))
    # objects.ip_addr_text writes every address as `inet`; `ip addr` prints an IPv6 one
    # as `inet6`, without broadcast
    addr = re.sub(r"inet ([0-9a-f]*:[0-9a-f:]*/\d+)(?: brd \S+)?", r"inet6 \1",
                  ip_addr_text(ifaces))
    v4 = [(n, st, [a for a in al if ":" not in a]) for n, st, al in ifaces]
    routes = route_local_text(v4) + "".join(
        f"local {a.split('/')[0]} dev {n} proto kernel metric 0 pref medium\n"
        for n, _st, al in [("lo", "UP", ["::1/128"]), *ifaces] for a in al if ":" in a)
    node: dict[str, Any] = node_json(NODE, POD_CIDR[4], NODE_IP[4])
    if family == 6:
        node["spec"]["podCIDRs"] = [POD_CIDR[4], POD_CIDR[6]]
        node["status"]["addresses"].insert(1, {"type": "InternalIP", "address": NODE_IP[6]})
    sysctls = {"net.ipv4.ip_forward": 1, "net.ipv4.conf.all.rp_filter": 1,
               "net.ipv4.conf.eth0.rp_filter": 1, "net.ipv4.conf.all.accept_local": 0,
               "net.ipv4.conf.eth0.accept_local": 0, "net.ipv6.conf.all.forwarding": 1}
    return {"addr.txt": addr, "route-local.txt": routes, "sysctl.txt": sysctl_text(sysctls),
            "node.json": json.dumps(node)}


def _services_json(cluster: Cluster) -> str:
    """`kubectl get svc -A -o json`; an ipMode: Proxy Service's status carries its
    address, which kube-proxy was not given."""
    doc = services_json(services(cluster))
    for i, s in enumerate(cluster.specs):
        if not s.ip_mode_proxy:
            continue
        item = next(x for x in doc["items"] if x["metadata"]["name"] == s.name)
        item["spec"].update(type="LoadBalancer", externalTrafficPolicy=s.etp,
                            allocateLoadBalancerNodePorts=True)
        if s.etp == "Local":
            item["spec"]["healthCheckNodePort"] = 32000 + i
        item["status"] = {"loadBalancer": {"ingress": [{"ip": lb_ip(cluster, i),
                                                        "ipMode": "Proxy"}]}}
    return json.dumps(doc)


def bundle(cluster: Cluster, mode: str) -> dict[str, str]:
    """The support bundle (file name -> text) of this node in ``mode``."""
    fam = cluster.family
    svcs = services(cluster)
    # an IPv6 cluster's node is dual-stack: kube-proxy's IPv4 proxier has no Service
    v4 = svcs if fam == 4 else []
    files: dict[str, str] = {}
    kube_ipvs0: tuple[str, ...] = ()
    if mode == "iptables":
        files["iptables-save.txt"] = iptables_mode(v4, cluster_cidr=cluster.cidr(4),
                                                   node_ip=NODE_IP[4])
        if fam == 6:
            files["ip6tables-save.txt"] = iptables_mode(
                svcs, cluster_cidr=cluster.cidr(6), node_ip=NODE_IP[6], family=6)
    elif mode in ("ipvs", "ipvs-tke"):
        bind = mode == "ipvs"
        parts = [_ipvs_files(v4, 4, bind, cluster.cidr(4))] + (
            [_ipvs_files(svcs, 6, bind, cluster.cidr(6))] if fam == 6 else [])
        files["iptables-save.txt"] = parts[0][0]
        if fam == 6:
            files["ip6tables-save.txt"] = parts[1][0]
        files["ipset.txt"] = "".join(p[1] for p in parts)
        files["ipvsadm.txt"] = "".join(p[2] for p in parts)
        kube_ipvs0 = tuple(a for p in parts for a in p[3])
    else:
        before = mode == "nftables-131765"
        files["nft-transaction.txt"] = _nft(v4, 4, before, cluster.detector) + (
            "\n" + _nft(svcs, 6, before, cluster.detector) if fam == 6 else "")
    files.update(_node_files(fam, kube_ipvs0))
    files["services.json"] = _services_json(cluster)
    return files


# --- what the agent says ------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """A pod of this node reaching one LB IP:port, as the verdict says it."""

    pod: str  # the pod-to-lb-* finding id
    summary: str
    other: frozenset[str]  # the other findings about the address (any port)
    ports: tuple[str, ...]  # the verdict's lb_ips entry: "TCP/80"
    kind: str

    @property
    def loops(self) -> bool:
        return self.pod == LOOPS


@functools.cache
def answers(cluster: Cluster, mode: str) -> dict[tuple[str, int], Answer]:
    files = bundle(cluster, mode)
    snap = load_texts([(n, t, name_format(n)) for n, t in files.items()],
                      origin=f"bundle:{cluster.id}-{mode}")
    v = diagnose(snap, NODE).to_dict("all")
    want = {"ipvs": "ipvs", "ipvs-tke": "ipvs", "iptables": "iptables"}.get(mode, "nftables")
    assert v["kube_proxy_mode"] == want, v["context"]["kube_proxy_mode_from"]
    ips = {r["ip"]: r for r in v["lb_ips"]}
    other: dict[str, set[str]] = {}
    pod: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for f in v["findings"]:
        if f["id"] in POD_IDS:
            pod.setdefault((f["lb_ip"], f["port"]), []).append(f)
        elif f["lb_ip"]:
            other.setdefault(f["lb_ip"], set()).add(f["id"])
    out = {}
    for key, fs in pod.items():
        assert len(fs) == 1, f"{mode}: {key} has {[f['id'] for f in fs]}"
        ip = key[0]
        out[key] = Answer(fs[0]["id"], fs[0]["summary"], frozenset(other.get(ip, ())),
                          tuple(ips[ip]["ports"]), ips[ip]["kind"])
    return out


def targets(cluster: Cluster) -> list[tuple[str, int, Spec]]:
    return [(lb_ip(cluster, i), (80, 443)[k], s) for i, s in enumerate(cluster.specs)
            for k in range(s.ports)]


# --- what kube-proxy does differently -------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """Where a mode's kube-proxy treats a pod's packet (or the address) differently."""

    mode: str
    when: str  # the Services it applies to, in words
    applies: Callable[[Cluster, Spec], bool] = field(repr=False)
    pod: str | None  # the pod-to-lb-* finding this mode gives instead (None: the same)
    extra: frozenset[str]  # findings this mode adds for the address
    reason: str
    source: str  # where kube-proxy does it (kubernetes/kubernetes)


def _not_dropped(s: Spec) -> bool:
    """kube-proxy serves the address and the pods are not outside its source ranges."""
    return s.vip and s.ranges != "others"


EXPECTED_DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        "ipvs", "every VIP-mode LB IP", lambda _c, s: s.vip, None, frozenset({"lb-ip-local"}),
        "upstream IPVS binds each LB ingress IP on kube-ipvs0: the kernel delivers the pod's "
        "SYN locally to IPVS (captured, as iptables' DNAT), and the VIP is a local address "
        "of the node, which lb-ip-local reports",
        "pkg/proxy/ipvs/proxier.go: syncProxyRules, 'Capture load-balancer ingress': "
        "syncService(..., bindAddr=true) -> netlinkHandle.EnsureAddressBind(addr, "
        "kube-ipvs0)"),
    Difference(
        "ipvs-tke", "eTP=Cluster, VIP mode, the pods not outside the source ranges",
        lambda _c, s: _not_dropped(s) and s.etp == "Cluster", "pod-to-lb-masqueraded",
        frozenset(),
        "TKE's IPVS proxier does not bind the LB IP, and IPVS only takes packets for a local "
        "address (LOCAL_IN): the pod's SYN is routed to the load balancer, masqueraded by "
        "KUBE-LOAD-BALANCER -> KUBE-MARK-MASQ",
        "pkg/proxy/ipvs/proxier.go: syncService(..., bindAddr=true) (the bind TKE leaves "
        "out); writeIptablesRules: '-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ'"),
    Difference(
        "ipvs-tke", "eTP=Local, VIP mode, the pods not outside the source ranges",
        lambda _c, s: _not_dropped(s) and s.etp == "Local", LOOPS, frozenset(),
        "as above, but eTP=Local keeps the client's source: KUBE-LOAD-BALANCER-LOCAL "
        "RETURNs before the masquerade mark, so the SYN leaves with the pod's address and "
        "the load balancer may send it back to this node (the loop)",
        "pkg/proxy/ipvs/proxier.go: ipsetWithIptablesChain {kubeLoadBalancerLocalSet, "
        "KUBE-LOAD-BALANCER, RETURN, dst,dst} ahead of writeIptablesRules' "
        "'-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ'"),
    Difference(
        "ipvs", "no --cluster-cidr (no local traffic detector), eTP=Local, no endpoint here",
        lambda c, s: not c.detector and _not_dropped(s) and s.etp == "Local"
        and not s.local_ep, "pod-to-lb-captured", frozenset(),
        "IPVS gives an eTP=Local virtual server the cluster's endpoints when the node has "
        "none (kubernetes#97081) and serves the bound VIP whatever the source; iptables and "
        "nftables let only a detected pod source short-circuit to the cluster endpoints, so "
        "without a detector the pod's SYN meets the 'has no local endpoints' drop",
        "pkg/proxy/ipvs/proxier.go: syncEndpoint, onlyNodeLocalEndpoints without "
        "localEndpoints -> endpoints = clusterEndpoints; pkg/proxy/iptables/proxier.go and "
        "pkg/proxy/nftables/proxier.go: the 'pod traffic for ... external destinations' / "
        "'short-circuit pod traffic' rule only if proxier.localDetector.IsImplemented()"),
    # No entry for kubernetes#131765 (nftables-131765): before #132456 the chains that
    # check @no-endpoint-services ran at priority -110 (pkg/proxy/nftables/proxier.go
    # nftablesBaseChains), which is before DNAT only on the output hook (the node's own
    # traffic). A pod's packet is DNATed in prerouting (its external chain's 'short-circuit
    # pod traffic' rule sends a cluster-CIDR source to the service chain) before the
    # forward hook's check sees it: its answer is iptables', in both layouts.
)


def expected(mode: str, cluster: Cluster, spec: Spec, ref: Answer
             ) -> tuple[str, frozenset[str], list[Difference]]:
    """The pod finding and other findings ``mode`` should give where iptables mode
    gives ``ref``, and the differences that make it so."""
    pod, other = ref.pod, set(ref.other)
    used = [d for d in EXPECTED_DIFFERENCES if d.mode == mode and d.applies(cluster, spec)]
    for d in used:
        pod = d.pod or pod
        other |= d.extra
    return pod, frozenset(other), used


# --- where the walkers disagree (bugs, not differences) -------------------------------------

class WalkerDisagreement(AssertionError):
    """A case of WALKER_DISAGREEMENTS failing exactly as described there (any other
    failure of such a case is an ordinary one)."""


@dataclass(frozen=True)
class Disagreement:
    wrong: frozenset[tuple[str, str]]  # what the mode says: ("pod", id), ("adds", id)
    reason: str


# (cluster, mode) -> the bug (of the agent, not a kube-proxy difference) it meets
WALKER_DISAGREEMENTS: dict[tuple[str, str], Disagreement] = {
    # none open. Found by this test and fixed (issue 31): IPVS mode with the LB VIP bound
    # said captured where sources outside loadBalancerSourceRanges are dropped in filter
    # INPUT before IPVS (the local delivery did not walk INPUT); IPVS mode said
    # etp-local-no-local-endpoint for an ipMode: Proxy address with a local endpoint (it
    # read the LB IP's virtual server, which kube-proxy does not make, not the NodePort's)
}


def _semantic(cluster: Cluster, spec: Spec) -> str:
    """What kube-proxy's iptables mode does with the pod's SYN (the reference itself is
    checked against it, so that a contract two walkers keep wrongly still fails)."""
    if spec.ip_mode_proxy:
        return "pod-to-lb-undetermined"  # no rule: the load balancer decides
    if spec.ranges == "others":
        return "pod-to-lb-dropped"  # KUBE-FW falls through, KUBE-PROXY-FIREWALL drops
    if not cluster.detector and spec.etp == "Local" and not spec.local_ep:
        # KUBE-EXT has no pod rule: no DNAT, KUBE-EXTERNAL-SERVICES "has no local
        # endpoints" drops it in FORWARD
        return "pod-to-lb-dropped"
    return "pod-to-lb-captured"  # KUBE-EXT (or KUBE-FW -> KUBE-EXT) -> DNAT


# --- the tests ----------------------------------------------------------------------------


def _lead(summary: str, ip: str, port: int) -> str:
    """The summary up to the address: the same in every mode (the rest says how)."""
    what = f"[{ip}]:{port}/TCP" if ":" in ip else f"{ip}:{port}/TCP"
    assert what in summary, summary
    return summary.split(what, 1)[0]


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda c: c.id)
def test_reference_is_what_kube_proxy_does(cluster: Cluster) -> None:
    got = answers(cluster, REFERENCE)
    for ip, port, spec in targets(cluster):
        assert (ip, port) in got, (ip, port, sorted(got))
        a = got[ip, port]
        assert a.pod == _semantic(cluster, spec), (ip, port, a.pod, a.summary)
        # eTP=Local with no endpoint here: the load balancer's health checks fail here
        # (an ipMode: Proxy load balancer reaches the NodePort: the same)
        no_local = spec.etp == "Local" and not spec.local_ep
        assert ("etp-local-no-local-endpoint" in a.other) == no_local, (ip, a.other)
    assert len(got) == len(targets(cluster)), sorted(got)


def _cases() -> list[Any]:
    out = []
    for c in CLUSTERS:
        for mode in MODES:
            if mode == REFERENCE:
                continue
            known = WALKER_DISAGREEMENTS.get((c.id, mode))
            marks = [pytest.mark.xfail(strict=True, raises=WalkerDisagreement,
                                       reason=f"walker disagreement: {known.reason}")] \
                if known else []
            out.append(pytest.param(c, mode, id=f"{c.id}-{mode}", marks=marks))
    return out


@pytest.mark.parametrize(("cluster", "mode"), _cases())
def test_mode_agrees_with_iptables_mode(cluster: Cluster, mode: str) -> None:
    ref = answers(cluster, REFERENCE)
    got = answers(cluster, mode)
    assert sorted(got) == sorted(ref), f"{mode} walks other LB IP:ports: {sorted(got)}"
    wrong: set[tuple[str, str]] = set()
    said: list[str] = []
    for ip, port, spec in targets(cluster):
        r, a = ref[ip, port], got[ip, port]
        pod, other, used = expected(mode, cluster, spec, r)
        why = "; ".join(d.reason for d in used) or "no expected difference"
        if (a.pod, a.loops) != (pod, pod == LOOPS):
            wrong.add(("pod", a.pod))
            said.append(f"{ip}:{port} ({spec}): {mode} says {a.pod} ({a.summary}); iptables "
                        f"says {r.pod} ({r.summary}); expected {pod}: {why}")
        wrong |= {("adds", x) for x in a.other - other}
        wrong |= {("lacks", x) for x in other - a.other}
        if a.other != other:
            said.append(f"{ip}: {mode} says {sorted(a.other)}, expected {sorted(other)}")
        assert (a.ports, a.kind) == (r.ports, r.kind), (ip, a.ports, a.kind, r.ports, r.kind)
        if a.pod == r.pod:
            # the wording only loosely: the same lead-in for the same address
            assert _lead(a.summary, ip, port) == _lead(r.summary, ip, port), \
                (a.summary, r.summary)
    known = WALKER_DISAGREEMENTS.get((cluster.id, mode))
    if known is not None and wrong == known.wrong:
        raise WalkerDisagreement("\n".join(said))
    assert not wrong, "\n".join(said)


def test_every_expected_difference_is_used_and_sourced() -> None:
    """An entry that no case needs, or that says no source, is a table gone stale."""
    for d in EXPECTED_DIFFERENCES:
        assert d.source.startswith("pkg/proxy/") and d.reason and d.when, d
        assert d.mode in MODES and d.mode != REFERENCE, d
        assert any(d.applies(c, s) for c in CLUSTERS for s in c.specs), d
        assert d.pod in (None, *POD_IDS), d
