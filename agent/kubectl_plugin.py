"""`kubectl loopback`: one-shot runs and the collector's views from a workstation.

    kubectl loopback check NODE [--capture 30s] [--json] [--image IMAGE] [-- AGENT ARGS]
    kubectl loopback nodes    [--collector URL] [--json]
    kubectl loopback services [--collector URL] [--json]

`check` starts a short-lived pod on NODE (the agent's image, the node's network and PID
namespaces, the DaemonSet's capabilities and read-only node mounts: ``check_pod``), streams
its report, exits with the agent's exit code (0 healthy, 1 at risk, 2 loopback, 3
unknown) and deletes the pod, also on Ctrl-C or SIGTERM. `nodes` and `services` read the
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
import time
from collections.abc import Iterator, Sequence
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


class CheckRun:
    def __init__(self, kubectl: Kubectl, namespace: str, name: str,
                 poll: float = 1.0) -> None:
        self.k, self.ns, self.name, self.poll = kubectl, namespace, name, poll
        self.created = False

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
    name = pod_name(args.node)
    run = CheckRun(k, ns, name, poll=args.poll)
    with _interrupts():
        try:
            run.create(check_pod(args.node, name, image=args.image, namespace=ns,
                                 agent_args=agent_args,
                                 deadline=int(args.start_timeout + seconds + 600)))
            print(f"kubectl-loopback: pod {ns}/{name} on node {args.node}", file=sys.stderr)
            run.wait_started(args.start_timeout)
            run.stream_logs()
            # the log stream can end before the container does (a kubelet or API server
            # restart): wait for the exit as long as the run could still take
            return run.exit_code(timeout=seconds + 120)
        except KeyboardInterrupt:
            print(f"kubectl-loopback: interrupted; deleting pod {ns}/{name}", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            try:
                run.delete()
            except (PluginError, KeyboardInterrupt):
                print(f"kubectl-loopback: pod {ns}/{name} may be left: delete it with "
                      f"kubectl -n {ns} delete pod {name}", file=sys.stderr)


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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kubectl loopback",
                description="loopback-agent from kubectl. kubectl's --kubeconfig, --context "
                            "and -n/--namespace are accepted anywhere and passed on.")
    p.add_argument("--version", action="version", version=f"kubectl-loopback {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("check", help="run the agent once on NODE in a short-lived pod",
                       description="Start a pod on NODE (namespace loopback-agent-node "
                                   "unless -n), stream the agent's report, exit with its "
                                   "code (0 healthy, 1 at risk, 2 loopback, 3 unknown) "
                                   "and delete the pod, also on Ctrl-C. Arguments after -- go to "
                                   "`loopback-agent check`.")
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
