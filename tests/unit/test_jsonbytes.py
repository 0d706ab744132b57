"""orjson (the daemon) and the standard library (the OCI hook) must write the same bytes.

The state file's checksum is a SHA-256 over its canonical JSON: a state the hook commits must
verify in the daemon and the other way round, so both encoders are compared on generated
documents of every shape we write, in every mode, and both decoders are held to the same rules.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nri_cpuplugin.base import jsonbytes
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.state import Assignment, NodeState, Released, decode, encode

# Everything but lone surrogates (neither encoder writes those: not UTF-8).
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | TEXT
DOCUMENTS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=20,
)


@contextlib.contextmanager
def stdlib(monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as m:
        m.setattr(jsonbytes, "_stdlib", True)
        yield


@settings(max_examples=400)
@given(DOCUMENTS, st.booleans(), st.booleans())
def test_both_encoders_write_the_same_bytes(doc, sort_keys, indent):
    fast = jsonbytes.dumps(doc, sort_keys=sort_keys, indent=indent)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jsonbytes, "_stdlib", True)
        slow = jsonbytes.dumps(doc, sort_keys=sort_keys, indent=indent)
        assert jsonbytes.loads(fast) == doc
    assert fast == slow
    assert jsonbytes.loads(slow) == doc


def _state() -> NodeState:
    return NodeState(
        policy="static",
        fingerprint="online=0-7;isolated=;smt=2;numa=1",
        reserved=CPUSet.parse("0"),
        shared=CPUSet.parse("0,3-7"),
        assignments={
            "ctr-ü": Assignment("ctr-ü", CPUSet.parse("1-2"), "uid", "app", 'pöd\n\t"x"', "ns")
        },
        released={("uid", "init"): Released(CPUSet.parse("1"), "init")},
        sharing={"s1": "uid2"},
        cgroups={"ctr-ü": "/kubepods/pod1/ctr", "s1": "/kubepods/besteffort/pod2/s1"},
    )


def test_a_state_written_by_one_verifies_in_the_other(monkeypatch):
    state = _state()
    fast = encode(state)
    with stdlib(monkeypatch):
        slow = encode(state)
        assert decode(fast) == state
    assert fast == slow
    assert decode(slow) == state


def test_paired_surrogate_escapes_are_one_character_in_both(monkeypatch):
    data = b'{"emoji": "\\ud83d\\ude00", "plain": "\\u00e9"}'
    with stdlib(monkeypatch):
        assert jsonbytes.loads(data) == orjson.loads(data) == {"emoji": "\U0001f600", "plain": "é"}


@pytest.mark.parametrize(
    "data, why",
    [
        (b'{"a": NaN}', "NaN"),
        (b'{"a": Infinity}', "Infinity"),
        (b'{"a": "\xff"}', "UTF-8"),
        (b'{"a": 1', ""),
        (b"", ""),
        (b'{"a": 1e400}', "infinite"),
        (b'{"a": ["\\ud800"]}', "lone surrogate"),
        (b'{"\\udc00": 1}', "lone surrogate"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    ],
)
def test_both_decoders_refuse_the_same_input(monkeypatch, data, why):
    with pytest.raises(jsonbytes.DecodeError):
        orjson.loads(data)
    with stdlib(monkeypatch), pytest.raises(jsonbytes.DecodeError, match=why or None):
        jsonbytes.loads(data)


# The standard library path reads and writes through json's C accelerator and falls back to
# json itself for anything else: it must give exactly what json gives, output and errors.

ODD = st.recursive(
    SCALARS | st.floats(allow_nan=True, allow_infinity=True),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(TEXT | st.integers(0, 9) | st.booleans() | st.none(), inner, max_size=4)
    ),
    max_leaves=12,
)


def _json_dumps(value, sort_keys, indent) -> bytes | type:
    try:
        return json.dumps(
            value,
            ensure_ascii=False,
            allow_nan=False,
            sort_keys=sort_keys,
            indent=2 if indent else None,
            separators=(",", ": ") if indent else (",", ":"),
        ).encode()
    except Exception as err:
        return type(err)


@settings(max_examples=400)
@given(ODD, st.booleans(), st.booleans())
def test_the_stdlib_path_writes_what_json_writes(value, sort_keys, indent):
    want = _json_dumps(value, sort_keys, indent)
    with stdlib(pytest.MonkeyPatch()):
        try:
            got = jsonbytes.dumps(value, sort_keys=sort_keys, indent=indent)
        except Exception as err:
            got = type(err)
    assert got == want


@pytest.mark.parametrize("indent", [False, True])
def test_the_stdlib_path_refuses_what_json_refuses(monkeypatch, indent):
    loop: list = [1]
    loop.append(loop)
    for value, error in (
        (loop, ValueError),  # a circular reference
        ({"a": float("nan")}, ValueError),
        ({"a": object()}, TypeError),
        ({(1, 2): 1}, TypeError),
        ({"a": "\ud800"}, UnicodeEncodeError),  # a lone surrogate is not UTF-8
    ):
        with stdlib(monkeypatch), pytest.raises(error):
            jsonbytes.dumps(value, indent=indent)


@settings(max_examples=300)
@given(
    DOCUMENTS,
    st.sampled_from(["", " ", "\n", " \t\r\n"]),
    st.sampled_from(["", " ", "\n", "\n\n "]),
)
def test_the_stdlib_path_reads_what_json_reads(doc, before, after):
    text = before + json.dumps(doc, indent=1 if len(before) % 2 else None) + after
    with stdlib(pytest.MonkeyPatch()):
        assert jsonbytes.loads(text) == json.loads(text) == doc
        assert jsonbytes.loads(text.encode()) == doc


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1} x',  # extra data
        '{"a": 1}{}',
        "\ufeff{}",  # a byte order mark
        " ",
        '{"a": [1, 2,]}',
        '{"a" 1}',
        '"tab\there"',  # a control character in a string (json's strict mode)
        "[1e400]",
        "[-Infinity]",
        '{"a": 01}',
    ],
)
def test_the_stdlib_path_reports_bad_input_as_json_does(monkeypatch, text):
    with pytest.raises(ValueError) as want:
        json.loads(text, parse_constant=_refuse, parse_float=_finite)
    with stdlib(monkeypatch), pytest.raises(jsonbytes.DecodeError) as got:
        jsonbytes.loads(text)
    assert str(got.value) == str(want.value)


def _refuse(name):
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def _finite(text):
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise json.JSONDecodeError(f"number {text} is infinite as a double", text, 0)
    return value


def test_the_stdlib_path_does_not_import_json_for_good_input():
    # (json imports re, enum and functools: the OCI hook's start-up time.)
    code = (
        "import sys\n"
        "from nri_cpuplugin.base import jsonbytes\n"
        "jsonbytes.use_stdlib()\n"
        'doc = jsonbytes.loads(b\' {"a": [1, true, null, "\\\\u00e9", {}], "b": -2} \')\n'
        "jsonbytes.dumps(doc, sort_keys=True, indent=True)\n"
        "jsonbytes.dumps(doc)\n"
        "print(sorted(m for m in ('json', 're', 'enum') if m in sys.modules))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.append({root!r})\n{code}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stderr
