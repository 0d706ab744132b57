"""packaging/ against the real runtimes, containerd 1.7.24, 2.1.9 and 2.3.4.

* The containerd NRI drop-ins, merged into a full private config through ``imports``, as
  ``containerd config dump`` shows them; 1.7 refuses the 2.x file (why there are two).
* The runtime-launched install: containerd started with the drop-in (paths moved into the
  instance), ``packaging/nri/10-cpuplugin`` in its plugin_path and
  ``packaging/nri/10-cpuplugin.conf`` in its plugin_config_path, both as shipped except for
  absolute paths.  containerd logs the plugin registered, and a Guaranteed pod comes up pinned.
* The systemd unit's command line run inside the unit's sandbox as far as it can be rebuilt
  without systemd: no capabilities at all (``CapabilityBoundingSet=``), no new privileges, the
  whole filesystem read-only except the state directory (``ProtectSystem=strict`` +
  ``ReadWritePaths=``), /proc limited to its own processes (``ProtectProc=invisible``,
  ``ProcSubset=pid``), W+X memory refused (``MemoryDenyWriteExecute=``), against an NRI
  socket whose directory is root-only, as the runtimes create it.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import host
from harness.containerd import Containerd, _toml
from harness.k8s import ContainerSpec

from e2e.daemon import settled_state, wait_for

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
DROP_INS = {
    "1.7": PACKAGING / "containerd/nri-containerd-1.7.toml",
    "2.1": PACKAGING / "containerd/nri-containerd-2.x.toml",
    "2.3": PACKAGING / "containerd/nri-containerd-2.x.toml",
}
# containerd 2.3 reads config version 3 and migrates it in memory: `config dump` says 4.
DUMPED_VERSION = {"1.7": 2, "2.1": 3, "2.3": 4}
FAIL_CLOSED = PACKAGING / "containerd/nri-containerd-2.2-fail-closed.toml"
NRI = "io.containerd.nri.v1.nri"
LAUNCHER = PACKAGING / "nri/10-cpuplugin"
LAUNCHED_CONF = PACKAGING / "nri/10-cpuplugin.conf"
UNIT = PACKAGING / "systemd/nri-cpuplugin.service"
CONFIG = PACKAGING / "config.toml"
INSTALLED_PROGRAM = "/usr/local/bin/nri-cpuplugin"
PROGRAM = Path(sys.executable).parent / "nri-cpuplugin"  # this venv's console script
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1


def replace_once(text: str, old: str, new: str) -> str:
    """Move one shipped value (a path) into the test's private world; it must be there once."""
    assert text.count(old) == 1, f"expected {old!r} exactly once"
    return text.replace(old, new)


def quoted(value: str | Path) -> str:
    return json.dumps(str(value))  # a TOML basic string


def main_config_without_nri(ctrd: Containerd) -> dict:
    """The harness's full private config minus its own NRI table: the drop-in must do it all."""
    config = ctrd.config()
    del config["plugins"][NRI]
    return config


def dump(ctrd: Containerd, config: dict, where: Path) -> subprocess.CompletedProcess:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "config.toml"
    path.write_text(_toml(config))
    return subprocess.run(
        [str(ctrd.binary), "--config", str(path), "config", "dump"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip


# -- containerd config dump --------------------------------------------------------------------


def test_containerd_config_dump_shows_the_dropin_merged(
    lab: Path, containerd_version: str, tmp_path: Path
) -> None:
    ctrd = Containerd(containerd_version, lab=lab)  # never started: only its binary and config
    dropin = DROP_INS[containerd_version]
    shipped = tomllib.loads(dropin.read_text())["plugins"][NRI]
    assert set(shipped) == {
        "disable", "disable_connections", "socket_path", "plugin_path", "plugin_config_path",
        "plugin_registration_timeout", "plugin_request_timeout",
    }  # fmt: skip

    plain = dump(ctrd, main_config_without_nri(ctrd), tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-2000:]
    default = tomllib.loads(plain.stdout)["plugins"][NRI]
    # Without the drop-in NRI is off in 1.7 (on in 2.x): the import is what turns it on.
    assert default["disable"] is (containerd_version == "1.7")

    # A main config with an NRI table of its own, every value different: the import wins
    # (1.7 replaces the whole plugin table, 2.x merges key by key; either way the drop-in's
    # values are what containerd runs with).
    config = main_config_without_nri(ctrd)
    config["plugins"][NRI] = {
        "disable": True, "disable_connections": True, "socket_path": "/main/nri.sock",
        "plugin_path": "/main/plugins", "plugin_config_path": "/main/conf.d",
        "plugin_registration_timeout": "9s", "plugin_request_timeout": "9s",
    }  # fmt: skip
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    (conf_d / "nri-cpuplugin.toml").write_text(dropin.read_text())
    config["imports"] = [str(conf_d / "*.toml")]
    merged = dump(ctrd, config, tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr[-2000:]
    doc = tomllib.loads(merged.stdout)
    # 1.7 lists the files it read, 2.x the patterns as written.
    assert {str(conf_d / "nri-cpuplugin.toml"), str(conf_d / "*.toml")} & set(doc["imports"])
    assert doc["version"] == DUMPED_VERSION[containerd_version]
    assert {k: doc["plugins"][NRI][k] for k in shipped} == shipped


def test_containerd_fail_closed_dropin_is_applied_from_22_and_ignored_before(
    lab: Path, containerd_version: str, tmp_path: Path
) -> None:
    """2.3 runs with the validator; 2.1 only warns that it does not know the table (and stays
    fail-open: why the drop-in's name says 2.2); 1.7 refuses config version 3 outright.  The
    validator's behaviour itself: tests/e2e/test_fail_closed.py."""
    ctrd = Containerd(containerd_version, lab=lab)
    config = main_config_without_nri(ctrd)
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    (conf_d / "nri-cpuplugin.toml").write_text(FAIL_CLOSED.read_text())
    config["imports"] = [str(conf_d / "*.toml")]
    result = dump(ctrd, config, tmp_path)
    shipped = tomllib.loads(FAIL_CLOSED.read_text())["plugins"][NRI]["default_validator"]
    if containerd_version == "1.7":
        assert result.returncode != 0 and "unsupported config version `3`" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    nri = tomllib.loads(result.stdout)["plugins"][NRI]
    if containerd_version == "2.1":
        assert "default_validator" not in nri
        assert "Ignoring unknown key in TOML for plugin" in result.stderr
        assert "key=default_validator" in result.stderr
    else:
        assert {k: nri["default_validator"][k] for k in shipped} == shipped


def test_containerd_17_refuses_the_2x_dropin(lab: Path, tmp_path: Path) -> None:
    ctrd = Containerd("1.7", lab=lab)
    config = main_config_without_nri(ctrd)
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    (conf_d / "nri.toml").write_text(DROP_INS["2.1"].read_text())
    config["imports"] = [str(conf_d / "*.toml")]
    result = dump(ctrd, config, tmp_path)
    assert result.returncode != 0
    assert "unsupported config version `3`" in result.stderr


# -- runtime-launched plugin -------------------------------------------------------------------


# containerd's log (logfmt, quotes escaped): plugin "pre-connected:10-cpuplugin[PID]" registered
# as "10-cpuplugin"
REGISTERED = re.compile(
    r'plugin \\"pre-connected:10-cpuplugin\[(\d+)\]\\" registered as \\"10-cpuplugin\\"'
)


def install_launched_plugin(ctrd: Containerd, state_dir: Path) -> None:
    """The drop-in into conf.d, imported by the main config; launcher and its configuration
    into the instance's plugin_path and plugin_config_path.  Only absolute paths change."""
    conf_d = ctrd.dir / "conf.d"
    conf_d.mkdir(parents=True)
    text = DROP_INS[ctrd.version].read_text()
    text = replace_once(text, quoted("/var/run/nri/nri.sock"), quoted(ctrd.nri_socket))
    text = replace_once(text, quoted("/opt/nri/plugins"), quoted(ctrd.plugin_path))
    text = replace_once(text, quoted("/etc/nri/conf.d"), quoted(ctrd.plugin_config_path))
    (conf_d / "nri-cpuplugin.toml").write_text(text)
    config = main_config_without_nri(ctrd)
    config["imports"] = [str(conf_d / "*.toml")]
    ctrd.config = lambda: config  # what start() writes as the main config

    ctrd.plugin_path.mkdir(parents=True)
    launcher = ctrd.plugin_path / LAUNCHER.name
    # Quoted for the shell: this checkout's path (the venv's) may have spaces.
    program = shlex.quote(str(PROGRAM))
    launcher.write_text(replace_once(LAUNCHER.read_text(), INSTALLED_PROGRAM, program))
    launcher.chmod(LAUNCHER.stat().st_mode & 0o7777)  # as shipped (checked: 0755)
    ctrd.plugin_config_path.mkdir(parents=True)
    conf = LAUNCHED_CONF.read_text()
    conf = replace_once(conf, quoted("/var/lib/nri-cpuplugin"), quoted(state_dir))
    (ctrd.plugin_config_path / LAUNCHED_CONF.name).write_text(conf)


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def test_runtime_launched_install_pins_a_guaranteed_pod(
    make_containerd: Callable[..., Containerd], tmp_path: Path
) -> None:
    ctrd = make_containerd(start=False)
    state_dir = tmp_path / "state"
    install_launched_plugin(ctrd, state_dir)
    try:
        ctrd.start()
        error = None
    except Exception as e:
        error = f"containerd {ctrd.version} did not start with the packaged NRI drop-in: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    log = ctrd.log_path.read_text(errors="replace")
    found = REGISTERED.search(log)
    assert found, "containerd did not log the launched plugin as registered"
    # (The pid in that line is the socketpair's creator, containerd; find the plugin by parent.)
    # The launcher exec'd the daemon; the runtime gave it nothing but the NRI variables.
    [pid] = [
        p for p in host.pids() if parent(p) == ctrd.pid and b"nri-cpuplugin" in host.cmdline(p)
    ]
    assert host.cmdline(pid).split(b"\0")[-3:] == [str(PROGRAM).encode(), b"run", b""]
    env = environ(pid)
    assert env["NRI_PLUGIN_SOCKET"] == "3" and env["NRI_PLUGIN_IDX"] == "10"
    assert env["NRI_PLUGIN_NAME"] == "cpuplugin"
    assert "PATH" not in env  # why the launcher names everything absolutely

    cri = ctrd.cri()
    pod = cri.run("pinned", [ContainerSpec.guaranteed("p", 1, command=FIRST_LINE)])
    [line] = cri.wait_logs(pod["p"], 1)
    # The configuration arrived through Configure: the state is where the .conf put it.
    state = settled_state(state_dir)
    cpus = state["assignments"][pod["p"]]["cpus"]
    assert line == f"Cpus_allowed_list:\t{cpus}"  # pinned from its first instruction
    assert host.read_cgroup(cri.cgroup_path(pod["p"]), "cpuset.cpus") == cpus
    assert state["reserved"] != cpus and state["reserved"]  # reserved_cpu_count = 1


# -- the systemd unit's sandbox ----------------------------------------------------------------

# Rebuilds the unit's filesystem and privilege settings, then execs the unit's command:
# private mount namespace; the state directory bound onto itself (stays writable); / and /sys
# read-only; a fresh /proc showing only our own processes and no other files; then setpriv
# (CapabilityBoundingSet= AmbientCapabilities= NoNewPrivileges=yes) and PR_SET_MDWE
# (MemoryDenyWriteExecute=yes, inherited across exec).
SANDBOX = r"""
set -e
state=$1; shift
mount --bind "$state" "$state"
mount -o remount,bind,ro /
mount -o remount,bind,ro /sys
mount -t proc -o hidepid=invisible,subset=pid proc /proc
exec setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs -- "$@"
"""
MDWE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0):\n"
    "    sys.exit(f'PR_SET_MDWE failed: errno {ctypes.get_errno()}')\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


PROBE = r"""
import errno, mmap, os, sys
state, elsewhere = sys.argv[1:]
def attempt(name, action):
    try:
        action()
        print(f"{name}:ok")
    except OSError as e:
        print(f"{name}:{errno.errorcode[e.errno]}")
attempt("state", lambda: open(os.path.join(state, "probe"), "w").close())
attempt("elsewhere", lambda: open(os.path.join(elsewhere, "probe"), "w").close())
attempt("proc-stat", lambda: open("/proc/stat").close())
attempt("wx", lambda: mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC))
status = dict(line.split(":\t", 1) for line in open("/proc/self/status") if ":\t" in line)
print("caps:%x" % max(int(status[f], 16) for f in ("CapEff", "CapPrm", "CapBnd", "CapAmb")))
print("nnp:" + status["NoNewPrivs"].strip())
os.unlink(os.path.join(state, "probe"))
"""


def sandbox(state_dir: Path) -> list[str]:
    """argv prefix: run the rest of the command line in the unit's sandbox."""
    return [
        "unshare", "--mount", "--propagation", "private", "--",
        "sh", "-c", SANDBOX, "sandbox", str(state_dir),
        sys.executable, "-c", MDWE,
    ]  # fmt: skip


def unit_command(config: Path) -> list[str]:
    [line] = [v for v in UNIT.read_text().splitlines() if v.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[0] == INSTALLED_PROGRAM
    at = argv.index("--config") + 1
    return [str(PROGRAM), *argv[1:at], str(config), *argv[at + 1 :]]


def status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def records(log: Path, action: str) -> list[dict]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [r for r in map(json.loads, filter(lambda s: s.startswith("{"), lines))
            if r.get("ACTION") == action]  # fmt: skip


def test_systemd_unit_command_runs_in_the_units_sandbox(
    containerd: Containerd, tmp_path: Path
) -> None:
    # The runtimes create the NRI socket's directory root-only (0700); so does this test.
    containerd.nri_socket.parent.chmod(0o700)
    nobody = subprocess.run(
        [
            "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try: s.connect(sys.argv[1])\n"
            "except PermissionError: print('EACCES')\n",
            str(containerd.nri_socket),
        ],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    assert nobody.stdout.strip() == "EACCES", nobody  # so the unit must run as root ...

    state_dir = tmp_path / "state"  # ... and StateDirectory= makes it root's, 0700
    state_dir.mkdir(mode=0o700)
    config = tmp_path / "config.toml"
    text = replace_once(CONFIG.read_text(), quoted("/var/lib/nri-cpuplugin"), quoted(state_dir))
    text = replace_once(text, quoted("/var/run/nri/nri.sock"), quoted(containerd.nri_socket))
    config.write_text(text)
    # The sandbox is what it claims to be (a probe in the same sandbox as the daemon below):
    probe = subprocess.run(
        [*sandbox(state_dir), sys.executable, "-c", PROBE, str(state_dir), str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    assert probe.stdout.split() == [
        "state:ok", "elsewhere:EROFS", "proc-stat:ENOENT", "wx:EACCES", "caps:0", "nnp:1",
    ], probe  # fmt: skip

    log = tmp_path / "daemon.log"
    with log.open("ab") as out:
        daemon = subprocess.Popen(
            [*sandbox(state_dir), *unit_command(config)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd="/",
            # systemd's clean environment; no journal here, so audit records go to stderr
            env={"PATH": "/usr/bin:/bin", "NRI_CPUPLUGIN_JOURNAL_SOCKET": "/nonexistent"},
        )  # fmt: skip
    try:
        wait_for(
            "the sandboxed daemon to synchronize with containerd",
            lambda: records(log, "synchronize") or daemon.poll() is not None,
        )
        assert daemon.poll() is None, log.read_text()[-3000:]
        status = status_fields(daemon.pid)  # unshare, sh, setpriv and python exec'd in place
        assert "nri-cpuplugin" in host.cmdline(daemon.pid).decode(errors="replace")
        for field in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh"):
            assert int(status[field], 16) == 0, (field, status[field])
        assert status["NoNewPrivs"] == "1"

        cri = containerd.cri()
        pod = cri.run("pinned", [ContainerSpec.guaranteed("p", 1, command=FIRST_LINE)])
        [line] = cri.wait_logs(pod["p"], 1)
        state = settled_state(state_dir)
        cpus = state["assignments"][pod["p"]]["cpus"]
        assert line == f"Cpus_allowed_list:\t{cpus}"
        assert host.read_cgroup(cri.cgroup_path(pod["p"]), "cpuset.cpus") == cpus
        [allocate] = records(log, "allocate")
        assert allocate["CPUS"] == cpus

        daemon.send_signal(signal.SIGTERM)  # systemctl stop; TimeoutStopSec=15s
        assert daemon.wait(15) == 0, log.read_text()[-3000:]
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
    assert (state_dir / "state.json").exists()  # the one writable place was enough
