"""NRI transport benchmarks on the plugin side (no runtime process involved)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from fake_runtime import FakeRuntime

from nri_cpuplugin.nri import connection as wire
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.stub import Stub

from .scratch import scratch
from .stats import summary


def realistic_pod(i: int = 0) -> pb.PodSandbox:
    uid = f"5b7c9f1e-{i:04d}-4c1a-9d2e-3f4a5b6c7d8e"
    pod = pb.PodSandbox(
        id=f"{i:064x}", name=f"checkout-api-7d9f8c6b5-{i:05d}", uid=uid, namespace="payments"
    )
    for k in range(15):
        pod.labels[f"app.kubernetes.io/label-{k}"] = f"value-{k}-{i}"
    for k in range(30):
        pod.annotations[f"example.com/annotation-{k}"] = f"some annotation value number {k}"
    pod.annotations["io.kubernetes.cri.sandbox-cpu-shares"] = "2048"
    pod.linux.cgroup_parent = f"/kubepods/pod{uid}"
    pod.linux.cgroups_path = f"/kubepods/pod{uid}/{i:064x}"
    for kind in ("ipc", "uts", "network", "pid", "mount"):
        pod.linux.namespaces.add(type=kind, path=f"/proc/{1000 + i}/ns/{kind}")
    pod.pid = 1000 + i
    return pod


def realistic_container(pod: pb.PodSandbox, i: int = 0) -> pb.Container:
    c = pb.Container(id=f"{i + 10**6:064x}", pod_sandbox_id=pod.id, name="api", state=3)
    for key, value in (
        ("io.kubernetes.pod.name", pod.name),
        ("io.kubernetes.pod.namespace", pod.namespace),
        ("io.kubernetes.pod.uid", pod.uid),
        ("io.kubernetes.container.name", "api"),
    ):
        c.labels[key] = value
    for k in range(30):
        c.annotations[f"example.com/container-annotation-{k}"] = f"value {k} " * 3
    c.args.extend(["/usr/local/bin/checkout-api", "--port=8080", "--log-level=info"])
    c.env.extend(f"ENV_VAR_{k}=some-value-{k}" for k in range(20))
    for k in range(10):
        c.mounts.add(
            destination=f"/var/run/secrets/mount-{k}",
            type="bind",
            source=f"/var/lib/kubelet/pods/{pod.uid}/volumes/mount-{k}",
            options=["rbind", "rprivate", "ro"],
        )
    cpu = c.linux.resources.cpu
    cpu.shares.value, cpu.quota.value, cpu.period.value = 2048, 200000, 100000
    c.linux.resources.memory.limit.value = 2 << 30
    c.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{c.id}"
    c.pid = 2000 + i
    return c


class NoOp:
    def create_container(self, pod, container):
        return None, []

    def synchronize(self, pods, containers):
        return []


def bench_create_decode_encode(rounds: int = 3000) -> dict:
    """Bytes of a realistic CreateContainer request in -> no-op handler -> response bytes out,
    through the sans-I/O connection and the stub's dispatch (no socket)."""
    pod = realistic_pod()
    request = pb.CreateContainerRequest(pod=pod, container=realistic_container(pod))
    runtime = wire.Connection(runtime=True)
    stub = Stub(NoOp(), "bench", "50", socket_path="/nonexistent")
    samples = []

    async def loop() -> None:
        plugin_conn = wire.Connection()
        for _ in range(rounds):
            _, data = runtime.send_request(
                "nri.pkg.api.v1alpha1.Plugin", "CreateContainer", request.SerializeToString()
            )
            start = time.perf_counter()
            [event] = plugin_conn.receive_data(data)
            payload = await stub._create_container(event.payload)
            out = plugin_conn.send_response(event.stream_id, payload)
            samples.append(time.perf_counter() - start)
            runtime.receive_data(out)

    asyncio.run(loop())
    return {"request_bytes": request.ByteSize(), **summary(samples)}


def bench_synchronize(n_containers: int = 1000, rounds: int = 20) -> dict:
    """A FAKE runtime (our codecs, real wire format, real unix socket) sends Synchronize with
    ``n_containers`` realistic containers and their pods, split into chunks below ttrpc's
    4 MiB limit as NRI >= 0.8 does; time from the first chunk sent to the final reply decoded
    (includes the runtime side's encoding, as a real runtime would spend it too)."""
    pods = [realistic_pod(i) for i in range(n_containers)]
    containers = [realistic_container(p, i) for i, p in enumerate(pods)]
    total = pb.SynchronizeRequest(pods=pods, containers=containers).ByteSize()
    # Like NRI >= 0.8: above ttrpc's 4 MiB the state goes in chunks marked "more".
    per_item = total / (2 * n_containers)
    chunk = max(1, int(3 * 1024 * 1024 / per_item))
    samples = []

    async def run(path: Path) -> None:
        runtime = FakeRuntime(path)
        await runtime.start()
        stub = Stub(NoOp(), "bench", "50", socket_path=str(path))
        task = asyncio.create_task(stub.run())
        await asyncio.wait_for(stub.connected.wait(), 10)
        for _ in range(rounds):
            start = time.perf_counter()
            await runtime.synchronize(pods, containers, chunk=chunk)
            samples.append(time.perf_counter() - start)
        stub.stop()
        await runtime.close()
        await task

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(Path(tmp) / "nri.sock"))
    chunks = -(-2 * n_containers // chunk)
    return {"state_bytes": total, "chunks": chunks, "containers": n_containers, **summary(samples)}


def bench_plugin_handlers(
    rounds: int = 500, synchronized: bool = False, earmarked: bool = False
) -> dict:
    """The CPU plugin daemon's own CreateContainer and StopContainer handlers (the hand-off to
    its worker thread, policy, durable state commit with fsync, audit record, reply), awaited
    on the event loop as the stub does, on this machine's topology, with one shared neighbour
    to update each time.  Until the answer: with ``synchronized`` (the runtime has listed its
    containers) an exclusive creation is answered before its commit; without, after it.  What
    follows the answer is waited for between requests, outside the figures.  ``earmarked``:
    each creation is in a new pod whose sandbox started with its 1-CPU limit (RunPodSandbox,
    outside the figures), so it takes the pod's earmark and is answered from it; no shared
    neighbour (the earmark moved it already)."""
    from nri_cpuplugin.daemon.service import Daemon
    from nri_cpuplugin.ops.audit import Audit
    from nri_cpuplugin.ops.config import Settings

    samples: dict[str, list[float]] = {"create_container": [], "stop_container": []}

    async def run(tmp: str) -> None:
        daemon = Daemon(Settings(state_dir=tmp, reserved_cpu_count=1), Audit(lambda r: None))
        try:
            await measure(daemon)
        finally:
            daemon.stop_hotplug()
            daemon.release_claim()

    async def measure(daemon: Daemon) -> None:
        nri = daemon.adapter
        await nri.configure("", "bench", "v0")
        if synchronized:
            await nri.synchronize([], [])
        if not earmarked:  # (whose cgroup this bench cannot write: its update would be owed)
            burstable = realistic_pod(1)
            burstable.linux.cgroup_parent = f"/kubepods/burstable/pod{burstable.uid}"
            await nri.create_container(burstable, realistic_container(burstable, 1))
        pod = realistic_pod(2)
        for i in range(rounds):
            if earmarked:
                pod = realistic_pod(10 + i)
                cpu = pod.linux.pod_resources.cpu
                cpu.shares.value, cpu.quota.value, cpu.period.value = 1024, 100000, 100000
                await nri.run_pod_sandbox(pod)
            container = realistic_container(pod, 10 + i)
            container.linux.resources.cpu.shares.value = 1024
            container.linux.resources.cpu.quota.value = 100000
            start = time.perf_counter()
            adjust, _ = await nri.create_container(pod, container)
            samples["create_container"].append(time.perf_counter() - start)
            assert adjust.linux.resources.cpu.cpus
            await daemon.drain()
            start = time.perf_counter()
            await nri.stop_container(pod, container)
            samples["stop_container"].append(time.perf_counter() - start)
            await nri.remove_container(pod, container)
            if earmarked:
                await nri.remove_pod_sandbox(pod)
            await daemon.drain()

    with scratch() as tmp:
        asyncio.run(run(tmp))
    return {name: summary(values) for name, values in samples.items()}
