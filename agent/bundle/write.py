"""Write a support bundle (the files of agent.bundle_files) from the live node.

`check --from DIR` must reach the verdict a live run reaches, so each file holds
what the matching probe read, in the form the bundle readers parse: the very dump
the nat probe chose, `ipset save`, `ip route show table local`, `ip -j addr show`,
the probe's sysctls as `key = value`, the raw API JSON. Nothing here writes to the
node; each file is written atomically (temp file + rename) so a reader never sees
half a file. A file that cannot be produced is reported as skipped, with why.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from agent.bundle import files as bundle_files
from agent.probes import ipsets as ipsets_probe
from agent.probes import ipvs as ipvs_probe
from agent.probes import kube_api, kube_proxy_metrics, nat_rules, nft_rules, sysctls
from agent.probes.base import CommandError, ProbeContext, kernel_module_present, run_command


class Skip(Exception):
    """This file cannot be written; ``str()`` is the reason."""


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _command(args: list[str], ctx: ProbeContext) -> bytes:
    try:
        return run_command(args, max(ctx.timeout, 10.0)).encode()
    except CommandError as exc:
        raise Skip(str(exc)) from None


def _local_routes(ctx: ProbeContext) -> bytes:
    """Both families' local tables in one file (the reader takes either); IPv6 may be
    disabled on the node, which costs only its part."""
    v4 = _command(["ip", "route", "show", "table", "local"], ctx)
    try:
        return v4 + _command(["ip", "-6", "route", "show", "table", "local"], ctx)
    except Skip:
        return v4


def _iptables(ctx: ProbeContext) -> bytes:
    try:
        chosen = nat_rules.select_backend(max(ctx.timeout, 10.0))
    except nat_rules.NatDumpError as exc:
        raise Skip(str(exc)) from None
    if chosen is None:
        raise Skip(nat_rules.NO_BINARY)
    return chosen[1].encode()


def _ip6tables(ctx: ProbeContext) -> bytes:
    """What the IPv6 rules probe reads: an empty file when there is no IPv6 table."""
    try:
        chosen = nat_rules.select_backend(max(ctx.timeout, 10.0), family=6)
    except nat_rules.NatDumpError as exc:
        raise Skip(str(exc)) from None
    if chosen is None:
        raise Skip(nat_rules.NO_BINARY6)
    return chosen[1].encode()


def _ipset(ctx: ProbeContext) -> bytes:
    if not kernel_module_present("ip_set"):
        # `ipset save` would make the kernel load ip_set; without it there are no sets.
        return b""
    try:
        return _command(["ipset", "save"], ctx)
    except Skip as exc:
        if "command not found" not in str(exc):
            raise
    # No binary: the netlink probe reads the same sets; render them as `ipset save`.
    result = ipsets_probe.collect(ctx)
    if result.value is None:
        raise Skip("; ".join(u.reason for u in result.unknowns) or "ipsets unreadable")
    return ipsets_probe.render_ipset_save(result.value).encode()  # type: ignore[arg-type]


def _ipvsadm(ctx: ProbeContext) -> bytes:
    # ipvsadm runs `modprobe ip_vs` when IPVS is missing: check first, never call it then.
    if not ipvs_probe.ipvs_available():
        raise Skip(ipvs_probe.NOT_LOADED)
    return _command(["ipvsadm", "-Ln"], ctx)


def _nft(ctx: ProbeContext) -> bytes:
    if not kernel_module_present("nf_tables"):
        raise Skip("nf_tables is not loaded: no nftables rules")
    try:
        text = nft_rules.read_table(max(ctx.timeout, 10.0))
    except CommandError as exc:
        raise Skip(nft_rules.NO_NFT if "command not found" in str(exc) else str(exc)) \
            from None
    if text is None:
        raise Skip("no table ip kube-proxy (kube-proxy is not in nftables mode)")
    return text.encode()


def _sysctl(ctx: ProbeContext) -> bytes:
    values, unknowns = sysctls.read_sysctls()
    if not values:
        raise Skip("; ".join(u.reason for u in unknowns) or "no sysctl readable")
    return sysctls.render_sysctl_txt(values).encode()


def _kube_proxy_metrics(ctx: ProbeContext) -> bytes:
    try:
        text, _ = kube_proxy_metrics.fetch(min(ctx.timeout, 5.0))
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise Skip(f"{kube_proxy_metrics.url()}: {exc or type(exc).__name__}") from None
    return text.encode()


def write_bundle(directory: str | os.PathLike[str], ctx: ProbeContext) -> list[tuple[str, str]]:
    """Write every bundle file into ``directory`` (created if missing).

    Returns (file name, "written" | "skipped: reason") for each file of
    bundle_files.ALL, in that order. Never raises for a source that fails.
    """
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    producers: dict[str, Callable[[], bytes]] = {
        bundle_files.IPTABLES: lambda: _iptables(ctx),
        bundle_files.IPSET: lambda: _ipset(ctx),
        bundle_files.IPVSADM: lambda: _ipvsadm(ctx),
        bundle_files.ROUTE_LOCAL: lambda: _local_routes(ctx),
        bundle_files.ADDR: lambda: _command(["ip", "-j", "addr", "show"], ctx),
        bundle_files.SYSCTL: lambda: _sysctl(ctx),
        bundle_files.NFT: lambda: _nft(ctx),
        bundle_files.IP6TABLES: lambda: _ip6tables(ctx),
        bundle_files.KUBE_PROXY_METRICS: lambda: _kube_proxy_metrics(ctx),
    }
    api_files = {"services": bundle_files.SERVICES, "node": bundle_files.NODE,
                 "ingresses": bundle_files.INGRESSES,
                 "kube-proxy": bundle_files.KUBE_PROXY_DAEMONSET}
    api_bodies: dict[str, bytes] = {}
    api_errors: dict[str, str] = {}
    if not ctx.use_kube_api:
        api_errors = dict.fromkeys(api_files.values(), kube_api.DISABLED)
    else:
        try:
            for raw in kube_api.fetch_raw(ctx):
                if raw.body is not None:
                    api_bodies[api_files[raw.what]] = raw.body if raw.what != "kube-proxy" \
                        else _reduced_daemon_set(raw.body)
                else:
                    api_errors[api_files[raw.what]] = raw.error or \
                        "no kube-proxy DaemonSet in kube-system"
        except Exception as exc:  # KubeUnavailable, ImportError: no API at all
            reason = (kube_api.NOT_INSTALLED if isinstance(exc, ImportError)
                      else str(exc) or type(exc).__name__)
            api_errors = dict.fromkeys(api_files.values(), reason)

    report: list[tuple[str, str]] = []
    for name in bundle_files.ALL:
        try:
            if name in producers:
                data = producers[name]()
            elif name in api_bodies:
                data = api_bodies[name]
            else:
                raise Skip(api_errors.get(name, "not produced"))
            _atomic_write(out_dir / name, data)
            report.append((name, "written"))
        except Skip as exc:
            report.append((name, f"skipped: {exc}"))
            _remove_stale(out_dir / name)
        except Exception as exc:  # a bundle is best effort: report, never a traceback
            report.append((name, f"skipped: {type(exc).__name__}: {exc}"))
            _remove_stale(out_dir / name)
    return report


def _remove_stale(path: Path) -> None:
    """A file from an earlier bundle in the same directory would pass for this node's
    current state; a skipped file must be absent instead."""
    with contextlib.suppress(OSError):
        path.unlink()


def _reduced_daemon_set(body: bytes) -> bytes:
    """kube-proxy's DaemonSet as a support ticket needs it: its name and its containers'
    names and images (its env, arguments and annotations stay out of the bundle)."""
    try:
        ds = json.loads(body)
        meta, spec = ds.get("metadata") or {}, (ds.get("spec") or {}).get("template") or {}
        containers = (spec.get("spec") or {}).get("containers") or []
        out = {"apiVersion": "apps/v1", "kind": "DaemonSet",
               "metadata": {k: meta[k] for k in ("name", "namespace", "labels") if k in meta},
               "spec": {"template": {"spec": {"containers": [
                   {k: c[k] for k in ("name", "image") if k in c}
                   for c in containers if isinstance(c, dict)]}}}}
    except (ValueError, AttributeError, TypeError):
        return body  # (not the object asked for: kept as sent, the reader says what it is)
    return (json.dumps(out, indent=2) + "\n").encode()
