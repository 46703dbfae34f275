"""`kubectl describe svc` text: kubectl's layout (pkg/describe describeService), blocks of
other kinds, and lines that are not its own. The real pastes are in
tests/data/realworld/ (test_realworld.py runs them); these are constructed, each for one
rule of the layout."""

from __future__ import annotations

import json

from agent.bundle import load_texts
from agent.bundle.sections import SVC_DESCRIBE, command_format, split_sections
from agent.diagnose import diagnose
from agent.parse.svc_describe import parse_svc_describe

TWO_PORTS = """\
Name:                     web
Namespace:                shop
Labels:                   app=web
Annotations:              service.kubernetes.io/qcloud-loadbalancer-internal-subnetid: subnet-1
                          service.kubernetes.io/tke-existed-lbid: lb-2
Selector:                 app=web
Type:                     LoadBalancer
IP Family Policy:         SingleStack
IP Families:              IPv4
IP:                       10.96.0.20
IPs:                      10.96.0.20
IP:                       198.51.100.9
LoadBalancer Ingress:     198.51.100.7 (VIP), lb-1.example.com
Port:                     <unset>  80/TCP
TargetPort:               8080/TCP
NodePort:                 <unset>  30080/TCP
Endpoints:                10.244.1.5:8080,10.244.2.6:8080 + 1 more...
Port:                     dns  53/UDP
TargetPort:               53/UDP
Endpoints:                <none>
Session Affinity:         None
External Traffic Policy:  Local
HealthCheck NodePort:     32001
Events:
  Type    Reason                Age   From                Message
  ----    ------                ----  ----                -------
  Normal  EnsuringLoadBalancer  2m    service-controller  Ensuring load balancer
"""


def lines(text: str) -> list[tuple[int, str]]:
    return list(enumerate(text.splitlines(), 1))


def test_kubectls_layout_is_read_field_by_field() -> None:
    (svc,), problems = parse_svc_describe(lines(TWO_PORTS), "paste.txt")
    assert problems == []
    assert (svc.key, svc.type, svc.cluster_ip) == ("shop/web", "LoadBalancer", "10.96.0.20")
    # the second "IP:" is spec.loadBalancerIP (asked for): not an address the LB has
    assert [(i.ip, i.hostname, i.ip_mode) for i in svc.lb_ingress] == [
        ("198.51.100.7", None, "VIP"), (None, "lb-1.example.com", None)]
    assert [(p.name, p.port, p.protocol, p.node_port) for p in svc.ports] == [
        (None, 80, "TCP", 30080), ("dns", 53, "UDP", None)]
    assert svc.external_traffic_policy == "Local" and svc.status_given
    assert svc.annotations == {
        "service.kubernetes.io/qcloud-loadbalancer-internal-subnetid": "subnet-1",
        "service.kubernetes.io/tke-existed-lbid": "lb-2"}


def test_a_pending_load_balancer_has_no_address_and_that_is_known() -> None:
    text = TWO_PORTS.replace("LoadBalancer Ingress:     198.51.100.7 (VIP), lb-1.example.com\n",
                             "")
    (svc,), _ = parse_svc_describe(lines(text), "p")
    assert svc.lb_ingress == () and svc.status_given


def test_blocks_of_other_kinds_and_foreign_lines_are_named_not_guessed() -> None:
    pod = "Name:         web-0\nNamespace:    shop\nNode:         node-1/10.0.0.5\n"
    text = pod + "\n" + TWO_PORTS.replace(
        "Port:                     dns  53/UDP", "Port:                     dns  53").replace(
        "lb-1.example.com", "<pending>") + "garbage\n"
    services, problems = parse_svc_describe(lines(text), "p")
    assert [s.key for s in services] == ["shop/web"]
    assert [p.port for p in services[0].ports] == [80]  # the bad Port line costs its port
    said = dict(problems)
    at = text.splitlines().index("Port:                     dns  53") + 1
    assert "not a Service's" in said[1]
    assert "not a Port line" in said[at]
    at = next(i for i, line in enumerate(text.splitlines(), 1) if "<pending>" in line)
    assert said[at] == "not an address or hostname: '<pending>'"
    assert [i.ip for i in services[0].lb_ingress] == ["198.51.100.7"]
    assert "not a `kubectl describe svc` line" in said[len(text.splitlines())]


def test_a_describe_is_its_own_section_after_other_output() -> None:
    text = ("$ ipset list KUBE-LOAD-BALANCER\nName: KUBE-LOAD-BALANCER\nType: hash:ip,port\n"
            "Members:\n198.51.100.7,tcp:80\n\n" + TWO_PORTS)
    assert [s.format for s in split_sections(text, "p")] == ["ipset", SVC_DESCRIBE]
    assert command_format("kubectl describe svc web -n shop")[0] == SVC_DESCRIBE
    assert command_format("kubectl -n shop describe service/web")[0] == SVC_DESCRIBE
    assert command_format("kubectl get -n shop svc")[0] != SVC_DESCRIBE
    assert command_format("kubectl get -o wide svc -A")[0] == "kubectl get svc"


def test_the_verdict_uses_the_described_service() -> None:
    snap = load_texts([("paste.txt", TWO_PORTS, "unknown")], origin="bundle:paste")
    v = diagnose(snap, "node").to_dict("all")
    assert [r["ip"] for r in v["lb_ips"]] == ["198.51.100.7"]
    lb = v["lb_ips"][0]
    assert lb["ports"] == ["TCP/80", "UDP/53"] and lb["services"] == ["shop/web"]


def test_a_manifest_pasted_after_the_describe_does_not_hide_its_address() -> None:
    manifest = ("apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: shop\n"
                "spec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n")
    for text in (TWO_PORTS + "\n$ cat web.yaml\n" + manifest,
                 "$ cat web.yaml\n" + manifest + "\n$ kubectl describe svc web\n" + TWO_PORTS):
        snap = load_texts([("paste.txt", text, "unknown")], origin="bundle:paste")
        (svc,) = snap.services
        assert svc.status_given and svc.lb_ingress[0].ip == "198.51.100.7"


def test_an_indented_label_that_looks_like_a_sysctl_stays_in_the_describe() -> None:
    text = TWO_PORTS.replace("Labels:                   app=web\n",
                             "Labels:                   app=web\n"
                             "                          net.example.io/tier=edge\n")
    assert [s.format for s in split_sections(text, "p")] == [SVC_DESCRIBE]
    (svc,) = load_texts([("p", text, "unknown")], origin="bundle:p").services
    assert svc.lb_ingress and svc.ports


def test_an_nlb_known_by_hostname_only_is_undecided_per_port() -> None:
    host = TWO_PORTS.replace("198.51.100.7 (VIP), lb-1.example.com", "lb-1.example.com")
    nlb = host.replace("Annotations:              ",
                       "Annotations:              service.beta.kubernetes.io/"
                       "aws-load-balancer-type: nlb\n                          ")
    v = diagnose(load_texts([("p", nlb, "unknown")], origin="bundle:p"), "node").to_dict("all")
    got = sorted((f["id"], f["lb_ip"], f["port"]) for f in v["findings"])
    assert got == [("pod-to-lb-undetermined", None, 53), ("pod-to-lb-undetermined", None, 80)]
    assert v["status"] == "unknown"
    assert any("lb-1.example.com:80/TCP" in f["summary"] for f in v["findings"])
    # no NLB asked for: a classic ELB, which proxies; named as not walked, not raised
    v = diagnose(load_texts([("p", host, "unknown")], origin="bundle:p"), "node").to_dict("all")
    assert v["findings"] == [] and v["status"] == "unknown"  # no rules: mode unknown
    assert any("ask for no NLB" in u["reason"] for u in v["unknowns"])
    # an address beside the hostname is walked instead (pod-to-lb), not said twice
    v = diagnose(load_texts([("p", TWO_PORTS, "unknown")], origin="bundle:p"),
                 "node").to_dict("all")
    assert all(f["lb_ip"] == "198.51.100.7" for f in v["findings"])


def test_an_nlb_chosen_by_its_load_balancer_class_is_undecided_too() -> None:
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "web", "namespace": "shop"},
           "spec": {"type": "LoadBalancer", "loadBalancerClass": "service.k8s.aws/nlb",
                    "ports": [{"port": 443, "protocol": "TCP", "nodePort": 31443}]},
           "status": {"loadBalancer": {"ingress": [
               {"hostname": "k8s-shop-web-0123456789.elb.us-west-2.amazonaws.com"}]}}}
    v = diagnose(load_texts([("svc.json", json.dumps(svc), "unknown")], origin="bundle:p"),
                 "node").to_dict("all")
    (f,) = v["findings"]
    assert (f["id"], f["port"], f["lb_ip"]) == ("pod-to-lb-undetermined", 443, None)
    assert "spec.loadBalancerClass: service.k8s.aws/nlb" in f["evidence"][1]
    # another class: not an NLB this rule knows; named as not walked
    svc["spec"]["loadBalancerClass"] = "example.com/lb"
    v = diagnose(load_texts([("svc.json", json.dumps(svc), "unknown")], origin="bundle:p"),
                 "node").to_dict("all")
    assert v["findings"] == []
    assert any("(loadBalancerClass example.com/lb): not walked" in u["reason"]
               for u in v["unknowns"])
