"""Read Services, the Node and Ingresses from `kubectl get ... -o json` documents.

Only the fields the loop-back diagnosis needs are read. JSON shape errors name the file
and the path inside the document ("items[3].spec.ports[0].port"); the line is not known
once the JSON is decoded, so it is given only for syntax errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from sys import intern
from typing import Any

from agent.errors import InputError
from agent.parse.ip_text import canonical_ip, is_network
from agent.parse.json_text import loads
from agent.snapshot import (
    Ingress,
    IngressBackend,
    KubeProxyImage,
    LoadBalancerIngress,
    NodeInfo,
    Service,
    ServicePort,
)


def load_json(text: str, source: str) -> dict[str, Any]:
    """Decode a JSON object; syntax errors become InputError with their line."""
    data = loads(text, source)
    if not isinstance(data, dict):
        raise InputError(source, 1, f"expected a JSON object, got a {_json_type(data)}")
    return data


def parse_services(doc: dict[str, Any], source: str = "services.json") -> tuple[Service, ...]:
    """A Service List (`kubectl get svc -A -o json`) or a single Service object."""
    services = [_service(item, path, source)
                for item, path in _items(doc, "Service", source)]
    return tuple(sorted(services, key=lambda s: s.key))


def parse_node(doc: dict[str, Any], source: str = "node.json") -> NodeInfo:
    """A Node object (`kubectl get node NAME -o json`), or a List holding exactly one."""
    items = _items(doc, "Node", source)
    if len(items) != 1:
        raise InputError(source, None, f"expected one Node, found {len(items)}")
    node, path = items[0]
    name = _req_str(node, "metadata", "name", path=path, source=source)
    spec = _obj(node, "spec", path, source)
    cidrs = _str_list(spec, "podCIDRs", f"{path}spec.", source)
    if not cidrs:
        # Older clusters and single-stack nodes may only fill the singular field.
        single = _opt_str(spec, "podCIDR", f"{path}spec.", source)
        cidrs = (single,) if single else ()
    for i, c in enumerate(cidrs):
        if not is_network(c):
            raise InputError(source, None, f"{path}spec.podCIDRs[{i}]: {c!r} is not a CIDR")
    status = _obj(node, "status", path, source)
    ips = []
    for i, addr in enumerate(_list(status, "addresses", f"{path}status.", source)):
        where = f"{path}status.addresses[{i}]."
        if not isinstance(addr, dict):
            raise InputError(source, None, f"{where[:-1]}: expected an object")
        if _opt_str(addr, "type", where, source) == "InternalIP":
            ip = _opt_str(addr, "address", where, source)
            if ip and canonical_ip(ip):
                ips.append(ip)
    info = status.get("nodeInfo")
    reported = info.get("kubeProxyVersion") if isinstance(info, dict) else None
    return NodeInfo(name, cidrs, tuple(ips),
                    _opt_str(spec, "providerID", f"{path}spec.", source) or None,
                    reported if isinstance(reported, str) and reported else None)


KUBE_PROXY = "kube-proxy"
KUBE_PROXY_NAMESPACE = "kube-system"
# what the API is asked for: kube-proxy's DaemonSet, by name (kubeadm's, EKS's, AKS's,
# TKE's; a static-pod kube-proxy has none, and then nothing is said)
KUBE_PROXY_DAEMONSET = KUBE_PROXY


def _kube_proxy_container(spec: dict[str, Any], path: str, source: str
                          ) -> tuple[str, str] | None:
    """(the container's name, its image): the container named kube-proxy, or the one
    whose image is kube-proxy."""
    for i, c in enumerate(_list(spec, "containers", path, source)):
        where = f"{path}containers[{i}]."
        if not isinstance(c, dict):
            raise InputError(source, None, f"{where[:-1]}: expected an object")
        image = _opt_str(c, "image", where, source)
        name = _opt_str(c, "name", where, source) or ""
        if image and (name == KUBE_PROXY or image_repository(image) == KUBE_PROXY):
            return name, image[:300]
    return None


def image_repository(image: str) -> str:
    """The last part of an image reference's repository: "kube-proxy" for
    "registry.example:5000/eks/kube-proxy:v1.31.10-eksbuild.8@sha256:..."."""
    return image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]


def _kube_proxys(doc: dict[str, Any], kind: str, source: str
                 ) -> Iterator[tuple[dict[str, Any], str, str, str, dict[str, Any]]]:
    """(object, path, namespace, name, metadata) of each ``kind`` object of ``doc`` that
    kube-proxy's installers name or label so, in kube-system."""
    for obj, path in _items(doc, kind, source):
        namespace, name = _ns_name(obj, path, source)
        meta = _obj(obj, "metadata", path, source)
        labels = _obj(meta, "labels", f"{path}metadata.", source)
        if namespace == KUBE_PROXY_NAMESPACE and (
                name == KUBE_PROXY or name.startswith(KUBE_PROXY + "-") or
                KUBE_PROXY in (labels.get("k8s-app"), labels.get("component"))):
            yield obj, path, namespace, name, meta


def kube_proxy_pods(doc: dict[str, Any], source: str) -> list[KubeProxyImage]:
    """kube-proxy's Pods among Pods (`kubectl -n kube-system get pods -o json`, one Pod):
    a kube-system Pod that kube-proxy's installers name or label so (kubeadm's DaemonSet:
    k8s-app=kube-proxy, pods kube-proxy-xxxxx; static pods: kube-proxy-NODE,
    component=kube-proxy), with the image its kube-proxy container runs (its status's,
    else its spec's)."""
    out = []
    for pod, path, namespace, name, meta in _kube_proxys(doc, "Pod", source):
        found = _kube_proxy_container(_obj(pod, "spec", path, source), f"{path}spec.",
                                      source)
        if found is None:
            continue
        container, image = found
        status = _obj(pod, "status", path, source)
        # (a paste may leave the status out: only what it shows not running is not)
        running = status.get("phase") in (None, "Running") and \
            not meta.get("deletionTimestamp")
        for cs in status.get("containerStatuses") or ():
            if isinstance(cs, dict) and cs.get("name") == container:
                state = cs.get("state")
                running = running and isinstance(state, dict) and "running" in state
                if isinstance(cs.get("image"), str) and cs["image"]:
                    image = cs["image"][:300]  # (what runs, where the spec was changed)
        out.append(KubeProxyImage(f"Pod {namespace}/{name}", image, source, running))
    return out


def kube_proxy_daemon_set(doc: dict[str, Any], source: str) -> list[KubeProxyImage]:
    """kube-proxy's DaemonSet (`kubectl -n kube-system get ds kube-proxy -o json`): the
    image of its template's kube-proxy container."""
    out = []
    for ds, path, namespace, name, _meta in _kube_proxys(doc, "DaemonSet", source):
        template = _obj(_obj(ds, "spec", path, source), "template", f"{path}spec.", source)
        found = _kube_proxy_container(
            _obj(template, "spec", f"{path}spec.template.", source),
            f"{path}spec.template.spec.", source)
        if found is not None:
            out.append(KubeProxyImage(f"DaemonSet {namespace}/{name}", found[1], source))
    return out


def choose_kube_proxy_image(found: Iterable[KubeProxyImage | None]
                            ) -> KubeProxyImage | None:
    """The one that says what kube-proxy runs here: a running Pod's, then a DaemonSet's,
    then a Pod's that is ending or waiting (one place: a watched, a listed and a saved
    input choose alike)."""
    ranked = sorted((f for f in found if f is not None),
                    key=lambda f: (not (f.running and f.of.startswith("Pod ")),
                                   not f.of.startswith("DaemonSet "), f.of))
    return ranked[0] if ranked else None


def parse_ingresses(doc: dict[str, Any],
                    source: str = "ingresses.json") -> tuple[Ingress, ...]:
    """An Ingress List (`kubectl get ingress -A -o json`) or a single Ingress object."""
    ingresses = [_ingress(item, path, source)
                 for item, path in _items(doc, "Ingress", source)]
    return tuple(sorted(ingresses, key=lambda i: i.key))


# --- objects ----------------------------------------------------------------------------


def _service(item: dict[str, Any], path: str, source: str) -> Service:
    plain = _plain_service(item)
    if plain is not None:
        return plain
    namespace, name = _ns_name(item, path, source)
    meta = _obj(item, "metadata", path, source)
    spec = _obj(item, "spec", path, source)
    sp = f"{path}spec."
    cluster_ip = _opt_str(spec, "clusterIP", sp, source)
    if cluster_ip in ("", "None"):
        cluster_ip = None  # headless Service: there is no virtual IP to bind or route
    raw_annotations = meta.get("annotations") or {}
    if not isinstance(raw_annotations, dict):
        raise InputError(source, None, f"{path}metadata.annotations: expected an object")
    # Only string values are real annotations; anything else is a malformed object,
    # skipped rather than fatal since annotations are hints, not evidence.
    annotations = {k: v for k, v in raw_annotations.items()
                   if isinstance(k, str) and isinstance(v, str)}
    ports = []
    for i, port in enumerate(_list(spec, "ports", sp, source)):
        where = f"{sp}ports[{i}]."
        if not isinstance(port, dict):
            raise InputError(source, None, f"{where[:-1]}: expected an object")
        ports.append(ServicePort(
            port=_req_int(port, "port", where, source),
            protocol=_opt_str(port, "protocol", where, source) or "TCP",
            node_port=_opt_int(port, "nodePort", where, source),
            name=_opt_str(port, "name", where, source) or None,
        ))
    status = _obj(item, "status", path, source)
    lb = _obj(status, "loadBalancer", f"{path}status.", source)
    lb_ingress = []
    for i, ing in enumerate(_list(lb, "ingress", f"{path}status.loadBalancer.", source)):
        where = f"{path}status.loadBalancer.ingress[{i}]."
        if not isinstance(ing, dict):
            raise InputError(source, None, f"{where[:-1]}: expected an object")
        lb_ingress.append(LoadBalancerIngress(
            ip=_opt_str(ing, "ip", where, source) or None,
            hostname=_opt_str(ing, "hostname", where, source) or None,
            ip_mode=_opt_str(ing, "ipMode", where, source) or None,
        ))
    return Service(
        namespace=namespace,
        name=name,
        type=_opt_str(spec, "type", sp, source) or "ClusterIP",
        cluster_ip=cluster_ip,
        external_ips=_str_list(spec, "externalIPs", sp, source),
        lb_ingress=tuple(lb_ingress),
        external_traffic_policy=_opt_str(spec, "externalTrafficPolicy", sp, source) or None,
        annotations=annotations,
        ports=tuple(ports),
        status_given=item.get("status") is not None,
        load_balancer_class=_opt_str(spec, "loadBalancerClass", sp, source) or None,
        cluster_ips=tuple(ip for ip in _str_list(spec, "clusterIPs", sp, source)
                          if ip not in ("", "None")),
        proxy_name=_proxy_name(meta.get("labels")),
        source_ranges=_str_list(spec, "loadBalancerSourceRanges", sp, source),
    )


def _plain_service(item: dict[str, Any]) -> Service | None:
    """What _service makes of a Service of the usual shape (each field it reads absent or of
    its JSON type), without the paths its messages would need; None for anything else,
    which _service reads and names. Values that repeat across Services (namespaces,
    types, protocols, addresses the node's other outputs hold too) are interned."""
    meta, spec, status = item.get("metadata"), item.get("spec"), item.get("status")
    if type(meta) is not dict or (spec is not None and type(spec) is not dict) or \
            (status is not None and type(status) is not dict):
        return None
    spec = spec or {}
    name, namespace = meta.get("name"), meta.get("namespace")
    raw_annotations = meta.get("annotations") or {}
    if type(name) is not str or not name or type(raw_annotations) is not dict or \
            (namespace is not None and type(namespace) is not str):
        return None
    cluster_ip, stype, lb_class = spec.get("clusterIP"), spec.get("type"), \
        spec.get("loadBalancerClass")
    etp, ext, raw_ports = spec.get("externalTrafficPolicy"), spec.get("externalIPs"), \
        spec.get("ports")
    ips, ranges = spec.get("clusterIPs"), spec.get("loadBalancerSourceRanges")
    if not _str_or_none(cluster_ip, stype, etp, lb_class) or \
            (ranges is not None and (type(ranges) is not list or
                                     any(type(v) is not str for v in ranges))) or \
            (ext is not None and (type(ext) is not list or
                                  any(type(v) is not str for v in ext))) or \
            (ips is not None and (type(ips) is not list or
                                  any(type(v) is not str for v in ips))) or \
            (raw_ports is not None and type(raw_ports) is not list):
        return None
    ports = []
    for port in raw_ports or ():
        if type(port) is not dict:
            return None
        number, protocol, node_port, pname = port.get("port"), port.get("protocol"), \
            port.get("nodePort"), port.get("name")
        if type(number) is not int or (node_port is not None and type(node_port) is not int) \
                or not _str_or_none(protocol, pname):
            return None
        ports.append(ServicePort(number, intern(protocol) if protocol else "TCP", node_port,
                                 intern(pname) if pname else None))
    lb = (status or {}).get("loadBalancer")
    if lb is not None and type(lb) is not dict:
        return None
    ingress = (lb or {}).get("ingress")
    if ingress is not None and type(ingress) is not list:
        return None
    lb_ingress = []
    for ing in ingress or ():
        if type(ing) is not dict:
            return None
        ip, host, mode = ing.get("ip"), ing.get("hostname"), ing.get("ipMode")
        if not _str_or_none(ip, host, mode):
            return None
        lb_ingress.append(LoadBalancerIngress(intern(ip) if ip else None, host or None,
                                              intern(mode) if mode else None))
    return Service(
        namespace=intern(namespace) if namespace else "default",
        name=name,
        type=intern(stype) if stype else "ClusterIP",
        cluster_ip=None if cluster_ip in ("", "None", None) else intern(cluster_ip),
        external_ips=tuple(ext) if ext else (),
        lb_ingress=tuple(lb_ingress),
        external_traffic_policy=intern(etp) if etp else None,
        annotations={k: v for k, v in raw_annotations.items()
                     if isinstance(k, str) and isinstance(v, str)},
        ports=tuple(ports),
        status_given=status is not None,
        load_balancer_class=lb_class or None,
        cluster_ips=tuple(intern(ip) for ip in ips if ip not in ("", "None")) if ips else (),
        proxy_name=_proxy_name(meta.get("labels")),
        source_ranges=tuple(ranges) if ranges else (),
    )


# kube-proxy's informer selects Services without this label (pkg/proxy/apis:
# LabelServiceProxyName); a Service with it is served by the proxy it names
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"


def _proxy_name(labels: Any) -> str | None:
    value = labels.get(PROXY_NAME_LABEL) if type(labels) is dict else None
    return value if type(value) is str else None


def _str_or_none(*values: Any) -> bool:
    # (a loop, not all() over a generator: 30k calls for 10k Services, 3x faster)
    for v in values:  # noqa: SIM110
        if v is not None and type(v) is not str:
            return False
    return True


def _ingress(item: dict[str, Any], path: str, source: str) -> Ingress:
    namespace, name = _ns_name(item, path, source)
    spec = _obj(item, "spec", path, source)
    sp = f"{path}spec."
    backends: set[IngressBackend] = set()
    default = spec.get("defaultBackend", spec.get("backend"))  # "backend": pre-v1 API
    if default is not None:
        _add_backend(backends, default, namespace, f"{sp}defaultBackend", source)
    for r, rule in enumerate(_list(spec, "rules", sp, source)):
        where = f"{sp}rules[{r}]"
        if not isinstance(rule, dict):
            raise InputError(source, None, f"{where}: expected an object")
        http = _obj(rule, "http", f"{where}.", source)
        for p, hpath in enumerate(_list(http, "paths", f"{where}.http.", source)):
            pwhere = f"{where}.http.paths[{p}]"
            if not isinstance(hpath, dict):
                raise InputError(source, None, f"{pwhere}: expected an object")
            if "backend" in hpath:
                _add_backend(backends, hpath["backend"], namespace, f"{pwhere}.backend",
                             source)
    status = _obj(item, "status", path, source)
    lb = _obj(status, "loadBalancer", f"{path}status.", source)
    ips = []
    for i, ing in enumerate(_list(lb, "ingress", f"{path}status.loadBalancer.", source)):
        where = f"{path}status.loadBalancer.ingress[{i}]."
        if not isinstance(ing, dict):
            raise InputError(source, None, f"{where[:-1]}: expected an object")
        ip = _opt_str(ing, "ip", where, source)
        if ip:
            ips.append(ip)
    return Ingress(
        namespace=namespace,
        name=name,
        ips=tuple(ips),
        tls=bool(spec.get("tls")),
        backends=tuple(sorted(backends, key=lambda b: (b.service, b.port or -1,
                                                       b.port_name or ""))),
    )


def _add_backend(out: set[IngressBackend], backend: Any, namespace: str, where: str,
                 source: str) -> None:
    if not isinstance(backend, dict):
        raise InputError(source, None, f"{where}: expected an object")
    svc = backend.get("service")
    if svc is not None:  # networking.k8s.io/v1
        if not isinstance(svc, dict):
            raise InputError(source, None, f"{where}.service: expected an object")
        name = _req_str(svc, "name", path=f"{where}.service.", source=source)
        port = _obj(svc, "port", f"{where}.service.", source)
        out.add(IngressBackend(f"{namespace}/{name}",
                               _opt_int(port, "number", f"{where}.service.port.", source),
                               _opt_str(port, "name", f"{where}.service.port.", source)
                               or None))
        return
    if "serviceName" in backend:  # extensions/v1beta1: serviceName + servicePort
        name = _req_str(backend, "serviceName", path=f"{where}.", source=source)
        sport = backend.get("servicePort")
        if isinstance(sport, int) and not isinstance(sport, bool):
            out.add(IngressBackend(f"{namespace}/{name}", sport, None))
        elif isinstance(sport, str) or sport is None:
            out.add(IngressBackend(f"{namespace}/{name}", None, sport or None))
        else:
            raise InputError(source, None, f"{where}.servicePort: expected a number or name")
    # A resource backend (spec.rules[].http.paths[].backend.resource) is no Service.


# --- document shape helpers -------------------------------------------------------------


def _items(doc: Any, kind: str, source: str) -> list[tuple[dict[str, Any], str]]:
    """The objects of a List (with their path for messages), or the single object."""
    if not isinstance(doc, dict):
        raise InputError(source, None, f"expected a JSON object, got a {_json_type(doc)}")
    doc_kind = doc.get("kind")
    if isinstance(doc_kind, str) and doc_kind.endswith("List") \
            and doc_kind not in ("List", f"{kind}List"):
        # Items of a typed list (PodList, ...) need not repeat their kind: check here.
        raise InputError(source, None, f"expected a {kind}List or List, got a {_short(doc_kind)}")
    if "items" in doc or doc_kind in ("List", f"{kind}List"):
        items = doc.get("items")
        if items is None:
            items = []  # kubectl omits "items" when there are none
        if not isinstance(items, list):
            raise InputError(source, None, "items: expected a list")
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise InputError(source, None, f"items[{i}]: expected an object")
            item_kind = item.get("kind")
            if item_kind is not None and item_kind != kind:
                raise InputError(source, None,
                                 f"items[{i}]: expected a {kind}, got a {_short(item_kind)}")
            out.append((item, f"items[{i}]."))
        return out
    if doc_kind != kind:
        raise InputError(source, None,
                         f"expected a {kind} or a List of them, got kind "
                         f"{_short(doc_kind) if doc_kind is not None else 'missing'}")
    return [(doc, "")]


def _ns_name(item: dict[str, Any], path: str, source: str) -> tuple[str, str]:
    meta = _obj(item, "metadata", path, source)
    name = _req_str(meta, "name", path=f"{path}metadata.", source=source)
    # Cluster-scoped reads and hand-trimmed files may leave namespace out.
    namespace = _opt_str(meta, "namespace", f"{path}metadata.", source) or "default"
    return namespace, name


def _obj(parent: dict[str, Any], key: str, path: str, source: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(source, None, f"{path}{key}: expected an object")
    return value


def _list(parent: dict[str, Any], key: str, path: str, source: str) -> list[Any]:
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InputError(source, None, f"{path}{key}: expected a list")
    return value


def _str_list(parent: dict[str, Any], key: str, path: str, source: str) -> tuple[str, ...]:
    values = _list(parent, key, path, source)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise InputError(source, None, f"{path}{key}[{i}]: expected a string")
    return tuple(values)


def _opt_str(parent: dict[str, Any], key: str, path: str, source: str) -> str | None:
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise InputError(source, None, f"{path}{key}: expected a string")
    return value


def _req_str(parent: dict[str, Any], *keys: str, path: str, source: str) -> str:
    """A non-empty string at parent[keys[0]][keys[1]]..."""
    value: Any = parent
    for key in keys[:-1]:
        value = _obj(value, key, path, source)
        path = f"{path}{key}."
    result = _opt_str(value, keys[-1], path, source)
    if not result:
        raise InputError(source, None, f"{path}{keys[-1]}: missing")
    return result


def _opt_int(parent: dict[str, Any], key: str, path: str, source: str) -> int | None:
    value = parent.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(source, None, f"{path}{key}: expected an integer")
    return value


def _req_int(parent: dict[str, Any], key: str, path: str, source: str) -> int:
    value = _opt_int(parent, key, path, source)
    if value is None:
        raise InputError(source, None, f"{path}{key}: missing")
    return value


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(value), "null")


def _short(value: Any, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."
