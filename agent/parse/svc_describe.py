"""Read `kubectl describe svc` text into Services: what tickets hold about a Service more
often than its YAML.

kubectl writes one block per Service, "Label:<tab>value" lines aligned into columns
(pkg/describe's describeService): Name, Namespace, Type, IP (the ClusterIP; a later "IP"
is spec.loadBalancerIP, asked for, not given), External IPs, LoadBalancer Ingress
(addresses or hostnames joined by ", ", newer kubectl adds " (VIP)" or " (Proxy)"), then
per port "Port: NAME PORT/PROTO" and "NodePort: NAME PORT/PROTO", External Traffic
Policy. Labels, Annotations and Events run on over indented lines. The block comes from
the API server's object, so its status is given: no LoadBalancer Ingress line means none.
"""

from __future__ import annotations

import re

from agent.parse.ip_text import canonical_ip
from agent.snapshot import LoadBalancerIngress, Service, ServicePort

_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"})
# "Label:" and its value, kubectl's columns (its tabwriter pads with spaces); the value
# ends at its last non-blank ("(.*?)[ \t]*$" retried the blanks after each character:
# quadratic in a run of them, minutes for a pasted line of 300k)
_FIELD = re.compile(r"^([A-Z][A-Za-z ]*?):(?:[ \t]+(.*\S))?[ \t]*$")
_PORT = re.compile(r"^(\S+)[ \t]+(\d+)/(TCP|UDP|SCTP)$")
_INGRESS = re.compile(r"^(\S+?)(?:[ \t]*\((VIP|Proxy)\))?$")
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")  # RFC 1123
Problem = tuple[int, str]  # (line, why)


def parse_svc_describe(lines: list[tuple[int, str]], source: str
                       ) -> tuple[tuple[Service, ...], list[Problem]]:
    """(line number, text) pairs of one or more `kubectl describe svc` blocks -> the
    Services, and the lines that could not be read (each block is read on its own: a
    bad line costs its field, a block of another kind is named and skipped)."""
    blocks: list[list[tuple[int, str]]] = []
    for n, line in lines:
        if line.startswith("Name:") or not blocks:
            blocks.append([])
        blocks[-1].append((n, line))
    services, problems = [], []
    for block in blocks:
        svc = _block(block, problems)
        if svc is not None:
            services.append(svc)
    return tuple(services), problems


def _block(block: list[tuple[int, str]], problems: list[Problem]) -> Service | None:
    fields: list[tuple[int, str, str]] = []  # (line, label, value)
    annotations: dict[str, str] = {}
    for n, line in block:
        if line[:1] in (" ", "\t") and fields and fields[-1][1] == "Annotations":
            _annotation(line, annotations)  # (kubectl's printAnnotationsMultiline)
            continue
        if not line.strip() or line[0] in " \t#":
            # a blank line, a Labels/Events line further on, or the paster's own "# ..."
            # between blocks (kubectl writes none)
            continue
        m = _FIELD.match(line)
        if m is None:
            problems.append((n, f"not a `kubectl describe svc` line: {line.strip()[:60]!r}"))
            continue
        fields.append((n, m.group(1), m.group(2) or ""))
        if m.group(1) == "Annotations":
            _annotation(m.group(2) or "", annotations)
    first = dict((label, value) for _, label, value in reversed(fields))  # first of each
    start = block[0][0]
    name, namespace, stype = first.get("Name"), first.get("Namespace"), first.get("Type")
    if not name or stype not in _TYPES:
        problems.append((start, "a `kubectl describe` block that is not a Service's (no "
                         "Name: and Type: lines of one): not used"))
        return None
    ports: list[ServicePort] = []
    lb: list[LoadBalancerIngress] = []
    external: list[str] = []
    for n, label, value in fields:
        if label == "Port":
            m = _PORT.match(value)
            if m is None:
                problems.append((n, f"not a Port line (NAME PORT/PROTOCOL): {value!r}"))
                continue
            pname = None if m.group(1) in ("<unset>", "<unnamed>") else m.group(1)
            ports.append(ServicePort(int(m.group(2)), m.group(3), None, pname))
        elif label == "NodePort":
            m = _PORT.match(value)
            if m is None or not ports:
                problems.append((n, f"not a NodePort line after a Port line: {value!r}"))
                continue
            last = ports[-1]
            ports[-1] = ServicePort(last.port, last.protocol, int(m.group(2)), last.name)
        elif label == "LoadBalancer Ingress":
            for item in filter(None, (v.strip() for v in value.split(","))):
                m = _INGRESS.match(item)
                ip = canonical_ip(m.group(1)) if m else None
                if m is None or not (ip or _HOSTNAME.fullmatch(m.group(1))):
                    problems.append((n, f"not an address or hostname: {item[:60]!r}"))
                    continue
                at = m.group(1)
                lb.append(LoadBalancerIngress(ip=ip or None, hostname=None if ip else at,
                                              ip_mode=m.group(2)))
        elif label == "External IPs":
            external += [v.strip() for v in value.split(",") if canonical_ip(v.strip())]
    cluster_ip = first.get("IP")
    policy = first.get("External Traffic Policy") or None
    return Service(
        namespace=namespace or "default", name=name, type=stype,
        cluster_ip=cluster_ip if cluster_ip and canonical_ip(cluster_ip) else None,
        external_ips=tuple(external), lb_ingress=tuple(lb),
        external_traffic_policy=policy, annotations=annotations,
        ports=tuple(ports), status_given=True)


def _annotation(text: str, into: dict[str, str]) -> None:
    """One "key: value" of the Annotations field (the first beside its label, the others
    indented under it); a line of another shape (a long value kubectl wrapped) is none."""
    key, sep, value = text.strip().partition(": ")
    if sep and " " not in key:
        into[key] = value.strip()
