"""podman 4.3.1 (bookworm, ``dpkg -x``, runc) with ``--hooks-dir`` pointing at the project's
hooks/ JSON: the containers/common hooks.d matching CRI-O uses, end to end.

The committed files name the installed program (/usr/local/bin/nri-cpuplugin-hook); the test
uses a copy of each whose ``hook.path`` is this checkout's hook program and whose args add a
private state directory - ``when`` and ``stages`` are the committed ones, unchanged.
A runtime that cannot start fails the test with the reason; nothing here skips.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import debs, host
from harness import podman as podman_harness
from harness import runc as runc_harness
from harness.podman import Podman
from harness.runc import hook_env, hook_program, kubernetes_annotations, pod

from e2e.ready import ready_or_fail
from nri_cpuplugin.storage.store import StateStore

HOOKS = Path(__file__).resolve().parents[2] / "hooks"
CPUS = host.online_cpus()
ALL = f"0-{CPUS[-1]}"
LAST = str(CPUS[-1])
REPORT = "grep Cpus_allowed_list /proc/self/status; grep cpuset /proc/self/cgroup"
EXCLUSIVE_1 = {"shares": 1024, "quota": 100000, "period": 100000}


def test_committed_hook_files_are_oci_hooks_1_0_0() -> None:
    files = sorted(HOOKS.glob("*.json"))
    stages = {}
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["version"] == "1.0.0"
        hook = doc["hook"]
        assert hook["path"].startswith("/") and hook["args"][0] == "nri-cpuplugin-hook"
        assert isinstance(hook["timeout"], int) and hook["timeout"] > 0
        for key, value in doc["when"]["annotations"].items():
            assert key.startswith("^") and key.endswith("$"), key  # RE2 search is unanchored
            assert value.startswith("^") and value.endswith("$"), value
        assert hook["args"][-1] in doc["stages"]
        stages[doc["stages"][0]] = f.name
    assert set(stages) == {"createRuntime", "poststop"}


@pytest.fixture
def hooks_dir(tmp_path: Path) -> tuple[Path, Path]:
    """(hooks dir for podman, state dir the hooks use)."""
    state_dir = tmp_path / "state"
    program = hook_program(tmp_path / "bin")
    out = tmp_path / "hooks.d"
    out.mkdir()
    for f in HOOKS.glob("*.json"):
        doc = json.loads(f.read_text())
        stage = doc["hook"]["args"][-1]
        doc["hook"]["path"] = str(program)
        doc["hook"]["args"] = [
            "nri-cpuplugin-hook",
            "--state-dir",
            str(state_dir),
            "--reserved-cpus",
            "0",
            stage,
        ]
        doc["hook"]["env"] = [*doc["hook"].get("env", []), *hook_env()]
        (out / f.name).write_text(json.dumps(doc, indent=1))
    return out, state_dir


@pytest.fixture
def pm(hooks_dir: tuple[Path, Path]) -> Iterator[Podman]:
    ready_or_fail(
        "podman from the bookworm debs",
        podman_harness.prepare,
        lambda: podman_harness.reap_stale() + runc_harness.reap_stale(),
    )
    instance = Podman(hooks_dir[0], debs.LAB)
    try:
        instance.start()
    except Exception as e:
        instance.close()
        pytest.fail(f"podman did not start: {e}", pytrace=False)
    yield instance
    if problems := instance.close():
        pytest.fail("teardown left things behind:\n  " + "\n  ".join(problems), pytrace=False)


def test_matching_container_is_pinned_and_released_non_matching_untouched(
    pm: Podman, hooks_dir: tuple[Path, Path]
) -> None:
    state_dir = hooks_dir[1]
    p = pod("db")
    annotations = kubernetes_annotations(p, "db")  # carries io.kubernetes.container.hash

    result = pm.run_container("pinned", REPORT, annotations, p.cgroup(pm.top), EXCLUSIVE_1)
    lines = result.stdout.splitlines()
    assert lines[0] == f"Cpus_allowed_list:\t{LAST}", result.stdout + result.stderr
    assert f":cpuset:{p.cgroup(pm.top)}/libpod-" in lines[1]  # under the --cgroup-parent
    state = StateStore(state_dir).peek().state
    # `run --rm` removed it, and podman ran the poststop hook: the CPU is back.
    assert state is not None and not state.assignments and str(state.shared) == ALL
    assert not list((state_dir / "hook-containers").glob("*.json"))

    untouched = {k: v for k, v in annotations.items() if k != "io.kubernetes.container.hash"}
    before = (state_dir / "state.json").read_bytes()
    result = pm.run_container("plain", REPORT, untouched, p.cgroup(pm.top), EXCLUSIVE_1)
    assert result.stdout.splitlines()[0] == f"Cpus_allowed_list:\t{ALL}", result.stdout
    assert (state_dir / "state.json").read_bytes() == before  # the hook never ran


def test_pinned_container_seen_while_running(pm: Podman, hooks_dir: tuple[Path, Path]) -> None:
    state_dir = hooks_dir[1]
    p = pod("db")
    result = pm.run_container(
        "running",
        "exec sleep 100000",
        kubernetes_annotations(p, "db"),
        p.cgroup(pm.top),
        EXCLUSIVE_1,
        extra=["--detach"],
    )
    cid = result.stdout.strip()
    state = StateStore(state_dir).peek().state
    assert state is not None and list(state.assignments) == [cid]
    cgroup = f"{p.cgroup(pm.top)}/libpod-{cid}"
    assert (host.cgroup_dir(cgroup) / "cpuset.cpus").read_text().strip() == LAST
    pid = int(pm.run(["inspect", "--format", "{{.State.Pid}}", cid]).stdout)
    assert host.cpus_allowed_list(pid) == LAST
    pm.run(["rm", "--force", "--time", "0", cid])
    state = StateStore(state_dir).peek().state
    assert state is not None and not state.assignments
