"""Deadline discipline end to end (daemon/deadline.py), through real containerd 1.7.24, 2.1.9 and
2.3.4 and runc on this 2-CPU machine (CPU 0 reserved and shared, CPU 1 exclusive): while
another nri-cpuplugin process holds the state lock, the daemon answers every request within
its budget - an exclusive creation with our error, a shared one with the shared pool - instead
of leaving it to the runtime's 2 s timeout, which would drop the plugin and start containers
unpinned."""

from __future__ import annotations

import time

import pytest
from harness import host
from harness.cri import CRIError
from harness.k8s import ContainerSpec, PodSpec
from lock_holder import LockHolder

from e2e.daemon import check_agreement, wait_for

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"


def test_a_held_state_lock_is_answered_in_time_not_left_to_the_runtime(containerd, cri, daemon):
    first = cri.run("first", [ContainerSpec.guaranteed("a", 1)])  # CPU 1; the pool is CPU 0
    holder = LockHolder(daemon.state_dir)
    try:
        # The exclusive candidate: refused through CRI with our message, not a timeout.
        pod_id = cri.run_pod(PodSpec("late", qos="guaranteed"))
        started = time.monotonic()
        with pytest.raises(CRIError) as err:
            cri.create_container(pod_id, ContainerSpec.guaranteed("x", 1))
        refused_after = time.monotonic() - started
        message = str(err.value)
        assert "cpuplugin: exclusive CPUs for container 'x' of pod default/late" in message
        assert "could not be decided within 1.5 s" in message
        assert "waiting for the state lock" in message and "state.lock" in message
        assert "kubelet retries it" in message
        # The shared one is created - and started - on the shared pool, not on every CPU as
        # it would be had the runtime dropped us.
        shared = cri.run(
            "shared", [ContainerSpec("s", cpu_request_milli=250, memory="32Mi", command=FIRST_LINE)]
        )
        assert cri.wait_logs(shared["s"], 1) == ["Cpus_allowed_list:\t0"]
        assert host.read_cgroup(cri.cgroup_path(shared["s"]), "cpuset.cpus") == "0"
    finally:
        holder.release()

    # Connected all along: one connect, no disconnect, and the runtime never gave up on us.
    assert len(daemon.new_records("connect")) == 1 and not daemon.new_records("disconnect")
    assert "closing plugin" not in containerd.log_path.read_text(errors="replace")
    missed = daemon.new_records("deadline")
    created = [r for r in missed if r["EVENT"] == "CreateContainer"]
    [refusal] = [r for r in created if r.get("POD_NAME") == "late"]
    [pooled] = [r for r in created if r.get("POD_NAME") == "shared"]
    assert (refusal["EVENT"], refusal["REASON"]) == ("CreateContainer", "state-lock")
    assert "answered with an error" in refusal["MESSAGE"]
    # Queued behind the refused one, which still waits for the lock: the same cause.
    assert (pooled["EVENT"], pooled["REASON"]) == ("CreateContainer", "state-lock")
    assert "answered with the shared pool 0" in pooled["MESSAGE"]
    # Our answer comes at 1.5 s; containerd then rolls the creation back (StopContainer and
    # RemoveContainer, answered within their budgets too) before CRI returns.
    assert 1.5 <= refused_after < 8, refused_after

    # Once the lock is free the late work is done: the shared container is recorded (it
    # follows the pool from now on), the refused one never got CPU 1.
    wait_for(
        "the late work to be committed",
        lambda: shared["s"] in daemon.state()["sharing"],
        timeout=20,
    )
    assert set(daemon.state()["assignments"]) == {first["a"]}
    pid = cri.inspect(shared["s"]).pid
    cri.stop(first["a"])
    wait_for(
        "the shared container to follow the pool", lambda: host.cpus_allowed_list(pid) == "0-1"
    )
    # And a later exclusive creation is decided and pinned as usual.
    again = cri.run("again", [ContainerSpec.guaranteed("q", 1, command=FIRST_LINE)])
    assert cri.wait_logs(again["q"], 1) == ["Cpus_allowed_list:\t1"]
    assert host.cpus_allowed_list(pid) == "0"
    assert check_agreement(daemon, cri) == {"s": "0", "q": "1"}
    assert len(daemon.new_records("connect")) == 1 and not daemon.new_records("disconnect")
