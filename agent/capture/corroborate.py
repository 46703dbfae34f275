"""Kernel evidence that corroborates (or not) what a capture saw, read-only.

Five sources, each a sampler with ``start()`` and ``finish() -> Corroboration``:

- ``in_martian_src`` (``MartianSampler``): the delta of that column of
  ``/proc/net/stat/rt_cache``: one hex row per CPU, summed. The counter is global (every
  network namespace of the host adds to it) although the file sits under /proc/net.
  The kernel counts there both local-address sources and reverse-path failures.
- ``TcpExtIPReversePathFilter`` (``NetstatSampler``): the delta of that
  ``/proc/net/netstat`` counter, which is per network namespace.
- ``TcpExtEmbryonicRsts`` (``NetstatSampler``): resets that ended a half-open
  (SYN_RECV) connection of this namespace. A bypassed handshake ends so: the client's
  RST (a pod that expected the LB), or, for a health check from a local address that
  IPv6 (no martian drop) answers, the node's own RST after its SYN-ACK went to lo. A
  pod's half-open connections count in the pod's namespace (a NodePort DNATed to a pod:
  the node's RST to the pod's SYN-ACK moves the pod's counter, not this one).
- ``kernel log`` (``KernelLogWatcher``): new lines with "martian source" read from
  ``/dev/kmsg``, opened read-only and non-blocking and positioned at the end at start,
  so only what the kernel logs during the capture is seen; never written to.
- ``kfree_skb`` (``DropReasonTracer``): on kernels with skb drop reasons, the
  ``skb:kfree_skb`` tracepoint filtered to IP_INVALID_SOURCE / IP_LOCAL_SOURCE /
  IP_RPFILTER in the agent's own tracefs instance (``instances/loopback-agent-<pid>``),
  read from its ``trace_pipe`` and always removed at the end. The global instance's
  files are never opened for writing; tracefs is never mounted by the agent.

Every sampler says "unavailable, because ..." instead of raising. ``corroborators()``
runs all five around a capture (draining the log and the trace pipe in a background
thread so that bursts do not overflow them) and ``attach``es the results to a
``CaptureResult``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from agent.capture.model import CaptureResult, Corroboration

RT_CACHE = "/proc/net/stat/rt_cache"
NETSTAT = "/proc/net/netstat"
KMSG = "/dev/kmsg"
TRACEFS_ROOTS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
DROP_REASONS = ("IP_INVALID_SOURCE", "IP_LOCAL_SOURCE", "IP_RPFILTER")

SRC_MARTIAN = "in_martian_src"
SRC_RPFILTER = "TcpExtIPReversePathFilter"
SRC_EMBRYONIC_RST = "TcpExtEmbryonicRsts"
SRC_KLOG = "kernel log"
SRC_KFREE_SKB = "kfree_skb"


class Sampler(Protocol):
    source: str

    def start(self) -> None: ...

    def finish(self) -> Corroboration: ...


def _unavailable(source: str, why: str) -> Corroboration:
    return Corroboration(source, False, None, f"unavailable, because {why}")


def _why(e: OSError) -> str:
    return e.strerror or str(e)


# --- counters ------------------------------------------------------------------------


def parse_rt_cache(text: str) -> dict[str, int]:
    """``/proc/net/stat/rt_cache``: the header line names the columns, then one row of
    hex numbers per possible CPU; returns column -> sum over the CPUs."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty")
    names = lines[0]
    sums = dict.fromkeys(names, 0)
    for row in lines[1:]:
        if len(row) != len(names):
            raise ValueError(f"a row has {len(row)} fields for {len(names)} columns")
        for name, value in zip(names, row, strict=True):
            sums[name] += int(value, 16)
    return sums


def parse_netstat(text: str) -> dict[str, int]:
    """``/proc/net/netstat`` (or ``snmp``): pairs of "Prefix: names" / "Prefix: values"
    lines; returns "PrefixName" -> value (e.g. "TcpExtIPReversePathFilter")."""
    out: dict[str, int] = {}
    lines = text.splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        prefix, _, rest = names.partition(":")
        vprefix, _, vrest = values.partition(":")
        if prefix != vprefix:
            raise ValueError(f"unpaired lines {prefix!r} / {vprefix!r}")
        for name, value in zip(rest.split(), vrest.split(), strict=True):
            out[prefix + name] = int(value)
    return out


class _CounterSampler:
    """Delta of one counter between start() and finish()."""

    source = ""
    scope = ""  # said in the detail, so nobody mistakes a global counter for the node's

    def __init__(self, path: str) -> None:
        self.path = path
        self._before: int | None = None
        self._error = ""

    def _read(self) -> int:
        raise NotImplementedError

    def start(self) -> None:
        try:
            self._before = self._read()
        except (OSError, ValueError, KeyError) as e:
            self._error = self._explain(e)

    def finish(self) -> Corroboration:
        if self._before is None:
            return _unavailable(self.source, self._error or "start() was not called")
        try:
            after = self._read()
        except (OSError, ValueError, KeyError) as e:
            return _unavailable(self.source, self._explain(e))
        return Corroboration(self.source, True, after - self._before,
                             f"delta over the capture; {self.scope}")

    def _explain(self, e: Exception) -> str:
        if isinstance(e, KeyError):
            return f"{self.path} has no {e.args[0]} counter on this kernel"
        if isinstance(e, OSError):
            return f"{self.path} cannot be read: {_why(e)}"
        return f"{self.path} is not in the expected format: {e}"


class MartianSampler(_CounterSampler):
    """``in_martian_src`` from ``/proc/net/stat/rt_cache`` (summed over the CPUs)."""

    source = SRC_MARTIAN
    scope = ("global: counts martian-source drops (local-address sources and reverse-path "
             "failures) of every network namespace on the host, not only this node's")

    def __init__(self, path: str = RT_CACHE) -> None:
        super().__init__(path)

    def _read(self) -> int:
        return parse_rt_cache(Path(self.path).read_text())["in_martian_src"]


class NetstatSampler(_CounterSampler):
    """``TcpExtIPReversePathFilter`` (or another netstat counter) of the reader's
    network namespace."""

    scope = "this network namespace only"

    def __init__(self, path: str = NETSTAT, counter: str = SRC_RPFILTER) -> None:
        super().__init__(path)
        self.counter = counter
        self.source = counter

    def _read(self) -> int:
        return parse_netstat(Path(self.path).read_text())[self.counter]


# --- kernel log ----------------------------------------------------------------------


def kmsg_text(record: bytes) -> str:
    """The message of one /dev/kmsg record ("prio,seq,usec,flags;message\\n" followed by
    optional " KEY=value" dictionary lines)."""
    text = record.decode("utf-8", errors="replace")
    _, _, message = text.partition(";")
    return message.split("\n", 1)[0]


class KernelLogWatcher:
    """Lines containing ``pattern`` that the kernel logs between start() and finish()."""

    source = SRC_KLOG

    def __init__(self, path: str = KMSG, pattern: str = "martian source", keep: int = 5,
                 log_martians_path: str = "/proc/sys/net/ipv4/conf/all/log_martians") -> None:
        self.path = path
        self.pattern = pattern
        self.keep = keep
        self.log_martians_path = log_martians_path
        self.lines: list[str] = []  # the first ``keep`` distinct matching lines
        self.count = 0
        self.lost = 0  # records overwritten before we read them (EPIPE)
        self._fd: int | None = None
        self._error = ""
        self._lock = threading.Lock()

    def start(self) -> None:
        try:
            # O_RDONLY: reading is all we do; O_NONBLOCK: read() says EAGAIN at the end
            # instead of waiting for the next message.
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self._error = f"{self.path} cannot be opened: {_why(e)}"
            if e.errno in (errno.EPERM, errno.EACCES):
                self._error += " (needs CAP_SYSLOG, or kernel.dmesg_restrict=0)"
            return
        try:
            os.lseek(fd, 0, os.SEEK_END)  # only what is logged from now on
        except OSError as e:
            os.close(fd)
            self._error = f"{self.path} cannot seek to the end: {_why(e)}"
            return
        self._fd = fd

    def poll(self) -> None:
        """Read every record logged since the last call (cheap when there is none)."""
        with self._lock:
            if self._fd is None:
                return
            while True:
                try:
                    record = os.read(self._fd, 16384)  # one record per read()
                except BlockingIOError:
                    return
                except BrokenPipeError:  # the ring wrapped past us; reading goes on
                    self.lost += 1
                    continue
                except OSError as e:
                    self._error = f"reading {self.path} failed: {_why(e)}"
                    os.close(self._fd)
                    self._fd = None
                    return
                if not record:
                    return
                message = kmsg_text(record)
                if self.pattern in message:
                    self.count += 1
                    if len(self.lines) < self.keep and message not in self.lines:
                        self.lines.append(message)

    def finish(self) -> Corroboration:
        self.poll()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return _unavailable(self.source, self._error or "start() was not called")
        os.close(fd)
        if self._error:
            return _unavailable(self.source, self._error)
        parts = [f'{self.count} new "{self.pattern}" lines in the kernel log (all network '
                 "namespaces log there; the kernel rate-limits these messages)"]
        if self.lost:
            parts.append(f"{self.lost} records were overwritten before they were read")
        if not self.count and self._log_martians() == "0":
            parts.append("net.ipv4.conf.all.log_martians is 0 here: the kernel logs martians "
                         "only for interfaces that have it set")
        parts += self.lines
        return Corroboration(self.source, True, self.count, "; ".join(parts))

    def _log_martians(self) -> str:
        try:
            return Path(self.log_martians_path).read_text().strip()
        except OSError:
            return ""


# --- the skb:kfree_skb tracepoint ----------------------------------------------------

_SYMBOL = re.compile(r'\{\s*(\d+)\s*,\s*"(\w+)"\s*\}')
_REASON = re.compile(rb"reason: (\w+)")
_LOCATION = re.compile(r"location=(\S+)")
_OVERRUN = re.compile(r"^(overrun|dropped events): (\d+)", re.M)


def drop_reason_values(format_text: str) -> dict[str, int]:
    """Drop reason name -> number, from the ``__print_symbolic(REC->reason, ...)`` table
    of the kfree_skb format file; empty when the event has no ``reason`` field."""
    if not re.search(r"field:[^;]*\breason;", format_text):
        return {}
    start = format_text.find("__print_symbolic(REC->reason")
    if start < 0:
        return {}
    return {name: int(num) for num, name in _SYMBOL.findall(format_text[start:])}


def find_tracefs(roots: Sequence[str] = TRACEFS_ROOTS) -> str | None:
    """The first of ``roots`` where tracefs is mounted (it has ``instances``)."""
    for root in roots:
        if os.path.isdir(os.path.join(root, "instances")):
            return root
    return None


class DropReasonTracer:
    """Counts skb drops by reason in the agent's own tracefs instance.

    A context manager: the instance is created on entry (``start``) and removed on exit,
    also when the block raises; ``finish`` (idempotent) reads the last events and removes
    it too. The tracepoint fires for every network namespace (its filter cannot select
    one), so the counts are host-wide; the detail says so.
    """

    source = SRC_KFREE_SKB

    def __init__(self, roots: Sequence[str] = TRACEFS_ROOTS,
                 reasons: Sequence[str] = DROP_REASONS, buffer_kb: int = 256,
                 keep: int = 3) -> None:
        self.roots = tuple(roots)
        self.reasons = tuple(reasons)
        self.buffer_kb = buffer_kb  # per CPU; the default would be ~1.4 MB per CPU
        self.keep = keep
        self.counts: dict[str, int] = {}
        self.samples: list[str] = []
        self.instance: str | None = None  # path of our instance while it exists
        self.values: dict[str, int] = {}  # reason -> number used in the filter
        self._fd: int | None = None
        self._tail = b""
        self._error = ""
        self._result: Corroboration | None = None
        self._overrun = 0
        self._others: list[str] = []
        self._lock = threading.Lock()

    def __enter__(self) -> DropReasonTracer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def start(self) -> None:
        root = find_tracefs(self.roots)
        if root is None:
            self._error = ("tracefs is not mounted (looked at " + ", ".join(self.roots) +
                           "); the agent does not mount it")
            return
        fmt_path = os.path.join(root, "events", "skb", "kfree_skb", "format")
        try:
            fmt = Path(fmt_path).read_text()
        except OSError as e:
            self._error = f"{fmt_path} cannot be read: {_why(e)}"
            return
        known = drop_reason_values(fmt)
        if not known:
            self._error = "skb:kfree_skb has no drop reason on this kernel (Linux 5.17+ has)"
            return
        self.values = {r: known[r] for r in self.reasons if r in known}
        if not self.values:
            self._error = "this kernel names none of the drop reasons " + ", ".join(self.reasons)
            return
        self.counts = dict.fromkeys(self.values, 0)
        instances = os.path.join(root, "instances")
        try:
            self.instance = self._mkdir(instances)
            # Reported, never removed: they may belong to an agent in another pid
            # namespace (a DaemonSet pod next to a debug pod) that is still running.
            self._others = sorted(n for n in os.listdir(instances)
                                  if n.startswith("loopback-agent-")
                                  and n != os.path.basename(self.instance))
        except OSError as e:
            self._error = f"cannot create a tracefs instance in {root}/instances: {_why(e)}"
            return
        try:
            self._configure()
        except OSError as e:
            self._error = f"cannot set up the tracefs instance {self.instance}: {_why(e)}"
            self._remove()

    def _mkdir(self, instances: str) -> str:
        base = os.path.join(instances, f"loopback-agent-{os.getpid()}")
        for n in range(100):
            path = base if n == 0 else f"{base}-{n}"
            try:
                os.mkdir(path)
                return path
            except FileExistsError:  # another tracer of this process, or a stale one
                continue
        raise OSError(errno.EEXIST, "no free instance name", base)

    def _configure(self) -> None:
        assert self.instance is not None
        inst = self.instance
        _write(os.path.join(inst, "buffer_size_kb"), str(self.buffer_kb))
        event = os.path.join(inst, "events", "skb", "kfree_skb")
        _write(os.path.join(event, "filter"),
               " || ".join(f"reason == {v}" for v in self.values.values()))
        _write(os.path.join(event, "enable"), "1")
        self._fd = os.open(os.path.join(inst, "trace_pipe"),
                           os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)

    def poll(self) -> None:
        """Count what the trace pipe holds now."""
        with self._lock:
            if self._fd is None:
                return
            while True:
                try:
                    chunk = os.read(self._fd, 65536)
                except BlockingIOError:
                    return
                except OSError as e:
                    self._error = f"reading trace_pipe failed: {_why(e)}"
                    return
                if not chunk:
                    return
                data = self._tail + chunk
                cut = data.rfind(b"\n") + 1
                self._tail = data[cut:]
                self._count(data[:cut])

    def _count(self, data: bytes) -> None:
        # bytes-level regex: a flood of drops must not cost a Python loop per event
        for reason in _REASON.findall(data):
            name = reason.decode()
            self.counts[name] = self.counts.get(name, 0) + 1
        if len(self.samples) < self.keep:
            # where in the kernel it dropped: distinct (reason, function) pairs
            for line in data.decode(errors="replace").splitlines()[:100]:
                loc = _LOCATION.search(line)
                reason = line.rsplit("reason: ", 1)[-1] if "reason: " in line else "?"
                sample = f"{reason} at {loc.group(1) if loc else '?'}"
                if sample not in self.samples and len(self.samples) < self.keep:
                    self.samples.append(sample)

    def finish(self) -> Corroboration:
        if self._result is not None:
            return self._result
        if self.instance is None:
            self._result = _unavailable(self.source, self._error or "start() was not called")
            return self._result
        self.poll()
        self._overrun = self._read_overrun()
        removed = self._remove()
        if self._error:
            self._result = _unavailable(self.source, self._error)
            return self._result
        total = sum(self.counts.values())
        per = ", ".join(f"{name}={n}" for name, n in sorted(self.counts.items()))
        parts = [f"skb drops by reason: {per}; counted in the agent's own tracefs instance, "
                 "host-wide (the tracepoint fires for every network namespace and cannot be "
                 "filtered by one)"]
        if self._overrun:
            parts.append(f"{self._overrun} events were lost to a full trace buffer: "
                         "counts are lower bounds")
        if removed:
            parts.append(removed)
        if self._others:
            parts.append("other loopback-agent instances exist (another agent running, or "
                         "left by one that was killed): " + ", ".join(self._others))
        parts += self.samples
        self._result = Corroboration(self.source, True, total, "; ".join(parts))
        return self._result

    def _read_overrun(self) -> int:
        assert self.instance is not None
        total = 0
        per_cpu = os.path.join(self.instance, "per_cpu")
        with contextlib.suppress(OSError):
            for cpu in os.listdir(per_cpu):
                with contextlib.suppress(OSError):
                    stats = Path(per_cpu, cpu, "stats").read_text()
                    total += sum(int(n) for _, n in _OVERRUN.findall(stats))
        return total

    def _remove(self) -> str:
        """Close the pipe, disable the event, remove the instance; "" when it went,
        else why it did not (said in the detail: it is left for a human to remove)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        inst, self.instance = self.instance, None
        if inst is None:
            return ""
        with contextlib.suppress(OSError):
            _write(os.path.join(inst, "events", "skb", "kfree_skb", "enable"), "0")
        last: OSError | None = None
        for _ in range(50):  # EBUSY while a reader is still leaving trace_pipe
            try:
                os.rmdir(inst)
                return ""
            except FileNotFoundError:
                return ""
            except OSError as e:
                last = e
                if e.errno != errno.EBUSY:
                    break
                time.sleep(0.02)
        return f"could not remove the tracefs instance {inst}: {_why(last) if last else '?'}"


def _write(path: str, text: str) -> None:
    # Only ever called on files inside our own instance.
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# --- all of them around a capture ----------------------------------------------------


class Corroborators:
    """Runs samplers around a capture; a background thread drains the ones that buffer
    (kernel log, trace pipe) every ``poll_interval`` seconds."""

    def __init__(self, samplers: Sequence[Sampler], poll_interval: float = 0.5) -> None:
        self.samplers = tuple(samplers)
        self.poll_interval = poll_interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._results: tuple[Corroboration, ...] | None = None

    def start(self) -> None:
        for s in self.samplers:
            # a sampler that broke here says so in finish() ("start() was not called")
            with contextlib.suppress(Exception):
                s.start()
        if any(hasattr(s, "poll") for s in self.samplers):
            self._thread = threading.Thread(target=self._drain, name="corroborate",
                                            daemon=True)
            self._thread.start()

    def _drain(self) -> None:
        while not self._stop.wait(self.poll_interval):
            self.poll()

    def poll(self) -> None:
        for s in self.samplers:
            poll = getattr(s, "poll", None)
            if poll is not None:
                poll()

    def finish(self) -> tuple[Corroboration, ...]:
        """Stop and read every sampler (idempotent)."""
        if self._results is None:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            results = []
            for s in self.samplers:
                try:
                    results.append(s.finish())
                except Exception as e:  # a sampler must never break the verdict
                    results.append(_unavailable(s.source, f"it failed: {e!r}"))
            self._results = tuple(results)
        return self._results

    def attach(self, result: CaptureResult) -> CaptureResult:
        """``result`` with the corroboration appended."""
        return replace(result, corroboration=result.corroboration + self.finish())


def default_samplers(proc_net: str = "/proc/net", kmsg: str = KMSG,
                     tracefs_roots: Sequence[str] = TRACEFS_ROOTS) -> list[Sampler]:
    """The five samplers; ``proc_net`` may be ``/proc/<pid>/net`` to read the counters
    of another process's network namespace."""
    return [MartianSampler(os.path.join(proc_net, "stat", "rt_cache")),
            NetstatSampler(os.path.join(proc_net, "netstat")),
            NetstatSampler(os.path.join(proc_net, "netstat"), SRC_EMBRYONIC_RST),
            KernelLogWatcher(kmsg),
            DropReasonTracer(tracefs_roots)]


@contextlib.contextmanager
def corroborators(samplers: Sequence[Sampler] | None = None,
                  poll_interval: float = 0.5) -> Iterator[Corroborators]:
    """Start the samplers (``default_samplers()`` unless given); on exit finish them all,
    which also removes the tracefs instance, whatever happened in the block."""
    corr = Corroborators(default_samplers() if samplers is None else samplers, poll_interval)
    try:
        corr.start()
        yield corr
    finally:
        corr.finish()


def by_source(results: Sequence[Corroboration]) -> Mapping[str, Corroboration]:
    return {c.source: c for c in results}
