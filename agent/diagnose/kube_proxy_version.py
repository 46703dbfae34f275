"""Which kube-proxy wrote the node's rules (issue 33): its version where the input says it
(its startup log), else the versions whose rule shapes the input shows. Each shape is
cited with the kube-proxy change that introduced or removed it; a known bug's detector
(agent.diagnose.known_bugs) asks ``affected`` whether the version or shape falls before
its fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.netfilter.nft_read import ruleset_of
from agent.snapshot import NodeSnapshot

_VERSION = re.compile(r"v?(\d{1,2})\.(\d{1,3})\.(\d{1,4})")


@dataclass(frozen=True, slots=True)
class Shape:
    """A rule shape only some kube-proxy versions write: between ``since`` (inclusive) and
    ``until`` (exclusive; and ``backport``, the first release of an older minor line that
    has the change), as (major, minor, patch)."""

    name: str
    since: tuple[int, int, int] | None
    until: tuple[int, int, int] | None
    backport: tuple[int, int, int] | None
    source: str


# nftables mode (GA 1.33): kubernetes#132456 replaced filter-prerouting / filter-output-post-
# dnat by filter-prerouting-pre-dnat / filter-output-pre-dnat (merged for v1.34.0,
# cherry-picked to v1.33.6 as #133969: CHANGELOG-1.33)
NFT_BEFORE_132456 = Shape(
    "nftables table ip kube-proxy with chains filter-prerouting and "
    "filter-output-post-dnat", (1, 29, 0), (1, 34, 0), (1, 33, 6),
    "kube-proxy nftables mode before kubernetes#132456 (v1.34.0; v1.33.6 in the 1.33 line)")
NFT_SINCE_132456 = Shape(
    "nftables table ip kube-proxy with chain filter-prerouting-pre-dnat",
    (1, 34, 0), None, (1, 33, 6),
    "kube-proxy nftables mode since kubernetes#132456 (v1.34.0; v1.33.6 in the 1.33 line)")
# iptables mode: kubernetes#109060 ("Kube proxy rule reorg XLB->EXT", v1.24.0) replaced the
# KUBE-XLB-* chains by KUBE-EXT-* and KUBE-SVL-*
IPT_XLB = Shape("iptables nat chains KUBE-XLB-*", None, (1, 24, 0), None,
                "kube-proxy iptables mode before kubernetes#109060 (v1.24.0: KUBE-XLB -> "
                "KUBE-EXT)")
IPT_EXT = Shape("iptables nat chains KUBE-EXT-*", (1, 24, 0), None, None,
                "kube-proxy iptables mode since kubernetes#109060 (v1.24.0)")


@dataclass(frozen=True, slots=True)
class KubeProxyVersion:
    version: tuple[int, int, int] | None  # as kube-proxy said it (its log, its Pod's image)
    shape: Shape | None  # what its rules' shapes say
    how: str  # for people: "v1.29.15 (kube-proxy's log ...)", "rules shaped as ..."
    # the oldest kube-proxy the Node's kubelet version allows (the version skew policy:
    # kube-proxy at most SKEW minors older than the kubelet beside it): it rules a fix
    # older than that in, never a bug
    floor: tuple[int, int, int] | None = None

    def before(self, fixed: tuple[int, int, int],
               backports: tuple[tuple[int, int, int], ...] = ()) -> bool | None:
        """Is this kube-proxy older than a fix released in ``fixed`` (and in each of
        ``backports``, the first patch release of an older minor line with it)? None when
        neither the version nor the shape decides it."""
        if self.version is not None:
            v = self.version
            line = next((b for b in backports if b[:2] == v[:2]), None)
            return v < (line or fixed)
        s = self.shape
        if s is None:
            return self._floor_has(fixed)
        if s.until is not None and s.until <= fixed:
            if s.backport is None:
                return True
            # the older line that dropped the shape at s.backport: its fix must come no
            # sooner, or versions between the two have the shape and the fix
            line = next((b for b in backports if b[:2] == s.backport[:2]), None)
            return True if line is None or line >= s.backport else None
        if s.since is not None and s.since >= fixed:
            return False
        return self._floor_has(fixed)


    def _floor_has(self, fixed: tuple[int, int, int]) -> bool | None:
        return False if self.floor is not None and self.floor >= fixed else None


# kubernetes.io/releases/version-skew-policy: kube-proxy may be up to three minor versions
# older or newer than the kubelet it runs beside (two before 1.25)
SKEW = 3


def version_of(text: str | None) -> tuple[int, int, int] | None:
    m = _VERSION.fullmatch(text.strip()) if text else None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


# an image tag that names a release: "v1.32.2", "v1.22.5-tke.1",
# "v1.29.0-minimal-eksbuild.1" (a vendor's build of that release)
_TAG = re.compile(r"v?(\d{1,2})\.(\d{1,3})\.(\d{1,4})([-+_][\w.+-]{0,80})?")


def image_version(image: str) -> tuple[tuple[int, int, int], bool] | None:
    """The release an image's tag names, and whether it is a vendor's build of it (a
    suffix); None when the tag names none (a digest only, "latest")."""
    last = image.split("@", 1)[0].rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    m = _TAG.fullmatch(last.split(":", 1)[1])
    if m is None or m.group(1) != "1":  # (a tag of the image's own numbering: no release)
        return None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))), bool(m.group(4))


def kube_proxy_version(snap: NodeSnapshot, mode: str) -> KubeProxyVersion | None:
    """What the input says of kube-proxy's version, or None when it says nothing."""
    kp = snap.kube_proxy
    logged = version_of(kp.version) if kp is not None else None
    pod = snap.kube_proxy_image
    tagged = image_version(pod.image) if pod is not None else None
    # (a Pod whose container is not running says what may run, not what does)
    said = logged or (tagged[0] if tagged and pod is not None and pod.running else None)
    shape = _shape(snap, mode)
    node = snap.node_info
    # the Node's field names the kubelet's version (kubelet wrote its own there): said, as
    # a hint, never taken as kube-proxy's for a known bug's fix
    hint = node.kube_proxy_version if node is not None and said is None else None
    if said is None and shape is None and hint is None and tagged is None:
        return None
    parts = []
    if logged is not None:
        parts.append(f"v{'.'.join(map(str, logged))} (kube-proxy's log: \"Version info\")")
    if pod is not None and tagged is not None and tagged[0] != logged:
        # the Pod's image: what the node runs unless its log (the process's own word,
        # from when it started) says otherwise
        parts.append(
            f"v{'.'.join(map(str, tagged[0]))} (the image of its {pod.of}: {pod.image}"
            + ("; a vendor's build of that release, whose own patches may differ"
               if tagged[1] else "")
            + ("; a node may still run the one before while the DaemonSet rolls"
               if pod.of.startswith("DaemonSet ") else
               "; its container is not running" if not pod.running else "") + ")"
            + ("; its log's version is the one taken" if logged is not None else ""))
    if shape is not None:
        parts.append(f"rules shaped as {shape.source}: {shape.name}")
    if hint is not None:
        parts.append(f"the Node's status.nodeInfo.kubeProxyVersion says {hint[:40]} (the "
                     "kubelet's own version, which kube-proxy usually matches: a hint, not "
                     "kube-proxy's word; deprecated in 1.31)")
    kubelet = _TAG.fullmatch(hint.strip()) if hint else None
    floor = (1, max(int(kubelet.group(2)) - SKEW, 0), 0) \
        if kubelet is not None and kubelet.group(1) == "1" else None
    if floor is not None:
        parts[-1] = parts[-1][:-1] + (f"; kube-proxy is at least v1.{floor[1]} beside it, "
                                      "by the version skew policy)")
    return KubeProxyVersion(said, shape, "; ".join(parts), floor)


def _shape(snap: NodeSnapshot, mode: str) -> Shape | None:
    if mode == "nftables":
        rs, _ = ruleset_of(snap)  # (read once per snapshot: the walk's own parse)
        table = None if rs is None else (rs.table("ip", "kube-proxy") or
                                         rs.table("ip6", "kube-proxy"))
        if table is None:
            return None
        names = {c.name for c in table.chains}
        if "filter-prerouting-pre-dnat" in names:
            return NFT_SINCE_132456
        if "filter-output-post-dnat" in names or "filter-prerouting" in names:
            return NFT_BEFORE_132456
        return None
    nat = snap.netfilter.table("nat") if snap.netfilter is not None else None
    if nat is None or mode not in ("iptables", "ipvs"):
        return None
    chains = [c.name for c in nat.chains]
    if any(n.startswith("KUBE-XLB-") for n in chains):
        return IPT_XLB
    if any(n.startswith("KUBE-EXT-") for n in chains):
        return IPT_EXT
    return None
