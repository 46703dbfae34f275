"""etp-local-no-local-endpoint: an externalTrafficPolicy=Local service with no endpoint
on this node; failing load-balancer health checks here are expected."""

from __future__ import annotations

import ipaddress
import re

from agent.diagnose.context import Context
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import Finding
from agent.diagnose.node_facts import parsed_ip
from agent.diagnose.rules.common import (
    has_kube_proxy_rules,
    ipv6_commands,
    no_kube_proxy_rules,
)
from agent.netfilter.shape import shape_id
from agent.snapshot import IpvsVirtualServer, NodeSnapshot

ID = "etp-local-no-local-endpoint"
_NO_LOCAL = "has no local endpoints"
_LOCAL_HINTS = (_NO_LOCAL, "KUBE-XLB-", "KUBE-SVL-")


def stated_no_local(snap: NodeSnapshot) -> dict[str, list[tuple[str, str]]]:
    """kube-proxy's own word, in a rule comment ("ns/svc:port has no local endpoints")
    where it speaks of externalTrafficPolicy=Local: nat KUBE-XLB-* and filter
    KUBE-EXTERNAL-SERVICES (filter KUBE-SERVICES says the same of internalTrafficPolicy=
    Local, on the ClusterIP: not this). "ns/svc" -> [(chain, "table chain: rule (where)")]."""
    out: dict[str, list[tuple[str, str]]] = {}
    nf = snap.netfilter
    for table in nf.tables if nf else ():
        for chain in table.chains:
            if not (chain.name.startswith("KUBE-XLB-") or
                    chain.name == "KUBE-EXTERNAL-SERVICES"):
                continue
            rules = chain.rules
            for i, text in enumerate(rules.texts):
                if _NO_LOCAL not in text:
                    continue
                m = _STATED.search(text)
                if m:
                    source = rules.source(i)
                    out.setdefault(m.group(1), []).append((chain.name, (
                        f"{table.name} {chain.name}: {text}"
                        + (f" ({source})" if source else ""))))
    return out


def _stated_for(t: LbTarget, entries: list[tuple[str, str]]) -> str | None:
    """The rule that says this LB IP:port has no local endpoint: any in the Service's own
    KUBE-XLB chain; in KUBE-EXTERNAL-SERVICES one for this address or its NodePort."""
    for chain, line in entries:
        if chain.startswith("KUBE-XLB-"):
            return line
        rule = line.split(": ", 1)[1]
        if _says(rule, f" -d {t.ip}", "/128" if ":" in t.ip else "/32") and \
                _says(rule, f"--dport {t.port}"):
            return line
        if t.node_port and "addrtype --dst-type LOCAL" in rule and \
                _says(rule, f"--dport {t.node_port}"):
            return line
    return None


def _says(rule: str, words: str, tail: str = "") -> bool:
    """Does ``rule`` hold ``words`` (and maybe ``tail``) ending at a word boundary, as
    re.search(re.escape(words) + "(?:" + tail + ")?\\b", rule) finds? (Without a regex: a
    pattern per LB IP filled re's cache of 512 and compiled 20k times for 10k of them.)"""
    i = rule.find(words)
    while i >= 0:
        end = i + len(words)
        if (tail and rule.startswith(tail, end) and _boundary(rule, end + len(tail))) or \
                _boundary(rule, end):
            return True
        i = rule.find(words, i + 1)
    return False


def _boundary(s: str, k: int) -> bool:
    """re's \\b at position ``k`` of ``s``: a word character on one side only."""
    return (k > 0 and (s[k - 1].isalnum() or s[k - 1] == "_")) != \
        (k < len(s) and (s[k].isalnum() or s[k] == "_"))


_STATED = re.compile(r'--comment "?([a-z0-9][-a-z0-9.]*/[a-z0-9][-a-z0-9.]*)(?::\S*)? '
                     + _NO_LOCAL)


def check(ctx: Context) -> list[Finding]:
    out = []
    stated = stated_no_local(ctx.snapshot) if ctx.mode != "ipvs" else {}
    on_node: _OnThisNode | None = None  # made at the first real server it is asked of
    for t in ctx.targets:
        if t.kind == "ingress" or t.etp == "Cluster":
            continue
        ev: list[str] = []
        shape: tuple[str, ...]  # how it was decided (agent.netfilter.shape)
        if ctx.mode == "ipvs":
            if t.etp != "Local":
                continue
            if ctx.snapshot.ipvs is None:
                ctx.unknown(ID, "IPVS state unknown: cannot tell which externalTrafficPolicy="
                            "Local services have endpoints on this node")
                continue
            vs = ctx.facts.virtual_server(t.protocol, t.ip, t.port)
            host, port = (f"[{t.ip}]" if ":" in t.ip else t.ip), t.port
            if vs is None and t.ip_mode == "Proxy" and t.node_port:
                # kube-proxy writes no virtual server for an ipMode: Proxy address (its
                # service tracker skips it, pkg/proxy/serviceport.go): the proxying load
                # balancer opens its connection to NodeIP:NodePort, whose server decides
                vs = _node_port_server(ctx, t.protocol, t.node_port)
                if vs is not None:
                    host = f"[{vs.address}]" if ":" in vs.address else vs.address
                    port = vs.port
            if vs is not None and vs.real_servers:
                # kube-proxy (1.21+, kubernetes#97081) lists the whole cluster's endpoints
                # when the node has none, for its own pods: only a real server on this
                # node (in its pod network, or one of its addresses) is a local endpoint
                pod = ctx.facts.pod
                if pod is None:
                    continue
                if on_node is None:
                    on_node = _OnThisNode(ctx, pod.prefix)
                if any(on_node(r.address) for r in vs.real_servers):
                    continue
                shape = ("ipvs", "real servers, none on this node")
                ev.append(f"externalTrafficPolicy=Local ({t.etp_how})")
                ev.append(f"IPVS virtual server {t.protocol} {host}:{port}: real servers "
                          + ", ".join(r.address for r in vs.real_servers[:5])
                          + (f" (+{len(vs.real_servers) - 5} more)"
                             if len(vs.real_servers) > 5 else "")
                          + f", none in this node's pod network {pod.prefix} ({pod.how}) "
                          "nor one of its addresses: kube-proxy lists the cluster's "
                          "endpoints when the node has none")
            else:
                ev.append(f"externalTrafficPolicy=Local ({t.etp_how})")
                ev.append(f"IPVS virtual server {t.protocol} {host}:{port} "
                          + ("has no real servers" if vs else "does not exist"))
                shape = ("ipvs", "no real servers" if vs else "no virtual server")
        elif t.service in stated and (said := _stated_for(t, stated[t.service])):
            # the rule that says so is kube-proxy's statement of the endpoints it has: no
            # walk needed (a walk can be misled by an excerpt or a test's shared NodePort)
            ev.append(f"kube-proxy's rule: {said}")
            ev.append(f"externalTrafficPolicy=Local ({t.etp_how or 'kube-proxy rules'})")
            shape = ("kube-proxy's rule says so",)
        else:
            if ctx.mode != "nftables" and not has_kube_proxy_rules(ctx):
                # no kube-proxy chain to walk: "not served" would be a claim on nothing
                if t.etp == "Local":
                    ctx.unknown(ID, no_kube_proxy_rules(ctx))
                continue
            served = ctx.paths.outside_to_lb(t)
            if ctx.family == 6:
                served = ipv6_commands(served)
            if served.served is None:
                if t.etp == "Local":
                    host = f"[{t.ip}]" if ":" in t.ip else t.ip
                    ctx.unknown(ID, f"{host}:{t.port}: {served.how}")
                continue
            if served.served:
                continue
            hinted = any(h in line for line in served.evidence for h in _LOCAL_HINTS)
            if t.etp != "Local" and not hinted:
                continue
            ev.extend(served.evidence)
            ev.append(f"externalTrafficPolicy=Local ({t.etp_how or 'kube-proxy rules'})")
            shape = ("walk", *(step.shape() for step in served.steps))
        out.append(Finding(
            ID, "info",
            f"{t.service or t.ip} ({f'[{t.ip}]' if ':' in t.ip else t.ip}:{t.port}/"
            f"{t.protocol}) is externalTrafficPolicy="
            "Local and has no endpoint on this node: the load balancer's health checks "
            "fail here by design",
            lb_ip=t.ip, port=t.port, protocol=t.protocol, service=t.service,
            evidence=tuple(ev), remedy=None, shape=shape_id((ID, *shape))))
    return out


def _node_port_server(ctx: Context, protocol: str, node_port: int
                      ) -> IpvsVirtualServer | None:
    """The virtual server of a NodePort: on the node's address, else the first on any
    address (kube-proxy makes one per node address, all alike)."""
    node_ip = ctx.facts.node_ip
    if node_ip is not None:
        return ctx.facts.virtual_server(protocol, node_ip, node_port)
    protocol = protocol.upper()
    return next((vs for vs in ctx.snapshot.ipvs or ()
                 if vs.port == node_port and vs.protocol == protocol), None)


class _OnThisNode:
    """Is a real server's address on this node (in its pod network, or one of its own)?
    An address that cannot be placed is not claimed remote. The pod prefix is parsed
    once and each address answered once: a 10k-service node asks of ~25k real servers,
    the same endpoints under many services (parsing the prefix per call cost 0.2 s)."""

    def __init__(self, ctx: Context, pod_prefix: str) -> None:
        self._facts = ctx.facts
        try:
            self._net: ipaddress.IPv4Network | ipaddress.IPv6Network | None = \
                ipaddress.ip_network(pod_prefix, strict=False)
        except ValueError:
            self._net = None  # every address is then "not placed": on this node
        self._seen: dict[str, bool] = {}

    def __call__(self, addr: str) -> bool:
        got = self._seen.get(addr)
        if got is None:
            got = self._seen[addr] = self._decide(addr)
        return got

    def _decide(self, addr: str) -> bool:
        if self._net is None:
            return True
        try:
            # (node_facts' cached parse, which is_local's lookup below reuses)
            if parsed_ip(addr) in self._net:
                return True
        except ValueError:
            return True  # not an address we can place: not claimed remote
        return bool(self._facts.is_local(addr))
