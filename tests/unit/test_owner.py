"""The daemon's claim on a state directory (storage/owner.py): how an OCI hook on the same node
tells that an NRI daemon places the containers, and why two daemons never share one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from model_stall import SteppedTime

from nri_cpuplugin.storage import owner


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[tuple[str, int]]:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    yield str(path), fd
    os.close(fd)


def test_no_claim_file_means_no_daemon(state_dir: tuple[str, int]) -> None:
    path, fd = state_dir
    assert owner.probe(fd, path) is None
    assert not os.path.exists(os.path.join(path, owner.DAEMON_FILE))  # probing creates nothing


def test_a_held_claim_is_a_running_daemon_and_a_released_one_is_not(
    state_dir: tuple[str, int],
) -> None:
    path, fd = state_dir
    held = owner.claim(fd, path, wait=0)
    assert owner.probe(fd, path) == owner.DaemonClaim(os.getpid(), True)
    os.close(held)  # the daemon exits (or is killed: the kernel drops the lock either way)
    assert owner.probe(fd, path) == owner.DaemonClaim(os.getpid(), False)
    again = owner.claim(fd, path, wait=0)  # the next daemon takes it over
    assert owner.probe(fd, path) == owner.DaemonClaim(os.getpid(), True)
    os.close(again)


def test_a_killed_daemon_releases_its_claim(state_dir: tuple[str, int]) -> None:
    path, fd = state_dir
    child = subprocess.Popen(
        [
            sys.executable, "-c",
            "import os, signal, sys\n"
            "from nri_cpuplugin.storage import owner\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "owner.claim(fd, sys.argv[1], 0)\n"
            "print('claimed', flush=True)\n"
            "signal.pause()\n",  # until killed
            path,
        ],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "claimed"
        assert owner.probe(fd, path) == owner.DaemonClaim(child.pid, True)
        child.kill()
        child.wait()
        assert owner.probe(fd, path) == owner.DaemonClaim(child.pid, False)
    finally:
        child.kill()
        child.wait()


def test_a_second_daemon_is_refused_after_waiting(state_dir: tuple[str, int]) -> None:
    path, fd = state_dir
    held = owner.claim(fd, path, wait=0)
    stepped = SteppedTime()
    with pytest.raises(owner.ClaimError, match=rf"in use by another .* \(pid {os.getpid()}\)"):
        owner.claim(fd, path, wait=0.2, clock=stepped.clock, sleep=stepped.sleep)
    assert sum(stepped.slept) >= 0.2 and stepped.slept  # it waited its 0.2 s, trying again
    os.close(held)


def test_a_probe_never_blocks_a_daemon_for_long(state_dir: tuple[str, int]) -> None:
    """A hook's probe takes a shared lock for an instant; a daemon claiming meanwhile waits
    for it instead of failing."""
    path, fd = state_dir
    os.close(owner.claim(fd, path, wait=0))
    import fcntl

    probe = os.open(os.path.join(path, owner.DAEMON_FILE), os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)  # a probe caught in the middle
    stepped = SteppedTime(on_sleep=lambda: os.close(probe))  # the probe done while claim waits
    os.close(owner.claim(fd, path, wait=30.0, clock=stepped.clock, sleep=stepped.sleep))
    assert stepped.slept == [0.02]  # it waited once, and went through once the probe was done


def test_a_link_in_place_of_the_claim_file_is_refused(
    state_dir: tuple[str, int], tmp_path: Path
) -> None:
    path, fd = state_dir
    (tmp_path / "elsewhere").write_text("")
    os.symlink(tmp_path / "elsewhere", os.path.join(path, owner.DAEMON_FILE))
    with pytest.raises(owner.ClaimError, match="symbolic link"):
        owner.claim(fd, path, wait=0)
    # The hook does not follow it either, and assumes the worst: a daemon may be there.
    assert owner.probe(fd, path) == owner.DaemonClaim(None, True)
