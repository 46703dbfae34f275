"""Lab clusters shared by the traffic and capture tests (built once per test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.lab.clb import Cluster, build_cluster
from agent.lab.scenarios import SCENARIOS


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
