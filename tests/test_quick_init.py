"""agent.quick_init: the replaced __init__ of a frozen dataclass does what the generated
one did (values, defaults, fresh factory values, argument errors, frozen), and a class
of any other shape is refused when it is made."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field

import pytest

from agent.diagnose.lb_ip import LbTarget
from agent.diagnose.model import Finding
from agent.quick_init import quick_init
from agent.snapshot import IpvsRealServer, IpvsVirtualServer, Service


def _twins(slots: bool) -> tuple[type, type]:
    """The same dataclass twice: with the stock __init__, and with quick_init's."""
    def make() -> type:
        @dataclass(frozen=True, slots=slots)
        class Thing:
            a: str
            b: int
            c: str | None = None
            d: tuple[str, ...] = ()
            e: dict[str, str] = field(default_factory=dict)
        return Thing
    return make(), quick_init(make())


@pytest.mark.parametrize("slots", [True, False])
def test_same_objects_as_the_generated_init(slots: bool) -> None:
    stock, quick = _twins(slots)
    assert quick.__init__ is not stock.__init__
    calls = [(("x", 1), {}), (("x", 1, "c"), {"e": {"k": "v"}}),
             ((), {"b": 2, "a": "y", "d": ("p",)}), (("x",), {"b": 3, "c": None})]
    for args, kwargs in calls:
        s, q = stock(*args, **kwargs), quick(*args, **kwargs)
        assert dataclasses.astuple(s) == dataclasses.astuple(q)
        assert repr(s).split("(", 1)[1] == repr(q).split("(", 1)[1]
        assert hash(dataclasses.replace(q, e=None)) == hash(dataclasses.replace(s, e=None))
    # a default_factory's value is made anew for each object, as the stock one does
    assert quick("x", 1).e is not quick("x", 1).e
    # the same argument errors
    for args, kwargs in [((), {}), (("x",), {}), (("x", 1, "c", (), {}, "extra"), {}),
                         (("x", 1), {"nope": 1}), (("x", 1), {"a": "again"})]:
        with pytest.raises(TypeError):
            stock(*args, **kwargs)
        with pytest.raises(TypeError):
            quick(*args, **kwargs)
    # still frozen, and replace() goes through the new __init__
    q = quick("x", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.a = "changed"  # type: ignore[misc]
    assert dataclasses.replace(q, b=5) == quick("x", 5)


def test_the_agents_classes_keep_their_fields() -> None:
    rs = IpvsRealServer("10.0.0.9", 8080)
    vs = IpvsVirtualServer("TCP", "10.0.0.5", 80, real_servers=(rs,))
    assert (vs.protocol, vs.address, vs.port, vs.scheduler, vs.real_servers) == \
        ("TCP", "10.0.0.5", 80, "rr", (rs,))
    assert Service("ns", "svc").annotations == {}
    t = LbTarget("10.0.0.5", 80, "TCP", "loadbalancer", "ns/svc", ("api",), node_port=30080)
    assert t.key == ("10.0.0.5", 80, "TCP") and t.node_port == 30080 and t.etp is None
    f = Finding("id", "info", "s")
    assert dataclasses.asdict(f) == dataclasses.asdict(dataclasses.replace(f))


def test_other_shapes_are_refused() -> None:
    @dataclass
    class NotFrozen:
        a: int

    @dataclass(frozen=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True)
    class WithInitVar:
        a: int
        b: InitVar[int] = 0

    @dataclass(frozen=True)
    class NotInInit:
        a: int
        b: int = field(default=0, init=False)

    @dataclass(frozen=True, kw_only=True)
    class KeywordOnly:
        a: int

    for cls in (NotFrozen, PostInit, WithInitVar, NotInInit, KeywordOnly, int):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)
