"""Services, Ingresses and this Node by list+watch (agent.kubewatch), against a real HTTP
server speaking the API's list+watch (tests/kube_apiserver.py): how many requests, what a
410 Gone costs, how an outage is waited out, and how soon the daemon sees a change."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.kubewatch import JitteredBackoff
from agent.probes import kube_api
from agent.probes.base import ProbeContext
from agent.snapshot import Ingress, KubeProxyImage, NodeInfo, Service
from tests.daemon_output import log_line, spooled
from tests.kube_apiserver import (
    FakeKubeAPI,
    daemon_set,
    ingress,
    kubeconfig,
    node,
    service,
)

pytest.importorskip("kubernetes")

RESOURCES = ("services", "ingresses", "nodes", "daemonsets")
PROXY_IMAGE = "registry.k8s.io/kube-proxy:v1.32.2"


def until(cond: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or cond}")


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_every=0.5) as server:
        for i in range(30):
            server.put("services", service(f"svc{i}", f"198.51.100.{i + 1}",
                                           node_port=30000 + i))
        server.put("services", service("plain"))
        server.put("nodes", node("n1"))
        server.put("nodes", node("n2", "10.0.0.6"))
        server.put("ingresses", ingress("web", "203.0.113.9", "svc1"))
        server.put("daemonsets", daemon_set(PROXY_IMAGE))
        # another DaemonSet of kube-system: not asked for, never read
        server.put("daemonsets", daemon_set("registry.k8s.io/coredns:v1.11.1", "coredns"))
        yield server


def start(api: FakeKubeAPI, tmp_path: Path, **kw: object):  # -> KubeInformer
    kc = kubeconfig(str(tmp_path / f"kc{random.random()}"), api.url)
    changes: list[str] = []
    kw.setdefault("watch_timeout", 1.0)
    inf = kube_api.start_informer(ProbeContext(node_name="n1", kubeconfig=kc),
                                  on_change=changes.append, **kw)
    inf.changes = changes
    assert inf.wait_synced(10)
    return inf


def test_one_list_then_one_watch_at_a_time(api: FakeKubeAPI, tmp_path: Path) -> None:
    t0 = time.monotonic()
    inf = start(api, tmp_path, watch_timeout=2.0)
    try:
        # watches end after timeoutSeconds (2-3 s here) and resume: sample the open ones
        most = dict.fromkeys(RESOURCES, 0)
        end = time.monotonic() + 5
        while time.monotonic() < end:
            for r in RESOURCES:
                most[r] = max(most[r], api.open_watches(r))
            time.sleep(0.01)
        values, unknowns = inf.read()
    finally:
        inf.stop()
    assert unknowns == []
    services, node_info, ingresses, proxy_image = values
    # decoded records, not API objects: what the diagnosis reads and nothing else
    assert len(services) == 31 and all(type(s) is Service for s in services)
    assert services[0].key < services[-1].key
    assert node_info == NodeInfo("n1", ("10.244.1.0/24",), ("10.0.0.5",))
    assert [type(i) for i in ingresses] == [Ingress]
    # kube-proxy's DaemonSet, by its name: its image
    assert proxy_image == KubeProxyImage("DaemonSet kube-system/kube-proxy", PROXY_IMAGE,
                                         "kubernetes API DaemonSet kube-system/kube-proxy")
    for r in RESOURCES:
        lists = api.requests("GET", r, watch=False, since=t0)
        watches = api.requests("GET", r, watch=True, since=t0)
        assert len(lists) == 1, (r, lists)  # O(1): one LIST, however long it runs
        assert 2 <= len(watches) <= 4, (r, len(watches))  # 5 s / (2-3 s) per watch
        assert most[r] == 1, (r, most[r])
        # each watch resumes where the last left off, with bookmarks asked for
        assert all(w.query["allowWatchBookmarks"] == "true" and w.query["resourceVersion"]
                   for w in watches)
    # this Node only: no agent lists the cluster's nodes
    assert {q.query.get("fieldSelector") for q in api.requests(resource="nodes", since=t0)} \
        == {"metadata.name=n1"}
    # and kube-proxy's DaemonSet by its name (what its RBAC's resourceNames allows)
    asked = api.requests(resource="daemonsets", since=t0)
    assert {(q.path, q.query.get("fieldSelector")) for q in asked} == \
        {("/apis/apps/v1/namespaces/kube-system/daemonsets", "metadata.name=kube-proxy")}
    assert {r.method for r in api.log} == {"GET"}


def test_changes_arrive_and_only_changes_that_matter_wake(api: FakeKubeAPI,
                                                           tmp_path: Path) -> None:
    inf = start(api, tmp_path)
    try:
        inf.changes.clear()
        api.put("services", service("new", "192.0.2.77"))
        until(lambda: "services" in inf.changes, what="a change callback")
        assert any(s.name == "new" for s in inf.read()[0][0])
        # a Service change the diagnosis cannot see (a label) changes nothing
        inf.changes.clear()
        svc = api.get("services", "new")
        svc["metadata"]["labels"] = {"team": "a"}
        api.put("services", svc)
        time.sleep(0.5)
        assert inf.changes == []
        api.delete("services", "new")
        until(lambda: "services" in inf.changes, what="a delete callback")
        assert not any(s.name == "new" for s in inf.read()[0][0])
        # another node's change is not even sent to this agent
        inf.changes.clear()
        api.put("nodes", node("n2", "10.0.0.99"))
        time.sleep(0.5)
        assert inf.changes == [] and inf.read()[0][1].internal_ips == ("10.0.0.5",)
        api.put("nodes", node("n1", "10.0.0.42"))
        until(lambda: "node" in inf.changes, what="a node change")
        assert inf.read()[0][1].internal_ips == ("10.0.0.42",)
        # an object that cannot be read is named, the rest kept
        bad = service("broken", "192.0.2.8")
        bad["spec"]["ports"][0]["port"] = "eighty"
        api.put("services", bad)
        until(lambda: inf.read()[1], what="an unknown")
        (what, why), = inf.read()[1]
        assert what == "services" and "default/broken" in why and "port" in why
        assert len(inf.read()[0][0]) == 31
    finally:
        inf.stop()


@pytest.mark.parametrize("gone_as", ["event", "http"])
def test_410_gone_costs_exactly_one_relist(api: FakeKubeAPI, tmp_path: Path,
                                           gone_as: str) -> None:
    api.gone_as = gone_as
    inf = start(api, tmp_path, watch_timeout=30.0)
    try:
        time.sleep(1.2)  # the first watches are open
        t0 = time.monotonic()
        api.compact()
        # a change the agent never sees as an event: only the new LIST can tell it
        api.put("services", service("missed", "192.0.2.99"))
        api.compact()
        if gone_as == "event":
            api.expire_watches()  # an in-stream ERROR 410 on every open watch
        else:
            api.cut_watches()  # the resumed watch gets an HTTP 410
        until(lambda: any(s.name == "missed" for s in inf.read()[0][0]), what="the relist")
        time.sleep(1.5)
        for r in RESOURCES:
            assert len(api.requests("GET", r, watch=False, since=t0)) == 1, r
            assert api.open_watches(r) == 1, r
        gone = [q for q in api.requests(since=t0) if q.status == 410]
        assert len(gone) == (len(RESOURCES) if gone_as == "http" else 0)
        assert inf.requests()["relists_after_gone"] == len(RESOURCES)
        assert inf.requests()["failures"] == 0  # a 410 is no error to back off from
    finally:
        inf.stop()


def test_outage_backs_off_with_jitter_and_resumes_without_list(tmp_path: Path) -> None:
    """Three agents, one API server that answers 503 for 6 s: each agent's requests are
    bounded, its delays grow, no two agents wait the same, and none LISTs afterwards."""
    with FakeKubeAPI(bookmark_every=0.5) as api:
        api.put("services", service("a", "198.51.100.1"))
        api.put("nodes", node("n1"))
        agents = [start(api, tmp_path, watch_timeout=30.0, backoff_base=0.2,
                        backoff_cap=1.6) for _ in range(3)]
        try:
            time.sleep(0.5)
            t0 = time.monotonic()
            api.outage = "503"
            time.sleep(6)
            t1 = time.monotonic()
            # the last state seen is still used, and said to be possibly old
            values, why = agents[0].read()
            assert [s.name for s in values[0]] == ["a"]
            assert ("services", "watch failing (HTTP 503 Service Unavailable); using the "
                                "state last seen") in why
            api.outage = None
            api.put("services", service("after", "198.51.100.2"))
            for a in agents:
                until(lambda a=a: any(s.name == "after" for s in a.read()[0][0]),
                      what="the resumed watch")
                until(lambda a=a: a.read()[1] == [], what="the errors to clear")
            during = api.requests(since=t0)
            during = [q for q in during if q.at < t1]
            # per agent and resource: delays 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6, then
            # 0.8-1.6 each: at most 2+1+1+1+ 6/0.8 -> 12 in 6 s, at least 6/1.6 -> 4
            per = len(during) / (3 * 3)
            assert 4 <= per <= 12, per
            assert all(q.status == 503 and q.watch for q in during)
            for a in agents:
                for r in a.reflectors:
                    d = r.delays
                    assert len(d) >= 4
                    steps = [min(1.6, 0.2 * 2 ** i) for i in range(len(d))]
                    assert all(s / 2 <= x <= s for x, s in zip(d, steps, strict=True)), d
            # not in lockstep: the agents' n-th delays differ
            firsts = [[r.delays[i] for a in agents for r in a.reflectors] for i in range(4)]
            for i, ds in enumerate(firsts):
                # (equal to the float only in lockstep: rounded, 9 draws collide often)
                assert len(set(ds)) == len(ds), (i, ds)
                assert max(ds) - min(ds) > 0.02 * 2 ** i, (i, ds)
            # the watch resumed from where it was: no LIST after the outage
            assert not api.requests("GET", watch=False, since=t0)
        finally:
            for a in agents:
                a.stop()


def test_refused_connections_back_off_too(tmp_path: Path) -> None:
    with FakeKubeAPI(bookmark_every=0.5) as api:
        api.put("services", service("a", "198.51.100.1"))
        inf = start(api, tmp_path, watch_timeout=30.0, backoff_base=0.2, backoff_cap=1.6)
        try:
            time.sleep(0.5)
            api.outage = "refuse"
            time.sleep(4)
            tries = inf.services.failures
            assert 3 <= tries <= 10, tries
            api.outage = None
            api.put("services", service("back", "198.51.100.3"))
            until(lambda: any(s.name == "back" for s in inf.read()[0][0]), what="resume")
            assert inf.services.lists == 1
        finally:
            inf.stop()


def test_jittered_backoff_bounds() -> None:
    b = JitteredBackoff(1.0, 8.0, random.Random(1))
    d = [b.next_delay() for _ in range(6)]
    assert all(s / 2 <= x <= s for x, s in zip(d, [1, 2, 4, 8, 8, 8], strict=True))
    b.reset()
    assert b.next_delay() <= 1.0


def test_probe_reads_the_informer_not_the_api(api: FakeKubeAPI, tmp_path: Path) -> None:
    inf = start(api, tmp_path, watch_timeout=30.0)
    try:
        n = len(api.log)
        res = kube_api.collect(ProbeContext(node_name="n1", kube_cache=inf))
        assert len(api.log) == n  # no request: memory
        services, node_info, ingresses, proxy_image = res.value
        assert len(services) == 31 and node_info.name == "n1" and len(ingresses) == 1
        assert proxy_image.image == PROXY_IMAGE
        assert res.unknowns == ()
    finally:
        inf.stop()


def test_daemon_sees_a_service_change_within_seconds(api: FakeKubeAPI,
                                                     tmp_path: Path) -> None:
    """`run` with a 60 s interval: a new LoadBalancer IP is in a verdict within seconds,
    and the daemon's API traffic is one LIST per resource plus watches."""
    kc = kubeconfig(str(tmp_path / "kc"), api.url)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    t0 = time.monotonic()
    spool = tmp_path / "spool"
    proc = subprocess.Popen(  # every verdict spooled (no collector): the lines name them
        [sys.executable, "-m", "agent", "run", "--no-capture", "--interval", "60",
         "--listen", "", "--spool", str(spool), "--kubeconfig", kc, "--heartbeat-every",
         "1", "--node-name", "n1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = spooled(log_line(proc.stdout.readline()), spool)
        ips = {r["ip"] for r in first["lb_ips"]}
        assert "198.51.100.1" in ips and "192.0.2.55" not in ips
        assert not any(u["source"] == "kubernetes API" for u in first["unknowns"])
        changed = time.monotonic()
        api.put("services", service("late", "192.0.2.55", node_port=31555))
        second = spooled(log_line(proc.stdout.readline()), spool)
        took = time.monotonic() - changed
        assert "192.0.2.55" in {r["ip"] for r in second["lb_ips"]}
        assert took < 10, took  # the interval is 60 s
        for r in RESOURCES:
            assert len(api.requests("GET", r, watch=False, since=t0)) == 1, r
    finally:
        proc.terminate()
        proc.wait(20)


def test_backoff_starts_over_after_a_healthy_spell(tmp_path: Path) -> None:
    """After an outage grew the backoff to its cap, hours of healthy watching and then one
    broken connection must retry at the base delay (client-go resets its backoff after a
    quiet spell), not at the cap: in production that is 30-60 s of old state for nothing."""
    with FakeKubeAPI(bookmark_every=0.5) as api:
        api.put("services", service("a", "198.51.100.1"))
        api.put("nodes", node("n1"))
        inf = start(api, tmp_path, watch_timeout=30.0, backoff_base=0.2, backoff_cap=1.6)
        try:
            time.sleep(0.5)
            api.outage = "503"
            time.sleep(4)
            api.outage = None
            until(lambda: inf.read()[1] == [], what="the errors to clear")
            assert max(inf.services.delays) > 0.8  # the outage reached the cap
            time.sleep(2 * 1.6 + 1.5)  # healthy, longer than twice the cap
            seen = len(inf.services.delays)
            api.outage = "refuse"  # every connection dropped at once, mid-stream
            time.sleep(0.05)
            api.outage = None
            until(lambda: len(inf.services.delays) > seen, what="the broken watch")
            assert inf.services.delays[seen] <= 0.2, list(inf.services.delays)[seen:]
            api.put("services", service("back", "198.51.100.3"))
            until(lambda: any(s.name == "back" for s in inf.read()[0][0]), what="resume")
            assert inf.services.lists == 1
        finally:
            inf.stop()


def test_forbidden_ingresses_leave_the_rest_working(tmp_path: Path) -> None:
    """RBAC without ingresses: Services and the Node are watched as usual, the verdict's
    unknowns say ingresses are forbidden, and the retries, however many, keep bounded
    memory."""
    with FakeKubeAPI(bookmark_every=0.5) as api:
        api.forbidden.add("ingresses")
        api.put("services", service("a", "198.51.100.1"))
        api.put("nodes", node("n1"))
        api.put("ingresses", ingress("web", "203.0.113.9", "a"))
        kc = kubeconfig(str(tmp_path / "kc"), api.url)
        inf = kube_api.start_informer(ProbeContext(node_name="n1", kubeconfig=kc),
                                      watch_timeout=30.0, backoff_base=0.001,
                                      backoff_cap=0.002)
        try:
            # the daemon waits for the first LISTs before its first verdict: not for one
            # that is refused (was the whole 10 s: first verdict 13.2 s, 1.5 s allowed)
            t0 = time.monotonic()
            assert not inf.wait_synced(10.0)
            assert time.monotonic() - t0 < 3, time.monotonic() - t0
            assert inf.services.synced.is_set() and inf.node.synced.is_set()
            until(lambda: inf.ingresses.failures > 200, timeout=30, what="many 403s")
            (services, node_info, ingresses, proxy_image), why = inf.read()
            assert [s.name for s in services] == ["a"] and node_info.name == "n1"
            assert ingresses is None and proxy_image is None  # (no kube-proxy DaemonSet)
            assert why == [("ingresses", "not listed yet: HTTP 403 Forbidden")]
            api.put("services", service("b", "198.51.100.2"))
            until(lambda: len(inf.read()[0][0]) == 2, what="services still watched")
            assert len(inf.ingresses.delays) <= 100  # not one float per retry, forever
        finally:
            inf.stop()


@pytest.mark.parametrize("raw", [b"<html>502 Bad Gateway</html>\n", b"[1, 2]\n",
                                 b'{"type": "ADDED"}\n', b'{"type": "ADDED", "obj\n'])
def test_garbage_on_a_watch_is_named_and_the_watch_resumes(api: FakeKubeAPI,
                                                           tmp_path: Path,
                                                           raw: bytes) -> None:
    inf = start(api, tmp_path, watch_timeout=30.0, backoff_base=1.0, backoff_cap=2.0)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        with api.lock:
            ours = [w for w in api.watches if w.resource == "services"]
            for w in ours:
                w.raw.append(raw)
            api.lock.notify_all()
        until(lambda: inf.services.failures, what="the bad line")
        (what, why), = inf.read()[1]
        assert what == "services" and "watch failing (services: watch sent" in why, why
        api.put("services", service("after", "198.51.100.99"))
        until(lambda: any(s.name == "after" for s in inf.read()[0][0]), what="resume")
        assert not api.requests("GET", "services", watch=False, since=t0)  # no LIST
        assert inf.read()[1] == []
    finally:
        inf.stop()


def test_a_silent_watch_ends_by_its_read_timeout(api: FakeKubeAPI, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An API server (or proxy) that stops sending mid-stream without closing: the watch's
    read timeout (its timeoutSeconds + READ_MARGIN) ends it, the verdict says the state
    may be old, and the watch resumes from its resourceVersion (no LIST)."""
    from agent.kubewatch import reflector

    monkeypatch.setattr(reflector, "READ_MARGIN", 1.0)  # production: 30 s
    inf = start(api, tmp_path, watch_timeout=2.0)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        api.hang_watches()
        until(lambda: inf.services.failures, timeout=15, what="the read timeout")
        took = time.monotonic() - t0
        assert took <= 2.0 * 2 + 1.0 + 1.0, took  # timeoutSeconds <= 4 s, + margin
        assert any("timed out" in why for _, why in inf.read()[1])
        api.put("services", service("after", "198.51.100.99"))
        until(lambda: any(s.name == "after" for s in inf.read()[0][0]), what="resume")
        assert inf.services.lists == 1
    finally:
        inf.stop()


def test_an_expired_continue_token_starts_the_list_over(api: FakeKubeAPI, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """LIST pages of 7 (31 Services: 5 pages); the history is compacted after the second
    page, so the third gets 410 Expired: the reflector lists again from the first page
    (not from the stale token), and ends with every Service, including one added while
    the pages went by."""
    from agent.kubewatch import reflector

    monkeypatch.setattr(reflector, "PAGE", 7)
    pages: list[str] = []

    def after_page(resource: str) -> None:
        pages.append(resource)
        if resource == "services" and len(pages) == 2:
            api.put("services", service("between", "192.0.2.200"))
            api.compact()

    api.after_page = after_page
    t0 = time.monotonic()
    inf = start(api, tmp_path, watch_timeout=30.0, backoff_base=0.1, backoff_cap=0.2)
    try:
        lists = [q for q in api.requests("GET", "services", watch=False, since=t0)]
        assert [q.status for q in lists] == [200, 200, 410] + [200] * 5, lists
        assert "continue" not in lists[3].query  # started over
        names = {s.name for s in inf.read()[0][0]}
        assert len(names) == 32 and "between" in names
        assert inf.read()[1] == []
    finally:
        inf.stop()


def test_daemon_coalesces_a_storm_of_changes(api: FakeKubeAPI, tmp_path: Path) -> None:
    """A Service changed every 50 ms for 11 s: the daemon diagnoses at most once per
    kube_change_gap (5 s), not once per change, and the last verdict has the last change."""
    import threading

    kc = kubeconfig(str(tmp_path / "kc"), api.url)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    spool = tmp_path / "spool"
    proc = subprocess.Popen(  # every verdict spooled (no collector): the lines name them
        [sys.executable, "-m", "agent", "run", "--no-capture", "--interval", "60",
         "--listen", "", "--spool", str(spool), "--kubeconfig", kc, "--heartbeat-every",
         "1", "--node-name", "n1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=env)
    seen: list[tuple[float, set[str]]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            t = time.monotonic()
            verdict = spooled(log_line(line), spool)
            seen.append((t, {r["ip"] for r in verdict["lb_ips"]}))

    threading.Thread(target=read, daemon=True).start()
    try:
        until(lambda: seen, timeout=30, what="the first verdict")
        t0, k = time.monotonic(), 0
        while time.monotonic() - t0 < 11:
            k += 1
            api.put("services", service("churn", f"192.0.2.{k % 250 + 1}", node_port=31000))
            time.sleep(0.05)
        last = f"192.0.2.{k % 250 + 1}"
        until(lambda: last in seen[-1][1], timeout=15, what="the last change")
        during = [t for t, _ in seen[1:]]
        assert k > 150 and 2 <= len(during) <= 4, (k, len(during))
        gaps = [b - a for a, b in itertools.pairwise(during)]
        assert all(g > 4.5 for g in gaps), gaps
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_change_never_wakes_the_cycle_that_just_began(tmp_path: Path) -> None:
    """Changes arriving while a cycle begins (the storm above, which once gave two
    verdicts 0.09 s apart in CI): one seen against the last cycle's start, overdue, must
    not set the wake after the new cycle cleared it. Switching threads every microsecond
    makes the interleaving common (without the lock it shows within 6,000 cycles, most runs)."""
    import threading

    from agent.daemon import Daemon, DaemonConfig

    d = Daemon(DaemonConfig(collector=None, spool_dir=str(tmp_path / "s"), interval=60.0,
                            listen=None))
    stop = threading.Event()

    def storm() -> None:
        while not stop.is_set():
            d._kube_changed("services")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=storm, daemon=True)
    t.start()
    woken = 0
    try:
        for _ in range(6000):
            d.cycle_started -= 10  # the last cycle is overdue: a change wakes at once
            d._begin_cycle()
            time.sleep(0.0002)  # the storm runs against the new cycle (due in 5 s)
            woken += d.wake.is_set()
    finally:
        stop.set()
        t.join(5)
        sys.setswitchinterval(old)
    assert woken == 0, woken
    assert d._kube_timer is not None  # the storm is due at the new cycle's gap
    d._kube_timer.cancel()


def test_a_change_with_no_thread_for_its_timer_wakes_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the thread limit Timer.start raises: the change is diagnosed now, and the
    next change still gets a timer (none was left half set)."""
    import threading

    from agent.daemon import Daemon, DaemonConfig

    d = Daemon(DaemonConfig(collector=None, spool_dir=str(tmp_path / "s"), interval=60.0,
                            listen=None))
    d._begin_cycle()

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Timer, "start", no_thread)
    d._kube_changed("services")
    assert d.wake.is_set() and d._kube_timer is None
    monkeypatch.undo()
    d._begin_cycle()
    d._kube_changed("services")
    assert not d.wake.is_set() and d._kube_timer is not None
    d._kube_timer.cancel()


_DEAD_PEER = r"""
import json, sys, time
from agent.probes import kube_api
from agent.probes.base import ProbeContext
kube_api.KEEPALIVE = (1, 1, 2)  # idle, interval, probes (production: client-go's 30, 15, 9)
inf = kube_api.start_informer(ProbeContext(node_name="n1", kubeconfig=sys.argv[1]),
                              watch_timeout=30.0)
assert inf.wait_synced(10)
time.sleep(1)
print("synced", flush=True)
sys.stdin.readline()  # the peer is dead from here on
t0 = time.monotonic()
while not inf.services.failures and time.monotonic() - t0 < 20:
    time.sleep(0.05)
print(json.dumps({"after": time.monotonic() - t0, "error": inf.services.error}), flush=True)
"""


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces")
def test_a_dead_peer_is_found_by_tcp_keepalive(tmp_path: Path) -> None:
    """The API server's host vanishes (its packets stop: iptables DROP in a namespace made
    here): nothing closes the watch, and its read timeout is timeoutSeconds + 30 s (5-10
    minutes in production). TCP keepalive, as client-go dials, finds the dead peer in
    idle + interval * probes (here 1 + 1 * 2 s), so the verdict says the state may be old."""
    from lab.netns import netns

    with netns("lbki") as ns, FakeKubeAPI(bookmark_every=0.5, netns=ns.name) as api:
        api.put("services", service("a", "198.51.100.1"))
        api.put("nodes", node("n1"))
        kc = kubeconfig(str(tmp_path / "kc"), api.url)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        proc = ns.popen([sys.executable, "-c", _DEAD_PEER, kc], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline() == "synced\n"
            ns.run("iptables", "-w", "-A", "INPUT", "-p", "tcp", "--sport", str(api.port),
                   "-j", "DROP")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            got = json.loads(proc.stdout.readline())
            assert got["error"] is not None and got["after"] < 8, got
        finally:
            proc.kill()
            proc.wait(10)


def test_an_endless_watch_line_is_cut_at_a_bound(api: FakeKubeAPI, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """32 MiB without a newline on a watch: the client's line splitter would keep it all
    (then fail on it as not JSON); the reflector stops reading at MAX_LINE (1 MiB here),
    says so, and resumes the watch."""
    from agent.kubewatch import reflector

    monkeypatch.setattr(reflector, "MAX_LINE", 1 << 20, raising=False)
    inf = start(api, tmp_path, watch_timeout=30.0, backoff_base=0.2, backoff_cap=0.4)
    try:
        time.sleep(0.5)
        with api.lock:
            for w in api.watches:
                if w.resource == "services":
                    w.raw.append(b"x" * (32 << 20) + b"\n")
            api.lock.notify_all()
        until(lambda: inf.services.failures, timeout=30, what="the long line")
        assert "a line longer than 1048576 bytes" in (inf.services.error or ""), \
            inf.services.error
        api.put("services", service("after", "198.51.100.99"))
        until(lambda: any(s.name == "after" for s in inf.read()[0][0]), what="resume")
        assert inf.services.lists == 1
    finally:
        inf.stop()


def test_kube_proxy_upgraded_under_a_running_agent(api: FakeKubeAPI, tmp_path: Path) -> None:
    """kube-proxy's DaemonSet rolled to a new image while the agent runs: the watch carries
    the new image; another DaemonSet changing wakes nothing that is read."""
    inf = start(api, tmp_path, watch_timeout=30.0)
    try:
        assert inf.read()[0][3].image == PROXY_IMAGE
        api.put("daemonsets", daemon_set("registry.k8s.io/kube-proxy:v1.33.6"))
        until(lambda: inf.read()[0][3].image.endswith(":v1.33.6"), what="the new image")
    finally:
        inf.stop()


def test_a_refused_kube_proxy_daemonset_is_said_and_asked_again_rarely(
        api: FakeKubeAPI, tmp_path: Path) -> None:
    """An install whose RBAC predates the Role: the rest works, the version is said to be
    unread (with why), and it is not asked for again every minute from every node."""
    api.forbidden.add("daemonsets")
    kc = kubeconfig(str(tmp_path / "kc"), api.url)
    inf = kube_api.start_informer(ProbeContext(node_name="n1", kubeconfig=kc),
                                  watch_timeout=30.0, backoff_base=0.05, backoff_cap=0.1)
    try:
        assert not inf.wait_synced(10.0)
        values, why = inf.read()
        assert len(values[0]) == 31 and values[3] is None
        assert why == [("kube-proxy", "not listed yet: HTTP 403 Forbidden")]
        time.sleep(3)
        # base 0.05 s doubling: 6 tries in the first 3 s at most, and never capped at the
        # other reflectors' 0.1 s (which would be ~30)
        refused = [q for q in api.requests(resource="daemonsets") if q.status == 403]
        assert 1 <= len(refused) <= 7, len(refused)
    finally:
        inf.stop()
