"""``nri-cpuplugin status``: what the state file says, joined with the live topology.

Per exclusive container it also explains placement: the NUMA nodes of its NICs and whether its
CPUs are on them, and whether it is degraded (lost CPUs to hotplug that nothing replaced).

Reads without the lock and moves nothing (StateStore.peek), so it is safe next to a running
daemon or hooks: commits replace the file atomically, so the reader sees one whole document.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .. import __version__
from ..base import jsonbytes
from ..core.cpuset import CPUSet
from ..core.irq import DEFAULT, keep_free
from ..core.state import Assignment, Earmark, NodeState
from ..core.topology import Topology, TopologyError, discover
from ..storage import owner
from ..storage.store import MISSING, StateStore
from . import health

# ``status``'s exit codes besides the daemon's health (ops/health.py: 0, 3, 4, 5).
EXIT_NO_STATE = 1


def command(state_dir: str, sysfs: str, as_json: bool, probe: str = "") -> int:
    """``nri-cpuplugin status``: its output and exit code.  ``probe`` ("ready" or "live"): the
    daemon's health only (no state file, no topology), in one line."""
    import sys

    if probe:
        verdict = daemon_health(state_dir)
        what = "live" if probe == "live" else "ready"
        if not verdict[what]:
            print(f"nri-cpuplugin: not {what}: {verdict['message']}", file=sys.stderr)
            return int(verdict["exit_code"])
        print(f"{what}: {verdict['message']}")
        return 0
    report = snapshot(state_dir, sysfs)
    if as_json:
        sys.stdout.write(jsonbytes.dumps(report, indent=True).decode() + "\n")
    else:
        sys.stdout.write(render_text(report))
    for problem in problems(report):
        print(f"nri-cpuplugin: {problem}", file=sys.stderr)
    return exit_code(report)


def snapshot(state_dir: str, sysfs: str) -> dict[str, Any]:
    store = StateStore(state_dir)
    result = store.peek()
    daemon = _daemon(state_dir)
    report: dict[str, Any] = {
        "version": __version__,
        "state_file": str(store.state_path),
        "daemon": daemon,
        "health": daemon_health(state_dir, daemon),
    }
    if result.state is None:
        report.update(
            state="missing" if result.code == MISSING else "bad",
            problem=result.problem,
        )
        return report
    state = result.state
    try:
        topology: Topology | None = discover(sysfs)
    except TopologyError as err:
        topology = None
        report["topology_problem"] = str(err)
    assignments = [
        _assignment(cid, a, topology)
        for cid, a in sorted(
            state.assignments.items(),
            key=lambda item: (min(item[1].cpus | item[1].lost), item[0]),
        )
    ]
    report.update(
        state="ok",
        policy=state.policy,
        reserved=str(state.reserved),
        shared=str(state.shared),
        shared_pool_millicores=len(state.shared) * 1000,
        exclusive=str(state.assigned),
        exclusive_cpu_count=len(state.assigned),
        earmarked={uid: _earmark(e) for uid, e in sorted(state.earmarks.items())},
        interrupt_free=str(keep_free(state)),
        interrupts_narrowed=len([n for n in state.irqs if n != DEFAULT]),
        shared_containers=len(state.sharing),
        assignments=assignments,
        degraded=[a for a in assignments if a["degraded"]],
    )
    if topology is not None:
        report.update(_free_per_node(state, topology))
    return report


def _assignment(cid: str, a: Assignment, topology: Topology | None) -> dict[str, Any]:
    numa = topology.numa_of(a.cpus) if topology is not None else CPUSet()
    return {
        "container_id": cid,
        "pod_namespace": a.pod_namespace,
        "pod_name": a.pod_name,
        "pod_uid": a.pod_uid,
        "container_name": a.container_name,
        "kind": a.kind,
        "cpus": str(a.cpus),
        "numa": str(numa),
        "degraded": a.degraded,
        "lost": str(a.lost),
        "nics": list(a.nics),
        "nic_numa": str(a.nic_nodes),
        "nic_strict": a.nic_strict,
        "nic_honoured": _honoured(a.nic_nodes, numa, bool(a.cpus)),
        "interrupt_free": a.irq_free,
    }


def _earmark(e: Earmark) -> dict[str, Any]:
    return {
        "cpus": str(e.cpus),
        "pod": f"{e.pod_namespace}/{e.pod_name}",
        "sandbox_id": e.sandbox_id,
        "cpu_limit_milli": e.limit_milli,
        "claimed_milli": e.claimed_milli,
    }


def _free_per_node(state: NodeState, topology: Topology) -> dict[str, Any]:
    """The isolated CPUs, and per NUMA node its CPUs, those free for exclusive use and how
    many are allocated."""
    free = topology.online - topology.isolated - state.reserved - state.exclusive
    return {
        "isolated": str(topology.isolated),
        "numa": {
            str(node): {
                "cpus": str(cpus),
                "free_exclusive": str(free & cpus),
                "allocated": len(state.assigned & cpus),
            }
            for node, cpus in topology.numa_nodes.items()
        },
    }


def _honoured(nic_nodes: CPUSet, numa: CPUSet, placed: bool) -> str:
    """ "yes"/"no" when the container's NICs gave a preference; "-" when they did not."""
    if not nic_nodes:
        return "-"
    if not placed or not numa:
        return "unknown"
    return "yes" if numa <= nic_nodes else "no"


def daemon_health(state_dir: str, daemon: dict[str, Any] | None = None) -> dict[str, Any]:
    """The verdict on the daemon that owns ``state_dir`` (ops/health.py), and what it said."""
    if daemon is None:
        daemon = _daemon(state_dir)
    running = None if daemon is None else daemon["running"]
    pid = None if daemon is None else daemon["pid"]
    said = health.read(state_dir) if running else None
    verdict = health.judge(running, pid, said, time.time())
    return {
        "verdict": verdict.verdict,
        "message": verdict.message,
        "live": verdict.live,
        "ready": verdict.ready,
        "exit_code": verdict.exit_code,
        "daemon_version": (said or {}).get("version"),
        "report": said,
    }


def exit_code(report: dict[str, Any]) -> int:
    """0 when all is well; else the daemon's health code when a daemon owns the directory
    and is not healthy, else 1 when there is no usable state file."""
    verdict = report["health"]
    if report["daemon"] is not None and verdict["exit_code"]:
        return int(verdict["exit_code"])
    return 0 if report["state"] == "ok" else EXIT_NO_STATE


def problems(report: dict[str, Any]) -> list[str]:
    """What is wrong, one line each (for stderr)."""
    found = []
    if report["daemon"] is not None and report["health"]["exit_code"]:
        found.append(report["health"]["message"])
    if report["state"] != "ok":
        found.append(report["problem"])  # (every problem names the file)
    if report.get("topology_problem"):
        found.append(f"free CPUs per NUMA node not shown: {report['topology_problem']}")
    return found


def _daemon(state_dir: str) -> dict[str, Any] | None:
    """Whether an NRI daemon owns the state directory (storage/owner.py): then it places the
    node's containers and an OCI hook on the node stands aside."""
    try:
        dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        claim = owner.probe(dir_fd, state_dir)
    finally:
        os.close(dir_fd)
    return None if claim is None else {"pid": claim.pid, "running": claim.running}


def _owner_line(daemon: dict[str, Any] | None) -> str:
    if daemon is None:
        return "daemon      none has claimed this state directory (OCI hook mode)"
    pid = f"pid {daemon['pid']}" if daemon["pid"] else "pid unknown"
    if daemon["running"]:
        return f"daemon      {pid}, running: it places containers; an OCI hook here stands aside"
    return f"daemon      {pid}, NOT RUNNING: nothing pins new containers until it is back"


def render_text(report: dict[str, Any]) -> str:
    lines = _daemon_lines(report)
    if report["state"] != "ok":
        return "\n".join(lines) + "\n"  # the problem goes to stderr (problems())
    lines += _pool_lines(report)
    if report["assignments"]:
        lines += ["", *_assignment_lines(report["assignments"])]
    if report.get("degraded"):
        lines += ["", *_degraded_lines(report["degraded"], report["shared"])]
    return "\n".join(lines) + "\n"


def _daemon_lines(report: dict[str, Any]) -> list[str]:
    verdict = report["health"]
    running = verdict["daemon_version"]
    version = f"version     {report['version']}"
    if running:
        version += f" (the daemon runs {running})"
    lines = [version, _owner_line(report.get("daemon"))]
    if report.get("daemon") is not None:
        lines.append(f"health      {verdict['verdict']}: {verdict['message']}")
    return lines


def _pool_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        f"state file  {report['state_file']}  (policy {report['policy']})",
        f"reserved    {report['reserved'] or '-'}",
        f"shared      {report['shared'] or '-'}  ({report['shared_containers']} containers)",
        f"exclusive   {report['exclusive'] or '-'}",
    ]
    for mark in report.get("earmarked", {}).values():
        lines.append(f"earmarked   {mark['cpus']}  for pod {mark['pod']} (starting)")
    if report.get("interrupt_free"):
        lines.append(
            f"irq-free    {report['interrupt_free']}  ({report['interrupts_narrowed']} "
            "interrupts kept off them)"
        )
    if report.get("isolated"):
        lines.append(f"isolated    {report['isolated']}")
    for node, info in report.get("numa", {}).items():
        lines.append(
            f"numa {node:<6} cpus {info['cpus']}  free for exclusive use: "
            f"{info['free_exclusive'] or '-'}"
        )
    return lines


def _assignment_lines(assignments: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'CPUS':<12} {'NUMA':<6} {'NIC-NUMA':<9} {'NEAR-NIC':<9} {'POD':<32} {'CONTAINER':<20} ID"
    ]
    for a in assignments:
        nic_numa = (a["nic_numa"] + ("!" if a["nic_strict"] else "")) or "-"
        lines.append(
            f"{a['cpus'] or '(shared)':<12} {a['numa'] or '-':<6} {nic_numa:<9} "
            f"{a['nic_honoured']:<9} {_pod(a):<32} {a['container_name']:<20} "
            f"{a['container_id'][:13]}"
        )
    nics = [a for a in assignments if a["nics"]]
    if nics:
        lines += ["", "NICs (NIC-NUMA '!' = strict):"]
        lines += [f"  {a['container_name']}: {'; '.join(a['nics'])}" for a in nics]
    return lines


def _degraded_lines(degraded: list[dict[str, Any]], shared: str) -> list[str]:
    lines = ["DEGRADED (lost CPUs to hotplug, nothing free replaced them):"]
    for a in degraded:
        runs = a["cpus"] or f"the shared pool {shared}"
        lines.append(
            f"  {_pod(a)}/{a['container_name']} ({a['container_id'][:13]}): lost {a['lost']}, "
            f"runs on {runs} until it returns"
        )
    return lines


def _pod(a: dict[str, Any]) -> str:
    return f"{a['pod_namespace']}/{a['pod_name']}" if a["pod_name"] else a["pod_uid"]
