"""What the common CNIs' own nat chains do to a pod's packet bound for a load balancer's
address, for a walk that meets a jump to one whose rules are not in the input (a pasted
`iptables -t nat -S POSTROUTING`, an excerpt): the CNI's standard layout decides it, the
walk says it assumed so and which command shows the chain; where the CNI's configuration
decides (an IP pool's natOutgoing, the VPC's CIDRs), both answers are followed and the
verdict says what it hangs on. A chain that is in the input is walked as written.

Each entry cites the code that writes the chain (issue 33, item 4). "private" is an
RFC 1918 or shared (100.64.0.0/10) address, where internal load balancers live.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from typing import Literal

# what the chain does to a pod's packet to an address outside the pod network:
# "passes" (no NAT for it), "masquerades" (to the node's address), "depends" (on the
# CNI's configuration, which the node's rules do not show)
Effect = Literal["passes", "masquerades", "depends"]


@dataclass(frozen=True, slots=True)
class CniChain:
    cni: str
    names: tuple[str, ...]  # the chain names it writes into the nat table
    public: Effect  # to a public address
    private: Effect  # to a private one
    does: str  # what it does, said for the evidence
    source: str  # the code (or doc) that writes it
    shows: str  # the commands that show what it holds on the node

    def effect(self, dst: str) -> Effect:
        return self.private if _private(dst) else self.public


_CALICO_SOURCE = ("projectcalico/calico felix/rules/static.go (StaticNATPreroutingChains, "
                  "StaticNATPostroutingChains) and felix/rules/nat.go "
                  "(makeNATOutgoingRuleIPTables)")
_CALICO_POST = CniChain(
    "Calico", ("cali-POSTROUTING", "cali-nat-outgoing"), "depends", "depends",
    "Calico's nat POSTROUTING chains: cali-nat-outgoing masquerades a pod's packet when the "
    "pod's IP pool has natOutgoing: true and the destination is in no Calico IP pool "
    "(`-m set --match-set cali40masq-ipam-pools src -m set ! --match-set "
    "cali40all-ipam-pools dst -j MASQUERADE`); with natOutgoing: false (common where pod "
    "addresses are routed, BGP) the pod's address leaves", _CALICO_SOURCE,
    "iptables -t nat -S cali-nat-outgoing; ipset list cali40masq-ipam-pools; "
    "calicoctl get ippool -o wide")

KNOWN: tuple[CniChain, ...] = (
    CniChain(
        "Calico", ("cali-PREROUTING", "cali-OUTPUT", "cali-fip-dnat"), "passes", "passes",
        "Calico's nat PREROUTING/OUTPUT chains only DNAT its floating IPs (cali-fip-dnat): a "
        "pod's packet to a load balancer's address passes them unless a workload has that "
        "address as a floating IP", _CALICO_SOURCE,
        "iptables -t nat -S cali-PREROUTING; iptables -t nat -S cali-fip-dnat"),
    _CALICO_POST,
    CniChain(
        "Calico", ("cali-fip-snat",), "passes", "passes",
        "Calico's floating IP SNAT: only a workload's own floating IP traffic",
        _CALICO_SOURCE, "iptables -t nat -S cali-fip-snat"),
    CniChain(
        "flannel", ("FLANNEL-POSTRTG",), "masquerades", "masquerades",
        "flannel writes this chain only with --ip-masq: it masquerades what leaves its "
        "Network (`-s <Network> ! -d 224.0.0.0/4 -j MASQUERADE`) and returns what kube-proxy "
        "marked 0x4000 (KUBE-POSTROUTING masquerades that)",
        "flannel-io/flannel pkg/trafficmngr/iptables/iptables.go (masqRules, v0.20.0 on)",
        "iptables -t nat -S FLANNEL-POSTRTG; cat /run/flannel/subnet.env"),
    CniChain(
        "AWS VPC CNI", ("AWS-SNAT-CHAIN-0",), "masquerades", "depends",
        "the AWS VPC CNI's SNAT chain returns destinations inside the VPC's CIDRs (and "
        "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS) and SNATs the rest to the node's primary "
        "address (`! -o vlan+ -m addrtype ! --dst-type LOCAL -j SNAT --to-source <primary "
        "IP>`): an internal load balancer's address is inside the VPC and keeps the pod's "
        "address (the NLB client-IP-preservation hairpin)",
        "aws/amazon-vpc-cni-k8s pkg/networkutils/network.go (buildIptablesSNATRules)",
        "iptables -t nat -S AWS-SNAT-CHAIN-0; iptables -t nat -S AWS-SNAT-CHAIN-1; aws ec2 "
        "describe-vpcs --query 'Vpcs[].CidrBlockAssociationSet[].CidrBlock'"),
    CniChain(
        "AWS VPC CNI", ("AWS-CONNMARK-CHAIN-0",), "passes", "passes",
        "the AWS VPC CNI's nat PREROUTING chain only sets a connection mark (0x80) that "
        "routes non-VPC pod traffic through the primary interface: no NAT",
        "aws/amazon-vpc-cni-k8s pkg/networkutils/iptables_connmark.go",
        "iptables -t nat -S AWS-CONNMARK-CHAIN-0"),
    CniChain(
        "Cilium", ("CILIUM_PRE_nat", "CILIUM_OUTPUT_nat"), "passes", "passes",
        "Cilium's nat feeder chains for PREROUTING and OUTPUT hold no rule for a pod's "
        "packet in its iptables mode (with its kube-proxy replacement Cilium serves load "
        "balancer addresses in eBPF, before iptables: no loop either)",
        "cilium/cilium pkg/datapath/iptables/iptables.go, custom_chain.go",
        "iptables -t nat -S CILIUM_PRE_nat; cilium-dbg status | grep KubeProxyReplacement"),
    CniChain(
        "Cilium", ("CILIUM_POST_nat",), "masquerades", "depends",
        "Cilium's iptables masquerade (`! -d <native-routing-cidr> -s <pod CIDR> ! -o "
        "cilium_+ -j MASQUERADE`): a destination inside ipv4-native-routing-cidr (the VPC's "
        "CIDR in cloud IPAM modes) keeps the pod's address",
        "cilium/cilium pkg/datapath/iptables/iptables.go (installMasqueradeRules)",
        "iptables -t nat -S CILIUM_POST_nat; cilium-dbg status --verbose | grep -i masq"),
    CniChain(
        "Antrea", ("ANTREA-POSTROUTING",), "masquerades", "masquerades",
        "Antrea masquerades pod traffic leaving the node for anything but a pod (`-s <pod "
        "CIDR> -m set ! --match-set ANTREA-POD-IP dst ! -o antrea-gw0 -j MASQUERADE`), "
        "unless it runs with noSNAT or in networkPolicyOnly mode (then the primary CNI "
        "decides)",
        "antrea-io/antrea pkg/agent/route/route_linux.go (syncIPTables)",
        "iptables -t nat -S ANTREA-POSTROUTING; kubectl -n kube-system get cm antrea-config "
        "-o yaml | grep -E 'noSNAT|trafficEncapMode'"),
    CniChain(
        "Weave Net", ("WEAVE",), "masquerades", "masquerades",
        "Weave Net masquerades what leaves its allocation range (`-s <range> ! -d <range> "
        "-j MASQUERADE`, weave expose)",
        "weaveworks/weave net/expose.go (exposeNAT), net/bridge.go",
        "iptables -t nat -S WEAVE"),
    CniChain(
        "ip-masq-agent", ("IP-MASQ-AGENT", "IP-MASQ"), "masquerades", "passes",
        "ip-masq-agent returns its nonMasqueradeCIDRs unmasqueraded (by default the RFC 1918 "
        "ranges: every internal load balancer's address) and masquerades the rest",
        "kubernetes-sigs/ip-masq-agent cmd/ip-masq-agent/ip-masq-agent.go and its README "
        "(the default nonMasqueradeCIDRs)",
        "iptables -t nat -S IP-MASQ-AGENT; kubectl -n kube-system get cm ip-masq-agent -o "
        "yaml"),
)
_BY_NAME = {name: c for c in KNOWN for name in c.names}


def known_chain(table: str, name: str) -> CniChain | None:
    """The CNI chain ``name`` is, where it is one of the nat table's known ones."""
    return _BY_NAME.get(name) if table == "nat" else None


_PRIVATE = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))


@functools.lru_cache(maxsize=4096)
def _private(addr: str) -> bool:
    try:
        a = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return any(a.version == n.version and a in n for n in _PRIVATE)
