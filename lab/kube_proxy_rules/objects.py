"""The Kubernetes API objects and the node's text outputs (addresses, local table,
sysctls) that go with a lab node."""


from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lab.kube_proxy_rules.common import IngressSpec, LbService

# --- Kubernetes API objects -----------------------------------------------------------


def services_json(services: Iterable[LbService]) -> dict[str, Any]:
    """``kubectl get svc -A -o json``; ports of one Service are merged into one item."""
    items: dict[tuple[str, str], dict[str, Any]] = {}
    for svc in services:
        key = (svc.namespace, svc.name)
        port: dict[str, Any] = {"name": svc.port_name, "port": svc.port,
                                "protocol": svc.protocol, "targetPort": svc.target_port}
        if svc.node_port:
            port["nodePort"] = svc.node_port
        if key in items:
            items[key]["spec"]["ports"].append(port)
            continue
        spec: dict[str, Any] = {
            "clusterIP": svc.cluster_ip, "clusterIPs": [svc.cluster_ip],
            "internalTrafficPolicy": "Cluster",
            "ipFamilies": ["IPv6" if ":" in svc.cluster_ip else "IPv4"],
            "ipFamilyPolicy": "SingleStack", "ports": [port], "sessionAffinity": "None",
            "type": svc.type,
        }
        if svc.type != "ClusterIP":
            spec["externalTrafficPolicy"] = svc.etp
        if svc.type == "LoadBalancer":
            spec["allocateLoadBalancerNodePorts"] = True
            if svc.health_check_node_port:
                spec["healthCheckNodePort"] = svc.health_check_node_port
        if svc.external_ips:
            spec["externalIPs"] = list(svc.external_ips)
        if svc.source_ranges:
            spec["loadBalancerSourceRanges"] = list(svc.source_ranges)
        metadata: dict[str, Any] = {"name": svc.name, "namespace": svc.namespace}
        if svc.annotations:
            metadata["annotations"] = dict(svc.annotations)
        status: dict[str, Any] = {"loadBalancer": {}}
        if svc.lb_ip:
            status["loadBalancer"] = {"ingress": [{"ip": svc.lb_ip}]}
        items[key] = {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
                      "spec": spec, "status": status}
    return {"apiVersion": "v1", "items": list(items.values()), "kind": "List",
            "metadata": {"resourceVersion": ""}}


def node_json(name: str, pod_cidr: str, internal_ip: str) -> dict[str, Any]:
    """``kubectl get node NAME -o json`` (the fields the agent reads)."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                              "kubernetes.io/os": "linux"}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": internal_ip},
                                 {"type": "Hostname", "address": name}]},
    }


def ingresses_json(ingresses: Iterable[IngressSpec]) -> dict[str, Any]:
    """``kubectl get ingress -A -o json`` (networking.k8s.io/v1)."""
    items = []
    for ing in ingresses:
        path = {"path": "/", "pathType": "Prefix",
                "backend": {"service": {"name": ing.service_name,
                                        "port": {"number": ing.service_port}}}}
        rule: dict[str, Any] = {"http": {"paths": [path]}}
        if ing.host:
            rule["host"] = ing.host
        spec: dict[str, Any] = {"rules": [rule]}
        if ing.tls:
            spec["tls"] = [{"hosts": [ing.host] if ing.host else [],
                            "secretName": f"{ing.name}-tls"}]
        metadata: dict[str, Any] = {"name": ing.name, "namespace": ing.namespace}
        if ing.annotations:
            metadata["annotations"] = dict(ing.annotations)
        items.append({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                      "metadata": metadata, "spec": spec,
                      "status": {"loadBalancer": {"ingress": [{"ip": ing.ip}]}}})
    return {"apiVersion": "v1", "items": items, "kind": "List",
            "metadata": {"resourceVersion": ""}}


# --- node text outputs (addresses, local table, sysctls) ------------------------------


def ip_addr_text(interfaces: Sequence[tuple[str, str, Sequence[str]]]) -> str:
    """``ip addr show`` for (ifname, state "UP"/"DOWN", ["a.b.c.d/len", ...])."""
    out: list[str] = []
    for idx, (ifname, state, addrs) in enumerate(interfaces, 1):
        if ifname == "lo":
            out.append(f"{idx}: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state "
                       "UNKNOWN group default qlen 1000")
            out.append("    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00")
        elif state == "UP":
            out.append(f"{idx}: {ifname}: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc "
                       "noqueue state UP group default qlen 1000")
            out.append(f"    link/ether 52:54:00:00:00:{idx:02x} brd ff:ff:ff:ff:ff:ff")
        else:  # kube-ipvs0: a dummy that kube-proxy never sets up
            out.append(f"{idx}: {ifname}: <BROADCAST,NOARP> mtu 1500 qdisc noop state DOWN "
                       "group default")
            out.append(f"    link/ether 6a:00:00:00:00:{idx:02x} brd ff:ff:ff:ff:ff:ff")
        for a in addrs:
            iface = ipaddress.ip_interface(a)
            scope = "host" if iface.ip.is_loopback else "global"
            brd = ""
            if iface.network.prefixlen < 31 and not iface.ip.is_loopback:
                brd = f" brd {iface.network.broadcast_address}"
            out.append(f"    inet {a}{brd} scope {scope} {ifname}")
            out.append("       valid_lft forever preferred_lft forever")
    return "\n".join(out) + "\n"


def route_local_text(interfaces: Sequence[tuple[str, str, Sequence[str]]]) -> str:
    """``ip route show table local`` for the same interface list (kernel trie order,
    trailing space included as iproute2 prints it)."""
    routes: list[tuple[int, int, str]] = []
    for ifname, _state, addrs in interfaces:
        for a in addrs:
            iface = ipaddress.ip_interface(a)
            ip = str(iface.ip)
            if iface.ip.is_loopback:
                net = iface.network
                routes.append((int(net.network_address), 0,
                               f"local {net} dev lo proto kernel scope host src {ip} "))
            routes.append((int(iface.ip), 1, f"local {ip} dev {ifname} proto kernel scope host "
                                             f"src {ip} "))
            if iface.network.prefixlen < 31:
                b = iface.network.broadcast_address
                routes.append((int(b), 1, f"broadcast {b} dev {ifname} proto kernel scope link "
                                          f"src {ip} "))
    routes.sort()
    return "".join(r[2] + "\n" for r in routes)


def sysctl_text(values: Mapping[str, str | int]) -> str:
    """``sysctl -a`` lines for the given keys."""
    return "".join(f"{k} = {v}\n" for k, v in sorted(values.items()))


