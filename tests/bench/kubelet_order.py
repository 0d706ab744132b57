"""Baseline for the churn benchmark: kubelet's documented allocation order, written from the
description in the CPU Manager KEP and the 2018 blog (sockets, then cores, then threads).

1. whole free sockets while the request still needs at least a socket's worth;
2. whole free cores while it needs at least a core's worth, cores on the socket with the
   fewest whole free cores first;
3. single threads: sockets already used by this request first, then the socket and the core
   with the fewest free CPUs (fill partly used ones), then lowest socket, core and CPU id.

It knows sockets and cores only - not NUMA nodes inside a socket or LLC groups - which is what
the comparison is meant to show.  Benchmark-only code; not used by the plugin.
"""

from __future__ import annotations

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.topology import Topology


def kubelet_take(topology: Topology, available: frozenset[int], count: int) -> CPUSet:
    free = set(available)
    taken: set[int] = set()
    socket_of = {c: topology.by_id[c].socket for c in topology.online}
    core_of = {c: topology.by_id[c].core for c in topology.online}
    per_socket = max(len(c) for c in topology.sockets.values())
    per_core = topology.smt_width

    def take(cpus) -> None:
        taken.update(cpus)
        free.difference_update(cpus)

    for _, cpus in sorted(topology.sockets.items()):
        if count - len(taken) >= per_socket and cpus <= free:
            take(cpus)

    def whole_cores_on(socket: int) -> int:
        return sum(1 for c in topology.cores.values() if c <= free and socket_of[min(c)] == socket)

    free_cores = sorted(
        (c for c in topology.cores.values() if c <= free),
        key=lambda c: (whole_cores_on(socket_of[min(c)]), socket_of[min(c)], min(c)),
    )
    for cpus in free_cores:
        if count - len(taken) >= per_core and cpus <= free:
            take(cpus)

    def order(cpu: int, used_sockets: set[int]) -> tuple:
        socket, core = socket_of[cpu], core_of[cpu]
        on_socket = sum(1 for c in free if socket_of[c] == socket)
        on_core = sum(1 for c in topology.cores[core] if c in free)
        return (socket not in used_sockets, on_socket, on_core, socket, core, cpu)

    while len(taken) < count:
        used = {socket_of[c] for c in taken}
        take([min(free, key=lambda cpu: order(cpu, used))])
    return CPUSet(taken)
