"""diagnose(snapshot) -> Verdict: pure, the same for a live node, a bundle or a snapshot."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field

from agent import __version__
from agent.capture.model import CaptureResult
from agent.diagnose import parallel
from agent.diagnose.context import Context, Unknowns
from agent.diagnose.family import ipv6_facts, ipv6_snapshot, v6_local_known
from agent.diagnose.iptables_backend import iptables_paths
from agent.diagnose.kube_proxy_version import kube_proxy_version
from agent.diagnose.lb_ip import ChainServices, LbTarget, discover, split_by_family
from agent.diagnose.model import (
    Finding,
    KubeProxyMode,
    LbIpReport,
    Verdict,
    VerdictContext,
    status_of,
)
from agent.diagnose.nft_paths import NftBackend, nft_mode, nft_paths, nft_targets
from agent.diagnose.node_facts import NodeFacts, build_facts, kube_proxy_mode
from agent.diagnose.parallel import SplitRules, usable_jobs
from agent.diagnose.rules import etp_local, pod_to_lb
from agent.snapshot import NodeSnapshot, Unknown
from agent.verdict_doc import OBSERVED_IDS

_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
# the rules that walk each LB IP: run again over the IPv6 view for IPv6 LB IPs
FAMILY_RULES = (pod_to_lb.check, etp_local.check)


# the node of a saved input that does not name it (no node.json, no --node-name): never
# the name of the machine the analyst runs the check on
UNNAMED_NODE = "unnamed-node"


def node_name(explicit: str | None, snap: NodeSnapshot | None, environ: dict[str, str]) -> str:
    """--node-name, else (a live node) NODE_NAME (downward API), else the snapshot's, else
    (live) the hostname; a saved input (a bundle, a paste, a snapshot file) is named by
    what it holds, else NODE_NAME, else UNNAMED_NODE: never by the machine that reads it."""
    held = snap.node if snap is not None else None
    if snap is not None and snap.origin != "live":
        return explicit or held or environ.get("NODE_NAME") or UNNAMED_NODE
    name = explicit or environ.get("NODE_NAME") or held
    if name:
        return name
    import socket  # (here: a bundle names its node, and socket costs 4 ms to import)

    return socket.gethostname()


# what each rule found in a snapshot's first diagnosis, by (rule, family), with the
# unknowns it added
Memo = dict[tuple[Callable[..., object], int], tuple[list[Finding], list[Unknown]]]


@dataclass(frozen=True)
class Prepared:
    """What a snapshot says about the node, derived once: the capture classifies SYN
    sources with it and the diagnosis walks it (agent.watch)."""

    facts: NodeFacts
    all_targets: tuple[LbTarget, ...]  # every LB/external/Ingress address, any family
    not_walked: tuple[str, ...] = ()  # targets left out past discovery's bounds, and why
    # what each rule that does not read the capture found, by (rule, family), with the
    # unknowns it added: filled by the first diagnosis of this snapshot when every rule
    # ran without an error, replayed by the next ones (the daemon keeps the Prepared of
    # an unchanged snapshot for the next capture: walking 10k LB IPs again each cycle was
    # 12 % of a core on an unchanged 10k-service node)
    memo: Memo = field(default_factory=dict, compare=False, repr=False)


def prepare(snap: NodeSnapshot) -> Prepared:
    found = discover(snap)
    targets = tuple(found.targets)
    if snap.nft:  # kube-proxy nftables mode: its table names LB IPs too
        targets = nft_targets(snap, targets)
    return Prepared(build_facts(snap), targets, tuple(found.not_walked))


def diagnose(snap: NodeSnapshot, node: str, now: dt.datetime | None = None,
             capture: CaptureResult | None = None,
             prepared: Prepared | None = None, jobs: int = 1) -> Verdict:
    """The verdict for one node; ``capture`` adds what watched handshakes showed;
    ``prepared`` is ``prepare(snap)`` when the caller already made it; ``jobs`` 2 lets a
    forked child walk half of a big node's LB IPs (the same verdict, sooner)."""
    prepared = prepared or prepare(snap)
    ctx, v6_ctx, findings = _contexts(snap, prepared, capture)
    findings += _run_rules(ctx, v6_ctx, prepared.memo, jobs)
    if prepared.not_walked:
        findings.append(Finding(
            "diagnosis-incomplete", "warning",
            "Some LB IP:port targets were not walked (more than the agent walks per Service "
            "or per node): loopback is not ruled out for them",
            evidence=tuple(prepared.not_walked[:20]) + (
                (f"... and {len(prepared.not_walked) - 20} more",)
                if len(prepared.not_walked) > 20 else ()),
            remedy="Check the Services named by hand; so many addresses x ports in one "
                   "Service is unusual (a tenant's mistake or an attack on node agents)."))
    # (each LB IP's key made once: 10k LB IPs have 2-3 findings each)
    ip_keys = {ip: _ip_key(ip) for ip in {f.lb_ip for f in findings}}
    findings.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], ip_keys[f.lb_ip], f.port or 0,
                                 f.id))
    now = now or dt.datetime.now(dt.UTC)
    return Verdict(
        node=node,
        time=now.isoformat(timespec="seconds").replace("+00:00", "Z"),
        agent_version=__version__,
        status=status_of(findings, observed=any(f.id in OBSERVED_IDS for f in findings),
                         mode=ctx.mode),
        kube_proxy_mode=ctx.mode,
        findings=tuple(findings),
        unknowns=tuple(ctx.unknowns),
        lb_ips=_lb_ip_reports(ctx),
        context=_context_record(ctx, v6_ctx),
        capture=capture,
    )


def _mode(snap: NodeSnapshot) -> tuple[KubeProxyMode, str]:
    """kube-proxy's mode and how the input shows it."""
    mode, mode_how = kube_proxy_mode(snap)
    if snap.nft or (snap.kube_proxy and snap.kube_proxy.mode == "nftables"):
        mode, mode_how = nft_mode(snap, mode, mode_how)
    return mode, mode_how


def _contexts(snap: NodeSnapshot, prepared: Prepared, capture: CaptureResult | None
              ) -> tuple[Context, Context | None, list[Finding]]:
    """What the rules walk: the context of the mode's path finder (IPv4, and IPv6 too in
    nftables mode), the IPv6 one of the iptables modes, and the findings that say what
    cannot be walked at all."""
    facts = prepared.facts
    mode, mode_how = _mode(snap)
    targets, v6_targets, skipped = split_by_family(list(prepared.all_targets))
    unknowns = Unknowns([*snap.unknowns, *(Unknown("LB IPs", r) for r in skipped)])
    paths = nft_paths(facts) if mode == "nftables" else iptables_paths(facts)
    if isinstance(paths.backend, NftBackend):  # its ip6 table is walked as the ip one
        nft = paths.backend
        targets += [t for t in v6_targets if nft.walks(t.ip)]
        v6_targets = [t for t in v6_targets if not nft.walks(t.ip)]
    ctx = Context(snap, facts, targets, paths, mode, mode_how, unknowns,
                  ChainServices(snap), capture, v6_targets,
                  kube_proxy_version=kube_proxy_version(snap, mode))
    findings = _lb_ips_unknown(ctx)
    if mode == "unknown" and snap.ip6tables is not None:
        # an ip6tables-save alone says it
        mode6, how6 = kube_proxy_mode(ipv6_snapshot(snap))
        if mode6 != "unknown":
            ctx.mode, ctx.mode_how = mode6, how6 + " (in the IPv6 rules)"
    v6_ctx = _ipv6_context(ctx, v6_targets) if v6_targets else None
    if v6_ctx is None:
        findings += _ipv6_not_walked(v6_targets, snap, ctx.mode)
    return ctx, v6_ctx, findings


def _lb_ips_unknown(ctx: Context) -> list[Finding]:
    """Where the input cannot show the LB IPs: Services given as manifests (unknowns), and
    none visible at all without the Service objects (a finding)."""
    snap = ctx.snapshot
    manifests = _manifests_only(snap)
    for key in manifests:
        ctx.unknown("LB IPs", f"Service {key} (type LoadBalancer) was given without its "
                    "status (a manifest, not `kubectl get svc -o yaml`): its load balancer "
                    "addresses are not in the input")
    if ctx.targets or ctx.v6_targets or (snap.services is not None and not manifests):
        return []
    # without the Service objects "none found" may just mean "not visible here"
    return [Finding(
        "lb-ips-unknown", "warning",
        "No LoadBalancer, external or Ingress address is visible: without the Service "
        "objects (API access or services.json) the agent cannot rule loopback out",
        evidence=(("no address in kube-proxy's service-ips map outside @cluster-ips"
                   if ctx.mode == "nftables" else
                   "no KUBE-LOAD-BALANCER ipset entry, no 'loadbalancer IP' rule"),
                  *(f"Service {key}: a manifest without status (its address is not in "
                    "it)" for key in manifests[:5])),
        remedy="Run with API access, or give --kube-json DIR / services.json in the "
               "bundle.")]


def _run_rules(ctx: Context, v6_ctx: Context | None, memo: Memo, jobs: int
               ) -> list[Finding]:
    """Every rule over ``ctx`` (the family rules over ``v6_ctx`` too). What each rule that
    does not read the capture found is kept in ``memo`` from a diagnosis where every rule
    ran, and replayed by the next ones of the same snapshot; a rule's internal error is a
    finding, never the others' loss."""
    from agent.diagnose.rules import CAPTURE_RULES, RULES

    reuse = bool(memo)  # (kept only from a diagnosis where every rule ran)
    made: Memo = {}

    def run(rule: Callable[[Context], list[Finding]], c: Context,
            how: Callable[[Context], list[Finding]]) -> list[Finding]:
        """``how(c)``, or what it found in this snapshot's first diagnosis (its unknowns
        added again, in the same order: the same verdict)."""
        if rule in CAPTURE_RULES:
            return how(c)
        key = (rule, c.family)
        if reuse:
            got, added = memo[key]
            for u in added:
                c.unknown(u.source, u.reason)
            return got
        before = len(c.unknowns)
        got = how(c)
        made[key] = (got, c.unknowns[before:])
        return got

    findings: list[Finding] = []
    failed = False
    split = SplitRules(ctx, FAMILY_RULES) \
        if ctx.mode in parallel.SPLIT_MODES and usable_jobs(jobs, len(ctx.targets)) > 1 \
        and not reuse else None
    for rule in RULES:
        how = rule
        if split is not None and rule in split.rules:
            def how(c: Context, r: Callable[[Context], list[Finding]] = rule,
                    s: SplitRules = split) -> list[Finding]:
                return s.run(r, c)
        try:
            findings.extend(run(rule, ctx, how))
        except Exception as e:  # a bug in one rule must not hide the others' findings
            failed = failed or rule not in CAPTURE_RULES
            findings.append(_internal_error(ctx, rule, e, ""))
    if split is not None:
        split.close()
    for rule in FAMILY_RULES if v6_ctx is not None else ():
        assert v6_ctx is not None
        try:
            findings.extend(run(rule, v6_ctx, rule))
        except Exception as e:
            failed = True
            findings.append(_internal_error(ctx, rule, e, " (IPv6)"))
    if not reuse and not failed:
        memo.update(made)
    return findings


def _internal_error(ctx: Context, rule: Callable[[Context], list[Finding]], e: Exception,
                    family: str) -> Finding:
    name = rule.__module__.rsplit(".", 1)[-1]
    ctx.unknown(f"rule {name}{family}", f"internal error: {type(e).__name__}: {e}")
    what = f"The {name} check of IPv6 LB IPs" if family else f"The {name} check"
    return Finding(
        "diagnosis-incomplete", "warning",
        f"{what} failed with an internal error: its findings are missing",
        evidence=(f"{type(e).__name__}: {e}",),
        remedy="Report it with the bundle (loopback-agent bundle DIR).")


def _lb_ip_reports(ctx: Context) -> tuple[LbIpReport, ...]:
    """One report per LB IP (both families), what the input says of it."""
    facts = ctx.facts
    lb_ips: dict[str, list[LbTarget]] = {}
    for t in (*ctx.targets, *ctx.v6_targets):
        lb_ips.setdefault(t.ip, []).append(t)
    # 10k LB IPs share a few port lists ("TCP/80") and each has one Service: one tuple
    # for each different one
    shared: dict[tuple[str, ...], tuple[str, ...]] = {}
    v6_known = v6_local_known(ctx.snapshot)
    return tuple(
        LbIpReport(
            ip=ip,
            ports=_one(shared, tuple(sorted({f"{t.protocol}/{t.port}" for t in ts if t.port}))),
            kind=ts[0].kind,
            services=_one(shared, tuple(sorted({t.service for t in ts if t.service}))),
            learned_from=ts[0].learned_from if len(ts) == 1 and len(
                set(ts[0].learned_from)) == len(ts[0].learned_from) else
            tuple(dict.fromkeys(s for t in ts for s in t.learned_from)),
            # (an IPv4-only local table says nothing of an IPv6 address)
            local=facts.is_local(ip) if ":" not in ip or v6_known else None,
        )
        for ip, ts in lb_ips.items()
    )


def _context_record(ctx: Context, v6_ctx: Context | None) -> VerdictContext:
    """The verdict's context: where the input came from and what the walk stood on."""
    snap, facts = ctx.snapshot, ctx.facts
    return VerdictContext(
        origin=snap.origin,
        kube_proxy_mode_from=ctx.mode_how,
        kube_proxy_version=ctx.kube_proxy_version.how if ctx.kube_proxy_version else None,
        node_ip=facts.node_ip,
        uplink=facts.uplink,
        pod_ip=facts.pod.pod_ip if facts.pod else None,
        pod_network=facts.pod.prefix if facts.pod else None,
        pod_interface=facts.pod.iface if facts.pod else None,
        iptables_backend=snap.netfilter.backend if snap.netfilter else None,
        # (the IPv6 walk's own: kube-proxy's jumps it assumed in an ip6tables restore input)
        assumed_rules=tuple(dict.fromkeys((
            *ctx.paths.notes,
            *(f"IPv6 rules: {n}" for n in (v6_ctx.paths.notes if v6_ctx else ()))))),
        given_by_user=dict(snap.given) if snap.given else None,
        ipv6=bool(ctx.v6_targets),
        node_ip6=facts.node_ip6,
        pod_ip6=facts.pod6.pod_ip if facts.pod6 else None,
        pod_network6=facts.pod6.prefix if facts.pod6 else None,
        ip6tables_backend=snap.ip6tables.backend if snap.ip6tables else None,
    )


def _manifests_only(snap: NodeSnapshot) -> list[str]:
    """The LoadBalancer Services given without a status (a manifest), by key: their load
    balancer addresses are unknown, not absent."""
    return [s.key for s in snap.services or ()
            if s.type == "LoadBalancer" and not s.status_given]


def _one(shared: dict[tuple[str, ...], tuple[str, ...]], value: tuple[str, ...]
         ) -> tuple[str, ...]:
    return shared.setdefault(value, value)


def _ipv6_context(ctx: Context, v6_targets: list[LbTarget]) -> Context | None:
    """The context that walks IPv6 LB IPs through the ip6tables rules (iptables and IPVS
    modes), or None where there is nothing to walk (no IPv6 rules in the input; nftables
    mode, whose IPv6 table another walker reads)."""
    snap = ctx.snapshot
    if snap.ip6tables is None or ctx.mode == "nftables":
        return None
    f6 = ipv6_facts(ctx.facts)
    return Context(f6.snapshot, f6, v6_targets, iptables_paths(f6), ctx.mode, ctx.mode_how,
                   ctx.unknowns, ChainServices(f6.snapshot), None, [], family=6)


def _ipv6_not_walked(targets: list[LbTarget], snap: NodeSnapshot | None = None,
                     mode: str = "") -> list[Finding]:
    """An IPv6 LB IP whose rules are not in the input: undecided, never silently
    healthy."""
    nft = mode == "nftables"
    # a live read that failed says why (no ip6tables-save binary, the dump failed)
    failed = next((u.reason for u in snap.unknowns if u.source == "ip6tables"), None) \
        if snap is not None and snap.ip6tables is None and not nft else None
    why = ("kube-proxy's IPv6 table is not in the input (`nft list table ip6 kube-proxy` "
           "shows it)" if nft else
           f"the IPv6 rules could not be read (ip6tables: {failed})" if failed else
           "the IPv6 rules are not in the input (`ip6tables-save` shows them)")
    out, seen = [], set()
    for t in targets:
        if t.key in seen:
            continue
        seen.add(t.key)
        what = f"[{t.ip}]:{t.port}/{t.protocol}" if t.port else f"{t.ip}"
        out.append(Finding(
            "pod-to-lb-undetermined", "warning",
            f"Could not decide whether pods reaching {what} loop back: {why}",
            lb_ip=t.ip, port=t.port or None, protocol=t.protocol, service=t.service,
            evidence=("learned from " + "; ".join(t.learned_from),
                      f"IPv6 is not walked: {why}"),
            remedy=("Give `nft list table ip6 kube-proxy` output (the bundle's "
                    "nft-ruleset.txt holds the whole ruleset), or check the ip6 table's "
                    "rules by hand, as for IPv4." if nft else
                    "Give `ip6tables-save` output (the bundle has it as ip6tables-save.txt), "
                    "or check the IPv6 nat rules by hand, as for IPv4.")))
    return out


def _ip_key(ip: str | None) -> tuple[int, ...]:
    if not ip:
        return (0,)
    try:
        return tuple(map(int, ip.split(".")))
    except ValueError:
        pass
    try:  # IPv6 after IPv4, in address order (not in the order they were found)
        return (999, int(ipaddress.IPv6Address(ip.split("%", 1)[0])))
    except ValueError:
        return (1000,)
