"""Command line: `loopback-agent check | snapshot | bundle | schema`."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from json.encoder import encode_basestring_ascii as _ENC  # json.dumps' own (C)
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from agent import __version__
from agent.errors import InputError
from agent.numbers import is_number
from agent.snapshot import NodeSnapshot
from agent.terminal import for_terminal, one_line

if TYPE_CHECKING:
    from agent.diagnose import Prepared
    from agent.diagnose.model import Detail, Finding

# Exit codes (documented in --help and README). 0-3 are verdicts; >= 64 follow sysexits.h.
EXIT_HEALTHY = 0
EXIT_AT_RISK = 1
EXIT_LOOPBACK = 2
EXIT_UNKNOWN = 3  # nothing at risk found, something that could hide a risk not decided
EXIT_USAGE = 64  # bad command line
EXIT_DATAERR = 65  # input exists but cannot be used (bad snapshot JSON, no bundle files)
EXIT_NOINPUT = 66  # --from DIR / --snapshot FILE does not exist or cannot be read
EXIT_SOFTWARE = 70  # a bug in the agent
EXIT_CANTCREAT = 73  # bundle DIR / -o FILE cannot be written

EXIT_BY_STATUS = {"healthy": EXIT_HEALTHY, "at-risk": EXIT_AT_RISK, "loopback": EXIT_LOOPBACK,
                  "unknown": EXIT_UNKNOWN}

EPILOG = """\
exit codes:
  0   healthy: every known LB IP was decided, no CLB loopback exposure found
  1   at risk: exposure found (see the findings)
  2   loopback observed (with capture)
  3   unknown: no exposure found, but something that could hide one was not decided
      (kube-proxy's mode, the LB IPs, a path: the findings say which)
  64  usage error (bad command line)
  65  input unusable (not a snapshot document; nothing usable in --from PATH)
  66  input missing (--from PATH or --snapshot FILE does not exist / is unreadable)
  70  internal error (a bug: please report it with the bundle)
  73  output cannot be written (bundle DIR, -o FILE)

examples:
  loopback-agent check                       # on the node (root, host network namespace)
  loopback-agent check --json | jq .status
  loopback-agent bundle /tmp/lb-bundle       # save what support needs
  loopback-agent check --from /tmp/lb-bundle # same verdict from the saved files
  loopback-agent check --from ticket.txt     # outputs pasted into one file, any formats
  xclip -o | loopback-agent check --from -   # ... or on standard input
  loopback-agent snapshot > node.json && loopback-agent check --snapshot node.json
"""


def _cidr(text: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_network(text.strip(), strict=False))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CIDR: {text!r} (e.g. 10.244.1.0/24)"
                                         ) from None


def _duration(text: str) -> float:
    """'30s', '2m', '1.5m', '45' -> seconds."""
    t = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(t[-1:])
    try:
        value = float(t[:-1] if scale else t) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30s or 2m)") from None
    if not 0 < value <= 24 * 3600:
        raise argparse.ArgumentTypeError(f"duration out of range: {text!r}")
    return value


def _listen(text: str) -> str:
    """'HOST:PORT', '[IPV6]:PORT', ':PORT' (every address) or '' (off)."""
    if text == "":
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not is_number(port) or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r} (try :9808)")
    if "/" in host:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r} (an address, not a URL: "
                                         "try :9808)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r} (an IPv6 address goes in "
                                         "brackets: [::1]:9808)")
    return text


def _listen_somewhere(text: str) -> str:
    """_listen without '' (the collector is nothing but its listener)."""
    if text == "":
        raise argparse.ArgumentTypeError("the collector must listen somewhere (try :8080)")
    return _listen(text)


def _cpu_percent(text: str) -> float:
    """A share of one CPU in percent, above 0 and at most 100 ("10", "2.5", "10%")."""
    try:
        v = float(text.strip().removesuffix("%"))
    except ValueError:
        v = float("nan")
    if not 0 < v <= 100:  # (NaN fails it too)
        raise argparse.ArgumentTypeError(f"not a percentage of one CPU above 0 and at most "
                                         f"100: {text!r} (try 10)")
    return v


def _log_format(text: str) -> str:
    from agent.logfmt import log_format

    try:
        return log_format(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _on_off(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"not on or off: {text!r}")
    return value in ("on", "true", "1", "yes")


def _port_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port range: {text!r} (try 30000-32767)") \
            from None
    if not 1 <= a <= b <= 65535:
        raise argparse.ArgumentTypeError(f"not a port range: {text!r}")
    return a, b


def _env_opt(p: argparse.ArgumentParser, flag: str, **kw: object) -> None:
    """An option whose default comes from LOOPBACK_AGENT_<NAME> when set."""
    env = "LOOPBACK_AGENT_" + flag.lstrip("-").replace("-", "_").upper()
    if env in os.environ:
        conv = kw.get("type", str)
        try:
            kw["default"] = conv(os.environ[env])  # type: ignore[operator]
        except (ValueError, argparse.ArgumentTypeError) as e:
            print(f"loopback-agent: environment {env}={os.environ[env]!r}: {e}",
                  file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
    kw["help"] = f"{kw.get('help', '')} [env {env}]"
    p.add_argument(flag, **kw)  # type: ignore[arg-type]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="loopback-agent",
        description="Finds out whether traffic through a cloud load balancer (CLB) loops back "
                    "into this Kubernetes node and is dropped, says why and what to do. "
                    "Read-only: it never changes iptables, routes, ipsets or sysctls.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"loopback-agent {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def live_opts(sp: argparse.ArgumentParser) -> None:
        g = sp.add_argument_group("live node options")
        g.add_argument("--node-name", help="node name in the verdict (default: $NODE_NAME, "
                       "then the hostname)")
        g.add_argument("--no-kube-api", action="store_true",
                       help="do not ask the Kubernetes API for Services, the Node, Ingresses")
        g.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then "
                       "$KUBECONFIG / ~/.kube/config)")
        g.add_argument("--kube-json", metavar="DIR",
                       help="read Services, the Node and Ingresses from saved kubectl JSON "
                            "(services.json, node.json, ingresses.json in DIR) instead of "
                            "the API: for nodes whose agent has no API access")
        g.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                       help="timeout for each probe command and API call (default 5)")

    c = sub.add_parser(
        "check", help="diagnose this node (or a saved bundle / snapshot) and print a report",
        description="Diagnose CLB loopback exposure. Without --from/--snapshot it reads the "
                    "live node (run as root in the host network namespace).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = c.add_mutually_exclusive_group()
    src.add_argument("--from", dest="from_dir", metavar="PATH",
                     help="read saved or pasted command outputs instead of the live node: a "
                          "directory (every file in it, any names), one file, or '-' "
                          "(stdin). Each file may hold several outputs one after another "
                          "(with or without shell prompts): iptables-save, iptables -S, "
                          "iptables -L -n -v, ipset save/list, ipvsadm -Ln / -S -n, ip addr "
                          "(-br, -j), ip route show table local, sysctl -a, kubectl get "
                          "svc/node/ingress -o yaml|json, kubectl get svc -A -o wide; "
                          "excerpts are fine")
    src.add_argument("--snapshot", metavar="FILE",
                     help="read a snapshot written by `loopback-agent snapshot` ('-' = stdin)")
    c.add_argument("--capture", metavar="DURATION", type=_duration,
                   help="also watch TCP handshakes to the NodePorts for DURATION (e.g. 30s, "
                        "2m) and report loopback as observed (exit 2); live node only")
    c.add_argument("--nodeport-range", metavar="LOW-HIGH", type=_port_range,
                   default=(30000, 32767),
                   help="NodePort range to watch (default 30000-32767, kube-apiserver's "
                        "--service-node-port-range)")
    c.add_argument("--pod-cidr", metavar="CIDR", action="append", type=_cidr,
                   help="this node's pod CIDR (repeatable), where the input does not show it "
                        "(no Node object, no rule naming it); stated in the verdict")
    c.add_argument("--mode", choices=("iptables", "ipvs", "nftables"),
                   help="kube-proxy's mode, where the input does not settle it; stated in "
                        "the verdict")
    c.add_argument("--json", action="store_true",
                   help="print the verdict document (JSON, schema v2: `loopback-agent "
                        "schema`): every finding that is not fine named, the LB IPs that "
                        "are fine counted by outcome and rule shape")
    c.add_argument("--all", action="store_true",
                   help="with --json: itemise every finding and LB IP with its evidence "
                        "(20-40 MB at 10k Services), as --verbose does for the report")
    c.add_argument("--lb-ip", metavar="IP", type=_lb_ip,
                   help="only this LB / external / Ingress address: its findings in full "
                        "and the status they make (its exit code)")
    c.add_argument("--what-if", metavar="MODE", choices=("nftables", "iptables", "ipvs"),
                   help="before moving kube-proxy to MODE (nftables, iptables or ipvs): "
                        "predict what this node would show, for the Services and endpoints "
                        "it serves today (the rules kube-proxy would write, walked by the "
                        "same engine), and say per LB address what appears and what "
                        "vanishes; the exit code is the predicted verdict's. Needs the "
                        "Services (API, --kube-json, services.json) and another of the "
                        "three modes today")
    c.add_argument("--npd", action="store_true",
                   help="node-problem-detector custom plugin: one line on stdout, exit 0 "
                        "OK, 1 NonOK (at risk or looping), 2 Unknown (cannot tell, or an "
                        "error); see daemonset/npd/")
    c.add_argument("-v", "--verbose", action="store_true",
                   help="show the evidence of informational notes too")
    c.add_argument("--jobs", metavar="N", type=_jobs, default=1,
                   help="processes that walk the LB IPs of a big iptables-mode node (1000 "
                        "or more targets; default 1): 2 forks a helper for half of them "
                        "where this process may use two CPUs: the same verdict, the "
                        "diagnosis in about 0.8x the time on 2 vCPUs, for about 1.5x the "
                        "memory (see README: whether it pays depends on the machine)")
    live_opts(c)

    s = sub.add_parser("snapshot", help="print the parsed node state as JSON",
                       description="Print the node state the diagnosis works from, as JSON "
                                   "(feed it back with `check --snapshot FILE`).")
    s.add_argument("--from", dest="from_dir", metavar="DIR",
                   help="build the snapshot from a saved bundle instead of the live node")
    s.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    live_opts(s)

    b = sub.add_parser("bundle", help="save the command outputs support needs into DIR",
                       description="Write iptables-save.txt, ipset.txt, ipvsadm.txt, "
                                   "route-local.txt, addr.txt, sysctl.txt and (when the "
                                   "Kubernetes API is reachable) services.json, node.json, "
                                   "ingresses.json into DIR. Read-only on the node.")
    b.add_argument("directory", metavar="DIR")
    live_opts(b)

    r = sub.add_parser(
        "run", help="daemon mode: a verdict every interval, shipped to a collector",
        description="The DaemonSet mode. Every interval: snapshot, watch NodePort handshakes, "
                    "diagnose; one bounded summary line per verdict on stdout (at most 16 KiB; "
                    "JSON, or text with --log-format text; other messages on stderr, in "
                    "the same format, each with its ts, level and msg); "
                    "verdicts are spooled durably and shipped when they change and as a "
                    "heartbeat. The options marked [env ...] can also be set with that "
                    "environment variable (LOOPBACK_AGENT_<OPTION>, e.g. "
                    "LOOPBACK_AGENT_COLLECTOR); the command line wins.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _env_opt(r, "--collector", metavar="URL", help="collector base URL (POST URL/v1/verdicts)")
    from agent.ship import auth  # the token file's default depends on the mode

    _env_opt(r, "--collector-auth", metavar="MODE", type=auth.auth_mode,
             default=auth.SHARED_TOKEN, action=auth.CollectorAuthOption,
             help=f"{auth.SHARED_TOKEN} (default): the --token-file every node shares; "
                  f"{auth.KUBE_TOKEN}: this pod's projected service-account token "
                  f"(audience {auth.KUBE_TOKEN_AUDIENCE}; --token-file defaults to "
                  f"{auth.KUBE_TOKEN_FILE}), which the collector checks with TokenReview")
    _env_opt(r, "--token-file", metavar="F", action=auth.TokenFileOption,
             default=auth.default_token_file(auth.env_mode()),
             help="bearer token file, re-read when it changes")
    _env_opt(r, "--ca-file", metavar="F", help="CA bundle for the collector's TLS certificate")
    _env_opt(r, "--spool", metavar="DIR", default="/var/lib/loopback-agent/spool",
             help="durable spool directory (default /var/lib/loopback-agent/spool)")
    _env_opt(r, "--interval", metavar="SECONDS", type=float, default=60.0,
             help="seconds per verdict, all of it capturing (without a capture the rest "
                  "is waited out; default 60)")
    _env_opt(r, "--heartbeat-every", metavar="N", type=int, default=10,
             help="ship an unchanged verdict, and print its full summary line, every N "
                  "intervals (default 10)")
    _env_opt(r, "--listen", metavar="HOST:PORT", default=":9808", type=_listen,
             help="/metrics, /healthz and /verdict (the last full verdict, to this node "
                  "only) (default :9808: every address, IPv6 and IPv4; [::1]:PORT for one "
                  "IPv6 address; '' to disable)")
    _env_opt(r, "--nodeport-range", metavar="LOW-HIGH", type=_port_range, default=(30000, 32767),
             help="NodePort range to watch (default 30000-32767)")
    _env_opt(r, "--reread-cpu", metavar="PERCENT", type=_cpu_percent, default=10.0,
             help="rules, ipsets and IPVS that changed are read again within this share "
                  "of one CPU (default 10): reads and a diagnosis that took 40 s of CPU "
                  "(iptables-nft-save of 10k services) are repeated 400 s after at the "
                  "soonest; until then the verdict is the node as those reads saw it, with "
                  "the Services of that time, and says so. 100: read every change at once")
    _env_opt(r, "--max-finding-series", metavar="N", type=int, default=500,
             help="cap on loopback_agent_finding series in /metrics (default 500)")
    _env_opt(r, "--log-format", metavar="json|text", type=_log_format, default="json",
             help="the verdicts' lines on stdout and the messages on stderr: one JSON "
                  "object a line (default), or text: 'TS LEVEL msg key=value ...'; both "
                  "carry ts, level and msg")
    r.add_argument("--no-capture", action="store_true", help="static checks only")
    r.add_argument("--kube-report", action="store_true",
                   help="also write the verdict to the cluster: a LoadBalancerLoopback "
                        "condition on this Node and Warning Events on changes (needs "
                        "patch nodes/status, create/patch events: daemonset/kube-report/)")
    r.add_argument("--cycles", type=int, help=argparse.SUPPRESS)  # tests and one-off runs
    live_opts(r)

    col = sub.add_parser(
        "collector", help="the fleet collector: verdicts in, fleet page and API out",
        description="An HTTP service: POST /v1/verdicts, GET /v1/nodes, /v1/nodes/NODE, "
                    "/v1/services, /metrics, /healthz, /openapi.json and / (the fleet page). "
                    "Options also read LOOPBACK_AGENT_<OPTION> from the environment.")
    _env_opt(col, "--listen", metavar="HOST:PORT", default=":8080", type=_listen_somewhere,
             help="where to listen (default :8080: every address, IPv6 and IPv4)")
    _env_opt(col, "--db", metavar="URL", default="sqlite:///var/lib/loopback-agent/collector.db",
             help="sqlite:///PATH or postgresql://USER@HOST/DB (default "
                  "sqlite:///var/lib/loopback-agent/collector.db)")
    _env_opt(col, "--token-file", metavar="F",
             help="require this bearer token for POSTs (re-read when it changes)")
    _env_opt(col, "--retention-days", metavar="DAYS", type=float, default=14.0,
             help="keep verdict history this long (the latest per node is always kept)")
    _env_opt(col, "--node-quota-mb", metavar="MIB", type=_positive_int, default=64,
             help="stored verdict documents (gzipped) one node may hold; past it its oldest "
                  "history goes first, its latest verdict never (default 64)")
    _env_opt(col, "--tls-cert", metavar="FILE",
             help="serve HTTPS with this certificate (PEM, chain after it); re-read when the "
                  "file changes")
    _env_opt(col, "--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    _env_opt(col, "--auth", metavar="MODE", choices=("shared-token", "kube-token"),
             default="shared-token",
             help="who may POST: 'shared-token' (default): the --token-file every agent "
                  "shares (anyone when there is none); 'kube-token': each agent's projected "
                  "service-account token, checked with the TokenReview API, for its own "
                  "node only")
    _env_opt(col, "--kube-audience", metavar="AUDIENCE", default="loopback-agent-collector",
             help="--auth kube-token: the audience agents' tokens must be for (default "
                  "loopback-agent-collector)")
    _env_opt(col, "--agent-service-account", metavar="USER",
             default="system:serviceaccount:loopback-agent-node:loopback-agent",
             help="--auth kube-token: the agents' service account (default system:"
                  "serviceaccount:loopback-agent-node:loopback-agent)")
    col.add_argument("--kubeconfig", metavar="FILE",
                     help="--auth kube-token: API credentials (default: in-cluster, then "
                          "$KUBECONFIG or ~/.kube/config)")
    _env_opt(col, "--token-review-cache", metavar="SECONDS", type=_seconds, default=60.0,
             help="--auth kube-token: how long a token's positive review is kept (default "
                  "60; never past the token's expiry)")
    _env_opt(col, "--log-format", metavar="json|text", type=_log_format, default="json",
             help="the access log on stdout and the messages on stderr: one JSON object a "
                  "line (default), or text: 'TS LEVEL msg key=value ...'; both carry ts, "
                  "level and msg")
    _env_opt(col, "--access-log", metavar="on|off", type=_on_off, default=True,
             help="a line on stdout per HTTP request: method, path (no query but paging), "
                  "status, bytes, duration, client address, the node a POST is for; never "
                  "a token (default on)")

    sub.add_parser("schema", help="print the verdict JSON Schema")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    say: Callable[[str], object] = _plain_say
    if args.command in ("run", "collector"):  # long-running: every line with a level
        from agent import logfmt

        say = logfmt.setup(args.log_format).error
    try:
        if args.command == "check":
            return _check(args)
        if args.command == "snapshot":
            return _snapshot(args)
        if args.command == "bundle":
            return _bundle(args)
        if args.command == "run":
            return _run(args)
        if args.command == "collector":
            return _collector(args)
        if args.command == "schema":
            sys.stdout.write(schema_text())
            return 0
    except _Exit as e:
        say(e.message)
        return e.code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: say so plainly, with an exit code scripts can tell
        say(f"internal error: {type(e).__name__}: {e} (please report this with the "
            "bundle)")
        if os.environ.get("LOOPBACK_AGENT_DEBUG"):
            raise
        return EXIT_SOFTWARE
    return EXIT_USAGE


def _plain_say(message: str) -> None:
    print(f"loopback-agent: {for_terminal(message)}", file=sys.stderr)


class _Exit(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def schema_text() -> str:
    # (imported here: importlib.resources costs 10-30 ms, which every check paid)
    from importlib import resources

    return resources.files("agent").joinpath("schema/verdict-v2.json").read_text()


def _probe_ctx(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from agent.probes.base import ProbeContext

    return ProbeContext(node_name=_node(args, None), use_kube_api=not args.no_kube_api,
                        kubeconfig=args.kubeconfig, timeout=args.timeout)


def _node(args: argparse.Namespace, snap: NodeSnapshot | None) -> str:
    from agent.diagnose import node_name

    return node_name(getattr(args, "node_name", None), snap, dict(os.environ))


def load_snapshot(args: argparse.Namespace) -> NodeSnapshot:
    """The node state from --from DIR, --snapshot FILE, or the live node."""
    if getattr(args, "from_dir", None):
        from agent.bundle import load_bundle

        d = Path(args.from_dir)
        if args.from_dir != "-" and not d.exists():
            raise _Exit(EXIT_NOINPUT, f"{d}: no such file or directory")
        try:
            snap = load_bundle(args.from_dir)
        except InputError as e:
            raise _Exit(_input_exit(e), str(e)) from e
        for u in snap.unknowns:
            if not u.reason.startswith("not given") and u.source != "kube-proxy":
                # (a reason that names its file and line already is not prefixed again)
                said = u.reason if u.reason.startswith(u.source) else \
                    f"{u.source}: {u.reason}"
                print(f"loopback-agent: warning: {one_line(said)}", file=sys.stderr)
        return snap
    if getattr(args, "snapshot", None):
        from agent.bundle import read_input

        path = args.snapshot
        name = "<stdin>" if path == "-" else path
        try:
            if path != "-":
                os.stat(path)
        except FileNotFoundError:  # (a dangling symlink too; any other error: read below)
            raise _Exit(EXIT_NOINPUT, f"{name}: no such file or directory") from None
        except OSError:
            pass
        try:
            # (bounded, never blocking on a FIFO nor reading a device: as --from reads)
            text = read_input(path, name)
        except InputError as e:
            raise _Exit(_input_exit(e), str(e)) from e
        try:
            snap = NodeSnapshot.from_json(text)
        except json.JSONDecodeError as e:
            raise _Exit(EXIT_DATAERR, f"{name}:{e.lineno}: not JSON: {e.msg}") from e
        except (ValueError, TypeError) as e:
            raise _Exit(EXIT_DATAERR, f"{name}: not a loopback-agent snapshot: {e}") from e
        return snap
    from agent.probes import collect_live

    kube_dir = getattr(args, "kube_json", None)
    if kube_dir and not Path(kube_dir).is_dir():
        raise _Exit(EXIT_NOINPUT, f"{kube_dir}: no such directory")
    if kube_dir:
        args.no_kube_api = True
    snap = collect_live(_probe_ctx(args))
    if not kube_dir:
        return snap
    from agent.bundle import with_kube_json

    try:
        return with_kube_json(snap, Path(kube_dir))
    except InputError as e:
        raise _Exit(EXIT_DATAERR, str(e)) from e


def _input_exit(e: InputError) -> int:
    """66 for an input that cannot be read at all (not permitted, a FIFO, a device, a
    directory named as a file), 65 for one read and found unusable."""
    from agent.parse.text_file import UnreadableInput

    return EXIT_NOINPUT if isinstance(e, UnreadableInput) else EXIT_DATAERR


def _one_shot_gc() -> None:
    """A 10k-service node's snapshot is some 300k long-lived objects that the cyclic
    collector's default thresholds (a young collection every 700 allocations) would
    rescan again and again while they are built and walked: about a third of `check`'s
    time on such a node. A one-shot command collects rarely instead (the daemon keeps
    the defaults): at 10k services a young collection every 50,000 allocations still
    cost 0.1 s in 34 collections that found 748 garbage objects in all; one every
    million costs 3 ms (1 s -> 0.1 s at 50k services), peak RSS unchanged."""
    import gc

    gc.set_threshold(1_000_000, 20, 100)


@contextlib.contextmanager
def _built_without_gc() -> Iterator[None]:
    """Read and prepare the snapshot with the cyclic collector off, then freeze what was
    built (it lives as long as the command): at 50k services even the rare young
    collections of _one_shot_gc each walked a million new objects, 0.5 s in all, to find
    the few hundred cyclic garbage objects a whole check makes. What comes after (the
    walks, a --capture's minutes) is collected as before, without rescanning these."""
    import gc

    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _check(args: argparse.Namespace) -> int:
    from agent.report import render

    if args.npd:
        return _npd(args)
    if args.what_if:
        return _what_if(args)
    verdict = _verdict(args)
    if args.lb_ip:
        known = {r.ip for r in verdict.lb_ips} | {f.lb_ip for f in verdict.findings}
        if args.lb_ip not in known:
            raise _Exit(EXIT_USAGE, f"--lb-ip {args.lb_ip}: not an address this node knows "
                        f"({len(verdict.lb_ips)} LB IPs; `check --json --all` lists them)")
        verdict = verdict.for_lb_ip(args.lb_ip)
    if args.json:
        detail: Detail = "lb_ip" if args.lb_ip else "all" if args.all else "summary"
        # indent for people; a huge verdict goes compact (the C encoder, 5x faster)
        if detail != "all" or len(verdict.findings) < 500:
            sys.stdout.write(json.dumps(verdict.to_dict(detail), indent=2) + "\n")
        else:
            from dataclasses import replace

            # the long lists' dicts made one at a time, as they are written (the whole
            # tree is 10 MiB for 10k LB IPs): Verdict.to_dict's lists, item by item
            doc = replace(verdict, findings=(), lb_ips=()).to_dict("all")
            remedies: dict[str | None, str] = {}
            doc["findings"] = _Encoded(_finding_json(f, remedies) for f in verdict.findings)
            doc["lb_ips"] = (r.to_dict() for r in verdict.lb_ips)
            n = len(verdict.lb_ips)
            doc["lb_ip_counts"] = {"total": n, "local": sum(1 for r in verdict.lb_ips
                                                             if r.local), "listed": n}
            _write_compact_json(doc, sys.stdout)
    else:
        # names, comments and log lines from the node: no escape reaches the terminal
        sys.stdout.write(for_terminal(render(verdict, verbose=args.verbose or args.all
                                             or bool(args.lb_ip))))
    return EXIT_BY_STATUS[verdict.status]


def _what_if(args: argparse.Namespace) -> int:
    from agent.predict.what_if import what_if
    from agent.report import render_what_if

    if args.capture or args.lb_ip:
        raise _Exit(EXIT_USAGE, "--what-if predicts from the node's rules: it cannot be "
                                "combined with --capture or --lb-ip")
    _one_shot_gc()
    with _built_without_gc():
        snap = load_snapshot(args)
    try:
        w = what_if(snap, _node(args, snap), args.what_if)
    except ValueError as e:
        raise _Exit(EXIT_DATAERR, f"--what-if {args.what_if}: {e}") from None
    if args.json:
        sys.stdout.write(json.dumps(w.to_dict("all" if args.all else "summary"), indent=2)
                         + "\n")
    else:
        sys.stdout.write(for_terminal(render_what_if(w, verbose=args.verbose or args.all)))
    return EXIT_BY_STATUS[w.predicted.status]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 86400:  # (NaN too)
        raise argparse.ArgumentTypeError(f"not a number of seconds from 0 to 86400: {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit() and 0 < len(text) <= 9 and int(text) > 0):
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return int(text)


def _lb_ip(text: str) -> str:
    """An address as the verdict writes it (IPv6 compressed)."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(text.strip().strip("[]")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {text!r}") from None


def _npd(args: argparse.Namespace) -> int:
    """NPD's custom plugin protocol: whatever happens, one bounded line and 0/1/2."""
    from agent.kubereport.condition import NPD_UNKNOWN, npd_line, npd_result

    try:
        code, line = npd_result(_verdict(args))
    except _Exit as e:
        code, line = NPD_UNKNOWN, npd_line(f"CannotCheck: {e.message}")
    except Exception as e:  # a bug is Unknown to NPD, not a crash it would report as such
        code, line = NPD_UNKNOWN, npd_line(f"CannotCheck: internal error: "
                                           f"{type(e).__name__}: {e}")
    sys.stdout.write(line + "\n")
    return code


def _verdict(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from agent.diagnose import diagnose, prepare

    if args.capture and (args.from_dir or args.snapshot):
        raise _Exit(EXIT_USAGE, "--capture watches the live node: it cannot be combined "
                                "with --from or --snapshot")
    _one_shot_gc()
    with _built_without_gc():
        snap = load_snapshot(args)
        given = {k: v for k, v in (("mode", args.mode),
                                   ("pod_cidr", ",".join(args.pod_cidr or ()))) if v}
        if given:
            from dataclasses import replace

            snap = replace(snap, given=given)
        prepared = prepare(snap)
    capture = _capture(args, prepared) if args.capture else None
    return diagnose(snap, _node(args, snap), capture=capture, prepared=prepared,
                    jobs=_jobs_for(args))


def _jobs_for(args: argparse.Namespace) -> int:
    """--jobs, where this process may run on that many CPUs (its affinity, which a
    container's cpuset narrows), else 1: the walk splits in two at most."""
    jobs = int(getattr(args, "jobs", 1) or 1)
    if jobs < 2:
        return 1
    try:
        return min(jobs, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return 1


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= 2:
        raise argparse.ArgumentTypeError(f"{n}: 1 or 2 (the walk splits in two at most)")
    return n


_JSON_CHUNK = 256  # list items encoded by one json.dumps call


class _Encoded:
    """A list for _write_compact_json whose items are JSON texts already."""

    def __init__(self, texts: Iterator[str]) -> None:
        self.texts = texts


def _finding_json(f: Finding, remedies: dict[str | None, str]) -> str:
    """``json.dumps(f.to_dict())``, the same text, from the finding's fields: each string
    through the C encoder's own string function, without the dict made to be walked (10k
    LB IPs have 20k findings: 0.18 -> 0.10 s). ``remedies`` remembers the few remedies'
    texts. Anything unusual (structured data, a value of another type) goes through
    json.dumps."""
    if f.data is not None or not (f.port is None or type(f.port) is int):
        return json.dumps(f.to_dict())
    try:
        remedy = remedies.get(f.remedy)
        if remedy is None:
            remedy = remedies[f.remedy] = _json_str(f.remedy)
        return (f'{{"id": {_ENC(f.id)}, "severity": {_ENC(f.severity)}, '
                f'"summary": {_ENC(f.summary)}, "lb_ip": {_json_str(f.lb_ip)}, '
                f'"port": {"null" if f.port is None else f.port}, '
                f'"protocol": {_json_str(f.protocol)}, "service": {_json_str(f.service)}, '
                f'"evidence": [{", ".join(map(_ENC, f.evidence))}], "remedy": {remedy}'
                + ("}" if f.shape is None else f', "shape": {_ENC(f.shape)}}}'))
    except TypeError:  # a field that is not a string
        return json.dumps(f.to_dict())


def _json_str(value: str | None) -> str:
    return "null" if value is None else _ENC(value)


def _write_compact_json(doc: dict[str, Any], out: TextIO) -> None:
    """``json.dumps(doc)`` + newline, written piece by piece: each item of the
    document's top-level lists (or generators, which stand for lists) is encoded on its
    own (the C encoder, the same bytes) and dropped once written, so the whole text
    (20-60 MiB for 10k LB IPs, twice that while it is built) is never held at once."""
    dumps = json.dumps
    buf: list[str] = ["{"]
    size = 0
    for n, (key, value) in enumerate(doc.items()):
        buf.append(("" if n == 0 else ", ") + dumps(key) + ": ")
        if isinstance(value, _Encoded):
            items, encoded = value.texts, True
        elif type(value) is list:
            items, encoded = iter(value), False
        elif isinstance(value, Iterator):
            items, encoded = value, False
        else:
            buf.append(dumps(value))
            continue
        buf.append("[")
        first = True
        while True:
            # a few hundred items per dumps call (one call per item cost a third of the
            # writing at 20k findings): a list's text is its items' joined by ", "
            chunk = list(itertools.islice(items, _JSON_CHUNK))
            if not chunk:
                break
            text = ", ".join(chunk) if encoded else dumps(chunk)[1:-1]
            buf.append(text if first else ", " + text)
            first = False
            size += len(text)
            if size > 1 << 16:
                out.write("".join(buf))
                buf, size = [], 0
        buf.append("]")
    buf.append("}\n")
    out.write("".join(buf))


def _capture(args: argparse.Namespace, prepared: Prepared):  # type: ignore[no-untyped-def]
    """Watch NodePort handshakes, with a progress line on stderr."""
    from agent.watch import watch_node

    tty = sys.stderr.isatty()
    last = [0.0]

    def progress(left: float, syns: int, unanswered: int) -> None:
        line = (f"capturing NodePorts {args.nodeport_range[0]}-{args.nodeport_range[1]}: "
                f"{left:4.0f}s left, {syns} SYNs, {unanswered} unanswered")
        if tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif left <= 0 or last[0] - left >= 5 or last[0] == 0:
            last[0] = left or 0.001
            print(line, file=sys.stderr, flush=True)

    # SIGTERM (pod stop, `timeout`), SIGHUP (a lost kubectl session) and Ctrl-C end the
    # capture early but normally: the verdict is still printed and the corroborators
    # (our own tracefs instance) are cleaned up.
    import threading  # (only a capture needs it: 9 ms of every check's start)

    from agent.signals import SignalEvents

    stop = threading.Event()
    try:
        with SignalEvents((signal.SIGTERM, signal.SIGHUP, signal.SIGINT), stop):
            result = watch_node(prepared, args.capture, port_range=args.nodeport_range,
                                stop=stop, progress=progress)
    finally:
        if tty:
            print(file=sys.stderr)
    if stop.is_set():
        print("loopback-agent: capture stopped early by a signal", file=sys.stderr)
    return result


def _run(args: argparse.Namespace) -> int:
    import logging

    from agent.daemon import Daemon, DaemonConfig, ListenError

    if not args.collector:
        logging.getLogger("loopback_agent.daemon").info(
            "no --collector: verdicts go to the spool only (and their summaries to stdout)")
    if args.kube_json and not Path(args.kube_json).is_dir():
        raise _Exit(EXIT_NOINPUT, f"{args.kube_json}: no such directory")
    try:
        Path(args.spool).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _Exit(EXIT_CANTCREAT, f"{args.spool}: {e.strerror or e}") from e
    cfg = DaemonConfig(
        collector=args.collector, spool_dir=args.spool, interval=args.interval,
        heartbeat_every=args.heartbeat_every, listen=args.listen or None,
        token_file=args.token_file, ca_file=args.ca_file, capture=not args.no_capture,
        nodeport_range=args.nodeport_range, node_name=_node(args, None),
        use_kube_api=not (args.no_kube_api or args.kube_json), kubeconfig=args.kubeconfig,
        kube_json=args.kube_json, cycles=args.cycles,
        max_finding_series=args.max_finding_series, kube_report=args.kube_report,
        reread_cpu=args.reread_cpu, log_format=args.log_format)
    try:
        return Daemon(cfg).run()
    except ListenError as e:
        raise _Exit(EXIT_CANTCREAT, str(e)) from e


def _collector(args: argparse.Namespace) -> int:
    from agent.collector.main import StartError, run

    try:
        return run(args)
    except StartError as e:
        raise _Exit(e.code, e.message) from e


def _snapshot(args: argparse.Namespace) -> int:
    snap = load_snapshot(args)
    if snap.node is None:
        from dataclasses import replace

        snap = replace(snap, node=_node(args, snap))
    text = snap.to_json() + "\n"
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            raise _Exit(EXIT_CANTCREAT, f"{args.output}: {e.strerror or e}") from e
    else:
        sys.stdout.write(text)
    return 0


def _bundle(args: argparse.Namespace) -> int:
    from agent.bundle.write import write_bundle

    d = Path(args.directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _Exit(EXIT_CANTCREAT, f"{d}: {e.strerror or e}") from e
    if not os.access(d, os.W_OK):
        raise _Exit(EXIT_CANTCREAT, f"{d}: not writable")
    results = write_bundle(d, _probe_ctx(args))
    for name, status in results:
        print(f"{name:<18} {status}", file=sys.stderr)
    written = sum(1 for _, s in results if s == "written")
    print(f"bundle: {written} files in {d} (check them with: loopback-agent check --from {d})",
          file=sys.stderr)
    return 0
