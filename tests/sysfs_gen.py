"""Generate realistic sysfs CPU/NUMA trees from a compact machine description.

Topology discovery has to be right on machines we do not have (multi-socket, SNC/NPS NUMA,
AMD CCX caches, offline CPUs, kernels without NUMA), so tests describe a machine as a
:class:`MachineSpec`, write the files the kernel would show with :func:`write_sysfs`, and compare
``discover(root)`` with :func:`expected_topology`, which derives the answer from the spec alone
without reading any file.

What is mimicked, and why it matters for discovery (Documentation/ABI/*/sysfs-devices-system-cpu,
drivers/base/{cpu,node,cacheinfo,topology}.c):

* ``core_id`` restarts at 0 in every package, so it cannot identify a core machine-wide.
* Offline CPUs keep only ``cpuN/online`` ("0"); their ``topology/`` and ``cache/`` directories are
  removed, and they disappear from every sibling/shared/node list of the online CPUs.
* cpu0 has no ``online`` file (not hot-pluggable on x86).
* ``offline`` = possible - online; possible-but-absent slots (VM vCPU headroom) have no ``cpuN``.
* Without ``CONFIG_NUMA`` there is no ``devices/system/node`` at all.
* Lists use the kernel's ``%*pbl`` format and masks ``%*pb`` (32-bit hex words, most significant
  first, the first word only as wide as ``nr_cpu_ids`` needs), each with a trailing newline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.topology import CPUInfo, Topology

__all__ = [
    "MachineSpec",
    "Place",
    "cpulist",
    "expected_topology",
    "hex_mask",
    "layout",
    "write_sysfs",
]

# CONFIG_NR_CPUS of the common distribution kernels; kernel_max = NR_CPUS - 1.
NR_CPUS = 8192

# Cache sizes only need to look plausible; nothing reads them.
_L1D, _L1I, _L2, _L3_PER_CORE = "48K", "32K", "2048K", 4096  # L3 in KiB per core


@dataclass(frozen=True)
class MachineSpec:
    """A compact description of a machine's CPU layout.

    ``numa_per_socket=0`` means a kernel built without NUMA (no ``devices/system/node``).
    ``cores_per_llc=None`` means one last-level cache per socket; ``has_l3=False`` means no
    level-3 cache at all (discovery then groups by socket).  ``numbering="split"`` gives SMT
    siblings ids N and N+total_cores (Intel, most AMD BIOSes); ``"adjacent"`` gives consecutive
    ids (some ARM/POWER and VMs).  ``absent`` is the number of possible-but-not-present CPU slots
    after the real ones (hotplug headroom of a VM).  cpu0 cannot be offline (as on x86).
    """

    sockets: int = 1
    cores_per_socket: int = 8
    threads_per_core: int = 1
    dies_per_socket: int = 1
    numa_per_socket: int = 1
    cores_per_llc: int | None = None
    has_l3: bool = True
    numbering: Literal["split", "adjacent"] = "split"
    offline: frozenset[int] = field(default_factory=frozenset)
    isolated: frozenset[int] = field(default_factory=frozenset)
    absent: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offline", frozenset(self.offline))
        object.__setattr__(self, "isolated", frozenset(self.isolated))
        positive = ("sockets", "cores_per_socket", "threads_per_core", "dies_per_socket")
        for attr in positive:
            if getattr(self, attr) < 1:
                raise ValueError(f"{self.name or 'MachineSpec'}: {attr} must be >= 1")
        if self.numa_per_socket < 0 or self.absent < 0:
            raise ValueError(f"{self.name}: numa_per_socket and absent must be >= 0")
        divisors = {
            "dies_per_socket": self.dies_per_socket,
            "numa_per_socket": self.numa_per_socket or 1,
            "cores_per_llc": self.cores_per_llc or self.cores_per_socket,
        }
        for attr, divisor in divisors.items():
            if self.cores_per_socket % divisor:
                raise ValueError(
                    f"{self.name}: cores_per_socket={self.cores_per_socket} is not a multiple of "
                    f"{attr}={divisor}"
                )
        if self.numbering not in ("split", "adjacent"):
            raise ValueError(f"{self.name}: numbering must be 'split' or 'adjacent'")
        bad = sorted(c for c in self.offline | self.isolated if not 0 <= c < self.total_cpus)
        if bad:
            last = self.total_cpus - 1
            raise ValueError(f"{self.name}: CPU ids {bad} are not present (0..{last})")
        if 0 in self.offline:
            raise ValueError(f"{self.name}: cpu0 cannot be offline (it has no online file)")

    # --- sizes ----------------------------------------------------------------------------
    @property
    def total_cores(self) -> int:
        return self.sockets * self.cores_per_socket

    @property
    def total_cpus(self) -> int:
        """Present CPUs (online + offline)."""
        return self.total_cores * self.threads_per_core

    @property
    def possible_cpus(self) -> int:
        """``nr_cpu_ids``: present CPUs plus the absent hotplug slots."""
        return self.total_cpus + self.absent

    @property
    def numa_nodes(self) -> int:
        """Kernel NUMA nodes; 0 when the kernel has no NUMA support."""
        return self.sockets * self.numa_per_socket

    @property
    def online(self) -> CPUSet:
        return CPUSet(range(self.total_cpus)) - self.offline

    def cpu_id(self, socket: int, core: int, thread: int) -> int:
        """The Linux CPU id of hardware thread ``thread`` of core ``core`` (0-based within the
        socket) of socket ``socket``."""
        global_core = socket * self.cores_per_socket + core
        if self.numbering == "split":
            return thread * self.total_cores + global_core
        return global_core * self.threads_per_core + thread


@dataclass(frozen=True)
class Place:
    """Where one CPU sits, in the spec's own coordinates (everything 0-based)."""

    cpu: int
    socket: int
    die: int  # within the socket, as the kernel's die_id
    core: int  # within the socket, as the kernel's core_id
    thread: int
    node: int | None  # kernel NUMA node number; None without CONFIG_NUMA
    llc: int | None  # machine-wide LLC group index; None without an L3

    @property
    def core_key(self) -> tuple[int, int]:
        """Identifies the physical core machine-wide (core_id alone repeats per socket)."""
        return (self.socket, self.core)

    @property
    def die_key(self) -> tuple[int, int]:
        return (self.socket, self.die)

    def core_index(self, spec: MachineSpec) -> int:
        """Machine-wide index of the core: the id the kernel gives its L1/L2 cache instances."""
        return self.socket * spec.cores_per_socket + self.core


def layout(spec: MachineSpec) -> dict[int, Place]:
    """Every present CPU of ``spec`` (online or not) and where it sits."""
    cores_per_die = spec.cores_per_socket // spec.dies_per_socket
    cores_per_node = spec.cores_per_socket // (spec.numa_per_socket or 1)
    cores_per_llc = spec.cores_per_llc or spec.cores_per_socket
    llcs_per_socket = spec.cores_per_socket // cores_per_llc
    places = {}
    for socket in range(spec.sockets):
        for core in range(spec.cores_per_socket):
            for thread in range(spec.threads_per_core):
                cpu = spec.cpu_id(socket, core, thread)
                places[cpu] = Place(
                    cpu=cpu,
                    socket=socket,
                    die=core // cores_per_die,
                    core=core,
                    thread=thread,
                    node=(
                        socket * spec.numa_per_socket + core // cores_per_node
                        if spec.numa_per_socket
                        else None
                    ),
                    llc=socket * llcs_per_socket + core // cores_per_llc if spec.has_l3 else None,
                )
    assert sorted(places) == list(range(spec.total_cpus)), "cpu_id() must be a bijection"
    return places


# --- kernel text formats ----------------------------------------------------------------------


def cpulist(cpus: Iterable[int]) -> str:
    """``%*pbl`` + newline: what every ``*_list``/``cpulist``/``online`` file holds."""
    return f"{CPUSet(cpus)}\n"


def hex_mask(cpus: Iterable[int], nbits: int) -> str:
    """``%*pb`` of an ``nbits``-wide bitmap, without the newline: 32-bit words, most significant
    first, comma separated, lower-case, zero padded; the first word only as wide as needed."""
    value = 0
    for cpu in cpus:
        value |= 1 << cpu
    words = []
    for start in range(0, nbits, 32):
        digits = (min(32, nbits - start) + 3) // 4
        words.append(f"{(value >> start) & 0xFFFFFFFF:0{digits}x}")
    return ",".join(reversed(words))


class _Writer:
    """Creates each directory once: on a disk-backed temp dir a file costs ~0.3 ms, so a 256-CPU
    tree (~8000 files) is worth not doubling with mkdir calls."""

    def __init__(self) -> None:
        self._made: set[Path] = set()

    def __call__(self, path: Path, text: str) -> None:
        parent = path.parent
        if parent not in self._made:
            parent.mkdir(parents=True, exist_ok=True)
            self._made.add(parent)
        with open(path, "w") as f:
            f.write(text)


# --- the tree ---------------------------------------------------------------------------------


def write_sysfs(spec: MachineSpec, root: Path, *, extras: bool = False) -> Path:
    """Write ``devices/system/{cpu,node}`` for ``spec`` below ``root``; return ``root`` (pass it
    to ``discover``).

    By default only the files discovery may read are written (plus their deprecated aliases
    that it falls back to).  ``extras=True`` adds what a real kernel also shows but discovery
    must not depend on: hex masks of packages/dies/caches/nodes, ``cluster_*``,
    ``core_siblings*``, ``coherency_line_size``, ``has_*memory`` and the ``cpuN/nodeM`` links.
    """
    root = Path(root)
    write = _Writer()
    places = layout(spec)
    online = spec.online
    nbits = spec.possible_cpus

    def group(key) -> dict[object, CPUSet]:
        members: dict[object, set[int]] = {}
        for place in places.values():
            if place.cpu in online:
                members.setdefault(key(place), set()).add(place.cpu)
        return {k: CPUSet(v) for k, v in members.items()}

    cores = group(lambda p: p.core_key)
    dies = group(lambda p: p.die_key)
    packages = group(lambda p: p.socket)
    llcs = group(lambda p: p.llc)
    nodes = group(lambda p: p.node)

    cpu_dir = root / "devices/system/cpu"
    write(cpu_dir / "possible", cpulist(range(spec.possible_cpus)))
    write(cpu_dir / "present", cpulist(range(spec.total_cpus)))
    write(cpu_dir / "online", cpulist(online))
    write(cpu_dir / "offline", cpulist(set(range(spec.possible_cpus)) - online))
    write(cpu_dir / "isolated", cpulist(spec.isolated))
    write(cpu_dir / "kernel_max", f"{NR_CPUS - 1}\n")

    for cpu, place in sorted(places.items()):
        this = cpu_dir / f"cpu{cpu}"
        if cpu not in online:
            write(this / "online", "0\n")  # and nothing else: topology/ and cache/ are removed
            continue
        if cpu != 0:
            write(this / "online", "1\n")
        core_cpus = cores[place.core_key]
        topo = this / "topology"
        write(topo / "physical_package_id", f"{place.socket}\n")
        write(topo / "die_id", f"{place.die}\n")
        write(topo / "core_id", f"{place.core}\n")  # per package: repeats in every socket
        write(topo / "core_cpus", f"{hex_mask(core_cpus, nbits)}\n")
        write(topo / "core_cpus_list", cpulist(core_cpus))
        write(topo / "thread_siblings_list", cpulist(core_cpus))
        write(topo / "package_cpus_list", cpulist(packages[place.socket]))
        write(topo / "die_cpus_list", cpulist(dies[place.die_key]))
        if extras:
            write(topo / "cluster_id", f"{place.core_index(spec)}\n")
            for name, cpus in {
                "thread_siblings": core_cpus,
                "die_cpus": dies[place.die_key],
                "package_cpus": packages[place.socket],
            }.items():
                write(topo / name, f"{hex_mask(cpus, nbits)}\n")
            for name, cpus in {
                "cluster_cpus": core_cpus,  # x86: cluster = L2 sharing = the core here
                "core_siblings": packages[place.socket],  # deprecated name of package_cpus
            }.items():
                write(topo / name, f"{hex_mask(cpus, nbits)}\n")
                write(topo / f"{name}_list", cpulist(cpus))

        caches = [
            (1, "Data", core_cpus, place.core_index(spec), _L1D),
            (1, "Instruction", core_cpus, place.core_index(spec), _L1I),
            (2, "Unified", core_cpus, place.core_index(spec), _L2),
        ]
        if place.llc is not None:
            l3_size = f"{_L3_PER_CORE * (spec.cores_per_llc or spec.cores_per_socket)}K"
            caches.append((3, "Unified", llcs[place.llc], place.llc, l3_size))
        for index, (level, kind, shared, cache_id, size) in enumerate(caches):
            cache = this / "cache" / f"index{index}"
            write(cache / "level", f"{level}\n")
            write(cache / "type", f"{kind}\n")
            write(cache / "id", f"{cache_id}\n")
            write(cache / "size", f"{size}\n")
            write(cache / "shared_cpu_list", cpulist(shared))
            if extras:
                write(cache / "shared_cpu_map", f"{hex_mask(shared, nbits)}\n")
                write(cache / "coherency_line_size", "64\n")

    if spec.numa_per_socket:
        node_dir = root / "devices/system/node"
        all_nodes = range(spec.numa_nodes)
        write(node_dir / "possible", cpulist(all_nodes))
        write(node_dir / "online", cpulist(all_nodes))
        write(node_dir / "has_cpu", cpulist(nodes))  # nodes with an online CPU
        for node in all_nodes:
            members = nodes.get(node, CPUSet())  # online CPUs only, as node_read_cpumap()
            write(node_dir / f"node{node}" / "cpulist", cpulist(members))
            write(node_dir / f"node{node}" / "distance", f"{_distance_row(spec, node)}\n")
            if extras:
                write(node_dir / f"node{node}" / "cpumap", f"{hex_mask(members, nbits)}\n")
        if extras:
            write(node_dir / "has_memory", cpulist(all_nodes))
            write(node_dir / "has_normal_memory", cpulist(all_nodes))
            for cpu in online:  # cpuN/nodeM -> ../../node/nodeM, as register_cpu_under_node()
                node = places[cpu].node
                os.symlink(f"../../node/node{node}", cpu_dir / f"cpu{cpu}" / f"node{node}")
    return root


def _distance_row(spec: MachineSpec, node: int) -> str:
    """SLIT row: 10 local, 12 same socket, 21 remote socket."""
    socket = node // spec.numa_per_socket
    return " ".join(
        "10" if other == node else "12" if other // spec.numa_per_socket == socket else "21"
        for other in range(spec.numa_nodes)
    )


# --- the expected answer ----------------------------------------------------------------------


def expected_topology(spec: MachineSpec) -> Topology:
    """What ``discover`` must return for ``write_sysfs(spec, ...)``, derived from the spec alone.

    The rules (README.md, ``topology --json``): ``core`` is the lowest online CPU id of the
    core's hardware threads, ``l3`` the lowest online CPU id of the LLC group (of the socket when
    there is no L3), ``numa`` the kernel node number (0 without NUMA), ``socket``/``die`` the
    kernel's ids; offline CPUs have ``online=False`` and no ids; absent slots are not listed.
    """
    places = layout(spec)
    online = spec.online

    def lowest_online(same) -> dict[int, int]:
        """cpu -> lowest online cpu among those for which same(place) is equal."""
        lowest: dict[object, int] = {}
        for cpu in sorted(online):
            lowest.setdefault(same(places[cpu]), cpu)
        return {cpu: lowest[same(places[cpu])] for cpu in online}

    core_of = lowest_online(lambda p: (p.socket, p.core))
    l3_of = lowest_online(lambda p: ("llc", p.llc) if spec.has_l3 else ("socket", p.socket))
    cpus = []
    for cpu in range(spec.total_cpus):
        place = places[cpu]
        if cpu in online:
            cpus.append(
                CPUInfo(
                    id=cpu,
                    socket=place.socket,
                    die=place.die,
                    numa=place.node if place.node is not None else 0,
                    l3=l3_of[cpu],
                    core=core_of[cpu],
                    online=True,
                    isolated=cpu in spec.isolated,
                )
            )
        else:
            cpus.append(CPUInfo(cpu, None, None, None, None, None, False, cpu in spec.isolated))
    return Topology(tuple(cpus))


# --- devices (NIC locality) -------------------------------------------------------------------


def write_fake_device(
    root: Path,
    bus: str,
    name: str,
    numa_node: int | None,
    *,
    local_cpulist: Iterable[int] | None = None,
    parent: str | None = None,
) -> Path:
    """A FAKE device below a generated tree, for NIC-locality tests: ``bus/<bus>/devices/<name>``
    links to ``devices/fake-pci0000:00/[<parent>/]<name>``, as the kernel links bus entries
    into the device tree.  ``numa_node`` (None: no file; -1: "unknown") and ``local_cpulist``
    go on ``parent`` when given (a virtio NIC's node is its PCI function's), else on the device.
    Returns the device directory.  Everything written here is named "fake" so it can never be
    mistaken for a real machine's tree."""
    root = Path(root)
    write = _Writer()
    base = root / "devices" / "fake-pci0000:00"
    holder = base / parent if parent else base / name
    device = holder / name if parent else holder
    device.mkdir(parents=True, exist_ok=True)
    if numa_node is not None:
        write(holder / "numa_node", f"{numa_node}\n")
    if local_cpulist is not None:
        write(holder / "local_cpulist", cpulist(local_cpulist))
    link_dir = root / "bus" / bus / "devices"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / name
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(os.path.relpath(device, link_dir), link)
    return device


def mirror_with_nic(directory: Path, bus: str, device: str, numa_node: int) -> Path:
    """This machine's CPUs (0-1 on one NUMA node, so a runtime can apply the cpusets placed on
    it) with its NIC's ``bus``/``device`` FAKED onto ``numa_node``; the tree's root."""
    root = write_sysfs(MachineSpec(name="this-vm", cores_per_socket=2), directory)
    write_fake_device(root, bus, device, numa_node, parent="fake-0000:00:03.0")
    return root
