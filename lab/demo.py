"""`make demo`: a real CLB loopback reproduced in network namespaces and diagnosed end to
end by the agent daemon, shipped to a collector, fixed with the remedy the verdict names.

Run as root: ``python -m lab.demo [--keep-open SECONDS] [--screenshot PATH]``.
``--help`` tells the story; the module docstring tells how it is built.

- Two lab clusters (``lab.clb.build_cluster``), built side by side: each has the
  node under diagnosis with a client pod, a second node, endpoint pods and a private CLB
  that does not SNAT. Node A runs TKE's IPVS kube-proxy that does not bind the LB IP
  (scenario ``tke-ipvs-etp-local``): the pod's connection to its own Service's LB IP
  goes out to the CLB and back to this node's NodePort (loop 1). Node B's kube-proxy binds
  the LB IP on kube-ipvs0 (``ipvs-lb-bound``): the CLB's health checks from its VIP are
  martians there (loop 2). One node cannot show both: whether the VIP is bound decides
  which loop happens, which is the whole story of PROBLEM.md.
- The collector runs as a real process on the root namespace's 127.0.0.1 (listening
  changes nothing there). Each node namespace gets a listener on its own 127.0.0.1:PORT,
  created by a thread that setns()es into it; every connection is relayed to the
  collector by this process. No link, route or address is added to the root namespace.
- The agent daemons (``loopback-agent run``) run inside the node namespaces with capture
  on, while threads drive real connections: the client pod to LB_IP:80 and the CLB's
  health checks to the NodePort.
- The remedy both verdicts name (TKE's prevent-loopback annotation with a kube-proxy that
  supports it) is applied in the lab: the Service annotated in the saved kubectl JSON,
  kube-proxy's state regenerated with the VIP bound, the CLB health-checking from
  100.64.0.2. Then the verdicts must turn healthy.
- Everything (processes, namespaces, the temp dir) is torn down on exit, on error, on
  Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from agent.diagnose.model import Verdict
from agent.diagnose.remedies import PREVENT_LOOPBACK
from agent.report import render
from lab.clb import Cluster, build_cluster, healthcheck, pod_connect
from lab.kube_proxy_rules import LbService
from lab.node import IPVS_KIND_ENV, IPVS_STANDIN_TABLE, STANDIN, ipvs_standin_nft
from lab.scenarios import HEALTH_CHECK_SOURCE, SCENARIOS, Scenario

EXIT_OK = 0
EXIT_STORY = 1  # the lab did not behave as the story expects (message says what)
EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69  # a tool the lab needs is missing
EXIT_NOPERM = 77  # not root (sysexits EX_NOPERM)
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

TOOLS = ("ip", "iptables-legacy-restore", "iptables-nft-restore", "ipset", "nft", "sysctl")

DESCRIPTION = """\
Reproduce CLB loopback in network namespaces and watch loopback-agent find it.

Builds two lab clusters side by side (a node with a client pod, a second node, endpoint
pods and a private CLB that does not SNAT), starts a collector on 127.0.0.1 and an agent
daemon (`loopback-agent run`, capture on) inside each lab node, and drives real traffic:

  node A  TKE's IPVS kube-proxy does not bind the LB IP: the client pod's connection to
          its own Service's LB IP goes out to the CLB, comes back to this node's NodePort
          with the pod's address and fails          -> loopback-observed
  node B  kube-proxy binds the LB IP on kube-ipvs0: the CLB health-checks from its VIP,
          a local address on the node, so every check is dropped as martian source
                                                    -> healthcheck-dropped-local-source

It prints each node's report, the collector's fleet summary and the page URL, then
applies the remedy the verdicts name (the prevent-loopback annotation with a kube-proxy
that supports it: the VIP bound, CLB health checks from 100.64.0.0/10) in the lab only,
and shows both nodes turn healthy. Nothing in this machine's own network namespace is
changed (the collector only listens on its 127.0.0.1); everything is removed at the
end, also on error, Ctrl-C and SIGTERM. Takes about 30 seconds.
"""

EPILOG = """\
exit codes:
  0    the story went as expected: both loops seen, both nodes healthy after the remedy
  1    it did not (the message says which step, with the logs)
  64   usage error
  69   a tool the lab needs is missing (make demo installs it)
  77   not root: network namespaces and iptables inside them need root
  130  interrupted (Ctrl-C), 143 terminated (SIGTERM): everything was torn down
"""


class StoryError(Exception):
    """A step of the demo did not turn out as expected."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the same teardown runs as for Ctrl-C."""


_T0 = time.monotonic()


def say(msg: str) -> None:
    """A progress line with the elapsed time: the terminal is never silent for long."""
    print(f"[{time.monotonic() - _T0:5.1f}s] {msg}", flush=True)


# --- relaying the node namespaces' 127.0.0.1:PORT to the collector ---------------------

_CLONE_NEWNET = 0x40000000


def listen_in_netns(ns_name: str, port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:``port`` inside network namespace ``ns_name``.

    setns() changes only the calling thread's namespace, so a throwaway thread enters the
    namespace, creates the socket (a socket stays in the namespace it was made in) and
    ends: no thread of this process is left in the lab namespace."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{ns_name}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns_name}): {os.strerror(err)}")
            finally:
                os.close(fd)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(64)
            box["sock"] = s
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=work, name=f"setns-{ns_name}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["sock"]


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until both sides have closed (half-close passed on)."""
    peer = {a: b, b: a}
    reading = [a, b]
    try:
        while reading:
            ready, _, _ = select.select(reading, [], [], 60)
            if not ready:
                return  # idle for a minute: the agent's HTTP client has given up
            for s in ready:
                data = s.recv(65536)
                if data:
                    peer[s].sendall(data)
                else:
                    reading.remove(s)
                    with contextlib.suppress(OSError):
                        peer[s].shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        a.close()
        b.close()


@contextmanager
def forward(ns_name: str, port: int, target: tuple[str, int]) -> Iterator[None]:
    """127.0.0.1:``port`` inside ``ns_name`` relayed to ``target`` in the root namespace."""
    listener = listen_in_netns(ns_name, port)
    stop = threading.Event()

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the demo is ending
            try:
                up = socket.create_connection(target, timeout=5)
                up.settimeout(None)
            except OSError:
                conn.close()  # collector gone: the agent retries and spools
                continue
            threading.Thread(target=_relay, args=(conn, up), daemon=True).start()

    t = threading.Thread(target=accept_loop, name=f"forward-{ns_name}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        listener.close()
        t.join(timeout=5)


# --- processes -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], timeout: float = 15) -> None:
    """SIGTERM the process's session (each child here leads its own), SIGKILL if needed."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    # whatever is left in its session (chromium's helpers, a stuck child)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


def http_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@contextmanager
def collector(tmp: Path, port: int) -> Iterator[str]:
    """``loopback-agent collector`` on the root namespace's 127.0.0.1:``port``."""
    log = tmp / "collector.log"
    cmd = [sys.executable, "-m", "agent", "collector", "--listen", f"127.0.0.1:{port}",
           "--db", f"sqlite://{tmp / 'collector.db'}"]
    say(f"collector: loopback-agent {' '.join(cmd[3:])}")
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise StoryError("the collector did not start:\n"
                                     + log.read_text()[-2000:]) from None
                time.sleep(0.1)
        yield url
    finally:
        stop_process(proc)


# --- the lab nodes -------------------------------------------------------------------


@dataclasses.dataclass
class DemoNode:
    """One lab cluster and the agent daemon on its node under diagnosis."""

    label: str  # "A" / "B"
    name: str  # the agent's --node-name
    story: str  # one line: what this node shows
    expect: frozenset[str]  # finding ids that show the loop
    cluster: Cluster
    scenario: Scenario  # its current scenario (the remedy changes it)
    hc_source: str = ""  # where the CLB's health checks come from
    daemon: subprocess.Popen[str] | None = None
    verdicts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    log: Path | None = None

    @property
    def svc(self) -> LbService:
        return next(s for s in self.scenario.services if s.lb_ip and s.node_port)


def start_daemon(n: DemoNode, url: str, tmp: Path, interval: float) -> None:
    """``loopback-agent run`` inside the node's namespace; its log lines are read by a
    thread (every cycle's verdict is shipped and summarised in full: --heartbeat-every 1;
    a lab node's few findings all fit in a line)."""
    n.log = tmp / f"agent-{n.label}.log"
    args = ["run", "--collector", url, "--spool", str(tmp / f"spool-{n.label}"),
            "--interval", f"{interval:g}", "--heartbeat-every", "1", "--listen", "",
            "--kube-json", str(n.cluster.lab.kube_dir), "--node-name", n.name]
    say(f"node {n.label}: agent daemon inside netns {n.cluster.node.name}: "
        f"loopback-agent {' '.join(a if a else repr(a) for a in args)}")
    with n.log.open("w") as err:
        n.daemon = n.cluster.node.popen([sys.executable, "-m", "agent", *args],
                                        stdout=subprocess.PIPE, stderr=err,
                                        start_new_session=True)

    def read(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with proc.stdout:  # EOF when the daemon exits
            for line in proc.stdout:
                with contextlib.suppress(ValueError):
                    v = json.loads(line)
                    with n.cond:
                        n.verdicts.append(v)
                        n.cond.notify_all()
        with n.cond:
            n.cond.notify_all()

    threading.Thread(target=read, args=(n.daemon,), daemon=True).start()


def first_verdicts(nodes: list[DemoNode], indices: Callable[[DemoNode], range],
                   timeout: float, tick: Callable[[], None],
                   wanted: Callable[[DemoNode, dict[str, Any]], bool],
                   failure: Callable[[DemoNode, dict[str, Any]], str],
                   ) -> dict[str, dict[str, Any]]:
    """Per node, the first of its verdicts at ``indices`` that is ``wanted``, each one
    printed as it comes; StoryError with ``failure`` when none is."""
    found: dict[str, dict[str, Any]] = {}
    for n in nodes:
        for i in indices(n):
            v = wait_verdict(n, i, timeout, tick)
            say(f"node {n.label}: verdict #{i + 1}: {v['status']} [{', '.join(ids(v))}]")
            if wanted(n, v):
                found[n.label] = v
                break
        else:
            raise StoryError(f"node {n.label}: {failure(n, v)}")
    return found


def wait_verdict(n: DemoNode, index: int, timeout: float,
                 tick: Callable[[], None]) -> dict[str, Any]:
    """The daemon's ``index``-th verdict (0-based), waiting for it; ``tick`` runs about
    every second meanwhile (progress lines)."""
    deadline = time.monotonic() + timeout
    while True:
        with n.cond:
            if len(n.verdicts) > index:
                return n.verdicts[index]
            if n.daemon is not None and n.daemon.poll() is not None:
                raise StoryError(f"node {n.label}: the agent daemon exited "
                                 f"{n.daemon.returncode}")
            if time.monotonic() > deadline:
                raise StoryError(f"node {n.label}: no verdict #{index + 1} within "
                                 f"{timeout:.0f}s")
            n.cond.wait(timeout=1)
        tick()


class Traffic:
    """A thread driving real connections in one cluster: the client pod to the Service's
    LB IP, and the CLB's TCP health check to the node's NodePort."""

    def __init__(self, n: DemoNode) -> None:
        self.n = n
        self.stop = threading.Event()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"traffic-{n.label}",
                                       daemon=True)

    def _run(self) -> None:
        c = self.n.cluster
        while not self.stop.is_set():
            svc = self.n.svc
            drives: list[tuple[str, Callable[[], Any]]] = [
                ("pod", lambda s=svc: pod_connect(c, s.lb_ip, s.port, timeout=0.5)),
                ("hc", lambda s=svc: healthcheck(c, c.scenario.node_ip, s.node_port,
                                                 timeout=0.5, source=self.n.hc_source)),
            ]
            for kind, drive in drives:
                try:
                    outcome = drive().outcome
                except Exception:
                    if self.stop.is_set():
                        return  # the lab is being torn down under us
                    outcome = "error"
                with self.lock:
                    self.counts[(kind, outcome)] += 1
            self.stop.wait(0.25)

    def take(self) -> str:
        """What happened since the last call, as one short phrase."""
        with self.lock:
            counts, self.counts = self.counts, Counter()
        svc = self.n.svc

        def part(kind: str, what: str) -> str:
            total = sum(v for (k, _), v in counts.items() if k == kind)
            ok = counts[(kind, "connected")]
            bad = ", ".join(f"{v} {o}" for (k, o), v in sorted(counts.items())
                            if k == kind and o != "connected")
            return f"{what} {ok}/{total} ok" + (f" ({bad})" if bad else "")

        return (part("pod", f"pod->{svc.lb_ip}:{svc.port}") + "; "
                + part("hc", f"health checks from {self.n.hc_source}"))


# --- the remedy, modelled in the lab ---------------------------------------------------


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # the daemon never reads a half-written file


def reconfigure(n: DemoNode, new: Scenario, backend: str) -> list[str]:
    """Bring node ``n``'s kube-proxy state and saved kubectl JSON from its scenario to
    ``new`` (what kube-proxy and the API server would do); returns what changed."""
    old, node, changes = n.scenario, n.cluster.node, []
    kube_dir = n.cluster.lab.kube_dir
    for name, text in new.kube_files().items():
        if (kube_dir / name).read_text() != text:
            _atomic_write(kube_dir / name, text)
            changes.append(f"{name} rewritten (what the API server now returns)")
    o_state, n_state = old.ipvs_state(), new.ipvs_state()
    if o_state and n_state and o_state.ipset_restore != n_state.ipset_restore:
        old_members = {ln for ln in o_state.ipset_restore.splitlines() if ln.startswith("add ")}
        new_members = {ln for ln in n_state.ipset_restore.splitlines() if ln.startswith("add ")}
        sets = [ln.split()[1] for ln in n_state.ipset_restore.splitlines()
                if ln.startswith("create ")]
        node.run("ipset", "restore", "-exist",
                 input="".join(f"flush {s}\n" for s in sets) + n_state.ipset_restore)
        changes += [f"ipset {ln.split()[1]} + {ln.split()[2]}"
                    for ln in sorted(new_members - old_members)]
        changes += [f"ipset {ln.split()[1]} - {ln.split()[2]}"
                    for ln in sorted(old_members - new_members)]
    if old.iptables_restore() != new.iptables_restore():
        node.run(f"iptables-{backend}-restore", input=new.iptables_restore())
        changes.append(f"kube-proxy's nat/filter rules restored (iptables-{backend})")
    before, after = set(old.kube_ipvs0_addresses()), set(new.kube_ipvs0_addresses())
    for a in sorted(after - before):
        node.run("ip", "address", "add", f"{a}/32", "dev", "kube-ipvs0")
        changes.append(f"kube-ipvs0: {a}/32 bound (now in table local)")
    for a in sorted(before - after):
        node.run("ip", "address", "del", f"{a}/32", "dev", "kube-ipvs0")
        changes.append(f"kube-ipvs0: {a}/32 removed")
    o_vs = ipvs_standin_nft(o_state.ipvsadm_save) if o_state else ""
    n_vs = ipvs_standin_nft(n_state.ipvsadm_save) if n_state else ""
    if o_vs != n_vs:  # one nft transaction: drop the old stand-in, load the new one
        node.run("nft", "-f", "-", input=f"table ip {IPVS_STANDIN_TABLE}\n"
                 f"delete table ip {IPVS_STANDIN_TABLE}\n{n_vs}")
        changes.append("IPVS virtual servers regenerated")
    n.scenario = new
    return changes


def apply_prevent_loopback(n: DemoNode, backend: str) -> list[str]:
    """TKE's remedy: the Service annotated with prevent-loopback, a kube-proxy that
    supports it (binds the VIP on kube-ipvs0 again), CLB health checks from 100.64/10."""
    services = tuple(
        dataclasses.replace(s, annotations={**s.annotations, PREVENT_LOOPBACK: "true"})
        if s.lb_ip else s for s in n.scenario.services)
    changes = [f"Service {s.namespace}/{s.name}: annotation {PREVENT_LOOPBACK}: \"true\""
               for s in services if s.lb_ip]
    if not n.scenario.bind_lb_ip:
        changes.append("kube-proxy replaced by one that honours the annotation: it binds "
                       "the LB IP on kube-ipvs0 again")
    changes += reconfigure(
        n, dataclasses.replace(n.scenario, services=services, bind_lb_ip=True), backend)
    changes.append(f"CLB: health checks now come from {HEALTH_CHECK_SOURCE} (100.64.0.0/10) "
                   f"instead of its VIP {n.hc_source}")
    n.hc_source = HEALTH_CHECK_SOURCE
    return changes


# --- output --------------------------------------------------------------------------


def fleet_summary(url: str) -> str:
    """The collector's views as two short tables."""
    nodes = http_json(url + "/v1/nodes")
    services = http_json(url + "/v1/services")
    w = max([len("NODE"), *(len(r["node"]) for r in nodes)])
    out = [f"Fleet (GET {url}/v1/nodes):",
           f"  {'NODE':<{w}}  {'STATUS':<9} {'MODE':<5} FINDINGS (warning and worse)"]
    out += [f"  {r['node']:<{w}}  {r['status']:<9} {r['kube_proxy_mode']:<5} "
            f"{', '.join(r['ids']) or '-'}" for r in nodes]
    out.append(f"Services (GET {url}/v1/services):")
    for r in services:
        out.append(f"  {r['service'] or '?'} {r['lb_ip'] or ''}: loop observed on "
                   f"{len(r['observed_nodes'])} node(s), exposed on {len(r['exposed_nodes'])}")
        out += textwrap.wrap(", ".join(r["ids"]), width=96, initial_indent="    findings: ",
                             subsequent_indent="      ", break_on_hyphens=False,
                             break_long_words=False)
        if r["observed_nodes"]:
            out.append(f"    observed on: {', '.join(r['observed_nodes'])}")
    if not services:
        out.append("  no Service is exposed or looping on any node")
    return "\n".join(out)


def ids(v: dict[str, Any], *, serious: bool = False) -> list[str]:
    return sorted({f["id"] for f in v["findings"] if not serious or f["severity"] != "info"})


def screenshot(url: str, path: Path, tmp: Path) -> None:
    """A PNG of the collector page from headless Chromium (Debian's)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        raise StoryError("--screenshot needs chromium (make demo installs it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp / 'chromium'}", "--hide-scrollbars",
           "--window-size=1280,900", f"--screenshot={path.resolve()}", url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    finally:
        stop_process(proc, timeout=1)
    if not path.exists() or path.stat().st_size < 10_000:
        raise StoryError(f"chromium did not write a screenshot to {path}")
    say(f"screenshot of the page written to {path}")


def _tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join("    " + ln for ln in path.read_text().splitlines()[-lines:])


# --- the story -----------------------------------------------------------------------


def story(args: argparse.Namespace, stack: ExitStack, tmp: Path) -> None:
    interval = args.interval
    cycle_timeout = interval * 3 + 30  # a cycle is one interval plus probes and shipping
    port = free_port()
    url = stack.enter_context(collector(tmp, port))

    plan = [
        ("A", "tke-ipvs-etp-local", "nft",
         "TKE's IPVS kube-proxy, LB IP not bound, eTP=Local: a pod reaching its own Service "
         "through the CLB loops back here", frozenset({"loopback-observed",
                                                      "pod-to-lb-not-masqueraded"})),
        ("B", "ipvs-lb-bound", "legacy",
         "kube-proxy binds the LB IP on kube-ipvs0: the CLB's health checks from its VIP "
         "are martians here", frozenset({"healthcheck-dropped-local-source",
                                         "lb-ip-local"})),
    ]
    nodes: list[DemoNode] = []
    for label, sc_name, backend, what, expect in plan:
        t = time.monotonic()
        say(f"node {label}: building lab cluster {sc_name!r} (iptables-{backend}): node, "
            "client pod, second node, endpoint pods, CLB ...")
        cluster = stack.enter_context(build_cluster(SCENARIOS[sc_name], backend))
        n = DemoNode(label=label, name=f"node-{label.lower()}.{sc_name}", story=what,
                     expect=expect, cluster=cluster, scenario=cluster.scenario,
                     hc_source=cluster.clb.vips[0])
        nodes.append(n)
        say(f"node {label}: built in {time.monotonic() - t:.1f}s: "
            f"{len(cluster.namespaces())} namespaces, node netns {cluster.node.name}")
        say(f"node {label}: {what}")
    backends = {label: backend for label, _s, backend, _w, _e in plan}

    for n in nodes:
        stack.enter_context(forward(n.cluster.node.name, port, ("127.0.0.1", port)))
    say(f"relaying 127.0.0.1:{port} inside each lab node to the collector (a socket "
        "made in each namespace; no link into the root namespace)")

    traffic = {n.label: Traffic(n) for n in nodes}
    for tr in traffic.values():
        tr.thread.start()

    def stop_traffic() -> None:
        for tr in traffic.values():
            tr.stop.set()
        for tr in traffic.values():
            tr.thread.join(timeout=10)

    stack.callback(stop_traffic)
    svc = nodes[0].svc
    say(f"traffic: the client pod {nodes[0].scenario.client_pod_ip} -> {svc.lb_ip}:{svc.port} "
        f"(its own Service, through the CLB) and the CLB's health checks -> "
        f"{nodes[0].scenario.node_ip}:{svc.node_port}, on both nodes, continuously")

    for n in nodes:
        start_daemon(n, f"http://127.0.0.1:{port}", tmp, interval)
        stack.callback(_stop_daemon, n)

    last_tick = [time.monotonic()]

    def tick() -> None:
        if time.monotonic() - last_tick[0] >= 3:
            last_tick[0] = time.monotonic()
            say("traffic: " + " | ".join(f"{k}: {tr.take()}" for k, tr in traffic.items()))

    # -- act 1: the loops --------------------------------------------------------------
    say(f"waiting for the agents' verdicts (every {interval:g}s of capture) ...")
    # normally the first verdict; allow for a slow start
    looping = first_verdicts(
        nodes, lambda n: range(4), cycle_timeout, tick,
        lambda n, v: n.expect <= set(ids(v)) and v["status"] == "loopback",
        lambda n, v: f"expected {sorted(n.expect)} in the verdict, got {ids(v)}")
    stored = wait_collector(url, {n.name: looping[n.label] for n in nodes}, tick)

    for n in nodes:
        print(f"\n{'=' * 100}\nnode {n.label}: {n.name} -- {n.story}\n"
              f"(the verdict as the collector stored it, rendered by the agent's report)\n"
              f"{'=' * 100}")
        print(render(Verdict.from_dict(stored[n.name])), end="", flush=True)
    print()
    print(fleet_summary(url))
    print(f"\nFleet page: {url}/\n", flush=True)
    if args.screenshot:
        screenshot(url + "/", Path(args.screenshot), tmp)

    # -- act 2: the remedy -------------------------------------------------------------
    print("The remedy the verdicts name:", flush=True)
    for n in nodes:
        for f in stored[n.name]["findings"]:
            if f["severity"] != "info" and f.get("remedy"):
                print(f"  node {n.label} {f['id']}: {f['remedy']}")
    named = [n for n in nodes
             if any(PREVENT_LOOPBACK in (f.get("remedy") or "")
                    for f in stored[n.name]["findings"] if f["severity"] != "info")]
    if len(named) != len(nodes):
        missing = [n.label for n in nodes if n not in named]
        raise StoryError(f"node(s) {missing}: the verdict does not name the prevent-loopback "
                         "remedy, the only one this lab models")
    print("\nApplying it in the lab (the observed findings defer to these static ones; the "
          "Service DNS name that loopback-observed also suggests is not needed then).\n"
          "Modelled, not real: the 'kube-proxy that supports it' is kube-proxy's state "
          "regenerated with the VIP bound;\nthe CLB's health-check source is the lab CLB's "
          "(TKE switches it when the annotation is set).", flush=True)
    say("traffic before the change: "
        + " | ".join(f"{k}: {tr.take()}" for k, tr in traffic.items()))
    changed_at: dict[str, int] = {}
    for n in nodes:
        for change in apply_prevent_loopback(n, backends[n.label]):
            say(f"node {n.label}: {change}")
        with n.cond:  # counted once the change is complete
            changed_at[n.label] = len(n.verdicts)

    # The cycle running during the change mixes the old snapshot with new traffic: the
    # second verdict after the change is the first one wholly after it.
    healthy = first_verdicts(
        nodes, lambda n: range(changed_at[n.label] + 1, changed_at[n.label] + 4),
        cycle_timeout, tick, lambda n, v: v["status"] == "healthy",
        lambda n, v: f"still {v['status']} after the remedy: {ids(v, serious=True)}")
    stored = wait_collector(url, {n.name: healthy[n.label] for n in nodes}, tick)
    print()
    for n in nodes:
        v = stored[n.name]
        print(f"node {n.label}: {n.name}: {looping[n.label]['status']} -> {v['status']} "
              f"(notes: {', '.join(ids(v)) or 'none'})")
        print(render(Verdict.from_dict(v)).splitlines()[1])
    print(f"traffic now: {' | '.join(f'{k}: {tr.take()}' for k, tr in traffic.items())}")
    print()
    print(fleet_summary(url))
    print(f"\nFleet page: {url}/", flush=True)

    if args.keep_open > 0:
        say(f"keeping the collector and the lab up for {args.keep_open:g}s: open {url}/ "
            "(Ctrl-C ends it early and cleans up)")
        end = time.monotonic() + args.keep_open
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(10.0, left))
            if end - time.monotonic() > 0:
                say(f"{end - time.monotonic():.0f}s left; page at {url}/")


def wait_collector(url: str, want: dict[str, dict[str, Any]],
                   tick: Callable[[], None], timeout: float = 30) -> dict[str, dict[str, Any]]:
    """Poll the collector until each node's latest stored verdict is the one wanted (same
    time and status) or newer; returns the stored documents."""
    deadline = time.monotonic() + timeout
    while True:
        latest = {r["node"]: r for r in http_json(url + "/v1/nodes")}
        if all(name in latest and latest[name]["time"] >= v["time"]
               and latest[name]["status"] == v["status"] for name, v in want.items()):
            break
        if time.monotonic() > deadline:
            raise StoryError(f"the collector did not get the verdicts: {latest}")
        tick()
        time.sleep(0.3)
    say("collector: " + ", ".join(f"{name} {latest[name]['status']}" for name in want))
    return {name: http_json(f"{url}/v1/nodes/{name}")[0] for name in want}


def _stop_daemon(n: DemoNode) -> None:
    if n.daemon is not None:
        stop_process(n.daemon)  # SIGTERM: it finishes its verdict and ships what it can


# --- entry point ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.demo", description=DESCRIPTION,
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep-open", type=float, default=0, metavar="SECONDS",
                   help="after the story, keep the collector (and the lab) up this long so "
                        "the page can be looked at (default 0)")
    p.add_argument("--screenshot", metavar="PATH",
                   help="write a PNG of the collector page (headless Chromium) while both "
                        "nodes show their loop, before the remedy")
    p.add_argument("--interval", type=float, default=4.0, metavar="SECONDS",
                   help="the agent daemons' --interval: seconds of capture per verdict "
                        "(default 4)")
    return p


def preflight() -> tuple[int, str] | None:
    """Refuse before building anything: not root, or a tool missing."""
    if os.geteuid() != 0:
        return EXIT_NOPERM, (
            "the demo needs root: it creates network namespaces, veth pairs and bridges, "
            "and loads iptables, ipset and nft rules inside them (nothing in this machine's "
            "own network namespace is changed). Run it as root: sudo make demo")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return EXIT_UNAVAILABLE, (f"missing tools: {', '.join(missing)} (make demo installs "
                                  "iproute2, iptables, ipset, nftables, procps)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.interval < 1 or args.keep_open < 0:
        print("demo: --interval must be >= 1 and --keep-open >= 0", file=sys.stderr)
        return EXIT_USAGE
    refused = preflight()
    if refused:
        print(f"demo: {refused[1]}", file=sys.stderr)
        return refused[0]

    def on_term(signum: int, _frame: object) -> None:
        raise Interrupted()

    # SIGHUP too (an ssh session that drops): the children run in their own sessions
    # and would outlive the demo, in namespaces nobody removes
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    # The demo's remedy edits the IPVS stand-in; on a host whose kernel has IP_VS and
    # dummy loaded the lab would otherwise build real IPVS (lab/node.py)
    os.environ[IPVS_KIND_ENV] = STANDIN
    tmp = Path(tempfile.mkdtemp(prefix="lbdemo-"))
    code = EXIT_OK
    stack = ExitStack()
    try:
        with stack:
            stack.callback(shutil.rmtree, tmp, True)
            try:
                story(args, stack, tmp)
                say("the story went as expected: both loops seen, both nodes healthy after "
                    "the remedy")
            except Exception as e:  # Interrupted is a KeyboardInterrupt: not caught here
                code = EXIT_STORY
                what = e if isinstance(e, StoryError) else f"{type(e).__name__}: {e}"
                print(f"\ndemo: FAILED: {what}", file=sys.stderr)
                for log in sorted(tmp.glob("*.log")):
                    if log.stat().st_size:
                        print(f"  {log.name}:\n{_tail(log)}", file=sys.stderr)
            finally:
                # a second Ctrl-C must not cut the teardown short
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(s, lambda *_: print("demo: cleaning up, please wait",
                                                      file=sys.stderr, flush=True))
                say("tearing down: agents, traffic, relays, lab namespaces, collector, "
                    "temp files ...")
    except Interrupted:
        code = EXIT_SIGTERM
    except KeyboardInterrupt:
        code = EXIT_SIGINT
    if code in (EXIT_SIGINT, EXIT_SIGTERM):
        print("\ndemo: interrupted; everything was torn down", file=sys.stderr, flush=True)
    else:
        say(f"done in {time.monotonic() - _T0:.1f}s (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
