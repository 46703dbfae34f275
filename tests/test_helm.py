"""The Helm chart (charts/loopback-agent/) renders the kustomize base's objects.

With Helm's own binary (v4, `make test` puts it in the venv: charts/install_helm.py):
`helm lint` passes (and fails on a broken template, and on values its values.schema.json
refuses). The chart names its objects after the release and puts them in the release's
namespace; rendered as release "loopback-agent" in loopback-agent-node with the collector
in loopback-agent (collector.namespaceOverride), the default values render exactly what
`kubectl kustomize daemonset/` renders but for namespace.yaml (the namespaces, which the
chart creates only with namespace.create), object for object and field for field, but for
the labels naming the tool and the release (managed-by, helm.sh/chart, instance, version)
and the chart's config checksum annotation; with tls + kube-token, kube-report, monitoring
or the network policy, exactly the kustomize overlay with those components. Under any
release name and namespace every reference between the objects resolves. Each value the
chart adds (names, namespaces, pull secrets, pod annotations and labels, scheduling,
security contexts, update strategies, service accounts, extra env/volumes/mounts, the
token Secret, the monitoring toggles, the NetworkPolicy) is checked on what it renders,
every rendered object is valid Kubernetes, and the chart's README lists every value.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.test_deploy import (
    AGENT_NAMESPACE,
    K8S_VERSIONS,
    KUSTOMIZE_DIR,
    NAMESPACE,
    NODE_CIDR,
    OVERLAYS,
    agent_ds,
    collector_dep,
    container_env,
    kustomize,
    one,
    only_container,
    parsed_with_env,
    pod_spec,
    tool,
    volume,
    workloads,
)

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "loopback-agent"
RELEASE = "loopback-agent"
# The kustomize base's layout: the release in the agents' namespace, the collector in its own
BASE_LAYOUT = (f"collector.namespaceOverride={NAMESPACE}",)
# Labels naming the tool and the release: the chart's own, not the base's
DERIVED_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart", "app.kubernetes.io/instance",
                  "app.kubernetes.io/version")
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
MONITORING_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}

Obj = dict[str, Any]
Key = tuple[str, str, str]


def helm(*args: str, cwd: Path = REPO, stdin: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, input=stdin,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-config",
                               "HELM_DATA_HOME": "/tmp/helm-data"})


def helm_args(command: str, sets: tuple[str, ...], values: Obj | None, release: str,
              namespace: str, chart: Path = CHART) -> tuple[list[str], str | None]:
    args = [command, release, str(chart), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    if values is not None:
        args += ["--values", "-"]
    return args, None if values is None else yaml.safe_dump(values)


def render(*sets: str, values: Obj | None = None, release: str = RELEASE,
           namespace: str = AGENT_NAMESPACE, chart: Path = CHART) -> list[Obj]:
    """`helm template` with these --set values and a values file."""
    args, stdin = helm_args("template", sets, values, release, namespace, chart)
    proc = helm(*args, stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_fails(*sets: str, values: Obj | None = None, release: str = RELEASE,
                 namespace: str = AGENT_NAMESPACE) -> str:
    args, stdin = helm_args("template", sets, values, release, namespace)
    proc = helm(*args, stdin=stdin)
    assert proc.returncode != 0, f"rendered: {sets} {values}"
    return proc.stderr


def template(*sets: str, values: Obj | None = None, chart: Path = CHART) -> list[Obj]:
    """Rendered in the kustomize base's layout (its names and namespaces)."""
    return render(*BASE_LAYOUT, *sets, values=values, chart=chart)


def key(o: Obj) -> Key:
    return o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]


def without_derived_labels(node: Any) -> Any:
    """`node` without the labels the chart derives from the release, wherever they are
    (object and pod labels, selectors)."""
    if isinstance(node, dict):
        return {k: without_derived_labels(v) for k, v in node.items()
                if k not in DERIVED_LABELS}
    if isinstance(node, list):
        return [without_derived_labels(v) for v in node]
    return node


def normalized(objs: list[Obj]) -> dict[Key, Obj]:
    out = {}
    for o in objs:
        o = without_derived_labels(copy.deepcopy(o))
        ann = o.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
        ann.pop("checksum/config", None)
        # volumes and mounts are matched by name and path, their order means nothing (a
        # kustomize patch puts what it adds first)
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        if "volumes" in spec:
            spec["volumes"].sort(key=lambda v: v["name"])
        for c in spec.get("containers", []):
            c.get("volumeMounts", []).sort(key=lambda m: m["mountPath"])
        out[key(o)] = o
    return out


def overlay(tmp_path: Path, components: list[str], patches: list[Obj] | None = None
            ) -> list[Obj]:
    rel = os.path.relpath(KUSTOMIZE_DIR, tmp_path)
    doc: Obj = {"resources": [rel], "components": [f"{rel}/{c}" for c in components]}
    if patches:
        doc["patches"] = patches
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    return kustomize(tmp_path)


@functools.cache
def namespace_file_keys() -> frozenset[Key]:
    """daemonset/namespace.yaml's objects: the namespaces and the critical-pods quota,
    which the README applies before `helm install` (and the chart renders only with
    namespace.create)."""
    docs = yaml.safe_load_all((KUSTOMIZE_DIR / "namespace.yaml").read_text())
    return frozenset(key(o) for o in docs if o)


def assert_same(helm_objs: list[Obj], kustomize_objs: list[Obj], *,
                with_namespaces: bool = False) -> None:
    h, k = normalized(helm_objs), normalized(kustomize_objs)
    if not with_namespaces:
        assert namespace_file_keys() <= set(k)
        k = {kk: v for kk, v in k.items() if kk not in namespace_file_keys()}
    assert sorted(h) == sorted(k)
    for kk in k:
        assert h[kk] == k[kk], f"{kk} differs:\nhelm: {json.dumps(h[kk], indent=1)}\n" \
                               f"kustomize: {json.dumps(k[kk], indent=1)}"


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def pod_annotations(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["annotations"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def the(objs: list[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {[key(o) for o in found]}"
    return found[0]


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def ds_of(objs: list[Obj]) -> Obj:
    return the(objs, "DaemonSet")


def dep_of(objs: list[Obj]) -> Obj:
    return the(objs, "Deployment")


def assert_wired(objs: list[Obj], external_accounts: frozenset[tuple[str, str]] = frozenset()
                 ) -> None:
    """Every reference between the objects resolves, whatever the names and namespaces:
    a pod's account, ConfigMaps and claim; a selector's pods; a binding's role and
    subjects; the agents' collector URL and the collector's idea of the agents' account;
    a monitor's pods or Service; the NetworkPolicy's peers. ``external_accounts``:
    (namespace, name) of ServiceAccounts the release uses without creating them."""
    keys = {key(o) for o in objs}
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"])
                for o in of_kind(objs, "ServiceAccount")} | external_accounts
    pods = [(w["metadata"]["namespace"], w) for w in workloads(objs)]
    for ns, w in pods:
        spec = pod_spec(w)
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w)), key(w)
        # no other workload's pods are selected
        assert [x for _, x in pods if selects(w["spec"]["selector"]["matchLabels"],
                                              pod_labels(x))] == [w]
        assert (ns, spec["serviceAccountName"]) in accounts, key(w)
        for c in spec["containers"]:
            for src in c.get("envFrom", []):
                assert ("ConfigMap", ns, src["configMapRef"]["name"]) in keys, key(w)
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", ns,
                        v["persistentVolumeClaim"]["claimName"]) in keys, key(w)
    for b in of_kind(objs, "RoleBinding") + of_kind(objs, "ClusterRoleBinding"):
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace", "") if ref["kind"] == "Role" else ""
        assert (ref["kind"], ns, ref["name"]) in keys, key(b)
        for s in b["subjects"]:
            assert (s["namespace"], s["name"]) in accounts, key(b)
    for svc in of_kind(objs, "Service"):
        ns = svc["metadata"]["namespace"]
        targets = [w for wns, w in pods if wns == ns
                   and selects(svc["spec"]["selector"], pod_labels(w))]
        assert len(targets) == 1, key(svc)
        ports = {p["name"] for p in only_container(targets[0])["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, key(svc)
    ds = ds_of(objs)
    agent_ns, agent_sa = ds["metadata"]["namespace"], pod_spec(ds)["serviceAccountName"]
    deps = of_kind(objs, "Deployment")
    if deps:
        dep = deps[0]
        collector_ns = dep["metadata"]["namespace"]
        service = one(objs, "Service", dep["metadata"]["name"])
        agent_env = container_env(objs, only_container(ds))
        url = agent_env["LOOPBACK_AGENT_COLLECTOR"]
        port = service["spec"]["ports"][0]["port"]
        assert re.fullmatch(rf"https?://{service['metadata']['name']}\.{collector_ns}\.svc"
                            rf":{port}", url), url
        collector_env = container_env(objs, only_container(dep))
        assert collector_env["LOOPBACK_AGENT_AGENT_SERVICE_ACCOUNT"] == \
            f"system:serviceaccount:{agent_ns}:{agent_sa}"
        # the collector may read the agents' pods, where they are (and the agent
        # kube-proxy's DaemonSet, in kube-system)
        roles = {r["metadata"]["name"]: r["metadata"]["namespace"]
                 for r in of_kind(objs, "Role")}
        assert sorted(roles.values()) == sorted([agent_ns, "kube-system"]), roles
    for m in of_kind(objs, "PodMonitor"):
        ns = m["metadata"]["namespace"]
        (target,) = [w for wns, w in pods if wns == ns
                     and selects(m["spec"]["selector"]["matchLabels"], pod_labels(w))]
        ports = {p["name"] for p in only_container(target)["ports"]}
        assert {e["port"] for e in m["spec"]["podMetricsEndpoints"]} <= ports, key(m)
    for m in of_kind(objs, "ServiceMonitor"):
        ns = m["metadata"]["namespace"]
        (target,) = [s for s in of_kind(objs, "Service") if s["metadata"]["namespace"] == ns
                     and selects(m["spec"]["selector"]["matchLabels"],
                                 s["metadata"]["labels"])]
        ports = {p["name"] for p in target["spec"]["ports"]}
        assert {e["port"] for e in m["spec"]["endpoints"]} <= ports, key(m)
    for policy in of_kind(objs, "NetworkPolicy"):
        ns = policy["metadata"]["namespace"]
        (target,) = [w for wns, w in pods if wns == ns and selects(
            policy["spec"]["podSelector"]["matchLabels"], pod_labels(w))]
        assert target["kind"] == "Deployment"
        agents = policy["spec"]["ingress"][0]["from"][0]
        assert agents["namespaceSelector"]["matchLabels"] == \
            {"kubernetes.io/metadata.name": agent_ns}
        assert selects(agents["podSelector"]["matchLabels"], pod_labels(ds))


def invalid(objs: list[Obj], version: str) -> list[str]:
    errors = []
    for o in objs:
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD's: the monitoring tests compare them with the component's
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message} "
                          f"at {list(e.path)}")
    return errors


# -- the values each test below sets; every case's objects are validated and wired ----------

AGENT_ENV = [{"name": "LOOPBACK_AGENT_INTERVAL", "value": "15"},
             {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {"name": "proxy",
                                                                      "key": "url"}}}]
COLLECTOR_ENV = [{"name": "PGPASSWORD", "valueFrom": {"secretKeyRef": {
    "name": "loopback-agent-db", "key": "password"}}}]
EXTRA_VOLUME = {"name": "extra", "configMap": {"name": "site-settings"}}
EXTRA_MOUNT = {"name": "extra", "mountPath": "/etc/site", "readOnly": True}
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}}
TOLERATION = {"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}
PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {
    "kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}

CASES: dict[str, Obj] = {
    "defaults": {},
    "tls kube-token kube-report": {"tls": {"enabled": True}, "auth": {"mode": "kube-token"},
                                   "agent": {"kubeReport": {"enabled": True}}},
    "without a collector": {"collector": {"enabled": False}},
    "namespace.create": {"namespace": {"create": True}},
    "pull secrets": {"imagePullSecrets": [{"name": "regcred"}]},
    "pod annotations and labels": {
        "agent": {"podAnnotations": {"prometheus.io/scrape": "false", "team": "net"},
                  "podLabels": {"team": "net", "app.kubernetes.io/component": "x"}},
        "collector": {"podAnnotations": {"team": "fleet"}, "podLabels": {"team": "fleet"}}},
    "scheduling": {
        "agent": {"affinity": AFFINITY, "nodeSelector": {"kubernetes.io/os": "linux"},
                  "tolerations": [TOLERATION], "priorityClassName": ""},
        "collector": {"affinity": AFFINITY, "nodeSelector": {"pool": "infra"},
                      "tolerations": [TOLERATION], "priorityClassName": "infra-high"}},
    "security contexts": {
        "agent": {"podSecurityContext": {"fsGroup": 0},
                  "securityContext": {"readOnlyRootFilesystem": False,
                                      "capabilities": {"add": ["NET_ADMIN", "NET_RAW",
                                                               "SYS_PTRACE"]}}},
        "collector": {"podSecurityContext": {"runAsUser": 10001, "runAsGroup": 10001,
                                             "fsGroup": 10001},
                      "securityContext": {"runAsNonRoot": True}}},
    "update strategies": {
        "agent": {"updateStrategy": {"rollingUpdate": {"maxUnavailable": 1}}},
        "collector": {"db": "postgresql://lb@db.example/lb", "replicas": 2,
                      "updateStrategy": {"type": "RollingUpdate",
                                         "rollingUpdate": {"maxSurge": 0,
                                                           "maxUnavailable": 1}}}},
    "existing service accounts": {
        "agent": {"serviceAccount": {"create": False, "name": "node-reader"}},
        "collector": {"serviceAccount": {"create": False}}},
    "service account annotations": {
        "agent": {"serviceAccount": {"name": "lb-agent", "annotations": {"team": "net"}}},
        "collector": {"serviceAccount": {"annotations": {
            "eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/lb"}}}},
    "extra env and volumes": {
        "agent": {"extraEnv": AGENT_ENV, "extraVolumes": [EXTRA_VOLUME],
                  "extraVolumeMounts": [EXTRA_MOUNT]},
        "collector": {"db": "postgresql://lb@db.example/lb", "extraEnv": COLLECTOR_ENV,
                      "extraVolumes": [EXTRA_VOLUME], "extraVolumeMounts": [EXTRA_MOUNT],
                      "extraArgs": ["--retention-days", "7"]}},
    "existing secret": {"auth": {"existingSecret": "fleet-token", "existingSecretKey": "t"}},
    "tls names": {"tls": {"enabled": True, "secretName": "cert", "caConfigMap": "bundle"}},
    "pod monitors": {"tls": {"enabled": True},
                     "monitoring": {"podMonitor": {"enabled": True},
                                    "labels": {"release": "kube-prometheus-stack"}}},
    "service monitors": {"tls": {"enabled": True},
                         "monitoring": {"serviceMonitor": {"enabled": True},
                                        "labels": {"release": "kube-prometheus-stack"}}},
    "prometheus rule": {"monitoring": {"prometheusRule": {"enabled": True}}},
    "dashboard": {"monitoring": {"dashboard": {
        "enabled": True, "labels": {"grafana_dashboard": None, "dashboards": "grafana"},
        "annotations": {"grafana_folder": "Kubernetes"}, "namespace": "grafana"}}},
    "network policy": {"collector": {"networkPolicy": {
        "enabled": True, "nodeCIDRs": [NODE_CIDR, "fd00::/64"],
        "readers": [PROMETHEUS_PEER]}}},
}
# (release, namespace, extra --set, the agents' objects' name, their namespace, the
# collector's namespace)
NAMINGS = [
    ("lb", "monitoring", (), "lb-loopback-agent", "monitoring", "monitoring"),
    ("loopback-agent-prod", "ops", (), "loopback-agent-prod", "ops", "ops"),
    ("x", "ops", ("nameOverride=lba",), "x-lba", "ops", "ops"),
    ("x", "ops", ("fullnameOverride=diag",), "diag", "ops", "ops"),
    ("x", "default", ("namespaceOverride=nodes", "collector.namespaceOverride=fleet"),
     "x-loopback-agent", "nodes", "fleet"),
]


@functools.cache
def case(name: str) -> list[Obj]:
    """The objects of CASES[name], rendered in the base's layout (cached: read-only)."""
    return template(values=CASES[name])


def case_accounts(name: str) -> frozenset[tuple[str, str]]:
    if name == "existing service accounts":
        return frozenset({(AGENT_NAMESPACE, "node-reader"), (NAMESPACE, "default")})
    return frozenset()


# -- helm lint and the values' schema ---------------------------------------------------------


@pytest.mark.parametrize("sets", [(), ("tls.enabled=true", "auth.mode=kube-token",
                                       "monitoring.podMonitor.enabled=true",
                                       "monitoring.prometheusRule.enabled=true",
                                       "monitoring.dashboard.enabled=true",
                                       "agent.kubeReport.enabled=true",
                                       "collector.networkPolicy.enabled=true",
                                       "namespace.create=true",
                                       "namespaceOverride=loopback-agent-node",
                                       "collector.namespaceOverride=loopback-agent"),
                                  ("collector.enabled=false",),
                                  ("monitoring.serviceMonitor.enabled=true",)])
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


@pytest.mark.parametrize(("setting", "path"), [
    ("agent.interval=often", "/agent/interval"),           # a number
    ("agent.port=70000", "/agent/port"),                   # a port
    ("collector.replicas=two", "/collector/replicas"),     # an integer
    ("collector.enabled=yes", "/collector/enabled"),       # a boolean
    ("agent.extraArgs=--no-capture", "/agent/extraArgs"),  # a list
    ("imagePullSecrets[0]=regcred", "/imagePullSecrets/0"),  # {name: ...}
    ("auth.mode=token", "/auth/mode"),                     # one of two
    ("image.digest=sha256:abc", "/image/digest"),
    ("namespaceOverride=Ops_NS", "/namespaceOverride"),    # a namespace's name
    ("auth.tokenSecret=t", "/auth"),                       # the chart's first version's
    ("monitoring.enabled=true", "/monitoring"),            # ... (which are gone)
])
def test_the_schema_refuses_wrong_values(setting: str, path: str) -> None:
    """helm lint and helm template check the values against values.schema.json."""
    proc = helm("lint", str(CHART), "--set", setting)
    assert proc.returncode != 0 and "1 chart(s) failed" in proc.stderr, proc.stdout
    assert f"at '{path}'" in proc.stdout, proc.stdout
    assert "don't meet the specifications of the schema" in render_fails(setting)


def schema_leaves(schema: Obj, prefix: str = "") -> dict[str, Obj]:
    """The values the schema describes: dotted path -> its schema (objects with their own
    properties are descended into; free-form ones, like resources, are values)."""
    out = {}
    for name, sub in schema["properties"].items():
        path = f"{prefix}{name}"
        if sub.get("type") == "object" and sub.get("additionalProperties") is False:
            out.update(schema_leaves(sub, f"{path}."))
        else:
            out[path] = sub
    return out


def value_leaves(values: Obj, schema: Obj, prefix: str = "") -> set[str]:
    out = set()
    for name, value in values.items():
        sub = schema["properties"][name]
        path = f"{prefix}{name}"
        if sub.get("type") == "object" and sub.get("additionalProperties") is False:
            out |= value_leaves(value, sub, f"{path}.")
        else:
            out.add(path)
    return out


def test_the_schema_and_the_readme_cover_every_value() -> None:
    """values.yaml, values.schema.json and the chart's README name the same values: each
    value has a default, a type and a line in the README's table."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    leaves = schema_leaves(schema)
    assert value_leaves(values, schema) == set(leaves) - {"global"}
    for path, sub in leaves.items():
        assert sub.get("description"), path
    table = [line for line in (CHART / "README.md").read_text().splitlines()
             if line.startswith("| `")]
    documented = {m for line in table for m in re.findall(r"`([\w.]+)`", line.split("|")[1])}
    assert documented == set(leaves) - {"global"}


def test_helm_is_the_pinned_upstream_binary() -> None:
    proc = helm("version", "--short")
    assert proc.returncode == 0 and proc.stdout.startswith("v4."), proc.stdout


# -- the same objects as kustomize -------------------------------------------------------------


def test_defaults_render_the_kustomize_base() -> None:
    """The base but for namespace.yaml, which the README applies before `helm install`:
    Helm would refuse to adopt namespaces it did not create."""
    objs = template()
    assert not of_kind(objs, "Namespace")
    assert_same(objs, kustomize(KUSTOMIZE_DIR))


def test_namespace_create_renders_all_of_the_base() -> None:
    """With namespace.create, from a release kept elsewhere: the whole base."""
    objs = render("namespace.create=true", f"namespaceOverride={AGENT_NAMESPACE}",
                  f"collector.namespaceOverride={NAMESPACE}", namespace="default")
    assert_same(objs, kustomize(KUSTOMIZE_DIR), with_namespaces=True)


def test_tls_and_kube_token_render_the_components(tmp_path: Path) -> None:
    assert_same(template("tls.enabled=true", "auth.mode=kube-token"),
                overlay(tmp_path, ["tls", "kube-token"]))


def test_kube_report_renders_the_component(tmp_path: Path) -> None:
    """The same flag and the same RBAC as daemonset/kube-report/: what the code calls
    (patch nodes/status; create/patch events.k8s.io Events) and no more."""
    assert_same(template("agent.kubeReport.enabled=true"), overlay(tmp_path, ["kube-report"]))


def test_monitoring_renders_the_component(tmp_path: Path) -> None:
    assert_same(template("monitoring.podMonitor.enabled=true",
                         "monitoring.prometheusRule.enabled=true"),
                overlay(tmp_path, ["monitoring"]))


def test_network_policy_renders_the_component(tmp_path: Path) -> None:
    """As daemonset/network-policy/ in the overlay its comment shows (the nodes' CIDR
    added to the agents' peers), which test_deploy.py checks too."""
    spec = OVERLAYS["network-policy"]
    assert_same(template("collector.networkPolicy.enabled=true",
                         f"collector.networkPolicy.nodeCIDRs={{{NODE_CIDR}}}"),
                overlay(tmp_path, spec["components"], spec["patches"]))


def test_dashboard_config_map_holds_the_dashboard() -> None:
    objs = template("monitoring.dashboard.enabled=true")
    cm = one(objs, "ConfigMap", "loopback-agent-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE  # with the collector
    assert json.loads(cm["data"]["loopback-agent.json"]) == \
        json.loads((REPO / "dashboards" / "loopback-agent.json").read_text())
    assert not [o for o in template() if o["metadata"]["name"] == "loopback-agent-dashboard"]


# -- names and namespaces from the release -----------------------------------------------------


@pytest.mark.parametrize(("release", "namespace", "sets", "fullname", "agent_ns",
                          "collector_ns"), NAMINGS)
def test_objects_follow_the_release(release: str, namespace: str, sets: tuple[str, ...],
                                    fullname: str, agent_ns: str, collector_ns: str) -> None:
    """`helm template -n NS` renders into NS, each object named after the release; every
    reference still resolves, and nothing is named as the base names it (but the kube-token
    audience, the code's default)."""
    objs = render(*sets, "monitoring.podMonitor.enabled=true",
                  "monitoring.prometheusRule.enabled=true", "agent.kubeReport.enabled=true",
                  "collector.networkPolicy.enabled=true", release=release,
                  namespace=namespace)
    assert not of_kind(objs, "Namespace")
    for o in objs:
        name, ns = o["metadata"]["name"], o["metadata"].get("namespace")
        assert name.startswith(fullname), name
        component = o["metadata"]["labels"].get("app.kubernetes.io/component")
        if o["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            assert ns is None, key(o)
        elif o["kind"] in ("Role", "RoleBinding"):
            # the collector's grant on the agents; the agent's on kube-proxy's DaemonSet
            assert ns == ("kube-system" if name.endswith("-kube-proxy-daemonset") else
                          agent_ns), key(o)
        elif component == "collector" or o["kind"] == "PrometheusRule":
            assert ns == collector_ns, key(o)
        else:
            assert ns == agent_ns, key(o)
    assert ds_of(objs)["metadata"]["name"] == fullname
    assert dep_of(objs)["metadata"]["name"] == f"{fullname}-collector"
    name_label = "lba" if "nameOverride=lba" in sets else "loopback-agent"
    for o in objs:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == release
        if "app.kubernetes.io/name" in labels:
            assert labels["app.kubernetes.io/name"] == name_label
    assert pod_labels(ds_of(objs))["app.kubernetes.io/instance"] == release
    # the alert that sends you to the agents' pods says where they are
    assert f"kubectl -n {agent_ns} get pods" in json.dumps(the(objs, "PrometheusRule"))
    assert_wired(objs)
    flat = json.dumps(objs)
    assert "loopback-agent-node" not in flat
    if fullname != RELEASE:
        assert not re.search(r'"loopback-agent-(collector|config|read|token)', flat.replace(
            '"audience": "loopback-agent-collector"', ""))


def test_two_releases_select_their_own_pods() -> None:
    """Two releases in one namespace: no selector of one matches the other's pods."""
    a, b = render(release="a"), render(release="b")
    for w in workloads(a):
        for x in workloads(b):
            assert not selects(w["spec"]["selector"]["matchLabels"], pod_labels(x))
    assert not {key(o) for o in a} & {key(o) for o in b}


def test_namespace_create_with_one_namespace() -> None:
    """The collector in the agents' namespace: one Namespace, privileged (the agents need
    it), and the quota; without a collector, the agents' alone."""
    for sets in ((), ("collector.enabled=false",)):
        objs = render("namespace.create=true", "namespaceOverride=lb", *sets,
                      namespace="default")
        (ns,) = of_kind(objs, "Namespace")
        assert ns["metadata"]["name"] == "lb"
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
        quota = the(objs, "ResourceQuota")
        assert quota["metadata"]["namespace"] == "lb"
        assert_wired(objs)
    split = template("namespace.create=true")
    assert {n["metadata"]["name"]: n["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
            for n in of_kind(split, "Namespace")} == {AGENT_NAMESPACE: "privileged",
                                                     NAMESPACE: "restricted"}


# -- the chart's own switches ------------------------------------------------------------------


def write_rules(objs: list[Obj]) -> list[tuple[str, str, list[str], list[str]]]:
    return [(o["metadata"]["name"], g, r.get("resources", []), r["verbs"])
            for o in objs if o["kind"] in ("ClusterRole", "Role") for r in o["rules"]
            for g in r["apiGroups"] if WRITE_VERBS & set(r["verbs"])]


def test_kube_report_adds_the_flag_and_its_rbac_only() -> None:
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
    objs = case("without a collector")
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not [n for n in names if "collector" in n[1]], names
    everything = template("collector.enabled=false", "namespace.create=true",
                          "collector.networkPolicy.enabled=true",
                          "monitoring.podMonitor.enabled=true")
    assert not [o for o in everything if "collector" in o["metadata"]["name"]]
    assert [n["metadata"]["name"] for n in of_kind(everything, "Namespace")] == \
        [AGENT_NAMESPACE]
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


def test_log_format_and_access_log_reach_both_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logs' two settings (issue 37): json lines and an access log by default, as the
    kustomize base has them; text lines and no access log when asked, read by the agent's
    and the collector's own option parsing from the variables the pods get."""
    monkeypatch.setattr("sys.argv", ["loopback-agent"])
    for sets, fmt, access in (((), "json", True),
                              (("logFormat=text", "collector.accessLog=false"), "text", False)):
        objs = template(*sets)
        run = parsed_with_env("run", container_env(objs, only_container(agent_ds(objs))),
                              monkeypatch)
        col = parsed_with_env("collector",
                              container_env(objs, only_container(collector_dep(objs))),
                              monkeypatch)
        assert (run.log_format, col.log_format, col.access_log) == (fmt, fmt, access)


def test_postgres_collector_rolls_without_a_volume() -> None:
    objs = template("collector.db=postgresql://lb@db.example/lb", "collector.replicas=2")
    dep = collector_dep(objs)
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    proc = helm("template", "x", str(CHART), "--set", "collector.replicas=2")
    assert proc.returncode != 0 and "PostgreSQL" in proc.stderr  # SQLite has one writer


# -- the values operators know from other charts -----------------------------------------------


def test_image_pull_secrets() -> None:
    objs = case("pull secrets")
    for w in (agent_ds(objs), collector_dep(objs)):
        assert pod_spec(w)["imagePullSecrets"] == [{"name": "regcred"}]
    assert not [w for w in workloads(template()) if "imagePullSecrets" in pod_spec(w)]


def test_pod_annotations_and_labels() -> None:
    """Added to the pods'; an annotation of the chart's may be overridden (annotation
    scraping off), the selector's labels may not."""
    objs, plain = case("pod annotations and labels"), template()
    ds, dep = agent_ds(objs), collector_dep(objs)
    assert pod_annotations(ds) == {**pod_annotations(agent_ds(plain)),
                                   "prometheus.io/scrape": "false", "team": "net"}
    assert pod_annotations(dep) == {**pod_annotations(collector_dep(plain)), "team": "fleet"}
    assert pod_labels(ds) == {**pod_labels(agent_ds(plain)), "team": "net"}
    assert pod_labels(ds)["app.kubernetes.io/component"] == "agent"
    assert pod_labels(dep) == {**pod_labels(collector_dep(plain)), "team": "fleet"}
    # null: none added
    unset = template("agent.podLabels=null", "agent.podAnnotations=null",
                     "collector.podLabels=null", "collector.podAnnotations=null")
    for w, p in ((agent_ds(unset), agent_ds(plain)), (collector_dep(unset), collector_dep(plain))):
        assert pod_labels(w) == pod_labels(p) and pod_annotations(w) == pod_annotations(p)
    # the workloads' and their selectors' labels stay
    for w, p in ((ds, agent_ds(plain)), (dep, collector_dep(plain))):
        assert w["metadata"]["labels"] == p["metadata"]["labels"]
        assert w["spec"]["selector"] == p["spec"]["selector"]


def test_scheduling() -> None:
    objs, plain = case("scheduling"), template()
    ds, dep = pod_spec(agent_ds(objs)), pod_spec(collector_dep(objs))
    assert ds["affinity"] == dep["affinity"] == AFFINITY
    assert ds["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert dep["nodeSelector"] == {"pool": "infra"}
    assert ds["tolerations"] == dep["tolerations"] == [TOLERATION]
    assert "priorityClassName" not in ds
    assert dep["priorityClassName"] == "infra-high"
    # the defaults: the agents everywhere, as system-node-critical; the collector as any pod
    ds0, dep0 = pod_spec(agent_ds(plain)), pod_spec(collector_dep(plain))
    assert ds0["tolerations"] == [{"operator": "Exists"}]
    assert ds0["priorityClassName"] == "system-node-critical"
    for spec in (ds0, dep0):
        assert "affinity" not in spec and "nodeSelector" not in spec
    assert "tolerations" not in dep0 and "priorityClassName" not in dep0


def test_security_contexts_are_overridden_key_by_key() -> None:
    """A value changes its key only: the rest of the secure default stays."""
    objs, plain = case("security contexts"), template()
    ds, ds0 = agent_ds(objs), agent_ds(plain)
    assert pod_spec(ds)["securityContext"] == {"fsGroup": 0}
    assert "securityContext" not in pod_spec(ds0)
    sc, sc0 = only_container(ds)["securityContext"], only_container(ds0)["securityContext"]
    assert sc == {**sc0, "readOnlyRootFilesystem": False,
                  "capabilities": {"drop": ["ALL"],
                                   "add": ["NET_ADMIN", "NET_RAW", "SYS_PTRACE"]}}
    dep, dep0 = collector_dep(objs), collector_dep(plain)
    assert pod_spec(dep)["securityContext"] == {**pod_spec(dep0)["securityContext"],
                                                "runAsUser": 10001, "runAsGroup": 10001,
                                                "fsGroup": 10001}
    assert only_container(dep)["securityContext"] == \
        {**only_container(dep0)["securityContext"], "runAsNonRoot": True}
    # null removes a key
    lax = template("agent.securityContext.seccompProfile=null")
    assert "seccompProfile" not in only_container(agent_ds(lax))["securityContext"]


def test_update_strategies() -> None:
    objs = case("update strategies")
    assert agent_ds(objs)["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert collector_dep(objs)["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    on_delete = template("agent.updateStrategy.type=OnDelete",
                         "agent.updateStrategy.rollingUpdate=null")
    assert agent_ds(on_delete)["spec"]["updateStrategy"] == {"type": "OnDelete"}
    # SQLite on its ReadWriteOnce volume: Recreate only
    assert collector_dep(template())["spec"]["strategy"] == {"type": "Recreate"}
    assert collector_dep(template("collector.updateStrategy=null"))["spec"]["strategy"] == \
        {"type": "Recreate"}
    err = render_fails("collector.updateStrategy.type=RollingUpdate")
    assert "PostgreSQL" in err
    assert "/agent/updateStrategy/type" in render_fails("agent.updateStrategy.type=Recreate")


def test_existing_service_accounts() -> None:
    """serviceAccount.create=false: no account made; the pods, the bindings and the
    collector's identity check use the named one (else "default")."""
    objs = case("existing service accounts")
    assert not of_kind(objs, "ServiceAccount")
    assert pod_spec(agent_ds(objs))["serviceAccountName"] == "node-reader"
    assert pod_spec(collector_dep(objs))["serviceAccountName"] == "default"
    read = one(objs, "ClusterRoleBinding", "loopback-agent-read")
    assert read["subjects"] == [{"kind": "ServiceAccount", "name": "node-reader",
                                 "namespace": AGENT_NAMESPACE}]
    pods = one(objs, "RoleBinding", "loopback-agent-collector-pods")
    assert pods["subjects"] == [{"kind": "ServiceAccount", "name": "default",
                                 "namespace": NAMESPACE}]
    env = container_env(objs, only_container(collector_dep(objs)))
    assert env["LOOPBACK_AGENT_AGENT_SERVICE_ACCOUNT"] == \
        f"system:serviceaccount:{AGENT_NAMESPACE}:node-reader"


def test_service_account_names_and_annotations() -> None:
    objs = case("service account annotations")
    agent = one(objs, "ServiceAccount", "lb-agent")
    assert agent["metadata"]["annotations"] == {"team": "net"}
    assert pod_spec(agent_ds(objs))["serviceAccountName"] == "lb-agent"
    collector = one(objs, "ServiceAccount", "loopback-agent-collector")
    assert collector["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/lb"}
    assert not [a for a in of_kind(template(), "ServiceAccount")
                if "annotations" in a["metadata"]]


def test_extra_env_volumes_and_mounts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Added after the chart's own; a variable wins over the ConfigMap's, as the kubelet
    has it: e.g. the PostgreSQL password from a Secret, never in a ConfigMap."""
    objs, plain = case("extra env and volumes"), template()
    ds, ds0 = agent_ds(objs), agent_ds(plain)
    assert only_container(ds)["env"] == only_container(ds0)["env"] + AGENT_ENV
    assert pod_spec(ds)["volumes"] == pod_spec(ds0)["volumes"] + [EXTRA_VOLUME]
    assert only_container(ds)["volumeMounts"] == \
        only_container(ds0)["volumeMounts"] + [EXTRA_MOUNT]
    monkeypatch.setattr("sys.argv", ["loopback-agent"])
    assert parsed_with_env("run", container_env(objs, only_container(ds)),
                           monkeypatch).interval == 15.0
    dep = collector_dep(objs)
    assert only_container(dep)["env"] == COLLECTOR_ENV
    assert "env" not in only_container(collector_dep(plain))
    assert only_container(dep)["args"] == ["collector", "--retention-days", "7"]
    names = [v["name"] for v in pod_spec(dep)["volumes"]]
    assert names[-1] == "extra" and EXTRA_MOUNT in only_container(dep)["volumeMounts"]
    collector_config = one(objs, "ConfigMap", "loopback-agent-collector-config")
    assert "password" not in json.dumps(collector_config)
    args = parsed_with_env("collector", container_env(objs, only_container(dep)), monkeypatch)
    assert args.db == "postgresql://lb@db.example/lb" and args.retention_days == 14.0


def test_existing_secret_for_the_token() -> None:
    """auth.existingSecret/existingSecretKey: both sides read that Secret's key as the
    token file; kube-token mode mounts no Secret at all."""
    objs = case("existing secret")
    for w, optional in ((agent_ds(objs), True), (collector_dep(objs), None)):
        source = volume(w, "token")["secret"]
        assert source["secretName"] == "fleet-token"
        assert source["items"] == [{"key": "t", "path": "token"}]
        assert source.get("optional") is optional
    env = container_env(objs, only_container(agent_ds(objs)))
    assert env["LOOPBACK_AGENT_TOKEN_FILE"] == "/etc/loopback-agent/token/token"
    plain = template("auth.existingSecret=fleet-token")
    assert "items" not in volume(agent_ds(plain), "token")["secret"]  # key "token"
    kube = template("auth.mode=kube-token", "auth.existingSecret=fleet-token")
    assert "fleet-token" not in json.dumps(kube)
    # the default: named after the release
    other = render(release="edge", namespace="ops")
    assert volume(ds_of(other), "token")["secret"]["secretName"] == \
        "edge-loopback-agent-token"


def test_tls_names() -> None:
    objs = case("tls names")
    assert volume(collector_dep(objs), "tls")["secret"]["secretName"] == "cert"
    assert volume(agent_ds(objs), "collector-ca")["configMap"]["name"] == "bundle"
    other = render("tls.enabled=true", release="edge", namespace="ops")
    assert volume(dep_of(other), "tls")["secret"]["secretName"] == \
        "edge-loopback-agent-collector-tls"
    assert volume(ds_of(other), "collector-ca")["configMap"]["name"] == \
        "edge-loopback-agent-collector-ca"
    env = container_env(other, only_container(ds_of(other)))
    assert env["LOOPBACK_AGENT_COLLECTOR"] == \
        "https://edge-loopback-agent-collector.ops.svc:8080"  # the certificate's name


# -- monitoring --------------------------------------------------------------------------------


@pytest.mark.parametrize(("toggle", "kinds"), [
    ("podMonitor", {("PodMonitor", "loopback-agent"),
                    ("PodMonitor", "loopback-agent-collector")}),
    ("serviceMonitor", {("ServiceMonitor", "loopback-agent"),
                        ("ServiceMonitor", "loopback-agent-collector"),
                        ("Service", "loopback-agent")}),
    ("prometheusRule", {("PrometheusRule", "loopback-agent")}),
    ("dashboard", {("ConfigMap", "loopback-agent-dashboard")}),
])
def test_each_monitoring_object_has_its_own_toggle(toggle: str,
                                                   kinds: set[tuple[str, str]]) -> None:
    plain = {(o["kind"], o["metadata"]["name"]) for o in template()}
    objs = template(f"monitoring.{toggle}.enabled=true")
    assert {(o["kind"], o["metadata"]["name"]) for o in objs} - plain == kinds
    assert not MONITORING_KINDS & {k for k, _ in plain}


def test_service_monitors_scrape_what_the_pod_monitors_do() -> None:
    """The same endpoints (node label, TLS, honorLabels), through Services: the collector's
    and a headless one listing the agents' metrics port."""
    pods, services = case("pod monitors"), case("service monitors")
    for name in ("loopback-agent", "loopback-agent-collector"):
        pm, sm = one(pods, "PodMonitor", name), one(services, "ServiceMonitor", name)
        assert sm["spec"]["endpoints"] == pm["spec"]["podMetricsEndpoints"]
        assert sm["metadata"]["namespace"] == pm["metadata"]["namespace"]
        assert sm["metadata"]["labels"] == pm["metadata"]["labels"]
        assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoint = one(services, "ServiceMonitor", "loopback-agent-collector")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["serverName"] == f"loopback-agent-collector.{NAMESPACE}.svc"
    assert endpoint["tlsConfig"]["ca"]["configMap"]["name"] == "loopback-agent-collector-ca"
    agents = one(services, "Service", "loopback-agent")
    assert agents["spec"]["clusterIP"] == "None"
    assert agents["metadata"]["namespace"] == AGENT_NAMESPACE
    assert agents["spec"]["ports"] == [{"name": "metrics", "port": 9808,
                                        "targetPort": "metrics", "protocol": "TCP"}]
    err = render_fails("monitoring.podMonitor.enabled=true",
                       "monitoring.serviceMonitor.enabled=true")
    assert "twice" in err


def test_monitoring_labels_reach_every_monitor_and_rule() -> None:
    objs = template("monitoring.podMonitor.enabled=true", "monitoring.prometheusRule.enabled=true",
                    "monitoring.labels.release=kps")
    monitoring = [o for o in objs if o["kind"] in MONITORING_KINDS]
    assert len(monitoring) == 3
    for o in monitoring:
        assert o["metadata"]["labels"]["release"] == "kps"
    assert not [o for o in objs if o["kind"] not in MONITORING_KINDS
                and "release" in o["metadata"]["labels"]]
    alone = render("monitoring.prometheusRule.enabled=true", "collector.enabled=false")
    assert the(alone, "PrometheusRule")["metadata"]["namespace"] == AGENT_NAMESPACE


def test_rules_and_dashboard_follow_the_release() -> None:
    """The generated rules (dashboards/mixin.py) select the scrape jobs by the base's names;
    the chart puts the release's in (its PodMonitors' jobs are NAMESPACE/FULLNAME, its
    ServiceMonitors' FULLNAME), and changes nothing else. With the default names the
    rules are the component's, unchanged."""
    from dashboards import mixin

    base = mixin.rule_groups(mixin.Config())
    assert the(template("monitoring.prometheusRule.enabled=true"), "PrometheusRule")["spec"] \
        == base
    objs = render("monitoring.prometheusRule.enabled=true", "monitoring.dashboard.enabled=true",
                  release="edge", namespace="ops")
    spec = the(objs, "PrometheusRule")["spec"]
    text = json.dumps(spec)
    agent, collector = 'job=~\\"(.+/)?edge-loopback-agent\\"', \
        'job=~\\"(.+/)?edge-loopback-agent-collector\\"'
    assert agent in text and collector in text
    assert 'job=~\\"(.+/)?loopback-agent' not in text
    back = text.replace(agent, 'job=~\\"(.+/)?loopback-agent\\"').replace(
        collector, 'job=~\\"(.+/)?loopback-agent-collector\\"').replace(
        "kubectl -n ops ", "kubectl -n loopback-agent-node ")
    assert json.loads(back) == base
    cm = one(objs, "ConfigMap", "edge-loopback-agent-dashboard")
    dash = cm["data"]["loopback-agent.json"]
    assert dash.count('job=~\\"(.+/)?edge-loopback-agent\\"') > 10
    assert dash.count('job=~\\"(.+/)?edge-loopback-agent-collector\\"') >= 3
    assert json.loads(dash)["templating"] != json.loads(
        (REPO / "dashboards" / "loopback-agent.json").read_text())["templating"]


def test_no_collector_no_collector_alerts() -> None:
    """collector.enabled=false (the agents ship to collector.url, a collector monitored
    elsewhere): the collector's group is left out, or LoopbackAgentCollectorDown would
    fire for ever; the agents' rules stay as they are."""
    from dashboards import mixin

    (agents, _) = mixin.rule_groups(mixin.Config())["groups"]
    spec = the(render("monitoring.prometheusRule.enabled=true", "collector.enabled=false",
                      "collector.url=https://collector.example:8080"), "PrometheusRule")["spec"]
    assert spec == {"groups": [agents]}
    assert [g["name"] for g in spec["groups"]] == ["loopback-agent"]
    alerts = {r["alert"] for r in agents["rules"]}
    assert not {"LoopbackAgentCollectorDown", "LoopbackAgentNodeSilent"} & alerts


def test_dashboard_labels_annotations_and_namespace() -> None:
    cm = the([o for o in case("dashboard") if o["kind"] == "ConfigMap"
              and o["metadata"]["name"].endswith("-dashboard")], "ConfigMap")
    assert cm["metadata"]["namespace"] == "grafana"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["labels"]["dashboards"] == "grafana"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Kubernetes"}


# -- the NetworkPolicy -------------------------------------------------------------------------


def test_network_policy_values() -> None:
    """The agents' peer names their namespace and labels (and the nodes' CIDRs), the
    readers' peers are the value's; off by default."""
    assert not of_kind(template(), "NetworkPolicy")
    policy = the(case("network policy"), "NetworkPolicy")
    agents, readers = policy["spec"]["ingress"]
    assert agents["from"][1:] == [{"ipBlock": {"cidr": NODE_CIDR}},
                                  {"ipBlock": {"cidr": "fd00::/64"}}]
    assert readers["from"] == [PROMETHEUS_PEER]
    for rule in (agents, readers):
        assert rule["ports"] == [{"protocol": "TCP", "port": "http"}]
    shared = render("collector.networkPolicy.enabled=true", "collector.networkPolicy.readers=null",
                    release="edge", namespace="ops")
    policy = the(shared, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "ops"
    (only,) = policy["spec"]["ingress"]
    assert only["from"][0]["namespaceSelector"]["matchLabels"] == \
        {"kubernetes.io/metadata.name": "ops"}
    assert_wired(shared)


# -- NOTES.txt ---------------------------------------------------------------------------------


def notes(*sets: str, release: str = RELEASE, namespace: str = AGENT_NAMESPACE) -> str:
    args, _ = helm_args("install", sets, None, release, namespace)
    proc = helm(*args, "--dry-run=client")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.partition("NOTES:\n")[2]


def test_notes_name_the_release_namespace() -> None:
    text = notes(release="edge", namespace="ops")
    assert "the agents (DaemonSet edge-loopback-agent) in ops" in text
    assert "kubectl -n ops create secret generic edge-loopback-agent-token" in text
    assert "kubectl -n ops port-forward svc/edge-loopback-agent-collector 8080" in text
    assert "kubectl loopback check NODE -n ops" in text
    assert "kubectl loopback nodes" not in text  # the plugin knows the base's name only
    assert "loopback-agent-node" not in text
    split = notes(*BASE_LAYOUT)
    for ns in (AGENT_NAMESPACE, NAMESPACE):
        assert f"kubectl -n {ns} create secret generic loopback-agent-token" in split
    assert f"kubectl loopback nodes -n {NAMESPACE}" in split
    assert "WARNING" in notes("auth.mode=kube-token")
    assert "nodeCIDRs" in notes("collector.networkPolicy.enabled=true")


# -- valid Kubernetes --------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", CASES)
def test_every_case_renders_valid_wired_kubernetes(name: str, version: str) -> None:
    objs = case(name)
    assert not invalid(objs, version)
    assert_wired(objs, case_accounts(name))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("naming", NAMINGS, ids=[n[0] + "/" + n[1] for n in NAMINGS])
def test_renders_under_other_names_are_valid_kubernetes(naming: tuple[Any, ...],
                                                        version: str) -> None:
    release, namespace, sets = naming[:3]
    objs = render(*sets, "namespace.create=true", "tls.enabled=true", "auth.mode=kube-token",
                  "agent.kubeReport.enabled=true", "collector.networkPolicy.enabled=true",
                  "monitoring.dashboard.enabled=true", release=release, namespace=namespace)
    assert not invalid(objs, version)


def test_chart_copies_of_the_monitoring_files_are_current() -> None:
    """Both written by dashboards/mixin.py (tests/test_monitoring.py: byte for byte)."""
    rules = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    component = yaml.safe_load((KUSTOMIZE_DIR / "monitoring" / "prometheusrule.yaml").read_text())
    assert rules == component["spec"]
    assert (CHART / "files" / "loopback-agent-dashboard.json").read_bytes() == \
        (REPO / "dashboards" / "loopback-agent.json").read_bytes()
