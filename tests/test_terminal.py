"""No escape sequence from a node reaches an operator's terminal (issue 35, items 7 and
8): the report of `check` and the kubectl plugin's tables show control characters escaped.

The attacks as they came: a Service name holding OSC 52 (writes the clipboard) as a JSON
escape in services.json, a doubled ESC in a rule comment (a one-pass strip of `ESC[m`
leaves a working `ESC]...BEL`), an unterminated OSC (swallows the rest of the report), and
a verdict sent to a real collector whose node, service and LB IP hold OSC 0, OSC 52 and
CSI 2J, printed by `kubectl loopback nodes` and `services`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import requests

from agent.terminal import for_terminal, one_line
from tests.test_collector import Proc

TKE = Path(__file__).parent / "data" / "bundles" / "tke-etp-local"
OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"  # the clipboard: "rm -rf ~"
OSC0 = "\x1b]0;owned\x07"
CSI_CLEAR = "\x1b[2J"
UNTERMINATED = "\x1b]0;"
C1_CSI = "\x9b31m"


def test_the_sanitiser_shows_every_control_and_keeps_the_text() -> None:
    assert for_terminal("a\tb\nc") == "a\tb\nc"
    assert for_terminal(f"x{OSC52}y") == "x\\x1b]52;c;cm0gLXJmIH4=\\x07y"
    assert for_terminal("\x1b\x1b[m]0;t\x07") == "\\x1b\\x1b[m]0;t\\x07"
    assert for_terminal(C1_CSI + "\u202e\ud800\x7f") == "\\x9b31m\\u202e\\ud800\\x7f"
    assert one_line("a\nb\tc") == "a\\x0ab\\x09c"
    assert for_terminal("plain ünïcode 日本") == "plain ünïcode 日本"


def test_check_report_passes_no_escape(tmp_path: Path) -> None:
    for f in TKE.iterdir():
        shutil.copy(f, tmp_path / f.name)
    svcs = json.loads((tmp_path / "services.json").read_text())
    web = next(s for s in svcs["items"] if s["metadata"]["name"] == "web")
    web["metadata"]["name"] = f"web{OSC52}{UNTERMINATED}"
    (tmp_path / "services.json").write_text(json.dumps(svcs))  # "\u001b" in the JSON
    rules = (tmp_path / "iptables-save.txt").read_text()
    (tmp_path / "iptables-save.txt").write_text(rules.replace(
        '"default/web:http"', f'"default/web:http \x1b\x1b[m]0;{OSC0}{CSI_CLEAR}"', 1))
    for args in ((), ("--verbose",), ("--lb-ip", "10.0.1.100")):
        r = subprocess.run([sys.executable, "-m", "agent", "check", "--from", str(tmp_path),
                            *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\x1b" not in r.stderr
        assert "web\\x1b]52;c;cm0gLXJmIH4=\\x07" in r.stdout  # shown, not dropped


def test_plugin_tables_pass_no_escape(tmp_path: Path) -> None:
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "agent", "check", "--from", str(TKE), "--json"],
        capture_output=True, text=True, timeout=60).stdout)
    doc["node"] = f"node{OSC0}{CSI_CLEAR}"
    for f in doc["findings"]:
        f["service"] = f"default/web{OSC52}"
        f["lb_ip"] = f"10.0.1.100{C1_CSI}{UNTERMINATED}"
    col = Proc(tmp_path / "c.db")
    try:
        r = requests.post(col.url + "/v1/verdicts", json={**doc, "idempotency_key": "k"},
                          timeout=30)
        assert r.status_code == 200, r.text
        for what in ("nodes", "services"):
            out = subprocess.run([sys.executable, "-m", "agent.kubectl_plugin", what,
                                  "--collector", col.url], capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            assert not any(c in out.stdout for c in "\x1b\x07\x9b"), repr(out.stdout)
            assert ("node\\x1b]0;owned\\x07\\x1b[2J" if what == "nodes" else
                    "default/web\\x1b]52;c;") in out.stdout
    finally:
        col.stop()
