"""A stateful model-based test of placement under races: the production daemon
(``Daemon``, through its NRI adapter, on an asyncio loop) driven by a model of containerd,
kubelet, systemd and the kernel (tests/model_runtime.py) through random interleavings of

* pods starting in parallel, step by step (RunPodSandbox, CreateContainer, the runtime applying
  the reply, StartContainer, an init container completing, a refused container retried),
  hypothesis choosing which pod advances: Guaranteed pods of whole CPUs (earmarked from the
  sandbox's CPU limit), with a sidecar (restartable init container or a second app container)
  or an init container, fractional Guaranteed, Burstable and BestEffort pods;
* stops and restarts of containers, removals of pods, in-place resizes and UpdateContainer
  without a CPU change, whose own entry the runtime applies at a later step of hypothesis'
  choosing before it sends PostUpdateContainer;
* daemon restarts (a new ``Daemon`` on the same state directory: Configure, Synchronize),
  runtime restarts (reconnect and Synchronize; no Stop/RemovePodSandbox for older pods ever
  after), the daemon's timers (the sweep), CPU hotplug, systemd's daemon-reload;
* a slow disk or the state lock held by another process: requests answered by their fallbacks
  within the budget, the late work settling afterwards;
* a full or failing disk (ENOSPC, EIO on every write) while pods start, stop and resize and
  the daemon or the runtime restarts: nothing waits, the invariants hold throughout;
* a runtime that lists its containers at each connection (Synchronize) and one that never
  does (containerd 1.7 with a plugin it launched);
* both cgroup drivers: cgroupfs, and systemd with the daemon's FAKE ``Units`` or without
  (``units=None``: the runtime applies those cpusets from the replies); pinning at creation or
  at start;
* ``DBusNodeModel``: the systemd driver with the daemon's own ``SystemdUnits`` on FAKE D-Bus
  (tests/model_dbus.py), and systemd's faults: busy (calls pending), late answers, a re-exec
  that loses the calls not read yet and re-applies every unit, unit files hidden from the
  daemon (issue 40).

After every step, once the late work has settled, the invariants hold:

1. no CPU is in two exclusive sets (assignments, earmarks; a running exclusive container's
   cgroup holds no other container's or pod's exclusive CPU);
2. no running shared container's cpuset overlaps an exclusive set (assigned or earmarked);
3. a refused CreateContainer or StartContainer leaves nothing assigned to its container (in
   memory, on disk); a refused resize leaves it as many exclusive CPUs as it held;
4. nothing is assigned to a container the runtime no longer has, nor earmarked for a pod it no
   longer has (a pod whose removal the runtime did not relay: once the sweep has run);
5. no audit record says a container was moved (MOVED=yes) to CPUs its cgroup is not on;
6. an earmark never splits a physical core that a whole-core choice from the same CPUs would
   keep whole;
7. an interrupt that lost online CPUs (pods that ask keep theirs free of interrupts) has them
   recorded as taken in the state file: recorded before written, whatever failed.

Size: ``NRI_MODEL_EXAMPLES`` schedules (default 50; three times as many for
``DBusNodeModel``) of ``NRI_MODEL_STEPS`` steps (default 40);
derandomized, no example database.  ``NRI_MODEL_EXAMPLES=500 ./dev unit -k model_races`` runs
a longer search.  Deterministic: a request's budget runs out exactly when the worker is stuck
on a stalled disk or lock, never by the clock (tests/model_stall.py), so each schedule runs
the same way every time; every wait is for a condition.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from model_runtime import (
    IRQ_FREE,
    IRQS,
    MACHINE,
    Ctr,
    Host,
    ModelNode,
    Pod,
    Records,
    cpu_event,
    cpuset_request,
    resize_request,
)
from proc_gen import affinities
from topologies import scratch_dir

from nri_cpuplugin.core.allocator import AllocationError
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.state import NodeState
from nri_cpuplugin.core.topology import Topology
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.storage.store import StateStore

EXAMPLES = int(os.environ.get("NRI_MODEL_EXAMPLES", "50"))
STEPS = int(os.environ.get("NRI_MODEL_STEPS", "40"))
BUDGET = 1.5  # each request's budget, as said in records: tests/model_stall.py runs it out
MAX_PODS = 5
STALLED_CALLS = 3  # requests made while the disk or the lock is stalled, at most
HOTPLUG = (3, 5, 11)  # CPUs that may go offline (5 and 11: one core); at most two at once

# (driver, the daemon has systemd (Units; "dbus": its own SystemdUnits on FAKE D-Bus), pin_at,
# the runtime lists its containers at each connection (not: containerd 1.7, a plugin it launched))
Config = tuple[str, bool | str, str, bool]
CONFIGS: list[Config] = [
    ("cgroupfs", False, "create", True),
    ("systemd", True, "create", True),
    ("systemd", False, "create", True),
    ("cgroupfs", False, "start", True),
    ("systemd", True, "start", True),
    ("cgroupfs", False, "create", False),
]
# The daemon's own SystemdUnits on FAKE D-Bus, with systemd's faults (``DBusNodeModel``)
DBUS_CONFIGS: list[Config] = [("systemd", "dbus", "create", True)]


def build_pod(kind: str, name: str, driver: str) -> Pod:
    """kubelet's pods by kind (requests = limits for Guaranteed)."""
    qos = {"burst": "burstable", "be": "besteffort"}.get(kind, "guaranteed")
    pod = Pod(name, qos, driver)
    if kind in ("g1", "g2", "g3"):
        return pod.add("main", int(kind[1]) * 1000, int(kind[1]) * 1000)
    if kind == "irq":  # 2 CPUs kept free of device interrupts
        pod.annotations[IRQ_FREE] = "true"
        return pod.add("main", 2000, 2000)
    if kind == "sidecar":  # a restartable init container beside the main one (limit 2.5)
        return pod.add("proxy", 500, 500, kind="init", sidecar=True).add("main", 2000, 2000)
    if kind == "pair":  # two app containers: 500m shared, 1 CPU exclusive (limit 1.5)
        return pod.add("side", 500, 500).add("main", 1000, 1000)
    if kind == "init":  # an init container of 1 CPU that completes, then 2 CPUs (limit 2)
        return pod.add("setup", 1000, 1000, kind="init").add("main", 2000, 2000)
    if kind == "frac":
        return pod.add("main", 1500, 1500)
    if kind == "burst":
        return pod.add("main", 500, None)
    return pod.add("main", 0, None)


# (irq twice: its interrupt work must often meet a failing disk)
KINDS = ("g1", "g2", "g3", "irq", "irq", "sidecar", "pair", "init", "frac", "burst", "be")


# What the examples did, by kind of step (NRI_MODEL_STATS=1 prints it at the end).
STATS: Counter[str] = Counter()


def _kind_of(line: str) -> str:
    """A step's line without names and numbers."""
    line = re.sub(r"\bp\d+[a-z0-9]*(/[a-z]+#\d+)?", "X", line.split(";")[0].split(":")[0])
    line = re.sub(r"\d[\d,-]*", "N", line)
    return re.sub(r" (on|->) .*", "", line)


@pytest.fixture(scope="module", autouse=True)
def stats() -> Iterator[None]:
    yield
    if os.environ.get("NRI_MODEL_STATS"):
        print("\nmodel steps:", sum(STATS.values()))
        for kind, count in STATS.most_common():
            print(f"  {count:6d}  {kind}")


class NodeModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="nri-model-", dir=scratch_dir()))
        self.node: ModelNode | None = None
        self.host: Host | None = None
        self.units = False
        self.stalled = ""  # "disk" or "lock" while requests miss their budget
        self.records = Records()
        self.records.observers.append(self.observe)
        self.splits: list[str] = []  # invariant 6's violations, as the records were made
        self.seen_state: NodeState | None = None
        self.untrue: list[str] = []  # invariant 5's violations, as the records were made
        self.swept: set[str] = set()  # pods removed unseen before the sweep last ran
        self.resizes: list[tuple[str, int]] = []  # refused: (id, how many CPUs it held)

    # --- set-up -----------------------------------------------------------------------------

    @initialize(
        config=st.sampled_from(CONFIGS),
        kinds=st.lists(st.sampled_from(KINDS), min_size=2, max_size=MAX_PODS),
    )
    def boot(self, config: Config, kinds: list[str]) -> None:
        driver, systemd, pin_at, lists = config
        self.driver, self.units = driver, systemd
        self.node = ModelNode(self.base, driver, systemd, pin_at, BUDGET, self.records, lists)
        self.machine, self.systemd = self.node.machine, self.node.systemd
        self.host, self.runtime = self.node.host, self.node.runtime
        self.say(f"{driver} driver, units {systemd}, pin at {pin_at}, lists {lists}")
        for kind in kinds:
            self.new_pod(kind)

    def teardown(self) -> None:
        if self.node is not None:
            self.node.close()
        shutil.rmtree(self.base, ignore_errors=True)

    def say(self, line: str) -> None:
        note(line)
        STATS[_kind_of(line)] += 1
        if os.environ.get("NRI_MODEL_DEBUG") and getattr(self, "runtime", None):
            self.host.quiesce() if not self.stalled else None
            cg = {repr(c): str(self.machine.cgroups.cpus(c.path)) for c in self.runtime.running()}
            note(f"    cgroups {cg} owed {sorted(i[:12] for i in self.host.daemon.node.owed)}")

    # --- helpers ------------------------------------------------------------------------------

    def pods(self, *phases: str) -> list[Pod]:
        return [p for p in self.runtime.pods if p.phase in phases]

    def advancing(self) -> list[Pod]:
        return [p for p in self.runtime.pods if self.runtime.next_step(p) is not None]

    def running(self, guaranteed: bool = False) -> list:
        return [
            c
            for c in self.runtime.running()
            if c.pending is None
            and not (c.kind == "init" and not c.sidecar)
            and (not guaranteed or c.pod.qos == "guaranteed")
        ]

    def removed_unrelayed(self) -> list[str]:
        return [p.uid for p in self.runtime.pods if p.phase == "removed" and p.old]

    def pending(self) -> list:
        return [c for c in self.runtime.running() if c.pending is not None]

    # --- kubelet and the runtime --------------------------------------------------------------

    @precondition(
        lambda self: self.host is not None and len(self.pods("planned", "running")) < MAX_PODS
    )
    @rule(kind=st.sampled_from(KINDS))
    def new_pod(self, kind: str) -> None:
        name = f"p{len(self.runtime.pods)}{kind}"
        self.runtime.pods.append(build_pod(kind, name, self.driver))
        self.say(f"pod {name} scheduled")

    @precondition(lambda self: self.host is not None and self.advancing())
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Pods start in parallel: up to four steps, each of a pod hypothesis picks (the
        invariants checked after each, as after every rule)."""
        for i in range(data.draw(st.integers(1, 4), label="steps")):
            pods = self.advancing()
            if not pods:
                return
            if i:
                self.placement_holds()
            pod = data.draw(st.sampled_from(pods), label="pod")
            self.say(self.runtime.advance(pod))

    @precondition(lambda self: self.host is not None and self.running())
    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        ctr = data.draw(st.sampled_from(self.running()), label="container")
        self.say(self.runtime.stop(ctr))

    @precondition(lambda self: self.host is not None and self.pods("running"))
    @rule(data=st.data())
    def remove_pod(self, data: st.DataObject) -> None:
        pod = data.draw(st.sampled_from(self.pods("running")), label="pod")
        self.say(self.runtime.remove_pod(pod))

    @precondition(lambda self: self.host is not None and self.running(guaranteed=True))
    @rule(data=st.data(), milli=st.sampled_from([1000, 2000, 3000, 1500]))
    def resize(self, data: st.DataObject, milli: int) -> None:
        ctr = data.draw(st.sampled_from(self.running(guaranteed=True)), label="container")
        held = self.host.daemon.node.state.assignments.get(ctr.id)
        line = self.runtime.update(ctr, resize_request(milli, milli))
        if "refused" in line:
            self.resizes.append((ctr.id, held.count if held else 0))
        else:
            ctr.milli = ctr.limit = milli
        self.say(line)

    @precondition(lambda self: self.host is not None and self.running())
    @rule(data=st.data())
    def update_kept(self, data: st.DataObject) -> None:
        ctr = data.draw(st.sampled_from(self.running()), label="container")
        self.say(self.runtime.update(ctr, cpuset_request(MACHINE.online)))

    @precondition(lambda self: self.host is not None and self.pending())
    @rule(data=st.data())
    def apply_own(self, data: st.DataObject) -> None:
        ctr = data.draw(st.sampled_from(self.pending()), label="container")
        self.say(self.runtime.apply_own(ctr))

    @precondition(lambda self: self.host is not None and self.runtime.live())
    @rule(which=st.sampled_from(["daemon", "runtime"]))
    def restart(self, which: str) -> None:
        """The daemon is killed and started again on its state directory (Configure and
        Synchronize), or containerd restarts (no Stop/RemovePodSandbox for the pods it had;
        containerd 1.7 kills the plugin it launched and launches it again)."""
        if which == "daemon":
            self.host.restart()
            self.say("daemon killed and started again; " + self.runtime.reconnect())
        else:
            self.say(self.runtime.restart())

    @precondition(lambda self: self.host is not None and self.runtime.live())
    @rule(what=st.sampled_from(["timers", "hotplug", "daemon-reload", "systemd"]), data=st.data())
    def node_event(self, what: str, data: st.DataObject) -> None:
        """Something on the node outside the runtime: the daemon's timers, CPU hotplug,
        systemd (a daemon-reload, a scope that stops or starts taking properties)."""
        if what == "timers":
            self.timers()
        elif what == "hotplug":
            self.hotplug(data.draw(st.sampled_from(HOTPLUG), label="cpu"))
        elif self.driver == "systemd" and what == "daemon-reload":
            if self.units == "dbus" and self.systemd.busy:  # (it works through its calls first)
                self.say(f"systemd answers {self.systemd.answer()} calls late")
                self.timers()
            self.say(f"daemon-reload: {len(self.systemd.daemon_reload())} cgroups written")
        elif self.units and what == "systemd" and self.running():
            ctr = data.draw(st.sampled_from(self.running()), label="container")
            refusing = self.systemd.refusing
            refusing.symmetric_difference_update({ctr.id})
            self.say(f"systemd {'refuses' if ctr.id in refusing else 'takes'} {ctr}'s properties")

    def timers(self) -> None:
        """The daemon's timers come due: the sweep (pods removed unseen), eviction rechecks."""
        fired = self.host.fire_timers()
        if any(isinstance(e, ev.SweepRound) for e in fired):
            self.swept = set(self.removed_unrelayed())
        self.say(f"{len(fired)} timers fired")

    def hotplug(self, cpu: int) -> None:
        """The kernel takes a CPU offline or brings it back (two at most offline)."""
        offline = self.machine.offline
        if cpu not in offline and len(offline) >= 2:
            return
        online = cpu in offline
        self.host.submit(cpu_event(self.machine, cpu, online))
        self.say(f"CPU {cpu} {'online' if online else 'offline'}")

    # --- stalls: a slow disk, the state lock held -------------------------------------------

    # What may happen while requests miss their budget (no restart: a Configure waits without
    # one), each drawn with its own arguments.
    DURING_STALL = ("new_pod", "advance", "advance", "advance", "stop", "remove_pod", "resize",
                    "update_kept", "apply_own", "hotplug", "timers")  # fmt: skip

    @precondition(lambda self: self.host is not None and (self.advancing() or self.running()))
    @rule(what=st.sampled_from(["disk", "lock"]), data=st.data())
    def stall(self, what: str, data: st.DataObject) -> None:
        """The disk stalls (or another process holds the state lock) while up to three things
        happen, each request answered by its fallback within the budget; then it recovers and
        the late work settles before the invariants are checked."""
        self.stalled = what
        self.node.stall.begin(what, self.host.settings.state_dir)
        self.say(f"the {what} stalls")
        try:
            self.some_steps(self.DURING_STALL, data)
        finally:
            self.say(f"the {what} recovers")
            self.recover_now()

    # What may happen while the disk fails: anything, restarts included (nothing waits for it).
    DURING_FAILURE = (*DURING_STALL, "restart")

    @precondition(lambda self: self.host is not None and self.runtime.live())
    @rule(error=st.sampled_from([errno.ENOSPC, errno.EIO]), data=st.data())
    def disk_fails(self, error: int, data: st.DataObject) -> None:
        """The state file's disk is full (ENOSPC) or failing (EIO) while up to three things
        happen, daemon restarts among them; the invariants hold after each.  Nothing waits
        for the disk: a state that cannot be written is kept in memory (an exclusive CPU only
        once the runtime has listed its containers, which give it back after a crash), the
        rest is refused; then the disk recovers."""
        self.node.stall.failing = error
        self.say(f"the disk fails ({errno.errorcode[error]})")
        try:
            self.some_steps(self.DURING_FAILURE, data, check=True)
        finally:
            self.node.stall.failing = 0
            self.say("the disk recovers")

    def some_steps(self, names: tuple[str, ...], data: st.DataObject, check: bool = False) -> None:
        """Up to three of ``names``, each drawn with its own arguments (where it applies); the
        invariants after each when ``check``."""
        for _ in range(data.draw(st.integers(1, STALLED_CALLS), label="steps")):
            name = data.draw(st.sampled_from(names), label="step")
            if self.applicable(name):
                self.during(name, data)
                if check:
                    self.placement_holds()

    def applicable(self, name: str) -> bool:
        return {
            "new_pod": len(self.pods("planned", "running")) < MAX_PODS,
            "advance": bool(self.advancing()),
            "stop": bool(self.running()),
            "remove_pod": bool(self.pods("running")),
            "resize": bool(self.running(guaranteed=True)),
            "update_kept": bool(self.running()),
            "apply_own": bool(self.pending()),
            "restart": bool(self.runtime.live()),
        }.get(name, True)

    def during(self, name: str, data: st.DataObject) -> None:
        method = getattr(self, name)
        if name == "new_pod":
            method(data.draw(st.sampled_from(KINDS), label="kind"))
        elif name == "resize":
            method(data, data.draw(st.sampled_from([1000, 2000, 3000, 1500]), label="milli"))
        elif name == "hotplug":
            method(data.draw(st.sampled_from(HOTPLUG), label="cpu"))
        elif name == "timers":
            method()
        elif name == "restart":
            method(data.draw(st.sampled_from(["daemon", "runtime"]), label="which"))
        else:
            method(data)

    def recover_now(self) -> None:
        self.node.stall.end()
        self.stalled = ""

    # --- the invariants -----------------------------------------------------------------------

    @invariant()
    def placement_holds(self) -> None:
        if self.host is None or self.stalled:
            return
        self.host.quiesce()
        problems = self.violations()
        assert not problems, "\n".join(problems)

    def violations(self) -> list[str]:
        node = self.host.daemon.node
        state = node.state
        problems = []
        problems += exclusive_overlaps(state)
        problems += self.cgroup_overlaps(state)
        problems += self.refusals_kept(state)
        problems += self.gone_but_held(state)
        problems += self.moves_untrue()
        problems += self.interrupts_unrecorded()
        problems += self.splits
        self.splits = []
        if problems and os.environ.get("NRI_MODEL_DEBUG"):
            online = node.policy.topology.online
            problems.append(f"pinned {node.pinned} returned {node.returned} online {online}")
            problems += [f"{r['ACTION']}: {r['MESSAGE']}" for r in self.records[-40:]]
        return problems

    def cgroup_overlaps(self, state: NodeState) -> list[str]:
        """Invariants 1 and 2 on the cgroups of running containers."""
        problems = []
        for ctr in self.runtime.running():
            on = self.machine.cgroups.cpus(ctr.path)
            if on is None:
                problems.append(f"running {ctr} has no cgroup")
                continue
            held = state.assignments.get(ctr.id)
            own = held.cpus if held is not None else CPUSet()
            taken = on & (state.exclusive - own)
            if taken and self.owed_unwritable(ctr):
                continue
            if taken:
                kind = "(1) exclusive" if own else "(2) shared"
                who = self.machine.cgroups.writer_of(ctr.path)
                owed = "owed" if ctr.id in self.host.daemon.node.owed else "not owed"
                pending = f", update pending {ctr.pending.cpu.cpus}" if ctr.pending else ""
                problems.append(
                    f"{kind} container {ctr} ({owed}{pending}) runs on {on} (last written by "
                    f"{who}), of which "
                    f"{taken} are exclusive to others; assignments "
                    f"{ {c[:14]: str(a.cpus) for c, a in state.assignments.items()} }, "
                    f"earmarks { {u: str(e.cpus) for u, e in state.earmarks.items()} }"
                )
        return problems

    def owed_unwritable(self, ctr: Ctr) -> bool:
        """Where invariants 1 and 2 cannot hold: a container the daemon cannot write (the
        systemd driver without systemd, or a scope systemd refuses to change) is moved only by
        the runtime, with the next reply that can carry updates.  What changes outside replies
        - an earmark at RunPodSandbox, CPU hotplug, the sweep, late work, the runtime applying
        an older answer of an UpdateContainer after its call returned (docs/nri-wire.md §11.3)
        - leaves it where it is until then.  What must hold: the daemon knows it, and owes it
        to that reply (a reply that creates a container on those CPUs carries it, and the
        runtime applies it before it creates the container)."""
        node = self.host.daemon.node
        if ctr.id not in node.owed:
            return False
        return ctr.id in self.systemd.refusing or not node.writer.can_write(
            ctr.msg.linux.cgroups_path
        )

    def refusals_kept(self, state: NodeState) -> list[str]:
        """Invariant 3."""
        problems = []
        disk = StateStore(self.host.settings.state_dir).peek().state
        for cid, request in self.runtime.refused:
            if request == "UpdateContainer":
                continue
            if cid in state.assignments:
                problems.append(
                    f"(3) refused {request} of {cid[:20]} holds {state.assignments[cid].cpus}"
                )
            if disk is not None and cid in disk.assignments:
                problems.append(f"(3) refused {request} of {cid[:20]} holds CPUs on disk")
        live = {c.id for c in self.runtime.live()}
        for cid, held in self.resizes:
            if cid not in live:
                continue  # stopped meanwhile
            now = state.assignments.get(cid)
            if (now.count if now is not None else 0) != held:
                problems.append(f"(3) refused resize of {cid[:20]}: held {held} CPUs, now {now}")
        self.resizes = []
        return problems

    def interrupts_unrecorded(self) -> list[str]:
        """Invariant 7: an interrupt's online CPUs that the kernel gave it (at boot, or when a
        hotplug left it none) and that it lacks now are on disk as taken (recorded before
        written: a crash can always give them back)."""
        disk = StateStore(self.host.settings.state_dir).peek().state
        recorded = disk.irqs if disk is not None else {}
        problems = []
        for number, now in affinities(self.machine.proc).items():
            if number not in IRQS:
                continue  # the default affinity (a mask)
            lost = (self.machine.irq_set[number] - CPUSet.parse(now)) & self.machine.online
            held = recorded.get(number)
            if lost - (held.taken if held is not None else CPUSet()):
                problems.append(f"(7) interrupt {number} lost CPUs {lost}; on disk: {held}")
        return problems

    def gone_but_held(self, state: NodeState) -> list[str]:
        """Invariant 4."""
        live = {c.id for c in self.runtime.live()}
        problems = [
            f"(4) {cid[:20]} holds {a.cpus} but the runtime has no such container"
            for cid, a in state.assignments.items()
            if cid not in live
        ]
        pods = {p.uid: p for p in self.runtime.pods}
        for uid, mark in state.earmarks.items():
            pod = pods.get(uid)
            if pod is None or pod.phase == "running":
                continue
            if not pod.old or uid in self.swept:
                problems.append(f"(4) CPUs {mark.cpus} stay earmarked for removed pod {pod}")
        return problems

    def observe(self, record: dict) -> None:
        """Invariants 5 and 6 as each record is made (on the daemon's worker thread, right
        after what it reports: a write, an event's commit)."""
        self.moved(record)
        host = self.host
        if host is None:
            return
        node = host.daemon.node
        now, before = node.state, self.seen_state
        if before is not None and now is not before:
            self.splits += earmark_splits(node.policy, before, now, node.pinned)
        self.seen_state = now

    def moved(self, record: dict) -> None:
        """Invariant 5, as each record is made (right after the write it reports)."""
        if record.get("MOVED") != "yes":
            return
        runtime = getattr(self, "runtime", None)
        ctr = runtime.by_id.get(record["CONTAINER_ID"]) if runtime is not None else None
        on = self.machine.cgroups.cpus(ctr.path) if ctr is not None else None
        if on != CPUSet.parse(record["CPUS"]):
            self.untrue.append(f"(5) audit says {ctr} was moved to {record['CPUS']}; it is on {on}")

    def moves_untrue(self) -> list[str]:
        problems, self.untrue = self.untrue, []
        return problems


def exclusive_overlaps(state: NodeState) -> list[str]:
    """Invariant 1 on the state: assignments and earmarks pairwise disjoint."""
    sets = [(f"container {cid[:20]}", a.cpus) for cid, a in state.assignments.items()]
    sets += [(f"earmark of {uid}", e.cpus) for uid, e in state.earmarks.items()]
    problems = []
    for i, (who, cpus) in enumerate(sets):
        for other, theirs in sets[i + 1 :]:
            if cpus & theirs:
                problems.append(f"(1) {who} and {other} both hold {cpus & theirs}")
    return problems


def broken_cores(topology: Topology, cpus: CPUSet, source: CPUSet) -> int:
    """How many cores wholly within ``source`` ``cpus`` take part of only."""
    cores = set()
    for cpu in cpus:
        try:
            siblings = topology.siblings(cpu)
        except KeyError:
            continue
        if siblings <= source and not siblings <= cpus:
            cores.add(min(siblings))
    return len(cores)


def earmark_splits(policy, before: NodeState | None, after: NodeState, pinned: CPUSet) -> list[str]:
    """Invariant 6: each earmark made or trimmed in this step splits no more of the whole
    cores it was chosen from than a whole-core choice of as many CPUs from the same CPUs (the
    free ones when it was made - less ``pinned``, the CPUs running containers look pinned to
    although the state does not hold them, which the daemon never hands out - or the earmark
    it was trimmed from)."""
    if before is None or before.fingerprint != after.fingerprint:
        return []  # (the online CPUs changed in this step: chosen from what, then?)
    problems = []
    for uid, mark in after.earmarks.items():
        old = before.earmarks.get(uid)
        if old is not None and old.cpus == mark.cpus:
            continue
        # What it was chosen from: the CPUs free before the step (the earmark it was trimmed
        # from), less what others hold now (several earmarks may be made in one step).
        source = policy.free_exclusive(before) - pinned if old is None else old.cpus
        source = source - (after.exclusive - mark.cpus)
        if not mark.cpus <= source:
            continue  # the CPUs changed under it (hotplug), or several steps in one
        try:
            best = policy.allocator.allocate(source, len(mark.cpus))
        except AllocationError:
            continue
        topology = policy.topology
        broken = broken_cores(topology, mark.cpus, source)
        if broken > broken_cores(topology, best, source):
            problems.append(
                f"(6) pod {uid} earmarked {mark.cpus} (from {source}): splits {broken} whole "
                f"cores where {best} splits {broken_cores(topology, best, source)}"
            )
    return problems


class DBusNodeModel(NodeModel):
    """The same node with the systemd driver and the daemon's own ``SystemdUnits`` (daemon/
    units.py) on FAKE D-Bus (tests/model_dbus.py), and systemd's faults besides: busy, late
    answers and refusals, re-executions that lose the calls not read yet, unit files hidden
    (issue 40).  A separate machine, so that NodeModel's schedules stay what they were; the
    disk and the lock never stall here (NodeModel covers them), which keeps its steps for
    systemd's faults."""

    def stall(self, what: str, data: st.DataObject) -> None:  # (no rule here: see above)
        raise AssertionError("no stalls in this machine")

    def owed_unwritable(self, ctr: Ctr) -> bool:
        """As NodeModel's, and: a container whose own update the runtime has yet to apply (it
        does right after the call returns, docs/nri-wire.md §11.3, which the model defers to a
        later step) - a re-exec meanwhile puts back what systemd held, which that update
        replaces; the daemon gave the container to the runtime."""
        return ctr.pending is not None or super().owed_unwritable(ctr)

    @precondition(lambda self: self.host is not None and self.systemd.queue)
    @rule()
    def reexec_with_calls_unread(self) -> None:
        """systemd re-executes while calls wait unread (the case that loses them)."""
        self.systemd_fault("reexec")

    @initialize(
        config=st.sampled_from(DBUS_CONFIGS),
        kinds=st.lists(st.sampled_from(KINDS), min_size=2, max_size=MAX_PODS),
        busy=st.booleans(),
    )
    def boot(self, config: Config, kinds: list[str], busy: bool) -> None:
        """As NodeModel's, and systemd may be busy from the start (its calls pending, then
        lost or answered late, are what its faults are about)."""
        super().boot(config, kinds)
        self.systemd.busy = busy

    @precondition(lambda self: self.host is not None)
    @rule(what=st.sampled_from(["busy", "answer", "reexec", "hide", "show"]))
    def systemd_fault(self, what: str) -> None:
        """systemd reached over FAKE D-Bus (tests/model_dbus.py) gets busy (calls queue,
        pending), answers what it had not read (refusals among them, late), re-executes (the
        unread calls lost, every unit re-applied to its cgroup), or its unit files are hidden
        from the daemon, or shown again (a scope refusing: NodeModel's "systemd" event).
        After an answer or a re-exec the daemon's timers come due - its follow-up, 0.2 s
        later, before anything else happens (what it cannot know of before, no daemon can
        act on)."""
        systemd = self.systemd
        if what == "busy":
            systemd.busy = True
            self.say("systemd busy")
        elif what in ("answer", "reexec"):
            if what == "answer":
                self.say(f"systemd answers {systemd.answer()} calls late")
            else:
                lost = len(systemd.queue)
                self.say(f"systemd re-executes: {lost} calls lost, {len(systemd.reexec())} "
                         "cgroups written")  # fmt: skip
            if not self.stalled:
                self.timers()
        else:
            systemd.hide(what == "hide")
            self.say(f"systemd's unit files {'hidden' if systemd.hidden else 'shown'}")


NodeModel.TestCase.settings = settings(
    max_examples=EXAMPLES,
    phases=tuple(Phase) if os.environ.get("NRI_MODEL_SHRINK", "1") == "1" else [Phase.generate],
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
TestNodeModel = NodeModel.TestCase
# Three times as many schedules: a fault must meet calls in flight to matter (~30 s for 150).
DBusNodeModel.TestCase.settings = settings(NodeModel.TestCase.settings, max_examples=EXAMPLES * 3)
TestDBusNodeModel = DBusNodeModel.TestCase
