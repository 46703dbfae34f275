"""The node's Services as kube-proxy is given them, with their endpoints, read from what
the node shows today: the Service objects (the API, services.json) and the endpoints the
current mode's rules send each service port to (IPVS real servers of the ClusterIP's
virtual server, the DNATs of iptables' KUBE-SEP chains behind the port's KUBE-SVC chain,
the DNATs of nftables' endpoint chains behind the ClusterIP's @service-ips element and
its service chain's vmap). What another mode would write is predicted from this
(agent.predict.what_if).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from agent.diagnose.lb_ip import chain_hash
from agent.diagnose.nft_paths import cluster_cidr as nft_cluster_cidr
from agent.diagnose.node_facts import NodeFacts, pod_cidrs_in_rules
from agent.netfilter.nft_model import NftSet, NftTable, Token
from agent.netfilter.nft_read import ruleset_of
from agent.netfilter.rules import parse_rule_text
from agent.predict.model import Endpoint, ServicePort
from agent.snapshot import NodeSnapshot, Service


@dataclass(frozen=True, slots=True)
class Cluster:
    ports: tuple[ServicePort, ...]
    cluster_cidr: str | None  # kube-proxy's local traffic detector (--cluster-cidr)
    cluster_cidr_how: str
    node_ip: str | None
    # what could not be read, by Service port ("ns/name:port: why"): predicted without it
    gaps: tuple[str, ...]


def read_cluster(snap: NodeSnapshot, facts: NodeFacts, mode: str) -> Cluster:
    """The IPv4 Service ports of ``snap`` kube-proxy serves, with the endpoints ``mode``'s
    rules send them to. Raises ValueError when the Services are not in the input."""
    if snap.services is None:
        raise ValueError("the Service objects are not in the input (API access, "
                         "--kube-json DIR or services.json): a prediction needs them")
    pod_net = _network(facts.pod.prefix) if facts.pod else None
    ports: list[ServicePort] = []
    gaps: list[str] = []
    v6 = 0
    for svc in snap.services:
        if svc.cluster_ip and (":" in svc.cluster_ip or
                               any(":" in ip for ip in svc.cluster_ips)):
            v6 += 1  # (its IPv6 side: not predicted yet)
        if svc.proxy_name or not svc.cluster_ip or ":" in svc.cluster_ip:
            continue  # (another proxy's; headless; IPv6)
        for p in svc.ports:
            key = f"{svc.key}:{p.name}" if p.name else svc.key
            eps, gap = _endpoints(snap, facts, mode, svc, p.port, p.protocol, key, pod_net)
            if gap:
                gaps.append(f"{key}/{p.protocol}: {gap}")
            lb = tuple(i.ip for i in svc.lb_ingress if i.ip and ":" not in i.ip
                       and i.ip_mode != "Proxy") if svc.type == "LoadBalancer" else ()
            ports.append(ServicePort(
                namespace=svc.namespace, name=svc.name, port_name=p.name or "",
                port=p.port, protocol=p.protocol, cluster_ip=svc.cluster_ip,
                node_port=p.node_port if svc.type in ("NodePort", "LoadBalancer") else None,
                lb_ips=lb, external_ips=tuple(a for a in svc.external_ips if ":" not in a),
                etp_local=svc.external_traffic_policy == "Local", endpoints=eps,
                # (kube-proxy writes each family's ranges in that family's rules)
                source_ranges=tuple(r.strip() for r in svc.source_ranges
                                    if ":" not in r and r.strip())))
    if v6:
        gaps.insert(0, f"{v6} Services with an IPv6 ClusterIP: their IPv6 side is not "
                       "predicted (IPv4 only)")
    _SERVICE_IPS.clear()  # (read for this snapshot's ports: not kept past them)
    cidr, how = _cluster_cidr(snap, mode)
    return Cluster(tuple(ports), cidr, how, facts.node_ip, tuple(gaps))


def _network(prefix: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(prefix, strict=False)
    except ValueError:
        return None


def _cluster_cidr(snap: NodeSnapshot, mode: str) -> tuple[str | None, str]:
    kp = snap.kube_proxy
    if kp is not None and kp.cluster_cidr:
        return kp.cluster_cidr, "kube-proxy's --cluster-cidr"
    if mode == "nftables":
        table = _nft_table(snap)
        found_nft = nft_cluster_cidr(table) if table is not None else None
        if found_nft:
            return found_nft, (f"the cluster CIDR kube-proxy's rules name (nft {table.family} "
                               f"kube-proxy: ip saddr != {found_nft} jump mark-for-masquerade)"
                               if table is not None else "")
        return None, ("no cluster CIDR in kube-proxy's flags or rules: predicted without a "
                      "local traffic detector")
    found = pod_cidrs_in_rules(snap)
    if found:
        return found[0][0], f"the cluster CIDR kube-proxy's rules name ({found[0][1]})"
    return None, ("no cluster CIDR in kube-proxy's flags or rules: predicted without a "
                  "local traffic detector")


def _endpoints(snap: NodeSnapshot, facts: NodeFacts, mode: str, svc: Service, port: int,
               protocol: str, key: str,
               pod_net: ipaddress.IPv4Network | ipaddress.IPv6Network | None
               ) -> tuple[tuple[Endpoint, ...], str]:
    """(the endpoints, in the order the rules list them; why they could not be read)."""
    assert svc.cluster_ip is not None

    def local(ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return bool((pod_net is not None and addr in pod_net) or facts.is_local(ip))

    if mode == "nftables":
        return _nft_endpoints(snap, svc.cluster_ip, port, protocol, local)
    if mode == "ipvs":
        if snap.ipvs is None:
            return (), "IPVS is not in the input (`ipvsadm -Ln`)"
        vs = facts.virtual_server(protocol, svc.cluster_ip, port)
        if vs is None:
            return (), f"no IPVS virtual server {protocol} {svc.cluster_ip}:{port}"
        return tuple(Endpoint(r.address, r.port, local(r.address))
                     for r in vs.real_servers if r.weight != 0), ""  # (0: draining)
    nat = snap.netfilter.table("nat") if snap.netfilter else None
    if nat is None:
        return (), "the nat rules are not in the input"
    chain = nat.chain(f"KUBE-SVC-{chain_hash(key, protocol)}")
    if chain is None:
        # kube-proxy writes no service chain for a port without endpoints (its filter
        # rules reject it): none, unless the rules are an excerpt
        return (), ("its KUBE-SVC chain is not in the excerpt" if snap.netfilter and
                    snap.netfilter.partial else "")
    out: list[Endpoint] = []
    for i, text in enumerate(chain.rules.texts):
        r = parse_rule_text(text, chain.rules.source(i))
        sep = nat.chain(r.target) if r.target and r.target.startswith("KUBE-SEP-") else None
        for j, sep_text in enumerate(sep.rules.texts if sep else ()):
            s = parse_rule_text(sep_text, sep.rules.source(j)) if sep else None
            to = s.target_opts.get("--to-destination", "") if s and s.target == "DNAT" else ""
            host, _, port_text = to.rpartition(":")
            if host and port_text.isdigit():
                host = host.strip("[]")
                out.append(Endpoint(host, int(port_text), local(host)))
    return tuple(dict.fromkeys(out)), ""


def _nft_table(snap: NodeSnapshot) -> NftTable | None:
    rs, _problems = ruleset_of(snap)
    return rs.kube_proxy if rs is not None else None


def _nft_endpoints(snap: NodeSnapshot, cluster_ip: str, port: int, protocol: str,
                   local: Callable[[str], bool]) -> tuple[tuple[Endpoint, ...], str]:
    """kube-proxy's nftables table: the ClusterIP's @service-ips element goes to the
    port's service chain, whose `numgen random mod N vmap { 0 : goto endpoint-..., ... }`
    numbers its endpoint chains, each DNATing (`dnat to IP:PORT`)."""
    table = _nft_table(snap)
    if table is None:
        return (), "kube-proxy's nftables table (ip kube-proxy) is not in the input"
    svc_ips = table.set("service-ips")
    if svc_ips is None:
        return (), "the service-ips map of kube-proxy's nftables table is not in the input"
    key = (cluster_ip, protocol.lower(), str(port))
    verdict = _service_ips(svc_ips).get(key)
    if verdict is None:
        # kube-proxy sends a port without endpoints to @no-endpoint-services: none
        return (), ""
    chain = table.chain(verdict.split()[-1])
    if chain is None:
        return (), f"its service chain {verdict.split()[-1]} is not in the input"
    names: list[str] = []
    for r in chain.rules:
        names += _vmap_targets(r.tokens)
    out: list[Endpoint] = []
    for name in names:
        ep = table.chain(name)
        for r in ep.rules if ep else ():
            words = [w for w in r.tokens if isinstance(w, str)]
            for i, w in enumerate(words[:-2]):
                if w == "dnat" and words[i + 1] == "to":
                    host, _, port_text = words[i + 2].rpartition(":")
                    if host and port_text.isdigit():
                        host = host.strip("[]")
                        out.append(Endpoint(host, int(port_text), local(host)))
    return tuple(dict.fromkeys(out)), ""


# the last @service-ips read, by identity (hashing the map would cost what reading it does)
_SERVICE_IPS: list[tuple[NftSet, dict[tuple[str, ...], str]]] = []


def _service_ips(svc_ips: NftSet) -> dict[tuple[str, ...], str]:
    """@service-ips by its key (address, protocol, port), read once per map (a node of
    10k Services has 30k elements, and each port asks)."""
    if _SERVICE_IPS and _SERVICE_IPS[0][0] is svc_ips:
        return _SERVICE_IPS[0][1]
    out: dict[tuple[str, ...], str] = {}
    for k, v in svc_ips.elements:
        if v:
            out.setdefault(k, v)
    _SERVICE_IPS[:] = [(svc_ips, out)]
    return out


def _vmap_targets(tokens: tuple[Token, ...]) -> list[str]:
    """The chains of a rule's `vmap { N : goto CHAIN, ... }` (in its order)."""
    out: list[str] = []
    for i, tok in enumerate(tokens[:-1]):
        group = tokens[i + 1]
        if tok != "vmap" or not isinstance(group, tuple):
            continue
        words = [w for w in group if isinstance(w, str)]
        out += [words[k + 1] for k in range(len(words) - 1)
                if words[k] in ("goto", "jump") and words[k + 1].startswith("endpoint-")]
    return out
