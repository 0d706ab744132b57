"""packaging/: every file checked by the program that consumes it, where that program exists here.

* systemd unit: ``systemd-analyze verify`` and ``security --offline`` against a private root
  (no systemd as PID 1 needed); its command line through the real CLI parser.
* configuration files: the plugin's own loader (the same one the runtime's Configure string
  goes through).
* runtime-launched launcher: ``sh -n``, its name and mode as the runtime demands (it runs for
  real, under both containerd versions, in tests/e2e/test_packaging_e2e.py).
* CRI-O drop-ins: tomllib, against the keys and types crio.conf(5) documents (and loaded by a
  real CRI-O 1.36.3 in tests/e2e/crio/test_crio_packaging.py).
* Kubernetes manifests: the Kubernetes OpenAPI schemas of several releases, offline
  (kubernetes-validate ships them), strict about unknown fields; plus least-privilege checks.
* Dockerfile: parsed; what it copies is tracked by git; its wheel stage's pip steps are run on
  exactly the copied files, and the wheels installed and run.
* the Python package: a clean clone of HEAD is built (sdist + wheel), and each artefact and
  ``pip install .`` are installed into fresh virtual environments and run.

The containerd drop-ins are checked with ``containerd config dump`` and by running both
containerd versions in tests/e2e/test_packaging_e2e.py (they need the runtime lab and root).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from harness import host
from harness.runc import pod, sandbox
from product_image import dockerfile_steps

from nri_cpuplugin.cli import EXIT_USAGE, build_parser
from nri_cpuplugin.core.topology import discover
from nri_cpuplugin.hardware import cgroupfs
from nri_cpuplugin.ops import audit
from nri_cpuplugin.ops.config import (
    DEFAULT_STATE_DIR,
    ConfigError,
    Settings,
    load_file,
    merge,
    parse_toml,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
UNIT = PACKAGING / "systemd/nri-cpuplugin.service"
BACKOFF = PACKAGING / "systemd/nri-cpuplugin.service.d/backoff.conf"
IRQ_DROPIN = PACKAGING / "systemd/nri-cpuplugin.service.d/irq.conf"
IRQBALANCE_DROPIN = PACKAGING / "systemd/irqbalance.service.d/nri-cpuplugin.conf"
CONFIG = PACKAGING / "config.toml"
LAUNCHER = PACKAGING / "nri/10-cpuplugin"
LAUNCHED_CONF = PACKAGING / "nri/10-cpuplugin.conf"
CRIO_NRI = PACKAGING / "crio/10-nri-cpuplugin-nri.conf"
CRIO_HOOKS = PACKAGING / "crio/10-nri-cpuplugin-hooks.conf"
DAEMONSET = PACKAGING / "kubernetes/daemonset.yaml"

# Where packaging/README.md says things go.
INSTALLED_PROGRAM = "/usr/local/bin/nri-cpuplugin"
INSTALLED_CONFIG = "/etc/nri-cpuplugin/config.toml"
NRI_SOCKET = "/var/run/nri/nri.sock"
NRI_PLUGIN_DIR = "/opt/nri/plugins"
NRI_CONF_DIR = "/etc/nri/conf.d"
# Oldest and newest Kubernetes releases whose schemas the manifests must satisfy (NRI needs
# containerd >= 1.7 / CRI-O >= 1.26, i.e. clusters of 1.26 and later).
KUBERNETES_VERSIONS = ("1.26", "1.30", kubernetes_validate.latest_version())


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, **kw)


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# -- systemd -----------------------------------------------------------------------------------


def parse_unit(path: Path) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values in order, systemd style: a key may repeat; an empty assignment
    resets the list."""
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        values = out.setdefault((section, key.strip()), [])
        if value.strip():
            values.append(value.strip())
        else:
            values.clear()
    return out


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.fail(
            "systemd-analyze is missing: install Debian's 'systemd' package (it provides the "
            "analyzer and the unit files a private root needs; systemd need not run)",
            pytrace=False,
        )
    return tool


def systemd_version() -> int:
    out = run([systemd_analyze(), "--version"]).stdout
    return int(re.match(r"systemd (\d+)", out).group(1))


@pytest.fixture
def unit_root(tmp_path: Path) -> Path:
    """A private filesystem root for systemd-analyze: the distribution's unit files (for
    sysinit.target and friends), our unit where an admin puts it, and an executable where
    ExecStart points (pip's console script)."""
    units = Path("/lib/systemd/system")
    if not (units / "sysinit.target").exists():
        pytest.fail(f"{units}/sysinit.target is missing: install Debian's 'systemd' package")
    root = tmp_path / "root"
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    program = root / INSTALLED_PROGRAM.lstrip("/")
    program.parent.mkdir(parents=True)
    shutil.copy(Path(sys.executable).parent / "nri-cpuplugin", program)
    return root


def verify(root: Path) -> subprocess.CompletedProcess:
    # --man=no: no man pages here; the unit names none anyway.
    return run([systemd_analyze(), "verify", f"--root={root}", "--man=no", UNIT.name], cwd=root)


def test_systemd_unit_verifies_without_a_single_warning(unit_root: Path) -> None:
    result = verify(unit_root)
    # verify exits 0 even after "Unknown key" warnings: the output must be empty as well.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_systemd_verify_would_notice_a_missing_program(unit_root: Path) -> None:
    """The check above can fail: verify looks for ExecStart's program inside the root."""
    (unit_root / INSTALLED_PROGRAM.lstrip("/")).unlink()
    result = verify(unit_root)
    assert result.returncode != 0
    assert f"Command {INSTALLED_PROGRAM} is not executable" in result.stderr


def test_systemd_backoff_dropin_is_for_systemd_254_and_later(unit_root: Path) -> None:
    dropin = unit_root / "etc/systemd/system" / BACKOFF.parent.name
    dropin.mkdir()
    shutil.copy(BACKOFF, dropin)
    result = verify(unit_root)
    assert result.returncode == 0
    warnings = sorted(re.findall(r"Unknown key '(\w+)'", result.stderr))
    if systemd_version() >= 254:
        assert result.stderr == ""
    else:  # ignored by older systemd, which is why the keys are not in the unit itself
        assert warnings == ["RestartMaxDelaySec", "RestartSteps"], result.stderr
        assert len(result.stderr.splitlines()) == 2, result.stderr


def test_systemd_irq_dropins_verify_and_open_proc_irq_only(unit_root: Path) -> None:
    """The interrupt drop-ins (docs/operator-guide.md section 5): ours shows /proc/irq to the
    daemon and lets it write there; irqbalance's loads our environment file after its own."""
    ours = unit_root / "etc/systemd/system" / IRQ_DROPIN.parent.name
    ours.mkdir()
    shutil.copy(IRQ_DROPIN, ours)
    result = verify(unit_root)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
    settings = dict(
        line.split("=", 1) for line in IRQ_DROPIN.read_text().splitlines() if "=" in line
    )
    assert settings["ProcSubset"] == "all" and settings["ProtectKernelTunables"] == "no"
    assert "EnvironmentFile=-/run/nri-cpuplugin/irqbalance.env" in IRQBALANCE_DROPIN.read_text()


def test_systemd_unit_exposure_is_low(unit_root: Path) -> None:
    def security(threshold: int) -> subprocess.CompletedProcess:
        return run(
            [
                systemd_analyze(), "security", "--offline=true", f"--root={unit_root}",
                f"--threshold={threshold}", "--no-pager", UNIT.name,
            ],
            cwd=unit_root,
        )  # fmt: skip

    result = security(20)
    level = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)[1])
    assert result.returncode == 0 and level <= 2.0, result.stdout
    # What is left is what the daemon needs: root (the 0700 NRI socket directory), AF_UNIX
    # (the sockets), AF_INET* and the host network (metrics).  No capability at all:
    failed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("✗")}
    assert not {f for f in failed if f.startswith("CapabilityBoundingSet")}, failed
    assert {"NoNewPrivileges=", "ProtectSystem=", "ProtectHome=", "PrivateTmp="}.isdisjoint(failed)
    assert security(10).returncode != 0  # the gate itself works


def test_systemd_unit_runs_the_documented_command_with_restart_and_state_dir() -> None:
    unit = parse_unit(UNIT)
    argv = shlex.split(unit["Service", "ExecStart"][0])
    assert argv[0] == INSTALLED_PROGRAM
    args = build_parser().parse_args(argv[1:])  # the real CLI accepts it
    assert (args.command, args.config) == ("run", INSTALLED_CONFIG)
    assert Path(INSTALLED_PROGRAM).name in project()["project"]["scripts"]
    # The state directory systemd creates and leaves writable is the plugin's default one.
    assert "/var/lib/" + unit["Service", "StateDirectory"][0] == DEFAULT_STATE_DIR
    assert DEFAULT_STATE_DIR in unit["Service", "ReadWritePaths"][0].split()
    assert unit["Service", "Restart"] == ["always"]
    assert unit["Unit", "StartLimitIntervalSec"] == ["0"]  # never gives up...
    # ...but on a configuration error (the CLI's exit 2): issue 39, it looped every 2 s.
    assert unit["Service", "RestartPreventExitStatus"] == [str(EXIT_USAGE)]
    # Started once registered (READY=1), watched while its worker answers (WATCHDOG=1).
    assert unit["Service", "Type"] == ["notify"]
    assert unit["Service", "NotifyAccess"] == ["main"]
    assert unit["Service", "WatchdogSec"] == ["1min"]
    assert "containerd.service" in unit["Unit", "After"][0].split()
    assert unit["Unit", "Wants"] == ["containerd.service"]
    assert unit["Service", "CapabilityBoundingSet"] == []  # reset to nothing
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert unit["Service", key] == [value], key


# -- the unit's sandbox against what the daemon does -------------------------------------------

# Where the daemon writes besides its state directory, and why.  A daemon change that writes
# somewhere new belongs here; the unit (and the DaemonSet's mounts) must then allow it.
DAEMON_WRITES = {
    cgroupfs.DEFAULT_ROOT: "shared containers' cpusets when the pool changes "
    "(CgroupWriter.write), cpuset repairs after CPU hotplug (CgroupWriter.repair)",
}
# systemd.exec(5): what ProtectSystem=strict leaves to other settings, and which setting that is.
API_FILESYSTEMS = {"/dev": "PrivateDevices", "/proc": "ProtectKernelTunables",
                   "/sys": "ProtectKernelTunables"}  # fmt: skip
# Values that leave /sys/fs/cgroup the host's hierarchy, writable (not: yes, strict, private).
CGROUPS_WRITABLE = ("no",)


def is_below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def unit_leaves_writable(unit: dict[tuple[str, str], list[str]], path: str) -> bool:
    """Whether the unit's filesystem settings leave ``path`` writable for the daemon, as
    systemd.exec(5) describes them (and src/core/namespace.c implements them: with
    ProtectKernelTunables= /sys is read-only except /sys/fs/cgroup, which is left to
    ProtectControlGroups=)."""
    service = {
        key: values[-1]
        for (section, key), values in unit.items()
        if values and section == "Service"
    }
    writable = [p for values in unit.get(("Service", "ReadWritePaths"), []) for p in values.split()]
    if any(is_below(path, p.lstrip("-")) for p in writable):
        return True
    if is_below(path, "/sys/fs/cgroup"):
        return service.get("ProtectControlGroups", "no") in CGROUPS_WRITABLE
    for root, setting in API_FILESYSTEMS.items():
        if is_below(path, root):
            return service.get(setting, "no") == "no"
    return service.get("ProtectSystem", "no") in ("no", "false")


def test_systemd_unit_lets_the_daemon_write_where_it_writes() -> None:
    unit = parse_unit(UNIT)
    for path, why in DAEMON_WRITES.items():
        assert unit_leaves_writable(unit, path), f"the unit makes {path} read-only: {why}"
    assert unit_leaves_writable(unit, DEFAULT_STATE_DIR)
    # The model can say no: the rest of the filesystem, and /sys outside the cgroups.
    assert not unit_leaves_writable(unit, "/etc/nri-cpuplugin")
    assert not unit_leaves_writable(unit, "/sys/devices/system/cpu/cpu1/online")
    protected = dict(unit)
    protected["Service", "ProtectControlGroups"] = ["yes"]
    assert not unit_leaves_writable(protected, cgroupfs.DEFAULT_ROOT)


# Rebuilds the unit's filesystem and privilege settings as far as the cgroup repairs care (the
# e2e test in tests/e2e/test_packaging_e2e.py runs the whole daemon in the rest of them): a
# private mount namespace; / and /sys read-only; the cgroup mounts read-only or not as the
# unit says; /proc showing only our own processes; then no capabilities and no new privileges.
REPAIR_SANDBOX = r"""
set -e
cgroups=$1; shift
mount -o remount,bind,ro /
mount -o remount,bind,ro /sys
if [ "$cgroups" = ro ]; then
  for m in $(awk '$5 ~ "^/sys/fs/cgroup" {print $5}' /proc/self/mountinfo); do
    mount -o remount,bind,ro "$m"
  done
fi
mount -t proc -o hidepid=invisible,subset=pid proc /proc
exec setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs -- "$@"
"""
# What the daemon does after CPU hotplug on cgroup v1 (CgroupWriter.repair): ancestors
# grown, the container's cpuset written, evicted processes put back - the same functions.
REPAIR = r"""
import json, sys
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware import cgroupfs, cpusets
cid, path, cpus, online = sys.argv[1:]
layout = cgroupfs.detect()
errors = cpusets.grow_ancestors(layout, [path], CPUSet.parse(online))
applied = cpusets.apply(layout, [cpusets.Target(cid, path, CPUSet.parse(cpus))])
print(json.dumps({"errors": errors + applied.errors, "returned": applied.returned}))
"""


def repair_in_units_sandbox(
    unit: dict[tuple[str, str], list[str]], cid: str, cgroup: str, cpus: str
) -> dict:
    """Run the daemon's repair of one container in the sandbox ``unit`` describes."""
    cgroups = "rw" if unit_leaves_writable(unit, cgroupfs.DEFAULT_ROOT) else "ro"
    online = ",".join(map(str, host.online_cpus()))
    result = run(
        [
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", REPAIR_SANDBOX, "sandbox", cgroups,
            sys.executable, "-c", REPAIR, cid, cgroup, cpus, online,
        ],
        cwd="/",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_systemd_unit_sandbox_lets_the_daemon_repair_cpusets_after_hotplug() -> None:
    """The cpuset writes the daemon makes after CPU hotplug, in the unit's sandbox; under
    ProtectControlGroups=yes (as shipped before) each fails with EROFS."""
    unit = parse_unit(UNIT)
    with sandbox() as box:
        container = box.add(pod("db"), "db", millicores=1000)
        last = str(host.online_cpus()[-1])
        report = repair_in_units_sandbox(unit, container.id, container.cgroup, last)
        assert report == {"errors": [], "returned": {}}
        assert box.cpus(container) == last and box.affinity(container) == last

        # The same under ProtectControlGroups=yes: this test would have caught it.
        protected = dict(unit)
        protected["Service", "ProtectControlGroups"] = ["yes"]
        report = repair_in_units_sandbox(protected, container.id, container.cgroup, "0")
        assert report["errors"] and all("Read-only file system" in e for e in report["errors"])
        assert box.cpus(container) == last


@pytest.mark.xfail(
    strict=True,
    reason="open: cgroup v1 lets a process without CAP_SYS_NICE move only processes whose "
    "capabilities are a subset of its own (cpuset's can_attach), and the unit grants none, "
    "so the processes of a root container that the kernel evicted stay evicted",
)
def test_systemd_unit_sandbox_lets_the_daemon_return_evicted_processes() -> None:
    unit = parse_unit(UNIT)
    with sandbox() as box:
        if box.cpu_root is None:
            pytest.fail("no cgroup v1 cpu hierarchy: the eviction witness needs one")
        container = box.add(pod("db"), "db", millicores=1000)  # its process: root, all caps
        # What cgroup v1 does when a cpuset loses its last CPU: its processes go up a level
        # (their cpu cgroup stays).  The repair must put them back.
        (box.cpuset_dir(container.cgroup).parent / "cgroup.procs").write_text(str(container.pid))
        last = str(host.online_cpus()[-1])
        report = repair_in_units_sandbox(unit, container.id, container.cgroup, last)
        assert report == {"errors": [], "returned": {container.id: 1}}


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CONFIG, LAUNCHED_CONF], ids=lambda p: p.name)
def test_config_files_are_accepted_by_the_plugin(path: Path) -> None:
    settings = merge(Settings(), load_file(path))
    assert settings.state_dir == DEFAULT_STATE_DIR
    assert settings.reserved_cpu_count == 1 and settings.reserved_cpus is None
    assert settings.metrics_listen is None  # metrics are opt-in
    # The loader is strict, so the acceptance above means something:
    text = path.read_text()
    assert text.count("\nreserved_cpu_count =") == 1
    with pytest.raises(ConfigError, match="unknown key 'reserved_cpu'"):
        parse_toml(text.replace("\nreserved_cpu_count =", "\nreserved_cpu ="), str(path))


def test_daemon_config_talks_to_the_socket_the_runtime_drop_ins_open() -> None:
    settings = merge(Settings(), load_file(CONFIG))
    assert settings.nri_socket == NRI_SOCKET
    crio = tomllib.loads(CRIO_NRI.read_text())["crio"]["nri"]
    assert crio["nri_listen"] == NRI_SOCKET
    for name in (
        "nri-containerd-1.7.toml",
        "nri-containerd-2.x.toml",
        "nri-containerd-2.2-fail-closed.toml",
    ):
        nri = tomllib.loads((PACKAGING / "containerd" / name).read_text())
        assert nri["plugins"]["io.containerd.nri.v1.nri"]["socket_path"] == NRI_SOCKET


def test_fail_closed_dropin_requires_this_plugin_and_is_otherwise_the_2x_one() -> None:
    """Same NRI settings as the fail-open 2.x drop-in it replaces, plus the validator requiring
    the name the daemon registers with; the DaemonSet's pod tolerates its absence."""
    containerd = PACKAGING / "containerd"
    plain = tomllib.loads((containerd / "nri-containerd-2.x.toml").read_text())
    closed = tomllib.loads((containerd / "nri-containerd-2.2-fail-closed.toml").read_text())
    assert closed["version"] == plain["version"] == 3
    nri = dict(closed["plugins"]["io.containerd.nri.v1.nri"])
    validator = nri.pop("default_validator")
    assert nri == plain["plugins"]["io.containerd.nri.v1.nri"]
    assert validator["enable"] is True
    assert validator["required_plugins"] == [Settings().nri_name]
    key = validator["tolerate_missing_plugins_annotation"]
    template = kinds()["DaemonSet"]["spec"]["template"]
    assert template["metadata"]["annotations"] == {key: "true"}


# -- runtime-launched plugin -------------------------------------------------------------------


def test_launcher_is_what_the_runtime_launches() -> None:
    # NN-name: the runtime refuses to start NRI at all if an executable there is misnamed.
    assert re.fullmatch(r"\d\d-[A-Za-z0-9_.+-]+", LAUNCHER.name)
    assert LAUNCHED_CONF.name == LAUNCHER.name + ".conf"  # what the runtime looks up first
    # Executable in git, so a checkout installs it executable (any x bit will do for NRI).
    mode = run(["git", "ls-files", "-s", str(LAUNCHER.relative_to(REPO))], cwd=REPO).stdout
    assert mode.startswith("100755 "), mode or "not tracked"
    assert LAUNCHER.stat().st_mode & stat.S_IXUSR
    # No PATH in the runtime's environment: absolute interpreter, absolute program.
    lines = LAUNCHER.read_text().splitlines()
    assert lines[0] == "#!/bin/sh"
    [exec_line] = [line for line in lines if line.startswith("exec ")]
    assert shlex.split(exec_line)[1:] == [INSTALLED_PROGRAM, "run"]
    syntax = run(["sh", "-n", str(LAUNCHER)])
    assert syntax.returncode == 0, syntax.stderr


# -- CRI-O -------------------------------------------------------------------------------------


def is_path(v: object) -> bool:
    return isinstance(v, str) and v.startswith("/")


def is_duration(v: object) -> bool:  # Go time.ParseDuration, as CRI-O decodes these
    return isinstance(v, str) and re.fullmatch(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", v) is not None


def is_bool(v: object) -> bool:
    return isinstance(v, bool)


# crio.conf(5): the CRIO.NRI table and crio.runtime.hooks_dir.
CRIO_KEYS = {
    ("crio", "nri", "enable_nri"): is_bool,
    ("crio", "nri", "nri_listen"): is_path,
    ("crio", "nri", "nri_plugin_dir"): is_path,
    ("crio", "nri", "nri_plugin_config_dir"): is_path,
    ("crio", "nri", "nri_disable_connections"): is_bool,
    ("crio", "nri", "nri_plugin_registration_timeout"): is_duration,
    ("crio", "nri", "nri_plugin_request_timeout"): is_duration,
    ("crio", "runtime", "hooks_dir"): lambda v: (
        isinstance(v, list) and bool(v) and all(map(is_path, v))
    ),
}


def leaves(doc: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out.update(leaves(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def check_crio(text: str) -> dict[tuple[str, ...], object]:
    found = leaves(tomllib.loads(text))
    for key, value in found.items():
        assert key in CRIO_KEYS, f"{'.'.join(key)} is not a documented CRI-O key"
        assert CRIO_KEYS[key](value), f"{'.'.join(key)} = {value!r} has the wrong type"
    return found


def test_crio_nri_dropin_enables_nri_with_the_documented_keys() -> None:
    found = check_crio(CRIO_NRI.read_text())
    assert found[("crio", "nri", "enable_nri")] is True
    assert found[("crio", "nri", "nri_disable_connections")] is False
    assert found[("crio", "nri", "nri_plugin_dir")] == NRI_PLUGIN_DIR  # launcher's home
    assert found[("crio", "nri", "nri_plugin_config_dir")] == NRI_CONF_DIR
    # The checker can fail: a misspelt key and a number where CRI-O wants a duration.
    with pytest.raises(AssertionError, match="not a documented"):
        check_crio(CRIO_NRI.read_text().replace("nri_listen", "nri_socket"))
    with pytest.raises(AssertionError, match="wrong type"):
        check_crio(CRIO_NRI.read_text().replace('timeout = "2s"', "timeout = 2"))


def test_crio_hooks_dropin_names_where_the_hooks_go() -> None:
    found = check_crio(CRIO_HOOKS.read_text())
    assert found == {
        ("crio", "runtime", "hooks_dir"): [
            "/usr/share/containers/oci/hooks.d",
            "/etc/containers/oci/hooks.d",
        ]
    }
    # The hook entries shipped in hooks/ (maintained there) run a program this package installs.
    scripts = project()["project"]["scripts"]
    entries = sorted((REPO / "hooks").glob("*.json"))
    assert entries
    for entry in entries:
        hook = json.loads(entry.read_text())["hook"]
        assert Path(hook["path"]).name in scripts, entry.name


# -- Kubernetes --------------------------------------------------------------------------------


def manifests() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(DAEMONSET.read_text()) if doc]


def kinds() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in manifests()}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schema(version: str) -> None:
    docs = manifests()
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "DaemonSet"]
    for doc in docs:
        # strict: unknown fields (typos) are errors, as `kubectl apply --validate=strict` does.
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_catches_mistakes() -> None:
    daemonset = kinds()["DaemonSet"]
    typo = copy.deepcopy(daemonset)
    typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privilegd"] = False
    wrong_type = copy.deepcopy(daemonset)
    wrong_type["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"] = 42
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_daemonset_runs_everywhere_with_no_more_privilege_than_needed() -> None:
    ds = kinds()["DaemonSet"]
    assert ds["metadata"]["namespace"] == "kube-system"
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]  # every taint, every node
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert pod["automountServiceAccountToken"] is False  # it never talks to the API server
    assert not any(pod.get(k) for k in ("hostPID", "hostIPC"))
    # the node's network: its pod must not wait for the CNI plugin, which may wait for it
    assert pod["hostNetwork"] is True
    # only on the nodes an operator labelled (NRI on, kubelet's policy none)
    assert pod["nodeSelector"] == {"nri-cpuplugin.io/enabled": "true"}
    [container] = pod["containers"]
    sc = container["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsUser"] == 0  # the NRI socket's directory is root's, mode 0700
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    resources = container["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert "cpu" not in resources.get("limits", {})  # a throttled plugin misses NRI deadlines


def test_daemonset_mounts_what_the_configured_daemon_uses() -> None:
    docs = kinds()
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: (m, volumes[m["name"]]) for m in container["volumeMounts"]}
    host_paths = {
        path: (v["hostPath"]["path"], v["hostPath"].get("type"), bool(m.get("readOnly")))
        for path, (m, v) in mounts.items()
        if "hostPath" in v
    }
    # The command the image runs, through the real CLI parser, and the settings it ends with.
    args = build_parser().parse_args(container["args"])
    assert container["command"] == ["nri-cpuplugin"] and args.command == "run"
    config_mount = str(Path(args.config).parent)
    assert mounts[config_mount][1]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    text = docs["ConfigMap"]["data"][Path(args.config).name]
    settings = merge(Settings(), parse_toml(text, "ConfigMap"))
    assert host_paths == {
        # the directory, so a socket the runtime recreates is seen
        str(Path(settings.nri_socket).parent): ("/var/run/nri", "DirectoryOrCreate", False),
        args.sysfs: ("/sys", "Directory", True),
        settings.state_dir: (DEFAULT_STATE_DIR, "DirectoryOrCreate", False),
        # the journal's socket, systemd's private bus and its unit files, read-only
        "/run/systemd": ("/run/systemd", "Directory", True),
        "/etc/systemd": ("/etc/systemd", "DirectoryOrCreate", True),
        # the host's cgroups where the daemon looks for them, writable (DAEMON_WRITES)
        cgroupfs.DEFAULT_ROOT: ("/sys/fs/cgroup", "Directory", False),
        # kubelet's CPU manager checkpoint, the file alone (pods' secrets are beside it)
        settings.kubelet_cpu_manager_state: ("/var/lib/kubelet/cpu_manager_state", "File", True),
    }
    for path in DAEMON_WRITES:
        assert not host_paths[path][2], f"{path} is mounted read-only: {DAEMON_WRITES[path]}"
    assert audit.JOURNAL_SOCKET.startswith("/run/systemd/")


def test_daemonset_probes_ask_the_daemon_of_the_mounted_state_directory() -> None:
    docs = kinds()
    [container] = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    settings = merge(Settings(), parse_toml(docs["ConfigMap"]["data"]["config.toml"], "ConfigMap"))
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    expected = {"startupProbe": "--live", "readinessProbe": "--ready", "livenessProbe": "--live"}
    for probe, flag in expected.items():
        command = container[probe]["exec"]["command"]
        assert command[0] == container["command"][0]
        args = build_parser().parse_args(command[1:])  # the real CLI accepts it
        assert args.command == "status" and flag in command
        # status reads the health file where the configured daemon writes it
        assert args.state_dir == settings.state_dir and settings.state_dir in mounted
        # a probe that times out before a cold Python start would fail a healthy daemon
        assert container[probe]["timeoutSeconds"] >= 5


def test_configmap_holds_the_packaged_config() -> None:
    assert kinds()["ConfigMap"]["data"]["config.toml"] == CONFIG.read_text()


# -- Dockerfile --------------------------------------------------------------------------------
# Its agreement with `./dev image` (base digest, locks, entrypoint, environment, labels,
# .dockerignore) is tests/unit/test_image_recipes.py; the image that recipe builds is checked in
# tests/system/test_image_build.py and loaded and run in tests/e2e/test_image.py.


def test_dockerfile_builds_from_tracked_files_and_runs_what_the_daemonset_expects() -> None:
    steps = dockerfile_steps()
    tracked = set(run(["git", "ls-files"], cwd=REPO).stdout.split())
    copies = [shlex.split(args) for op, args in steps if op == "COPY"]
    assert copies
    for *sources, _dest in copies:
        if sources[0].startswith("--from="):
            continue  # from the build stage, not the context
        for source in sources:
            path = source.rstrip("/")
            assert (REPO / path).exists(), source
            assert path in tracked or any(t.startswith(path + "/") for t in tracked), source
    entrypoint = json.loads(dict(steps)["ENTRYPOINT"])
    assert entrypoint[0] in project()["project"]["scripts"]
    [container] = kinds()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == entrypoint
    assert json.loads(dict(steps)["CMD"]) == ["run"]
    assert dict(steps)["USER"] == "0"


# -- the Python package, from a clean clone ----------------------------------------------------


def venv(path: Path) -> Path:
    """A fresh virtual environment without pip (fast); this interpreter's pip installs into it."""
    result = run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    assert result.returncode == 0, result.stderr
    return path / "bin/python"


def pip_command(python: Path, *args: str, cwd: Path | None = None) -> None:
    result = run([sys.executable, "-m", "pip", "--python", str(python), *args], cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def pip_install(python: Path, *args: str, cwd: Path | None = None) -> None:
    pip_command(python, "install", *args, cwd=cwd)


def check_installed(python: Path) -> None:
    """The console script works outside the source tree."""
    program = python.parent / "nri-cpuplugin"
    result = run([str(program), "--help"], cwd="/")
    assert result.returncode == 0 and "topology" in result.stdout, result.stderr
    result = run([str(program), "topology", "--json"], cwd="/")
    assert result.returncode == 0, result.stderr
    online = {c["id"] for c in json.loads(result.stdout)["cpus"] if c["online"]}
    assert online == set(discover().online)  # this machine, as the work tree sees it
    # It really is the installed copy, not the work tree.
    where = run([str(python), "-c", "import nri_cpuplugin; print(nri_cpuplugin.__file__)"], cwd="/")
    assert str(REPO) not in where.stdout and str(python.parents[1]) in where.stdout, where.stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A clean clone of the committed HEAD: what a user gets, nothing from this work tree."""
    src = tmp_path_factory.mktemp("clone") / "nri-cpuplugin"
    result = run(["git", "clone", "--quiet", str(REPO), str(src)])
    assert result.returncode == 0, result.stderr
    return src


@pytest.fixture(scope="module")
def dist(clone: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    result = run([sys.executable, "-m", "build", "--outdir", str(out), str(clone)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_sdist_and_wheel_install_and_run(dist: Path, tmp_path: Path) -> None:
    [wheel] = dist.glob("*.whl")
    [sdist] = dist.glob("*.tar.gz")
    for name, artefact in (("wheel", wheel), ("sdist", sdist)):
        python = venv(tmp_path / name)
        pip_install(python, str(artefact))
        check_installed(python)
    # packaging/README.md's install: a venv, its console scripts linked into /usr/local/bin
    # (here a stand-in); they run through the link with no PATH, as runtimes and systemd do.
    bin_dir = tmp_path / "usr-local-bin"
    bin_dir.mkdir()
    for script in project()["project"]["scripts"]:
        (bin_dir / script).symlink_to(python.parent / script)
    result = run([str(bin_dir / "nri-cpuplugin"), "topology", "--json"], cwd="/", env={})
    assert result.returncode == 0 and json.loads(result.stdout)["cpus"], result.stderr
    result = run([str(bin_dir / "nri-cpuplugin-hook"), "--help"], cwd="/", env={})
    assert result.returncode == 0, result.stderr
    # hooks/README.md: `install-hook` replaces the link with the launcher, which runs the
    # installed package with -I -S (no site-packages scan) and no environment at all.
    launcher = bin_dir / "nri-cpuplugin-hook"
    result = run([str(bin_dir / "nri-cpuplugin"), "install-hook", "--path", str(launcher)],
                 cwd="/", env={})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert launcher.read_text().startswith(f"#!{python} -IS\n") and not launcher.is_symlink()
    result = run([str(launcher), "--help"], cwd="/", env={})
    assert result.returncode == 0 and result.stdout.startswith("usage: nri-cpuplugin-hook")


def test_pip_install_from_a_clean_clone(clone: Path, tmp_path: Path) -> None:
    python = venv(tmp_path / "venv")
    pip_install(python, ".", cwd=clone)
    check_installed(python)


def test_dockerfile_pip_steps_work_on_exactly_the_copied_files(clone: Path, tmp_path: Path) -> None:
    """Replays the wheel stage's COPY and pip steps on a clean clone as build context (absolute
    paths moved under a stand-in root, the stage's venv a fresh one): a file the build needs but
    the Dockerfile forgets to copy, or a lock pip refuses, fails here.  The wheels it leaves are
    then installed into a fresh venv as the final stage installs them, and the program run."""
    image = tmp_path / "image"
    build_python = venv(image / "build")
    steps = dockerfile_steps()
    froms = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    stage = steps[froms[0] : froms[1]]
    ran = []
    for op, args in stage:
        if op == "COPY":
            *sources, dest = shlex.split(args)
            target = image / dest.lstrip("/")
            for source in sources:  # docker: a directory's contents go into dest
                origin = clone / source
                if origin.is_dir():
                    shutil.copytree(origin, target, dirs_exist_ok=True)
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(origin, target / origin.name)
        elif op == "RUN":
            for command in args.split("&&"):
                words = shlex.split(command)
                if words[0] == "/build/bin/pip":
                    moved = [str(image / w.lstrip("/")) if w.startswith("/") else w for w in words]
                    pip_command(build_python, *moved[1:])
                    ran.append(words[1])
    assert ran == ["install", "download", "wheel"]
    python = venv(tmp_path / "venv")
    wheels = image / "wheels"
    locks = image / "locks"
    pip_install(python, "--no-index", "--no-deps", "--require-hashes", "--find-links",
                str(wheels), "-r", str(locks / "requirements.lock"))  # fmt: skip
    [own] = wheels.glob("nri_cpuplugin-*.whl")
    pip_install(python, "--no-index", "--no-deps", str(own))
    check_installed(python)
