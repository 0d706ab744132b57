"""State commit benchmark: what one durable commit of a realistic node state costs.

The number that matters is the fsync share: the encode, write and rename are CPU work we
control, the two fsyncs are the disk's.  Note that the result depends on the filesystem of the
directory measured (tmpfs fsyncs are free), which is reported alongside.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import uuid
from pathlib import Path

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.state import Assignment, NodeState
from nri_cpuplugin.storage.store import StateStore

from .stats import summary

N_CPUS = 256
RESERVED = CPUSet({0, 1})
MIN_SHARED = 4  # kubelet never lets the shared pool run dry; neither do we
_NAMESPACES = ("default", "payments", "search", "ml-serving", "kube-system", "observability")
_APPS = ("api", "worker", "indexer", "ingest", "cache", "model", "proxy", "batch")


def realistic_state(n_assignments: int = 200, seed: int = 1) -> NodeState:
    """A 256-CPU node with ``n_assignments`` disjoint exclusive containers of 1..16 CPUs.

    Sizes follow what fills real nodes: a few large containers, many of one or two CPUs, as
    much of the machine handed out as fits (200 containers leave 4 shared CPUs).
    """
    budget = N_CPUS - len(RESERVED) - MIN_SHARED
    if not 1 <= n_assignments <= budget:
        raise ValueError(f"n_assignments must be 1..{budget} on a {N_CPUS}-CPU node")
    rng = random.Random(seed)
    sizes = [1] * n_assignments
    extra = budget - n_assignments
    for i, want in enumerate(([16, 8, 4, 4] + [2] * n_assignments)[:n_assignments]):
        grow = min(want - 1, extra)
        sizes[i] += grow
        extra -= grow
    rng.shuffle(sizes)

    assignments = {}
    next_cpu = len(RESERVED)
    for size in sizes:
        cid = f"{rng.getrandbits(256):064x}"
        app = rng.choice(_APPS)
        suffix = "".join(rng.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        assignments[cid] = Assignment(
            container_id=cid,
            cpus=CPUSet(range(next_cpu, next_cpu + size)),
            pod_uid=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            container_name=app,
            pod_name=f"{app}-{rng.getrandbits(40):010x}-{suffix}",
            pod_namespace=rng.choice(_NAMESPACES),
            kind="app",
        )
        next_cpu += size
    shared = CPUSet(range(next_cpu, N_CPUS))
    fingerprint = "sha256:" + f"{rng.getrandbits(256):064x}"
    return NodeState("static", fingerprint, RESERVED, shared, assignments)


def bench_commit(
    n_assignments: int = 200, repeats: int = 300, directory: str | None = None
) -> dict:
    """Commit a realistic state ``repeats`` times; seconds per commit and the fsync part.

    Flat ``*_s`` keys are seconds; ``total`` and ``fsync`` are the same samples as
    ``stats.summary`` dicts (milliseconds), the shape the other benchmarks report in.

    ``directory`` picks the filesystem to measure on (default: the system temp dir).  The lock
    is taken once: lock cost is not commit cost, and the daemon batches under one lock too.
    """
    state = realistic_state(n_assignments)
    totals: list[float] = []
    fsyncs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-state-", dir=directory) as tmp:
        store = StateStore(Path(tmp) / "state")
        with store.locked():
            for _ in range(5):  # warm up: directory creation, page cache, allocator
                store.commit(state)
            for _ in range(repeats):
                timing = store.commit(state)
                totals.append(timing.total_seconds)
                fsyncs.append(timing.fsync_seconds)
        filesystem = _filesystem(tmp)
    return {
        "n_assignments": n_assignments,
        "repeats": repeats,
        "size_bytes": timing.bytes_written,
        "filesystem": filesystem,
        "total": summary(totals),
        "fsync": summary(fsyncs),
        "fsync_share": statistics.median(f / t for f, t in zip(fsyncs, totals, strict=True)),
    }


def _filesystem(path: str) -> str:
    """Filesystem type holding ``path`` (from mountinfo), or "unknown"."""
    dev = os.stat(path).st_dev
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as mountinfo:
            for line in mountinfo:
                fields = line.split()
                if fields[2] == wanted and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return "unknown"
