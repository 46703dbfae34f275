"""`check --what-if nftables`: what this node would show if kube-proxy ran in nftables
mode, for the Services and endpoints it serves today (issue 34).

The prediction is a snapshot of the same node as kube-proxy leaves it in that mode: its
nftables table written as its proxier would (agent.predict.nftables, for the Services and
the endpoints the current rules send them to), and what kube-proxy removes when it starts
in nftables mode taken away (its iptables chains and the rules that jump to them, its
ipsets, IPVS's virtual servers and the kube-ipvs0 device with its addresses: the
proxier's cleanup of the other modes); everything else of the node (addresses, routes,
sysctls, a CNI's chains) stays. The same engine diagnoses it; the diff compares, per
load balancer address and port, the findings of today with the predicted ones. Findings
that depend on kube-proxy's version are predicted for a kube-proxy with the
kubernetes#131765 fix (v1.34.0, v1.33.6) and again without it: what differs is said with
the release to move to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Literal

from agent.diagnose import diagnose, prepare
from agent.diagnose.model import Detail, Verdict
from agent.predict.cluster import Cluster, read_cluster
from agent.predict.nftables import nftables_rules
from agent.snapshot import Netfilter, NftDump, NodeSnapshot, Rules, Table

Target = Literal["nftables"]
TARGETS: tuple[Target, ...] = ("nftables",)
SOURCE = "predicted: kube-proxy nftables mode"

# kube-proxy's own iptables chains in iptables and IPVS mode (pkg/proxy/iptables/proxier.go,
# pkg/proxy/ipvs/proxier.go); kubelet's (KUBE-FIREWALL, KUBE-KUBELET-CANARY, and before
# 1.28 KUBE-MARK-DROP) are not kube-proxy's to remove
_KUBE_PROXY_PREFIXES = ("KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-SVL-", "KUBE-FW-",
                        "KUBE-XLB-")
_KUBE_PROXY_CHAINS = frozenset({
    "KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
    "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY",
    "KUBE-LOAD-BALANCER", "KUBE-NODE-PORT", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER",
    "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-LOOP-BACK"})
_WHAT_THE_MODE_REMOVES = (
    "kube-proxy removes the other modes' rules when it starts in nftables mode (its "
    "iptables chains, ipsets, IPVS virtual servers and kube-ipvs0): predicted without them")


def kube_proxy_chain(name: str) -> bool:
    return name in _KUBE_PROXY_CHAINS or name.startswith(_KUBE_PROXY_PREFIXES)


@dataclass(frozen=True, slots=True)
class Change:
    lb_ip: str
    port: int | None
    protocol: str | None
    service: str | None
    today: tuple[str, ...]  # finding ids
    predicted: tuple[str, ...]
    # the predicted ids a kube-proxy without the kubernetes#131765 fix would show instead
    unfixed: tuple[str, ...] | None = None

    @property
    def appear(self) -> tuple[str, ...]:
        return tuple(i for i in self.predicted if i not in self.today)

    @property
    def vanish(self) -> tuple[str, ...]:
        return tuple(i for i in self.today if i not in self.predicted)


@dataclass(frozen=True)
class WhatIf:
    target: Target
    today: Verdict
    predicted: Verdict
    changes: tuple[Change, ...]  # per LB address:port where the findings differ
    same: int  # LB address:ports whose findings stay
    notes: tuple[str, ...]  # what the prediction took, and what it could not read

    def to_dict(self, detail: Detail = "summary") -> dict[str, Any]:
        return {"what_if": self.target,
                "today": self.today.to_dict(detail),
                "predicted": self.predicted.to_dict(detail),
                "changes": [dict(dataclasses.asdict(c), appear=list(c.appear),
                                 vanish=list(c.vanish)) for c in self.changes],
                "unchanged": self.same, "notes": list(self.notes)}


def predicted_snapshot(snap: NodeSnapshot, cluster: Cluster, target: Target,
                       before_132456: bool = False) -> NodeSnapshot:
    text = nftables_rules(cluster.ports, family=4, cluster_cidr=cluster.cluster_cidr,
                          node_ips=(cluster.node_ip,) if cluster.node_ip else (),
                          before_132456=before_132456)
    kept_sets = tuple(s for s in snap.ipsets or () if not s.name.startswith("KUBE-"))
    return replace(
        snap,
        origin=f"{snap.origin} ({SOURCE})",
        netfilter=_without_kube_proxy(snap.netfilter),
        ip6tables=_without_kube_proxy(snap.ip6tables),
        ipsets=kept_sets if snap.ipsets is not None else None,
        ipvs=() if snap.ipvs is not None else None,
        addresses=tuple(a for a in snap.addresses if a.ifname != "kube-ipvs0")
        if snap.addresses is not None else None,
        local_routes=tuple(r for r in snap.local_routes if r.dev != "kube-ipvs0")
        if snap.local_routes is not None else None,
        nft=(*(d for d in snap.nft or () if "kube-proxy" not in d.text),
             NftDump("text", text, SOURCE)),
        kube_proxy=replace(snap.kube_proxy, mode=target, pid=None)
        if snap.kube_proxy is not None else None,
        given={**(snap.given or {}), "mode": target})


def _without_kube_proxy(nf: Netfilter | None) -> Netfilter | None:
    if nf is None:
        return None
    tables = []
    for t in nf.tables:
        chains = []
        for c in t.chains:
            if kube_proxy_chain(c.name):
                continue
            texts = c.rules.texts
            keep = [i for i, x in enumerate(texts) if not _referenced(x)]
            rules = Rules([texts[i] for i in keep], [c.rules.source(i) for i in keep]) \
                if len(keep) < len(texts) else c.rules
            chains.append(replace(c, rules=rules) if rules is not c.rules else c)
        tables.append(Table(t.name, tuple(chains)) if len(chains) != len(t.chains) or
                      any(a is not b for a, b in zip(chains, t.chains, strict=True)) else t)
    return replace(nf, tables=tuple(tables))


def _referenced(text: str) -> list[str]:
    """The kube-proxy chains and sets a rule jumps to or matches on."""
    words = text.split()
    out = []
    for i, w in enumerate(words[:-1]):
        nxt = words[i + 1]
        if (w in ("-j", "-g") and kube_proxy_chain(nxt)) or \
                (w == "--match-set" and nxt.startswith("KUBE-")):
            out.append(nxt)
    return out


def what_if(snap: NodeSnapshot, node: str, target: Target,
            today: Verdict | None = None) -> WhatIf:
    """Today's verdict, the predicted one and what changes. Raises ValueError where the
    node's input cannot support a prediction (its Services, its mode)."""
    prepared = prepare(snap)  # (the node's facts, once: today's diagnosis and the model's)
    if today is None:
        today = diagnose(snap, node, prepared=prepared)
    mode = today.kube_proxy_mode
    if mode == target:
        raise ValueError(f"kube-proxy already runs in {target} mode here")
    if mode not in ("iptables", "ipvs"):
        raise ValueError(f"kube-proxy's mode here is {mode}: a prediction needs the "
                         "iptables or IPVS mode's rules (where the endpoints are read)")
    cluster = read_cluster(snap, prepared.facts, mode)
    fixed = _predict(snap, cluster, target, node, False)
    # the layout before kubernetes#132456 differs only for an eTP=Local port without a
    # local endpoint (its @no-endpoint-services drop): walked again only where there is one
    affected = any(p.etp_local and not any(e.local for e in p.endpoints) and p.endpoints
                   for p in cluster.ports)
    unfixed = _predict(snap, cluster, target, node, True) if affected else fixed
    notes = (_WHAT_THE_MODE_REMOVES,
             f"its local traffic detector: {cluster.cluster_cidr_how}",
             "nftables mode serves NodePorts on the node's primary address only, and never "
             "on 127.0.0.1 (KEP-3866: its --nodeport-addresses default is \"primary\")",
             *(f"not read, predicted without it: {g}" for g in cluster.gaps[:20]),
             *((f"{len(cluster.gaps) - 20} more service ports not read",)
               if len(cluster.gaps) > 20 else ()))
    return WhatIf(target, today, fixed, *_changes(today, fixed, unfixed), notes)


def _predict(snap: NodeSnapshot, cluster: Cluster, target: Target, node: str,
             before_132456: bool) -> Verdict:
    v = diagnose(predicted_snapshot(snap, cluster, target, before_132456), node)
    how = (f"predicted: kube-proxy in {target} mode"
           + (" before kubernetes#132456 (older than v1.34.0 / v1.33.6)"
              if before_132456 else ""))
    return replace(v, context=replace(v.context, kube_proxy_mode_from=how))


def _by_target(v: Verdict) -> dict[tuple[str, int | None, str | None], tuple[list[str],
                                                                           str | None]]:
    out: dict[tuple[str, int | None, str | None], tuple[list[str], str | None]] = {}
    for f in v.findings:
        if f.lb_ip is None:
            continue
        ids, svc = out.setdefault((f.lb_ip, f.port, f.protocol), ([], f.service))
        if f.id not in ids:
            ids.append(f.id)
        if svc is None and f.service:
            out[(f.lb_ip, f.port, f.protocol)] = (ids, f.service)
    return out


def _changes(today: Verdict, fixed: Verdict, unfixed: Verdict
             ) -> tuple[tuple[Change, ...], int]:
    a, b, c = _by_target(today), _by_target(fixed), _by_target(unfixed)
    changes: list[Change] = []
    same = 0
    for key in sorted(a.keys() | b.keys(), key=lambda k: (k[0], k[1] or 0, k[2] or "")):
        now, pred = a.get(key, ([], None)), b.get(key, ([], None))
        old = c.get(key, ([], None))
        alt = tuple(sorted(old[0])) if sorted(old[0]) != sorted(pred[0]) else None
        if sorted(now[0]) == sorted(pred[0]) and alt is None:
            same += 1
            continue
        changes.append(Change(key[0], key[1], key[2], now[1] or pred[1],
                              tuple(sorted(now[0])), tuple(sorted(pred[0])), alt))
    return tuple(changes), same
