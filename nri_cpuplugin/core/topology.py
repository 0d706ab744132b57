"""The machine's CPU topology, discovered from sysfs or loaded from ``topology --json`` output.

Every CPU carries the ids of the groups it belongs to: socket, die, NUMA node, last-level-cache
(LLC) group and physical core.  Kernel ids are not unique machine-wide for cores (``core_id``
restarts in every package) and may be missing for caches, so ``core`` and ``l3`` are the lowest
CPU id of the group: unique, stable across reboots, and readable by a human.

Offline CPUs have no topology directory in sysfs; they are listed with ``online=False`` and
``None`` for every group id.
"""

from __future__ import annotations

import os

from ..base.errors import PluginError
from ..base.value import Value, cached_property
from .cpuset import MAX_CPU_ID, CPUSet

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

DEFAULT_SYSFS = "/sys"


class TopologyError(PluginError):
    """The topology source is unreadable or inconsistent."""

    code = "topology"


class CPUInfo(Value):
    id: int
    socket: int | None
    die: int | None
    numa: int | None
    l3: int | None
    core: int | None
    online: bool = True
    isolated: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "socket": self.socket,
            "die": self.die,
            "numa": self.numa,
            "l3": self.l3,
            "core": self.core,
            "online": self.online,
            "isolated": self.isolated,
        }


class Topology(Value):
    """An immutable view of all CPUs; group maps are derived once and cached."""

    cpus: tuple[CPUInfo, ...]

    def __post_init__(self) -> None:
        ids = [c.id for c in self.cpus]
        if len(set(ids)) != len(ids):
            raise TopologyError("duplicate CPU ids in topology")
        if not self.online:
            raise TopologyError("topology has no online CPU")
        for cpu in self.cpus:
            if cpu.online and None in (cpu.socket, cpu.numa, cpu.l3, cpu.core):
                raise TopologyError(f"online CPU {cpu.id} lacks a socket, numa, l3 or core id")

    # --- sets -------------------------------------------------------------------------------
    @cached_property
    def by_id(self) -> dict[int, CPUInfo]:
        return {c.id: c for c in self.cpus}

    @cached_property
    def all_cpus(self) -> CPUSet:
        return CPUSet(c.id for c in self.cpus)

    @cached_property
    def online(self) -> CPUSet:
        return CPUSet(c.id for c in self.cpus if c.online)

    @cached_property
    def offline(self) -> CPUSet:
        return self.all_cpus - self.online

    @cached_property
    def isolated(self) -> CPUSet:
        return CPUSet(c.id for c in self.cpus if c.online and c.isolated)

    # --- groups (online CPUs only) ----------------------------------------------------------
    def _group(self, attr: str) -> dict[int, CPUSet]:
        groups: dict[int, set[int]] = {}
        for cpu in self.cpus:
            if cpu.online:
                groups.setdefault(getattr(cpu, attr), set()).add(cpu.id)
        return {key: CPUSet(members) for key, members in sorted(groups.items())}

    def group_ids(self, kind: str) -> dict[int, int]:
        """Each online CPU's id of one kind of group ("socket", "die", "numa", "l3", "core");
        online CPUs have them all (checked when the topology is made)."""
        return {cpu.id: getattr(cpu, kind) for cpu in self.cpus if cpu.online}

    @cached_property
    def sockets(self) -> dict[int, CPUSet]:
        return self._group("socket")

    @cached_property
    def numa_nodes(self) -> dict[int, CPUSet]:
        return self._group("numa")

    @cached_property
    def llc_groups(self) -> dict[int, CPUSet]:
        return self._group("l3")

    @cached_property
    def cores(self) -> dict[int, CPUSet]:
        return self._group("core")

    @cached_property
    def smt_width(self) -> int:
        """Hardware threads per physical core (the widest core, as kubelet's CPUsPerCore)."""
        return max(len(c) for c in self.cores.values())

    def numa_of(self, cpus: CPUSet) -> CPUSet:
        """NUMA node ids of the given CPUs (suitable for cpuset.mems)."""
        infos = [self.by_id.get(cpu) for cpu in cpus]
        return CPUSet(info.numa for info in infos if info and info.online and info.numa is not None)

    def siblings(self, cpu: int) -> CPUSet:
        """The online CPUs of ``cpu``'s physical core (KeyError for an offline or unknown CPU)."""
        core = self.by_id[cpu].core
        if core is None:
            raise KeyError(cpu)
        return self.cores[core]

    def fingerprint(self) -> str:
        """Identifies the CPU layout: a state file from a different layout must not be trusted."""
        return (
            f"online={self.online};isolated={self.isolated};smt={self.smt_width};"
            f"numa={len(self.numa_nodes)}"
        )

    # --- serialisation ----------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        return {"cpus": [c.as_dict() for c in self.cpus]}

    @classmethod
    def from_dict(cls, doc: Any) -> Topology:
        """Load ``topology --json`` output; raise TopologyError naming what is wrong."""
        if not isinstance(doc, dict) or not isinstance(doc.get("cpus"), list):
            raise TopologyError('topology JSON must be an object with a "cpus" list')
        cpus = []
        for index, entry in enumerate(doc["cpus"]):
            if not isinstance(entry, dict):
                raise TopologyError(f"topology JSON: cpus[{index}] is not an object")
            try:
                cpus.append(
                    CPUInfo(
                        id=_id_field(entry, "id", index, maximum=MAX_CPU_ID),
                        socket=_int_field(entry, "socket", index),
                        die=_int_field(entry, "die", index),
                        numa=_int_field(entry, "numa", index, maximum=MAX_CPU_ID),
                        l3=_int_field(entry, "l3", index, maximum=MAX_CPU_ID),
                        core=_int_field(entry, "core", index, maximum=MAX_CPU_ID),
                        online=_bool_field(entry, "online", index, default=True),
                        isolated=_bool_field(entry, "isolated", index, default=False),
                    )
                )
            except KeyError as missing:
                raise TopologyError(f"topology JSON: cpus[{index}] lacks {missing}") from None
        return cls(tuple(sorted(cpus, key=lambda c: c.id)))


def _int_field(entry: dict, key: str, index: int, maximum: int | None = None) -> int | None:
    """A group id of a CPU: None (an offline CPU's) or a bounded non-negative integer."""
    return None if entry[key] is None else _id_field(entry, key, index, maximum)


def _id_field(entry: dict, key: str, index: int, maximum: int | None = None) -> int:
    # ids, NUMA nodes, cores and l3 groups end up in CPUSets (all_cpus, numa_of), which reject
    # values above MAX_CPU_ID with a ValueError; bound them here so a bad document fails at load
    # with a TopologyError naming the field instead of later, elsewhere.
    value = entry[key]
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < 0
        or (maximum is not None and value > maximum)
    ):
        expected = "a non-negative integer" if maximum is None else f"an integer 0..{maximum}"
        raise TopologyError(f"topology JSON: cpus[{index}].{key} = {value!r}; expected {expected}")
    return value


def _bool_field(entry: dict, key: str, index: int, default: bool) -> bool:
    value = entry.get(key, default)
    if not isinstance(value, bool):
        raise TopologyError(f"topology JSON: cpus[{index}].{key} = {value!r}; expected a boolean")
    return value


# --- sysfs discovery ------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise TopologyError(f"cannot read {path}: {err.strerror}") from err


def _read_cpulist(path: Path) -> CPUSet | None:
    """The CPUs a sysfs file lists, or None when there is no such file."""
    text = _read(path)
    if text is None:
        return None
    try:
        return CPUSet.parse(text)
    except ValueError as err:
        raise TopologyError(f"{path}: {err}") from err


def _cpulist_or(path: Path, default: CPUSet) -> CPUSet:
    found = _read_cpulist(path)
    return default if found is None else found


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise TopologyError(f"{path}: expected an integer, found {text.strip()!r}") from None


def discover(sysfs: str | os.PathLike[str] = DEFAULT_SYSFS) -> Topology:
    """Read the CPU topology below a sysfs root (``/sys`` or a generated test tree)."""
    from pathlib import Path  # here: the OCI hook reads a cached topology, without pathlib

    root = Path(sysfs)
    cpu_dir = root / "devices/system/cpu"
    online, offline, isolated = _cpu_sets(root, cpu_dir)
    numa_of = _numa_map(root, online)
    groups = {
        cpu: _socket_die_core(cpu_dir / f"cpu{cpu}" / "topology", cpu, online)
        for cpu in sorted(online)
    }
    socket_first_cpu: dict[int, int] = {}
    for cpu, (socket, _die, _core) in groups.items():
        socket_first_cpu.setdefault(socket, cpu)
    infos = [
        CPUInfo(
            id=cpu,
            socket=socket,
            die=die,
            numa=numa_of.get(cpu, 0),
            l3=_llc_group(cpu_dir / f"cpu{cpu}" / "cache", cpu, online, socket_first_cpu[socket]),
            core=core,
            online=True,
            isolated=cpu in isolated,
        )
        for cpu, (socket, die, core) in groups.items()
    ]
    infos.extend(
        CPUInfo(cpu, None, None, None, None, None, online=False, isolated=cpu in isolated)
        for cpu in sorted(offline)
    )
    return Topology(tuple(sorted(infos, key=lambda c: c.id)))


def _cpu_sets(root: Path, cpu_dir: Path) -> tuple[CPUSet, CPUSet, CPUSet]:
    """The online, offline and isolated CPUs."""
    online = _read_cpulist(cpu_dir / "online")
    if online is None:
        raise TopologyError(
            f"{cpu_dir / 'online'} not found: is {root} a sysfs root? (use --sysfs to choose one)"
        )
    offline = _cpulist_or(cpu_dir / "offline", CPUSet())
    present = _cpulist_or(cpu_dir / "present", online)
    # "offline" also lists ids beyond the present CPUs (up to NR_CPUS); keep only real CPUs.
    offline = (offline & present) - online
    # isolated may hold a placeholder on some kernels; unparsable means "none".
    try:
        isolated = _cpulist_or(cpu_dir / "isolated", CPUSet())
    except TopologyError:
        isolated = CPUSet()
    return online, offline, isolated


def _socket_die_core(topo: Path, cpu: int, online: CPUSet) -> tuple[int, int, int]:
    """An online CPU's socket and die ids (0 when the kernel has none) and its core group."""
    socket = _read_int(topo / "physical_package_id")
    die = _read_int(topo / "die_id")
    core_cpus = (
        _read_cpulist(topo / "core_cpus_list")
        or _read_cpulist(topo / "thread_siblings_list")
        or CPUSet([cpu])
    )
    return (
        0 if socket is None or socket < 0 else socket,
        0 if die is None or die < 0 else die,
        min((core_cpus & online) | {cpu}),
    )


def _llc_group(cache_dir: Path, cpu: int, online: CPUSet, socket_group: int) -> int:
    """The lowest online CPU sharing this CPU's level-3 cache; a CPU without one counts its
    socket as its LLC group."""
    llc = _llc_cpus(cache_dir)
    return socket_group if llc is None else min((llc & online) | {cpu})


def _numa_map(root: Path, online: CPUSet) -> dict[int, int]:
    """CPU -> NUMA node from node*/cpulist; a kernel without NUMA means node 0 for all."""
    node_dir = root / "devices/system/node"
    mapping: dict[int, int] = {}
    if node_dir.is_dir():
        for entry in sorted(node_dir.iterdir()):
            name = entry.name
            if not (name.startswith("node") and name[4:].isdigit()):
                continue
            for cpu in _cpulist_or(entry / "cpulist", CPUSet()):
                mapping[cpu] = int(name[4:])
    return mapping


def _llc_cpus(cache_dir: Path) -> CPUSet | None:
    """CPUs sharing this CPU's level-3 unified cache, or None when it has none."""
    if not cache_dir.is_dir():
        return None
    for index in sorted(cache_dir.glob("index*")):
        level = _read_int(index / "level")
        kind = (_read(index / "type") or "").strip()
        if level == 3 and kind in ("Unified", ""):
            return _read_cpulist(index / "shared_cpu_list")
    return None
