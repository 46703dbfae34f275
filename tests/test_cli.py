"""The command line on saved bundles: exit codes, bad input, the verdict contract."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from agent.cli import schema_text
from agent.verdict_doc import expand_targets

DATA = Path(__file__).parent / "data" / "bundles"
TKE = DATA / "tke-etp-local"


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True,
                          text=True, input=stdin, timeout=300)


def copy_bundle(tmp_path: Path, src: Path = TKE) -> Path:
    d = tmp_path / "bundle"
    shutil.copytree(src, d)
    return d


def fine(v: dict[str, Any]) -> set[tuple[str, str]]:
    """(finding id, LB IP) of the LB IPs a summary counts as fine."""
    return {(g["id"], ip) for g in v["ok"] for ip, _ in expand_targets(g["targets"])}


def test_from_bundle_reports_the_loop_and_exits_1() -> None:
    r = run("check", "--from", str(TKE), "--json", "--node-name", "n1")
    assert r.returncode == 1, r.stderr
    v = json.loads(r.stdout)
    jsonschema.validate(v, json.loads(schema_text()))
    assert v["node"] == "n1" and v["status"] == "at-risk" and v["kube_proxy_mode"] == "ipvs"
    by_id = {(f["id"], f["lb_ip"]) for f in v["findings"]}
    assert ("pod-to-lb-not-masqueraded", "10.0.1.100") in by_id
    # a fine LB IP is counted (issue 32), named in its group's compact targets
    assert ("pod-to-lb-masqueraded", "10.0.1.101") in fine(v)
    assert ("pod-to-lb-masqueraded", "10.0.1.101") not in by_id
    loop = next(f for f in v["findings"] if f["id"] == "pod-to-lb-not-masqueraded")
    assert loop["service"] == "default/web" and loop["port"] == 80
    assert any("KUBE-LOAD-BALANCER-LOCAL dst,dst -j RETURN" in e for e in loop["evidence"])
    assert any("IP-MASQ-AGENT -d 10.0.0.0/8" in e for e in loop["evidence"])
    assert "prevent-loopback" in loop["remedy"]
    sources = {u["source"] for u in v["unknowns"]}
    assert "ipvs" in sources and "addresses" not in sources


def test_human_report_names_status_ips_and_remedy() -> None:
    r = run("check", "--from", str(TKE))
    assert r.returncode == 1
    out = r.stdout
    assert "AT RISK" in out and "kube-proxy mode: ipvs" in out
    assert "10.0.1.100" in out and "10.0.1.101" in out
    assert "Remedy:" in out and "Could not read" in out


def test_node_name_from_environment(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(TKE), "--json"],
                       capture_output=True, text=True,
                       env={"NODE_NAME": "from-downward-api", "PATH": "/usr/bin:/bin"})
    assert json.loads(r.stdout)["node"] == "from-downward-api"


def test_cluster_policy_instead_is_healthy(tmp_path: Path) -> None:
    d = copy_bundle(tmp_path)
    ipset = (d / "ipset.txt").read_text().replace(
        "add KUBE-LOAD-BALANCER-LOCAL 10.0.1.100,tcp:80 comment \"default/web:http\"\n", "")
    (d / "ipset.txt").write_text(ipset)
    r = run("check", "--from", str(d), "--json")
    assert r.returncode == 0, r.stdout
    v = json.loads(r.stdout)
    assert v["status"] == "healthy"
    assert v["findings"] == [] and {fid for fid, _ in fine(v)} == {"pod-to-lb-masqueraded"}


def test_kube_proxy_restore_input_gives_the_same_verdict(tmp_path: Path) -> None:
    """kube-proxy's own restore input: no header, no /32, --or-mark, no built-in jumps."""
    d = copy_bundle(tmp_path)
    lines = []
    for line in (d / "iptables-save.txt").read_text().splitlines():
        if line.startswith("#") or (line.startswith(":") and "ACCEPT" in line):
            continue
        if line.startswith(("-A PREROUTING", "-A OUTPUT", "-A POSTROUTING -m comment "
                                                           "--comment \"kubernetes")):
            continue
        lines.append(line.replace("--set-xmark 0x4000/0x4000", "--or-mark 0x4000"))
    # ip-masq-agent's jump is not kube-proxy's: it stays, in a built-in chain kube-proxy
    # never declares
    (d / "iptables-save.txt").write_text("\n".join(lines) + "\n")
    r = run("check", "--from", str(d), "--json", "--all")
    assert r.returncode == 1, r.stderr
    v = json.loads(r.stdout)
    assumed = v["context"]["assumed_rules"]
    assert any("PREROUTING -> KUBE-SERVICES" in a for a in assumed)
    assert any("POSTROUTING -> KUBE-POSTROUTING" in a for a in assumed)
    found = {(f["id"], f["lb_ip"]) for f in v["findings"]}
    assert ("pod-to-lb-not-masqueraded", "10.0.1.100") in found
    # eTP=Cluster is marked and masqueraded through the assumed POSTROUTING jump
    assert ("pod-to-lb-masqueraded", "10.0.1.101") in found


def test_missing_directory_is_exit_66() -> None:
    r = run("check", "--from", "/nonexistent/bundle")
    assert r.returncode == 66
    assert "/nonexistent/bundle" in r.stderr and "Traceback" not in r.stderr


def test_directory_without_bundle_files_is_exit_65(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    r = run("check", "--from", str(tmp_path))
    assert r.returncode == 65
    assert "nothing usable found: notes.txt: no known command output" in r.stderr


def test_usage_error_is_exit_64() -> None:
    r = run("check", "--bogus")
    assert r.returncode == 64
    r = run()
    assert r.returncode == 64


def test_help_teaches_exit_codes_and_examples() -> None:
    r = run("check", "--help")
    assert r.returncode == 0
    for text in ("--from", "--snapshot", "--json", "exit codes", "64", "bundle"):
        assert text in r.stdout


@pytest.mark.parametrize("garbage", [
    "this is not iptables-save output\n",
    "*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j KUBE-SERVICES\n",  # truncated
    "\x00\x01\x02binary",
])
def test_garbage_rules_file_is_an_unknown_naming_file_and_line(tmp_path: Path,
                                                               garbage: str) -> None:
    d = copy_bundle(tmp_path)
    (d / "iptables-save.txt").write_text(garbage)
    r = run("check", "--from", str(d), "--json")
    assert "Traceback" not in r.stderr
    assert r.returncode == 3  # unknown: nothing at risk found, nothing ruled out
    v = json.loads(r.stdout)
    reasons = [u["reason"] for u in v["unknowns"] if u["source"] == "iptables-save.txt"]
    assert reasons and reasons[0].startswith("iptables-save.txt:")
    assert "iptables-save.txt:" in r.stderr  # the warning names the file and line
    # without rules the walk cannot decide: that is not "healthy", nor "at-risk"
    assert v["status"] == "unknown"
    assert {f["id"] for f in v["findings"]} == {"pod-to-lb-undetermined"}


def test_every_file_garbage_is_refused_naming_each(tmp_path: Path) -> None:
    d = copy_bundle(tmp_path)
    for i, f in enumerate(sorted(d.iterdir())):
        # (FF FE starts UTF-16 as Windows writes it: its garbage is named as such)
        f.write_bytes((b"\xff\xfe garbage \x00\n" if i % 2 else b"\x80 garbage\n") * 3)
    r = run("check", "--from", str(d), "--json")
    assert "Traceback" not in r.stderr
    assert r.returncode == 65 and not r.stdout
    for i, f in enumerate(sorted(d.iterdir())):
        assert f"{f.name}:1: not {'UTF-16' if i % 2 else 'UTF-8'} text" in r.stderr


def test_unknown_match_in_the_path_is_named_not_guessed(tmp_path: Path) -> None:
    d = copy_bundle(tmp_path)
    text = (d / "iptables-save.txt").read_text().replace(
        "-A KUBE-SERVICES -m comment --comment \"Kubernetes service lb portal\"",
        "-A KUBE-SERVICES -m u32 --u32 \"0>>22&0x3C@12>>26&0x3C@0=0\" -j RETURN\n"
        "-A KUBE-SERVICES -m comment --comment \"Kubernetes service lb portal\"")
    (d / "iptables-save.txt").write_text(text)
    r = run("check", "--from", str(d), "--json")
    assert r.returncode == 3  # unknown: nothing at risk found, nothing ruled out
    v = json.loads(r.stdout)
    und = [f for f in v["findings"] if f["id"] == "pod-to-lb-undetermined"]
    assert und and "u32" in und[0]["summary"] and "iptables-save.txt:" in und[0]["summary"]


def test_bad_snapshot_file_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "node.json"
    bad.write_text('{\n  "schema": "loopback-agent/snapshot/v1",\n  oops\n}')
    r = run("check", "--snapshot", str(bad))
    assert r.returncode == 65
    assert f"{bad}:3" in r.stderr
    other = tmp_path / "other.json"
    other.write_text('{"schema": "something/else"}')
    assert run("check", "--snapshot", str(other)).returncode == 65
    assert run("check", "--snapshot", str(tmp_path / "missing.json")).returncode == 66


def test_snapshot_round_trip_from_bundle(tmp_path: Path) -> None:
    snap = run("snapshot", "--from", str(TKE))
    assert snap.returncode == 0, snap.stderr
    (tmp_path / "s.json").write_text(snap.stdout)
    a = run("check", "--snapshot", str(tmp_path / "s.json"), "--json", "--node-name", "x")
    b = run("check", "--from", str(TKE), "--json", "--node-name", "x")
    va, vb = json.loads(a.stdout), json.loads(b.stdout)
    for v in (va, vb):
        v.pop("time")
    assert va == vb and a.returncode == b.returncode == 1
    # and from stdin
    c = run("check", "--snapshot", "-", "--json", "--node-name", "x", stdin=snap.stdout)
    vc = json.loads(c.stdout)
    vc.pop("time")
    assert vc == va


def test_hundred_thousand_rules(tmp_path: Path) -> None:
    d = copy_bundle(tmp_path)
    text = (d / "iptables-save.txt").read_text()
    extra = [":KUBE-SVC-FILLER - [0:0]"]
    for i in range(100_000):
        extra.append(f"-A KUBE-SERVICES -d 10.{100 + i // 65536}.{i // 256 % 256}.{i % 256}/32 "
                     f"-p tcp -m comment --comment \"ns/s{i}:http cluster IP\" -m tcp "
                     f"--dport 80 -j KUBE-SVC-FILLER")
    text = text.replace(":KUBE-SERVICES - [0:0]", ":KUBE-SERVICES - [0:0]\n" + extra[0])
    text = text.replace("COMMIT", "\n".join(extra[1:]) + "\nCOMMIT", 1)
    (d / "iptables-save.txt").write_text(text)
    t0 = time.monotonic()
    r = run("check", "--from", str(d), "--json")
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    v = json.loads(r.stdout)
    assert ("pod-to-lb-not-masqueraded", "10.0.1.100") in {(f["id"], f["lb_ip"])
                                                           for f in v["findings"]}
    print(f"check --from with 100k rules: {elapsed:.2f}s")


def test_schema_command_prints_the_contract() -> None:
    r = run("schema")
    assert r.returncode == 0
    schema = json.loads(r.stdout)
    assert schema["properties"]["schema"]["const"] == "loopback-agent/verdict/v2"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_capture_needs_the_live_node_and_a_duration() -> None:
    r = run("check", "--from", str(TKE), "--capture", "5s")
    assert r.returncode == 64 and "--capture watches the live node" in r.stderr
    r = run("check", "--capture", "soon")
    assert r.returncode == 64 and "not a duration" in r.stderr
    r = run("check", "--capture", "5s", "--nodeport-range", "32767-30000")
    assert r.returncode == 64 and "not a port range" in r.stderr


def test_bad_listen_address_is_a_usage_error() -> None:
    for cmd, why in ((["run", "--listen", "nowhere"], "(try :9808)"),
                     (["collector", "--listen", "host:99999"], "(try :9808)"),
                     # an IPv6 address without brackets was read as host ":" port 1, and
                     # binding it an internal error
                     (["run", "--listen", "::1"], "goes in brackets: [::1]:9808"),
                     (["collector", "--listen", "fe80::1:8080"], "goes in brackets"),
                     (["run", "--listen", "http://[::1]:80"], "not a URL"),
                     # was an internal error (int(''))
                     (["collector", "--listen", ""], "must listen somewhere")):
        r = run(*cmd)
        assert r.returncode == 64 and why in r.stderr, \
            (cmd, r.stderr)


def test_bad_environment_value_names_the_variable() -> None:
    r = subprocess.run([sys.executable, "-m", "agent", "run", "--help"], capture_output=True,
                       text=True, env={**__import__("os").environ,
                                       "LOOPBACK_AGENT_INTERVAL": "soon"})
    assert r.returncode == 64 and "LOOPBACK_AGENT_INTERVAL='soon'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("bad", ["nan", "NaN%", "0", "-5", "100.5", "inf", "abc", ""])
def test_a_bad_reread_share_is_refused_naming_option_or_variable(
        bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--reread-cpu and LOOPBACK_AGENT_REREAD_CPU: a share of one CPU in (0, 100]; NaN
    would make every read due never (every comparison false), 0 never."""
    from agent.cli import EXIT_USAGE, build_parser

    with pytest.raises(SystemExit) as flag:
        build_parser().parse_args(["run", "--reread-cpu", bad])
    err = capsys.readouterr().err
    assert flag.value.code == EXIT_USAGE and "--reread-cpu" in err and repr(bad) in err
    monkeypatch.setenv("LOOPBACK_AGENT_REREAD_CPU", bad)
    with pytest.raises(SystemExit) as env:
        build_parser()
    err = capsys.readouterr().err
    assert env.value.code == EXIT_USAGE
    assert f"LOOPBACK_AGENT_REREAD_CPU={bad!r}" in err and "percentage of one CPU" in err


def test_a_reread_share_takes_percent_signs_and_fractions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import build_parser

    monkeypatch.delenv("LOOPBACK_AGENT_REREAD_CPU", raising=False)
    assert build_parser().parse_args(["run"]).reread_cpu == 10.0
    for text, value in (("2.5", 2.5), ("10%", 10.0), (" 100 ", 100.0)):
        assert build_parser().parse_args(["run", "--reread-cpu", text]).reread_cpu == value
    monkeypatch.setenv("LOOPBACK_AGENT_REREAD_CPU", "25%")
    assert build_parser().parse_args(["run"]).reread_cpu == 25.0


@pytest.mark.parametrize("edit, named", [
    (lambda d: d["addresses"][0].update(prefixlen=None), "$.addresses[0].prefixlen"),
    (lambda d: d["addresses"][0].update(address="10.0.0.300"), "$.addresses[0].address"),
    (lambda d: d["local_routes"].__setitem__(0, None), "$.local_routes[0]"),
    (lambda d: d["services"][0]["ports"][0].update(protocol=""), "protocol"),
    (lambda d: d["services"][0].update(name="\udc80"), "lone surrogate"),
    (lambda d: d.update(node_info={"name": "n", "pod_cidrs": ["garbage"]}),
     "$.node_info.pod_cidrs[0]"),
    (lambda d: d["ipsets"][0].pop("name"), "lacks 'name'"),
])
def test_a_damaged_snapshot_is_refused_naming_the_field(tmp_path: Path, edit, named) -> None:  # type: ignore[no-untyped-def]
    # each of these used to end in an internal error (exit 70) inside the diagnosis
    snap = run("snapshot", "--from", str(TKE))
    assert snap.returncode == 0, snap.stderr
    doc = json.loads(snap.stdout)
    edit(doc)
    f = tmp_path / "node.json"
    f.write_text(json.dumps(doc))
    r = run("check", "--snapshot", str(f))
    assert r.returncode == 65, r.stderr
    assert named in r.stderr and "internal error" not in r.stderr


def test_a_bad_pod_cidr_in_the_node_object_is_named_not_fatal(tmp_path: Path) -> None:
    d = copy_bundle(tmp_path)
    (d / "node.json").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
        "spec": {"podCIDR": "10.0.0.0/33", "podCIDRs": ["garbage"]}, "status": {}}))
    r = run("check", "--from", str(d), "--json")
    assert r.returncode == 1, r.stderr  # the rest of the bundle still decides
    assert "spec.podCIDRs[0]: 'garbage' is not a CIDR" in r.stderr
    assert json.loads(r.stdout)["status"] == "at-risk"


def test_a_big_json_verdict_is_written_piece_by_piece_with_the_same_content(
        tmp_path: Path) -> None:
    """Over 500 findings `check --json --all` writes item by item (never the whole text
    at once): the document must be the one Verdict.to_dict("all") makes."""
    from agent.bundle import load_bundle
    from agent.diagnose import diagnose
    from lab.kube_proxy_rules.synthetic import synthetic

    for name, text in synthetic(600, "iptables").items():
        (tmp_path / name).write_text(text)
    r = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(tmp_path),
                        "--json", "--all", "--node-name", "big"], capture_output=True,
                       text=True,
                       timeout=120)
    got = json.loads(r.stdout)
    assert len(got["findings"]) >= 500, "too few findings to take the piecewise path"
    assert "\n" not in r.stdout.rstrip("\n")  # compact: the piecewise writer ran
    want = diagnose(load_bundle(str(tmp_path)), "big").to_dict("all")
    got.pop("time"), want.pop("time")
    assert got == want


def test_finding_json_is_json_dumps() -> None:
    """`check --json` of a big verdict writes findings from their fields (cli._finding_json):
    the very text json.dumps makes of to_dict(), whatever the fields hold."""
    from agent.cli import _finding_json
    from agent.diagnose.model import Finding

    findings = [
        Finding("lb-ip-local", "warning", "LB IP 10.0.32.1 \u00e9\u4e2d \"q\" \\ \n\t\x01",
                lb_ip="10.0.32.1", port=80, protocol="TCP", service="ns/svc",
                evidence=("a", "b \u2028 \U0001f600"), remedy="r\u00e9"),
        Finding("x", "info", "s", evidence=(), remedy=None),
        Finding("x", "info", "s", port=0, data={"ports": [1, 2.5, None, True]}),
        Finding("x", "info", "s", port=True),  # type: ignore[arg-type]
        Finding("x", "info", "s", evidence=(1,)),  # type: ignore[arg-type]
    ]
    remedies: dict[str | None, str] = {}
    for f in findings * 2:
        assert _finding_json(f, remedies) == json.dumps(f.to_dict())


def test_an_offline_verdict_is_named_by_its_input_not_by_this_machine(tmp_path: Path) -> None:
    """issue 37: `check --from` of a bundle without node.json was named after the
    analyst's own machine; a bundle with node.json is named by it, --node-name wins."""
    import socket

    v = json.loads(run("check", "--from", str(TKE), "--json").stdout)
    assert v["node"] == "unnamed-node" != socket.gethostname()
    d = copy_bundle(tmp_path)
    (d / "node.json").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "10.0.0.10"},
        "spec": {"podCIDR": "172.16.1.0/24"}}))
    assert json.loads(run("check", "--from", str(d), "--json").stdout)["node"] == "10.0.0.10"
    named = run("check", "--from", str(d), "--json", "--node-name", "given")
    assert json.loads(named.stdout)["node"] == "given"


def test_warnings_say_no_python_none_and_name_their_file_once(tmp_path: Path) -> None:
    """issue 37, bug 5: a YAML object without a kind was "1 None objects: not used", and a
    warning whose reason names its file and line printed the file twice."""
    d = copy_bundle(tmp_path)
    # (a List as kubectl prints one, holding an object that has no kind: a ConfigMap's
    # trimmed copy, say)
    (d / "svc-extra.yaml").write_text("kind: List\nitems:\n- metadata:\n    name: x\n"
                                      "  data:\n    a: b\n")
    r = run("check", "--from", str(d))
    assert r.returncode in (0, 1, 2, 3), r.stderr
    said = r.stdout + r.stderr
    assert "None" not in said, said
    assert "1 objects without a kind: not used" in said
    named = [line for line in r.stderr.splitlines() if "svc-extra.yaml" in line]
    assert len(named) == 2 and all(line.count("svc-extra.yaml") == 1 for line in named), named


@pytest.mark.parametrize("option,value,said", [
    ("--token-review-cache", "nan", "not a number of seconds"),
    ("--token-review-cache", "-5", "not a number of seconds"),
    ("--node-quota-mb", "0", "not a positive whole number"),
    ("--node-quota-mb", "\u00b2", "not a positive whole number"),
])
def test_collector_limits_refuse_what_is_no_limit(option: str, value: str, said: str,
                                                  tmp_path: Path) -> None:
    r = run("collector", "--listen", "127.0.0.1:9", "--db", str(tmp_path / "c.db"),
            option, value)
    assert r.returncode == 64 and said in r.stderr and option in r.stderr, r.stderr
