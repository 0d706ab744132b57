"""Exclusive CPUs kept free of device interrupts: the plan (core/irq.py) as a table, the /proc files
(hardware/interrupts/affinity.py) on a generated tree, and the daemon keeping a pod's CPUs free and
giving them back (a generated /proc/irq beside the generated sysfs: the host's are never touched;
irqbalance is tests/fake_irqbalance.py's FAKE).  The kernel's refusals of managed interrupts (EIO)
are the FAKE edge here; the guest node tests them for real (tests/guest/)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from builders import Machine, container, pod
from daemon_driver import Driver
from fake_irqbalance import FakeIrqbalance, short_root
from proc_gen import proc_tree
from topologies import build

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.irq import DEFAULT, Irq, plan
from nri_cpuplugin.core.state import IrqRecord
from nri_cpuplugin.daemon.events import IrqRescan
from nri_cpuplugin.hardware.interrupts import affinity as irq_files
from nri_cpuplugin.hardware.interrupts.keeper import Roots
from nri_cpuplugin.ops import status
from nri_cpuplugin.ops.config import Settings

REPO = Path(__file__).resolve().parents[2]
P = CPUSet.parse
ONLINE = P("0-7")
POOL = P("0,3-7")


@pytest.mark.parametrize(
    ("requested", "keep", "record", "written", "recorded"),
    [
        # narrowed: what it may use less the kept-free CPUs, and what was taken recorded
        ("0-7", "1-2", None, "0,3-7", "1-2"),
        # not on a kept-free CPU: left alone
        ("4-5", "1-2", None, None, None),
        # only on kept-free CPUs: the shared pool, never an empty set
        ("1", "1-2", None, "0,3-7", "1"),
        # released: given back what was taken, and what irqbalance did meanwhile kept
        ("4", "", "1-2", "1-2,4", None),
        # partly released: one CPU back, the other still taken
        ("4", "2", "1-2", "1,4", "2"),
        # offline now: given back once it is online again (the kernel widens no mask)
        ("4", "", "1,9", "1,4", "9"),
    ],
)
def test_the_plan_narrows_and_gives_back_exactly_what_it_took(
    requested, keep, record, written, recorded
):
    records = {5: IrqRecord("virtio0-input.0", P(record))} if record else {}
    irqs = [Irq(5, P(requested), "virtio0-input.0")]
    result = plan(irqs, P(keep), ONLINE, POOL, records)
    assert dict(result.writes).get(5) == (P(written) if written else None)
    assert result.records.get(5) == (
        IrqRecord("virtio0-input.0", P(recorded)) if recorded else None
    )


def test_a_reused_number_or_a_refused_interrupt_is_not_ours():
    records = {5: IrqRecord("virtio0-input.0", P("1-2"))}
    moved = [Irq(5, P("4"), "nvme0q1")]  # another device got number 5: nothing to give back
    assert plan(moved, CPUSet(), ONLINE, POOL, records).writes == ()
    managed = [Irq(7, P("0-7"), "virtio1-req.0")]
    assert plan(managed, P("1"), ONLINE, POOL, {}, frozenset({(7, "virtio1-req.0")})).writes == ()


# --- the /proc files ---------------------------------------------------------------------------


def test_interrupts_are_read_and_written_in_the_kernels_formats(tmp_path):
    proc = proc_tree(tmp_path / "proc", {24: "0-7", 25: "garbage"}, default="00000000,000000ff")
    found = {i.number: i for i in irq_files.interrupts(str(proc))}
    assert found[24] == Irq(24, P("0-7"), "PCI-MSIX 1-edge virtio24")
    assert 25 not in found  # unreadable: never touched
    assert found[DEFAULT].requested == P("0-7")
    irq_files.write(str(proc), DEFAULT, P("0,3-7"))
    assert (proc / "irq" / "default_smp_affinity").read_text() == "00000000,000000f9\n"
    irq_files.write(str(proc), 24, P("0,3-7"))
    assert (proc / "irq" / "24" / "smp_affinity_list").read_text() == "0,3-7\n"
    with pytest.raises(ValueError, match="not a hex CPU mask"):
        irq_files.parse_mask("fg")


# --- the daemon ----------------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path):
    root, _ = build("single-socket-no-smt", tmp_path)  # 8 CPUs, 0-1 reserved
    proc = proc_tree(tmp_path / "proc", {24: "0-7", 25: "0-7", 26: "6"})
    assert Roots.beside(str(root)).proc == str(proc)
    settings = Settings(sysfs=str(root), state_dir=str(tmp_path / "state"), reserved_cpu_count=2)
    driver = Driver(settings)
    driver.configure()
    driver.synchronize([], [])
    yield driver, proc
    driver.close()


def affinity(proc: Path, number: int) -> str:
    return (proc / "irq" / str(number) / "smp_affinity_list").read_text().strip()


def test_a_pod_that_asks_has_its_cpus_kept_free_and_given_back(node, monkeypatch):
    driver, proc = node
    managed = []

    def write(proc_root, number, cpus):  # FAKE kernel edge: interrupt 25 is managed
        if number == 25:
            managed.append(number)
            raise irq_files.Refused("managed")
        return real(proc_root, number, cpus)

    real = irq_files.write
    monkeypatch.setattr(irq_files, "write", write)
    db = pod("db")
    db.annotations["irq-free.nri-cpuplugin.io"] = "true"
    pg = container("pg", db, 2000)
    adjust, _ = driver.create_container(db, pg)
    cpus = P(adjust.linux.resources.cpu.cpus)
    assert len(cpus) == 2
    assert not P(affinity(proc, 24)) & cpus and P(affinity(proc, 24))
    assert affinity(proc, 25) == "0-7" and managed == [25]  # left alone, counted
    assert affinity(proc, 26) == "6" or not P(affinity(proc, 26)) & cpus
    assert irq_files.default_affinity(str(proc)) == P("0-7") - cpus
    assert driver.on_disk().irqs[24].taken == cpus  # recorded with the state
    [record] = driver.records.of("irq")
    assert record["MANAGED"] == "1" and record["CPUS"] == str(cpus)
    shown = status.render_text(status.snapshot(driver.settings.state_dir, driver.settings.sysfs))
    assert f"irq-free    {cpus}  (1 interrupts kept off them)" in shown
    driver.stop_container(db, pg)
    assert affinity(proc, 24) == "0-7"
    assert irq_files.default_affinity(str(proc)) == P("0-7")
    assert not driver.on_disk().irqs


@pytest.fixture
def read_only(node):
    """The generated /proc/irq bind-mounted read-only over itself, as a container's is."""
    irq = str(node[1] / "irq")
    subprocess.run(["mount", "--bind", irq, irq], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", irq], check=True)
        yield node
    finally:
        subprocess.run(["umount", irq], check=True)


def test_a_read_only_proc_irq_is_a_warning_that_names_the_fix_not_managed_interrupts(read_only):
    driver, proc = read_only
    db = pod("db")
    db.annotations["irq-free.nri-cpuplugin.io"] = "true"
    adjust, _ = driver.create_container(db, container("pg", db, 2000))
    assert len(P(adjust.linux.resources.cpu.cpus)) == 2  # pinned all the same
    assert affinity(proc, 24) == "0-7"
    [record] = driver.records.of("irq")
    assert (record["PRIORITY"], record["NARROWED"], record["MANAGED"]) == ("4", "0", "0")
    assert record["FAILED"] == "3"  # 24, 25 and the default, not written
    assert record["MESSAGE"].startswith("interrupts not kept off CPUs 2-3: cannot write")
    assert "/proc/irq is read-only here" in record["MESSAGE"]
    assert "docs/operator-guide.md section 5" in record["MESSAGE"]
    assert not driver.on_disk().irqs  # nothing recorded as taken


def test_a_pod_that_does_not_ask_leaves_the_interrupts_alone(node):
    driver, proc = node
    db = pod("db")
    driver.create_container(db, container("pg", db, 2000))
    assert affinity(proc, 24) == "0-7" and not driver.records.of("irq")


def test_what_a_killed_daemon_took_is_given_back_by_the_next_one(node):
    driver, proc = node
    db = pod("db")
    db.annotations["irq-free.nri-cpuplugin.io"] = "true"
    driver.create_container(db, container("pg", db, 2000))
    narrowed = affinity(proc, 24)
    assert narrowed != "0-7"
    settings = driver.node.file_settings
    driver.close()  # as kill -9: nothing given back
    again = Driver(settings)
    again.configure()
    assert affinity(proc, 24) == narrowed  # the container may still run: kept
    again.synchronize([], [])  # the runtime lists no container: it is gone
    assert affinity(proc, 24) == "0-7" and not again.on_disk().irqs
    again.close()


def guide_snippet(marker: str) -> str:
    """The Python of the operator guide's code block after ``<!-- marker: ... -->``."""
    guide = (REPO / "docs" / "operator-guide.md").read_text()
    block = guide.split(f"<!-- {marker}:", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    body = re.search(r"<<'EOF'\n(.*?)^EOF$", textwrap.dedent(block), re.S | re.M)
    assert body, f"no heredoc after <!-- {marker} --> in the operator guide"
    return body[1]


def test_the_guides_removal_gives_back_what_a_stopped_daemon_took(node):
    """docs/operator-guide.md 7.1: with the plugin gone and its container still running, the
    guide's command gives every interrupt back exactly what the state file says was taken."""
    driver, proc = node
    db = pod("db")
    db.annotations["irq-free.nri-cpuplugin.io"] = "true"
    adjust, _ = driver.create_container(db, container("pg", db, 2000))
    cpus = P(adjust.linux.resources.cpu.cpus)
    (proc / "irq" / "26" / "smp_affinity_list").write_text("5\n")  # irqbalance, meanwhile
    assert P(affinity(proc, 24)) == P("0-7") - cpus
    assert irq_files.default_affinity(str(proc)) == P("0-7") - cpus
    state = Path(driver.settings.state_dir) / "state.json"
    online = Path(driver.settings.sysfs) / "devices/system/cpu/online"
    driver.close()  # stopped: nothing given back
    script = (
        guide_snippet("give-interrupts-back")
        .replace('"/proc"', repr(str(proc)))
        .replace('"/sys/devices/system/cpu/online"', repr(str(online)))
    )
    result = subprocess.run(
        [sys.executable, "-", str(state)],
        input=script, cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert affinity(proc, 24) == "0-7" and affinity(proc, 25) == "0-7"
    assert irq_files.default_affinity(str(proc)) == P("0-7")
    assert affinity(proc, 26) == "5"  # not ours: left as irqbalance set it
    assert f"interrupt 24 (PCI-MSIX 1-edge virtio24): CPUs {cpus} given back" in result.stdout
    # Run again: nothing left to give.
    again = subprocess.run(
        [sys.executable, "-", str(state)],
        input=script, cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert again.returncode == 0 and again.stdout == "", again.stderr


def test_cpu_hotplug_recomputes_the_kept_free_cpus(tmp_path):
    machine = Machine(tmp_path)  # 8 CPUs, 2 sockets; its sysfs at tmp_path/sysfs
    machine.set()
    proc = proc_tree(tmp_path / "proc", {24: "0-7"})
    settings = Settings(sysfs=str(machine.root), state_dir=str(tmp_path / "state"))
    driver = Driver(settings, flags={"reserved_cpus": P("0")})
    driver.configure()
    driver.daemon.stop_hotplug()  # events are submitted below, as the listener would
    driver.synchronize([], [])
    try:
        db = pod("db")
        db.annotations["irq-free.nri-cpuplugin.io"] = "true"
        pg = container("pg", db, 2000)
        before = P(driver.create_container(db, pg)[0].linux.resources.cpu.cpus)
        assert not P(affinity(proc, 24)) & before
        lost = max(before)
        machine.set(offline={lost})
        driver.hotplug("offline", lost)
        held = driver.state.assignments[pg.id].cpus
        assert held != before  # a replacement CPU, which the interrupt must leave too
        assert not P(affinity(proc, 24)) & held
        # the offline CPU stays recorded as taken, to be given back once it is online again
        assert lost in driver.on_disk().irqs[24].taken
        machine.set()
        driver.hotplug("online", lost)
        assert not P(affinity(proc, 24)) & driver.state.assignments[pg.id].cpus
        driver.stop_container(db, pg)
        assert affinity(proc, 24) == "0-7" and not driver.on_disk().irqs
    finally:
        driver.close()


def test_an_odd_interrupts_header_is_said_once_and_stops_nothing(node):
    driver, proc = node
    rows = (proc / "interrupts").read_text().splitlines()
    (proc / "interrupts").write_text("\n".join([rows[0] + " CPUx", *rows[1:]]) + "\n")
    with pytest.raises(irq_files.IrqError, match="CPUx"):
        irq_files.counts(str(proc))
    db = pod("db")
    db.annotations["irq-free.nri-cpuplugin.io"] = "true"
    pg = container("pg", db, 2000)
    cpus = P(driver.create_container(db, pg)[0].linux.resources.cpu.cpus)
    assert len(cpus) == 2 and affinity(proc, 24) == "0-7"  # placed; the interrupts left alone
    driver.submit(IrqRescan())
    web = pod("web")
    driver.create_container(web, container("nginx", web, 1000))  # later requests answered
    driver.submit(IrqRescan())
    [record] = driver.records.of("irq")  # said once, not at every look
    assert "/interrupts" in record["MESSAGE"] and "CPUx" in record["MESSAGE"]
    assert record["PRIORITY"] == "4"  # a warning


def test_an_irqbalance_ban_is_lifted_when_no_interrupt_was_narrowed_and_after_a_restart():
    with short_root() as root:
        sysfs, _ = build("single-socket-no-smt", root)  # 8 CPUs, 0-1 reserved
        # every interrupt, the default affinity too, already off the CPUs a pod gets
        proc_tree(root / "proc", {24: "0-1"}, default="03")
        irqbalance = FakeIrqbalance(sysfs)
        settings = Settings(sysfs=str(sysfs), state_dir=str(root / "state"), reserved_cpu_count=2)
        driver = Driver(settings)
        driver.configure()
        driver.synchronize([], [])
        db = pod("db")
        db.annotations["irq-free.nri-cpuplugin.io"] = "true"
        pg = container("pg", db, 2000)
        try:
            cpus = P(driver.create_container(db, pg)[0].linux.resources.cpu.cpus)
            assert irqbalance.banned() == cpus and not driver.on_disk().irqs  # nothing narrowed
            driver.stop_container(db, pg)
            assert irqbalance.banned() & ONLINE == CPUSet()  # lifted
            driver.create_container(db, container("pg2", db, 2000))
            assert irqbalance.banned() == cpus
        finally:
            driver.close()  # as kill -9: nothing lifted
        again = Driver(settings)
        try:
            again.configure()
            again.synchronize([], [])  # the runtime lists no container: it is gone
            assert irqbalance.banned() & ONLINE == CPUSet()
        finally:
            again.close()
            irqbalance.stop()
