"""Where the node's sources disagree (issue 33, item 3): each source alone looks fine,
together they say kube-proxy has not written what the cluster asks, or has not taken back
what it no longer asks.

- ``kube-ipvs0-stale-address``: an address bound on kube-ipvs0 that no Service names
  (and no IPVS virtual server serves, where IPVS is read): kube-proxy unbinds an address
  when its last Service goes (pkg/proxy/ipvs/proxier.go, syncProxyRules: "Clean up
  legacy bind address"), so one left means its syncs stopped or something else bound it.
  The node takes packets to it in as its own, and nothing serves them.
- ``lb-ip-without-kube-proxy-rule``: a Service's LoadBalancer or external address (and
  port) that kube-proxy's rules, sets or maps never name, where they name others: the
  Service came after kube-proxy's last sync (or kube-proxy skips it); pods' packets to it
  are walked as written, i.e. uncaptured.
- ``ipvs-set-without-virtual-server`` / ``ipvs-virtual-server-without-set``: IPVS mode
  writes each LB or external address:port twice, as an ipset entry (its iptables rules
  match on it: masquerade marks, source ranges) and as an IPVS virtual server (what
  serves it); one without the other is a sync that stopped half way.
- ``loop-back-set-missing-endpoint``: a local endpoint of an IPVS virtual server missing
  from KUBE-LOOP-BACK, the set whose entries make kube-proxy masquerade a pod that IPVS
  sends back to itself (pkg/proxy/ipvs/proxier.go writes "IP,proto:port,IP" for each
  local endpoint): without it the pod answers its own SYN from its own address and the
  connection resets (kubernetes#134884's symptom).

- ``kube-proxy-sync-stale``: kube-proxy's metrics say a change has waited longer than its
  own health check allows (pkg/proxy/healthcheck/proxy_health.go: unhealthy once a
  queued update is older than healthTimeout, which cmd/kube-proxy sets to twice the sync
  period, 30 s by default); ``kube-proxy-sync-failures``: its rule writes have failed
  since it started (kubeproxy_sync_proxy_rules_{iptables_restore,nftables_sync}_failures_total).

Each says which sources it compared; none fires where a source it needs is not in the
input, or where the input is an excerpt (what is not shown is not absent).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re

from agent.diagnose.context import Context
from agent.diagnose.lb_ip import LB_SETS, ip_proto_port
from agent.diagnose.model import Finding
from agent.diagnose.rules import known_bugs
from agent.netfilter.nft_read import ruleset_of
from agent.parse.ip_text import canonical_ip
from agent.snapshot import IpvsVirtualServer, KubeProxySync, NodeSnapshot, Service

STALE_ADDRESS = "kube-ipvs0-stale-address"
NO_RULE = "lb-ip-without-kube-proxy-rule"
SET_WITHOUT_VS = "ipvs-set-without-virtual-server"
VS_WITHOUT_SET = "ipvs-virtual-server-without-set"
LOOP_BACK_MISSING = "loop-back-set-missing-endpoint"
SYNC_STALE = "kube-proxy-sync-stale"
SYNC_FAILURES = "kube-proxy-sync-failures"
HEALTH_TIMEOUT = 60.0  # seconds: 2 x kube-proxy's default syncPeriod (see above)

_LOOP_BACK = {4: "KUBE-LOOP-BACK", 6: "KUBE-6-LOOP-BACK"}
# at most this many findings of one id: a node whose kube-proxy stopped syncing a day
# ago may disagree on thousands; the first ones and the count say it
PER_ID = 200


def check(ctx: Context) -> list[Finding]:
    if ctx.family != 4:
        return []  # (one pass over every family's sources, in the first context)
    out = _sync(ctx) + _stale_addresses(ctx) + _without_rule(ctx)
    if ctx.mode == "ipvs":
        out += _sets_vs_virtual_servers(ctx) + _loop_back(ctx)
    return out


def _stale_families(sync: KubeProxySync) -> list[tuple[str, float, float | None]]:
    """(family, when its last change was queued, its last sync) of each family whose
    queued change was still unapplied past HEALTH_TIMEOUT when the metrics were read."""
    synced = dict(sync.last_sync)
    out = []
    for family, queued in sync.last_queued:
        last = synced.get(family)
        if sync.read_at is not None and (last is None or last < queued) and \
                sync.read_at - queued > HEALTH_TIMEOUT:
            out.append((family, queued, last))
    return out


def sync_state(sync: KubeProxySync | None) -> tuple[object, ...]:
    """What kube-proxy's metrics decide (which families are stale, the failures): they
    move on every read (the read time, each sync's timestamp), and a daemon whose node is
    otherwise unchanged keeps its verdict while this is the same."""
    if sync is None:
        return ()
    return (tuple(f for f, _, _ in _stale_families(sync)), sync.failures)


def _sync(ctx: Context) -> list[Finding]:
    sync = ctx.snapshot.kube_proxy_sync
    if sync is None:
        return []
    out = []
    for family, queued, last in _stale_families(sync):
        assert sync.read_at is not None  # (_stale_families: only with a read time)
        fam = f" ({family})" if family else ""
        out.append(Finding(
            SYNC_STALE, "warning",
            f"kube-proxy{fam} has not applied a change it queued at {_when(queued)} (its "
            "last successful sync: "
            f"{_when(last) if last is not None else 'none since it started'}): the node's "
            "rules lag the cluster, so Services and endpoints changed since are not what "
            "the rules here say",
            evidence=(f"{sync.source}: kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"
                      f"{fam} {_when(queued)}, kubeproxy_sync_proxy_rules_last_timestamp_seconds"
                      f"{fam} {_when(last) if last is not None else '(absent)'}",
                      f"read at {_when(sync.read_at)}: the change had waited "
                      f"{_ago(sync.read_at - queued)}"
                      + (f", {_ago(sync.read_at - last)} since the last sync"
                         if last is not None else ""),
                      f"kube-proxy's own /healthz fails after {HEALTH_TIMEOUT:.0f} s of this "
                      "(twice its default sync period)"),
            remedy=("Read kube-proxy's log on this node for why its syncs fail or hang "
                    "(`kubectl -n kube-system logs <kube-proxy pod>`: iptables-restore, "
                    "ipset or nft errors, a lock held by another writer) and restart it.")))
    for family, failed in sync.failures:
        if failed <= 0:
            continue
        fam = f" ({family})" if family else ""
        out.append(Finding(
            SYNC_FAILURES, "info",
            f"kube-proxy{fam} failed to write its rules {failed:.0f} times since it started; "
            "each failure is retried, so this says its syncs were troubled, not that they "
            "still are",
            evidence=(f"{sync.source}: kubeproxy_sync_proxy_rules_*_failures_total{fam} "
                      f"{failed:.0f}",),
            remedy="Read kube-proxy's log on this node for the failed writes' errors."))
    return out


def _when(epoch: float) -> str:
    try:
        return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):  # (a year past 9999)
        return f"{epoch:.0f}"


def _ago(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172800:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} days"


def _capped(found: list[Finding], what: str) -> list[Finding]:
    if len(found) <= PER_ID:
        return found
    last = found[PER_ID - 1]
    more = len(found) - PER_ID
    return [*found[:PER_ID - 1], Finding(
        last.id, last.severity,
        f"{last.summary} (and {more} more {what} like it, not listed one by one)",
        evidence=last.evidence, remedy=last.remedy)]


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


# -- an address on kube-ipvs0 nothing names --------------------------------------------


def _stale_addresses(ctx: Context) -> list[Finding]:
    """IPVS mode only (after a move to iptables mode kube-ipvs0 stays behind with its
    addresses, and nothing is stale). kube-proxy binds an address with its virtual server
    and unbinds it when the last one goes, so the virtual servers decide; an excerpt's
    Services (one pasted YAML) cannot say an address is no one's."""
    snap = ctx.snapshot
    services, ipvs = snap.services, snap.ipvs
    bound = [a for a in snap.addresses or () if a.ifname == "kube-ipvs0"]
    if ctx.mode != "ipvs" or not bound or ipvs is None:
        return []
    named: set[str] = set()
    for s in services or ():
        for ip in (*(s.cluster_ips or ((s.cluster_ip,) if s.cluster_ip else ())),
                   *s.external_ips, *(i.ip for i in s.lb_ingress if i.ip)):
            named.add(canonical_ip(ip) or ip)
    served = {canonical_ip(vs.address) or vs.address for vs in ipvs}
    compared = f"the {len(ipvs)} IPVS virtual servers" + (
        f" and the {len(services)} Services' addresses" if services is not None else "")
    found = []
    for a in bound:
        ip = canonical_ip(a.address) or a.address
        if ip in served or ip in named:
            continue
        route = ctx.facts.local_route(ip)
        found.append(Finding(
            STALE_ADDRESS, "warning",
            f"{ip} is bound on kube-ipvs0, but no IPVS virtual server serves it"
            + (" and no Service names it" if services is not None else "")
            + ": kube-proxy unbinds an address with its last virtual server, so its syncs "
              "have stopped or something else bound it; this node takes packets to it in as "
              "its own and answers them with a reset (pods reaching it never get to a load "
              "balancer)",
            lb_ip=ip,
            evidence=(f"address {ip}/{a.prefixlen} on kube-ipvs0",
                      *((f"routing: local table: {route.line}",) if route else ()),
                      f"no match among {compared}"),
            remedy=("Look at kube-proxy's log for sync errors (`kubectl -n kube-system logs "
                    "<kube-proxy pod on this node>`) and restart it if its syncs stopped; "
                    f"once no Service uses {ip}, kube-proxy (or `ip addr del {ip}/"
                    f"{a.prefixlen} dev kube-ipvs0`) removes it.")))
    return _capped(found, "addresses")


# -- a Service's address kube-proxy never wrote ------------------------------------------


def _without_rule(ctx: Context) -> list[Finding]:
    snap = ctx.snapshot
    if snap.services is None or ctx.mode == "unknown":
        return []
    writes = _kube_proxy_writes(ctx)
    if writes is None:
        return []
    written, versions, also = writes
    by_key = {s.key: s for s in snap.services}
    in_rules: set[str] | None = None  # (the rules' destinations, read once when needed)
    found = []
    for t in ctx.targets:
        if t.by_kube_proxy or t.kind == "ingress" or not t.port or t.service is None or \
                t.ip_mode == "Proxy" or (6 if ":" in t.ip else 4) not in versions or \
                (t.ip, t.protocol.lower(), str(t.port)) in also:
            continue
        svc = by_key.get(t.service)
        if svc is None or svc.proxy_name or not _same_family(svc, t.ip):
            continue  # (another proxy's; kube-proxy writes no other family's address)
        if t.kind == "loadbalancer" and ctx.mode == "ipvs" and \
                snap.ipset("KUBE-LOAD-BALANCER") is None:
            continue  # (an excerpt without the set that would list it)
        if t.kind == "external" and ctx.mode == "ipvs" and \
                snap.ipset("KUBE-EXTERNAL-IP") is None and \
                snap.ipset("KUBE-EXTERNAL-IP-LOCAL") is None:
            continue
        if ctx.mode == "ipvs" and snap.ipvs is not None and \
                ctx.facts.virtual_server(t.protocol, t.ip, t.port) is not None:
            continue  # (served; the sets' side is ipvs-virtual-server-without-set's)
        if ctx.mode != "nftables":
            if in_rules is None:
                in_rules = _destinations_in_rules(snap)
            if t.ip in in_rules:
                continue  # a rule for it that discovery did not read as an LB rule
        where = f"{_host(t.ip)}:{t.port}/{t.protocol}"
        found.append(Finding(
            NO_RULE, "warning",
            f"Service {t.service} has {where}, but kube-proxy's {written} never name it "
            "where they name other Services' addresses: kube-proxy has not synced since the "
            "address was given (or its syncs fail); until it does, pods' packets to it are "
            "not captured on this node",
            lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
            evidence=("learned from " + "; ".join(t.learned_from),
                      f"kube-proxy's {written}: nothing for {where}",
                      f"kube-proxy mode: {ctx.mode_how}"),
            remedy=("Look at kube-proxy's log on this node for sync errors (`kubectl -n "
                    "kube-system logs <kube-proxy pod>`; its metric "
                    "kubeproxy_sync_proxy_rules_last_timestamp_seconds says when it last "
                    "synced) and restart it if its syncs stopped.")))
    return _capped(found, "addresses")


def _same_family(svc: Service, ip: str) -> bool:
    """Does kube-proxy serve an address of ``ip``'s family for ``svc`` (its ClusterIPs'
    families: kube-proxy drops an LB address of another family)?"""
    ips = svc.cluster_ips or ((svc.cluster_ip,) if svc.cluster_ip else ())
    return not ips or any((":" in c) == (":" in ip) for c in ips)


Keys = set[tuple[str, str, str]]


def _kube_proxy_writes(ctx: Context) -> tuple[str, frozenset[int], Keys] | None:
    """What holds kube-proxy's record of LB addresses in this mode, the IP versions it is
    in the input for, and the addresses it records elsewhere (nftables: those without
    endpoints, only in @no-endpoint-services), where it is in the input in full and
    kube-proxy has written into it (its Services' ClusterIPs are there): else a missing
    address proves nothing."""
    snap = ctx.snapshot
    if ctx.mode == "nftables":
        rs, _ = ruleset_of(snap)
        versions: set[int] = set()
        elsewhere: Keys = set()
        for fam, v in (("ip", 4), ("ip6", 6)):
            t = rs.table(fam, "kube-proxy") if rs is not None else None
            m = t.set("service-ips") if t is not None else None
            if t is None or m is None or not m.elements:
                continue
            versions.add(v)
            for name in ("no-endpoint-services", "firewall-ips"):
                other = t.set(name)
                elsewhere |= {(p[0], p[1], p[2]) for p, _ in other.elements
                              if len(p) == 3} if other else set()
        return ("nftables maps (service-ips, no-endpoint-services, firewall-ips)",
                frozenset(versions), elsewhere) if versions else None
    nf = snap.netfilter
    if nf is None or nf.partial:
        return None
    if ctx.mode == "ipvs":
        cluster = snap.ipset("KUBE-CLUSTER-IP")
        if snap.ipsets is None or cluster is None or not cluster.members:
            return None
        return "ipsets (KUBE-LOAD-BALANCER, KUBE-EXTERNAL-IP)" + (
            " and IPVS virtual servers" if snap.ipvs is not None else ""), frozenset({4}), set()
    nat = nf.table("nat")
    services = nat.chain("KUBE-SERVICES") if nat else None
    if services is None or not services.rules:
        return None
    return "iptables rules (KUBE-SERVICES, KUBE-EXTERNAL-SERVICES)", frozenset({4}), set()


_DEST = re.compile(r"(?<!! )-d ([0-9a-fA-F.:]+)/(?:32|128)\b")


def _destinations_in_rules(snap: NodeSnapshot) -> set[str]:
    """The addresses kube-proxy's service chains match as their destination (both
    families): a rule discovery did not read as an LB rule still names its address."""
    out: set[str] = set()
    for nf in (snap.netfilter, snap.ip6tables):
        for table, chain in (("nat", "KUBE-SERVICES"), ("filter", "KUBE-EXTERNAL-SERVICES"),
                             ("filter", "KUBE-PROXY-FIREWALL")):
            t = nf.table(table) if nf is not None else None
            c = t.chain(chain) if t else None
            for text in c.rules.texts if c else ():
                if "-d " in text:
                    out.update(canonical_ip(m) or m for m in _DEST.findall(text))
    return out


# -- IPVS: the sets and the virtual servers ----------------------------------------------


def _sets_vs_virtual_servers(ctx: Context) -> list[Finding]:
    snap = ctx.snapshot
    if snap.ipsets is None or snap.ipvs is None:
        return []
    set_keys: dict[tuple[str, str, int], str] = {}
    for name in LB_SETS:
        s = snap.ipset(name)
        for m in s.members if s else ():
            got = ip_proto_port(m)
            if got is not None:
                set_keys.setdefault((canonical_ip(got[0]) or got[0], got[1], got[2]), name)
    found = []
    for (ip, proto, port), name in set_keys.items():
        if ctx.facts.virtual_server(proto, ip, port) is not None:
            continue
        where = f"{_host(ip)}:{port}/{proto}"
        found.append(Finding(
            SET_WITHOUT_VS, "warning",
            f"ipset {name} lists {where} but IPVS has no virtual server for it: kube-proxy "
            "writes both in one sync, so its last sync stopped half way (or something "
            "removed the virtual server); nothing on this node serves it",
            lb_ip=ip, port=port, protocol=proto,
            evidence=(f"ipset {name} member {ip},{proto.lower()}:{port}",
                      f"IPVS: no virtual server {proto} {where} among {len(snap.ipvs)}"),
            remedy=("Look at kube-proxy's log on this node for IPVS errors and restart it; "
                    "`ipvsadm -Ln` shows what IPVS serves.")))
    sets_found, found = _capped(found, "entries"), []
    for t in ctx.targets:
        if t.kind == "ingress" or not t.port or t.service is None or \
                (canonical_ip(t.ip) or t.ip, t.protocol, t.port) in set_keys:
            continue
        # (the set that would list it must be in the input: an excerpt's are not all)
        wanted = ("KUBE-LOAD-BALANCER",) if t.kind == "loadbalancer" else (
            "KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL")
        if ":" in t.ip or not any(snap.ipset(n) is not None for n in wanted):
            continue
        vs = ctx.facts.virtual_server(t.protocol, t.ip, t.port)
        if vs is None:
            continue
        where = f"{_host(t.ip)}:{t.port}/{t.protocol}"
        found.append(Finding(
            VS_WITHOUT_SET, "warning",
            f"IPVS serves {where} of Service {t.service}, but no kube-proxy ipset lists "
            "it: kube-proxy's iptables rules match LB addresses through those sets (the "
            "masquerade mark, source ranges), so traffic to it is served without them; "
            "kube-proxy's last sync stopped half way",
            lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
            evidence=(f"IPVS virtual server {t.protocol} {where} "
                      f"({len(vs.real_servers)} real servers)",
                      f"not in ipsets {', '.join(wanted)}",
                      "learned from " + "; ".join(t.learned_from)),
            remedy="Look at kube-proxy's log on this node for ipset errors and restart it."))
    return sets_found + _capped(found, "addresses")


def _loop_back(ctx: Context) -> list[Finding]:
    """Local endpoints are those in this node's own pod CIDR as its Node object gives it
    (a pod network guessed from a cluster CIDR would take other nodes' pods for local)."""
    snap = ctx.snapshot
    node = snap.node_info
    if snap.ipsets is None or snap.ipvs is None or node is None or not node.pod_cidrs:
        return []
    found = []
    for version, name in _LOOP_BACK.items():
        members = ctx.facts.ipset_members(name)
        nets = [n for n in map(_network, node.pod_cidrs) if n is not None
                and n.version == version]
        if members is None or not nets:
            continue
        prefix = ", ".join(map(str, nets))
        # each local endpoint's entry "IP,proto:port,IP", with the virtual servers it serves
        missing: dict[str, tuple[str, int, list[IpvsVirtualServer]]] = {}
        # (each address's locality once: 10k Services have 60k real servers, most remote)
        local: dict[str, bool] = {}
        for vs in snap.ipvs:
            proto = vs.protocol.lower()
            for rs in vs.real_servers:
                if rs.weight == 0:
                    continue  # (draining: kube-proxy keeps it while connections end)
                here = local.get(rs.address)
                if here is None:
                    here = local[rs.address] = _within(rs.address, version, nets)
                if not here:
                    continue
                entry = f"{rs.address},{proto}:{rs.port},{rs.address}"
                if entry in members[1]:
                    continue
                if entry in missing:
                    missing[entry][2].append(vs)
                else:
                    missing[entry] = (rs.address, rs.port, [vs])
        for entry, (ep, port, servers) in missing.items():
            found.append(_loop_back_finding(name, entry, ep, port, servers, prefix,
                                            "the Node's spec.podCIDRs"))
    return _capped(found, "endpoints")


def _within(ip: str, version: int,
            nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return addr.version == version and any(addr in n for n in nets)


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return None


def _loop_back_finding(name: str, entry: str, ep: str, port: int,
                       servers: list[IpvsVirtualServer], prefix: str, how: str) -> Finding:
    shown = ", ".join(f"{vs.protocol} {_host(vs.address)}:{vs.port}" for vs in servers[:4])
    shown += f" and {len(servers) - 4} more" if len(servers) > 4 else ""
    first = servers[0]
    bug = known_bugs.entry("kubernetes#134884")
    return Finding(
        LOOP_BACK_MISSING, "warning",
        f"Endpoint {_host(ep)}:{port} is on this node but not in ipset {name}: if that pod "
        "reaches its own Service and IPVS picks it, kube-proxy does not masquerade the "
        "packet, the pod answers itself from its own address and the connection resets",
        lb_ip=first.address, port=first.port, protocol=first.protocol,
        evidence=(f"IPVS real server {_host(ep)}:{port} of {shown}",
                  f"{ep} is in this node's pod network {prefix} ({how})",
                  f"ipset {name} has no member {entry}"),
        remedy=("kube-proxy adds the entry on its next sync: look at its log for ipset "
                "errors and restart it (the symptom kubernetes#134884 reports; a pod that "
                "answers itself from its own address with the entry present points at "
                "br_netfilter instead: `sysctl net.bridge.bridge-nf-call-iptables`)."),
        # the state the catalogue's kubernetes#134884 names (its reported_by: this rule)
        data={"kind": "known-bug", "bug": bug.id, "issue": bug.issue})
