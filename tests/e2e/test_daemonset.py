"""The shipped DaemonSet (packaging/kubernetes/daemonset.yaml) run for real: its pod, with the
image the project builds (`./dev image`), run on a private containerd (2.1, 2.3) by a FAKE
kubelet (harness/kubelet_pod.py: no kubelet or API server runs here) that turns the manifest's
pod template into the CRI calls kubelet makes - command, args, mounts, securityContext,
resources, restartPolicy.  Only the host paths differ: the runtime's NRI socket directory, the
state directory and /run/systemd (with the journal's socket) are the test's own.

The plugin in its container registers with the runtime, a Guaranteed pod started afterwards is
born pinned (its first output line), a shared pod is moved off its CPU, and when the plugin's
container is killed and restarted (as kubelet restarts it) the pinned pod is not touched.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import host
from harness.containerd import Containerd
from harness.journald import PrivateJournal
from harness.k8s import ContainerSpec, PodSpec
from harness.kubelet_pod import DaemonSetPod
from product_image import cached

from e2e.daemon import wait_for

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "packaging/kubernetes/daemonset.yaml"
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"

pytestmark = pytest.mark.parametrize("containerd_version", ["2.1", "2.3"], indirect=True)


@pytest.fixture
def containerd(make_containerd: Callable[..., Containerd]) -> Containerd:
    """No CNI plugin: the DaemonSet's pod is on the node's network."""
    ctrd = make_containerd()
    ctrd.import_images(cached().archive)
    return ctrd


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[PrivateJournal]:
    with PrivateJournal(str(tmp_path / "run-systemd/journal")) as j:
        yield j


@pytest.fixture
def plugin_pod(
    containerd: Containerd, journal: PrivateJournal, tmp_path: Path
) -> Iterator[DaemonSetPod]:
    pod = DaemonSetPod(
        containerd.cri(),
        MANIFEST,
        tmp_path / "kubelet",
        host_paths={
            "/var/run/nri": containerd.nri_socket.parent,
            "/var/lib/nri-cpuplugin": tmp_path / "state",
            "/run/systemd": tmp_path / "run-systemd",
            "/etc/systemd": tmp_path / "etc-systemd",
        },
    )
    yield pod
    pod.delete(grace=2)


def synchronized(journal: PrivateJournal, count: int) -> Callable[[], bool]:
    return lambda: len(journal.entries("ACTION=synchronize")) >= count


def cpus_of(cri, cid: str) -> str:
    return host.read_cgroup(cri.cgroup_path(cid), "cpuset.cpus")


def test_the_daemonset_pod_pins_and_survives_a_kill(
    containerd: Containerd, journal: PrivateJournal, plugin_pod: DaemonSetPod
) -> None:
    cri = containerd.cri()
    shared = cri.run("web", [ContainerSpec("web", cpu_request_milli=100)])
    assert cpus_of(cri, shared["web"]) == "0-1"

    plugin_pod.start()
    wait_for("the plugin in its pod to synchronize", synchronized(journal, 1), 60)
    registered = containerd.log_path.read_text(errors="replace")
    assert "10-cpuplugin" in registered, "containerd did not log the plugin's registration"

    pinned = cri.run(
        PodSpec("db", qos="guaranteed"), [ContainerSpec.guaranteed("db", 1, command=FIRST_LINE)]
    )
    assert cri.wait_logs(pinned["db"], 1)[0] == "Cpus_allowed_list:\t1"
    assert cpus_of(cri, shared["web"]) == "0"

    # kill -9 the plugin; kubelet (here the fake) starts its container again
    os.kill(plugin_pod.pid(), signal.SIGKILL)
    wait_for("the plugin's container to exit", lambda: not plugin_pod.running(), 30)
    assert plugin_pod.sync()
    wait_for("the restarted plugin to synchronize", synchronized(journal, 2), 60)
    assert cpus_of(cri, pinned["db"]) == "1"
    assert cpus_of(cri, shared["web"]) == "0"

    # the restarted plugin still places: the pinned pod's CPU is given back when it goes
    cri.stop_pod(pinned.id)
    cri.remove_pod(pinned.id)
    wait_for("web to get CPU 1 back", lambda: cpus_of(cri, shared["web"]) == "0-1", 30)


def test_the_probes_say_ready_only_once_the_plugin_is_registered(
    containerd: Containerd, journal: PrivateJournal, tmp_path: Path
) -> None:
    """The manifest's exec probes, run in the plugin's container as kubelet runs them: live
    but not ready while the runtime's socket is absent, ready once it is there."""
    later = containerd.short_dir / "nri-later"  # the socket's filesystem: linked here below
    later.mkdir()
    pod = DaemonSetPod(
        containerd.cri(),
        MANIFEST,
        tmp_path / "kubelet",
        host_paths={
            "/var/run/nri": later,
            "/var/lib/nri-cpuplugin": tmp_path / "state",
            "/run/systemd": tmp_path / "run-systemd",
            "/etc/systemd": tmp_path / "etc-systemd",
        },
    )
    try:
        pod.start()
        wait_for("the startup probe to pass", lambda: pod.probe("startupProbe") == 0, 60)
        assert pod.probe("livenessProbe") == 0
        assert pod.probe("readinessProbe") == 4  # alive, not registered with the runtime
        os.link(containerd.nri_socket, later / "nri.sock")  # the runtime's socket appears
        wait_for("the readiness probe to pass", lambda: pod.probe("readinessProbe") == 0, 60)
        assert pod.probe("livenessProbe") == 0
    finally:
        pod.delete(grace=2)
