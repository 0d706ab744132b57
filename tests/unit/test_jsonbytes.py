"""orjson (the daemon) and the standard library (the OCI hook) must write the same bytes.

The state file's checksum is a SHA-256 over its canonical JSON: a state the hook commits must
verify in the daemon and the other way round, so both encoders are compared on generated
documents of every shape we write, in every mode, and both decoders are held to the same rules.
"""

from __future__ import annotations

import contextlib

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
