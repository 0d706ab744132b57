"""A storm of CRI calls racing the daemon's own changes to the same containers, on real
containerd 1.7.24, 2.1.9 and 2.3.4: no CRI call may hang, and the runtime and the daemon must
still work afterwards.

Every containerd with an NRI before 0.12.1 deadlocks for good when a plugin's unsolicited
``UpdateContainers`` meets any CRI call on its way into NRI: the runtime serves the first
holding NRI's adaptation lock while it waits for its own NRI lock, and every CRI event takes
the two the other way round (docs/architecture.md, "Changes outside event replies").  The
daemon changes containers outside event replies after CPU hotplug (an exclusive container
whose CPU goes offline is degraded into the shared pool, and restored when the CPU returns;
the shared containers follow the pool), after RemoveContainer / RemovePodSandbox and in its
background checks.  It used to tell the runtime with UpdateContainers; this storm wedged all
three versions within its first few hotplugs.  It now writes the cgroups itself.

For ``STORM`` seconds per version, concurrently:

* ``UPDATERS`` threads call UpdateContainerResources in a loop on the running shared
  (Burstable) containers and on the exclusive container running at the time - the very
  containers the daemon changes outside its replies - alternating kubelet's re-application of
  limits (the reply keeps our cpuset) with in-place resizes of a shared container's request;
* one thread creates, starts, stops and removes exclusive (Guaranteed, 1 CPU) containers and
  their pods (stopping the container first, or leaving that to StopPodSandbox and
  RemovePodSandbox on every other round);
* one thread takes CPU 1 offline and back (e2e/cpu_hotplug.py, as test_hotplug.py does) just
  after an exclusive container has started on it, bringing it back before that container
  ends or, every other time, after.

Every CRI call must return within ``BOUND`` seconds; the longest call per version is printed as
one JSON line, ``STORM-RESULT {...}`` (``pytest -s``, or ``-rP``).  The storm must have made the
daemon change containers the updaters were hitting, outside its replies, or it proved nothing
(its ``outside-reply`` audit records say which); and the runtime must never have been asked for
an unsolicited update (containerd logs each one).  At the end a new exclusive container is
pinned to CPU 1 and the shared containers are off it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import host
from harness.containerd import RELEASES, Containerd
from harness.cri import CRIClient, CRIError
from harness.k8s import ContainerSpec, PodSpec

from e2e.cpu_hotplug import check_hotpluggable, restore_cpu, set_online
from e2e.daemon import Daemon, check_agreement, wait_for

BOUND = 10.0  # seconds: the longest any CRI call may take
STORM = 30.0  # seconds of storm per containerd version
# The gRPC deadline of each call: past BOUND, so that a hung call is measured as one and ends
# the storm, rather than hanging the test.
CALL_TIMEOUT = BOUND + 5
UPDATERS = 3
SHARED = 4
EXCLUSIVE_LIVES = 0.8  # seconds each exclusive container of the churn runs
# Seconds CPU 1 stays offline, in turn: shorter than the exclusive container under it lives
# (it is degraded, then restored) and longer (it ends degraded, and the shared containers
# grow back onto CPU 1 when it returns) ...
OFFLINE_FOR = (0.5, 1.5)
ONLINE_FOR = 1.0  # ... and online at least, between cycles
# gRPC codes that mean the runtime did not answer in time or went away: a hang, never a race.
HANG = ("DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED")
# What containerd logs (NRI's adaptation, every version) for each unsolicited UpdateContainers.
UNSOLICITED = "requested container updates"


@pytest.fixture(scope="module", autouse=True)
def _cpu_restored() -> Iterator[None]:
    check_hotpluggable()
    yield
    restore_cpu()


def burstable(name: str) -> ContainerSpec:
    return ContainerSpec(name, cpu_request_milli=250, memory="32Mi")


def guaranteed(name: str) -> ContainerSpec:
    return ContainerSpec.guaranteed(name, 1)


def error_kind(details: str) -> str:
    """A runtime's error message without what varies (ids, paths, repeated prefixes): its
    first and last words say what failed and why."""
    text = re.sub(r"/\S+|[0-9a-f]{64}", "_", details)
    text = re.sub(r"(failed to update resources: )+", "failed to update resources: ", text)
    return text if len(text) <= 120 else f"{text[:50]} ... {text[-65:]}"


class Abandoned(Exception):
    """The runtime hung: the storm's threads stop where they are."""


class Calls:
    """Every CRI call of the storm, timed: the longest per method, counts, and the errors."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.lock = threading.Lock()
        self.longest: dict[str, float] = {}
        self.ok: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.hangs: list[str] = []

    def __call__(self, method: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``'s result, or the CRIError it raised: the storm expects races (a
        container stopped while it is updated, an exclusive CPU that is offline just now)."""
        if self.hangs:
            raise Abandoned
        started = time.monotonic()
        try:
            result = fn(*args, **kw)
        except CRIError as err:
            result = err
        took = time.monotonic() - started
        with self.lock:
            self.longest[method] = max(self.longest.get(method, 0.0), took)
            if isinstance(result, CRIError):
                self.failed[method] += 1
                self.errors[f"{method}: {result.code}: {error_kind(result.details)}"] += 1
                if result.code in HANG:
                    self.hangs.append(f"{method} failed after {took:.1f} s: {result}")
            else:
                self.ok[method] += 1
            if took > BOUND:
                self.hangs.append(f"{method} took {took:.1f} s")
            if self.hangs:
                self.stop.set()  # the runtime is wedged: nothing more to learn
        return result

    def slowest(self) -> tuple[str, float]:
        with self.lock:
            method = max(self.longest, key=self.longest.__getitem__)
            return method, self.longest[method]


class Storm:
    """The storm's threads and what they share: the containers the updaters hit, and the
    exclusive container running now (CPU 1 goes offline under it)."""

    def __init__(self, containerd: Containerd, shared: list[str]) -> None:
        self.containerd = containerd
        self.stop = threading.Event()
        self.calls = Calls(self.stop)
        self.shared = shared
        self.exclusive: str | None = None
        self.exclusive_started = threading.Event()
        self.hit: set[str] = set()  # containers an UpdateContainerResources succeeded on
        self.cycles = 0
        self.hotplug_errors: list[str] = []
        self.crashes: list[str] = []
        self.clients: list[CRIClient] = []
        self.threads: list[threading.Thread] = []

    def client(self) -> CRIClient:
        """One CRI client (gRPC channel) per thread, as kubelet's goroutines would each call."""
        c = CRIClient(
            self.containerd.address,
            top_cgroup=self.containerd.top_cgroup,
            log_root=self.containerd.dir / "logs",
            timeout=CALL_TIMEOUT,
        )
        self.clients.append(c)
        return c

    def start(self) -> None:
        bodies: list[tuple[str, Callable[[], None]]] = [
            (f"updater-{i}", lambda i=i: self.updater(i)) for i in range(UPDATERS)
        ]
        bodies += [("churn", self.churn), ("hotplug", self.hotplug)]
        for name, body in bodies:
            thread = threading.Thread(target=self._run, args=(name, body), name=name, daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run(self, name: str, body: Callable[[], None]) -> None:
        try:
            body()
        except Abandoned:
            pass
        except BaseException as err:  # reported by the test, never lost with the thread
            self.crashes.append(f"{name}: {type(err).__name__}: {err}")
            self.stop.set()

    def finish(self) -> list[str]:
        """Stop the storm; returns the threads that did not end (each call ends within
        CALL_TIMEOUT, so none should be left)."""
        self.stop.set()
        deadline = time.monotonic() + CALL_TIMEOUT + 10
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        restore_cpu()
        for c in self.clients:
            c.close()
        return [t.name for t in self.threads if t.is_alive()]

    def updater(self, index: int) -> None:
        c = self.client()
        n = index
        while not self.stop.is_set():
            exclusive = self.exclusive
            targets = [*self.shared, *([exclusive] if exclusive else [])]
            cid = targets[n % len(targets)]
            n += 1
            if cid == exclusive or n % 2:
                # Kubelet re-applying a container's limits: the runtime re-applies its stored
                # spec, and our reply keeps our cpuset (and a degraded container's quota).
                memory = "64Mi" if n % 4 < 2 else "48Mi"
                result = self.calls(
                    "UpdateContainerResources", c.update_resources, cid, memory=memory
                )
            else:
                # An in-place resize of a shared container's CPU request: it stays shared.
                milli = 250 if n % 4 < 2 else 300
                result = self.calls(
                    "UpdateContainerResources", c.update_resources, cid, cpu_request_milli=milli
                )
            if not isinstance(result, CRIError):
                self.hit.add(cid)

    def churn(self) -> None:
        c = self.client()
        i = 0
        while not self.stop.is_set():
            i += 1
            pod = self.calls("RunPodSandbox", c.run_pod, PodSpec(f"x{i}", qos="guaranteed"))
            if isinstance(pod, CRIError):
                continue
            # Refused while CPU 1 is offline: the storm's hotplug, not a failure.
            cid = self.calls("CreateContainer", c.create_container, pod, guaranteed(f"x{i}"))
            created = not isinstance(cid, CRIError)
            if created and not isinstance(self.calls("StartContainer", c.start, cid), CRIError):
                self.exclusive = cid
                self.exclusive_started.set()
                self.stop.wait(EXCLUSIVE_LIVES)
                self.exclusive = None
            if created and i % 2:
                # As kubelet does; on even rounds StopPodSandbox stops it and RemovePodSandbox
                # removes it.
                self.calls("StopContainer", c.stop, cid, 0)
                self.calls("RemoveContainer", c.remove, cid)
            self.calls("StopPodSandbox", c.stop_pod, pod)
            self.calls("RemovePodSandbox", c.remove_pod, pod)

    def hotplug(self) -> None:
        while not self.stop.is_set():
            # Right after an exclusive container started, when one does within a while: it
            # is degraded into the shared pool, and restored if it still runs when the CPU
            # returns; if not, the shared containers grow back onto the CPU then.
            self.exclusive_started.wait(2 * EXCLUSIVE_LIVES)
            self.exclusive_started.clear()
            if self.stop.is_set():
                break
            try:
                set_online(False)
            except OSError as err:  # the kernel may refuse on a busy machine: try again
                self.hotplug_errors.append(str(err))
                self.stop.wait(ONLINE_FOR)
                continue
            try:
                self.stop.wait(OFFLINE_FOR[self.cycles % len(OFFLINE_FOR)])
            finally:
                restore_cpu()
            self.cycles += 1
            self.stop.wait(ONLINE_FOR)


def test_cri_calls_never_hang_while_the_daemon_changes_the_same_containers(
    containerd: Containerd,
    cri: CRIClient,
    daemon: Daemon,
    containerd_version: str,
    record_property: Callable[[str, object], None],
) -> None:
    shared = [cri.run(f"s{i}", [burstable(f"s{i}")])[f"s{i}"] for i in range(SHARED)]
    assert check_agreement(daemon, cri) == {f"s{i}": "0-1" for i in range(SHARED)}
    storm = Storm(containerd, shared)
    before = len(daemon.records())
    started = time.monotonic()
    storm.start()
    try:
        storm.stop.wait(STORM)
    finally:
        stuck = storm.finish()
    took = time.monotonic() - started

    records = daemon.records()[before:]
    outside = [r for r in records if r["ACTION"] == "outside-reply"]
    changed = Counter(cid for r in outside for cid in r["CONTAINER_IDS"].split(","))
    exclusive_changed = sorted(set(changed) & storm.hit - set(shared))
    shared_changed = sorted(set(changed) & set(shared))
    method, longest = storm.calls.slowest()
    unsolicited = containerd.log_path.read_text(errors="replace").count(UNSOLICITED)
    result = {
        "containerd": RELEASES[containerd_version],
        "storm_s": round(took, 1),
        "longest_call_s": round(longest, 3),
        "longest_call": method,
        "longest_per_method_s": {m: round(s, 3) for m, s in sorted(storm.calls.longest.items())},
        "calls_ok": dict(storm.calls.ok),
        "calls_failed": dict(storm.calls.failed),
        "hotplug_cycles": storm.cycles,
        "outside_reply_changes": len(outside),
        "written_directly": sum(int(r["WRITTEN"]) for r in outside),
        "owed_to_runtime": sum(int(r["OWED"]) for r in outside),
        "changed_exclusive_containers_also_updated": len(exclusive_changed),
        "changed_shared_containers": len(shared_changed),
        "unsolicited_updates": unsolicited,
    }
    print("STORM-RESULT " + json.dumps(result, sort_keys=True))
    record_property("storm", json.dumps(result, sort_keys=True))  # in --junitxml reports
    print("STORM-ERRORS " + json.dumps(storm.calls.errors.most_common(10)))

    assert not stuck, f"threads still blocked in a CRI call: {stuck}"
    assert not storm.crashes, storm.crashes
    assert not storm.calls.hangs, f"CRI calls hung: {storm.calls.hangs[:5]}"
    assert longest < BOUND, result
    # The storm happened ...
    assert storm.calls.ok["UpdateContainerResources"] >= 100, result
    # Races with hotplug and the churn fail a few updates (an exclusive CPU that went offline
    # between our reply and runc, a container stopped meanwhile); more would be a bug.
    assert storm.calls.failed["UpdateContainerResources"] * 20 <= sum(storm.calls.ok.values())
    assert storm.calls.ok["StartContainer"] >= 5 and storm.calls.ok["RemovePodSandbox"] >= 5
    assert storm.cycles >= 5, (result, storm.hotplug_errors)
    # ... and raced the daemon: it changed, outside its replies, exclusive containers the
    # updaters were hitting (degraded and restored) and the shared ones.
    assert len(exclusive_changed) >= 3, result
    assert shared_changed, result
    # Never through the runtime's UpdateContainers, which is what deadlocks it.
    assert unsolicited == 0, result

    # Still healthy: the daemon is connected and synchronized with this runtime ...
    assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon died"
    assert not [r for r in records if r["ACTION"] == "disconnect"], "the runtime dropped us"
    assert host.online_cpus() == [0, 1]
    wait_for(
        "the churn's containers to be gone and CPU 1 back in the shared pool",
        lambda: not daemon.state()["assignments"] and daemon.state()["shared"] == "0-1",
    )
    # ... and a new exclusive container is pinned, with the shared ones off its CPU.
    final = cri.run("final", [guaranteed("final")])["final"]
    assert host.cpus_allowed_list(cri.inspect(final).pid) == "1"
    assert check_agreement(daemon, cri) == {"final": "1", **{f"s{i}": "0" for i in range(SHARED)}}
