"""The ``nri-cpuplugin`` command.

Exit codes: 0 success; 1 the request cannot be met (e.g. not enough CPUs); 2 bad input or usage.
Errors are one line on stderr that says what was wrong and what to do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import orjson

from .allocator import KNOWN_OPTIONS, AllocationError, Allocator, OptionError
from .cpuset import CPUSet
from .topology import DEFAULT_SYSFS, Topology, TopologyError, discover

EXIT_UNSATISFIABLE = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the command line; exit 2."""


def _cpulist(text: str) -> CPUSet:
    try:
        return CPUSet.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def load_topology(topology_file: str | None, sysfs: str | None) -> Topology:
    """Topology from ``topology --json`` output or from a sysfs root."""
    if topology_file is None:
        return discover(sysfs or DEFAULT_SYSFS)
    try:
        data = Path(topology_file).read_bytes() if topology_file != "-" else sys.stdin.buffer.read()
        return Topology.from_dict(orjson.loads(data))
    except OSError as err:
        raise UsageError(f"cannot read topology file {topology_file}: {err.strerror}") from None
    except orjson.JSONDecodeError as err:
        raise UsageError(f"topology file {topology_file} is not JSON: {err}") from None


def cmd_topology(args: argparse.Namespace) -> int:
    topology = discover(args.sysfs)
    if args.json:
        sys.stdout.write(orjson.dumps(topology.as_dict(), option=orjson.OPT_INDENT_2).decode())
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
                for llc, llc_cpus in topology.llc_groups.items():
                    part = llc_cpus & numa_cpus & socket_cpus
                    if part:
                        cores = [c for c in topology.cores.values() if c & part]
                        print(f"    llc {llc}: {part}   cores: {' '.join(map(str, cores))}")
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nri-cpuplugin",
        description="Exclusive, topology-aware CPU sets for Kubernetes containers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    topo = commands.add_parser("topology", help="show the CPU topology")
    topo.add_argument("--sysfs", default=DEFAULT_SYSFS, metavar="ROOT", help="sysfs root (/sys)")
    topo.add_argument("--json", action="store_true", help="machine-readable output")
    topo.set_defaults(func=cmd_topology)

    alloc = commands.add_parser("allocate", help="choose exclusive CPUs as the policy would")
    source = alloc.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--topology", metavar="FILE", help="output of 'topology --json' (- = stdin)"
    )
    source.add_argument("--sysfs", metavar="ROOT", help="discover from this sysfs root")
    alloc.add_argument("--available", type=_cpulist, required=True, metavar="LIST")
    alloc.add_argument("--count", type=int, required=True, metavar="N")
    alloc.add_argument(
        "--option", action="append", default=[], metavar="NAME", help=", ".join(KNOWN_OPTIONS)
    )
    alloc.add_argument(
        "--reserved", type=_cpulist, default=CPUSet(), metavar="LIST", help="never handed out"
    )
    alloc.set_defaults(func=cmd_allocate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, TopologyError) as err:
        print(f"nri-cpuplugin: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
