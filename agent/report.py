"""The human-readable report of a verdict (what an SRE reads at 3 a.m.)."""

from __future__ import annotations

import textwrap
from collections import Counter
from typing import TYPE_CHECKING

from agent.capture.model import NodePortStats
from agent.diagnose.model import Finding, Verdict

if TYPE_CHECKING:
    from agent.predict.what_if import WhatIf

_STATUS_LINE = {
    "healthy": "HEALTHY: no CLB loopback exposure found",
    "unknown": "UNKNOWN: no exposure found, but loopback could not be ruled out on this node "
               "(see below why)",
    "at-risk": "AT RISK: this node is exposed to CLB loopback",
    "loopback": "LOOPBACK OBSERVED: traffic through the load balancer loops back and fails",
}
_MARK = {"critical": "CRITICAL", "warning": "WARNING", "info": "info"}
TOP_PORTS = 10  # NodePorts listed in the capture section
# A 10k-service node's report was 60,000 lines, every "ok" LB IP and every note listed:
# without --verbose, the LB IPs that are ok and the notes of a kind past these counts are
# counted, not listed (the LB IPs at risk and the findings are always listed)
OK_LB_IPS_LISTED = 20
EXPOSED_LB_IPS_LISTED = 50  # the rest are under Findings (--verbose lists every one)
NOTES_LISTED = 20  # notes listed one by one; past it, grouped by kind
NOTES_PER_KIND = 3  # a kind's notes shown when grouped
FINDINGS_IN_FULL = 5  # a kind's findings with their evidence; past it (when more than
# twice as many), one line each
FINDINGS_IN_LINES = 50  # a kind's findings in one line each; past it, counted


def _failed(p: NodePortStats) -> int:
    return sum(n for o in ("bypassed", "unanswered") for n in p.counts.get(o, {}).values())


def render(v: Verdict, verbose: bool = False, width: int = 100) -> str:
    out: list[str] = []
    ctx = v.context

    def wrap(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text, width=width, initial_indent=indent,
                             subsequent_indent=indent + "  ", break_long_words=False,
                             break_on_hyphens=False) or [indent]

    out.append(f"loopback-agent {v.agent_version}  node {v.node}  {v.time}  "
               f"({ctx.origin})")
    out.append(_STATUS_LINE.get(v.status, v.status))
    out.append(f"kube-proxy mode: {v.kube_proxy_mode}"
               + (f" ({ctx.kube_proxy_mode_from})" if ctx.kube_proxy_mode_from else "")
               + (f"; version {ctx.kube_proxy_version}" if ctx.kube_proxy_version else ""))
    node_bits = []
    if ctx.uplink:
        node_bits.append(f"uplink {ctx.uplink} {ctx.node_ip or ''}".rstrip())
    if ctx.pod_network:
        node_bits.append(f"pods {ctx.pod_network} via {ctx.pod_interface or '?'}")
    if ctx.iptables_backend:
        node_bits.append(f"iptables backend {ctx.iptables_backend}")
    if node_bits:
        out.append("node: " + "; ".join(node_bits))
    out.append("")

    out.append(f"LoadBalancer / external / Ingress IPs known here: {len(v.lb_ips)}")
    by_ip: dict[str, list[Finding]] = {}
    for f in v.findings:
        if f.lb_ip:
            by_ip.setdefault(f.lb_ip, []).append(f)
    shown = {"ok": 0, "exposed": 0}
    hidden = {"ok": 0, "exposed": 0}
    limit = {"ok": OK_LB_IPS_LISTED, "exposed": EXPOSED_LB_IPS_LISTED}
    # the address column as wide as the longest address (IPv6 ones run to 39 characters)
    ip_width = max(15, max((len(r.ip) for r in v.lb_ips), default=0))
    for r in v.lb_ips:
        worst = by_ip.get(r.ip, [])
        tag = "exposed" if any(f.severity != "info" for f in worst) else "ok"
        if not verbose and shown[tag] >= limit[tag]:
            hidden[tag] += 1
            continue
        shown[tag] += 1
        svc = ",".join(r.services) or "service unknown"
        local = {True: "bound locally", False: "not local", None: "local?"}[r.local]
        out.append(f"  {r.ip:<{ip_width + 1}} {' '.join(r.ports):<14} {r.kind:<12} "
                   f"{svc:<28} {local:<13} {tag}")
    if hidden["exposed"]:
        out.append(f"  ... and {hidden['exposed']} more exposed (their findings are below; "
                   "--verbose lists every one)")
    if hidden["ok"]:
        out.append(f"  ... and {hidden['ok']} more, all ok (--verbose lists every one)")
    out.append("")

    cap = v.capture
    if cap and not cap.seconds:
        out.append("Capture did not run (the reason is under \"Could not read\").")
        out.append("")
    elif cap:
        out.append(f"Captured {cap.seconds:.0f}s of NodePort handshakes "
                   f"({cap.port_range[0]}-{cap.port_range[1]}): "
                   f"{sum(p.syns for p in cap.ports) + cap.syns_omitted} SYNs, "
                   f"kernel drops {cap.kernel_drops}, evicted {cap.table_evictions}")
        # the ports with the most failed handshakes, then the busiest: a burst to the
        # whole range is a few lines, not thousands
        top = sorted(cap.ports, key=lambda p: (-_failed(p), -p.syns, p.node_port))
        for p in sorted(top[:TOP_PORTS], key=lambda p: p.node_port):
            counts = ", ".join(f"{o} from {s}: {n}" for o, by in sorted(p.counts.items())
                               for s, n in sorted(by.items()))
            out.extend(wrap(f"NodePort {p.node_port}: {counts}", "  "))
        more = len(top) - TOP_PORTS + cap.ports_omitted
        if more > 0:
            out.append(f"  ... and {more} more NodePorts")
        out.append("")

    problems = [f for f in v.findings if f.severity != "info"]
    infos = [f for f in v.findings if f.severity == "info"]
    if problems:
        out.append(f"Findings ({len(problems)}):")
        per_kind = Counter(f.id for f in problems)
        seen: Counter[str] = Counter()
        for f in problems:
            seen[f.id] += 1
            n = seen[f.id]
            if verbose or n <= FINDINGS_IN_FULL or per_kind[f.id] <= 2 * FINDINGS_IN_FULL:
                out.extend(_finding(f, wrap, evidence=True))
            elif n <= FINDINGS_IN_FULL + FINDINGS_IN_LINES:
                # the same finding again for another LB IP: where, not the why again
                if n == FINDINGS_IN_FULL + 1:
                    out.append("")
                    out.append(f"  [{_MARK[f.severity]}] {f.id}, also for "
                               "(as above; --verbose shows each one's evidence):")
                out.append(f"    {_where(f)}" + (f"  ({f.service})" if f.service else ""))
        for kind, n in per_kind.items():
            if not verbose and n > FINDINGS_IN_FULL + FINDINGS_IN_LINES:
                out.append(f"  ... and {n - FINDINGS_IN_FULL - FINDINGS_IN_LINES} more {kind} "
                           "(--verbose lists every one; --json for a script)")
    else:
        out.append("Findings: none that put this node at risk.")
    if infos:
        out.append("")
        out.append(f"Notes ({len(infos)}):")
        if verbose or len(infos) <= NOTES_LISTED:
            for f in infos:
                out.extend(_finding(f, wrap, evidence=verbose))
        else:
            out.extend(_grouped_notes(infos, wrap))
    if v.unknowns:
        out.append("")
        out.append(f"Could not read or decide ({len(v.unknowns)}):")
        for u in v.unknowns:
            out.extend(wrap(f"- {u.source}: {u.reason}", "  "))
    assumed = ctx.assumed_rules
    if assumed:
        out.append("")
        out.append("Assumed (not in the dump):")
        for a in assumed:
            out.extend(wrap(f"- {a}", "  "))
    if infos and not verbose:
        out.append("")
        out.append("(--verbose shows the evidence of the notes; --json prints the verdict.)")
    return "\n".join(out) + "\n"


def _where(f: Finding) -> str:
    where = f.lb_ip or ""
    if f.port:
        # an IPv6 address before its port in brackets: 2001:db8::7:80 is another address
        where = f"[{where}]" if ":" in where else where
        # (no address: a port of the Service, as a load balancer known by hostname has)
        where += f":{f.port}/{f.protocol or ''}" if where else f"port {f.port}/{f.protocol or ''}"
    return where


def _grouped_notes(infos: list[Finding], wrap) -> list[str]:  # type: ignore[no-untyped-def]
    """Many notes (one per LB IP on a big node): per kind, how many and a few of them."""
    kinds: dict[str, list[Finding]] = {}
    for f in infos:
        kinds.setdefault(f.id, []).append(f)
    lines: list[str] = []
    for kind, fs in sorted(kinds.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append("")
        lines.append(f"  {kind}: {len(fs)} notes" + (", the first of them:"
                                                      if len(fs) > NOTES_PER_KIND else ":"))
        for f in fs[:NOTES_PER_KIND]:
            lines += _finding(f, wrap, evidence=False)[1:]
        if len(fs) > NOTES_PER_KIND:
            lines.append(f"  ... and {len(fs) - NOTES_PER_KIND} more {kind} (--verbose lists "
                         "each with its evidence)")
    return lines


def _finding(f: Finding, wrap, evidence: bool) -> list[str]:  # type: ignore[no-untyped-def]
    head = f"[{_MARK[f.severity]}] {f.id}  {_where(f)}"
    if f.service:
        head += f"  ({f.service})"
    lines = ["", "  " + head]
    lines += wrap(f.summary, "    ")
    if f.data and f.data.get("kind") == "nodeport-table":
        lines += _nodeport_table(f.data, wrap)
    if evidence and f.evidence:
        lines.append("    Evidence:")
        for e in f.evidence:
            lines += wrap(f"- {e}", "      ")
    if f.remedy:
        lines += wrap(f"Remedy: {f.remedy}", "    ")
    return lines


def _nodeport_table(d: dict, wrap) -> list[str]:  # type: ignore[no-untyped-def,type-arg]
    """A capture finding's NodePorts: ranges, then the busiest rows and how many more."""
    ranges = ", ".join(str(r) for r in d.get("port_ranges") or [])
    if d.get("ports_not_in_ranges"):
        ranges += f" and {d['ports_not_in_ranges']} more"
    when = ""
    if d.get("first_seen"):
        when = f", first {d['first_seen']}, last {d.get('last_seen') or '?'}"
    lines = wrap(f"NodePorts ({d.get('nodeports', 0)}): {ranges}{when}", "    ")
    for r in d.get("ports") or []:
        # times of day (the finding's line above has the dates)
        seen = (f"  {str(r['first_seen'])[11:19]}..{str(r.get('last_seen') or '?')[11:19]}"
                if r.get("first_seen") else "")
        lines.append(f"      {r['node_port']:<6} {r.get('service') or '-':<28} "
                     f"{r['syns']:>6} SYNs (bypassed {r.get('bypassed', 0)}, "
                     f"unanswered {r.get('unanswered', 0)}){seen}")
    if d.get("ports_more"):
        lines.append(f"      ... and {d['ports_more']} more NodePorts")
    return lines


# changes listed one by one in the --what-if report; past it, counted (--verbose: all)
CHANGES_LISTED = 30


def render_what_if(w: WhatIf, verbose: bool = False, width: int = 100) -> str:
    """`check --what-if MODE`: today's status and the predicted one, then per LB address
    what appears and what vanishes, and what the prediction took."""

    def wrap(text: str, indent: str, then: str | None = None) -> list[str]:
        return textwrap.wrap(text, width=width, initial_indent=indent,
                             subsequent_indent=then or indent + "  ", break_long_words=False,
                             break_on_hyphens=False) or [indent]

    t, p = w.today, w.predicted
    out = [f"loopback-agent {t.agent_version}  node {t.node}  {t.time}  ({t.context.origin})",
           f"WHAT IF kube-proxy ran in {w.target} mode here (predicted for the Services and "
           f"endpoints it serves today)",
           f"  today ({t.kube_proxy_mode}):  {_STATUS_LINE[t.status]}",
           f"  predicted ({w.target}):  {_STATUS_LINE[p.status]}", ""]
    if not w.changes:
        out.append(f"No LB address changes its findings ({w.same} address:ports compared).")
    else:
        out.append(f"Changes ({len(w.changes)} LB address:ports; {w.same} unchanged):")
        if len(w.changes) > CHANGES_LISTED:
            # what changes, counted: 10k Services make thousands of the same few
            kinds = Counter((c.vanish, c.appear) for c in w.changes)
            for (gone, came), n in kinds.most_common(8):
                out += wrap(f"{n} x " + "; ".join(x for x in (
                    "vanish: " + ", ".join(gone) if gone else "",
                    "appear: " + ", ".join(came) if came else "") if x), "  ")
            out.append("")
        shown = w.changes if verbose else w.changes[:CHANGES_LISTED]
        for c in shown:
            host = f"[{c.lb_ip}]" if ":" in c.lb_ip else c.lb_ip
            where = f"{host}:{c.port}/{c.protocol}" if c.port else host
            out.append(f"  {where}" + (f"  ({c.service})" if c.service else ""))
            if c.vanish:
                out += wrap("vanish: " + ", ".join(c.vanish), "    ")
            if c.appear:
                out += wrap("appear: " + ", ".join(c.appear), "    ")
            if c.unfixed is not None:
                out += wrap("with a kube-proxy older than v1.34.0 / v1.33.6 (before "
                            "kubernetes#132456, the fix of kubernetes#131765): "
                            + ", ".join(c.unfixed), "    ")
        if len(shown) < len(w.changes):
            out.append(f"  ... and {len(w.changes) - len(shown)} more (--verbose lists "
                       "them, --json gives them all)")
    out += ["", "The prediction took:"]
    for n in w.notes:
        out += wrap(n, "  - ", "    ")
    if verbose:
        out += ["", "=" * 20 + " the predicted verdict " + "=" * 20, "",
                render(p, verbose=True, width=width)]
    else:
        out.append("")
        out.append("(--verbose adds the predicted verdict in full; --json gives both "
                   "verdicts and the changes.)")
    return "\n".join(out) + "\n"
