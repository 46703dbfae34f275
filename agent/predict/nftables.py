"""What kube-proxy in nftables mode writes for a node's Services: the knftables
transaction of its proxier for table `ip kube-proxy` (or `ip6 kube-proxy`), as `nft -f`
takes it (pkg/proxy/nftables/proxier.go, v1.31+ generation).

The base chains, sets and maps are those of the proxier's test expectations
(proxier_test.go, baseRules; tests/data/realworld/k8s-nftables-overall-rules-*). Each
Service port adds, as syncProxyRules writes them: a `service-` chain (the ClusterIP's
masquerade rule for traffic from outside the cluster CIDR, then a `numgen random`
verdict map over its endpoint chains), an `external-` chain (Cluster: mark for masquerade
and go to the service chain; Local: short-circuit pod and local traffic to the service
chain, then go to the `local-` chain of the node's own endpoints when it has some), an
`endpoint-` chain per endpoint (masquerade hairpin traffic, DNAT), a `firewall-` chain
for loadBalancerSourceRanges, and the elements of `cluster-ips`, `service-ips`,
`service-nodeports`, `firewall-ips` and `no-endpoint-services`/`no-endpoint-nodeports`
(drop where eTP=Local has no local endpoint, the reject chain where the port has none).
Without a local traffic detector (no --cluster-cidr) the two rules that need it are left
out, as the proxier does (both under localDetector.IsImplemented()). ``before_132456``
writes the filter chains as kube-proxy did before kubernetes#132456 (v1.34.0; v1.33.6).

Chain names carry an 8-character base32 hash of the service port (and endpoint) as
kube-proxy's do; the hash input is ours (the names are opaque to the walk).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable

from agent.predict.model import Endpoint, ServicePort

__all__ = ["Endpoint", "ServicePort", "nftables_rules"]


def _h8(data: str) -> str:
    return base64.b32encode(hashlib.sha256(data.encode()).digest()[:5]).decode()


# kubernetes#132456 (v1.34.0, v1.33.6 by #133969) split the pre-DNAT filter chains off
# and moved the others to priority 0; before it (nftablesBaseChains/nftablesJumpChains):
_BEFORE_132456 = {
    "add chain {t} filter-prerouting-pre-dnat {{ type filter hook prerouting priority -110 ; }}":
        "add chain {t} filter-prerouting {{ type filter hook prerouting priority -110 ; }}",
    "add chain {t} filter-output-pre-dnat {{ type filter hook output priority -110 ; }}":
        "add chain {t} filter-output-post-dnat {{ type filter hook output priority -90 ; }}",
    "add chain {t} filter-forward {{ type filter hook forward priority 0 ; }}":
        "add chain {t} filter-forward {{ type filter hook forward priority -110 ; }}",
    "add chain {t} filter-input {{ type filter hook input priority 0 ; }}":
        "add chain {t} filter-input {{ type filter hook input priority -110 ; }}",
    "add chain {t} filter-output {{ type filter hook output priority 0 ; }}":
        "add chain {t} filter-output {{ type filter hook output priority -110 ; }}",
    "add rule {t} filter-prerouting-pre-dnat ct state new jump firewall-check":
        "add rule {t} filter-prerouting ct state new jump firewall-check",
    "add rule {t} filter-output-pre-dnat ct state new jump firewall-check":
        "add rule {t} filter-output ct state new jump firewall-check",
    "add rule {t} filter-output ct state new jump cluster-ips-check":
        "add rule {t} filter-output-post-dnat ct state new jump cluster-ips-check",
}


def _base(t: str, ip: str, node_ips: Iterable[str], service_cidr: str | None,
          before_132456: bool) -> list[str]:
    addr = "ipv6_addr" if ip == "ip6" else "ipv4_addr"
    lines = [
        f'add table {t} {{ comment "rules for kube-proxy" ; }}',
        f'add set {t} cluster-ips {{ type {addr} ; comment "Active ClusterIPs" ; }}',
        f'add set {t} nodeport-ips {{ type {addr} ; comment "IPs that accept NodePort '
        'traffic" ; }',
        f"add map {t} firewall-ips {{ type {addr} . inet_proto . inet_service : verdict ; "
        'comment "destinations that are subject to LoadBalancerSourceRanges" ; }',
        f"add map {t} no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; "
        'comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }',
        f"add map {t} no-endpoint-services {{ type {addr} . inet_proto . inet_service : "
        'verdict ; comment "vmap to drop or reject packets to services with no endpoints" ; }',
        f"add map {t} service-ips {{ type {addr} . inet_proto . inet_service : verdict ; "
        'comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }',
        f"add map {t} service-nodeports {{ type inet_proto . inet_service : verdict ; "
        'comment "NodePort traffic" ; }',
        f"add chain {t} cluster-ips-check",
        f"add chain {t} filter-prerouting-pre-dnat {{ type filter hook prerouting priority "
        "-110 ; }",
        f"add chain {t} filter-output-pre-dnat {{ type filter hook output priority -110 ; }}",
        f"add chain {t} filter-forward {{ type filter hook forward priority 0 ; }}",
        f"add chain {t} filter-input {{ type filter hook input priority 0 ; }}",
        f"add chain {t} filter-output {{ type filter hook output priority 0 ; }}",
        f"add chain {t} firewall-check",
        f"add chain {t} mark-for-masquerade",
        f"add chain {t} masquerading",
        f"add chain {t} nat-output {{ type nat hook output priority -100 ; }}",
        f"add chain {t} nat-postrouting {{ type nat hook postrouting priority 100 ; }}",
        f"add chain {t} nat-prerouting {{ type nat hook prerouting priority -100 ; }}",
        f"add chain {t} nodeport-endpoints-check",
        f'add chain {t} reject-chain {{ comment "helper for @no-endpoint-services / '
        '@no-endpoint-nodeports" ; }',
        f"add chain {t} services",
        f"add chain {t} service-endpoints-check",
        f'add rule {t} cluster-ips-check {ip} daddr @cluster-ips reject comment "Reject '
        'traffic to invalid ports of ClusterIPs"',
        *([f"add rule {t} cluster-ips-check {ip} daddr {{ {service_cidr} }} drop comment "
           '"Drop traffic to unallocated ClusterIPs"'] if service_cidr else []),
        f"add rule {t} filter-prerouting-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-forward ct state new jump service-endpoints-check",
        f"add rule {t} filter-forward ct state new jump cluster-ips-check",
        f"add rule {t} filter-input ct state new jump nodeport-endpoints-check",
        f"add rule {t} filter-input ct state new jump service-endpoints-check",
        f"add rule {t} filter-output ct state new jump service-endpoints-check",
        f"add rule {t} filter-output-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-output ct state new jump cluster-ips-check",
        f"add rule {t} firewall-check {ip} daddr . meta l4proto . th dport vmap @firewall-ips",
        f"add rule {t} mark-for-masquerade mark set mark or 0x4000",
        f"add rule {t} masquerading mark and 0x4000 == 0 return",
        f"add rule {t} masquerading mark set mark xor 0x4000",
        f"add rule {t} masquerading masquerade fully-random",
        f"add rule {t} nat-output jump services",
        f"add rule {t} nat-postrouting jump masquerading",
        f"add rule {t} nat-prerouting jump services",
        f"add rule {t} nodeport-endpoints-check {ip} daddr @nodeport-ips meta l4proto . th "
        "dport vmap @no-endpoint-nodeports",
        f"add rule {t} reject-chain reject",
        f"add rule {t} services {ip} daddr . meta l4proto . th dport vmap @service-ips",
        f"add rule {t} services {ip} daddr @nodeport-ips meta l4proto . th dport vmap "
        "@service-nodeports",
        *(f"add element {t} nodeport-ips {{ {a} }}" for a in node_ips),
        f"add rule {t} service-endpoints-check {ip} daddr . meta l4proto . th dport vmap "
        "@no-endpoint-services",
    ]
    if before_132456:
        for i, line in enumerate(lines):
            for new, old in _BEFORE_132456.items():
                if line == new.format(t=t):
                    lines[i] = old.format(t=t)
    return lines


def _host(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def nftables_rules(ports: Iterable[ServicePort], *, family: int = 4,
                   cluster_cidr: str | None, node_ips: Iterable[str],
                   service_cidr: str | None = None, before_132456: bool = False) -> str:
    """The transaction (`nft -f` text) kube-proxy's ``family`` proxier writes for
    ``ports``; ``cluster_cidr`` None: kube-proxy without a local traffic detector."""
    ip = "ip6" if family == 6 else "ip"
    t = f"{ip} kube-proxy"
    out = _base(t, ip, node_ips, service_cidr, before_132456)
    for sp in ports:
        out += _service_port(t, ip, sp, cluster_cidr)
    return "\n".join(out) + "\n"


def _service_port(t: str, ip: str, sp: ServicePort, cluster_cidr: str | None) -> list[str]:
    proto = sp.protocol.lower()
    name = f"{sp.namespace}/{sp.name}/{proto}/{sp.port_name}"
    base = f"{_h8(sp.key + proto)}-{name}"
    cluster, external, local = f"service-{base}", f"external-{base}", f"local-{base}"
    firewall = f"firewall-{base}"
    eps = {e: f"endpoint-{_h8(sp.key + proto + e.ip)}-{name}__"
              f"{e.ip.replace(':', '.')}/{e.port}" for e in sp.endpoints}
    local_eps = [c for e, c in eps.items() if e.local]
    external_ips = (*sp.external_ips, *sp.lb_ips)
    uses_external = bool(sp.lb_ips or sp.node_port or sp.external_ips)
    etp_local = sp.etp_local and uses_external
    uses_local = bool(etp_local and local_eps)
    comment = f'comment "{sp.key}"'
    out = [f"# {sp.namespace}/{sp.name}"]
    if not eps:
        # no endpoint at all: every address of the port goes to the reject chain
        for a in (sp.cluster_ip, *external_ips):
            out.append(f"add element {t} no-endpoint-services {{ {a} . {proto} . {sp.port} "
                       f"{comment} : goto reject-chain }}")
        if sp.node_port:
            out.append(f"add element {t} no-endpoint-nodeports {{ {proto} . {sp.node_port} "
                       f"{comment} : goto reject-chain }}")
        out.append(f"add element {t} cluster-ips {{ {sp.cluster_ip} }}")
        out.append("")
        return out
    fw = bool(sp.source_ranges and sp.lb_ips)
    # (the chains first: `nft -f` refuses a jump to a chain not made yet)
    out += [f"add chain {t} {c}" for c in (
        cluster, *((external,) if uses_external else ()), *((local,) if uses_local else ()),
        *eps.values(), *((firewall,) if fw else ()))]
    if cluster_cidr:
        out.append(f"add rule {t} {cluster} {ip} daddr {sp.cluster_ip} {proto} dport "
                   f"{sp.port} {ip} saddr != {cluster_cidr} jump mark-for-masquerade")
    out.append(_to_endpoints(t, cluster, list(eps.values())))
    if uses_external:
        if not etp_local:
            out.append(f"add rule {t} {external} jump mark-for-masquerade")
            out.append(f"add rule {t} {external} goto {cluster}")
        else:
            if cluster_cidr:
                out.append(f"add rule {t} {external} {ip} saddr {cluster_cidr} goto {cluster} "
                           'comment "short-circuit pod traffic"')
            out.append(f"add rule {t} {external} fib saddr type local jump "
                       'mark-for-masquerade comment "masquerade local traffic"')
            out.append(f"add rule {t} {external} fib saddr type local goto {cluster} "
                       'comment "short-circuit local traffic"')
            if uses_local:
                out.append(f"add rule {t} {external} goto {local}")
                out.append(_to_endpoints(t, local, local_eps))
    for e, chain in eps.items():
        out.append(f"add rule {t} {chain} {ip} saddr {e.ip} jump mark-for-masquerade")
        out.append(f"add rule {t} {chain} meta l4proto {proto} dnat to {_host(e.ip, e.port)}")
    out.append(f"add element {t} cluster-ips {{ {sp.cluster_ip} }}")
    out.append(f"add element {t} service-ips {{ {sp.cluster_ip} . {proto} . {sp.port} : "
               f"goto {cluster} }}")
    no_external = etp_local and not local_eps
    for a in external_ips:
        out.append(f"add element {t} service-ips {{ {a} . {proto} . {sp.port} : goto "
                   f"{external} }}")
        if no_external:
            out.append(f"add element {t} no-endpoint-services {{ {a} . {proto} . {sp.port} "
                       f"{comment} : drop }}")
    if sp.node_port:
        out.append(f"add element {t} service-nodeports {{ {proto} . {sp.node_port} : goto "
                   f"{external} }}")
        if no_external:
            out.append(f"add element {t} no-endpoint-nodeports {{ {proto} . {sp.node_port} "
                       f"{comment} : drop }}")
    if fw:
        out.append(f"add rule {t} {firewall} {ip} saddr != {{ {', '.join(sp.source_ranges)} }} "
                   "drop")
        out += [f"add element {t} firewall-ips {{ {a} . {proto} . {sp.port} {comment} : goto "
                f"{firewall} }}" for a in sp.lb_ips]
    out.append("")
    return out


def _to_endpoints(t: str, chain: str, endpoints: list[str]) -> str:
    """writeServiceToEndpointRules: a random choice over the endpoint chains."""
    vmap = " , ".join(f"{i} : goto {ep}" for i, ep in enumerate(endpoints))
    return f"add rule {t} {chain} numgen random mod {len(endpoints)} vmap {{ {vmap} }}"
