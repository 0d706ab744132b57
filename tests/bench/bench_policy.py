"""Policy benchmarks: decision latency at scale and allocation quality under churn."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable

from nri_cpuplugin.core.allocator import Allocator
from nri_cpuplugin.core.policy import StaticPolicy
from nri_cpuplugin.core.topology import Topology
from nri_cpuplugin.core.workload import GUARANTEED, Workload

from .kubelet_order import kubelet_take
from .stats import summary

# 200 live containers on 254 assignable CPUs: every size appears, small ones dominate.
LIVE_MIX = [16] * 1 + [8] * 1 + [4] * 2 + [2] * 20 + [1] * 176


def _workload(rng: random.Random, cpus: int) -> Workload:
    return Workload(
        container_id=f"{rng.getrandbits(256):064x}",
        container_name=f"c{rng.randrange(10**6)}",
        pod_uid=str(uuid.UUID(int=rng.getrandbits(128))),
        pod_name="bench",
        pod_namespace="default",
        qos=GUARANTEED,
        cpu_request_milli=cpus * 1000,
        cpu_limit_milli=cpus * 1000,
    )


def bench_decisions(topology: Topology, rounds: int = 2000, seed: int = 7) -> dict:
    """Allocate and release latency with ~200 live exclusive containers of mixed sizes."""
    rng = random.Random(seed)
    policy = StaticPolicy.from_config(topology, reserved_count=2)
    state = policy.empty_state()
    live: list[tuple[str, int]] = []
    pods: dict[str, str] = {}
    for size in LIVE_MIX:
        workload = _workload(rng, size)
        _, state = policy.admit(state, workload)
        live.append((workload.container_id, size))
        pods[workload.container_id] = workload.pod_uid
    admit_s, release_s = [], []
    for _ in range(rounds):
        cid, size = live.pop(rng.randrange(len(live)))
        start = time.perf_counter()
        _, state = policy.release(state, cid)
        release_s.append(time.perf_counter() - start)
        state = policy.forget_pod(state, pods.pop(cid))  # each container is its own pod
        free = len(policy.free_exclusive(state))
        size = rng.choice([s for s in (1, 2, 4, 8, 16) if s <= min(free, size + 8)])
        workload = _workload(rng, size)
        start = time.perf_counter()
        _, state = policy.admit(state, workload)
        admit_s.append(time.perf_counter() - start)
        live.append((workload.container_id, size))
        pods[workload.container_id] = workload.pod_uid
    return {
        "live_containers": len(live),
        "admit": summary(admit_s),
        "release": summary(release_s),
        "decision": summary([a + r for a, r in zip(admit_s, release_s, strict=True)]),
    }


def churn_quality(topology: Topology, steps: int = 10_000, seed: int = 11) -> dict:
    """Random allocate/release churn, the same sequence fed to our allocator and to the
    kubelet-order baseline; counts how often a request that *could* fit one NUMA node (one LLC
    group) at that moment actually got one."""
    ours = Allocator(topology)
    contenders: dict[str, Callable] = {
        "nri-cpuplugin": ours.allocate,
        "kubelet order": lambda avail, n: kubelet_take(topology, avail, n),
    }
    return {name: _churn(topology, take, steps, seed) for name, take in contenders.items()}


def _churn(topology: Topology, take: Callable, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    free = set(topology.online)
    held: list[frozenset] = []
    numa_of = {c: topology.by_id[c].numa for c in topology.online}
    llc_of = {c: topology.by_id[c].l3 for c in topology.online}
    counts = {"requests": 0, "numa_fit": 0, "numa_hit": 0, "llc_fit": 0, "llc_hit": 0}
    for _ in range(steps):
        # Keep the machine busy (60-95 % used) so fragmentation matters.
        used = 1 - len(free) / len(topology.online)
        if held and (used > 0.95 or (used > 0.6 and rng.random() < 0.5)):
            free |= held.pop(rng.randrange(len(held)))
            continue
        size = rng.choice((1, 2, 2, 4, 4, 6, 8, 8, 12, 16))
        if size > len(free):
            continue
        numa_fit = any(len(cpus & free) >= size for cpus in topology.numa_nodes.values())
        llc_fit = any(len(cpus & free) >= size for cpus in topology.llc_groups.values())
        chosen = take(frozenset(free), size)
        counts["requests"] += 1
        counts["numa_fit"] += numa_fit
        counts["numa_hit"] += numa_fit and len({numa_of[c] for c in chosen}) == 1
        counts["llc_fit"] += llc_fit
        counts["llc_hit"] += llc_fit and len({llc_of[c] for c in chosen}) == 1
        free -= chosen
        held.append(frozenset(chosen))
    counts["numa_rate"] = counts["numa_hit"] / max(1, counts["numa_fit"])
    counts["llc_rate"] = counts["llc_hit"] / max(1, counts["llc_fit"])
    return counts


def bench_resize(topology: Topology, rounds: int = 2000, seed: int = 13) -> dict:
    """In-place resize latency (grow and shrink through the engine, as the daemon decides
    them) with ~200 live exclusive containers of mixed sizes."""
    from nri_cpuplugin.core.engine import Engine

    rng = random.Random(seed)
    engine = Engine(StaticPolicy.from_config(topology, reserved_count=2))
    state = engine.policy.empty_state()
    live: list[tuple[Workload, int]] = []
    for size in LIVE_MIX:
        workload = _workload(rng, size)
        state = engine.create(state, workload).state
        live.append((workload, size))
    grow_s, shrink_s = [], []
    for _ in range(rounds):
        index = rng.randrange(len(live))
        workload, size = live[index]
        free = len(engine.policy.free_exclusive(state))
        if free and size < 16 and rng.random() < 0.5:
            new, samples = size + rng.randint(1, min(free, 4)), grow_s
        elif size > 1:
            new, samples = rng.randint(1, size - 1), shrink_s
        else:
            continue
        resized = workload.evolve(cpu_request_milli=new * 1000, cpu_limit_milli=new * 1000)
        start = time.perf_counter()
        state = engine.resize(state, resized).state
        samples.append(time.perf_counter() - start)
        live[index] = (resized, new)
    return {"live_containers": len(live), "grow": summary(grow_s), "shrink": summary(shrink_s)}


def resize_churn(topology: Topology, steps: int = 10_000, seed: int = 17) -> dict:
    """Random create/remove/grow/shrink steps (machine kept 60-95 % busy): how often a grow
    stayed inside the container's current NUMA node (LLC group) whenever the free CPUs there
    could have taken it."""
    from nri_cpuplugin.core.engine import Engine
    from nri_cpuplugin.core.policy import PolicyError

    rng = random.Random(seed)
    engine = Engine(StaticPolicy.from_config(topology, reserved_count=2))
    policy = engine.policy
    state = policy.empty_state()
    live: dict[str, tuple[Workload, int]] = {}
    numa_of = {c: topology.by_id[c].numa for c in topology.online}
    llc_of = {c: topology.by_id[c].l3 for c in topology.online}
    counts = {"grows": 0, "numa_fit": 0, "numa_kept": 0, "llc_fit": 0, "llc_kept": 0}
    assignable = len(policy.free_exclusive(policy.empty_state()))
    for _ in range(steps):
        used = 1 - len(policy.free_exclusive(state)) / assignable
        roll = rng.random()
        if live and (used > 0.95 or (used > 0.6 and roll < 0.25)):
            cid = rng.choice(list(live))
            state = engine.stop(state, cid).state
            state = engine.remove_pod(state, live.pop(cid)[0].pod_uid).state
            continue
        if not live or roll < 0.4:
            size = rng.choice((1, 2, 2, 4, 4, 8))
            workload = _workload(rng, size)
            try:
                state = engine.create(state, workload).state
            except PolicyError:
                continue
            live[workload.container_id] = (workload, size)
            continue
        cid = rng.choice(list(live))
        workload, size = live[cid]
        held = state.assignments[cid].cpus
        free = policy.free_exclusive(state)
        if roll < 0.75 and size > 1:
            new = rng.randint(1, size - 1)
        else:
            new = size + rng.randint(1, 4)
            extra = new - size
            nodes = {numa_of[c] for c in held}
            groups = {llc_of[c] for c in held}
            numa_fit = len([c for c in free if numa_of[c] in nodes]) >= extra
            llc_fit = len([c for c in free if llc_of[c] in groups]) >= extra
        resized = workload.evolve(cpu_request_milli=new * 1000, cpu_limit_milli=new * 1000)
        try:
            state = engine.resize(state, resized).state
        except PolicyError:
            continue
        live[cid] = (resized, new)
        if new > size:
            grown = state.assignments[cid].cpus - held
            counts["grows"] += 1
            counts["numa_fit"] += numa_fit
            counts["numa_kept"] += numa_fit and {numa_of[c] for c in grown} <= nodes
            counts["llc_fit"] += llc_fit
            counts["llc_kept"] += llc_fit and {llc_of[c] for c in grown} <= groups
    counts["numa_rate"] = counts["numa_kept"] / max(1, counts["numa_fit"])
    counts["llc_rate"] = counts["llc_kept"] / max(1, counts["llc_fit"])
    return counts
