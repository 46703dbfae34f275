"""Names the kernel hands over (interfaces), as text every output can encode."""

from __future__ import annotations


def kernel_name(raw: bytes | str) -> str:
    """An interface name as text. The kernel takes any bytes but '/', ':' and blanks; one
    that is not UTF-8 comes from netlink as bytes (pyroute2) and from /proc and /sys with
    surrogate escapes: either broke the snapshot's JSON, the bundle's sysctl.txt and the
    report. Its odd bytes become U+FFFD, the same from every source (the names match;
    two names that differ only there read the same), a surrogate no escape made "?"."""
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    if raw.isascii():
        return raw
    try:
        data = raw.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no escape made
        data = raw.encode("utf-8", "replace")
    return data.decode("utf-8", "replace")
