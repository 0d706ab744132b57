"""Topology discovery over generated sysfs trees of named machines, plus this machine's /sys.

Every named machine is checked against ``expected_topology`` (derived from the spec alone) and
against hand-written numbers, so a bug shared by the generator and the expectation still shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sysfs_gen import MachineSpec, expected_topology, hex_mask, write_sysfs
from topologies import NAMED, build, scratch_dir, spec_of, topology

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.topology import Topology, TopologyError, discover


@dataclass(frozen=True)
class Machine:
    spec: MachineSpec
    root: Path
    topo: Topology


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Trees shared by the tests of this module: on tmpfs when possible (a 256-CPU tree is
    ~8000 files, seconds on a disk-backed temp dir)."""
    fast = scratch_dir()
    if fast is None:
        yield tmp_path_factory.mktemp("sysfs")
        return
    path = Path(tempfile.mkdtemp(prefix="nri-topology-", dir=fast))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fast_tmp(scratch: Path) -> Path:
    """A fresh directory for a tree that a test will modify."""
    return Path(tempfile.mkdtemp(dir=scratch))


@pytest.fixture(scope="module", params=sorted(NAMED))
def machine(request: pytest.FixtureRequest, scratch: Path) -> Machine:
    spec = NAMED[request.param]
    root, topo = build(spec, scratch)
    return Machine(spec, root, topo)


# --- every named machine --------------------------------------------------------------------

# Written by hand from the fixture descriptions, not computed:
# present, online, sockets, NUMA nodes, LLC groups, physical cores with an online thread, SMT.
SIZES = {
    "single-socket-no-smt": (8, 8, 1, 1, 1, 8, 1),
    "xeon-e5-2680v3-2s": (48, 48, 2, 2, 2, 24, 2),
    "snc-2s-2numa": (64, 64, 2, 4, 2, 32, 2),
    "epyc-1s-4numa": (128, 128, 1, 4, 8, 64, 2),
    "quad-socket": (64, 64, 4, 4, 4, 32, 2),
    "offline-isolcpus": (16, 14, 1, 1, 1, 7, 2),
    "partially-offline-vm": (8, 7, 1, 1, 1, 4, 2),
    "adjacent-siblings": (16, 16, 2, 2, 2, 8, 2),
    "no-numa-no-l3": (16, 16, 2, 1, 2, 8, 2),
    "multi-die-2s": (32, 32, 2, 4, 4, 16, 2),
    "bench-2s-256t-8numa": (256, 256, 2, 8, 16, 128, 2),
}


def test_every_named_machine_has_hand_written_sizes() -> None:
    assert set(SIZES) == set(NAMED)


def test_sizes(machine: Machine) -> None:
    t = machine.topo
    got = (
        len(t.cpus),
        len(t.online),
        len(t.sockets),
        len(t.numa_nodes),
        len(t.llc_groups),
        len(t.cores),
        t.smt_width,
    )
    assert got == SIZES[machine.spec.name]


def test_discover_matches_independent_expectation(machine: Machine) -> None:
    got, want = machine.topo, expected_topology(machine.spec)
    # Aspect by aspect first, so that a failure says which one is wrong.
    assert got.online == want.online
    assert got.offline == want.offline
    assert got.isolated == want.isolated
    assert got.sockets == want.sockets
    assert got.numa_nodes == want.numa_nodes
    assert got.llc_groups == want.llc_groups
    assert got.cores == want.cores
    assert got.smt_width == want.smt_width == machine.spec.threads_per_core
    for have, expect in zip(got.cpus, want.cpus, strict=True):
        assert have == expect
    assert got == want


def test_groups_partition_online_cpus_and_are_keyed_by_their_lowest_cpu(machine: Machine) -> None:
    t = machine.topo
    for name in ("sockets", "numa_nodes", "llc_groups", "cores"):
        groups = getattr(t, name)
        assert sum(len(g) for g in groups.values()) == len(t.online), name
        assert CPUSet().union(*groups.values()) == t.online, name
    for key, members in {**t.cores, **t.llc_groups}.items():
        assert key == min(members)
    for members in t.cores.values():  # a core never straddles a socket, node or LLC
        for attr in ("socket", "die", "numa", "l3"):
            assert len({getattr(t.by_id[c], attr) for c in members}) == 1, attr


def test_core_ids_unique_machine_wide_although_core_id_repeats_per_socket(
    machine: Machine,
) -> None:
    spec, t = machine.spec, machine.topo
    cpu_dir = machine.root / "devices/system/cpu"
    raw = {c: int((cpu_dir / f"cpu{c}/topology/core_id").read_text()) for c in t.online}
    # The kernel's core_id restarts in every package...
    assert set(raw.values()) <= set(range(spec.cores_per_socket))
    if spec.sockets > 1:
        assert len(set(raw.values())) < len(t.cores)
    # ...but ours names one physical core machine-wide: same id <=> same (socket, core_id).
    physical = {(t.by_id[c].socket, raw[c]) for c in t.online}
    assert len(t.cores) == len(physical)
    for cpu in t.online:
        for other in t.online:
            same_core = t.by_id[cpu].core == t.by_id[other].core
            assert same_core == (
                (t.by_id[cpu].socket, raw[cpu]) == (t.by_id[other].socket, raw[other])
            )


def test_offline_cpus_are_listed_without_ids(machine: Machine) -> None:
    t = machine.topo
    assert t.offline == CPUSet(machine.spec.offline)
    for cpu in t.offline:
        info = t.by_id[cpu]
        assert not info.online
        assert (info.socket, info.die, info.numa, info.l3, info.core) == (None,) * 5
    grouped = CPUSet().union(*t.cores.values(), *t.sockets.values(), *t.numa_nodes.values())
    assert not grouped & t.offline


def test_round_trip_through_json(machine: Machine) -> None:
    t = machine.topo
    assert Topology.from_dict(t.as_dict()) == t
    assert Topology.from_dict(json.loads(json.dumps(t.as_dict()))) == t


def test_extra_kernel_files_do_not_change_discovery(machine: Machine, scratch: Path) -> None:
    root = write_sysfs(machine.spec, Path(tempfile.mkdtemp(dir=scratch)), extras=True)
    assert discover(root) == machine.topo


def test_cached_topology_helper_agrees(machine: Machine) -> None:
    assert topology(machine.spec.name) == machine.topo


# --- spot checks, by hand -------------------------------------------------------------------

SPOT = [
    # machine, cpu, its siblings, its socket's CPUs, its NUMA node's CPUs, its LLC group
    ("single-socket-no-smt", 3, "3", "0-7", "0-7", "0-7"),
    ("xeon-e5-2680v3-2s", 0, "0,24", "0-11,24-35", "0-11,24-35", "0-11,24-35"),
    ("xeon-e5-2680v3-2s", 36, "12,36", "12-23,36-47", "12-23,36-47", "12-23,36-47"),
    ("snc-2s-2numa", 40, "8,40", "0-15,32-47", "8-15,40-47", "0-15,32-47"),
    ("snc-2s-2numa", 31, "31,63", "16-31,48-63", "24-31,56-63", "16-31,48-63"),
    ("epyc-1s-4numa", 64, "0,64", "0-127", "0-15,64-79", "0-7,64-71"),
    ("epyc-1s-4numa", 127, "63,127", "0-127", "48-63,112-127", "56-63,120-127"),
    ("quad-socket", 57, "25,57", "24-31,56-63", "24-31,56-63", "24-31,56-63"),
    ("offline-isolcpus", 4, "4,12", "0-4,6-12,14-15", "0-4,6-12,14-15", "0-4,6-12,14-15"),
    ("partially-offline-vm", 5, "5", "0,2-7", "0,2-7", "0,2-7"),
    ("adjacent-siblings", 9, "8-9", "8-15", "8-15", "8-15"),
    ("no-numa-no-l3", 12, "4,12", "4-7,12-15", "0-15", "4-7,12-15"),
    ("multi-die-2s", 21, "5,21", "0-7,16-23", "4-7,20-23", "4-7,20-23"),
    ("bench-2s-256t-8numa", 200, "72,200", "64-127,192-255", "64-79,192-207", "72-79,200-207"),
    ("bench-2s-256t-8numa", 255, "127,255", "64-127,192-255", "112-127,240-255", "120-127,248-255"),
]


@pytest.mark.parametrize(("name", "cpu", "siblings", "socket", "node", "llc"), SPOT)
def test_spot_checks(name: str, cpu: int, siblings: str, socket: str, node: str, llc: str) -> None:
    t = topology(name)
    info = t.by_id[cpu]
    assert str(t.siblings(cpu)) == siblings
    assert info.core == min(CPUSet.parse(siblings))
    assert str(t.sockets[info.socket]) == socket
    assert str(t.numa_nodes[info.numa]) == node
    assert str(t.llc_groups[info.l3]) == llc
    assert info.l3 == min(CPUSet.parse(llc))


def test_offline_isolcpus_sets() -> None:
    t = topology("offline-isolcpus")
    assert (str(t.online), str(t.offline), str(t.isolated)) == (
        "0-4,6-12,14-15",
        "5,13",
        "2-3,10-11",
    )
    assert 5 not in t.cores and t.siblings(4) == CPUSet([4, 12])


def test_partially_offline_core_is_named_by_its_online_thread() -> None:
    t = topology("partially-offline-vm")
    assert t.by_id[5].core == 5 and t.siblings(5) == CPUSet([5])
    assert t.smt_width == 2  # the widest core, as kubelet's CPUsPerCore
    assert t.all_cpus == CPUSet(range(8))  # absent hotplug slots 8-11 are not CPUs


def test_multi_die_ids_are_per_package() -> None:
    t = topology("multi-die-2s")
    assert [t.by_id[c].die for c in (0, 4, 8, 12, 16, 20)] == [0, 1, 0, 1, 0, 1]


def test_numa_numbering_is_the_kernel_node_number() -> None:
    assert list(topology("bench-2s-256t-8numa").numa_nodes) == list(range(8))
    assert topology("no-numa-no-l3").numa_of(CPUSet([3, 12])) == CPUSet([0])
    assert topology("snc-2s-2numa").numa_of(CPUSet([0, 40, 63])) == CPUSet([0, 1, 3])


# --- degraded and hostile sysfs trees -------------------------------------------------------


def test_older_kernel_without_core_cpus_list_and_die_id(fast_tmp: Path) -> None:
    """Before ~5.3 only thread_siblings_list existed; before 5.2 there was no die_id."""
    root, _ = build("adjacent-siblings", fast_tmp)
    for cpu_dir in (root / "devices/system/cpu").glob("cpu[0-9]*"):
        for name in ("core_cpus_list", "core_cpus", "die_id"):
            (cpu_dir / "topology" / name).unlink(missing_ok=True)
    assert discover(root) == expected_topology(NAMED["adjacent-siblings"])


def test_offline_file_with_unmerged_ranges_and_ids_beyond_present(fast_tmp: Path) -> None:
    """The ABI document's example shape: adjacent unmerged ranges and ids up to NR_CPUS-1."""
    root, _ = build("partially-offline-vm", fast_tmp)
    (root / "devices/system/cpu/offline").write_text("1,8-11,12-8191\n")
    assert discover(root) == expected_topology(NAMED["partially-offline-vm"])


@pytest.mark.parametrize("content", ["(null)\n", "none\n", "0-3 garbage\n", "3-1\n"])
def test_unparsable_isolated_is_treated_as_empty(fast_tmp: Path, content: str) -> None:
    root, _ = build("offline-isolcpus", fast_tmp)
    (root / "devices/system/cpu/isolated").write_text(content)
    t = discover(root)
    assert t.isolated == CPUSet()
    assert t.online == NAMED["offline-isolcpus"].online


def test_missing_isolated_file_is_empty(fast_tmp: Path) -> None:
    root, _ = build("single-socket-no-smt", fast_tmp)
    (root / "devices/system/cpu/isolated").unlink()
    assert discover(root).isolated == CPUSet()


@pytest.mark.parametrize("content", ["0-3,x\n", "0-\n", "3-1\n", "0, 1\n"])
def test_malformed_online_file_is_a_topology_error_quoting_the_file(
    fast_tmp: Path, content: str
) -> None:
    root, _ = build("single-socket-no-smt", fast_tmp)
    online = root / "devices/system/cpu/online"
    online.write_text(content)
    with pytest.raises(TopologyError) as err:
        discover(root)
    assert str(online) in str(err.value)
    assert repr(content) in str(err.value)


def test_empty_online_file_is_a_topology_error(fast_tmp: Path) -> None:
    root, _ = build("single-socket-no-smt", fast_tmp)
    (root / "devices/system/cpu/online").write_text("\n")
    with pytest.raises(TopologyError, match="no online CPU"):
        discover(root)


@pytest.mark.parametrize("layout", ["empty", "missing", "file"])
def test_non_sysfs_root_is_a_clear_topology_error(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "not-sysfs"
    if layout == "empty":
        root.mkdir()
    elif layout == "file":
        root.write_text("hello\n")
    with pytest.raises(TopologyError) as err:
        discover(root)
    message = str(err.value)
    assert f"{root / 'devices/system/cpu/online'} not found" in message
    assert "sysfs root" in message and "--sysfs" in message


# --- the generator itself -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "nbits", "text"),
    [
        ({0}, 2, "1"),  # what a 2-CPU machine shows in core_cpus
        ({0, 1}, 2, "3"),
        (set(), 8, "00"),
        ({0}, 48, "0000,00000001"),
        (range(32, 48), 48, "ffff,00000000"),
        ({0, 63}, 64, "80000000,00000001"),
        ({64}, 65, "1,00000000,00000000"),
    ],
)
def test_hex_mask_matches_kernel_bitmap_format(cpus, nbits: int, text: str) -> None:
    assert hex_mask(cpus, nbits) == text


def test_generated_files_follow_kernel_conventions(scratch: Path) -> None:
    spec = NAMED["offline-isolcpus"]
    root = write_sysfs(spec, Path(tempfile.mkdtemp(dir=scratch)), extras=True)
    cpu_dir = root / "devices/system/cpu"
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            text = path.read_text()
            assert text.endswith("\n") and "\n" not in text[:-1], path
    assert (cpu_dir / "online").read_text() == "0-4,6-12,14-15\n"
    assert (cpu_dir / "offline").read_text() == "5,13\n"
    assert (cpu_dir / "isolated").read_text() == "2-3,10-11\n"
    assert not (cpu_dir / "cpu0/online").exists()
    assert (cpu_dir / "cpu1/online").read_text() == "1\n"
    assert sorted(p.name for p in (cpu_dir / "cpu5").iterdir()) == ["online"]
    assert (cpu_dir / "cpu5/online").read_text() == "0\n"
    # siblings and shared lists of online CPUs no longer mention the offline ones
    assert (cpu_dir / "cpu4/cache/index3/shared_cpu_list").read_text() == "0-4,6-12,14-15\n"
    assert (root / "devices/system/node/node0/cpulist").read_text() == "0-4,6-12,14-15\n"
    for cpu in spec.online:
        topo = cpu_dir / f"cpu{cpu}/topology"
        for mask, listed in [
            (topo / "core_cpus", topo / "core_cpus_list"),
            (topo / "package_cpus", topo / "package_cpus_list"),
            (cpu_dir / f"cpu{cpu}/cache/index3/shared_cpu_map", None),
        ]:
            listed = listed or mask.with_name("shared_cpu_list")
            bits = int(mask.read_text().strip().replace(",", ""), 16)
            assert CPUSet(i for i in range(bits.bit_length()) if bits >> i & 1) == CPUSet.parse(
                listed.read_text()
            )
    assert (cpu_dir / "cpu0/node0").resolve() == (root / "devices/system/node/node0").resolve()
    assert (cpu_dir / "cpu0/cache/index0/type").read_text() == "Data\n"
    assert (root / "devices/system/node/node0/distance").read_text() == "10\n"


def test_generated_tree_without_numa_has_no_node_directory(scratch: Path) -> None:
    root = write_sysfs(NAMED["no-numa-no-l3"], Path(tempfile.mkdtemp(dir=scratch)))
    assert not (root / "devices/system/node").exists()
    assert not (root / "devices/system/cpu/cpu0/cache/index3").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cores_per_socket": 6, "numa_per_socket": 4}, "not a multiple of numa_per_socket"),
        ({"cores_per_socket": 12, "cores_per_llc": 8}, "not a multiple of cores_per_llc"),
        ({"offline": {0}}, "cpu0 cannot be offline"),
        ({"isolated": {8}}, "not present"),
        ({"numbering": "zigzag"}, "numbering"),
        ({"sockets": 0}, "sockets must be >= 1"),
    ],
)
def test_machine_spec_rejects_impossible_machines(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        MachineSpec(**fields)


def test_spec_of_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="xeon-e5-2680v3-2s"):
        spec_of("no-such-machine")


# --- from_dict validation -------------------------------------------------------------------

GOOD = {"id": 0, "socket": 0, "die": 0, "numa": 0, "l3": 0, "core": 0, "online": True}
OFF = {
    "id": 1,
    "socket": None,
    "die": None,
    "numa": None,
    "l3": None,
    "core": None,
    "online": False,
}


def _without(entry: dict, key: str) -> dict:
    return {k: v for k, v in entry.items() if k != key}


BAD_DOCS = [
    ("top-level list", [GOOD], '"cpus" list'),
    ("cpus not a list", {"cpus": {"0": GOOD}}, '"cpus" list'),
    ("no cpus key", {"cpu": [GOOD]}, '"cpus" list'),
    ("entry not an object", {"cpus": [GOOD, 1]}, "cpus[1] is not an object"),
    ("missing id", {"cpus": [_without(GOOD, "id")]}, "cpus[0] lacks 'id'"),
    ("missing core", {"cpus": [_without(GOOD, "core")]}, "cpus[0] lacks 'core'"),
    ("null id", {"cpus": [{**GOOD, "id": None}]}, "cpus[0].id = None"),
    ("negative socket", {"cpus": [{**GOOD, "socket": -1}]}, "cpus[0].socket = -1"),
    ("string numa", {"cpus": [{**GOOD, "numa": "0"}]}, "cpus[0].numa = '0'"),
    ("bool core", {"cpus": [{**GOOD, "core": True}]}, "cpus[0].core = True"),
    ("float l3", {"cpus": [{**GOOD, "l3": 0.0}]}, "cpus[0].l3 = 0.0"),
    ("huge id", {"cpus": [GOOD, {**OFF, "id": 10**9}]}, "cpus[1].id = 1000000000"),
    ("huge numa", {"cpus": [{**GOOD, "numa": 10**9}]}, "cpus[0].numa = 1000000000"),
    ("online not bool", {"cpus": [{**GOOD, "online": "yes"}]}, "cpus[0].online = 'yes'"),
    ("isolated not bool", {"cpus": [{**GOOD, "isolated": 1}]}, "cpus[0].isolated = 1"),
    ("duplicate ids", {"cpus": [GOOD, GOOD]}, "duplicate CPU ids"),
    ("empty", {"cpus": []}, "no online CPU"),
    ("only offline", {"cpus": [OFF]}, "no online CPU"),
    ("online without socket", {"cpus": [{**GOOD, "socket": None}]}, "online CPU 0 lacks"),
]


@pytest.mark.parametrize(
    ("doc", "message"), [b[1:] for b in BAD_DOCS], ids=[b[0] for b in BAD_DOCS]
)
def test_from_dict_rejects_bad_documents_naming_the_field(doc, message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        Topology.from_dict(doc)


def test_from_dict_defaults_and_order() -> None:
    doc = {"cpus": [OFF, _without(GOOD, "online")]}  # unsorted; online/isolated optional
    t = Topology.from_dict(doc)
    assert [c.id for c in t.cpus] == [0, 1]
    assert t.by_id[0].online and not t.by_id[0].isolated
    assert t.offline == CPUSet([1])


# --- this machine ---------------------------------------------------------------------------

REAL_ONLINE = Path("/sys/devices/system/cpu/online")


@pytest.mark.skipif(not REAL_ONLINE.exists(), reason="no sysfs on this machine")
def test_real_sysfs() -> None:
    t = discover("/sys")
    online = CPUSet.parse(REAL_ONLINE.read_text())
    assert t.online == online
    assert CPUSet(os.sched_getaffinity(0)) <= online  # a cgroup/affinity may narrow it
    if "PYTHON_CPU_COUNT" not in os.environ:  # glibc counts /sys/devices/system/cpu/online
        assert os.cpu_count() == len(online)
    assert CPUSet().union(*t.cores.values()) == online
    assert 1 <= t.smt_width <= len(online)
    assert Topology.from_dict(json.loads(json.dumps(t.as_dict()))) == t
