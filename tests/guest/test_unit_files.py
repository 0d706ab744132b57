"""What each OCI runtime and systemd release leaves in systemd's unit files for a container's scope,
and whether the daemon's reading of them (hardware/systemd/unit_config.py) agrees with systemd at
every step: runc 1.1.5 on systemd 252 (bookworm), runc 1.3.6 and crun 1.21 on systemd 257 (trixie).
unit_files.py gathers it in the guest; the files are printed for the CI log.

The hand-over (daemon/units.py) relies on: a scope created with a cpuset has ``AllowedCPUs``
(so the daemon must hand it over before writing the cgroup directly); after the hand-over an
empty ``AllowedCPUs`` is the last word, and a reload leaves the cgroup file alone; a runtime's
update with a cpuset gives systemd a cpuset again, which the daemon must see in the files.
"""

from __future__ import annotations

import json

import pytest
from harness.guest import Guest
from harness.guest_runtimes import GuestRuntime
from harness.host import parse_cpu_list

from guest.conftest import SCENARIO_RUNTIME, on_guest


def _cpus(text: str) -> set[int]:
    return set(parse_cpu_list(text.replace(" ", ",")))


@pytest.mark.parametrize(
    ("guest", "runtime_name"),
    # On bookworm CRI-O runs the same runc 1.1.5 as containerd: one of them is enough there.
    [
        on_guest("bookworm", SCENARIO_RUNTIME),
        on_guest("trixie", "crio"),
        on_guest("trixie", SCENARIO_RUNTIME),
    ],
    indirect=["guest"],
    scope="session",  # else a mix of indirect and direct arguments makes it the test's scope
)
def test_unit_files_agree_with_systemd_through_handover_update_and_reload(
    guest: Guest, placing_runtime: GuestRuntime
) -> None:
    facts = guest.call(
        "guest.unit_files:unit_files",
        timeout=900,
        address=placing_runtime.cri_socket,
        runtime=placing_runtime.name,
    )
    print(f"{guest.recipe.suite} {placing_runtime.name}: update to {facts['update_to']}")
    for step, state in facts["steps"].items():
        print(f"--- {step}: {json.dumps({k: v for k, v in state.items() if k != 'files'})}")
        for path, text in state["files"].items():
            lines = [line for line in text.splitlines() if "Allowed" in line or "[" in line]
            print(f"    {path}: {lines}")
    steps = facts["steps"]
    for step, state in steps.items():
        # The daemon's reading of the files is systemd's own view, whatever the release.
        assert state["holds_cpuset"] == bool(state["allowed_cpus"]), (step, state)
    exclusive = _cpus(facts["pinned_first_line"])
    pinned = steps["pinned_created"]
    assert pinned["holds_cpuset"] and _cpus(pinned["allowed_cpus"]) == exclusive, pinned
    assert any("AllowedCPUs=" in text for text in pinned["files"].values()), pinned["files"]
    assert facts["shared_moved_after_s"] == 0, "moved by the pinned container's creation"
    handed = steps["shared_handed_over"]
    assert not handed["holds_cpuset"], f"the shared scope was handed over: {handed}"
    for step in ("shared_handed_over", "shared_after_reload", "shared_after_update",
                 "shared_after_update_reload"):  # fmt: skip
        assert not _cpus(steps[step]["cpuset_cpus"]) & exclusive, (step, steps[step])
    assert _cpus(steps["pinned_after_reloads"]["cpuset_cpus"]) == exclusive
    # No CFS quota on exclusive CPUs, through reloads too: crun 1.21 on systemd turned the
    # quota -1 a creation once carried into "1000 100000", 1 % of a CPU (containers/crun#1794).
    for step in ("pinned_created", "pinned_after_reloads"):
        assert steps[step]["cpu_max"].startswith("max "), (step, steps[step]["cpu_max"])
    # After the runtime's update the unit holds a cpuset again; the second pod's CPUs must
    # not come back with a reload either (in the cgroup, and in what systemd holds).
    both = exclusive | _cpus(facts["second_first_line"])
    assert facts["shared_moved_again_after_s"] == 0, "moved by the second pod's creation"
    for step in ("shared_after_second_pinned", "shared_after_second_reload"):
        state = steps[step]
        assert not _cpus(state["cpuset_cpus"]) & both, (step, state)
        assert not _cpus(state["allowed_cpus"]) & both, (step, state)
