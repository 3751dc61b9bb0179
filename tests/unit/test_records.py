"""imagebuild.records behaves as dataclasses does for what the project uses (side by side)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from imagebuild.core import records


def _pair(frozen: bool):
    out = []
    for deco, fld in ((dataclasses.dataclass, dataclasses.field), (records.dataclass, records.field)):
        @deco(frozen=frozen)
        class Rec:
            name: str
            line: int | None = None
            tags: tuple = fld(default=())
            extra: dict = fld(default_factory=dict)

            @property
            def shown(self) -> str:
                return f"{self.name}:{self.line}"
        out.append(Rec)
    return out


@pytest.mark.parametrize("frozen", [True, False])
def test_same_behaviour_as_dataclasses(frozen):
    for Rec in _pair(frozen):
        a = Rec("x")
        assert (a.name, a.line, a.tags, a.extra, a.shown) == ("x", None, (), {}, "x:None")
        assert Rec("x", 1) == Rec(name="x", line=1) and Rec("x", 1) != Rec("x", 2)
        assert Rec("x") != ("x", None, (), {})
        assert repr(Rec("x", 1)).endswith("Rec(name='x', line=1, tags=(), extra={})")
        assert Rec("x").extra is not Rec("x").extra  # a fresh default per instance
        for bad in (lambda R=Rec: R(), lambda R=Rec: R("x", nope=1), lambda R=Rec: R("x", name="y"),
                    lambda R=Rec: R("a", 1, (), {}, 5)):
            with pytest.raises(TypeError):
                bad()
        if frozen:
            with pytest.raises(TypeError):  # the dict field makes it unhashable, in both
                hash(Rec("x", 1))
            with pytest.raises(AttributeError):
                a.name = "y"
            with pytest.raises(AttributeError):
                del a.name
        else:
            assert Rec.__hash__ is None
            a.line = 7
            assert a.line == 7
        b = dataclasses.replace(Rec("x", 1), line=2)
        assert (b.name, b.line) == ("x", 2)
        assert dataclasses.is_dataclass(a) and [f.name for f in dataclasses.fields(a)] == \
            ["name", "line", "tags", "extra"]
        assert dataclasses.asdict(Rec("x", 1)) == {"name": "x", "line": 1, "tags": (), "extra": {}}


@records.dataclass(frozen=True)
class Point:
    x: int
    y: int = 0


@dataclasses.dataclass(frozen=True)
class DPoint:
    x: int
    y: int = 0


def test_hash_replace_and_pickle():
    a = Point(1, 2)
    assert hash(a) == hash(Point(1, 2)) and {a, Point(1, 2)} == {a}
    assert hash(a) == hash(DPoint(1, 2))  # the same hash as dataclasses gives: the fields' tuple
    assert records.replace(a, y=3) == Point(1, 3)
    assert pickle.loads(pickle.dumps(a)) == a


def test_definition_errors_like_dataclasses():
    with pytest.raises(ValueError):
        @records.dataclass
        class Bad:
            items: list = []  # noqa: RUF012

    with pytest.raises(TypeError):
        @records.dataclass
        class Order:
            a: int = 1
            b: int


def test_class_defined_methods_are_kept():
    @records.dataclass(frozen=True)
    class Own:
        x: int

        def __repr__(self) -> str:
            return "own"

    assert repr(Own(1)) == "own" and Own(1) == Own(1)


def test_pickle_module_level_record():
    from imagebuild.core.errors import Problem

    p = Problem("f", "m", line=3)
    assert pickle.loads(pickle.dumps(p)) == p and p.location() == "f:3"
