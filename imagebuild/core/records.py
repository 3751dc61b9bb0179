"""``@dataclass`` for the modules every command imports, without dataclasses' start-up cost.

``dataclasses`` imports ``inspect`` (~10 ms) and writes each class's ``__init__``, ``__repr__``,
``__eq__`` and ``__hash__`` as source text that it compiles with ``exec`` (~1.5 ms a class, and
the start-up path has ~30 classes). ``--version``, ``list``, ``validate`` and ``plan --no-engine``
must start in under 100 ms (docs/cli.md, "Start-up time"), so the definition, plan and error
classes use this instead: the same spelling and the same behaviour for what this project uses
(``@dataclass`` and ``@dataclass(frozen=True)``, defaults, ``field(default=...)`` and
``field(default_factory=...)``), with generic methods made once.

The classes still work with the ``dataclasses`` functions (``replace``, ``fields``, ``asdict``,
``is_dataclass``): ``__dataclass_fields__`` is built, importing dataclasses, when first asked for.
"""

from __future__ import annotations

__all__ = ["FrozenInstanceError", "dataclass", "field", "replace"]

MISSING = object()


class FrozenInstanceError(AttributeError):
    """Assigning to a field of a frozen record."""


class Field:
    __slots__ = ("default", "default_factory")

    def __init__(self, default=MISSING, default_factory=MISSING):
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.default = default
        self.default_factory = default_factory


def field(*, default=MISSING, default_factory=MISSING) -> Field:
    return Field(default, default_factory)


def dataclass(cls=None, /, *, frozen: bool = False):
    def wrap(c):
        return _process(c, frozen)

    return wrap if cls is None else wrap(cls)


def replace(obj, /, **changes):
    """A copy of the record ``obj`` with ``changes`` (as ``dataclasses.replace``)."""
    for name in type(obj).__record_fields__:
        changes.setdefault(name, getattr(obj, name))
    return type(obj)(**changes)


def _process(cls, frozen: bool):
    annotations = cls.__dict__.get("__annotations__", {})
    names = tuple(n for n, t in annotations.items() if not str(t).startswith(("ClassVar", "typing.ClassVar")))
    defaults: dict = {}
    factories: dict = {}
    for n in names:
        v = cls.__dict__.get(n, MISSING)
        if isinstance(v, Field):
            if v.default_factory is not MISSING:
                factories[n] = v.default_factory
                delattr(cls, n)
                continue
            v = v.default
            if v is MISSING:
                delattr(cls, n)
            else:
                setattr(cls, n, v)
        if v is not MISSING:
            if isinstance(v, (list, dict, set)):
                raise ValueError(f"mutable default {type(v)} for field {n} is not allowed: use default_factory")
            defaults[n] = v
        elif defaults or factories:
            raise TypeError(f"non-default argument {n!r} follows default argument")
    fieldset = frozenset(names)
    qualname = cls.__qualname__

    def __init__(self, *args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{qualname}.__init__() takes {len(names) + 1} positional arguments but "
                            f"{len(args) + 1} were given")
        values = dict(zip(names, args, strict=False))
        for k, v in kwargs.items():
            if k not in fieldset:
                raise TypeError(f"{qualname}.__init__() got an unexpected keyword argument {k!r}")
            if k in values:
                raise TypeError(f"{qualname}.__init__() got multiple values for argument {k!r}")
            values[k] = v
        if len(values) < len(names):
            for n in names:
                if n not in values:
                    if n in defaults:
                        values[n] = defaults[n]
                    elif n in factories:
                        values[n] = factories[n]()
                    else:
                        raise TypeError(f"{qualname}.__init__() missing required argument: {n!r}")
        d = self.__dict__
        for n in names:
            d[n] = values[n]
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def __repr__(self):
        return f"{qualname}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return all(getattr(self, n) == getattr(other, n) for n in names)
        return NotImplemented

    methods = {"__init__": __init__, "__repr__": __repr__, "__eq__": __eq__}
    if frozen:
        def __setattr__(self, name, value):
            raise FrozenInstanceError(f"cannot assign to field {name!r}")

        def __delattr__(self, name):
            raise FrozenInstanceError(f"cannot delete field {name!r}")

        def __hash__(self):
            return hash(tuple(getattr(self, n) for n in names))

        methods.update(__setattr__=__setattr__, __delattr__=__delattr__, __hash__=__hash__)
    for name, fn in methods.items():
        if name in cls.__dict__:
            continue  # the class defines its own
        fn.__qualname__ = f"{qualname}.{name}"
        setattr(cls, name, fn)
    if not frozen and "__hash__" not in cls.__dict__:
        cls.__hash__ = None  # mutable and compared by value: unhashable, as with dataclasses
    cls.__record_fields__ = names
    cls.__match_args__ = names
    cls.__dataclass_fields__ = _DataclassFields(names, annotations, defaults, factories)
    return cls


class _DataclassFields:
    """``__dataclass_fields__``, made (with real ``dataclasses.Field`` objects) when first read."""

    def __init__(self, names, annotations, defaults, factories):
        self._args = (names, annotations, defaults, factories)

    def __get__(self, obj, owner):
        import dataclasses

        names, annotations, defaults, factories = self._args
        out = {}
        for n in names:
            f = dataclasses.field(default=defaults.get(n, dataclasses.MISSING),
                                  default_factory=factories.get(n, dataclasses.MISSING))
            f.name, f.type, f._field_type = n, annotations[n], dataclasses._FIELD
            out[n] = f
        type.__setattr__(owner, "__dataclass_fields__", out)
        return out
