"""Named machine fixtures (kubelet cpumanager style) and helpers to materialise them.

Tests import these directly (``from topologies import NAMED, build``): pyproject.toml's pytest
``pythonpath`` puts ``tests/`` on the import path, whichever test runs and from wherever.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

from sysfs_gen import MachineSpec, expected_topology, write_sysfs

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.topology import Topology, discover

__all__ = ["NAMED", "build", "expected", "offline", "scratch_dir", "spec_of", "topology"]


def _spec(name: str, **fields) -> tuple[str, MachineSpec]:
    return name, MachineSpec(name=name, **fields)


NAMED: dict[str, MachineSpec] = dict(
    [
        # A small VM or desktop: 8 CPUs, no SMT.
        _spec("single-socket-no-smt", sockets=1, cores_per_socket=8, threads_per_core=1),
        # The node of the Kubernetes CPU Manager blog post: 2 x 12 cores x 2 threads, one NUMA
        # node per socket, siblings N and N+24.  48 CPUs.
        _spec("xeon-e5-2680v3-2s", sockets=2, cores_per_socket=12, threads_per_core=2),
        # Intel Sub-NUMA Clustering: 2 NUMA nodes per socket, LLC still socket-wide.  64 CPUs.
        _spec(
            "snc-2s-2numa", sockets=2, cores_per_socket=16, threads_per_core=2, numa_per_socket=2
        ),
        # AMD EPYC in NPS4: 4 NUMA nodes, an L3 per 8-core CCX, siblings N and N+64.  128 CPUs.
        _spec(
            "epyc-1s-4numa",
            sockets=1,
            cores_per_socket=64,
            threads_per_core=2,
            numa_per_socket=4,
            cores_per_llc=8,
        ),
        # 4 sockets x 8 cores x 2 threads.  64 CPUs.
        _spec("quad-socket", sockets=4, cores_per_socket=8, threads_per_core=2),
        # 8 cores x 2 threads; core 5 (cpus 5 and 13) hot-unplugged; isolcpus=2-3,10-11.
        # 16 present, 14 online.
        _spec(
            "offline-isolcpus",
            sockets=1,
            cores_per_socket=8,
            threads_per_core=2,
            offline={5, 13},
            isolated={2, 3, 10, 11},
        ),
        # A VM with vCPU hotplug headroom (possible 0-11, present 0-7) where cpu1 is unplugged
        # but its sibling cpu5 is online: that core's id is 5, not 1.  8 present, 7 online.
        _spec(
            "partially-offline-vm",
            sockets=1,
            cores_per_socket=4,
            threads_per_core=2,
            offline={1},
            absent=4,
        ),
        # Siblings are N and N+1 (some ARM/POWER machines and VMs).  16 CPUs.
        _spec(
            "adjacent-siblings",
            sockets=2,
            cores_per_socket=4,
            threads_per_core=2,
            numbering="adjacent",
        ),
        # CONFIG_NUMA=n and no L3: NUMA is node 0 for all, the LLC group falls back to the socket.
        # 16 CPUs.
        _spec(
            "no-numa-no-l3",
            sockets=2,
            cores_per_socket=4,
            threads_per_core=2,
            numa_per_socket=0,
            has_l3=False,
        ),
        # Multi-die packages (Cascade Lake-AP style): die_id repeats per socket, a NUMA node and
        # an L3 per die.  32 CPUs.
        _spec(
            "multi-die-2s",
            sockets=2,
            cores_per_socket=8,
            threads_per_core=2,
            dies_per_socket=2,
            numa_per_socket=2,
            cores_per_llc=4,
        ),
        # The benchmark machine: 2 x 64 cores x 2 threads, NPS4 (8 NUMA nodes), 8-core CCXs.
        # 256 CPUs.
        _spec(
            "bench-2s-256t-8numa",
            sockets=2,
            cores_per_socket=64,
            threads_per_core=2,
            numa_per_socket=4,
            cores_per_llc=8,
        ),
    ]
)


def spec_of(name_or_spec: str | MachineSpec) -> MachineSpec:
    if isinstance(name_or_spec, MachineSpec):
        return name_or_spec
    try:
        return NAMED[name_or_spec]
    except KeyError:
        raise KeyError(f"no named topology {name_or_spec!r}; known: {sorted(NAMED)}") from None


def build(name_or_spec: str | MachineSpec, tmp_path: Path) -> tuple[Path, Topology]:
    """Write the machine's sysfs tree below ``tmp_path`` and return (root, discover(root)).

    Each call gets a fresh directory, so one ``tmp_path`` can hold several machines."""
    spec = spec_of(name_or_spec)
    base = Path(tmp_path) / f"sysfs-{spec.name or 'machine'}"
    root, n = base, 1
    while root.exists():
        n += 1
        root = base.with_name(f"{base.name}-{n}")
    write_sysfs(spec, root)
    return root, discover(root)


def scratch_dir() -> str | None:
    """A tmpfs directory for throw-away trees when there is a roomy one (/dev/shm), else None
    (the system temp dir).  On a disk-backed temp dir each file costs ~0.3 ms; on tmpfs ~0.01 ms."""
    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 512 << 20:
            return shm
    except OSError:
        pass
    return None


@cache
def topology(name_or_spec: str | MachineSpec) -> Topology:
    """The discovered Topology of a machine, for tests that need no files (cached; the tree is
    written to a temporary directory and removed)."""
    with tempfile.TemporaryDirectory(prefix="sysfs-", dir=scratch_dir()) as tmp:
        return build(name_or_spec, Path(tmp))[1]


def expected(name_or_spec: str | MachineSpec) -> Topology:
    """The independently computed Topology (see sysfs_gen.expected_topology)."""
    return expected_topology(spec_of(name_or_spec))


def offline(base: Topology, cpus: str) -> Topology:
    """``base`` with ``cpus`` offline, as discover() would report it (no ids for them)."""
    gone = CPUSet.parse(cpus)
    doc = base.as_dict()
    for entry in doc["cpus"]:
        if entry["id"] in gone:
            entry.update(socket=None, die=None, numa=None, l3=None, core=None, online=False)
    return Topology.from_dict(doc)
