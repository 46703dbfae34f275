"""`kubectl loopback`: one-shot runs and the collector's views from a workstation.

    kubectl loopback check NODE [--capture 30s] [--json] [--image IMAGE] [-- AGENT ARGS]
    kubectl loopback nodes    [--collector URL] [--json]
    kubectl loopback services [--collector URL] [--json]

`check` starts a short-lived pod on NODE (the agent's image, the node's network and PID
namespaces, the DaemonSet's capabilities and read-only node mounts: ``check_pod``), streams
its report, exits with the agent's exit code (0 healthy, 1 at risk, 2 loopback, 3
unknown) and deletes the pod, also on Ctrl-C or SIGTERM. Where the agent is not installed
(no ServiceAccount loopback-agent in its namespace: the pod could not be created), the pod
is made by `kubectl debug node/NODE --profile=netadmin` instead (``debug_args``), and then
followed and deleted the same way. `nodes` and `services` read the
collector through `kubectl port-forward` (or --collector URL). Everything cluster-side is
done by the user's own `kubectl`, with their --kubeconfig, --context and -n/--namespace
(accepted anywhere on the line, as kubectl users type them after the plugin's name).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

# Standard library only, and nothing of the agent but its version and its terminal
# sanitiser (a leaf): the krew archive (plugins/build_krew.py) carries these files alone
# and runs them with the user's python3.
from agent import __version__
from agent.terminal import one_line

IMAGE = f"ghcr.io/loopback-agent/loopback-agent:{__version__}"  # the kustomize base's image
AGENT_NAMESPACE = "loopback-agent-node"  # the only namespace admitting the agent's pods
COLLECTOR_NAMESPACE = "loopback-agent"
COLLECTOR_SERVICE = "loopback-agent-collector"
COLLECTOR_PORT = 8080
SERVICE_ACCOUNT = "loopback-agent"  # its read-only RBAC: Services, Nodes, Ingresses
# Not installed: `kubectl debug node/NODE` with this profile (kubectl 1.27 or later): the
# node's network, PID and IPC namespaces, NET_ADMIN and NET_RAW (privileged up to 1.28)
DEBUG_PROFILE = "netadmin"

EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69  # the pod could not run, kubectl or the collector failed
EXIT_INTERRUPTED = 130

# waiting reasons that will not resolve by themselves: give up at once, say why
_HOPELESS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName",
             "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


class PluginError(Exception):
    def __init__(self, message: str, code: int = EXIT_UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


# -- kubectl, with the user's flags ---------------------------------------------------------

# kubectl's global flags this plugin passes through (each takes a value)
_PASSTHROUGH = {"--kubeconfig": "kubeconfig", "--context": "context", "-n": "namespace",
                "--namespace": "namespace"}


def split_kubectl_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """({'kubeconfig'|'context'|'namespace': value}, the rest), wherever the flags are
    (before or after the subcommand; ``--flag value`` and ``--flag=value``), up to a
    ``--`` after which everything is the agent's."""
    flags: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--":
            rest.append(arg)
            rest.extend(it)
            break
        name, eq, value = arg.partition("=")
        if name in _PASSTHROUGH:
            if not eq:
                value = next(it, None)  # type: ignore[assignment]
                if value is None:
                    raise PluginError(f"{name} needs a value", EXIT_USAGE)
            flags[_PASSTHROUGH[name]] = value
        elif arg.startswith("-n") and len(arg) > 2 and not arg.startswith("--"):
            flags["namespace"] = arg[2:]  # -nNAMESPACE, as kubectl takes it
        else:
            rest.append(arg)
    return flags, rest


@dataclass(frozen=True)
class Kubectl:
    kubeconfig: str | None = None
    context: str | None = None
    binary: str = "kubectl"

    def argv(self, namespace: str | None, *args: str) -> list[str]:
        out = [self.binary]
        if self.kubeconfig:
            out.append(f"--kubeconfig={self.kubeconfig}")
        if self.context:
            out.append(f"--context={self.context}")
        if namespace:
            out.append(f"--namespace={namespace}")
        return [*out, *args]

    def run(self, namespace: str | None, *args: str, stdin: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(self.argv(namespace, *args), input=stdin, text=True,
                                  capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise PluginError(f"kubectl {args[0]}: no answer in {timeout:.0f}s") from e

    def checked(self, namespace: str | None, *args: str, stdin: str | None = None,
                timeout: float = 60) -> str:
        proc = self.run(namespace, *args, stdin=stdin, timeout=timeout)
        if proc.returncode != 0:
            raise PluginError(f"kubectl {' '.join(args[:2])}: "
                              f"{(proc.stderr or proc.stdout).strip() or proc.returncode}")
        return proc.stdout


def find_kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise PluginError("kubectl not found on PATH")
    return found


# -- check: the one-shot pod ------------------------------------------------------------------


def pod_name(node: str) -> str:
    """loopback-check-NODE-xxxxx, a valid (DNS-1123) pod name whatever the node's name."""
    stem = re.sub(r"[^a-z0-9-]+", "-", node.lower()).strip("-")[:40].strip("-") or "node"
    return f"loopback-check-{stem}-{secrets.token_hex(3)}"


def check_pod(node: str, name: str, *, image: str = IMAGE, namespace: str = AGENT_NAMESPACE,
              agent_args: Sequence[str] = (), deadline: int = 900) -> dict[str, Any]:
    """The pod `check` runs: the DaemonSet's view of the node (host network and PID,
    root with NET_ADMIN and NET_RAW only, read-only root filesystem, the read-only
    tracefs mount) and its service account (the API reads), without what only a shipping
    agent needs (the spool, the collector's tokens). tests/test_kubectl_plugin.py holds it
    against the rendered DaemonSet."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            # not the DaemonSet's component label: its controller would adopt the pod
            "labels": {"app.kubernetes.io/name": "loopback-agent",
                       "app.kubernetes.io/component": "check"},
        },
        "spec": {
            "nodeName": node,  # no scheduling: this node, whatever its taints say
            "tolerations": [{"operator": "Exists"}],
            "restartPolicy": "Never",
            "activeDeadlineSeconds": deadline,  # an orphan (the plugin killed -9) ends
            "terminationGracePeriodSeconds": 5,
            "serviceAccountName": SERVICE_ACCOUNT,
            "hostNetwork": True,
            "dnsPolicy": "ClusterFirstWithHostNet",
            "hostPID": True,
            "containers": [{
                "name": "agent",
                "image": image,
                "args": ["check", *agent_args],
                "env": [{"name": "NODE_NAME",
                         "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                "resources": {"requests": {"cpu": "20m", "memory": "64Mi"},
                              "limits": {"cpu": "1", "memory": "768Mi"}},
                "securityContext": {
                    "runAsUser": 0,
                    "runAsNonRoot": False,
                    "privileged": False,
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "seccompProfile": {"type": "RuntimeDefault"},
                    "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]},
                },
                "volumeMounts": [
                    {"name": "tracefs", "mountPath": "/sys/kernel/tracing", "readOnly": True},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }],
            "volumes": [
                {"name": "tracefs", "hostPath": {"path": "/sys/kernel/tracing", "type": ""}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
            ],
        },
    }


def _container_state(pod: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """('waiting'|'running'|'terminated'|'', its details) of the agent container."""
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        if cs.get("name") == "agent":
            for state, detail in (cs.get("state") or {}).items():
                return state, detail or {}
    return "", {}


def agent_installed(k: Kubectl, namespace: str) -> bool | None:
    """Whether the ServiceAccount the check pod runs as is in ``namespace``: False when it
    is not (the agent is not installed there, or the namespace does not exist: either way
    the pod could not be created), None when kubectl cannot tell (no right to read
    ServiceAccounts, no answer): then the pod is tried, and its own error says why."""
    try:
        proc = k.run(namespace, "get", "serviceaccount", SERVICE_ACCOUNT,
                     "--ignore-not-found", "-o", "name", timeout=30)
    except PluginError:
        return None
    if proc.returncode != 0:
        return None
    return bool(proc.stdout.strip())


def debug_args(node: str, image: str, agent_args: Sequence[str]) -> list[str]:
    """`kubectl debug`'s arguments for the pod `check` runs where the agent is not
    installed: on NODE, in the node's network, PID and IPC namespaces with NET_ADMIN and
    NET_RAW (the netadmin profile), the agent's image, the container named as
    ``check_pod``'s (so it is followed the same way), not attached (the plugin follows its
    log from the start and reads the exit code, which an attach does not give)."""
    return ["debug", f"node/{node}", f"--profile={DEBUG_PROFILE}", f"--image={image}",
            "--container=agent", f"--env=NODE_NAME={node}", "--attach=false",
            "--", "loopback-agent", "check", *agent_args]


# what `kubectl debug node/...` prints before it creates the pod (the name is kubectl's:
# node-debugger-NODE-xxxxx; there is no flag to choose it)
_DEBUG_POD = re.compile(r"^Creating debugging pod (\S+) with container ", re.M)


class CheckRun:
    def __init__(self, kubectl: Kubectl, namespace: str | None, name: str,
                 poll: float = 1.0) -> None:
        self.k, self.ns, self.name, self.poll = kubectl, namespace, name, poll
        self.created = False

    def where(self) -> str:
        """The pod as the user would name it (kubectl's current namespace if ns is None)."""
        return f"{self.ns}/{self.name}" if self.ns else self.name

    def delete_hint(self) -> str:
        ns = f" -n {self.ns}" if self.ns else ""
        return f"kubectl{ns} delete pod {self.name}"

    def get(self) -> dict[str, Any]:
        out = self.k.checked(self.ns, "get", "pod", self.name, "-o", "json")
        try:
            return json.loads(out)
        except (ValueError, RecursionError) as e:
            raise PluginError(f"kubectl get pod {self.name}: not JSON ({e})") from e

    def create(self, pod: dict[str, Any]) -> None:
        # before the call: interrupted or timed out while kubectl waits for the answer,
        # the pod may exist already (the delete tolerates one that does not)
        self.created = True
        self.k.checked(self.ns, "create", "-f", "-", stdin=json.dumps(pod))

    def create_by_debug(self, node: str, image: str, agent_args: Sequence[str],
                        timeout: float = 60) -> None:
        """The pod made by `kubectl debug node/NODE` (``debug_args``); its name is the one
        kubectl prints. kubectl's output goes to files, so whatever ends the call (its
        exit, a timeout, Ctrl-C), what it said is read, and a pod it named is deleted."""
        cmd = self.k.argv(self.ns, *debug_args(node, image, agent_args))
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise PluginError(f"kubectl debug: no answer in {timeout:.0f}s") from None
            finally:
                _stop(proc)
                out.seek(0)
                m = _DEBUG_POD.search(out.read(64 * 1024).decode(errors="replace"))
                if m:  # said before the create: the pod may exist (the delete tolerates not)
                    self.name, self.created = m.group(1), True
            if proc.returncode != 0:
                err.seek(0)
                said = err.read(64 * 1024).decode(errors="replace").strip()
                raise PluginError(
                    f"kubectl debug node/{node} failed: {said or proc.returncode} (it needs "
                    f"kubectl 1.27 or later for --profile={DEBUG_PROFILE}, and a namespace "
                    "that admits privileged pods: -n NAMESPACE chooses it)")
        if not self.created:
            raise PluginError(f"kubectl debug node/{node} did not say which pod it created: "
                              "find it with kubectl get pods -l "
                              "app.kubernetes.io/managed-by=kubectl-debug and delete it")

    def wait_started(self, timeout: float) -> None:
        """Until the container runs or has run; a hopeless wait fails at once."""
        end = time.monotonic() + timeout
        while True:
            pod = self.get()
            state, detail = _container_state(pod)
            if state in ("running", "terminated"):
                return
            reason = detail.get("reason", "")
            if reason in _HOPELESS:
                raise PluginError(f"pod {self.name}: {reason}: {detail.get('message', '')}"
                                  .rstrip(": "))
            if pod.get("status", {}).get("phase") == "Failed":
                raise PluginError(f"pod {self.name} failed: "
                                  f"{pod['status'].get('reason', '')} "
                                  f"{pod['status'].get('message', '')}".strip())
            if time.monotonic() > end:
                why = reason or pod.get("status", {}).get("phase", "no status")
                raise PluginError(f"pod {self.name} did not start in {timeout:.0f}s ({why})")
            time.sleep(self.poll)

    def stream_logs(self) -> None:
        """The report, as the agent prints it, until the container exits."""
        cmd = self.k.argv(self.ns, "logs", "--follow", f"pod/{self.name}", "-c", "agent")
        sys.stdout.flush()
        proc = subprocess.Popen(cmd)  # our stdout and stderr: the report as it comes
        try:
            proc.wait()
        finally:  # interrupted: a SIGTERM reached only us, not kubectl
            _stop(proc)

    def exit_code(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while True:
            state, detail = _container_state(self.get())
            if state == "terminated" and isinstance(detail.get("exitCode"), int):
                return int(detail["exitCode"])
            if time.monotonic() > end:
                raise PluginError(f"pod {self.name}: no exit code after {timeout:.0f}s")
            time.sleep(self.poll)

    def delete(self) -> None:
        if self.created:
            self.k.run(self.ns, "delete", "pod", self.name, "--ignore-not-found",
                       "--wait=false", timeout=30)
            self.created = False


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def _interrupts() -> Iterator[None]:
    """SIGTERM (and SIGHUP) end the run like Ctrl-C: the pod is still deleted."""
    def raise_interrupt(signum: int, frame: object) -> NoReturn:
        raise KeyboardInterrupt

    old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def cmd_check(k: Kubectl, namespace: str | None, args: argparse.Namespace) -> int:
    ns = namespace or AGENT_NAMESPACE
    agent_args: list[str] = []
    if args.capture:
        agent_args += ["--capture", args.capture]
    if args.json:
        agent_args.append("--json")
    if args.verbose:
        agent_args.append("--verbose")
    agent_args += args.agent_args
    seconds = _duration(args.capture) if args.capture else 0.0
    if agent_installed(k, ns) is False:
        # no ServiceAccount (nor, often, namespace) to run the pod as: kubectl debug's
        # pod, in kubectl's current namespace or -n's
        print(f"kubectl-loopback: loopback-agent is not installed (no ServiceAccount "
              f"{SERVICE_ACCOUNT} in namespace {ns}): running the check in a `kubectl "
              f"debug node/{args.node} --profile={DEBUG_PROFILE}` pod instead; it reads "
              "no Services, Node or Ingresses unless its namespace's default "
              "ServiceAccount may (see --help)", file=sys.stderr)
        run = CheckRun(k, namespace, "", poll=args.poll)
        return _follow(run, args, seconds, lambda: run.create_by_debug(
            args.node, args.image, agent_args))
    name = pod_name(args.node)
    run = CheckRun(k, ns, name, poll=args.poll)
    return _follow(run, args, seconds, lambda: run.create(check_pod(
        args.node, name, image=args.image, namespace=ns, agent_args=agent_args,
        deadline=int(args.start_timeout + seconds + 600))))


def _follow(run: CheckRun, args: argparse.Namespace, seconds: float,
            create: Callable[[], None]) -> int:
    """Create the pod, stream its report, return the agent's exit code; the pod is
    deleted whatever happens (Ctrl-C and SIGTERM too)."""
    with _interrupts():
        try:
            create()
            print(f"kubectl-loopback: pod {run.where()} on node {args.node}",
                  file=sys.stderr)
            run.wait_started(args.start_timeout)
            run.stream_logs()
            # the log stream can end before the container does (a kubelet or API server
            # restart): wait for the exit as long as the run could still take
            return run.exit_code(timeout=seconds + 120)
        except KeyboardInterrupt:
            if run.created:
                print(f"kubectl-loopback: interrupted; deleting pod {run.where()}",
                      file=sys.stderr)
            else:
                print("kubectl-loopback: interrupted before a pod was named",
                      file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            try:
                run.delete()
            except (PluginError, KeyboardInterrupt):
                print(f"kubectl-loopback: pod {run.where()} may be left: delete it with "
                      f"{run.delete_hint()}", file=sys.stderr)


# -- nodes, services: the collector -----------------------------------------------------------


@contextmanager
def collector_url(k: Kubectl, namespace: str | None, url: str | None,
                  timeout: float = 30) -> Iterator[str]:
    """--collector URL as given, or a `kubectl port-forward` to the collector's Service
    on a free local port (stopped afterwards)."""
    if url:
        yield url.rstrip("/")
        return
    ns = namespace or COLLECTOR_NAMESPACE
    cmd = k.argv(ns, "port-forward", "--address=127.0.0.1", f"svc/{COLLECTOR_SERVICE}",
                 f":{COLLECTOR_PORT}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = _forwarded_port(proc, timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _forwarded_port(proc: subprocess.Popen[str], timeout: float) -> int:
    """The local port from 'Forwarding from 127.0.0.1:PORT -> 8080'."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    seen: list[str] = []
    exited = False
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:  # kubectl is exiting: its error is on stderr
            exited = True
            break
        seen.append(line.strip())
        m = re.search(r"Forwarding from 127\.0\.0\.1:(\d+) ->", line)
        if m:
            return int(m.group(1))
    err = ""
    if exited or proc.poll() is not None:
        # stdout closed comes before the exit: wait for it, then read what kubectl said
        # (its stderr read before it had exited was empty: "no port" 8 times in 10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if proc.stderr is not None and proc.poll() is not None:
            err = proc.stderr.read(64 * 1024)
    why = (err or " ".join(seen)).strip() or (
        f"kubectl exited ({proc.returncode}) without a word" if exited
        else f"no port within {timeout:.0f} s")
    raise PluginError(f"kubectl port-forward to the collector failed: {why}")


MAX_REPLY = 64 * 1024 * 1024  # a page of 5,000 nodes is far less


def fetch_list(url: str, path: str, limit: int, ca_file: str | None) -> tuple[list[Any], int]:
    """One page of a collector list and its X-Total-Count."""
    import ssl
    import urllib.error
    import urllib.request

    ctx = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(f"{url}{path}?limit={int(limit)}", timeout=30,
                                    context=ctx) as r:
            body = r.read(MAX_REPLY + 1)
            total = r.headers.get("X-Total-Count", "")
    except urllib.error.HTTPError as e:
        raise PluginError(f"collector {url}{path}: HTTP {e.code}: "
                          f"{e.read(200).decode(errors='replace')}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise PluginError(f"collector {url}: {getattr(e, 'reason', e)}") from e
    if len(body) > MAX_REPLY:
        raise PluginError(f"collector {url}{path}: reply larger than {MAX_REPLY} bytes")
    try:
        rows = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise PluginError(f"collector {url}{path}: not JSON") from e
    if not isinstance(rows, list):
        raise PluginError(f"collector {url}{path}: not a list")
    return rows, int(total) if total.isascii() and total.isdigit() and len(total) < 20 \
        else len(rows)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns; each cell on one line, its control characters shown escaped (the
    names come from verdicts nodes sent: no escape sequence reaches the terminal)."""
    rows = [[one_line(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [header, *rows]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def _names(items: Sequence[str], shown: int = 3) -> str:
    more = f" +{len(items) - shown}" if len(items) > shown else ""
    return ",".join(items[:shown]) + more or "-"


def cmd_list(k: Kubectl, namespace: str | None, args: argparse.Namespace) -> int:
    path = "/v1/nodes" if args.command == "nodes" else "/v1/services"
    with collector_url(k, namespace, args.collector) as url:
        rows, total = fetch_list(url, path, args.limit, args.ca_file)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if args.command == "nodes":
        out = table(["NODE", "STATUS", "MODE", "FINDINGS", "IDS", "VERDICT TIME"],
                    [[str(r.get("node")), str(r.get("status")), str(r.get("kube_proxy_mode")),
                      str(r.get("findings")), _names(r.get("ids") or []), str(r.get("time"))]
                     for r in rows])
    else:
        out = table(["SERVICE", "LB IP", "OBSERVED", "EXPOSED", "FINDINGS"],
                    [[str(r.get("service") or "-"), str(r.get("lb_ip") or "-"),
                      f"{r.get('observed_count', 0)} {_names(r.get('observed_nodes') or [])}",
                      f"{r.get('exposed_count', 0)} {_names(r.get('exposed_nodes') or [])}",
                      _names(r.get("ids") or [])] for r in rows])
    print(out if rows else f"no {args.command} reported to the collector yet")
    if total > len(rows):
        print(f"({len(rows)} of {total} shown; --limit N for more)", file=sys.stderr)
    return 0


# -- the command line ---------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"kubectl-loopback: {one_line(message)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _duration(text: str) -> float:
    """'30s', '2m', '1.5m', '45' -> seconds: agent.cli's grammar (a test holds them equal),
    so a bad value is refused here, not after a pod started."""
    t = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(t[-1:])
    try:
        value = float(t[:-1] if scale else t) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30s or 2m)") from None
    if not 0 < value <= 24 * 3600:
        raise argparse.ArgumentTypeError(f"duration out of range: {text!r}")
    return value


def _capture(text: str) -> str:
    _duration(text)
    return text


CHECK_EPILOG = f"""\
where the agent is not installed:
  When the namespace has no ServiceAccount {SERVICE_ACCOUNT} (the agent was never
  installed, or the namespace does not exist), the pod is made instead by
    kubectl debug node/NODE --profile={DEBUG_PROFILE} --image=IMAGE --container=agent \\
        --env=NODE_NAME=NODE --attach=false -- loopback-agent check [ARGS]
  (kubectl 1.27 or later), in kubectl's current namespace or -n's, which must admit
  privileged pods (Pod Security "privileged"; "default" usually does). The plugin says so
  on stderr, streams the report, exits with the agent's code and deletes the pod, as above.
  That pod shares the node's network, PID and IPC namespaces (kube-proxy's process and
  flags are seen) with NET_ADMIN and NET_RAW, but it cannot see:
  - the Services, the Node and the Ingresses: it runs as that namespace's default
    ServiceAccount, which is normally not allowed to read them; the report then lists
    them as unknown and the LB IPs come from kube-proxy's rules alone (-- --no-kube-api
    skips the attempt);
  - with --capture, the kernel's drop reasons (tracefs is not mounted in it; the
    report says so).
  --image chooses its image too (default: the DaemonSet's,
  {IMAGE}).
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kubectl loopback",
                description="loopback-agent from kubectl. kubectl's --kubeconfig, --context "
                            "and -n/--namespace are accepted anywhere and passed on.")
    p.add_argument("--version", action="version", version=f"kubectl-loopback {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("check", help="run the agent once on NODE in a short-lived pod",
                       description="Start a pod on NODE (namespace loopback-agent-node "
                                   "unless -n, as the agent's\nServiceAccount), stream the "
                                   "agent's report, exit with its code (0 healthy,\n1 at "
                                   "risk, 2 loopback, 3 unknown) and delete the pod, also "
                                   "on Ctrl-C.\nArguments after -- go to "
                                   "`loopback-agent check`.",
                       epilog=CHECK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("node", metavar="NODE")
    c.add_argument("--capture", metavar="DURATION", type=_capture,
                   help="also watch NodePort handshakes this long (e.g. 30s)")
    c.add_argument("--json", action="store_true", help="the verdict document, not the report")
    c.add_argument("--verbose", action="store_true", help="the report's evidence too")
    c.add_argument("--image", default=IMAGE, help=f"the agent's image (default {IMAGE})")
    c.add_argument("--start-timeout", metavar="SECONDS", type=float, default=120.0,
                   help="how long the pod may take to start (image pull; default 120)")
    c.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    for name, what in (("nodes", "each node's latest verdict, worst first"),
                       ("services", "per Service and LB IP, the nodes exposed or looping")):
        s = sub.add_parser(name, help=f"the collector's view: {what}",
                           description=f"The collector's view: {what}. Through `kubectl "
                                       "port-forward` to svc/loopback-agent-collector "
                                       "(namespace loopback-agent unless -n), or "
                                       "--collector URL.")
        s.add_argument("--collector", metavar="URL", help="the collector's base URL")
        s.add_argument("--ca-file", metavar="FILE", help="CA bundle for an https collector")
        s.add_argument("--limit", type=int, default=500 if name == "nodes" else 100,
                       help="rows to fetch")
        s.add_argument("--json", action="store_true", help="the collector's JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        flags, rest = split_kubectl_flags(sys.argv[1:] if argv is None else argv)
        cut = rest.index("--") if "--" in rest else len(rest)
        args = build_parser().parse_args(rest[:cut])
        args.agent_args = rest[cut + 1:]
        if args.agent_args and args.command != "check":
            raise PluginError(f"{args.command} takes no arguments after --", EXIT_USAGE)
        k = Kubectl(flags.get("kubeconfig"), flags.get("context"), find_kubectl())
        if args.command == "check":
            return cmd_check(k, flags.get("namespace"), args)
        return cmd_list(k, flags.get("namespace"), args)
    except PluginError as e:
        print(f"kubectl-loopback: {one_line(str(e))}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except argparse.ArgumentTypeError as e:
        print(f"kubectl-loopback: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
