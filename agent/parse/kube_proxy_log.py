"""kube-proxy's log lines that say a sync failed, in klog's form (plain or structured):

    E0718 12:11:12.833267       1 proxier.go:1499] Failed to bind service address ...
    E0718 12:11:12.851157       1 ipset.go:152] "Failed to add entry" err="..."

One place for what such a line is (the file klog names is one of kube-proxy's proxier's:
another component's "Failed to sync pod" about kube-proxy's Pod is not kube-proxy's word)
and for when two lines say the same (a log repeats its error every sync).
"""

from __future__ import annotations

import re

# klog's header: severity, date, time, thread id, file:line]
_KLOG = re.compile(r"[IWEF]\d{4} [\d:.]+\s+\d+ ([\w.-]+\.go):\d+\] (.*)")
# the files of kube-proxy's proxiers that log a failed sync (pkg/proxy/{iptables,ipvs,
# nftables}/proxier.go, pkg/proxy/ipvs/ipset.go, pkg/proxy/ipvs/util/...)
_FILES = frozenset({"proxier.go", "ipset.go", "netlink_linux.go", "graceful_termination.go"})


def failed_sync(line: str) -> str | None:
    """The message of a kube-proxy line that says a sync failed ("Failed to ..."), without
    klog's header; None for any other line."""
    m = _KLOG.search(line)
    if m is None or m.group(1) not in _FILES:
        return None
    msg = m.group(2).strip()
    return msg if msg.lstrip('"').startswith("Failed to ") else None
