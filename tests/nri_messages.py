"""NRI messages as the runtime would send them for kubelet's pods (builders for tests)."""

from __future__ import annotations

from nri_cpuplugin.nri.pb import nri_pb2 as pb


def pod(name: str, qos: str = "guaranteed") -> pb.PodSandbox:
    parent = {
        "guaranteed": f"/kubepods/pod{name}",
        "burstable": f"/kubepods/burstable/pod{name}",
        "besteffort": f"/kubepods/besteffort/pod{name}",
    }[qos]
    sandbox = pb.PodSandbox(id=f"sb-{name}", name=name, uid=f"uid-{name}", namespace="ns")
    sandbox.linux.cgroup_parent = parent
    return sandbox


def guaranteed_pod(name: str, milli: int) -> pb.PodSandbox:
    """A Guaranteed pod whose sandbox carries its CPU limit of ``milli`` (kubelet sends the
    sum over its containers; NRI passes it on as ``pod_resources``)."""
    sandbox = pod(name)
    cpu = sandbox.linux.pod_resources.cpu
    cpu.shares.value = milli * 1024 // 1000
    cpu.period.value, cpu.quota.value = 100000, milli * 100
    return sandbox


def container(name: str, sandbox: pb.PodSandbox, milli: int, state: int = 3, cpus: str = ""):
    c = pb.Container(id=f"{name:0<64}", pod_sandbox_id=sandbox.id, name=name, state=state)
    c.linux.resources.cpu.shares.value = max(2, milli * 1024 // 1000)
    c.linux.resources.cpu.period.value = 100000
    c.linux.resources.cpu.quota.value = milli * 100
    c.linux.resources.cpu.cpus = cpus
    return c
