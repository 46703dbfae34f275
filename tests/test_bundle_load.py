"""load_bundle: a directory of bundle files -> NodeSnapshot, with Unknowns for the gaps."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.bundle import files as bundle_files
from agent.bundle import load_bundle
from agent.errors import InputError
from agent.snapshot import NodeSnapshot, Unknown

DATA = Path(__file__).parent / "data" / "parse"

# bundle file name -> sample in tests/data/parse/
SAMPLES = {
    bundle_files.IPTABLES: "iptables-save.txt",
    bundle_files.IPSET: "ipset-save.txt",
    bundle_files.IPVSADM: "ipvsadm-Ln.txt",
    bundle_files.ROUTE_LOCAL: "route-local.txt",
    bundle_files.ADDR: "addr.txt",
    bundle_files.SYSCTL: "sysctl.txt",
    bundle_files.SERVICES: "services.json",
    bundle_files.NODE: "node.json",
    bundle_files.INGRESSES: "ingresses.json",
}
KUBE_PROXY = Unknown("kube-proxy", "its flags, log or configuration are not in the input "
                     "(`ps -ef | grep kube-proxy` or `kubectl -n kube-system logs` of its "
                     "pod would show its mode)")
README = Unknown("README.txt", "README.txt: no known command output in it (give iptables-save, "
                 "ipset save, ipvsadm -Ln, ip addr, ip route show table local, sysctl -a, "
                 "or kubectl get svc -A -o yaml)")


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    for name, sample in SAMPLES.items():
        shutil.copy(DATA / sample, tmp_path / name)
    (tmp_path / "README.txt").write_text("not a bundle file, ignored\n")
    return tmp_path


def test_full_bundle(bundle: Path) -> None:
    snap = load_bundle(bundle)
    assert snap.node == "node-1"
    assert snap.origin == f"bundle:{bundle}"
    assert snap.unknowns == (README, KUBE_PROXY)
    assert snap.kube_proxy is None
    assert snap.netfilter is not None and snap.netfilter.backend == "nft"
    nat = snap.netfilter.table("nat")
    assert nat is not None and nat.chain("KUBE-POSTROUTING") is not None
    assert snap.ipset("KUBE-LOAD-BALANCER-LOCAL") is not None
    assert snap.ipvs is not None and len(snap.ipvs) == 8
    assert snap.local_routes is not None
    assert any(r.dst == "203.0.113.10" and r.dev == "kube-ipvs0" for r in snap.local_routes)
    assert snap.addresses is not None
    assert any(a.ifname == "kube-ipvs0" and not a.link_up for a in snap.addresses)
    assert snap.sysctls is not None and snap.sysctls["net.ipv4.ip_forward"] == "1"
    assert snap.services is not None and len(snap.services) == 4
    assert snap.ingresses is not None and len(snap.ingresses) == 2
    assert snap.node_info is not None and snap.node_info.internal_ips[0] == "10.0.0.10"
    # The snapshot survives its own JSON round trip.
    assert NodeSnapshot.from_json(snap.to_json()) == snap


def test_json_forms_of_ip_output(bundle: Path) -> None:
    shutil.copy(DATA / "addr.json", bundle / bundle_files.ADDR)
    shutil.copy(DATA / "route-local.json", bundle / bundle_files.ROUTE_LOCAL)
    shutil.copy(DATA / "ipset-list.txt", bundle / bundle_files.IPSET)
    shutil.copy(DATA / "ipvsadm-S.txt", bundle / bundle_files.IPVSADM)
    assert load_bundle(str(bundle)) == load_bundle(bundle)  # str or Path
    snap = load_bundle(bundle)
    assert snap.unknowns == (README, KUBE_PROXY)


def test_missing_file(bundle: Path) -> None:
    (bundle / bundle_files.IPVSADM).unlink()
    (bundle / bundle_files.NODE).unlink()
    snap = load_bundle(bundle)
    assert snap.ipvs is None
    assert snap.node_info is None and snap.node is None
    assert snap.unknowns == (Unknown("ipvs", "not given (`ipvsadm -Ln` output would show "
                                     "it)"), README, KUBE_PROXY)
    assert snap.addresses is not None


def test_garbage_file(bundle: Path) -> None:
    (bundle / bundle_files.ROUTE_LOCAL).write_text("local 10.0.0.5 dev eth0\nlocal ???\n")
    (bundle / bundle_files.IPTABLES).write_text("*nat\n:PREROUTING ACCEPT [0:0]\n")
    (bundle / bundle_files.SERVICES).write_text('{"kind": "List", "items": [,]}')
    snap = load_bundle(bundle)
    # the readable route is used, the unreadable line named; the nat table without COMMIT
    # is read and named; bad JSON leaves the Services unknown
    assert snap.local_routes is not None and [r.dst for r in snap.local_routes] == ["10.0.0.5"]
    assert snap.netfilter is not None and snap.services is None
    reasons = {u.source: u.reason for u in snap.unknowns}
    assert reasons["route-local.txt"].startswith("route-local.txt:2: ")
    assert reasons["iptables-save.txt"] == ("iptables-save.txt:1: table 'nat' is not closed "
                                            "by COMMIT (file truncated?)")
    assert reasons["services.json"].startswith("services.json:1: not valid YAML/JSON")
    assert snap.addresses is not None


def test_not_utf8_names_the_line(bundle: Path) -> None:
    data = (DATA / "addr.txt").read_bytes().splitlines(keepends=True)
    data[2] = b"    inet 10.0.0.\xff/24 scope global lo\n"
    (bundle / bundle_files.ADDR).write_bytes(b"".join(data))
    snap = load_bundle(bundle)
    assert snap.addresses is None
    (reason,) = [u.reason for u in snap.unknowns if u.source == "addr.txt"]
    assert reason == "addr.txt:3: not UTF-8 text (byte 0xff at column 17)"
    assert Unknown("addresses", "not given (`ip addr` output would show it)") in snap.unknowns


def test_unreadable_file(bundle: Path) -> None:
    # Root reads any mode, so a directory in the file's place stands in for "unreadable".
    (bundle / bundle_files.SYSCTL).unlink()
    (bundle / bundle_files.SYSCTL).mkdir()
    snap = load_bundle(bundle)
    assert snap.sysctls is None
    (reason,) = [u.reason for u in snap.unknowns if u.source == "sysctl.txt"]
    assert reason == "sysctl.txt: not a regular file: skipped"


def test_empty_ipset_file_is_no_sets(bundle: Path) -> None:
    (bundle / bundle_files.IPSET).write_text("")
    (bundle / bundle_files.ADDR).write_text("")
    snap = load_bundle(bundle)
    # the bundle's empty ipset.txt is `ipset save` printing nothing: no sets; an empty
    # addr.txt says nothing (a node always has addresses)
    assert snap.ipsets == () and snap.addresses is None
    assert Unknown("addr.txt", "addr.txt: empty") in snap.unknowns


def test_single_file_bundle(tmp_path: Path) -> None:
    shutil.copy(DATA / "sysctl.txt", tmp_path / bundle_files.SYSCTL)
    snap = load_bundle(tmp_path)
    assert snap.sysctls is not None
    assert [u.source for u in snap.unknowns] == ["iptables", "ipsets", "ipvs", "addresses",
                                                 "local table", "services", "kube-proxy"]
    # the same file given alone, or on standard input, reads the same
    assert load_bundle(tmp_path / bundle_files.SYSCTL).sysctls == snap.sysctls


def test_no_such_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(InputError, match="no such file or directory") as err:
        load_bundle(missing)
    assert err.value.source == str(missing)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InputError, match=r"nothing usable found: .*no known command output"):
        load_bundle(a_file)


def test_no_bundle_files(tmp_path: Path) -> None:
    (tmp_path / "other.txt").write_text("hello\n")
    with pytest.raises(InputError, match=r"nothing usable found: other.txt: no known command"):
        load_bundle(tmp_path)


def test_empty_rules_files_are_no_tables_as_a_live_read_says(bundle: Path) -> None:
    # `bundle` writes iptables-save.txt / ip6tables-save.txt empty only where the dump
    # printed nothing (no table: the live probe's "no rules"); a failed dump leaves no
    # file. Both families read an empty file the same way, as the live check does.
    (bundle / bundle_files.IPTABLES).write_text("")
    (bundle / bundle_files.IP6TABLES).write_text("\n")
    snap = load_bundle(bundle)
    assert snap.netfilter is not None and snap.netfilter.tables == ()
    assert snap.ip6tables is not None and snap.ip6tables.tables == ()
    assert not any(u.source in ("iptables", bundle_files.IPTABLES) for u in snap.unknowns), \
        snap.unknowns
