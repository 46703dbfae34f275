"""The kube-proxy process: its mode, cluster CIDR and masquerade-all setting.

Found through /proc (psutil); a DaemonSet sees it only with hostPID. The config
file path is inside kube-proxy's mount namespace, so it is read through
/proc/PID/root. When kube-proxy runs with --config, the file wins over the other
flags (kube-proxy's Options.Complete replaces the flag-built config with the
file's), so we do the same.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil

from agent.errors import InputError
from agent.parse.ip_text import is_network
from agent.parse.kube_proxy_log import failed_sync
from agent.parse.text_file import read_text_file
from agent.probes.base import Probe, ProbeContext, ProbeResult, register, unavailable
from agent.snapshot import KubeProxy, Unknown

SOURCE = "kube-proxy"
NOT_FOUND = "no kube-proxy process found"
CONFIG_LIMIT = 1 << 20  # a KubeProxyConfiguration is a few KiB


def is_kube_proxy(name: str | None, cmdline: Sequence[str]) -> bool:
    if name == "kube-proxy":
        return True
    if not cmdline:
        return False
    exe = os.path.basename(cmdline[0])
    if exe == "kube-proxy":
        return True
    # hyperkube bundles all components: `hyperkube kube-proxy ...` (old: `hyperkube proxy`).
    return exe == "hyperkube" and len(cmdline) > 1 and cmdline[1] in ("kube-proxy", "proxy")


def parse_flags(args: Sequence[str]) -> dict[str, str]:
    """--name=value / --name value for the flags we care about (pflag syntax)."""
    valued = {"proxy-mode", "cluster-cidr", "config"}
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if name == "masquerade-all":
            # A pflag bool takes its value only after '=': `--masquerade-all false`
            # means true plus a stray argument.
            out[name] = value if eq else "true"
        elif name in valued:
            if eq:
                out[name] = value
            elif i < len(args):
                out[name] = args[i]
                i += 1
    return out


def _bool(value: str | None) -> bool | None:
    if value is None:
        return None
    v = value.strip().strip("\"'").lower()
    if v in ("true", "1", "t", "yes"):
        return True
    if v in ("false", "0", "f", "no"):
        return False
    return None


def _scalar(raw: str) -> str:
    """A YAML scalar as written on one line: drop a trailing comment and quotes."""
    v = raw.strip()
    if v[:1] in ("'", '"'):
        quote = v[0]
        end = v.find(quote, 1)
        return v[1:end] if end > 0 else v[1:]
    return v.split(" #", 1)[0].strip()


def read_config(text: str) -> dict[str, str]:
    """mode / clusterCIDR / masqueradeAll from a KubeProxyConfiguration (YAML or JSON).

    A tiny reader on purpose (no YAML dependency): top-level `mode:` and
    `clusterCIDR:`, and `masqueradeAll:` under `iptables:` (v1alpha1) or `linux:`
    (newer) or at the top.
    """
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # (then read as YAML, line by line)
        doc = None
    if isinstance(doc, dict):
        out: dict[str, str] = {}
        for key in ("mode", "clusterCIDR"):
            if isinstance(doc.get(key), str):
                out[key] = doc[key]
        for section in (doc.get("iptables"), doc.get("linux"), doc):
            if isinstance(section, dict) and "masqueradeAll" in section:
                out["masqueradeAll"] = str(section["masqueradeAll"]).lower()
                break
        return out
    out = {}
    section = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        key, _, value = stripped.partition(":")
        key = key.strip().strip("\"'")
        if not line[0].isspace():
            section = key if not value.strip() else ""
            if key in ("mode", "clusterCIDR", "masqueradeAll"):
                out.setdefault(key, _scalar(value))
        elif key == "masqueradeAll" and section in ("iptables", "linux"):
            out.setdefault(key, _scalar(value))
    return out


def _config_path(pid: int, path: str, cwd: str | None) -> Path:
    """FILE as kube-proxy sees it -> the same file through /proc/PID/root."""
    if not os.path.isabs(path):
        path = os.path.join(cwd or "/", path)
    return Path(f"/proc/{pid}/root") / path.lstrip("/")


def describe(pid: int, cmdline: Sequence[str], cwd: str | None = None,
             read: Callable[[Path], str] | None = None) -> tuple[KubeProxy, list[Unknown]]:
    """Build KubeProxy from a process's argv (and its config file, when readable)."""
    start = 2 if os.path.basename(cmdline[0]) == "hyperkube" else 1
    flags = parse_flags(cmdline[start:])
    unknowns: list[Unknown] = []
    mode = flags.get("proxy-mode")
    cidr = flags.get("cluster-cidr")
    masq = _bool(flags.get("masquerade-all"))
    config_file = flags.get("config")
    if config_file:
        path = _config_path(pid, config_file, cwd)
        try:
            # (not blocking on a FIFO, nor reading a device or a huge file: whoever owns
            # kube-proxy's filesystem owns what is there)
            text = read(path) if read else \
                read_text_file(path, str(path), CONFIG_LIMIT, follow=True)
        except (OSError, UnicodeDecodeError, InputError) as exc:
            why = exc.message if isinstance(exc, InputError) else \
                getattr(exc, "strerror", None) or exc
            unknowns.append(Unknown(SOURCE, f"cannot read config {config_file} via {path}: "
                                    f"{why}; mode/clusterCIDR/masqueradeAll from flags only"))
        else:
            conf = read_config(text)
            # The file replaces the flag-built config: a key absent from it is
            # kube-proxy's default (reported as None), not the flag's value.
            mode = conf.get("mode") or None
            cidr = conf.get("clusterCIDR") or None
            masq = _bool(conf.get("masqueradeAll"))
    return KubeProxy(pid=pid, mode=mode or None, cluster_cidr=cidr or None,
                     masquerade_all=masq, config_file=config_file,
                     args=tuple(cmdline)), unknowns


def find_processes() -> Iterable[psutil.Process]:
    return psutil.process_iter(["pid", "name", "cmdline"])


def collect(ctx: ProbeContext) -> ProbeResult:
    denied: list[str] = []
    for proc in sorted(find_processes(), key=lambda p: p.pid):
        try:
            info = proc.info  # filled by process_iter; None where access was denied
            cmdline = info.get("cmdline") or []
            if not is_kube_proxy(info.get("name"), cmdline):
                continue
            if not cmdline:
                cmdline = proc.cmdline()
            try:
                cwd: str | None = proc.cwd()
            except (psutil.AccessDenied, psutil.ZombieProcess):
                cwd = None
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied as exc:
            denied.append(f"kube-proxy pid {proc.pid} found but unreadable: access denied"
                          f" ({exc.msg or 'no permission'})")
            continue
        value, unknowns = describe(proc.pid, cmdline, cwd)
        return ProbeResult(value, tuple(unknowns))
    if denied:
        return unavailable(SOURCE, "; ".join(denied[:3]))
    return unavailable(SOURCE, NOT_FOUND)


PROBE = register(Probe(name=SOURCE, field="kube_proxy", collect=collect))


# --- what a paste shows of kube-proxy (offline) ------------------------------------------

# kube-proxy's startup log: `FLAG: --proxy-mode="ipvs"` (every flag, at -v>=1) and the
# proxier it chose ("Using ipvs Proxier.", "Using iptables Proxier", newer: "Using
# iptables proxy"; klog's structured form quotes it)
_LOG_FLAG = re.compile(r'FLAG: --(proxy-mode|cluster-cidr|masquerade-all)="([^"]*)"')
_LOG_PROXIER = re.compile(r'"?Using (ipvs|iptables|nftables|userspace) [Pp]rox(?:ier|y)\b')
# its version, logged at startup: `server.go:865] "Version info" version="v1.29.15"`
_LOG_VERSION = re.compile(r'"Version info" version="(v\d{1,2}\.\d{1,3}\.\d{1,4})[^"]{0,40}"')
MAX_ERRORS = 20  # different messages kept (a log repeats each every sync: once each)
MAX_ERROR_LINE = 400
_PROXY_ARGS = re.compile(r"(?:^|[\s/\"'])kube-proxy(?:\s|\"|'|$)")


def from_paste(lines: Sequence[str]) -> tuple[KubeProxy | None, str]:
    """KubeProxy from pasted text: its command line (`ps`, a pod spec's args, a systemd
    unit), its startup log, or its KubeProxyConfiguration (also inside the kube-proxy
    ConfigMap). (None, "") when the text says nothing of it; else the fact and where the
    mode came from."""
    mode = cidr = masq = version = None
    errors: list[str] = []
    said: set[str] = set()  # the messages of those lines (a repeated one is kept once)
    how = ""
    text = "\n".join(lines)
    if "KubeProxyConfiguration" in text:
        start = text.index("KubeProxyConfiguration")
        block = text[text.rfind("\n", 0, text.rfind("apiVersion", 0, start) + 1) + 1:]
        conf = read_config(_dedent(block))
        mode, cidr = conf.get("mode"), conf.get("clusterCIDR")
        masq = _bool(conf.get("masqueradeAll"))
        how = "KubeProxyConfiguration"
        if not mode:
            mode, how = "iptables", "KubeProxyConfiguration with mode unset (iptables on Linux)"
    for line in lines:
        v = _LOG_VERSION.search(line)
        if v:
            version = v.group(1)
        msg = failed_sync(line) if len(errors) < MAX_ERRORS else None
        if msg is not None and msg not in said:
            said.add(msg)
            errors.append(line.strip()[:MAX_ERROR_LINE])
        m = _LOG_PROXIER.search(line)
        if m and m.group(1) != "userspace":
            mode, how = m.group(1), f"kube-proxy's log: {line.strip()[:100]}"
        for flag, value in _LOG_FLAG.findall(line):
            if flag == "proxy-mode" and value and not mode:
                mode, how = value, f"kube-proxy's log: FLAG: --proxy-mode={value}"
            elif flag == "cluster-cidr" and value:
                cidr = cidr or value
            elif flag == "masquerade-all":
                masq = _bool(value)
        if _PROXY_ARGS.search(line) and "--" in line:
            words = line.replace("\\", " ").replace('"', " ").replace(",", " ").split()
            flags = parse_flags(words)
            if flags.get("proxy-mode") and not mode:
                mode = flags["proxy-mode"]
                how = f"kube-proxy's command line: --proxy-mode={mode}"
            cidr = cidr or flags.get("cluster-cidr")
            if flags.get("masquerade-all"):
                masq = _bool(flags["masquerade-all"])
    if cidr and not all(is_network(c.strip()) for c in cidr.split(",")):
        how = (f"{how}; " if how else "") + f"its cluster CIDR {cidr!r} is not a CIDR: not used"
        cidr = None
    if version and not (mode or cidr or masq is not None or errors or "kube-proxy" in text
                        or "Prox" in text):
        version = None  # another component's "Version info" (its log says nothing else)
    if mode is None and cidr is None and masq is None and version is None and not errors:
        return None, how
    return KubeProxy(mode=mode or None, cluster_cidr=cidr or None,
                     masquerade_all=masq, version=version, errors=tuple(errors)), how


def _dedent(block: str) -> str:
    """A KubeProxyConfiguration embedded in a ConfigMap (`config.conf: |`) is indented."""
    lines = block.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    pad = len(first) - len(first.lstrip())
    return "\n".join(ln[pad:] if ln[:pad].isspace() else ln for ln in lines)
