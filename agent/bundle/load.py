"""Read saved or pasted command outputs into a NodeSnapshot, by content, not by name.

``check --from`` takes a directory of files with any names (a bundle that `bundle DIR`
wrote, or what a ticket holds), one file, or standard input. Each file is split into
the outputs it holds (agent.bundle.sections) and each output goes to the reader of its
format. Nothing is all-or-nothing: lines that cannot be read are reported (file, line,
why) and the rest is used; a file is refused only when nothing in it is usable, with the
format it looked like and the command that gives what is needed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from agent.bundle import files as bundle_files
from agent.bundle import sections as fmt
from agent.bundle.markup import without_markup
from agent.bundle.sections import Section, split_sections
from agent.errors import InputError
from agent.netfilter.listing import listing_to_rules
from agent.netfilter.nft_json import looks_like_nft_json
from agent.netfilter.nft_text import split_nft
from agent.netfilter.rules_text import RulesText, chain_table, read_rules_text, settle
from agent.parse.addr_text import parse_addresses
from agent.parse.ipset_text import parse_ipsets
from agent.parse.ipvsadm_text import parse_ipvsadm
from agent.parse.kube import (
    choose_kube_proxy_image,
    kube_proxy_daemon_set,
    kube_proxy_pods,
    parse_ingresses,
    parse_node,
    parse_services,
)
from agent.parse.kube_proxy_log import failed_sync
from agent.parse.kube_proxy_metrics import read_metrics
from agent.parse.route_text import parse_local_routes
from agent.parse.svc_describe import parse_svc_describe
from agent.parse.svc_table import parse_svc_table
from agent.parse.sysctl_text import parse_sysctls
from agent.parse.text_file import decode_text, read_text_file
from agent.snapshot import (
    Address,
    IpSet,
    IpvsVirtualServer,
    KubeProxyImage,
    KubeProxySync,
    LocalRoute,
    Netfilter,
    NftDump,
    NodeInfo,
    NodeSnapshot,
    Service,
    Unknown,
)

MAX_FILE_BYTES = 256 * 1024 * 1024  # a bigger "paste" is not a paste
MAX_FILES = 1000
_PROBLEMS_SHOWN = 20
T = TypeVar("T")


@dataclass
class _Evidence:
    """Everything read so far, from every file."""

    rules: RulesText = field(default_factory=RulesText)
    rules6: RulesText = field(default_factory=RulesText)  # ip6tables-save / ip6tables -S
    ipsets: dict[str, IpSet] = field(default_factory=dict)
    ipvs: dict[tuple[str, str, int], IpvsVirtualServer] = field(default_factory=dict)
    addresses: dict[tuple[str, str], Address] = field(default_factory=dict)
    local_routes: dict[tuple[str, str, str | None], LocalRoute] = field(default_factory=dict)
    main_routes: dict[tuple[str, str, str | None], LocalRoute] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    services: dict[str, Service] = field(default_factory=dict)
    node: NodeInfo | None = None
    kube_proxy_images: list[KubeProxyImage] = field(default_factory=list)
    ingresses: dict[str, Any] = field(default_factory=dict)
    services_read: bool = False  # a Service list was read (it may be empty)
    seen: dict[str, list[str]] = field(default_factory=dict)  # format -> sources
    problems: list[tuple[str, int | None, str]] = field(default_factory=list)
    notes: list[Unknown] = field(default_factory=list)
    # lines that may speak of kube-proxy (its command line, log, configuration)
    kube_proxy_lines: list[str] = field(default_factory=list)
    nft: list[NftDump] = field(default_factory=list)  # kube-proxy nftables mode's rules
    ip6_none: bool = False  # an empty ip6tables-save.txt: the node has no IPv6 table
    ip4_none: bool = False  # an empty iptables-save.txt: no IPv4 table
    kube_proxy_sync: KubeProxySync | None = None  # kube-proxy's sync metrics

    def saw(self, format_: str, where: str) -> None:
        self.seen.setdefault(format_, []).append(where)


def load_bundle(path: str | Path) -> NodeSnapshot:
    """Read a directory (every regular file in it), one file, or '-' (standard input).

    Raises InputError only when nothing usable was found; problems with single lines
    and files become ``unknowns``.
    """
    p = Path(path)
    if str(path) == "-":
        texts: Iterable[tuple[str, str | InputError, str]] = [
            ("<stdin>", read_input("-", "<stdin>"), fmt.UNKNOWN)]
    elif p.is_dir():
        texts = _dir_texts(p)  # one file at a time: each text is dropped once read
    elif p.exists():
        # the file the user named: a symlink to it is fine (one inside a directory is not)
        texts = [(str(p), read_input(str(p), str(p)), fmt.name_format(p.name))]
    else:
        raise InputError(str(path), None, "no such file or directory")
    return load_texts(texts, origin=f"bundle:{path}")


def load_texts(texts: Iterable[tuple[str, str | InputError, str]], origin: str
               ) -> NodeSnapshot:
    """(source name, text or why it could not be read, format hint from the name) ->
    the snapshot."""
    ev = _Evidence()
    refused: list[str] = []
    names: list[str] = []
    for source, text, hint in texts:
        names.append(source)
        if isinstance(text, InputError):
            refused.append(str(text))
            continue
        text = without_markup(text)  # what a paste wraps around the outputs
        base = source.rsplit("/", 1)[-1]
        if base in (bundle_files.IPTABLES, bundle_files.IP6TABLES) and not text.strip():
            # (ip6)tables-save prints nothing where no table exists, and the live probe
            # reads that as "no rules"; `bundle` writes no file where the dump failed
            if base == bundle_files.IP6TABLES:
                ev.saw(IP6TABLES, f"{source} (empty)")
                ev.ip6_none = True
            else:
                ev.saw(fmt.IPTABLES, f"{source} (empty)")
                ev.ip4_none = True
            continue
        if hint in (fmt.IPSET, fmt.IPVSADM) and (not text or text.isspace()):
            # `ipset save` / `ipvsadm -Ln` print nothing on a node without sets or IPVS:
            # the bundle's empty file says "none", not "unknown"
            ev.saw(hint, f"{source} (empty)")
            continue
        before = sum(len(v) for v in ev.seen.values())
        text = _nft_part(text, source, ev)
        text = _ip6_dumps(text, source, ev)
        sections = split_sections(text, source, hint)
        if not _one_whole_dump(sections):
            _kube_proxy_lines(text, source, ev)
        for s in sections:
            _read_section(s, ev)
        if sum(len(v) for v in ev.seen.values()) == before:
            named = any(p[0] == source for p in ev.problems) or \
                any(p[0] == source for p in ev.rules.problems) or \
                any(p[0] == source for p in ev.rules6.problems)
            refused.append(_refusal(source, text, sections, named))
    if not ev.seen:
        lines = [f"{src}:{n}: {why}" if n else f"{src}: {why}"
                 for src, n, why in ev.problems[:5]]
        lines += [f"{src}:{p.line}: {p.why}" for src, p in ev.rules.problems[:5]]
        raise InputError(names[0] if len(names) == 1 else origin.removeprefix("bundle:"),
                         None, "nothing usable found" + (": " + "; ".join(refused + lines)
                                                         if refused else " (no files)"))
    return _snapshot(ev, origin, refused)


def _nft_part(text: str, source: str, ev: _Evidence) -> str:
    """Take nftables rules (`nft list ...` text, an `nft -f` script, `nft -j` JSON) out
    of a paste; agent.netfilter.nft_read reads them. The rest is read as usual."""
    if looks_like_nft_json(text):
        ev.nft.append(NftDump("json", text, source))
        ev.saw("nft", source)
        return ""
    part, rest = split_nft(text)
    if part is not None:
        ev.nft.append(NftDump("text", part, source))
        ev.saw("nft", source)
    return rest


# an ip6tables-save dump inside a text: from its header to its last COMMIT (or to the
# next dump's header): taken out, like nft rules, so an iptables-save beside it in the same
# paste stays IPv4
_IP6_HEADER = re.compile(r"^# Generated by ip6tables-\S*save\b.*$", re.M)
_ANY_HEADER = re.compile(r"^# Generated by ip6?tables-\S*save\b", re.M)
_COMPLETED = re.compile(r"^# Completed on\b.*$", re.M)


def _ip6_dumps(text: str, source: str, ev: _Evidence) -> str:
    """Read the ip6tables-save dumps of ``text`` into ``ev.rules6``; the rest of the text,
    with their lines blank (so later messages name the right line numbers)."""
    if "# Generated by ip6tables" not in text:
        return text
    out: list[str] = []
    at = 0
    for m in _IP6_HEADER.finditer(text):
        if m.start() < at:
            continue
        nxt = _ANY_HEADER.search(text, m.end())
        stop = nxt.start() if nxt else len(text)
        done = _COMPLETED.search(text, m.end(), stop)
        end = done.end() if done else _dump_end(text, m.end(), stop)
        first = text.count("\n", 0, m.start()) + 1
        block = text[m.start():end]
        out.append(text[at:m.start()])
        out.append("\n" * block.count("\n"))
        at = end
        before = ev.rules6.count()
        # a dump that opens the text is read as text (its lines numbered from 1, and no
        # tuple per line); one further down as numbered lines
        read_rules_text(block if first == 1 else list(enumerate(block.splitlines(), first)),
                        source, ev.rules6)
        if ev.rules6.count() > before or ev.rules6.tables_seen:
            ev.saw(IP6TABLES, f"{source}:{first}")
    out.append(text[at:])
    return "".join(out)


# what an ip6tables-save dump is made of (and blank lines a paste may add)
_DUMP_LINE = re.compile(r"\*\S|:\S|-[AIN] |\[\d+:\d+\]|COMMIT\s*$|\s*$")


def _dump_end(text: str, start: int, stop: int) -> int:
    """Where a dump without its "# Completed" line ends: at its last line of dump
    content before a line that is not (the next command's prompt or output, which would
    otherwise be read as IPv6 rules and lost to its own reader)."""
    last = pos = start
    while pos < stop:
        nl = text.find("\n", pos + 1, stop)
        line_end = nl if nl >= 0 else stop
        line = text[pos + 1 if text.startswith("\n", pos) else pos:line_end]
        if not _DUMP_LINE.match(line):
            break
        if line.strip():
            last = line_end
        pos = line_end
    return last


def _one_whole_dump(sections: list[Section]) -> bool:
    """Is the text one whole iptables-save dump (every line a dump's: a header, a chain,
    a rule, COMMIT)? None of its lines is kube-proxy's output, and a scan of 18 MB (10k
    services) for kube-proxy's words would cost 30 ms."""
    return len(sections) == 1 and sections[0].format == fmt.IPTABLES and \
        sections[0].text is not None


def _kube_proxy_lines(text: str, source: str, ev: _Evidence) -> None:
    """Keep what may say kube-proxy's mode and cluster CIDR (a substring test per line:
    a big dump costs little); the file counts as read when it does say it."""
    if "KubeProxyConfiguration" in text:
        lines = text.splitlines()  # a YAML document: its lines together
    elif "kube-proxy" in text or "Prox" in text or "FLAG: --" in text or \
            '"Version info"' in text or "Failed to " in text:
        lines = [ln for ln in text.splitlines()
                 if ("kube-proxy" in ln or "Prox" in ln or "FLAG: --" in ln
                     or '"Version info"' in ln
                     or ("Failed to " in ln and failed_sync(ln) is not None))
                 and not ln.startswith(("-A ", ":", "["))]
    else:
        return
    if lines and any(_from_paste(lines)):  # a fact, or a value it names as unusable
        ev.kube_proxy_lines += lines
        ev.saw("kube-proxy", source)


def _from_paste(lines: list[str]):  # type: ignore[no-untyped-def]
    """agent.probes.kube_proxy.from_paste, imported when a text speaks of kube-proxy (the
    probes package and psutil cost 15-20 ms to import, which a check --from that does
    not need them spends for nothing)."""
    from agent.probes.kube_proxy import from_paste

    return from_paste(lines)


def _dir_texts(d: Path):  # type: ignore[no-untyped-def]
    names = sorted(os.listdir(d))
    if len(names) > MAX_FILES:
        raise InputError(str(d), None, f"{len(names)} files: more than {MAX_FILES}")
    for name in names:
        if name.startswith("."):
            continue
        f = d / name
        try:
            st = os.stat(f, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            # FIFOs, devices, directories, symlinks: never opened
            yield name, InputError(name, None, "not a regular file: skipped"), fmt.UNKNOWN
            continue
        try:
            yield name, read_text_file(f, name, MAX_FILE_BYTES), fmt.name_format(name)
        except InputError as e:
            yield name, e, fmt.UNKNOWN


def read_input(path: str, name: str) -> str:
    """The text of a file the user named (a symlink to it is followed), or of standard
    input for "-", as read_text_file reads a file: at most MAX_FILE_BYTES (`cat /dev/zero |`
    would otherwise fill the memory), UTF-8; else an InputError naming ``name``."""
    if path != "-":
        return read_text_file(Path(path), name, MAX_FILE_BYTES, follow=True)
    try:
        data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise InputError(name, None, f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise InputError(name, None, f"larger than {MAX_FILE_BYTES // 2**20} MiB")
    return decode_text(data, name)


# --- one reader per format ---------------------------------------------------------------


def _read_section(s: Section, ev: _Evidence) -> None:
    where = f"{s.source}:{s.first_line}"
    if s.format in (fmt.IPTABLES, fmt.IPTABLES_LIST) and _is_ipv6_rules(s):
        before = ev.rules6.count()
        if s.format == fmt.IPTABLES:
            table = s.hint.get("table") if s.command else None
            read_rules_text(s.text if s.text is not None else s.lines, s.source, ev.rules6,
                            table=table)
        else:
            _iptables_list(s, ev, ev.rules6)
        if ev.rules6.count() > before:
            ev.saw(IP6TABLES, where)
        return
    if s.hint.get("family") == "ipv6":
        ev.notes.append(Unknown(where, f"`{s.command}`: IPv6 output of this command is "
                                "not analysed"))
        return
    reader = _READERS.get(s.format)
    if reader is None:
        return
    try:
        ok = reader(s, ev)
    except Exception as e:  # a reader's bug must cost this section, not the verdict
        ev.problems.append((s.source, s.first_line, f"this {s.format} output could not be "
                            f"read (internal error {type(e).__name__}: {e}; please report "
                            "it): skipped"))
        return
    if ok:
        ev.saw(s.format, where)


IP6TABLES = "ip6tables"  # what ev.seen calls the IPv6 rules
# an IPv6 address or prefix as a rule's -s/-d (ip6tables prints "addr/128"), or a match
# only ip6tables has; each alternative starts with a literal, so a 30 MB dump is scanned in
# tenths of a second (a leading "(?:^|\s)" made the engine try every position: 1.8 s at
# 10k services)
_V6_RULE = re.compile(r"-[sd] [0-9a-fA-F]*:[0-9a-fA-F:.]*(?:/\d+)?(?=\s)|"
                      r"--(?:source|destination) [0-9a-fA-F]*:|-p (?:ipv6-icmp|icmpv6)\b|"
                      r"--reject-with icmp6-|icmp6-type\b|--to-(?:destination|source) \[|"
                      r"--match-set KUBE-6-")  # (kube-proxy's IPv6 ipsets: IPVS mode)
_V4_RULE = re.compile(r"-[sd] \d+\.\d+\.\d+\.\d+|--(?:source|destination) \d+\.\d+\.\d+\.\d+|"
                      r"--reject-with icmp-|--to-destination \d+\.")


def _is_ipv6_rules(s: Section) -> bool:
    """Is this iptables section IPv6 (`ip6tables ...`, an ip6tables-save header, IPv6
    addresses in -s/-d and no IPv4 ones)?"""
    if s.hint.get("family") == "ipv6" or "ip6tables" in s.source.rsplit("/", 1)[-1]:
        return True
    text = s.text if s.text is not None else "\n".join(line for _, line in s.lines)
    if text.lstrip().startswith("# Generated by ip6tables"):
        return True
    if s.format == fmt.IPTABLES_LIST:
        # `ip6tables -L -n` prints "::/0" for any address (iptables "0.0.0.0/0"); other
        # addresses are told as in rules, once the listing is read as rules
        if "::/0" in text and _ANY6.search(text):
            return True
        pairs, _ = listing_to_rules(s.lines, s.hint.get("chain"))
        text = "\n".join(line for _, line in pairs)
    # IPv4 first: in an IPv4 dump its first rule with an address settles it
    return not _outside_comments(_V4_RULE, text) and _outside_comments(_V6_RULE, text)


_ANY6 = re.compile(r"(?<!\S)::/0(?!\S)")


def _outside_comments(pattern: re.Pattern[str], text: str) -> bool:
    """Does ``pattern`` match ``text`` outside a quoted comment (an address in a comment
    says nothing of the rule's family)? Most dumps have no match at all: that costs one
    search."""
    for m in pattern.finditer(text):
        start = text.rfind("\n", 0, m.start()) + 1
        if text.count('"', start, m.start()) % 2 == 0:
            return True
    return False


def _iptables(s: Section, ev: _Evidence) -> bool:
    before = ev.rules.count()
    table = s.hint.get("table") if s.command else None
    read_rules_text(s.text if s.text is not None else s.lines, s.source, ev.rules, table=table)
    return ev.rules.count() > before


def _iptables_list(s: Section, ev: _Evidence, into: RulesText | None = None) -> bool:
    """An `iptables -L` listing (``into``: the IPv6 rules for an ip6tables one)."""
    rules = ev.rules if into is None else into
    pairs, problems = listing_to_rules(s.lines, s.hint.get("chain"))
    ev.problems += [(s.source, n, why) for n, why in problems]
    if not pairs:
        return False
    table = s.hint.get("table")  # `iptables -L` lists filter, `-t T -L` table T
    if table is not None:
        read_rules_text(pairs, s.source, rules, table=table)
        return True
    # a listing pasted without its command: each chain's rules go together, to the table
    # its name and targets say, else rule by rule (and the verdict says it was inferred)
    blocks: dict[str, list[tuple[int, str]]] = {}
    for n, line in pairs:
        blocks.setdefault(line.split(None, 2)[1], []).append((n, line))
    for chain, block in blocks.items():
        targets = [t.group(1) for _, line in block for t in [_JUMP.search(line)] if t]
        guessed = chain_table(chain, targets)
        if guessed is not None:
            rules.inferred[guessed] = rules.inferred.get(guessed, 0) + sum(
                1 for _, line in block if line.startswith("-A "))
        read_rules_text(block, s.source, rules, table=guessed)
    return True


_JUMP = re.compile(r" -[jg] (\S+)")


def _tolerant(parse: Callable[[str, str], T], s: Section, ev: _Evidence,
              lines: list[tuple[int, str]] | None = None) -> T | None:
    """Run a strict parser on the section; at each line it refuses, report the line,
    drop it and read the rest again (a bounded number of times)."""
    if lines is None and s.text is not None:
        try:
            return parse(s.text, s.source)  # a whole file: no copy of its lines
        except InputError:
            pass
    kept = list(lines if lines is not None else s.all_lines())
    for _ in range(25):
        try:
            return parse("\n".join(t for _, t in kept) + "\n", s.source)
        except InputError as e:
            if e.line is None or not 1 <= e.line <= len(kept):
                ev.problems.append((s.source, s.first_line, e.message))
                return None
            ev.problems.append((s.source, kept[e.line - 1][0], e.message))
            del kept[e.line - 1]
    ev.problems.append((s.source, s.first_line, "too many unreadable lines: section skipped"))
    return None


def _ipset(s: Section, ev: _Evidence) -> bool:
    if s.text is not None and "Number of entries:" not in s.text:
        sets = _tolerant(parse_ipsets, s, ev)  # a whole file (split_sections)
        for st in sets or ():
            old = ev.ipsets.get(st.name)
            ev.ipsets[st.name] = st if old is None else IpSet(
                st.name, st.type, tuple(dict.fromkeys(old.members + st.members)))
        return bool(sets)
    lines = s.all_lines()
    name = s.hint.get("set")
    if name and not any(t.lstrip().startswith(("Name:", "create ", "add ")) for _, t in lines):
        # `ipset list NAME | grep ...`: bare members, the name is the command's
        members = tuple(t.strip() for _, t in lines if t.strip())
        old = ev.ipsets.get(name)
        ev.ipsets[name] = IpSet(name, old.type if old else _guess_type(members),
                                tuple(dict.fromkeys((old.members if old else ()) + members)))
        return bool(members)
    sets = _tolerant(parse_ipsets, s, ev, _without_ipset_counts(lines))
    for st in sets or ():
        old = ev.ipsets.get(st.name)
        ev.ipsets[st.name] = st if old is None else IpSet(
            st.name, st.type, tuple(dict.fromkeys(old.members + st.members)))
    return bool(sets)


def _without_ipset_counts(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """An excerpt of `ipset list` (grep, head) lacks members its header counts: drop the
    count so the reader takes what is there."""
    return [(n, t) for n, t in lines if not t.lstrip().startswith("Number of entries:")]


def _guess_type(members: tuple[str, ...]) -> str:
    m = members[0] if members else ""
    if m.isdigit():
        return "bitmap:port"
    parts = m.split(",")
    dims = ["net" if "/" in p else "port" if ":" in p else "ip" for p in parts]
    return "hash:" + ",".join(dims)


def _ipvsadm(s: Section, ev: _Evidence) -> bool:
    servers = _tolerant(parse_ipvsadm, s, ev)
    for vs in servers or ():
        ev.ipvs[(vs.protocol, vs.address, vs.port)] = vs
    return servers is not None


_BR = re.compile(r"^([\w@.-]+)\s+(UP|DOWN|UNKNOWN|LOWERLAYERDOWN|DORMANT)\s+(.*)$")


def _addr(s: Section, ev: _Evidence) -> bool:
    lines = [(n, t) for n, t in s.lines if t.strip()]
    if s.text is not None or (lines and lines[0][1].lstrip().startswith("[")):
        got = _tolerant(parse_addresses, s, ev)
    elif lines and all(_BR.match(t.strip()) for _, t in lines):
        got = tuple(_brief(t.strip()) for _, t in lines)  # `ip -br addr`
        got = tuple(a for group in got for a in group)
    else:
        if lines and lines[0][1][:1].isspace():
            # an excerpt that starts inside an interface: the command names it, or the
            # address lines do ("inet 10.0.0.5/32 scope global kube-ipvs0")
            dev = s.hint.get("dev") or _label(lines) or "unknown-interface"
            # kube-proxy keeps kube-ipvs0 DOWN; of another interface the state is not known
            flags = "BROADCAST,NOARP" if dev == "kube-ipvs0" else "BROADCAST,UP"
            lines = [(lines[0][0], f"0: {dev}: <{flags}> mtu 1500 state UNKNOWN"), *lines]
            ev.notes.append(Unknown(f"{s.source}:{s.first_line}", f"addresses read without "
                                    f"their interface line: taken as interface {dev}"))
        got = _tolerant(parse_addresses, s, ev, lines)
    for a in got or ():
        ev.addresses[(a.ifname, a.address)] = a
    return bool(got)


def _label(lines: list[tuple[int, str]]) -> str | None:
    for _, t in lines:
        words = t.split()
        if words[:1] in (["inet"], ["inet6"]) and "scope" in words:
            tail = words[words.index("scope") + 2:]
            names = [w for w in tail if re.match(r"^[a-z][\w@.:-]*$", w) and w not in (
                "secondary", "dynamic", "noprefixroute", "deprecated", "tentative")]
            if names:
                return names[-1].split(":")[0]
    return None


def _brief(line: str) -> list[Address]:
    m = _BR.match(line)
    assert m
    ifname = m.group(1).split("@")[0]
    up = m.group(2) != "DOWN"
    out = []
    for word in m.group(3).split():
        try:
            iface = ipaddress.ip_interface(word)
        except ValueError:
            continue
        scope = "link" if iface.ip.is_link_local else "host" if iface.ip.is_loopback \
            else "global"
        out.append(Address(ifname, str(iface.ip), iface.network.prefixlen, scope, up))
    return out


_ROUTE_TYPES = ("local ", "broadcast ", "anycast ", "unicast ", "multicast ")


def _route(s: Section, ev: _Evidence) -> bool:
    if s.text is not None and s.doc is None:
        return _route_file(s, ev)
    table = s.hint.get("route_table")
    lines = [(n, t) for n, t in s.lines if t.strip()]
    if s.doc is not None or (lines and lines[0][1].lstrip().startswith("[")):
        # `ip -j route show table local`
        routes = _tolerant(parse_local_routes, s, ev)
        if not routes or not any(r.type == "local" for r in routes):
            return False
        return _keep_local(routes, ev)
    typed = [t.lstrip().startswith(_ROUTE_TYPES) for _, t in lines]
    if (table not in (None, "local", "255", "all") and not any(typed)) or (
            table is None and not any(t.lstrip().startswith(("local ", "broadcast "))
                                      for _, t in lines)):
        return _keep_main(_tolerant(parse_local_routes, s, ev, lines), s, ev)
    if s.hint.get("route_type") == "local" or (table in ("local", "255") and not any(typed)):
        # `ip route show table local type local` prints no type word
        lines = [(n, t if t.lstrip().startswith(_ROUTE_TYPES) else "local " + t.strip())
                 for n, t in lines]
    return _keep_local(_tolerant(parse_local_routes, s, ev, lines), ev)


# a line of the local table (`ip route show table local` prints them, the main table none)
_LOCAL_ROUTE_LINE = re.compile(r"^\s*(?:local|broadcast) ", re.M)


def _route_file(s: Section, ev: _Evidence) -> bool:
    """A whole file of `ip route` text and nothing else, no command (split_sections reads
    20k lines of kube-ipvs0's routes as one text): what _route does with its lines, the
    line tests made by one regex search."""
    routes = _tolerant(parse_local_routes, s, ev)
    if not _LOCAL_ROUTE_LINE.search(s.text or ""):
        return _keep_main(routes, s, ev)
    return _keep_local(routes, ev)


def _keep_main(routes: tuple[LocalRoute, ...] | None, s: Section, ev: _Evidence) -> bool:
    """The main table: not the node's own addresses, but where its pods are routed (False:
    the section gave no local table)."""
    for r in routes or ():
        ev.main_routes[(r.type, r.dst, r.dev)] = r
    if routes:
        ev.saw("ip route (main)", f"{s.source}:{s.first_line}")
    return False


def _keep_local(routes: tuple[LocalRoute, ...] | None, ev: _Evidence) -> bool:
    for r in routes or ():
        ev.local_routes[(r.type, r.dst, r.dev)] = r
    return bool(routes)


def _sysctl(s: Section, ev: _Evidence) -> bool:
    got = _tolerant(parse_sysctls, s, ev)
    if got is None:
        return False
    ev.sysctls.update(got)
    return True


def _metrics(s: Section, ev: _Evidence) -> bool:
    lines = s.all_lines()
    got, problems = read_metrics((t for _, t in lines), s.source,
                                 lines[0][0] if lines else 1)
    ev.problems += [(s.source, n, why) for n, why in problems]
    if got is None:
        return False
    old = ev.kube_proxy_sync  # (a page and a grep of it: what the later one adds)
    ev.kube_proxy_sync = got if old is None else KubeProxySync(
        old.source, old.read_at or got.read_at,
        tuple(sorted({**dict(old.last_sync), **dict(got.last_sync)}.items())),
        tuple(sorted({**dict(old.last_queued), **dict(got.last_queued)}.items())),
        tuple(sorted({**dict(old.failures), **dict(got.failures)}.items())))
    return True


def _kube(s: Section, ev: _Evidence) -> bool:
    text = "\n".join(t for _, t in s.lines) if s.doc is None else ""
    try:
        docs = [s.doc] if s.doc is not None else [json.loads(text)] if text.lstrip(
        ).startswith(("{", "[")) else _yaml_documents(text)
    except Exception as e:
        if not isinstance(e, (ValueError, RecursionError)) and not _yaml_error(e):
            raise
        mark = getattr(e, "problem_mark", None)
        line = s.first_line + (mark.line if mark else getattr(e, "lineno", 1) - 1)
        why = getattr(e, "problem", None) or e
        if isinstance(e, RecursionError):  # (JSON's and YAML's parsers recurse per level)
            why = f"nested deeper than its parser can follow ({e})"
        ev.problems.append((s.source, line, f"not valid YAML/JSON: {why}"))
        return False
    used = False
    items: list[Any] = []
    for d in docs:
        if isinstance(d, dict) and ("items" in d or str(d.get("kind", "")).endswith("List")):
            if not d.get("items") and (d.get("kind") == "ServiceList" or
                                       (fmt.name_format(s.source) == fmt.KUBE and
                                       re.search(r"svc|service", s.source, re.I))):
                ev.services_read = used = True
            items += d.get("items") or []
        else:
            items.append(d)
    by_kind: dict[str, list[Any]] = {}
    for item in items:
        if not isinstance(item, dict):
            ev.problems.append((s.source, s.first_line, "a YAML/JSON document that is not "
                                "an object"))
            continue
        spec = item.get("spec")
        # (items of `kubectl cluster-info dump` and of typed lists carry no kind)
        kind = item.get("kind") or ("Service" if isinstance(spec, dict) and "ports" in spec
                                    else "Pod" if isinstance(spec, dict) and
                                    "containers" in spec else None)
        by_kind.setdefault(str(kind), []).append(item)
    where = f"{s.source}:{s.first_line}"
    for n, item in enumerate(by_kind.get("Service", ())):
        if not isinstance(item.get("metadata"), dict) or "name" not in item["metadata"]:
            # trimmed by its author: keep the object, name it by where it stands
            item["metadata"] = {"name": f"unnamed-{s.first_line}-{n}",
                                "namespace": "unknown", **(item.get("metadata") or {})}
    for kind, objs in by_kind.items():
        for o in objs:
            o.setdefault("kind", kind)
        doc = {"kind": "List", "items": objs}
        try:
            if kind == "Service":
                for svc in parse_services(doc, where):
                    _add_service(ev, svc)
                ev.services_read = True
            elif kind == "Node":
                ev.node = parse_node(objs[0], where)
            elif kind == "Ingress":
                for ing in parse_ingresses(doc, where):
                    ev.ingresses[ing.key] = ing
            elif kind in ("Pod", "DaemonSet"):
                # (kube-system's Pods on the node, kube-proxy's DaemonSet: its image)
                ev.kube_proxy_images += (kube_proxy_pods if kind == "Pod" else
                                         kube_proxy_daemon_set)(doc, where)
            else:
                what = f"{kind} objects" if kind != "None" else "objects without a kind"
                ev.notes.append(Unknown(where, f"{len(objs)} {what}: not used"))
                continue
        except InputError as e:
            ev.problems.append((s.source, s.first_line, e.message))
            continue
        used = True
    return used


def _yaml_documents(text: str) -> list[Any]:
    import yaml  # only for pasted YAML: 10 ms to import, which a bundle's JSON does without

    return [d for d in yaml.safe_load_all(text) if d is not None]


def _yaml_error(e: Exception) -> bool:
    yaml = sys.modules.get("yaml")  # not imported: no YAML was read
    return yaml is not None and isinstance(e, yaml.YAMLError)


def _svc_table(s: Section, ev: _Evidence) -> bool:
    got = _tolerant(parse_svc_table, s, ev)
    for svc in got or ():
        ev.services.setdefault(svc.key, svc)
    if got is not None:
        ev.services_read = True
    if got:
        ev.notes.append(Unknown(f"{s.source}:{s.first_line}", "Services read from `kubectl "
                                "get svc` text: externalTrafficPolicy and annotations are "
                                "not in it"))
    return bool(got)


def _add_service(ev: _Evidence, svc: Service) -> None:
    """A Service read from YAML/JSON or a describe replaces one read before, but a
    manifest (no status) never replaces one whose status was given: the address the
    API server gave it must not turn into "not given" because its YAML is pasted too."""
    old = ev.services.get(svc.key)
    if old is None or svc.status_given or not old.status_given:
        ev.services[svc.key] = svc


def _svc_describe(s: Section, ev: _Evidence) -> bool:
    got, problems = parse_svc_describe(s.all_lines(), s.source)
    ev.problems += [(s.source, n, why) for n, why in problems]
    for svc in got:
        _add_service(ev, svc)  # (over a `kubectl get svc` row: it says more)
    if got:
        ev.services_read = True  # (as a single Service's YAML is: the Services given)
    return bool(got)


_READERS: dict[str, Callable[[Section, _Evidence], bool]] = {
    fmt.IPTABLES: _iptables, fmt.IPTABLES_LIST: _iptables_list, fmt.IPSET: _ipset,
    fmt.IPVSADM: _ipvsadm, fmt.ADDR: _addr, fmt.ROUTE: _route, fmt.SYSCTL: _sysctl,
    fmt.KUBE: _kube, fmt.SVC_TABLE: _svc_table, fmt.SVC_DESCRIBE: _svc_describe,
    fmt.METRICS: _metrics,
}


def _refusal(source: str, text: str, sections: list[Section], named: bool) -> str:
    if not text.strip():
        return f"{source}: empty"
    looked = [s.format for s in sections if s.format != fmt.UNKNOWN]
    if looked and named:
        return f"{source}: nothing in it could be read (the lines are named above)"
    if looked:
        f = looked[0]
        return (f"{source}: looked like {f} output but no line of it could be read "
                f"(give `{fmt.COMMAND_FOR.get(f, f)}` output)")
    return (f"{source}: no known command output in it (give iptables-save, ipset save, "
            "ipvsadm -Ln, ip addr, ip route show table local, sysctl -a, or kubectl "
            "get svc -A -o yaml)")


# --- the snapshot ------------------------------------------------------------------------


def _snapshot(ev: _Evidence, origin: str, refused: list[str]) -> NodeSnapshot:
    unknowns: list[Unknown] = []
    netfilter = Netfilter("unknown", ()) if ev.ip4_none else None
    if ev.rules.count() or ev.rules.tables_seen:
        netfilter = settle(ev.rules)
        if ev.rules.inferred:
            placed = ", ".join(f"{n} to {t}" for t, n in sorted(ev.rules.inferred.items()))
            total = sum(ev.rules.inferred.values())
            unknowns.append(Unknown("iptables", f"{total} rules had no table "
                                    f"header: placed by their chains and targets ({placed})"))
    for source, p in (*ev.rules.problems, *ev.rules6.problems):
        ev.problems.append((source, p.line, p.why))
    ip6tables = Netfilter("unknown", ()) if ev.ip6_none else None
    if ev.rules6.count() or ev.rules6.tables_seen:
        ip6tables = settle(ev.rules6)
        if ev.rules6.inferred:
            placed = ", ".join(f"{n} to {t}" for t, n in sorted(ev.rules6.inferred.items()))
            unknowns.append(Unknown("ip6tables", f"{sum(ev.rules6.inferred.values())} IPv6 "
                                    f"rules had no table header: placed by their chains and "
                                    f"targets ({placed})"))
    for what, attr, cmd in (
            ("iptables", fmt.IPTABLES, "iptables-save"), ("ipsets", fmt.IPSET, "ipset save"),
            ("ipvs", fmt.IPVSADM, "ipvsadm -Ln"), ("addresses", fmt.ADDR, "ip addr"),
            ("local table", fmt.ROUTE, "ip route show table local"),
            ("sysctls", fmt.SYSCTL, "sysctl -a"),
            ("services", fmt.KUBE, "kubectl get svc -A -o yaml")):
        if attr in ev.seen or (attr == fmt.IPTABLES and fmt.IPTABLES_LIST in ev.seen) or \
                (attr == fmt.KUBE and ev.services_read):
            continue
        if attr == fmt.IPTABLES and IP6TABLES in ev.seen:
            unknowns.append(Unknown(what, "IPv4 rules not given (only `ip6tables-save` "
                                    "output was): IPv4 LB IPs are not walked"))
            continue
        unknowns.append(Unknown(what, f"not given (`{cmd}` output would show it)"))
    for source, line, why in ev.problems[:_PROBLEMS_SHOWN]:
        unknowns.append(Unknown(source, f"{source}:{line}: {why}" if line else
                                f"{source}: {why}"))
    if len(ev.problems) > _PROBLEMS_SHOWN:
        unknowns.append(Unknown("input", f"{len(ev.problems) - _PROBLEMS_SHOWN} more lines "
                                "were not read"))
    unknowns += ev.notes
    unknowns += [Unknown(r.split(":", 1)[0], r) for r in refused
                 if "(the lines are named above)" not in r]
    kube_proxy, how = _from_paste(ev.kube_proxy_lines) if ev.kube_proxy_lines else (None, "")
    if "not used" in how:  # a value it could not use: said like any unreadable line
        unknowns.append(Unknown("input", f"kube-proxy: {how}"))
    if kube_proxy is None:
        unknowns.append(Unknown("kube-proxy", "its flags, log or configuration are not in "
                                "the input (`ps -ef | grep kube-proxy` or `kubectl -n "
                                "kube-system logs` of its pod would show its mode)"))
    else:
        unknowns.append(Unknown("kube-proxy", f"read from the input: {how}"))
    return NodeSnapshot(
        kube_proxy=kube_proxy,
        node=ev.node.name if ev.node else None,
        origin=origin,
        netfilter=netfilter,
        ipsets=tuple(sorted(ev.ipsets.values(), key=lambda s: s.name))
        if fmt.IPSET in ev.seen else None,
        ipvs=tuple(ev.ipvs[k] for k in sorted(ev.ipvs)) if fmt.IPVSADM in ev.seen else None,
        addresses=tuple(ev.addresses.values()) if fmt.ADDR in ev.seen else None,
        local_routes=tuple(ev.local_routes.values()) if fmt.ROUTE in ev.seen else None,
        sysctls=dict(sorted(ev.sysctls.items())) if fmt.SYSCTL in ev.seen else None,
        services=tuple(ev.services.values()) if ev.services_read else None,
        ingresses=tuple(ev.ingresses.values()) if ev.ingresses else None,
        node_info=ev.node,
        kube_proxy_image=choose_kube_proxy_image(ev.kube_proxy_images),
        routes=tuple(ev.main_routes.values()) if ev.main_routes else None,
        unknowns=tuple(unknowns),
        nft=tuple(ev.nft) or None,
        ip6tables=ip6tables,
        kube_proxy_sync=ev.kube_proxy_sync,
    )


def with_kube_json(snap: NodeSnapshot, directory: Path) -> NodeSnapshot:
    """Replace the API objects of a live snapshot with saved kubectl output (`run` and
    `check --kube-json DIR`, for nodes whose agent has no API access). Raises InputError
    when DIR holds none of services.json, node.json, ingresses.json."""
    names = (bundle_files.SERVICES, bundle_files.NODE, bundle_files.INGRESSES)
    if not any((directory / n).exists() for n in names):
        raise InputError(str(directory), None, f"none of {', '.join(names)}")
    kube = load_bundle(directory)
    unknowns = tuple(u for u in snap.unknowns if u.source != "kubernetes API")
    unknowns += tuple(u for u in kube.unknowns
                      if u.source in (*names, bundle_files.KUBE_PROXY_DAEMONSET))
    return replace(snap, services=kube.services, node_info=kube.node_info,
                   ingresses=kube.ingresses, kube_proxy_image=kube.kube_proxy_image,
                   unknowns=unknowns)


__all__ = ["load_bundle", "load_texts", "with_kube_json"]
