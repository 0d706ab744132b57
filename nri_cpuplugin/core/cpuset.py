"""An immutable set of CPU ids and the Linux cpulist format ("0-3,8,10-11").

The text form is what the kernel prints in sysfs and cgroupfs and what kubelet, CRI-O and runc
exchange: ascending, maximal runs merged into ``a-b``, comma separated, no spaces; the empty set
is the empty string.  Parsing is as strict as kubelet's ``cpuset.Parse`` (so that whatever we
accept, kubelet and the runtimes accept too) except that surrounding whitespace, such as the
trailing newline of a sysfs file, is tolerated.
"""

from __future__ import annotations

TYPE_CHECKING = False  # collections.abc is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

# Far above any real NR_CPUS (8192 today); stops "0-999999999" from allocating gigabytes.
MAX_CPU_ID = 1 << 16


class CPUSet(frozenset[int]):
    """A frozenset of non-negative CPU ids that prints itself in cpulist format."""

    # The text form, made on first use: one set is printed many times over (every sibling's
    # write, the answer, the audit records), and sets never change.
    __slots__ = ("_text",)
    _text: str

    def __new__(cls, cpus: Iterable[int] = ()) -> CPUSet:
        self = super().__new__(cls, cpus)
        for cpu in self:
            if type(cpu) is not int or not 0 <= cpu <= MAX_CPU_ID:
                raise ValueError(f"invalid CPU id {cpu!r}: expected an integer 0..{MAX_CPU_ID}")
        return self

    @classmethod
    def _trusted(cls, cpus: frozenset[int]) -> CPUSet:
        """Wrap the result of an operation on valid sets without checking it again."""
        return frozenset.__new__(cls, cpus)

    @classmethod
    def parse(cls, text: str) -> CPUSet:
        """Parse cpulist text; raise ValueError quoting the input when it is malformed."""
        stripped = text.strip()
        if not stripped:
            return cls()
        cpus: set[int] = set()
        for element in stripped.split(","):
            # One element is "N" or "A-B" (no sign, no spaces).  Not a regular expression: the
            # hook would import re for this alone.
            start, dash, end = element.partition("-")
            if not _digits(start) or (dash and not _digits(end)):
                raise ValueError(
                    f"invalid cpulist {text!r}: element {element!r} is not N or A-B "
                    "(expected e.g. '0-3,8')"
                )
            first = _cpu_id(start, text)
            last = _cpu_id(end, text) if dash else first
            if first > last:
                raise ValueError(f"invalid cpulist {text!r}: range {element!r} is reversed")
            cpus.update(range(first, last + 1))
        return cls(cpus)

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Maximal runs of consecutive ids, ascending, as inclusive (first, last) pairs."""
        run_start = run_end = -2  # no run yet: no id follows it
        for cpu in sorted(self):
            if cpu == run_end + 1:
                run_end = cpu
                continue
            if run_start >= 0:
                yield run_start, run_end
            run_start = run_end = cpu
        if run_start >= 0:
            yield run_start, run_end

    def __str__(self) -> str:
        try:
            return self._text
        except AttributeError:
            self._text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in self.ranges())
            return self._text

    def __repr__(self) -> str:
        return f"CPUSet({str(self)!r})"

    def sorted(self) -> list[int]:
        return sorted(self)

    # frozenset's operators return plain frozensets; keep the type so results print as cpulists.
    # (They take any iterable of ids where frozenset's take sets of anything: typeshed's
    # signatures for frozenset cannot be narrowed to ints, hence the ignored overrides.)
    def __or__(self, other: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.__or__(self, _valid(other)))

    def __and__(self, other: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.__and__(self, _plain(other)))

    def __sub__(self, other: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.__sub__(self, _plain(other)))

    def __xor__(self, other: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.__xor__(self, _valid(other)))

    __ror__ = __or__
    __rand__ = __and__

    def union(self, *others: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.union(self, *map(_valid, others)))

    def intersection(self, *others: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.intersection(self, *others))

    def difference(self, *others: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.difference(self, *others))

    def symmetric_difference(self, other: Iterable[int]) -> CPUSet:  # type: ignore[override]
        return CPUSet._trusted(frozenset.symmetric_difference(self, _valid(other)))

    __rxor__ = __xor__

    def copy(self) -> CPUSet:
        return self  # immutable, as frozenset.copy() returns self


def _valid(cpus: Iterable[int]) -> frozenset[int]:
    """What joins a CPUSet must be valid CPU ids too; other CPUSets already are."""
    return cpus if isinstance(cpus, CPUSet) else CPUSet(cpus)


def _plain(cpus: Iterable[int]) -> frozenset[int] | set[int]:
    """Intersection and difference only remove ids, so any set-like operand will do."""
    return cpus if isinstance(cpus, (set, frozenset)) else frozenset(cpus)


def _digits(text: str) -> bool:
    """ASCII decimal digits only: str.isdigit() alone also takes other Unicode digits ("٣",
    "²"), which int() may accept but kubelet, runc and the kernel reject."""
    return text.isascii() and text.isdigit()


def _cpu_id(digits: str, text: str) -> int:
    """One id of a cpulist element, bounded before int() so that a 5000-digit number gets our
    error quoting the input rather than int()'s "Exceeds the limit (4300 digits)"."""
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(MAX_CPU_ID)) or int(significant) > MAX_CPU_ID:
        shown = significant if len(significant) <= 20 else f"{significant[:20]}..."
        raise ValueError(f"invalid cpulist {text!r}: CPU id {shown} exceeds {MAX_CPU_ID}")
    return int(significant)


# The empty set, for defaults (a CPUSet is immutable, so one instance serves everyone).
EMPTY = CPUSet()
