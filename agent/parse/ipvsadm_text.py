"""Read IPVS virtual servers from `ipvsadm -Ln` or `ipvsadm -S -n` output.

Firewall-mark services (FWM / ``-f``) are skipped: kube-proxy does not create them, and
they carry no address to compare with the node's addresses. Addresses must be numeric;
without ``-n`` ipvsadm prints host and service names that cannot be resolved offline.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from sys import intern

from agent.errors import InputError
from agent.parse.ip_text import ASCII_OCTET, canonical_ip
from agent.snapshot import IpvsRealServer, IpvsVirtualServer

_LIST_PROTOCOLS = {"TCP": "TCP", "UDP": "UDP", "SCTP": "SCTP"}
_SAVE_PROTOCOLS = {
    "-t": "TCP", "--tcp-service": "TCP",
    "-u": "UDP", "--udp-service": "UDP",
    "--sctp-service": "SCTP",
}
_SAVE_FWMARK = {"-f", "--fwmark-service"}
_SAVE_FORWARD = {
    "-m": "Masq", "--masquerading": "Masq",
    "-g": "Route", "--gatewaying": "Route",
    "-i": "Tunnel", "--ipip": "Tunnel",
}
_FORWARD_NAMES = {"Masq", "Route", "Tunnel", "Local", "Bypass"}
_SERVICE_LINE = re.compile(r"^(TCP|UDP|SCTP|FWM)\s+(\S+)\s+(\S+)(?:\s.*)?$")
_REAL_LINE = re.compile(r"^->\s+(\S+)\s+(\S+)\s+([0-9]+)(?:\s.*)?$")
_SCHEDULER = re.compile(r"^[a-z][a-z0-9_-]*$")
# ipvsadm's default scheduler when -A has no -s (`ipvsadm -S` always prints one).
_DEFAULT_SCHEDULER = "wlc"


@dataclass
class _Service:
    protocol: str
    address: str
    port: int
    scheduler: str
    reals: list[IpvsRealServer] = field(default_factory=list)


# `ipvsadm -S -n` as kube-proxy's state prints it: "-A -t ADDR:PORT -s SCHED" and
# "-a -t ADDR:PORT -r ADDR:PORT -m -w N". Such a line is read without the general loop of
# _save_line when all of it is valid; anything else (and any error) goes that way.
_SAVE_SHAPE = re.compile(r"-([Aa]) -([tu]) (\S+)(?: -s ([a-z][a-z0-9_-]*)|"
                         r" -r ((\S+) -([mgi]) -w ([0-9]+)))")
_FORWARD_FLAG = {"m": "Masq", "g": "Route", "i": "Tunnel"}
_PROTOCOL_FLAG = {"t": "TCP", "u": "UDP"}


# kube-proxy's whole `ipvsadm -S -n` dump (a 10k-service node: 30k services, 100k lines)
# is read one service at a time: its -A line and the -a lines of its real servers that
# follow it, all of one regex match (the -a lines name the -A line's service as written,
# by backreference). Matches one after another from the start to the end of the text
# mean every line is in shape; anything else is read by the general loop.
# (A persistent service's "-p TIMEOUT", which the general loop passes over, is one too.)
_SAVE_SERVICE = re.compile(r"-A -([tu]) (\S+) -s ([a-z][a-z0-9_-]*)(?: -p [0-9]+)?\n"
                           r"((?:-a -\1 \2 -r \S+ -[mgi] -w [0-9]+\n)*)")
_REAL_PART = re.compile(r"(\S+) -([mgi]) -w ([0-9]+)")
# The same for `ipvsadm -Ln` (what `bundle` saves): its header lines (not --stats/--rate
# ones), then service lines, each followed by its real servers' lines, as ipvsadm
# prints them.
_LIST_HEAD = re.compile(r"(?:IP Virtual Server version [^\n]*\n)?"
                        r"(?:Prot LocalAddress:Port Scheduler Flags\n)?"
                        r"(?:  -> RemoteAddress:Port [^\n]*\n)?")
# a service line or one of its real servers' (what follows the scheduler and the weight,
# as the general loop, passed over: flags, connection counters)
_LIST_LINE = re.compile(r"^(?:(TCP|UDP|SCTP)  (\S+) ([a-z][a-z0-9_-]*)|"
                        r"  -> (\S+) +(Masq|Route|Tunnel|Local|Bypass) +([0-9]+))"
                        r"(?: [^\n]*)?\n", re.M)
# "10.0.0.5:80" as _addr_port reads it (a canonical dotted quad as it is, a port of at
# most 5 ASCII digits); one fullmatch where _addr_port costs 3x more
_V4_PORT = re.compile(rf"({ASCII_OCTET}(?:\.{ASCII_OCTET}){{3}}):([0-9]{{1,5}})")
_BY_PLACE = operator.attrgetter("address", "port")

_Servers = dict[tuple[str, str, int], tuple[str, tuple[IpvsRealServer, ...]]]


def parse_ipvsadm(text: str, source: str = "ipvsadm.txt") -> tuple[IpvsVirtualServer, ...]:
    """Parse `ipvsadm -Ln` or `ipvsadm -S -n`; a table with only its headers is empty."""
    servers = _whole_save(text) if text.startswith("-A ") else \
        _whole_listing(text) if text.startswith(("IP Virtual", "Prot ", "TCP ", "UDP ")) \
        else None
    if servers is None:
        servers = {key: (s.scheduler, tuple(sorted(s.reals, key=_BY_PLACE)))
                   for key, s in _services(text, source).items()}
    return tuple(
        IpvsVirtualServer(key[0], intern(key[1]), key[2], intern(scheduler), reals)
        for key in sorted(servers) for scheduler, reals in (servers[key],)
    )


def _whole_save(text: str) -> _Servers | None:
    """(scheduler, sorted real servers) of each service of a text made of _SAVE_SERVICE
    blocks only, each service once, every address valid (what kube-proxy's state gives),
    as the general loop of _services reads them; None for any other text, for that loop
    to read it (and name the line)."""
    text = text.rstrip("\n") + "\n"
    servers: _Servers = {}
    places: dict[str, tuple[str, int | None] | None] = {}
    reals: dict[str, IpvsRealServer] = {}
    # a node lists each endpoint set under the ClusterIP, LB IP and NodePort services of
    # a Service: their real servers, the -a lines less their service, read and sorted
    # once (what they say does not depend on the service, but where a real server has
    # no port: then it is the service's, and the block is read each time)
    blocks: dict[str, tuple[IpvsRealServer, ...]] = {}
    pos = 0
    for m in _SAVE_SERVICE.finditer(text):
        if m.start() != pos:
            return None  # a line that is not of a block (the general loop reads it)
        pos = m.end()
        prot, service, scheduler, block = m.groups()
        key = _service_key(_PROTOCOL_FLAG[prot], service, places)
        if key is None or key in servers:
            return None  # a service twice: its real servers add up (the general loop's)
        if not block:
            servers[key] = (scheduler, ())
            continue
        parts = block.replace(f"-a -{prot} {service} -r ", "")
        got = blocks.get(parts)
        if got is None:
            read = _reals(parts, key[2], reals, places)
            if read is None:
                return None
            got, shareable = read
            if shareable:  # (not when a real server without a port took the service's)
                blocks[parts] = got
        servers[key] = (scheduler, got)
    return servers if pos == len(text) else None


def _whole_listing(text: str) -> _Servers | None:
    """What _whole_save is to `ipvsadm -S -n`, for `ipvsadm -Ln`: (scheduler, sorted
    real servers) of each service of a text of _LIST_HEAD and then _LIST_LINE lines only,
    each service once, every address valid; None for any other text.

    The lines are taken apart by one findall (each match is one whole line: as many
    matches as lines means every line is in shape), and a real server is told by its
    address, method and weight, not its connection counters: a node lists each endpoint
    set under a Service's ClusterIP, LB IP and NodePort, and counters differ on a busy
    node (matching block by block and line by line cost 4x more at 10k services)."""
    text = text.rstrip("\n") + "\n"
    head = _LIST_HEAD.match(text)
    assert head is not None  # (every part of it optional: it matches any text)
    pos = head.end()
    lines = _LIST_LINE.findall(text, pos)
    if len(lines) != text.count("\n", pos):
        return None  # a line that is not of a block (the general loop reads it)
    servers: _Servers = {}
    places: dict[str, tuple[str, int | None] | None] = {}
    reals: dict[tuple[str, ...], IpvsRealServer] = {}
    # a service's real servers, sorted once per set of them (the same endpoints under
    # a Service's ClusterIP, LB IP and NodePort)
    blocks: dict[tuple[tuple[str, ...], ...], tuple[IpvsRealServer, ...]] = {}
    key: tuple[str, str, int] | None = None  # the service being read
    scheduler = ""
    block: list[tuple[str, ...]] = []  # its real servers' lines so far

    def close() -> bool:
        """The service being read, with its real servers, into ``servers``; False where
        an address is not valid."""
        if key is None:
            return True
        got = _sorted_block(block, blocks, reals, places)
        if got is not None:
            servers[key] = (scheduler, got)
        return got is not None

    for line in lines:
        if not line[0]:
            if key is None:
                return None  # a real server before any service
            block.append(line[3:])
            continue
        if not close():
            return None
        key = _service_key(line[0], line[1], places)
        if key is None or key in servers:
            return None  # (a service twice: its real servers add up, the general loop's)
        scheduler, block = line[2], []
    return servers if close() else None


def _sorted_block(block: list[tuple[str, ...]],
                  blocks: dict[tuple[tuple[str, ...], ...], tuple[IpvsRealServer, ...]],
                  reals: dict[tuple[str, ...], IpvsRealServer],
                  places: dict[str, tuple[str, int | None] | None]
                  ) -> tuple[IpvsRealServer, ...] | None:
    """The real servers of (ADDR:PORT, method, weight) listing lines, sorted (each set
    once); None where an address is not valid."""
    if not block:
        return ()
    lines = tuple(block)
    got = blocks.get(lines)
    if got is not None:
        return got
    out = []
    for line in lines:
        rs = reals.get(line)
        if rs is None:
            addr, forward, weight = line
            where = _service_key("", addr, places)  # (ADDR:PORT, as a service's)
            if where is None:
                return None
            rs = reals[line] = IpvsRealServer(intern(where[1]), where[2], forward,
                                              int(weight))
        out.append(rs)
    got = blocks[lines] = tuple(sorted(out, key=_BY_PLACE))
    return got


def _service_key(protocol: str, place: str, places: dict[str, tuple[str, int | None] | None]
                 ) -> tuple[str, str, int] | None:
    """(protocol, address, port) of "ADDR:PORT" as _addr_port reads it; None where it
    does not (or gives no port)."""
    v4 = _V4_PORT.fullmatch(place)
    if v4 is not None and int(v4[2]) <= 65535:
        return (protocol, v4[1], int(v4[2]))
    got = _place(place, places)
    if got is None or got[1] is None:
        return None
    return (protocol, got[0], got[1])


def _reals(parts: str, port: int, reals: dict[str, IpvsRealServer],
           places: dict[str, tuple[str, int | None] | None]
           ) -> tuple[tuple[IpvsRealServer, ...], bool] | None:
    """The real servers of "ADDR:PORT -m -w W\\n" lines, sorted, and whether every one
    gave its port (else the block read depends on the service's ``port``); None where an
    address is not valid."""
    out = []
    shareable = True
    for part in parts.split("\n")[:-1]:
        rs = reals.get(part)
        if rs is None:
            shape = _REAL_PART.fullmatch(part)
            assert shape is not None  # (_SAVE_SERVICE matched the line as one)
            real, forward, weight = shape.groups()
            m = _V4_PORT.fullmatch(real)
            where = (m[1], int(m[2])) if m is not None and int(m[2]) <= 65535 else \
                _place(real, places)
            if where is None:
                return None
            rs = _real_server(part, where, port, forward, weight, reals)
            shareable &= where[1] is not None
        out.append(rs)
    return tuple(sorted(out, key=_BY_PLACE)), shareable


def _real_server(part: str, where: tuple[str, int | None], port: int, forward: str,
                 weight: str, reals: dict[str, IpvsRealServer]) -> IpvsRealServer:
    """The real server of one saved `-r ADDR[:PORT] -m -w W` part, remembered by its text
    unless it has no port (then it takes the service's ``port``: not one to share)."""
    if where[1] is None:
        return IpvsRealServer(intern(where[0]), port, _FORWARD_FLAG[forward], int(weight))
    rs = reals[part] = IpvsRealServer(intern(where[0]), where[1], _FORWARD_FLAG[forward],
                                      int(weight))
    return rs


def _services(text: str, source: str) -> dict[tuple[str, str, int], _Service]:
    """Any `ipvsadm -Ln` / `ipvsadm -S -n` text, line by line."""
    services: dict[tuple[str, str, int], _Service] = {}
    current: _Service | None = None
    in_fwmark = False  # real servers of a skipped FWM service are skipped too
    stats = False  # `ipvsadm -Ln --stats/--rate`: counters where scheduler and method were
    # a node lists each endpoint under its ClusterIP, LB IP and NodePort services: one
    # address read once, one real server object shared
    places: dict[str, tuple[str, int | None] | None] = {}
    reals: dict[str, IpvsRealServer] = {}
    saved_shape = _SAVE_SHAPE.fullmatch
    # `ipvsadm -S` lists a service's real servers right after it: the last service's
    # "-t ADDR:PORT" and the service it is
    last_place: tuple[str, str] | None = None
    last: _Service | None = None
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line:
            continue
        if line[0] == "-":
            m = saved_shape(line)
            if m is not None:
                g = m.groups()
                if g[0] == "a" and g[5] is not None and last is not None \
                        and (g[1], g[2]) == last_place:
                    rs = reals.get(g[4])
                    if rs is not None:  # a real server read before, of the same service
                        last.reals.append(rs)
                        continue
                saved = _saved(g, services, places, reals)
                if saved is not None:
                    if g[0] == "A":
                        last_place = (g[1], g[2])
                        last = services[saved]
                    continue
            if line.startswith("->"):
                if line.split()[1:2] == ["RemoteAddress:Port"]:
                    continue  # the column header
                if in_fwmark:
                    continue
                if current is None:
                    raise InputError(source, lineno,
                                     "real server line before any virtual server line")
                if stats:
                    # no forwarding method in the stats listing: kube-proxy only uses Masq
                    address, port = _addr_port(line.split()[1], source, lineno)
                    current.reals.append(IpvsRealServer(address, port, "Masq", 1))
                    continue
                current.reals.append(_list_real(line, source, lineno))
                continue
            _save_line(line, services, source, lineno)
            continue
        if line.startswith("IP Virtual Server version") or line.startswith("Prot "):
            stats = stats or (line.startswith("Prot ") and ("Conns" in line or "CPS" in line))
            continue  # headers are optional: `ipvsadm -Ln | tail -n +4` is fine too
        m = _SERVICE_LINE.match(line)
        if not m:
            raise InputError(source, lineno,
                             f"not an `ipvsadm -Ln` or `ipvsadm -S -n` line: {_short(line)!r}")
        prot, addrport, scheduler = m.groups()
        if prot == "FWM":
            in_fwmark, current = True, None
            continue
        in_fwmark = False
        address, port = _addr_port(addrport, source, lineno)
        if stats:
            scheduler = "?"  # not in the stats listing
        else:
            _check_scheduler(scheduler, source, lineno)
        key = (_LIST_PROTOCOLS[prot], address, port)
        current = services.setdefault(key, _Service(*key, scheduler))
    return services


def _saved(groups: tuple[str, ...], services: dict[tuple[str, str, int], _Service],
           places: dict[str, tuple[str, int | None] | None],
           reals: dict[str, IpvsRealServer]) -> tuple[str, str, int] | None:
    """Add a `_SAVE_SHAPE` line (its groups) as _save_line would, and give its service's
    key; None (nothing done) when any part of it is not valid, for _save_line to say
    what."""
    command, prot, service, scheduler, real_part, real, forward, weight = groups
    place = _place(service, places)
    if place is None or place[1] is None:
        return None
    key = (_PROTOCOL_FLAG[prot], place[0], place[1])
    if command == "A":
        if scheduler is None:
            return None
        svc = services.get(key)
        if svc is None:
            services[key] = _Service(*key, scheduler)
        else:
            svc.scheduler = scheduler
        return key
    svc = services.get(key)
    if real is None or svc is None:
        return None
    rs = reals.get(real_part)
    if rs is None:
        where = _place(real, places)
        if where is None:
            return None
        rs = _real_server(real_part, where, key[2], forward, weight, reals)
    svc.reals.append(rs)
    return key


def _place(text: str, places: dict[str, tuple[str, int | None] | None]
           ) -> tuple[str, int | None] | None:
    """What _addr_port makes of ``text`` (a port of None: none given), None where it
    refuses it; remembered per text."""
    if text in places:
        return places[text]
    got: tuple[str, int | None] | None
    try:
        read = _addr_port(text, "", 0, default_port=-1)
    except InputError:
        got = None
    else:
        got = (read[0], None) if read[1] == -1 else read
    places[text] = got
    return got


def _list_real(line: str, source: str, lineno: int) -> IpvsRealServer:
    m = _REAL_LINE.match(line)
    if not m:
        raise InputError(source, lineno, f"bad real server line {_short(line)!r}")
    addrport, forward, weight = m.groups()
    if forward not in _FORWARD_NAMES:
        raise InputError(source, lineno, f"unknown forwarding method {_short(forward)!r}")
    address, port = _addr_port(addrport, source, lineno)
    return IpvsRealServer(address, port, forward, int(weight))


def _save_line(line: str, services: dict[tuple[str, str, int], _Service],
               source: str, lineno: int) -> None:
    tokens = line.split()
    command = tokens[0]
    if command not in ("-A", "--add-service", "-a", "--add-server"):
        raise InputError(source, lineno,
                         f"expected an `ipvsadm -S` line ('-A ...' or '-a ...'), "
                         f"got {_short(line)!r}")
    protocol: str | None = None
    service: str | None = None
    fwmark = False
    scheduler = _DEFAULT_SCHEDULER
    real: str | None = None
    forward = "Route"  # ipvsadm's default forwarding method is direct routing
    weight = 1
    i = 1
    while i < len(tokens):
        opt = tokens[i]
        arg = tokens[i + 1] if i + 1 < len(tokens) else None
        takes_arg = True
        if opt in _SAVE_PROTOCOLS:
            protocol, service = _SAVE_PROTOCOLS[opt], arg
        elif opt in _SAVE_FWMARK:
            fwmark = True
        elif opt in ("-s", "--scheduler"):
            scheduler = arg or ""
            _check_scheduler(scheduler, source, lineno)
        elif opt in ("-r", "--real-server"):
            real = arg
        elif opt in ("-w", "--weight"):
            if arg is None or not (arg.isascii() and arg.isdigit()):
                raise InputError(source, lineno, f"bad weight {arg!r}")
            weight = int(arg)
        elif opt in _SAVE_FORWARD:
            forward = _SAVE_FORWARD[opt]
            takes_arg = False
        elif opt.startswith("-"):
            # Other options (-p TIMEOUT, -M MASK, -o, --pe NAME, -b FLAGS, -x/-y, tunnel
            # settings) do not matter here. Skip a following non-option word as their value.
            takes_arg = arg is not None and not arg.startswith("-")
        else:
            raise InputError(source, lineno, f"unexpected word {_short(opt)!r}")
        if takes_arg:
            if arg is None:
                raise InputError(source, lineno, f"option {opt} needs a value")
            i += 1
        i += 1
    if fwmark:
        return
    if protocol is None or service is None:
        raise InputError(source, lineno, "no service address (-t, -u or --sctp-service)")
    address, port = _addr_port(service, source, lineno)
    key = (protocol, address, port)
    if command in ("-A", "--add-service"):
        if real is not None:
            raise InputError(source, lineno, "-A (add service) with a real server -r")
        svc = services.setdefault(key, _Service(*key, scheduler))
        svc.scheduler = scheduler
        return
    if real is None:
        raise InputError(source, lineno, "-a (add real server) without -r")
    of = services.get(key)
    if of is None:
        raise InputError(source, lineno,
                         f"real server for {protocol} {service} before that service's -A line")
    raddr, rport = _addr_port(real, source, lineno, default_port=port)
    of.reals.append(IpvsRealServer(raddr, rport, forward, weight))


def _addr_port(text: str, source: str, lineno: int,
               default_port: int | None = None) -> tuple[str, int]:
    """"10.0.0.5:80" / "[fd00::1]:80" -> (address, port), both checked."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise InputError(source, lineno, f"bad address {_short(text)!r}")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise InputError(source, lineno, f"bad address {_short(text)!r}")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, None  # a bare address (only valid for -r)
    address = canonical_ip(host)
    if address is None:
        raise InputError(source, lineno,
                         f"{_short(host)!r} is not a numeric address "
                         "(use `ipvsadm -Ln` / `ipvsadm -S -n`)")
    if port_text is None:
        if default_port is None:
            raise InputError(source, lineno, f"address {_short(text)!r} has no port")
        return address, default_port
    if not port_text.isdigit() or not port_text.isascii() or int(port_text) > 65535:
        raise InputError(source, lineno,
                         f"{_short(port_text)!r} is not a numeric port (use -n)")
    return address, int(port_text)


def _check_scheduler(name: str, source: str, lineno: int) -> None:
    if not _SCHEDULER.match(name):
        raise InputError(source, lineno, f"bad scheduler name {_short(name)!r}")


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
