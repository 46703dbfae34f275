"""The node state kube-proxy (and its neighbours) would leave behind, as plain text.

Pure functions, no I/O. They model what the upstream sources write, so the lab, the
parser tests and the benchmark all see realistic input. kube-proxy's own modes are the
agent's generators (agent.predict: nftables, iptables, ipvs, the iptables renderings in
agent.predict.xtables), which `check --what-if` writes too; the modules here adapt the
lab's Service model (``LbService``) to the agent's (agent.predict.model) and call them,
so there is one implementation of each:

* iptables mode, "new" generation (v1.24+, pkg/proxy/iptables/proxier.go): KUBE-SVC-,
  KUBE-SVL-, KUBE-EXT-, KUBE-SEP- chains, "has no local endpoints" DROPs in the filter
  table, KUBE-POSTROUTING with the RETURN / --xor-mark / MASQUERADE triple
  (agent.predict.iptables);
* iptables mode, "old" generation (v1.18/v1.19 era): KUBE-FW- and KUBE-XLB- chains,
  KUBE-MARK-DROP for eTP=Local without local endpoints, KUBE-POSTROUTING with a single
  mark-matching MASQUERADE (the lab's own: no prediction targets it);
* IPVS mode (pkg/proxy/ipvs/proxier.go, ipset.go): the KUBE-* ipsets, the set-matching
  nat rules, the kube-ipvs0 addresses and the IPVS virtual servers (agent.predict.ipvs);
* nftables mode (pkg/proxy/nftables/proxier.go): the knftables transaction for table
  `ip kube-proxy`, as `nft -f` takes it (agent.predict.nftables; the benchmark's nftables
  state);
* ip-masq-agent's IP-MASQ-AGENT chain and a plain CNI masquerade rule.

Two renderings of the same iptables rules exist because both occur in the field: what
``iptables-save`` prints on a node (``iptables_mode``: header, built-in chain hooks,
``/32`` suffixes, ``--set-xmark``, 11-digit probabilities, comments quoted only when
needed) and what kube-proxy itself pipes into ``iptables-restore``
(``kube_proxy_restore_input``: kube-proxy's argument order, ``--or-mark 0x004000``,
no hooks). The save rendering was checked against real ``iptables-save`` output by
loading it into a namespace and saving it back (tests/test_lab.py).

One module per mode (iptables, ipvs, nftables), what they share in common, the
neighbours (ip-masq-agent, CNI), the API objects and node text outputs (objects), and the
benchmark's synthetic states (synthetic); this package re-exports their public names.
"""

from lab.kube_proxy_rules.common import IngressSpec, LbService, chain_hash, endpoint_chain_hash
from lab.kube_proxy_rules.iptables import iptables_mode, kube_proxy_restore_input
from lab.kube_proxy_rules.ipvs import IpvsNodeState, ipvs_mode
from lab.kube_proxy_rules.neighbours import cni_masquerade, ip_masq_agent, merge_restore
from lab.kube_proxy_rules.objects import (
    ingresses_json,
    ip_addr_text,
    node_json,
    route_local_text,
    services_json,
    sysctl_text,
)
from lab.kube_proxy_rules.synthetic import synthetic

__all__ = [
    "IngressSpec", "IpvsNodeState", "LbService", "chain_hash", "cni_masquerade",
    "endpoint_chain_hash", "ingresses_json", "ip_addr_text", "ip_masq_agent", "iptables_mode",
    "ipvs_mode", "kube_proxy_restore_input", "merge_restore", "node_json", "route_local_text",
    "services_json", "synthetic", "sysctl_text",
]
