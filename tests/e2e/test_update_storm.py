"""A storm of CRI calls racing the daemon's own changes to the same containers, on real
containerd 1.7.24, 2.1.9 and 2.3.4: no CRI call may hang, and the runtime and the daemon must
still work afterwards.

Every containerd with an NRI before 0.12.1 deadlocks for good when a plugin's unsolicited
``UpdateContainers`` meets any CRI call on its way into NRI: the runtime serves the first
holding NRI's adaptation lock while it waits for its own NRI lock, and every CRI event takes
the two the other way round (docs/architecture.md, "Changes outside event replies").  The
daemon changes containers outside event replies after CPU hotplug (an exclusive container
whose CPU goes offline is degraded into the shared pool, and restored when the CPU returns;
the shared containers follow the pool), after RemoveContainer / RemovePodSandbox and in its
background checks.  It used to tell the runtime with UpdateContainers; this storm wedged all
three versions within its first few hotplugs.  It now writes the cgroups itself.

For ``STORM`` seconds per version, concurrently:

* ``UPDATERS`` threads call UpdateContainerResources in a loop on the running shared
  (Burstable) containers and on the exclusive container running at the time - the very
  containers the daemon changes outside its replies - alternating kubelet's re-application of
  limits (the reply keeps our cpuset) with in-place resizes of a shared container's request;
* one thread creates, starts, stops and removes exclusive (Guaranteed, 1 CPU) containers and
  their pods (stopping the container first, or leaving that to StopPodSandbox and
  RemovePodSandbox on every other round);
* one thread takes CPU 1 offline and back (e2e/cpu_hotplug.py, as test_hotplug.py does) just
  after an exclusive container has started on it, bringing it back before that container
  ends or, every other time, after.

Every CRI call must return within ``BOUND`` seconds; the longest call per version is printed as
one JSON line, ``STORM-RESULT {...}`` (``pytest -s``, or ``-rP``).  The storm must have made the
daemon change containers the updaters were hitting, outside its replies, or it proved nothing
(its ``outside-reply`` audit records say which); and the runtime must never have been asked for
an unsolicited update (containerd logs each one).  At the end a new exclusive container is
pinned to CPU 1 and the shared containers are off it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from harness import host
from harness.containerd import RELEASES, Containerd
from harness.cri import CRIClient

from e2e import storm as storm_mod
from e2e.cpu_hotplug import check_hotpluggable, restore_cpu
from e2e.daemon import Daemon, check_agreement, wait_for
from e2e.storm import BOUND, SHARED, STORM, Storm, burstable, guaranteed


@pytest.fixture(scope="module", autouse=True)
def _cpu_restored() -> Iterator[None]:
    check_hotpluggable()
    yield
    restore_cpu()


def test_cri_calls_never_hang_while_the_daemon_changes_the_same_containers(
    containerd: Containerd,
    cri: CRIClient,
    daemon: Daemon,
    containerd_version: str,
    record_property: Callable[[str, object], None],
) -> None:
    shared = [cri.run(f"s{i}", [burstable(f"s{i}")])[f"s{i}"] for i in range(SHARED)]
    assert check_agreement(daemon, cri) == {f"s{i}": "0-1" for i in range(SHARED)}
    storm = Storm(containerd, shared)
    before = len(daemon.records())
    took, stuck = storm_mod.run(storm, STORM)

    records = daemon.records()[before:]
    outside = [r for r in records if r["ACTION"] == "outside-reply"]
    changed = Counter(cid for r in outside for cid in r["CONTAINER_IDS"].split(","))
    exclusive_changed = sorted(set(changed) & storm.hit - set(shared))
    shared_changed = sorted(set(changed) & set(shared))
    method, longest = storm.calls.slowest()
    unsolicited = storm_mod.unsolicited_updates(containerd)
    result = {
        "containerd": RELEASES[containerd_version],
        "storm_s": round(took, 1),
        "longest_call_s": round(longest, 3),
        "longest_call": method,
        "longest_per_method_s": {m: round(s, 3) for m, s in sorted(storm.calls.longest.items())},
        "calls_ok": dict(storm.calls.ok),
        "calls_failed": dict(storm.calls.failed),
        "hotplug_cycles": storm.cycles,
        "outside_reply_changes": len(outside),
        "written_directly": sum(int(r["WRITTEN"]) for r in outside),
        "owed_to_runtime": sum(int(r["OWED"]) for r in outside),
        "changed_exclusive_containers_also_updated": len(exclusive_changed),
        "changed_shared_containers": len(shared_changed),
        "unsolicited_updates": unsolicited,
    }
    print("STORM-RESULT " + json.dumps(result, sort_keys=True))
    record_property("storm", json.dumps(result, sort_keys=True))  # in --junitxml reports
    print("STORM-ERRORS " + json.dumps(storm.calls.errors.most_common(10)))

    assert not stuck, f"threads still blocked in a CRI call: {stuck}"
    assert not storm.crashes, storm.crashes
    assert not storm.calls.hangs, f"CRI calls hung: {storm.calls.hangs[:5]}"
    assert longest < BOUND, result
    # The storm happened ...
    assert storm.calls.ok["UpdateContainerResources"] >= 100, result
    # Races with hotplug and the churn fail a few updates (an exclusive CPU that went offline
    # between our reply and runc, a container stopped meanwhile); more would be a bug.
    assert storm.calls.failed["UpdateContainerResources"] * 20 <= sum(storm.calls.ok.values())
    assert storm.calls.ok["StartContainer"] >= 5 and storm.calls.ok["RemovePodSandbox"] >= 5
    assert storm.cycles >= 5, (result, storm.hotplug_errors)
    # ... and raced the daemon: it changed, outside its replies, exclusive containers the
    # updaters were hitting (degraded and restored) and the shared ones.
    assert len(exclusive_changed) >= 3, result
    assert shared_changed, result
    # Never through the runtime's UpdateContainers, which is what deadlocks it.
    assert unsolicited == 0, result

    # Still healthy: the daemon is connected and synchronized with this runtime ...
    assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon died"
    assert not [r for r in records if r["ACTION"] == "disconnect"], "the runtime dropped us"
    assert host.online_cpus() == [0, 1]
    wait_for(
        "the churn's containers to be gone and CPU 1 back in the shared pool",
        lambda: not daemon.state()["assignments"] and daemon.state()["shared"] == "0-1",
    )
    # ... and a new exclusive container is pinned, with the shared ones off its CPU.
    final = cri.run("final", [guaranteed("final")])["final"]
    assert host.cpus_allowed_list(cri.inspect(final).pid) == "1"
    assert check_agreement(daemon, cri) == {"final": "1", **{f"s{i}": "0" for i in range(SHARED)}}
