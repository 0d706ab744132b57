"""The guest benchmark's host counterpart (bench_guest.py): the same 1-CPU Guaranteed pod
starts, measured the same way, on this host's cgroupfs driver (cgroup v1) - so that the two
tables can be read side by side.

As in the dense-node benchmark (bench_density.py), two private containerd instances of one
version run side by side, one with ``nri-cpuplugin run`` and one with no plugin, each with the
same N running Burstable containers; the sides alternate within each round (who goes first
alternates too).  Each instance's runc is the counting wrapper of runc_calls.py.
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from e2e.daemon import Daemon
from harness.containerd import Containerd, at_least
from harness.cri import CRIClient
from harness.k8s import ContainerSpec, PodSpec

from . import runc_calls, shared_window, start_sample

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep infinity"


def _counting_runc(version: str, wrapper: Path) -> dict[str, Any]:
    """containerd's config overrides that make ``wrapper`` its runc."""
    runtimes = {"runtimes": {"runc": {"options": {"BinaryName": wrapper}}}}
    cri = (
        "io.containerd.cri.v1.runtime" if at_least(version, "2.0") else "io.containerd.grpc.v1.cri"
    )
    return {"plugins": {cri: {"containerd": runtimes}}}


def bench_host_pod_starts(
    version: str = "2.3",
    shared_counts: tuple[int, ...] = (0, 8, 32, 100),
    rounds: int = 30,
    warmup: int = 2,
) -> dict[str, Any]:
    from .bench_guest import cell_summary  # one summary for both tables

    report: dict[str, Any] = {"rounds": rounds, "version": version, "cells": {}}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        runtimes: dict[str, Containerd] = {}
        logs: dict[str, Path] = {}
        for side in ("plugin", "none"):
            wrapper, logs[side] = Path(tmp) / f"runc-{side}", Path(tmp) / f"runc-{side}.log"
            runtime = Containerd(
                version, debug=False, config_overrides=_counting_runc(version, wrapper)
            )
            wrapper.write_text(runc_calls.wrapper(runtime.runc, logs[side]))
            wrapper.chmod(0o755)
            runtimes[side] = stack.enter_context(runtime)
        report["release"] = runtimes["none"].release
        daemon = Daemon(runtimes["plugin"].nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        running = 0
        ends = dict.fromkeys(runtimes, 0)
        for count in sorted(shared_counts):
            for runtime in runtimes.values():
                cri = runtime.cri()
                for i in range(running, count):
                    cri.run(f"shared{i}", [ContainerSpec(f"s{i}", cpu_request_milli=100)])
            running = count
            samples: dict[str, list[dict[str, Any]]] = {"plugin": [], "none": []}
            for i in range(warmup + rounds):
                for side in ("plugin", "none") if i % 2 else ("none", "plugin"):
                    sample = _timed_start(
                        runtimes[side].cri(),
                        f"{count}-{i}",
                        side == "plugin",
                        logs[side],
                        ends[side],
                    )
                    ends[side] = sample["log_end"]
                    if i >= warmup:
                        samples[side].append(sample)
            report["cells"][count] = cell_summary(samples)
    return report


def _shared(cri: CRIClient) -> tuple[dict[str, Path], dict[str, str]]:
    roles = {pod.id: "shared-sandbox" for pod in cri.pods()}
    shared = {}
    for c in cri.containers(state="CONTAINER_RUNNING"):
        roles[c.id] = "shared"
        shared[c.id] = shared_window.cpuset_dir(cri.inspect(c.id).pid)
    return shared, roles


def _timed_start(cri: CRIClient, label: str, pinned: bool, log: Path, since: int) -> dict[str, Any]:
    """guest_side.timed_guaranteed_start on the host: cgroups found from the processes."""
    spec = ContainerSpec.guaranteed("app", 1, command=FIRST_LINE)
    shared, roles = _shared(cri)

    def first_line(cid: str) -> str:
        lines = cri.wait_logs(cid, "Cpus_allowed_list", timeout=30)
        return next(x for x in lines if "Cpus_allowed_list" in x).split(":", 1)[1].strip()

    return start_sample.timed_start(
        cri,
        PodSpec.for_containers(f"g-{label}", [spec]),
        spec,
        shared=shared,
        roles=roles,
        pinned=pinned,
        runc_log=log,
        since=since,
        own_cpuset=lambda cid: shared_window.cpuset_dir(cri.inspect(cid).pid),
        first_line=first_line,
    )
