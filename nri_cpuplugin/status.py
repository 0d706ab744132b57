"""``nri-cpuplugin status``: what the state file says, joined with the live topology.

Reads without the lock and moves nothing (StateStore.peek), so it is safe next to a running
daemon or hooks: commits replace the file atomically, so the reader sees one whole document.
"""

from __future__ import annotations

from typing import Any

from .cpuset import CPUSet
from .store import StateStore
from .topology import TopologyError, discover


def snapshot(state_dir: str, sysfs: str) -> dict[str, Any]:
    store = StateStore(state_dir)
    result = store.peek()
    report: dict[str, Any] = {"state_file": str(store.state_path)}
    if result.state is None:
        report.update(
            state="missing" if "no state file" in (result.problem or "") else "bad",
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
        }
        for cid, a in sorted(
            state.assignments.items(), key=lambda item: (min(item[1].cpus), item[0])
        )
    ]
    report.update(
        state="ok",
        policy=state.policy,
        reserved=str(state.reserved),
        shared=str(state.shared),
        shared_pool_millicores=len(state.shared) * 1000,
        exclusive=str(state.exclusive),
        exclusive_cpu_count=len(state.exclusive),
        shared_containers=len(state.sharing),
        assignments=assignments,
    )
    if topology is not None:
        free = topology.online - topology.isolated - state.reserved - state.exclusive
        report["isolated"] = str(topology.isolated)
        report["numa"] = {
            str(node): {
                "cpus": str(cpus),
                "free_exclusive": str(free & cpus),
                "allocated": len(state.exclusive & cpus),
            }
            for node, cpus in topology.numa_nodes.items()
        }
    return report


def render_text(report: dict[str, Any]) -> str:
    if report["state"] != "ok":
        return f"state file {report['state_file']}: {report['problem']}\n"
    lines = [
        f"state file  {report['state_file']}  (policy {report['policy']})",
        f"reserved    {report['reserved'] or '-'}",
        f"shared      {report['shared'] or '-'}  ({report['shared_containers']} containers)",
        f"exclusive   {report['exclusive'] or '-'}",
    ]
    if report.get("isolated"):
        lines.append(f"isolated    {report['isolated']}")
    for node, info in report.get("numa", {}).items():
        lines.append(
            f"numa {node:<6} cpus {info['cpus']}  free for exclusive use: "
            f"{info['free_exclusive'] or '-'}"
        )
    if report["assignments"]:
        lines.append("")
        lines.append(f"{'CPUS':<12} {'NUMA':<6} {'POD':<40} {'CONTAINER':<20} ID")
        for a in report["assignments"]:
            pod = f"{a['pod_namespace']}/{a['pod_name']}" if a["pod_name"] else a["pod_uid"]
            lines.append(
                f"{a['cpus']:<12} {a['numa']:<6} {pod:<40} {a['container_name']:<20} "
                f"{a['container_id'][:13]}"
            )
    return "\n".join(lines) + "\n"
