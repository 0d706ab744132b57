"""Fail-closed pinning on containerd 2.3.4 (NRI 0.12; the default validator exists from
containerd 2.2): packaging/containerd/nri-containerd-2.2-fail-closed.toml, imported as shipped
(paths moved into the instance), makes NRI's built-in default validator require the plugin.

* Without the daemon - before it first starts, after it stopped, while it restarts after a
  crash - every CreateContainer fails with the validator's message, Guaranteed or not; with it
  connected, Guaranteed containers are created pinned.  Never an unpinned Guaranteed one.
* The toleration annotation the drop-in names lets a pod (or one container) be created
  without the plugin; only a boolean is accepted.
* Without a node-wide list, a pod can require the plugin itself (NRI's
  ``required-plugins.noderesource.dev`` annotation).
* What the validator cannot see (NRI 0.12.0): the runtime counts every plugin still in its
  list, and it drops a plugin whose connection closed only at the end of the next NRI event.
  So the first creation after the plugin went away, if no other event came first, and a
  creation the plugin stalls on past the request timeout are created without it (fail open).
  A new pod is safe: its RunPodSandbox comes first.  The tests below pin this down, so that
  a fixed runtime shows up here (and docs/operator-guide.md section 6 can be updated).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import host
from harness.containerd import VERSIONS, Containerd, at_least
from harness.cri import CRIClient, CRIError
from harness.k8s import ContainerSpec, PodSpec

from e2e.daemon import Daemon, wait_for
from e2e.fail_closed import NRI, install_fail_closed
from e2e.plugin_process import PluginProcess

CLOSED = 'connection to plugin \\"50-cpuplugin\\" closed'
REFUSED = (
    'validator "00-default-validator" rejected container adjustment, reason: validation '
    'error: required plugin "cpuplugin" not present'
)
TOLERATE = "tolerate-missing-plugins.nri-cpuplugin.io"
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
WITH_VALIDATOR = sorted(v for v in VERSIONS if at_least(v, "2.2"))


@pytest.fixture(params=WITH_VALIDATOR, ids=lambda v: f"containerd-{v}")
def containerd_version(request: pytest.FixtureRequest) -> str:
    """The default validator exists from containerd 2.2 (NRI 0.10): here, 2.3."""
    return request.param


@pytest.fixture
def fail_closed(make_containerd: Callable[..., Containerd]) -> Containerd:
    ctrd = make_containerd(start=False)
    install_fail_closed(ctrd)
    try:
        ctrd.start()
        error = None
    except Exception as e:
        error = f"containerd {ctrd.version} did not start with the fail-closed drop-in: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    return ctrd


@pytest.fixture
def daemon(fail_closed: Containerd, tmp_path: Path) -> Iterator[Daemon]:
    process = Daemon(fail_closed.nri_socket, tmp_path / "state")
    yield process
    process.stop()


def refused(cri: CRIClient, pod_id: str, spec: ContainerSpec) -> str:
    with pytest.raises(CRIError) as err:
        cri.create_container(pod_id, spec)
    return err.value.details


def wait_runtime_noticed_the_plugin_gone(ctrd: Containerd, closed_before: int) -> None:
    wait_for(
        "containerd to see the plugin's connection closed",
        lambda: ctrd.log_path.read_text(errors="replace").count(CLOSED) > closed_before,
    )


def closed_count(ctrd: Containerd) -> int:
    return ctrd.log_path.read_text(errors="replace").count(CLOSED)


def pinned_cpus(cri: CRIClient, cid: str) -> str:
    """The cpuset in the container's OCI spec: what runc creates it with."""
    return cri.inspect(cid).spec["linux"]["resources"]["cpu"].get("cpus", "")


def test_no_container_is_created_while_the_plugin_is_absent(fail_closed, daemon):
    cri = fail_closed.cri()
    guaranteed = cri.run_pod(PodSpec("exclusive", qos="guaranteed"))
    besteffort = cri.run_pod(PodSpec("anything", qos="besteffort"))
    app = ContainerSpec.guaranteed("app", 1, command=FIRST_LINE)

    # Before the daemon ever ran: refused, Guaranteed or not (the validator is node-wide).
    assert REFUSED in refused(cri, guaranteed, app)
    assert REFUSED in refused(cri, besteffort, ContainerSpec("be"))
    assert cri.containers() == []  # nothing half-created is left for kubelet to trip over

    # Connected: created, and pinned from its first instruction.
    daemon.start()
    cid = cri.create_container(guaranteed, app)
    cri.start(cid)
    assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
    cri.stop(cid, timeout=0)
    cri.remove(cid)

    # Stopped (systemctl stop): refused again, from the next pod on (its RunPodSandbox is the
    # event at whose end the runtime drops the closed plugin; see the module docstring).
    closed = closed_count(fail_closed)
    daemon.stop()
    wait_runtime_noticed_the_plugin_gone(fail_closed, closed)
    guaranteed = cri.run_pod(PodSpec("exclusive-2", qos="guaranteed"))
    assert REFUSED in refused(cri, guaranteed, app)

    # Restarting: every attempt kubelet makes meanwhile is refused or pinned, never unpinned.
    daemon.start(wait=False)
    outcomes: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            cid = cri.create_container(guaranteed, app)
        except CRIError as e:
            assert REFUSED in e.details, e.details
            outcomes.append("refused")
            time.sleep(0.02)
            continue
        outcomes.append(f"created on {pinned_cpus(cri, cid)}")
        break
    assert outcomes[0] == "refused" and outcomes[-1] == "created on 1", outcomes
    cri.start(cid)
    assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]

    # Crashed (SIGKILL) with a pinned container running: it keeps running pinned; new pods'
    # containers wait for the restart, then come up as the policy says.
    closed = closed_count(fail_closed)
    daemon.kill9()
    wait_runtime_noticed_the_plugin_gone(fail_closed, closed)
    besteffort = cri.run_pod(PodSpec("anything-2", qos="besteffort"))
    assert REFUSED in refused(cri, besteffort, ContainerSpec("be"))
    daemon.start()
    shared = cri.create_container(besteffort, ContainerSpec("be", command=FIRST_LINE))
    cri.start(shared)
    assert cri.wait_logs(shared, 1) == ["Cpus_allowed_list:\t0"]
    assert host.cpus_allowed_list(cri.inspect(cid).pid) == "1"


@pytest.mark.parametrize(
    ("annotation", "where", "created"),
    [
        (TOLERATE, "pod", True),
        (f"{TOLERATE}/pod", "pod", True),
        (f"{TOLERATE}/container.app", "pod", True),  # container-scoped, set on the pod
        (f"{TOLERATE}/container.other", "pod", False),  # another container's
        (TOLERATE, "container", False),  # the validator reads pod annotations only
    ],
)
def test_the_toleration_annotation_lets_a_pod_start_without_the_plugin(
    fail_closed, annotation, where, created
):
    cri = fail_closed.cri()
    on_pod = {annotation: "true"} if where == "pod" else {}
    on_container = {annotation: "true"} if where == "container" else {}
    pod = cri.run_pod(PodSpec("tolerant", qos="guaranteed", annotations=on_pod))
    app = ContainerSpec.guaranteed("app", 1, annotations=on_container)
    if created:
        cid = cri.create_container(pod, app)
        assert pinned_cpus(cri, cid) == ""  # no plugin, so no pinning: fail open, by request
    else:
        assert REFUSED in refused(cri, pod, app)


@pytest.mark.parametrize("value", ["false", "maybe"])
def test_the_toleration_annotation_takes_booleans_only(fail_closed, value):
    cri = fail_closed.cri()
    pod = cri.run_pod(PodSpec("odd", qos="guaranteed", annotations={TOLERATE: value}))
    message = refused(cri, pod, ContainerSpec.guaranteed("app", 1))
    if value == "false":
        assert REFUSED in message
    else:
        assert f'invalid {TOLERATE} annotation "maybe"' in message


def test_a_pod_can_require_the_plugin_itself(make_containerd, tmp_path):
    """The validator on, no node-wide list: only pods that ask for the plugin wait for it."""
    ctrd = make_containerd(
        config_overrides={"plugins": {NRI: {"default_validator": {"enable": True}}}}
    )
    cri = ctrd.cri()
    asking = cri.run_pod(
        PodSpec(
            "asking",
            qos="guaranteed",
            annotations={"required-plugins.noderesource.dev": '["cpuplugin"]'},
        )
    )
    assert REFUSED in refused(cri, asking, ContainerSpec.guaranteed("app", 1))
    relaxed = cri.run_pod(PodSpec("relaxed", qos="besteffort"))
    cri.create_container(relaxed, ContainerSpec("app"))  # not asking: created without it
    daemon = Daemon(ctrd.nri_socket, tmp_path / "state").start()
    try:
        cid = cri.create_container(asking, ContainerSpec.guaranteed("app", 1))
        assert pinned_cpus(cri, cid) == "1"
    finally:
        daemon.stop()


def test_a_stalled_plugin_is_dropped_and_the_container_created_unpinned(fail_closed, tmp_path):
    """The validator checks who is connected when the creation starts; a required plugin that
    then misses the request timeout (2 s) is dropped by the runtime, which goes on as if it
    had not answered.  Our daemon answers within 75 % of the timeout even when its handler is
    slow; only a stalled process (SIGSTOP, swapping) gets here."""
    plugin = PluginProcess(tmp_path / "events.jsonl")
    plugin.start(fail_closed.nri_socket, name="cpuplugin", subscribe="create", pin="1", stall=3)
    try:
        cri = fail_closed.cri()
        pod = cri.run_pod(PodSpec("stalled", qos="guaranteed"))
        started = time.monotonic()
        cid = cri.create_container(pod, ContainerSpec.guaranteed("app", 1))
        assert 1.9 < time.monotonic() - started < 10
        assert pinned_cpus(cri, cid) == ""  # created, without the plugin's adjustment
        wait_for(
            "the runtime to log the plugin dropped",
            lambda: (
                "closing plugin 50-cpuplugin" in fail_closed.log_path.read_text(errors="replace")
            ),
        )
        # Gone now, so the next creation is refused again.
        assert REFUSED in refused(cri, pod, ContainerSpec.guaranteed("again", 1))
    finally:
        plugin.stop()


def test_upstream_gap_the_first_creation_after_the_plugin_left_is_not_checked(fail_closed, daemon):
    """NRI 0.12.0: a plugin whose connection closed stays in the runtime's list until the end
    of the next NRI event, and the validator sees it as present.  So if that event is a
    CreateContainer (a container restarted in a running pod, say), it is created without the
    plugin; the one after is refused."""
    cri = fail_closed.cri()
    pod = cri.run_pod(PodSpec("restarting", qos="guaranteed"))
    daemon.start()
    closed = closed_count(fail_closed)
    daemon.stop()
    wait_runtime_noticed_the_plugin_gone(fail_closed, closed)
    cid = cri.create_container(pod, ContainerSpec.guaranteed("app", 1))  # not refused ...
    assert pinned_cpus(cri, cid) == ""  # ... and not pinned: the plugin is gone
    assert (
        "closing plugin 50-cpuplugin, failed to handle CreateContainer request: ttrpc: closed"
        in (fail_closed.log_path.read_text(errors="replace"))
    )
    assert REFUSED in refused(cri, pod, ContainerSpec.guaranteed("next", 1))
