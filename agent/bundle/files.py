"""The files of a support bundle (`bundle DIR` writes them, `check --from DIR` reads them)."""

IPTABLES = "iptables-save.txt"
IPSET = "ipset.txt"
IPVSADM = "ipvsadm.txt"
ROUTE_LOCAL = "route-local.txt"
ADDR = "addr.txt"
SYSCTL = "sysctl.txt"
SERVICES = "services.json"
NODE = "node.json"
INGRESSES = "ingresses.json"
# kube-proxy's DaemonSet, reduced to its name and its containers' images (its version)
KUBE_PROXY_DAEMONSET = "kube-proxy-daemonset.json"
# `nft list ruleset` when a kube-proxy table is in it (bundles before 2026-11 have it as
# nft-kube-proxy.json, `nft -j`: every file is read by its content, so both still load)
NFT = "nft-ruleset.txt"
IP6TABLES = "ip6tables-save.txt"  # the IPv6 rules, of the backend iptables-save.txt's is
# kube-proxy's :10249/metrics, with the time it was read above it (its sync health)
KUBE_PROXY_METRICS = "kube-proxy-metrics.txt"

ALL = (IPTABLES, IPSET, IPVSADM, ROUTE_LOCAL, ADDR, SYSCTL, SERVICES, NODE, INGRESSES, NFT,
       IP6TABLES, KUBE_PROXY_METRICS, KUBE_PROXY_DAEMONSET)
