"""A faster ``__init__`` for the frozen dataclasses a big node makes by the ten thousand.

A frozen dataclass's generated ``__init__`` sets each field through
``object.__setattr__`` (it must get past the class's own ``__setattr__``, which refuses):
a global lookup, an attribute lookup and a call per field, 1.2 us for eight fields. A
10k-service IPVS node makes 200k such objects (virtual servers, routes, addresses, LB
targets, findings): a tenth of `check --from`. The same stores through the slots'
descriptors (or the instance's ``__dict__``) take half that. The class stays what
``@dataclass`` made (fields, eq, hash, repr, frozen); only ``__init__`` is replaced, and
only for the plain shape below, which is checked when the class is made.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_NO_ARG: Any = object()  # a default_factory field's parameter when it was not passed


def quick_init(cls: type[T]) -> type[T]:
    """Replace ``cls.__init__`` (a frozen dataclass: positional-or-keyword fields with or
    without defaults; no __post_init__, InitVar, init=False or kw_only) by one that sets
    the same fields the same way, faster. Anything else is refused (TypeError), not
    handled differently."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init:
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen dataclass with __init__")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init: {cls.__name__} has __post_init__")
    fields = dataclasses.fields(cls)
    # the generated __init__ takes exactly the fields, in order, none keyword-only (an
    # InitVar, init=False or kw_only field would make it differ)
    wanted = [f.name for f in fields]
    given = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if [p.name for p in given] != wanted or any(
            p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in given):
        raise TypeError(f"quick_init: {cls.__name__}'s __init__ is not one parameter per "
                        "field (InitVar, init=False or kw_only)")
    if any(name.startswith("_qi_") or name == "self" for name in wanted):  # ours below
        raise TypeError(f"quick_init: {cls.__name__} has a field named self or _qi_...")
    slots = "__slots__" in cls.__dict__
    ns: dict[str, Any] = {"_qi_no_arg": _NO_ARG}
    args, body = [], []
    for f in fields:
        name = f.name
        if f.default is not dataclasses.MISSING:
            ns[f"_qi_d_{name}"] = f.default
            args.append(f"{name}=_qi_d_{name}")
        elif f.default_factory is not dataclasses.MISSING:
            ns[f"_qi_f_{name}"] = f.default_factory
            args.append(f"{name}=_qi_no_arg")
            body.append(f" if {name} is _qi_no_arg: {name} = _qi_f_{name}()")
        else:
            args.append(name)
        if slots:
            # the slot's descriptor, in the class that declared the field
            owner = next(c for c in cls.__mro__ if name in c.__dict__)
            ns[f"_qi_s_{name}"] = owner.__dict__[name].__set__
            body.append(f" _qi_s_{name}(self, {name})")
        else:
            body.append(f" _qi_dict[{name!r}] = {name}")
    if not slots:
        body.insert(0, " _qi_dict = self.__dict__")
    src = f"def __init__(self, {', '.join(args)}):\n" + "\n".join(body or [" pass"]) + "\n"
    exec(src, ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]  # (replacing it is the point)
    return cls
