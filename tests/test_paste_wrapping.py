"""The real pastes of tests/data/realworld/ as they travel to a ticket: saved by Windows
tools (a UTF-8 byte order mark, PowerShell 5's UTF-16 with CRLF), put in a Markdown code
block (with or without prose around it), quoted in a reply (once or twice), indented as
an e-mail or Markdown code block, copied from a web page (non-breaking spaces in the
aligned columns) or kept in a terminal log (colour codes). Each wrapping is constructed
(labelled here): the pastes inside are verbatim. Read through the real file reader, every
wrapped case must get the verdict of the unwrapped one (status, mode, finding ids, LB
IPs).

What is not covered, on purpose: tabs for indentation inside YAML (YAML refuses them
and kubectl never writes them), and a wrapping of only some of a file's lines.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.bundle import load_bundle
from agent.bundle.markup import without_markup
from agent.diagnose import diagnose
from agent.errors import InputError
from agent.parse.text_file import decode_text

CORPUS = Path(__file__).parent / "data" / "realworld"
CASES = sorted(p.parent for p in CORPUS.glob("*/case.json"))


def _ends(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def _quoted(text: str, mark: str) -> str:
    # GitHub's quote of a reply: "> " before each line, ">" alone on an empty one
    return "".join(mark.rstrip() + "\n" if line == "\n" else mark + line
                   for line in text.splitlines(True))


WRAPPINGS: dict[str, Callable[[str], bytes]] = {
    "utf8-bom": lambda t: b"\xef\xbb\xbf" + t.encode(),
    "utf16-powershell": lambda t: t.replace("\n", "\r\n").encode("utf-16"),  # BOM + LE
    "crlf": lambda t: t.replace("\n", "\r\n").encode(),
    "markdown-fence": lambda t: ("```console\n" + _ends(t) + "```\n").encode(),
    "markdown-issue": lambda t: ("### What happened?\n\nThe node shows this:\n\n```\n"
                                 + _ends(t) + "```\n\nAny idea? Thanks!\n").encode(),
    "quoted-reply": lambda t: _quoted(_ends(t), "> ").encode(),
    "quoted-twice": lambda t: _quoted(_quoted(_ends(t), "> "), "> ").encode(),
    "indented-block": lambda t: "".join(
        "    " + line if line.strip() else line for line in t.splitlines(True)).encode(),
    "web-nbsp": lambda t: t.replace("  ", "\u00a0 ").encode(),
    # `... | grep --color=always KUBE` kept in a terminal log, with its title escape
    "terminal-colours": lambda t: ("\x1b]0;root@node: ~\x07" + t.replace(
        "KUBE", "\x1b[01;31m\x1b[KKUBE\x1b[m\x1b[K")).encode(),
}


def _verdict(d: Path) -> tuple[object, ...]:
    v = diagnose(load_bundle(d), "node").to_dict("all")
    return (v["status"], v["kube_proxy_mode"], sorted({f["id"] for f in v["findings"]}),
            sorted(r["ip"] for r in v["lb_ips"]))


def _written(case: Path, into: Path, wrap: Callable[[str], bytes] | None) -> Path:
    into.mkdir(parents=True)
    for f in case.iterdir():
        if f.name != "case.json":
            text = f.read_text()
            (into / f.name).write_bytes(wrap(text) if wrap else text.encode())
    return into


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], tuple[object, ...]]:
    """The verdict of each case as it is, read once for all its wrappings."""
    tmp = tmp_path_factory.mktemp("plain")

    @functools.cache
    def verdict(case: Path) -> tuple[object, ...]:
        return _verdict(_written(case, tmp / case.name, None))
    return verdict


@pytest.mark.parametrize("wrapping", sorted(WRAPPINGS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_wrapped_paste_gets_the_verdict_of_the_paste(
        case: Path, wrapping: str, plain: Callable[[Path], tuple[object, ...]],
        tmp_path: Path) -> None:
    want = plain(case)
    got = _verdict(_written(case, tmp_path / "wrapped", WRAPPINGS[wrapping]))
    assert got == want, f"{case.name} {wrapping}"


def _curly(text: str) -> bytes:
    # a word processor's or a notes app's "smart" quotes, opening and closing
    return re.sub(r'"([^"\n]*)"', "\u201c\\1\u201d", text).encode()


RULE_DUMPS = [c for c in CASES
              if {"iptables-save", "iptables -S"} & set(json.loads(
                  (c / "case.json").read_text())["formats"])]


@pytest.mark.parametrize("case", RULE_DUMPS, ids=[c.name for c in RULE_DUMPS])
def test_rules_with_a_word_processors_quotes_read_as_written(
        case: Path, plain: Callable[[Path], tuple[object, ...]], tmp_path: Path) -> None:
    """(Only rule dumps: in YAML such quotes are data, and a double-quoted value holding
    them would not parse if they were straightened.)"""
    got = _verdict(_written(case, tmp_path / "curly", _curly))
    assert got == plain(case), case.name


def test_the_corpus_holds_every_format_the_wrappings_must_survive() -> None:
    # (the test above proves little on a corpus of one format)
    formats = "\n".join(f for c in CASES
                        for f in json.loads((c / "case.json").read_text())["formats"])
    assert len(RULE_DUMPS) >= 10
    for needed in ("iptables-save", "iptables -L -n -v", "ipvsadm -Ln", "ipset list",
                   "ip addr", "kubectl get svc text", "nft -f script", "nft list table",
                   "kubectl yaml"):
        assert needed in formats, needed


def test_line_numbers_stay_those_of_the_paste(tmp_path: Path) -> None:
    """A problem in a quoted, indented or fenced paste names the line the user sees."""
    text = "*nat\n:KUBE-SERVICES - [0:0]\n:BROKEN\n-A KUBE-SERVICES -j RETURN\nCOMMIT\n"
    for name, wrap in WRAPPINGS.items():
        d = tmp_path / name
        d.mkdir()
        (d / "iptables-save.txt").write_bytes(wrap(text))
        v = diagnose(load_bundle(d), "node").to_dict("all")
        # the bad line is the third of the dump; "markdown-*" put lines before it
        before = {"markdown-fence": 1, "markdown-issue": 5}.get(name, 0)
        said = [u["reason"] for u in v["unknowns"] if "BROKEN" in u["reason"]]
        assert said == [f"iptables-save.txt:{3 + before}: bad chain declaration "
                        "':BROKEN'"], (name, said)


def test_only_a_wrapping_of_every_line_is_taken_off() -> None:
    # a heredoc's continuation prompts ("> ") on some lines, an indented excerpt of `ip
    # addr` under its unindented interface line: left as they are
    heredoc = "$ cat <<EOF\n> a\n> b\nEOF\n"
    assert without_markup(heredoc) == heredoc
    addr = "4: kube-ipvs0: <BROADCAST,NOARP> mtu 1500\n    inet 10.0.0.1/32 scope global\n"
    assert without_markup(addr) == addr
    # tabs and spaces are not one indent: nothing is shared
    mixed = "\tNAME  TYPE\n    svc  LoadBalancer\n"
    assert without_markup(mixed) == mixed
    # blank lines keep their place; a shared indent goes, a deeper one stays
    assert without_markup("  a\n\n    b\n  c\n") == "a\n\n  b\nc\n"
    # quoted twice ("> > " and ">>"), blank quoted lines, unquoted blank lines
    assert without_markup("> > a\n>>\n\n> > b\n") == "a\n\n\nb\n"


def test_a_big_dump_without_markup_is_the_same_object() -> None:
    # (the 18 MB dump of a 10k-service node must not be copied for nothing, nor walked
    # character by character for holding one non-ASCII letter)
    text = "*nat\n" + "-A KUBE-SERVICES -j RETURN\n" * 1000 + "COMMIT\n"
    assert without_markup(text) is text
    accented = text.replace("RETURN\n", '-m comment --comment "caf\u00e9" -j RETURN\n', 1)
    assert without_markup(accented) is accented


def test_blank_first_lines_do_not_hide_a_quote_or_an_indent() -> None:
    assert without_markup("   \n> a\n>\n> b\n") == "   \na\n\nb\n"
    assert without_markup("\n\n  x\n    y\n") == "\n\nx\n  y\n"


@pytest.mark.parametrize(("data", "said"), [
    (b"\xef\xbb\xbfab\n\x80\n", "f:2: not UTF-8 text (byte 0x80 at column 1)"),
    ("ab\ncd".encode("utf-16") + b"\x00\xd8A\x00", "f:2: not UTF-16 text (a lone surrogate"),
    ("ab\r\ncd".encode("utf-16") + b"x", "f:2: not UTF-16 text"),  # a cut unit
])
def test_bad_text_is_named_by_line_in_either_encoding(data: bytes, said: str) -> None:
    with pytest.raises(InputError) as e:
        decode_text(data, "f")
    assert str(e.value).startswith(said), str(e.value)


def test_utf16_big_endian_and_a_bom_alone() -> None:
    assert decode_text("*nat\r\nCOMMIT\r\n".encode("utf-16-be").join((b"\xfe\xff", b"")),
                       "f") == "*nat\nCOMMIT\n"
    assert decode_text(b"\xef\xbb\xbf", "f") == ""
