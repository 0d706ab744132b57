"""CPUSet and the Linux cpulist format: kernel/kubelet examples, rejections, properties.

Contract (docs/cgroups-and-hooks.md §16): accept what kubelet's ``cpuset.Parse``
accepts after ``strings.TrimSpace`` (as CRI-O does), print exactly what kubelet's ``String()`` and
the kernel's ``%*pbl`` print.
"""

from __future__ import annotations

import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nri_cpuplugin.core.cpuset import MAX_CPU_ID, CPUSet

# input -> canonical output
EXAMPLES = [
    ("", ""),
    ("\n", ""),  # what sysfs shows for an empty list (e.g. cpu/isolated without isolcpus=)
    ("  \t\n", ""),
    ("0", "0"),
    ("0-3", "0-3"),
    ("0-3,8-11", "0-3,8-11"),
    ("0-3\n", "0-3"),  # a sysfs file read as is
    (" 0-3,8-11 \n", "0-3,8-11"),
    ("3-6,1-5", "1-6"),  # overlapping ranges: kubelet accepts them
    ("3-3", "3"),
    ("5,4,3", "3-5"),  # unsorted
    ("0,1,2,3,5", "0-3,5"),  # runs are merged
    ("4-31,32-63", "4-63"),  # cpu/offline's unmerged adjacent ranges
    ("1,1,1", "1"),
    ("007", "7"),  # leading zeros: strconv.Atoi accepts them too
    (f"{MAX_CPU_ID}", f"{MAX_CPU_ID}"),
    ("0-2,4,6-7,9", "0-2,4,6-7,9"),
]


@pytest.mark.parametrize(("text", "canonical"), EXAMPLES)
def test_examples(text: str, canonical: str) -> None:
    cpus = CPUSet.parse(text)
    assert str(cpus) == canonical
    assert CPUSet.parse(canonical) == cpus
    assert isinstance(cpus, CPUSet)


REJECTED = [
    "0,",  # empty elements (kubelet: "strconv.Atoi: parsing \"\"")
    ",3",
    "0,,3",
    ",",
    "3-1",  # reversed range
    "-1",  # negative / leading '-'
    "1-",
    "1--3",
    "1-2-3",
    "a",
    "0x3",
    "1.5",
    "0-3, 5",  # inner space: kubelet rejects it; we strip only the surrounding whitespace
    "0 - 3",
    "0-3\n5",  # an inner newline is inner whitespace too
    "+3",  # Go's strconv.Atoi accepts "+3", so kubelet does; we reject it (we never print a
    #  sign, and nothing that prints cpulists does), keeping the accepted language minimal.
    "1-+3",
    "\u0663",  # ARABIC-INDIC DIGIT THREE: a Unicode digit that int() accepts, Atoi does not
    "0-\uff13",  # FULLWIDTH DIGIT THREE
    f"{MAX_CPU_ID + 1}",  # beyond any real NR_CPUS
    f"0-{MAX_CPU_ID + 1}",
    "0-99999999999",
    "9" * 5000,  # beyond int()'s 4300-digit limit: still our error, quoting the input
    f"{MAX_CPU_ID + 1}-3",
    "all",  # kernel command-line extensions are not cpulists
    "0-N",
    "0-7:2/4",
]


@pytest.mark.parametrize("text", REJECTED)
def test_rejections_quote_the_input(text: str) -> None:
    with pytest.raises(ValueError) as err:
        CPUSet.parse(text)
    assert repr(text) in str(err.value)


@pytest.mark.parametrize("cpus", [[-1], [MAX_CPU_ID + 1], [True], [1.0], ["3"], [None], "0-3"])
def test_constructor_rejects_non_cpu_ids(cpus) -> None:
    with pytest.raises(ValueError, match="invalid CPU id"):
        CPUSet(cpus)


def test_empty_and_repr() -> None:
    assert str(CPUSet()) == ""
    assert not CPUSet.parse("\n")
    assert repr(CPUSet([0, 1, 2, 5])) == "CPUSet('0-2,5')"
    assert CPUSet([3, 1, 2]).sorted() == [1, 2, 3]
    assert list(CPUSet.parse("0-2,5,7-8").ranges()) == [(0, 2), (5, 5), (7, 8)]


def test_value_semantics() -> None:
    a = CPUSet.parse("0-3")
    assert a == frozenset({0, 1, 2, 3}) and hash(a) == hash(frozenset({0, 1, 2, 3}))
    assert {a: 1}[CPUSet([3, 2, 1, 0])] == 1
    assert a.copy() is a


def test_a_printed_set_prints_the_same_and_its_results_print_their_own() -> None:
    a = CPUSet.parse("0-3")
    assert str(a) == str(a) == "0-3"  # the second from the kept text
    assert str(a - {1}) == "0,2-3" and str(a | {8}) == "0-3,8" and str(a & {9}) == ""
    assert pickle.loads(pickle.dumps(a)) == a and str(pickle.loads(pickle.dumps(a))) == "0-3"


OPERATIONS = [
    lambda a, b: a | b,
    lambda a, b: a & b,
    lambda a, b: a - b,
    lambda a, b: a ^ b,
    lambda a, b: a.union(b),
    lambda a, b: a.intersection(b),
    lambda a, b: a.difference(b),
    lambda a, b: a.symmetric_difference(b),
    lambda a, b: a | set(b),
    lambda a, b: a & set(b),
    lambda a, b: a - list(b),
    lambda a, b: frozenset(b) | a,
    lambda a, b: frozenset(b) & a,
    lambda a, b: frozenset(b) ^ a,
]

cpu_ids = st.integers(min_value=0, max_value=4096)
cpu_sets = st.frozensets(cpu_ids, max_size=300)


@given(cpu_sets, cpu_sets)
def test_set_operations_keep_the_cpuset_type(a: frozenset[int], b: frozenset[int]) -> None:
    x, y = CPUSet(a), CPUSet(b)
    plain = [a | b, a & b, a - b, a ^ b, a | b, a & b, a - b, a ^ b]
    plain += [a | b, a & b, a - b, b | a, b & a, b ^ a]
    for operation, want in zip(OPERATIONS, plain, strict=True):
        got = operation(x, y)
        assert type(got) is CPUSet
        assert got == want


def test_union_with_invalid_ids_is_rejected() -> None:
    with pytest.raises(ValueError):
        CPUSet([1]) | {-1}
    with pytest.raises(ValueError):
        CPUSet([1]).union([MAX_CPU_ID + 1])


@given(cpu_sets)
def test_printed_form_parses_back(cpus: frozenset[int]) -> None:
    assert CPUSet.parse(str(CPUSet(cpus))) == cpus
    assert CPUSet.parse(f"{CPUSet(cpus)}\n") == cpus  # as read back from sysfs


_CANONICAL = re.compile(r"(?:\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)?")


@given(cpu_sets)
def test_printed_form_is_canonical(cpus: frozenset[int]) -> None:
    text = str(CPUSet(cpus))
    assert str(CPUSet.parse(text)) == text
    assert _CANONICAL.fullmatch(text), text
    assert " " not in text and "\n" not in text
    previous_last = None
    for element in filter(None, text.split(",")):
        first, _, last = element.partition("-")
        first_id, last_id = int(first), int(last or first)
        assert str(first_id) == first and (not last or str(last_id) == last)  # no leading zeros
        assert first_id < last_id or not last  # "3-3" is printed "3"
        # ascending and maximal: a gap of at least one id between neighbouring elements
        assert previous_last is None or first_id > previous_last + 1
        previous_last = last_id


@given(st.lists(st.tuples(cpu_ids, st.integers(0, 40)), max_size=30), st.randoms())
def test_any_valid_spelling_parses_to_the_same_set(elements, random) -> None:
    """Unsorted, overlapping, duplicated, 'a-a' and single ids all mean the same set."""
    cpus = set()
    spelled = []
    for first, length in elements:
        last = min(first + length, 4096)
        cpus.update(range(first, last + 1))
        spelled.append(str(first) if first == last and random.random() < 0.5 else f"{first}-{last}")
    random.shuffle(spelled)
    assert CPUSet.parse(",".join(spelled)) == cpus


_CPULIST_ALPHABET = st.sampled_from([*"0123456789,-", " ", "\n", "\t", "+", "a", "\u0663", ":"])


@settings(max_examples=300)
@given(st.one_of(st.text(_CPULIST_ALPHABET, max_size=30), st.text(max_size=30)))
def test_garbage_parses_or_raises_value_error(text: str) -> None:
    try:
        cpus = CPUSet.parse(text)
    except ValueError as err:
        assert repr(text) in str(err)
        return
    assert CPUSet.parse(str(cpus)) == cpus
    assert str(CPUSet.parse(str(cpus))) == str(cpus)
