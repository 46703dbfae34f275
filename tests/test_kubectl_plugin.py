"""`kubectl loopback` (agent.kubectl_plugin): the one-shot pod held against the rendered
DaemonSet, and the plugin run as a process against a fake `kubectl`: a real executable this
test writes and puts first on PATH (the suite's PATH is declared-only, tests/declared_path.py),
which records every argv it gets and plays a pod's life. The exit code is the agent's, the pod
is deleted on every path (normal end, a pod that cannot start, SIGINT, SIGTERM), and the
user's --kubeconfig/--context/--namespace reach every kubectl call. Where the agent is not
installed (no ServiceAccount: the fake answers `get serviceaccount --ignore-not-found` with
nothing), the pod comes from `kubectl debug node/NODE` (the fake prints kubectl's "Creating
debugging pod" line and plays that pod). `nodes` reads a real collector process through the
fake's `port-forward` line.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from agent import kubectl_plugin as plugin
from tests import tarsafe
from tests.test_collector import Proc, verdict
from tests.test_deploy import agent_ds, kustomize, only_container, pod_spec, volume

REPO = Path(__file__).resolve().parents[1]
KREW = REPO / "plugins" / "loopback.yaml"

FAKE_KUBECTL = r'''#!{python}
"""A stand-in kubectl: records its argv, answers as a cluster would for one pod."""
import json, os, sys, time
from pathlib import Path

state = Path(os.environ["FAKE_KUBECTL_DIR"])
argv = sys.argv[1:]
record = {{"argv": argv}}
words = [a for a in argv if not a.startswith("--") or a in ("--follow",)]
verb = words[0] if words else ""
if verb == "create":
    record["stdin"] = sys.stdin.read()
    (state / "pod.json").write_text(record["stdin"])
    if os.environ.get("FAKE_CREATE_SLEEP"):  # the API server has it; the answer is slow
        with open(state / "calls.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        (state / "create-sent").write_text("")
        time.sleep(float(os.environ["FAKE_CREATE_SLEEP"]))
        sys.exit(0)
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps(record) + "\n")
scenario = os.environ.get("FAKE_SCENARIO", "ok")

def pod_status(container):
    gets = int((state / "gets").read_text()) if (state / "gets").exists() else 0
    (state / "gets").write_text(str(gets + 1))
    if scenario == "imagepull":
        return {{"phase": "Pending", "containerStatuses": [{{"name": container, "state":
                {{"waiting": {{"reason": "ErrImagePull", "message": "pull access denied"}}}}}}]}}
    if gets == 0:
        return {{"phase": "Pending", "containerStatuses": [{{"name": container, "state":
                {{"waiting": {{"reason": "ContainerCreating"}}}}}}]}}
    if not (state / "logs-done").exists():
        return {{"phase": "Running", "containerStatuses": [{{"name": container, "state":
                {{"running": {{}}}}}}]}}
    code = int(os.environ.get("FAKE_EXIT", "0"))
    return {{"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
        {{"name": container, "state": {{"terminated": {{"exitCode": code}}}}}}]}}

if verb == "create":
    print("pod/" + json.loads(record["stdin"])["metadata"]["name"] + " created")
elif verb == "get" and "serviceaccount" in argv:  # is the agent installed?
    if os.environ.get("FAKE_SA_ERROR"):
        print(os.environ["FAKE_SA_ERROR"], file=sys.stderr)
        sys.exit(1)
    if not os.environ.get("FAKE_NOT_INSTALLED"):  # --ignore-not-found: nothing, exit 0
        print("serviceaccount/loopback-agent")
elif verb == "debug":  # kubectl debug node/NODE: its line, then the pod (or an error)
    node = argv[argv.index("debug") + 1].split("/", 1)[1]
    container = next((a.split("=", 1)[1] for a in argv if a.startswith("--container=")),
                     "debugger")
    name = "node-debugger-" + node + "-x7k2q"
    if os.environ.get("FAKE_DEBUG_FAIL", "").startswith("error: unknown profile"):
        print(os.environ["FAKE_DEBUG_FAIL"], file=sys.stderr)  # before any pod is named
        sys.exit(1)
    print("Creating debugging pod " + name + " with container " + container + " on node "
          + node + ".", flush=True)
    if os.environ.get("FAKE_DEBUG_FAIL"):
        print(os.environ["FAKE_DEBUG_FAIL"], file=sys.stderr)
        sys.exit(1)
    (state / "pod.json").write_text(json.dumps({{"metadata": {{"name": name}}, "spec": {{
        "nodeName": node, "containers": [{{"name": container}}]}}}}))
    if os.environ.get("FAKE_DEBUG_SLEEP"):  # the API server is slow to answer the create
        (state / "debug-sent").write_text("")
        time.sleep(float(os.environ["FAKE_DEBUG_SLEEP"]))
elif verb == "get" and scenario == "deep":  # JSON nested past any parser's depth
    print("[" * 100000 + "]" * 100000)
elif verb == "get":
    pod = json.loads((state / "pod.json").read_text())
    pod["status"] = pod_status(pod["spec"]["containers"][0]["name"])
    print(json.dumps(pod))
elif verb == "logs":
    print("node n1: AT RISK (exit 1)", flush=True)
    if os.environ.get("FAKE_LOGS_SLEEP"):
        (state / "logs-started").write_text("")
        time.sleep(float(os.environ["FAKE_LOGS_SLEEP"]))
    (state / "logs-done").write_text("")
elif verb == "delete":
    print("pod deleted")
elif verb == "port-forward" and os.environ.get("FAKE_PF_FAIL"):
    print(os.environ["FAKE_PF_FAIL"], file=sys.stderr, flush=True)
    sys.exit(1)
elif verb == "port-forward":
    print("Forwarding from 127.0.0.1:" + os.environ["FAKE_PF_PORT"] + " -> 8080", flush=True)
    print("Forwarding from [::1]:" + os.environ["FAKE_PF_PORT"] + " -> 8080", flush=True)
    time.sleep(60)
else:
    print("fake kubectl: unexpected " + " ".join(argv), file=sys.stderr)
    sys.exit(1)
'''


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "kubectl"
    exe.write_text(FAKE_KUBECTL.format(python=sys.executable))
    exe.chmod(0o755)
    (tmp_path / "state").mkdir()
    return tmp_path


def plugin_env(fake: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "FAKE_KUBECTL_DIR": str(fake / "state"), **extra}
    env["PATH"] = f"{fake / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)  # this checkout's agent, also in the child
    return env


def run_plugin(fake: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.kubectl_plugin", *args],
                          capture_output=True, text=True, timeout=60,
                          env=plugin_env(fake, **env))


def calls(fake: Path) -> list[dict[str, Any]]:
    path = fake / "state" / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def verbs(fake: Path) -> list[str]:
    return [next(a for a in c["argv"] if not a.startswith("--")) for c in calls(fake)]


def created_pod(fake: Path) -> dict[str, Any]:
    """The pod the plugin sent to `kubectl create`."""
    (create,) = [c for c in calls(fake) if "create" in c["argv"]]
    return json.loads(create["stdin"])


def sa_check(*flags: str, namespace: str = "loopback-agent-node") -> list[str]:
    """The argv of the plugin's "is the agent installed?" question."""
    return [*flags, f"--namespace={namespace}", "get", "serviceaccount", "loopback-agent",
            "--ignore-not-found", "-o", "name"]


# -- the pod spec against the DaemonSet's -------------------------------------------------------


@pytest.fixture(scope="module")
def daemonset() -> dict[str, Any]:
    return agent_ds(kustomize(REPO / "daemonset"))


def test_check_pod_sees_the_node_as_the_daemonset_does(daemonset: dict[str, Any]) -> None:
    pod = plugin.check_pod("node-1", "loopback-check-node-1-abc123")
    spec, ds_spec = pod["spec"], pod_spec(daemonset)
    (c,) = spec["containers"]
    ds_c = only_container(daemonset)
    assert c["image"] == ds_c["image"]  # the kustomize base's image: same release
    assert c["securityContext"] == ds_c["securityContext"]
    assert c["resources"] == ds_c["resources"]
    for key in ("hostNetwork", "hostPID", "dnsPolicy", "serviceAccountName", "tolerations"):
        assert spec[key] == ds_spec[key], key
    assert pod["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert [e for e in c["env"] if e["name"] == "NODE_NAME"] == \
        [e for e in ds_c["env"] if e["name"] == "NODE_NAME"]
    assert c["args"][0] == "check" and "command" not in c
    # the DaemonSet's read-only node mounts, identical; of its other read-only mounts only
    # credentials to the collector are left out (a one-shot check ships nothing)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    left_out = []
    for m in ds_c["volumeMounts"]:
        if not m.get("readOnly"):
            continue
        v = volume(daemonset, m["name"])
        if "hostPath" in v:
            assert mounts[m["mountPath"]] == m
            assert vols[m["name"]] == v
        else:
            left_out.append(v)
    assert left_out and all("secret" in v or "projected" in v for v in left_out)
    # nothing of the node is writable: no spool, no writable hostPath
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/tmp"} and "emptyDir" in vols["tmp"]
    assert spec["restartPolicy"] == "Never" and spec["nodeName"] == "node-1"
    assert spec["activeDeadlineSeconds"] > 0


def test_check_pod_is_not_adopted_by_the_daemonset(daemonset: dict[str, Any]) -> None:
    labels = plugin.check_pod("n", "p")["metadata"]["labels"]
    selector = daemonset["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= labels.items()


def test_check_pod_is_valid_kubernetes() -> None:
    import kubernetes_validate

    from tests.test_deploy import K8S_VERSIONS

    for version in K8S_VERSIONS:
        kubernetes_validate.validate(plugin.check_pod("node-1", "x", agent_args=["--json"]),
                                     version, strict=True)


@pytest.mark.parametrize("node", ["ip-10-0-1-5.ec2.internal", "Node_With_Caps", "a" * 300, "%%"])
def test_pod_names_are_valid(node: str) -> None:
    import re

    name = plugin.pod_name(node)
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert plugin.pod_name(node) != name  # two runs on one node do not collide


@pytest.mark.parametrize("text", ["30s", "2m", "1.5m", "45", " 1H ", "0s", "soon", "25h",
                                  "nan", "-3s", "m", ""])
def test_capture_durations_as_the_agent_reads_them(text: str) -> None:
    import argparse

    from agent.cli import _duration

    def outcome(parse: Any) -> Any:
        try:
            return parse(text)
        except argparse.ArgumentTypeError as e:
            return str(e)

    assert outcome(plugin._duration) == outcome(_duration)


# -- kubectl's flags --------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flags", "rest"), [
    (["check", "n1", "--context", "prod", "-n", "ns"], {"context": "prod", "namespace": "ns"},
     ["check", "n1"]),
    (["--kubeconfig=/k", "nodes", "--namespace=x"], {"kubeconfig": "/k", "namespace": "x"},
     ["nodes"]),
    (["check", "n1", "-nfoo", "--", "-n", "agent-flag"], {"namespace": "foo"},
     ["check", "n1", "--", "-n", "agent-flag"]),
])
def test_kubectl_flags_anywhere(argv: list[str], flags: dict[str, str], rest: list[str]) -> None:
    assert plugin.split_kubectl_flags(argv) == (flags, rest)


# -- the plugin as a process, against the fake kubectl -----------------------------------------


@pytest.mark.parametrize("code", [0, 1, 2])
def test_check_exits_with_the_agents_code_and_deletes_the_pod(fake: Path, code: int) -> None:
    proc = run_plugin(fake, "check", "node-1", "--capture", "30s", "--context", "prod",
                      "--kubeconfig", "/tmp/kc", "--poll", "0.05", FAKE_EXIT=str(code))
    assert proc.returncode == code, proc.stderr
    assert "node n1: AT RISK" in proc.stdout  # the report, streamed
    # installed: the agent's ServiceAccount is there, so the pod runs as it (no debug pod)
    assert calls(fake)[0]["argv"] == sa_check("--kubeconfig=/tmp/kc", "--context=prod")
    assert verbs(fake)[:2] == ["get", "create"] and verbs(fake)[-1] == "delete"
    assert "logs" in verbs(fake) and "debug" not in verbs(fake)
    assert "not installed" not in proc.stderr
    for c in calls(fake):  # the user's flags on every call, in the agent's namespace
        assert {"--context=prod", "--kubeconfig=/tmp/kc",
                "--namespace=loopback-agent-node"} <= set(c["argv"]), c["argv"]
    pod = created_pod(fake)
    assert pod["spec"]["nodeName"] == "node-1"
    assert pod["spec"]["containers"][0]["args"] == ["check", "--capture", "30s"]
    name = pod["metadata"]["name"]
    assert calls(fake)[-1]["argv"][-4:] == ["pod", name, "--ignore-not-found", "--wait=false"]


def test_agent_arguments_and_namespace_pass_through(fake: Path) -> None:
    proc = run_plugin(fake, "-n", "ops", "check", "node-1", "--json", "--image", "reg/x:1",
                      "--poll", "0.05", "--", "--no-kube-api", "--mode", "ipvs")
    assert proc.returncode == 0, proc.stderr
    assert calls(fake)[0]["argv"] == sa_check(namespace="ops")
    pod = created_pod(fake)
    c = pod["spec"]["containers"][0]
    assert c["args"] == ["check", "--json", "--no-kube-api", "--mode", "ipvs"]
    assert c["image"] == "reg/x:1" and pod["metadata"]["namespace"] == "ops"
    assert all("--namespace=ops" in call["argv"] for call in calls(fake))


def test_a_pod_that_cannot_start_is_reported_and_deleted(fake: Path) -> None:
    proc = run_plugin(fake, "check", "node-1", "--poll", "0.05", FAKE_SCENARIO="imagepull")
    assert proc.returncode == plugin.EXIT_UNAVAILABLE
    assert "ErrImagePull: pull access denied" in proc.stderr
    assert "logs" not in verbs(fake) and verbs(fake)[-1] == "delete"


def test_a_pod_answer_nested_too_deep_is_an_error_and_the_pod_deleted(fake: Path) -> None:
    # json.loads raises RecursionError, not ValueError, for such nesting: it was an
    # internal error (traceback, no delete in the plugin's own words)
    proc = run_plugin(fake, "check", "node-1", "--poll", "0.05", FAKE_SCENARIO="deep")
    assert proc.returncode == plugin.EXIT_UNAVAILABLE, proc.stderr
    assert "not JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert verbs(fake)[-1] == "delete"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_deletes_the_pod(fake: Path, sig: signal.Signals) -> None:
    p = subprocess.Popen([sys.executable, "-m", "agent.kubectl_plugin", "check", "node-1",
                          "--poll", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=plugin_env(fake, FAKE_LOGS_SLEEP="30"))
    deadline = time.monotonic() + 30
    while not (fake / "state" / "logs-started").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    started = time.monotonic()
    p.send_signal(sig)  # to the plugin only, as `kill` would (Ctrl-C also reaches kubectl)
    _, err = p.communicate(timeout=30)
    assert p.returncode == plugin.EXIT_INTERRUPTED, err
    assert time.monotonic() - started < 15  # the fake's 30 s log stream was not waited out
    assert verbs(fake)[-1] == "delete", verbs(fake)
    assert "deleting pod" in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_while_creating_deletes_the_pod(fake: Path, sig: signal.Signals) -> None:
    """Interrupted while `kubectl create` waits for its answer (a slow API server, Ctrl-C
    at that moment): the pod may exist already, so it is deleted (--ignore-not-found if
    it does not). It was left running on the node until its activeDeadlineSeconds (15 min)
    and then left as a Failed pod: the plugin deleted only pods whose create had
    answered."""
    p = subprocess.Popen([sys.executable, "-m", "agent.kubectl_plugin", "check", "node-1",
                          "--poll", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=plugin_env(fake, FAKE_CREATE_SLEEP="30"))
    deadline = time.monotonic() + 30
    while not (fake / "state" / "create-sent").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == plugin.EXIT_INTERRUPTED, err
    assert verbs(fake) == ["get", "create", "delete"], (verbs(fake), err)
    name = json.loads((fake / "state" / "pod.json").read_text())["metadata"]["name"]
    assert calls(fake)[-1]["argv"][-4:] == ["pod", name, "--ignore-not-found", "--wait=false"]


def test_usage_errors_start_no_pod(fake: Path) -> None:
    for args in (["check"], ["check", "n1", "--capture", "soon"], ["nodes", "--", "x"],
                 ["check", "n1", "--context"]):
        proc = run_plugin(fake, *args)
        assert proc.returncode == plugin.EXIT_USAGE, (args, proc.stderr)
    assert calls(fake) == []


# -- not installed: kubectl debug's pod (issue 37, bug 4) ----------------------------------------

DEBUG_NAME = "node-debugger-node-1-x7k2q"  # the fake's; kubectl's has a random suffix


def debug_argv(*flags: str, image: str = plugin.IMAGE, agent: tuple[str, ...] = ()) -> list[str]:
    return [*flags, "debug", "node/node-1", "--profile=netadmin", f"--image={image}",
            "--container=agent", "--env=NODE_NAME=node-1", "--attach=false", "--",
            "loopback-agent", "check", *agent]


@pytest.mark.parametrize(("args", "flags", "namespace", "image", "agent"), [
    # kubectl's current namespace: no --namespace on the debug pod's calls
    (["--context", "prod", "check", "node-1", "--capture", "30s"], ("--context=prod",),
     None, plugin.IMAGE, ("--capture", "30s")),
    # -n: asked there, and the debug pod made there; --image and the agent's flags kept
    (["-n", "ops", "check", "node-1", "--json", "--image", "reg/x:1", "--", "--no-kube-api"],
     (), "ops", "reg/x:1", ("--json", "--no-kube-api")),
])
def test_without_the_agent_installed_check_runs_a_kubectl_debug_pod(
        fake: Path, args: list[str], flags: tuple[str, ...], namespace: str | None,
        image: str, agent: tuple[str, ...]) -> None:
    """issue 37, bug 4: on a cluster without the DaemonSet (no namespace loopback-agent-node,
    no ServiceAccount) `check` failed: its pod could not be created. It now runs the agent in
    a `kubectl debug node/NODE --profile=netadmin` pod, says so, and follows and deletes that
    pod as its own (the agent's exit code, the report streamed from the start)."""
    cut = args.index("--") if "--" in args else len(args)
    proc = run_plugin(fake, *args[:cut], "--poll", "0.05", *args[cut:],
                      FAKE_NOT_INSTALLED="1", FAKE_EXIT="2")
    assert proc.returncode == 2, proc.stderr
    assert "node n1: AT RISK" in proc.stdout  # the report, streamed
    assert "Creating debugging pod" not in proc.stdout  # kubectl's chatter kept off stdout
    assert "not installed" in proc.stderr and "kubectl debug node/node-1 --profile=netadmin" \
        in proc.stderr
    where = (f"--namespace={namespace}",) if namespace else ()
    assert calls(fake)[0]["argv"] == sa_check(*flags, namespace=namespace or plugin.AGENT_NAMESPACE)
    assert calls(fake)[1]["argv"] == debug_argv(*flags, *where, image=image, agent=agent)
    assert "create" not in verbs(fake) and "logs" in verbs(fake)
    for c in calls(fake)[1:]:  # all in the debug pod's namespace
        assert [a for a in c["argv"] if a.startswith("--namespace")] == list(where), c["argv"]
    logs = next(c for c in calls(fake) if "logs" in c["argv"])
    assert logs["argv"][-3:] == [f"pod/{DEBUG_NAME}", "-c", "agent"]
    assert calls(fake)[-1]["argv"] == [*flags, *where, "delete", "pod", DEBUG_NAME,
                                       "--ignore-not-found", "--wait=false"]
    # what the debug pod runs is a command line the agent's own parser takes
    from agent.cli import build_parser

    command = calls(fake)[1]["argv"][calls(fake)[1]["argv"].index("--") + 1:]
    assert command[0] == "loopback-agent"
    assert build_parser().parse_args(command[1:]).command == "check"


def test_the_fallback_is_not_taken_when_kubectl_cannot_tell(fake: Path) -> None:
    """No right to read ServiceAccounts is not "not installed": the agent's own pod is tried
    (and its own error, if any, says why)."""
    proc = run_plugin(fake, "check", "node-1", "--poll", "0.05",
                      FAKE_SA_ERROR='Error from server (Forbidden): serviceaccounts '
                                    '"loopback-agent" is forbidden')
    assert proc.returncode == 0, proc.stderr
    assert verbs(fake)[:2] == ["get", "create"] and "debug" not in verbs(fake)
    assert "not installed" not in proc.stderr


@pytest.mark.parametrize(("error", "deleted"), [
    # the namespace refuses the pod: kubectl named it first, so it is deleted (if there)
    ('Error from server (Forbidden): pods "node-debugger-node-1-x7k2q" is forbidden: '
     'violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true, '
     'hostPID=true, hostIPC=true)', True),
    # a kubectl older than 1.27: refused before any pod
    ("error: unknown profile: netadmin", False),
])
def test_a_failing_kubectl_debug_is_a_clear_error(fake: Path, error: str, deleted: bool) -> None:
    proc = run_plugin(fake, "check", "node-1", "--poll", "0.05", FAKE_NOT_INSTALLED="1",
                      FAKE_DEBUG_FAIL=error)
    assert proc.returncode == plugin.EXIT_UNAVAILABLE, proc.stderr
    assert f"kubectl-loopback: kubectl debug node/node-1 failed: {error}" in proc.stderr
    assert "kubectl 1.27" in proc.stderr and "Traceback" not in proc.stderr
    assert verbs(fake) == ["get", "debug", *(["delete"] if deleted else [])], verbs(fake)
    if deleted:
        assert calls(fake)[-1]["argv"][-4:] == ["pod", DEBUG_NAME, "--ignore-not-found",
                                                "--wait=false"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_while_kubectl_debug_creates_deletes_its_pod(fake: Path,
                                                                 sig: signal.Signals) -> None:
    """kubectl names the pod before it creates it: interrupted while it waits for the
    API server, the pod it named is deleted."""
    p = subprocess.Popen([sys.executable, "-m", "agent.kubectl_plugin", "check", "node-1",
                          "--poll", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=plugin_env(fake, FAKE_NOT_INSTALLED="1",
                                                   FAKE_DEBUG_SLEEP="30"))
    deadline = time.monotonic() + 30
    while not (fake / "state" / "debug-sent").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == plugin.EXIT_INTERRUPTED, err
    assert verbs(fake) == ["get", "debug", "delete"], (verbs(fake), err)
    assert calls(fake)[-1]["argv"] == ["delete", "pod", DEBUG_NAME, "--ignore-not-found",
                                       "--wait=false"]
    assert f"deleting pod {DEBUG_NAME}" in err


def test_check_help_says_what_the_fallback_cannot_see(fake: Path) -> None:
    proc = run_plugin(fake, "check", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for needle in ("kubectl debug node/NODE --profile=netadmin", "kubectl 1.27",
                   "cannot see", "Services, the Node and the Ingresses", "tracefs",
                   "--no-kube-api", plugin.IMAGE):
        assert needle in text, needle
    assert calls(fake) == []


# -- nodes and services, from a real collector ---------------------------------------------------


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Any:
    c = Proc(tmp_path_factory.mktemp("col") / "c.db")
    try:
        for node in ("node-a", "node-b"):
            r = requests.post(c.url + "/v1/verdicts", timeout=10,
                              json={**verdict(node), "idempotency_key": node})
            assert r.status_code == 200, r.text
        yield c
    finally:
        c.stop()


def test_nodes_through_port_forward(fake: Path, collector: Any) -> None:
    proc = run_plugin(fake, "nodes", "--context", "prod",
                      FAKE_PF_PORT=str(collector.port))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "STATUS", "MODE"]
    assert {ln.split()[0] for ln in lines[1:]} == {"node-a", "node-b"}
    assert all(ln.split()[1] == "at-risk" for ln in lines[1:])
    (pf,) = calls(fake)
    assert pf["argv"][-3:] == ["--address=127.0.0.1", "svc/loopback-agent-collector", ":8080"]
    assert {"--context=prod", "--namespace=loopback-agent"} <= set(pf["argv"])


def test_services_from_a_collector_url(fake: Path, collector: Any) -> None:
    proc = run_plugin(fake, "services", "--collector", collector.url, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows[0]["service"] == "default/web"
    assert sorted(rows[0]["exposed_nodes"]) == ["node-a", "node-b"]
    assert calls(fake) == []  # no kubectl needed with --collector
    table = run_plugin(fake, "services", "--collector", collector.url)
    assert table.stdout.splitlines()[0].split()[:3] == ["SERVICE", "LB", "IP"]
    assert "default/web" in table.stdout


def test_a_collector_answer_nested_too_deep_is_an_error(fake: Path) -> None:
    body = b"[" * 100_000 + b"]" * 100_000

    class Deep(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Deep)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = run_plugin(fake, "nodes", "--collector",
                          f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == plugin.EXIT_UNAVAILABLE, proc.stderr
    assert "not JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unreachable_collector_is_an_error(fake: Path) -> None:
    proc = run_plugin(fake, "nodes", "--collector", "http://127.0.0.1:9")
    assert proc.returncode == plugin.EXIT_UNAVAILABLE and "collector" in proc.stderr


# -- packaging -------------------------------------------------------------------------------------


def test_console_script_and_krew_manifest() -> None:
    import tomllib  # the suite's Python (3.11) has it

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["kubectl-loopback"] == "agent.kubectl_plugin:main"
    manifest = yaml.safe_load(KREW.read_text())
    assert manifest["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2"
    assert manifest["kind"] == "Plugin" and manifest["metadata"]["name"] == "loopback"
    spec = manifest["spec"]
    assert spec["version"] == f"v{project['project']['version']}"
    assert spec["shortDescription"] and spec["homepage"].startswith("https://")
    (platform,) = spec["platforms"]
    assert platform["bin"] == "kubectl-loopback"
    assert platform["uri"].startswith("https://")
    assert platform["uri"].endswith(f"/v{project['project']['version']}/"
                                    f"kubectl-loopback-v{project['project']['version']}.tar.gz")
    # the archive's sha256: this build's (reproducible), so the manifest is not stale
    sys.path.insert(0, str(REPO / "plugins"))
    try:
        import build_krew
    finally:
        sys.path.remove(str(REPO / "plugins"))
    data = build_krew.archive_bytes()
    assert data == build_krew.archive_bytes()
    import hashlib

    assert platform["sha256"] == hashlib.sha256(data).hexdigest(), \
        "plugins/loopback.yaml is stale: python plugins/build_krew.py --write-manifest"


def test_krew_archive_runs_standalone(fake: Path) -> None:
    """Unpacked as krew would, the launcher runs the plugin with a python3 that has no
    agent installed (the venv's base interpreter, no PYTHONPATH) against the fake kubectl."""
    import fnmatch
    import io
    import tarfile

    sys.path.insert(0, str(REPO / "plugins"))
    try:
        import build_krew
    finally:
        sys.path.remove(str(REPO / "plugins"))
    store = fake / "krew-store"
    with tarfile.open(fileobj=io.BytesIO(build_krew.archive_bytes()), mode="r:gz") as tar:
        names = tar.getnames()
        tarsafe.extract(tar, store / "unpacked")
    (platform,) = yaml.safe_load(KREW.read_text())["spec"]["platforms"]
    for op in platform["files"]:  # krew's file operations: every one matches something
        assert fnmatch.filter(names, op["from"]), op
    (fake / "bin" / "python3").symlink_to(sys._base_executable)  # type: ignore[attr-defined]
    env = plugin_env(fake)
    del env["PYTHONPATH"]
    link = fake / "bin" / "kubectl-loopback"  # krew links its bin/ entry to the store
    link.symlink_to(store / "unpacked" / platform["bin"])
    proc = subprocess.run([str(link), "check", "node-1", "--poll", "0.05"],
                          capture_output=True, text=True, timeout=60,
                          env={**env, "FAKE_EXIT": "1"})
    assert proc.returncode == 1, proc.stderr
    assert "node n1: AT RISK" in proc.stdout and verbs(fake)[-1] == "delete"


def test_readme_documents_the_plugin() -> None:
    from tests import docs

    text = docs.text()
    for needle in ("kubectl loopback check", "kubectl loopback nodes",
                   "kubectl loopback services", "plugins/loopback.yaml"):
        assert needle in text, needle


def test_a_failing_port_forward_says_kubectls_own_error(fake: Path) -> None:
    """issue 37, bug 1: with a broken kubeconfig, `nodes` said "no port within the
    timeout" 8 times in 10: kubectl's stderr was read before it had exited."""
    error = 'error: error loading config file "/nope": open /nope: no such file or directory'
    for _ in range(10):
        proc = run_plugin(fake, "nodes", FAKE_PF_FAIL=error)
        assert proc.returncode != 0
        assert error in proc.stderr and "no port" not in proc.stderr, proc.stderr
