"""Inputs built to hurt the readers, as real files through the real command: JSON and YAML
nested past what their parsers follow, and lines padded with long runs of blanks.

Each case failed before its fix: the nesting as an internal error (exit 70, "please
report this"), not a refusal naming the file; the padding in time quadratic in the run
(a rule line padded with 32k blanks took 34 s, a megabyte would take hours). The
padding tests give the readers a run a quadratic reader would need hours for (minutes
for the continuations), under a limit a linear one meets a hundred times over: they
cannot pass by luck nor fail on a slow machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.bundle import sections as fmt
from agent.errors import InputError
from agent.netfilter.rules_text import RulesText, read_rules_text, settle
from agent.parse.text_file import UnreadableInput, read_text_file
from agent.probes.kube_api import RawResponse, _parse
from agent.probes.kube_proxy import read_config
from tests.fifo import blocked_writer

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "tests" / "data" / "bundles" / "tke-etp-local"
DEEP_JSON = "[" * 20_000 + "]" * 20_000  # (the recursion limit is 1000 levels)
DEEP_YAML = "spec: " + "[" * 5_000 + "]" * 5_000 + "\n"
EXIT_DATAERR, EXIT_NOINPUT = 65, 66


def agent(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LOOPBACK_AGENT_DEBUG", None)  # (it turns an internal error into a traceback)
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, timeout=120, env=env, check=False)


# -- nesting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["paste.txt", "services.json", "svc.yaml"])
def test_a_pasted_file_nested_too_deep_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text(DEEP_YAML if name.endswith(".yaml") else DEEP_JSON)
    proc = agent("check", "--from", str(f))
    assert proc.returncode == EXIT_DATAERR, proc.stderr
    assert str(f) in proc.stderr and "internal error" not in proc.stderr


@pytest.mark.parametrize("text", [DEEP_JSON, DEEP_YAML])
def test_a_bundle_file_nested_too_deep_costs_that_file_only(tmp_path: Path, text: str) -> None:
    for f in BUNDLE.iterdir():
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "services.json").write_text(text)
    proc = agent("check", "--from", str(tmp_path))
    assert proc.returncode in (0, 1), proc.stderr  # a verdict from the rest of the bundle
    assert "services.json:1: not valid YAML/JSON: nested deeper than its parser can follow" \
        in proc.stderr
    assert "internal error" not in proc.stderr


def test_a_snapshot_nested_too_deep_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "snap.json"
    f.write_text(DEEP_JSON)
    proc = agent("check", "--snapshot", str(f))
    assert proc.returncode == EXIT_DATAERR, proc.stderr
    assert f"{f}: not a loopback-agent snapshot: JSON nested deeper" in proc.stderr


def test_an_api_answer_nested_too_deep_is_an_input_error() -> None:
    with pytest.raises(InputError, match="bad JSON"):
        _parse(RawResponse("services", body=DEEP_JSON.encode()))


def test_a_kube_proxy_config_nested_too_deep_reads_as_nothing() -> None:
    assert read_config(DEEP_JSON) == {}


# -- long runs of blanks ---------------------------------------------------------------------


class _TooSlow(Exception):
    pass


@pytest.fixture
def within_20s() -> Iterator[None]:
    """SIGALRM after 20 s: a reader quadratic in these runs needs hours. The alarm is
    also remembered: a reader that catches every exception (to name the file) would
    swallow the one raised, and the test would pass after 20 s."""
    fired: list[bool] = []

    def fire(*_: object) -> None:
        fired.append(True)
        raise _TooSlow("quadratic in the blank run")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not fired, "a reader took over 20 s (quadratic in the blank run?)"


BLANKS = " " * 500_000  # quadratic: 34 s at 32k, so hours here; linear: tenths


@pytest.mark.parametrize("text", [
    # a terminal's padding inside one rule (what the unwrapping looks for)
    f"*nat\n-A KUBE-SERVICES{BLANKS}-j KUBE-NODEPORTS\nCOMMIT\n",
    f"-A KUBE-SERVICES -s 10.0.0.1/32{BLANKS}5 -j RETURN\n",
    f"-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-X{BLANKS}\n-A KUBE-SVC-X -j DROP\n",
    # backslash continuations joined into one line of blanks
    "*nat\n" + "\\\n" * 200_000 + "COMMIT\n",
], ids=["padded-rule", "padded-before-a-number", "trailing-padding", "continuations"])
def test_rule_text_with_a_long_blank_run_is_read_in_linear_time(text: str,
                                                                within_20s: None) -> None:
    into = RulesText()
    read_rules_text(text, "paste.txt", into)
    settle(into)


@pytest.mark.parametrize("name", ["iptables-save.txt", "iptables-L.txt", "ipset.txt",
                                  "ipvsadm.txt", "addr.txt", "route-local.txt", "sysctl.txt",
                                  "services.yaml", "nft.txt", "paste.txt"])
def test_every_reader_takes_a_long_blank_run_in_linear_time(name: str,
                                                            within_20s: None) -> None:
    for text in (f"-A X{BLANKS}-j Y\n", f"x{BLANKS}x\n", f"{BLANKS}\n" * 2,
                 f"- {BLANKS}A\n", f"1.2.3.4{BLANKS}5\n",
                 # `kubectl describe svc` fields, and the wrappings taken off a paste
                 f"Name:  web\nType:  LoadBalancer\nEndpoints:  x{BLANKS}y\n"
                 f"Port:  a{BLANKS}80/TCP\nLoadBalancer Ingress:  h{BLANKS}(VIP)\n",
                 f"> x{BLANKS}y\n> z\n", f"  x{BLANKS}y\n  z\n", f"```{BLANKS}x\n",
                 f"\x1b[{'0' * len(BLANKS)}x\n"):
        # (refused, naming the file: what a reader may do with it)
        with contextlib.suppress(InputError):
            load_texts([(name, text, fmt.name_format(name))], origin="paste")


# -- what a named input may be ---------------------------------------------------------------


@pytest.fixture
def odd_files(tmp_path: Path) -> dict[str, Path]:
    """A FIFO nobody writes to, a device (through a symlink), a directory, and a sparse
    3 GiB file: each as --snapshot would be handed it."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(3 << 30)  # (sparse: no disk, but read whole it took 6 GiB of memory)
    return {"fifo": fifo, "device": zero, "directory": tmp_path, "3 GiB": big}


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "3 GiB"])
def test_a_snapshot_that_is_no_regular_file_or_too_big_is_refused_at_once(
        odd_files: dict[str, Path], kind: str) -> None:
    # before: a FIFO hung for ever, /dev/zero took 14 GB in 20 s, 3 GiB was read whole;
    # what cannot be read at all is 66 (as a missing file), what is read and bad 65
    proc = agent("check", "--snapshot", str(odd_files[kind]))
    assert proc.returncode == (EXIT_DATAERR if kind == "3 GiB" else EXIT_NOINPUT), \
        proc.stderr
    assert proc.stderr.startswith(f"loopback-agent: {odd_files[kind]}: ")
    assert ("not a regular file" if kind != "3 GiB" else "larger than 256 MiB") in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's capabilities (setpriv)")
def test_a_big_file_that_may_not_be_read_says_so(tmp_path: Path) -> None:
    # before: its size was judged before it was opened for reading, so a 3 GiB file the
    # user may not read said "larger than 256 MiB" (65) instead of "Permission denied"
    # (66, what a small one says). Root without the capabilities that override file
    # permissions: it may not read a file of mode 000.
    big = tmp_path / "snap.json"
    with big.open("wb") as f:
        f.truncate(3 << 30)  # (sparse)
    big.chmod(0)
    drop = "-dac_override,-dac_read_search"
    proc = subprocess.run(["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", "--",
                           sys.executable, "-m", "agent", "check", "--snapshot", str(big)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stderr) == (
        EXIT_NOINPUT, f"loopback-agent: {big}: cannot read: Permission denied\n")


def test_a_snapshot_through_a_named_symlink_is_read(tmp_path: Path) -> None:
    snap = agent("snapshot", "--from", str(BUNDLE))
    assert snap.returncode == 0, snap.stderr
    (tmp_path / "snap.json").write_text(snap.stdout)
    (tmp_path / "link.json").symlink_to(tmp_path / "snap.json")
    proc = agent("check", "--snapshot", str(tmp_path / "link.json"), "--json")
    assert proc.returncode in (0, 1), proc.stderr
    assert '"schema": "loopback-agent/verdict/v2"' in proc.stdout


@pytest.mark.parametrize("option", ["--from", "--snapshot"])
def test_standard_input_is_read_up_to_its_bound(option: str) -> None:
    # 300 MB of zeros through a pipe: refused once past 256 MiB, not read into memory whole
    # (before, `--snapshot -` and `--from -` read all of it: /dev/zero filled the memory)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen(["head", "-c", "300000000", "/dev/zero"],
                          stdout=subprocess.PIPE) as zeros:
        proc = subprocess.run([sys.executable, "-m", "agent", "check", option, "-"],
                              stdin=zeros.stdout, capture_output=True, text=True,
                              timeout=120, env=env, check=False)
    assert proc.returncode == EXIT_DATAERR, proc.stderr
    assert proc.stderr == "loopback-agent: <stdin>: larger than 256 MiB\n"


def test_standard_input_that_is_not_utf8_names_the_line_and_column() -> None:
    proc = subprocess.run([sys.executable, "-m", "agent", "check", "--from", "-"],
                          input=b"*nat\n-A X -j \xff\n", capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert proc.returncode == EXIT_DATAERR, proc.stderr
    assert b"<stdin>:2: not UTF-8 text (byte 0xff at column 9)" in proc.stderr


def test_a_fifo_or_device_named_as_input_is_never_opened(tmp_path: Path) -> None:
    """Its type is read through O_PATH before any open for reading (opening a device may
    act: a watchdog arms). Seen on a FIFO: a writer blocked in open() is released by any
    reader's open, which the old O_NONBLOCK open was."""
    fifo = tmp_path / "fifo"
    with blocked_writer(fifo) as released:
        for follow in (False, True):
            with pytest.raises(UnreadableInput, match="not a regular file"):
                read_text_file(fifo, "fifo", 1 << 20, follow=follow)
        assert not released.wait(0.5), "the FIFO was opened for reading"


def test_a_dangling_symlink_named_as_a_snapshot_is_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "snap.json").symlink_to(tmp_path / "gone.json")
    proc = agent("check", "--snapshot", str(tmp_path / "snap.json"))
    assert proc.returncode == EXIT_NOINPUT, proc.stderr
    assert "no such file or directory" in proc.stderr


_WITHOUT_PROC = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
# a mount namespace of this process alone, /proc an empty tmpfs there (a chroot, a
# rescue shell): the host's mounts are untouched
assert libc.unshare(0x00020000) == 0, ctypes.get_errno()  # CLONE_NEWNS
assert libc.mount(b"none", b"/", None, 0x4000 | (1 << 18), None) == 0  # MS_REC|MS_PRIVATE
assert libc.mount(b"none", b"/proc", b"tmpfs", 0, None) == 0, ctypes.get_errno()
from agent.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_inputs_are_read_without_proc() -> None:
    """The reopen through /proc/self/fd falls back to the path (checked to be the same
    file) where /proc is not mounted: the first version of the O_PATH read lost every
    file there ("cannot read: No such file or directory")."""
    for given in (BUNDLE, BUNDLE / "iptables-save.txt"):
        proc = subprocess.run([sys.executable, "-c", _WITHOUT_PROC, "check", "--from",
                               str(given)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
        assert proc.returncode in (0, 1, 3), proc.stderr  # 3: the rules alone
        assert "cannot read" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("line", [
    '-A KUBE-SERVICES -d 203.0.113.10/32 -p tcp -m comment --comment "a/b:http loadbalancer '
    'IP" -m tcp --dport 8\u00b2 -j ACCEPT',  # a superscript two: "²".isdigit() is true
    '-A KUBE-SERVICES -d 203.0.113.10/32 -p tcp -m comment --comment "a/b:http loadbalancer '
    'IP" -m tcp --dport \u0663 -j ACCEPT',  # an Arabic-Indic three
    "-I KUBE-SERVICES 1" + "9" * 5000 + " -j ACCEPT",  # past int()'s 4,300 digits
], ids=["superscript", "arabic-indic", "5000-digits"])
def test_a_malformed_number_is_no_internal_error(tmp_path: Path, line: str) -> None:
    """A number str.isdigit() accepts and int() refuses (or reads as nobody typed it)
    passed the readers' guards: `check --from` ended in "internal error" (exit 70) or
    lost its whole section (issue 35, item 14)."""
    dump = tmp_path / "iptables-save.txt"
    dump.write_text("*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n"
                    "-A PREROUTING -j KUBE-SERVICES\n" + line + "\nCOMMIT\n")
    proc = agent("check", "--from", str(dump), "--json")
    assert proc.returncode in (0, 1, 2, 3), proc.stderr
    assert "internal error" not in proc.stdout + proc.stderr


def test_one_service_with_250k_targets_is_capped_and_said(tmp_path: Path) -> None:
    """issue 35, item 12: one Service with 500 externalIPs x 500 ports (33 KB) made 250k
    targets: 26 s and 746 MiB in `check`. The first 1,000 of one object are walked, the
    rest counted in a finding that keeps loopback not ruled out."""
    import json
    import shutil

    for f in BUNDLE.iterdir():
        shutil.copy(f, tmp_path / f.name)
    svcs = json.loads((tmp_path / "services.json").read_text())
    svcs["items"].append({
        "kind": "Service", "metadata": {"namespace": "tenant", "name": "many"},
        "spec": {"type": "ClusterIP", "clusterIP": "172.30.9.9",
                 "externalIPs": [f"198.19.{i // 250}.{i % 250 + 1}" for i in range(500)],
                 "ports": [{"name": f"p{i}", "port": 1000 + i, "protocol": "TCP"}
                           for i in range(500)]},
        "status": {"loadBalancer": {}}})
    (tmp_path / "services.json").write_text(json.dumps(svcs))
    proc = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(tmp_path),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # the bundle's own exposure still stands
    v = json.loads(proc.stdout)
    (incomplete,) = [f for f in v["findings"] if f["id"] == "diagnosis-incomplete"]
    assert any("Service tenant/many has 250000 address:port targets (500 addresses x 500 "
               "ports): the first 1000 were walked" in e for e in incomplete["evidence"])
    assert v["lb_ip_counts"]["total"] <= 2 + 1000


@pytest.mark.parametrize("was,now", [
    # issue 35, item 14: "²".isdigit() is true and int("²") fails; int() of 5,000 digits
    # fails too: each escaped the reader's guard (exit 70, or a whole section lost)
    ("-m mark ! --mark 0x4000/0x4000", "-m mark ! --mark 0x4000/0x4\u00b2"),
    ("-m mark ! --mark 0x4000/0x4000", "-m mark ! --mark " + "9" * 5000),
    ("-A KUBE-POSTROUTING -m mark", "-A KUBE-POSTROUTING -p tcp -m tcp ! --dport 8\u00b2 "
                                    "-m mark"),
])
def test_a_malformed_number_in_the_path_is_undecided_naming_it(tmp_path: Path, was: str,
                                                                now: str) -> None:
    import json
    import shutil

    for f in BUNDLE.iterdir():
        shutil.copy(f, tmp_path / f.name)
    rules = (tmp_path / "iptables-save.txt").read_text()
    assert was in rules
    (tmp_path / "iptables-save.txt").write_text(rules.replace(was, now, 1))
    proc = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(tmp_path),
                           "--json", "--all"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr  # unknown: KUBE-POSTROUTING decides masquerade
    v = json.loads(proc.stdout)
    und = [f for f in v["findings"] if f["id"] == "pod-to-lb-undetermined"]
    assert und and all("is not a" in f["summary"] and "iptables-save.txt:26" in f["summary"]
                       for f in und), und


def test_a_malformed_insert_position_is_said_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "iptables-save.txt").write_text(
        "*nat\n:PREROUTING ACCEPT [0:0]\n"
        "-I PREROUTING " + "9" * 5000 + " -j ACCEPT\n"
        "-I PREROUTING \u00b9 -j ACCEPT\nCOMMIT\n")
    proc = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr and proc.returncode == 3, proc.stderr
    assert "iptables-save.txt:3: -I position '99999999999999999999' is not a number" \
        in proc.stderr
    # each said once, the file not named twice (issue 37: "FILE: FILE:3: ...")
    warnings = [ln for ln in proc.stderr.splitlines() if "-I position" in ln]
    assert len(warnings) == 2 and all(ln.count("iptables-save.txt") == 1 for ln in warnings)
    assert "iptables-save.txt:4: -I position '\\xb9' is not a number" in proc.stderr \
        or "iptables-save.txt:4: -I position '¹' is not a number" in proc.stderr


def test_insert_positions_give_the_order_list_insert_gives() -> None:
    """The chain's order from `-A` and `-I N` lines (computed once, not by list inserts:
    200k `-I CHAIN 1` lines took 11 s) is the one iptables-restore makes."""
    import random

    from agent.netfilter.rules_text import ChainRules

    rng = random.Random(7)
    for _ in range(200):
        want: list[str] = []
        got = ChainRules()
        for k in range(rng.randrange(1, 40)):
            text = f"-A C rule-{k}"
            if rng.random() < 0.6 and want:
                at = rng.randrange(0, len(want) + 3)  # past the end too: at the end
                want.insert(at, text)
                got.insert(at, text, "f", k + 1)
            else:
                want.append(text)
                got.append(text, "f", k + 1)
        assert [r.text for r in got] == want
        assert list(got.frozen().texts) == want
        assert [r.source for r in got] == [f"f:{int(t.rsplit('-', 1)[1]) + 1}" for t in want]


def test_insert_lines_are_read_in_linear_time() -> None:
    def dump(n: int) -> str:
        return ("*nat\n:PREROUTING ACCEPT [0:0]\n" + "".join(
            f"-I PREROUTING 1 -s 10.0.{i % 250}.1 -j ACCEPT\n" for i in range(n)) + "COMMIT\n")
    small, big = (_read_time(dump(n)) for n in (50_000, 100_000))
    assert big < 2.5 * small + 0.05, (small, big)  # was quadratic: x4


def _read_time(text: str) -> float:
    import time

    t0 = time.process_time()
    into = RulesText()
    read_rules_text(text, "iptables-save.txt", into)
    settle(into)
    return time.process_time() - t0


def _check_time(text: str, name: str) -> float:
    """CPU seconds of reading ``text`` as file ``name`` and diagnosing it (best of two)."""
    import time

    from agent.diagnose import diagnose

    best = float("inf")
    for _ in range(2):
        t0 = time.process_time()
        diagnose(load_texts([(name, text, fmt.name_format(name))], origin="bundle:t"), "n")
        best = min(best, time.process_time() - t0)
    return best


_RULES = "*nat\n:PREROUTING ACCEPT [0:0]\n{}COMMIT\n"
# issue 35, item 11: the shapes that were super-linear, each as the attack sent it
SUPER_LINEAR = {
    "continuation lines": ("iptables-save.txt", lambda n: _RULES.format(
        "-A PREROUTING -s 10.0.0.1 \\\n  -j ACCEPT\n" * n)),
    "-I CHAIN 1 lines": ("iptables-save.txt", lambda n: _RULES.format("".join(
        f"-I PREROUTING 1 -s 10.0.{i % 250}.1 -j ACCEPT\n" for i in range(n)))),
    "-s inside comments": ("iptables-save.txt", lambda n: _RULES.format(
        '-A PREROUTING -m comment --comment "-s 1.2.3.4 -s 5.6.7.8" -j ACCEPT\n' * n)),
    "runs of ! -s X/N": ("iptables-save.txt", lambda n: _RULES.format(
        "-A PREROUTING " + "! -s 10.0.0.0/8 " * n + "-j ACCEPT\n")),
    "describe padded with U+3000": ("paste.txt", lambda n: (
        "Name:              web\nNamespace:         default\nType:              "
        "LoadBalancer\nIP:" + "\u3000" * (20 * n) + "10.0.0.1\nLoadBalancer Ingress:   "
        "1.2.3.4\nPort:  http  80/TCP\n")),
    "describe padded with \\x1f": ("paste.txt", lambda n: (
        "Name:              web\nType:              LoadBalancer\nIP:" + "\x1f" * (20 * n)
        + "10.0.0.1\nLoadBalancer Ingress:   1.2.3.4\nPort:  http  80/TCP\n")),
}


@pytest.mark.parametrize("shape", list(SUPER_LINEAR))
def test_each_reader_is_linear_in_what_was_super_linear(shape: str) -> None:
    name, make = SUPER_LINEAR[shape]
    small, big = (_check_time(make(n), name) for n in (10_000, 20_000))
    assert big < 2.6 * small + 0.05, (shape, small, big)  # doubled input: time doubled
