"""Who may POST verdicts, and for which node.

Three modes (``collector --auth``):
- ``shared-token`` without ``--token-file``: anyone who reaches the port (a lab);
- ``shared-token`` with ``--token-file``: one bearer token shared by every agent, compared in
  constant time; it lets its holder post as any node;
- ``kube-token``: each agent sends its pod's projected service-account token (audience
  ``loopback-agent-collector``); the Kubernetes TokenReview API says whose it is, and a
  verdict is taken only for the node that the token's pod runs on.

The caller is known from the headers alone, before the body is read or parsed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from agent.collector.intake import BadRequest
from agent.ship.sender import TokenFile

AUDIENCE = "loopback-agent-collector"
AGENT_SERVICE_ACCOUNT = "system:serviceaccount:loopback-agent-node:loopback-agent"
NODE_NAME = "authentication.kubernetes.io/node-name"  # Kubernetes >= 1.30, bound tokens
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
_JWT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
MAX_TOKEN = 16 * 1024


@dataclass(frozen=True)
class Caller:
    who: str
    node: str | None  # the only node it may post for; None: any node


class Authenticator(Protocol):
    def authenticate(self, authorization: str) -> Caller: ...


def _bearer(authorization: str) -> str:
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise BadRequest(401, "missing bearer token")
    return token.strip()


class Anyone:
    def authenticate(self, authorization: str) -> Caller:
        return Caller("anyone", None)


class SharedToken:
    """The token in a file (re-read when it changes), compared in constant time."""

    def __init__(self, path: str) -> None:
        self.file = TokenFile(path)

    def authenticate(self, authorization: str) -> Caller:
        want = self.file.token()
        # header values arrive decoded as ISO-8859-1: encoding back gives the sent bytes
        got = authorization.encode("latin-1", "replace")
        if not want or not hmac.compare_digest(got, f"Bearer {want}".encode()):
            raise BadRequest(401, "missing or wrong bearer token")
        return Caller("shared token", None)


def authorize(caller: Caller, nodes: list[str]) -> None:
    """403 unless the caller may post a verdict for every one of ``nodes``."""
    if caller.node is None:
        return
    other = next((n for n in nodes if n != caller.node), None)
    if other is not None:
        raise BadRequest(403, f"{caller.who} runs on node {caller.node!r}: it may not post "
                              f"a verdict for node {other[:253]!r}")


def _token_expiry(token: str) -> float | None:
    """The token's exp claim, read without verifying (only to cache no longer)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        exp = claims.get("exp") if isinstance(claims, dict) else None
        return float(exp) if isinstance(exp, (int, float)) else None
    except (ValueError, IndexError, binascii.Error, RecursionError):
        return None


REFUSED_TTL = 10.0  # seconds a refused token is refused without another review


class KubeTokenReview:
    """Verifies projected service-account tokens with the TokenReview API.

    A positive answer is cached for ``ttl`` seconds (never past the token's expiry): an
    agent posting every minute costs the API server a review every few posts, not one
    per post. At most ``concurrency`` reviews run at once: a flood of bad tokens cannot
    turn the collector into a load on the API server (beyond that: 503, retry later).

    Reviews are kept apart (issue 35, item 3): a token that passed a review before (its
    cache entry expired, the token not) is ``known`` and reviewed in its own slots; any
    other token shares ``unknown_concurrency`` slots (the server gives it a small queue
    too), so a flood of made-up tokens cannot hold back the fleet's re-reviews. Requests
    that carry a token whose review is under way wait for that review, not for a slot.
    """

    blocking = True  # calls the API: the server runs it off its event loop

    def __init__(self, api_client: Any, audience: str = AUDIENCE,
                 service_account: str = AGENT_SERVICE_ACCOUNT, timeout: float = 5.0,
                 ttl: float = 60.0, max_cached: int = 10000, concurrency: int = 4,
                 unknown_concurrency: int = 2) -> None:
        from kubernetes import client

        self.auth_api = client.AuthenticationV1Api(api_client)
        self.core_api = client.CoreV1Api(api_client)
        self.audience = audience
        self.service_account = service_account
        self.timeout = timeout
        self.ttl = ttl
        self.max_cached = max_cached
        self._cache: OrderedDict[bytes, tuple[Caller, float]] = OrderedDict()
        self._refused: OrderedDict[bytes, tuple[BadRequest, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(concurrency)
        self._unknown_slots = threading.BoundedSemaphore(unknown_concurrency)
        # tokens that passed a review, until they expire: their next review is "known"
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._inflight: dict[bytes, threading.Event] = {}

    def cached(self, authorization: str) -> Caller | None:
        """The answer without calling the API, when there is one (a malformed token, or
        one reviewed recently, either way): cheap enough for the server's event loop, so
        known agents never queue behind reviews of unknown tokens."""
        token = _bearer(authorization)
        if len(token) > MAX_TOKEN or not _JWT.fullmatch(token):
            raise BadRequest(401, "the bearer token is not a Kubernetes service-account "
                                  "token (a JWT)")
        key = hashlib.sha256(token.encode()).digest()
        with self._lock:
            hit = self._cache.get(key)
            refused = self._refused.get(key)
        now = time.time()
        if hit is not None and hit[1] > now:
            return hit[0]
        if refused is not None and refused[1] > now:
            raise refused[0]
        return None

    def known(self, authorization: str) -> bool:
        """Did this token pass a review before (and has not expired)? Cheap: for the
        server's event loop, to queue its review apart from unknown tokens'."""
        key = hashlib.sha256(_bearer(authorization).encode()).digest()
        with self._lock:
            until = self._seen.get(key)
        return until is not None and until > time.time()

    def authenticate(self, authorization: str) -> Caller:
        hit = self.cached(authorization)
        if hit is not None:
            return hit
        token = _bearer(authorization)
        key = hashlib.sha256(token.encode()).digest()
        with self._lock:
            running = self._inflight.get(key)
            if running is None:
                mine = self._inflight[key] = threading.Event()
        if running is not None:
            # the same token's review is under way: its answer, not a slot of our own
            running.wait(self.timeout + 1)
            hit = self.cached(authorization)
            if hit is not None:
                return hit
            raise BadRequest(503, "this token's review did not finish", retry_after=5)
        try:
            return self._reviewed(token, key, self.known(authorization))
        finally:
            with self._lock:
                del self._inflight[key]
            mine.set()

    def _reviewed(self, token: str, key: bytes, known: bool) -> Caller:
        now = time.time()
        slots = self._slots if known else self._unknown_slots
        if not slots.acquire(timeout=self.timeout):
            raise BadRequest(503, "too many token reviews in progress", retry_after=5)
        try:
            caller = self._review(token)
        except BadRequest as e:
            if e.code in (401, 403):
                # a refused token is refused again for a while without asking the API:
                # a flood of one bad token costs one review
                with self._lock:
                    self._refused[key] = (e, now + REFUSED_TTL)
                    while len(self._refused) > self.max_cached:
                        self._refused.popitem(last=False)
            raise
        finally:
            slots.release()
        until = now + self.ttl
        exp = _token_expiry(token)
        if exp is not None:
            until = min(until, exp)
        with self._lock:
            self._cache[key] = (caller, until)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            # known until the token expires (a projected token lives an hour or so)
            self._seen[key] = exp if exp is not None else now + 3600
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_cached:
                self._seen.popitem(last=False)
        return caller

    def _call(self, what: str, fn: Any, *args: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout)
            doc = json.loads(resp.data)
        except ApiException as e:
            if e.status == 404 and what == "pod":
                return {}
            # 401/403 here are the collector's own credentials or RBAC: not the agent's
            # fault, and it may be fixed: the agent retries later
            raise BadRequest(503, f"cannot verify the token: {what}: Kubernetes API "
                                  f"answered HTTP {e.status} {e.reason or ''}".strip(),
                             retry_after=30) from None
        except Exception as e:  # connection refused, timeout, not JSON
            raise BadRequest(503, f"cannot verify the token: {what}: "
                                  f"{type(e).__name__}", retry_after=10) from None
        return doc if isinstance(doc, dict) else {}

    def _review(self, token: str) -> Caller:
        review = self._call("tokenreview", self.auth_api.create_token_review, {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]}})
        status = review.get("status") or {}
        if not status.get("authenticated"):
            why = str(status.get("error") or "not authenticated")[:200]
            raise BadRequest(401, f"the token was refused by the Kubernetes API: {why}")
        # the API answers with the audiences it matched: a reviewer that ignored
        # spec.audiences must not make a token for another audience good here
        if self.audience not in (status.get("audiences") or []):
            raise BadRequest(401, f"the token is not for audience {self.audience!r}")
        user = status.get("user") or {}
        username = str(user.get("username") or "")
        if username != self.service_account:
            raise BadRequest(403, f"{username[:200]!r} is not the agent's service account "
                                  f"({self.service_account})")
        extra = user.get("extra") or {}

        def first(name: str) -> str | None:
            values = extra.get(name) or []
            return str(values[0]) if values else None

        node = first(NODE_NAME)
        pod, pod_uid = first(POD_NAME), first(POD_UID)
        if node is None and pod is not None:
            parts = username.split(":")  # system:serviceaccount:NS:NAME
            namespace = parts[2] if len(parts) == 4 else ""
            found = self._call("pod", self.core_api.read_namespaced_pod, pod, namespace)
            meta, spec = found.get("metadata") or {}, found.get("spec") or {}
            if pod_uid is not None and meta.get("uid") != pod_uid:
                raise BadRequest(401, f"the token's pod {namespace}/{pod} no longer exists")
            node = spec.get("nodeName") or None
        if not node:
            raise BadRequest(403, "the token is not bound to a pod scheduled on a node "
                                  "(use a projected service-account token)")
        who = f"pod {pod}" if pod else username
        return Caller(who, str(node))
