"""The container runtimes of the guest node, configured as on a production node: systemd
services, the systemd cgroup driver, NRI on, one NRI socket (``/var/run/nri/nri.sock``, the
path packaging/ uses) - and one runtime at a time, as a node has one.

* containerd 2.3.4 (the release tarball from the shared runtimes directory, tarballs.py) and
  containerd 1.7.24 (the pinned trixie package), each with runc 1.1.5 from the image,
  ``SystemdCgroup = true``;
* CRI-O 1.36.3 (the shared build, crio.py) with ``cgroup_manager = "systemd"``, conmon 2.1.6
  and runc from the image, overlay storage in /var/lib/containers.

On the trixie guest (guest_image.TRIXIE) the same units run runc 1.3.6 from the lab
(packages.RUNC_13) instead of the image's, and CRI-O runs trixie's crun 1.21 by default (with
trixie's conmon 2.1.12), as CRI-O does on Fedora, RHEL and OpenShift: :func:`for_recipe`.

Their binaries stay in the lab, which the guest sees read-only at the host's path, so a unit
names them where the host unpacked them.  What the host harness needs only because its host is
not a node (private top cgroups, short socket directories, the oom_score_adj wrapper, vfs
storage, copyimg in a private mount namespace) is not needed here: the guest is root on its
own machine.  What stays: no CNI configuration (pods use the host network), no registry (the
lab's images are imported), ``disable_hostport_mapping`` and no irqbalance for CRI-O (the image
has neither iptables nor irqbalance).

Each runtime's unit ``Conflicts=`` with the others, so starting one stops whichever ran.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cri, crio, debs, guest_image, image, tarballs
from .containerd import _duration, _toml
from .packages import CONTAINERD_17, CONTAINERD_23, RUNC_13

NRI_SOCKET = "/var/run/nri/nri.sock"
RUNC = "/usr/sbin/runc"  # bookworm's 1.1.5, pinned in the image (guest_image.py)
CRUN = "/usr/bin/crun"  # trixie's 1.21, pinned in that image
# The first line of ``runc --version`` of each guest's runc (the smoke test checks it).
RUNC_RELEASE = {"bookworm": "runc version 1.1.5", "trixie": "runc version 1.3.6"}
CONMON = "/usr/bin/conmon"
CONFIG_DIR = "/etc/nri-guest"
UNIT_DIR = "/etc/systemd/system"
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The project's OCI hook on the crio-hooks node: hooks/*.json in this directory name the hook
# program where packaging installs it; guest_node.py writes that program (a launcher of the
# shared checkout's code).
HOOKS_DIR = "/etc/containers/oci/hooks.d"
HOOK_PROGRAM = "/usr/local/bin/nri-cpuplugin-hook"


@dataclass(frozen=True)
class NRITimeouts:
    """The runtime's NRI timeouts: a plugin must register within ``registration`` seconds
    and answer each request within ``request``."""

    registration: float = 5.0
    request: float = 2.0


# Under TCG every guest CPU runs about 10x slower than the host's, and other test runs may
# load the host further: the runtimes' defaults (5 s / 2 s, containerd's and CRI-O's) are
# raised 12x / 10x so that a slow moment of the emulation does not make the runtime drop the
# plugin.  (With 6 s, a host at load 9 - two other test runs beside the guest - once starved
# the guest long enough for containerd to drop the plugin while a pod was created, and the
# pod started unpinned.)  The daemon's own request budget (1.5 s, its deadline) is unchanged
# and still answers first whenever it gets the CPU; only the runtime's guard behind it is
# wider.
EMULATED_NRI_TIMEOUTS = NRITimeouts(registration=60.0, request=20.0)


@dataclass(frozen=True)
class GuestRuntime:
    """One runtime as the guest runs it."""

    name: str  # e.g. "containerd-2.3": the unit is <name>.service
    release: str
    cri_socket: str
    files: Mapping[str, str]  # guest path -> content (configs and the unit)
    # Commands that put the lab's images into the runtime's store; ``images_while_running``:
    # they talk to the running runtime (containerd) rather than to its storage (CRI-O).
    import_images: tuple[tuple[str, ...], ...] = ()
    images_while_running: bool = True
    nri: bool = True  # False: NRI off, the project's OCI hook places containers (crio-hooks)

    @property
    def unit(self) -> str:
        return f"{self.name}.service"


@dataclass(frozen=True)
class OCIRuntimes:
    """The OCI runtimes a guest's runtimes run: ``runc`` for containerd (and CRI-O when
    ``crun`` is None), ``crun`` for CRI-O."""

    runc: str = RUNC
    crun: str | None = None


def for_recipe(recipe: guest_image.Recipe, lab: Path = debs.LAB) -> OCIRuntimes:
    """The OCI runtimes of the guest built from ``recipe``."""
    if recipe.suite == "trixie":
        return OCIRuntimes(runc=str(debs.unpack(RUNC_13, lab) / "usr/sbin/runc"), crun=CRUN)
    return OCIRuntimes()


def prepare(lab: Path = debs.LAB) -> None:
    """Everything the guest reads from the lab, made on the host before the guest boots (the
    guest sees the lab read-only): binaries unpacked and checked, images, CRI stubs."""
    debs.unpack(RUNC_13, lab)
    tarballs.unpack(CONTAINERD_23, lab)
    debs.unpack(CONTAINERD_17, lab)
    crio.binaries(lab)
    image.images_tar(lab)
    crio.oci_layout(lab)
    cri.stubs(lab)


def runtimes(
    lab: Path = debs.LAB, nri: NRITimeouts | None = None, runc: str = RUNC, crun: str | None = None
) -> dict[str, GuestRuntime]:
    """The three runtimes by name, their binaries at the lab paths :func:`prepare` made.
    ``runc``: the program the runtimes run as runc (a newer release, or a benchmark's counting
    wrapper); ``crun``: CRI-O's default runtime instead of runc."""
    nri = nri or NRITimeouts()
    oci = OCIRuntimes(runc, crun)
    made = [
        _containerd("2.3", "2.3.4", tarballs.unpack(CONTAINERD_23, lab) / "bin", lab, nri, runc),
        _containerd("1.7", "1.7.24", debs.unpack(CONTAINERD_17, lab) / "usr/bin", lab, nri, runc),
        _crio(lab, nri, oci),
        _crio(lab, nri, oci, hooks=True),
    ]
    names = [r.name for r in made]
    return {r.name: _with_unit_conflicts(r, names) for r in made}


def _with_unit_conflicts(runtime: GuestRuntime, names: list[str]) -> GuestRuntime:
    others = " ".join(f"{n}.service" for n in names if n != runtime.name)
    unit_path = f"{UNIT_DIR}/{runtime.unit}"
    files = dict(runtime.files)
    files[unit_path] = files[unit_path].replace("@CONFLICTS@", others)
    return GuestRuntime(
        runtime.name,
        runtime.release,
        runtime.cri_socket,
        files,
        runtime.import_images,
        runtime.images_while_running,
        runtime.nri,
    )


def _nri_table(nri: NRITimeouts) -> dict[str, Any]:
    return {
        "disable": False,
        "disable_connections": False,
        "socket_path": NRI_SOCKET,
        "plugin_path": "/opt/nri/plugins",
        "plugin_config_path": "/etc/nri/conf.d",
        "plugin_registration_timeout": _duration(nri.registration),
        "plugin_request_timeout": _duration(nri.request),
    }


def _containerd(
    minor: str, release: str, bin_dir: Path, lab: Path, nri: NRITimeouts, runc_binary: str
) -> GuestRuntime:
    name = f"containerd-{minor}"
    state = f"/run/{name}"
    socket = f"{state}/containerd.sock"
    config_path = f"{CONFIG_DIR}/{name}/config.toml"
    runc = {
        "runtime_type": "io.containerd.runc.v2",
        # The systemd cgroup driver: each container a scope in its pod's slice.
        "options": {"BinaryName": runc_binary, "SystemdCgroup": True},
    }
    common: dict[str, Any] = {
        "root": f"/var/lib/{name}",
        "state": state,
        "grpc": {"address": socket},
        "ttrpc": {"address": f"{socket}.ttrpc"},
        # containerd gives the shim 2 s to report a task's state (`runc state`, a fork and exec
        # of a Go binary): under emulation, on a loaded guest, that ran out once in CI and
        # failed a StopContainer with "failed to get task ...: context deadline exceeded".
        "timeouts": {"io.containerd.timeout.task.state": "30s"},
    }
    if minor == "1.7":
        config: dict[str, Any] = {
            "version": 2,
            **common,
            "plugins": {
                "io.containerd.grpc.v1.cri": {
                    "sandbox_image": image.PAUSE_IMAGE,
                    "containerd": {
                        "snapshotter": "overlayfs",
                        "default_runtime_name": "runc",
                        "runtimes": {"runc": runc},
                    },
                },
                "io.containerd.nri.v1.nri": _nri_table(nri),
            },
        }
    else:
        config = {
            "version": 3,
            # 2.3 imports /etc/containerd/conf.d/*.toml unless told otherwise.
            "imports": [],
            **common,
            "plugins": {
                "io.containerd.cri.v1.images": {
                    "snapshotter": "overlayfs",
                    "pinned_images": {"sandbox": image.PAUSE_IMAGE},
                },
                "io.containerd.cri.v1.runtime": {
                    "containerd": {"default_runtime_name": "runc", "runtimes": {"runc": runc}},
                },
                "io.containerd.nri.v1.nri": _nri_table(nri),
            },
        }
    # As containerd's own unit: the shims and containers outlive a restart (KillMode=process),
    # the runtime manages its own cgroup subtree (Delegate=yes).
    unit = f"""\
# Written by tests/harness/guest_runtimes.py: containerd {release} on the guest node.
[Unit]
Description=containerd {release} (nri-cpuplugin guest node)
After=local-fs.target dbus.service
Conflicts=@CONFLICTS@

[Service]
Environment=PATH={bin_dir}:{SERVICE_PATH}
ExecStartPre=-/sbin/modprobe overlay
ExecStart={bin_dir}/containerd --config {config_path}
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999
"""
    ctr_import = (str(bin_dir / "ctr"), "--address", socket, "-n", "k8s.io", "images", "import")
    return GuestRuntime(
        name,
        release,
        socket,
        {config_path: _toml(config), f"{UNIT_DIR}/{name}.service": unit},
        import_images=((*ctr_import, "--platform", "linux/amd64", str(image.images_tar(lab))),),
    )


def _crio(lab: Path, nri: NRITimeouts, oci: OCIRuntimes, hooks: bool = False) -> GuestRuntime:
    """CRI-O with NRI on (``crio``), or with NRI off and the project's OCI hook in hooks.d
    (``crio-hooks``: packaging/crio/10-nri-cpuplugin-hooks.conf's mode).  Both use the same
    storage and sockets: one of them runs at a time."""
    name = "crio-hooks" if hooks else "crio"
    binaries = crio.binaries(lab)
    config_path = f"{CONFIG_DIR}/{name}/crio.conf"
    socket = "/var/run/crio/crio.sock"
    storage = {"driver": "overlay", "graphroot": "/var/lib/containers/storage"}
    storage["runroot"] = "/run/containers/storage"
    oci_runtimes = {
        "runc": {
            "runtime_path": oci.runc,
            "runtime_type": "oci",
            "runtime_root": "/run/runc",
            "monitor_path": CONMON,
            # conmon in a scope of the pod's slice, as on a node
            "monitor_cgroup": "pod",
        }
    }
    if oci.crun is not None:
        oci_runtimes["crun"] = {**oci_runtimes["runc"], "runtime_path": oci.crun}
        oci_runtimes["crun"]["runtime_root"] = "/run/crun"
    config = {
        "crio": {
            "root": storage["graphroot"],
            "runroot": storage["runroot"],
            "storage_driver": "overlay",
            "api": {"listen": socket},
            "runtime": {
                "cgroup_manager": "systemd",
                "default_runtime": "runc" if oci.crun is None else "crun",
                "pinns_path": str(binaries / "pinns"),
                "log_level": "info",
                # Neither iptables/nft nor irqbalance in the image.
                "disable_hostport_mapping": True,
                "irqbalance_config_file": "",
                "irqbalance_config_restore_file": "disable",
                "runtimes": oci_runtimes,
            },
            "image": {
                "pause_image": image.PAUSE_IMAGE,
                "pause_command": "",  # the lab's pause image is a shell, not /pause
                "signature_policy": "/etc/containers/policy.json",
            },
            "nri": {
                "enable_nri": not hooks,
                "nri_listen": NRI_SOCKET,
                "nri_plugin_dir": "/opt/nri/plugins",
                "nri_plugin_config_dir": "/etc/nri/conf.d",
                "nri_plugin_registration_timeout": _duration(nri.registration),
                "nri_plugin_request_timeout": _duration(nri.request),
            },
        }
    }
    if hooks:
        config["crio"]["runtime"]["hooks_dir"] = [HOOKS_DIR]
    mode = "the OCI hook, NRI off" if hooks else "NRI"
    unit = f"""\
# Written by tests/harness/guest_runtimes.py: CRI-O {crio.VERSION} on the guest node.
[Unit]
Description=CRI-O {crio.VERSION} with {mode}, {"runc" if oci.crun is None else "crun"} \
(nri-cpuplugin guest node)
After=local-fs.target dbus.service
Conflicts=@CONFLICTS@

[Service]
Environment=PATH={binaries}:{SERVICE_PATH}
ExecStart={binaries}/crio --config {config_path}
Type=notify
KillMode=process
Restart=on-failure
RestartSec=5
LimitNOFILE=1048576
LimitNPROC=1048576
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999
TimeoutStartSec=0
"""
    layout = crio.oci_layout(lab)
    store = ("--root", storage["graphroot"], "--runroot", storage["runroot"])
    store += ("--storage-driver", "overlay", "--signature-policy", "/etc/containers/policy.json")
    copyimg = (str(binaries / "copyimg"), *store)
    imports = tuple(
        (*copyimg, "--image-name", image_name, "--import-from", f"oci:{layout}:{ref}")
        for image_name, ref in crio.OCI_REFS.items()
    )
    files = {
        **(_hook_files() if hooks else {}),
        config_path: _toml(config),
        f"{UNIT_DIR}/{name}.service": unit,
        "/etc/containers/policy.json": json.dumps(
            {"default": [{"type": "insecureAcceptAnything"}]}
        ),
        "/etc/containers/registries.conf": "unqualified-search-registries = []\n",
        "/etc/containers/storage.conf": _toml({"storage": storage}),
    }
    return GuestRuntime(
        name,
        crio.VERSION,
        socket,
        files,
        import_images=imports,
        images_while_running=False,
        nri=not hooks,
    )


def _hook_files() -> dict[str, str]:
    """hooks/*.json as packaging ships them (they name :data:`HOOK_PROGRAM` already)."""
    files = {}
    for source in sorted((debs.REPO / "hooks").glob("*.json")):
        entry = json.loads(source.read_text())
        if entry["hook"]["path"] != HOOK_PROGRAM:
            raise ValueError(f"{source} runs {entry['hook']['path']}, not {HOOK_PROGRAM}")
        files[f"{HOOKS_DIR}/{source.name}"] = source.read_text()
    return files
