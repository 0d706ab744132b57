"""The hook's record of each container it places: where its cgroups are, and what the policy
reads of it.

``<state_dir>/hook-containers/<container id>.json``, one small file per container, written
under the state lock before the state commit that names the container and removed after the
commit that forgets it.  The live cgroups say whether a recorded container still runs; the
record says where its cgroup is.

Why these are not part of ``state.json``: they are the hook's only way to find the containers
that still run when the state document had to be set aside (torn, edited, foreign), and must
not share its fate.  They are written the same way - atomically, fsynced, relative to the
directory's handle, never through a link - so a crash leaves a whole record or none.
"""

from __future__ import annotations

import os

from ..base import files, jsonbytes, shape
from ..base.errors import suppress
from ..base.value import Value
from ..core import annotation
from ..core.workload import Workload
from ..hardware import cgroupfs
from ..hardware.cgroupfs import ContainerCgroups
from . import oci

RECORDS_DIR = "hook-containers"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes; annotations are filtered


class Record(Value):
    workload: Workload
    cgroups: ContainerCgroups
    # cpu.shares of its cgroup when last seen (cgroup v1; None: unknown): a later difference
    # is an in-place resize (``runc update`` runs no hook).
    shares: int | None = None


class Records:
    """The records directory below an open state directory handle (the caller holds the lock)."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.dir = os.path.join(state_dir, RECORDS_DIR)

    def _open(self, dir_fd: int, create: bool) -> int | None:
        """The records directory's handle; refused if it is a link or not a directory."""
        if create:
            with suppress(FileExistsError):
                os.mkdir(RECORDS_DIR, 0o700, dir_fd=dir_fd)
        try:
            return os.open(
                RECORDS_DIR,
                os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                dir_fd=dir_fd,
            )
        except FileNotFoundError:
            return None
        except OSError as err:
            raise _unusable(self.dir, RECORDS_DIR, dir_fd, err) from None

    def load(self, dir_fd: int) -> tuple[dict[str, Record], dict[str, str]]:
        """(records by container id, {container id: why its file is unusable})."""
        records: dict[str, Record] = {}
        problems: dict[str, str] = {}
        rec_fd = self._open(dir_fd, create=False)
        if rec_fd is None:
            return records, problems
        try:
            # Temp files of record writes killed before their rename (``.<id>.json.<hex>.tmp``):
            # records are written only under the lock the caller holds, so none is live.
            files.remove_temps(rec_fd, ".", ".tmp")
            for name in os.listdir(rec_fd):
                cid = name.removesuffix(".json")
                if not name.endswith(".json") or not oci.is_container_id(cid):
                    continue  # our temp files and anything else are not records
                try:
                    records[cid] = _decode(
                        cid, files.read_bounded(name, MAX_RECORD_BYTES, dir_fd=rec_fd)
                    )
                except (OSError, ValueError, TypeError, KeyError, cgroupfs.CgroupError) as err:
                    problems[cid] = f"record {name} is unusable and is removed: {err}"
        finally:
            os.close(rec_fd)
        return records, problems

    def write(self, dir_fd: int, record: Record) -> None:
        rec_fd = self._open(dir_fd, create=True)
        assert rec_fd is not None
        try:
            name = f"{record.workload.container_id}.json"
            files.write_atomic(self.dir, name, jsonbytes.dumps(_encode(record)), dir_fd=rec_fd)
        finally:
            os.close(rec_fd)

    def remove(self, dir_fd: int, cids: list[str]) -> None:
        if not cids:
            return
        rec_fd = self._open(dir_fd, create=False)
        if rec_fd is None:
            return
        try:
            for cid in cids:
                with suppress(FileNotFoundError):
                    os.unlink(f"{cid}.json", dir_fd=rec_fd)
        finally:
            os.close(rec_fd)


def _unusable(path: str, name: str, dir_fd: int, err: OSError) -> files.FileError:
    """Why the records directory cannot be used (a link is never followed: it could point
    anywhere, and the hook removes files in there)."""
    try:
        target = os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return files.FileError(
            f"the hook's records directory {path} is not a directory of ours "
            f"({err.strerror or err}); remove it",
            "not-regular",
            path,
        )
    return files.FileError(
        f"the hook's records directory {path} is a symbolic link (to {target[:200]!r}); "
        "nri-cpuplugin never creates one and does not follow it: remove the link (and check "
        "who made it)",
        "link",
        path,
    )


def _encode(record: Record) -> dict:
    w = record.workload
    return {
        "version": RECORD_VERSION,
        "container_id": w.container_id,
        "cpuset_cgroup": record.cgroups.cpuset,
        "cpu_cgroup": record.cgroups.cpu,
        "container_name": w.container_name,
        "pod_uid": w.pod_uid,
        "pod_name": w.pod_name,
        "pod_namespace": w.pod_namespace,
        "qos": w.qos,
        "cpu_request_milli": w.cpu_request_milli,
        "cpu_limit_milli": w.cpu_limit_milli,
        # Only what the policy reads, bounded: pods carry kilobytes of unrelated annotations
        # (a record is read by every later hook run).
        "annotations": annotation.ours(w.annotations, w.container_name),
        "kind": w.kind,
        "cpu_shares": record.shares,
    }


def _decode(cid: str, data: bytes) -> Record:
    doc = shape.obj(jsonbytes.loads(data), "record")
    if doc.get("version") != RECORD_VERSION or doc.get("container_id") != cid:
        raise ValueError("not a record of this version for this container")
    cpuset = shape.string(doc, "cpuset_cgroup")
    cpu = shape.string(doc, "cpu_cgroup", optional=True)
    cgroupfs.split_path(cpuset)
    if cpu is not None:
        cgroupfs.split_path(cpu)
    workload = Workload(
        container_id=cid,
        container_name=shape.string(doc, "container_name"),
        pod_uid=shape.string(doc, "pod_uid"),
        pod_name=shape.string(doc, "pod_name"),
        pod_namespace=shape.string(doc, "pod_namespace"),
        qos=shape.string(doc, "qos"),
        cpu_request_milli=shape.integer(doc, "cpu_request_milli"),
        cpu_limit_milli=shape.integer(doc, "cpu_limit_milli", optional=True),
        annotations=annotation.ours(
            shape.string_map(doc, "annotations"), shape.string(doc, "container_name")
        ),
        kind=shape.string(doc, "kind"),
        cgroup_path=cpuset,
    )
    shares = shape.integer(doc, "cpu_shares", optional=True, minimum=0)
    return Record(workload, ContainerCgroups(cpuset, cpu), shares)
