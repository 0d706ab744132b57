"""The OCI hook's process entry: ``nri-cpuplugin-hook`` (and ``nri-cpuplugin hook``).

CRI-O and podman (through runc or crun) run this program once per container event with the
container's state JSON on stdin (docs/cgroups-and-hooks.md).  This module parses the command
line and the configuration, picks the action from the stage, runs it (runner.py) and turns any
failure into one line on stderr and an exit status.  It is on the path of every container
start, so it imports only what it needs (tests/system/test_hook_imports.py).
"""

from __future__ import annotations

import os
import sys

from ..base import jsonbytes
from ..base.errors import PluginError, suppress
from ..core.cpuset import CPUSet
from ..core.events import ERR
from ..core.policy import PolicyError
from ..core.topology import TopologyError
from ..hardware import cgroupfs
from ..hardware.cgroupfs import CgroupError
from ..ops.audit import Audit
from ..ops.config import ConfigError, Settings, base_settings, flag_overrides, merge
from ..storage.store import StateLockTimeout
from . import oci
from .failure import EXIT_INPUT, EXIT_OK, EXIT_REFUSED, HookFailure
from .records import RECORDS_DIR
from .runner import DEFAULT_LOCK_TIMEOUT, FAULT_ENV, FAULT_STEPS, Hook, Options
from .topology_cache import TOPOLOGY_CACHE

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import BinaryIO, TextIO

__all__ = [
    "FAULT_ENV",
    "FAULT_STEPS",
    "RECORDS_DIR",
    "TOPOLOGY_CACHE",
    "Options",
    "main",
    "run",
]

ALLOCATE, RELEASE = "allocate", "release"
STAGES = {
    "createRuntime": ALLOCATE,
    "create-runtime": ALLOCATE,
    "prestart": ALLOCATE,
    "poststop": RELEASE,
}
# runc reports "creating" in createRuntime/prestart, crun "created"; both say "stopped" in
# poststop.
STATUSES = {"creating": ALLOCATE, "created": ALLOCATE, "stopped": RELEASE}


def action_for(stage: str | None, status: str) -> str:
    if stage is not None:
        try:
            return STAGES[stage]
        except KeyError:
            raise oci.InputError(
                f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}"
            ) from None
    try:
        return STATUSES[status]
    except KeyError:
        raise oci.InputError(
            f"cannot tell the hook stage from container status {status!r}; give it as an "
            "argument (createRuntime or poststop)"
        ) from None


def run(
    settings: Settings,
    options: Options,
    stdin: BinaryIO,
    stderr: TextIO,
    audit: Audit | None = None,
) -> int:
    """One hook invocation; returns the exit status.  Failures print one line on ``stderr``
    (the runtime shows it to whoever created the container) and leave an audit record."""
    audit = audit if audit is not None else Audit(SOURCE="oci-hook")
    cid = ""
    try:
        state = oci.read_state(stdin)
        cid = state.id
        hook = Hook(settings, options, audit)
        if action_for(options.stage, state.status) == ALLOCATE:
            return hook.allocate(state)
        return hook.release(state)
    except HookFailure as err:
        return _fail(stderr, audit, str(err), err.code, err.action, cid, **err.fields)
    except (oci.InputError, ConfigError, TopologyError) as err:
        return _fail(stderr, audit, str(err), EXIT_INPUT, "hook-input", cid)
    except PolicyError as err:  # configuration the policy cannot run with
        return _fail(stderr, audit, str(err), EXIT_INPUT, "hook-config", cid)
    except (CgroupError, StateLockTimeout, PluginError) as err:
        # (PluginError: files and the state directory; their messages name the file.)
        return _fail(
            stderr, audit, str(err), EXIT_REFUSED, "hook-failed", cid, reason_code=err.code
        )
    except OSError as err:
        where = err.filename or "(no file named by the system)"
        return _fail(stderr, audit, f"{where}: {err.strerror or err}", 1, "hook-failed", cid)
    except Exception as err:  # a bug must still fail as one line, not a traceback
        return _fail(
            stderr, audit, f"internal error: {type(err).__name__}: {err}", 1, "hook-failed", cid
        )


def _fail(
    stderr: TextIO, audit: Audit, reason: str, code: int, action: str, cid: str, **fields: object
) -> int:
    line = " ".join(reason.split())  # exactly one line, whatever the message held
    fields.setdefault("container_id", cid or None)
    with suppress(Exception):  # the reason on stderr matters more than the record
        audit.record(action, line, ERR, reason=line, **fields)
    stderr.write(f"nri-cpuplugin: {line}\n")
    stderr.flush()
    return code


USAGE = """\
usage: nri-cpuplugin-hook [--config FILE] [--state-dir DIR] [--reserved-cpus LIST]
                          [--sysfs ROOT] [--cgroup-root DIR] [--lock-timeout SECONDS] [STAGE]

Place (createRuntime) or release (poststop) the container whose OCI state JSON is on stdin,
writing cgroupfs directly.  Without STAGE it is read from the state's status (creating ->
createRuntime, stopped -> poststop).  Also run as `nri-cpuplugin hook`.

  STAGE                    createRuntime (also prestart) or poststop
  --config FILE            TOML configuration (the daemon's keys)
  --state-dir DIR          state directory (/var/lib/nri-cpuplugin)
  --reserved-cpus LIST     reserved CPUs, e.g. 0-1 (instead of the configured ones)
  --sysfs ROOT             sysfs root for the topology (/sys)
  --cgroup-root DIR        cgroup mount root (/sys/fs/cgroup; v1 or v2)
  --lock-timeout SECONDS   longest wait for the state lock (10; 0: fail at once when it
                           is held); keep it well below the hook's timeout

Exit status: 0 placed, released or left alone; 1 refused, or the state or the cgroups
could not be written; 2 bad input or configuration.
"""
# The hook parses its few options itself: argparse and the CLI's parser cost more start-up
# time than the rest of the hook's own code (docs/benchmarks.md, "OCI hook").
FLAGS = ("--config", "--state-dir", "--reserved-cpus", "--sysfs", "--cgroup-root", "--lock-timeout")


class UsageError(PluginError, ValueError):
    """Bad command line; the message says which argument and what is accepted."""

    code = "usage"


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, str]] | None:
    """(STAGE or None, {flag name without dashes: value}); None for --help."""
    stage: str | None = None
    values: dict[str, str] = {}
    args = iter(argv)
    options = True
    for arg in args:
        if options and arg in ("-h", "--help"):
            return None
        if options and arg == "--":
            options = False  # what follows is the STAGE, even if it starts with "-"
        elif options and arg.startswith("-") and arg != "-":
            flag, has_value, value = arg.partition("=")
            if flag not in FLAGS:
                raise UsageError(f"unknown option {flag}; options: {', '.join(FLAGS)}")
            if not has_value:
                following = next(args, None)
                if following is None or following.startswith("--"):  # a forgotten value
                    raise UsageError(f"{flag} needs a value ({flag}=VALUE if it starts with -)")
                value = following
            values[flag[2:]] = value
        elif stage is None:
            stage = arg
        else:
            raise UsageError(f"unexpected argument {arg!r}: only one STAGE is taken")
    return stage, values


def settings_and_options(
    stage: str | None, values: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[Settings, Options]:
    """Defaults, then the config file, then the flags (flags win)."""
    reserved = None
    if "reserved-cpus" in values:
        try:
            reserved = CPUSet.parse(values["reserved-cpus"])
        except ValueError as err:
            raise ConfigError(f"--reserved-cpus: {err}") from None
    flags = flag_overrides(
        state_dir=values.get("state-dir"), sysfs=values.get("sysfs"), reserved_cpus=reserved
    )
    lock_timeout = DEFAULT_LOCK_TIMEOUT
    if "lock-timeout" in values:
        try:
            lock_timeout = float(values["lock-timeout"])
        except ValueError:
            lock_timeout = -1.0
        if not 0 <= lock_timeout < float("inf"):
            raise ConfigError(
                f"--lock-timeout {values['lock-timeout']!r}: expected a number of seconds >= 0"
            )
    options = Options(
        stage=stage,
        cgroup_root=values.get("cgroup-root") or cgroupfs.DEFAULT_ROOT,
        lock_timeout=lock_timeout,
        fault=environ.get(FAULT_ENV) or None,
    )
    return merge(base_settings(values.get("config")), flags), options


def main(argv: list[str] | None = None) -> int:
    """``nri-cpuplugin-hook`` (and ``nri-cpuplugin hook``)."""
    jsonbytes.use_stdlib()  # a new process per container start: start-up time matters most
    try:
        parsed = parse_args(sys.argv[1:] if argv is None else argv)
        if parsed is None:
            sys.stdout.write(USAGE)
            return EXIT_OK
        settings, options = settings_and_options(*parsed, os.environ)
    except (UsageError, ConfigError) as err:
        return _fail(sys.stderr, Audit(SOURCE="oci-hook"), str(err), EXIT_INPUT, "hook-config", "")
    return run(settings, options, sys.stdin.buffer, sys.stderr)


def launch() -> None:
    """The entry of the launcher ``nri-cpuplugin install-hook`` writes (hook_launcher.py): ``main``,
    then exit without the interpreter's teardown (~3 ms of module and object cleanup): by then
    the state is committed and fsynced, the cgroups are written, the audit records are sent,
    and the standard streams are flushed here."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
