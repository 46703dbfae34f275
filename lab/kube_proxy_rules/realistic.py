"""Support bundles shaped like real nodes' (issue 31), for the benchmark and its test.

``synthetic()`` (synthetic.py) makes the lightest bundle that holds a node's LB IPs:
compact ``services.json`` of bare Services, ``ipvsadm -S`` save form, one port each, the
same two endpoints shapes over and over. What `loopback-agent bundle` writes on a real
node, and what people paste, is heavier, and that is what ``realistic()`` makes:

* ``services.json`` as ``kubectl get svc -A -o json`` prints it: 4-space indent, keys
  sorted (Go's encoding of an unstructured object), each Service with metadata (labels,
  a cloud controller's annotation on most, uid, resourceVersion, creationTimestamp;
  managedFields left out as kubectl leaves them out), the whole spec (clusterIP(s),
  ports with nodePort/targetPort/protocol/name, selector, type LoadBalancer,
  externalTrafficPolicy, healthCheckNodePort, sessionAffinity, ipFamilies,
  ipFamilyPolicy, internalTrafficPolicy, allocateLoadBalancerNodePorts) and
  status.loadBalancer.ingress (``ipMode: VIP`` on about half): some 1.7 KB a Service;
* 2-5 endpoints a Service (some on this node's pods), about 30 % eTP=Local (with a
  health check NodePort), about 10 % with a second port (https), NodePorts and cluster
  IPs allocated at random as the API server does (a widened NodePort range: past its
  35,536 ports the rest have none, allocateLoadBalancerNodePorts false);
* iptables mode: ``iptables-save`` of kube-proxy's new generation (iptables.py), an empty
  ``ipset save`` (ip_set not loaded), no ipvsadm.txt (ip_vs not loaded: `bundle` skips
  it);
* IPVS mode: ``ipvsadm -Ln`` (what `bundle` writes, not the ``-S`` save form) in the
  kernel's hash order with connection counters, ``ipset save``, the iptables rules
  (ipvs.py); half the LB VIPs bound on kube-ipvs0 (upstream's proxier) and half not
  (TKE's), every bound address in ``ip addr``, the KUBE-IPVS-IPS set and the local table;
* nftables mode: ``nft list ruleset`` (``nft-ruleset.txt``, what `bundle` writes) of
  kube-proxy's transaction (nftables.py) as nft prints it back (sets before chains,
  priority names, ``meta mark`` expressions, 2 addresses a line in a set's elements),
  and ``iptables-save`` holding kubelet's chains only;
* ``ip -j addr show`` (what `bundle` writes) with a veth per local pod, both families'
  local tables (``ip route`` and ``ip -6 route show table local``), the probe's sysctls,
  ``node.json``.

``realistic(..., with_services=False)`` leaves services.json out: the LB IPs are then
learned from the rules alone. Deterministic for a given seed; pure, no I/O.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import random
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lab.kube_proxy_rules.common import _IPTABLES_VERSION, _SAVE_DATE, LbService
from lab.kube_proxy_rules.iptables import iptables_mode
from lab.kube_proxy_rules.ipvs import ipvs_mode
from lab.kube_proxy_rules.nftables import nftables_mode
from lab.kube_proxy_rules.objects import node_json, route_local_text, sysctl_text
from lab.kube_proxy_rules.synthetic import NODE_SYSCTLS

MODES = ("iptables", "ipvs", "nftables")
NODE_IP = "10.0.0.10"
NODE_NAME = "10.0.0.10"  # (TKE names its nodes by their address)
POD_CIDR = "172.16.1.0/24"
CLUSTER_CIDR = "172.16.0.0/16"
SERVICE_CIDR = "10.96.0.0/12"
LB_NET = "10.64.0.0/14"  # the VPC range the cloud's load balancers take their VIPs from
LOCAL_PODS = 110  # kubelet's default maxPods: this node's pods, 172.16.1.2-111
LOCAL_SHARE = 0.08  # of endpoints on this node
NODE_PORTS = range(30000, 65536)  # a widened --service-node-port-range
ETP_LOCAL_SHARE = 0.30
TWO_PORT_SHARE = 0.10
IPMODE_VIP_SHARE = 0.5
BOUND_SHARE = 0.5  # LB VIPs on kube-ipvs0 (upstream IPVS); the rest not (TKE)
ANNOTATED_SHARE = 0.6  # Services with a cloud controller's annotation

_APPS = ("api", "web", "gateway", "checkout", "cart", "payments", "search", "catalog",
         "auth", "orders", "inventory", "billing", "notify", "media", "metrics", "ingress",
         "grpc-edge", "reports", "profile", "ledger")
_TEAMS = ("shop", "platform", "data", "mobile", "ads", "risk", "infra", "growth")
_CLOUD_ANNOTATIONS = (  # what a cloud's controller or a chart sets on an LB Service
    ("service.kubernetes.io/qcloud-loadbalancer-internal-subnetid", "subnet-{h8}"),
    ("service.cloud.tencent.com/direct-access", "false"),
    ("service.kubernetes.io/loadbalance-id", "lb-{h8}"),
    ("service.beta.kubernetes.io/aws-load-balancer-type", "nlb"),
    ("service.beta.kubernetes.io/aws-load-balancer-internal", "true"),
)


@dataclass(frozen=True)
class RealService:
    """One LoadBalancer Service of a realistic bundle (its ports, one LbService each)."""

    ports: tuple[LbService, ...]
    app: str
    uid: str
    resource_version: str
    created: str
    ip_mode_vip: bool
    bound: bool  # its LB VIP on kube-ipvs0 (IPVS mode)
    annotations: tuple[tuple[str, str], ...]

    @property
    def first(self) -> LbService:
        return self.ports[0]


def realistic_services(n_services: int, seed: int = 0) -> list[RealService]:
    """``n_services`` LoadBalancer Services as described in the module docstring."""
    rng = random.Random(seed)
    svc_net = ipaddress.IPv4Network(SERVICE_CIDR)
    lb_net = ipaddress.IPv4Network(LB_NET)
    # random unique addresses and NodePorts, as the API server allocates them
    cluster_ips = rng.sample(range(11, svc_net.num_addresses - 1), n_services)
    lb_ips = rng.sample(range(1, lb_net.num_addresses - 1), n_services)
    free_ports = list(NODE_PORTS)
    rng.shuffle(free_ports)
    local_pods = [f"172.16.1.{2 + k}" for k in range(LOCAL_PODS)]
    base_time = dt.datetime(2024, 3, 1, tzinfo=dt.UTC)
    n_namespaces = max(1, n_services // 40)
    out: list[RealService] = []
    for i in range(n_services):
        team = _TEAMS[rng.randrange(len(_TEAMS))]
        namespace = f"{team}-{rng.randrange(n_namespaces):04d}"
        app = _APPS[rng.randrange(len(_APPS))]
        name = f"{app}-{i:05d}"
        n_eps = 2 + rng.randrange(4)  # 2-5 pods
        pods: dict[str, bool] = {}  # pod IP -> on this node
        while len(pods) < n_eps:
            if rng.random() < LOCAL_SHARE:
                pods[local_pods[rng.randrange(LOCAL_PODS)]] = True
            else:
                pods[f"172.16.{2 + rng.randrange(254)}.{2 + rng.randrange(250)}"] = False
        local = [ip for ip, here in pods.items() if here]
        remote = [ip for ip, here in pods.items() if not here]
        etp = "Local" if rng.random() < ETP_LOCAL_SHARE else "Cluster"
        port_specs = [("http", 80, 8080)]
        if rng.random() < TWO_PORT_SHARE:
            port_specs.append(("https", 443, 8443))
        # NodePorts while the range lasts (then allocateLoadBalancerNodePorts: false);
        # a Local Service's health check port comes from the same range
        with_node_ports = len(free_ports) >= len(port_specs) + (etp == "Local")
        hc_port = free_ports.pop() if with_node_ports and etp == "Local" else None
        cluster_ip = str(svc_net.network_address + cluster_ips[i])
        lb_ip = str(lb_net.network_address + lb_ips[i])
        ports = tuple(LbService(
            namespace=namespace, name=name, port_name=pname, port=port, target_port=target,
            node_port=free_ports.pop() if with_node_ports else None, cluster_ip=cluster_ip,
            lb_ip=lb_ip, etp=etp, local_endpoints=tuple(local),
            remote_endpoints=tuple(remote), health_check_node_port=hc_port)
            for pname, port, target in port_specs)
        h8 = f"{rng.getrandbits(32):08x}"
        annotations = []
        if rng.random() < ANNOTATED_SHARE:
            key, value = _CLOUD_ANNOTATIONS[rng.randrange(len(_CLOUD_ANNOTATIONS))]
            annotations.append((key, value.format(h8=h8)))
        created = base_time + dt.timedelta(seconds=rng.randrange(60 * 86400))
        out.append(RealService(
            ports=ports, app=app, uid=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            resource_version=str(rng.randrange(10**6, 10**9)),
            created=created.strftime("%Y-%m-%dT%H:%M:%SZ"),
            ip_mode_vip=rng.random() < IPMODE_VIP_SHARE, bound=rng.random() < BOUND_SHARE,
            annotations=tuple(sorted(annotations))))
    return out


# --- services.json ----------------------------------------------------------------------


def service_object(s: RealService) -> dict[str, Any]:
    """One item of ``kubectl get svc -A -o json``."""
    first = s.first
    ports = []
    for p in s.ports:
        port: dict[str, Any] = {"name": p.port_name, "port": p.port, "protocol": p.protocol,
                                "targetPort": p.target_port}
        if p.node_port:
            port["nodePort"] = p.node_port
        ports.append(port)
    spec: dict[str, Any] = {
        "allocateLoadBalancerNodePorts": first.node_port is not None,
        "clusterIP": first.cluster_ip, "clusterIPs": [first.cluster_ip],
        "externalTrafficPolicy": first.etp, "internalTrafficPolicy": "Cluster",
        "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "ports": ports,
        "selector": {"app": s.app},
        "sessionAffinity": "None", "type": "LoadBalancer"}
    if first.health_check_node_port:
        spec["healthCheckNodePort"] = first.health_check_node_port
    ingress: dict[str, Any] = {"ip": first.lb_ip}
    if s.ip_mode_vip:
        ingress["ipMode"] = "VIP"
    metadata: dict[str, Any] = {
        "creationTimestamp": s.created, "labels": {"app": s.app}, "name": first.name,
        "namespace": first.namespace, "resourceVersion": s.resource_version, "uid": s.uid}
    if s.annotations:  # (kubectl prints no empty map: omitempty)
        metadata["annotations"] = dict(s.annotations)
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata,
        "spec": spec, "status": {"loadBalancer": {"ingress": [ingress]}}}


def kubectl_json(doc: Any) -> str:
    """What kubectl's JSON printer writes: keys sorted, 4-space indent, a final newline."""
    return json.dumps(doc, indent=4, sort_keys=True) + "\n"


def services_json_text(services: Sequence[RealService]) -> str:
    """``kubectl get svc -A -o json`` of ``services``, byte for byte what
    ``kubectl_json`` of the whole list gives. Each item is encoded on its own (Python's
    indenting encoder is pure Python: the whole list at once costs the same, this keeps
    the memory of one item's text at a time) and indented into the list."""
    items = ",\n".join("        " + kubectl_json(service_object(s))[:-1].replace("\n", "\n        ")
                       for s in services)
    body = f"[\n{items}\n    ]" if items else "[]"
    return ('{\n    "apiVersion": "v1",\n    "items": ' + body +
            ',\n    "kind": "List",\n    "metadata": {\n        "resourceVersion": ""\n    }\n}\n')


# --- node text outputs --------------------------------------------------------------------


def _mac(i: int, first: int = 0x52) -> str:
    return f"{first:02x}:54:00:{(i >> 16) & 0xff:02x}:{(i >> 8) & 0xff:02x}:{i & 0xff:02x}"


def _fe80(mac: str) -> str:
    b = [int(x, 16) for x in mac.split(":")]
    b[0] ^= 2
    return str(ipaddress.IPv6Address(bytes([0xfe, 0x80, 0, 0, 0, 0, 0, 0, b[0], b[1], b[2],
                                            0xff, 0xfe, b[3], b[4], b[5]])))


_FOREVER = 4294967295


def _v4_info(cidr: str, ifname: str, scope: str = "global", **extra: Any) -> dict[str, Any]:
    iface = ipaddress.IPv4Interface(cidr)
    info: dict[str, Any] = {"family": "inet", "local": str(iface.ip),
                            "prefixlen": iface.network.prefixlen}
    if iface.network.prefixlen < 31 and scope == "global":
        info["broadcast"] = str(iface.network.broadcast_address)
    info["scope"] = scope
    info.update(extra)
    info.update({"label": ifname, "valid_life_time": _FOREVER,
                 "preferred_life_time": _FOREVER})
    return info


def _v6_link(mac: str) -> dict[str, Any]:
    return {"family": "inet6", "local": _fe80(mac), "prefixlen": 64, "scope": "link",
            "valid_life_time": _FOREVER, "preferred_life_time": _FOREVER}


@dataclass(frozen=True)
class _Link:
    name: str
    kind: str  # "lo" | "eth" | "bridge" | "veth" | "dummy"
    v4: tuple[str, ...]  # "a.b.c.d/len"
    mac: str


def _links(kube_ipvs0: Sequence[str] | None) -> list[_Link]:
    links = [_Link("lo", "lo", ("127.0.0.1/8",), "00:00:00:00:00:00"),
             _Link("eth0", "eth", (f"{NODE_IP}/24",), _mac(2)),
             _Link("cni0", "bridge", ("172.16.1.1/24",), _mac(3, 0x6a))]
    if kube_ipvs0 is not None:
        links.append(_Link("kube-ipvs0", "dummy", tuple(a + "/32" for a in kube_ipvs0),
                           _mac(4, 0x6e)))
    links += [_Link(f"veth{(0x1f2e3d4c * (k + 1)) & 0xffffffff:08x}", "veth", (),
                    _mac(0x100 + k, 0x6a)) for k in range(LOCAL_PODS)]
    return links


def ip_j_addr(links: Sequence[_Link]) -> str:
    """``ip -j addr show`` (iproute2 6.x): one line of JSON."""
    out = []
    for idx, link in enumerate(links, 1):
        obj: dict[str, Any] = {"ifindex": idx, "ifname": link.name}
        if link.kind == "veth":
            obj["link_index"] = 2
            obj["link_netnsid"] = idx - 5
        if link.kind == "lo":
            obj.update({"flags": ["LOOPBACK", "UP", "LOWER_UP"], "mtu": 65536,
                        "qdisc": "noqueue", "operstate": "UNKNOWN"})
        elif link.kind == "dummy":  # kube-ipvs0: kube-proxy never sets it up
            obj.update({"flags": ["BROADCAST", "NOARP"], "mtu": 1500, "qdisc": "noop",
                        "operstate": "DOWN"})
        else:
            obj.update({"flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"], "mtu": 1500,
                        "qdisc": "mq" if link.kind == "eth" else "noqueue"})
            if link.kind == "veth":
                obj["master"] = "cni0"
            obj["operstate"] = "UP"
        obj["group"] = "default"
        if link.kind != "dummy":
            obj["txqlen"] = 1000
        obj.update({"link_type": "loopback" if link.kind == "lo" else "ether",
                    "address": link.mac,
                    "broadcast": "00:00:00:00:00:00" if link.kind == "lo"
                    else "ff:ff:ff:ff:ff:ff"})
        if link.kind == "eth":
            obj["altnames"] = ["enp0s5"]
        infos: list[dict[str, Any]] = []
        for a in link.v4:
            if link.kind == "lo":
                infos.append(_v4_info(a, link.name, "host"))
            elif link.kind == "eth":
                infos.append(_v4_info(a, link.name, dynamic=True, noprefixroute=True))
            else:
                infos.append(_v4_info(a, link.name))
        if link.kind == "lo":
            infos.append({"family": "inet6", "local": "::1", "prefixlen": 128,
                          "scope": "host", "noprefixroute": True,
                          "valid_life_time": _FOREVER, "preferred_life_time": _FOREVER})
        elif link.kind != "dummy":
            infos.append(_v6_link(link.mac))
        obj["addr_info"] = infos
        out.append(obj)
    return json.dumps(out, separators=(",", ":")) + "\n"


def local_routes(links: Sequence[_Link]) -> str:
    """``ip route show table local`` then ``ip -6 route show table local`` (what `bundle`
    writes): the kernel's routes for the links' addresses."""
    v4 = route_local_text([(link.name, "UP", link.v4) for link in links])
    v6 = ["local ::1 dev lo proto kernel metric 0 pref medium"]
    for link in links:
        if link.kind not in ("lo", "dummy"):
            v6.append(f"local {_fe80(link.mac)} dev {link.name} proto kernel metric 0 "
                      "pref medium")
    v6 += [f"multicast ff00::/8 dev {link.name} proto kernel metric 256 pref medium"
           for link in links if link.kind not in ("lo", "dummy")]
    return v4 + "".join(line + "\n" for line in v6)


# --- IPVS: `ipvsadm -Ln` ----------------------------------------------------------------

_SAVE_LINE = re.compile(r"^-([Aa]) -([tu]) (\S+)(?: -s (\S+)| -r (\S+) -m -w (\d+))$")


def ipvsadm_listing(save: str, rng: random.Random) -> str:
    """``ipvsadm -Ln`` of the services an ``ipvsadm -S -n`` text holds: in a shuffled
    order (the kernel's hash table's), each real server with connection counters (most
    idle, some busy)."""
    blocks: list[list[str]] = []
    for line in save.splitlines():
        m = _SAVE_LINE.match(line)
        if m is None:
            raise ValueError(f"not an ipvsadm -S line of ipvs_mode's: {line!r}")
        kind, proto, vs, sched, rs, weight = m.groups()
        if kind == "A":
            blocks.append([f"{'TCP' if proto == 't' else 'UDP'}  {vs} {sched}"])
        else:
            busy = rng.random() < 0.3
            active = rng.randrange(60) if busy else 0
            inactive = rng.randrange(600) if busy else 0
            blocks[-1].append(f"  -> {rs:<28} {'Masq':<7} {int(weight):<6} {active:<10} "
                              f"{inactive:<10}")
    rng.shuffle(blocks)
    head = ["IP Virtual Server version 1.2.1 (size=4096)",
            "Prot LocalAddress:Port Scheduler Flags",
            "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn"]
    return "\n".join(head + [line for b in blocks for line in b]) + "\n"


# --- nftables: `nft list ruleset` -------------------------------------------------------

_ADD = re.compile(r"^add (table|set|map|chain|rule|element) (ip6?) (\S+)(?: (\S+))?(?: (.*))?$")
_PROPS = re.compile(r"^\{ (.*) ; \}$")
_STD_PRIO = (("raw", -300, None), ("mangle", -150, None), ("dstnat", -100, "prerouting"),
             ("filter", 0, None), ("security", 50, None), ("srcnat", 100, "postrouting"))
_RULE_REWRITES = (  # what nft prints for what knftables wrote
    ("mark set mark or 0x4000", "meta mark set meta mark | 0x00004000"),
    ("mark and 0x4000 == 0 return", "meta mark & 0x00004000 == 0x00000000 return"),
    ("mark set mark xor 0x4000", "meta mark set meta mark ^ 0x00004000"),
)
_ONE_ELEMENT_SET = re.compile(r"\{ ([^{},\s]+) \}")


def _priority(hook: str, prio: int) -> str:
    """nft's prio2str: a standard priority's name (+/- up to 10) where the hook takes it."""
    for name, value, only in _STD_PRIO:
        if (only is None or only == hook) and abs(prio - value) <= 10:
            off = prio - value
            return name if off == 0 else f"{name} {'+' if off > 0 else '-'} {abs(off)}"
    return str(prio)


def _rule_text(rule: str) -> str:
    for old, new in _RULE_REWRITES:
        if rule == old:
            return new
    rule = rule.replace(" , ", ", ")
    if " vmap " not in rule:  # a one-element anonymous set prints as its value
        rule = _ONE_ELEMENT_SET.sub(r"\1", rule)
    return rule


def nft_list_ruleset(transaction: str) -> str:
    """``nft list ruleset`` after ``nft -f`` of kube-proxy's ``transaction`` (what
    nftables.py writes): the table's sets and maps, then its chains, each in the order made,
    as nft 1.0 prints them (tests/data/nft/overall-list.txt is the kernel's own)."""
    table: tuple[str, str] | None = None
    table_comment: str | None = None
    sets: dict[str, tuple[str, dict[str, str]]] = {}  # name -> (set|map, properties)
    elements: dict[str, dict[str, None]] = {}
    chains: dict[str, tuple[dict[str, str], list[str]]] = {}
    for line in transaction.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _ADD.match(line)
        if m is None:
            raise ValueError(f"not a line of nftables_mode's: {line!r}")
        kind, family, name, obj, rest = m.groups()
        table = (family, name)
        if kind == "table":
            props = _props(" ".join(x for x in (obj, rest) if x))
            table_comment = props.get("comment")
        elif kind in ("set", "map"):
            sets[obj] = (kind, _props(rest or ""))
            elements[obj] = {}
        elif kind == "chain":
            chains[obj] = (_props(rest or ""), [])
        elif kind == "rule":
            chains[obj][1].append(_rule_text(rest or ""))
        else:  # element: "{ X }" (one element a line in nftables.py)
            body = (rest or "")[2:-2]
            elements[obj][body] = None
    if table is None:
        return ""
    out = [f"table {table[0]} {table[1]} {{"]
    if table_comment:
        out.append(f"\tcomment {table_comment}")
    for name, (kind, props) in sets.items():
        out.append(f"\t{kind} {name} {{")
        out.append(f"\t\ttype {props['type']}")
        if "comment" in props:
            out.append(f"\t\tcomment {props['comment']}")
        elems = list(elements[name])
        if elems:
            per_line = 2 if props["type"] in ("ipv4_addr", "ipv6_addr") else 1
            rows = [", ".join(elems[k:k + per_line]) for k in range(0, len(elems), per_line)]
            out.append("\t\telements = { " + ",\n\t\t\t     ".join(rows) + " }")
        out.append("\t}")
        out.append("")
    for k, (name, (props, rules)) in enumerate(chains.items()):
        out.append(f"\tchain {name} {{")
        if "type" in props:
            kind, _, hook, _, prio = props["type"].split()[:5]
            out.append(f"\t\ttype {kind} hook {hook} priority {_priority(hook, int(prio))}; "
                       "policy accept;")
        if "comment" in props:
            out.append(f"\t\tcomment {props['comment']}")
        out.extend("\t\t" + r for r in rules)
        out.append("\t}")
        if k < len(chains) - 1:
            out.append("")
    out.append("}")
    return "\n".join(out) + "\n"


def _props(text: str) -> dict[str, str]:
    """``{ type X ; comment "Y" ; }`` -> {"type": "X", "comment": '"Y"'}."""
    m = _PROPS.match(text.strip())
    if m is None:
        return {}
    props = {}
    for part in m.group(1).split(" ; "):
        key, _, value = part.strip().partition(" ")
        props[key] = value
    return props


def kubelet_iptables_nft() -> str:
    """``iptables-save`` of a node whose kube-proxy runs in nftables mode: kubelet's own
    chains only (its iptables hint and canaries, KUBE-FIREWALL's localnet guard), through
    iptables-nft."""
    header = f"# Generated by iptables-nft-save {_IPTABLES_VERSION} (nf_tables) on {_SAVE_DATE}"
    done = f"# Completed on {_SAVE_DATE}"
    return "\n".join([
        header, "*mangle", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]",
        ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]", ":POSTROUTING ACCEPT [0:0]",
        ":KUBE-IPTABLES-HINT - [0:0]", ":KUBE-KUBELET-CANARY - [0:0]", "COMMIT", done,
        header, "*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]",
        ":OUTPUT ACCEPT [0:0]", ":KUBE-FIREWALL - [0:0]", ":KUBE-KUBELET-CANARY - [0:0]",
        "-A INPUT -j KUBE-FIREWALL", "-A OUTPUT -j KUBE-FIREWALL",
        '-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block '
        'incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT '
        "-j DROP", "COMMIT", done,
        header, "*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]",
        ":OUTPUT ACCEPT [0:0]", ":POSTROUTING ACCEPT [0:0]", ":KUBE-KUBELET-CANARY - [0:0]",
        "COMMIT", done]) + "\n"


# --- the bundle --------------------------------------------------------------------------


def realistic(n_services: int, mode: str, seed: int = 0, with_services: bool = True,
              services: Sequence[RealService] | None = None) -> dict[str, str]:
    """A support bundle (file name -> text) of a node with ``n_services`` LoadBalancer
    Services in kube-proxy ``mode``, shaped as `loopback-agent bundle` and kubectl write
    them (module docstring). ``services``: realistic_services(n_services, seed), when the
    caller has them already (the same Services in each mode)."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'iptables', 'ipvs' or 'nftables', not {mode!r}")
    svcs = list(services) if services is not None else realistic_services(n_services, seed)
    ports = [p for s in svcs for p in s.ports]
    rng = random.Random(f"{seed}-{mode}")
    sysctls: dict[str, str | int] = dict(NODE_SYSCTLS)
    bundle: dict[str, str] = {}
    kube_ipvs0: list[str] | None = None
    if mode == "iptables":
        bundle["iptables-save.txt"] = iptables_mode(ports, generation="new",
                                                    cluster_cidr=CLUSTER_CIDR, node_ip=NODE_IP)
        bundle["ipset.txt"] = ""  # ip_set not loaded: `bundle` writes an empty file
        sysctls["net.ipv4.conf.all.route_localnet"] = 1  # localhostNodePorts
    elif mode == "nftables":
        bundle["nft-ruleset.txt"] = nft_list_ruleset(nftables_mode(
            ports, cluster_cidr=CLUSTER_CIDR, node_ip=NODE_IP, service_cidr=SERVICE_CIDR))
        bundle["iptables-save.txt"] = kubelet_iptables_nft()
        bundle["ipset.txt"] = ""
    else:
        state = ipvs_mode(ports, bind_lb_ip=True, cluster_cidr=CLUSTER_CIDR, node_ip=NODE_IP)
        unbound = {s.first.lb_ip for s in svcs if not s.bound}
        kube_ipvs0 = [a for a in state.kube_ipvs0_addresses if a not in unbound]
        drop = {f"add KUBE-IPVS-IPS {a}" for a in unbound}
        bundle["iptables-save.txt"] = state.iptables_restore
        bundle["ipset.txt"] = "".join(line + "\n" for line in state.ipset_save.splitlines()
                                      if line not in drop)
        bundle["ipvsadm.txt"] = ipvsadm_listing(state.ipvsadm_save, rng)
        sysctls.update({"net.ipv4.vs.conntrack": 1, "net.ipv4.vs.expire_nodest_conn": 1,
                        "net.ipv4.vs.expire_quiescent_template": 1,
                        "net.ipv4.conf.all.arp_ignore": 1, "net.ipv4.conf.all.arp_announce": 2})
    links = _links(kube_ipvs0)
    bundle["addr.txt"] = ip_j_addr(links)
    bundle["route-local.txt"] = local_routes(links)
    bundle["sysctl.txt"] = sysctl_text(sysctls)
    if with_services:
        bundle["services.json"] = services_json_text(svcs)
    bundle["node.json"] = kubectl_json(node_json(NODE_NAME, POD_CIDR, NODE_IP))
    return bundle


__all__ = ["MODES", "RealService", "ipvsadm_listing", "kubectl_json", "nft_list_ruleset",
           "realistic", "realistic_services", "services_json_text"]
