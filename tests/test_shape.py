"""A rule's shape (agent.netfilter.shape): the fast reading of a rule's words must give
what the one regex over the whole text gives, for every rule of the corpus and for strings
made to hit its edges (a quote after a word, a hash before a dash, brace sets), and a
shape's name must stay what verdicts already stored call it."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from agent.netfilter import shape
from agent.netfilter.shape import _SET, _VARYING, chain_shape, rule_shape, shape_id

DATA = Path(__file__).resolve().parent / "data"


def _by_the_regex(text: str) -> str:
    return _VARYING.sub("*", _SET.sub("{*}", text) if "{" in text else text)


def _corpus_lines() -> list[str]:
    lines = []
    for f in sorted(DATA.rglob("*")):
        if f.is_file() and f.suffix in (".txt", ".nft", "") and f.stat().st_size < 4_000_000:
            try:
                text = f.read_text()
            except UnicodeDecodeError:
                continue
            lines += [line.strip() for line in text.splitlines() if line.strip()]
    return lines


def test_the_corpus_rules_shape_as_the_regex_says() -> None:
    lines = _corpus_lines()
    assert len(lines) > 5_000  # (the corpus is there)
    shape._cache.clear()
    wrong = [(t, rule_shape(t), _by_the_regex(t)) for t in lines
             if rule_shape(t) != _by_the_regex(t)]
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("seed", range(4))
def test_strings_made_to_hit_the_edges_shape_as_the_regex_says(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = 'aZ09/:" []{}(),;-_.\\\tABCDEFGHIJKLMNOP\n'
    texts = ['a"b c"12', '"x" ABCDEFGHIJKLMNOP-12', 'x "ABCDEFGHIJKLMNOP" 1',
             'tcp:80 "q q"x1', ' "a"', '"a b" c', 'x"a b"', '"a" "b"', '"a"', '""', '',
             "  double  blanks 10.0.0.1/32  "]
    # (words of the alphabet, and now and then a 16-character hash, with a digit or none)
    words = [*alphabet, "ABCDEFGHIJKLMNOP", "ABCDEFGH2JKLMNOP", "KUBE-SEP-", "x y"]
    texts += ["".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
              for _ in range(10_000)]
    shape._cache.clear()
    wrong = [(t, rule_shape(t), _by_the_regex(t)) for t in texts
             if rule_shape(t) != _by_the_regex(t)]
    assert not wrong, wrong[:3]


def test_kube_proxys_rules_of_two_services_have_one_shape() -> None:
    # kube-proxy's hashes are base32 (A-Z, 2-7): one in 28 holds no digit, and its chain
    # takes the shape of the others (it took one of its own: "-A KUBE-SEP-* ...")
    a = ('-A KUBE-SEP-ABCDEFGHIJKLMNOP -p tcp -m comment --comment "ns/web:http" -m tcp '
         "-j DNAT --to-destination 10.1.2.3:8080")
    b = ('-A KUBE-SEP-QRSTUVWXYZ234567 -p tcp -m comment --comment "other/api:http" -m tcp '
         "-j DNAT --to-destination 10.9.8.7:9090")
    assert rule_shape(a) == rule_shape(b) == \
        "-A * -p tcp -m comment --comment * -m tcp -j DNAT --to-destination *"
    assert rule_shape(a.replace("DNAT", "REDIRECT")) != rule_shape(b)
    # what kube-proxy's shared chains are named tells paths apart: kept
    for one, other in (("KUBE-MARK-MASQ", "KUBE-MARK-DROP"), ("KUBE-SERVICES", "KUBE-NODEPORTS"),
                       ("KUBE-POSTROUTING", "KUBE-FORWARD"), ("mark-for-masquerade", "services")):
        assert rule_shape(f"-A X -j {one}") != rule_shape(f"-A X -j {other}")
    assert rule_shape("-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-EXT-ABCDEFGHIJKLMNOP") == \
        rule_shape("-A KUBE-SERVICES -d 10.0.0.2/32 -j KUBE-EXT-ABCDEFGHIJKLMN2P") == \
        "-A KUBE-SERVICES -d * -j *"
    assert chain_shape("KUBE-SVC-ABCDEFGHIJKLMNOP") == chain_shape("KUBE-SVC-X") == "KUBE-SVC-*"
    assert chain_shape("PREROUTING") == "PREROUTING"


def test_words_and_chains_remembered_stay_few() -> None:
    for n in range(20_000):
        rule_shape(f"-A KUBE-SEP-{n:016d} -s 10.{n >> 16}.{(n >> 8) & 255}.{n & 255}/32 "
                   f"--dport {n} -j X")
        chain_shape(f"KUBE-SEP-{n:016d}")
    for cache in (shape._word_shape, chain_shape):
        info = cache.cache_info()
        assert info.maxsize is not None and info.currsize <= info.maxsize <= 4096


@pytest.mark.parametrize("parts", [(), ("",), ("a", "b"), ("walk", "nat PREROUTING: -A *", "")])
def test_a_shapes_name_is_what_stored_verdicts_call_it(parts: tuple[str, ...]) -> None:
    h = hashlib.blake2b(digest_size=6)  # (the name as it was first made: part, newline)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    assert shape_id(parts) == shape_id(iter(parts)) == h.hexdigest()
