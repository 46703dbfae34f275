"""`run --kube-report` (the Node condition LoadBalancerLoopback and Warning Events) and
`check --npd` (node-problem-detector's plugin protocol), against a real HTTP API server
(tests/kube_apiserver.py) and the saved bundles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kubernetes_validate
import pytest

from agent.bundle import load_bundle
from agent.diagnose import diagnose
from agent.diagnose.model import Finding, LbIpReport, Verdict
from agent.kubereport import KubeReporter, condition_of
from agent.kubereport.condition import CONDITION_TYPE, MESSAGE_MAX, NPD_LINE_MAX
from agent.probes import kube_api
from agent.probes.base import ProbeContext
from tests.daemon_output import log_lines, spooled
from tests.kube_apiserver import FakeKubeAPI, kubeconfig, node, service
from tests.test_deploy import K8S_VERSIONS

pytest.importorskip("kubernetes")

ROOT = Path(__file__).parents[1]
DATA = ROOT / "tests" / "data"
RISKY = DATA / "bundles" / "tke-etp-local"  # pod-to-lb-not-masqueraded 10.0.1.100
HEALTHY = DATA / "constructed" / "itp-local-filter-rule"


def verdict_of(bundle: Path, node_name: str = "n1") -> Verdict:
    return diagnose(load_bundle(str(bundle)), node_name)


# -- the condition, from real verdicts -----------------------------------------------------


def test_condition_of_saved_bundles() -> None:
    risky = condition_of(verdict_of(RISKY))
    assert risky.status == "True" and risky.reason == "PodToLbNotMasqueraded"
    assert risky.message == "at-risk: 10.0.1.100 (default/web)"  # the info one not named
    healthy = condition_of(verdict_of(HEALTHY))
    assert healthy.status == "False" and healthy.reason == "NoLoadBalancerLoopback"


def test_condition_unknown_when_it_cannot_tell(tmp_path: Path) -> None:
    (tmp_path / "addr.txt").write_text(
        (DATA / "constructed" / "full-xlb-mark-drop-no-cluster-cidr" / "addr.txt").read_text())
    c = condition_of(verdict_of(tmp_path))  # no rules, no Services: lb-ips-unknown
    assert (c.status, c.reason) == ("Unknown", "LbIpsUnknown")
    v = verdict_of(HEALTHY)
    # the status decides (kube-proxy's mode unknown makes it "unknown"; the report and
    # the condition say the same thing of one verdict)
    assert condition_of(replace(v, kube_proxy_mode="unknown", status="unknown")).status \
        == "Unknown"
    assert condition_of(v).status == "False"


def test_condition_reason_is_the_most_severe_and_message_bounded() -> None:
    v = verdict_of(RISKY)
    many = tuple(Finding("lb-ip-local", "warning", "s", lb_ip=f"198.51.100.{i}",
                         service=f"team-{i}/svc-{i}") for i in range(40))
    v = replace(v, findings=many + v.findings)  # the critical one listed last
    c = condition_of(v)
    assert c.reason == "PodToLbNotMasqueraded"
    assert len(c.message) <= MESSAGE_MAX and c.message.endswith("more")
    assert c.message.startswith("at-risk: 10.0.1.100 (default/web), 198.51.100.0")
    shown = c.message.count("(")
    assert c.message.endswith(f" +{41 - shown} more")
    looping = replace(verdict_of(HEALTHY), status="loopback")
    assert condition_of(looping).status == "True"


# -- the writer, against the API server ----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.t

    def tick(self) -> None:
        self.t += timedelta(minutes=1)


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        server.put("nodes", node("n1"))
        yield server


def reporter(api: FakeKubeAPI, tmp_path: Path, clock: Clock) -> KubeReporter:
    kc = kubeconfig(str(tmp_path / "kc"), api.url)
    return KubeReporter(kube_api.api_client(ProbeContext(kubeconfig=kc)), "n1", clock=clock)


def our_condition(api: FakeKubeAPI, name: str = "n1") -> dict:
    conds = api.get("nodes", name)["status"]["conditions"]
    (c,) = [c for c in conds if c["type"] == CONDITION_TYPE]
    return c


def writes(api: FakeKubeAPI, since: int = 0) -> list:
    return [r for r in api.log[since:] if r.method in ("PATCH", "POST", "PUT", "DELETE")]


def test_finding_heal_and_no_repeats(api: FakeKubeAPI, tmp_path: Path) -> None:
    clock = Clock()
    rep = reporter(api, tmp_path, clock)
    risky, healthy = verdict_of(RISKY), verdict_of(HEALTHY)

    assert rep.report(risky) == []
    c = our_condition(api)
    assert c["status"] == "True" and c["reason"] == "PodToLbNotMasqueraded"
    assert "10.0.1.100" in c["message"] and "default/web" in c["message"]
    assert c["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    # the strategic merge left the kubelet's condition alone
    ready = [x for x in api.get("nodes", "n1")["status"]["conditions"] if x["type"] == "Ready"]
    assert ready == node("n1")["status"]["conditions"]
    (patch,) = [r for r in writes(api) if r.method == "PATCH"]
    assert patch.path == "/api/v1/nodes/n1/status"
    (event,) = api.objects("events")
    assert event["type"] == "Warning" and event["reason"] == "PodToLbNotMasqueraded"
    assert event["regarding"] == {"apiVersion": "v1", "kind": "Service",
                                  "namespace": "default", "name": "web"}
    assert event["metadata"]["namespace"] == "default" and "10.0.1.100" in event["note"]
    assert event["reportingController"] == "loopback-agent" and "series" not in event

    # unchanged: nothing written, however many verdicts
    n = len(api.log)
    for _ in range(5):
        clock.tick()
        assert rep.report(risky) == []
    assert writes(api, n) == []

    # healed: False, a new transition time, no Event
    clock.tick()
    rep.report(healthy)
    c = our_condition(api)
    assert c["status"] == "False" and c["reason"] == "NoLoadBalancerLoopback"
    assert c["lastTransitionTime"] == "2026-01-02T03:10:05Z"
    assert len(api.objects("events")) == 1

    # back again: the same Event's series, not a new Event
    clock.tick()
    rep.report(risky)
    (event,) = api.objects("events")
    assert event["series"] == {"count": 2, "lastObservedTime": "2026-01-02T03:11:05.000000Z"}
    assert our_condition(api)["status"] == "True"

    # what was written is valid Kubernetes, as the API's schemas say (the test server
    # itself is lenient): the Event as created, the Node with our condition
    for version in K8S_VERSIONS:
        for r in writes(api):
            if r.method == "POST":
                kubernetes_validate.validate(r.body, version, strict=True)
        kubernetes_validate.validate(api.get("nodes", "n1"), version, strict=True)
        for e in api.objects("events"):
            kubernetes_validate.validate(e, version, strict=True)

    # a new LB IP at risk, status unchanged: the message changes, not the transition time
    transition = our_condition(api)["lastTransitionTime"]
    clock.tick()
    more = replace(risky, findings=(*risky.findings, Finding(
        "lb-ip-local", "warning", "bound", lb_ip="10.0.1.200", service="shop/cart")))
    rep.report(more)
    c = our_condition(api)
    assert "10.0.1.200 (shop/cart)" in c["message"] and c["lastTransitionTime"] == transition
    assert c["lastHeartbeatTime"] == "2026-01-02T03:12:05Z"
    assert len(api.objects("events")) == 2  # the new finding's own Event
    assert {e["metadata"]["namespace"] for e in api.objects("events")} == {"default", "shop"}


def test_a_restarted_agent_continues(api: FakeKubeAPI, tmp_path: Path) -> None:
    clock = Clock()
    risky = verdict_of(RISKY)
    reporter(api, tmp_path, clock).report(risky)
    transition = our_condition(api)["lastTransitionTime"]
    clock.tick()
    n = len(api.log)
    again = reporter(api, tmp_path, clock)  # a new process: knows nothing
    assert again.report(risky) == []
    # the condition was read, not rewritten
    assert not [r for r in writes(api, n) if r.path.endswith("/status")]
    assert our_condition(api)["lastTransitionTime"] == transition
    # the finding is news to this process: it continues the existing Event's series
    (event,) = api.objects("events")
    assert event["series"]["count"] == 2
    assert [r.status for r in writes(api, n)] == [409, 200, 200]  # create, read, patch


def test_a_finding_without_service_regards_the_node(api: FakeKubeAPI, tmp_path: Path) -> None:
    v = replace(verdict_of(HEALTHY), status="unknown", findings=(Finding(
        "lb-ips-unknown", "warning", "No LoadBalancer address is visible"),))
    reporter(api, tmp_path, Clock()).report(v)
    assert our_condition(api)["status"] == "Unknown"
    (event,) = api.objects("events")
    assert event["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "n1",
                                  "uid": "n1"}  # what `kubectl describe node` matches


def test_write_failures_are_reported_and_retried(api: FakeKubeAPI, tmp_path: Path) -> None:
    rep = reporter(api, tmp_path, Clock())
    api.outage = "503"
    problems = rep.report(verdict_of(RISKY))
    assert len(problems) == 2 and all("503" in p for p in problems)
    api.outage = None
    assert rep.report(verdict_of(RISKY)) == []
    assert our_condition(api)["status"] == "True" and len(api.objects("events")) == 1


def test_lb_ips_only_healthy_condition(api: FakeKubeAPI, tmp_path: Path) -> None:
    v = replace(verdict_of(HEALTHY), lb_ips=(LbIpReport("192.0.2.1", ("TCP/80",),
                                                         "loadbalancer", ("a/b",), (), False),))
    reporter(api, tmp_path, Clock()).report(v)
    assert our_condition(api)["message"].startswith("no LoadBalancer loopback exposure (1 ")


# -- the daemon, on a lab node, against the API server in the node's namespace -------------


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces")
def test_daemon_kube_report_on_and_off(tmp_path: Path) -> None:
    from lab.node import build_lab
    from lab.scenarios import SCENARIOS

    with build_lab(SCENARIOS["tke-ipvs-etp-local"], "nft") as lab:
        node_doc = json.loads((lab.kube_dir / "node.json").read_text())
        name = node_doc["metadata"]["name"]
        with FakeKubeAPI(netns=lab.node.name) as api:
            for svc in json.loads((lab.kube_dir / "services.json").read_text())["items"]:
                api.put("services", svc)
            api.put("nodes", node_doc)
            kc = kubeconfig(str(tmp_path / "kc"), api.url)

            def run(*extra: str) -> list[dict]:
                # every verdict spooled (no collector): the full ones, by the lines' keys
                out = lab.node.run(sys.executable, "-m", "agent", "run", "--no-capture",
                                   "--interval", "1", "--cycles", "3", "--listen", "",
                                   "--spool", str(tmp_path / "spool"), "--kubeconfig", kc,
                                   "--heartbeat-every", "1", "--node-name", name, *extra,
                                   timeout=120).stdout
                return [spooled(line, tmp_path / "spool") for line in log_lines(out)]

            verdicts = run()
            assert [v["status"] for v in verdicts] == ["at-risk"] * 3
            assert writes(api) == []  # off: nothing written to the API
            # the informer: one LIST per resource for the whole run
            assert len([r for r in api.log if r.method == "GET" and not r.watch
                        and r.resource == "services"]) == 1

            n = len(api.log)
            verdicts = run("--kube-report")
            (lb_ip, svc), = {(f["lb_ip"], f["service"]) for f in verdicts[0]["findings"]
                             if f["severity"] == "critical"}
            c = our_condition(api, name)
            assert c["status"] == "True" and lb_ip in c["message"]
            assert [(r.method, r.path) for r in writes(api, n)] == [
                ("PATCH", f"/api/v1/nodes/{name}/status"),
                ("POST", f"/apis/events.k8s.io/v1/namespaces/{svc.split('/')[0]}/events")]
            (event,) = api.objects("events")
            assert event["type"] == "Warning" and lb_ip in event["note"]
            assert event["regarding"]["name"] == svc.split("/")[1]


# -- node-problem-detector -----------------------------------------------------------------


def npd(path: Path | str) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "agent", "check", "--npd", "--from", str(path)],
                       capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout.splitlines()


@pytest.mark.parametrize(("bundle", "code", "start"), [
    (RISKY, 1, "PodToLbNotMasqueraded: at-risk: 10.0.1.100 (default/web)"),
    (HEALTHY, 0, "NoLoadBalancerLoopback: no LoadBalancer loopback exposure"),
    (DATA / "constructed" / "full-xlb-mark-drop-no-cluster-cidr", 1,
     "PodToLbNotMasqueraded: at-risk: 203.0.113.50 (default/web)"),
    (DATA / "constructed" / "excerpt-postrouting-unseen", 2,
     "PodToLbUndetermined: undetermined: 203.0.113.50 (default/web)"),
    ("/nonexistent/bundle", 2, "CannotCheck: /nonexistent/bundle: no such file"),
])
def test_check_npd_on_saved_bundles(bundle: Path | str, code: int, start: str) -> None:
    rc, lines = npd(bundle)
    assert rc == code and len(lines) == 1, (rc, lines)
    assert lines[0].startswith(start) and len(lines[0]) <= NPD_LINE_MAX


def test_npd_plugin_config_runs_check_npd() -> None:
    cfg = json.loads((ROOT / "daemonset" / "npd" / "loopback-agent-monitor.json").read_text())
    assert cfg["plugin"] == "custom"
    assert cfg["pluginConfig"]["max_output_length"] == NPD_LINE_MAX
    (cond,) = cfg["conditions"]
    assert cond["type"] == CONDITION_TYPE and cond["reason"] == "NoLoadBalancerLoopback"
    (rule,) = cfg["rules"]
    assert rule["type"] == "permanent" and rule["condition"] == CONDITION_TYPE
    assert rule["args"][:2] == ["check", "--npd"]
    # the arguments are ones the CLI takes
    from agent.cli import build_parser

    args = build_parser().parse_args(rule["args"])
    assert args.npd and args.no_kube_api


# -- review fixes: what an operator meets later ----------------------------------------------


def test_an_expired_event_is_created_again(api: FakeKubeAPI, tmp_path: Path) -> None:
    """The API server deletes Events after --event-ttl (1 h by default). A finding that
    comes back after that must get a new Event, not a PATCH of the gone one answered 404
    at every verdict from then on (which left the finding without any Event, for good)."""
    api.put("services", service("web", "10.0.1.100"))
    clock = Clock()
    rep = reporter(api, tmp_path, clock)
    risky, healthy = verdict_of(RISKY), verdict_of(HEALTHY)
    assert rep.report(risky) == []
    (event,) = api.objects("events")
    api.delete("events", event["metadata"]["name"], event["metadata"]["namespace"])  # TTL
    clock.tick()
    assert rep.report(healthy) == []
    clock.tick()
    assert rep.report(risky) == []
    (again,) = api.objects("events")
    assert again["metadata"]["name"] == event["metadata"]["name"] and "series" not in again
    assert again["eventTime"].startswith("2026-01-02T03:06:05")  # made now, not copied
    clock.tick()
    rep.report(healthy)
    clock.tick()
    assert rep.report(risky) == []  # and the new one's series goes on
    (again,) = api.objects("events")
    assert again["series"]["count"] == 2


def test_events_regard_objects_as_kubectl_describe_finds_them(api: FakeKubeAPI,
                                                              tmp_path: Path) -> None:
    """`kubectl describe node N` lists Events whose involvedObject.uid is the Node's uid or
    its name (the kubelet's convention, client-go's NodeRecorder: "this makes the event
    appear in kubectl describe node"), `kubectl describe svc` those with the Service's uid:
    an Event regarding an object without a uid shows in neither."""
    svc = api.put("services", service("web", "10.0.1.100"))
    reporter(api, tmp_path, Clock()).report(verdict_of(RISKY))
    (event,) = api.objects("events")
    assert event["regarding"] == {"apiVersion": "v1", "kind": "Service",
                                  "namespace": "default", "name": "web",
                                  "uid": svc["metadata"]["uid"]}
    v = replace(verdict_of(HEALTHY), status="at-risk", findings=(Finding(
        "lb-ips-unknown", "warning", "No LoadBalancer address is visible"),))
    with FakeKubeAPI() as other:
        other.put("nodes", node("n1"))
        reporter(other, tmp_path, Clock()).report(v)
        (event,) = other.objects("events")
        assert event["regarding"]["uid"] in ("n1", other.get("nodes", "n1")["metadata"]["uid"])
        assert event["metadata"]["namespace"] == "default"
    # a Service gone meanwhile (its GET answers 404): the Event is still written
    with FakeKubeAPI() as gone:
        gone.put("nodes", node("n1"))
        assert reporter(gone, tmp_path, Clock()).report(verdict_of(RISKY)) == []
        (event,) = gone.objects("events")
        assert event["regarding"]["name"] == "web" and "uid" not in event["regarding"]


def test_a_hanging_api_server_costs_one_timeout_per_verdict(tmp_path: Path) -> None:
    """An API server that accepts connections and never answers (overloaded, or a proxy
    in front of a dead one): each request waits out its timeout. One verdict with many
    new findings made one request per finding, one timeout each, in the daemon's loop: 40
    findings and the default 5 s are 3.5 min, past /healthz's 3 intervals + 30 s, so the
    kubelet killed the agent, again and again. After the first timeout the rest waits for
    the next verdict."""
    import socket
    import time

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(256)  # the kernel completes handshakes; nothing ever answers
    try:
        url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
        kc = kubeconfig(str(tmp_path / "kc"), url)
        rep = KubeReporter(kube_api.api_client(ProbeContext(kubeconfig=kc)), "n1",
                           timeout=0.5, clock=Clock())
        v = verdict_of(RISKY)
        many = tuple(Finding("lb-ip-local", "warning", "s", lb_ip=f"198.51.100.{i}",
                             service=f"team-{i}/svc-{i}") for i in range(20))
        v = replace(v, findings=v.findings + many)
        t0 = time.monotonic()
        problems = rep.report(v)
        took = time.monotonic() - t0
        assert problems and all("timed out" in p or "Timeout" in p or "wait for" in p
                                for p in problems), problems
        assert took < 3 * 0.5 + 1.0, (took, problems)  # was 22 x 0.5 s = 11 s
        assert len(problems) <= 3, problems
        rep.close()
    finally:
        lsock.close()


def test_new_events_per_verdict_are_bounded(api: FakeKubeAPI, tmp_path: Path) -> None:
    """A node with thousands of LB IPs at risk (the 10k-Service clusters this agent is
    measured on) wrote one Event per finding in its first verdict: thousands of requests
    in the daemon's loop (past /healthz's limit: restarted, and a restarted agent starts
    over), from every node at once. At most EVENTS_PER_VERDICT new ones a verdict (as
    client-go's event recorder bursts 25 per object), the rest in the verdicts after."""
    from agent.kubereport.writer import EVENTS_PER_VERDICT

    v = verdict_of(RISKY)
    many = tuple(Finding("lb-ip-local", "warning", "s", lb_ip=f"198.51.{i // 250}.{i % 250}",
                         service=f"team/svc-{i}") for i in range(3 * EVENTS_PER_VERDICT))
    v = replace(v, findings=v.findings + many)
    rep = reporter(api, tmp_path, Clock())
    total = len(many) + 1
    seen = []
    for _ in range(4):
        n = len(api.log)
        problems = rep.report(v)
        assert len([r for r in api.log[n:] if r.method == "POST"]) <= EVENTS_PER_VERDICT
        seen.append(len(api.objects("events")))
        assert len(problems) <= 1, problems
    assert seen == [EVENTS_PER_VERDICT, 2 * EVENTS_PER_VERDICT, 3 * EVENTS_PER_VERDICT,
                    total]
    n = len(api.log)
    assert rep.report(v) == [] and writes(api, n) == []  # all written: nothing more


def test_a_check_that_crashed_is_unknown_not_at_risk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that fails with an internal error leaves the verdict a "diagnosis-incomplete"
    warning: the agent cannot tell, so the condition is Unknown (NPD: exit 2), not True
    (which said "at risk" about a node that may be fine, with reason DiagnosisIncomplete)."""
    import agent.diagnose.rules as rules_mod
    from agent.kubereport import npd_result

    def broken(ctx: object) -> list[Finding]:
        raise RuntimeError("boom")

    monkeypatch.setattr(rules_mod, "RULES", (*rules_mod.RULES, broken))
    v = verdict_of(HEALTHY)
    assert [f.id for f in v.findings if f.severity != "info"] == ["diagnosis-incomplete"]
    c = condition_of(v)
    assert (c.status, c.reason) == ("Unknown", "DiagnosisIncomplete")
    assert npd_result(v)[0] == 2


def test_event_names_are_valid_whatever_the_service_field(api: FakeKubeAPI,
                                                          tmp_path: Path) -> None:
    """A finding's service is "ns/name"; one read from a hand-written rule comment may be
    anything. The Event's name and regarding stay valid (a DNS subdomain; a Service only
    when both parts are there), or the API would refuse it at every verdict."""
    import re

    odd = ("web", "/web", "ns/", "a/b/c", "Team/Web")
    v = replace(verdict_of(HEALTHY), status="at-risk", findings=tuple(
        Finding("lb-ip-local", "warning", "s", lb_ip=f"192.0.2.{i}", service=s)
        for i, s in enumerate(odd)))
    assert reporter(api, tmp_path, Clock()).report(v) == []
    events = api.objects("events")
    assert len(events) == len(odd)
    subdomain = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    for e in events:
        assert subdomain.fullmatch(e["metadata"]["name"]), e["metadata"]["name"]
        assert subdomain.fullmatch(e["metadata"]["namespace"]), e["metadata"]["namespace"]
        r = e["regarding"]
        assert r["kind"] == "Node" or (r["name"] and r["namespace"]), r


def test_a_healthy_nftables_node_is_false_not_unknown(tmp_path: Path) -> None:
    """kube-proxy's nftables mode is walked (agent.diagnose's nft paths): a healthy node in
    that mode is False / NPD OK. The condition took only iptables and IPVS as known modes
    and said "kube-proxy's mode is unknown (nftables)", Unknown, NPD exit 2, on every
    healthy nftables node. The bundle: kube-proxy's real nftables rules (tests/data/
    realworld/k8s-nftables-overall-rules-lb-etp-local-sourceranges) and a node address."""
    real = DATA / "realworld" / "k8s-nftables-overall-rules-lb-etp-local-sourceranges"
    (tmp_path / "nft.txt").write_text((real / "nft-transaction.txt").read_text())
    (tmp_path / "addr.txt").write_text(
        "2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 state UP\n"
        "    inet 192.168.0.2/24 brd 192.168.0.255 scope global eth0\n")
    v = verdict_of(tmp_path)
    assert (v.status, v.kube_proxy_mode) == ("healthy", "nftables")
    c = condition_of(v)
    assert (c.status, c.reason) == ("False", "NoLoadBalancerLoopback"), c
    assert "kube-proxy nftables" in c.message
    rc, lines = npd(tmp_path)
    assert rc == 0 and lines[0].startswith("NoLoadBalancerLoopback: "), (rc, lines)
