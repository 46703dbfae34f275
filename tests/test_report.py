"""The text report of a big node stays readable: a 10k-service node's report was 60,000
lines (every ok LB IP, every note). Without --verbose the LB IPs that are ok, the notes
and the repeats of a finding are counted past a few; the LB IPs at risk and every kind of
finding are always named; --verbose still lists everything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.bundle import load_bundle
from agent.diagnose import diagnose
from agent.diagnose.model import Verdict
from agent.report import (
    EXPOSED_LB_IPS_LISTED,
    FINDINGS_IN_FULL,
    FINDINGS_IN_LINES,
    NOTES_PER_KIND,
    OK_LB_IPS_LISTED,
    render,
)
from lab.kube_proxy_rules import synthetic

N = 200
_ROW = re.compile(r"^  \d+\.\d+\.\d+\.\d+ +TCP/", re.M)


def _verdict(tmp: Path, mode: str) -> Verdict:
    d = tmp / mode
    d.mkdir()
    for name, text in synthetic(N, mode).items():
        (d / name).write_text(text)
    return diagnose(load_bundle(str(d)), "node-a")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Verdict:
    return _verdict(tmp_path_factory.mktemp("rep"), "iptables")


@pytest.fixture(scope="module")
def at_risk(tmp_path_factory: pytest.TempPathFactory) -> Verdict:
    return _verdict(tmp_path_factory.mktemp("rep"), "ipvs")  # every LB IP bound locally


def test_a_healthy_big_node_counts_what_is_ok(healthy: Verdict) -> None:
    assert healthy.status == "healthy" and len(healthy.lb_ips) == N
    text = render(healthy)
    assert len(_ROW.findall(text)) == OK_LB_IPS_LISTED
    assert f"... and {N - OK_LB_IPS_LISTED} more, all ok (--verbose lists every one)" in text
    kinds: dict[str, int] = {}
    for f in healthy.findings:
        kinds[f.id] = kinds.get(f.id, 0) + 1
    assert len(kinds) >= 2  # pod-to-lb-captured and etp-local-no-local-endpoint
    for kind, n in kinds.items():  # each kind counted, a few shown, the rest said
        assert f"  {kind}: {n} notes" in text
        assert text.count(f"[info] {kind}  ") == NOTES_PER_KIND
        assert f"... and {n - NOTES_PER_KIND} more {kind}" in text
    assert len(text.splitlines()) < 80, text


def test_verbose_lists_everything(healthy: Verdict, at_risk: Verdict) -> None:
    for v in (healthy, at_risk):
        text = render(v, verbose=True)
        assert len(_ROW.findall(text)) == N
        assert "... and" not in text
        for f in v.findings:
            assert f"[{f.severity.upper() if f.severity != 'info' else 'info'}] {f.id}  " \
                f"{f.lb_ip}:{f.port}/TCP" in text


def test_an_at_risk_big_node_names_the_first_and_counts_the_rest(at_risk: Verdict) -> None:
    assert at_risk.status == "at-risk"
    text = render(at_risk)
    exposed = [r for r in at_risk.lb_ips
               if any(f.lb_ip == r.ip and f.severity != "info" for f in at_risk.findings)]
    assert len(exposed) == N
    rows = _ROW.findall(text)
    assert len(rows) == EXPOSED_LB_IPS_LISTED
    assert f"... and {N - EXPOSED_LB_IPS_LISTED} more exposed" in text
    serious = [f for f in at_risk.findings if f.severity != "info"]
    by_kind: dict[str, list] = {}
    for f in serious:
        by_kind.setdefault(f.id, []).append(f)
    for kind, fs in by_kind.items():
        # the first ones with their evidence, the next ones one line each, then a count
        assert text.count(f"] {kind}  ") == FINDINGS_IN_FULL
        for f in fs[FINDINGS_IN_FULL:FINDINGS_IN_FULL + FINDINGS_IN_LINES]:
            assert f"\n    {f.lb_ip}:{f.port}/TCP  ({f.service})\n" in text
        assert f"... and {len(fs) - FINDINGS_IN_FULL - FINDINGS_IN_LINES} more {kind}" in text
    assert "Evidence:" in text and len(text.splitlines()) < 400


def test_a_small_node_is_listed_in_full(tmp_path: Path) -> None:
    d = tmp_path / "small"
    d.mkdir()
    for name, text in synthetic(8, "iptables").items():
        (d / name).write_text(text)
    v = diagnose(load_bundle(str(d)), "node-a")
    text = render(v)
    assert len(_ROW.findall(text)) == 8 and "... and" not in text
    assert text.count("[info] ") == len(v.findings)


def test_a_few_findings_of_a_kind_are_all_shown_in_full(at_risk: Verdict) -> None:
    from dataclasses import replace

    few = [f for f in at_risk.findings if f.severity != "info"][:2 * FINDINGS_IN_FULL]
    v = replace(at_risk, findings=tuple(few), lb_ips=at_risk.lb_ips[:len(few)])
    text = render(v)
    assert text.count("Evidence:") == len(few) and "also for" not in text


def test_ipv6_addresses_keep_the_columns_and_are_bracketed_before_a_port() -> None:
    """A dual-stack node (constructed bundle): the LB IP column is as wide as its longest
    address, and a finding's address:port is unambiguous ([2001:db8:ff::7]:80, not
    2001:db8:ff::7:80, which is another address)."""
    import dataclasses

    from agent.diagnose.model import LbIpReport

    data = Path(__file__).parent / "data" / "constructed" / "ipvs6-dual-stack-kube-6-sets"
    v = diagnose(load_bundle(str(data)), "node-a")
    long6 = "2001:db8:ffff:ffff:ffff:ffff:ffff:1"  # 35 characters
    v = dataclasses.replace(v, lb_ips=(
        *v.lb_ips, LbIpReport(ip=long6, ports=("TCP/443",), kind="loadbalancer",
                              services=("ns/web",), learned_from=("constructed",),
                              local=False),
        LbIpReport(ip="10.0.32.1", ports=("TCP/80",), kind="loadbalancer",
                   services=("ns/web4",), learned_from=("constructed",), local=False)))
    text = render(v, verbose=True)
    rows = [line for line in text.splitlines()
            if line.startswith("  ") and " TCP/" in line and "loadbalancer" in line]
    assert len(rows) == 4, text
    assert len({row.index(" TCP/") for row in rows}) == 1, rows  # one column for the ports
    assert all(row.index(" TCP/") > len("  " + long6) for row in rows)
    assert "[2001:db8:ff::7]:80/TCP" in text and "2001:db8:ff::7:80" not in text
