"""Interrupt upkeep under load and under faults (daemon/irq_upkeep.py): the runtime's requests
are never held behind interrupt work, and no affinity is narrowed before what it takes is
durably recorded, so a daemon killed at any point - the disk full or not - leaves a state from
which the next run gives every CPU back exactly.

The daemon as ``nri-cpuplugin run`` builds it (tests/daemon_driver.py) on a generated 8-CPU
node (CPUs 0-1 reserved) with a generated /proc beside it (tests/proc_gen.py).  Time is the
interrupt writes' own (tests/model_stall.py ``SlowIrqWrites``); a full disk is the FAKE edge
of the state file's durable write (``files.write_atomic``).  The daemon's timers are held
(tests/daemon_driver.py ``Timers``): the test submits the rescan and the retry when it wants."""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

from builders import container, guaranteed_pod, pod
from daemon_driver import Driver, Timers
from model_stall import SlowIrqWrites
from proc_gen import affinities, proc_tree
from topologies import build

from nri_cpuplugin.base import files
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.irq import Irq, plan, while_writing
from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.core.state import IrqRecord
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.hardware.interrupts import affinity as irq_files
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.storage.store import StateStore

P = CPUSet.parse
IRQ_FREE = "irq-free.nri-cpuplugin.io"


def node_at(base: Path, interrupts: int, budget: float = 1.5) -> Settings:
    """The generated node below ``base``: its sysfs, a /proc with ``interrupts`` interrupts on
    every CPU, its state directory."""
    root, _ = build("single-socket-no-smt", base)
    proc_tree(base / "proc", {n: "0-7" for n in range(24, 24 + interrupts)})
    return Settings(
        sysfs=str(root),
        state_dir=str(base / "state"),
        reserved_cpu_count=2,
        nri_request_budget=budget,
    )


def irq_free_pod(name: str):
    sandbox = pod(name)
    sandbox.annotations[IRQ_FREE] = "true"
    return sandbox


def cpus_of(number: int, affinity: str) -> CPUSet:
    """An affinity as /proc shows it: a list, or the default's hex mask (-1)."""
    return irq_files.parse_mask(affinity) if number < 0 else P(affinity)


def on_disk(state_dir: str):
    return StateStore(state_dir).peek().state


# --- the records while writes are pending ------------------------------------------------------


def test_while_writes_are_pending_a_record_names_what_was_taken_before_and_after():
    """Interrupts 5 and 6 give CPU 1 back and lose 2-3, 7 loses 2-3, 8's number now belongs
    to another device: until its write is made, each record holds both sets (a kill leaves
    the interrupt either way); once made, the plan's alone."""
    before = {
        5: IrqRecord("virtio5", P("1-2")),
        6: IrqRecord("virtio6", P("1")),
        8: IrqRecord("gone-device", P("1")),
    }
    found = [
        Irq(5, P("0,3-7"), "virtio5"),
        Irq(6, P("0,2-7"), "virtio6"),
        Irq(7, P("0-7"), "virtio7"),
        Irq(8, P("0-7"), "nvme0q1"),
    ]
    planned = plan(found, P("2-3"), P("0-7"), P("0-1,4-7"), before)
    assert dict(planned.writes) == dict.fromkeys([5, 6, 7, 8], P("0-1,4-7"))

    def taken(pending, refused=()):
        records = while_writing(before, planned, pending, refused)
        return {n: str(r.taken) for n, r in records.items()}

    assert taken([5, 6, 7, 8]) == {5: "1-3", 6: "1-3", 7: "2-3", 8: "2-3"}
    assert taken([6]) == {5: "2-3", 6: "1-3", 7: "2-3", 8: "2-3"}
    assert taken([], refused=[7]) == {5: "2-3", 6: "2-3", 8: "2-3"}
    assert while_writing(before, planned, [8])[8].names == "nvme0q1"


# --- requests first ------------------------------------------------------------------------------


def test_a_request_queued_behind_interrupt_work_is_answered_within_its_budget(tmp_path):
    """200 interrupts to narrow at 20 ms a write (4 s of work) and a budget of 1.5 s: the pod
    that comes meanwhile is decided by its own requests, none answered by a fallback, and the
    interrupts are all narrowed afterwards."""
    settings = node_at(tmp_path, 200)
    writes = SlowIrqWrites(cost=0.02)
    driver = Driver(settings, later=Timers())
    writes.install(driver.daemon.worker)
    adapter = driver.daemon.adapter
    db, web = irq_free_pod("db"), guaranteed_pod("web", 2000)
    pg, nginx = container("pg", db, 2000), container("nginx", web, 2000)
    try:
        driver.configure()
        driver.synchronize([], [])
        writes.held = True

        async def scenario() -> None:
            await adapter.create_container(db, pg)  # its interrupts narrowed from now on
            await adapter.run_pod_sandbox(web)
            await adapter.create_container(web, nginx)
            await adapter.start_container(web, nginx)

        driver.run(scenario())
        during = writes.writes
        writes.release()
        driver.settle()
        assert not driver.records.of("deadline"), [r["MESSAGE"] for r in driver.records]
        assert during < 200  # the pod's requests went before the interrupt work
        state = driver.state
        kept = state.assignments[pg.id].cpus
        assert len(state.assignments[nginx.id].cpus) == 2  # decided, not answered without it
        assert all(not cpus_of(n, a) & kept for n, a in affinities(tmp_path / "proc").items())
        assert len(on_disk(settings.state_dir).irqs) == 201  # the default affinity too
    finally:
        writes.close()
        driver.close()


def test_a_pass_planned_again_midway_gives_back_exactly_what_it_took(tmp_path):
    """Pods come and go while the interrupts are being narrowed: each change plans the pass
    again from where it is, and in the end every interrupt keeps off the CPUs of the pod
    still there - and only those - as its record says."""
    settings = node_at(tmp_path, 100)
    writes = SlowIrqWrites(cost=0.02)
    driver = Driver(settings, later=Timers())
    writes.install(driver.daemon.worker)
    adapter = driver.daemon.adapter
    db, cache = irq_free_pod("db"), irq_free_pod("cache")
    pg, redis = container("pg", db, 2000), container("redis", cache, 2000)
    try:
        driver.configure()
        driver.synchronize([], [])
        writes.held = True

        async def scenario() -> None:
            await adapter.create_container(db, pg)
            await adapter.create_container(cache, redis)  # planned again: both kept free
            await adapter.stop_container(db, pg)  # and again: pg's CPUs given back

        driver.run(scenario())
        assert writes.writes < 100
        writes.release()
        driver.settle()
        kept = driver.state.assignments[redis.id].cpus
        assert not driver.records.of("deadline")
        assert {n: cpus_of(n, a) for n, a in affinities(tmp_path / "proc").items()} == {
            n: P(ORIGINAL) - kept for n in [-1, *range(24, 124)]
        }
        records = on_disk(settings.state_dir).irqs
        assert {n: r.taken for n, r in records.items()} == dict.fromkeys(
            [-1, *range(24, 124)], kept
        )
    finally:
        writes.close()
        driver.close()


# --- a full disk, a kill at any point ------------------------------------------------------------


class FullDisk:
    """The state file's durable write fails (ENOSPC) from its ``fail_from``-th call on, until
    ``recover``; ``calls`` counts them."""

    def __init__(self, monkeypatch, fail_from: int | None) -> None:
        self.fail_from = fail_from
        self.calls = 0
        write = files.write_atomic

        def full(*args, **kwargs):
            self.calls += 1
            if self.fail_from is not None and self.calls >= self.fail_from:
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(*args, **kwargs)

        monkeypatch.setattr(files, "write_atomic", full)

    def recover(self) -> None:
        self.fail_from = None


class Kills:
    """A kill -9 at every interrupt write: the node's tree (sysfs, /proc, the state directory)
    as it is right after each write, copied aside; and before each write, whether the state
    file records what the write takes from the interrupt's affinity at start (``ORIGINAL``)."""

    def __init__(self, monkeypatch, base: Path, state_dir: str) -> None:
        self.copies: list[Path] = []
        self.unrecorded: list[str] = []
        write = irq_files.write

        def noted(proc, number, cpus):
            taken = P(ORIGINAL) - cpus
            state = on_disk(state_dir)
            record = state.irqs.get(number) if state is not None else None
            if taken and (record is None or not taken <= record.taken):
                self.unrecorded.append(f"interrupt {number} narrowed to {cpus}, {record=}")
            write(proc, number, cpus)
            copy = base.with_name(f"{base.name}-kill{len(self.copies)}")
            shutil.copytree(base, copy, symlinks=True)
            self.copies.append(copy)

        monkeypatch.setattr(irq_files, "write", noted)


ORIGINAL = "0-7"
INTERRUPTS = 3


def place_irq_free_pod(settings: Settings) -> Driver:
    driver = Driver(settings, later=Timers())
    driver.configure()
    driver.synchronize([], [])
    db = irq_free_pod("db")
    with contextlib.suppress(PolicyError):  # refused: its decision could not be made durable
        driver.create_container(db, container("pg", db, 2000))
    return driver


def gives_everything_back(base: Path) -> list[str]:
    """A new daemon on a killed one's node, the disk recovered: the runtime lists no container
    (the pod is gone), and every interrupt has every CPU again, nothing recorded as taken."""
    settings = Settings(
        sysfs=str(next(base.glob("sysfs-*"))), state_dir=str(base / "state"), reserved_cpu_count=2
    )
    again = Driver(settings, later=Timers())
    try:
        again.configure()
        again.synchronize([], [])
        left = {n: a for n, a in affinities(base / "proc").items() if cpus_of(n, a) != P(ORIGINAL)}
        state = on_disk(settings.state_dir)
        recorded = dict(state.irqs) if state is not None else {}
    finally:
        again.close()
    return (
        [f"{base.name}: affinities {left} not given back, records {recorded}"]
        if (left or recorded)
        else []
    )


def commits_of_a_placement(tmp_path: Path, monkeypatch) -> int:
    with monkeypatch.context() as patch:
        disk = FullDisk(patch, None)
        place_irq_free_pod(node_at(tmp_path / "count", INTERRUPTS)).close()
    return disk.calls


def test_with_the_disk_full_at_any_commit_a_kill_at_any_point_loses_no_cpu(tmp_path, monkeypatch):
    """Finding 6 of issue 40: the disk fills at each commit in turn, for good; the daemon is
    killed after each interrupt write, or at the end.  No write ever narrows an affinity
    beyond what the state file records, and each killed node's next run gives every CPU back
    exactly once the disk has recovered."""
    commits = commits_of_a_placement(tmp_path, monkeypatch)
    assert commits >= 3  # the runtime's list, the interrupts' records before and after the writes
    problems = []
    for fail_from in range(1, commits + 2):  # (the last: the disk never fills)
        base = tmp_path / f"full-from-{fail_from}"
        settings = node_at(base, INTERRUPTS)
        with monkeypatch.context() as patch:
            disk = FullDisk(patch, fail_from)
            kills = Kills(patch, base, settings.state_dir)
            place_irq_free_pod(settings).close()  # the end: as a kill -9, nothing given back
            disk.recover()
        problems += [f"full from commit {fail_from}: {u}" for u in kills.unrecorded]
        for killed in [*kills.copies, base]:
            problems += gives_everything_back(killed)
    assert not problems, "\n".join(problems)


def test_interrupts_left_alone_on_a_full_disk_are_narrowed_once_it_recovers(tmp_path, monkeypatch):
    settings = node_at(tmp_path, INTERRUPTS)
    driver = Driver(settings, later=Timers())
    driver.configure()
    driver.synchronize([], [])
    disk = FullDisk(monkeypatch, 1)
    try:
        db = irq_free_pod("db")
        pg = container("pg", db, 2000)
        driver.create_container(db, pg)  # placed: its commit waits for its StartContainer
        assert all(cpus_of(n, a) == P(ORIGINAL) for n, a in affinities(tmp_path / "proc").items())
        [warning] = [r for r in driver.records.of("irq") if "could not" in r["MESSAGE"]]
        assert "No space left on device" in warning["MESSAGE"]
        disk.recover()
        driver.submit(ev.IrqRescan())  # the retry the daemon set a timer for
        kept = driver.state.assignments[pg.id].cpus
        narrowed = affinities(tmp_path / "proc")
        assert all(not cpus_of(n, a) & kept for n, a in narrowed.items())
        assert on_disk(settings.state_dir).irqs[24].taken == kept
    finally:
        driver.close()
