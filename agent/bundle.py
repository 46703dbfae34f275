"""Load a support bundle directory (the files `bundle DIR` writes) into a NodeSnapshot.

Every file is optional: a missing, unreadable or unparsable file leaves its snapshot
field ``None`` and adds an ``Unknown`` saying why, so a diagnosis can still run on the
rest and say what it could not see.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import bundle_files
from agent.errors import InputError
from agent.netfilter.save_format import parse_iptables_save
from agent.parse.addr_text import parse_addresses
from agent.parse.ipset_text import parse_ipsets
from agent.parse.ipvsadm_text import parse_ipvsadm
from agent.parse.kube import load_json, parse_ingresses, parse_node, parse_services
from agent.parse.route_text import parse_local_routes
from agent.parse.sysctl_text import parse_sysctls
from agent.snapshot import NodeSnapshot, Unknown

# file name -> (NodeSnapshot field, reader of the file's text)
_READERS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    bundle_files.IPTABLES: ("netfilter", parse_iptables_save),
    bundle_files.IPSET: ("ipsets", parse_ipsets),
    bundle_files.IPVSADM: ("ipvs", parse_ipvsadm),
    bundle_files.ROUTE_LOCAL: ("local_routes", parse_local_routes),
    bundle_files.ADDR: ("addresses", parse_addresses),
    bundle_files.SYSCTL: ("sysctls", parse_sysctls),
    bundle_files.SERVICES: ("services", lambda t, s: parse_services(load_json(t, s), s)),
    bundle_files.NODE: ("node_info", lambda t, s: parse_node(load_json(t, s), s)),
    bundle_files.INGRESSES: ("ingresses", lambda t, s: parse_ingresses(load_json(t, s), s)),
}
assert set(_READERS) == set(bundle_files.ALL)


def load_bundle(directory: str | Path) -> NodeSnapshot:
    """Read every bundle file present in ``directory``.

    Raises InputError only when there is no bundle at all (no such directory, or none
    of the bundle files in it); problems with single files become ``unknowns``.
    """
    path = Path(directory)
    if not path.is_dir():
        raise InputError(str(directory), None, "no such directory")
    present = [name for name in bundle_files.ALL if (path / name).exists()]
    if not present:
        raise InputError(str(directory), None,
                         f"no bundle files found (expected {', '.join(bundle_files.ALL)})")
    fields: dict[str, Any] = {}
    unknowns: list[Unknown] = []
    for name in bundle_files.ALL:
        field, reader = _READERS[name]
        if name not in present:
            unknowns.append(Unknown(source=name, reason="not in bundle"))
            continue
        try:
            fields[field] = reader(_read_text(path / name, name), name)
        except InputError as e:
            unknowns.append(Unknown(source=name, reason=str(e)))
        except Exception as e:  # a parser bug must not hide the other files' evidence
            unknowns.append(Unknown(source=name, reason=f"internal error reading it: "
                                    f"{type(e).__name__}: {e}"))
    unknowns.append(Unknown(source="kube-proxy", reason="process flags are not part of a bundle"))
    node_info = fields.get("node_info")
    return NodeSnapshot(
        node=node_info.name if node_info is not None else None,
        origin=f"bundle:{directory}",
        kube_proxy=None,
        unknowns=tuple(unknowns),
        **fields,
    )


def _read_text(file: Path, name: str) -> str:
    """The file as UTF-8 text; a read failure or a bad byte is an InputError."""
    try:
        data = file.read_bytes()
    except OSError as e:
        raise InputError(name, None, f"cannot read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(name, line,
                         f"not UTF-8 text (byte 0x{data[e.start]:02x} at column {column})"
                         ) from None
