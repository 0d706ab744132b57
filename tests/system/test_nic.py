"""NIC NUMA locality: real network namespaces and links (pyroute2), device NUMA nodes from
generated (fake) sysfs trees, this machine's own virtio NIC, and placement on 2- and 8-node
machines."""

from __future__ import annotations

import errno
import os
import random

import pytest
from builders import container, pod, workload
from daemon_driver import Driver
from netns_util import host_nic, leftover_test_namespaces, pod_netns
from sysfs_gen import write_fake_device
from topologies import build, topology

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.placement import NICPreference
from nri_cpuplugin.core.policy import PolicyError, StaticPolicy
from nri_cpuplugin.hardware import netns_links, nic
from nri_cpuplugin.hardware.nic_guard import netns_path
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.ops.status import snapshot

P = CPUSet.parse
TWO_NODES = "xeon-e5-2680v3-2s"  # 48 CPUs, NUMA 0 and 1
EIGHT_NODES = "bench-2s-256t-8numa"  # 256 CPUs, NUMA 0-7


@pytest.fixture(autouse=True)
def _no_leftover_namespaces():
    before = leftover_test_namespaces()
    yield
    assert leftover_test_namespaces() == before, "a test left a network namespace behind"


@pytest.fixture(scope="module")
def lower():
    return host_nic()


def fake_tree(tmp_path, machine: str, lower, node: int | None):
    """A generated machine whose FAKE device tree puts the host NIC's parent device (this
    machine: virtio2 on virtio) below a PCI function on NUMA ``node``."""
    root, topo = build(machine, tmp_path)
    write_fake_device(root, lower.parent_bus, lower.parent_dev, node, parent="fake-0000:00:03.0")
    return root, topo


# --- annotations -------------------------------------------------------------------------------


def test_annotations_parse_and_the_container_specific_value_wins():
    assert nic.request({}, "c") == nic.Request(None, "prefer")
    got = nic.request(
        {
            nic.NICS_ANNOTATION: "net1, net2",
            f"{nic.LOCALITY_ANNOTATION}/container.db": "Strict",
            nic.LOCALITY_ANNOTATION: "off",
        },
        "db",
    )
    assert got == nic.Request(("net1", "net2"), "strict")


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({nic.LOCALITY_ANNOTATION: "always"}, "expected one of prefer, strict, off"),
        ({nic.NICS_ANNOTATION: " , "}, "comma-separated interface names"),
        ({nic.NICS_ANNOTATION: "../../etc"}, "not a valid interface name"),
        ({nic.NICS_ANNOTATION: "a-very-long-interface-name"}, "not a valid interface name"),
        ({nic.NICS_ANNOTATION: ",".join(f"n{i}" for i in range(17))}, "1 to 16"),
    ],
)
def test_bad_annotations_are_refused_with_the_reason(annotations, message):
    with pytest.raises(PolicyError, match=message):
        nic.request(annotations, "c")


def test_netns_path_from_nri_and_oci_namespaces():
    nri = [pb.LinuxNamespace(type="ipc"), pb.LinuxNamespace(type="network", path="/run/netns/x")]
    assert netns_path(nri) == "/run/netns/x"
    assert netns_path([{"type": "network", "path": "/proc/7/ns/net"}]) == "/proc/7/ns/net"
    assert netns_path([{"type": "network"}]) is None  # a new one: not a pod's
    assert netns_path([{"type": "pid", "path": "/proc/7/ns/pid"}]) is None


# --- sysfs -------------------------------------------------------------------------------------


def test_device_numa_walks_up_to_the_first_device_that_says(tmp_path):
    root, topo = build(TWO_NODES, tmp_path)
    write_fake_device(root, "virtio", "virtio9", 1, parent="fake-0000:00:09.0")
    write_fake_device(root, "pci", "fake-0000:3b:00.0", -1)
    write_fake_device(root, "pci", "fake-0000:5e:00.0", None, local_cpulist=topo.numa_nodes[1])
    write_fake_device(root, "pci", "fake-0000:6e:00.0", None, local_cpulist=topo.online)
    assert nic.device_numa(str(root), "virtio", "virtio9") == 1
    assert nic.device_numa(str(root), "pci", "fake-0000:3b:00.0") is None  # -1: unknown
    assert nic.device_numa(str(root), "pci", "fake-0000:5e:00.0", topo) == 1
    assert nic.device_numa(str(root), "pci", "fake-0000:6e:00.0", topo) is None  # all CPUs
    assert nic.device_numa(str(root), "pci", "absent") is None
    assert nic.device_numa(str(root), "..", "x") is None
    assert nic.device_numa(str(root), "pci", "../../../etc") is None


def test_this_machines_real_nic_says_no_numa_preference(lower):
    """The VM's virtio NIC: its PCI function's numa_node is -1."""
    assert nic.device_numa("/sys", lower.parent_bus, lower.parent_dev) is None


# --- real namespaces and links ----------------------------------------------------------------


def test_a_veth_only_pod_has_no_preference(tmp_path, lower):
    root, topo = fake_tree(tmp_path, TWO_NODES, lower, 1)
    with pod_netns() as ns:
        ns.add_veth("eth0")
        found = nic.locality(ns.path, {}, "c", str(root), topo)
    assert found.preference is None and found.nics == ()
    assert "no interface with a device" in found.note


def test_this_machines_virtio_nic_gives_no_preference(lower):
    with pod_netns() as ns:
        ns.add_veth("eth0")
        ns.add_macvlan(lower.name, "net1")
        found = nic.locality(ns.path, {}, "c", "/sys")
    assert found.nodes == CPUSet()  # no preference; the NIC is still on record for status
    [net1] = found.nics
    assert net1 == nic.NIC("net1", f"{lower.parent_bus}/{lower.parent_dev}", None, lower.name)
    assert "no NUMA preference" in found.note


@pytest.mark.parametrize("machine", [TWO_NODES, EIGHT_NODES])
def test_a_stacked_nic_is_traced_to_its_device_and_its_node_is_preferred(tmp_path, lower, machine):
    last = len(topology(machine).numa_nodes) - 1
    root, topo = fake_tree(tmp_path, machine, lower, last)
    policy = StaticPolicy(topo, P("0"))
    with pod_netns() as ns:
        ns.add_veth("eth0")
        ns.add_macvlan(lower.name, "net1")
        found = nic.locality(ns.path, {}, "c", str(root), topo)
        named = nic.locality(ns.path, {nic.NICS_ANNOTATION: "eth0"}, "c", str(root), topo)
    assert found.nodes == CPUSet([last])
    assert found.preference.nics == (
        f"net1 ({lower.parent_bus}/{lower.parent_dev} via {lower.name}, NUMA {last})",
    )
    decision, _ = policy.admit(policy.empty_state(), workload(4000), found.preference)
    assert decision.cpus <= topo.numa_nodes[last] and decision.mems == CPUSet([last])
    assert "next to its NICs" in decision.reason
    assert named.nodes == CPUSet()  # the annotation chose the veth: nothing to prefer


def test_host_network_pods_get_a_preference_only_when_annotated(tmp_path, lower):
    root, topo = fake_tree(tmp_path, TWO_NODES, lower, 1)
    plain = nic.locality(None, {}, "c", str(root), topo)
    assert plain.preference is None and "host network" in plain.note
    annotated = nic.locality(None, {nic.NICS_ANNOTATION: lower.name}, "c", str(root), topo)
    assert annotated.nodes == P("1")


def test_strict_locality_fails_when_the_nics_cannot_be_inspected(tmp_path):
    missing = str(tmp_path / "no-such-netns")
    with pytest.raises(PolicyError, match="strict but the interfaces"):
        nic.locality(missing, {nic.LOCALITY_ANNOTATION: "strict"}, "c", "/sys")
    relaxed = nic.locality(missing, {}, "c", "/sys")
    assert relaxed.preference is None and "cannot inspect" in relaxed.note
    assert not (tmp_path / "no-such-netns").exists()  # opened without O_CREAT: nothing made
    with pytest.raises(PolicyError, match="not a network namespace"):
        nic.locality("/proc/self/ns/pid", {nic.LOCALITY_ANNOTATION: "strict"}, "c", "/sys")


def test_a_fifo_or_a_device_named_as_the_netns_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "netns-fifo"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    for path in (str(fifo), "/dev/null"):
        with pytest.raises(netns_links.NICError, match="not a network namespace"):
            netns_links.netlink_socket(path)


def test_a_failure_inside_the_netns_thread_is_an_error_not_a_hang(monkeypatch):
    """Whatever fails in the thread that enters the namespace (here: no file descriptor left
    for ctypes), the caller is released with the reason and every descriptor is closed."""

    def no_fds():
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(netns_links, "_libc", no_fds)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(netns_links.NICError, match="Too many open files"):
        netns_links.netlink_socket("/proc/self/ns/net")
    assert len(os.listdir("/proc/self/fd")) == before


def test_strict_locality_fails_when_a_named_interface_is_missing(tmp_path, lower):
    with pod_netns() as ns:
        ns.add_veth("eth0")
        annotations = {nic.NICS_ANNOTATION: "net9", nic.LOCALITY_ANNOTATION: "strict"}
        with pytest.raises(PolicyError, match="net9 not found"):
            nic.locality(ns.path, annotations, "c", "/sys")


# --- placement: the NIC's node whenever it has room; strict fails cleanly -------------------


@pytest.mark.parametrize("machine", [TWO_NODES, EIGHT_NODES])
@pytest.mark.parametrize("strict", [False, True], ids=["prefer", "strict"])
def test_the_nic_node_is_chosen_whenever_it_has_enough_free_cpus(machine, strict):
    topo = topology(machine)
    policy = StaticPolicy(topo, P("0"))
    rng = random.Random(f"{machine}-{strict}")
    state = policy.empty_state()
    placed = refused = 0
    for i in range(120):
        node = rng.choice(sorted(topo.numa_nodes))
        count = rng.choice([1, 2, 2, 3, 4, 6, 8])
        near_free = policy.free_exclusive(state) & topo.numa_nodes[node]
        pref = NICPreference(CPUSet([node]), strict, (f"fake-nic on NUMA {node}",))
        asked = workload(count * 1000, pod=f"pod-{i}")
        try:
            decision, new_state = policy.admit(state, asked, pref)
        except PolicyError as err:
            assert len(near_free) < count or not policy.free_exclusive(state), err
            if strict:
                assert "NIC locality is strict" in str(err) and f"NUMA {node}" in str(err)
            refused += 1
            continue
        if len(near_free) >= count:
            assert decision.cpus <= topo.numa_nodes[node], (node, count, decision.cpus)
        else:
            assert not strict
        assert new_state.assignments[asked.container_id].nic_nodes == CPUSet([node])
        placed += 1
        state = new_state
        # Free some CPUs now and then, so nodes fill and empty again.
        if rng.random() < 0.3 and state.assignments:
            victim = rng.choice(sorted(state.assignments))
            state = policy.release(state, victim)[1]
    assert placed > 20 and (refused > 0 or not strict)


# --- through the plugin ---------------------------------------------------------------------


def nri_pod(name: str, netns: str | None, **annotations: str) -> pb.PodSandbox:
    """A Guaranteed pod in the network namespace ``netns`` (None: the host's)."""
    sandbox = pod(name)
    sandbox.annotations.update(annotations)
    if netns is not None:
        sandbox.linux.namespaces.add(type="network", path=netns)
    return sandbox


def nri_container(name: str, sandbox: pb.PodSandbox, cpus: int) -> pb.Container:
    return container(name, sandbox, cpus * 1000)


def test_the_daemon_places_next_to_the_nic_explains_it_and_fails_strict_cleanly(tmp_path, lower):
    root, topo = fake_tree(tmp_path, TWO_NODES, lower, 1)
    state_dir = tmp_path / "state"
    settings = Settings(sysfs=str(root), state_dir=str(state_dir), reserved_cpus=P("0,24"))
    plugin = Driver(settings)
    records = plugin.records
    try:
        plugin.configure()
        plugin.daemon.stop_hotplug()
        with pod_netns() as ns:
            ns.add_veth("eth0")
            ns.add_macvlan(lower.name, "net1")
            pod = nri_pod("dpdk", ns.path)
            adjust, _ = plugin.create_container(pod, nri_container("fwd", pod, 4))
            assert CPUSet.parse(adjust.linux.resources.cpu.cpus) <= topo.numa_nodes[1]
            [record] = records.of("nic-locality")
            assert record["HONOURED"] == "honoured" and record["NIC_NUMA"] == "1"
            # Node 1 now has 20 free CPUs: a strict request for 22 fails cleanly, with the
            # reason.
            strict = nri_pod("greedy", ns.path, **{nic.LOCALITY_ANNOTATION: "strict"})
            before = plugin.state
            with pytest.raises(PolicyError, match="NIC locality is strict"):
                plugin.create_container(strict, nri_container("big", strict, 22))
            assert plugin.state == before and records.of("refuse")
            # Without strict it is placed anyway, and the audit says the preference was not
            # met.
            loose = nri_pod("loose", ns.path)
            adjust, _ = plugin.create_container(loose, nri_container("big2", loose, 22))
            assert not CPUSet.parse(adjust.linux.resources.cpu.cpus) <= topo.numa_nodes[1]
            assert records.of("nic-locality")[-1]["HONOURED"] == "not honoured"
        # A host-network pod: no inspection at all.
        host = nri_pod("hostnet", None)
        plugin.create_container(host, nri_container("h", host, 1))
        assert records.of("nic-locality")[-1]["HONOURED"] == "no preference"
    finally:
        plugin.close()
    report = snapshot(str(state_dir), str(root))
    by_name = {a["container_name"]: a for a in report["assignments"]}
    assert by_name["fwd"]["nic_numa"] == "1" and by_name["fwd"]["nic_honoured"] == "yes"
    assert by_name["big2"]["nic_honoured"] == "no"
    assert by_name["h"]["nic_honoured"] == "-"
    assert any("net1" in line for line in by_name["fwd"]["nics"])
