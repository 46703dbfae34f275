"""Sources that disagree, on live lab nodes (issue 33, item 3): a node built in a network
namespace, then made stale on purpose the way a kube-proxy whose syncs stopped leaves it
(its rule for a Service gone, an address left on kube-ipvs0), and `check` run inside it
with the Services given; the agent changes nothing.

The IPVS virtual servers' side (a set entry without its virtual server, KUBE-LOOP-BACK, an
address left on kube-ipvs0) needs IP_VS, which this kernel lacks: tests/guest checks it in
the VM.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from agent.diagnose.rules.consistency import NO_RULE, STALE_ADDRESS
from lab.netns import Netns
from lab.node import build_lab
from lab.scenarios import SCENARIOS
from tests.nodestate import capture

pytestmark = pytest.mark.netns

LB_IP = "10.0.1.10"


def check_in(ns: Netns, kube: str) -> dict[str, Any]:
    r = ns.run(sys.executable, "-m", "agent", "check", "--json", "--all", "--node-name", "n",
               "--kube-json", kube, check=False, timeout=120)
    assert r.returncode in (0, 1, 3), r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def ids(v: dict[str, Any], wanted: str) -> list[tuple[str | None, str | None]]:
    return [(f["lb_ip"], f["service"]) for f in v["findings"] if f["id"] == wanted]


@pytest.mark.parametrize("backend", ["legacy", "nft"])
def test_a_service_whose_rules_kube_proxy_never_wrote(backend: str) -> None:
    with build_lab(SCENARIOS["iptables-new-etp-local"], backend) as lab:
        kube = str(lab.kube_dir)
        assert ids(check_in(lab.node, kube), NO_RULE) == []  # as kube-proxy wrote it
        # kube-proxy stopped before this Service's sync: no rule names its address
        save, restore = f"iptables-{backend}-save", f"iptables-{backend}-restore"
        lab.node.run("sh", "-c", f"{save} | grep -v -- '-d {LB_IP}/32' | {restore}")
        assert f"-d {LB_IP}/32" not in lab.node.run(save).stdout
        before = capture(lab.node)
        v = check_in(lab.node, kube)
        assert capture(lab.node) == before
        assert ids(v, NO_RULE) == [(LB_IP, "demo/web")]
        walked = {f["id"] for f in v["findings"] if f["lb_ip"] == LB_IP}
        assert "pod-to-lb-not-masqueraded" in walked  # and the walk agrees
        # the same node without the Services: nothing to compare, nothing said
        r = lab.node.run(sys.executable, "-m", "agent", "check", "--json", "--all",
                         "--node-name", "n", check=False, timeout=120)
        assert NO_RULE not in {f["id"] for f in json.loads(r.stdout)["findings"]}


def test_an_address_left_on_kube_ipvs0_needs_the_virtual_servers() -> None:
    # kube-proxy binds an address with its virtual server and unbinds it with the last
    # one: without IPVS (this kernel has none; the VM's guest test has it) an address no
    # Service names is not called stale
    with build_lab(SCENARIOS["ipvs-lb-bound"], "legacy") as lab:
        lab.node.run("ip", "address", "add", "10.0.1.77/32", "dev", "kube-ipvs0")
        v = check_in(lab.node, str(lab.kube_dir))
        assert any(u["source"] == "ipvs" for u in v["unknowns"]), v["unknowns"]
        assert ids(v, STALE_ADDRESS) == []
