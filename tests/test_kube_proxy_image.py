"""kube-proxy's version from its image (issue 33, item 1): real Pod objects people posted
(tests/data/kube_proxy_pods, each with its source), kube-proxy's DaemonSet, the one choice
among them, the version a known bug's fix is decided by, and the live read against a real
HTTP server speaking the API (tests/kube_apiserver.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.bundle import load_texts
from agent.bundle.sections import name_format
from agent.diagnose import diagnose
from agent.diagnose.kube_proxy_version import image_version, kube_proxy_version
from agent.errors import InputError
from agent.parse.kube import choose_kube_proxy_image, kube_proxy_pods
from agent.snapshot import NodeSnapshot

PODS = Path(__file__).parent / "data" / "kube_proxy_pods"
BUGS = Path(__file__).parent / "data" / "known_bugs"


def snap_of(*files: tuple[str, str]) -> NodeSnapshot:
    return load_texts([(n, t, name_format(n)) for n, t in files], origin="bundle:t")


@pytest.mark.parametrize("file,name,image,version,vendor", [
    ("kubeadm-daemonset-kube-proxy-p4jmn.json", "kube-proxy-p4jmn",
     "registry.k8s.io/kube-proxy:v1.28.15", (1, 28, 15), False),
    ("eks-kube-proxy-82mb2.json", "kube-proxy-82mb2",
     "602401143452.dkr.ecr.us-east-1.amazonaws.com/eks/kube-proxy:"
     "v1.31.10-minimal-eksbuild.8", (1, 31, 10), True),
    ("static-gke-kubelet-kube-proxy-gke-haissam.json",
     "kube-proxy-gke-haissam-default-pool-be5066f1-wnvn",
     "gcr.io/google_containers/kube-proxy:v1.9.2-gke.1", (1, 9, 2), True),
    ("minikube-kube-proxy-dt5lc.yaml", "kube-proxy-dt5lc", "k8s.gcr.io/kube-proxy:v1.14.0",
     (1, 14, 0), False),
])
def test_posted_pods_say_kube_proxys_version(file: str, name: str, image: str,
                                             version: tuple[int, int, int],
                                             vendor: bool) -> None:
    """As posted (kind-less items of `kubectl cluster-info dump`, a kubelet's static Pod
    labelled component=kube-proxy, a YAML document), under the bundle's file name."""
    text = (PODS / file).read_text()
    snap = snap_of((f"kube-proxy-pod{Path(file).suffix}", text))
    pod = snap.kube_proxy_image
    assert pod is not None and (pod.of, pod.image) == (f"Pod kube-system/{name}", image)
    assert not [u for u in snap.unknowns if "not used" in u.reason]
    v = kube_proxy_version(snap, "iptables")
    # (the kubelet's static Pod was posted Pending: its image is said, not taken)
    pending = "gke" in file
    assert v is not None and v.version == (None if pending else version)
    assert f"the image of its Pod kube-system/{name}: {image}" in v.how
    assert ("a vendor's build" in v.how) == vendor
    assert ("its container is not running" in v.how) == pending


def test_the_running_kube_proxy_among_kube_systems_pods() -> None:
    """kube-system's Pods on a node (constructed around the posted kubeadm Pod): CoreDNS is
    not kube-proxy, a kube-proxy Pod in another namespace is not this node's kube-proxy,
    one being deleted during a roll and one waiting for its new image give way to the
    running one, which also wins over the DaemonSet's template (one chooser for every
    input: a bundle, a paste, the API)."""
    real = json.loads((PODS / "kubeadm-daemonset-kube-proxy-p4jmn.json").read_text())

    def variant(name: str, image: str, **status: object) -> dict:  # type: ignore[type-arg]
        p = json.loads(json.dumps(real))
        p["metadata"]["name"] = name
        p["spec"]["containers"][0]["image"] = image
        p["status"].update(status)
        p["status"]["containerStatuses"][0]["image"] = image
        return p  # type: ignore[no-any-return]

    ending = variant("kube-proxy-old11", "registry.k8s.io/kube-proxy:v1.27.16")
    ending["metadata"]["deletionTimestamp"] = "2024-10-24T21:20:00Z"
    waiting = variant("kube-proxy-new22", "registry.k8s.io/kube-proxy:v1.29.10")
    waiting["status"]["containerStatuses"][0]["state"] = {
        "waiting": {"reason": "ImagePullBackOff"}}
    coredns = {"metadata": {"name": "coredns-5dd5756b68-x", "namespace": "kube-system",
                            "labels": {"k8s-app": "kube-dns"}},
               "spec": {"containers": [{"name": "coredns",
                                        "image": "registry.k8s.io/coredns/coredns:v1.10.1"}]},
               "status": {"phase": "Running"}}
    elsewhere = json.loads(json.dumps(real))
    elsewhere["metadata"]["namespace"] = "tenant-a"
    found = kube_proxy_pods({"kind": "PodList", "items": [coredns, ending, waiting,
                                                          elsewhere, real]}, "pods.json")
    assert [(f.of, f.running) for f in found] == [
        ("Pod kube-system/kube-proxy-old11", False), ("Pod kube-system/kube-proxy-new22", False),
        ("Pod kube-system/kube-proxy-p4jmn", True)]
    for order in (found, found[::-1]):
        chosen = choose_kube_proxy_image(order)
        assert chosen is not None and chosen.of == "Pod kube-system/kube-proxy-p4jmn"
    # without the running one: the DaemonSet's template, then an ending Pod's
    from agent.snapshot import KubeProxyImage

    ds = KubeProxyImage("DaemonSet kube-system/kube-proxy",
                        "registry.k8s.io/kube-proxy:v1.28.15", "x")
    chosen = choose_kube_proxy_image([found[0], ds, found[1]])
    assert chosen is not None and chosen.of.startswith("DaemonSet")
    assert kube_proxy_pods({"kind": "PodList", "items": [coredns]}, "x") == []
    bad = json.loads(json.dumps(real))
    bad["spec"]["containers"] = {"name": "kube-proxy"}
    with pytest.raises(InputError, match=r"items\[1\]\.spec\.containers: expected a list"):
        kube_proxy_pods({"kind": "PodList", "items": [coredns, bad]}, "pods.json")
    # the waiting Pod's image is said, not taken as kube-proxy's version
    snap = snap_of(("pods.json", json.dumps({"kind": "PodList", "items": [waiting]})))
    v = kube_proxy_version(snap, "iptables")
    assert v is not None and v.version is None and "its container is not running" in v.how


@pytest.mark.parametrize("image,expected", [
    ("registry.k8s.io/kube-proxy:v1.32.2", ((1, 32, 2), False)),
    ("registry.example:5000/kube-proxy:v1.30.1@sha256:" + "a" * 64, ((1, 30, 1), False)),
    ("ccr.ccs.tencentyun.com/tkeimages/kube-proxy:v1.22.5-tke.1", ((1, 22, 5), True)),
    ("registry.k8s.io/kube-proxy@sha256:" + "b" * 64, None),  # a digest says no release
    ("registry.example:5000/kube-proxy", None),  # (the port is not a tag)
    ("registry.k8s.io/kube-proxy:latest", None),
    ("registry.example/kube-proxy:v2.1.0", None),  # (an image's own numbering)
])
def test_image_tags(image: str, expected: object) -> None:
    assert image_version(image) == expected


def hc_bundle(image: str | None, log_version: str | None = None) -> dict:  # type: ignore[type-arg]
    from tests.test_known_bugs import HC_SERVICE, HC_SETS

    files = [("iptables-filter.txt",
              (BUGS / "k8s-117621-kube-ipvs-filter-v1.26.3.txt").read_text()),
             ("ipset.txt", HC_SETS), ("services.json", HC_SERVICE)]
    if image is not None:
        real = json.loads((PODS / "kubeadm-daemonset-kube-proxy-p4jmn.json").read_text())
        real["spec"]["containers"][0]["image"] = image
        real["status"]["containerStatuses"][0]["image"] = image
        files.append(("pods.json", json.dumps(real)))
    if log_version is not None:
        files.append(("kube-proxy.log", 'I0504 10:00:00.000000       1 server.go:497] '
                      f'"Version info" version="{log_version}"\n'
                      'I0504 10:00:00.000001       1 server_others.go:255] "Using ipvs '
                      'Proxier"\n'))
    return diagnose(snap_of(*files), "n").to_dict("all")


def found_117621(v: dict) -> list[dict]:  # type: ignore[type-arg]
    return [f for f in v["findings"] if (f.get("data") or {}).get("bug") == "kubernetes#117621"]


def test_the_pods_image_decides_a_known_bugs_fix() -> None:
    """kubernetes#117621's posted chain: the Pod's image before the fix says the bug with
    the version; the image with the fix says nothing; kube-proxy's own log wins over an
    image that disagrees (the process's word), and both are said."""
    (f,) = found_117621(hc_bundle("registry.k8s.io/kube-proxy:v1.26.3"))
    assert "v1.26.3 (the image of its Pod kube-system/kube-proxy-p4jmn" in f["summary"]
    assert found_117621(hc_bundle("registry.k8s.io/kube-proxy:v1.28.15")) == []
    assert len(found_117621(hc_bundle(None))) == 1  # (no version: said "if it is")
    v = hc_bundle("registry.k8s.io/kube-proxy:v1.28.15", log_version="v1.26.3")
    (f,) = found_117621(v)
    how = v["context"]["kube_proxy_version"]
    assert how.startswith("v1.26.3 (kube-proxy's log") and "v1.28.15 (the image" in how
    assert "its log's version is the one taken" in how


def test_the_api_gives_kube_proxys_daemonset(tmp_path: Path) -> None:
    """A one-shot read (`check`, `bundle`) against a real HTTP API server: kube-proxy's
    DaemonSet by its name; none (a static-pod kube-proxy) says nothing; a DaemonSet the
    account may not read (an install whose RBAC predates the Role) is said, the rest read;
    a bundle keeps only its name and images."""
    pytest.importorskip("kubernetes")
    from agent.bundle.write import _reduced_daemon_set
    from agent.probes import kube_api
    from agent.probes.base import ProbeContext
    from tests.kube_apiserver import FakeKubeAPI, daemon_set, kubeconfig, node, service

    with FakeKubeAPI() as api:
        api.put("services", service("a", "198.51.100.1"))
        api.put("nodes", node("n1"))
        kc = kubeconfig(str(tmp_path / "kc"), api.url)
        res = kube_api.collect(ProbeContext(node_name="n1", kubeconfig=kc))
        values = dict(zip(kube_api.FIELDS, res.value, strict=True))
        assert values["kube_proxy_image"] is None and res.unknowns == ()  # (none)
        api.put("daemonsets", daemon_set("registry.k8s.io/kube-proxy:v1.33.5"))
        res = kube_api.collect(ProbeContext(node_name="n1", kubeconfig=kc))
        values = dict(zip(kube_api.FIELDS, res.value, strict=True))
        assert values["kube_proxy_image"].of == "DaemonSet kube-system/kube-proxy"
        assert values["kube_proxy_image"].image.endswith(":v1.33.5") and res.unknowns == ()
        (q,) = api.requests("GET", "daemonsets", since=0)[-1:]
        assert q.path == "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy"
        reduced = json.loads(_reduced_daemon_set(json.dumps(
            api.get("daemonsets", "kube-proxy", "kube-system")).encode()))
        assert reduced["spec"]["template"]["spec"]["containers"] == [
            {"name": "kube-proxy", "image": "registry.k8s.io/kube-proxy:v1.33.5"}]
        snap = snap_of(("kube-proxy-daemonset.json", json.dumps(reduced)))
        assert snap.kube_proxy_image is not None
        assert snap.kube_proxy_image.image.endswith(":v1.33.5")
        api.forbidden.add("daemonsets")
        res = kube_api.collect(ProbeContext(node_name="n1", kubeconfig=kc))
        values = dict(zip(kube_api.FIELDS, res.value, strict=True))
        assert values["kube_proxy_image"] is None and values["node_info"].name == "n1"
        (u,) = res.unknowns
        assert u.reason.startswith("kube-proxy: HTTP 403 Forbidden (the DaemonSet")
