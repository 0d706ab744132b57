"""NRI 0.12 on the wire, against real containerd 2.3.4 (and any later kind the harness gets).

* The version exchange: we register saying which NRI we speak, the runtime's Configure says
  which NRI it runs; both ends log or keep what the other said.
* One RPC per lifecycle event: a plugin with every handler gets each of the 13 events by its
  own method and never a StateChange (a test per method, from one kubelet-shaped lifecycle
  including CRI UpdateContainerResources and UpdatePodSandboxResources), and nothing else.
* The fallback: a plugin that answers one per-event method UNIMPLEMENTED gets that event as
  StateChange instead, and from then on every event that has a StateChange form (a test per
  method); the runtime records the deprecation.
* The CPU plugin daemon: subscribed to UpdatePodSandbox here (never on 1.7/2.1, whose NRI
  would refuse the bit), it re-asserts a resized pod's cpusets through the runtime.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import host
from harness.containerd import VERSIONS, Containerd, at_least
from harness.cri import CRIClient
from harness.k8s import ContainerSpec

from e2e.daemon import Daemon, check_agreement, wait_for
from e2e.plugin_process import PluginProcess
from nri_cpuplugin.nri.handlers import PER_EVENT_METHODS
from nri_cpuplugin.nri.stub import NRI_VERSION

NRI_012 = sorted(v for v in VERSIONS if at_least(v, "2.3"))

# (event, container, the NRI 0.12 method that carries it), in the order the lifecycle below
# produces them.
LIFECYCLE = [
    ("run_pod_sandbox", None, "RunPodSandbox"),
    ("create_container", "work", "CreateContainer"),
    ("post_create_container", "work", "PostCreateContainer"),
    ("start_container", "work", "StartContainer"),
    ("post_start_container", "work", "PostStartContainer"),
    ("update_container", "work", "UpdateContainer"),
    ("post_update_container", "work", "PostUpdateContainer"),
    ("update_pod_sandbox", None, "UpdatePodSandbox"),
    ("post_update_pod_sandbox", None, "PostUpdatePodSandbox"),
    ("stop_container", "work", "StopContainer"),
    ("remove_container", "work", "RemoveContainer"),
    ("stop_pod_sandbox", None, "StopPodSandbox"),
    ("remove_pod_sandbox", None, "RemovePodSandbox"),
]
# Events with a StateChange form: the ones NRI 0.12 falls back for (docs/nri-wire.md §9.5).
FALLBACK = set(PER_EVENT_METHODS)


@pytest.fixture(params=NRI_012, ids=lambda v: f"containerd-{v}")
def containerd_version(request: pytest.FixtureRequest) -> str:
    """This module's tests need NRI 0.12: only the harness's containerd 2.3 and later."""
    return request.param


def drive_lifecycle(cri: CRIClient) -> None:
    """Every event once, as kubelet causes them: a pod with one container, an in-place resize
    of the container and then of the pod, teardown."""
    pod = cri.run("life", [ContainerSpec("work", cpu_request_milli=250, memory="32Mi")])
    cri.update_resources(pod["work"], cpu_request_milli=300)
    cri.update_pod_resources(pod.id, cpu_request_milli=300, cpu_limit_milli=500)
    cri.stop(pod["work"])
    cri.remove(pod["work"])
    cri.stop_pod(pod.id)
    cri.remove_pod(pod.id)


def delivered_lifecycle(plugin: PluginProcess, ctrd: Containerd) -> list[tuple]:
    def complete() -> list[tuple] | None:
        got = [d for d in plugin.delivered() if d[0] != "synchronize"]
        return got if len(got) >= len(LIFECYCLE) else None

    try:
        return wait_for("every lifecycle event", complete)  # type: ignore[return-value]
    except AssertionError:
        pytest.fail(f"delivered so far: {plugin.delivered()}\n{ctrd.log_tail()}", pytrace=False)


# -- one method per event, and nothing else ----------------------------------------------------


@dataclass(frozen=True)
class Served:
    version: str
    records: list[dict]
    delivered: list[tuple]
    methods: set[str]
    stub_log: list[str]
    configure: dict
    runtime_log: str


@pytest.fixture(scope="module", params=NRI_012, ids=lambda v: f"containerd-{v}")
def served(
    request: pytest.FixtureRequest, lab: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """One lifecycle through a plugin that handles every event, shared by the per-method
    tests below (each asks about its method)."""
    ctrd = Containerd(request.param, lab=lab)
    plugin = PluginProcess(tmp_path_factory.mktemp("served") / "events.jsonl")
    error = None
    try:
        try:
            ctrd.start()
        except Exception as e:
            error = f"containerd {ctrd.version} did not start: {e}"
        if error is None:
            plugin.start(ctrd.nri_socket)
            drive_lifecycle(ctrd.cri())
            delivered = delivered_lifecycle(plugin, ctrd)
            result = Served(
                version=ctrd.release,
                records=plugin.events(),
                delivered=delivered,
                methods={r["method"] for r in plugin.events("rpc")},
                stub_log=[r["message"] for r in plugin.events("stub-log")],
                configure=plugin.events("configure")[0],
                runtime_log=ctrd.log_path.read_text(errors="replace"),
            )
    finally:
        plugin.stop()
        left = ctrd.teardown()
    if error:
        pytest.fail(error, pytrace=False)
    yield result
    if left:
        pytest.fail("teardown left things behind:\n  " + "\n  ".join(left), pytrace=False)


@pytest.mark.parametrize(
    ("event", "container", "method"), LIFECYCLE, ids=[m for _, _, m in LIFECYCLE]
)
def test_each_event_arrives_by_its_own_method(served, event, container, method):
    assert (event, container, method) in served.delivered, served.delivered


def test_events_arrive_in_lifecycle_order_and_never_as_state_change(served):
    assert served.delivered == LIFECYCLE
    assert "StateChange" not in served.methods
    assert not [line for line in served.stub_log if "UNIMPLEMENTED" in line]
    assert "deprecated=StateChange" not in served.runtime_log


def test_pod_update_carries_the_pods_new_resources(served):
    """CRI UpdatePodSandboxResources(resources: 300m request, 500m limit; no overhead) as
    NRI UpdatePodSandbox: LinuxResources with kubelet's shares, quota and period."""
    [update] = [r for r in served.records if r["event"] == "update_pod_sandbox"]
    assert (update["shares"], update["quota"], update["period"]) == (307, 50_000, 100_000)
    assert update["overhead_set"] is False and update["pod"] == "life"


def test_the_runtime_calls_nothing_else(served):
    """Registration, sync and the 13 event methods: no Shutdown, no validation (we never
    subscribe to it), nothing answered UNIMPLEMENTED."""
    assert served.methods == {"Configure", "Synchronize"} | {m for _, _, m in LIFECYCLE}


def test_version_exchange_at_registration(served):
    # What the runtime said in Configure (NRI_version, field 6), kept by the stub as said.
    assert served.configure["nri_version"] == "v0.12.0"
    assert served.configure["nri_inferred"] is False
    assert served.configure["version"] == f"v{served.version}"
    # What we said in RegisterPlugin (NRI_version, field 3), as the runtime logged it.
    logged = re.search(
        r'registered as \\"50-transport\\" \(with NRI version ([^)]*)\)', served.runtime_log
    )
    assert logged and logged.group(1) == NRI_VERSION


# -- UNIMPLEMENTED: the runtime falls back to StateChange -----------------------------------------


@pytest.mark.parametrize("method", sorted(FALLBACK))
def test_unimplemented_method_falls_back_to_state_change(make_containerd, tmp_path, method):
    ctrd = make_containerd()
    plugin = PluginProcess(tmp_path / "events.jsonl").start(ctrd.nri_socket, unimplemented=[method])
    try:
        drive_lifecycle(ctrd.cri())
        delivered = delivered_lifecycle(plugin, ctrd)
    finally:
        plugin.stop()
    # Up to the refused method every event came by its own method; the refused one came again
    # as StateChange, and so did every later event that has a StateChange form: the runtime
    # wraps the plugin for good.  The others (CreateContainer, UpdateContainer,
    # UpdatePodSandbox, StopContainer) have no such form and keep their methods.
    refused_at = next(i for i, (_, _, m) in enumerate(LIFECYCLE) if m == method)
    expected = [
        (event, container, "StateChange" if i >= refused_at and m in FALLBACK else m)
        for i, (event, container, m) in enumerate(LIFECYCLE)
    ]
    assert delivered == expected
    answered = [r["message"] for r in plugin.events("stub-log") if "UNIMPLEMENTED" in r["message"]]
    assert answered == [f"answering {method} with UNIMPLEMENTED"]  # asked once, never again
    log = ctrd.log_path.read_text(errors="replace")
    assert re.search(
        rf"deprecated=StateChange details=\"does not implement a dedicated {method} RPC call\"",
        log,
    ), ctrd.log_tail()


# -- the CPU plugin daemon: pod-level resize --------------------------------------------------


def test_daemon_subscribes_to_pod_updates_and_reasserts_cpusets_on_a_pod_resize(
    containerd: Containerd, cri: CRIClient, tmp_path: Path
) -> None:
    daemon = Daemon(containerd.nri_socket, tmp_path / "state").start()
    try:
        [config] = daemon.records("config")
        assert config["NRI_VERSION"] == "v0.12.0"
        pod = cri.run("resized", [ContainerSpec.guaranteed("pinned", 1)])
        other = cri.run("other", [ContainerSpec("shared", cpu_request_milli=250, memory="32Mi")])
        path = cri.cgroup_path(pod["pinned"])
        assert host.read_cgroup(path, "cpuset.cpus") == "1"
        # Someone widened the pinned container's cpuset behind our back (cgroup v1: its
        # parents have CPU 0 too) ...
        (host.cgroup_dir(path, "cpuset") / "cpuset.cpus").write_text("0-1")
        assert host.cpus_allowed_list(cri.inspect(pod["pinned"]).pid) == "0-1"
        # ... then kubelet resizes the pod in place: pod-level cgroups first, then
        # UpdatePodSandboxResources, which containerd 2.3 relays as NRI UpdatePodSandbox.
        cri.update_pod_resources(pod.id, cpu_request_milli=1000, cpu_limit_milli=1000)
        [record] = wait_for("the pod-update record", lambda: daemon.records("pod-update"))
        assert record["POD_NAME"] == "resized" and record["CPU_LIMIT_MILLI"] == "1000"
        # The reply carries nothing; the daemon writes the cgroups itself (never an
        # unsolicited UpdateContainers, which can deadlock the runtime).
        wait_for(
            "the pinned cpuset back",
            lambda: host.read_cgroup(path, "cpuset.cpus") == "1",
        )
        assert host.cpus_allowed_list(cri.inspect(pod["pinned"]).pid) == "1"
        assert check_agreement(daemon, cri) == {"pinned": "1", "shared": "0"}
        assert other  # the other pod's container was not touched: still on the shared CPU
    finally:
        daemon.stop()


def test_cpu_plugin_runs_as_an_nri_012_plugin(
    make_containerd: Callable[..., Containerd], tmp_path: Path
) -> None:
    """The daemon's whole exchange with 2.3.4 uses the 0.12 methods: no deprecation warning
    for StateChange, and RemoveContainer / RemovePodSandbox served by their own methods."""
    ctrd = make_containerd()
    daemon = Daemon(ctrd.nri_socket, tmp_path / "state").start()
    try:
        cri = ctrd.cri()
        pod = cri.run("gone", [ContainerSpec.guaranteed("g", 1)])
        cri.remove_all()
        wait_for("the release", lambda: daemon.records("release"))
        assert pod
    finally:
        daemon.stop()
    log = ctrd.log_path.read_text(errors="replace")
    assert "deprecated=StateChange" not in log
    assert re.search(r'plugin \\"external:50-cpuplugin\[\d+\]\\" registered', log)
