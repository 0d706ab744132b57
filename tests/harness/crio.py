"""A private, disposable CRI-O 1.36.3 (NRI 0.11) for the e2e tests, beside the containerd ones.

Debian ships no CRI-O, so the binaries (``crio``, ``pinns``, ``copyimg``) come from the runtime
lab's tarball next to the checkout (``../shared/runtimes/cri-o/``, or ``NRI_CRIO_DIST``), checked
against pinned SHA256 sums - the tarball's and each binary's - before they are unpacked into the
lab cache.  Everything else is Debian's: conmon 2.1.6 and runc 1.1.5 from bookworm (or crun
1.8.1 as the default runtime handler, ``runtime="crun"``: harness/crun.py).

Each :class:`Crio` owns:

* an instance directory ``<lab>/run/crio-<token>/``: crio.conf, storage.conf, registries.conf,
  policy.json, the image and container storage (``vfs``: no overlay mounts), pod logs,
  ``hooks.d``, the NRI plugin and plugin-config directories, the runtime wrapper and
  ``crio.log``;
* a short private directory ``/run/nri-crio-<token>/`` (``shortpaths.py``) for what a long
  checkout path would break: the CRI and NRI sockets (108-byte ``sun_path``), the runroot (the
  bundles, conmon's attach sockets), the OCI runtime's state root, the namespaces pinns pins,
  the exit files and the version file;
* a private top cgroup ``/nri-crio-<token>``: with the cgroupfs manager every pod cgroup, every
  container's ``crio-<id>`` and every conmon (``conmon_cgroup = "pod"``) is below it.

Three workarounds this host needs (each was tried, see ../shared/runtimes/cri-o/README.md):

1. No CAP_SYS_RESOURCE: runc cannot lower ``oom_score_adj`` (kubelet asks -997 for Guaranteed
   containers, CRI-O -998 for infra containers).  ``runtime_path`` names a small wrapper that,
   for ``runc create`` only, raises ``process.oomScoreAdj`` in the bundle's config.json to its
   own value, then execs runc - the same clamp containerd's ``restrict_oom_score_adj`` makes.
2. No iptables/nft and no irqbalance: ``disable_hostport_mapping`` and the two irqbalance
   settings, or CRI-O does not start.
3. No registry: the lab's busybox and pause images are imported with ``copyimg`` into CRI-O's
   storage before it starts; CRI requests carry ``user_specified_image`` (harness/cri.py).

Teardown (:meth:`Crio.teardown`, the context manager and :func:`reap_stale`) is containerd's
(harness/containerd.py): CRI removal first, then CRI-O by pid, then every process found by its
cgroup under the top cgroup or a directory of the instance on its command line (conmon, runc,
containers), then every mount below both directories (shm, pinned namespaces), then the cgroup
tree in every hierarchy, then both directories.  Processes are only ever signalled by pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import crun, debs, host, image, shortpaths
from .containerd import (
    HarnessError,
    _cleanup,
    _duration,
    _instance_pids,
    _leftovers,
    _merge,
    _toml,
    reap_short_dirs,
)
from .cri import CRIClient, CRIError
from .packages import CONMON, RUNC
from .runtime_process import RuntimeProcess
from .tarballs import SHARED

VERSION = "1.36.3"
NRI_VERSION = "0.11.0"
# Where the runtime lab keeps CRI-O for these machines: next to the checkout (or next to the
# checkout this one was cloned from, tarballs.SHARED).
DIST = Path(os.environ.get("NRI_CRIO_DIST", SHARED / "cri-o"))
TARBALL = (
    f"crio-{VERSION}-linux-amd64.tar.gz",
    "a814d58c232e277a0a23dba51f215645cc6b043a1bc35a1d2182ad219986e841",
)
SOURCE = (
    f"cri-o-{VERSION}-src.tar.gz",
    "ba516607443c63ccf4e355ffcb1892b20cfd0e8d011be2c4cd843669f73dcb36",
)
BINARIES = {
    "crio": "389ef59cf9717c2a72f70a2935ab9e68b1e287a40a72eb0c3664b4007e2a0a9e",
    "pinns": "c3ccdb9152f62c3d7e8fa10dd8eab406e2952ef244f47e085db36e131b4b3def",
    "copyimg": "574d2a9941b7d3ea35c4c7f92358e6d9cfff66d075ae5f9e2510b46b08f1597f",
}
# NRI's schema as CRI-O 1.36.3 vendors it (tests/system/test_api_proto.py compares ours).
NRI_API_PROTO = f"cri-o-{VERSION}/vendor/github.com/containerd/nri/pkg/api/api.proto"
# Short names under which the lab images are referenced inside the OCI layout for copyimg.
OCI_REFS = {image.PAUSE_IMAGE: "pause", image.BUSYBOX_IMAGE: "busybox"}

# The runc wrapper (workaround 1).  Plain sh and sed: it runs for every runc call CRI-O and
# conmon make, so it must cost next to nothing; only `create` touches the bundle.  Global
# options that take a value are skipped so that their value is never taken for the command.
_RUNC_WRAPPER = r"""#!/bin/sh
# Written by tests/harness/crio.py: runc with oom_score_adj clamped to what this host allows.
runc=__RUNC__
bundle=.
command=
skip=
previous=
for arg in "$@"; do
  if [ -n "$skip" ]; then skip=; previous=$arg; continue; fi
  case "$previous" in --bundle|-b) bundle=$arg ;; esac
  case "$arg" in
    --bundle=*) bundle=${arg#--bundle=} ;;
    --root|--log|--log-format|--criu|--rootless) [ -z "$command" ] && skip=1 ;;
    -*) ;;
    *) [ -z "$command" ] && command=$arg ;;
  esac
  previous=$arg
done
if [ "$command" = create ] && [ -f "$bundle/config.json" ]; then
  own=$(cat /proc/self/oom_score_adj)
  value='"oomScoreAdj":[[:space:]]*\(-\{0,1\}[0-9]\{1,\}\)'
  want=$(sed -n "s/.*$value.*/\1/p" "$bundle/config.json")
  if [ -n "$want" ] && [ "$want" -lt "$own" ]; then
    sed -i "s/\(\"oomScoreAdj\":[[:space:]]*\)-\{0,1\}[0-9]\{1,\}/\1$own/" "$bundle/config.json"
  fi
fi
exec "$runc" "$@"
"""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(name: str, sha256: str) -> Path:
    path = DIST / name
    if not path.is_file():
        raise HarnessError(
            f"{path} is missing: the CRI-O tests use the runtime lab's build of CRI-O {VERSION} "
            "(set NRI_CRIO_DIST to the directory holding it)"
        )
    actual = _sha256(path)
    if actual != sha256:
        raise HarnessError(f"{path}: SHA256 {actual} does not match the pinned {sha256}")
    return path


def binaries(lab: Path = debs.LAB) -> Path:
    """The directory holding ``crio``, ``pinns`` and ``copyimg`` (unpacked and verified once)."""
    target = lab / "pkgs" / f"cri-o_{VERSION}"
    if (target / ".unpacked").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".crio.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".unpacked").exists():
            return target
        tarball = _verified(*TARBALL)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        with tarfile.open(tarball) as tar:
            for name in BINARIES:
                member = tar.getmember(name)
                if not member.isfile():
                    raise HarnessError(f"{tarball}: {name} is not a regular file")
                source = tar.extractfile(member)
                assert source is not None
                (partial / name).write_bytes(source.read())
                (partial / name).chmod(0o755)
        for name, sha256 in BINARIES.items():
            if (actual := _sha256(partial / name)) != sha256:
                raise HarnessError(f"{tarball}: {name} has SHA256 {actual}, pinned {sha256}")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        (target / ".unpacked").touch()
    return target


def nri_api_proto(lab: Path = debs.LAB) -> Path:
    """NRI 0.11's ``pkg/api/api.proto`` from the CRI-O source tarball's vendor tree (once)."""
    target = lab / "pkgs" / f"cri-o-src_{VERSION}" / "api.proto"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(_verified(*SOURCE)) as tar:
        source = tar.extractfile(NRI_API_PROTO)
        if source is None:
            raise HarnessError(f"{SOURCE[0]} has no {NRI_API_PROTO}")
        partial = target.with_suffix(".partial")
        partial.write_bytes(source.read())
        partial.rename(target)
    return target


def oci_layout(lab: Path = debs.LAB) -> Path:
    """The lab images as an OCI layout directory for ``copyimg --import-from oci:DIR:REF``.

    The shared tarball names both images by tag (``1``) in ``org.opencontainers.image.ref.name``;
    copyimg picks an image by that annotation, so here each gets a name of its own."""
    tar = image.images_tar(lab)
    target = tar.parent / "crio-oci"
    if (target / ".done").exists():
        return target
    with (tar.parent / ".crio-oci.lock").open("w") as lock:  # parallel workers share it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".done").exists():
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        with tarfile.open(tar) as archive:
            archive.extractall(partial, filter="data")
        index = json.loads((partial / "index.json").read_text())
        for manifest in index["manifests"]:
            name = manifest["annotations"]["io.containerd.image.name"]
            manifest["annotations"]["org.opencontainers.image.ref.name"] = OCI_REFS[name]
        (partial / "index.json").write_text(json.dumps(index))
        (partial / ".done").touch()
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    return target


def prepare(lab: Path = debs.LAB) -> None:
    """Everything slow, once: CRI-O verified and unpacked, conmon and runc, the images."""
    binaries(lab)
    debs.unpack(CONMON, lab)
    debs.unpack(RUNC, lab)
    oci_layout(lab)


class Crio(RuntimeProcess):
    """One private CRI-O.  ``with Crio() as crio:`` starts it and guarantees teardown;
    ``crio.cri()`` is the CRI client (the same one the containerd tests use).

    ``nri``: NRI on (external plugins connect to :attr:`nri_socket`; executables ``NN-name`` in
    :attr:`plugin_path` are launched by CRI-O at start, configs in :attr:`plugin_config_path`).
    Hooks go into :attr:`hooks_dir` through :meth:`install_hook` (CRI-O watches the directory).
    ``config_overrides`` is merged into :meth:`config`, e.g. a second runtime handler.
    ``runtime``: the default handler's OCI runtime, ``runc`` (handler ``runc``) or ``crun``
    (handler ``crun``, as on Fedora, RHEL and OpenShift; harness/crun.py).
    """

    def __init__(
        self,
        *,
        lab: Path = debs.LAB,
        nri: bool = True,
        plugin_registration_timeout: float | str = 5.0,
        plugin_request_timeout: float | str = 2.0,
        log_level: str = "debug",
        start_timeout: float = 30.0,
        config_overrides: Mapping[str, Any] | None = None,
        token: str | None = None,
        runtime: str = "runc",
    ) -> None:
        self.version = VERSION
        self.runtime = crun.check_runtime(runtime)
        self.lab = Path(lab)
        self.nri = nri
        self.plugin_registration_timeout = plugin_registration_timeout
        self.plugin_request_timeout = plugin_request_timeout
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.config_overrides = dict(config_overrides or {})
        self.token = token or secrets.token_hex(4)
        self.dir = self.lab / "run" / f"crio-{self.token}"
        self.top_cgroup = f"/nri-crio-{self.token}"
        self.short_dir = shortpaths.path_for("crio", self.token)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._cri: CRIClient | None = None
        self._images_imported = False
        self._last_log: list[str] = []

    # -- paths -----------------------------------------------------------------------------

    @property
    def address(self) -> Path:
        return self.short_dir / "crio.sock"

    @property
    def nri_socket(self) -> Path:
        return self.short_dir / "nri.sock"

    @property
    def runroot(self) -> Path:
        return self.short_dir / "runroot"

    @property
    def root(self) -> Path:
        return self.dir / "storage"

    @property
    def hooks_dir(self) -> Path:
        return self.dir / "hooks.d"

    @property
    def plugin_path(self) -> Path:
        return self.dir / "nri" / "plugins"

    @property
    def plugin_config_path(self) -> Path:
        return self.dir / "nri" / "conf.d"

    @property
    def config_path(self) -> Path:
        return self.dir / "crio.conf"

    @property
    def config_dir(self) -> Path:
        """Drop-ins (``--config-dir``, /etc/crio/crio.conf.d on a node), read after the main
        config in name order; keys they set win, lists included."""
        return self.dir / "crio.conf.d"

    @property
    def log_path(self) -> Path:
        return self.dir / "crio.log"

    @property
    def binary(self) -> Path:
        return binaries(self.lab) / "crio"

    @property
    def runc(self) -> Path:
        return debs.unpack(RUNC, self.lab) / "usr/sbin/runc"

    @property
    def runtime_root(self) -> Path:
        """The OCI runtime's state root (``runtime_root``: its ``--root``)."""
        return self.short_dir / self.runtime

    @property
    def runtime_wrapper(self) -> Path:
        """The handler's ``runtime_path``: the oom_score_adj clamp (workaround 1) around runc,
        or around the crun wrapper."""
        return self.dir / "bin" / self.runtime

    @property
    def crun_wrapper(self) -> Path:
        return self.dir / "bin" / "crun-1.8.1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    # -- config ----------------------------------------------------------------------------

    def _storage_env(self) -> dict[str, str]:
        return {
            "CONTAINERS_STORAGE_CONF": str(self.dir / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(self.dir / "registries.conf"),
        }

    def config(self) -> dict[str, Any]:
        """The CRI-O configuration as a dict (written as TOML by :meth:`start`)."""
        d, s = self.dir, self.short_dir
        conmon = debs.unpack(CONMON, self.lab) / "usr/bin/conmon"
        base: dict[str, Any] = {
            "crio": {
                "root": self.root,
                "runroot": self.runroot,
                "storage_driver": "vfs",  # no overlay mounts, nothing for the page-size limit
                "log_dir": d / "pod-logs",
                "version_file": s / "version",  # a missing one means "rebooted": wipe all
                "version_file_persist": d / "version-persist",
                "clean_shutdown_file": d / "clean.shutdown",
                "api": {"listen": self.address},
                "runtime": {
                    "cgroup_manager": "cgroupfs",  # no systemd as PID 1 here
                    "conmon_cgroup": "pod",
                    "default_runtime": self.runtime,
                    "hooks_dir": [self.hooks_dir],
                    "log_level": self.log_level,
                    "drop_infra_ctr": True,
                    "pinns_path": binaries(self.lab) / "pinns",
                    "namespaces_dir": s / "ns",
                    "container_exits_dir": s / "exits",
                    "container_attach_socket_dir": s,
                    "cdi_spec_dirs": [d / "cdi"],
                    # Neither iptables/nft nor irqbalance here (workaround 2).
                    "disable_hostport_mapping": True,
                    "irqbalance_config_file": "",
                    "irqbalance_config_restore_file": "disable",
                    "runtimes": {
                        self.runtime: {
                            "runtime_path": self.runtime_wrapper,
                            "runtime_type": "oci",
                            "runtime_root": self.runtime_root,
                            "monitor_path": conmon,
                            "monitor_cgroup": "pod",
                        }
                    },
                },
                "image": {
                    "pause_image": image.PAUSE_IMAGE,
                    "pause_command": "",  # empty: the image's own command (no /pause in it)
                    "signature_policy": d / "policy.json",
                    "signature_policy_dir": d / "policies",
                    "namespaced_auth_dir": d / "auth",
                },
                "network": {"network_dir": d / "cni/net.d", "plugin_dirs": [d / "cni/bin"]},
                "nri": {
                    "enable_nri": self.nri,
                    "nri_listen": self.nri_socket,
                    "nri_plugin_dir": self.plugin_path,
                    "nri_plugin_config_dir": self.plugin_config_path,
                    "nri_plugin_registration_timeout": _duration(self.plugin_registration_timeout),
                    "nri_plugin_request_timeout": _duration(self.plugin_request_timeout),
                },
            }
        }
        if self.runtime == "crun":
            # crun 1.8.1 writes CRI-O's default -1 ("no limit") into pids.max literally, which
            # the kernel refuses (EINVAL): 0 is the same "no limit" in a form it writes as max.
            base["crio"]["runtime"]["pids_limit"] = 0
        return _merge(base, self.config_overrides)

    def _prepare(self) -> None:
        for sub in ("pod-logs", "logs", "cni/net.d", "cni/bin", "cdi", "policies", "auth", "bin"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        for sub in (self.hooks_dir, self.plugin_path, self.plugin_config_path, self.config_dir):
            sub.mkdir(parents=True, exist_ok=True)
        shortpaths.ensure("crio", self.short_dir, instance=self.dir, top=self.top_cgroup)
        self.runroot.mkdir(exist_ok=True)
        (self.dir / "instance.json").write_text(
            json.dumps(
                {
                    "version": VERSION,
                    "token": self.token,
                    "owner": [os.getpid(), host.start_time(os.getpid())],
                    "short_dir": str(self.short_dir),
                }
            )
        )
        (self.dir / "policy.json").write_text(
            json.dumps({"default": [{"type": "insecureAcceptAnything"}]})
        )
        (self.dir / "registries.conf").write_text("unqualified-search-registries = []\n")
        (self.dir / "storage.conf").write_text(
            _toml({"storage": {"driver": "vfs", "graphroot": self.root, "runroot": self.runroot}})
        )
        target = self.runc
        if self.runtime == "crun":
            target = crun.write_wrapper(self.crun_wrapper, self.lab)
        self.runtime_wrapper.write_text(_RUNC_WRAPPER.replace("__RUNC__", _sh_quote(target)))
        self.runtime_wrapper.chmod(0o755)
        self.config_path.write_text(_toml(self.config()))

    def import_images(self) -> None:
        """Copy the lab images into CRI-O's storage with CRI-O's own ``copyimg``."""
        layout = oci_layout(self.lab)
        copyimg = binaries(self.lab) / "copyimg"
        for name, ref in OCI_REFS.items():
            result = subprocess.run(
                [
                    # copyimg keeps a blob-info cache in /var/lib/containers/cache, a path no
                    # option moves: a private mount namespace gives it a throwaway /var/lib.
                    "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                    'mount -t tmpfs -o size=16m copyimg-var-lib /var/lib && exec "$@"', "sh",
                    str(copyimg), "--root", str(self.root), "--runroot", str(self.runroot),
                    "--storage-driver", "vfs",
                    "--signature-policy", str(self.dir / "policy.json"),
                    "--image-name", name, "--import-from", f"oci:{layout}:{ref}",
                ],
                capture_output=True, text=True, check=False, timeout=120,
                env={**os.environ, **self._storage_env()},
            )  # fmt: skip
            if result.returncode:
                raise HarnessError(
                    f"copyimg {name} failed (exit {result.returncode}): "
                    f"{(result.stderr or result.stdout).strip()[-1500:]}"
                )
        self._images_imported = True

    # -- hooks -----------------------------------------------------------------------------

    def install_hook(self, name: str, doc: Mapping[str, Any]) -> Path:
        """Put an oci-hooks(5) file into the hooks directory.  CRI-O watches it with inotify
        and logs a half-written file as a parse error, so the file is renamed into place."""
        self.hooks_dir.mkdir(parents=True, exist_ok=True)
        target = self.hooks_dir / name
        tmp = self.hooks_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.rename(target)
        return target

    def remove_hook(self, name: str) -> None:
        (self.hooks_dir / name).unlink(missing_ok=True)

    def wait_log(self, text: str, timeout: float = 10.0, since: int = 0) -> str:
        """Wait until the log (from byte ``since``) has a line containing ``text``."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(FileNotFoundError), self.log_path.open("rb") as f:
                f.seek(since)
                for line in f.read().decode(errors="replace").splitlines():
                    if text in line:
                        return line
            if time.monotonic() > deadline:
                raise TimeoutError(f"no line with {text!r} in {self.log_path} after {timeout} s")
            time.sleep(0.05)

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start CRI-O and wait until CRI answers Version (and the NRI socket exists).  On the
        first start the lab images are imported.  Raises HarnessError with the log's reason."""
        if self.running:
            raise HarnessError(f"CRI-O is already running (pid {self.pid})")
        binary = self.binary
        prepare(self.lab)
        self._prepare()
        if not self._images_imported:
            self.import_images()
        env = {
            "PATH": os.pathsep.join([str(binary.parent), "/usr/sbin:/usr/bin:/sbin:/bin"]),
            **self._storage_env(),
        }
        self._log_file = self.log_path.open("ab")
        self._log_file.write(f"==== harness: starting {binary}\n".encode())
        self._log_file.flush()
        # Own session: a Ctrl-C on the test run must not reach CRI-O before teardown does.
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=env,
            start_new_session=True,
        )
        self._wait_ready(timeout or self.start_timeout)

    def command(self, *args: str) -> list[str]:
        return [
            str(self.binary), "--config", str(self.config_path),
            "--config-dir", str(self.config_dir), *args,
        ]  # fmt: skip

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.cri()
        client.reconnect()
        last = "no answer yet"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                raise HarnessError(
                    f"CRI-O {VERSION} exited with {code} during start-up: {self.reason()}\n"
                    f"{self.log_tail()}"
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
                    f"CRI-O {VERSION} not ready after {timeout} s ({last}): {self.reason()}\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return list(self._last_log)

    def reason(self) -> str:
        """Why CRI-O says it stopped or failed: its last fatal or error line, if any."""
        for line in reversed(self._log_lines()):
            if "level=fatal" in line or "level=error" in line:
                return line[:1500]
        return "(no error in CRI-O's log)"

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of CRI-O's log, for error messages."""
        text = self._log_lines()[-lines:]
        if not text:
            return f"(no CRI-O log at {self.log_path})"
        # Debug lines dump whole configurations and specs; the head is what a reader needs.
        text = [line if len(line) <= 1000 else line[:1000] + " [...]" for line in text]
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)

    # -- teardown --------------------------------------------------------------------------

    def __enter__(self) -> Crio:
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
        when clean).  Safe to call more than once and with CRI-O dead or wedged."""
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
        if self.runtime == "crun":
            crun.remove_default_rundir()
        self._images_imported = False  # the storage went with the instance directory
        deadline = time.monotonic() + timeout
        while alive := [p for p, t in tracked.items() if host.is_alive(p, t)]:
            if time.monotonic() > deadline:
                return [*self.leftovers(), *(f"process {p} did not exit" for p in alive)]
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        return self.leftovers()

    def leftovers(self) -> list[str]:
        """What of this instance still exists: processes, mounts, cgroup dirs, directories."""
        return _leftovers(self.dir, self.short_dir, self.top_cgroup)


def _sh_quote(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def reap_stale(lab: Path = debs.LAB) -> list[str]:
    """Clean up CRI-O instances whose owning test process is gone (a killed or crashed run):
    those recorded in ``lab``, and those found by their short directories alone."""
    problems: list[str] = []
    for meta_file in sorted((lab / "run").glob("crio-*/instance.json")):
        try:
            meta = json.loads(meta_file.read_text())
            pid, started = meta["owner"]
        except (OSError, ValueError, KeyError):
            continue
        if host.start_time(pid) == started:
            continue  # its owner still runs (maybe a parallel test session)
        short = Path(meta.get("short_dir") or meta_file.parent)
        top = f"/nri-crio-{meta['token']}"
        _cleanup(meta_file.parent, short, top, 10.0)
        problems += _leftovers(meta_file.parent, short, top)
    return problems + reap_short_dirs("crio")
