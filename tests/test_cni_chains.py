"""The CNIs' own nat chains around kube-proxy's (issue 33, item 4).

Where a chain's rules are in the input they are walked as written; where only the jump to
it is (a pasted `iptables -t nat -S POSTROUTING`, an excerpt), the CNI's standard layout
decides it and the verdict says so with the command that shows the chain, or, where the
CNI's configuration decides (Calico's natOutgoing, the VPC's CIDRs for the AWS VPC CNI),
the finding is undetermined and names what it hangs on.

The jump lines and chain rules are verbatim from public threads (each named below); the
live tests put them on a lab node of the TKE IPVS kind (the LB address not bound, eTP
Local: kube-proxy leaves a pod's packet to it alone, so the CNI's chain decides), with
the lab's addresses in place of the posters' (constructed: 10.233.64.0/18 -> the lab's
172.16.0.0/16, and so on, said at each). The kernel is the judge: the pod's SYN is watched
leaving the node, and its source address must be what the agent said.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.netfilter.cni_chains import known_chain
from lab.clb import Cluster, build_cluster, pod_connect, sniff
from lab.scenarios import LB_IP, SCENARIOS
from tests.nodestate import capture

SCENARIO = SCENARIOS["tke-ipvs-etp-local"]  # kube-proxy leaves the pod's packet alone
NODE_IP = SCENARIO.node_ip

# -- each CNI's chain as its users posted it ----------------------------------------------

# flannel v0.20.x: the jump from https://github.com/flannel-io/flannel/issues/1702 (oe-hbk,
# 2023-01-17) and the chain from the same thread (10.233.64.0/18 -> 172.16.0.0/16,
# 10.233.64.0/24 -> 172.16.1.0/24: the lab's cluster and node pod CIDRs)
FLANNEL = """\
-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG
-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 172.16.0.0/16 -d 172.16.0.0/16 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 172.16.0.0/16 ! -d 224.0.0.0/4 -m comment --comment "flanneld masq" -j MASQUERADE
-A FLANNEL-POSTRTG ! -s 172.16.0.0/16 -d 172.16.1.0/24 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG ! -s 172.16.0.0/16 -d 172.16.0.0/16 -m comment --comment "flanneld masq" -j MASQUERADE
"""  # noqa: E501
# AWS VPC CNI v1.7-v1.15: the chain as ipamd logged it in
# https://github.com/aws/amazon-vpc-cni-k8s/issues/2073 (Ullaakut, 2022-09-05): the VPC
# CIDR 10.0.0.0/16 is the lab's own; --to-source 10.0.0.11 -> the lab node's 10.0.0.10;
# the jump as https://github.com/antrea-io/antrea/pull/3975 posted it (2022-07-07)
AWS = """\
-A POSTROUTING -m comment --comment "AWS SNAT CHAIN" -j AWS-SNAT-CHAIN-0
-A AWS-SNAT-CHAIN-0 ! -d 10.0.0.0/16 -m comment --comment "AWS SNAT CHAIN" -j AWS-SNAT-CHAIN-1
-A AWS-SNAT-CHAIN-1 ! -o vlan+ -m comment --comment "AWS, SNAT" -m addrtype ! --dst-type LOCAL -j SNAT --to-source 10.0.0.10 --random-fully
"""  # noqa: E501
# Calico: the chains from https://github.com/aws/amazon-vpc-cni-k8s/pull/34 (2018) and the
# natOutgoing rule from https://github.com/weaveworks/weave/issues/3588 (2019); the jump's
# comment as Felix writes it (felix/dataplane/linux/int_dataplane.go, cali:O3lYWMrLQYEMJtB5,
# as posted in https://github.com/projectcalico/calico/issues/5978); its ipsets hold the
# lab's pod CIDR (constructed: an IP pool 172.16.0.0/16 with natOutgoing: true)
CALICO = """\
-A POSTROUTING -m comment --comment "cali:O3lYWMrLQYEMJtB5" -j cali-POSTROUTING
-A cali-POSTROUTING -m comment --comment "cali:Z-c7XtVd2Bq7s_hA" -j cali-fip-snat
-A cali-POSTROUTING -m comment --comment "cali:nYKhEzDlr11Jccal" -j cali-nat-outgoing
-A cali-nat-outgoing -m comment --comment "cali:Dw4T8UWPnCLxRJiI" -m set --match-set cali40masq-ipam-pools src -m set ! --match-set cali40all-ipam-pools dst -j MASQUERADE
"""  # noqa: E501
CALICO_SETS = ("create cali40masq-ipam-pools hash:net\nadd cali40masq-ipam-pools 172.16.0.0/16\n"
               "create cali40all-ipam-pools hash:net\nadd cali40all-ipam-pools 172.16.0.0/16\n")


def chains_of(rules: str) -> list[str]:
    """The chains the rules add to or jump to (cali-fip-snat is jumped to, and empty)."""
    names = []
    for line in rules.splitlines():
        words = line.split()
        names += [words[1]] if words[1] != "POSTROUTING" else []
        target = words[words.index("-j") + 1]
        names += [target] if target not in ("MASQUERADE", "SNAT", "RETURN") else []
    return list(dict.fromkeys(names))


def test_the_posted_jumps_name_known_chains() -> None:
    for rules, cni in ((FLANNEL, "flannel"), (AWS, "AWS VPC CNI"), (CALICO, "Calico")):
        jump = rules.splitlines()[0].split(" -j ")[1]
        got = known_chain("nat", jump)
        assert got is not None and got.cni == cni, jump
    # and the other chains the research found posted (antrea-io/antrea#3975, cilium/cilium
    # #15234, kubernetes-sigs/ip-masq-agent#35 and #206, weaveworks/weave#3599)
    for name, cni in (("ANTREA-POSTROUTING", "Antrea"), ("CILIUM_POST_nat", "Cilium"),
                      ("IP-MASQ-AGENT", "ip-masq-agent"), ("IP-MASQ", "ip-masq-agent"),
                      ("WEAVE", "Weave Net"), ("AWS-CONNMARK-CHAIN-0", "AWS VPC CNI")):
        got = known_chain("nat", name)
        assert got is not None and got.cni == cni
    assert known_chain("filter", "FLANNEL-POSTRTG") is None  # (a nat chain)
    assert known_chain("nat", "KUBE-POSTROUTING") is None


# -- live: the kernel's answer, the agent's on the whole dump and on an excerpt ------------


@contextmanager
def node_with(rules: str, sets: str = "") -> Iterator[Cluster]:
    with build_cluster(SCENARIO, "legacy", real_server=NODE_IP) as c:
        if sets:
            c.node.run("ipset", "restore", input=sets)
        new = "".join(f":{name} - [0:0]\n" for name in chains_of(rules))
        c.node.run("iptables-legacy-restore", "--noflush",
                   input=f"*nat\n{new}{rules}COMMIT\n")
        yield c


def source_leaving(c: Cluster) -> str:
    """The source address the pod's SYN to the LB address leaves the node with."""
    with sniff(c.node) as seen:
        pod_connect(c, LB_IP, 80, timeout=2.0)
    syns = seen.find("SYN", iface="eth0", direction="out", dst=LB_IP)
    assert syns, seen
    return syns[0].src


def verdicts(c: Cluster, tmp: Path, cut: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the live verdict, the verdict of a bundle saved from the node with the chains
    ``cut`` taken out of its iptables-save, as an excerpt leaves them)."""
    kube = str(c.lab.kube_dir)
    before = capture(c.node)
    r = c.node.run(sys.executable, "-m", "agent", "check", "--json", "--all", "--node-name",
                   "n", "--kube-json", kube, check=False, timeout=120)
    assert capture(c.node) == before
    assert r.returncode in (0, 1, 3), r.stderr
    live = json.loads(r.stdout)
    out = tmp / "bundle"
    b = c.node.run(sys.executable, "-m", "agent", "bundle", str(out), "--no-kube-api",
                   check=False, timeout=120)
    assert b.returncode == 0, b.stderr
    for f in ("services.json", "node.json"):
        shutil.copy(Path(kube) / f, out / f)
    save = out / "iptables-save.txt"
    save.write_text("".join(line for line in save.read_text().splitlines(keepends=True)
                            if not any(line.startswith((f"-A {ch} ", f":{ch} "))
                                       for ch in cut)))
    r = c.node.run(sys.executable, "-m", "agent", "check", "--from", str(out), "--json",
                   "--all", check=False, timeout=120)
    assert r.returncode in (0, 1, 3), r.stderr
    return live, json.loads(r.stdout)


def walk_of(v: dict[str, Any]) -> dict[str, Any]:
    got = [f for f in v["findings"] if f["lb_ip"] == LB_IP and f["id"].startswith("pod-to-lb")]
    assert len(got) == 1, got
    return got[0]


@pytest.mark.netns
def test_flannel_masquerades_and_its_layout_decides_an_excerpt(tmp_path: Path) -> None:
    with node_with(FLANNEL) as c:
        assert source_leaving(c) == NODE_IP  # the kernel: masqueraded
        live, excerpt = verdicts(c, tmp_path, ["FLANNEL-POSTRTG"])
    assert walk_of(live)["id"] == "pod-to-lb-masqueraded"
    assert any("FLANNEL-POSTRTG" in e and "-j MASQUERADE" in e for e in walk_of(live)["evidence"])
    f = walk_of(excerpt)
    assert f["id"] == "pod-to-lb-masqueraded"
    ev = "\n".join(f["evidence"])
    assert "FLANNEL-POSTRTG, assumed: masquerades it to the node's address" in ev
    assert "`iptables -t nat -S FLANNEL-POSTRTG" in ev
    assert "flannel-io/flannel pkg/trafficmngr/iptables/iptables.go" in ev


@pytest.mark.netns
def test_aws_keeps_the_pod_address_inside_the_vpc_and_an_excerpt_says_it_depends(
        tmp_path: Path) -> None:
    with node_with(AWS) as c:
        # the LB address 10.0.1.10 is inside the VPC's 10.0.0.0/16: not SNATed
        assert source_leaving(c) == SCENARIO.client_pod_ip
        live, excerpt = verdicts(c, tmp_path, ["AWS-SNAT-CHAIN-0", "AWS-SNAT-CHAIN-1"])
    assert walk_of(live)["id"] == "pod-to-lb-not-masqueraded"
    f = walk_of(excerpt)
    assert f["id"] == "pod-to-lb-undetermined"
    assert "what AWS VPC CNI's AWS-SNAT-CHAIN-0 does on this node" in f["summary"]
    assert "aws ec2 describe-vpcs" in f["summary"]


@pytest.mark.netns
def test_calico_nat_outgoing_masquerades_and_an_excerpt_says_it_depends(
        tmp_path: Path) -> None:
    with node_with(CALICO, CALICO_SETS) as c:
        assert source_leaving(c) == NODE_IP  # natOutgoing: the pool's pods are masqueraded
        live, excerpt = verdicts(c, tmp_path, ["cali-POSTROUTING", "cali-nat-outgoing",
                                               "cali-fip-snat"])
    assert walk_of(live)["id"] == "pod-to-lb-masqueraded"
    f = walk_of(excerpt)
    assert f["id"] == "pod-to-lb-undetermined"
    assert "what Calico's cali-POSTROUTING does on this node" in f["summary"]
    assert "ipset list cali40masq-ipam-pools" in f["summary"]
