"""The ``nri-cpuplugin`` command.

Exit codes (README.md, "Commands"): 0 success; 1 the request cannot be met (``allocate``: not
enough suitable CPUs; ``status``: no usable state file) or ``run`` cannot start (e.g. its state
lock is unusable); 2 bad input, usage or configuration (including a state directory that is not
ours alone); ``status`` also 3, 4 and 5 for the daemon's health (ops/health.py).  Errors are
one line on stderr that says what was wrong and what to do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .base import jsonbytes
from .base.errors import PluginError
from .core.allocator import KNOWN_OPTIONS, AllocationError, Allocator, OptionError
from .core.cpuset import CPUSet
from .core.policy import PolicyError
from .core.topology import DEFAULT_SYSFS, Topology, TopologyError, discover
from .hook.launcher import DEFAULT_PATH as DEFAULT_HOOK_PATH
from .ops.config import (
    DEFAULT_STATE_DIR,
    LOG_LEVELS,
    ConfigError,
    Settings,
    base_settings,
    flag_overrides,
    merge,
)

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    # What add_subparsers returns (a private argparse type: named only for the checker).
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_UNSATISFIABLE = 1
EXIT_USAGE = 2
# Reasons `run` cannot start that the operator fixes in the configuration or the node's setup
# (exit 2, like a bad flag): the state directory is unusable or not ours alone.
START_USAGE_CODES = ("state-dir", "launch")


class UsageError(PluginError):
    """Bad input from the command line; exit 2."""

    code = "usage"


def _cpulist(text: str) -> CPUSet:
    try:
        return CPUSet.parse(text)
    except ValueError as err:
        import argparse

        raise argparse.ArgumentTypeError(str(err)) from None


def _count(text: str) -> int:
    """A number of CPUs: a whole number, 0 or more (a negative count is bad input, exit 2)."""
    import argparse

    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count} is negative; expected 0 or more CPUs")
    return count


def load_topology(topology_file: str | None, sysfs: str | None) -> Topology:
    """Topology from ``topology --json`` output or from a sysfs root."""
    if topology_file is None:
        return discover(sysfs or DEFAULT_SYSFS)
    try:
        data = Path(topology_file).read_bytes() if topology_file != "-" else sys.stdin.buffer.read()
        return Topology.from_dict(jsonbytes.loads(data))
    except OSError as err:
        raise UsageError(f"cannot read topology file {topology_file}: {err.strerror}") from None
    except jsonbytes.DecodeError as err:
        raise UsageError(f"topology file {topology_file} is not JSON: {err}") from None


def cmd_topology(args: argparse.Namespace) -> int:
    topology = discover(args.sysfs)
    if args.json:
        sys.stdout.write(jsonbytes.dumps(topology.as_dict(), indent=True).decode())
        sys.stdout.write("\n")
        return 0
    print(
        f"online {topology.online or '-'}   offline {topology.offline or '-'}   "
        f"isolated {topology.isolated or '-'}   threads/core {topology.smt_width}"
    )
    for socket, socket_cpus in topology.sockets.items():
        print(f"socket {socket}: {socket_cpus}")
        for numa, numa_cpus in topology.numa_nodes.items():
            if numa_cpus & socket_cpus:
                print(f"  numa {numa}: {numa_cpus & socket_cpus}")
                for line in _llc_lines(topology, numa_cpus & socket_cpus):
                    print(line)
    return 0


def _llc_lines(topology: Topology, cpus: CPUSet) -> list[str]:
    """The LLC groups within ``cpus`` (a NUMA node's part of a socket) and their cores."""
    lines = []
    for llc, llc_cpus in topology.llc_groups.items():
        part = llc_cpus & cpus
        if part:
            cores = [c for c in topology.cores.values() if c & part]
            lines.append(f"    llc {llc}: {part}   cores: {' '.join(map(str, cores))}")
    return lines


def cmd_allocate(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology, args.sysfs)
    try:
        allocator = Allocator(topology, args.option)
    except OptionError as err:
        raise UsageError(str(err)) from None
    stray = (args.available | args.reserved) - topology.online
    if stray:
        raise UsageError(f"CPUs {stray} are not online in the topology (online: {topology.online})")
    available = args.available - args.reserved
    try:
        chosen = allocator.allocate(available, args.count)
    except AllocationError as err:
        print(f"nri-cpuplugin: {err}", file=sys.stderr)
        return EXIT_UNSATISFIABLE
    print(chosen)
    return 0


def _settings_from_args(args: argparse.Namespace) -> tuple[Settings, dict]:
    """(defaults + config file, flag overrides): flags win over the file and the runtime."""
    flags = flag_overrides(
        nri_socket=args.socket,
        state_dir=args.state_dir,
        reserved_cpus=args.reserved_cpus,
        sysfs=args.sysfs,
        log_level=args.log_level,
    )
    return base_settings(args.config), flags


def cmd_run(args: argparse.Namespace) -> int:
    # Imported here: the NRI stack (protobuf) is not needed by the other commands.
    import asyncio
    import logging
    import signal

    from . import __version__
    from .daemon.service import Daemon
    from .nri.stub import Stub
    from .ops import kubelet
    from .ops.audit import Audit

    base, flags = _settings_from_args(args)
    settings = merge(base, flags)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    kubelet.check(settings.kubelet_cpu_manager_state)  # kubelet's static policy: exit 2
    try:
        daemon = Daemon(base, Audit(), flags)
        stub = Stub.from_environment(
            daemon.adapter, settings.nri_name, settings.nri_index, settings.nri_socket,
            observe=daemon.observe_request,
        )  # fmt: skip
        daemon.stub = stub
        if stub.launched_fd is None:
            daemon.load_state()  # daemon: ready before the runtime is; launched: after Configure
    except (UsageError, TopologyError, ConfigError, PolicyError):
        raise  # main(): one line, exit 2
    except PluginError as err:
        # A state directory or lock that must not be used, and the like: one line naming the
        # file and what to do (systemd logs it), never a traceback.
        print(f"nri-cpuplugin: {err}", file=sys.stderr)
        return EXIT_USAGE if err.code in START_USAGE_CODES else EXIT_UNSATISFIABLE
    # Once it is sure to run (a refusal above is one line on stderr, nothing else).
    daemon.audit.record(
        "start", f"nri-cpuplugin {__version__} started (pid {os.getpid()})",
        version=__version__, pid=os.getpid(),
    )  # fmt: skip

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stub.stop)
        if stub.launched_fd is None:
            await daemon.start_metrics()  # launched: once the runtime's config is known
            daemon.start_hotplug()  # follow CPUs going offline/online even while disconnected
        beating = asyncio.create_task(daemon.heartbeat.run())
        try:
            await stub.run()
        finally:
            daemon.heartbeat.stop()
            await beating
            daemon.stop_hotplug()
            await daemon.drain()

    asyncio.run(serve())
    daemon.audit.record("shutdown", "nri-cpuplugin stopped; assignments stay in the state file")
    return 0


def cmd_install_hook(args: argparse.Namespace) -> int:
    from .hook.launcher import LauncherError, install

    try:
        install(args.path, args.python)
    except LauncherError as err:
        raise UsageError(str(err)) from None
    except OSError as err:
        # (files.FileError's message names the file and the reason; a bare OSError's does not)
        reason = str(err) if isinstance(err, PluginError) else f"{err.strerror or err}"
        prefix = "" if isinstance(err, PluginError) else f"cannot write {args.path}: "
        raise UsageError(prefix + reason) from None
    print(f"wrote {args.path}: the OCI hook, run by {args.python or sys.executable} -I -S")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .ops.status import command

    probe = "ready" if args.ready else "live" if args.live else ""
    return command(args.state_dir, args.sysfs, args.json, probe)


def cmd_version(args: argparse.Namespace) -> int:
    from . import __version__

    print(f"nri-cpuplugin {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import argparse  # here: `hook` never builds this parser (see main)

    from . import __version__

    parser = argparse.ArgumentParser(
        prog="nri-cpuplugin",
        description="Exclusive, topology-aware CPU sets for Kubernetes containers.",
        epilog="Exit status: 0 success; 1 the request cannot be met or the command failed; "
        "2 bad input, usage or configuration (`COMMAND --help` says more).",
    )
    parser.add_argument(
        "--version", action="version", version=f"nri-cpuplugin {__version__}",
        help="print the version and exit",
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_topology, _add_allocate, _add_run, _add_hook, _add_install_hook, _add_status):
        add(commands)
    commands.add_parser("version", help="print the version", epilog="Exit status: 0.").set_defaults(
        func=cmd_version
    )
    return parser


# One function per command: its options (each with help text), its exit statuses, its handler.


def _add_topology(commands: Subparsers) -> None:
    topo = commands.add_parser(
        "topology",
        help="show the CPU topology",
        epilog="Exit status: 0 shown; 2 the sysfs root cannot be read.",
    )
    topo.add_argument("--sysfs", default=DEFAULT_SYSFS, metavar="ROOT", help="sysfs root (/sys)")
    topo.add_argument(
        "--json", action="store_true", help="machine-readable output ('allocate --topology' input)"
    )
    topo.set_defaults(func=cmd_topology)


def _add_allocate(commands: Subparsers) -> None:
    alloc = commands.add_parser(
        "allocate",
        help="choose exclusive CPUs as the policy would",
        epilog="Exit status: 0 the chosen CPUs are printed; 1 the request cannot be met (the "
        "reason on stderr); 2 bad input (a malformed or negative value, CPUs that are not "
        "online, an unknown or refused option, an unreadable topology).",
    )
    source = alloc.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--topology", metavar="FILE", help="output of 'topology --json' (- = stdin)"
    )
    source.add_argument("--sysfs", metavar="ROOT", help="discover from this sysfs root")
    alloc.add_argument(
        "--available",
        type=_cpulist,
        required=True,
        metavar="LIST",
        help="CPUs free to choose from, in Linux list format (0-3,8)",
    )
    alloc.add_argument(
        "--count", type=_count, required=True, metavar="N", help="CPUs to choose (0: an empty line)"
    )
    alloc.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a kubelet CPU manager policy option, repeatable: {', '.join(KNOWN_OPTIONS)}",
    )
    alloc.add_argument(
        "--reserved", type=_cpulist, default=CPUSet(), metavar="LIST", help="never handed out"
    )
    alloc.set_defaults(func=cmd_allocate)


def _add_run(commands: Subparsers) -> None:
    run = commands.add_parser(
        "run",
        help="the NRI plugin daemon",
        epilog="Exit status: 0 stopped by SIGTERM or SIGINT; 1 cannot start for another reason "
        "(e.g. its state lock cannot be used); 2 bad configuration or options, or a state "
        "directory that is unsafe, unusable or claimed by another daemon.",
    )
    run.add_argument("--socket", metavar="PATH", help="runtime NRI socket (/var/run/nri/nri.sock)")
    run.add_argument("--config", metavar="FILE", help="TOML configuration")
    run.add_argument("--state-dir", metavar="DIR", help=f"state directory ({DEFAULT_STATE_DIR})")
    run.add_argument(
        "--reserved-cpus",
        type=_cpulist,
        metavar="LIST",
        help="CPUs kept for the system, never exclusive (instead of the configured ones)",
    )
    run.add_argument("--sysfs", metavar="ROOT", help="sysfs root for topology (/sys)")
    run.add_argument(
        "--log-level", choices=LOG_LEVELS, help="log messages from this level on (info)"
    )
    run.set_defaults(func=cmd_run)


def _add_hook(commands: Subparsers) -> None:
    # Listed for --help only: main() hands `hook ...` to hook.main before parsing (see there).
    commands.add_parser(
        "hook",
        add_help=False,
        help="OCI runtime hook for CRI-O/podman: the container state JSON on stdin "
        "(`nri-cpuplugin hook --help`)",
    )


def _add_install_hook(commands: Subparsers) -> None:
    launcher = commands.add_parser(
        "install-hook",
        help="write the OCI hook's launcher (the program hooks/*.json names)",
        description="Write the program hooks/*.json runs: this interpreter started with -I -S "
        "and this package's directory appended to its path - faster than the "
        "nri-cpuplugin-hook console script "
        "(no site-packages scan), and unaffected by PYTHON* variables.  Replaces the file or "
        "symlink at PATH in one rename.",
        epilog="Exit status: 0 written; 2 the launcher cannot be written at PATH.",
    )
    launcher.add_argument(
        "--path",
        default=DEFAULT_HOOK_PATH,
        metavar="PATH",
        help=f"where to write the launcher ({DEFAULT_HOOK_PATH})",
    )
    launcher.add_argument(
        "--python", metavar="PATH", help=f"interpreter to name (this one: {sys.executable})"
    )
    launcher.set_defaults(func=cmd_install_hook)


def _add_status(commands: Subparsers) -> None:
    status = commands.add_parser(
        "status",
        help="the daemon's health, and pools and assignments from the state file",
        epilog="Exit status: 0 the state is shown and the daemon, if one owns the state "
        "directory, is healthy; 1 there is no usable state file (missing, or unreadable: the "
        "message says why); 3 the daemon is not running; 4 it runs but is not registered "
        "with the runtime; 5 it is stale (its event loop or worker does not answer, or it "
        "lags behind the runtime's events).  With --ready or --live: 0 ready (live), else "
        "3, 4 or 5 as above.",
    )
    status.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        metavar="DIR",
        help=f"state directory ({DEFAULT_STATE_DIR})",
    )
    status.add_argument(
        "--sysfs",
        default=DEFAULT_SYSFS,
        metavar="ROOT",
        help="sysfs root for the free CPUs per NUMA node (/sys)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    probe = status.add_mutually_exclusive_group()
    probe.add_argument(
        "--ready",
        action="store_true",
        help="readiness probe: exit 0 only when the daemon is registered with the runtime "
        "and keeps up with its events",
    )
    probe.add_argument(
        "--live",
        action="store_true",
        help="liveness probe: exit 0 unless the daemon is not running or its event loop or "
        "worker does not answer",
    )
    status.set_defaults(func=cmd_status)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hook"]:
        # The hook starts once per container: it parses its own few options rather than pay
        # for this parser, and imports only what it needs (tests/system/test_hook_imports.py).
        from .hook import entry

        return entry.main(argv[1:])
    args = build_parser().parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except (UsageError, TopologyError, ConfigError, PolicyError) as err:
        print(f"nri-cpuplugin: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
