"""The probe contract: a named, read-only reader of one source on the node.

Like a Prometheus node_exporter collector, each probe module registers one ``Probe``
at import time; ``agent.probes.collect_live`` runs them all. A probe returns facts
(``ProbeResult.value``) or says why it could not (``ProbeResult.unknowns``); it must
never change the node (no iptables/ipset/route/sysctl writes, no module loading).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.probes import memory_limit
from agent.snapshot import NodeSnapshot, Unknown


@dataclass(frozen=True)
class ProbeContext:
    """What every probe may need to know about the run (never about the node)."""

    node_name: str | None = None
    use_kube_api: bool = True
    kubeconfig: str | None = None
    timeout: float = 5.0  # seconds, for each subprocess / API request
    # A running agent.kubewatch.KubeInformer (the daemon's): the kube_api probe reads its
    # memory instead of asking the API server every cycle.
    kube_cache: object | None = None
    # the daemon's reads of the previous cycle: a source whose change marker is the same
    # is not read again (None: read everything, e.g. a one-off `check`)
    cache: ReadCache | None = field(default=None, compare=False)
    # long reads (the rules dump) at the lowest CPU and I/O priority: the daemon's, not
    # a `check` someone waits for
    background: bool = False


@dataclass(frozen=True)
class ProbeResult:
    """``value`` is None when the source could not be read; ``unknowns`` says why.

    A probe that fills several snapshot fields returns a tuple with one value per
    field (in ``Probe.fields`` order), or None for "none of them could be read".
    """

    value: object | None
    unknowns: tuple[Unknown, ...] = ()
    # a failure the same read would repeat while the source is unchanged (the kernel
    # killed it for memory): a daemon's ReadCache keeps it like a partial read, rather
    # than an out-of-memory kill on the node every cycle
    repeats: bool = False


@dataclass(frozen=True)
class Probe:
    name: str  # also the Unknown.source used when the probe crashes
    field: str | tuple[str, ...]  # the NodeSnapshot field(s) it fills
    collect: Callable[[ProbeContext], ProbeResult]

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.field,) if isinstance(self.field, str) else tuple(self.field)


REGISTRY: list[Probe] = []


class ReadCache:
    """The last read of each expensive source, keyed by its change marker.

    ``read(source, marker, collect)`` takes the marker *before* reading, so a change made
    during a read shows as a new marker next time. A read that failed (value None) is not
    kept: the next cycle tries again, unless the failure ``repeats``; that one, and one
    that said what it could not read (unknowns, e.g. a dump that overran its budget), is
    reused at most ``retry_after`` times. A
    marker that cannot be taken (it raises) means "it may have changed": never reused.
    Where the marker moved, ``content(marker)`` (a digest of what the source holds,
    costlier; given the marker just taken, whose cheap parts it may keep)
    may still say it holds the same: the read is reused then, and is not out of date.
    Its CPU counts with the reads' in ``cpu_share``.
    Not thread-safe: one daemon cycle at a time uses it.

    ``cpu_share``: sources whose marker moved are read again only once the last cycle
    that read any (its reads' CPU, the agent's and its commands', and the diagnoses
    ``charge``d to it) fits that share of one CPU since it began; until then their last
    reads stand, each with an unknown saying so (``stale``). A cycle reads every changed
    source or none, so the reads stay one picture of the node. On a 10k-service
    iptables-nft node kube-proxy rewrites the rules on every endpoint change, and a read
    and its walk cost some 40 s of CPU: done on every change, that is a core all day on
    every such node of the fleet.
    """

    def __init__(self, retry_after: int = 10, cpu_share: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after = retry_after
        self.cpu_share = cpu_share  # None: read every change at once (tests, one-offs)
        self._clock = clock
        # source -> (its marker, the read, reuses left, its content digest or None)
        self._last: dict[str, tuple[object, ProbeResult, float, object]] = {}
        self.reused: dict[str, int] = {}  # source -> reads saved (metrics, logs, tests)
        self.read_count: dict[str, int] = {}  # source -> reads done
        self.marker_seconds: dict[str, float] = {}  # source -> last marker's cost
        self.read_cpu: dict[str, float] = {}  # source -> CPU seconds of its last read
        # the last cycle that read: when it began (clock, wall clock), its CPU seconds
        self._window: tuple[float, float, float] | None = None
        self._said: tuple[float, float, float] | None = None  # (window, due, CPU) put off
        self.cycle_reads: set[str] = set()  # sources read again in this cycle (begin_cycle)
        self.stale: set[str] = set()  # sources put off in this cycle
        self.deferred: dict[str, int] = {}  # source -> changed reads put off (metrics, tests)
        self._due: bool | None = None  # is this cycle past the due time (asked once)
        self.same_content: dict[str, int] = {}  # source -> moved markers found unchanged
        self._content_next: dict[str, float] = {}  # source -> when its digest may be taken
        self._changed: set[str] = set()  # sources a digest found changed since their read

    def begin_cycle(self) -> None:
        self.cycle_reads = set()
        self.stale = set()
        self._due = None

    def read(self, source: str, marker: Callable[[], object],
             collect: Callable[[], ProbeResult],
             content: Callable[[object], object] | None = None) -> ProbeResult:
        start = time.monotonic()
        try:
            key: object = marker()
        except Exception:  # an unreadable marker: read the source (reused never)
            key = None
        self.marker_seconds[source] = time.monotonic() - start
        last = self._last.get(source)
        if key is not None and last is not None and last[0] == key and last[2] > 0:
            self._last[source] = (key, last[1], last[2] - 1, last[3])
            self.reused[source] = self.reused.get(source, 0) + 1
            return last[1]
        digest: object = None
        if content is not None and key is not None and last is not None and \
                last[3] is not None and last[2] > 0 and source not in self._changed and \
                self._content_due(source):
            # the marker moved, yet the source may hold what it held: a commit that wrote
            # the same rules again (kube-proxy's syncs do, every one)
            digest, spent = self._content(source, content, key)
            self.charge(spent)  # (within the share the reads take, on the last read's)
            if digest is not None and digest == last[3]:
                self._last[source] = (key, last[1], last[2] - 1, digest)
                self.reused[source] = self.reused.get(source, 0) + 1
                self.same_content[source] = self.same_content.get(source, 0) + 1
                return last[1]
            # changed: no digest again until it is read (each would only say so again)
            self._changed.add(source)
        put_off = self._put_off(source, key, last)
        if put_off is not None:
            return put_off
        spent = 0.0
        if content is not None and key is not None and digest is None:
            digest, spent = self._content(source, content, key)  # (before the read, as key)
        # the old read goes before the new one is made: a 10k-service node's listing is
        # tens of MB of text, held twice at the read's peak otherwise
        self._last.pop(source, None)
        self._changed.discard(source)
        # a read of the node again (not of a source that failed last time, whose retries
        # neither open a window nor make the others read)
        again = last is not None or self._window is None
        del last
        if again and not self.cycle_reads:  # the first such read of this cycle: a window
            self._window = (self._clock(), time.time(), 0.0)
        cpu = _cpu_seconds()
        result = collect()
        cpu = self.read_cpu[source] = _cpu_seconds() - cpu
        self.charge(cpu + spent)
        if digest is not None and key is not None:
            # a change during the read (kube-proxy commits while iptables-nft-save runs):
            # the read may show what the digest does not, and a later digest equal to it
            # (the change undone) would keep that read for good
            try:
                during = marker() != key
            except Exception:
                during = True
            if during:
                digest = None
        if again:
            self.cycle_reads.add(source)
        self.read_count[source] = self.read_count.get(source, 0) + 1
        if result.value is not None or result.repeats:
            # (kept with an unreadable marker too: never reused, only stood on while a
            # read is put off)
            uses = float("inf") if not result.unknowns else float(self.retry_after)
            self._last[source] = (key, result, uses, digest)
        else:
            self._last.pop(source, None)
        return result

    def _content_due(self, source: str) -> bool:
        """May the content digest of ``source`` be taken now? Its own CPU spaces them
        within ``cpu_share`` (2 s of CPU at 155k nft rules), and is charged to the last
        read as a read's is."""
        return self.cpu_share is None or self._clock() >= self._content_next.get(source, 0.0)

    def _content(self, source: str, content: Callable[[object], object], key: object
                 ) -> tuple[object, float]:
        """``content(key)`` (None when it cannot be taken) and its CPU seconds, which
        space the next one."""
        cpu = _cpu_seconds()
        try:
            digest = content(key)
        except Exception:
            digest = None
        spent = _cpu_seconds() - cpu
        if self.cpu_share is not None:
            self._content_next[source] = self._clock() + spent / self.cpu_share
        return digest, spent

    def charge(self, seconds: float) -> None:
        """Add ``seconds`` of CPU (a diagnosis of what was read) to the last cycle that
        read: a changed node costs its reads and its walks."""
        if self._window is not None:
            began, wall, cpu = self._window
            self._window = (began, wall, cpu + seconds)

    def _put_off(self, source: str, key: object,
                 last: tuple[object, ProbeResult, float, object] | None
                 ) -> ProbeResult | None:
        """The last read, said to be out of date, while reading again would spend more
        than ``cpu_share``; None: read now."""
        if self.cpu_share is None or last is None or self._window is None or \
                self.cycle_reads or (key is not None and last[0] == key):
            # (this cycle reads already: all that changed; the same marker: a partial
            # read retried)
            return None
        began, wall, cpu = self._window
        due = began + cpu / self.cpu_share
        if self._due is None:  # (once a cycle: not a source put off, the next one read)
            self._due = self._clock() >= due
        if self._due:
            return None
        self.stale.add(source)
        self.deferred[source] = self.deferred.get(source, 0) + 1
        # the same words every cycle until the read (an unchanged snapshot, whose verdict
        # the daemon does not make again): the due time as first said in this window,
        # though the diagnosis of the first verdict put off is charged to it after
        if self._said is None or self._said[0] != began:
            self._said = (began, due, cpu)
        _, said_due, said_cpu = self._said
        what = "changed" if key is not None else \
            "may have changed (its change marker could not be read)"
        why = (f"{what} since it was read at {_utc(wall)}; it is read again from "
               f"{_utc(wall + said_due - began)} on (that cycle's reads and diagnosis took "
               f"{_seconds(said_cpu)} of CPU, and changes are read within "
               f"{self.cpu_share * 100:g} % of one CPU: --reread-cpu): until then the "
               "verdict shows the node as that read saw it")
        result = last[1]
        return ProbeResult(result.value, (*result.unknowns, Unknown(source, why)),
                           result.repeats)


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s < 100 else f"{s:.0f} s"


def _cpu_seconds() -> float:
    """CPU time of this thread and of the children it waited for (a read's commands)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.thread_time() + children.ru_utime + children.ru_stime


def _utc(wall: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%H:%M:%S UTC")


def cached(ctx: ProbeContext, source: str, marker: Callable[[], object],
           collect: Callable[[], ProbeResult],
           content: Callable[[object], object] | None = None) -> ProbeResult:
    """``collect()``, or the previous cycle's result when ``marker()`` has not moved, or
    when it moved and ``content(marker)`` (a digest of what the source holds, costlier
    than the marker) has not."""
    if ctx.cache is None:
        return collect()
    return ctx.cache.read(source, marker, collect, content)


# Fields a probe may fill: everything in the snapshot except bookkeeping.
_FILLABLE = frozenset(NodeSnapshot.__dataclass_fields__) - {"node", "origin", "unknowns",
                                                            "schema"}


def register(probe: Probe) -> Probe:
    """Add ``probe`` to the registry (once per name: a re-import replaces, not duplicates)."""
    for f in probe.fields:
        if f not in _FILLABLE:
            raise ValueError(f"probe {probe.name!r}: {f!r} is not a NodeSnapshot field")
    for i, existing in enumerate(REGISTRY):
        if existing.name == probe.name:
            REGISTRY[i] = probe
            return probe
        clash = set(existing.fields) & set(probe.fields)
        if clash:
            raise ValueError(f"probe {probe.name!r} and {existing.name!r} both fill "
                             f"{sorted(clash)}")
    REGISTRY.append(probe)
    return probe


def unavailable(source: str, reason: str, fields: int = 1) -> ProbeResult:
    """The usual "could not read" result (``fields`` > 1: a tuple of Nones)."""
    value: object | None = None if fields == 1 else (None,) * fields
    return ProbeResult(value, (Unknown(source, reason),))


# --- helpers shared by probes and the bundle writer ----------------------------------


class CommandError(RuntimeError):
    """A command that could not run or exited non-zero; ``str()`` is fit for a report."""


class CommandTimeout(CommandError):
    """The command was stopped when its time was up (``seconds``)."""

    def __init__(self, message: str, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


class CommandKilled(CommandError):
    """The command died of a signal: on a node, the kernel's out-of-memory killer, most
    often (the message says whether the cgroup counted a kill, and its limit). ``oom``:
    the cgroup counted one meanwhile (None: it cannot say)."""

    def __init__(self, message: str, oom: bool | None = None) -> None:
        super().__init__(message)
        self.oom = oom


def low_priority(args: Sequence[str]) -> list[str]:
    """``args`` run at the lowest CPU priority (nice 19) and the lowest best-effort I/O
    priority (ionice -c2 -n7), from its first instruction: a wrapper, not a
    setpriority() after the fork (that would race) nor a preexec_fn (unsafe with the
    daemon's threads). Without nice/ionice (coreutils, util-linux) it runs as it is."""
    prefix: list[str] = []
    if shutil.which("nice"):
        prefix += ["nice", "-n", "19"]
    if shutil.which("ionice"):
        prefix += ["ionice", "-c", "2", "-n", "7"]
    return [*prefix, *args]


# sets its own oom_score_adj (in the shell's process: a brace group, not a subshell),
# then becomes the command, whether the write worked or not
_FIRST_VICTIM = ('{ echo 1000 > /proc/self/oom_score_adj; } 2>/dev/null; exec "$@"')


def first_victim(args: Sequence[str]) -> list[str]:
    """``args`` as the process the out-of-memory killer takes first (oom_score_adj 1000):
    a child is charged to the agent's container, and when a listing outgrows the
    container's limit it is the listing that must die, not the agent that would say why.
    A wrapper, like low_priority (raising one's own score needs no privilege; a
    preexec_fn is unsafe with the daemon's threads). Not util-linux's choom: it refuses
    to run the command when the score cannot be written (a read-only /proc), and every
    read would fail; here the command runs regardless, and as it is without a shell."""
    sh = shutil.which("sh")
    return [sh, "-c", _FIRST_VICTIM, "sh", *args] if sh else list(args)


def run_command(args: Sequence[str], timeout: float, background: bool = False) -> str:
    """Run a read-only command, return its stdout as printed (a byte that is not UTF-8
    as U+FFFD).

    Raises CommandError (missing binary, timeout, non-zero exit with its stderr; a death
    by a signal as CommandKilled) so callers can turn it into an Unknown or a "skipped"
    line, never a traceback. ``background``: a long read, run at the lowest CPU and I/O
    priority.
    """
    exe = shutil.which(args[0])
    if exe is None:
        raise CommandError(f"{args[0]}: command not found")
    # LC_ALL=C: the tools we call print numbers and keywords the parsers expect only
    # in the C locale.
    env = {**os.environ, "LC_ALL": "C"}
    argv = [exe, *args[1:]]
    if background:
        argv = low_priority(argv)
    argv = first_victim(argv)
    kills = memory_limit.oom_kills()
    start = time.monotonic()
    try:
        # a byte that is not UTF-8 (a rule's or a set's comment in Latin-1, an interface
        # name: any tool may write one) as U+FFFD: strict decoding failed the whole read (a
        # node with one such comment lost every rule it has); an escape ("\\xe9") would
        # make `ip -j`'s JSON invalid
        proc = subprocess.run(argv, capture_output=True, text=True, encoding="utf-8",
                              errors="replace", timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CommandTimeout(f"{' '.join(args)}: timed out after {timeout:g}s",
                             timeout) from None
    except OSError as exc:
        raise CommandError(f"{' '.join(args)}: {exc}") from None
    if proc.returncode < 0:
        after = memory_limit.oom_kills()
        oom = None if kills is None or after is None else after > kills
        raise CommandKilled(killed(" ".join(args), -proc.returncode,
                                   time.monotonic() - start, oom), oom)
    if proc.returncode != 0:
        err = proc.stderr.strip() or proc.stdout.strip() or "no output"
        raise CommandError(f"{' '.join(args)} exited {proc.returncode}: {err}")
    return proc.stdout


def killed(command: str, signum: int, seconds: float, oom: bool | None) -> str:
    """Why ``command`` died of ``signum``, for the verdict: the out-of-memory killer when
    the cgroup's kill count rose meanwhile (``oom``; None: may have, for a SIGKILL), with
    the container's limit and what to do."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    head = f"{command} was killed ({name}) after {seconds:.1f}s"
    if signum != signal.SIGKILL:
        return head
    limit = memory_limit.limit_bytes()
    room = (f"this container may use {memory_limit.mib(limit)} (its cgroup's memory limit)"
            if limit is not None else "the memory limit is not known")
    if oom:
        return (f"{head} by the kernel's out-of-memory killer: {room}, and this read needs "
                "more on this node; raise the agent's memory limit (the DaemonSet's "
                "resources.limits.memory says how to size it)")
    return (f"{head}: by the out-of-memory killer if it outgrew the container ({room}), "
            "else by another process")


def kernel_module_present(name: str) -> bool:
    """Is kernel module ``name`` loaded or built in (so using it cannot trigger a load)?

    Asking the kernel for a netlink subsystem or family it does not have makes it
    call modprobe (nfnetlink's "nfnl-subsys-N", genetlink family aliases), which
    would change the node. So probes ask /proc and /sys first:
    - no /proc/modules: a kernel without loadable modules cannot autoload anything,
      so querying is harmless (the feature is built in or absent);
    - listed in /proc/modules: loaded;
    - /sys/module/NAME: loaded, or built in with parameters;
    - listed in modules.builtin: built in.
    """
    modules = Path("/proc/modules")
    if not modules.exists():
        return True
    try:
        for line in modules.read_text().splitlines():
            if line.split(" ", 1)[0] == name:
                return True
    except OSError:
        pass
    if Path("/sys/module", name).exists():
        return True
    try:
        builtin = Path("/lib/modules", os.uname().release, "modules.builtin").read_text()
    except OSError:
        return False
    return any(line.rsplit("/", 1)[-1] in (f"{name}.ko", f"{name.replace('_', '-')}.ko")
               for line in builtin.splitlines())
