"""The hook's cache of the CPU topology, so that a container start does not rediscover it.

``topology.discover`` reads ~10 sysfs files per CPU: 60 ms on a 256-thread node, more than the
rest of the hook.  Within one boot the layout only changes with the online, present or isolated
sets, so the hook keeps the last result in the state directory, keyed by those (and the boot id
and the sysfs tree itself), and discovers again when any differs.  A cache: written without
fsync, and anything unreadable (torn, foreign, a FIFO, a link) is simply discovered afresh.
"""

from __future__ import annotations

import os

from ..base import files, jsonbytes
from ..base.errors import suppress
from ..core.topology import Topology, TopologyError, discover

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from typing import Any

TOPOLOGY_CACHE = "hook-topology.json"
MAX_TOPOLOGY_BYTES = 4 << 20  # ~120 bytes per CPU


def cached_topology(sysfs: str, state_dir: str, dir_fd: int) -> Topology:
    """The topology of ``sysfs``; ``dir_fd`` is the (checked) state directory's handle."""
    key = _topology_key(sysfs)
    if key is not None:
        try:
            doc = jsonbytes.loads(
                files.read_bounded(TOPOLOGY_CACHE, MAX_TOPOLOGY_BYTES, dir_fd=dir_fd)
            )
            if isinstance(doc, dict) and doc.get("key") == key:
                return Topology.from_dict(doc.get("topology"))
        except (OSError, ValueError, TopologyError):
            pass  # missing, torn or foreign: discover afresh
    topology = discover(sysfs)
    if key is not None:
        data = jsonbytes.dumps({"key": key, "topology": topology.as_dict()})
        with suppress(OSError):  # a cache: failing to write it costs only time
            files.write_atomic(state_dir, TOPOLOGY_CACHE, data, durable=False, dir_fd=dir_fd)
    return topology


def remove_stale_writes(dir_fd: int) -> None:
    """Temp files of cache writes killed before their rename.  Those writes take no lock, so
    only files a minute old go: a live write takes milliseconds."""
    files.remove_temps(dir_fd, f".{TOPOLOGY_CACHE}.", ".tmp", min_age=60.0)


def _topology_key(sysfs: str) -> dict[str, Any] | None:
    cpu_dir = os.path.join(sysfs, "devices/system/cpu")
    try:
        info = os.stat(cpu_dir)
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        lists: dict[str, str | None] = {}
        for name in ("online", "offline", "present", "isolated"):
            try:
                with open(os.path.join(cpu_dir, name)) as f:
                    lists[name] = f.read(4096).strip()
            except FileNotFoundError:
                lists[name] = None
    except OSError:
        return None  # no cache without a reliable key
    return {
        "sysfs": os.path.realpath(sysfs),
        "tree": [info.st_dev, info.st_ino, info.st_mtime_ns],
        "boot_id": boot_id,
        **lists,
    }
