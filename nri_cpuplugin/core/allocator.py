"""Topology-aware best-fit choice of exclusive CPUs: (topology, available, count, options) -> set.

How a choice is made
--------------------
The machine is seen as a tree of nested groups.  By default the levels are

    NUMA node  >  socket  >  last-level-cache (LLC) group  >  physical core  >  hardware thread

(with ``align-by-socket`` the socket is the top level).  Each tree node is the *intersection* of
the groups on its path, so the tree nests even on machines whose groups do not (an LLC that
spans two sub-NUMA clusters, a NUMA node that spans two sockets).

A request for ``n`` CPUs descends the tree.  At every group it asks: how few children can hold
``n`` free CPUs?  If one child can, each child that fits is tried (recursively) and the best
result is kept.  If several are needed, the smallest possible number of children is used,
filled two ways, both scored: the roomiest taken whole and the remainder placed, recursively,
in the last one; or their whole free cores taken first, as kubelet's packed allocator does, and
the threads left over placed in one of them.  Below an LLC group, whole free cores are taken
first, then single threads, preferring threads that complete a core that is already partly used.

Candidates are compared by a score, lowest wins, in this order:

1. NUMA nodes spanned (sockets first with ``align-by-socket``),
2. sockets spanned,
3. LLC groups spanned,
4. physical cores spanned, then threads on cores the container does not have to itself: for a
   given count, the fewer cores, the more of them are wholly this container's, so the fewer
   of its threads have another tenant (another container now, or later on a sibling left
   free) on their core.  With two threads per core the second measure follows from the
   first; with four it tells one whole core plus one thread (one thread shared) from three
   3/4-free cores.  Without this rule a NUMA node holding only single free threads beside
   other containers' threads would win by best fit (rule 6) over a roomier node with whole
   free cores,
5. cores left partly used (touched by this request but with free threads remaining): among
   picks spanning equally many cores, complete a half-used core rather than open a new one,
6. best fit: free CPUs remaining in the NUMA nodes, then the LLC groups, we touched (a tight
   fit keeps other nodes whole for later, larger requests),
7. the lowest CPU ids, so the result is deterministic.

Rules 4 and 5 only ever choose between candidates that rules 1-3 rank equal, so a request that
fits one NUMA node (one LLC group) still gets one.  With ``distribute-cpus-across-cores`` they
are off: spreading over cores is what was asked for.

This is never worse aligned than kubelet's static policy, whose order (whole sockets, whole
cores, then threads on the fullest socket) is a special case of the same preferences.

Options use kubelet's names and meanings:

* ``full-pcpus-only``: only whole free cores; the count must be a multiple of the SMT width.
* ``distribute-cpus-across-numa``: a request that needs more than one NUMA node is split
  evenly over the fewest nodes that can hold equal shares (in whole-core units where possible).
* ``align-by-socket``: minimise sockets before NUMA nodes.
* ``distribute-cpus-across-cores``: one thread per core before a second thread of any core.
* ``prefer-align-cpus-by-uncorecache``: accepted; LLC packing is always on here (rule 3).
* ``strict-cpu-reservation``: a pool rule (reserved CPUs leave the shared pool); see policy.py.

Incompatible combinations are refused as kubelet refuses them.
"""

from __future__ import annotations

from itertools import accumulate, combinations
from math import comb

from ..base.errors import PluginError
from .cpuset import CPUSet
from .topology import Topology

TYPE_CHECKING = False  # collections.abc is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    Plans = dict[tuple[int, int], frozenset[int]]  # (a child's first CPU, count) -> its pick

FULL_PCPUS_ONLY = "full-pcpus-only"
DISTRIBUTE_ACROSS_NUMA = "distribute-cpus-across-numa"
ALIGN_BY_SOCKET = "align-by-socket"
DISTRIBUTE_ACROSS_CORES = "distribute-cpus-across-cores"
PREFER_ALIGN_BY_UNCORECACHE = "prefer-align-cpus-by-uncorecache"
STRICT_CPU_RESERVATION = "strict-cpu-reservation"

KNOWN_OPTIONS = (
    FULL_PCPUS_ONLY,
    DISTRIBUTE_ACROSS_NUMA,
    ALIGN_BY_SOCKET,
    DISTRIBUTE_ACROSS_CORES,
    PREFER_ALIGN_BY_UNCORECACHE,
    STRICT_CPU_RESERVATION,
)

# Pairs kubelet refuses to combine (pkg/kubelet/cm/cpumanager/policy_options.go).
_INCOMPATIBLE = (
    (FULL_PCPUS_ONLY, DISTRIBUTE_ACROSS_CORES),
    (DISTRIBUTE_ACROSS_NUMA, DISTRIBUTE_ACROSS_CORES),
    (PREFER_ALIGN_BY_UNCORECACHE, DISTRIBUTE_ACROSS_CORES),
    (PREFER_ALIGN_BY_UNCORECACHE, DISTRIBUTE_ACROSS_NUMA),
)

# Above this many combinations of children, fall back to "largest first" instead of trying all.
_MAX_COMBINATIONS = 128


class AllocationError(PluginError):
    """The request cannot be met; the message names what was asked and what is free."""

    code = "no-room"


class OptionError(PluginError, ValueError):
    """Unknown or incompatible policy options."""

    code = "option"


def validate_options(names: Iterable[str], topology: Topology | None = None) -> frozenset[str]:
    """Check option names and combinations the way kubelet does; return them as a set."""
    options = frozenset(names)
    unknown = sorted(options - set(KNOWN_OPTIONS))
    if unknown:
        raise OptionError(
            f"unknown policy option(s) {', '.join(unknown)}; known: {', '.join(KNOWN_OPTIONS)}"
        )
    for first, second in _INCOMPATIBLE:
        if first in options and second in options:
            raise OptionError(f"policy options {first} and {second} cannot be used together")
    if (
        topology is not None
        and ALIGN_BY_SOCKET in options
        and len(topology.sockets) > len(topology.numa_nodes)
    ):
        raise OptionError(
            f"{ALIGN_BY_SOCKET} needs at least as many NUMA nodes as sockets; this machine has "
            f"{len(topology.sockets)} sockets and {len(topology.numa_nodes)} NUMA nodes"
        )
    return options


class _Node:
    """A group of CPUs in the allocation tree (see the module docstring)."""

    __slots__ = ("children", "cpus", "first", "is_core")

    def __init__(
        self, cpus: frozenset[int], children: list[_Node], first: int, is_core: bool = False
    ) -> None:
        self.cpus = cpus
        self.children = children
        self.first = first  # lowest CPU id: deterministic tie-break
        self.is_core = is_core

    @property
    def children_are_cores(self) -> bool:
        return bool(self.children) and self.children[0].is_core


class Allocator:
    """Precomputes the allocation tree of one topology; ``allocate`` is then a pure function."""

    def __init__(self, topology: Topology, options: Iterable[str] = ()) -> None:
        self.topology = topology
        self.options = validate_options(options, topology)
        by_socket = ALIGN_BY_SOCKET in self.options
        self._numa = topology.group_ids("numa")
        self._socket = topology.group_ids("socket")
        self._llc = topology.group_ids("l3")
        self._core = topology.group_ids("core")
        # Plain frozensets: the score runs thousands of times per second.
        self._core_cpus = {k: frozenset(v) for k, v in topology.cores.items()}
        self._numa_cpus = {k: frozenset(v) for k, v in topology.numa_nodes.items()}
        self._llc_cpus = {k: frozenset(v) for k, v in topology.llc_groups.items()}
        levels = ("socket", "numa") if by_socket else ("numa", "socket")
        self._root = self._build(topology.online, (*levels, "l3", "core"))
        self._smt = topology.smt_width

    def _build(self, cpus: Iterable[int], levels: Sequence[str]) -> _Node:
        cpus = frozenset(cpus)
        if not levels:
            return _Node(cpus, [], min(cpus), is_core=True)
        attr = levels[0]
        groups: dict[int, list[int]] = {}
        for cpu in sorted(cpus):
            groups.setdefault(getattr(self.topology.by_id[cpu], attr), []).append(cpu)
        children = [self._build(members, levels[1:]) for members in groups.values()]
        if attr == "core":
            # Cores hang directly below their LLC part; a core node is a leaf of threads.
            children = [_Node(c.cpus, [], c.first, is_core=True) for c in children]
        return _Node(cpus, children, min(cpus))

    # --- public ---------------------------------------------------------------------------

    def allocate(self, available: Iterable[int], count: int) -> CPUSet:
        """Choose ``count`` CPUs from ``available``; raise AllocationError if impossible.

        A count of 0 gives the empty set, as kubelet's allocator does: a container that needs
        no exclusive CPU is not an error."""
        avail = frozenset(available)
        offline = avail - self._root.cpus
        if offline:
            raise AllocationError(
                f"CPUs {CPUSet(offline)} are not online CPUs of this topology "
                f"(online: {self.topology.online})"
            )
        if count < 0:
            raise AllocationError(f"cannot allocate {count} CPUs: the count must not be negative")
        if count == 0:
            return CPUSet()
        if FULL_PCPUS_ONLY in self.options:
            avail = self._whole_free_cores(avail, count)
        if count > len(avail):
            raise AllocationError(
                f"cannot allocate {count} CPUs: only {len(avail)} available ({CPUSet(avail)})"
            )
        return CPUSet(self._plan(self._root, count, avail, top=True))

    def _whole_free_cores(self, avail: frozenset[int], count: int) -> frozenset[int]:
        if count % self._smt:
            raise AllocationError(
                f"cannot allocate {count} CPUs with {FULL_PCPUS_ONLY}: the count must be a "
                f"multiple of {self._smt} (threads per core)"
            )
        whole = frozenset().union(*(cpus for cpus in self.topology.cores.values() if cpus <= avail))
        if count > len(whole):
            raise AllocationError(
                f"cannot allocate {count} CPUs with {FULL_PCPUS_ONLY}: only "
                f"{len(whole) // self._smt} whole free cores ({CPUSet(whole) or 'none'}) in "
                f"{CPUSet(avail)}"
            )
        return whole

    # --- search ---------------------------------------------------------------------------

    def _plan(self, node: _Node, n: int, avail: frozenset[int], top: bool = False) -> frozenset:
        """Best ``n`` free CPUs inside ``node`` (the caller guarantees there are enough)."""
        if node.is_core:
            return frozenset(sorted(node.cpus & avail)[:n])
        if node.children_are_cores:
            return self._take_threads(node, n, avail)
        children = [(child, len(child.cpus & avail)) for child in node.children]
        children = [(child, free) for child, free in children if free]
        if len(children) == 1:
            return self._plan(children[0][0], n, avail)
        if top and DISTRIBUTE_ACROSS_NUMA in self.options and not any(f >= n for _, f in children):
            spread = self._distribute(children, n, avail)
            if spread is not None:
                return spread
        return min(self._candidates(children, n, avail), key=lambda pick: self._score(pick, avail))

    def _candidates(
        self, children: list[tuple[_Node, int]], n: int, avail: frozenset[int]
    ) -> list[frozenset[int]]:
        """The best pick within each smallest set of children (with their free CPUs) that
        holds ``n`` free CPUs; ``_score`` chooses among them."""
        need = _fewest_children(sorted((f for _, f in children), reverse=True), n)
        if need == 1:
            return [self._plan(child, n, avail) for child, free in children if free >= n]
        candidates = []
        memo: Plans = {}  # the children's picks, shared by the combinations
        for combo in self._combinations(children, need):
            if sum(free for _, free in combo) < n:
                continue
            # Roomiest first: take those whole, place the remainder in the last one.
            ordered = sorted(combo, key=lambda cf: (-cf[1], cf[0].first))
            whole = frozenset().union(*(c.cpus & avail for c, _ in ordered[:-1]))
            rest = self._plan(ordered[-1][0], n - len(whole), avail)
            candidates.append(whole | rest)
            spanned = len({self._core[cpu] for cpu in whole | rest})  # as few as can be: kept
            if DISTRIBUTE_ACROSS_CORES not in self.options and spanned > -(-n // self._smt):
                candidates.extend(self._whole_cores_first(ordered, n, avail, memo))
        return candidates

    def _whole_cores_first(
        self, ordered: list[tuple[_Node, int]], n: int, avail: frozenset[int], memo: Plans
    ) -> list[frozenset[int]]:
        """Picks over these children taking their whole free cores first (roomiest first), as
        kubelet's packed allocator does, the threads left over placed in each child with room:
        taking a child whole splits cores when others have whole ones to spare (see rule 4)."""
        shares, left = [], n
        for child, _ in ordered:
            shares.append(self._whole_core_share(child, left, avail))
            left -= shares[-1]

        def plan(child: _Node, k: int) -> frozenset[int]:
            if (child.first, k) not in memo:
                memo[child.first, k] = self._plan(child, k, avail) if k else frozenset()
            return memo[child.first, k]

        pairs = list(zip(ordered, shares, strict=True))
        plans = [plan(c, k) for (c, _), k in pairs]
        return [
            frozenset().union(plan(child, k + left), *plans[:i], *plans[i + 1 :])
            for i, ((child, free), k) in enumerate(pairs)
            if free - k >= left
        ]

    def _whole_core_share(self, node: _Node, limit: int, avail: frozenset[int]) -> int:
        """How many of ``node``'s free CPUs whole free cores make up, at most ``limit``."""
        cores = {self._core[cpu] for cpu in node.cpus & avail}
        sizes = sorted(len(self._core_cpus[c]) for c in cores if self._core_cpus[c] <= avail)
        return max(total for total in accumulate(sizes, initial=0) if total <= limit)

    def _combinations(self, children: list, need: int) -> Iterable[tuple]:
        if comb(len(children), need) <= _MAX_COMBINATIONS:
            return combinations(children, need)
        # Too many to try: the roomiest need-1 children plus each possible last child.
        ordered = sorted(children, key=lambda cf: (-cf[1], cf[0].first))
        head = tuple(ordered[: need - 1])
        return ((*head, last) for last in ordered[need - 1 :])

    def _take_threads(self, node: _Node, n: int, avail: frozenset[int]) -> frozenset:
        """Pick threads inside one LLC part: whole cores first, then best-fitting threads."""
        cores = [(core, sorted(core.cpus & avail)) for core in node.children]
        cores = [(core, free) for core, free in cores if free]
        if DISTRIBUTE_ACROSS_CORES in self.options:
            return self._one_thread_per_core(cores, n)
        picked = []
        remaining = n
        rest = []
        for core, free in cores:
            if len(free) == len(core.cpus) and remaining >= len(free):
                picked.extend(free)
                remaining -= len(free)
            else:
                rest.append((core, free))
        if remaining:
            picked.extend(_fewest_threads_beside_others(rest, remaining))
        return frozenset(picked)

    def _one_thread_per_core(self, cores: list[tuple[_Node, list[int]]], n: int) -> frozenset:
        """distribute-cpus-across-cores: idle cores first, one thread per core per round, so
        siblings stay idle longest."""
        cores = sorted(cores, key=lambda cf: (-len(cf[1]), cf[0].first))
        picked: list[int] = []
        for depth in range(self._smt):
            for _, free in cores:
                if depth < len(free) and len(picked) < n:
                    picked.append(free[depth])
        return frozenset(picked)

    def _distribute(self, children: list, n: int, avail: frozenset[int]) -> frozenset | None:
        """Even split over the fewest top-level nodes (distribute-cpus-across-numa)."""
        unit = self._smt if n % self._smt == 0 else 1
        for k in range(2, len(children) + 1):
            units, extra = divmod(n // unit, k)
            shares = [(units + (1 if i < extra else 0)) * unit for i in range(k)]
            best = None
            for combo in self._combinations(children, k):
                ordered = sorted(combo, key=lambda cf: (-cf[1], cf[0].first))
                if any(free < share for (_, free), share in zip(ordered, shares, strict=True)):
                    continue
                pick = frozenset().union(
                    *(self._plan(c, s, avail) for (c, _), s in zip(ordered, shares, strict=True))
                )
                key = self._score(pick, avail)
                if best is None or key < best[0]:
                    best = (key, pick)
            if best is not None:
                return best[1]
        return None

    def _score(self, pick: frozenset[int], avail: frozenset[int]) -> tuple:
        """The score of a pick, lower is better, field by field (see the module docstring):
        (primary, secondary, llcs, cores, shared_threads, partial_cores, numa_leftover,
        llc_leftover, ids).  A plain tuple: a namedtuple would make the OCI hook import
        collections for it."""
        numa = {self._numa[c] for c in pick}
        sockets = {self._socket[c] for c in pick}
        llcs = {self._llc[c] for c in pick}
        cores = {self._core[c] for c in pick}
        left = avail - pick
        partial = 0
        shared_threads = 0
        for core in cores:
            core_cpus = self._core_cpus[core]
            if not core_cpus <= pick:
                shared_threads += len(core_cpus & pick)
                partial += not core_cpus.isdisjoint(left)
        numa_left = sum(len(self._numa_cpus[x] & left) for x in numa)
        llc_left = sum(len(self._llc_cpus[x] & left) for x in llcs)
        first, second = (
            (len(sockets), len(numa))
            if ALIGN_BY_SOCKET in self.options
            else (len(numa), len(sockets))
        )
        spanned = len(cores)
        if DISTRIBUTE_ACROSS_CORES in self.options:
            # Spreading over cores is the point; do not penalise it.
            spanned = shared_threads = partial = 0
        return (
            first,
            second,
            len(llcs),
            spanned,
            shared_threads,
            partial,
            numa_left,
            llc_left,
            tuple(sorted(pick)),
        )


def _fewest_threads_beside_others(cores: list[tuple[_Node, list[int]]], n: int) -> list[int]:
    """``n`` threads from partly used cores (or whole ones too big for ``n``): the tightest
    single core that holds them, else as few cores as possible, roomiest first."""
    fitting = [(len(free), core.first, free) for core, free in cores if len(free) >= n]
    if fitting:
        return min(fitting)[2][:n]
    picked: list[int] = []
    for _, free in sorted(cores, key=lambda cf: (-len(cf[1]), cf[0].first)):
        picked.extend(free[: n - len(picked)])
        if len(picked) == n:
            break
    return picked


def _fewest_children(free_desc: list[int], n: int) -> int:
    total = 0
    for index, free in enumerate(free_desc, start=1):
        total += free
        if total >= n:
            return index
    raise AssertionError("caller guarantees enough free CPUs")


def allocate(
    topology: Topology, available: Iterable[int], count: int, options: Iterable[str] = ()
) -> CPUSet:
    """One-shot convenience around Allocator (the daemon keeps an Allocator instead)."""
    return Allocator(topology, options).allocate(available, count)


def reserve_by_count(topology: Topology, count: int) -> CPUSet:
    """``count`` CPUs from the lowest-numbered physical cores, whole cores first (as kubelet
    reserves kube/system-reserved CPUs); isolated CPUs are left for the workloads."""
    if count <= 0:
        raise AllocationError(f"reserved CPU count must be at least 1, got {count}")
    candidates = topology.online - topology.isolated
    if count >= len(candidates):
        raise AllocationError(
            f"cannot reserve {count} CPUs: only {len(candidates)} non-isolated online CPUs "
            f"({candidates}); at least one must stay for workloads"
        )
    chosen: list[int] = []
    for core_cpus in sorted(topology.cores.values(), key=min):
        chosen.extend(sorted(core_cpus & candidates)[: count - len(chosen)])
        if len(chosen) == count:
            break
    return CPUSet(chosen)
