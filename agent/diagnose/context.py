"""What every diagnosis rule gets: the snapshot and the facts derived from it once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.capture.model import CaptureResult
from agent.diagnose.kube_proxy_version import KubeProxyVersion
from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import KubeProxyMode
from agent.diagnose.node_facts import NodeFacts
from agent.diagnose.paths import PathFinder
from agent.snapshot import NodeSnapshot, Unknown


@dataclass
class Context:
    snapshot: NodeSnapshot
    facts: NodeFacts
    targets: list[LbTarget]
    paths: PathFinder
    mode: KubeProxyMode
    mode_how: str
    unknowns: Unknowns  # shared by the IPv4 and IPv6 contexts of one diagnosis
    chain_services: Mapping[str, str]  # KUBE-SVC-<hash> etc. -> "ns/name"
    capture: CaptureResult | None = None
    # IPv6 LB addresses: not walked (ip6tables), but decided where the rule does not need
    # a walk (lb-ip-local)
    v6_targets: list[LbTarget] = field(default_factory=list)
    # the family this context walks: 6 for the IPv6 view (agent.diagnose.family), where
    # findings that rest on IPv4-only sysctls (rp_filter, accept_local) do not apply
    family: int = 4
    # which kube-proxy wrote the rules, where the input says (its log, its rules' shape)
    kube_proxy_version: KubeProxyVersion | None = None

    def unknown(self, source: str, reason: str) -> None:
        self.unknowns.add(source, reason)


class Unknowns(list[Unknown]):
    """The verdict's unknowns in the order reported, each once. A set beside the list
    keeps that linear: an IPVS node whose addresses are not in the input reports one per
    LB IP, and a scan of the list for each made 10k LB IPs cost 0.7 s."""

    def __init__(self, items: Iterable[Unknown] = ()) -> None:
        super().__init__(items)
        self._seen = set(self)

    def add(self, source: str, reason: str) -> None:
        u = Unknown(source, reason)
        if u not in self._seen:
            self._seen.add(u)
            self.append(u)
