"""Real IPVS: boot a stock Debian kernel under virtme-ng and run the IPVS-mode tests
there (``make test-vm`` runs only these; ``make test`` includes them).

This machine's kernel has no IP_VS and no dummy, so elsewhere IPVS is a stand-in (see
lab/node.py). In the guest the same lab code builds a real dummy kube-ipvs0 and
real virtual servers (``ipvsadm -R``, as kube-proxy's rules would), and the guest runs:

- tests/guest: the live IPVS probe against ``ipvsadm -Ln``, the lab on real IPVS;
- the IPVS scenarios of the ``check`` tests (live verdict == ``check --from`` on the
  bundle saved in the guest, with real ``ipvsadm`` output; nothing changed on the node);
- the capture tests and the lab's traffic tests: a real health check from a VIP bound
  on kube-ipvs0 dropped as martian source, the TKE variant whose pod traffic loops
  through the CLB.
- the dual-stack node's IPv6 IPVS proxier (lab.dual_stack): real IPv6 virtual servers
  read live == from the bundle, and a pod's IPv6 SYN through them to the endpoint pod.

The VM boots once for the whole guest run, in the background from the moment pytest
has collected it (tests/vm_guest.py), so it overlaps the host's tests. If it cannot
start, these tests fail and say why; they never skip.
"""

from __future__ import annotations

import os
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest

from lab import vm
from tests import vm_guest

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def kernel() -> vm.Kernel:
    if os.geteuid() != 0:
        pytest.fail("the VM tests need root (apt-get download, the guest's lab)")
    try:
        return vm.ensure_kernel()
    except vm.VmError as exc:
        pytest.fail(f"cannot prepare the stock kernel: {exc}")


@pytest.fixture(scope="module")
def guest_run() -> Iterator[tuple[vm.VmResult, ET.Element]]:
    if os.geteuid() != 0:
        pytest.fail("the VM tests need root (apt-get download, the guest's lab)")
    try:
        kernel, result, waited = vm_guest.result()
    except vm.VmError as exc:
        pytest.fail(f"the VM did not run the guest tests: {exc}")
    # the figure the issue asks to keep an eye on, in the -rA / -s output of make test-vm
    print(f"\nVM ({kernel.package} {kernel.package_version}): guest tests took "
          f"{result.seconds:.0f} s, in the background (waited {waited:.0f} s for them)")
    junit = result.outdir / "junit.xml"
    if not junit.exists():
        pytest.fail(f"the guest wrote no junit.xml (exit {result.returncode}):\n"
                    f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    yield result, ET.parse(junit).getroot()
    shutil.rmtree(result.outdir, ignore_errors=True)


def test_the_guest_reports_status_and_output(kernel: vm.Kernel) -> None:
    r = vm.run("uname -r; cat /proc/net/ip_vs | head -1; ip link add d0 type dummy && "
               "echo dummy; echo to-stderr >&2; exit 3", kernel=kernel, timeout=300)
    shutil.rmtree(r.outdir)
    assert r.returncode == 3
    lines = r.stdout.splitlines()
    assert lines[0] == kernel.release  # the stock kernel, not this machine's
    assert lines[1].startswith("IP Virtual Server version")
    assert lines[2] == "dummy"
    assert r.stderr.strip() == "to-stderr"


def test_a_guest_that_does_not_finish_is_an_error_not_a_hang(kernel: vm.Kernel) -> None:
    with pytest.raises(vm.VmError, match="did not finish within 3 s"):
        vm.run("sleep 600", kernel=kernel, timeout=3)


def test_ipvs_mode_on_real_ipvs(guest_run: tuple[vm.VmResult, ET.Element]) -> None:
    result, junit = guest_run
    cases = junit.findall(".//testcase")
    bad = [(c.get("classname"), c.get("name"), (child.get("message") or "")[:500])
           for c in cases for child in c if child.tag in ("failure", "error", "skipped")]
    assert not bad, f"in the VM (a skip counts as a failure here): {bad}\n{result.stdout[-6000:]}"
    assert len(cases) >= vm_guest.MIN_GUEST_TESTS, [c.get("name") for c in cases]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    names = {c.get("name", "").split("[")[0] for c in cases}
    for required in ("test_the_ipvs_probe_lists_what_ipvsadm_lists",
                     "test_forwarding_method_comes_from_the_raw_attribute",
                     "test_the_lab_runs_on_real_ipvs",
                     "test_healthcheck_from_a_vip_bound_here_is_observed_dropped",
                     "test_same_node_pod_loop_is_observed",
                     "test_live_check_finds_what_the_scenario_expects",
                     "test_ipvs_sources_that_disagree_on_real_ipvs",
                     "test_what_if_nftables_on_real_ipvs"):
        assert required in names
