"""daemonset/npd/: node-problem-detector (NPD) running loopback-agent-monitor.json (issue 37,
bug 2).

As shipped, the plugin config ran /opt/loopback-agent/bin/loopback-agent, which no image
had: NPD's own image has neither the agent's Python nor iptables, ipset, ipvsadm or nft,
and the agent's image had the agent only on PATH. NPD checks that a plugin's path exists
when it loads the config, so NPD would not even start. Held here: the path the config runs
is made by the agent's Dockerfile, in the image the shipped NPD DaemonSet runs NPD in (NPD's
binary copied from NPD's image); that command line, with these arguments, is the agent
answering NPD's protocol; the config passes NPD's own checks; the DaemonSet is valid
Kubernetes and sees the node as the agent DaemonSet does; the README's instructions name
files that exist and say what the manifests do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest

from agent.cli import build_parser
from agent.kubereport.condition import CONDITION_TYPE, NPD_LINE_MAX
from tests.test_deploy import (
    DOCKERFILE,
    K8S_VERSIONS,
    KUSTOMIZE_DIR,
    agent_ds,
    kustomize,
    one,
    only_container,
    pod_spec,
    volume,
)

REPO = Path(__file__).resolve().parents[1]
NPD_DIR = REPO / "daemonset" / "npd"
CONFIG = NPD_DIR / "loopback-agent-monitor.json"
README = NPD_DIR / "README.md"
RISKY = REPO / "tests" / "data" / "bundles" / "tke-etp-local"  # at risk: 10.0.1.100
NPD_IMAGE = "registry.k8s.io/node-problem-detector/node-problem-detector"
NPD_CLUSTER_ROLE = "system:node-problem-detector"  # Kubernetes' own (bootstrap policy)

Obj = dict[str, Any]


def config() -> Obj:
    return json.loads(CONFIG.read_text())


def the_rule() -> Obj:
    (rule,) = config()["rules"]
    return rule


@pytest.fixture(scope="module")
def npd() -> list[Obj]:
    return kustomize(NPD_DIR)


@pytest.fixture(scope="module")
def base() -> list[Obj]:
    return kustomize(KUSTOMIZE_DIR)


def npd_ds(objs: list[Obj]) -> Obj:
    return one(objs, "DaemonSet", "loopback-agent-npd")


def final_stage(dockerfile: str) -> str:
    """The Dockerfile's last stage (the image), its continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile)
    return re.split(r"(?m)^FROM\s", text)[-1]


def duration(text: str) -> float:
    """NPD's (Go's) durations as this config writes them: 10m, 2m, 30s."""
    m = re.fullmatch(r"(\d+)(s|m|h)", text)
    assert m, f"unexpected duration {text!r}"
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


# -- the plugin's path and arguments ----------------------------------------------------------


def test_the_plugin_path_is_made_by_the_image_npd_runs_it_in(npd: list[Obj],
                                                             base: list[Obj]) -> None:
    path = the_rule()["path"]
    # NPD's container is the agent's image, the release the base DaemonSet runs
    c = only_container(npd_ds(npd))
    assert c["image"] == only_container(agent_ds(base))["image"]
    # ... whose Dockerfile makes the path in the image: a link to the program its
    # ENTRYPOINT runs, which is the agent's console script (a missing one fails the build)
    stage = final_stage(DOCKERFILE.read_text())
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])\s*$", stage, re.M).group(1))[0]
    link = re.search(r'&&\s+mkdir -p (\S+)\s+&&\s+ln -s "\$\(command -v (\S+)\)" (\S+)',
                     stage)
    assert link, "the Dockerfile's image does not make the plugin's path"
    assert link.group(3) == path and link.group(1) == str(PurePosixPath(path).parent)
    assert link.group(2) == entry
    import tomllib  # the suite's Python (3.11) has it

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[entry] == "agent.cli:main"
    # nothing in NPD's pod is mounted over it
    for m in c["volumeMounts"]:
        assert not path.startswith(m["mountPath"].rstrip("/") + "/"), m


def test_the_plugin_arguments_are_a_live_check_the_agent_takes() -> None:
    args = build_parser().parse_args(the_rule()["args"])
    assert args.command == "check" and args.npd and args.no_kube_api
    assert not args.from_dir and not args.snapshot  # the live node, not a saved one


def test_the_configured_command_answers_npds_protocol(tmp_path: Path) -> None:
    """The rule's command line as NPD runs it (path, then args), the path made as the
    Dockerfile makes it (a link to the agent's console script: this venv's), on a saved
    node (--from added: this machine is not a node): one line, NonOK's exit code."""
    rule = the_rule()
    script = Path(sys.executable).parent / "loopback-agent"
    assert script.is_file(), "the agent's console script: pip install -e ."
    link = tmp_path / "root" / rule["path"].lstrip("/")
    link.parent.mkdir(parents=True)
    link.symlink_to(script)
    proc = subprocess.run([str(link), *rule["args"], "--from", str(RISKY)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[0].startswith("PodToLbNotMasqueraded: at-risk: 10.0.1.100")
    assert len(lines[0]) <= config()["pluginConfig"]["max_output_length"] == NPD_LINE_MAX


def test_npd_accepts_the_config() -> None:
    """What NPD's CustomPluginConfig.Validate checks besides the path (above): the plugin
    kind, no rule timeout past the global one, a default condition for each permanent
    rule; and that runs do not overlap."""
    cfg = config()
    assert cfg["plugin"] == "custom"
    glob = cfg["pluginConfig"]
    assert glob["concurrency"] == 1
    assert duration(glob["timeout"]) < duration(glob["invoke_interval"])
    defaults = {c["type"] for c in cfg["conditions"]}
    assert defaults == {CONDITION_TYPE}
    for rule in cfg["rules"]:
        assert duration(rule["timeout"]) <= duration(glob["timeout"])
        assert rule["type"] == "permanent" and rule["condition"] in defaults


# -- the DaemonSet ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_kubernetes(npd: list[Obj], version: str) -> None:
    errors = []
    for o in npd:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message} "
                          f"at {list(e.path)}")
    assert not errors, f"invalid for Kubernetes {version}:\n" + "\n".join(errors)


def test_npd_is_nothing_but_this_daemonset_its_config_and_rights(npd: list[Obj]) -> None:
    assert sorted(o["kind"] for o in npd) == \
        ["ClusterRoleBinding", "ConfigMap", "DaemonSet", "ServiceAccount"]


def test_npd_runs_its_own_binary_with_the_shipped_config(npd: list[Obj]) -> None:
    ds = npd_ds(npd)
    c = only_container(ds)
    # NPD's binary, copied out of NPD's image into the emptyDir the container runs it from
    (init,) = pod_spec(ds)["initContainers"]
    assert init["image"].startswith(f"{NPD_IMAGE}:v")
    assert init["command"][:2] == ["cp", "/node-problem-detector"]
    dest = PurePosixPath(init["command"][2])
    (src_mount,) = [m for m in init["volumeMounts"]
                    if dest.parent == PurePosixPath(m["mountPath"])]
    (run_mount,) = [m for m in c["volumeMounts"] if m["name"] == src_mount["name"]]
    assert c["command"] == [str(PurePosixPath(run_mount["mountPath"]) / dest.name)]
    assert "emptyDir" in volume(ds, src_mount["name"]) and run_mount["readOnly"] is True
    # the config: loopback-agent-monitor.json as shipped, where the flag says it is
    (flag,) = [a for a in c["args"] if a.startswith("--config.")]
    name, _, where = flag.partition("=")
    assert name == "--config.custom-plugin-monitor"  # this monitor only: no log monitors
    where_path = PurePosixPath(where)
    (cfg_mount,) = [m for m in c["volumeMounts"]
                    if PurePosixPath(m["mountPath"]) == where_path.parent]
    cmap = one(npd, "ConfigMap", volume(ds, cfg_mount["name"])["configMap"]["name"])
    assert json.loads(cmap["data"][where_path.name]) == config()
    # its problem API and Prometheus endpoint off: with hostNetwork they would take the
    # node's 127.0.0.1:20256/20257 from an NPD the node already runs
    assert {"--port=0", "--prometheus-port=0"} <= set(c["args"])


def test_npd_sees_the_node_as_the_agent_does(npd: list[Obj], base: list[Obj]) -> None:
    ds, agent = npd_ds(npd), agent_ds(base)
    spec, c, agent_c = pod_spec(ds), only_container(ds), only_container(agent)
    assert spec["hostNetwork"] is True and spec["hostPID"] is True
    assert spec["tolerations"] == pod_spec(agent)["tolerations"]
    # root with NET_ADMIN and NET_RAW only, read-only root filesystem: the agent's
    assert c["securityContext"] == agent_c["securityContext"]
    # the check runs inside this container: the agent's limits (sized by the biggest node)
    assert c["resources"]["limits"] == agent_c["resources"]["limits"]
    assert [e for e in c["env"] if e["name"] == "NODE_NAME"] == \
        [e for e in agent_c["env"] if e["name"] == "NODE_NAME"]
    (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volume(ds, tmp["name"])
    # nothing of the node mounted; the copying init container is unprivileged
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    sc = spec["initContainers"][0]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False


def test_npd_has_npds_own_rights_only(npd: list[Obj]) -> None:
    ds = npd_ds(npd)
    sa = one(npd, "ServiceAccount", pod_spec(ds)["serviceAccountName"])
    assert sa["metadata"]["namespace"] == ds["metadata"]["namespace"]
    (crb,) = [o for o in npd if o["kind"] == "ClusterRoleBinding"]
    assert crb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                              "name": NPD_CLUSTER_ROLE}
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                "namespace": sa["metadata"]["namespace"]}]


# -- the README ---------------------------------------------------------------------------------


def test_the_readme_names_what_exists_and_says_what_ships(npd: list[Obj]) -> None:
    text = README.read_text()
    # every file or directory of the repository it names exists (here, or from the root;
    # not API resources such as `nodes/status`, nor paths inside the pod)
    named = [n for n in re.findall(r"`([A-Za-z0-9_./-]+)`", text)
             if re.search(r"\.(json|yaml|md)$", n) or n == "Dockerfile"
             or n.startswith("daemonset/")]
    assert "npd-daemonset.yaml" in named and "daemonset/kube-report/" in named
    for n in named:
        assert (NPD_DIR / n).exists() or (REPO / n).exists(), f"README names {n}: missing"
    # the command it gives applies a kustomization that exists (the one tested above)
    (target,) = re.findall(r"kubectl apply -k (\S+)", text)
    assert (REPO / target / "kustomization.yaml").is_file()
    assert (REPO / target).resolve() == NPD_DIR
    # the recommended way, --kube-report: its component exists and adds the flag the CLI takes
    assert "--kube-report" in text
    component = REPO / "daemonset" / "kube-report" / "kustomization.yaml"
    assert "--kube-report" in component.read_text()
    assert build_parser().parse_args(["run", "--kube-report"]).kube_report
    # the paths and flags it says the pod uses are the shipped ones
    c = only_container(npd_ds(npd))
    assert f"`{the_rule()['path']}`" in text
    for flag in re.findall(r"`(--(?:config\.|port|prometheus-port)[^`]*)`", text):
        assert flag in c["args"], flag
    init = pod_spec(npd_ds(npd))["initContainers"][0]
    assert f"`{init['command'][1]}`" in text
    npd_tag = init["image"].rpartition(":")[2]
    assert npd_tag in text  # the NPD version it talks about is the one set
