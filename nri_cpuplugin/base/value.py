"""Immutable value classes declared by annotated fields, as frozen dataclasses are, but cheap to
define.

Why not ``dataclasses``: it writes each class's methods as source text and compiles it when
the class is defined - about 1 ms per class here, plus ~10 ms to import ``dataclasses`` and
``inspect``.  The OCI hook is a new process per container start and defines ~20 such classes,
which cost more than everything else it does (docs/benchmarks.md, "OCI hook").  ``Value``
gives the same behaviour from one set of generic methods (the NRI transport, ``nri/``, which
the hook never loads, keeps its dataclasses):

    class Released(Value):
        cpus: CPUSet
        kind: str = "app"

- the constructor takes the fields positionally or by name, in declaration order (a subclass's
  fields after its bases'), and class attributes are the defaults (so they must be immutable);
- instances cannot be changed; ``evolve(**changes)`` returns a changed copy;
- equality and hashing compare the type and every field; ``repr`` shows them;
- ``__post_init__``, when a class defines it, runs after the fields are set (to check or
  normalise them, with ``object.__setattr__``);
- ``cached_property`` (below) caches a derived value per instance, as
  ``functools.cached_property`` does (which works too: instances have a ``__dict__``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, ClassVar, Self, dataclass_transform
else:

    def dataclass_transform(**_: object) -> Callable[[type], type]:
        """typing's marker, for type checkers only: they then read a ``Value``'s constructor
        from its fields, as a frozen dataclass's."""
        return lambda cls: cls


@dataclass_transform(frozen_default=True)
class Value:
    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}
    _names: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # (Not inspect.get_annotations: importing inspect is half of what this module saves.)
        # Strings in the class namespace with ``from __future__ import annotations``, as in
        # every module here; Python >= 3.14 without it computes them on first access.
        annotations = cls.__dict__.get("__annotations__")  # noqa: RUF063
        if annotations is None:
            annotations = cls.__annotations__ if "__annotate__" in cls.__dict__ else {}
        own = [
            name
            for name, annotation in annotations.items()
            if not str(annotation).startswith(("ClassVar", "typing.ClassVar"))
        ]
        cls._fields = (*cls._fields, *(name for name in own if name not in cls._fields))
        cls._defaults = {**cls._defaults, **{n: cls.__dict__[n] for n in own if n in cls.__dict__}}
        cls._names = frozenset(cls._fields)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = self._fields
        if len(args) > len(fields):
            raise TypeError(
                f"{type(self).__name__}() takes at most {len(fields)} positional arguments "
                f"({len(args)} given)"
            )
        values = dict(self._defaults)
        values.update(zip(fields, args, strict=False))  # fewer args: defaults
        if kwargs:
            unknown = kwargs.keys() - self._names
            if unknown:
                names = ", ".join(sorted(unknown))
                raise TypeError(f"{type(self).__name__}() has no field {names}")
            twice = kwargs.keys() & set(fields[: len(args)])
            if twice:
                raise TypeError(f"{type(self).__name__}() got {', '.join(sorted(twice))} twice")
            values.update(kwargs)
        if len(values) != len(fields):
            missing = [name for name in fields if name not in values]
            raise TypeError(f"{type(self).__name__}() is missing {', '.join(missing)}")
        self.__dict__.update(values)
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def evolve(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (checked and normalised as a new instance)."""
        values = {name: self.__dict__[name] for name in self._fields}
        values.update(changes)
        return type(self)(**values)

    def _values(self) -> tuple[Any, ...]:
        d = self.__dict__
        return tuple([d[name] for name in self._fields])

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self is other or self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __repr__(self) -> str:
        d = self.__dict__
        fields = ", ".join(f"{name}={d[name]!r}" for name in self._fields)
        return f"{type(self).__name__}({fields})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable (use evolve(); {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable ({name!r})")


class CachedProperty:
    """``functools.cached_property`` without importing functools, which loads collections: the
    OCI hook's start-up (tests/system/test_hook_imports.py).  The value computed on first
    access is stored in the instance's ``__dict__`` under the same name, where later lookups
    find it first (this is a non-data descriptor), so it costs nothing after that."""

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = self.func(instance)
        instance.__dict__[self.name] = value
        return value


if TYPE_CHECKING:
    # Type checkers know functools' by name: the value has the decorated function's type.
    from functools import cached_property
else:
    cached_property = CachedProperty  # (lower case: it stands in for functools.cached_property)
