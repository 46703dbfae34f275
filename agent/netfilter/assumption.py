"""What a walk assumed where the input could not decide a match: a fact of the node the
input lacks. Both walkers (iptables and nftables) record one on the step that forked on it
and the path finder merges paths by them; nothing reads them back out of evidence text.

Each carries the question it stands for and the command that answers it on the node
(``fact``), as the verdict shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AssumptionKind(StrEnum):
    POD_SOURCE = "pod-source"  # a match on the source; the pods' addresses are unknown
    INTERFACE = "interface"  # -i/-o, iifname/oifname: the packet's interface is unknown
    ADDRTYPE = "addrtype"  # addrtype, fib ... type: which addresses are local
    IPSET = "ipset"  # a set the input does not hold
    LOCAL_ADDRESS = "local-address"  # routing: is the destination bound on the node
    UNSEEN_CHAIN = "unseen-chain"  # a kube-proxy chain jumped to, not in the input
    CNI_CHAIN = "cni-chain"  # a CNI's chain jumped to, not in the input
    MATCH = "match"  # any other match the input does not decide


@dataclass(frozen=True, slots=True)
class Assumption:
    kind: AssumptionKind
    subject: str  # the address, interface, set, chain or match asked about
    fact: str  # what it asks, and the command on the node that shows it
    # True: the walk followed every answer (a fork); False: it took the one the standard
    # layout of kube-proxy or a CNI gives, where the input does not show it
    forked: bool = True

    @property
    def direction(self) -> str:
        """For an interface: "-i" (enters) or "-o" (leaves)."""
        return self.subject.split(" ", 1)[0]


def pod_source() -> Assumption:
    return Assumption(AssumptionKind.POD_SOURCE, "pod CIDR", (
        "this node's pod CIDR; `kubectl get node NODE -o jsonpath='{.spec.podCIDR}'` shows "
        "it (or give --pod-cidr)"))


def interface(flag: str, pattern: str) -> Assumption:
    """``flag`` "-i" or "-o"; ``pattern`` as the rule names it (``azv+``, ``cni0``)."""
    way = "enters" if flag == "-i" else "leaves"
    return Assumption(AssumptionKind.INTERFACE, f"{flag} {pattern}", (
        f"whether the pod's packet {way} by an interface {pattern} names (kube-proxy's "
        "--detect-local-mode); `ip route` and `ip addr` on the node show the pods' "
        "interfaces"))


def addrtype() -> Assumption:
    return Assumption(AssumptionKind.ADDRTYPE, "local addresses", (
        "which addresses are local on this node (an `addrtype` match); `ip route show table "
        "local` shows it"))


def ipset(name: str) -> Assumption:
    return Assumption(AssumptionKind.IPSET, name,
                      f"the members of ipset {name}; `ipset list {name}` shows them")


def local_address(addr: str, shows: str) -> Assumption:
    """``shows``: the command(s) that tell, as the evidence quotes them."""
    return Assumption(AssumptionKind.LOCAL_ADDRESS, addr,
                      f"whether {addr} is bound on this node; {shows} shows it")


def unseen_chain(chain: str, shows: str) -> Assumption:
    """``shows``: the command that prints the chain (``iptables -t nat -S CHAIN``)."""
    return Assumption(AssumptionKind.UNSEEN_CHAIN, chain, f"what {chain} does; `{shows}` shows it",
                      forked=False)


def cni_chain(chain: str, cni: str, shows: str, forked: bool) -> Assumption:
    """A CNI's chain the input does not hold: its standard layout taken (``forked``
    False), or both of the answers its configuration allows followed."""
    return Assumption(AssumptionKind.CNI_CHAIN, chain,
                      f"what {cni}'s {chain} does on this node; `{shows}` shows it",
                      forked=forked)


def match(what: str) -> Assumption:
    """A match no other kind names; ``what`` is the step's line, which says it."""
    return Assumption(AssumptionKind.MATCH, what, what)
