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
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import cni, host
from harness.containerd import Containerd
from harness.cri import CRIError
from harness.journald import PrivateJournal
from harness.k8s import ContainerSpec, PodSpec
from harness.kubelet_pod import DaemonSetPod, kubelet_checkpoint, patched
from netns_util import NETNS_DIR, host_nic
from product_image import cached
from sysfs_gen import mirror_with_nic

from e2e.daemon import wait_for
from nri_cpuplugin.hardware import nic

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "packaging/kubernetes/daemonset.yaml"
NODE_FEATURES = REPO / "packaging/kubernetes/node-features.yaml"
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"

# Each test on both containerd releases the manifest supports; the NIC test on the newest only
# (the node-features patch changes the plugin's pod, not what the runtime does with it).
ON_BOTH = pytest.mark.parametrize("containerd_version", ["2.1", "2.3"], indirect=True)


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


def host_paths(containerd: Containerd, tmp_path: Path, policy: str = "none") -> dict[str, Path]:
    """The manifest's hostPath volumes that are the test's own on this machine."""
    return {
        "/var/run/nri": containerd.nri_socket.parent,
        "/var/lib/nri-cpuplugin": tmp_path / "state",
        "/run/systemd": tmp_path / "run-systemd",
        "/etc/systemd": tmp_path / "etc-systemd",
        "/var/lib/kubelet/cpu_manager_state": kubelet_checkpoint(tmp_path / "cpu-manager", policy),
    }


@pytest.fixture
def plugin_pod(
    containerd: Containerd, journal: PrivateJournal, tmp_path: Path
) -> Iterator[DaemonSetPod]:
    paths = host_paths(containerd, tmp_path)
    pod = DaemonSetPod(containerd.cri(), MANIFEST, tmp_path / "kubelet", host_paths=paths)
    yield pod
    pod.delete(grace=2)


def synchronized(journal: PrivateJournal, count: int) -> Callable[[], bool]:
    return lambda: len(journal.entries("ACTION=synchronize")) >= count


def cpus_of(cri, cid: str) -> str:
    return host.read_cgroup(cri.cgroup_path(cid), "cpuset.cpus")


@ON_BOTH
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


@ON_BOTH
def test_the_probes_say_ready_only_once_the_plugin_is_registered(
    containerd: Containerd, journal: PrivateJournal, tmp_path: Path
) -> None:
    """The manifest's exec probes, run in the plugin's container as kubelet runs them: live
    but not ready while the runtime's socket is absent, ready once it is there."""
    later = containerd.short_dir / "nri-later"  # the socket's filesystem: linked here below
    later.mkdir()
    paths = {**host_paths(containerd, tmp_path), "/var/run/nri": later}
    pod = DaemonSetPod(containerd.cri(), MANIFEST, tmp_path / "kubelet", host_paths=paths)
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


@ON_BOTH
def test_the_daemonset_pod_refuses_a_node_whose_kubelet_runs_the_static_policy(
    containerd: Containerd, journal: PrivateJournal, tmp_path: Path
) -> None:
    """The manifest mounts kubelet's checkpoint: on a node where kubelet's static CPU manager
    owns the CPUs the plugin exits 2 at its start, saying how to migrate, and never registers."""
    paths = host_paths(containerd, tmp_path, policy="static")
    pod = DaemonSetPod(containerd.cri(), MANIFEST, tmp_path / "kubelet", host_paths=paths)
    try:
        pod.start()
        wait_for("the plugin's container to exit", lambda: not pod.running(), 60)
        status = containerd.cri().container_status(pod.container_id or "")["status"]
        assert status.get("exit_code") == 2, status
        said = "\n".join(pod.logs())
        assert "kubelet's static CPU manager policy owns this node's CPUs" in said, said
        assert "set kubelet's cpuManagerPolicy to none" in said, said
        assert not journal.entries("ACTION=synchronize")
    finally:
        pod.delete(grace=2)


@pytest.fixture
def runtime_netns() -> Iterator[Path]:
    """/var/run/netns, where containerd makes pods' network namespaces by default and where the
    node-features patch mounts them from, as a shared mount (``ip netns`` and containerd make
    it one; under systemd, every mount is shared).  What the test's pods leave there is
    unmounted and removed at the end, whatever happened."""
    before = set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mountpoint", "-q", str(NETNS_DIR)], check=False).returncode:
        subprocess.run(["mount", "--bind", str(NETNS_DIR), str(NETNS_DIR)], check=True)
    subprocess.run(["mount", "--make-shared", str(NETNS_DIR)], check=True)
    yield NETNS_DIR
    for name in set(os.listdir(NETNS_DIR)) - before:
        subprocess.run(["umount", str(NETNS_DIR / name)], capture_output=True, check=False)
        (NETNS_DIR / name).unlink(missing_ok=True)


@pytest.mark.parametrize("containerd_version", ["2.3"], indirect=True)
def test_nic_locality_needs_the_node_features_patch_and_works_with_it(
    make_containerd: Callable[..., Containerd],
    journal: PrivateJournal,
    runtime_netns: Path,
    tmp_path: Path,
) -> None:
    """A pod asking for strict NIC locality, its ``net1`` a macvlan on this machine's NIC (whose
    device a generated sysfs puts on NUMA node 0): refused under the DaemonSet as shipped, which
    cannot enter pods' network namespaces; born pinned, with the NIC's node honoured, once the
    DaemonSet is patched with packaging/kubernetes/node-features.yaml (real kubectl)."""
    lower = host_nic()
    containerd = make_containerd(start=False)  # pods' namespaces at the default place
    cni.install(containerd, lower.name)
    containerd.start()
    containerd.import_images(cached().archive)
    cri = containerd.cri()
    sysfs = mirror_with_nic(tmp_path / "fake-sysfs", lower.parent_bus, lower.parent_dev, 0)
    paths = {**host_paths(containerd, tmp_path), "/sys": sysfs}
    strict = {nic.LOCALITY_ANNOTATION: "strict"}
    patched_manifest = patched(MANIFEST, NODE_FEATURES, tmp_path / "patched.yaml")

    for manifest, synchronizations in ((MANIFEST, 1), (patched_manifest, 2)):
        plugin = DaemonSetPod(cri, manifest, tmp_path / "kubelet", host_paths=paths)
        try:
            plugin.start()
            wait_for("the plugin to synchronize", synchronized(journal, synchronizations), 60)
            pod = cri.run_pod(
                PodSpec("nic-strict", qos="guaranteed", host_network=False, annotations=strict)
            )
            app = ContainerSpec.guaranteed("fwd", 1, command=FIRST_LINE)
            if manifest is MANIFEST:
                with pytest.raises(CRIError, match="NIC locality is strict"):
                    cri.create_container(pod, app)
            else:
                cid = cri.create_container(pod, app)
                cri.start(cid)
                assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
                [record] = journal.entries("ACTION=nic-locality", "HONOURED=honoured")
                assert record["NIC_NUMA"] == "0", record
                assert f"net1 ({lower.parent_bus}/{lower.parent_dev}" in record["NICS"]
            cri.stop_pod(pod)
            cri.remove_pod(pod)
        finally:
            plugin.delete(grace=2)
