"""kube-proxy's nftables mode: the knftables transaction its proxier writes for table
`ip kube-proxy` (pkg/proxy/nftables/proxier.go, v1.31+ generation), as `nft -f` takes it.

The base chains, sets and maps are those of the proxier's test expectations
(proxier_test.go, baseRules: tests/data/realworld/k8s-nftables-overall-rules-*); each
Service port adds, as syncProxyRules writes them: a `service-` chain (the cluster IP's
masquerade rule for traffic from outside the cluster CIDR, then a `numgen random` verdict
map over its endpoint chains), an `external-` chain (Cluster: mark for masquerade and go
to the service chain; Local: short-circuit pod and local traffic to the service chain,
then go to the `local-` chain of the node's own endpoints when it has some), an
`endpoint-` chain per endpoint (masquerade hairpin traffic, DNAT), and the elements of
`cluster-ips`, `service-ips`, `service-nodeports` and, where eTP=Local has no local
endpoint, the `drop` elements of `no-endpoint-services` and `no-endpoint-nodeports`.
Chain names carry an 8-character base32 hash of the service port (and endpoint) as
kube-proxy's do; its input here is ours (the names are opaque to the agent)."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable

from lab.kube_proxy_rules.common import LbService

TABLE = "ip kube-proxy"


def _h8(data: str) -> str:
    return base64.b32encode(hashlib.sha256(data.encode()).digest()[:5]).decode()


def _base(node_ip: str, service_cidr: str) -> list[str]:
    t = TABLE
    return [
        f'add table {t} {{ comment "rules for kube-proxy" ; }}',
        f'add set {t} cluster-ips {{ type ipv4_addr ; comment "Active ClusterIPs" ; }}',
        f'add set {t} nodeport-ips {{ type ipv4_addr ; comment "IPs that accept NodePort '
        'traffic" ; }',
        f"add map {t} firewall-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; "
        'comment "destinations that are subject to LoadBalancerSourceRanges" ; }',
        f"add map {t} no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; "
        'comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }',
        f"add map {t} no-endpoint-services {{ type ipv4_addr . inet_proto . inet_service : "
        'verdict ; comment "vmap to drop or reject packets to services with no endpoints" ; }',
        f"add map {t} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; "
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
        f'add rule {t} cluster-ips-check ip daddr @cluster-ips reject comment "Reject '
        'traffic to invalid ports of ClusterIPs"',
        f"add rule {t} cluster-ips-check ip daddr {{ {service_cidr} }} drop comment \"Drop "
        'traffic to unallocated ClusterIPs"',
        f"add rule {t} filter-prerouting-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-forward ct state new jump service-endpoints-check",
        f"add rule {t} filter-forward ct state new jump cluster-ips-check",
        f"add rule {t} filter-input ct state new jump nodeport-endpoints-check",
        f"add rule {t} filter-input ct state new jump service-endpoints-check",
        f"add rule {t} filter-output ct state new jump service-endpoints-check",
        f"add rule {t} filter-output-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-output ct state new jump cluster-ips-check",
        f"add rule {t} firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips",
        f"add rule {t} mark-for-masquerade mark set mark or 0x4000",
        f"add rule {t} masquerading mark and 0x4000 == 0 return",
        f"add rule {t} masquerading mark set mark xor 0x4000",
        f"add rule {t} masquerading masquerade fully-random",
        f"add rule {t} nat-output jump services",
        f"add rule {t} nat-postrouting jump masquerading",
        f"add rule {t} nat-prerouting jump services",
        f"add rule {t} nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th "
        "dport vmap @no-endpoint-nodeports",
        f"add rule {t} reject-chain reject",
        f"add rule {t} services ip daddr . meta l4proto . th dport vmap @service-ips",
        f"add rule {t} services ip daddr @nodeport-ips meta l4proto . th dport vmap "
        "@service-nodeports",
        f"add element {t} nodeport-ips {{ {node_ip} }}",
        f"add rule {t} service-endpoints-check ip daddr . meta l4proto . th dport vmap "
        "@no-endpoint-services",
    ]


def _to_endpoints(chain: str, endpoints: list[str]) -> str:
    """writeServiceToEndpointRules: a random choice over the endpoint chains."""
    vmap = " , ".join(f"{i} : goto {ep}" for i, ep in enumerate(endpoints))
    return f"add rule {TABLE} {chain} numgen random mod {len(endpoints)} vmap {{ {vmap} }}"


def nftables_mode(services: Iterable[LbService], *, cluster_cidr: str, node_ip: str,
                  service_cidr: str) -> str:
    """The transaction (`nft -f` text) for ``services`` (TCP ports with endpoints; no
    session affinity or source ranges: what synthetic() makes)."""
    t = TABLE
    out = _base(node_ip, service_cidr)
    for svc in services:
        proto = svc.protocol.lower()
        base = (f"{_h8(svc.port_name_key + proto)}-{svc.namespace}/{svc.name}/{proto}/"
                f"{svc.port_name}")
        cluster, external, local = f"service-{base}", f"external-{base}", f"local-{base}"
        eps = {ip: f"endpoint-{_h8(svc.port_name_key + proto + ip)}-{svc.namespace}/"
                   f"{svc.name}/{proto}/{svc.port_name}__{ip}/{svc.target_port}"
               for ip in (*svc.local_endpoints, *svc.remote_endpoints)}
        etp_local = svc.etp == "Local" and (svc.lb_ip or svc.node_port)
        uses_external = bool(svc.lb_ip or svc.node_port or svc.external_ips)
        uses_local = bool(uses_external and etp_local and svc.local_endpoints)
        out.append(f"# {svc.namespace}/{svc.name}")
        # (the chains first: `nft -f` refuses a jump to a chain not made yet)
        out += [f"add chain {t} {c}" for c in (
            cluster, *((external,) if uses_external else ()), *((local,) if uses_local else ()),
            *eps.values())]
        out.append(f"add rule {t} {cluster} ip daddr {svc.cluster_ip} {proto} dport "
                   f"{svc.port} ip saddr != {cluster_cidr} jump mark-for-masquerade")
        out.append(_to_endpoints(cluster, list(eps.values())))
        if uses_external:
            if not etp_local:
                out.append(f"add rule {t} {external} jump mark-for-masquerade")
                out.append(f"add rule {t} {external} goto {cluster}")
            else:
                out.append(f"add rule {t} {external} ip saddr {cluster_cidr} goto {cluster} "
                           'comment "short-circuit pod traffic"')
                out.append(f"add rule {t} {external} fib saddr type local jump "
                           'mark-for-masquerade comment "masquerade local traffic"')
                out.append(f"add rule {t} {external} fib saddr type local goto {cluster} "
                           'comment "short-circuit local traffic"')
                if uses_local:
                    out.append(f"add rule {t} {external} goto {local}")
                    out.append(_to_endpoints(local, [eps[ip] for ip in svc.local_endpoints]))
        for ip, chain in eps.items():
            out.append(f"add rule {t} {chain} ip saddr {ip} jump mark-for-masquerade")
            out.append(f"add rule {t} {chain} meta l4proto {proto} dnat to "
                       f"{ip}:{svc.target_port}")
        out.append(f"add element {t} cluster-ips {{ {svc.cluster_ip} }}")
        out.append(f"add element {t} service-ips {{ {svc.cluster_ip} . {proto} . "
                   f"{svc.port} : goto {cluster} }}")
        no_external = etp_local and not svc.local_endpoints
        comment = f'comment "{svc.namespace}/{svc.name}:{svc.port_name}"'
        for ip in (*svc.external_ips, *((svc.lb_ip,) if svc.lb_ip else ())):
            out.append(f"add element {t} service-ips {{ {ip} . {proto} . {svc.port} : "
                       f"goto {external} }}")
            if no_external:
                out.append(f"add element {t} no-endpoint-services {{ {ip} . {proto} . "
                           f"{svc.port} {comment} : drop }}")
        if svc.node_port:
            out.append(f"add element {t} service-nodeports {{ {proto} . {svc.node_port} : "
                       f"goto {external} }}")
            if no_external:
                out.append(f"add element {t} no-endpoint-nodeports {{ {proto} . "
                           f"{svc.node_port} {comment} : drop }}")
        out.append("")
    return "\n".join(out) + "\n"
