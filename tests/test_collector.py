"""The collector as a real process on loopback with its SQLite store: ingest, idempotency,
bad input (422 naming the field, 413, 400, 401), views, escaping, restart, and the
agent's shipping path end to end."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from agent.listen import on_every_address
from agent.ship.sender import Sender, drain
from agent.ship.spool import Spool
from tests.hosts import with_hosts

TKE = Path(__file__).parent / "data" / "bundles" / "tke-etp-local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """A real PostgreSQL server for the tests: its own data directory and port, started
    as the postgres user, stopped and removed afterwards."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        if not bins:
            raise RuntimeError("PostgreSQL is not installed (make test installs it)")
        self.bin = bins[-1]
        self.dir = Path(tempfile.mkdtemp(prefix="lbpg"))
        shutil.chown(self.dir, "postgres")
        self.port = free_port()
        self._pg("initdb", "-D", f"{self.dir}/data", "-A", "trust", "-U", "postgres")
        self._pg("pg_ctl", "-D", f"{self.dir}/data", "-l", f"{self.dir}/log", "-w", "-o",
                 f"-k {self.dir} -p {self.port} -h 127.0.0.1", "start")
        self.n = 0

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bin / tool), *args],
                       check=True, capture_output=True)

    def new_db(self) -> str:
        import psycopg

        self.n += 1
        name = f"t{self.n}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def url(self, db: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        self._pg("pg_ctl", "-D", f"{self.dir}/data", "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    pg = Postgres()
    yield pg
    pg.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'c.db'}"
    return request.getfixturevalue("postgres").new_db()


class Proc:
    """``loopback-agent collector`` as a real process on 127.0.0.1 (``extra``: more
    options; ``preexec_fn``: e.g. a lower RLIMIT_NOFILE; ``verify``: the CA for https)."""

    def __init__(self, db: Path | str, token: Path | None = None, extra: tuple[str, ...] = (),
                 preexec_fn: Any = None, verify: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        scheme = "https" if "--tls-cert" in extra else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.verify = verify if verify is not None else True
        url = db if isinstance(db, str) else f"sqlite://{db}"
        cmd = [sys.executable, "-m", "agent", "collector", "--listen",
               f"127.0.0.1:{self.port}", "--db", url, *extra]
        if token:
            cmd += ["--token-file", str(token)]
        # stdout (the access log, a line per request) to a file: a pipe nobody reads
        # would fill and stop the collector; appended to, read by access_log()
        fd, self.out = tempfile.mkstemp(prefix="collector-stdout-")
        os.close(fd)
        with open(self.out, "ab") as out:
            self.p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE,
                                      text=True, preexec_fn=preexec_fn, env=env)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.p.poll() is None:
            try:
                if requests.get(self.url + "/healthz", timeout=1,
                                verify=self.verify).status_code == 200:
                    return
            except requests.ConnectionError:
                time.sleep(0.1)
        self.p.kill()
        raise RuntimeError(self.p.communicate()[1] or "no collector")

    def stop(self) -> str:
        """Stops it; returns what it said on stderr."""
        self.p.terminate()
        try:
            _, err = self.p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            _, err = self.p.communicate()
        return err

    def access_log(self) -> str:
        """What it wrote on stdout so far (its access log)."""
        return Path(self.out).read_text()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.unlink(self.out)


@pytest.fixture
def collector(db_url: str) -> Iterator[Proc]:
    c = Proc(db_url)
    yield c
    c.stop()


def verdict(node: str = "n1") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(TKE), "--json",
                          "--node-name", node], capture_output=True, text=True)
    return json.loads(out.stdout)


def test_ingest_is_idempotent_and_feeds_the_views(collector: Proc) -> None:
    v = {**verdict("node-a"), "idempotency_key": "k1"}
    r = requests.post(collector.url + "/v1/verdicts", json=v, timeout=5)
    assert r.status_code == 200 and r.json() == {"stored": 1, "duplicates": 0}
    r = requests.post(collector.url + "/v1/verdicts", json=[v], timeout=5)
    assert r.json() == {"stored": 0, "duplicates": 1}
    nodes = requests.get(collector.url + "/v1/nodes", timeout=5).json()
    assert [(n["node"], n["status"]) for n in nodes] == [("node-a", "at-risk")]
    assert "pod-to-lb-not-masqueraded" in nodes[0]["ids"]
    services = requests.get(collector.url + "/v1/services", timeout=5).json()
    assert services[0]["service"] == "default/web" and services[0]["exposed_nodes"] == [
        "node-a"]
    hist = requests.get(collector.url + "/v1/nodes/node-a", timeout=5).json()
    assert len(hist) == 1
    assert requests.get(collector.url + "/v1/nodes/nope", timeout=5).status_code == 404
    metrics = requests.get(collector.url + "/metrics", timeout=5).text
    assert "loopback_collector_verdicts_duplicate_total 1.0" in metrics
    assert requests.get(collector.url + "/openapi.json", timeout=5).json()["openapi"]


@pytest.mark.parametrize(("body", "code", "needle"), [
    (b"{not json", 400, "not JSON"),
    (b'{"a": 1, "a": 2}', 400, "duplicate key 'a'"),
    (json.dumps({"schema": "loopback-agent/verdict/v9"}).encode(), 422, ""),
    (json.dumps([]).encode(), 422, "empty batch"),
])
def test_bad_bodies_are_refused_with_the_reason(collector: Proc, body: bytes, code: int,
                                                needle: str) -> None:
    r = requests.post(collector.url + "/v1/verdicts", data=body,
                      headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == code and needle in r.json()["error"]


def test_422_names_the_bad_field_and_index(collector: Proc) -> None:
    good = verdict()
    bad = json.loads(json.dumps(good))
    bad["findings"][0]["severity"] = "catastrophic"
    r = requests.post(collector.url + "/v1/verdicts", json=[good, bad], timeout=5)
    assert r.status_code == 422
    assert r.json()["error"].startswith("[1]/findings/0/severity:")
    # nothing of a refused batch is stored
    assert requests.get(collector.url + "/v1/nodes", timeout=5).json() == []


def test_huge_bodies_and_batches_are_413(collector: Proc) -> None:
    r = requests.post(collector.url + "/v1/verdicts", data=b"x" * (5 * 1024 * 1024),
                      timeout=10)
    assert r.status_code == 413
    v = verdict()
    r = requests.post(collector.url + "/v1/verdicts", json=[v] * 501, timeout=10)
    assert r.status_code == 413


def test_markup_from_nodes_stays_inert_in_the_page(collector: Proc) -> None:
    v = verdict("<script>alert(1)</script>")
    v["findings"][0]["service"] = "ns/<img src=x onerror=alert(2)>"
    assert requests.post(collector.url + "/v1/verdicts", json=v, timeout=5).status_code == 200
    page = requests.get(collector.url + "/", timeout=5).text
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page
    assert 'http-equiv="refresh"' in page


def test_token_required_when_configured(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    c = Proc(tmp_path / "t.db", token)
    try:
        v = verdict()
        assert requests.post(c.url + "/v1/verdicts", json=v, timeout=5).status_code == 401
        r = requests.post(c.url + "/v1/verdicts", json=v, timeout=5,
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = requests.post(c.url + "/v1/verdicts", json=v, timeout=5,
                          headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
    finally:
        c.stop()


def test_the_agents_spool_arrives_exactly_once_across_a_collector_restart(
        tmp_path: Path, db_url: str) -> None:
    db = db_url
    spool = Spool(tmp_path / "spool")
    for i in range(5):
        spool.put({**verdict(f"node-{i % 2}"), "time": f"2026-11-22T00:00:0{i}Z"})
    down = drain(spool, Sender("http://127.0.0.1:9", timeout=1))
    assert down.sent == 0 and len(spool) == 5  # collector not running: kept
    c = Proc(db)
    try:
        assert drain(spool, Sender(c.url), batch=2).sent == 5
    finally:
        c.stop()
    c = Proc(db)  # restarted on the same database
    try:
        hist = {n: requests.get(f"{c.url}/v1/nodes/{n}", timeout=5).json()
                for n in ("node-0", "node-1")}
        assert [v["time"][-3:-1] for v in hist["node-0"]] == ["04", "02", "00"]
        assert len(hist["node-1"]) == 2
    finally:
        c.stop()


def test_two_replicas_on_one_postgresql_store_a_retried_verdict_once(
        postgres: Postgres) -> None:
    url = postgres.new_db()
    a, b = Proc(url), Proc(url)
    try:
        v = {**verdict("node-r"), "idempotency_key": "same"}
        assert requests.post(a.url + "/v1/verdicts", json=v, timeout=5).json()["stored"] == 1
        assert requests.post(b.url + "/v1/verdicts", json=v, timeout=5).json() == {
            "stored": 0, "duplicates": 1}
        assert len(requests.get(b.url + "/v1/nodes/node-r", timeout=5).json()) == 1
    finally:
        a.stop()
        b.stop()


def test_agent_killed_mid_run_loses_nothing_and_duplicates_nothing(tmp_path: Path) -> None:
    """The daemon (static checks only: this test is about shipping) is SIGKILLed twice
    while shipping a verdict every cycle, then runs to the end on the same spool: every
    verdict it spooled reaches the collector exactly once."""
    c = Proc(tmp_path / "k.db")
    spool = tmp_path / "spool"
    cmd = [sys.executable, "-m", "agent", "run", "--no-capture", "--interval", "0.2",
           "--heartbeat-every", "1", "--collector", c.url, "--spool", str(spool),
           "--listen", "", "--no-kube-api", "--node-name", "killed"]
    printed = 0
    try:
        for _ in range(2):
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
            time.sleep(2.5)
            p.kill()
            out, _ = p.communicate()
            printed += len(out.splitlines())
        last = subprocess.run([*cmd, "--cycles", "2"], capture_output=True, text=True,
                              timeout=120)
        assert last.returncode == 0, last.stderr
        printed += len(last.stdout.splitlines())
        hist = requests.get(c.url + "/v1/nodes/killed?", timeout=10).json()
    finally:
        c.stop()
    keys = [v["idempotency_key"] for v in hist]
    assert len(keys) == len(set(keys))  # nothing stored twice
    # a kill can land between spooling a verdict and printing its line: at most one per kill
    assert printed <= len(keys) <= printed + 2, (printed, len(keys))
    assert not list(spool.glob("*.json"))  # and nothing is left behind


def test_wrong_token_then_fixed_token_delivers_everything(tmp_path: Path) -> None:
    """401s are retried with backoff (the verdicts stay spooled); once the mounted token
    file is fixed the daemon re-reads it and delivers."""
    token = tmp_path / "server-token"
    token.write_text("right\n")
    agent_token = tmp_path / "agent-token"
    agent_token.write_text("wrong\n")
    c = Proc(tmp_path / "t.db", token)
    spool = tmp_path / "spool"
    p = subprocess.Popen([sys.executable, "-m", "agent", "run", "--no-capture", "--interval",
                          "0.3", "--heartbeat-every", "1", "--collector", c.url, "--spool",
                          str(spool), "--token-file", str(agent_token), "--listen", "",
                          "--no-kube-api", "--node-name", "tok"],
                         # stdout unread here: a pipe would fill and block the daemon
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert requests.get(c.url + "/v1/nodes/tok", timeout=5).status_code == 404
        assert list(spool.glob("*.json"))  # kept while refused
        agent_token.write_text("right\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if requests.get(c.url + "/v1/nodes/tok", timeout=5).status_code == 200:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("nothing delivered after the token was fixed")
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
        c.stop()
    assert p.returncode == 0
    assert "HTTP 401" in err and "retrying in" in err


def test_unicode_node_names_round_trip(collector: Proc) -> None:
    name = "节点-ü-🚀"
    v = verdict(name)
    assert requests.post(collector.url + "/v1/verdicts", json=v, timeout=5).status_code == 200
    hist = requests.get(collector.url + "/v1/nodes/" + requests.utils.quote(name), timeout=5)
    assert hist.status_code == 200 and hist.json()[0]["node"] == name
    assert name in requests.get(collector.url + "/", timeout=5).text


def test_healthz_of_the_daemon_fails_when_cycles_stop(tmp_path: Path) -> None:
    from agent.daemon import Daemon, DaemonConfig

    d = Daemon(DaemonConfig(collector=None, spool_dir=str(tmp_path / "s"), interval=1.0,
                            listen=None))
    assert d.healthy() == (True, "ok")
    d.last_cycle_end -= 100
    ok, why = d.healthy()
    assert not ok and "no verdict for" in why


def test_page_lists_a_node_once_per_service_when_observed_and_exposed() -> None:
    """The demo's fleet: each node both exposes the LB IP and saw it loop."""
    from agent.collector.store import Store

    def finding(fid: str) -> dict[str, Any]:
        return {"id": fid, "severity": "error", "lb_ip": "10.0.1.10", "service": "demo/web"}

    store = Store(":memory:")
    store.add([{"node": n, "status": "loopback", "kube_proxy_mode": "ipvs", "time": "t",
                "unknowns": [], "idempotency_key": n,
                "findings": [finding("lb-ip-local"), finding("loopback-observed")]}
               for n in ("node-a", "node-b")])
    from agent.collector import browse

    page = browse.fleet_page(store, browse.FleetView.of({}))
    row = page[page.index("demo/web"):]
    row = row[:row.index("</tr>")]
    assert ">node-a</a>" in row and ">node-b</a>" in row


_CLIENT = """
import json, sys, urllib.request
url, body = sys.argv[1], sys.stdin.read()
req = urllib.request.Request(url, data=body.encode() or None,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=10) as r:
    print(r.status)
"""


@pytest.mark.netns
def test_the_default_listener_takes_ipv6_and_ipv4(tmp_path: Path) -> None:
    """`--listen :PORT` (the default's form): agents of an IPv6-only cluster reach the
    collector's Service on IPv6, the kubelet probes its pod there; IPv4 still works.
    Before, the default was 0.0.0.0: IPv6 refused. In a namespace of its own."""
    from lab.netns import netns

    with netns("lbc6") as ns:
        ns.run("ip", "link", "set", "lo", "up")
        proc = ns.popen([sys.executable, "-m", "agent", "collector", "--listen", ":18090",
                         "--db", f"sqlite://{tmp_path / 'c.db'}"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stderr is not None
            said = json.loads(proc.stderr.readline())
            assert said["level"] == "info" and said["url"] == "http://[::]:18090/"
            assert said["msg"].startswith("collector on http://[::]:18090/")
            for i, host in enumerate(("[::1]", "127.0.0.1")):
                body = json.dumps({**verdict(f"n{i}"), "idempotency_key": f"k{i}"})
                got = ns.run(sys.executable, "-c", _CLIENT,
                             f"http://{host}:18090/v1/verdicts", input=body)
                assert got.stdout.strip() == "200", got.stderr
                got = ns.run(sys.executable, "-c", _CLIENT, f"http://{host}:18090/healthz",
                             input="")
                assert got.stdout.strip() == "200", got.stderr
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


@pytest.mark.netns
def test_a_name_with_ipv6_addresses_only_is_listened_on(tmp_path: Path) -> None:
    """`--listen NAME:PORT`, the name having IPv6 addresses only: before, an IPv4 socket
    tried to resolve it and the collector failed to start."""
    from lab.netns import netns

    hosts = tmp_path / "hosts"
    hosts.write_text("fd00:99::2 collector6.test\n")
    with netns("lbc6n") as ns:
        ns.sh("ip link set lo up && ip addr add fd00:99::2/128 dev lo nodad")
        proc = ns.popen(with_hosts(hosts, [
            sys.executable, "-m", "agent", "collector", "--listen", "collector6.test:18091",
            "--db", f"sqlite://{tmp_path / 'c.db'}"]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert json.loads(line)["msg"].startswith("collector on http"), \
                line + proc.stderr.read()
            got = ns.run(sys.executable, "-c", _CLIENT, "http://[fd00:99::2]:18091/healthz",
                         input="")
            assert got.stdout.strip() == "200", got.stderr
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


def test_every_address_is_ipv4_alone_where_the_kernel_has_no_ipv6() -> None:
    """What an IPv6 socket raises on a kernel booted with ipv6.disable=1: not reproducible
    here (namespaces share the kernel's IPv6; the lab node's disable_ipv6 sysctls leave
    "::" bindable, and the daemon test above reaches it over IPv4 there)."""
    tried: list[str] = []

    def bind(host: str) -> str:
        tried.append(host)
        if host == "::":
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return host

    assert on_every_address(bind) == "0.0.0.0" and tried == ["::", "0.0.0.0"]

    def busy(host: str) -> str:  # any other error is the caller's: never IPv4 alone quietly
        raise OSError(errno.EADDRINUSE, "Address already in use")

    with pytest.raises(OSError, match="in use"):
        on_every_address(busy)
