#!/bin/sh
# Regenerates the real-tool samples in this directory. Everything happens inside a
# throwaway network namespace (deleted on exit); the root namespace is never touched.
# Needs root, iproute2, ipset, procps sysctl. ipvsadm samples are hand-written: the
# kernel these were made on has no IP_VS, so ipvsadm cannot list anything.
set -eu
cd "$(dirname "$0")"
N="lbgen$$"
ip netns add "$N"
trap 'ip netns del "$N"' EXIT
X="ip netns exec $N"

# --- ipsets as kube-proxy (IPVS mode) creates them, plus odd corners -----------------
$X ipset create KUBE-CLUSTER-IP hash:ip,port
$X ipset add KUBE-CLUSTER-IP 10.96.0.1,tcp:443
$X ipset add KUBE-CLUSTER-IP 10.96.0.10,udp:53
$X ipset add KUBE-CLUSTER-IP 10.96.0.10,tcp:53
$X ipset create KUBE-LOAD-BALANCER-LOCAL hash:ip,port
$X ipset add KUBE-LOAD-BALANCER-LOCAL 203.0.113.10,tcp:80
$X ipset create KUBE-NODE-PORT-TCP bitmap:port range 0-65535
$X ipset add KUBE-NODE-PORT-TCP 30080
$X ipset add KUBE-NODE-PORT-TCP 31443
$X ipset create KUBE-LOOP-BACK hash:ip,port,ip
$X ipset add KUBE-LOOP-BACK 10.244.1.5,tcp:8080,10.244.1.5
$X ipset create KUBE-LOAD-BALANCER-SOURCE-CIDR hash:ip,port,net
$X ipset add KUBE-LOAD-BALANCER-SOURCE-CIDR 203.0.113.10,tcp:80,198.51.100.0/24
$X ipset create KUBE-NET hash:net
$X ipset add KUBE-NET 10.244.0.0/16
$X ipset add KUBE-NET 10.0.0.0/8 nomatch
$X ipset create TEST-IPS hash:ip timeout 300 counters comment
$X ipset add TEST-IPS 10.0.0.7 timeout 100 comment "hello world"
$X ipset add TEST-IPS 10.0.0.8
$X ipset create TEST-NOMATCH-OPTS hash:net timeout 300 comment
$X ipset add TEST-NOMATCH-OPTS 192.0.2.0/24 timeout 100 nomatch comment "x y"
$X ipset create TEST-EMPTY hash:ip family inet6
$X ipset create TEST-V6 hash:ip,port family inet6
$X ipset add TEST-V6 fd00::1,tcp:80
$X ipset save > ipset-save.txt
$X ipset list > ipset-list.txt

# --- addresses: kube-ipvs0 is a dummy on real nodes; this kernel has no dummy driver,
# so a bridge left DOWN stands in (same <BROADCAST,...> flags without UP) ------------
$X ip link set lo up
$X ip link add kube-ipvs0 type bridge
$X ip addr add 10.96.0.1/32 dev kube-ipvs0
$X ip addr add 203.0.113.10/32 dev kube-ipvs0
$X ip addr add fd00::5/128 dev kube-ipvs0
$X ip link add eth0 type veth peer name veth1
$X ip addr add 10.0.0.10/24 brd + dev eth0
$X ip addr add 10.0.0.11/24 dev eth0 label eth0:vip
$X ip -6 addr add 2001:db8::10/64 dev eth0 nodad
$X ip addr add 10.1.1.1 peer 10.1.1.2/32 dev veth1
$X ip link set eth0 up
$X ip link set veth1 up
# a name with a dot, so sysctl prints it with a slash (eth0/100)
$X ip link add eth0.100 type bridge
$X ip link set eth0.100 up
$X ip addr show > addr.txt
$X ip -j addr show > addr.json
$X ip route show table local > route-local.txt
$X ip -j route show table local > route-local.json

# --- sysctls (net.* only: the namespace's own values, no host details) -----------------
$X sysctl -w net.ipv4.ip_forward=1 >/dev/null
$X sysctl -w net.ipv4.conf.eth0.rp_filter=1 >/dev/null
$X sysctl -w net.ipv4.conf.kube-ipvs0.accept_local=1 >/dev/null
$X sysctl -w net.ipv4.conf.all.log_martians=1 >/dev/null
$X sysctl -w net.ipv4.conf.eth0/100.route_localnet=1 >/dev/null
$X sysctl net > sysctl.txt

# --- a few kube-proxy-like nat rules, for the bundle round trip ----------------------------
$X iptables -t nat -N KUBE-SERVICES
$X iptables -t nat -N KUBE-MARK-MASQ
$X iptables -t nat -N KUBE-POSTROUTING
$X iptables -t nat -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
$X iptables -t nat -A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
$X iptables -t nat -A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
$X iptables -t nat -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
$X iptables -t nat -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
$X iptables -t nat -A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
$X iptables -t nat -A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE
$X iptables-save > iptables-save.txt
