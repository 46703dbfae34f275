"""`check --what-if MODE` (nftables, iptables, ipvs): what this node would show if
kube-proxy ran in that mode, for the Services and endpoints it serves today (issue 34).

The prediction is a snapshot of the same node as kube-proxy leaves it in the target mode:
what the current mode left taken away (kube-proxy's nftables table; its iptables chains
and the rules that jump to them; its ipsets; IPVS's virtual servers and the kube-ipvs0
device with its addresses and local routes), then the target mode's own state written
as its proxier would, for the Services and the endpoints the current rules send them to
(agent.predict.cluster): nftables mode's table (agent.predict.nftables); iptables mode's
nat and filter rules (agent.predict.iptables), merged into the node's other tables and
chains, kube-proxy's jumps ahead of the others' in the built-in chains; IPVS mode's rules
(merged the same way), ipsets, virtual servers, and every ClusterIP, external and load
balancer address bound on kube-ipvs0 with its local route (agent.predict.ipvs).
Everything else of the node (addresses, routes, sysctls, a CNI's chains and nft tables)
stays. The same engine diagnoses it; the diff compares, per load balancer address and
port, the findings of today with the predicted ones.

kube-proxy itself removes the other modes' state only when it moves to or from nftables
mode (cmd/kube-proxy/app/server_linux.go platformCleanup); between iptables and IPVS mode
the old mode's state stays until `kube-proxy --cleanup` or a reboot: the prediction is of
the node switched cleanly, and says so. Findings that depend on kube-proxy's version are
predicted for a kube-proxy with the fixes the engine knows (agent/diagnose/data/
known_bugs.json): nftables mode is walked again without the kubernetes#131765 fix
(v1.34.0, v1.33.6) and what differs is said with the release to move to; for the other
modes the notes name each known bug of the mode with its fixed-in release, and say where
this node's kube-proxy, when its version is in the input, is older.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from agent.diagnose import diagnose, prepare
from agent.diagnose.kube_proxy_version import kube_proxy_version
from agent.diagnose.model import Detail, Verdict
from agent.diagnose.rules.known_bugs import catalogue
from agent.netfilter.rules_text import parse_iptables_save
from agent.parse.ipset_text import parse_ipsets
from agent.parse.ipvsadm_text import parse_ipvsadm
from agent.predict.cluster import Cluster, read_cluster
from agent.predict.iptables import iptables_rules
from agent.predict.ipvs import IPVS_SETS, ipvs_mode, set_name
from agent.predict.nftables import nftables_rules
from agent.snapshot import (
    Address,
    Chain,
    LocalRoute,
    Netfilter,
    NftDump,
    NodeSnapshot,
    Rules,
    Table,
)

Target = Literal["nftables", "iptables", "ipvs"]
TARGETS: tuple[Target, ...] = ("nftables", "iptables", "ipvs")
_MODE_NAME = {"nftables": "nftables", "iptables": "iptables", "ipvs": "IPVS"}


def source_of(target: str) -> str:
    """The name the predicted rules are cited by ("predicted: kube-proxy ipvs mode:12")."""
    return f"predicted: kube-proxy {target} mode"


SOURCE = source_of("nftables")

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
_CLEANUP = "cmd/kube-proxy/app/server_linux.go platformCleanup"


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
    """``snap`` as kube-proxy in ``target`` mode would leave the node, for ``cluster``."""
    source = source_of(target)
    base = _without_kube_proxy_state(snap, target)
    if target == "nftables":
        text = nftables_rules(cluster.ports, family=4, cluster_cidr=cluster.cluster_cidr,
                              node_ips=(cluster.node_ip,) if cluster.node_ip else (),
                              before_132456=before_132456)
        return replace(base, nft=(*(base.nft or ()), NftDump("text", text, source)))
    if target == "iptables":
        text = iptables_rules(cluster.ports, cluster_cidr=cluster.cluster_cidr,
                              node_ip=cluster.node_ip)
        # localhostNodePorts (default true): kube-proxy's IPv4 proxier sets it
        # (pkg/proxy/iptables/proxier.go NewProxier)
        sysctls = {**base.sysctls, "net.ipv4.conf.all.route_localnet": "1"} \
            if base.sysctls is not None else None
        return replace(base, netfilter=_merged(base.netfilter, text, source),
                       sysctls=sysctls)
    state = ipvs_mode(cluster.ports, bind_lb_ip=True, cluster_cidr=cluster.cluster_cidr,
                      node_ips=_node_port_addresses(base, cluster))
    bound = state.kube_ipvs0_addresses
    return replace(
        base,
        # (IPVS's virtual servers are all kube-proxy's, written here: not unknown any more)
        unknowns=tuple(u for u in base.unknowns if u.source not in ("ipvs", "ipvsadm.txt")),
        netfilter=_merged(base.netfilter, state.iptables_restore, source),
        ipsets=(*(base.ipsets or ()), *parse_ipsets(state.ipset_save, source)),
        ipvs=parse_ipvsadm(state.ipvsadm_save, source) if state.ipvsadm_save else (),
        # (a DOWN dummy device, as kube-proxy leaves it: its addresses are local all the
        # same, in table local)
        addresses=(*base.addresses, *(Address("kube-ipvs0", a, 32, "global", False)
                                      for a in bound))
        if base.addresses is not None else None,
        local_routes=(*base.local_routes, *(
            LocalRoute("local", a, "kube-ipvs0", a,
                       f"local {a} dev kube-ipvs0 proto kernel scope host src {a}")
            for a in bound)) if base.local_routes is not None else None)


def _without_kube_proxy_state(snap: NodeSnapshot, target: Target) -> NodeSnapshot:
    """``snap`` without what any mode of kube-proxy left (its nftables tables, its
    iptables chains and the rules that jump to them or match its sets, its ipsets, IPVS's
    virtual servers, kube-ipvs0's addresses and local routes), named as ``target``'s."""
    kept_sets = tuple(s for s in snap.ipsets or () if s.name not in KUBE_PROXY_SETS)
    nft = tuple(d for d in map(_without_kube_proxy_tables, snap.nft or ()) if d is not None)
    return replace(
        snap,
        origin=f"{snap.origin} ({source_of(target)})",
        netfilter=_without_kube_proxy(snap.netfilter),
        ip6tables=_without_kube_proxy(snap.ip6tables),
        ipsets=kept_sets if snap.ipsets is not None else None,
        ipvs=() if snap.ipvs is not None else None,
        addresses=tuple(a for a in snap.addresses if a.ifname != "kube-ipvs0")
        if snap.addresses is not None else None,
        local_routes=tuple(r for r in snap.local_routes if r.dev != "kube-ipvs0")
        if snap.local_routes is not None else None,
        nft=nft if snap.nft is not None else None,
        # (today's process: its log lines and its sync metrics are not the new one's)
        kube_proxy=replace(snap.kube_proxy, mode=target, pid=None, errors=())
        if snap.kube_proxy is not None else None,
        kube_proxy_sync=None,
        given={**(snap.given or {}), "mode": target})


def _node_port_addresses(snap: NodeSnapshot, cluster: Cluster) -> tuple[str, ...]:
    """Where IPVS mode makes the NodePorts' virtual servers: the node's IPv4 addresses but
    kube-ipvs0's and the loopback ones (nodeAddressSet: GetAllLocalAddressesExcept(
    kube-ipvs0), isValidForSet), its own address first."""
    out = [cluster.node_ip] if cluster.node_ip else []
    for a in snap.addresses or ():
        if a.ifname == "kube-ipvs0" or ":" in a.address:
            continue
        try:
            if ipaddress.ip_address(a.address).is_loopback:
                continue
        except ValueError:
            continue
        out.append(a.address)
    return tuple(dict.fromkeys(out))


def _merged(kept: Netfilter | None, text: str, source: str) -> Netfilter:
    """The rules kube-proxy writes (``text``, iptables-save's) with the node's other ones:
    per table and chain kube-proxy's rules first (it prepends its jumps to the built-in
    chains), then the node's that are not the same rule; a built-in chain keeps the
    node's policy."""
    gen = parse_iptables_save(text, source, backend=kept.backend if kept else "unknown")
    if kept is None:
        return gen
    names = [t.name for t in kept.tables] + [t.name for t in gen.tables
                                              if kept.table(t.name) is None]
    tables = []
    for name in names:
        k, g = kept.table(name), gen.table(name)
        if g is None or k is None:
            tables.append(g or k)
            continue
        chains = []
        for c in g.chains:
            old = k.chain(c.name)
            if old is None:
                chains.append(c)
                continue
            ours = set(c.rules.texts)
            rest = [i for i, x in enumerate(old.rules.texts) if x not in ours]
            rules = Rules([*c.rules.texts, *(old.rules.texts[i] for i in rest)],
                          [*c.rules.sources(), *(old.rules.source(i) for i in rest)])
            chains.append(Chain(c.name, old.policy if old.policy else c.policy, rules))
        chains += [c for c in k.chains if g.chain(c.name) is None]
        tables.append(Table(name, tuple(chains)))
    return replace(kept, tables=tuple(t for t in tables if t is not None))


# `table ip kube-proxy {` of a listing; `add chain ip kube-proxy ...` of a transaction
_NFT_TABLE = re.compile(r"^table\s+(?:ip|ip6)\s+kube-proxy(?=\s|\{|$)")
_NFT_COMMAND = re.compile(r"^(?:add|create|flush|delete|destroy|insert|replace)\s+"
                          r"(?:\w+\s+)?(?:ip|ip6)\s+kube-proxy(?=\s|\{|$)")
_NFT_ANY_TABLE = re.compile(r"^(?:table\s|(?:add|create)\s+table\s)", re.M)


def _without_kube_proxy_tables(d: NftDump) -> NftDump | None:
    """A dump without kube-proxy's tables (`ip kube-proxy`, `ip6 kube-proxy`): what
    kube-proxy's cleanup of nftables mode deletes; None when nothing else is left."""
    if d.format == "json":
        try:
            doc = json.loads(d.text)
        except ValueError:
            return d
        items = doc.get("nftables") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            return d
        kept = [it for it in items if not _kube_proxy_item(it)]
        if len(kept) == len(items):
            return d
        if not any(isinstance(it, dict) and "table" in it for it in kept):
            return None
        return replace(d, text=json.dumps({"nftables": kept}))
    # (a line taken out stays as an empty one: the others keep their line numbers, which
    # the evidence cites)
    out: list[str] = []
    depth = 0
    gone = False
    for line in d.text.splitlines(keepends=True):
        words = line.strip()
        if depth > 0:
            depth += words.count("{") - words.count("}")
        elif _NFT_TABLE.match(words):
            depth = words.count("{") - words.count("}")
        elif not _NFT_COMMAND.match(words):
            out.append(line)
            continue
        gone = True
        out.append("\n")
    if not gone:
        return d
    text = "".join(out)
    return replace(d, text=text) if _NFT_ANY_TABLE.search(text) else None


def _kube_proxy_item(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    for kind, obj in item.items():
        if not isinstance(obj, dict) or obj.get("family") not in ("ip", "ip6"):
            continue
        if obj.get("table") == "kube-proxy" or (kind == "table" and
                                                obj.get("name") == "kube-proxy"):
            return True
    return False


def _without_kube_proxy(nf: Netfilter | None) -> Netfilter | None:
    """kube-proxy's chains taken away, with its jumps to them from the built-in chains and
    the rules that match its ipsets. Another component's chain that jumps to one of
    kube-proxy's (a hostport chain to KUBE-MARK-MASQ) is kept, and so is the chain it
    jumps to, flushed: kube-proxy's cleanup cannot delete a chain another rule refers to."""
    if nf is None:
        return None
    tables = []
    for t in nf.tables:
        chains = []
        wanted: set[str] = set()  # kube-proxy's chains another component's rules jump to
        for c in t.chains:
            if kube_proxy_chain(c.name):
                continue
            texts = c.rules.texts
            keep = [i for i, x in enumerate(texts) if not _kube_proxys_rule(x, c.name)]
            for i in keep:
                wanted.update(_jumps_to_kube_proxy(texts[i]))
            rules = Rules([texts[i] for i in keep], [c.rules.source(i) for i in keep]) \
                if len(keep) < len(texts) else c.rules
            chains.append(replace(c, rules=rules) if rules is not c.rules else c)
        chains += [Chain(c.name, c.policy, Rules([], [])) for c in t.chains
                   if c.name in wanted]
        tables.append(Table(t.name, tuple(chains)) if len(chains) != len(t.chains) or
                      any(a is not b for a, b in zip(chains, t.chains, strict=True)) else t)
    return replace(nf, tables=tuple(tables))


_BUILT_IN = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
# kube-proxy's ipsets (IPVS mode), both families
KUBE_PROXY_SETS = frozenset(set_name(name, family) for name, _t, _c in IPVS_SETS
                            for family in (4, 6))


def _jumps_to_kube_proxy(text: str) -> list[str]:
    words = text.split()
    return [words[i + 1] for i, w in enumerate(words[:-1])
            if w in ("-j", "-g") and kube_proxy_chain(words[i + 1])]


def _kube_proxys_rule(text: str, chain: str) -> bool:
    """Is this rule of a chain that is not kube-proxy's kube-proxy's own: its jump from a
    built-in chain to one of its chains, or a rule matching one of its ipsets?"""
    if chain in _BUILT_IN and _jumps_to_kube_proxy(text):
        return True
    words = text.split()
    return any(w == "--match-set" and words[i + 1] in KUBE_PROXY_SETS
               for i, w in enumerate(words[:-1]))


def what_if(snap: NodeSnapshot, node: str, target: Target,
            today: Verdict | None = None) -> WhatIf:
    """Today's verdict, the predicted one and what changes. Raises ValueError where the
    node's input cannot support a prediction (its Services, its mode)."""
    if target not in TARGETS:
        raise ValueError(f"{target}: not a mode kube-proxy runs in here (one of "
                         f"{', '.join(TARGETS)})")
    prepared = prepare(snap)  # (the node's facts, once: today's diagnosis and the model's)
    if today is None:
        today = diagnose(snap, node, prepared=prepared)
    mode = today.kube_proxy_mode
    if mode == target:
        raise ValueError(f"kube-proxy already runs in {target} mode here")
    if mode not in ("iptables", "ipvs", "nftables"):
        raise ValueError(f"kube-proxy's mode here is {mode}: a prediction needs the "
                         "iptables, IPVS or nftables mode's rules (where the endpoints are "
                         "read)")
    cluster = read_cluster(snap, prepared.facts, mode)
    fixed = _predict(snap, cluster, target, node, False)
    # the nftables layout before kubernetes#132456 differs only for an eTP=Local port
    # without a local endpoint (its @no-endpoint-services drop): walked again only where
    # there is one
    affected = target == "nftables" and any(
        p.etp_local and not any(e.local for e in p.endpoints) and p.endpoints
        for p in cluster.ports)
    unfixed = _predict(snap, cluster, target, node, True) if affected else fixed
    notes = (*_what_changes(mode, target),
             f"its local traffic detector: {cluster.cluster_cidr_how}",
             *_serves(mode, target),
             *_version_notes(snap, cluster, mode, target),
             *(("predicted as upstream kube-proxy's IPVS mode, which binds the LB IPs: "
                "these Services are Tencent's (TKE), whose own kube-proxy leaves LB IPs "
                "unbound in IPVS mode, so on TKE lb-ip-local would not appear and pods' "
                "traffic to them leaves the node as it does today",)
               if target == "ipvs" and _tencents(snap) else ()),
             *(("the Services' health check NodePorts (spec.healthCheckNodePort) are not in "
                "the input the agent reads: their accept rules and set entries are left out "
                "(no finding reads them)",) if target != "nftables" and any(
                 p.etp_local and p.lb_ips for p in cluster.ports) else ()),
             *(f"not read, predicted without it: {g}" for g in cluster.gaps[:20]),
             *((f"{len(cluster.gaps) - 20} more service ports not read",)
               if len(cluster.gaps) > 20 else ()))
    return WhatIf(target, today, fixed, *_changes(today, fixed, unfixed), notes)


def _tencents(snap: NodeSnapshot) -> bool:
    """Does a Service carry Tencent's annotations?"""
    from agent.diagnose.remedies import tke_annotated

    return any(tke_annotated(svc.annotations) for svc in snap.services or ())


def _what_changes(mode: str, target: Target) -> Iterator[str]:
    """What kube-proxy removes, and what the prediction keeps, moving from ``mode``."""
    if target == "nftables":
        yield _WHAT_THE_MODE_REMOVES
        return
    if mode == "nftables":
        yield (f"kube-proxy removes its nftables tables (ip kube-proxy, ip6 kube-proxy) when "
               f"it starts in {_MODE_NAME[target]} mode ({_CLEANUP}): predicted without them")
    else:
        old = ("IPVS's virtual servers, kube-ipvs0 with its addresses and the KUBE-* ipsets"
               if mode == "ipvs" else
               "iptables mode's KUBE-SVC/SEP/EXT chains, and its filter chains with their "
               "jumps from INPUT, FORWARD and OUTPUT")
        yield (f"predicted for the node switched cleanly: kube-proxy does not remove the "
               f"{_MODE_NAME[mode]} mode's state when it starts in {_MODE_NAME[target]} "
               f"mode ({_CLEANUP} cleans iptables and IPVS state only for nftables mode or "
               f"with --cleanup): {old} stay until `kube-proxy --cleanup` or a reboot, "
               "taken away here")
    yield ("the node's other iptables chains and rules (a CNI's, ip-masq-agent's, "
           "kubelet's) and nftables tables are kept; kube-proxy's jumps come first in the "
           "built-in chains, as it prepends them")
    if target == "ipvs":
        yield ("IPVS mode binds every ClusterIP, external IP and LoadBalancer IP on "
               "kube-ipvs0 (pkg/proxy/ipvs/proxier.go: syncService(..., bindAddr=true)): "
               "each LB IP becomes a local address of the node (lb-ip-local), pods' "
               "traffic to it is served on the node, and a health check the load "
               "balancer sends from its own address arrives as a martian; MetalLB and "
               "kube-vip in ARP mode need kube-proxy's strictARP (--ipvs-strict-arp), or "
               "the node answers ARP for every LB IP (MetalLB's installation docs: "
               "\"If you're using kube-proxy in IPVS mode, since Kubernetes v1.14.2 you "
               "have to enable strict ARP mode\")")


def _serves(mode: str, target: Target) -> Iterator[str]:
    """Where the target mode serves NodePorts."""
    if target == "nftables":
        yield ("nftables mode serves NodePorts on the node's primary address only, and "
               "never on 127.0.0.1 (KEP-3866: its --nodeport-addresses default is "
               "\"primary\")")
    elif target == "iptables":
        yield ("iptables mode serves NodePorts on every local address, 127.0.0.1 included: "
               "it sets net.ipv4.conf.all.route_localnet=1 (--iptables-localhost-nodeports, "
               "default true; --nodeport-addresses limits them)"
               + ("; nftables mode served them on the primary address only"
                  if mode == "nftables" else ""))
    else:
        yield ("IPVS mode serves NodePorts with a virtual server on each address of the "
               "node but kube-ipvs0's and the loopback ones (--nodeport-addresses unset; "
               "an older IPVS mode served them on 127.0.0.1 too, where they never answer: "
               "kubernetes#90236, stopped by kubernetes#101023)"
               + ("; nftables mode served them on the primary address only"
                  if mode == "nftables" else ""))


def _version_notes(snap: NodeSnapshot, cluster: Cluster, mode: str, target: Target
                   ) -> Iterator[str]:
    """The known bugs of the target mode (agent/diagnose/data/known_bugs.json) that this
    node's Services would meet with a kube-proxy older than the fix: the prediction has
    the fix; each is named with its fixed-in releases and the Services, and, where
    kube-proxy's version is in the input (its log, its Pod's image: the same kube-proxy
    runs the new mode), said against it. nftables mode's #131765 is walked instead
    (Change.unfixed)."""
    if target == "nftables":
        return
    said = kube_proxy_version(snap, mode)
    # what the input says of kube-proxy's version but its rules' shape, which tells of
    # today's mode
    version = replace(said, shape=None) if said is not None else None
    for bug in catalogue():
        if target not in bug.modes or bug.fixed is None:
            continue
        meets = _would_meet(bug.detector, snap, cluster)
        if not meets:
            continue
        fixed = ", ".join(["v" + ".".join(map(str, bug.fixed))] + [
            f"v{'.'.join(map(str, b))} in the {b[0]}.{b[1]} line" for b in bug.backports])
        before = version.before(bug.fixed, bug.backports) if version is not None else None
        if before is False:
            continue
        who = ", ".join(meets[:3]) + (f" and {len(meets) - 3} more" if len(meets) > 3 else "")
        if before and version is not None and version.version is not None:
            runs = "v" + ".".join(map(str, version.version))
            yield (f"this node's kube-proxy ({runs}, as the input says) is "
                   f"older than the fix of {bug.id} "
                   f"({fixed}): in {_MODE_NAME[target]} mode {who} would meet it ({bug.title}); "
                   "predicted with the fix")
        else:
            yield (f"predicted for a kube-proxy with the fix of {bug.id} ({fixed}); with an "
                   f"older one {who} would meet it: {bug.title}")


def _would_meet(detector: str | None, snap: NodeSnapshot, cluster: Cluster) -> list[str]:
    """The Service ports of this node a known bug's unfixed kube-proxy would meet (by
    what its detector looks for), all of them for a detector not known here."""
    ports = cluster.ports
    if detector == "ipvs_empty_local_virtual_server":  # kubernetes#75262
        return [p.key for p in ports if p.etp_local and (p.lb_ips or p.external_ips)
                and not any(e.local for e in p.endpoints)]
    if detector == "ipvs_filter_rejects_health_checks":  # kubernetes#117621
        return [p.key for p in ports if p.etp_local and p.lb_ips]
    if detector == "lb_ip_of_another_family":  # kubernetes#80297
        return [s.key for s in snap.services or () if s.type == "LoadBalancer"
                and any(i.ip and ":" in i.ip for i in s.lb_ingress)]
    return sorted({p.key for p in ports})


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
    for key in sorted(a.keys() | b.keys() | c.keys(),
                      key=lambda k: (k[0], k[1] or 0, k[2] or "")):
        now, pred = a.get(key, ([], None)), b.get(key, ([], None))
        old = c.get(key, ([], None))
        alt = tuple(sorted(old[0])) if sorted(old[0]) != sorted(pred[0]) else None
        if sorted(now[0]) == sorted(pred[0]) and alt is None:
            same += 1
            continue
        changes.append(Change(key[0], key[1], key[2], now[1] or pred[1],
                              tuple(sorted(now[0])), tuple(sorted(pred[0])), alt))
    return tuple(changes), same
