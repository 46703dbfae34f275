"""The Helm chart (charts/loopback-agent/) renders the kustomize base's objects.

With Helm's own binary (v4, `make test` puts it in the venv: charts/install_helm.py):
`helm lint` passes (and fails on a broken template), and `helm template` with the default
values renders exactly what `kubectl kustomize daemonset/` renders, object for object and
field for field, but for the labels naming the tool (managed-by, helm.sh/chart) and the
chart's config checksum annotation; with tls + kube-token, exactly the kustomize overlay
with those components; with monitoring, the monitoring component's objects. The chart's own
switches (--kube-report and its RBAC, collector off, image, resources, tolerations, extra
flags) are checked on what they render, and every rendered object is valid Kubernetes.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.test_deploy import (
    K8S_VERSIONS,
    KUSTOMIZE_DIR,
    agent_ds,
    collector_dep,
    container_env,
    kustomize,
    one,
    only_container,
    parsed_with_env,
    pod_spec,
    tool,
)

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "loopback-agent"
TOOL_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart")
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}

Obj = dict[str, Any]


def helm(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache",
                                        "HELM_CONFIG_HOME": "/tmp/helm-config",
                                        "HELM_DATA_HOME": "/tmp/helm-data"})


def template(*sets: str, chart: Path = CHART) -> list[Obj]:
    args = ["template", "loopback-agent", str(chart), "--namespace", "loopback-agent"]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def normalized(objs: list[Obj]) -> dict[tuple[str, str, str], Obj]:
    out = {}
    for o in objs:
        o = copy.deepcopy(o)
        labels = o["metadata"].get("labels", {})
        for key in TOOL_LABELS:
            labels.pop(key, None)
        ann = o.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
        ann.pop("checksum/config", None)
        # volumes and mounts are matched by name and path, their order means nothing (a
        # kustomize patch puts what it adds first)
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        if "volumes" in spec:
            spec["volumes"].sort(key=lambda v: v["name"])
        for c in spec.get("containers", []):
            c.get("volumeMounts", []).sort(key=lambda m: m["mountPath"])
        out[(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])] = o
    return out


def overlay(tmp_path: Path, components: list[str]) -> list[Obj]:
    rel = os.path.relpath(KUSTOMIZE_DIR, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [rel], "components": [f"{rel}/{c}" for c in components]}))
    return kustomize(tmp_path)


def assert_same(helm_objs: list[Obj], kustomize_objs: list[Obj]) -> None:
    h, k = normalized(helm_objs), normalized(kustomize_objs)
    assert sorted(h) == sorted(k)
    for key in k:
        assert h[key] == k[key], f"{key} differs:\nhelm: {json.dumps(h[key], indent=1)}\n" \
                                 f"kustomize: {json.dumps(k[key], indent=1)}"


# -- helm lint -------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [(), ("tls.enabled=true", "auth.mode=kube-token",
                                       "monitoring.enabled=true", "monitoring.dashboard=true",
                                       "agent.kubeReport.enabled=true"),
                                  ("collector.enabled=false",)])
def test_helm_lint(sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_helm_lint_catches_a_broken_chart(tmp_path: Path) -> None:
    broken = tmp_path / "loopback-agent"
    shutil.copytree(CHART, broken)
    path = broken / "templates" / "agent-daemonset.yaml"
    path.write_text(path.read_text().replace("{{- end }}\n", "", 1))
    proc = helm("lint", str(broken))
    assert proc.returncode != 0 and "1 chart(s) failed" in proc.stderr
    assert "[ERROR] templates/: parse error" in proc.stdout


def test_helm_is_the_pinned_upstream_binary() -> None:
    proc = helm("version", "--short")
    assert proc.returncode == 0 and proc.stdout.startswith("v4."), proc.stdout


# -- the same objects as kustomize -------------------------------------------------------------


def test_defaults_render_the_kustomize_base() -> None:
    assert_same(template(), kustomize(KUSTOMIZE_DIR))


def test_tls_and_kube_token_render_the_components(tmp_path: Path) -> None:
    assert_same(template("tls.enabled=true", "auth.mode=kube-token"),
                overlay(tmp_path, ["tls", "kube-token"]))


def test_kube_report_renders_the_component(tmp_path: Path) -> None:
    """The same flag and the same RBAC as daemonset/kube-report/: what the code calls
    (patch nodes/status; create/patch events.k8s.io Events) and no more."""
    assert_same(template("agent.kubeReport.enabled=true"), overlay(tmp_path, ["kube-report"]))


def test_monitoring_renders_the_component(tmp_path: Path) -> None:
    assert_same(template("monitoring.enabled=true"), overlay(tmp_path, ["monitoring"]))


def test_dashboard_config_map_holds_the_dashboard() -> None:
    objs = template("monitoring.enabled=true", "monitoring.dashboard=true")
    cm = one(objs, "ConfigMap", "loopback-agent-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["loopback-agent.json"]) == \
        json.loads((REPO / "dashboards" / "loopback-agent.json").read_text())
    assert not [o for o in template("monitoring.enabled=true")
                if o["metadata"]["name"] == "loopback-agent-dashboard"]


# -- the chart's own switches ------------------------------------------------------------------


def write_rules(objs: list[Obj]) -> list[tuple[str, str, list[str], list[str]]]:
    return [(o["metadata"]["name"], g, r.get("resources", []), r["verbs"])
            for o in objs if o["kind"] in ("ClusterRole", "Role") for r in o["rules"]
            for g in r["apiGroups"] if WRITE_VERBS & set(r["verbs"])]


def test_kube_report_adds_the_flag_and_its_rbac_only(monkeypatch: pytest.MonkeyPatch) -> None:
    off, on = template(), template("agent.kubeReport.enabled=true")
    assert only_container(agent_ds(off))["args"] == ["run"]
    assert only_container(agent_ds(on))["args"] == ["run", "--kube-report"]
    # off: the agent's account has no write anywhere (the collector's TokenReview create
    # is its only one)
    assert [w[0] for w in write_rules(off)] == ["loopback-agent-collector-tokenreview"]
    added = [w for w in write_rules(on) if w[0] == "loopback-agent-report"]
    assert sorted((g, tuple(res), tuple(v)) for _, g, res, v in added) == [
        ("", ("nodes/status",), ("patch",)),
        ("events.k8s.io", ("events",), ("create", "patch"))]
    binding = one(on, "ClusterRoleBinding", "loopback-agent-report")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "loopback-agent",
                                    "namespace": "loopback-agent-node"}]
    # nothing else changes
    rest_on = {k: v for k, v in normalized(on).items() if "loopback-agent-report" not in k}
    rest_off = normalized(off)
    ds_key = ("DaemonSet", "loopback-agent-node", "loopback-agent")
    only_container(rest_on[ds_key])["args"] = ["run"]
    assert rest_on == rest_off


def test_without_a_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = template("collector.enabled=false")
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not [n for n in names if "collector" in n[1]], names
    assert ("Namespace", "loopback-agent") not in names  # the collector's namespace
    env = container_env(objs, only_container(agent_ds(objs)))
    assert "LOOPBACK_AGENT_COLLECTOR" not in env  # verdicts to stdout and the spool
    external = template("collector.enabled=false", "collector.url=https://c.example:8443")
    env = container_env(external, only_container(agent_ds(external)))
    args = parsed_with_env("run", env, monkeypatch)
    assert args.collector == "https://c.example:8443"


def test_values_reach_the_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = template("image.repository=reg.example/lb", "image.tag=9.9",
                    "agent.resources.limits.memory=256Mi", "agent.tolerations=null",
                    "agent.extraArgs={--no-capture}", "agent.interval=30",
                    "collector.resources.requests.cpu=250m")
    ds, dep = agent_ds(objs), collector_dep(objs)
    assert only_container(ds)["image"] == only_container(dep)["image"] == "reg.example/lb:9.9"
    assert only_container(ds)["resources"]["limits"]["memory"] == "256Mi"
    assert "tolerations" not in pod_spec(ds)
    assert only_container(dep)["resources"]["requests"]["cpu"] == "250m"
    c = only_container(ds)
    assert c["args"] == ["run", "--no-capture"]
    monkeypatch.setattr("sys.argv", ["loopback-agent"])
    args = parsed_with_env("run", container_env(objs, c), monkeypatch)
    assert args.interval == 30.0
    digest = "sha256:" + "a" * 64
    pinned = template(f"image.digest={digest}")
    assert only_container(agent_ds(pinned))["image"] == \
        f"ghcr.io/loopback-agent/loopback-agent@{digest}"


def test_postgres_collector_rolls_without_a_volume() -> None:
    objs = template("collector.db=postgresql://lb@db.example/lb", "collector.replicas=2")
    dep = collector_dep(objs)
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    proc = helm("template", "x", str(CHART), "--set", "collector.replicas=2")
    assert proc.returncode != 0 and "PostgreSQL" in proc.stderr  # SQLite has one writer


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_objects_are_valid_kubernetes(version: str) -> None:
    errors = []
    for sets in ((), ("tls.enabled=true", "auth.mode=kube-token",
                      "agent.kubeReport.enabled=true", "monitoring.enabled=true",
                      "monitoring.dashboard=true"), ("collector.enabled=false",)):
        for o in template(*sets):
            if o["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD's: test_monitoring_renders_the_component compares them
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{sets} {o['kind']}/{o['metadata']['name']}: {e.message}")
    assert not errors, "\n".join(errors)


def test_chart_copies_of_the_monitoring_files_are_current() -> None:
    rules = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    component = yaml.safe_load((KUSTOMIZE_DIR / "monitoring" / "prometheusrule.yaml").read_text())
    assert rules == component["spec"]
    assert (CHART / "files" / "loopback-agent-dashboard.json").read_bytes() == \
        (REPO / "dashboards" / "loopback-agent.json").read_bytes()
