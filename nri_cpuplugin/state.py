"""The node's CPU assignments as one immutable value, and its versioned JSON document form.

The document is self-checking: a SHA-256 over the canonical (sorted-key) body catches torn or
hand-edited files, and structural checks catch documents that parse but could not have been
written by us (overlapping assignments, shared CPUs that are also assigned).  Storage, locking
and atomic replacement live in ``store.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

import orjson

from .cpuset import CPUSet

FORMAT_VERSION = 1
CONTAINER_KINDS = ("app", "init", "sidecar")


class StateFormatError(ValueError):
    """A state document that must not be trusted; the message says why."""


@dataclass(frozen=True)
class Assignment:
    """Exclusive CPUs held by one live container."""

    container_id: str
    cpus: CPUSet
    pod_uid: str
    container_name: str
    pod_name: str = ""
    pod_namespace: str = ""
    kind: str = "app"


@dataclass(frozen=True)
class Released:
    """What a stopped container held, so its restart (same pod and name) gets the same CPUs and
    a finished init container's CPUs can go to the app containers of its pod."""

    cpus: CPUSet
    kind: str


def _frozen(mapping: Mapping | None) -> Mapping:
    # States are derived from states thousands of times a second: reuse what is already frozen.
    if isinstance(mapping, MappingProxyType):
        return mapping
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class NodeState:
    policy: str
    fingerprint: str
    reserved: CPUSet
    shared: CPUSet
    assignments: Mapping[str, Assignment] = field(default_factory=dict)
    released: Mapping[tuple[str, str], Released] = field(default_factory=dict)
    # Live containers running in the shared pool (id -> pod uid): the ones whose cpuset must
    # follow the pool.  Kept here so a restart without a runtime resync still knows them.
    sharing: Mapping[str, str] = field(default_factory=dict)
    # Where tracked containers' cgroups are (id -> the runtime's cgroupsPath), so that their
    # liveness can be checked when the runtime cannot be asked (see liveness.py).
    cgroups: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "assignments", _frozen(self.assignments))
        object.__setattr__(self, "released", _frozen(self.released))
        object.__setattr__(self, "sharing", _frozen(self.sharing))
        object.__setattr__(self, "cgroups", _frozen(self.cgroups))

    @cached_property
    def exclusive(self) -> CPUSet:
        """All exclusively assigned CPUs (computed once per state value)."""
        # Assignment sets are CPUSets already: skip re-validating every id.
        return CPUSet._trusted(frozenset().union(*(a.cpus for a in self.assignments.values())))

    def evolve(self, **changes: Any) -> NodeState:
        return replace(self, **changes)


# --- document form ------------------------------------------------------------------------


def to_document(state: NodeState) -> dict[str, Any]:
    body = {
        "version": FORMAT_VERSION,
        "policy": state.policy,
        "fingerprint": state.fingerprint,
        "reserved": str(state.reserved),
        "shared": str(state.shared),
        "assignments": {
            cid: {
                "cpus": str(a.cpus),
                "pod_uid": a.pod_uid,
                "container_name": a.container_name,
                "pod_name": a.pod_name,
                "pod_namespace": a.pod_namespace,
                "kind": a.kind,
            }
            for cid, a in sorted(state.assignments.items())
        },
        "released": [
            {"pod_uid": uid, "container_name": name, "cpus": str(r.cpus), "kind": r.kind}
            for (uid, name), r in sorted(state.released.items())
        ],
        "sharing": dict(sorted(state.sharing.items())),
        "cgroups": dict(sorted(state.cgroups.items())),
    }
    body["checksum"] = checksum(body)
    return body


def checksum(body: Mapping[str, Any]) -> str:
    canonical = {k: v for k, v in body.items() if k != "checksum"}
    return (
        "sha256:" + hashlib.sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)).hexdigest()
    )


def encode(state: NodeState) -> bytes:
    return orjson.dumps(to_document(state), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)


def decode(data: bytes) -> NodeState:
    """Parse and verify a document; raise StateFormatError saying what is wrong."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raise StateFormatError(f"not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise StateFormatError("the document is not a JSON object")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise StateFormatError(f"format version {version!r}; this build reads {FORMAT_VERSION}")
    if doc.get("checksum") != checksum(doc):
        raise StateFormatError("checksum mismatch (torn write or edited by hand)")
    try:
        state = NodeState(
            policy=_str(doc, "policy"),
            fingerprint=_str(doc, "fingerprint"),
            reserved=CPUSet.parse(_str(doc, "reserved")),
            shared=CPUSet.parse(_str(doc, "shared")),
            assignments={
                cid: _assignment(cid, entry) for cid, entry in _dict(doc, "assignments").items()
            },
            released=dict(_released(entry) for entry in _list(doc, "released")),
            sharing=_strings(_dict(doc, "sharing"), "sharing"),
            cgroups=_strings(_dict(doc, "cgroups"), "cgroups"),
        )
    except (ValueError, TypeError, KeyError) as err:
        raise StateFormatError(f"malformed field: {err}") from None
    _check_consistent(state)
    return state


def _str(doc: Mapping, key: str) -> str:
    value = doc[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, found {type(value).__name__}")
    return value


def _dict(doc: Mapping, key: str) -> dict:
    value = doc[key]
    if not isinstance(value, dict):
        raise TypeError(f"{key} must be an object")
    return value


def _list(doc: Mapping, key: str) -> list:
    value = doc[key]
    if not isinstance(value, list):
        raise TypeError(f"{key} must be a list")
    return value


def _kind(entry: Mapping) -> str:
    kind = _str(entry, "kind")
    if kind not in CONTAINER_KINDS:
        raise ValueError(f"unknown container kind {kind!r}")
    return kind


def _assignment(cid: str, entry: Any) -> Assignment:
    if not isinstance(entry, dict):
        raise TypeError(f"assignment {cid!r} must be an object")
    return Assignment(
        container_id=cid,
        cpus=CPUSet.parse(_str(entry, "cpus")),
        pod_uid=_str(entry, "pod_uid"),
        container_name=_str(entry, "container_name"),
        pod_name=_str(entry, "pod_name"),
        pod_namespace=_str(entry, "pod_namespace"),
        kind=_kind(entry),
    )


def _released(entry: Any) -> tuple[tuple[str, str], Released]:
    if not isinstance(entry, dict):
        raise TypeError("released entries must be objects")
    key = (_str(entry, "pod_uid"), _str(entry, "container_name"))
    return key, Released(CPUSet.parse(_str(entry, "cpus")), _kind(entry))


def _strings(entries: dict, key: str) -> dict[str, str]:
    for cid, value in entries.items():
        if not isinstance(value, str):
            raise TypeError(f"{key}[{cid!r}] must be a string")
    return entries


def _check_consistent(state: NodeState) -> None:
    seen: dict[int, str] = {}
    for cid, assignment in state.assignments.items():
        if not assignment.cpus:
            raise StateFormatError(f"assignment {cid!r} has no CPUs")
        for cpu in assignment.cpus:
            if cpu in seen:
                raise StateFormatError(f"CPU {cpu} is assigned to both {seen[cpu]!r} and {cid!r}")
            seen[cpu] = cid
    both = set(state.sharing) & set(state.assignments)
    if both:
        raise StateFormatError(f"containers {sorted(both)} are both shared and exclusive")
    overlap = state.shared & CPUSet(seen)
    if overlap:
        raise StateFormatError(f"CPUs {overlap} are both shared and exclusively assigned")
    if not state.shared:
        raise StateFormatError("the shared pool is empty")
