"""Our api/*.proto against upstream's: same names, numbers and types, byte for byte on the wire.

Upstream schemas: NRI 0.6.1 and 0.8.0 ``pkg/api/api.proto`` and ttrpc 1.2.4 and 1.2.7
``request.proto`` + ``proto/status.proto`` from Debian's Go source packages; NRI 0.12.0 from
containerd 2.3.4's source tarball and NRI 0.11.0 from CRI-O 1.36.3's (their vendor trees; both
tarballs and the files taken from them pinned by SHA256 in tests/harness/packages.py).  They
are compiled with grpcio-tools' protoc into descriptor sets and compared with the descriptors
embedded in our generated modules, so the check covers what actually runs.  Rules:

- every message, field, enum value, service and method of ours exists in the newest upstream
  (NRI 0.12.0 / ttrpc 1.2.7) under the same full name, with the same number, type, type name
  (for message and enum fields), label and map-entry-ness; where it also exists in an older
  one (NRI 0.11.0, 0.8.0, 0.6.1 / ttrpc 1.2.4) it is the same there, and its number is not
  used by anything else there - except the Event enum's LAST sentinel, which NRI 0.10 moved
  from 12 to 15 and which never travels;
- decoding sees everything upstream sends in what we define: our messages, enums and
  services lack nothing of NRI 0.8.0 (or ttrpc 1.2.7), those we added from NRI 0.10-0.12 lack
  nothing of 0.12.0, and we define every NRI 0.8.0 type;
- the upstream differences 0.6.1 -> 0.8.0, 0.8.0 -> 0.12.0 and 0.11.0 -> 0.12.0 (where they
  touch what we define) and ttrpc 1.2.4 -> 1.2.7 are what docs/nri-wire.md §13.2 says;
- the committed gencode is what ``./dev proto`` produces from api/ today.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from nri_cpuplugin.nri.pb import nri_pb2, ttrpc_pb2, ttrpc_status_pb2
from tests.harness import debs, packages, tarballs

REPO = Path(__file__).resolve().parents[2]
PB_DIR = REPO / "nri_cpuplugin" / "nri" / "pb"
PROTOC_ARGS = ["-Inri_cpuplugin/nri/pb=api", "--python_out={out}", "--pyi_out={out}"]  # as ./dev

NRI_SRC = Path("usr/share/gocode/src/github.com/containerd/nri")
TTRPC_SRC = Path("usr/share/gocode/src/github.com/containerd/ttrpc")

FDP = descriptor_pb2.FieldDescriptorProto


def _field(name: str, number: int, type_: int, label: int, type_name: str = "") -> FDP:
    return FDP(name=name, number=number, type=type_, label=label, type_name=type_name)


# ttrpc's proto/status.proto only declares `Status { int32 code = 1; }` (no package), but its
# Go code binds that file to google.rpc.Status (genproto), which is what Go peers encode and
# decode.  These are that message's fields; our Status is compared with them.
GOOGLE_RPC_STATUS_FIELDS = (
    _field("code", 1, FDP.TYPE_INT32, FDP.LABEL_OPTIONAL),
    _field("message", 2, FDP.TYPE_STRING, FDP.LABEL_OPTIONAL),
    _field("details", 3, FDP.TYPE_MESSAGE, FDP.LABEL_REPEATED, ".google.protobuf.Any"),
)
GENPROTO_STATUS_IMPORT = 'status "google.golang.org/genproto/googleapis/rpc/status"'

# What NRI 0.7/0.8 added over 0.6.1 (docs/nri-wire.md §13.2); nothing was changed or
# removed.  Added messages are listed without their fields.
NRI_061_TO_080 = {
    "+field nri.pkg.api.v1alpha1.ConfigureRequest.registration_timeout = 4",
    "+field nri.pkg.api.v1alpha1.ConfigureRequest.request_timeout = 5",
    "+field nri.pkg.api.v1alpha1.SynchronizeRequest.more = 3",
    "+field nri.pkg.api.v1alpha1.SynchronizeResponse.more = 2",
    "+field nri.pkg.api.v1alpha1.PodSandbox.ips = 10",
    "+message nri.pkg.api.v1alpha1.CDIDevice",
    "+field nri.pkg.api.v1alpha1.ContainerAdjustment.CDI_devices = 8",
    "+message nri.pkg.api.v1alpha1.LinuxPids",
    "+field nri.pkg.api.v1alpha1.LinuxResources.pids = 8",
    "+field nri.pkg.api.v1alpha1.LinuxContainerAdjustment.oom_score_adj = 4",
}
TTRPC_124_TO_127: set[str] = set()

_P = "nri.pkg.api.v1alpha1"
# What NRI 0.10-0.12 added to what we define (docs/nri-wire.md §13.2): the types we took,
# fields of our messages, values of our enum, methods of our services.  Nothing was removed or
# renumbered; the LAST sentinel moved.
_PER_EVENT = (
    "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "PostCreateContainer",
    "StartContainer", "PostStartContainer", "PostUpdateContainer", "RemoveContainer",
    "PostUpdatePodSandbox",
)  # fmt: skip
_NRI_011_TO_012 = {
    f"+field {_P}.RegisterPluginRequest.NRI_version = 3",
    f"+field {_P}.ConfigureRequest.NRI_version = 6",
    f"+field {_P}.LinuxContainerAdjustment.memory_policy = 12",
    *(f"+method {_P}.Plugin/{m}" for m in _PER_EVENT),
    *(f"+message {_P}.{m}{part}" for m in _PER_EVENT for part in ("Request", "Response")),
}
NRI_080_TO_012 = _NRI_011_TO_012 | {
    f"+field {_P}.Container.{name} = {number}"
    for name, number in (
        ("created_at", 14), ("started_at", 15), ("finished_at", 16), ("exit_code", 17),
        ("status_reason", 18), ("status_message", 19), ("CDI_devices", 20), ("user", 21),
    )
} | {
    f"+field {_P}.LinuxContainer.{name} = {number}"
    for name, number in (
        ("io_priority", 6), ("seccomp_profile", 7), ("seccomp_policy", 8), ("sysctl", 9),
        ("net_devices", 10), ("scheduler", 11), ("rdt", 12),
    )
} | {
    f"+field {_P}.LinuxContainerAdjustment.{name} = {number}"
    for name, number in (
        ("io_priority", 5), ("seccomp_policy", 6), ("namespaces", 7), ("sysctl", 8),
        ("net_devices", 9), ("scheduler", 10), ("rdt", 11),
    )
} | {
    f"+field {_P}.ContainerAdjustment.args = 9",
    f"+method {_P}.Plugin/UpdatePodSandbox",
    f"+message {_P}.UpdatePodSandboxRequest",
    f"+message {_P}.UpdatePodSandboxResponse",
    f"+method {_P}.Plugin/ValidateContainerAdjustment",
    f"+value {_P}.Event.UPDATE_POD_SANDBOX = 12",
    f"+value {_P}.Event.POST_UPDATE_POD_SANDBOX = 13",
    f"+value {_P}.Event.VALIDATE_CONTAINER_ADJUSTMENT = 14",
    f"~value {_P}.Event.LAST: 12 -> 15",
}  # fmt: skip
# The sentinel that moved: an older upstream's LAST = 12 is our UPDATE_POD_SANDBOX.  It never
# travels (a valid mask is built from it), so differing from a pre-0.10 schema there is right.
SENTINEL = f"{_P}.Event.LAST"


# --- schemas as comparable indexes -------------------------------------------------------


@dataclass
class Schema:
    """Every message, enum and service of some .proto files, by full name (no leading dot)."""

    label: str
    messages: dict[str, descriptor_pb2.DescriptorProto] = field(default_factory=dict)
    enums: dict[str, descriptor_pb2.EnumDescriptorProto] = field(default_factory=dict)
    services: dict[str, descriptor_pb2.ServiceDescriptorProto] = field(default_factory=dict)

    def add_file(self, fdp: descriptor_pb2.FileDescriptorProto) -> None:
        prefix = f"{fdp.package}." if fdp.package else ""
        for message in fdp.message_type:
            self._add_message(prefix + message.name, message)
        for enum in fdp.enum_type:
            self.enums[prefix + enum.name] = enum
        for service in fdp.service:
            self.services[prefix + service.name] = service

    def _add_message(self, name: str, message: descriptor_pb2.DescriptorProto) -> None:
        self.messages[name] = message
        for nested in message.nested_type:
            self._add_message(f"{name}.{nested.name}", nested)
        for enum in message.enum_type:
            self.enums[f"{name}.{enum.name}"] = enum


def _field_shape(f: FDP) -> dict[str, object]:
    return {
        "number": f.number,
        "type": FDP.Type.Name(f.type),
        "type_name": f.type_name,  # fully qualified by protoc: compares by full name
        "label": FDP.Label.Name(f.label),
        "proto3_optional": f.proto3_optional,
        "in a oneof": f.HasField("oneof_index"),
    }


def _protoc(*args: str, cwd: Path = REPO) -> None:
    # `python -m grpc_tools.protoc` adds the bundled google/protobuf/*.proto include itself.
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        pytest.fail(f"protoc {' '.join(args)} (in {cwd}) failed:\n{result.stderr}")


def _for_protoc(text: str) -> str:
    """Drop what only Go's gogo/protobuf plugins understand (imports, file and field options)."""
    text = re.sub(r'^\s*import\s+"(github\.com/gogo|gogoproto)/[^"]*";\s*$', "", text, flags=re.M)
    text = re.sub(r"^\s*option\s+\(gogoproto\.[^;]*;\s*$", "", text, flags=re.M)
    return re.sub(r"\s*\[\s*\(gogoproto\.[^\]]*\]", "", text)


def _compile_upstream(
    root: Path, files: list[str], tmp: Path
) -> list[descriptor_pb2.FileDescriptorProto]:
    """Copy ``files`` (relative to ``root``), strip gogo bits, compile; return their descriptors."""
    for name in files:
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_for_protoc((root / name).read_text()))
    out = tmp / "set.binpb"
    _protoc(f"-I{tmp}", f"--descriptor_set_out={out}", "--include_imports", *files, cwd=tmp)
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return [f for f in fds.file if not f.name.startswith("google/protobuf/")]


# NRI schemas vendored by runtimes whose sources are pinned tarballs: (tarball, vendor dir).
VENDORED = {
    "NRI 0.12.0": (packages.CONTAINERD_23_SRC, "containerd/nri v0.12.0"),
    "NRI 0.11.0": (packages.CRIO_136_SRC, "containerd/nri v0.11.0"),
}
VENDORED_API = Path("vendor/github.com/containerd/nri/pkg/api")


@cache
def _upstream(which: str) -> Schema:
    schema = Schema(which)
    if which in VENDORED:
        tarball, module = VENDORED[which]
        tree = tarballs.unpack(tarball)  # the tarball and the files used checked by SHA256
        # The vendor tree is that version: go's own record of what it vendored says so.
        assert f"# github.com/{module}\n" in (tree / "vendor/modules.txt").read_text(), which
        with tempfile.TemporaryDirectory(prefix="upstream-proto-") as tmp:
            files = _compile_upstream(tree / VENDORED_API, ["api.proto"], Path(tmp))
        for fdp in files:
            schema.add_file(fdp)
        return schema
    deb = {
        "NRI 0.6.1": packages.NRI_API_061,
        "NRI 0.8.0": packages.NRI_API_080,
        "ttrpc 1.2.4": packages.TTRPC_124,
        "ttrpc 1.2.7": packages.TTRPC_127,
    }[which]
    tree = debs.unpack(deb)
    with tempfile.TemporaryDirectory(prefix="upstream-proto-") as tmp:
        if which.startswith("NRI"):
            files = _compile_upstream(tree / NRI_SRC, ["pkg/api/api.proto"], Path(tmp))
        else:
            files = _compile_upstream(
                tree / TTRPC_SRC, ["request.proto", "proto/status.proto"], Path(tmp)
            )
    for fdp in files:
        schema.add_file(fdp)
    if which.startswith("ttrpc"):
        _substitute_google_rpc_status(schema, tree / TTRPC_SRC / "request.pb.go")
    return schema


def _substitute_google_rpc_status(schema: Schema, go_source: Path) -> None:
    """Give upstream's ``Status`` the fields of google.rpc.Status, which ttrpc's Go code uses.

    Only after checking that the Go code still makes that substitution and that the .proto's
    own fields agree with google.rpc.Status.
    """
    go = go_source.read_text()
    assert GENPROTO_STATUS_IMPORT in go and re.search(r"\bStatus\s+\*status\.Status\b", go), (
        f"{schema.label}: {go_source.name} no longer binds Response.status to google.rpc.Status "
        "(genproto); our Status carries its message/details fields - recheck api/ttrpc_status.proto"
    )
    declared = schema.messages["Status"]
    status = descriptor_pb2.DescriptorProto(name="Status", field=GOOGLE_RPC_STATUS_FIELDS)
    by_name = {f.name: f for f in status.field}
    for f in declared.field:
        assert f.name in by_name and _field_shape(f) == _field_shape(by_name[f.name]), (
            f"{schema.label}: proto/status.proto's Status.{f.name} {_field_shape(f)} disagrees "
            "with google.rpc.Status"
        )
    schema.messages["Status"] = status


def _ours(*modules: object) -> Schema:
    schema = Schema("ours")
    for module in modules:
        schema.add_file(
            descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        )
    return schema


OURS = {
    "NRI": lambda: _ours(nri_pb2),
    "ttrpc": lambda: _ours(ttrpc_pb2, ttrpc_status_pb2),
}


# --- comparison --------------------------------------------------------------------------


def _compare(ours: Schema, theirs: Schema, *, required: bool) -> tuple[list[str], list[str]]:
    """(problems, names of ours that ``theirs`` lacks).  ``required``: lacking is a problem."""
    problems: list[str] = []
    absent: list[str] = []

    def missing(what: str) -> None:
        if required:
            problems.append(f"{what} does not exist in {theirs.label}")
        else:
            absent.append(what)

    for name, message in ours.messages.items():
        other = theirs.messages.get(name)
        if other is None:
            missing(f"message {name}")
            continue
        if message.options.map_entry != other.options.map_entry:
            problems.append(
                f"message {name}: map entry is {message.options.map_entry} here, "
                f"{other.options.map_entry} in {theirs.label}"
            )
        their_fields = {f.name: f for f in other.field}
        their_numbers = {f.number: f.name for f in other.field}
        for f in message.field:
            theirs_f = their_fields.get(f.name)
            if theirs_f is None:
                missing(f"field {name}.{f.name}")
                if f.number in their_numbers:
                    problems.append(
                        f"field {name}.{f.name} = {f.number}: {theirs.label} uses number "
                        f"{f.number} for field {their_numbers[f.number]!r}"
                    )
                continue
            mine, upstream = _field_shape(f), _field_shape(theirs_f)
            for key in mine:
                if mine[key] != upstream[key]:
                    problems.append(
                        f"field {name}.{f.name}: {key} is {mine[key]!r} here, "
                        f"{upstream[key]!r} in {theirs.label}"
                    )

    for name, enum in ours.enums.items():
        other = theirs.enums.get(name)
        if other is None:
            missing(f"enum {name}")
            continue
        their_values = {v.name: v.number for v in other.value}
        their_numbers = {v.number: v.name for v in other.value}
        for v in enum.value:
            if v.name not in their_values:
                missing(f"enum value {name}.{v.name}")
                if v.number in their_numbers:
                    problems.append(
                        f"enum value {name}.{v.name} = {v.number}: {theirs.label} uses "
                        f"{v.number} for {their_numbers[v.number]}"
                    )
            elif their_values[v.name] != v.number:
                problems.append(
                    f"enum value {name}.{v.name}: number is {v.number} here, "
                    f"{their_values[v.name]} in {theirs.label}"
                )

    for name, service in ours.services.items():
        other = theirs.services.get(name)
        if other is None:
            missing(f"service {name}")
            continue
        their_methods = {m.name: m for m in other.method}
        for m in service.method:
            theirs_m = their_methods.get(m.name)
            if theirs_m is None:
                missing(f"method {name}/{m.name}")
                continue
            for key in ("input_type", "output_type", "client_streaming", "server_streaming"):
                if getattr(m, key) != getattr(theirs_m, key):
                    problems.append(
                        f"method {name}/{m.name}: {key} is {getattr(m, key)!r} here, "
                        f"{getattr(theirs_m, key)!r} in {theirs.label}"
                    )
    return problems, absent


def _lacking(ours: Schema, theirs: Schema) -> list[str]:
    """What ``theirs`` has inside the messages/enums/services we define and we do not."""
    lacking: list[str] = []
    for name, message in ours.messages.items():
        if name in theirs.messages:
            have = {f.name for f in message.field}
            lacking += [
                f"field {name}.{f.name} = {f.number} (decode would skip it)"
                for f in theirs.messages[name].field
                if f.name not in have
            ]
    for name, enum in ours.enums.items():
        if name in theirs.enums:
            have = {v.name for v in enum.value}
            lacking += [
                f"enum value {name}.{v.name} = {v.number}"
                for v in theirs.enums[name].value
                if v.name not in have
            ]
    for name, service in ours.services.items():
        if name in theirs.services:
            have = {m.name for m in service.method}
            lacking += [
                f"method {name}/{m.name}"
                for m in theirs.services[name].method
                if m.name not in have
            ]
    return lacking


def _diff(old: Schema, new: Schema) -> set[str]:
    """Wire-visible changes from ``old`` to ``new``, one line each."""
    changes: set[str] = set()
    for kind, old_items, new_items in (
        ("message", old.messages, new.messages),
        ("enum", old.enums, new.enums),
        ("service", old.services, new.services),
    ):
        changes |= {f"+{kind} {n}" for n in new_items.keys() - old_items.keys()}
        changes |= {f"-{kind} {n}" for n in old_items.keys() - new_items.keys()}
    for name in old.messages.keys() & new.messages.keys():
        before = {f.name: f for f in old.messages[name].field}
        after = {f.name: f for f in new.messages[name].field}
        changes |= {f"+field {name}.{n} = {after[n].number}" for n in after.keys() - before.keys()}
        changes |= {f"-field {name}.{n} = {before[n].number}" for n in before.keys() - after.keys()}
        for n in before.keys() & after.keys():
            if _field_shape(before[n]) != _field_shape(after[n]):
                changes.add(
                    f"~field {name}.{n}: {_field_shape(before[n])} -> {_field_shape(after[n])}"
                )
    for name in old.enums.keys() & new.enums.keys():
        before = {v.name: v.number for v in old.enums[name].value}
        after = {v.name: v.number for v in new.enums[name].value}
        changes |= {f"+value {name}.{n} = {after[n]}" for n in after.keys() - before.keys()}
        changes |= {f"-value {name}.{n} = {before[n]}" for n in before.keys() - after.keys()}
        changes |= {
            f"~value {name}.{n}: {before[n]} -> {after[n]}"
            for n in before.keys() & after.keys()
            if before[n] != after[n]
        }
    for name in old.services.keys() & new.services.keys():
        before = {m.name: m for m in old.services[name].method}
        after = {m.name: m for m in new.services[name].method}
        changes |= {f"+method {name}/{n}" for n in after.keys() - before.keys()}
        changes |= {f"-method {name}/{n}" for n in before.keys() - after.keys()}
        changes |= {
            f"~method {name}/{n}"
            for n in before.keys() & after.keys()
            if before[n].SerializeToString() != after[n].SerializeToString()
        }
    return changes


def _report(problems: list[str]) -> str:
    return f"{len(problems)} difference(s):\n  " + "\n  ".join(problems)


# --- tests: schemas ----------------------------------------------------------------------

PAIRS = [
    ("NRI", "NRI 0.12.0", ("NRI 0.11.0", "NRI 0.8.0", "NRI 0.6.1")),
    ("ttrpc", "ttrpc 1.2.7", ("ttrpc 1.2.4",)),
]


def _not_sentinel(problem: str) -> bool:
    return SENTINEL not in problem and f"for {SENTINEL.rpartition('.')[2]}" not in problem


@pytest.mark.parametrize(("ours_name", "newest", "older"), PAIRS, ids=["nri", "ttrpc"])
def test_everything_of_ours_matches_upstream(
    ours_name: str, newest: str, older: tuple[str, ...]
) -> None:
    ours = OURS[ours_name]()
    problems, _ = _compare(ours, _upstream(newest), required=True)
    for label in older:
        found, _ = _compare(ours, _upstream(label), required=False)
        problems += [p for p in found if _not_sentinel(p)]
    assert not problems, _report(problems)


def test_only_the_sentinel_differs_from_older_nri() -> None:
    """The exception above is exactly the moved LAST, nothing else hides behind it."""
    ours = OURS["NRI"]()
    for label in ("NRI 0.8.0", "NRI 0.6.1"):
        found, _ = _compare(ours, _upstream(label), required=False)
        assert sorted(found) == [
            f"enum value {_P}.Event.LAST: number is 15 here, 12 in {label}",
            f"enum value {_P}.Event.UPDATE_POD_SANDBOX = 12: {label} uses 12 for LAST",
        ], found


@pytest.mark.parametrize(
    ("ours_name", "reference"),
    [("NRI", "NRI 0.8.0"), ("ttrpc", "ttrpc 1.2.7")],
    ids=["nri", "ttrpc"],
)
def test_our_types_lack_nothing_upstream_sends(ours_name: str, reference: str) -> None:
    ours = OURS[ours_name]()
    base = _upstream(reference)
    lacking = _lacking(ours, base)
    if ours_name == "NRI":
        # What we took from NRI 0.10-0.12 (types 0.8.0 does not have) is complete as of 0.12.0.
        newer = Schema("ours, added after 0.8.0")
        newer.messages = {n: m for n, m in ours.messages.items() if n not in base.messages}
        lacking += _lacking(newer, _upstream("NRI 0.12.0"))
    assert not lacking, "missing here but present upstream: " + _report(lacking)


def test_we_define_every_nri_080_type() -> None:
    ours, theirs = OURS["NRI"](), _upstream("NRI 0.8.0")
    undefined = [
        f"{kind} {name}"
        for kind, mine, upstream in (
            ("message", ours.messages, theirs.messages),
            ("enum", ours.enums, theirs.enums),
            ("service", ours.services, theirs.services),
        )
        for name in sorted(upstream.keys() - mine.keys())
    ]
    assert not undefined, "defined in NRI 0.8.0 but not in api/nri.proto: " + _report(undefined)


def test_ttrpc_types_we_leave_out() -> None:
    ours, theirs = OURS["ttrpc"](), _upstream("ttrpc 1.2.7")
    assert theirs.messages.keys() - ours.messages.keys() == {"ttrpc.StringList"}


@pytest.mark.parametrize(
    ("older", "newer", "expected"),
    [("NRI 0.6.1", "NRI 0.8.0", NRI_061_TO_080), ("ttrpc 1.2.4", "ttrpc 1.2.7", TTRPC_124_TO_127)],
    ids=["nri", "ttrpc"],
)
def test_upstream_changes_between_versions(older: str, newer: str, expected: set[str]) -> None:
    """Sanity check of docs/nri-wire.md §13.2 against the sources themselves."""
    changes = _diff(_upstream(older), _upstream(newer))
    print(f"\n{older} -> {newer}:", *sorted(changes) or ["(no change)"], sep="\n  ")
    assert changes == expected, (
        f"{older} -> {newer} differs from docs/nri-wire.md §13.2:\n"
        f"  unexpected: {sorted(changes - expected)}\n  not seen: {sorted(expected - changes)}"
    )


def _touching(changes: set[str], ours: Schema) -> set[str]:
    """The changes to what we define - types we took from the newer version, fields of our
    messages, values of our enums, methods of our services - and every removal or change
    anywhere; whole new types we do not define are left out."""
    defined = {*ours.messages, *ours.enums, *ours.services}
    kept = set()
    for change in changes:
        kind, _, rest = change.partition(" ")
        subject = rest.split(" ", 1)[0].split(":", 1)[0]
        if kind.endswith(("message", "enum", "service")):
            owner = subject
        elif kind.endswith("method"):
            owner = subject.rpartition("/")[0]
        else:  # a field or an enum value
            owner = subject.rpartition(".")[0]
        if not kind.startswith("+") or owner in defined:
            kept.add(change)
    return kept


@pytest.mark.parametrize(
    ("older", "expected"),
    [("NRI 0.8.0", NRI_080_TO_012), ("NRI 0.11.0", _NRI_011_TO_012)],
    ids=["from-0.8.0", "from-0.11.0"],
)
def test_nri_012_changes_to_what_we_define(older: str, expected: set[str]) -> None:
    """docs/nri-wire.md §13.2 for NRI 0.10-0.12 (0.8.0: containerd 2.1; 0.11.0: CRI-O 1.36)."""
    changes = _touching(_diff(_upstream(older), _upstream("NRI 0.12.0")), OURS["NRI"]())
    print(f"\n{older} -> NRI 0.12.0:", *sorted(changes) or ["(no change)"], sep="\n  ")
    assert changes == expected, (
        f"{older} -> NRI 0.12.0 differs from docs/nri-wire.md §13.2:\n"
        f"  unexpected: {sorted(changes - expected)}\n  not seen: {sorted(expected - changes)}"
    )


# --- tests: the generated code -----------------------------------------------------------


def _generated() -> dict[str, Path]:
    return {p.name: p for p in sorted(PB_DIR.glob("*_pb2.py*"))}


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """The committed gencode is exactly what `./dev proto` makes of api/*.proto now."""
    sources = [str(p.relative_to(REPO)) for p in sorted((REPO / "api").glob("*.proto"))]
    _protoc(*(arg.format(out=tmp_path) for arg in PROTOC_ARGS), *sources)
    fresh = {p.name: p for p in sorted((tmp_path / "nri_cpuplugin/nri/pb").iterdir())}
    committed = _generated()
    assert fresh.keys() == committed.keys(), "run ./dev proto: the set of generated files changed"
    stale = [n for n in fresh if fresh[n].read_bytes() != committed[n].read_bytes()]
    assert not stale, (
        f"{stale} differ from a fresh compile of api/*.proto with grpcio-tools "
        f"{metadata.version('grpcio-tools')}: run ./dev proto (with the grpcio-tools pinned in "
        "pyproject.toml) and commit the result"
    )


def test_protobuf_pins_match_the_gencode() -> None:
    """The runtime range admits the gencode's version check; grpcio-tools is the one used."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = [d for d in project["dependencies"] if re.match(r"protobuf\b", d)]
    assert len(runtime) == 1, f"expected one protobuf runtime dependency, got {runtime}"
    pin = re.fullmatch(r"protobuf>=(\d+)\.(\d+)\.(\d+),<(\d+)", runtime[0])
    assert pin, f"{runtime[0]!r}: expected protobuf>=X.Y.Z,<X+1"
    floor, ceiling = tuple(map(int, pin.groups()[:3])), int(pin.group(4))
    tools = [d for d in project["optional-dependencies"]["test"] if d.startswith("grpcio-tools==")]
    assert tools == [f"grpcio-tools=={metadata.version('grpcio-tools')}"], (
        f"test extra pins {tools}, installed grpcio-tools is {metadata.version('grpcio-tools')}"
    )
    for name, path in _generated().items():
        if name.endswith(".py"):
            call = re.search(
                r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
                path.read_text(),
            )
            assert call, f"{name}: no ValidateProtobufRuntimeVersion call found"
            gencode = tuple(map(int, call.groups()))
            assert floor >= gencode, f"{name} needs protobuf >= {gencode}, pyproject allows {floor}"
            assert ceiling == gencode[0] + 1, (
                f"{name}: protobuf {gencode[0]}.x only, not <{ceiling}"
            )


def test_generated_imports_stay_inside_the_package() -> None:
    """No generated module imports a top-level ``*_pb2`` (or ``api``): only protobuf or us."""
    for name, path in _generated().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                allowed = module in {"typing", "collections.abc"} or module.startswith(
                    ("google.protobuf", "nri_cpuplugin.nri.pb")
                )
                assert allowed, f"{name} imports {module!r}, which is outside nri_cpuplugin"


def test_generated_code_imports_without_grpc_tools() -> None:
    """Committed gencode needs only the protobuf runtime (grpc_tools blocked in a subprocess)."""
    probe = (
        "import sys\n"
        "sys.modules['grpc_tools'] = None\n"
        "sys.modules['grpc'] = None\n"
        "from nri_cpuplugin.nri.pb import nri_pb2, ttrpc_pb2, ttrpc_status_pb2\n"
        "ours = ('nri_cpuplugin.nri.pb.', 'google.protobuf.')\n"
        "bad = [m for m in sys.modules\n"
        "       if m == 'api' or (m.endswith('_pb2') and not m.startswith(ours))]\n"
        "assert not bad, f'imported as top-level modules: {bad}'\n"
        "r = ttrpc_pb2.Response(status=ttrpc_status_pb2.Status(code=12, message='method X'))\n"
        "assert ttrpc_pb2.Response.FromString(r.SerializeToString()).status.message == 'method X'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


# --- tests: bytes on the wire (docs/nri-wire.md) -------------------------------------------


def test_register_plugin_bytes() -> None:
    """nri-wire.md §6: RegisterPlugin "cpupin"/"50", payload and ttrpc Request envelope."""
    payload = nri_pb2.RegisterPluginRequest(plugin_name="cpupin", plugin_idx="50")
    assert payload.SerializeToString() == b"\x0a\x06cpupin\x12\x0250"
    envelope = ttrpc_pb2.Request(
        service="nri.pkg.api.v1alpha1.Runtime",
        method="RegisterPlugin",
        payload=payload.SerializeToString(),
    ).SerializeToString()
    assert envelope == (
        b"\x0a\x1cnri.pkg.api.v1alpha1.Runtime\x12\x0eRegisterPlugin\x1a\x0c\x0a\x06cpupin\x12\x0250"
    )
    assert len(envelope) == 0x3C  # the ttrpc header's length field in the doc's example


def test_create_container_pinning_bytes() -> None:
    """nri-wire.md §10.3: adjust(1).linux(6).resources(2).cpu(2), cpus(6) "2-3", mems(7) "0"."""
    wire = bytes.fromhex("0a0e320c120a1208 3203") + b"2-3" + bytes.fromhex("3a01") + b"0"
    response = nri_pb2.CreateContainerResponse(
        adjust=nri_pb2.ContainerAdjustment(
            linux=nri_pb2.LinuxContainerAdjustment(
                resources=nri_pb2.LinuxResources(cpu=nri_pb2.LinuxCPU(cpus="2-3", mems="0"))
            )
        )
    )
    assert response.SerializeToString() == wire
    assert nri_pb2.CreateContainerResponse.FromString(wire) == response
    wrapped = ttrpc_pb2.Response(payload=wire).SerializeToString()
    assert wrapped[:2] == b"\x12\x10" and wrapped[2:] == wire  # OK: no status field at all


def test_wire_details_from_the_doc() -> None:
    """Empty wrapper = 0 (nri-wire.md §10.1); negative timeout_nano = 10-byte varint (§3.4)."""
    cpu = nri_pb2.LinuxCPU(shares=nri_pb2.OptionalUInt64())
    assert cpu.SerializeToString() == b"\x0a\x00"
    assert nri_pb2.LinuxCPU.FromString(b"\x0a\x00").HasField("shares")
    assert not nri_pb2.LinuxCPU.FromString(b"").HasField("shares")
    request = ttrpc_pb2.Request(timeout_nano=-1)
    assert request.SerializeToString() == b"\x20" + b"\xff" * 9 + b"\x01"
    assert not ttrpc_pb2.Response.FromString(b"").HasField("status")  # Go's OK reply: empty


def test_create_container_request_decodes_012_event_requests() -> None:
    """NRI 0.12's per-event requests are {1 pod, 2 container}: CreateContainerRequest reads them."""
    pod = nri_pb2.PodSandbox(id="pod-1", name="web", uid="u-1", namespace="default")
    container = nri_pb2.Container(id="ctr-1", pod_sandbox_id="pod-1", name="app")

    def submessage(number: int, message: nri_pb2.PodSandbox | nri_pb2.Container) -> bytes:
        body = message.SerializeToString()
        assert len(body) < 0x80  # one-byte length varint keeps this hand encoding simple
        return bytes([number << 3 | 2, len(body)]) + body

    start_container_request = submessage(1, pod) + submessage(2, container)
    decoded = nri_pb2.CreateContainerRequest.FromString(start_container_request)
    assert decoded.pod == pod and decoded.container == container
    run_pod_sandbox_request = submessage(1, pod)
    decoded = nri_pb2.CreateContainerRequest.FromString(run_pod_sandbox_request)
    assert decoded.pod == pod and not decoded.HasField("container")
