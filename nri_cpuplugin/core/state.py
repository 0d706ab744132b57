"""The node's CPU assignments as one immutable value, and its versioned JSON document form.

The document is self-checking: a SHA-256 over the canonical (sorted-key) body catches torn or
hand-edited files, and structural checks catch documents that parse but could not have been
written by us (overlapping assignments, shared CPUs that are also assigned).  Storage, locking
and atomic replacement live in ``store.py``.
"""

from __future__ import annotations

from types import MappingProxyType

from .. import __version__
from ..base import jsonbytes, shape
from ..base.errors import PluginError

# CPython's built-in SHA-256 (the same digest): hashlib loads OpenSSL, ~2 ms of every start of
# the OCI hook.
try:
    from _sha256 import sha256  # type: ignore[import-not-found]  # CPython 3.11
except ImportError:  # pragma: no cover - other versions
    try:
        from _sha2 import sha256  # type: ignore[import-not-found]  # CPython >= 3.12
    except ImportError:
        from hashlib import sha256
from ..base.value import Value, cached_property
from .cpuset import CPUSet

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

FORMAT_VERSION = 1
# Which build wrote a document ("written_by"): for the operator after an upgrade or a rollback.
# Informational only: readers of every version ignore fields they do not know (decode reads
# the fields it names), and the checksum covers it like any other field.
WRITER = f"nri-cpuplugin {__version__}"
CONTAINER_KINDS = ("app", "init", "sidecar")


class StateFormatError(PluginError, ValueError):
    """A state document that must not be trusted; the message says why."""

    code = "corrupt"


class Assignment(Value):
    """Exclusive CPUs held by one live container.

    ``lost`` are CPUs it held that went offline (or were taken back to keep the shared pool
    non-empty) and that no free CPU could replace: the container is *degraded* while it is
    non-empty, and each of these CPUs returns to it when it is usable again.  ``cpus`` may be
    empty only then (the container runs in the shared pool meanwhile).

    ``nic_nodes`` are the NUMA nodes of the NICs its placement preferred (empty: no
    preference), ``nics`` describe those NICs for ``status``, and ``nic_strict`` says the pod
    asked to fail rather than be placed elsewhere (replacements after hotplug keep to it too).
    """

    container_id: str
    cpus: CPUSet
    pod_uid: str
    container_name: str
    pod_name: str = ""
    pod_namespace: str = ""
    kind: str = "app"
    lost: CPUSet = CPUSet()
    nic_nodes: CPUSet = CPUSet()
    nics: tuple[str, ...] = ()
    nic_strict: bool = False
    # In-place resize: the CPUs it started with (empty: never resized, ``cpus`` are those) and
    # the CPUs added since, oldest first - a shrink gives back the newest first.
    initial: CPUSet = CPUSet()
    added: tuple[int, ...] = ()
    # Device interrupts are kept off its CPUs while it holds them (core/irq.py).
    irq_free: bool = False

    @property
    def degraded(self) -> bool:
        return bool(self.lost)

    @property
    def count(self) -> int:
        """The number of exclusive CPUs the container is entitled to."""
        return len(self.cpus) + len(self.lost)


class Released(Value):
    """What a stopped container held, so its restart (same pod and name) gets the same CPUs and
    a finished init container's CPUs can go to the app containers of its pod."""

    cpus: CPUSet
    kind: str


class Earmark(Value):
    """CPUs set aside for a Guaranteed pod's exclusive containers when its sandbox started, so
    that creating them moves no other container (docs/architecture.md, "Earmarks").

    ``limit_milli`` is the pod's CPU limit as kubelet sent it (the sum over its containers) and
    ``claimed_milli`` what its containers created since have taken of it (``claimants``, by
    name: a restart claims nothing more): the earmark never keeps more whole CPUs than the
    difference, so what a pod cannot use goes back to the shared pool as its containers are
    created.  ``deferred`` are the pod's init containers created so far, (id, name, limit):
    kubelet's pod limit counts an init container only when it runs on beside the app
    containers (a sidecar), so whether it claims is decided when the first app container
    comes."""

    cpus: CPUSet
    sandbox_id: str
    limit_milli: int
    claimed_milli: int = 0
    claimants: tuple[str, ...] = ()
    pod_name: str = ""
    pod_namespace: str = ""
    deferred: tuple[tuple[str, str, int], ...] = ()


class IrqRecord(Value):
    """CPUs taken out of one interrupt's affinity to keep them interrupt-free (core/irq.py):
    given back when no container needs them so.  ``names`` are the interrupt's handlers as
    /proc/interrupts shows them: a number reused by another device is not ours to restore."""

    names: str
    taken: CPUSet


_EMPTY: Mapping = MappingProxyType({})


def _frozen(mapping: Mapping | None) -> Mapping:
    # States are derived from states thousands of times a second: reuse what is already frozen.
    if isinstance(mapping, MappingProxyType):
        return mapping
    return MappingProxyType(dict(mapping or {}))


class NodeState(Value):
    policy: str
    fingerprint: str
    reserved: CPUSet
    shared: CPUSet
    assignments: Mapping[str, Assignment] = _EMPTY
    released: Mapping[tuple[str, str], Released] = _EMPTY
    # Live containers running in the shared pool (id -> pod uid): the ones whose cpuset must
    # follow the pool.  Kept here so a restart without a runtime resync still knows them.
    sharing: Mapping[str, str] = _EMPTY
    # Where tracked containers' cgroups are (id -> the runtime's cgroupsPath), so that their
    # liveness can be checked when the runtime cannot be asked (see liveness.py).
    cgroups: Mapping[str, str] = _EMPTY
    # CPUs earmarked for pods (pod uid -> Earmark): out of the shared pool, not yet any
    # container's.
    earmarks: Mapping[str, Earmark] = _EMPTY
    # Interrupts whose affinity we narrowed (number -> what we took; -1: the default affinity
    # of new interrupts): recorded before the write, so a crash never loses what to give back.
    irqs: Mapping[int, IrqRecord] = _EMPTY

    def __post_init__(self) -> None:
        object.__setattr__(self, "assignments", _frozen(self.assignments))
        object.__setattr__(self, "released", _frozen(self.released))
        object.__setattr__(self, "sharing", _frozen(self.sharing))
        object.__setattr__(self, "cgroups", _frozen(self.cgroups))
        object.__setattr__(self, "earmarks", _frozen(self.earmarks))
        object.__setattr__(self, "irqs", _frozen(self.irqs))

    @cached_property
    def assigned(self) -> CPUSet:
        """The CPUs containers hold exclusively (computed once per state value)."""
        # Assignment sets are CPUSets already: skip re-validating every id.
        return CPUSet._trusted(frozenset().union(*(a.cpus for a in self.assignments.values())))

    @cached_property
    def exclusive(self) -> CPUSet:
        """Every CPU out of the shared pool for exclusive use: assigned or earmarked."""
        if not self.earmarks:
            return self.assigned
        marked = frozenset().union(*(e.cpus for e in self.earmarks.values()))
        return CPUSet._trusted(frozenset(self.assigned) | marked)


# --- document form ------------------------------------------------------------------------


def _assignment_document(a: Assignment) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "cpus": str(a.cpus),
        "pod_uid": a.pod_uid,
        "container_name": a.container_name,
        "pod_name": a.pod_name,
        "pod_namespace": a.pod_namespace,
        "kind": a.kind,
    }
    # Written only when set, so documents of nodes without hotplug or NIC preferences keep the
    # same bytes (and checksum) as before these fields existed; decode() defaults them.
    if a.lost:
        entry["lost"] = str(a.lost)
    if a.nic_nodes:
        entry["nic_nodes"] = str(a.nic_nodes)
    if a.nics:
        entry["nics"] = list(a.nics)
    if a.nic_strict:
        entry["nic_strict"] = True
    if a.initial:
        entry["initial"] = str(a.initial)
    if a.added:
        entry["added"] = list(a.added)
    if a.irq_free:
        entry["irq_free"] = True
    return entry


def to_document(state: NodeState) -> dict[str, Any]:
    body = {
        "version": FORMAT_VERSION,
        "written_by": WRITER,
        "policy": state.policy,
        "fingerprint": state.fingerprint,
        "reserved": str(state.reserved),
        "shared": str(state.shared),
        "assignments": {
            cid: _assignment_document(a) for cid, a in sorted(state.assignments.items())
        },
        "released": [
            {"pod_uid": uid, "container_name": name, "cpus": str(r.cpus), "kind": r.kind}
            for (uid, name), r in sorted(state.released.items())
        ],
        "sharing": dict(sorted(state.sharing.items())),
        "cgroups": dict(sorted(state.cgroups.items())),
    }
    if state.irqs:  # only when set, as earmarks
        body["irqs"] = {
            str(n): {"names": r.names, "taken": str(r.taken)} for n, r in sorted(state.irqs.items())
        }
    if state.earmarks:  # only when set: older documents keep their bytes and checksum
        body["earmarks"] = {uid: _earmark_body(e) for uid, e in sorted(state.earmarks.items())}
    body["checksum"] = checksum(body)
    return body


def _earmark_body(e: Earmark) -> dict[str, Any]:
    body: dict[str, Any] = {
        "cpus": str(e.cpus),
        "sandbox_id": e.sandbox_id,
        "limit_milli": e.limit_milli,
        "claimed_milli": e.claimed_milli,
        "claimants": list(e.claimants),
        "pod_name": e.pod_name,
        "pod_namespace": e.pod_namespace,
    }
    if e.deferred:  # only when set: older documents keep their bytes and checksum
        body["deferred"] = [list(entry) for entry in e.deferred]
    return body


def checksum(body: Mapping[str, Any]) -> str:
    canonical = {k: v for k, v in body.items() if k != "checksum"}
    digest: str = sha256(jsonbytes.dumps(canonical, sort_keys=True)).hexdigest()
    return "sha256:" + digest


def encode(state: NodeState) -> bytes:
    return jsonbytes.dumps(to_document(state), sort_keys=True, indent=True)


def decode(data: bytes) -> NodeState:
    """Parse and verify a document; raise StateFormatError saying what is wrong."""
    try:
        doc = jsonbytes.loads(data)
    except jsonbytes.DecodeError as err:
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
            policy=shape.string(doc, "policy"),
            fingerprint=shape.string(doc, "fingerprint"),
            reserved=CPUSet.parse(shape.string(doc, "reserved")),
            shared=CPUSet.parse(shape.string(doc, "shared")),
            assignments={
                cid: _assignment(cid, entry)
                for cid, entry in shape.mapping(doc, "assignments").items()
            },
            released=dict(_released(entry) for entry in shape.array(doc, "released")),
            sharing=_strings(doc, "sharing"),
            cgroups=_strings(doc, "cgroups"),
            earmarks={uid: _earmark(uid, e) for uid, e in _optional_map(doc, "earmarks").items()},
            irqs=dict(_irq(n, e) for n, e in _optional_map(doc, "irqs").items()),
        )
    except (ValueError, TypeError, KeyError) as err:
        raise StateFormatError(f"malformed field: {err}") from None
    _check_consistent(state)
    return state


def _kind(entry: Mapping) -> str:
    kind: str = shape.string(entry, "kind")
    if kind not in CONTAINER_KINDS:
        raise ValueError(f"unknown container kind {kind!r}")
    return kind


def _assignment(cid: str, entry: Any) -> Assignment:
    entry = shape.obj(entry, f"assignment {cid!r}")
    return Assignment(
        container_id=cid,
        cpus=CPUSet.parse(shape.string(entry, "cpus")),
        pod_uid=shape.string(entry, "pod_uid"),
        container_name=shape.string(entry, "container_name"),
        pod_name=shape.string(entry, "pod_name"),
        pod_namespace=shape.string(entry, "pod_namespace"),
        kind=_kind(entry),
        lost=CPUSet.parse(shape.string(entry, "lost", optional=True) or ""),
        nic_nodes=CPUSet.parse(shape.string(entry, "nic_nodes", optional=True) or ""),
        nics=tuple(shape.strings(entry.get("nics", []), f"assignment {cid!r} nics")),
        nic_strict=shape.boolean(entry, "nic_strict"),
        initial=CPUSet.parse(shape.string(entry, "initial", optional=True) or ""),
        added=tuple(_cpu_ids(entry.get("added", []), f"assignment {cid!r} added")),
        irq_free=shape.boolean(entry, "irq_free"),
    )


def _irq(number: str, entry: Any) -> tuple[int, IrqRecord]:
    if not (number.isdigit() or number == "-1") or len(number) > 9:
        raise TypeError(f"interrupt {number[:20]!r} is not an interrupt number")
    entry = shape.obj(entry, f"interrupt {number}")
    return int(number), IrqRecord(
        shape.string(entry, "names"), CPUSet.parse(shape.string(entry, "taken"))
    )


def _optional_map(doc: Mapping, key: str) -> dict:
    return shape.mapping(doc, key) if key in doc else {}


def _earmark(uid: str, entry: Any) -> Earmark:
    entry = shape.obj(entry, f"earmark of pod {uid!r}")
    return Earmark(
        cpus=CPUSet.parse(shape.string(entry, "cpus")),
        sandbox_id=shape.string(entry, "sandbox_id"),
        limit_milli=_milli(entry, "limit_milli", uid),
        claimed_milli=_milli(entry, "claimed_milli", uid),
        claimants=tuple(shape.strings(entry.get("claimants", []), f"earmark of pod {uid!r}")),
        pod_name=shape.string(entry, "pod_name"),
        pod_namespace=shape.string(entry, "pod_namespace"),
        deferred=tuple(_deferred(item, uid) for item in entry.get("deferred", [])),
    )


def _deferred(item: Any, uid: str) -> tuple[str, str, int]:
    """One deferred init container of an earmark: [container id, name, limit in millicores]."""
    if (
        not isinstance(item, list)
        or len(item) != 3
        or not all(isinstance(v, str) for v in item[:2])
        or type(item[2]) is not int
        or item[2] < 0
    ):
        raise TypeError(
            f"earmark of pod {uid!r}: a deferred init container must be [id, name, millicores]"
        )
    return item[0], item[1], item[2]


def _milli(entry: Mapping, key: str, uid: str) -> int:
    value = entry.get(key)
    if type(value) is not int or value < 0:
        raise TypeError(f"earmark of pod {uid!r}: {key} must be a non-negative integer")
    return value


def _cpu_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise TypeError(f"{what} must be a list of CPU ids")
    return value


def _released(entry: Any) -> tuple[tuple[str, str], Released]:
    entry = shape.obj(entry, "released entry")
    key = (shape.string(entry, "pod_uid"), shape.string(entry, "container_name"))
    return key, Released(CPUSet.parse(shape.string(entry, "cpus")), _kind(entry))


def _strings(doc: Mapping, key: str) -> dict[str, str]:
    shape.mapping(doc, key)  # required, unlike most maps
    return shape.string_map(doc, key)


def _check_consistent(state: NodeState) -> None:
    """No CPU in two places: held, owed, earmarked and shared are disjoint (owed ones may be
    shared meanwhile), and the shared pool has a CPU."""
    seen, owed = _held_and_owed(state)
    for uid, earmark in state.earmarks.items():
        if not earmark.cpus:
            raise StateFormatError(f"the earmark of pod {uid!r} has no CPUs")
        for cpu in earmark.cpus:
            if cpu in seen or cpu in owed:
                holder = seen.get(cpu) or owed[cpu]
                raise StateFormatError(f"CPU {cpu} is earmarked for pod {uid!r} and {holder!r}")
            seen[cpu] = f"pod {uid}"
    both = set(state.sharing) & set(state.assignments)
    if both:
        raise StateFormatError(f"containers {sorted(both)} are both shared and exclusive")
    overlap = state.shared & CPUSet(seen)
    if overlap:
        raise StateFormatError(f"CPUs {overlap} are both shared and held or earmarked")
    if not state.shared:
        raise StateFormatError("the shared pool is empty")


def _held_and_owed(state: NodeState) -> tuple[dict[int, str], dict[int, str]]:
    """Which container holds each assigned CPU, and which is owed each lost one: each CPU
    in one place only."""
    seen: dict[int, str] = {}
    owed: dict[int, str] = {}
    for cid, assignment in state.assignments.items():
        if not assignment.cpus and not assignment.lost:
            raise StateFormatError(f"assignment {cid!r} has no CPUs")
        for cpu in assignment.cpus:
            if cpu in seen:
                raise StateFormatError(f"CPU {cpu} is assigned to both {seen[cpu]!r} and {cid!r}")
            seen[cpu] = cid
        for cpu in assignment.lost:
            if cpu in owed:
                raise StateFormatError(f"lost CPU {cpu} is owed to both {owed[cpu]!r} and {cid!r}")
            owed[cpu] = cid
    for cpu, cid in owed.items():
        if cpu in seen:
            raise StateFormatError(f"CPU {cpu} is held by {seen[cpu]!r} and owed to {cid!r}")
    return seen, owed
