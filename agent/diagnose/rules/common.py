"""Evidence lines several rules share."""

from __future__ import annotations

from dataclasses import replace
from typing import overload

from agent.diagnose.context import Context
from agent.diagnose.outcome import PathOutcome
from agent.diagnose.paths import ServedOutcome


def sysctl(ctx: Context, iface: str | None, name: str) -> str | None:
    s = ctx.snapshot.sysctls
    if s is None or iface is None:
        return None
    return s.get(f"net.ipv4.conf.{iface.replace('.', '/')}.{name}")


def sysctl_evidence(ctx: Context) -> list[str]:
    """accept_local / rp_filter / log_martians on the uplink, as the kernel applies them
    (rp_filter takes the max of 'all' and the interface; accept_local and log_martians
    the OR for log_martians, the interface value for accept_local)."""
    up = ctx.facts.uplink
    if ctx.snapshot.sysctls is None or up is None:
        return []
    al = sysctl(ctx, up, "accept_local")
    rp_if, rp_all = sysctl(ctx, up, "rp_filter"), sysctl(ctx, "all", "rp_filter")
    lm_if, lm_all = sysctl(ctx, up, "log_martians"), sysctl(ctx, "all", "log_martians")
    out = []
    if al is not None:
        out.append(f"sysctl net.ipv4.conf.{up}.accept_local = {al}"
                   + (" (martian-source drop applies)" if al == "0" else
                      " (accepted, but replies to a local address go to lo: no handshake)"))
    if rp_if is not None or rp_all is not None:
        eff = max(int(rp_if or 0), int(rp_all or 0))
        out.append(f"sysctl rp_filter: {up}={rp_if}, all={rp_all} -> effective {eff}")
    if lm_if is not None or lm_all is not None:
        on = (lm_if == "1") or (lm_all == "1")
        out.append(f"sysctl log_martians: {up}={lm_if}, all={lm_all} -> "
                   + ("drops are logged as 'martian source'" if on else "drops are not logged"))
    return out


def rp_filter_effective(ctx: Context) -> int | None:
    up = ctx.facts.uplink
    rp_if, rp_all = sysctl(ctx, up, "rp_filter"), sysctl(ctx, "all", "rp_filter")
    if rp_if is None and rp_all is None:
        return None
    return max(int(rp_if or 0), int(rp_all or 0))


# the commands an IPv6 walk's messages name (the walk's are IPv4's)
_V6_WORDS = (("`iptables -t ", "`ip6tables -t "), ("{.spec.podCIDR}", "{.spec.podCIDRs}"),
             ("`ip route show table local`", "`ip -6 route show table local`"))


def ipv6_said(text: str) -> str:
    """``text`` of an IPv6 walk with the IPv6 commands in place of the IPv4 ones."""
    for v4, v6 in _V6_WORDS:
        if v4 in text:
            text = text.replace(v4, v6)
    return text


@overload
def ipv6_commands(o: PathOutcome) -> PathOutcome: ...


@overload
def ipv6_commands(o: ServedOutcome) -> ServedOutcome: ...


def ipv6_commands(o: PathOutcome | ServedOutcome) -> PathOutcome | ServedOutcome:
    """A walk's outcome (PathOutcome, ServedOutcome) as an IPv6 walk says it."""
    how, evidence = ipv6_said(o.how), tuple(map(ipv6_said, o.evidence))
    if isinstance(o, PathOutcome):  # (a NamedTuple)
        return o._replace(how=how, evidence=evidence)
    return replace(o, how=how, evidence=evidence)


def has_kube_proxy_rules(ctx: Context) -> bool:
    """Do the rules this context walks hold kube-proxy's nat chains (iptables and IPVS
    modes)? Walking rules without them would prove nothing."""
    nf = ctx.snapshot.netfilter
    nat = nf.table("nat") if nf else None
    if nf is None:
        return True  # unreadable rules are reported by the walk itself
    return nat is not None and any(c.name.startswith("KUBE-") for c in nat.chains)


def no_kube_proxy_rules(ctx: Context) -> str:
    """Why a walk was not made: what the rules lack, in this context's family."""
    nf = ctx.snapshot.netfilter
    if ctx.family == 6 and nf is not None and not nf.tables:
        return ("the IPv6 rules hold no table (`ip6tables-save` printed nothing): kube-proxy "
                "wrote no IPv6 rules on this node (IPv6 disabled or unused here, or an "
                f"IPv4-only kube-proxy; mode: {ctx.mode_how})")
    if ctx.family == 6:
        return ("kube-proxy's rules were not found in the IPv6 rules (`ip6tables-save`: no "
                f"KUBE- chain in its nat table; mode: {ctx.mode_how}): an IPv4-only "
                "kube-proxy, a replacement such as Cilium, or the other ip6tables backend?")
    return ("kube-proxy's rules were not found in the iptables dump (mode: "
            f"{ctx.mode_how}): kube-proxy in nftables mode, a replacement such as Cilium, "
            "or the other iptables backend?")
