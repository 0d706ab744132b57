"""Benchmarks through real CRI-O 1.36.3 + conmon + runc (the test harness), side by side.

Three private CRI-O instances run at once - one with nothing, one with our hooks.d files in its
``hooks_dir`` (NRI off, as on a hook-mode node), one with the NRI daemon connected - and the
measured operation rotates between them, so machine noise hits every side alike.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from e2e.crio.hooksd import hook_files
from e2e.daemon import Daemon
from harness.crio import Crio
from harness.k8s import ContainerSpec, PodSpec
from harness.runc import hook_program

from .stats import summary

SIDES = ("none", "hook", "daemon")


def bench_crio_exclusive_start(rounds: int = 30, shared: tuple[int, ...] = (0, 32)) -> dict:
    """CRI CreateContainer + StartContainer of a Guaranteed 1-CPU container on CRI-O: no
    pinning vs the OCI hook vs the NRI daemon, with ``n`` shared (Burstable) containers
    running beside it for each ``n`` in ``shared``.  Pinning moves every one of them off the
    new exclusive CPU in the same step: the hook and the daemon write their cgroups themselves
    before the create returns."""
    report: dict = {"rounds": rounds}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plain = stack.enter_context(Crio(log_level="info"))
        hooked = Crio(log_level="info", nri=False)
        program = hook_program(work / "bin")
        for name, doc in hook_files(program, work / "hook-state").items():
            hooked.install_hook(name, doc)
        stack.enter_context(hooked)
        pinned = stack.enter_context(Crio(log_level="info"))
        daemon = Daemon(pinned.nri_socket, work / "daemon-state").start()
        stack.callback(daemon.stop)
        runtimes = {"none": plain, "hook": hooked, "daemon": pinned}
        running = 0
        for n in sorted(shared):
            for runtime in runtimes.values():  # grow every node to n shared containers
                cri = runtime.cri()
                for i in range(running, n):
                    cri.run(f"shared-{i}", [ContainerSpec("s", cpu_request_milli=50)])
            running = n
            pods = {
                side: runtime.cri().run_pod(PodSpec(f"pinned-{n}", qos="guaranteed"))
                for side, runtime in runtimes.items()
            }
            samples: dict[str, list[float]] = {side: [] for side in SIDES}
            for i in range(rounds + 3):
                shift = i % len(SIDES)  # rotate who goes first
                for side in SIDES[shift:] + SIDES[:shift]:
                    cri = runtimes[side].cri()
                    start = time.perf_counter()
                    cid = cri.create_container(pods[side], ContainerSpec.guaranteed(f"g{i}", 1))
                    cri.start(cid)
                    elapsed = time.perf_counter() - start
                    cri.stop(cid, timeout=0)
                    cri.remove(cid)
                    if i >= 3:  # warm-up rounds are not measured
                        samples[side].append(elapsed)
            report[n] = {side: summary(values) for side, values in samples.items()}
        report["allocations"] = len(daemon.records("allocate"))
    return report
