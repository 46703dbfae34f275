"""Lab clusters shared by the traffic and capture tests (built once per test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab import netns
from lab.clb import Cluster, build_cluster
from lab.node import REAL, ipvs_kind
from lab.scenarios import SCENARIOS

# tests/guest needs real IPVS: it runs inside the VM (tests/test_vm_ipvs.py), which fails
# loudly when it cannot; elsewhere it is not collected rather than skipped test by test
collect_ignore_glob = [] if ipvs_kind() == REAL else ["guest/*"]


@pytest.fixture(scope="module")
def etp_local() -> Iterator[Cluster]:
    """TKE IPVS, LB IP not bound, eTP=Local: pod -> VIP leaves with the pod's IP."""
    with build_cluster(SCENARIOS["tke-ipvs-etp-local"], "nft") as c:
        yield c


@pytest.fixture(scope="module")
def lb_bound() -> Iterator[Cluster]:
    """Upstream IPVS: the LB IP is bound on node 1's kube-ipvs0."""
    with build_cluster(SCENARIOS["ipvs-lb-bound"], "legacy") as c:
        yield c


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM and SIGHUP (CI cancelling the job, `timeout`, a closed terminal) stop the run
    as Ctrl-C does: pytest ends the session, each test's clean-up runs (its namespaces and
    processes go). By default they killed it where it stood; lab.netns's own handler,
    for scripts and benches, deletes the namespaces and then lets the signal kill it."""
    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    netns.on_termination(interrupted)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The VM's guest run starts now, in the background, when its test was selected:
    it overlaps the host's tests instead of following them (tests/vm_guest.py)."""
    if any(item.nodeid.startswith("tests/test_vm_ipvs.py::test_ipvs_mode_on_real_ipvs")
           for item in session.items):
        from tests import vm_guest

        vm_guest.start()
