"""`run --kube-report`: the verdict as a Node condition and Warning Events (opt-in).

- One condition, type LoadBalancerLoopback, on this agent's own Node, written with a
  strategic-merge PATCH of nodes/NAME/status (conditions merge by type: the kubelet's and
  NPD's are left alone), and only when its status, reason or message changes;
  lastTransitionTime only when its status does. The condition as it stands is read once
  (a GET of the Node) so a restarted agent neither rewrites it nor resets the time.
- A Warning Event (events.k8s.io/v1) when a warning/critical finding appears, regarding
  the Service it names (else the Node). A finding that goes and comes back adds to the
  same Event's series (series.count, lastObservedTime: a PATCH), never one Event per
  interval. Written with create and patch only (RBAC: daemonset/kube-report/). An Event
  the API server has deleted (its TTL) starts a new series. At most EVENTS_PER_VERDICT new
  ones a verdict, and none after a request got no answer: the rest in the next verdicts.
- ``regarding`` carries a uid (the Service's, read with a GET; for a Node its name, as the
  kubelet does) so that `kubectl describe` lists the Event.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from agent.diagnose.model import Finding, Verdict
from agent.kubereport.condition import (
    CONDITION_TYPE,
    Condition,
    EventKey,
    camel,
    condition_of,
    event_keys,
)
from agent.kubewatch.reflector import describe

CONTROLLER = "loopback-agent"
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
NOTE_MAX = 1024  # the API refuses a longer note
# New Events written per verdict, the rest in the next ones: a node with thousands of LB IPs
# at risk must neither hold the daemon's loop for thousands of requests nor flood the API
# from every node at once (client-go's recorder bursts 25 per object)
EVENTS_PER_VERDICT = 25


def _now() -> datetime:
    return datetime.now(UTC)


def _time(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _done(resp: Any) -> None:
    """Read the answer to its end before the connection goes back to the pool (an unread
    body would be taken for the next answer)."""
    try:
        resp.data  # noqa: B018
    finally:
        resp.release_conn()


_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def service_ref(service: str) -> tuple[str, str] | None:
    """(namespace, name) of "ns/name"; None for anything else (a hand-written rule comment
    may say anything): the Event then regards the Node, and its name stays valid."""
    ns, slash, name = service.partition("/")
    if slash and _LABEL.fullmatch(ns) and _LABEL.fullmatch(name):
        return ns, name
    return None


class KubeReporter:
    def __init__(self, api_client: Any, node_name: str, *, timeout: float = 5.0,
                 clock: Callable[[], datetime] = _now) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.events = client.EventsV1Api(api_client)
        self.api_client = api_client
        self.node = node_name
        self.timeout = timeout
        self.clock = clock
        self.current: Condition | None = None  # the Node's condition, as last read/written
        self.read = False
        self.active: set[EventKey] = set()  # findings of the last verdict with an Event
        self.series: dict[EventKey, int] = {}  # count so far, per Event this agent wrote

    def close(self) -> None:
        self.api_client.close()

    def report(self, v: Verdict) -> list[str]:
        """Write what changed; the problems (to log) are retried with the next verdict."""
        from kubernetes.client.exceptions import ApiException

        problems = []
        reachable = True
        try:
            self._condition(condition_of(v))
        except Exception as exc:  # ApiException (403: RBAC not granted), timeouts
            problems.append(f"node {self.node} condition {CONDITION_TYPE}: {describe(exc)}")
            # no answer at all (a timeout, refused): the Events would wait as long, each
            reachable = isinstance(exc, ApiException)
        problems += self._events(v, reachable)
        return problems

    # -- the condition ---------------------------------------------------------------------

    def _opts(self) -> dict[str, Any]:
        return {"_preload_content": False, "_request_timeout": self.timeout}

    def _condition(self, want: Condition) -> None:
        if not self.read:
            self.current = self._read_condition()
            self.read = True
        if want == self.current:
            return
        now = _time(self.clock())
        cond = {"type": CONDITION_TYPE, "status": want.status, "reason": want.reason,
                "message": want.message, "lastHeartbeatTime": now}
        if self.current is None or self.current.status != want.status:
            cond["lastTransitionTime"] = now  # else the merge keeps the one it has
        _done(self.core.patch_node_status(self.node, {"status": {"conditions": [cond]}},
                                          _content_type=STRATEGIC, **self._opts()))
        self.current = want

    def _read_condition(self) -> Condition | None:
        resp = self.core.read_node(self.node, **self._opts())
        try:
            doc = json.loads(resp.data)
        finally:
            resp.release_conn()
        conditions = ((doc.get("status") or {}).get("conditions") or []) \
            if isinstance(doc, dict) else []
        for c in conditions:
            if isinstance(c, dict) and c.get("type") == CONDITION_TYPE:
                return Condition(str(c.get("status", "")), str(c.get("reason", "")),
                                 str(c.get("message", "")))
        return None

    # -- events ----------------------------------------------------------------------------

    def _events(self, v: Verdict, reachable: bool = True) -> list[str]:
        """An Event per new finding. Once a request got no answer (timed out, refused),
        the rest wait for the next verdict: one timeout per verdict, not one per finding
        (which, with many findings, kept the daemon's loop past its liveness limit)."""
        from kubernetes.client.exceptions import ApiException

        keys = event_keys(v)
        problems = []
        failed = set()
        tried = 0
        for key, finding in keys.items():
            if key in self.active:
                continue  # still there: no news
            if not reachable or tried >= EVENTS_PER_VERDICT:
                failed.add(key)
                continue
            tried += 1
            try:
                self._emit(key, finding)
            except Exception as exc:
                failed.add(key)
                problems.append(f"event for {key.finding} {key.lb_ip}: {describe(exc)}")
                reachable = isinstance(exc, ApiException)
        waiting = len(failed) - sum(1 for p in problems if p.startswith("event for "))
        if waiting:
            why = (f"at most {EVENTS_PER_VERDICT} a verdict" if reachable
                   else "the API server did not answer")
            problems.append(f"{waiting} events wait for the next verdict ({why})")
        self.active = set(keys) - failed
        return problems

    def event_name(self, key: EventKey) -> tuple[str, str]:
        """(namespace, name): stable per node and finding, so a restarted agent finds it."""
        digest = hashlib.sha256("|".join((self.node, key.finding, key.lb_ip, str(key.port),
                                          key.service)).encode()).hexdigest()[:12]
        ref = service_ref(key.service)
        if ref:
            ns, name = ref
            return ns, f"{name[:200]}.{digest}"
        return "default", f"{self.node[:200]}.{digest}"

    def _emit(self, key: EventKey, f: Finding) -> None:
        from kubernetes.client.exceptions import ApiException

        ns, name = self.event_name(key)
        now = _micro(self.clock())
        if key in self.series:
            try:
                self._observe_again(ns, name, self.series[key] + 1, now, key)
                return
            except ApiException as exc:
                if exc.status != 404:
                    raise
                # the API server deleted it (--event-ttl, 1 h by default): a new series
                del self.series[key]
        # kubectl describe finds an Event by the uid of what it regards: a Service's own,
        # for a Node its name (the kubelet's convention, which kubectl also matches)
        ref = service_ref(key.service)
        if ref:
            sns, sname = ref
            regarding = {"apiVersion": "v1", "kind": "Service", "namespace": sns,
                         "name": sname}
            uid = self._service_uid(sns, sname)
            if uid:
                regarding["uid"] = uid
        else:
            regarding = {"apiVersion": "v1", "kind": "Node", "name": self.node,
                         "uid": self.node}
        note = f"{f.summary} (node {self.node}" + (f", LB IP {f.lb_ip}" if f.lb_ip else "") \
            + (f", port {f.port}" if f.port else "") + ")"
        body = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": name, "namespace": ns},
                "eventTime": now, "type": "Warning", "reason": camel(f.id),
                "action": "Diagnose", "reportingController": CONTROLLER,
                "reportingInstance": f"{CONTROLLER}-{self.node}"[:128],
                "regarding": regarding, "note": note[:NOTE_MAX]}
        try:
            _done(self.events.create_namespaced_event(ns, body, **self._opts()))
            self.series[key] = 1
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Written before this agent started: continue its series. An empty merge
            # patch changes nothing and answers the Event (no "get" permission needed).
            resp = self.events.patch_namespaced_event(name, ns, {}, _content_type=MERGE,
                                                      **self._opts())
            try:
                doc = json.loads(resp.data)
            finally:
                resp.release_conn()
            series = doc.get("series") if isinstance(doc, dict) else None
            count = series.get("count", 1) if isinstance(series, dict) else 1
            self._observe_again(ns, name, int(count) + 1, now, key)

    def _service_uid(self, namespace: str, name: str) -> str:
        """The Service's uid, "" when it cannot be read (gone, not allowed): the Event is
        still written, found by `kubectl get events` if not by `kubectl describe`."""
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self.core.read_namespaced_service(name, namespace, **self._opts())
        except ApiException:
            return ""
        try:
            doc = json.loads(resp.data)
        except ValueError:
            return ""
        finally:
            resp.release_conn()
        uid = ((doc.get("metadata") or {}).get("uid") or "") if isinstance(doc, dict) else ""
        return uid if isinstance(uid, str) else ""

    def _observe_again(self, ns: str, name: str, count: int, now: str, key: EventKey) -> None:
        patch = {"series": {"count": count, "lastObservedTime": now}}
        _done(self.events.patch_namespaced_event(name, ns, patch, _content_type=MERGE,
                                                 **self._opts()))
        self.series[key] = count
