"""Value (nri_cpuplugin/value.py): the frozen-dataclass behaviour the value types rely on."""

from __future__ import annotations

from functools import cached_property

import pytest

from nri_cpuplugin.base.value import Value


class Point(Value):
    x: int
    y: int = 0


class Labelled(Point):
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "label", self.label.strip())

    @cached_property
    def norm(self) -> int:
        return abs(self.x) + abs(self.y)


def test_fields_positional_keyword_and_defaults():
    assert Point(1) == Point(x=1, y=0) == Point(1, y=0)
    assert Labelled._fields == ("x", "y", "label")
    assert Labelled(1, 2, " a ").label == "a"  # __post_init__ ran
    assert repr(Labelled(1, label="b")) == "Labelled(x=1, y=0, label='b')"


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((), {}, "missing x"),
        ((1, 2, 3), {}, "at most 2 positional"),
        ((1,), {"z": 2}, "no field z"),
        ((1,), {"x": 2}, "x twice"),
    ],
)
def test_bad_construction_says_what_is_wrong(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        Point(*args, **kwargs)


def test_immutable_evolve_equality_and_hash():
    p = Labelled(1, 2, "a")
    with pytest.raises(AttributeError, match="immutable"):
        p.x = 3
    with pytest.raises(AttributeError, match="immutable"):
        del p.x
    q = p.evolve(y=5, label=" b ")
    assert (p.y, q.y, q.label) == (2, 5, "b")  # evolve builds anew: __post_init__ again
    assert p.norm == 3 and q.norm == 6  # cached per instance, never copied by evolve
    assert p == Labelled(1, 2, "a") and hash(p) == hash(Labelled(1, 2, "a"))
    assert p != q and Point(1, 2) != Labelled(1, 2)  # other type: never equal
    assert len({p, Labelled(1, 2, "a"), q}) == 2
    with pytest.raises(TypeError, match="no field z"):
        p.evolve(z=1)
