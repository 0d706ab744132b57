"""NIC locality end to end: real containerd 1.7.24 / 2.1.9 / 2.3.4 creates each pod's network
namespace and runs a real CNI plugin (e2e/cni_test_plugin.py: a veth as eth0, and for ``nic-*``
pods a macvlan ``net1`` on this machine's virtio NIC); NRI hands the daemon the namespace's path,
the daemon lists the interfaces inside with pyroute2, traces net1 to its device and places the
container.

This machine has one NUMA node and its NIC says ``numa_node = -1``: with the real /sys there is
no preference, and the audit trail and ``status`` say so.  A generated sysfs tree that mirrors
this machine's CPUs (so the runtime can apply the cpusets) but puts the NIC's device on NUMA 0
(a FAKE device entry) shows a preference honoured, and strict locality failing cleanly through
CRI when the NIC's node has no free CPU.  Multi-node placement is covered with real namespaces
and generated 2- and 8-node machines in tests/system/test_nic.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import cni
from harness.cri import CRIError
from harness.k8s import ContainerSpec, PodSpec
from netns_util import host_nic
from sysfs_gen import mirror_with_nic

from e2e.daemon import Daemon, check_agreement
from nri_cpuplugin.hardware import nic

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"


@pytest.fixture
def lower():
    return host_nic()


@pytest.fixture
def containerd(make_containerd, containerd_version, lower):
    """containerd with the CNI test plugin (harness/cni.py)."""
    ctrd = make_containerd(start=False, config_overrides=cni.overrides(containerd_version))
    cni.install(ctrd, lower.name)
    ctrd.start()
    return ctrd


def daemon_with(containerd, tmp_path: Path, sysfs: str | None) -> Daemon:
    config = None
    if sysfs is not None:
        config = tmp_path / "plugin.toml"
        config.write_text(f'sysfs = "{sysfs}"\n')
    return Daemon(containerd.nri_socket, tmp_path / "state", config=config)


def pod_network(name: str, **kw) -> PodSpec:
    return PodSpec(name, qos="guaranteed", host_network=False, **kw)


def test_this_machines_virtio_nic_gives_no_preference(containerd, tmp_path, lower):
    daemon = daemon_with(containerd, tmp_path, None).start()
    try:
        cri = containerd.cri()
        pod_id = cri.run_pod(pod_network("nic-real"))
        cid = cri.create_container(pod_id, ContainerSpec.guaranteed("app", 1, command=FIRST_LINE))
        cri.start(cid)
        assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
        [record] = daemon.new_records("nic-locality")
        assert record["HONOURED"] == "no preference" and not record.get("NIC_NUMA")
        device = f"{lower.parent_bus}/{lower.parent_dev}"
        assert f"net1 ({device} via {lower.name}, no NUMA preference)" in record["NICS"]
        assert "/netns/" in record["MESSAGE"]  # the runtime's namespace, found through NRI
        # Read when the pod started (RunPodSandbox comes after CNI set up net1), not now.
        assert "(interfaces read when the pod started)" in record["MESSAGE"]
        [entry] = daemon.status(getattr(daemon, "sysfs", None))["assignments"]
        assert entry["nic_numa"] == "" and entry["nic_honoured"] == "-"
        assert any("net1" in n for n in entry["nics"])
        check_agreement(daemon, cri)

        # A daemon started after the pod did reads the interfaces at the creation: the same.
        cri.stop(cid, timeout=0)
        cri.remove(cid)
        daemon.stop()
        daemon.start()
        again = cri.create_container(pod_id, ContainerSpec.guaranteed("app2", 1))
        cri.start(again)
        [record] = daemon.new_records("nic-locality")
        assert f"net1 ({device} via {lower.name}, no NUMA preference)" in record["NICS"]
        assert "read when the pod started" not in record["MESSAGE"]
    finally:
        daemon.stop()


def test_a_nic_node_is_honoured_and_strict_locality_fails_cleanly(containerd, tmp_path, lower):
    root = mirror_with_nic(tmp_path / "fake-sysfs", lower.parent_bus, lower.parent_dev, 0)
    daemon = daemon_with(containerd, tmp_path, str(root))
    daemon.sysfs = str(root)
    daemon.start()
    try:
        cri = containerd.cri()
        pod_id = cri.run_pod(pod_network("nic-near"))
        cid = cri.create_container(pod_id, ContainerSpec.guaranteed("fwd", 1, command=FIRST_LINE))
        cri.start(cid)
        assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
        [record] = daemon.new_records("nic-locality")
        assert record["HONOURED"] == "honoured" and record["NIC_NUMA"] == "0"
        [entry] = daemon.status(getattr(daemon, "sysfs", None))["assignments"]
        assert (entry["nic_numa"], entry["nic_honoured"]) == ("0", "yes")

        # The NIC's node has no free CPU left: strict locality refuses, through CRI, with why.
        strict = pod_network("nic-strict", annotations={nic.LOCALITY_ANNOTATION: "strict"})
        strict_id = cri.run_pod(strict)
        with pytest.raises(CRIError, match="NIC locality is strict"):
            cri.create_container(strict_id, ContainerSpec.guaranteed("fwd", 1))
        assert daemon.new_records("refuse")
        # A pod with only a veth has nothing to prefer and is not inspected for shared work.
        veth_only = cri.run_pod(PodSpec("plain", qos="burstable", host_network=False))
        shared = cri.create_container(
            veth_only, ContainerSpec("s", cpu_request_milli=250, memory="32Mi")
        )
        cri.start(shared)
        assert len(daemon.new_records("nic-locality")) == 1
        check_agreement(daemon, cri)
    finally:
        daemon.stop()
