"""Per-node identity (`collector --auth kube-token`): the collector, a real process, asks a
real HTTP server on 127.0.0.1 that speaks the Kubernetes TokenReview and pod endpoints
(a small fixture API server: the collector's own Kubernetes client is not mocked) whose
token each POST carries, and takes a verdict only for the node that token's pod runs on.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from agent.ship.sender import Sender, drain
from agent.ship.spool import Spool
from tests.test_collector import Proc, free_port, verdict

AGENT_SA = "system:serviceaccount:loopback-agent-node:loopback-agent"
COLLECTOR_CREDENTIAL = "collector-own-token"
AUDIENCE = "loopback-agent-collector"


def jwt(subject: str, exp: float | None = None) -> str:
    """Shaped like a service-account token; only the fixture API can tell it is good."""
    def b64(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")
    return f"{b64({'alg': 'RS256'})}.{b64({'sub': subject, 'exp': exp or time.time() + 3600})}" \
           ".c2lnbmF0dXJl"


class FakeKubeAPI:
    """TokenReview (POST /apis/authentication.k8s.io/v1/tokenreviews) and pod reads
    (GET /api/v1/namespaces/NS/pods/NAME), answering as a Kubernetes API server does,
    for the tokens and pods the test registers. Counts every request."""

    def __init__(self) -> None:
        self.tokens: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: Counter[str] = Counter()
        # a stuck API server: while cleared, token reviews wait here (60 s at most)
        self.open = threading.Event()
        self.open.set()
        self.delay = 0.0  # seconds each token review takes
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _status(self, code: int, reason: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": reason, "code": code})

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {COLLECTOR_CREDENTIAL}":
                    self._status(401, "Unauthorized")
                    return False
                return True

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/apis/authentication.k8s.io/v1/tokenreviews":
                    return self._status(404, "NotFound")
                if not self._authorized():
                    return None
                spec = body["spec"]
                api.calls["tokenreview started"] += 1
                api.open.wait(60)
                time.sleep(api.delay)
                api.calls["tokenreview"] += 1
                api.calls[f"tokenreview:{spec['token'][-12:]}"] += 1
                known = api.tokens.get(spec["token"])
                matched = [a for a in spec.get("audiences") or []
                           if known and a in known["audiences"]]
                if known is None or not matched:
                    status = {"authenticated": False, "error": "invalid bearer token"}
                else:
                    status = {"authenticated": True, "audiences": matched, "user": {
                        "username": known["username"], "uid": "u-1",
                        "groups": ["system:serviceaccounts"], "extra": known["extra"]}}
                return self._send(201, {"apiVersion": "authentication.k8s.io/v1",
                                        "kind": "TokenReview", "spec": spec, "status": status})

            def do_GET(self) -> None:
                m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/?]+)", self.path)
                if not m:
                    return self._status(404, "NotFound")
                if not self._authorized():
                    return None
                api.calls["pod"] += 1
                pod = api.pods.get((m.group(1), m.group(2)))
                if pod is None:
                    return self._status(404, "NotFound")
                return self._send(200, pod)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def agent_token(self, pod: str, node: str | None, *, username: str = AGENT_SA,
                    audiences: tuple[str, ...] = (AUDIENCE,), pod_node: str | None = None,
                    uid: str | None = None) -> str:
        """A bound token of ``pod``; ``node``: the node-name extra (Kubernetes >= 1.30),
        None for an older API server (then the pod is read: on ``pod_node``)."""
        token = jwt(pod)
        extra = {"authentication.kubernetes.io/pod-name": [pod],
                 "authentication.kubernetes.io/pod-uid": [f"uid-{pod}"]}
        if node is not None:
            extra["authentication.kubernetes.io/node-name"] = [node]
        self.tokens[token] = {"username": username, "audiences": audiences, "extra": extra}
        ns = username.split(":")[2]
        self.pods[(ns, pod)] = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": pod, "namespace": ns, "uid": uid or f"uid-{pod}"},
            "spec": {"nodeName": pod_node or node}}
        return token

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fixture",
            "clusters": [{"name": "fixture", "cluster": {"server": self.url}}],
            "users": [{"name": "collector", "user": {"token": COLLECTOR_CREDENTIAL}}],
            "contexts": [{"name": "fixture",
                          "context": {"cluster": "fixture", "user": "collector"}}]}))
        return path

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kube() -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI()
    yield api
    api.stop()


@pytest.fixture
def collector(kube: FakeKubeAPI, tmp_path: Path) -> Iterator[Proc]:
    c = Proc(tmp_path / "c.db", extra=("--auth", "kube-token", "--kubeconfig",
                                       str(kube.kubeconfig(tmp_path / "kubeconfig"))))
    yield c
    c.stop()


def post(c: Proc, body: Any, token: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(c.url + "/v1/verdicts", json=body, headers=headers, timeout=10)


def nodes(c: Proc) -> list[str]:
    return [n["node"] for n in requests.get(c.url + "/v1/nodes", timeout=5).json()]


def test_a_verdict_is_taken_only_for_the_node_of_the_tokens_pod(
        collector: Proc, kube: FakeKubeAPI) -> None:
    a = kube.agent_token("agent-aaaaa", "node-a")
    assert post(collector, verdict("node-a"), a).status_code == 200
    r = post(collector, verdict("node-b"), a)
    assert r.status_code == 403 and "'node-a'" in r.json()["error"] \
        and "'node-b'" in r.json()["error"]
    r = post(collector, [verdict("node-a"), verdict("node-b")], a)
    assert r.status_code == 403  # the whole batch, nothing of it stored
    assert nodes(collector) == ["node-a"]
    # positive answers are cached: one review for all of these posts
    for _ in range(3):
        assert post(collector, verdict("node-a"), a).status_code == 200
    assert kube.calls[f"tokenreview:{a[-12:]}"] == 1


def test_an_older_api_server_is_asked_for_the_pods_node(
        collector: Proc, kube: FakeKubeAPI) -> None:
    """Before Kubernetes 1.30 the review names the pod, not its node: the pod is read."""
    c_token = kube.agent_token("agent-ccccc", None, pod_node="node-c")
    assert post(collector, verdict("node-c"), c_token).status_code == 200
    assert kube.calls["pod"] == 1
    assert post(collector, verdict("node-a"), c_token).status_code == 403
    gone = kube.agent_token("agent-ddddd", None, pod_node="node-d", uid="a-newer-pod")
    r = post(collector, verdict("node-d"), gone)
    assert r.status_code == 401 and "no longer exists" in r.json()["error"]


@pytest.mark.parametrize(("case", "code"), [
    ("none", 401), ("not a jwt", 401), ("unknown", 401), ("other audience", 401),
    ("other service account", 403), ("not bound to a pod", 403)])
def test_tokens_that_prove_no_node_are_refused(collector: Proc, kube: FakeKubeAPI,
                                               case: str, code: int) -> None:
    token = {
        "none": None,
        "not a jwt": "s3cret-shared-token",
        "unknown": jwt("nobody"),
        "other audience": kube.agent_token("agent-x", "node-a",
                                           audiences=("https://kubernetes.default.svc",)),
        "other service account": kube.agent_token(
            "web-1", "node-a", username="system:serviceaccount:default:default"),
        "not bound to a pod": kube.agent_token("agent-y", None, pod_node=""),
    }[case]
    r = post(collector, verdict("node-a"), token)
    assert r.status_code == code, r.text
    assert nodes(collector) == []
    if case == "not a jwt":
        assert kube.calls["tokenreview"] == 0  # refused without asking the API


def test_api_server_down_is_503_and_cached_callers_go_on(
        collector: Proc, kube: FakeKubeAPI) -> None:
    a = kube.agent_token("agent-aaaaa", "node-a")
    b = kube.agent_token("agent-bbbbb", "node-b")
    assert post(collector, verdict("node-a"), a).status_code == 200
    kube.stop()
    r = post(collector, verdict("node-b"), b)
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert post(collector, verdict("node-a"), a).status_code == 200


def test_the_agents_sender_delivers_with_its_projected_token(
        collector: Proc, kube: FakeKubeAPI, tmp_path: Path) -> None:
    """The agent's side as it ships: the token file it re-reads, the spool it drains."""
    token_file = tmp_path / "token"
    token_file.write_text(kube.agent_token("agent-eeeee", "node-e"))
    spool = Spool(tmp_path / "spool")
    for i in range(3):
        spool.put({**verdict("node-e"), "time": f"2026-11-22T00:00:0{i}Z"})
    assert drain(spool, Sender(collector.url, token_file=token_file)).sent == 3
    assert len(requests.get(collector.url + "/v1/nodes/node-e", timeout=5).json()) == 3


def test_kube_token_mode_needs_an_api_and_no_shared_token(tmp_path: Path,
                                                          kube: FakeKubeAPI) -> None:
    def start(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent", "collector", "--listen",
                               f"127.0.0.1:{free_port()}", "--db",
                               f"sqlite://{tmp_path / 'x.db'}", "--auth", "kube-token", *extra],
                              capture_output=True, text=True, timeout=30, env=env)

    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")}
    r = start("--kubeconfig", str(tmp_path / "missing"), env=env)
    assert r.returncode == 64 and "needs the Kubernetes API" in r.stderr
    (tmp_path / "t").write_text("x")
    r = start("--kubeconfig", str(kube.kubeconfig(tmp_path / "kc")), "--token-file",
              str(tmp_path / "t"))
    assert r.returncode == 64 and "--token-file" in r.stderr


def test_known_agents_never_queue_behind_reviews_of_unknown_tokens(
        collector: Proc, kube: FakeKubeAPI) -> None:
    # a flood of JWT-shaped garbage while the API server is stuck: no review ends until
    # the test lets them, and the collector runs 4 at once; an agent reviewed before is
    # answered from the cache meanwhile (not by time: while no review of the flood has
    # ended), and one bad token repeated costs a single review
    a = kube.agent_token("agent-aaaaa", "node-a")
    assert post(collector, verdict("node-a"), a).status_code == 200
    reviewed = kube.calls["tokenreview"]
    kube.open.clear()
    def refused(i: int) -> None:
        with contextlib.suppress(requests.RequestException):  # queued ones may time out
            post(collector, verdict("x"), jwt(f"bad{i}"))

    flood = [threading.Thread(target=refused, args=(i,)) for i in range(24)]
    try:
        for t in flood:
            t.start()
        deadline = time.monotonic() + 30
        while kube.calls["tokenreview started"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kube.calls["tokenreview started"] >= 4  # the collector's reviewers are busy
        # queued behind the flood it would wait for a reviewer: none is free until the
        # test opens the API server, so the post would time out
        assert post(collector, verdict("node-a"), a).status_code == 200
        assert kube.calls["tokenreview"] == reviewed  # no review ended in the meantime
    finally:
        kube.open.set()
    for t in flood:
        t.join(timeout=60)
    deadline = time.monotonic() + 30  # reviews of the flood still queued: let them end
    while kube.calls["tokenreview"] < 1 + 24 and time.monotonic() < deadline:
        time.sleep(0.1)
    bad = jwt("same-bad-one")
    before = kube.calls["tokenreview"]
    codes = [post(collector, verdict("node-a"), bad).status_code for _ in range(5)]
    assert codes == [401] * 5
    assert kube.calls["tokenreview"] - before == 1  # refused again from memory


def test_a_flood_of_made_up_tokens_does_not_stop_known_agents(
        kube: FakeKubeAPI, tmp_path: Path) -> None:
    """issue 35, item 3: 80 clients without any credential sending random JWT-shaped
    tokens, each review taking 0.2 s: 9 of 10 agents whose cache entry had expired got
    503 "too many token reviews waiting", and every entry expires within its cache time,
    so one client stopped the fleet's intake. Known tokens are now reviewed apart."""
    c = Proc(tmp_path / "c.db", extra=(
        "--auth", "kube-token", "--kubeconfig", str(kube.kubeconfig(tmp_path / "kc")),
        "--token-review-cache", "1"))
    stop = threading.Event()
    refused: Counter[int] = Counter()

    def flood() -> None:
        s = requests.Session()
        while not stop.is_set():
            fake = jwt(f"x-{secrets.token_hex(8)}")
            with contextlib.suppress(requests.RequestException):
                refused[s.post(c.url + "/v1/verdicts", json={}, timeout=10,
                               headers={"Authorization": f"Bearer {fake}"}).status_code] += 1

    try:
        agents = {f"node-{i}": kube.agent_token(f"agent-{i:05d}", f"node-{i}")
                  for i in range(10)}
        for node, token in agents.items():
            assert post(c, verdict(node), token).status_code == 200
        time.sleep(1.5)  # every agent's cached review has expired
        kube.delay = 0.2
        threads = [threading.Thread(target=flood) for _ in range(80)]
        for t in threads:
            t.start()
        time.sleep(2)
        codes = [post(c, verdict(node), token).status_code for node, token in agents.items()]
        assert codes == [200] * 10, codes
        assert refused[503] > 0  # the flood was refused, the known agents were not
    finally:
        stop.set()
        for t in threads:
            t.join()
        c.stop()
