"""Pods' interfaces read ahead at RunPodSandbox (daemon/pod_nics.py), alone and in the daemon."""

from __future__ import annotations

import threading

import pytest
from builders import container, pod
from daemon_driver import Driver
from topologies import build

from nri_cpuplugin.core import annotation
from nri_cpuplugin.daemon import pod_nics
from nri_cpuplugin.daemon.pod_nics import PodNICs
from nri_cpuplugin.hardware import netns_links
from nri_cpuplugin.nri.handlers import EVENT_BITS
from nri_cpuplugin.nri.stub import Stub
from nri_cpuplugin.ops.config import Settings

NETNS = "/var/run/netns/cni-1234"
ETH0 = netns_links.Link(2, "eth0", "veth", "", "", 7, 0, False)
LISTING = ([ETH0], None)


class Lister:
    """Counts its calls and the threads they came from; ``gate`` holds each call."""

    def __init__(self, result=LISTING, gate: threading.Event | None = None):
        self.result, self.gate = result, gate
        self.calls: list[tuple[str, str]] = []

    def __call__(self, netns: str):
        self.calls.append((netns, threading.current_thread().name))
        if self.gate is not None:
            assert self.gate.wait(10)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_a_pod_read_ahead_is_read_once_off_the_caller_thread_and_answers_its_namespace_only():
    lister = Lister()
    nics = PodNICs(lister)
    nics.read_ahead("uid-a", NETNS)
    read = nics.lister_for("uid-a", NETNS)
    assert read is not None and read(NETNS) == LISTING
    assert lister.calls == [(NETNS, "nri-cpuplugin-pod-nics")]
    assert nics.lister_for("uid-a", "/var/run/netns/other") is None  # not what was read
    assert nics.lister_for("uid-b", NETNS) is None  # never read: the caller reads itself


def test_a_creation_waits_for_a_read_still_running():
    gate = threading.Event()
    nics = PodNICs(Lister(gate=gate))
    nics.read_ahead("uid-a", NETNS)
    got = []
    waiter = threading.Thread(target=lambda: got.append(nics.lister_for("uid-a", NETNS)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # waiting for the read
    gate.set()
    waiter.join(10)
    assert got[0] is not None and got[0](NETNS) == LISTING


def test_a_failed_read_is_reported_as_the_creation_own_would_be_never_read_twice():
    lister = Lister(netns_links.NICError("cannot open network namespace: gone"))
    nics = PodNICs(lister)
    nics.read_ahead("uid-a", NETNS)
    read = nics.lister_for("uid-a", NETNS)
    assert read is not None
    with pytest.raises(netns_links.NICError, match="cannot open network namespace: gone"):
        read(NETNS)
    assert len(lister.calls) == 1


def test_an_unexpected_failure_leaves_the_creation_to_read_for_itself():
    nics = PodNICs(Lister(ValueError("a bug")))
    nics.read_ahead("uid-a", NETNS)
    assert nics.lister_for("uid-a", NETNS) is None


def test_a_stalled_read_is_waited_for_no_longer_than_a_netlink_receive(monkeypatch):
    monkeypatch.setattr(pod_nics, "WAIT", 0.05)
    gate = threading.Event()
    nics = PodNICs(Lister(gate=gate))
    nics.read_ahead("uid-a", NETNS)
    read = nics.lister_for("uid-a", NETNS)
    gate.set()
    assert read is not None
    with pytest.raises(netns_links.NICError, match=r"started with the pod, took over 0\.05 s"):
        read(NETNS)


def test_without_a_thread_to_read_the_creation_reads_for_itself(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    nics = PodNICs(Lister())
    nics.read_ahead("uid-a", NETNS)  # no error for RunPodSandbox
    assert nics.lister_for("uid-a", NETNS) is None and len(nics) == 0
    monkeypatch.undo()
    nics.read_ahead("uid-b", NETNS)  # a thread is tried again for the next pod
    assert nics.lister_for("uid-b", NETNS) is not None


def test_a_pod_gone_before_its_turn_is_not_read():
    gate = threading.Event()
    lister = Lister(gate=gate)
    nics = PodNICs(lister)
    nics.read_ahead("busy", NETNS)  # holds the thread
    nics.read_ahead("gone", "/var/run/netns/gone")
    nics.forget("gone")
    gate.set()
    nics.read_ahead("next", NETNS)
    assert nics.lister_for("next", NETNS) is not None
    assert [netns for netns, _ in lister.calls] == [NETNS, NETNS]


def test_entries_go_with_their_pods_and_are_bounded():
    nics = PodNICs(Lister(), limit=2)
    for uid in ("a", "b", "c"):
        nics.read_ahead(uid, NETNS)
    assert len(nics) == 2 and nics.lister_for("a", NETNS) is None  # the oldest went
    nics.read_ahead("b", NETNS)  # read again: now the newest
    nics.read_ahead("d", NETNS)
    assert nics.lister_for("c", NETNS) is None and nics.lister_for("b", NETNS) is not None
    nics.forget("b")
    assert nics.lister_for("b", NETNS) is None
    nics.keep_only(["x"])
    assert len(nics) == 0


@pytest.fixture
def plugin(tmp_path):
    """The daemon, connected; its pods' interfaces read by a ``Lister`` (netlink's place)."""
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    settings = Settings(sysfs=str(root), state_dir=str(tmp_path / "state"), reserved_cpu_count=2)
    plugin = Driver(settings)
    plugin.configure()
    yield plugin
    plugin.close()


def in_netns(sandbox, path=NETNS):
    sandbox.linux.namespaces.add(type="network", path=path)
    return sandbox


def test_the_daemon_reads_guaranteed_pods_ahead_and_the_creation_uses_that(plugin):
    lister = Lister()
    plugin.daemon.pod_nics.lister = lister
    db = in_netns(pod("db"))
    plugin.run_pod_sandbox(db)
    plugin.create_container(db, container("postgres", db, 2000))
    assert [netns for netns, _ in lister.calls] == [NETNS]  # once, ahead
    [record] = plugin.records.of("nic-locality")
    assert "(interfaces read when the pod started)" in record["MESSAGE"]
    assert plugin.state.assignments  # placed
    # Nothing to read ahead: a Burstable pod, the host network, locality turned off.
    plugin.run_pod_sandbox(in_netns(pod("web", "burstable")))
    plugin.run_pod_sandbox(pod("host"))
    off = in_netns(pod("off"))
    off.annotations[annotation.NIC_LOCALITY] = "off"
    plugin.run_pod_sandbox(off)
    assert len(lister.calls) == 1 and len(plugin.daemon.pod_nics) == 1
    plugin.remove_pod_sandbox(db)
    assert len(plugin.daemon.pod_nics) == 0


def test_a_recreated_sandbox_keeps_its_read_when_the_old_one_is_removed_after_it(plugin):
    """Same pod uid, a new sandbox (and network namespace): the old sandbox's removal, which
    may come later, drops only its own read."""
    lister = Lister()
    plugin.daemon.pod_nics.lister = lister
    old = in_netns(pod("db"))
    plugin.run_pod_sandbox(old)
    new = in_netns(pod("db"), "/var/run/netns/cni-5678")
    new.id = "sb-db-2"
    plugin.run_pod_sandbox(new)
    plugin.remove_pod_sandbox(old)
    plugin.create_container(new, container("postgres", new, 2000))
    # (The old sandbox's read may be dropped before its turn.)  The new one was read once,
    # ahead, and used.
    assert [netns for netns, _ in lister.calls].count("/var/run/netns/cni-5678") == 1
    [record] = plugin.records.of("nic-locality")
    assert "(interfaces read when the pod started)" in record["MESSAGE"]


def test_the_note_says_the_read_ahead_was_used_only_when_it_was(plugin):
    plugin.daemon.pod_nics.lister = Lister(
        netns_links.NICError("cannot open network namespace: gone")
    )
    db = in_netns(pod("db"))
    plugin.run_pod_sandbox(db)
    plugin.create_container(db, container("postgres", db, 2000))
    [record] = plugin.records.of("nic-locality")
    assert (
        "cannot inspect /var/run/netns/cni-1234: cannot open network namespace: gone"
        in (record["MESSAGE"])
    )
    assert "(interfaces read when the pod started)" not in record["MESSAGE"]


def test_without_the_read_ahead_the_daemon_neither_reads_ahead_nor_hears_pods_start(tmp_path):
    """Neither reading ahead nor earmarking CPUs for pods: RunPodSandbox is not subscribed."""
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    settings = Settings(
        sysfs=str(root), state_dir=str(tmp_path / "state"), reserved_cpu_count=2,
        nic_read_ahead=False, earmark_pods=False,
    )  # fmt: skip
    plugin = Driver(settings)
    try:
        stub = plugin.daemon.stub = Stub(plugin.daemon.adapter, "cpuplugin", "50")
        events = plugin.configure()
        assert events == stub.handled_events & ~EVENT_BITS["run_pod_sandbox"]
        plugin.run_pod_sandbox(in_netns(pod("db")))
        assert len(plugin.daemon.pod_nics) == 0
    finally:
        plugin.close()
