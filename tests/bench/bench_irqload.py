"""Decision latency while the daemon narrows and rescans thousands of interrupts (issue 43).

The daemon as ``nri-cpuplugin run`` builds it (daemon/service.py), its NRI adapter called on an
event loop as the stub calls it, on a generated 48-CPU node (sysfs) with a generated /proc beside
it: ``IRQS`` changeable interrupts, each affinity write made to take ``WRITE_COST`` (a write hook
around hardware/interrupts/affinity.py ``write``: the FAKE slow kernel; the product has no test
hook).  A stream of pod starts - RunPodSandbox, CreateContainer, StartContainer of Guaranteed and
Burstable pods, the oldest removed as new ones come - runs on each side for the same time:

* **interrupt work**: an irq-free pod placed at the start (every interrupt narrowed), a second
  one later (planned again mid-way), a rescan every ``RESCAN`` seconds (each re-reads every
  interrupt), and a FAKE irqbalance that puts a tenth of the interrupts back on every CPU
  before each rescan;
* **none**: the same node and stream, its pods not irq-free: no interrupt work.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path

from builders import container, guaranteed_pod, pod
from proc_gen import proc_tree
from topologies import build

from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.daemon.service import Daemon
from nri_cpuplugin.hardware.interrupts import affinity as irq_files
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings

from .scratch import scratch
from .stats import summary

IRQS = 2000
WRITE_COST = 0.020
RESCAN = 5.0
CPUS = 48
REQUESTS = ("RunPodSandbox", "CreateContainer", "StartContainer")
SIDES = ("none", "interrupt work")  # (the work a side leaves unfinished is no other's)
LIVE_PODS = 8  # pods kept running; the oldest is removed when a new one starts
IRQ_FREE = "irq-free.nri-cpuplugin.io"


class Records(list):
    def __call__(self, record: dict) -> None:
        self.append(record)

    def of(self, action: str) -> list[dict]:
        return [r for r in self if r["ACTION"] == action]


class SlowWrites:
    """Every affinity write takes ``WRITE_COST`` more (the hook stays in until ``close``)."""

    def __init__(self) -> None:
        self.count = 0
        self._write = irq_files.write

        def slow(*args, **kwargs):
            time.sleep(WRITE_COST)
            self.count += 1
            return self._write(*args, **kwargs)

        irq_files.write = slow

    def close(self) -> None:
        irq_files.write = self._write


def node(base: Path) -> Settings:
    root, _ = build("xeon-e5-2680v3-2s", base)
    irqs = {n: f"0-{CPUS - 1}" for n in range(24, 24 + IRQS)}
    proc_tree(base / "proc", irqs, "ffff,ffffffff", CPUS)
    return Settings(sysfs=str(root), state_dir=str(base / "state"), reserved_cpu_count=2)


async def _timed(took: dict[str, list[float]], name: str, call) -> bool:
    """Whether the request was answered without an error (its time counts either way)."""
    started = time.perf_counter()
    try:
        await call
    except PolicyError:  # answered with an error: kubelet would retry the container
        return False
    finally:
        took[name].append(time.perf_counter() - started)
    return True


class Side:
    def __init__(self, base: Path, irq_work: bool, seconds: float) -> None:
        self.base = base
        self.irq_work = irq_work
        self.seconds = seconds
        self.records = Records()
        self.daemon = Daemon(node(base), Audit(self.records))
        self.adapter = self.daemon.adapter
        self.took: dict[str, list[float]] = {name: [] for name in REQUESTS}
        self.live: list[tuple] = []
        self.rescans = 0
        self.irqbalance_moves = 0

    async def run(self) -> None:
        await self.adapter.configure("", "containerd", "v2.1.9")
        await self.adapter.synchronize([], [])
        started = time.monotonic()
        extras = [asyncio.create_task(self._irq_side(started))] if self.irq_work else []
        i = 0
        while time.monotonic() - started < self.seconds:
            await self._start(i)
            i += 1
            await asyncio.sleep(0.05)
        for task in extras:
            task.cancel()
        await asyncio.gather(*extras, return_exceptions=True)

    async def _start(self, i: int, irq_free: bool = False) -> None:
        guaranteed = i % 2 == 0 or irq_free
        sandbox = guaranteed_pod(f"p{i}", 2000) if guaranteed else pod(f"p{i}", "burstable")
        sandbox.id, sandbox.uid = f"sb-{i}-{self.irq_work}", f"uid-{i}-{self.irq_work}"
        if irq_free and self.irq_work:
            sandbox.annotations[IRQ_FREE] = "true"
        ctr = container(f"c{i}x{int(self.irq_work)}", sandbox, 2000 if guaranteed else 500)
        await _timed(self.took, "RunPodSandbox", self.adapter.run_pod_sandbox(sandbox))
        if not await _timed(
            self.took, "CreateContainer", self.adapter.create_container(sandbox, ctr)
        ):
            await self.adapter.remove_pod_sandbox(sandbox)
            return
        await _timed(self.took, "StartContainer", self.adapter.start_container(sandbox, ctr))
        if irq_free:
            return  # kept for the whole run
        self.live.append((sandbox, ctr))
        if len(self.live) > LIVE_PODS:
            old, old_ctr = self.live.pop(0)
            await self.adapter.stop_container(old, old_ctr)
            await self.adapter.remove_container(old, old_ctr)
            await self.adapter.remove_pod_sandbox(old)

    async def _irq_side(self, started: float) -> None:
        """Two irq-free pods (the second a third of the way in), rescans, a FAKE irqbalance."""
        await self._start(10_000, irq_free=True)
        rng = random.Random(43)
        second = False
        while True:
            await asyncio.sleep(RESCAN)
            if not second and time.monotonic() - started > self.seconds / 3:
                second = True
                await self._start(10_001, irq_free=True)
            for number in rng.sample(range(24, 24 + IRQS), IRQS // 10):
                path = self.base / "proc" / "irq" / str(number) / "smp_affinity_list"
                path.write_text(f"0-{CPUS - 1}\n")
            self.irqbalance_moves += IRQS // 10
            self.daemon.deadline.submit(ev.IrqRescan())  # as the rescan timer does
            self.rescans += 1

    def close(self) -> None:
        self.daemon.stop_hotplug()
        self.daemon.release_claim()


def bench_irq_load(seconds: float) -> dict:
    """Both sides, ``seconds`` each, one after the other in this process."""
    writes = SlowWrites()
    results: dict[str, dict] = {}
    try:
        with scratch("bench-irqload-") as tmp:
            for side in SIDES:
                base = Path(tmp) / side.replace(" ", "-")
                loop = asyncio.new_event_loop()
                running = Side(base, side == "interrupt work", seconds)
                before = writes.count
                try:
                    loop.run_until_complete(running.run())
                    written = writes.count - before
                    misses = len(running.records.of("deadline"))
                finally:
                    running.close()
                    loop.close()
                    shutil.rmtree(base, ignore_errors=True)
                results[side] = {
                    "per_request": {name: summary(s) for name, s in running.took.items()},
                    "misses": misses,
                    "writes": written,
                    "rescans": running.rescans,
                    "irqbalance_moves": running.irqbalance_moves,
                }
    finally:
        writes.close()
    return {"seconds": seconds, "sides": results, "budget_s": Settings().nri_request_budget}
