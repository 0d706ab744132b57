"""Upgrade and rollback of the DaemonSet with pinned pods running, on containerd 2.3.4 made to
require the plugin (packaging/containerd's fail-closed drop-in).

0.1.0 (the release before this one: its image built from its commit by today's recipe, its
manifest as it shipped then) -> this version -> 0.1.0 again, each step as the DaemonSet
controller takes it with RollingUpdate and maxUnavailable 1 on one node - the old pod deleted,
then the new one created - and run by the FAKE kubelet (harness/kubelet_pod.py).  Throughout,
a sampler reads the cgroup cpusets of a Guaranteed pod and of a shared one: the pinned one
never moves and the shared one never holds its CPU.  While no plugin is connected a new
container is refused rather than started unpinned; each version places containers from the
state the other wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import cni, host
from harness.containerd import Containerd
from harness.cri import CRIClient, CRIError
from harness.journald import PrivateJournal
from harness.k8s import ContainerSpec, PodSpec
from harness.kubelet_pod import DaemonSetPod, kubelet_checkpoint
from harness.sampler import Sampler
from netns_util import host_nic
from product_image import MANIFEST, RELEASE_0_1_0, cached, manifest_of

from e2e.daemon import wait_for
from e2e.fail_closed import install_fail_closed

REPO = Path(__file__).resolve().parents[2]
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
REFUSED = 'required plugin "cpuplugin" not present'

pytestmark = pytest.mark.parametrize("containerd_version", ["2.3"], indirect=True)


@pytest.fixture
def fail_closed(make_containerd: Callable[..., Containerd], containerd_version: str) -> Containerd:
    """With a CNI plugin: 0.1.0's pod was on the pod network."""
    ctrd = make_containerd(start=False, config_overrides=cni.overrides(containerd_version))
    cni.install(ctrd, host_nic().name)
    install_fail_closed(ctrd)
    ctrd.start()
    for revision in (RELEASE_0_1_0, "HEAD"):
        ctrd.import_images(cached(revision=revision).archive)
    return ctrd


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[PrivateJournal]:
    with PrivateJournal(str(tmp_path / "run-systemd/journal")) as j:
        yield j


def refused_while_away(cri: CRIClient, name: str) -> None:
    """A new pod's container on a node with no plugin: refused, never started unpinned."""
    pod_id = cri.run_pod(PodSpec(name, qos="guaranteed"))
    try:
        with pytest.raises(CRIError, match=REFUSED):
            cri.create_container(pod_id, ContainerSpec.guaranteed(name, 1))
    finally:
        cri.stop_pod(pod_id)
        cri.remove_pod(pod_id)


def test_upgrade_and_rollback_move_no_pinned_container(
    fail_closed: Containerd, journal: PrivateJournal, tmp_path: Path
) -> None:
    cri = fail_closed.cri()
    manifests = {
        "0.1.0": manifest_of(RELEASE_0_1_0, tmp_path),
        "this": REPO / MANIFEST,
    }
    host_paths = {
        "/var/run/nri": fail_closed.nri_socket.parent,
        "/var/lib/nri-cpuplugin": tmp_path / "state",
        "/run/systemd": tmp_path / "run-systemd",
        "/etc/systemd": tmp_path / "etc-systemd",
        "/run/systemd/journal/socket": journal.socket_path,  # 0.1.0's mount
        "/var/lib/kubelet/cpu_manager_state": kubelet_checkpoint(tmp_path / "cpu-mgr"),  # 0.2.0
    }
    synchronized = 0

    def run_plugin(release: str) -> DaemonSetPod:
        nonlocal synchronized
        pod = DaemonSetPod(cri, manifests[release], tmp_path / "kubelet", host_paths=host_paths)
        pod.start()
        synchronized += 1
        wait_for(
            f"the {release} plugin to synchronize",
            lambda: len(journal.entries("ACTION=synchronize")) >= synchronized,
            60,
        )
        return pod

    plugin = run_plugin("0.1.0")
    shared = cri.run("web", [ContainerSpec("web", cpu_request_milli=100)])
    pinned = cri.run(
        PodSpec("db", qos="guaranteed"), [ContainerSpec.guaranteed("db", 1, command=FIRST_LINE)]
    )
    assert cri.wait_logs(pinned["db"], 1)[0] == "Cpus_allowed_list:\t1"
    paths = (cri.cgroup_path(pinned["db"]), cri.cgroup_path(shared["web"]))

    def cpusets() -> tuple[str, ...]:
        return tuple(host.read_cgroup(path, "cpuset.cpus") for path in paths)

    with Sampler(cpusets) as sampler:
        for step, release in enumerate(("this", "0.1.0")):
            plugin.delete(grace=15)  # the controller deletes the old pod first
            refused_while_away(cri, f"while-away-{step}")
            plugin = run_plugin(release)
            # the new version places a new shared container from the state the old one wrote
            late = cri.run(f"late-{step}", [ContainerSpec("late", cpu_request_milli=100)])
            assert host.read_cgroup(cri.cgroup_path(late["late"]), "cpuset.cpus") == "0"
    plugin.delete(grace=15)

    print(f"{sampler.samples} samples of both cpusets through the upgrade and the rollback")
    assert sampler.samples > 10
    assert sampler.seen == {("1", "0")}, "the pinned container moved, or a shared one got its CPU"
