"""The update storm (tests/e2e/test_update_storm.py says what it is and why): CRI calls racing
the daemon's own changes to the same containers, on one private containerd.  Shared by the test,
which asserts that no call hangs, and the benchmark (bench/bench_storm.py), which reports how
long the calls took with the daemon and without any plugin."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from harness.containerd import Containerd
from harness.cri import CRIClient, CRIError
from harness.k8s import ContainerSpec, PodSpec

from e2e.cpu_hotplug import restore_cpu, set_online

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
    """Every CRI call of the storm, timed: how long each took, per method (``took``), the
    longest, counts, and the errors."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.lock = threading.Lock()
        self.longest: dict[str, float] = {}
        self.took: dict[str, list[float]] = {}
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
            self.took.setdefault(method, []).append(took)
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

    def __init__(self, containerd: Containerd, shared: list[str], hotplug: bool = True) -> None:
        self.containerd = containerd
        self.with_hotplug = hotplug
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
        bodies.append(("churn", self.churn))
        if self.with_hotplug:
            bodies.append(("hotplug", self.hotplug))
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


def run(storm: Storm, seconds: float) -> tuple[float, list[str]]:
    """Run the storm for ``seconds`` (less if the runtime hangs): (seconds it ran, the threads
    still blocked in a CRI call at the end)."""
    started = time.monotonic()
    storm.start()
    try:
        storm.stop.wait(seconds)
    finally:
        stuck = storm.finish()
    return time.monotonic() - started, stuck


def unsolicited_updates(containerd: Containerd) -> int:
    """How many times the runtime was asked for container updates outside its replies."""
    return containerd.log_path.read_text(errors="replace").count(UNSOLICITED)
