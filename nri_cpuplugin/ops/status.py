"""``nri-cpuplugin status``: what the state file says, joined with the live topology.

Per exclusive container it also explains placement: the NUMA nodes of its NICs and whether its
CPUs are on them, and whether it is degraded (lost CPUs to hotplug that nothing replaced).

Reads without the lock and moves nothing (StateStore.peek), so it is safe next to a running
daemon or hooks: commits replace the file atomically, so the reader sees one whole document.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.cpuset import CPUSet
from ..core.topology import TopologyError, discover
from ..storage import owner
from ..storage.store import MISSING, StateStore


def snapshot(state_dir: str, sysfs: str) -> dict[str, Any]:
    store = StateStore(state_dir)
    result = store.peek()
    report: dict[str, Any] = {"state_file": str(store.state_path), "daemon": _daemon(state_dir)}
    if result.state is None:
        report.update(
            state="missing" if result.code == MISSING else "bad",
            problem=result.problem,
        )
        return report
    state = result.state
    try:
        topology = discover(sysfs)
    except TopologyError as err:
        topology = None
        report["topology_problem"] = str(err)
    numa_of = (lambda cpus: topology.numa_of(cpus)) if topology else (lambda cpus: CPUSet())
    assignments = [
        {
            "container_id": cid,
            "pod_namespace": a.pod_namespace,
            "pod_name": a.pod_name,
            "pod_uid": a.pod_uid,
            "container_name": a.container_name,
            "kind": a.kind,
            "cpus": str(a.cpus),
            "numa": str(numa_of(a.cpus)),
            "degraded": a.degraded,
            "lost": str(a.lost),
            "nics": list(a.nics),
            "nic_numa": str(a.nic_nodes),
            "nic_strict": a.nic_strict,
            "nic_honoured": _honoured(a.nic_nodes, numa_of(a.cpus), bool(a.cpus)),
        }
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
        earmarked={
            uid: {
                "cpus": str(e.cpus),
                "pod": f"{e.pod_namespace}/{e.pod_name}",
                "sandbox_id": e.sandbox_id,
                "cpu_limit_milli": e.limit_milli,
                "claimed_milli": e.claimed_milli,
            }
            for uid, e in sorted(state.earmarks.items())
        },
        shared_containers=len(state.sharing),
        assignments=assignments,
        degraded=[a for a in assignments if a["degraded"]],
    )
    if topology is not None:
        free = topology.online - topology.isolated - state.reserved - state.exclusive
        report["isolated"] = str(topology.isolated)
        report["numa"] = {
            str(node): {
                "cpus": str(cpus),
                "free_exclusive": str(free & cpus),
                "allocated": len(state.assigned & cpus),
            }
            for node, cpus in topology.numa_nodes.items()
        }
    return report


def _honoured(nic_nodes: CPUSet, numa: CPUSet, placed: bool) -> str:
    """ "yes"/"no" when the container's NICs gave a preference; "-" when they did not."""
    if not nic_nodes:
        return "-"
    if not placed or not numa:
        return "unknown"
    return "yes" if numa <= nic_nodes else "no"


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
    if report["state"] != "ok":
        return f"{report['problem']}\n"  # (every problem names the file)
    lines = [
        f"state file  {report['state_file']}  (policy {report['policy']})",
        _owner_line(report.get("daemon")),
        f"reserved    {report['reserved'] or '-'}",
        f"shared      {report['shared'] or '-'}  ({report['shared_containers']} containers)",
        f"exclusive   {report['exclusive'] or '-'}",
    ]
    for mark in report.get("earmarked", {}).values():
        lines.append(f"earmarked   {mark['cpus']}  for pod {mark['pod']} (starting)")
    if report.get("isolated"):
        lines.append(f"isolated    {report['isolated']}")
    for node, info in report.get("numa", {}).items():
        lines.append(
            f"numa {node:<6} cpus {info['cpus']}  free for exclusive use: "
            f"{info['free_exclusive'] or '-'}"
        )
    if report["assignments"]:
        lines.append("")
        lines.append(
            f"{'CPUS':<12} {'NUMA':<6} {'NIC-NUMA':<9} {'NEAR-NIC':<9} {'POD':<32} "
            f"{'CONTAINER':<20} ID"
        )
        for a in report["assignments"]:
            pod = f"{a['pod_namespace']}/{a['pod_name']}" if a["pod_name"] else a["pod_uid"]
            nic_numa = (a["nic_numa"] + ("!" if a["nic_strict"] else "")) or "-"
            lines.append(
                f"{a['cpus'] or '(shared)':<12} {a['numa'] or '-':<6} {nic_numa:<9} "
                f"{a['nic_honoured']:<9} {pod:<32} {a['container_name']:<20} "
                f"{a['container_id'][:13]}"
            )
        nics = [a for a in report["assignments"] if a["nics"]]
        if nics:
            lines.append("")
            lines.append("NICs (NIC-NUMA '!' = strict):")
            for a in nics:
                lines.append(f"  {a['container_name']}: {'; '.join(a['nics'])}")
    if report.get("degraded"):
        lines.append("")
        lines.append("DEGRADED (lost CPUs to hotplug, nothing free replaced them):")
        for a in report["degraded"]:
            pod = f"{a['pod_namespace']}/{a['pod_name']}" if a["pod_name"] else a["pod_uid"]
            runs = a["cpus"] or f"the shared pool {report['shared']}"
            lines.append(
                f"  {pod}/{a['container_name']} ({a['container_id'][:13]}): lost {a['lost']}, "
                f"runs on {runs} until it returns"
            )
    return "\n".join(lines) + "\n"
