"""What an OCI runtime hands a hook: the container state on stdin and the bundle's config.json.

Both are input from outside the process, so everything is bounded and checked before use:
sizes, types, the container id (it names a file of ours), the bundle path.  The Workload built
here reads Kubernetes intent exactly as ``workload.from_nri`` does (docs/cgroups-and-hooks.md
§7-§8), so the hook and the NRI plugin decide alike.
"""

from __future__ import annotations

import os

from ..base import files, jsonbytes, shape
from ..base.errors import PluginError
from ..base.value import Value
from ..core import annotation
from ..core.workload import (
    BESTEFFORT,
    Workload,
    kind_of,
    millicores_from_quota,
    millicores_from_shares,
    qos_from_cgroup_parent,
)

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, BinaryIO

# The state document is small (id, pid, bundle, annotations); Kubernetes caps a pod's
# annotations at 256 KiB, so 1 MiB leaves room and still bounds what we read.
MAX_STATE_BYTES = 1 << 20
# config.json carries env, mounts and annotations; real ones are tens of KiB.
MAX_CONFIG_BYTES = 16 << 20
MAX_PATH = 4096
MAX_NAME = 256  # pod names are <= 253 characters, uids 36
# Container ids name a record file of ours, so they are restricted to a safe file name: runc's
# own alphabet minus the oddities, never starting with a dot (no ".", "..", hidden files):
# 1-128 characters of [A-Za-z0-9_.-], the first one of [A-Za-z0-9_] (is_container_id).
_ID_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_ID_CHARS = _ID_FIRST | {".", "-"}
MAX_CONTAINER_ID = 128
MAX_PID = 1 << 22  # PID_MAX_LIMIT on 64-bit Linux

# Kubernetes identity: CRI-O copies the CRI labels into annotations; containerd's CRI plugin
# uses its own io.kubernetes.cri.* keys.  First match wins.
POD_UID_KEYS = ("io.kubernetes.pod.uid", "io.kubernetes.cri.sandbox-uid")
POD_NAME_KEYS = ("io.kubernetes.pod.name", "io.kubernetes.cri.sandbox-name")
POD_NAMESPACE_KEYS = ("io.kubernetes.pod.namespace", "io.kubernetes.cri.sandbox-namespace")
CONTAINER_NAME_KEYS = ("io.kubernetes.container.name", "io.kubernetes.cri.container-name")
CONTAINER_TYPE_KEYS = ("io.kubernetes.cri-o.ContainerType", "io.kubernetes.cri.container-type")
# kubelet's pods all live below a cgroup named kubepods (cgroupfs "kubepods", systemd
# "kubepods.slice" and its "kubepods-..." children).
KUBEPODS = "kubepods"


class InputError(PluginError, ValueError):
    """Input from the runtime that we refuse to act on; the message says what and why."""

    code = "input"


class OCIState(Value):
    """The runtime-spec "State" a hook reads from stdin."""

    id: str
    status: str
    pid: int | None
    bundle: str
    annotations: Mapping[str, str]


class OCIConfig(Value):
    """The parts of ``<bundle>/config.json`` the policy needs."""

    annotations: Mapping[str, str]
    shares: int | None
    quota: int | None
    period: int | None
    # ``linux.namespaces``: ({"type": ..., "path": ...}, ...), for the pod's network namespace
    namespaces: tuple[Mapping[str, str], ...] = ()


# --- state (stdin) ---------------------------------------------------------------------------


def read_state(stream: BinaryIO, limit: int = MAX_STATE_BYTES) -> OCIState:
    """Read and validate the state JSON; InputError if it is not a usable one."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"the container state on stdin is larger than {limit} bytes")
    return parse_state(data)


def parse_state(data: bytes) -> OCIState:
    if not data.strip():
        raise InputError("no container state on stdin (expected the OCI state JSON)")
    try:
        doc = jsonbytes.loads(data)
    except jsonbytes.DecodeError as err:
        raise InputError(f"the container state on stdin is not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise InputError("the container state on stdin is not a JSON object")
    cid = check_container_id(doc.get("id"))
    status = doc.get("status", "")
    if not isinstance(status, str) or len(status) > 64:
        raise InputError(f"state field 'status' is not a short string: {_show(status)}")
    pid = doc.get("pid")
    if pid is not None and (type(pid) is not int or not 0 <= pid <= MAX_PID):
        raise InputError(f"state field 'pid' is not a process id: {_show(pid)}")
    bundle = check_abs_path(doc.get("bundle"), "state field 'bundle'")
    return OCIState(
        id=cid,
        status=status,
        pid=pid or None,  # runc and crun send 0 or nothing when there is no process
        bundle=bundle,
        annotations=_string_map(doc, "annotations", "state field 'annotations'"),
    )


def is_container_id(text: str) -> bool:
    """Whether ``text`` is a container id we accept (a safe file name; see _ID_FIRST).  Sets,
    not a regular expression: the hook would import re for this alone."""
    return 0 < len(text) <= MAX_CONTAINER_ID and text[0] in _ID_FIRST and _ID_CHARS.issuperset(text)


def check_container_id(value: object) -> str:
    if not isinstance(value, str) or not is_container_id(value):
        raise InputError(
            f"container id {_show(value)} is not 1-128 characters of [A-Za-z0-9_.-] "
            "starting with a letter, digit or '_'"
        )
    return value


def check_abs_path(value: object, what: str) -> str:
    """An absolute, normalised path: no NUL, no '.'/'..' components, bounded length."""
    if not isinstance(value, str) or not value:
        raise InputError(f"{what} is not a path: {_show(value)}")
    if len(value) > MAX_PATH:
        raise InputError(f"{what} is longer than {MAX_PATH} characters")
    if "\0" in value:
        raise InputError(f"{what} contains a NUL byte: {_show(value)}")
    if not value.startswith("/"):
        raise InputError(f"{what} is not absolute: {_show(value)}")
    if any(part in (".", "..") for part in value.split("/")):
        raise InputError(f"{what} contains '.' or '..' components: {_show(value)}")
    return value


# --- config.json -----------------------------------------------------------------------------


def read_config(bundle: str, limit: int = MAX_CONFIG_BYTES) -> OCIConfig:
    """Read ``<bundle>/config.json`` (a regular file, not followed through a link, bounded)."""
    path = os.path.join(bundle, "config.json")
    try:
        data = files.read_bounded(path, limit)
    except files.FileError as err:
        raise InputError(str(err)) from None
    return parse_config(data, path)


def parse_config(data: bytes, path: str = "config.json") -> OCIConfig:
    try:
        doc = jsonbytes.loads(data)
    except jsonbytes.DecodeError as err:
        raise InputError(f"{path} is not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path} is not a JSON object")
    try:
        linux = _object(doc, "linux")
        cpu = _object(_object(linux, "resources"), "cpu")
        return OCIConfig(
            annotations=shape.string_map(doc, "annotations", f"{path} annotations"),
            shares=shape.integer(cpu, "shares", optional=True, minimum=0),
            quota=shape.integer(cpu, "quota", optional=True),
            period=shape.integer(cpu, "period", optional=True, minimum=0),
            namespaces=_namespaces(linux.get("namespaces"), path),
        )
    except shape.ShapeError as err:
        raise InputError(f"{path}: {err}") from None


def _namespaces(value: object, path: str) -> tuple[Mapping[str, str], ...]:
    """``linux.namespaces``: a list of {"type": str, "path": absolute path (optional)}."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > 64:
        raise InputError(f"{path}: linux.namespaces is not a list of namespaces")
    out = []
    for entry in value:
        kind = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(kind, str) or len(kind) > 64:
            raise InputError(f"{path}: linux.namespaces entry without a type: {_show(entry)}")
        ns = {"type": kind}
        if entry.get("path") is not None:
            ns["path"] = check_abs_path(entry["path"], f"{path}: linux.namespaces {kind} path")
        out.append(ns)
    return tuple(out)


# --- Kubernetes view -------------------------------------------------------------------------


def first(annotations: Mapping[str, str], keys: tuple[str, ...]) -> str:
    for key in keys:
        value = annotations.get(key)
        if value:
            return value
    return ""


def is_sandbox(annotations: Mapping[str, str]) -> bool:
    """The pod's infra ("pause") container: never placed (CRI-O does not even run hooks.d
    hooks for it, but a hook injected another way might be)."""
    return first(annotations, CONTAINER_TYPE_KEYS) == "sandbox"


def kubernetes_identity(annotations: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    """(pod uid, pod name, namespace, container name), or None when the container does not
    carry the pod uid and container name every kubelet-created container has."""
    identity = (
        first(annotations, POD_UID_KEYS),
        first(annotations, POD_NAME_KEYS),
        first(annotations, POD_NAMESPACE_KEYS),
        first(annotations, CONTAINER_NAME_KEYS),
    )
    if not identity[0] or not identity[3]:
        return None
    for value in identity:
        if len(value) > MAX_NAME or "\0" in value:
            raise InputError(f"Kubernetes identity annotation {_show(value)} is not a plain name")
    return identity


def qos_from_cgroup(cgroup_path: str) -> str:
    """QoS class from where kubelet put the pod: the container's parent cgroups.  A container
    outside kubelet's ``kubepods`` tree is not a kubelet pod and never gets exclusive CPUs (the
    NRI path treats a missing cgroup parent the same way)."""
    parents = [part for part in cgroup_path.split("/") if part][:-1]
    if not any(part.startswith(KUBEPODS) for part in parents):
        return BESTEFFORT
    return qos_from_cgroup_parent("/".join(parents))


def from_oci(
    state: OCIState, config: OCIConfig, cgroup_path: str, identity: tuple[str, str, str, str]
) -> Workload:
    """The Workload the NRI path would build for this container (``workload.from_nri``)."""
    pod_uid, pod_name, pod_namespace, container_name = identity
    return Workload(
        container_id=state.id,
        container_name=container_name,
        pod_uid=pod_uid,
        pod_name=pod_name,
        pod_namespace=pod_namespace,
        qos=qos_from_cgroup(cgroup_path),
        cpu_request_milli=millicores_from_shares(config.shares) if config.shares else 0,
        cpu_limit_milli=millicores_from_quota(config.quota, config.period),
        annotations=annotation.read(config.annotations, container_name),
        kind=kind_of(config.annotations),
        cgroup_path=cgroup_path,
    )


# --- helpers ---------------------------------------------------------------------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _object(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = doc.get(key)
    return {} if value is None else shape.obj(value, key)


def _string_map(doc: Mapping[str, Any], key: str, what: str) -> dict[str, str]:
    try:
        return shape.string_map(doc, key, what)
    except shape.ShapeError as err:
        raise InputError(str(err)) from None
