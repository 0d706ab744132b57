"""podman 4.3.1 (bookworm) from ``dpkg -x``, private everything, running our hooks.d JSON.

podman reads oci-hooks(5) files with the same containers/common code CRI-O uses, so
``--hooks-dir`` exercises the real matching (``when.annotations``, stages) and the real hook
execution (runc runs createRuntime, podman itself runs poststop).  Setup needs three
workarounds:

1. rlimits: this host has no CAP_SYS_RESOURCE, so podman's default nofile/nproc limits cannot
   be set; containers.conf lowers them.
2. rpath: conmon starts ``podman container cleanup`` with a scrubbed environment (no
   LD_LIBRARY_PATH), so a patched copy of the podman binary finds the extracted libgpgme and
   libsubid through its RUNPATH instead.
3. runc, not crun: bookworm's crun 1.8.1 refuses a hybrid cgroup host.

Storage, configuration, logs and the rootfs live in one instance directory under
``<lab>/run/``; the runroot (podman refuses one longer than 50 characters) in a short private
directory (``shortpaths.py``); the containers in a private top cgroup used as their
``--cgroup-parent``.  Teardown removes the containers, then kills any process left (by pid),
unmounts and removes cgroups and both directories.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import debs, host, image, runc, shortpaths
from .containerd import _cleanup, _leftovers
from .packages import PATCHELF, PODMAN_STACK, RUNC

LIB = "usr/lib/x86_64-linux-gnu"
# The patched binary's cache key: the packages, and the form of its RUNPATH (2: relative).
_PODMAN_KEY = hashlib.sha256(
    ":".join(["2", *(deb.sha256 for deb in (*PODMAN_STACK, PATCHELF))]).encode()
).hexdigest()[:12]
# Podman itself leaves these behind on any host (runc's state root, libmount's utab); they are
# shared, empty-when-unused directories that we remove only if empty.
_SHARED_DIRS = (Path("/run/runc"), Path("/run/mount"))


class PodmanError(RuntimeError):
    """podman could not be prepared or run; the message carries its own words."""


def _patched_podman(lab: Path) -> Path:
    """The podman binary with a RUNPATH to the extracted libraries (built once, cached).

    The RUNPATH is relative to the binary ($ORIGIN): it names no checkout path, so a ':' in
    that path (the RUNPATH separator) cannot split it, and a lab that moved keeps working."""
    trees = [debs.unpack(deb, lab) for deb in PODMAN_STACK]
    target_dir = lab / "podman-bin" / _PODMAN_KEY
    libs = ":".join(
        f"$ORIGIN/{os.path.relpath(t / LIB, target_dir)}" for t in trees if (t / LIB).is_dir()
    )
    target = target_dir / "podman"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with (target_dir.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        patchelf = debs.unpack(PATCHELF, lab) / "usr/bin/patchelf"
        partial = target_dir / "podman.partial"
        shutil.copy2(trees[0] / "usr/bin/podman", partial)
        result = subprocess.run(
            [str(patchelf), "--set-rpath", libs, str(partial)], capture_output=True, text=True
        )
        if result.returncode:
            raise PodmanError(f"patchelf failed: {result.stderr.strip()}")
        partial.rename(target)
    return target


def _toml_string(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


class Podman:
    """One private podman.  ``with Podman(hooks_dir=...) as pm:`` prepares and cleans up."""

    def __init__(self, hooks_dir: Path, lab: Path = debs.LAB, token: str | None = None) -> None:
        self.lab = lab
        self.hooks_dir = hooks_dir
        self.token = token or secrets.token_hex(4)
        self.top = f"/nri-hook-{self.token}"
        self.dir = lab / "run" / f"podman-{self.token}"
        self.rootfs = self.dir / "rootfs"
        self.short: Path | None = None
        self._binary: Path | None = None

    # --- setup -------------------------------------------------------------------------------

    def __enter__(self) -> Podman:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = self.close()
        if leftovers and exc[0] is None:
            raise PodmanError("teardown left things behind:\n  " + "\n  ".join(leftovers))

    @property
    def conf(self) -> Path:
        return self.dir / "containers.conf"

    @property
    def storage_conf(self) -> Path:
        return self.dir / "storage.conf"

    @property
    def runroot(self) -> Path:
        assert self.short is not None, "start() first"
        return self.short / "runroot"

    @property
    def tmp_dir(self) -> Path:
        # Not limited: conmon binds the attach sockets below it through /proc/self/fd/N/.
        return self.dir / "tmp"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.short = shortpaths.make("podman", instance=self.dir, top=self.top)
        (self.dir / "owner.json").write_text(
            json.dumps(
                {
                    "owner": [os.getpid(), host.start_time(os.getpid())],
                    "top": self.top,
                    "short": str(self.short),
                }
            )
        )
        self._binary = _patched_podman(self.lab)
        trees = {deb.name: debs.unpack(deb, self.lab) for deb in PODMAN_STACK}
        runc_binary = debs.unpack(RUNC, self.lab) / "usr/sbin/runc"
        conmon = trees["conmon"] / "usr/bin/conmon"
        seccomp = trees["golang-github-containers-common"] / "usr/share/containers/seccomp.json"
        for d in (self.dir / "root", self.runroot, self.tmp_dir, self.dir / "volumes"):
            d.mkdir(exist_ok=True)
        (self.dir / "net").mkdir(exist_ok=True)
        self.conf.write_text(
            "[containers]\n"
            'log_driver = "k8s-file"\n'
            'netns = "host"\n'
            # No CAP_SYS_RESOURCE here; podman lowers its own nproc limit to 32768 for conmon.
            'default_ulimits = ["nofile=1024:1024", "nproc=32768:32768"]\n'
            f"seccomp_profile = {_toml_string(seccomp)}\n"
            "\n[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            f"events_logfile_path = {_toml_string(self.dir / 'events.log')}\n"
            'runtime = "runc"\n'
            f"conmon_path = [{_toml_string(conmon)}]\n"
            f"hooks_dir = [{_toml_string(self.hooks_dir)}]\n"
            f"tmp_dir = {_toml_string(self.tmp_dir)}\n"
            f"volume_path = {_toml_string(self.dir / 'volumes')}\n"
            'lock_type = "file"\n'
            "\n[engine.runtimes]\n"
            f"runc = [{_toml_string(runc_binary)}]\n"
            "\n[network]\n"
            f"network_config_dir = {_toml_string(self.dir / 'net')}\n"
        )
        self.storage_conf.write_text(
            "[storage]\n"
            'driver = "vfs"\n'
            f"graphroot = {_toml_string(self.dir / 'root')}\n"
            f"runroot = {_toml_string(self.runroot)}\n"
        )
        if not self.rootfs.exists():
            # A private copy: podman writes /etc/hosts and friends into a --rootfs.
            shutil.copytree(image.rootfs(self.lab), self.rootfs, symlinks=True)
        version = self.run(["--version"])
        if "4.3.1" not in version.stdout:
            raise PodmanError(f"unexpected podman: {version.stdout.strip()}")

    def env(self) -> dict[str, str]:
        trees = [debs.unpack(deb, self.lab) for deb in PODMAN_STACK]
        return {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "CONTAINERS_CONF": str(self.conf),
            "CONTAINERS_STORAGE_CONF": str(self.storage_conf),
            "CONTAINERS_REGISTRIES_CONF": str(
                next(t for t in trees if (t / "etc/containers/registries.conf").exists())
                / "etc/containers/registries.conf"
            ),
        }

    def command(self, args: Sequence[str]) -> list[str]:
        assert self._binary is not None, "start() first"
        return [
            str(self._binary),
            "--root",
            str(self.dir / "root"),
            "--runroot",
            str(self.runroot),
            "--hooks-dir",
            str(self.hooks_dir),
            *args,
        ]

    def run(
        self,
        args: Sequence[str],
        check: bool = True,
        timeout: float = 120,
        throwaway_var_lib: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """``throwaway_var_lib``: for commands that copy images (``load``), whose blob-info
        cache goes to /var/lib/containers/cache, a path no option moves - they run in a private
        mount namespace with a tmpfs on /var/lib, so the host's is never written."""
        command = self.command(args)
        if throwaway_var_lib:
            command = [
                "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                'mount -t tmpfs -o size=16m podman-var-lib /var/lib && exec "$@"', "sh",
                *command,
            ]  # fmt: skip
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if check and result.returncode:
            raise PodmanError(
                f"podman {' '.join(args)} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    # --- containers ------------------------------------------------------------------------

    def run_container(
        self,
        name: str,
        command: str,
        annotations: Mapping[str, str] = (),  # type: ignore[assignment]
        cgroup_parent: str | None = None,
        cpu: Mapping[str, Any] | None = None,
        extra: Sequence[str] = (),
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """``podman run --rm`` of the busybox rootfs; returns its output."""
        args = ["run", "--rm", "--name", name, "--network", "host", "--read-only"]
        for key, value in dict(annotations).items():
            args += ["--annotation", f"{key}={value}"]
        if cgroup_parent:
            args += ["--cgroup-parent", cgroup_parent]
        cpu = cpu or {}
        if "shares" in cpu:
            args += ["--cpu-shares", str(cpu["shares"])]
        if "quota" in cpu:
            args += [
                "--cpu-quota",
                str(cpu["quota"]),
                "--cpu-period",
                str(cpu.get("period", 100000)),
            ]
        if "cpus" in cpu:
            args += ["--cpuset-cpus", str(cpu["cpus"])]
        args += [*extra, "--rootfs", str(self.rootfs), "/bin/sh", "-c", command]
        return self.run(args, check=check)

    def close(self) -> list[str]:
        if self._binary is not None:
            with contextlib.suppress(Exception):
                self.run(["rm", "--all", "--force", "--time", "0"], check=False, timeout=60)
        short = self.short or self.dir
        _cleanup(self.dir, short, self.top, 10.0)
        for d in _SHARED_DIRS:
            with contextlib.suppress(OSError):
                d.rmdir()  # only if empty: another podman's or runc's files stay
        return _leftovers(self.dir, short, self.top)


def prepare(lab: Path = debs.LAB) -> None:
    """Everything slow, once: the podman stack unpacked and patched, runc, the rootfs."""
    _patched_podman(lab)
    debs.unpack(RUNC, lab)
    image.rootfs(lab)


def reap_stale(lab: Path = debs.LAB) -> list[str]:
    """Clean up podman instances whose owning test process is gone."""
    return runc.reap_stale(lab, kinds=("podman",))
