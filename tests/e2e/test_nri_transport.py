"""Our NRI transport (mux, ttrpc, stub) against real containerd 1.7.24 (NRI 0.6.1), 2.1.9
(NRI 0.8.0) and 2.3.4 (NRI 0.12.0), with the recording test plugin of nri_test_plugin.py.
What only NRI 0.12 does is in test_nri_012.py."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.cri import CRIError
from harness.k8s import ContainerSpec

from e2e.daemon import wait_for
from e2e.plugin_process import PLUGIN, PluginProcess

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[PluginProcess]:
    process = PluginProcess(tmp_path / "events.jsonl")
    yield process
    process.stop()


def test_registration_configure_and_synchronize(containerd, cri, plugin):
    plugin.start(containerd.nri_socket)
    [configure] = plugin.events("configure")
    assert configure["runtime"] == "containerd"
    wait_for("Synchronize", lambda: plugin.events("synchronize"))


def test_synchronize_delivers_existing_pods_and_containers(containerd, cri, plugin):
    cri.run("early", [ContainerSpec("worker")])
    plugin.start(containerd.nri_socket)
    [sync] = wait_for("Synchronize", lambda: plugin.events("synchronize"))
    assert "early" in sync["pods"] and "worker" in sync["containers"]


def test_lifecycle_events_arrive_in_order(containerd, cri, plugin):
    plugin.start(containerd.nri_socket)
    pod = cri.run("life", [ContainerSpec("work")])
    cri.stop(pod["work"])
    cri.remove(pod["work"])
    cri.stop_pod(pod.id)
    cri.remove_pod(pod.id)
    expected = [
        ("run_pod_sandbox", None),
        ("create_container", "work"),
        ("post_create_container", "work"),
        ("start_container", "work"),
        ("post_start_container", "work"),
        ("stop_container", "work"),
        ("remove_container", "work"),
        ("stop_pod_sandbox", None),
        ("remove_pod_sandbox", None),
    ]

    def seen():
        got = [(e["event"], e.get("container")) for e in plugin.events() if e.get("pod") == "life"]
        return got if len(got) >= len(expected) else None

    assert wait_for("the whole lifecycle", seen) == expected


def test_adjustment_is_in_force_from_the_first_instruction(containerd, cri, plugin):
    plugin.start(containerd.nri_socket, subscribe="create", pin="1")
    pod = cri.run("pinned", [ContainerSpec("first", command=FIRST_LINE)])
    [line] = cri.wait_logs(pod["first"], 1)
    assert line == "Cpus_allowed_list:\t1"  # CRI asked for no cpuset at all


def test_update_of_another_container_lands_in_its_live_cgroup(containerd, cri, plugin):
    plugin.start(
        containerd.nri_socket,
        subscribe="create",
        retarget={"trigger": "trigger", "target": "target", "cpus": "0"},
    )
    pod = cri.run("pair", [ContainerSpec("target")])
    pid = cri.inspect(pod["target"]).pid
    assert host.cpus_allowed_list(pid) == "0-1"
    cri.create_container(pod.id, ContainerSpec("trigger"))
    assert host.read_cgroup(cri.cgroup_path(pod["target"]), "cpuset.cpus") == "0"
    assert host.cpus_allowed_list(pid) == "0"


@pytest.mark.parametrize("size", [5_000, 1_100_000], ids=["over-4KiB", "over-1MiB"])
def test_big_replies_get_through(containerd, cri, plugin, size):
    plugin.start(containerd.nri_socket, subscribe="create", big=size)
    pod = cri.run("big", [ContainerSpec("large")])
    annotations = cri.inspect(pod["large"]).spec["annotations"]
    assert len(annotations["test.nri/big"]) == size
    assert plugin.proc.poll() is None  # and the plugin is still connected, not dropped
    cri.create_container(pod.id, ContainerSpec("again"))
    assert [e["container"] for e in plugin.events("create_container")] == ["large", "again"]


def test_error_reply_fails_the_creation_with_our_message(containerd, cri, plugin):
    plugin.start(containerd.nri_socket, subscribe="create", refuse="bad")
    pod_id = cri.run_pod("refused")
    with pytest.raises(CRIError) as err:
        cri.create_container(pod_id, ContainerSpec("bad"))
    assert "refusing bad on purpose (test)" in str(err.value)
    cri.create_container(pod_id, ContainerSpec("good"))  # the plugin stayed connected


def test_runtime_launched_plugin_uses_fd_3(make_containerd, tmp_path):
    containerd = make_containerd(start=False)
    log = tmp_path / "launched.jsonl"
    launcher = containerd.plugin_path / "50-transport"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    # The runtime gives launched plugins no PATH: name the interpreter absolutely.
    # Quoted: the checkout (and with it the interpreter) may have spaces in its path.
    launcher.write_text(f"#!/bin/sh\nexec {shlex.join([sys.executable, str(PLUGIN)])}\n")
    launcher.chmod(0o755)
    conf = containerd.plugin_config_path / "50-transport.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(json.dumps({"log": str(log), "pin": "1"}))
    containerd.start()
    process = PluginProcess(log)
    [configure] = wait_for("the launched plugin's Configure", lambda: process.events("configure"))
    assert configure["launched_fd"] == "3"
    pod = containerd.cri().run("launched", [ContainerSpec("child", command=FIRST_LINE)])
    [line] = containerd.cri().wait_logs(pod["child"], 1)
    assert line == "Cpus_allowed_list:\t1"
    pid = configure["pid"]
    containerd.stop()
    # Its socket closed with the runtime: the launched plugin must exit by itself.
    wait_for("the launched plugin to exit", lambda: not host.is_alive(pid))


def test_daemon_reconnects_and_resyncs_after_containerd_restart(containerd, cri, plugin):
    plugin.start(containerd.nri_socket)
    wait_for("the first Synchronize", lambda: plugin.events("synchronize"))
    containerd.restart()
    ready = time.monotonic()
    wait_for("a second Synchronize", lambda: len(plugin.events("synchronize")) >= 2, timeout=5)
    elapsed = time.monotonic() - ready
    assert elapsed < 5
    assert {e["pid"] for e in plugin.events("configure")} == {plugin.proc.pid}
    assert os.path.exists(containerd.nri_socket)
