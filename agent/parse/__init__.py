"""Readers for the text/JSON outputs of node tools and kubectl (bundle files).

Every reader is a pure function of the text; bad input raises ``agent.errors.InputError``
naming the file and, where known, the 1-based line.
"""

from agent.parse.addr_text import parse_addresses
from agent.parse.ipset_text import parse_ipsets
from agent.parse.ipvsadm_text import parse_ipvsadm
from agent.parse.kube import load_json, parse_ingresses, parse_node, parse_services
from agent.parse.route_text import parse_local_routes
from agent.parse.sysctl_text import parse_sysctls

__all__ = [
    "load_json",
    "parse_addresses",
    "parse_ingresses",
    "parse_ipsets",
    "parse_ipvsadm",
    "parse_local_routes",
    "parse_node",
    "parse_services",
    "parse_sysctls",
]
