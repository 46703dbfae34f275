"""Run a command as root inside a VM booted on a stock Debian kernel, which has what
this development machine's kernel lacks (IP_VS, ``dummy``), as production nodes do.

The kernel is Debian's ``linux-image-amd64`` (the package it depends on, e.g.
``linux-image-6.1.0-56-amd64``), fetched with ``apt-get download`` and unpacked with
``dpkg -x`` into a cache directory (never installed into this machine's /boot), with
``depmod`` run there so the guest can load modules. virtme-ng boots it under qemu with
the host's filesystem shared read-only (writes land in a throw-away overlay), so the
guest runs this checkout's venv and the host's iptables, ipset and ipvsadm.

How the guest is reached, and why:

- ``--disable-kvm --force-9p``: ``/dev/kvm`` here is a paravirtual device on which a
  stock kernel never boots; software emulation does (about 10 s to the guest command).
- The guest's output and exit status come back through a shared writable directory
  (``--rwdir``): without udev, vng's script I/O ports are missing, its own output falls
  back to the console and it exits 255 even on success. Its console goes to a log file
  that errors quote.
- A timeout kills qemu's whole process group.
- vng mounts the root share uncached, so under emulation every Python start re-reads
  its modules from the host (about 6 s to import the agent). The trees the guest runs
  from (/usr, Python's prefix, the venv and the checkout) are therefore shared again on
  their own 9p devices and mounted over themselves with ``cache=loose`` (about 1.3 s);
  they do not change while the guest runs.

Nothing here touches the host's network: the guest has no network device (``-net
none``) and whatever it configures lives in its own kernel.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

META_PACKAGE = "linux-image-amd64"
CACHE_ENV = "LOOPBACK_AGENT_VM_CACHE"
KVM_ENV = "LOOPBACK_AGENT_VM_KVM"
DEFAULT_CACHE = Path.home() / ".cache" / "loopback-agent" / "vm"
# what the guest loads before anything else, as kube-proxy does on an IPVS node
# (and br_netfilter, which every Kubernetes node loads: bridged pod-to-pod replies must
# pass conntrack to be un-NATed; this machine's kernel has it built in)
GUEST_MODULES = ("ip_vs", "ip_vs_rr", "dummy", "br_netfilter")


# VMs booted by this process and not yet reaped: killed when it exits, also when a
# caller (a background thread, see tests/vm_guest.py) is still waiting on one
_RUNNING: set[subprocess.Popen[bytes]] = set()
_RUNNING_LOCK = threading.Lock()


class VmError(RuntimeError):
    """The VM could not be prepared, booted, or did not report back."""


@dataclass(frozen=True)
class Kernel:
    package: str  # e.g. linux-image-6.1.0-56-amd64
    package_version: str  # e.g. 6.1.192-2
    release: str  # uname -r in the guest, e.g. 6.1.0-56-amd64
    image: Path  # the vmlinuz inside the cache
    root: Path  # the unpacked package: boot/, lib/modules/RELEASE/ (with modules.dep)


@dataclass(frozen=True)
class VmResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # boot to power-off, as the host saw it
    outdir: Path  # the shared writable directory (files the guest left there)


def _run(args: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]


def _apt(args: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """An apt command; on failure once more after ``apt-get update`` (a fresh machine
    may have no package lists yet)."""
    r = _run(args, cwd=cwd)
    if r.returncode != 0:
        upd = _run(["apt-get", "update", "-qq"])
        if upd.returncode != 0:
            raise VmError(f"apt-get update failed: {upd.stderr.strip()}")
        r = _run(args, cwd=cwd)
    if r.returncode != 0:
        raise VmError(f"{' '.join(args)} failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def kernel_package() -> tuple[str, str]:
    """The versioned image package ``linux-image-amd64`` depends on, and its version."""
    show = _apt(["apt-cache", "show", "--no-all-versions", META_PACKAGE]).stdout
    m = re.search(r"^Depends:.*?\b(linux-image-[0-9][^\s,(]*)", show, re.M)
    if not m:
        raise VmError(f"cannot tell which kernel {META_PACKAGE} depends on:\n{show}")
    package = m.group(1)
    info = _apt(["apt-cache", "show", "--no-all-versions", package]).stdout
    v = re.search(r"^Version: (\S+)", info, re.M)
    if not v:
        raise VmError(f"no version for {package}:\n{info}")
    return package, v.group(1)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _found(root: Path, package: str, version: str) -> Kernel | None:
    images = sorted((root / "boot").glob("vmlinuz-*"))
    if len(images) != 1:
        return None
    release = images[0].name.removeprefix("vmlinuz-")
    if not (root / "lib" / "modules" / release / "modules.dep").is_file():
        return None
    return Kernel(package, version, release, images[0], root)


def ensure_kernel(cache: Path | None = None) -> Kernel:
    """The stock kernel unpacked in ``cache`` (default: $LOOPBACK_AGENT_VM_CACHE or
    ~/.cache/loopback-agent/vm), fetched on first use."""
    if missing := missing_tools():
        raise VmError("cannot prepare the VM, missing: " + "; ".join(missing))
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    # one fetch at a time (a thread or another run): a second one would replace the
    # tree a booting guest reads its modules from
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_kernel(cache)


def _ensure_kernel(cache: Path) -> Kernel:
    try:
        package, version = kernel_package()
    except VmError as exc:
        # offline, or no package lists and no root: the newest kernel already cached
        cached = sorted((k for d in cache.glob("linux-image-*_*") if (k := _found(
            d, *d.name.split("_", 1))) is not None), key=lambda k: k.root.stat().st_mtime)
        if cached:
            return cached[-1]
        raise VmError(f"{exc}; and no kernel is cached in {cache}") from None
    root = cache / f"{package}_{version}"
    kernel = _found(root, package, version)
    if kernel:
        return kernel
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    try:
        _apt(["apt-get", "download", f"{package}={version}"], cwd=work)
        debs = list(work.glob("*.deb"))
        if len(debs) != 1:
            raise VmError(f"apt-get download {package} left {debs}")
        unpacked = work / "root"
        r = _run(["dpkg", "-x", str(debs[0]), str(unpacked)])
        if r.returncode != 0:
            raise VmError(f"dpkg -x {debs[0].name} failed: {r.stderr.strip()}")
        releases = [p.name for p in (unpacked / "lib" / "modules").iterdir()]
        if len(releases) != 1:
            raise VmError(f"{debs[0].name} holds modules for {releases}")
        # Debian's packages leave modules.dep to the postinst; the guest's modprobe needs it
        r = _run(["depmod", "-b", str(unpacked), releases[0]])
        if r.returncode != 0:
            raise VmError(f"depmod failed: {r.stderr.strip()}")
        shutil.rmtree(root, ignore_errors=True)
        unpacked.rename(root)  # whole or not at all: a killed fetch leaves only .fetch-*
    finally:
        shutil.rmtree(work, ignore_errors=True)
    kernel = _found(root, package, version)
    if not kernel:
        raise VmError(f"{root} has no single vmlinuz with modules.dep")
    return kernel


def _vng() -> str:
    here = Path(sys.executable).parent / "vng"  # the venv's, when run from it
    found = str(here) if here.exists() else shutil.which("vng")
    if not found:
        raise VmError("vng not found: pip install virtme-ng (make venv does)")
    return found


def missing_tools() -> list[str]:
    """What the host needs to fetch the kernel and boot the guest; empty when all is
    there (make deps installs them)."""
    need = {"qemu-system-x86_64": "Debian package qemu-system-x86",
            "busybox": "Debian package busybox-static (vng builds the initramfs with it)",
            "depmod": "Debian package kmod", "apt-get": "apt", "apt-cache": "apt",
            "dpkg": "dpkg",
            "file": "Debian package file (vng reads the kernel's version with it)",
            "strings": "Debian package binutils (vng's fallback when file cannot tell)"}
    return [f"{tool} ({why})" for tool, why in need.items() if not shutil.which(tool)]


def cached_trees(cwd: Path) -> list[Path]:
    """The host trees the guest runs code from, without one inside another."""
    trees = sorted({Path("/usr"), Path(sys.base_prefix).resolve(),
                    Path(sys.prefix).resolve(), cwd})
    return [t for t in trees if not any(o != t and o in t.parents for o in trees)]


def _share_args(trees: Sequence[Path]) -> tuple[list[str], str]:
    """qemu options exporting ``trees`` read-only, and the guest's mounts of them."""
    opts, mounts = [], []
    for i, tree in enumerate(trees):
        tag = f"lbvm{i}"
        opts.append(f"--qemu-opts=-fsdev local,id={tag},path={tree},security_model=none,"
                    f"readonly=on,multidevs=remap -device virtio-9p-pci,fsdev={tag},"
                    f"mount_tag={tag}")
        mounts.append(f"mount -t 9p -o ro,trans=virtio,version=9p2000.L,cache=loose,"
                      f"msize=524288 {tag} {shlex.quote(str(tree))} || setup_failed 96\n")
    return opts, "".join(mounts)


def run(script: str, *, kernel: Kernel, timeout: float = 600, cwd: Path | None = None,
        env: Mapping[str, str] | None = None, cpus: int = 2, memory: str = "2G",
        log: Path | None = None) -> VmResult:
    """Boot ``kernel`` and run ``script`` (sh) as root in ``cwd`` (default: here), with
    ``env`` added and the modules of GUEST_MODULES loaded. Returns its exit status and
    output; raises VmError when the guest does not report back within ``timeout``.

    The guest sees the host's files read-only; the directory in ``VmResult.outdir`` (and
    $VM_OUT inside the guest) is the one place it writes to the host: the caller removes
    it (on VmError it is kept for a look, and named in the message).
    """
    if missing := missing_tools():
        raise VmError("cannot boot the VM, missing: " + "; ".join(missing))
    out = Path(tempfile.mkdtemp(prefix="lbvm-"))
    q = shlex.quote(str(out))
    cwd = (cwd or Path.cwd()).resolve()
    exports = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
               "VM_OUT": str(out), **(env or {})}
    (out / "script.sh").write_text(script)
    modules = " ".join(GUEST_MODULES)
    shares, mounts = _share_args(cached_trees(cwd))
    # modules come from the cache, whatever is mounted over /lib: for the guest's own
    # modprobe calls and the kernel's on-demand loading (nf_tables, ip_set, veth, ...)
    (out / "modprobe").write_text(
        f'#!/bin/sh\nexec /sbin/modprobe -d {shlex.quote(str(kernel.root))} "$@"\n')
    (out / "modprobe").chmod(0o755)
    # 95-97: the guest could not be set up (mount, modules, cwd); reported like the
    # script's own status, with the reason in stderr
    (out / "run.sh").write_text(
        f"setup_failed() {{ echo \"guest setup failed ($1)\" > {q}/stderr; "
        f"echo $1 > {q}/rc; exit; }}\n"
        + mounts
        + f"echo {q}/modprobe > /proc/sys/kernel/modprobe\n"
        + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in exports.items())
        + f"cd {shlex.quote(str(cwd))} || setup_failed 97\n"
        + f"{q}/modprobe -a {modules} > {q}/modprobe.log 2>&1 || setup_failed 95\n"
        # bounded inside too: an orphaned qemu (its caller killed) stops by itself
        + f"timeout -s KILL {int(timeout) + 1} sh {q}/script.sh > {q}/stdout "
          f"2> {q}/stderr < /dev/null\n"
        + f"echo $? > {q}/rc.tmp && mv {q}/rc.tmp {q}/rc\n")
    console = log or out / "console.log"
    # KVM only when asked: here /dev/kvm is a paravirtual device a stock kernel never
    # boots on; on a host with real KVM, LOOPBACK_AGENT_VM_KVM=1 saves the emulation
    kvm = [] if os.environ.get(KVM_ENV) == "1" else ["--disable-kvm"]
    args = [_vng(), "--run", str(kernel.image), *kvm, "--force-9p",
            "--cpus", str(cpus), "--memory", memory, f"--rwdir={out}", *shares,
            "--exec", f"sh {q}/run.sh"]
    vng_env = {**os.environ,
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    started = time.monotonic()
    with open(console, "w") as con:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=con, stderr=con,
                                env=vng_env, start_new_session=True, preexec_fn=_die_with_parent)
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise VmError(f"the VM did not finish within {timeout:.0f} s; console: "
                          f"{_tail(console)}; guest stderr: {_tail(out / 'stderr')} "
                          f"(all in {out})") from None
        finally:
            _kill(proc)
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
    seconds = time.monotonic() - started
    rc_file = out / "rc"
    if not rc_file.exists():
        raise VmError(f"the guest never reported an exit status (vng exit {proc.returncode}, "
                      f"{seconds:.0f} s); console: {_tail(console)} (all in {out})")
    return VmResult(returncode=int(rc_file.read_text()),
                    stdout=(out / "stdout").read_text(errors="replace"),
                    stderr=(out / "stderr").read_text(errors="replace"),
                    seconds=seconds, outdir=out)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the caller dies. That reaches vng only; qemu (which
    virtme-run, vng's child, execs) would go on, so the guest also bounds its own
    command with ``timeout`` and powers off by itself (see run)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@atexit.register
def _kill_running() -> None:
    """qemu outlives vng (see _die_with_parent): a caller that exits while a guest runs
    takes the guest's process group with it rather than leaving emulation spinning."""
    with _RUNNING_LOCK:
        for proc in list(_RUNNING):
            _kill(proc)
        _RUNNING.clear()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """qemu and whatever vng left in its session, also after a normal exit."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(none)"
    return text[-chars:].strip() or "(empty)"
