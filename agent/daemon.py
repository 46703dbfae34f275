"""`loopback-agent run`: the DaemonSet mode.

Every interval: snapshot the node, watch NodePort handshakes for the interval, diagnose,
print a bounded summary of the verdict as one line on stdout (for the log pipeline:
agent.ship.logline; JSON, or a human line with --log-format text), spool the verdict (its
v2 summary document) when it changed or a heartbeat is due, and ship the spool to the
collector. Without a capture (--no-capture, or none possible here) the rest of the
interval is waited out. /metrics, /healthz and (to this node only) /verdict, the last
verdict (?detail=all: every finding itemised; ?lb_ip=IP: one address's), are served on
--listen (bounded: agent.daemon_http). SIGTERM: finish the current verdict, ship what the
grace period allows, leave the rest in the spool, exit 0. Anything else the daemon says
is a line on stderr with a level, in the same format (agent.logfmt).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import datetime as dt
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from agent import logfmt
from agent.bundle import files as bundle_files
from agent.bundle import with_kube_json
from agent.capture.model import OUTCOMES, SOURCE_CLASSES
from agent.daemon_http import BoundedHTTPServer, QuietHandler, from_this_host
from agent.diagnose import Prepared, diagnose, node_name, prepare
from agent.diagnose.model import Verdict
from agent.diagnose.rules.consistency import sync_state
from agent.listen import on_every_address, split_listen
from agent.probes import collect_live, kube_api
from agent.probes.base import ProbeContext, ReadCache
from agent.ship import logline
from agent.ship.sender import Backoff, Sender, drain
from agent.ship.spool import IDEMPOTENCY_KEY, Spool
from agent.signals import SignalEvents
from agent.snapshot import NodeSnapshot, Unknown
from agent.verdict_doc import STATUSES
from agent.watch import watch_node

# what says the Services, Ingresses and Node: the API, or --kube-json's files
_KUBE_SOURCES = frozenset({kube_api.SOURCE, bundle_files.SERVICES, bundle_files.NODE,
                           bundle_files.INGRESSES, bundle_files.KUBE_PROXY_DAEMONSET})

# loopback_agent_finding has one series per (finding id, severity, LB IP, Service): a node
# with thousands of LB IPs at risk must not blow up Prometheus. Past the cap the least
# severe are left out and counted (loopback_agent_finding_series_dropped_total).
MAX_FINDING_SERIES = 500
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
_LABEL_MAX = 253  # a DNS name's length: longer label values are cut, not refused
# what the daemon says besides the verdicts: stderr, a line each (agent.logfmt, set up by
# the command); stdout carries only the verdicts' lines
log = logging.getLogger(logfmt.LOGGER + ".daemon")


def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has none): nothing to give back
        return None


_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Give the heap a cycle freed back to the kernel (glibc's malloc_trim): the read and
    the walks of a 10k-service node free tens of MiB that glibc would keep in the process
    until the next cycle; the daemon then idles. Measured at 10k: RSS -15 MiB (iptables
    mode), -12 MiB (nftables mode)."""
    if _TRIM is not None:
        _TRIM(0)


@dataclass(frozen=True)
class DaemonConfig:
    collector: str | None
    spool_dir: str
    interval: float = 60.0
    heartbeat_every: int = 10  # intervals between verdicts shipped although unchanged
    listen: str | None = ":9808"  # every address, IPv6 and IPv4 (agent.listen)
    token_file: str | None = None
    ca_file: str | None = None
    grace: float = 10.0  # seconds to keep shipping after SIGTERM
    capture: bool = True
    nodeport_range: tuple[int, int] = (30000, 32767)
    node_name: str | None = None
    use_kube_api: bool = True
    kubeconfig: str | None = None
    kube_json: str | None = None  # saved kubectl JSON (--kube-json DIR), re-read each cycle
    cycles: int | None = None  # stop after this many verdicts (tests, one-off runs)
    max_finding_series: int = MAX_FINDING_SERIES  # cap of loopback_agent_finding's series
    # list+watch of Services/Ingresses/this Node (agent.kubewatch): a watch's length, and
    # the least time between two diagnoses a kube change can ask for (bursts coalesce)
    kube_watch_timeout: float = 300.0
    kube_change_gap: float = 5.0  # also the shortest capture a change may cut
    kube_report: bool = False  # write the Node condition and Events (agent.kubereport)
    # the share of one CPU, in percent, that reading changed rules/ipsets/IPVS again may
    # take (ReadCache.cpu_share); 100: read every change at once
    reread_cpu: float = 10.0
    log_format: str = "json"  # the verdicts' lines on stdout (agent.logfmt: json or text)


class Metrics:
    """Node-level series a dashboard needs. Labels are enums, except the per-finding series
    (LB IP, Service), whose number is capped at ``max_finding_series``."""

    def __init__(self, max_finding_series: int = MAX_FINDING_SERIES) -> None:
        self.max_finding_series = max_finding_series
        self._finding_keys: set[tuple[str, str, str, str]] = set()
        # the findings the series were last set from; an unchanged cycle's verdict reuses
        # the very tuple (a frozen one), so its series stay as they are
        self._findings_seen: tuple[Any, ...] | None = None
        self._dropped_last = 0
        r = self.registry = CollectorRegistry()
        p = "loopback_agent_"
        self.status = Gauge(p + "status", "1 for the node's current verdict status",
                            ["status"], registry=r)
        self.findings = Gauge(p + "findings", "Findings in the current verdict",
                              ["id", "severity"], registry=r)
        self.lb_ips_local = Gauge(p + "lb_ips_local",
                                  "LoadBalancer IPs that are local addresses here", registry=r)
        self.syns = Counter(p + "nodeport_syns", "NodePort SYNs by outcome and source class",
                            ["outcome", "source_class"], registry=r)
        self.kernel_drops = Counter(p + "capture_kernel_drops",
                                    "Packets the kernel dropped from the capture ring",
                                    registry=r)
        self.martian = Counter(p + "martian_source_drops",
                               "in_martian_src increase seen during captures (host-wide)",
                               registry=r)
        self.spool_depth = Gauge(p + "spool_depth", "Verdicts waiting to be shipped",
                                 registry=r)
        self.spool_dropped = Gauge(p + "spool_dropped", "Verdicts dropped: spool was full",
                                   registry=r)
        self.spool_set_aside = Gauge(p + "spool_set_aside",
                                     "Spool entries set aside: not readable verdicts, or "
                                     "refused by the collector", registry=r)
        self.spool_write_failures = Counter(p + "spool_write_failures",
                                            "Verdicts that could not be spooled (disk full, "
                                            "too large)", registry=r)
        self.shipped = Counter(p + "shipped_verdicts", "Verdicts accepted by the collector",
                               registry=r)
        self.ship_failures = Counter(p + "ship_failures", "Failed shipping attempts",
                                     registry=r)
        self.probe_seconds = Gauge(p + "cycle_duration_seconds",
                                   "Duration of the last cycle's phases", ["phase"],
                                   registry=r)
        self.last_verdict = Gauge(p + "last_verdict_timestamp_seconds",
                                  "When the last verdict was made", registry=r)
        self.finding = Gauge(p + "finding", "1 while this finding is in the current verdict "
                             "(the series goes when the finding does)",
                             ["id", "severity", "lb_ip", "service"], registry=r)
        self.finding_dropped = Counter(p + "finding_series_dropped",
                                       "Finding series left out of loopback_agent_finding "
                                       "(over the cap), summed over verdicts", registry=r)
        # registered at the first capture: with --no-capture there is no series to alert on
        self.capture_available = Gauge(p + "capture_available",
                                       "1 if the last cycle's NodePort capture ran, 0 if it "
                                       "was unavailable (absent with --no-capture)",
                                       registry=None)
        self._capture_registered = False
        self.capture_packets = Counter(p + "capture_packets",
                                       "Packets the capture filter passed to the agent",
                                       registry=r)
        # (source: one of the few cached sources, "nat rules", "ipsets", ...)
        self.read_put_off = Gauge(p + "read_put_off",
                                  "1 while this source changed and its read is put off "
                                  "(--reread-cpu): the verdict shows its last read",
                                  ["source"], registry=r)
        self.read_cpu = Gauge(p + "read_cpu_seconds", "CPU of this source's last read",
                              ["source"], registry=r)
        self.read_kept = Counter(p + "read_kept_commits",
                                 "Commits that moved this source's change marker (the nft "
                                 "generation) and left what it holds as read: not read "
                                 "again", ["source"], registry=r)
        self._kept_seen: dict[str, int] = {}

    def verdict(self, v: Verdict) -> None:
        for s in STATUSES:
            self.status.labels(s).set(1 if v.status == s else 0)
        if v.findings is not self._findings_seen:  # 37k findings: 0.15 s a cycle
            self.findings.clear()
            by_key = collections.Counter((f.id, f.severity) for f in v.findings)
            for (fid, severity), n in by_key.items():
                self.findings.labels(fid, severity).set(n)
            self._set_findings(v)
            self._findings_seen = v.findings
        elif self._dropped_last:
            self.finding_dropped.inc(self._dropped_last)  # counted per verdict
        self.lb_ips_local.set(sum(1 for r in v.lb_ips if r.local))
        cap = v.capture
        if cap:
            unavailable = any(p.startswith("capture unavailable") for p in cap.problems)
            self.capture_available.set(0 if unavailable else 1)
            if not self._capture_registered:
                self.registry.register(self.capture_available)
                self._capture_registered = True
            self.capture_packets.inc(cap.packets_seen)
            for port in cap.ports:
                for outcome, by_src in port.counts.items():
                    for src, n in by_src.items():
                        if outcome in OUTCOMES and src in SOURCE_CLASSES:
                            self.syns.labels(outcome, src).inc(n)
            self.kernel_drops.inc(cap.kernel_drops)
            for c in cap.corroboration:
                if c.source == "in_martian_src" and c.value:
                    self.martian.inc(c.value)
        self.last_verdict.set(time.time())

    def reads(self, cache: ReadCache) -> None:
        for source, cpu in cache.read_cpu.items():
            self.read_cpu.labels(source).set(cpu)
            self.read_put_off.labels(source).set(1 if source in cache.stale else 0)
        for source, n in cache.same_content.items():
            if n > self._kept_seen.get(source, 0):
                self.read_kept.labels(source).inc(n - self._kept_seen.get(source, 0))
                self._kept_seen[source] = n

    def _set_findings(self, v: Verdict) -> None:
        """One series per distinct finding key, the most severe first up to the cap; series
        of findings that are gone are removed (not left at 0: absent means absent)."""
        keys = sorted({(f.id, f.severity, (f.lb_ip or "")[:_LABEL_MAX],
                        (f.service or "")[:_LABEL_MAX]) for f in v.findings},
                      key=lambda k: (_SEVERITY_RANK.get(k[1], 3), k))
        kept = set(keys[:max(0, self.max_finding_series)])
        self._dropped_last = len(keys) - len(kept)
        if self._dropped_last:
            self.finding_dropped.inc(self._dropped_last)
        for gone in self._finding_keys - kept:
            self.finding.remove(*gone)
        for key in kept:
            self.finding.labels(*key).set(1)
        self._finding_keys = kept


class Daemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        # set by a stop or a kube change: ends the wait between cycles (and the capture)
        self.wake = threading.Event()
        self.kube: Any = None  # agent.kubewatch.KubeInformer, when there is an API
        self.reporter: Any = None  # agent.kubereport.KubeReporter, with --kube-report
        self._kube_timer: threading.Timer | None = None
        self.cycle_started = 0.0
        # a change the cycle under way may not hold yet; with cycle_started and the clear
        # of wake, under one lock: a change seen against the last cycle's start must not
        # wake the one that just began (it would end at once, a verdict 0.1 s after one)
        self._kube_pending = False
        self._wake_lock = threading.Lock()
        self.metrics = Metrics(cfg.max_finding_series)
        self.spool = Spool(cfg.spool_dir)
        self.sender = (Sender(cfg.collector, token_file=cfg.token_file, ca_file=cfg.ca_file)
                       if cfg.collector else None)
        self.backoff = Backoff()
        # unchanged rules/ipsets/IPVS are not re-read each cycle, changed ones within a
        # share of a CPU
        self.reads = ReadCache(cpu_share=cfg.reread_cpu / 100)
        # the Services, Ingresses and Node (and what the API said of them) when the rules
        # were last read: the verdict pairs them with a read that stands while a new one
        # is put off (fresh Services beside old rules would miss a new LB IP's rules)
        self._kube_at_read: tuple[dict[str, Any], tuple[Unknown, ...]] | None = None
        self._last: tuple[NodeSnapshot, Any, Verdict] | None = None  # snapshot, prepared, v
        self.next_ship = 0.0
        self.last_cycle_end = time.monotonic()
        self._server: BoundedHTTPServer | None = None
        # the last verdict and its idempotency key (when spooled), for GET /verdict; its
        # JSON is made at the first request, once per verdict (a 10k-IP node's is ~21 MB)
        self._published: tuple[Verdict, str | None] | None = None
        self._published_json: bytes | None = None
        self._publish_lock = threading.Lock()
        # the last full log line: what it showed (logline.same_key) and its verdict's time
        self._line_key: Any = None
        self._line_time = ""
        self._since_line = 0

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        # stop first: the loop, woken, looks at it (set by a thread: see agent.signals)
        signals = SignalEvents((signal.SIGTERM, signal.SIGINT), self.stop, self.wake)
        last_key: Any = None
        since_ship = 0
        cycles = 0
        try:
            if self.cfg.listen:
                self._serve(self.cfg.listen)
            self._start_kube()
        except BaseException:
            signals.close()
            raise
        try:
            while True:
                started = self._begin_cycle()
                if self.stop.is_set():  # a SIGTERM just before the clear still ends it
                    self.wake.set()
                verdict = self.cycle()
                cycles += 1
                key = verdict.change_key()
                since_ship += 1
                ikey = None  # the idempotency key the verdict was spooled under
                if key != last_key or since_ship >= self.cfg.heartbeat_every:
                    doc = verdict.to_dict()  # the JSON form, at the edges: spool, /verdict
                    doc[IDEMPOTENCY_KEY] = str(uuid.uuid4())
                    if self._spool(doc):
                        last_key, since_ship = key, 0  # else: tried again next cycle
                        ikey = doc[IDEMPOTENCY_KEY]
                    del doc
                # spooled, then printed: the line names the key only of a verdict that is
                # stored (a kill in between ships a verdict the log lacks, never the reverse)
                self._publish(verdict, ikey)
                sys.stdout.write(self._log_line(verdict, ikey))
                sys.stdout.flush()
                self._kube_report(verdict)
                self.ship(deadline=None)
                release_free_heap()
                self.last_cycle_end = time.monotonic()
                if self.stop.is_set() or (self.cfg.cycles and cycles >= self.cfg.cycles):
                    break
                # A cycle lasts one interval: the capture fills it. Without one
                # (--no-capture, or the capture is unavailable here and returned at
                # once) wait out the rest, or the node would be probed back to back.
                if self._wait(started):
                    break
            self.ship(deadline=time.monotonic() + self.cfg.grace)
        finally:
            signals.close()
            if self.kube is not None:
                self.kube.stop()
            if self.reporter is not None:
                self.reporter.close()
            if self._server:
                self._server.shutdown()
                self._server.server_close()
        log.info(f"stopped; {len(self.spool)} verdicts left in the spool {self.cfg.spool_dir}",
                 extra=logfmt.fields(spool_depth=len(self.spool)))
        return 0

    def _begin_cycle(self) -> float:
        with self._wake_lock:
            started = self.cycle_started = time.monotonic()
            self._kube_pending = False  # this cycle reads the API's objects
            self.wake.clear()
        return started

    def cycle(self) -> Verdict:
        t0 = time.monotonic()
        kube_seen = self.kube.version() if self.kube is not None else None
        self.reads.begin_cycle()
        snap = collect_live(ProbeContext(node_name=self.cfg.node_name,
                                         use_kube_api=self.cfg.use_kube_api,
                                         kubeconfig=self.cfg.kubeconfig,
                                         kube_cache=self.kube,
                                         cache=self.reads, background=True))
        if self.cfg.kube_json:
            snap = self._with_kube_json(snap, self.cfg.kube_json)
        snap = self._kube_as_read(snap)
        # the same snapshot as last cycle (its parts reused: ReadCache): the same facts,
        # and without a capture the same verdict, made again only in its time
        last = self._last if self._last is not None and same_node(self._last[0], snap) \
            else None
        self._last = None  # changed: the old facts go before the new ones are made
        # the capture and the diagnosis share the facts; no capture: the verdict is reused
        work = time.thread_time()  # (the capture's minutes below are not the diagnosis)
        if last is None:
            prepared: Prepared | None = prepare(snap)
        elif self.cfg.capture:
            prepared = last[1]
        else:
            prepared = None  # the same verdict, below
        t1 = time.monotonic()
        work = time.thread_time() - work
        capture = None
        if self.cfg.capture and prepared is not None:
            capture = watch_node(prepared, self.cfg.interval,
                                 port_range=self.cfg.nodeport_range, stop=self.wake)
        resumed = time.thread_time()
        if self.kube is not None and self.kube.version() != kube_seen and not self.reads.stale:
            # changed during the capture (which it ended): diagnose what the API says now
            snap = self._refresh_kube(snap)
            prepared = prepare(snap)
            last = None  # not the snapshot the last verdict was made of
        t2 = time.monotonic()
        if last is not None and not self.cfg.capture:  # the same verdict
            now = dt.datetime.now(dt.UTC)
            v = dataclasses.replace(last[2], time=now.isoformat(timespec="seconds")
                                    .replace("+00:00", "Z"))
        else:
            v = diagnose(snap, node_name(self.cfg.node_name, snap, dict(os.environ)),
                         capture=capture, prepared=prepared)
        # the facts are kept for the next capture only: without one they are memory
        self._last = (snap, prepared if self.cfg.capture else None, v)
        if last is None:  # a new snapshot, diagnosed in full: part of the reads' cost
            self.reads.charge(work + time.thread_time() - resumed)
        t3 = time.monotonic()
        for phase, secs in (("probes", t1 - t0), ("capture", t2 - t1), ("diagnose", t3 - t2)):
            self.metrics.probe_seconds.labels(phase).set(secs)
        self.metrics.verdict(v)
        self.metrics.reads(self.reads)
        return v

    # -- the log line and /verdict -------------------------------------------------------

    def _log_line(self, v: Verdict, ikey: str | None) -> str:
        """The summary line; the short form while the summary would be the same as the
        last full one, which is repeated every heartbeat_every cycles (a log query over
        that window always finds one; a rotated log starts over within it)."""
        key = logline.same_key(v)
        self._since_line += 1
        since = None
        if key == self._line_key and self._since_line < self.cfg.heartbeat_every:
            since = self._line_time
        else:
            self._line_key, self._line_time, self._since_line = key, v.time, 0
        return logline.summary_line(v, self._where(v, ikey), unchanged_since=since,
                                    fmt=self.cfg.log_format)

    def _where(self, v: Verdict, ikey: str | None) -> logline.Where:
        http = None
        if self.cfg.listen:
            host, port = split_listen(self.cfg.listen)
            if host in ("", "0.0.0.0", "::"):  # served on every address: this node's own
                host = "127.0.0.1"
            http = f"http://{f'[{host}]' if ':' in host else host}:{port}/verdict"
        collector = None
        if self.cfg.collector:
            collector = f"{self.cfg.collector.rstrip('/')}/v1/nodes/{quote(v.node, safe='')}"
        return logline.Where(http=http, collector=collector,
                             spool=str(Path(self.cfg.spool_dir).absolute()), key=ikey)

    def _publish(self, v: Verdict, ikey: str | None) -> None:
        with self._publish_lock:
            self._published, self._published_json = (v, ikey), None

    def verdict_json(self) -> bytes | None:
        """The last verdict's JSON as shipped (the summary: with its idempotency key when
        it was spooled), made once per verdict whatever the number of requests."""
        with self._publish_lock:
            if self._published is None:
                return None
            if self._published_json is None:
                v, ikey = self._published
                doc = v.to_dict()
                if ikey is not None:
                    doc[IDEMPOTENCY_KEY] = ikey
                self._published_json = json.dumps(doc, separators=(",", ":")).encode()
            return self._published_json

    def verdict_reply(self, path: str) -> tuple[bytes, str, int]:
        """GET /verdict (the summary), /verdict?detail=all (every finding itemised, made
        per request: 20-40 MB at 10k Services), /verdict?lb_ip=IP (one address's
        findings in full)."""
        query = parse_qs(urlsplit(path).query, max_num_fields=4)
        detail, ip = query.get("detail", [""])[-1], query.get("lb_ip", [""])[-1]
        if detail not in ("", "summary", "all") or set(query) - {"detail", "lb_ip"}:
            return (b"the query takes detail=summary|all or lb_ip=IP\n", "text/plain", 400)
        with self._publish_lock:
            published = self._published
        if published is None:
            return b"no verdict yet\n", "text/plain", 503
        v = published[0]
        if ip:
            try:
                ip = str(ipaddress.ip_address(ip.strip("[]")))
            except ValueError:
                return b"lb_ip: not an IP address\n", "text/plain", 400
            if ip not in {r.ip for r in v.lb_ips} | {f.lb_ip for f in v.findings}:
                return b"lb_ip: not an address this node knows\n", "text/plain", 404
            doc = v.for_lb_ip(ip).to_dict("lb_ip")
            return json.dumps(doc, separators=(",", ":")).encode(), "application/json", 200
        if detail == "all":
            return (json.dumps(v.to_dict("all"), separators=(",", ":")).encode(),
                    "application/json", 200)
        body = self.verdict_json()
        return (body, "application/json", 200) if body else (b"no verdict yet\n",
                                                             "text/plain", 503)

    # -- Services/Ingresses/Node by list+watch ----------------------------------------------

    def _start_kube(self) -> None:
        """Watch the API instead of reading it each cycle; without one (not configured,
        --no-kube-api, --kube-json) the probe says why, as before."""
        if not self.cfg.use_kube_api or self.cfg.kube_json:
            return
        try:
            self.kube = kube_api.start_informer(
                ProbeContext(node_name=self.cfg.node_name, kubeconfig=self.cfg.kubeconfig),
                on_change=self._kube_changed, watch_timeout=self.cfg.kube_watch_timeout)
        except kube_api.KubeUnavailable as e:
            log.warning(f"kubernetes API: {e}")
            return
        # the first verdict should know the Services: wait a little for the first LISTs
        self.kube.wait_synced(10.0)

    def _kube_report(self, v: Verdict) -> None:
        if not self.cfg.kube_report:
            return
        if self.reporter is None:
            from agent.kubereport import KubeReporter

            try:
                api = kube_api.api_client(ProbeContext(kubeconfig=self.cfg.kubeconfig))
            except kube_api.KubeUnavailable as e:
                log.warning(f"--kube-report: kubernetes API: {e}")
                return
            self.reporter = KubeReporter(api, v.node)
        for problem in self.reporter.report(v):
            log.warning(f"--kube-report: {problem}")

    def _kube_changed(self, what: str) -> None:
        """A change the diagnosis can see: diagnose now (ending the wait or the capture),
        but not sooner than kube_change_gap after the cycle began; not while a read of
        changed rules is put off (the verdict keeps the Services of the last read)."""
        if self.reads.stale:
            return
        with self._wake_lock:
            self._kube_pending = True
            self._wake_when_due()

    def _kube_timer_fired(self) -> None:
        with self._wake_lock:
            self._kube_timer = None
            # no wake when a cycle begun since took the change, or while a read is put
            # off (that verdict keeps the Services of the last read: the next read's
            # cycle takes the change)
            if self._kube_pending and not self.reads.stale:
                self._wake_when_due()

    def _wake_when_due(self) -> None:
        """Under _wake_lock: wake the loop now, or set one timer for a burst at the due
        time of the cycle under way (a timer set in an earlier cycle re-checks)."""
        due = self.cycle_started + self.cfg.kube_change_gap - time.monotonic()
        if due <= 0:
            self.wake.set()
        elif self._kube_timer is None:
            timer = threading.Timer(due, self._kube_timer_fired)
            timer.daemon = True
            try:
                timer.start()
            except RuntimeError:  # no thread to be had: diagnose now rather than never
                self.wake.set()
                return
            self._kube_timer = timer

    def _kube_as_read(self, snap: NodeSnapshot) -> NodeSnapshot:
        """``snap`` with the Services, Ingresses and Node of the last read of the rules
        while a changed source's read is put off (ReadCache.stale): the verdict is then
        the node as of that read, whole."""
        if not self.reads.stale or self._kube_at_read is None:
            # kept from a cycle that read the rules (the kube objects are taken first:
            # never newer than those rules), when the API answered
            if self.reads.cycle_reads and snap.services is not None:
                mine = tuple(u for u in snap.unknowns if u.source in _KUBE_SOURCES)
                self._kube_at_read = ({f: getattr(snap, f) for f in kube_api.FIELDS}, mine)
            return snap
        values, said = self._kube_at_read
        others = tuple(u for u in snap.unknowns if u.source not in _KUBE_SOURCES)
        return replace(snap, unknowns=others + said, **values)

    def _refresh_kube(self, snap: NodeSnapshot) -> NodeSnapshot:
        ctx = ProbeContext(node_name=self.cfg.node_name, kube_cache=self.kube)
        res = kube_api.PROBE.collect(ctx)
        values = dict(zip(kube_api.FIELDS, res.value, strict=True)) \
            if isinstance(res.value, tuple) else {}
        unknowns = tuple(u for u in snap.unknowns if u.source != kube_api.SOURCE)
        return replace(snap, unknowns=unknowns + res.unknowns, **values)

    def _wait(self, started: float) -> bool:
        """Wait out the interval, or less when woken; True when stopping."""
        self.wake.wait(max(0.0, started + self.cfg.interval - time.monotonic()))
        return self.stop.is_set()

    @staticmethod
    def _with_kube_json(snap: NodeSnapshot, directory: str) -> NodeSnapshot:
        """Services/Node/Ingresses from saved kubectl JSON, re-read every cycle (the
        files may be refreshed by a sidecar); unreadable: keep the live snapshot, say so."""
        try:
            return with_kube_json(snap, Path(directory))
        except Exception as e:  # a bad file must not stop the daemon
            log.warning(f"--kube-json {directory}: {getattr(e, 'message', e)}")
            return snap

    def _spool(self, doc: dict[str, Any]) -> bool:
        """Spool a verdict; False (logged, counted) when it could not be stored."""
        try:
            self.spool.put(doc)
            return True
        except (OSError, ValueError) as e:
            self.metrics.spool_write_failures.inc()
            log.error(f"verdict not spooled: {e}")
            return False

    def ship(self, deadline: float | None) -> None:
        """One drain pass (several until ``deadline`` when stopping), with backoff."""
        m = self.metrics
        while self.sender is not None and len(self.spool):
            now = time.monotonic()
            if deadline is None and now < self.next_ship:
                break
            res = drain(self.spool, self.sender)
            m.shipped.inc(res.sent)
            if res.held:
                log.warning(f"{res.held} verdicts kept in the spool: too large to send without "
                    f"gzip, which the collector does not take ({res.held_why}); they go "
                    "once it does (upgrade the collector)")
            if res.last is None:
                self.backoff.success()
                break
            m.ship_failures.inc()
            delay = self.backoff.next_delay(res.last.retry_after)
            self.next_ship = time.monotonic() + delay
            log.warning(f"shipping failed ({res.last.error}); retrying in {delay:.1f}s",
                        extra=logfmt.fields(retry_in_s=round(delay, 1)))
            if deadline is None or time.monotonic() + min(delay, 1.0) > deadline:
                break
            time.sleep(min(delay, 1.0, max(0.0, deadline - time.monotonic())))
        m.spool_depth.set(len(self.spool))
        m.spool_dropped.set(self.spool.dropped)
        m.spool_set_aside.set(self.spool.corrupt + self.spool.rejected)
        for problem in self.spool.take_problems():
            log.warning(problem)

    # -- /metrics and /healthz --------------------------------------------------------

    def healthy(self) -> tuple[bool, str]:
        # a cycle lasts one interval (the capture) plus probes: 3 intervals is stuck
        age = time.monotonic() - self.last_cycle_end
        if age > 3 * self.cfg.interval + 30:
            return False, f"no verdict for {age:.0f}s (interval {self.cfg.interval:.0f}s)"
        return True, "ok"

    def _serve(self, listen: str) -> None:
        host, port = split_listen(listen)
        daemon = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, ctype, code = (generate_latest(daemon.metrics.registry),
                                         CONTENT_TYPE_LATEST, 200)
                elif self.path == "/healthz":
                    ok, why = daemon.healthy()
                    body, ctype, code = why.encode() + b"\n", "text/plain", 200 if ok else 503
                elif self.path.split("?", 1)[0] == "/verdict":
                    # the full verdict is the node's whole state: to this node only (its
                    # own addresses, `kubectl port-forward`), not to whoever reaches :9808
                    if from_this_host(self.request, str(self.client_address[0])):
                        body, ctype, code = daemon.verdict_reply(self.path)
                    else:
                        body, ctype, code = (b"forbidden: from this node only\n",
                                             "text/plain", 403)
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        try:
            if host:
                self._server = BoundedHTTPServer((host, port), Handler)
            else:
                self._server = on_every_address(
                    lambda h: BoundedHTTPServer((h, port), Handler))
        except OSError as e:  # (in use, not this host's address, a name that resolves not)
            raise ListenError(f"cannot listen on {listen}: {e.strerror or e}") from e
        threading.Thread(target=self._server.serve_forever, daemon=True).start()


class ListenError(Exception):
    """--listen cannot be served (the command says so and exits 73, not as a bug)."""


def same_node(a: NodeSnapshot, b: NodeSnapshot) -> bool:
    """The same node for the verdict: equal snapshots, except that kube-proxy's metrics
    (their read time, each sync's timestamp) move on every read and count only by what
    they decide (agent.diagnose.rules.consistency.sync_state)."""
    if a.kube_proxy_sync == b.kube_proxy_sync:
        return a == b
    return sync_state(a.kube_proxy_sync) == sync_state(b.kube_proxy_sync) and \
        replace(a, kube_proxy_sync=None) == replace(b, kube_proxy_sync=None)


