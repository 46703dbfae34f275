"""NodeSnapshot: everything the probes (or a saved bundle) learned about one node.

Plain frozen dataclasses with a JSON round trip. A field that is ``None`` means
"could not be read"; the reason is in ``unknowns``. An empty tuple means "read,
and there was nothing".
"""

from __future__ import annotations

import array
import dataclasses
import functools
import ipaddress
import json
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

from agent.quick_init import quick_init

SNAPSHOT_SCHEMA = "loopback-agent/snapshot/v1"


@quick_init
@dataclass(frozen=True, slots=True)
class Address:
    """One IPv4/IPv6 address bound on an interface (`ip addr`)."""

    ifname: str
    address: str
    prefixlen: int
    scope: str = "global"  # "global" | "host" | "link" | "site"
    link_up: bool = True  # interface administratively/operationally up


@quick_init
@dataclass(frozen=True, slots=True)
class LocalRoute:
    """One route of the `local` table (table 255), e.g. `local 10.0.0.5 dev kube-ipvs0 ...`."""

    type: str  # "local" | "broadcast" | "anycast" | ...
    dst: str  # an address or a prefix ("127.0.0.0/8")
    dev: str | None
    src: str | None
    line: str  # the route as `ip route show table local` prints it, for evidence


@dataclass(frozen=True, slots=True)
class IpSet:
    """One ipset with its members in `ipset save` form, e.g. "10.0.0.5,tcp:80"."""

    name: str
    type: str  # "hash:ip,port", "bitmap:port", ...
    members: tuple[str, ...] = ()


@quick_init
@dataclass(frozen=True, slots=True)
class IpvsRealServer:
    address: str
    port: int
    forward: str = "Masq"  # "Masq" | "Route" | "Tunnel" | "Local"
    weight: int = 1


@quick_init
@dataclass(frozen=True, slots=True)
class IpvsVirtualServer:
    protocol: str  # "TCP" | "UDP" | "SCTP"
    address: str
    port: int
    scheduler: str = "rr"
    real_servers: tuple[IpvsRealServer, ...] = ()


@dataclass(frozen=True, slots=True)
class Rule:
    """One iptables rule as `iptables-save` prints it (without counters)."""

    text: str  # "-A KUBE-SERVICES -d 10.0.0.5/32 -p tcp ... -j KUBE-EXT-X"
    source: str = ""  # where it came from, "iptables-save.txt:123"


class Rules(Sequence[Rule]):
    """A chain's rules without an object per rule: their texts, and where each came from,
    either one file and each rule's line in it, or each rule's whole source. A node of
    10k services holds 200k rules: a :class:`Rule` is made only for the ones a caller
    takes (``rules[i]``, iteration); ``texts`` and ``source(i)`` make none."""

    __slots__ = ("_file", "_where", "texts")

    def __init__(self, texts: Sequence[str] = (), sources: Sequence[str] = ()) -> None:
        if len(texts) != len(sources):
            raise ValueError("Rules: one source per text")
        self.texts: tuple[str, ...] = tuple(texts)
        self._file: str | None = None  # set: _where holds line numbers in this file
        self._where: Sequence[Any] = tuple(sources)

    @classmethod
    def of(cls, rules: Iterable[Rule]) -> Rules:
        if isinstance(rules, Rules):
            return rules
        rules = tuple(rules)
        return cls(tuple(r.text for r in rules), tuple(r.source for r in rules))

    @classmethod
    def in_file(cls, texts: Sequence[str], file: str, lines: Sequence[int]) -> Rules:
        """Rules read from ``file``, the i-th on line ``lines[i]`` (source "file:line")."""
        if len(texts) != len(lines):
            raise ValueError("Rules: one line per text")
        out = cls.__new__(cls)
        out.texts = tuple(texts)
        out._file = file
        # lines one after another (a dump's chain) are a range: none stored one by one
        out._where = lines if isinstance(lines, range) else array.array("I", lines)
        return out

    def source(self, i: int) -> str:
        """Where rule ``i`` came from ("iptables-save.txt:123")."""
        if self._file is None:
            return self._where[i]  # type: ignore[no-any-return]
        return f"{self._file}:{self._where[i]}"

    def sources(self) -> Iterator[str]:
        if self._file is None:
            return iter(self._where)
        return (f"{self._file}:{n}" for n in self._where)

    def __len__(self) -> int:
        return len(self.texts)

    @overload
    def __getitem__(self, i: int) -> Rule: ...

    @overload
    def __getitem__(self, i: slice) -> Rules: ...

    def __getitem__(self, i: int | slice) -> Rule | Rules:
        if isinstance(i, slice):
            out = Rules.__new__(Rules)
            out.texts, out._file, out._where = self.texts[i], self._file, self._where[i]
            return out
        return Rule(self.texts[i], self.source(i))

    def __iter__(self) -> Iterator[Rule]:
        return map(Rule, self.texts, self.sources())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Rules):
            return self.texts == other.texts and list(self.sources()) == list(other.sources())
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Rules({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Rules, (self.texts, tuple(self.sources())))


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    policy: str | None = None  # "ACCEPT"/"DROP" for built-in chains, None for user chains
    rules: Rules = field(default_factory=Rules)  # given as any sequence of Rule

    def __post_init__(self) -> None:
        if not isinstance(self.rules, Rules):
            object.__setattr__(self, "rules", Rules.of(self.rules))


@dataclass(frozen=True)
class Table:
    name: str  # "nat", "filter", "mangle", "raw"
    chains: tuple[Chain, ...] = ()

    def chain(self, name: str) -> Chain | None:
        return self._by_name.get(name)

    @functools.cached_property
    def _by_name(self) -> dict[str, Chain]:
        # cached_property writes the instance __dict__ directly: fine on a frozen class
        return {c.name: c for c in self.chains}


@dataclass(frozen=True, slots=True)
class Netfilter:
    """The iptables rules of the backend that holds kube-proxy's chains."""

    backend: str  # "legacy" | "nft" | "unknown" (e.g. a saved file)
    tables: tuple[Table, ...] = ()
    # an excerpt (rules without their table header: `-S CHAIN`, grep): a chain that is
    # not in it is unseen, not empty
    partial: bool = False

    def table(self, name: str) -> Table | None:
        for t in self.tables:
            if t.name == name:
                return t
        return None


@dataclass(frozen=True, slots=True)
class NftDump:
    """nftables rules as given (`nft list ...` / `nft -f` text or `nft -j` JSON);
    agent.netfilter.nft_read reads them (kube-proxy's nftables mode)."""

    format: str  # "text" | "json"
    text: str
    source: str


@dataclass(frozen=True, slots=True)
class KubeProxySync:
    """kube-proxy's own account of its syncs (its metrics, :10249/metrics), per IP family
    ("IPv4", "IPv6"; "" where the metric has no family label, before v1.30)."""

    source: str  # "http://127.0.0.1:10249/metrics", "kube-proxy-metrics.txt"
    read_at: float | None  # the node's clock when read (None: a paste that does not say)
    # kubeproxy_sync_proxy_rules_last_timestamp_seconds: the last successful sync
    last_sync: tuple[tuple[str, float], ...] = ()
    # kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds: the last change queued
    last_queued: tuple[tuple[str, float], ...] = ()
    # kubeproxy_sync_proxy_rules_{iptables_restore,nftables_sync}_failures_total
    failures: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class KubeProxy:
    """The kube-proxy process as seen through /proc (psutil)."""

    pid: int | None = None
    mode: str | None = None  # "ipvs" | "iptables" | "nftables" | None when not given
    cluster_cidr: str | None = None
    masquerade_all: bool | None = None
    config_file: str | None = None
    args: tuple[str, ...] = ()
    version: str | None = None  # "v1.29.15", as its log says it ("Version info")
    # its log's lines saying a sync failed ("Failed to bind service address to dummy
    # device", "Failed to add entry ... to ip set"), the first few, as written
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KubeProxyImage:
    """The image kube-proxy runs from, as an API object shows it: its DaemonSet (what the
    API gives the agent) or its Pod (a paste, a bundle)."""

    of: str  # "DaemonSet kube-system/kube-proxy", "Pod kube-system/kube-proxy-7xq2m"
    image: str  # its kube-proxy container's: "registry.k8s.io/kube-proxy:v1.32.2"
    source: str  # "kubernetes API kube-proxy", "kube-proxy-daemonset.json:1"
    # a Pod whose kube-proxy container runs (not ending, not waiting for its image); a
    # DaemonSet's template is taken as what runs
    running: bool = True


@quick_init
@dataclass(frozen=True, slots=True)
class ServicePort:
    port: int
    protocol: str = "TCP"
    node_port: int | None = None
    name: str | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class LoadBalancerIngress:
    ip: str | None = None
    hostname: str | None = None
    ip_mode: str | None = None  # "VIP" | "Proxy" | None (field absent)


@quick_init
@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    type: str = "ClusterIP"
    cluster_ip: str | None = None
    external_ips: tuple[str, ...] = ()
    lb_ingress: tuple[LoadBalancerIngress, ...] = ()
    external_traffic_policy: str | None = None  # "Cluster" | "Local"
    annotations: dict[str, str] = field(default_factory=dict)
    ports: tuple[ServicePort, ...] = ()
    # False: the object had no status at all (a manifest as it was applied, which people
    # paste beside the node's outputs, not the API server's object, which always has
    # one): its load balancer addresses are not in the input, not absent
    status_given: bool = True
    load_balancer_class: str | None = None  # spec.loadBalancerClass ("service.k8s.aws/nlb")
    # spec.clusterIPs (the first is cluster_ip): a dual-stack Service's second family's
    # ClusterIP is only here
    cluster_ips: tuple[str, ...] = ()
    # label service.kubernetes.io/service-proxy-name: kube-proxy leaves such a Service to
    # the proxy named (its service informer selects only Services without the label)
    proxy_name: str | None = None
    source_ranges: tuple[str, ...] = ()  # spec.loadBalancerSourceRanges

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class IngressBackend:
    """An Ingress rule's backend service (for mapping an Ingress address to services)."""

    service: str  # "ns/name"
    port: int | None = None
    port_name: str | None = None


@dataclass(frozen=True, slots=True)
class Ingress:
    namespace: str
    name: str
    ips: tuple[str, ...] = ()  # status.loadBalancer.ingress[].ip
    tls: bool = False
    backends: tuple[IngressBackend, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    pod_cidrs: tuple[str, ...] = ()
    internal_ips: tuple[str, ...] = ()
    provider_id: str | None = None  # spec.providerID ("aws:///eu-west-1a/i-...")
    # status.nodeInfo.kubeProxyVersion: what the kubelet reported there (its own version;
    # deprecated in 1.31 and left empty since): a hint of kube-proxy's, not its word
    kube_proxy_version: str | None = None


@dataclass(frozen=True, slots=True)
class Unknown:
    """Something that could not be read, and why (shown to the user, kept in the verdict)."""

    source: str  # "ipvs", "nat rules", "services.json", ...
    reason: str


@dataclass(frozen=True)
class NodeSnapshot:
    node: str | None = None
    origin: str = "live"  # "live" | "bundle:DIR" | "snapshot:FILE"
    addresses: tuple[Address, ...] | None = None
    local_routes: tuple[LocalRoute, ...] | None = None
    netfilter: Netfilter | None = None
    ipsets: tuple[IpSet, ...] | None = None
    ipvs: tuple[IpvsVirtualServer, ...] | None = None
    sysctls: dict[str, str] | None = None  # "net.ipv4.conf.eth0.rp_filter" -> "1"
    kube_proxy: KubeProxy | None = None
    kube_proxy_image: KubeProxyImage | None = None  # None: not read, or not shown
    services: tuple[Service, ...] | None = None
    ingresses: tuple[Ingress, ...] | None = None
    node_info: NodeInfo | None = None
    # the main routing table (`ip route`), when given: where the CNI routes this node's pods
    routes: tuple[LocalRoute, ...] | None = None
    unknowns: tuple[Unknown, ...] = ()
    # what the user stated where detection cannot reach (check --mode, --pod-cidr):
    # "mode" -> "ipvs", "pod_cidr" -> "10.244.1.0/24,..."
    given: dict[str, str] | None = None
    nft: tuple[NftDump, ...] | None = None  # nftables rules (kube-proxy nftables mode)
    # the IPv6 iptables rules (`ip6tables-save`) of the backend kube-proxy writes to, as
    # ``netfilter`` holds the IPv4 ones; None: not read (an old snapshot has none)
    ip6tables: Netfilter | None = None
    kube_proxy_sync: KubeProxySync | None = None  # None: its metrics were not read
    schema: str = SNAPSHOT_SCHEMA

    def ipset(self, name: str) -> IpSet | None:
        return self._ipsets_by_name.get(name)

    @functools.cached_property
    def _ipsets_by_name(self) -> dict[str, IpSet]:
        return {s.name: s for s in self.ipsets or ()}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(to_plain(self), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> NodeSnapshot:
        try:
            data = json.loads(text)
        except RecursionError:  # (a JSONDecodeError, a ValueError too, keeps its line)
            raise ValueError("JSON nested deeper than the parser can follow") from None
        if not isinstance(data, dict) or data.get("schema") != SNAPSHOT_SCHEMA:
            raise ValueError(f"not a {SNAPSHOT_SCHEMA} document")
        # (from_plain of a dataclass calls it with the fields it read: a cls, or raises)
        return cast(NodeSnapshot, from_plain(cls, data))


# --- generic JSON <-> dataclass conversion -------------------------------------------


def to_plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists; other JSON types unchanged."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple, Rules)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    return obj


_HINTS: dict[type, dict[str, Any]] = {}


def from_plain(tp: Any, value: Any, path: str = "$") -> Any:
    """Rebuild a value of type ``tp`` (a dataclass or a typing form) from plain JSON data;
    ValueError naming the path (``$.addresses[3].prefixlen``) for data of the wrong
    shape, so a damaged snapshot is refused with a message instead of failing later."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and type(None) in typing.get_args(tp):
            return None
        return from_plain(args[0], value, path) if len(args) == 1 else value
    if value is None:
        raise ValueError(f"{path}: null where a value is required")
    if tp is Rules:
        return Rules.of(from_plain(tuple[Rule, ...], value, path))
    if origin is tuple:
        (inner, *_rest) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        return tuple(from_plain(inner, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected an object, got {type(value).__name__}")
        bad = next((k for k, v in value.items()
                    if isinstance(v, bool) or not isinstance(v, (str, int))), None)
        if bad is not None:
            raise ValueError(f"{path}.{bad}: expected a string, got "
                             f"{type(value[bad]).__name__}")
        return {_text(k, path): _text(str(v), f"{path}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected an object for {tp.__name__}")
        hints = _HINTS.get(tp)
        if hints is None:
            hints = _HINTS[tp] = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = from_plain(hints[f.name], value[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and \
                    f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{path}: {tp.__name__} lacks {f.name!r}")
        for name, check in _CHECKS.get(tp, ()):
            if kwargs.get(name) is not None:
                check(kwargs[name], f"{path}.{name}")
        return tp(**kwargs)
    return _scalar(tp, value, path)


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {type(value).__name__}")
        return _text(value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true or false, got {type(value).__name__}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {type(value).__name__}")
        return value
    return value


def _text(value: str, path: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{path}: not valid Unicode (a lone surrogate)") from None
    return value


# What the diagnosis takes for granted of a field's value: checked when a snapshot is
# read back, so a damaged document is refused up front (it is never the agent's own).
def _address(value: str, path: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{path}: {value!r} is not an IP address") from None


def _address_or_net(value: str, path: str) -> None:
    if value == "default":  # a main-table route (snapshot.routes)
        return
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{path}: {value!r} is not an IP address or prefix") from None


def _nets(values: Any, path: str) -> None:
    for i, v in enumerate(values if isinstance(values, tuple) else str(values).split(",")):
        _address_or_net(v.strip(), f"{path}[{i}]")


def _addresses(values: tuple[str, ...], path: str) -> None:
    for i, v in enumerate(values):
        _address(v, f"{path}[{i}]")


def _in_range(lo: int, hi: int) -> Callable[[int, str], None]:
    def check(value: int, path: str) -> None:
        if not lo <= value <= hi:
            raise ValueError(f"{path}: {value} is not in {lo}..{hi}")
    return check


_PORT = _in_range(0, 65535)


def _one_of(*allowed: str) -> Callable[[str, str], None]:
    def check(value: str, path: str) -> None:
        if value not in allowed:
            raise ValueError(f"{path}: {value!r} is not one of {', '.join(allowed)}")
    return check


_PROTOCOL = _one_of("TCP", "UDP", "SCTP")
_CHECKS: dict[type, tuple[tuple[str, Any], ...]] = {
    Address: (("address", _address), ("prefixlen", _in_range(0, 128))),
    LocalRoute: (("dst", _address_or_net), ("src", _address)),
    IpvsRealServer: (("address", _address), ("port", _PORT)),
    IpvsVirtualServer: (("address", _address), ("port", _PORT)),
    NodeInfo: (("pod_cidrs", _nets), ("internal_ips", _addresses)),
    KubeProxy: (("cluster_cidr", _nets),),
    ServicePort: (("port", _PORT), ("node_port", _PORT), ("protocol", _PROTOCOL)),
    IngressBackend: (("port", _PORT),),
}
