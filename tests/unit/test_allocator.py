"""Allocator behaviour over named topologies (kubelet cpumanager style tables) plus properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sysfs_gen import MachineSpec
from topologies import topology

from nri_cpuplugin.core.allocator import (
    ALIGN_BY_SOCKET,
    DISTRIBUTE_ACROSS_CORES,
    DISTRIBUTE_ACROSS_NUMA,
    FULL_PCPUS_ONLY,
    PREFER_ALIGN_BY_UNCORECACHE,
    AllocationError,
    Allocator,
    OptionError,
    allocate,
    reserve_by_count,
    validate_options,
)
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.topology import Topology

P = CPUSet.parse

# SMT4 with adjacent siblings (POWER9 style): 8 cores x 4 threads, 2 NUMA nodes, one L3; 32 CPUs.
# The only machine here where cores spanned and threads on shared cores tell picks apart.  Kept
# out of topologies.NAMED, whose machines each need hand-written sizes in test_topology.py.
SMT4 = MachineSpec(
    name="smt4-2numa",
    sockets=1,
    cores_per_socket=8,
    threads_per_core=4,
    numa_per_socket=2,
    numbering="adjacent",
)


def all_but(name: str | MachineSpec, taken: str) -> CPUSet:
    return topology(name).online - P(taken)


# Xeon E5-2680 v3 node: socket 0 = cores 0-11 (+24-35), socket 1 = cores 12-23 (+36-47).
# SNC: NUMA 0 = 0-7,32-39  NUMA 1 = 8-15,40-47  NUMA 2 = 16-23,48-55  NUMA 3 = 24-31,56-63.
# EPYC NPS4: NUMA n = cores 16n..16n+15; LLC groups of 8 cores: 0-7,64-71 / 8-15,72-79 / ...
# SMT4 (adjacent siblings): core k = 4k..4k+3; NUMA 0 = cores 0-3 (0-15), NUMA 1 = 16-31.

# Other containers hold one thread of many cores, as in the `allocate` reports behind rule 4.
# SNC: NUMA 0 keeps only single threads 34-39 (cores 2-7 half held, cores 0-1 wholly held);
# NUMA 1 has whole cores 9-15 and the free half 40 of core 8.  NUMA 0 is the tighter fit.
SNC_SINGLES = all_but("snc-2s-2numa", "0-8,32-33")
# Xeon: socket 0 keeps single threads 30-35 only; socket 1 is free.
XEON_SINGLES = all_but("xeon-e5-2680v3-2s", "0-11,24-29")
# EPYC NUMA 0: LLC 0 keeps single threads 64-71 only; LLC 1 has whole cores 9-15 and 72 (core 8).
EPYC_SINGLES = all_but("epyc-1s-4numa", "0-8")
# SMT4: NUMA 0 has 3 free threads on each core; NUMA 1 whole cores 5-7 and 17-19 (core 4).
SMT4_SINGLES = all_but(SMT4, "0,4,8,12,16")
CASES = [
    # (id, topology, available (None = all online), count, options, expected)
    ("one cpu: lowest id", "xeon-e5-2680v3-2s", None, 1, (), "0"),
    ("two cpus: a whole core", "xeon-e5-2680v3-2s", None, 2, (), "0,24"),
    ("three cpus: a core and a thread", "xeon-e5-2680v3-2s", None, 3, (), "0-1,24"),
    ("a socket's worth: the whole socket", "xeon-e5-2680v3-2s", None, 24, (), "0-11,24-35"),
    ("socket plus a core", "xeon-e5-2680v3-2s", None, 26, (), "0-12,24-36"),
    (
        "complete a partly used core",
        "xeon-e5-2680v3-2s",
        all_but("xeon-e5-2680v3-2s", "0"),
        1,
        (),
        "24",
    ),
    (
        "best fit: the fuller socket",
        "xeon-e5-2680v3-2s",
        all_but("xeon-e5-2680v3-2s", "0-5,24-29"),
        12,
        (),
        "6-11,30-35",
    ),
    ("whole machine", "xeon-e5-2680v3-2s", None, 48, (), "0-47"),
    ("no smt: lowest ids", "single-socket-no-smt", None, 3, (), "0-2"),
    ("snc: a socket's worth stays in one socket", "snc-2s-2numa", None, 32, (), "0-15,32-47"),
    ("snc: one numa node when it fits", "snc-2s-2numa", None, 16, (), "0-7,32-39"),
    (
        "snc: two numa nodes of one socket beat two sockets",
        "snc-2s-2numa",
        all_but("snc-2s-2numa", "0-5,32-37,16-23,48-55"),
        20,
        (),
        "6-15,38-47",
    ),
    ("epyc: one llc group for 16", "epyc-1s-4numa", None, 16, (), "0-7,64-71"),
    (
        "epyc: a whole llc group beats filling a used one",
        "epyc-1s-4numa",
        all_but("epyc-1s-4numa", "0-1,64-65"),
        16,
        (),
        "8-15,72-79",
    ),
    (
        "epyc: best fit inside the used llc group",
        "epyc-1s-4numa",
        all_but("epyc-1s-4numa", "0-3,64-67"),
        8,
        (),
        "4-7,68-71",
    ),
    ("epyc: a numa node's worth is one numa node", "epyc-1s-4numa", None, 32, (), "0-15,64-79"),
    (
        "quad socket: fill the fullest socket",
        "quad-socket",
        all_but("quad-socket", "16-22,48-54"),
        2,
        (),
        "23,55",
    ),
    (
        "offline and isolated cpus are simply not available",
        "offline-isolcpus",
        topology("offline-isolcpus").online - topology("offline-isolcpus").isolated,
        4,
        (),
        "0-1,8-9",
    ),
    ("adjacent siblings: whole core", "adjacent-siblings", None, 2, (), "0-1"),
    (
        "full-pcpus-only skips the half core",
        "xeon-e5-2680v3-2s",
        all_but("xeon-e5-2680v3-2s", "0"),
        2,
        (FULL_PCPUS_ONLY,),
        "1,25",
    ),
    (
        "distribute across numa: fits one node, packs",
        "xeon-e5-2680v3-2s",
        None,
        4,
        (DISTRIBUTE_ACROSS_NUMA,),
        "0-1,24-25",
    ),
    (
        "distribute across numa: even split in whole cores",
        "xeon-e5-2680v3-2s",
        None,
        28,
        (DISTRIBUTE_ACROSS_NUMA,),
        "0-6,12-18,24-30,36-42",
    ),
    (
        "distribute across cores: one thread per core",
        "xeon-e5-2680v3-2s",
        None,
        4,
        (DISTRIBUTE_ACROSS_CORES,),
        "0-3",
    ),
    # Whole cores before leftover threads: as few cores as the alignment allows, then best fit.
    (
        "snc singles: 5 = two whole cores and the thread completing a half-used core",
        "snc-2s-2numa",
        SNC_SINGLES,
        5,
        (),
        "9-10,40-42",
    ),
    ("snc singles: 4 = two whole cores", "snc-2s-2numa", SNC_SINGLES, 4, (), "9-10,41-42"),
    (
        "snc singles: same with the uncore cache option",
        "snc-2s-2numa",
        SNC_SINGLES,
        5,
        (PREFER_ALIGN_BY_UNCORECACHE,),
        "9-10,40-42",
    ),
    (
        "snc singles: 4 with the uncore cache option",
        "snc-2s-2numa",
        SNC_SINGLES,
        4,
        (PREFER_ALIGN_BY_UNCORECACHE,),
        "9-10,41-42",
    ),
    ("snc singles: 1 cpu still completes a core", "snc-2s-2numa", SNC_SINGLES, 1, (), "34"),
    (
        "snc singles: a numa node's worth still stays in one node",
        "snc-2s-2numa",
        SNC_SINGLES,
        15,
        (),
        "9-15,40-47",
    ),
    (
        "xeon singles: a whole core of the roomy socket",
        "xeon-e5-2680v3-2s",
        XEON_SINGLES,
        2,
        (),
        "12,36",
    ),
    ("xeon singles: 3 = a core and a thread", "xeon-e5-2680v3-2s", XEON_SINGLES, 3, (), "12-13,36"),
    (
        "epyc singles: the llc group with whole cores",
        "epyc-1s-4numa",
        EPYC_SINGLES,
        4,
        (),
        "9-10,73-74",
    ),
    ("epyc singles: 5 completes core 8", "epyc-1s-4numa", EPYC_SINGLES, 5, (), "9-10,72-74"),
    ("epyc singles: 8 = four whole cores", "epyc-1s-4numa", EPYC_SINGLES, 8, (), "9-12,73-76"),
    ("smt4 singles: 3 fit one core, tightest", SMT4, SMT4_SINGLES, 3, (), "1-3"),
    ("smt4 singles: 4 = a whole core", SMT4, SMT4_SINGLES, 4, (), "20-23"),
    (
        "smt4 singles: 6 = a whole core plus 2, not two 3/4 cores",
        SMT4,
        SMT4_SINGLES,
        6,
        (),
        "17-18,20-23",
    ),
    ("smt4 singles: 9 = two whole cores plus 1", SMT4, SMT4_SINGLES, 9, (), "17,20-27"),
    # Spilling over two nodes: whole free cores first, as kubelet's packed allocator takes them,
    # never the roomiest node whole (which splits the other node's core and takes a half core).
    # Xeon: node 0 has core 11 (11,35) free, node 1 cores 22 and 23 and the half core 45.
    (
        "spill: three whole cores, not a split core and a half core",
        "xeon-e5-2680v3-2s",
        P("11,22-23,35,45-47"),
        6,
        (),
        "11,22-23,35,46-47",
    ),
    (
        "spill: whole cores too when both nodes have a half core",
        "xeon-e5-2680v3-2s",
        P("10-11,22-23,35,45-47"),
        6,
        (),
        "11,22-23,35,46-47",
    ),
    (
        "spill: none when one node holds the request, half core and all",
        "xeon-e5-2680v3-2s",
        P("11,22-23,35,45-47"),
        5,
        (),
        "22-23,45-47",
    ),
    # SMT4: NUMA 0 has core 3 (12-15) free; NUMA 1 core 7 (28-31) and 3 threads of core 6.
    ("spill smt4: two whole cores, not three", SMT4, P("12-15,25-31"), 8, (), "12-15,28-31"),
    # EPYC NUMA 0, two LLC groups: core 7 (7,71) in the first, cores 8-9 and the half core 74
    # in the second.
    (
        "spill over llc groups: whole cores first",
        "epyc-1s-4numa",
        P("7-9,71-74"),
        6,
        (),
        "7-9,71-73",
    ),
    (
        "distribute across cores: singles are what it asks for",
        "snc-2s-2numa",
        SNC_SINGLES,
        4,
        (DISTRIBUTE_ACROSS_CORES,),
        "34-37",
    ),
    (
        "uncore cache option is accepted; packing is the default",
        "epyc-1s-4numa",
        None,
        16,
        (PREFER_ALIGN_BY_UNCORECACHE,),
        "0-7,64-71",
    ),
]


@pytest.mark.parametrize(
    ("topo", "available", "count", "options", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_allocation_table(topo, available, count, options, expected):
    t = topology(topo)
    chosen = allocate(t, t.online if available is None else available, count, options)
    assert str(chosen) == expected


def _bench_avail(free_per_numa: dict[int, int]) -> CPUSet:
    """Available CPUs on the 8-NUMA bench machine with the given free count per NUMA node
    (whole cores, lowest first)."""
    t = topology("bench-2s-256t-8numa")
    cpus: list[int] = []
    for node, cpus_of_node in t.numa_nodes.items():
        cores = sorted({t.by_id[c].core for c in cpus_of_node})
        wanted = free_per_numa.get(node, 0)
        for core in cores:
            take = sorted(t.cores[core])[: wanted - sum(1 for c in cpus if c in cpus_of_node)]
            cpus.extend(take)
    return CPUSet(cpus)


def test_align_by_socket_prefers_one_socket_over_fewer_numa_nodes():
    t = topology("bench-2s-256t-8numa")
    # Socket 0: four nodes with 18 free each (72).  Socket 1: 32 + 4 free.
    avail = _bench_avail({0: 18, 1: 18, 2: 18, 3: 18, 4: 32, 5: 4})
    numa_first = allocate(t, avail, 40)
    by_socket = allocate(t, avail, 40, [ALIGN_BY_SOCKET])
    assert {t.by_id[c].socket for c in numa_first} == {0, 1}
    assert len({t.by_id[c].numa for c in numa_first}) == 2
    assert {t.by_id[c].socket for c in by_socket} == {0}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ([FULL_PCPUS_ONLY, DISTRIBUTE_ACROSS_CORES], "cannot be used together"),
        ([DISTRIBUTE_ACROSS_NUMA, DISTRIBUTE_ACROSS_CORES], "cannot be used together"),
        ([PREFER_ALIGN_BY_UNCORECACHE, DISTRIBUTE_ACROSS_CORES], "cannot be used together"),
        ([PREFER_ALIGN_BY_UNCORECACHE, DISTRIBUTE_ACROSS_NUMA], "cannot be used together"),
        (["pin-harder"], "unknown policy option(s) pin-harder"),
    ],
)
def test_incompatible_options_rejected(options, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_options(options)


def test_align_by_socket_needs_numa_nodes_at_least_sockets():
    # CONFIG_NUMA=n on a 2-socket machine: 2 sockets, 1 NUMA node.
    with pytest.raises(OptionError, match="2 sockets and 1 NUMA nodes"):
        Allocator(topology("no-numa-no-l3"), [ALIGN_BY_SOCKET])


@pytest.mark.parametrize(
    ("available", "count", "options", "message"),
    [
        ("0-3", 5, (), "cannot allocate 5 CPUs: only 4 available (0-3)"),
        ("0-3", -1, (), "count must not be negative"),
        ("0-47", 3, (FULL_PCPUS_ONLY,), "must be a multiple of 2"),
        ("0-3,24", 4, (FULL_PCPUS_ONLY,), "only 1 whole free cores (0,24)"),
        ("0-3,99", 1, (), "CPUs 99 are not online"),
    ],
)
def test_unsatisfiable_requests_explain_themselves(available, count, options, message):
    with pytest.raises(AllocationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        allocate(topology("xeon-e5-2680v3-2s"), P(available), count, options)


@pytest.mark.parametrize("options", [(), (FULL_PCPUS_ONLY,), (DISTRIBUTE_ACROSS_NUMA,)])
def test_zero_cpus_is_the_empty_set(options):
    # As kubelet: a container that needs no exclusive CPU gets none, not an error - even when
    # nothing is free.
    t = topology("xeon-e5-2680v3-2s")
    for available in (t.online, CPUSet()):
        assert allocate(t, available, 0, options) == CPUSet()


@pytest.mark.parametrize(
    ("topo", "count", "expected"),
    [
        ("xeon-e5-2680v3-2s", 1, "0"),
        ("xeon-e5-2680v3-2s", 2, "0,24"),
        ("xeon-e5-2680v3-2s", 3, "0-1,24"),
        ("adjacent-siblings", 2, "0-1"),
        ("offline-isolcpus", 5, "0-1,4,8-9"),  # skips isolated 2-3/10-11 and offline 5
    ],
)
def test_reserve_by_count_takes_lowest_physical_cores(topo, count, expected):
    assert str(reserve_by_count(topology(topo), count)) == expected


def test_reserve_by_count_refuses_zero_and_everything():
    t = topology("single-socket-no-smt")
    with pytest.raises(AllocationError, match="at least 1"):
        reserve_by_count(t, 0)
    with pytest.raises(AllocationError, match="at least one must stay"):
        reserve_by_count(t, 8)


# --- properties over every named topology ------------------------------------------------

MACHINES = [
    "xeon-e5-2680v3-2s",
    "snc-2s-2numa",
    "epyc-1s-4numa",
    "quad-socket",
    "offline-isolcpus",
    "adjacent-siblings",
    "no-numa-no-l3",
    "multi-die-2s",
    SMT4,
]


@st.composite
def requests(draw):
    name = draw(st.sampled_from(MACHINES))
    t = topology(name)
    online = sorted(t.online)
    avail = CPUSet(draw(st.sets(st.sampled_from(online), min_size=1)))
    count = draw(st.integers(min_value=1, max_value=len(avail)))
    return t, avail, count


@settings(max_examples=300, deadline=None)
@given(requests())
def test_result_is_a_well_aligned_subset(request_):
    t, avail, count = request_
    chosen = allocate(t, avail, count)
    assert len(chosen) == count and chosen <= avail
    assert allocate(t, avail, count) == chosen  # deterministic
    for groups, attr in ((t.numa_nodes, "numa"), (t.llc_groups, "l3"), (t.sockets, "socket")):
        if any(len(g & avail) >= count for g in groups.values()):
            assert len({getattr(t.by_id[c], attr) for c in chosen}) == 1, attr


def _fewest_cores(t: Topology, cpus: set[int], count: int) -> int:
    """How few physical cores can hold ``count`` of ``cpus``: the freest cores first."""
    free = sorted((len(core & cpus) for core in t.cores.values()), reverse=True)
    total = 0
    for used, on_core in enumerate(free, start=1):
        total += on_core
        if total >= count:
            return used
    raise AssertionError("not enough CPUs")


@settings(max_examples=300, deadline=None)
@given(requests())
def test_spans_as_few_cores_as_its_alignment_allows(request_):
    # Random availability leaves many cores half held, as other containers' single threads
    # do.  Whenever one NUMA x socket x LLC part can hold the request, the result lies in one
    # such part (rules 1-3) and uses no more cores than the best such part needs (rule 4).
    t, avail, count = request_
    parts: dict[tuple, set[int]] = {}
    for cpu in avail:
        info = t.by_id[cpu]
        parts.setdefault((info.numa, info.socket, info.l3), set()).add(cpu)
    fitting = [cpus for cpus in parts.values() if len(cpus) >= count]
    if not fitting:
        return
    chosen = allocate(t, avail, count)
    assert len({(t.by_id[c].numa, t.by_id[c].socket, t.by_id[c].l3) for c in chosen}) == 1
    spanned = len({t.by_id[c].core for c in chosen})
    assert spanned == min(_fewest_cores(t, cpus, count) for cpus in fitting)


@settings(max_examples=150, deadline=None)
@given(requests())
def test_full_pcpus_only_returns_whole_cores(request_):
    t, avail, count = request_
    count = count - count % t.smt_width or t.smt_width
    try:
        chosen = allocate(t, avail, count, [FULL_PCPUS_ONLY])
    except AllocationError as err:
        whole = [c for c in t.cores.values() if c <= avail]
        assert sum(len(c) for c in whole) < count, str(err)
        return
    assert all(t.cores[t.by_id[c].core] <= chosen for c in chosen)
