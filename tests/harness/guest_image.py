"""The guest node's disk, kernel and initrd: Debian built by debootstrap from Debian's archive,
cached in the lab under a hash of its recipe and rebuilt when missing.  Two recipes:
:data:`BOOKWORM` (systemd 252, kernel 6.1, runc 1.1.5; the default) and :data:`TRIXIE`
(systemd 257, kernel 6.12, crun 1.21; runc 1.3 comes from the lab, guest_runtimes.py).

What can be trusted and how:

* debootstrap checks the suite's ``InRelease`` signature against Debian's archive keyring
  (``--force-check-gpg``: no unsigned fallback), the ``Packages`` index against the
  ``Release`` checksums and every ``.deb`` against the index, so every package is the
  archive's.
* The packages whose behaviour the tests measure - the kernel, systemd, runc, conmon - are also
  pinned here by version and SHA256 (:data:`PINNED`), checked on the downloaded ``.deb``
  files: a point release that changes them fails the build with a message instead of silently
  changing the node.  The rest is whatever the suite holds; the build records every package
  and version in ``manifest.json``.

The image holds the operating system only: systemd as PID 1, dbus, udev, the kernel and
initramfs, python3, runc, conmon, iproute2, util-linux.  The runtimes, their configuration and
everything the tests run come over the checkout share at boot (guest_vm.py), so changing them
never rebuilds the image.  The one thing in it that belongs to the harness is the unit that
starts the command channel's agent, itself read from the harness directory share
(guest_agent.py), so the agent can change without a rebuild too.

The root filesystem is made by ``mkfs.ext4 -d`` from the debootstrap tree: no loop device, no
mount.  The tree is removed afterwards; the cached image is never written (the VM boots it
with ``snapshot=on``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import debs, host, host_tools, shortpaths
from .debs import Deb
from .packages import CONMON, RUNC

KERNEL_RELEASE = "6.1.0-50-amd64"
KERNEL = Deb(
    f"linux-image-{KERNEL_RELEASE}",
    "6.1.176-1",
    "7b5597492a0a65aee61985a492e6bcc3f2cde830072a0e3b3d8c7e1b90279bd3",
)
KERNEL_META = Deb(
    "linux-image-amd64",
    "6.1.176-1",
    "03c256cf13f624ed458e907f89afe7c8cc661b991fffbdb3f3bdced3e30132bc",
)
SYSTEMD = Deb(
    "systemd",
    "252.39-1~deb12u2",
    "286f879c537bfba92e59d580c075ad20ab49020244c79634656850a306dd462b",
)
SYSTEMD_SYSV = Deb(
    "systemd-sysv",
    "252.39-1~deb12u2",
    "e3dc84316cfdf7e3feefe4eaf507758d2630ea131e1834e1f07525b3e537db2d",
)
PINNED = (KERNEL, KERNEL_META, SYSTEMD, SYSTEMD_SYSV, RUNC, CONMON)
# Installed by name on top of debootstrap's minbase (essential packages + apt) besides the
# pinned ones; their dependencies are resolved by debootstrap.
BASE_PACKAGES = (
    "dbus",  # runc's and the runtimes' systemd cgroup driver talk to systemd over D-Bus
    "udev",  # device units, module autoloading, /dev/virtio-ports
    "kmod",
    "initramfs-tools",
    "python3",  # the agent; the tests' Python code (the host venv's cp311 packages)
    "iproute2",
    "procps",
    "libseccomp2",
    "libsqlite3-0",  # CRI-O 1.36.3 links the system libsqlite3 (shared/runtimes/cri-o)
)

# trixie: what current nodes run (systemd 255-257, kernels >= 6.8).  Its runc is 1.1.15, so
# the runc under test (1.3) comes from sid through the lab instead (packages.RUNC_13); CRI-O
# runs trixie's crun here, as Fedora's, RHEL's and OpenShift's CRI-O does by default.
TRIXIE_KERNEL_RELEASE = "6.12.117+deb13-amd64"
TRIXIE_PINNED = (
    Deb(
        f"linux-image-{TRIXIE_KERNEL_RELEASE}",
        "6.12.117-1",
        "ca712d36790184f6ac125ce2b20ea4e2202ae6bb7817b7de268f1f0115ccda73",
    ),
    Deb(
        "linux-image-amd64",
        "6.12.117-1",
        "c91bd9b74771215b734ac74717b7994f654d694091336f381c9f6b5368a88b5d",
    ),
    Deb(
        "systemd",
        "257.13-1~deb13u1",
        "ee81302a1d5b7434762b6e784a572854d4b6cf6235e33e2d104ad4e1cae71ab4",
    ),
    Deb(
        "systemd-sysv",
        "257.13-1~deb13u1",
        "3bed48042b6e40f8a3c439e79b4a4ed6a12102eb3ab66123dc43aa18f0416729",
    ),
    Deb("crun", "1.21-1", "f94f8d4acf08a304884666d67d9faa797ab8401b46c311827783a432cb15b652"),
    Deb("conmon", "2.1.12-4", "5de1cc371415dc0a75d988d74b89789a86a6d541de3ccaf2214e548c584d1605"),
)


@dataclass(frozen=True)
class Recipe:
    """One suite's image: the packages pinned by version and SHA256, the kernel to boot, and
    the minor version of the suite's python3 (the guest runs the tests' code with it)."""

    suite: str
    kernel_release: str
    pinned: tuple[Deb, ...]
    python: str

    @property
    def packages(self) -> tuple[str, ...]:
        return (*(deb.name for deb in self.pinned), *BASE_PACKAGES)


BOOKWORM = Recipe("bookworm", KERNEL_RELEASE, PINNED, "3.11")
TRIXIE = Recipe("trixie", TRIXIE_KERNEL_RELEASE, TRIXIE_PINNED, "3.13")
RECIPES = {r.suite: r for r in (BOOKWORM, TRIXIE)}
# Bump when the tree or image layout made here changes without the constants above changing.
FORMAT = 1
IMAGE_SIZE = "4G"  # sparse; about 1 GB is used
HOSTNAME = "nri-guest"
# shortpaths kind of a build's private directory (<tmp>/nri-guest-build-XXXX)
BUILD_KIND = "guest-build"

# The harness directory comes into the guest under this 9p tag, and the agent runs from it.
HARNESS_TAG = "nri-harness"
HARNESS_MOUNT = "/run/nri-guest/harness"
AGENT_UNIT = "nri-guest-agent.service"
_AGENT_UNIT_TEXT = f"""\
# Written by tests/harness/guest_image.py.  The host's command channel: the agent reads
# requests from a virtio-serial port and runs them (tests/harness/guest_agent.py, read from the
# host's harness directory so that it can change without an image rebuild).
[Unit]
Description=nri-cpuplugin test harness: host command channel
# As early as the root filesystem allows and independent of the rest of the boot, so that the
# host can still ask what went wrong when the boot itself did not finish.
DefaultDependencies=no
Conflicts=shutdown.target
Before=shutdown.target

[Service]
ExecStartPre=/bin/mkdir -p {HARNESS_MOUNT}
ExecStartPre=/bin/sh -c 'mountpoint -q {HARNESS_MOUNT} || \
mount -t 9p -o trans=virtio,version=9p2000.L,ro {HARNESS_TAG} {HARNESS_MOUNT}'
ExecStart=/usr/bin/python3 -u {HARNESS_MOUNT}/guest_agent.py
Restart=always
RestartSec=1

[Install]
WantedBy=sysinit.target
"""
# Units of the base system a disposable test node does not need; masked so that they cost
# no boot time under emulation.
_MASKED = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "dpkg-db-backup.timer",
    "systemd-tmpfiles-clean.timer",
    "getty@tty1.service",  # no display: the console is the serial port
)
_FILES = {
    "etc/hostname": f"{HOSTNAME}\n",
    "etc/hosts": f"127.0.0.1 localhost\n127.0.1.1 {HOSTNAME}\n",
    # No fsck: the image is built fresh and booted with snapshot=on, never written.
    "etc/fstab": "/dev/vda / ext4 rw,noatime 0 0\n",
    # containerd's and CRI-O's overlay snapshotters/drivers
    "etc/modules-load.d/nri-guest.conf": "overlay\n",
    # A unit that hangs while stopping must not hold a test session's shutdown for 90 s.
    "etc/systemd/system.conf.d/nri-guest.conf": "[Manager]\nDefaultTimeoutStopSec=20s\n",
    f"etc/systemd/system/{AGENT_UNIT}": _AGENT_UNIT_TEXT,
}


class GuestImageError(RuntimeError):
    """The image could not be built; the message says which step and why."""


@dataclass(frozen=True)
class GuestImage:
    """A built image: ``disk`` (raw ext4, the root filesystem), ``kernel`` and ``initrd`` for
    QEMU's direct kernel boot, and ``manifest`` (the recipe and every installed package)."""

    dir: Path
    key: str

    @property
    def disk(self) -> Path:
        return self.dir / "disk.img"

    @property
    def kernel(self) -> Path:
        return self.dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.img"

    @property
    def manifest(self) -> dict:
        return json.loads((self.dir / "manifest.json").read_text())


def recipe(of: Recipe = BOOKWORM) -> dict:
    """Everything the image is made from; its hash names the cache entry."""
    return {
        "format": FORMAT,
        "suite": of.suite,
        "variant": "minbase",
        "packages": list(of.packages),
        "pinned": [[d.name, d.version, d.sha256] for d in of.pinned],
        "files": _FILES,
        "masked": list(_MASKED),
        "enabled": {AGENT_UNIT: "sysinit.target"},
        "size": IMAGE_SIZE,
    }


def recipe_key(of: Recipe = BOOKWORM) -> str:
    return hashlib.sha256(json.dumps(recipe(of), sort_keys=True).encode()).hexdigest()[:16]


def cached(lab: Path = debs.LAB, of: Recipe = BOOKWORM) -> GuestImage | None:
    """The image of the recipe if it is built, else None (nothing is built)."""
    image = GuestImage(lab / "guest" / "images" / recipe_key(of), recipe_key(of))
    return image if (image.dir / ".done").exists() else None


def build(lab: Path = debs.LAB, log: Path | None = None, of: Recipe = BOOKWORM) -> GuestImage:
    """The image of the recipe, built first if it is not cached (2-5 minutes on a 2-CPU
    machine, mostly downloads and dpkg).  ``log`` receives debootstrap's output (default:
    ``build.log`` next to the image)."""
    key = recipe_key(of)
    target = lab / "guest" / "images" / key
    image = GuestImage(target, key)
    if (target / ".done").exists():
        return image
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".lock").open("w") as lock:  # another session may be building it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".done").exists():
            return image
        tools = host_tools.ensure("debootstrap", "mkfs.ext4", "gpgv", lab=lab)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        # debootstrap is a shell script that breaks on a target path with spaces (its grep
        # of the Packages lists): the tree is made in a short private directory instead.
        work = shortpaths.make(BUILD_KIND, within=shortpaths.BASES[1])
        try:
            _build_into(partial, work, lab, tools, log or partial / "build.log", of)
        finally:
            remove_build_dir(work)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        (target / ".done").touch()
        _remove_stale_images(target.parent, keep=target, suite=of.suite)
    return image


def _debootstrap(work: Path, lab: Path, tools: dict[str, Path], log: Path, of: Recipe) -> Path:
    """The bootstrapped tree (in ``work``); the downloaded packages stay in the lab."""
    cache = lab / "guest" / "debs"  # a recipe change downloads only what changed
    cache.mkdir(parents=True, exist_ok=True)
    (work / "debs").symlink_to(cache)  # named through the short directory, for the same reason
    mirror = debs._archive_uri()
    rootfs = work / "rootfs"
    command = [
        str(tools["debootstrap"]),
        "--variant=minbase",
        f"--include={','.join(of.packages)}",
        f"--keyring={debs.KEYRING}",
        "--force-check-gpg",
        f"--cache-dir={work / 'debs'}",
        of.suite,
        str(rootfs),
        mirror,
    ]
    with log.open("ab") as out_log:
        out_log.write(f"==== {' '.join(command)}\n".encode())
        out_log.flush()
        result = subprocess.run(
            command, stdout=out_log, stderr=subprocess.STDOUT, check=False, timeout=3600
        )
    if result.returncode:
        raise GuestImageError(
            f"debootstrap {of.suite} from {mirror} failed (exit {result.returncode}); if a pinned "
            f"package is gone from the suite, see the pins in guest_image.py.\n{_tail(log)}"
        )
    _check_pins(cache, _installed(rootfs), of)
    return rootfs


def _build_into(
    out: Path, work: Path, lab: Path, tools: dict[str, Path], log: Path, of: Recipe
) -> None:
    started = time.monotonic()
    rootfs = _debootstrap(work, lab, tools, log, of)
    installed = _installed(rootfs)
    _configure(rootfs, of)
    shutil.copyfile(rootfs / f"boot/vmlinuz-{of.kernel_release}", out / "vmlinuz")
    shutil.copyfile(rootfs / f"boot/initrd.img-{of.kernel_release}", out / "initrd.img")
    for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()  # debootstrap's copies: the lab's cache keeps them
    disk = out / "disk.img"
    subprocess.run(["truncate", "-s", IMAGE_SIZE, str(disk)], check=True)
    mkfs = subprocess.run(
        [str(tools["mkfs.ext4"]), "-q", "-F", "-L", "nri-guest", "-d", str(rootfs), str(disk)],
        capture_output=True, text=True, check=False, timeout=1800,
    )  # fmt: skip
    if mkfs.returncode:
        raise GuestImageError(f"mkfs.ext4 -d {rootfs} failed: {mkfs.stderr.strip()[-1500:]}")
    manifest = {
        "recipe": recipe(of),
        "key": recipe_key(of),
        "mirror": debs._archive_uri(),
        "installed": installed,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _installed(rootfs: Path) -> dict[str, str]:
    """Package -> version of everything installed, from the tree's dpkg status file."""
    out: dict[str, str] = {}
    for stanza in (rootfs / "var/lib/dpkg/status").read_text().split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            out[fields["Package"]] = fields["Version"]
    return out


def _check_pins(cache: Path, installed: dict[str, str], of: Recipe) -> None:
    problems = []
    for deb in of.pinned:
        if installed.get(deb.name) != deb.version:
            problems.append(
                f"{deb.name}: the suite installed {installed.get(deb.name)}, "
                f"the recipe pins {deb.version}"
            )
            continue
        path = cache / deb.filename
        actual = debs._sha256(path) if path.exists() else f"no {path.name} in {cache}"
        if actual != deb.sha256:
            problems.append(f"{deb.name} {deb.version}: SHA256 {actual}, pinned {deb.sha256}")
    if problems:
        raise GuestImageError(
            "the archive changed under the guest recipe - check the packages and update the "
            "pins in tests/harness/guest_image.py deliberately:\n  " + "\n  ".join(problems)
        )
    python = installed.get(f"python{of.python}", "")
    if not python.startswith(f"{of.python}."):
        # The guest runs the host venv's packages (cp311) or their builds for its own python
        # (guest_python.py): the minor version must be the recipe's.
        raise GuestImageError(
            f"the guest's python{of.python} is {python or 'missing'}; need {of.python}"
        )


def _configure(rootfs: Path, of: Recipe) -> None:
    for name, text in _FILES.items():
        path = rootfs / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    # A fixed machine id: every boot of the snapshot is then not a "first boot".
    (rootfs / "etc/machine-id").write_text(hashlib.md5(recipe_key(of).encode()).hexdigest() + "\n")
    systemd = rootfs / "etc/systemd/system"
    _symlink(systemd / "default.target", "/lib/systemd/system/multi-user.target")
    for unit in _MASKED:
        _symlink(systemd / unit, "/dev/null")
    _symlink(systemd / "sysinit.target.wants" / AGENT_UNIT, f"/etc/systemd/system/{AGENT_UNIT}")


def _symlink(link: Path, target: str) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(target)


def remove_build_dir(path: Path) -> None:
    """A build's short directory with its tree (also one a killed build left, for guest_vm's
    reaper): the mounts debootstrap made inside it (proc, sys) are undone first, so that the
    removal never follows them into the host's."""
    if not path.exists():
        return
    for point in reversed(host.mounts_under(path)):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    if left := host.mounts_under(path):
        raise GuestImageError(f"cannot remove {path}: still mounted there: {left}")
    shutil.rmtree(path, ignore_errors=True)


def _remove_stale_images(images: Path, keep: Path, suite: str) -> None:
    """Images of the suite's older recipes: 1 GB each, never used again.  Another suite's
    image stays: both guests are booted by one test session."""
    for other in images.iterdir():
        if other == keep or not other.is_dir() or other.name.endswith(".partial"):
            continue
        if _suite_of(other) == suite:
            shutil.rmtree(other, ignore_errors=True)


def _suite_of(image: Path) -> str | None:
    """The suite an image was built from (its manifest), None when that cannot be read (an
    image without one is left alone)."""
    try:
        return json.loads((image / "manifest.json").read_text())["recipe"]["suite"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"(no log at {path})"
    return f"--- last lines of {path} ---\n" + "\n".join(text)
