"""The daemon's stdout contract (agent.ship.logline): every line one JSON object of at most
16 KiB, whatever the verdict holds. The verdicts here are constructed (a 10k-LB-IP node's
findings in the shapes diagnose makes; hostile strings no diagnosis makes today); the
daemon's own lines on a lab node are in tests/test_daemon_netns.py."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.diagnose.model import Finding, LbIpReport, Verdict
from agent.ship.logline import LINE_BYTES, MAX_FINDINGS, Where, same_key, summary_line
from agent.snapshot import Unknown

SCHEMA = json.loads(resources.files("agent").joinpath("schema/log-line-v1.json").read_text())
WHERE = Where(http="http://127.0.0.1:9808/verdict",
              collector="http://collector:8080/v1/nodes/node-a",
              spool="/var/lib/loopback-agent/spool", key="0b1e6c1e-4f7a-4d7e-9a51-0c1c0ffee000")


def parse(line: str) -> dict[str, Any]:
    """What a strict pipeline does with the line: bytes, one line, ASCII, JSON whose
    strings are all valid Unicode (serde_json and Go refuse a lone surrogate)."""
    data = line.encode("ascii")  # raises on anything but ASCII
    assert len(data) <= LINE_BYTES and data.endswith(b"\n") and data.count(b"\n") == 1
    doc = json.loads(data)

    def strict(x: Any) -> None:
        if isinstance(x, str):
            x.encode("utf-8")  # raises on a lone surrogate
        elif isinstance(x, dict):
            for k, val in x.items():
                strict(k)
                strict(val)
        elif isinstance(x, list):
            for val in x:
                strict(val)

    strict(doc)
    jsonschema.validate(doc, SCHEMA)
    return doc


def ip(i: int) -> str:
    return f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"


def big_node(n: int = 10_000) -> Verdict:
    """n LB IPs; findings as a big at-risk node has them: an info and a warning per IP
    (listed first, as diagnose may list them), and a critical one for every 7th IP (last)."""
    lbs = tuple(LbIpReport(ip(i), ("TCP/80", "TCP/443"), "loadbalancer",
                           (f"team-{i % 50}/svc-{i}",), ("iptables",), i % 10 == 0)
                for i in range(n))
    infos = [Finding("lb-ip-not-local", "info", f"{ip(i)} is not a local address",
                     ip(i), 80, "TCP", f"team-{i % 50}/svc-{i}", ("e1", "e2"))
             for i in range(n)]
    warnings = [Finding("hairpin-via-nodeport", "warning", f"{ip(i)} reaches a NodePort",
                        ip(i), 443, "TCP", f"team-{i % 50}/svc-{i}", ("e",) * 5)
                for i in range(n)]
    criticals = [Finding("pod-to-lb-not-masqueraded", "critical",
                         f"a pod's packet to {ip(i)}:80 leaves unmasqueraded", ip(i), 80,
                         "TCP", f"team-{i % 50}/svc-{i}", ("e",) * 8, "set masqueradeAll")
                 for i in range(0, n, 7)]
    return Verdict("node-a", "2026-11-25T15:00:00Z", "0.9.0", "at-risk", "iptables",
                   tuple(infos + warnings + criticals), (Unknown("x", "y"),), lbs)


def test_a_10k_lb_ip_verdict_fits_one_line_with_its_counts_and_worst_findings() -> None:
    v = big_node()
    full = json.dumps(v.to_dict(), separators=(",", ":"))
    doc = parse(summary_line(v, WHERE))
    n_crit = len(range(0, 10_000, 7))
    assert len(full) > 100 * LINE_BYTES  # what stdout carried before
    assert doc["line"] == "summary" and doc["node"] == "node-a" and doc["status"] == "at-risk"
    assert doc["kube_proxy_mode"] == "iptables" and doc["time"] == "2026-11-25T15:00:00Z"
    c = doc["counts"]
    assert c["findings"] == 20_000 + n_crit
    assert c["by_severity"] == {"critical": n_crit, "warning": 10_000, "info": 10_000}
    assert c["by_id"] == {"lb-ip-not-local": 10_000, "hairpin-via-nodeport": 10_000,
                          "pod-to-lb-not-masqueraded": n_crit}
    assert (c["lb_ips"], c["lb_ips_local"], c["lb_ips_affected"], c["unknowns"]) == \
        (10_000, 1_000, 10_000, 1)
    # the most severe first: the criticals (listed last in the verdict), in their order
    shown = doc["findings"]
    assert len(shown) == MAX_FINDINGS
    assert [f["lb_ip"] for f in shown] == [ip(i) for i in range(0, 7 * MAX_FINDINGS, 7)]
    assert shown[0] == {"id": "pod-to-lb-not-masqueraded", "severity": "critical",
                        "lb_ip": "10.0.0.0", "service": "team-0/svc-0", "port": 80,
                        "summary": "a pod's packet to 10.0.0.0:80 leaves unmasqueraded"}
    # then the affected LB IPs: those with a critical finding first, then the others
    ips = doc["lb_ips"]
    assert len(ips) > 300 and len(set(ips)) == len(ips)
    assert ips[:n_crit if len(ips) > n_crit else len(ips)] == \
        [ip(i) for i in range(0, 10_000, 7)][:len(ips)]
    om = doc["omitted"]
    assert om == {"findings": c["findings"] - MAX_FINDINGS, "lb_ips": 10_000 - len(ips),
                  "finding_ids": 0}
    assert doc["full"] == {"http": WHERE.http, "collector": WHERE.collector,
                           "spool": WHERE.spool, "key": WHERE.key}
    # the budget is used, not wasted: one more LB IP would not have fitted
    assert LINE_BYTES - len(summary_line(v, WHERE)) < len(json.dumps(ips[-1])) + 1


def test_a_healthy_node_lists_everything_and_omits_nothing() -> None:
    v = Verdict("n", "2026-11-25T15:00:00Z", "0.9.0", "healthy", "ipvs",
                (Finding("lb-ip-not-local", "info", "fine", "192.0.2.1", 80),), (),
                (LbIpReport("192.0.2.1", ("TCP/80",), "loadbalancer", ("a/b",), ("x",),
                            False),))
    doc = parse(summary_line(v))
    assert doc["omitted"] == {"findings": 0, "lb_ips": 0, "finding_ids": 0}
    assert doc["lb_ips"] == ["192.0.2.1"] and len(doc["findings"]) == 1
    assert doc["full"] == {}


def test_the_unchanged_form_is_short_and_says_since_when() -> None:
    v = big_node(2_000)
    doc = parse(summary_line(v, WHERE, unchanged_since="2026-11-25T14:00:00Z"))
    assert doc["line"] == "unchanged" and doc["unchanged_since"] == "2026-11-25T14:00:00Z"
    assert "findings" not in doc and "lb_ips" not in doc
    assert doc["counts"]["by_severity"] == {"critical": 286, "warning": 2000, "info": 2000}
    assert len(summary_line(v, WHERE, unchanged_since="t")) < 1024


def test_same_key_sees_what_a_line_shows_and_not_the_time() -> None:
    from dataclasses import replace

    v = big_node(50)
    assert same_key(v) == same_key(replace(v, time="2026-11-25T15:01:00Z"))
    last = replace(v.findings[-1], summary="other words")
    changed = replace(v, findings=(*v.findings[:-1], last))
    assert same_key(v) != same_key(changed)
    assert same_key(v) != same_key(replace(v, lb_ips=v.lb_ips[1:]))


# (a string put in every field, how the node name (the string x 3) starts in the line)
HOSTILE = [("\ud800", "\ufffd\ufffd\ufffd"), ("\udfff" * 3, "\ufffd" * 9),
           ("a\ud83d", "a\ufffda\ufffd"), ("\ud83d\ude80" * 5000, "\U0001f680" * 8),
           ("\x00\x1f\x7f\"\\/", "\x00\x1f\x7f\"\\/\x00"), ("\u2028\u2029", "\u2028\u2029" * 3),
           ("</script>", "</script></script>"), ("\U0001d54f" * 300, "\U0001d54f" * 8),
           ("é" * 100_000, "é" * 8), ("\n" * 50_000, "\n" * 8)]


@pytest.mark.parametrize(("s", "node_starts"), HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_strings_keep_the_line_valid_and_bounded(s: str, node_starts: str) -> None:
    fs = tuple(Finding(s, s, s, s, 80, "TCP", s * 2, (s,)) for _ in range(30))
    lbs = tuple(LbIpReport(s + str(i), (s,), s, (s,), (s,), None) for i in range(30))
    v = Verdict(s * 3, s, s, s, s, fs, (Unknown(s, s),), lbs)  # type: ignore[arg-type]
    where = Where(http=s, collector=s * 4, spool=s, key=s)
    for since in (None, s):
        doc = parse(summary_line(v, where, unchanged_since=since))
        assert doc["counts"]["findings"] == 30
        assert doc["counts"]["by_severity"]["other"] == 30  # not a severity: one key
    doc = parse(summary_line(v, where))
    assert doc["node"].startswith(node_starts)
    assert doc["omitted"]["findings"] == 30 - len(doc["findings"])


def test_a_lone_surrogate_becomes_the_replacement_character_and_a_pair_is_kept() -> None:
    v = Verdict("node-\ud800-\ud83d\ude80", "t", "v", "healthy", "ipvs", (), ())
    assert parse(summary_line(v))["node"] == "node-\ufffd-\U0001f680"


_TEXT = st.text(max_size=300)
_FINDING = st.builds(Finding, st.sampled_from(["a", "b", "c"]) | _TEXT,
                     st.sampled_from(["critical", "warning", "info", "bogus"]), _TEXT,
                     st.none() | _TEXT, st.none() | st.integers(-10**30, 10**30), st.none(),
                     st.none() | _TEXT)
_VERDICT = st.builds(Verdict, _TEXT, _TEXT, _TEXT, _TEXT, _TEXT,
                     st.lists(_FINDING, max_size=40).map(tuple), st.just(()),
                     st.lists(st.builds(LbIpReport, _TEXT, st.just(()),
                                        st.just("loadbalancer"), st.just(()), st.just(()),
                                        st.none() | st.booleans()), max_size=10).map(tuple))


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_VERDICT, st.integers(2048, LINE_BYTES), st.none() | st.text(max_size=300))
def test_any_verdict_any_budget(v: Verdict, budget: int, since: str | None) -> None:
    line = summary_line(v, Where(http=since, key=since), unchanged_since=since, budget=budget)
    assert len(line.encode()) <= budget
    doc = parse(line)
    if doc["line"] == "summary":
        assert len(doc["findings"]) + doc["omitted"]["findings"] == len(v.findings)
        assert len(doc["lb_ips"]) + doc["omitted"]["lb_ips"] == doc["counts"]["lb_ips_affected"]
        assert sum(doc["counts"]["by_id"].values()) <= len(v.findings)
        ranks = {"critical": 0, "warning": 1, "info": 2}
        shown = [ranks.get(f["severity"], 3) for f in doc["findings"]]
        assert shown == sorted(shown)
