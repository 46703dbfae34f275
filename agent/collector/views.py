"""Fleet views computed from the latest verdict of each node (pure functions)."""

from __future__ import annotations

from typing import Any

_RANK = {"loopback": 0, "at-risk": 1, "healthy": 2}
OBSERVED = {"loopback-observed", "healthcheck-dropped-local-source"}


def nodes_view(latest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Latest verdict per node, worst first."""
    rows = []
    for v in latest:
        serious = [f for f in v["findings"] if f["severity"] != "info"]
        rows.append({"node": v["node"], "status": v["status"], "time": v["time"],
                     "kube_proxy_mode": v["kube_proxy_mode"],
                     "findings": len(serious),
                     "ids": sorted({f["id"] for f in serious}),
                     "unknowns": len(v["unknowns"])})
    return sorted(rows, key=lambda r: (_RANK.get(r["status"], 3), -r["findings"], r["node"]))


def services_view(latest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each LB IP / Service: on which nodes it is exposed, where loopback was observed."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for v in latest:
        for f in v["findings"]:
            if f["severity"] == "info" or not (f["lb_ip"] or f["service"]):
                continue
            key = (f["service"] or "", f["lb_ip"] or "")
            row = out.setdefault(key, {"service": f["service"], "lb_ip": f["lb_ip"],
                                       "exposed_nodes": set(), "observed_nodes": set(),
                                       "ids": set()})
            row["ids"].add(f["id"])
            (row["observed_nodes"] if f["id"] in OBSERVED else row["exposed_nodes"]).add(
                v["node"])
    rows = [{**r, "exposed_nodes": sorted(r["exposed_nodes"]),
             "observed_nodes": sorted(r["observed_nodes"]), "ids": sorted(r["ids"])}
            for r in out.values()]
    return sorted(rows, key=lambda r: (-len(r["observed_nodes"]), -len(r["exposed_nodes"]),
                                       r["service"] or "", r["lb_ip"] or ""))
