"""A private, disposable containerd (1.7, 2.1 or 2.3) with NRI enabled, for the e2e tests.

Each :class:`Containerd` owns one directory under ``<lab>/run/`` holding its config, state,
runc state, NRI plugin directories, pod logs and its log file; one short private directory
(``shortpaths.py``) holding what a long checkout path would break - its sockets and its root;
and one private top cgroup (``/nri-e2e-<token>``) under which every pod cgroup is created.
Nothing is installed and the host's containerd (if any) is never touched: binaries come from the
pinned Debian packages (1.7.24, 2.1.9) or the pinned release tarball (2.3.4, harness/tarballs.py),
unpacked into the lab cache.

Teardown (:meth:`Containerd.teardown`, also run by the context manager and by
:func:`reap_stale` for instances a killed test run left behind) works even when the runtime is
wedged: CRI removal first, then containerd by pid, then any shim or container process found by
its cgroup (under the private top cgroup) or by one of its directories on its command line,
then every mount under its directories, then the cgroup directories in every hierarchy.
Processes are only ever signalled by pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import crun, debs, host, image, shortpaths, tarballs
from .cri import CRIClient, CRIError
from .debs import Deb
from .packages import CONTAINERD_17, CONTAINERD_21, CONTAINERD_23, RUNC
from .runtime_process import RuntimeProcess
from .tarballs import Tarball

# The instance kinds, by minor version; each is one pinned build (RELEASES: its full version,
# NRI: the NRI library it carries, docs/nri-wire.md §13.1).
VERSIONS: dict[str, Deb | Tarball] = {
    "1.7": CONTAINERD_17,
    "2.1": CONTAINERD_21,
    "2.3": CONTAINERD_23,
}
RELEASES = {"1.7": "1.7.24", "2.1": "2.1.9", "2.3": "2.3.4"}
NRI = {"1.7": "0.6.1", "2.1": "0.8.0", "2.3": "0.12.0"}
_MNT_DETACH = 2
# containerd always puts shim sockets here; no configuration setting moves them.
_SHIM_SOCKET_DIR = Path("/run/containerd/s")


class HarnessError(RuntimeError):
    """The runtime could not be started or cleaned up; the message carries the evidence."""


def at_least(version: str, minimum: str) -> bool:
    """``version`` (``"2.3"``) is ``minimum`` or newer."""
    return tuple(map(int, version.split("."))) >= tuple(map(int, minimum.split(".")))


def bin_dir(version: str, lab: Path = debs.LAB) -> Path:
    """Where ``containerd``, ``ctr`` and ``containerd-shim-runc-v2`` of ``version`` are,
    unpacked (and, for a tarball, checked against their pins) on first use."""
    artifact = VERSIONS[version]
    if isinstance(artifact, Tarball):
        return tarballs.unpack(artifact, lab) / "bin"
    return debs.unpack(artifact, lab) / "usr/bin"


def _duration(value: float | str) -> str:
    """Go duration for the config: seconds as a number, or a ready string like ``"500ms"``."""
    if isinstance(value, str):
        return value
    return f"{round(value * 1000)}ms"


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _toml(table: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> str:
    """Just enough TOML for containerd configs: scalars, lists of scalars and nested tables."""

    def key(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return str(v)
        if isinstance(v, str | Path):
            return json.dumps(str(v))  # a JSON string is a valid TOML basic string
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"no TOML form for {v!r}")

    lines = [f"{key(k)} = {value(v)}" for k, v in table.items() if not isinstance(v, Mapping)]
    out = "\n".join(lines) + "\n" if lines else ""
    for k, v in table.items():
        if isinstance(v, Mapping):
            path = (*prefix, k)
            out += f"\n[{'.'.join(key(p) for p in path)}]\n" + _toml(v, path)
    return out


class Containerd(RuntimeProcess):
    """One private containerd.  ``with Containerd("2.1") as ctrd:`` starts it and guarantees
    teardown; ``ctrd.cri()`` is the CRI client.

    ``plugin_registration_timeout`` / ``plugin_request_timeout`` are NRI's (seconds or a Go
    duration string).  Runtime-launched NRI plugins go into :attr:`plugin_path` (executables
    named ``NN-name``) with optional configs in :attr:`plugin_config_path` (``NN-name.conf``);
    containerd starts them at boot.  ``config_overrides`` is merged into :meth:`config`, e.g.
    ``{"plugins": {"io.containerd.nri.v1.nri": {"disable_connections": True}}}``.
    ``runtime``: the OCI runtime binary of the ``runc`` handler (``io.containerd.runc.v2``'s
    ``BinaryName``): bookworm's runc, or crun through its wrapper (harness/crun.py).
    """

    def __init__(
        self,
        version: str = "2.1",
        *,
        lab: Path = debs.LAB,
        nri: bool = True,
        plugin_registration_timeout: float | str = 5.0,
        plugin_request_timeout: float | str = 2.0,
        nri_disable_connections: bool = False,
        debug: bool = True,
        start_timeout: float = 20.0,
        config_overrides: Mapping[str, Any] | None = None,
        token: str | None = None,
        runtime: str = "runc",
    ) -> None:
        if version not in VERSIONS:
            raise ValueError(f"containerd version {version!r}: expected one of {list(VERSIONS)}")
        self.version = version
        self.runtime = crun.check_runtime(runtime)
        self.lab = Path(lab)
        self.nri = nri
        self.plugin_registration_timeout = plugin_registration_timeout
        self.plugin_request_timeout = plugin_request_timeout
        self.nri_disable_connections = nri_disable_connections
        self.debug = debug
        self.start_timeout = start_timeout
        self.config_overrides = dict(config_overrides or {})
        self.token = token or secrets.token_hex(4)
        self.dir = self.lab / "run" / f"containerd-{version}-{self.token}"
        self.top_cgroup = f"/nri-e2e-{self.token}"
        # Its short private directory (harness/shortpaths.py), made by start(): the sockets
        # (108-byte limit) and containerd's root (the overlayfs snapshotter's mount options
        # name three paths below it, and mount data is limited to a page).
        self.short_dir = shortpaths.path_for("containerd", self.token)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._cri: CRIClient | None = None
        self._images_imported = False
        self._last_log: list[str] = []

    # -- paths -----------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """containerd's root: content store, snapshots and the pods' shm mounts."""
        return self.short_dir / "root"

    @property
    def address(self) -> Path:
        """The containerd gRPC socket (CRI and containerd API)."""
        return self.short_dir / "containerd.sock"

    @property
    def nri_socket(self) -> Path:
        """Where external NRI plugins connect."""
        return self.short_dir / "nri.sock"

    @property
    def plugin_path(self) -> Path:
        """Runtime-launched NRI plugins: executables named ``NN-name``, started at boot."""
        return self.dir / "nri/plugins"

    @property
    def plugin_config_path(self) -> Path:
        """Configs for runtime-launched plugins: ``NN-name.conf`` or ``name.conf``."""
        return self.dir / "nri/conf.d"

    @property
    def log_path(self) -> Path:
        return self.dir / "containerd.log"

    @property
    def config_path(self) -> Path:
        return self.dir / "config.toml"

    @property
    def runc_root(self) -> Path:
        return self.dir / "runc"

    @property
    def bin_dir(self) -> Path:
        return bin_dir(self.version, self.lab)

    @property
    def binary(self) -> Path:
        return self.bin_dir / "containerd"

    @property
    def ctr(self) -> Path:
        return self.bin_dir / "ctr"

    @property
    def release(self) -> str:
        """The full version, e.g. ``2.3.4``."""
        return RELEASES[self.version]

    @property
    def shim_socket_dir(self) -> Path:
        """Where shims put their sockets: configurable from 2.3 on (at most 42 characters, so
        in the short directory); always /run/containerd/s before."""
        return self.short_dir / "s" if at_least(self.version, "2.3") else _SHIM_SOCKET_DIR

    @property
    def runc(self) -> Path:
        return debs.unpack(RUNC, self.lab) / "usr/sbin/runc"

    @property
    def runtime_binary(self) -> Path:
        """What the shim runs as its OCI runtime: runc itself, or the instance's crun wrapper."""
        return self.runc if self.runtime == "runc" else self.dir / "bin" / "crun"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    # -- config ----------------------------------------------------------------------------

    def _nri_section(self) -> dict[str, Any]:
        return {
            "disable": not self.nri,
            "disable_connections": self.nri_disable_connections,
            "socket_path": self.nri_socket,
            "plugin_path": self.plugin_path,
            "plugin_config_path": self.plugin_config_path,
            "plugin_registration_timeout": _duration(self.plugin_registration_timeout),
            "plugin_request_timeout": _duration(self.plugin_request_timeout),
        }

    def config(self) -> dict[str, Any]:
        """The containerd configuration as a dict (written as TOML by :meth:`start`)."""
        return _merge(self._base_config(), self.config_overrides)

    def _base_config(self) -> dict[str, Any]:
        d = self.dir
        runc = {
            "runtime_type": "io.containerd.runc.v2",
            "options": {
                "BinaryName": self.runtime_binary,
                "Root": self.runc_root,
                "SystemdCgroup": False,
            },
        }
        common = {
            "root": self.root,
            "state": d / "state",
            "temp": d / "tmp",  # default: the system temp dir
            "grpc": {"address": self.address},
            "ttrpc": {"address": f"{self.address}.ttrpc"},
            "debug": {"level": "debug" if self.debug else "info"},
        }
        # Keep every default path that would point outside the instance directory inside it.
        opt = {"path": d / "opt"}
        cdi = [d / "cdi"]
        # Without CAP_SYS_RESOURCE runc cannot lower oom_score_adj (kubelet asks -997/-998);
        # restrict_oom_score_adj clamps it to containerd's own value.
        if self.version == "1.7":
            return {
                "version": 2,
                **common,
                "disabled_plugins": [
                    f"io.containerd.snapshotter.v1.{s}"
                    for s in ("btrfs", "zfs", "aufs", "devmapper")
                ]
                + ["io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"],
                "plugins": {
                    "io.containerd.grpc.v1.cri": {
                        "sandbox_image": image.PAUSE_IMAGE,
                        "restrict_oom_score_adj": True,
                        "cdi_spec_dirs": cdi,
                        "containerd": {
                            "snapshotter": "overlayfs",
                            "default_runtime_name": "runc",
                            "runtimes": {"runc": runc},
                        },
                        "cni": {"bin_dir": d / "cni/bin", "conf_dir": d / "cni/net.d"},
                    },
                    "io.containerd.internal.v1.opt": opt,
                    "io.containerd.nri.v1.nri": self._nri_section(),
                },
            }
        config: dict[str, Any] = {
            # 2.3 writes version 4 and migrates a version 3 file in memory: one file for 2.x.
            "version": 3,
            **common,
            "disabled_plugins": [
                f"io.containerd.snapshotter.v1.{s}" for s in ("btrfs", "zfs", "devmapper", "erofs")
            ]
            + [
                "io.containerd.differ.v1.erofs",
                "io.containerd.tracing.processor.v1.otlp",
                "io.containerd.internal.v1.tracing",
            ],
            "plugins": {
                "io.containerd.cri.v1.images": {
                    "snapshotter": "overlayfs",
                    "pinned_images": {"sandbox": image.PAUSE_IMAGE},
                },
                "io.containerd.cri.v1.runtime": {
                    "restrict_oom_score_adj": True,
                    "cdi_spec_dirs": cdi,
                    "containerd": {"default_runtime_name": "runc", "runtimes": {"runc": runc}},
                    "cni": {"bin_dirs": [d / "cni/bin"], "conf_dir": d / "cni/net.d"},
                },
                "io.containerd.image-verifier.v1.bindir": {"bin_dir": d / "opt/image-verifier"},
                "io.containerd.internal.v1.opt": opt,
                "io.containerd.nri.v1.nri": self._nri_section(),
            },
        }
        if at_least(self.version, "2.3"):
            # 2.3 imports /etc/containerd/conf.d/*.toml unless told otherwise: nothing of the
            # host's.  Its shims' sockets can live in the instance (2.1 forces /run/containerd/s).
            config["imports"] = []
            config["plugins"]["io.containerd.shim.v1.manager"] = {
                "socket_dir": self.shim_socket_dir
            }
        return config

    def _prepare(self) -> None:
        for sub in ("state", "tmp", "cni/bin", "cni/net.d", "cdi", "logs", "opt"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        # Also after a teardown(), which removed it: the paths stay what they were.
        shortpaths.ensure(
            "containerd", self.short_dir, instance=self.dir, top=self.top_cgroup, token=self.token
        )
        self.root.mkdir(exist_ok=True)
        self.plugin_path.mkdir(parents=True, exist_ok=True)
        self.plugin_config_path.mkdir(parents=True, exist_ok=True)
        # Who owns this instance: reap_stale() cleans up after owners that died.
        (self.dir / "instance.json").write_text(
            json.dumps(
                {
                    "version": self.version,
                    "token": self.token,
                    "owner": [os.getpid(), host.start_time(os.getpid())],
                    "short_dir": str(self.short_dir),
                }
            )
        )
        if self.runtime == "crun":
            crun.write_wrapper(self.runtime_binary, self.lab)
        self.config_path.write_text(_toml(self.config()))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float | None = None, *, import_images: bool = True) -> None:
        """Start containerd and wait until CRI answers Version (and the NRI socket exists).
        On the first start the lab images are imported.  Raises HarnessError with the log tail."""
        if self.running:
            raise HarnessError(f"containerd {self.version} is already running (pid {self.pid})")
        binary, runc = self.binary, self.runc  # unpack before the clock starts
        image.images_tar(self.lab)
        self._prepare()
        env = dict(os.environ)
        # containerd finds its shim on PATH; runc is named in the config but PATH costs nothing.
        env["PATH"] = os.pathsep.join([str(binary.parent), str(runc.parent), env.get("PATH", "")])
        self._log_file = self.log_path.open("ab")
        self._log_file.write(f"==== harness: starting {binary}\n".encode())
        self._log_file.flush()
        # Own session: a Ctrl-C on the test run must not hit containerd before teardown does.
        self._proc = subprocess.Popen(
            [str(binary), "--config", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=env,
            start_new_session=True,
        )
        self._wait_ready(timeout or self.start_timeout)
        if import_images and not self._images_imported:
            self.import_images()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.cri()
        client.reconnect()
        last = "no answer yet"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise HarnessError(
                    f"containerd {self.version} exited with {self._proc.returncode} during "
                    f"start-up\n{self.log_tail()}"
                )
            try:
                client.version(timeout=1.0)
                if not self.nri or self.nri_socket.exists():
                    return
                last = f"CRI is up but the NRI socket {self.nri_socket} is missing"
            except CRIError as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"containerd {self.version} not ready after {timeout} s ({last})\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)

    def import_images(self, tar: Path | None = None) -> None:
        """Import the lab images (or ``tar``) into the CRI namespace with the snapshotter CRI
        uses, so nothing is unpacked twice."""
        tar = tar or image.images_tar(self.lab)
        result = subprocess.run(
            [
                str(self.ctr), "--address", str(self.address), "-n", "k8s.io",
                "images", "import", "--snapshotter", "overlayfs", "--platform", "linux/amd64",
                str(tar),
            ],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        if result.returncode:
            raise HarnessError(
                f"ctr images import {tar} failed (exit {result.returncode}): "
                f"{result.stderr.strip()[-1500:]}\n{self.log_tail()}"
            )
        if tar == image.images_tar(self.lab):
            self._wait_until_cri_has(image.IMAGES)
        self._images_imported = True

    def _wait_until_cri_has(self, refs: Mapping[str, object], timeout: float = 10.0) -> None:
        # containerd 2.x's CRI learns of an imported image from the image store's events, a
        # moment after `ctr images import` returned: a RunPodSandbox sent at once can miss the
        # pause image and try to pull it from the (unresolvable) lab registry.
        deadline = time.monotonic() + timeout
        missing = list(refs)
        while missing:
            missing = [ref for ref in missing if not self.cri().image_known(ref)]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"CRI of containerd {self.version} does not list {missing} {timeout} s "
                    f"after they were imported\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of containerd's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            if self._last_log:  # teardown removed the file; it kept the end for reports
                text = self._last_log[-lines:]
            else:
                return f"(no containerd log at {self.log_path})"
        # Debug lines dump whole OCI specs; the head of each line is what a reader needs.
        text = [line if len(line) <= 1000 else line[:1000] + " [...]" for line in text]
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)

    def cgroup_dir(self, cgroup_path: str, controller: str = "cpuset") -> Path:
        """Host directory of a cgroupfs path (e.g. a container's cgroupsPath) in one hierarchy."""
        return host.cgroup_dir(cgroup_path, controller)

    # -- teardown --------------------------------------------------------------------------

    def __enter__(self) -> Containerd:
        if not self.running:
            try:
                self.start()
            except BaseException:
                self.teardown()  # __exit__ does not run when __enter__ raises
                raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        leftovers = self.teardown()
        if leftovers and exc is None:
            raise HarnessError("teardown left things behind:\n  " + "\n  ".join(leftovers))

    def teardown(self, timeout: float = 10.0) -> list[str]:
        """Remove everything this instance created; returns what could not be removed (empty
        when clean).  Safe to call more than once and with containerd dead or wedged."""
        # Everything running now must be gone when we return - including processes that exit
        # on their own meanwhile (shims after their last task), which lose their argv while
        # exiting and could not be recognised any more.
        tracked = {
            pid: host.start_time(pid)
            for pid in _instance_pids(self.dir, self.short_dir, self.top_cgroup)
        }
        if self.running and self._cri is not None:
            with contextlib.suppress(Exception):
                self._cri.remove_all()
        if self._cri is not None:
            self._cri.close()
        self.stop(timeout)
        with contextlib.suppress(OSError):
            self._last_log = self.log_path.read_text(errors="replace").splitlines()[-200:]
        _cleanup(self.dir, self.short_dir, self.top_cgroup, timeout)
        self._images_imported = False  # a later start() begins with an empty root again
        deadline = time.monotonic() + timeout
        while alive := [p for p, t in tracked.items() if host.is_alive(p, t)]:
            if time.monotonic() > deadline:
                return [*self.leftovers(), *(f"process {p} did not exit" for p in alive)]
            for pid in alive:  # same pid and start time: still ours
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        return self.leftovers()

    def leftovers(self) -> list[str]:
        """What of this instance still exists: processes, mounts, cgroup dirs, directories."""
        return _leftovers(self.dir, self.short_dir, self.top_cgroup)

    def processes(self) -> list[int]:
        """Pids of shims, containers and plugins belonging to this instance (not containerd)."""
        own = self.pid
        short = self.short_dir
        return [p for p in _instance_pids(self.dir, short, self.top_cgroup) if p != own]


def reap_stale(lab: Path = debs.LAB) -> list[str]:
    """Clean up instances whose owning test process is gone (a killed or crashed run): those
    in ``lab``, and those whose short directory remains (whatever lab they used).  Returns
    what could not be removed."""
    problems: list[str] = []
    for meta_file in sorted((lab / "run").glob("containerd-*/instance.json")):
        try:
            meta = json.loads(meta_file.read_text())
            pid, started = meta["owner"]
        except (OSError, ValueError, KeyError):
            continue
        if host.start_time(pid) == started:
            continue  # its owner still runs (maybe a parallel test session)
        # Older records name the directory holding the sockets "socket_dir".
        short = Path(meta.get("short_dir") or meta.get("socket_dir") or meta_file.parent)
        problems += _reap(meta_file.parent, short, f"/nri-e2e-{meta['token']}")
    problems += reap_short_dirs("containerd")
    return problems


def reap_short_dirs(*kinds: str) -> list[str]:
    """Clean up after instances of ``kinds`` whose owner died, found by their short private
    directories: also when their lab directory is gone or belongs to another checkout.
    Session directories (the interpreter link) of dead test processes go too."""
    problems: list[str] = []
    for short, record in shortpaths.stale(*kinds):
        inst = Path(record.get("instance", short))
        problems += _reap(inst, short, record["top"]) if "top" in record else []
    return problems + shortpaths.reap_sessions()


def _reap(inst: Path, short: Path, top: str) -> list[str]:
    _cleanup(inst, short, top, 10.0)
    return _leftovers(inst, short, top)


# ---------------------------------------------------------------------------------------------
# Process, mount and cgroup plumbing (module level so reap_stale can use it without an object)


def _ancestors() -> set[int]:
    """This process and its ancestors: never candidates for killing, whatever their argv."""
    found, pid = {os.getpid()}, os.getppid()
    with contextlib.suppress(OSError, ValueError):
        while pid > 1 and pid not in found:
            found.add(pid)
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    return found


def _in_cgroup_tree(pid: int, top: str) -> bool:
    try:
        paths = host.proc_cgroups(pid).values()
    except OSError:
        return False
    return any(p == top or p.startswith(f"{top}/") for p in paths)


def _instance_pids(inst: Path, short: Path, top: str) -> list[int]:
    """Live processes of an instance: in a cgroup under ``top`` in any hierarchy (containers,
    pause), or with the instance or short directory on the command line (containerd, shims,
    runc, runtime-launched NRI plugins).  Never this process or its ancestors."""
    exclude = _ancestors()
    needles = [f"{inst}/".encode(), f"{short}/".encode()]
    found = []
    for pid in host.pids():
        if pid in exclude:
            continue
        argv = host.cmdline(pid)
        if not argv:
            continue  # kernel thread, zombie or gone: nothing to kill
        if any(n in argv for n in needles) or _in_cgroup_tree(pid, top):
            found.append(pid)
    return found


def _describe(pid: int) -> str:
    return host.cmdline(pid).replace(b"\0", b" ").decode(errors="replace").strip()[:300]


def _kill_instance_processes(inst: Path, short: Path, top: str, timeout: float) -> None:
    """SIGKILL (by pid) until none is left; processes may fork or exit meanwhile, so rescan."""
    deadline = time.monotonic() + timeout
    sockets: set[str] = set()
    killed: dict[int, int | None] = {}
    while pids := _instance_pids(inst, short, top):
        for pid in pids:
            if b"containerd-shim" in host.cmdline(pid):
                # A SIGKILLed shim leaves its socket in /run/containerd/s; note it first.
                sockets.update(
                    s for s in host.unix_socket_paths(pid) if host.is_under(s, _SHIM_SOCKET_DIR)
                )
            killed.setdefault(pid, host.start_time(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # A killed process leaves its cgroup and loses its argv before it is really gone: a pid
    # namespace's init, for one, lingers until every member is reaped, and members whose shim
    # died are reaped by PID 1 at its own pace.  Wait, so that "gone" means gone.
    while any(host.is_alive(p, t) for p, t in killed.items()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in sockets:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _umount_all(*roots: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(5):  # stacked mounts may need several passes
        points = host.mounts_under(*roots)
        if not points:
            return
        for point in reversed(points):  # newest first: children before parents
            if libc.umount2(point.encode(), 0) != 0 and ctypes.get_errno() != errno.EINVAL:
                libc.umount2(point.encode(), _MNT_DETACH)  # busy: detach lazily


def _cgroup_dirs(top: str) -> list[Path]:
    """Every directory of the ``top`` tree in every hierarchy, deepest first."""
    dirs = []
    for root in sorted(set(host.cgroup_hierarchies().values())):
        base = root / top.lstrip("/")
        if base.exists():
            dirs += [Path(d) for d, _, _ in os.walk(base)]
    return sorted(dirs, key=lambda d: -len(d.parts))


def _rmdir_cgroups(top: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while dirs := _cgroup_dirs(top):
        for d in dirs:  # children first: a cgroup with children cannot be removed
            with contextlib.suppress(OSError):
                d.rmdir()
        if time.monotonic() > deadline:
            return
        if _cgroup_dirs(top):
            time.sleep(0.05)  # tasks still exiting keep a cgroup busy for a moment


def _cleanup(inst: Path, short: Path, top: str, timeout: float) -> None:
    _kill_instance_processes(inst, short, top, timeout)
    _umount_all(inst, short)
    _rmdir_cgroups(top, timeout)
    for d in {inst, short}:
        if d.exists() and not host.mounts_under(d):  # never rmtree through a mount
            shutil.rmtree(d, ignore_errors=True)
    # containerd always creates /run/containerd/s for shim sockets.  Remove the directories once
    # empty, but not while any other containerd (another harness instance, maybe with another
    # lab directory) could be about to put a socket there.
    if not any(inst.parent.glob("containerd-*")) and not _any_containerd_running():
        for d in (_SHIM_SOCKET_DIR, _SHIM_SOCKET_DIR.parent):
            with contextlib.suppress(OSError):
                d.rmdir()  # only succeeds when empty: a host containerd's files stay


def _any_containerd_running() -> bool:
    for pid in host.pids():
        argv0 = host.cmdline(pid).split(b"\0", 1)[0]
        if os.path.basename(argv0).startswith(b"containerd"):
            return True
    return False


def _leftovers(inst: Path, short: Path, top: str) -> list[str]:
    problems = [f"process {p}: {_describe(p)}" for p in _instance_pids(inst, short, top)]
    problems += [f"mount {p}" for p in host.mounts_under(inst, short)]
    problems += [f"cgroup {d}" for d in _cgroup_dirs(top)]
    problems += [f"directory {d}" for d in sorted({inst, short}) if d.exists()]
    return problems
