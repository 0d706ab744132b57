"""The suite passes from any checkout location: long, with spaces, or short.

The lab lives in the checkout, and several tools limit the paths the harness hands them (unix
sockets, podman's runroot, overlay mount options, shebangs: harness/shortpaths.py).  The
harness keeps those in short private directories it makes and removes; these tests check that
it does, that a killed run's ones are reaped, and - the real proof - run a slice of this suite
(containerd 1.7 and 2.1 through CRI with the plugin, runc and podman with the OCI hook) from a
copy of this checkout at a long path with spaces, and at a short one, from another working
directory, with ``python -m pytest`` rather than ``./dev test``, on a lab that starts empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import containerd as containerd_harness
from harness import debs, host, shortpaths, tarballs
from harness import podman as podman_harness
from harness import runc as runc_harness
from harness.k8s import PodSpec
from harness.packages import (
    BUSYBOX_STATIC,
    CRI_API,
    CRUN,
    LIBYAJL2,
    PATCHELF,
    PODMAN_STACK,
    RUNC,
)

from e2e.ready import ready_or_fail

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# One test per runtime path the checkout location could break: containerd's sockets and root
# (CRI, an external NRI plugin on the socket, a runtime-launched one through a shell script),
# runc running the hook launcher (its shebang), podman (its runroot).
SLICE = (
    "tests/e2e/test_harness.py::"
    "test_guaranteed_container_sees_requested_cpuset_in_private_cgroup[containerd-2.1]",
    "tests/e2e/test_cpu_plugin.py::test_born_pinned_with_memory_node_and_no_quota[containerd-1.7]",
    "tests/e2e/test_cpu_plugin.py::"
    "test_runtime_launched_plugin_without_synchronize_keeps_its_state[containerd-2.1]",
    "tests/e2e/test_hook_runc.py::"
    "test_exclusive_container_is_pinned_before_it_runs_and_shared_moves_in_the_same_run",
    "tests/e2e/test_hook_podman.py::"
    "test_matching_container_is_pinned_and_released_non_matching_untouched",
)
# What the slice downloads: handed to the copies so that they need no network.  A copy has no
# shared runtimes directory beside it: the tarballs the lab fixture prepares are seeded too.
SLICE_TARBALLS = tuple(
    t for t in containerd_harness.VERSIONS.values() if isinstance(t, tarballs.Tarball)
)
SLICE_DEBS = (
    *(d for d in containerd_harness.VERSIONS.values() if isinstance(d, debs.Deb)),
    RUNC,
    BUSYBOX_STATIC,
    CRI_API,
    PATCHELF,
    *PODMAN_STACK,
    CRUN,  # the lab fixture prepares crun too (harness/crun.py)
    LIBYAJL2,
)
LONG_MIN = 200  # characters; the issue asks for at least 120
# Never copied: caches and build output of this checkout (its lab may be elsewhere too).
_NOT_COPIED = {".git", ".venv", ".lab", ".pytest_cache", ".ruff_cache", ".hypothesis"}
_NOT_COPIED_TOP = {"build", "dist"}


def _owned_by(pid: int) -> list[Path]:
    """Short directories whose owner record names ``pid``."""
    found = []
    for root in shortpaths.BASES:
        for path in root.glob(f"{shortpaths.PREFIX}*"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                if json.loads((path / shortpaths.OWNER_FILE).read_text())["owner"][0] == pid:
                    found.append(path)
    return found


# --- the short directories themselves ---------------------------------------------------------


def _check_short(path: Path) -> None:
    assert len(str(path)) <= shortpaths.MAX_LENGTH and " " not in str(path), path
    assert path.parent in shortpaths.BASES, path
    assert path.stat().st_mode & 0o777 == 0o700, oct(path.stat().st_mode)
    record = json.loads((path / shortpaths.OWNER_FILE).read_text())
    assert record["owner"] == shortpaths.owner()


def test_limited_paths_live_in_short_private_directories_removed_at_teardown(
    make_containerd, lab: Path, tmp_path: Path
) -> None:
    ctrd = make_containerd()
    _check_short(ctrd.short_dir)
    # Everything that is limited is below the short directory, whatever the lab path ...
    assert ctrd.address.is_socket() and ctrd.nri_socket.is_socket()
    assert all(len(str(s)) < 108 for s in (ctrd.address, ctrd.nri_socket))
    assert Path(f"{ctrd.address}.ttrpc").is_socket()
    assert host.is_under(ctrd.root, ctrd.short_dir)
    ctrd.cri().run_pod(PodSpec("p"))  # the sandbox's rootfs is an overlay mount
    overlays = [o for _, fstype, o in host.mount_options_under(ctrd.dir) if fstype == "overlay"]
    assert overlays, "no rootfs overlay below the instance directory"
    # ... so the overlay options (lowerdir, upperdir, workdir) do not grow with the lab path.
    assert all(str(debs.LAB) not in o and str(ctrd.short_dir) in o for o in overlays), overlays
    # ... and everything else stays in the lab, where a reader finds it.
    assert host.is_under(ctrd.log_path, debs.LAB) and host.is_under(ctrd.config_path, debs.LAB)

    ready_or_fail("podman from the bookworm debs", podman_harness.prepare, lambda: [])
    (tmp_path / "hooks.d").mkdir()
    with podman_harness.Podman(tmp_path / "hooks.d") as pm:
        assert pm.short is not None
        _check_short(pm.short)
        assert len(str(pm.runroot)) <= 50  # podman refuses a longer one
        out = pm.run_container("c", "echo ok", cgroup_parent=f"{pm.top}/c").stdout
        assert out == "ok\n"
    assert not pm.short.exists() and not pm.dir.exists()

    link = shortpaths.interpreter()
    _check_short(link.parent)
    assert link.resolve() == Path(sys.executable).resolve()
    launcher = runc_harness.hook_program(tmp_path / "bin")
    assert launcher.read_text().startswith(f"#!{link} -IS\n")

    assert ctrd.teardown() == []
    assert not ctrd.short_dir.exists() and not ctrd.dir.exists()

    # Reading an instance's configuration (as the packaging tests do) makes nothing.
    unstarted = containerd_harness.Containerd(ctrd.version, lab=lab)
    assert unstarted.config()["grpc"]["address"] == unstarted.address
    assert not unstarted.short_dir.exists() and not unstarted.dir.exists()


_KILLED_OWNER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from harness import shortpaths
    from harness.containerd import Containerd
    from harness.k8s import PodSpec
    from harness.podman import Podman
    ctrd = Containerd("2.1")
    ctrd.start()
    ctrd.cri().run_pod(PodSpec("orphan"))  # a shim, a pause process, an overlay mount
    pm = Podman(Path(sys.argv[2]))
    pm.start()
    print(json.dumps({
        "containerd": [str(ctrd.dir), str(ctrd.short_dir), ctrd.top_cgroup, ctrd.pid],
        "podman": [str(pm.dir), str(pm.short), pm.top],
        "session": str(shortpaths.interpreter().parent),
    }), flush=True)
    time.sleep(1000)
    """
)


def test_a_killed_runs_short_directories_are_reaped(lab: Path, tmp_path: Path) -> None:
    """A test run killed mid-test leaves a containerd, a podman container and its short
    directories; the next run's reapers remove all of it - also when the instance's record
    in the lab is gone, by the record in the short directory."""
    ready_or_fail("podman from the bookworm debs", podman_harness.prepare, lambda: [])
    (tmp_path / "hooks.d").mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", _KILLED_OWNER, str(TESTS), str(tmp_path / "hooks.d")],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert owner.stdout is not None
        made = json.loads(owner.stdout.readline() or "{}")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert made, "the owner process did not report its instances"
    ctrd_dir, ctrd_short, ctrd_top, ctrd_pid = made["containerd"]
    pm_dir, pm_short, pm_top = made["podman"]
    dirs = [Path(d) for d in (ctrd_dir, ctrd_short, pm_dir, pm_short, made["session"])]
    # containerd runs in a session of its own: it, the shim and the pause process live on.
    orphans = {
        pid: host.start_time(pid)
        for pid in containerd_harness._instance_pids(Path(ctrd_dir), Path(ctrd_short), ctrd_top)
    }
    try:
        assert all(d.is_dir() for d in dirs)  # a SIGKILL runs no cleanup
        assert ctrd_pid in orphans and len(orphans) >= 3, orphans
        assert host.mounts_under(ctrd_dir)  # the sandbox's rootfs and shm
        Path(ctrd_dir, "instance.json").unlink()  # only the short directory knows it now
    finally:
        left = containerd_harness.reap_stale(lab) + podman_harness.reap_stale(lab)
    assert left == []

    assert [d for d in dirs if d.exists()] == []
    assert [p for p, started in orphans.items() if host.is_alive(p, started)] == []
    assert host.mounts_under(*dirs) == []
    for top in (ctrd_top, pm_top):
        assert containerd_harness._cgroup_dirs(top) == []
    assert _owned_by(owner.pid) == []


# --- the suite from other checkouts -----------------------------------------------------------


def _copy_checkout(dest: Path) -> None:
    """This checkout's files (what a clone has, plus local edits), without caches."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        top = Path(directory) == REPO
        return [
            n
            for n in names
            if n in _NOT_COPIED
            or n == "__pycache__"
            or n.endswith(".egg-info")
            or (top and n in _NOT_COPIED_TOP)
            or Path(directory, n) == debs.LAB
        ]

    shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)


def _seed_debs(checkout: Path) -> None:
    """The verified .debs and tarballs only (hard links where possible): the copy unpacks,
    builds and generates everything else itself, as a fresh clone does."""
    for sub, fetched in (
        ("debs", [debs.fetch(deb) for deb in SLICE_DEBS]),  # checked against their pins
        ("tarballs", [tarballs.fetch(t) for t in SLICE_TARBALLS]),
    ):
        target = checkout / ".lab" / sub
        target.mkdir(parents=True)
        for source in fetched:
            try:
                os.link(source, target / source.name)
            except OSError:  # another filesystem
                shutil.copy2(source, target / source.name)


def _venv(checkout: Path) -> Path:
    """``<checkout>/.venv``: a real venv, so its interpreter's path is as long as the
    checkout's, with the copy's source and this venv's packages on its path (what
    ``pip install -e`` would give, without a minute of downloads)."""
    venv.EnvBuilder(symlinks=True, with_pip=False).create(checkout / ".venv")
    python = checkout / ".venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, cwd="/",
    ).stdout.strip()  # fmt: skip
    here = sysconfig.get_paths()["purelib"]
    Path(purelib, "_nri_cpuplugin_checkout.pth").write_text(f"{checkout}\n{here}\n")
    return python


def _labs(root: Path) -> Iterator[Path]:
    """The lab of each checkout copy below ``root`` (a walk that stops at checkouts)."""
    for directory, subdirs, files in os.walk(root):
        if "pyproject.toml" in files:
            subdirs.clear()
            yield Path(directory, ".lab")


def _remove_checkout(root: Path) -> list[str]:
    """Whatever a run from the copy left (nothing, unless it was killed), then the copy."""
    problems: list[str] = []
    for lab in _labs(root):
        problems += containerd_harness.reap_stale(lab)
        problems += runc_harness.reap_stale(lab, kinds=("hook", "runc", "podman"))
    if mounts := host.mounts_under(root):
        return [*problems, *(f"mount {m}" for m in mounts)]  # never rmtree through a mount
    shutil.rmtree(root, ignore_errors=True)
    return problems + ([f"directory {root}"] if root.exists() else [])


@pytest.fixture
def checkout_root() -> Iterator[Path]:
    """A private directory (mode 0700, like ``mktemp -d``) for a copy of the checkout, in
    /tmp (a copy's lab holds a few hundred MB, too much for a small /run tmpfs); removed
    afterwards, or by the next run if this one is killed."""
    for stale, _ in shortpaths.stale("checkout"):
        if problems := _remove_checkout(stale):
            pytest.fail(f"a killed run's checkout copy {stale} stays:\n" + "\n".join(problems))
    root = shortpaths.make("checkout", within=Path("/tmp"))
    yield root
    if problems := _remove_checkout(root):
        pytest.fail("the checkout copy could not be removed:\n" + "\n".join(problems))


def _long_path(root: Path) -> Path:
    path = root / "a checkout path with spaces"
    n = 0
    while len(str(path)) < LONG_MIN:
        n += 1
        path = path / f"deliberately long directory name number {n}"
    return path / "nri cpuplugin"


@pytest.mark.parametrize("where", ["long", "short"])
def test_e2e_slice_passes_from_a_copy_of_the_checkout(
    lab: Path, checkout_root: Path, tmp_path: Path, where: str
) -> None:
    checkout = _long_path(checkout_root) if where == "long" else checkout_root / "c"
    if where == "long":
        assert len(str(checkout)) >= LONG_MIN and " " in str(checkout)
    else:
        assert len(str(checkout)) <= 32
    checkout.parent.mkdir(parents=True, exist_ok=True)
    _copy_checkout(checkout)
    _seed_debs(checkout)
    python = _venv(checkout)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "PYTHON", "NRI_", "VIRTUAL_ENV"))
    }
    # The copy's own code is what runs, from any working directory.
    imported = subprocess.run(
        [str(python), "-c", "import nri_cpuplugin; print(nri_cpuplugin.__file__)"],
        capture_output=True, text=True, check=True, cwd="/", env=env,
    ).stdout.strip()  # fmt: skip
    assert imported == str(checkout / "nri_cpuplugin" / "__init__.py")

    run = subprocess.Popen(
        [
            str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q",
            f"--basetemp={tmp_path / 'basetemp'}", *(str(checkout / t) for t in SLICE),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/", env=env,
    )  # fmt: skip
    try:
        output, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
    assert run.returncode == 0, output[-6000:]
    assert re.fullmatch(rf"{len(SLICE)} passed in [0-9.]+s( \(.*\))?", summary), summary

    # It ran on the copy's own lab, which started empty but for the .debs, and left nothing.
    copy_lab = checkout / ".lab"
    assert (copy_lab / "pkgs").is_dir() and not (copy_lab / "apt").exists()
    assert list((copy_lab / "run").iterdir()) == []
    assert _owned_by(run.pid) == []
    assert host.mounts_under(checkout) == []
