"""A full disk under the state directory (a small tmpfs in a private mount namespace): shared
containers keep starting, exclusive CPUs are refused with the file named (until the runtime
has listed its containers to the daemon), nothing is left behind, and a daemon restarted on
it does not write (or fail) when nothing changed."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from builders import container
from builders import pod as nri_pod
from daemon_driver import Driver, Records
from harness.private_mount import fill, in_private_tmpfs
from harness.runc import CgroupSandbox, pod, sandbox
from topologies import build

from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.ops.config import Settings


@pytest.fixture
def box() -> Iterator[CgroupSandbox]:
    with sandbox() as fake_node:
        yield fake_node


def leftovers(state_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(state_dir) if n.endswith(".tmp"))


def test_hook_on_a_full_disk(box: CgroupSandbox) -> None:
    state_dir = str(box.dir / "full-state")
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    late = box.add(pod("late", "burstable"), "late", millicores=100)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    args = ["--state-dir", state_dir]

    def scenario() -> dict:
        first = box.hook(web, args=args)
        fill(state_dir)
        shared = box.hook(late, args=args)
        exclusive = box.hook(db, args=args)
        return {
            "first": first.returncode,
            "shared": [shared.returncode, shared.stderr],
            "exclusive": [exclusive.returncode, exclusive.reason_lines[-1]],
            "late_cpus": box.cpus(late),
            "db_cpus": box.cpus(db),
            "leftovers": leftovers(state_dir),
            "records": sorted(os.listdir(os.path.join(state_dir, "hook-containers"))),
        }

    seen = in_private_tmpfs(state_dir, 256, scenario)
    assert seen["first"] == 0
    code, stderr = seen["shared"]
    assert code == 0 and "state-unsaved" in stderr  # placed, and said so
    assert seen["late_cpus"] == "0-1"  # on the shared pool all the same
    code, reason = seen["exclusive"]
    assert (code == 1 and "state.json" in reason) or "hook-containers" in reason, reason
    assert "No space left on device" in reason
    assert seen["db_cpus"] != "1"  # no exclusive CPU that a crash could forget
    assert seen["leftovers"] == [] and seen["records"] == [f"{web.id}.json"]


def test_daemon_on_a_full_disk(tmp_path) -> None:
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    state_dir = str(tmp_path / "full-state")
    settings = Settings(sysfs=str(root), state_dir=state_dir, reserved_cpu_count=2)

    def scenario() -> dict:
        records = Records()
        plugin = Driver(settings, records)
        try:
            plugin.configure()
            web = nri_pod("web", "burstable")
            plugin.create_container(web, container("nginx", web, 500))
        finally:
            plugin.close()  # the daemon is gone (its claim with it)
        fill(state_dir)
        # A restart with a valid state on a full disk: nothing changed, nothing written.
        restarted = Driver(settings, records)
        try:
            restarted.configure()
            api = nri_pod("api", "burstable")
            adjust, _ = restarted.create_container(api, container("api", api, 250))
            db = nri_pod("db")
            try:
                restarted.create_container(db, container("postgres", db, 2000))
                refusal = None
            except PolicyError as err:
                refusal = [err.code, str(err)]
            # Once the runtime has listed its containers (as it does at every reconnection),
            # an exclusive assignment a crash kept from the disk comes back from that list.
            restarted.synchronize([web, api, db], [])
            granted, _ = restarted.create_container(db, container("postgres", db, 2000))
        finally:
            restarted.close()
        return {
            "shared_cpus": adjust.linux.resources.cpu.cpus,
            "granted": granted.linux.resources.cpu.cpus,
            "refusal": refusal,
            "actions": [r["ACTION"] for r in records],
            "leftovers": leftovers(state_dir),
        }

    seen = in_private_tmpfs(state_dir, 256, scenario)
    assert seen["shared_cpus"] == "0-47"  # shared containers never fail
    code, message = seen["refusal"]
    assert code == "not-durable" and "state.json" in message and "No space left" in message
    assert "state-unsaved" in seen["actions"] and "refuse" in seen["actions"]
    after = seen["actions"][seen["actions"].index("refuse") + 1 :]
    assert seen["granted"] == "1,25" and "allocate" in after and "state-unsaved" in after
    assert seen["leftovers"] == []
