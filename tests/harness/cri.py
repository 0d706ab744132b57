"""A small CRI client that drives containerd the way kubelet does, for the e2e tests.

The gRPC stubs are generated (once, cached in the lab directory) with grpcio-tools from the real
CRI ``api.proto`` in Debian's cri-api package, so requests are exactly what kubelet sends on
the wire.  The proto imports gogoproto only for Go code-generation options; those lines are
dropped before compiling.

Tests describe workloads with :class:`PodSpec` / :class:`ContainerSpec` (``k8s.py``, re-exported
here) in Kubernetes terms; :class:`CRIClient` turns them into the CRI requests kubelet would send
(cpu shares, CFS quota, cgroup parent per QoS class, kubelet labels and annotations, OOM score).
Pods use the host network (no CNI) and one PID namespace per container unless shared.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, NamedTuple

from . import debs, host
from .k8s import (
    BESTEFFORT,
    BURSTABLE,
    CFS_PERIOD_US,
    GUARANTEED,
    ContainerSpec,
    PodSpec,
    memory_bytes,
    milli_to_quota,
    milli_to_shares,
    oom_score_adj,
    qos_class,
    qos_from_cgroup_parent,
)
from .packages import CRI_API

# Re-exported: tests import the workload types together with the client.
__all__ = [
    "BESTEFFORT",
    "BURSTABLE",
    "GUARANTEED",
    "CRIClient",
    "CRIError",
    "ContainerRef",
    "ContainerSpec",
    "Inspect",
    "PodRef",
    "PodSpec",
    "RunningPod",
    "memory_bytes",
    "milli_to_quota",
    "milli_to_shares",
    "parse_cri_log",
    "qos_class",
    "stubs",
]

_PROTO = "usr/share/gocode/src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto"
# The generated modules live in a package with an unmistakable name: the gRPC module imports
# its messages as ``from <package> import api_pb2``, and a bare ``api_pb2`` could collide.
_STUB_PACKAGE = "nri_e2e_cri_v1"


class CRIError(RuntimeError):
    """A CRI call failed; the message names the call, the gRPC status and the runtime's text."""

    def __init__(self, method: str, code: str, details: str) -> None:
        super().__init__(f"CRI {method} failed: {code}: {details}")
        self.method, self.code, self.details = method, code, details


# --------------------------------------------------------------------------------------------
# Stubs


def stubs(lab: Path = debs.LAB) -> SimpleNamespace:
    """The CRI messages (``.pb``) and gRPC stubs (``.grpc``), generated once and imported."""
    if _STUB_PACKAGE in sys.modules:
        return SimpleNamespace(
            pb=sys.modules[f"{_STUB_PACKAGE}.api_pb2"],
            grpc=sys.modules[f"{_STUB_PACKAGE}.api_pb2_grpc"],
        )
    out = _generate(lab)
    pkg_dir = out / _STUB_PACKAGE
    spec = importlib.util.spec_from_file_location(
        _STUB_PACKAGE, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[_STUB_PACKAGE] = package
    spec.loader.exec_module(package)
    return SimpleNamespace(
        pb=importlib.import_module(f"{_STUB_PACKAGE}.api_pb2"),
        grpc=importlib.import_module(f"{_STUB_PACKAGE}.api_pb2_grpc"),
    )


def _generate(lab: Path) -> Path:
    # The generated code embeds the protoc version and checks it against protobuf at import,
    # so the cache is keyed by the grpcio-tools version as well as the proto's.
    tools = importlib.metadata.version("grpcio-tools")
    out = lab / "cri-stubs" / f"cri-api-{CRI_API.version}_grpcio-tools-{tools}"
    if (out / ".done").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / ".done").exists():
            return out
        from grpc_tools import protoc  # only needed on a cold cache

        source = (debs.unpack(CRI_API, lab) / _PROTO).read_text()
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        (partial / _STUB_PACKAGE).mkdir(parents=True)
        (partial / _STUB_PACKAGE / "__init__.py").write_text('"""Generated CRI stubs."""\n')
        (partial / _STUB_PACKAGE / "api.proto").write_text(
            "".join(line for line in source.splitlines(True) if "gogo" not in line)
        )
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{partial}",
                f"-I{include}",
                f"--python_out={partial}",
                f"--grpc_python_out={partial}",
                f"{partial}/{_STUB_PACKAGE}/api.proto",
            ]
        )
        if rc:
            raise RuntimeError(f"grpc_tools.protoc failed (exit {rc}) on the CRI api.proto")
        (partial / ".done").touch()
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out


class Inspect(NamedTuple):
    """What ``ContainerStatus(verbose)`` says about the live container: its init pid and the
    OCI runtime spec it was created with (after NRI adjustments, unlike ``status.resources``)."""

    pid: int
    spec: dict[str, Any]


@dataclass(frozen=True)
class ContainerRef:
    id: str
    pod_id: str
    name: str
    state: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]


@dataclass(frozen=True)
class PodRef:
    id: str
    name: str
    uid: str
    namespace: str
    state: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]


@dataclass(frozen=True)
class RunningPod:
    """A pod started by :meth:`CRIClient.run`: its sandbox id and container ids by name."""

    id: str
    spec: PodSpec
    containers: Mapping[str, str]

    def __getitem__(self, name: str) -> str:
        return self.containers[name]


# --------------------------------------------------------------------------------------------
# The client


class CRIClient:
    """CRI RuntimeService client bound to one containerd and one private top cgroup.

    ``top_cgroup`` (e.g. ``/nri-e2e-1a2b3c``) stands in for the root of kubelet's cgroup tree:
    pods go to ``<top>/kubepods[/burstable|/besteffort]/pod<uid>``.  Pod log directories are
    created below ``log_root``.
    """

    # Short reconnect backoff: containerd restarts within a second in these tests.  gRPC also
    # takes the minimum as each connection attempt's deadline (the HTTP/2 handshake included).
    reconnect_options: Sequence[tuple[str, int]] = (
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    )

    def __init__(
        self,
        address: str | Path,
        *,
        top_cgroup: str,
        log_root: Path,
        timeout: float = 30.0,
        lab: Path = debs.LAB,
    ) -> None:
        self.address = str(address)
        self.top_cgroup = "/" + top_cgroup.strip("/")
        self.log_root = Path(log_root)
        self.timeout = timeout
        self._api = stubs(lab)
        self.pb = self._api.pb
        self._channel: Any = None
        self._stub: Any = None
        self._pods: dict[str, Any] = {}  # pod id -> PodSandboxConfig, reused for containers
        self.reconnect()

    # -- connection ----------------------------------------------------------------------

    def reconnect(self) -> None:
        """Open a fresh channel (after containerd restarted, the old one may sit in backoff)."""
        import grpc

        self.close()
        options = [*self.reconnect_options, ("grpc.max_receive_message_length", 16 * 1024 * 1024)]
        self._channel = grpc.insecure_channel(f"unix://{self.address}", options=options)
        self._stub = self._api.grpc.RuntimeServiceStub(self._channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self) -> CRIClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Any RuntimeService RPC by name, with gRPC errors turned into :class:`CRIError`."""
        import grpc

        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise CRIError(method, e.code().name, e.details() or "") from None

    # -- runtime -------------------------------------------------------------------------

    def version(self, timeout: float | None = None) -> dict[str, str]:
        r = self.call("Version", self.pb.VersionRequest(), timeout)
        return {
            "version": r.version,
            "runtime_name": r.runtime_name,
            "runtime_version": r.runtime_version,
            "runtime_api_version": r.runtime_api_version,
        }

    def image_known(self, ref: str) -> bool:
        """Whether the runtime's CRI image service has ``ref`` (ImageStatus)."""
        import grpc

        stub = self._api.grpc.ImageServiceStub(self._channel)
        request = self.pb.ImageStatusRequest(image=self.pb.ImageSpec(image=ref))
        try:
            return stub.ImageStatus(request, timeout=self.timeout).HasField("image")
        except grpc.RpcError as e:
            raise CRIError("ImageStatus", e.code().name, e.details() or "") from None

    def status(self) -> dict[str, bool]:
        """Runtime conditions, e.g. ``{"RuntimeReady": True, "NetworkReady": False}`` (no CNI)."""
        r = self.call("Status", self.pb.StatusRequest())
        return {c.type: c.status for c in r.status.conditions}

    # -- pods ----------------------------------------------------------------------------

    def cgroup_parent(self, pod: PodSpec) -> str:
        """kubelet's cgroupfs pod cgroup, under our private top cgroup."""
        qos_dir = "" if pod.qos == GUARANTEED else f"/{pod.qos}"
        return f"{self.top_cgroup}/kubepods{qos_dir}/pod{pod.uid}"

    def run_pod(self, pod: PodSpec | str, **kwargs: Any) -> str:
        """RunPodSandbox; ``pod`` is a :class:`PodSpec` or a name plus PodSpec keywords
        (``qos=``, ``uid=``, ``annotations=``, ``cpu_request_milli=``, ...).  Returns the id."""
        spec = pod if isinstance(pod, PodSpec) else PodSpec(pod, **kwargs)
        pb = self.pb
        log_dir = self.log_root / f"{spec.namespace}_{spec.name}_{spec.uid}"
        log_dir.mkdir(parents=True, exist_ok=True)  # containerd does not create it
        linux = pb.LinuxPodSandboxConfig(
            cgroup_parent=self.cgroup_parent(spec),
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=self._namespaces(
                    spec.share_process_namespace, spec.host_network, spec.host_pid
                )
            ),
        )
        if spec.cpu_request_milli or spec.cpu_limit_milli or spec.memory:
            linux.resources.CopyFrom(
                self._resources(
                    spec.cpu_request_milli or 0, spec.cpu_limit_milli, memory_bytes(spec.memory)
                )
            )
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=spec.name, uid=spec.uid, namespace=spec.namespace, attempt=0
            ),
            log_directory=str(log_dir),
            labels={
                **spec.labels,
                "io.kubernetes.pod.name": spec.name,
                "io.kubernetes.pod.namespace": spec.namespace,
                "io.kubernetes.pod.uid": spec.uid,
            },
            annotations=dict(spec.annotations),
            linux=linux,
        )
        r = self.call(
            "RunPodSandbox",
            pb.RunPodSandboxRequest(config=config, runtime_handler=spec.runtime_handler),
        )
        self._pods[r.pod_sandbox_id] = config
        return r.pod_sandbox_id

    def _namespaces(
        self, share_process_namespace: bool, host_network: bool = True, host_pid: bool = False
    ) -> Any:
        """kubelet's namespacesForPod, sent for the sandbox and again for every container (an
        unset container value would mean POD for all three).  Host network: no CNI needed, and
        no hostname, which the host UTS namespace cannot take."""
        pb = self.pb
        pid = pb.NODE if host_pid else pb.POD if share_process_namespace else pb.CONTAINER
        network = pb.NODE if host_network else pb.POD
        return pb.NamespaceOption(network=network, pid=pid, ipc=pb.POD)

    def stop_pod(self, pod_id: str) -> None:
        self.call("StopPodSandbox", self.pb.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def remove_pod(self, pod_id: str) -> None:
        """RemovePodSandbox, then the pod's cgroup goes, as kubelet removes it (the runtime
        leaves the cgroups above its containers' alone)."""
        self.call("RemovePodSandbox", self.pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
        config = self._pods.pop(pod_id, None)
        if config is not None and config.linux.cgroup_parent.startswith("/"):
            host.remove_cgroup(config.linux.cgroup_parent)

    def pod_status(self, pod_id: str) -> dict[str, Any]:
        """PodSandboxStatus(verbose) as a dict: ``status`` plus containerd's parsed ``info``."""
        from google.protobuf import json_format

        r = self.call(
            "PodSandboxStatus",
            self.pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True),
        )
        info = json.loads(r.info["info"]) if "info" in r.info else {}
        return {"status": json_format.MessageToDict(r.status), "info": info}

    def pods(self, *, ready_only: bool = False) -> list[PodRef]:
        request = self.pb.ListPodSandboxRequest()
        if ready_only:
            request.filter.state.state = self.pb.SANDBOX_READY
        return [
            PodRef(
                p.id,
                p.metadata.name,
                p.metadata.uid,
                p.metadata.namespace,
                self.pb.PodSandboxState.Name(p.state),
                dict(p.labels),
                dict(p.annotations),
            )
            for p in self.call("ListPodSandbox", request).items
        ]

    # -- containers ----------------------------------------------------------------------

    def create_container(self, pod_id: str, container: ContainerSpec | str, **kwargs: Any) -> str:
        """CreateContainer in ``pod_id``; ``container`` is a :class:`ContainerSpec` or a name
        plus ContainerSpec keywords (``command=``, ``cpu_limit_milli=``, ...).  Returns the id."""
        spec = (
            container
            if isinstance(container, ContainerSpec)
            else ContainerSpec(container, **kwargs)
        )
        pb = self.pb
        pod_config = self._pod_config(pod_id)
        meta = pod_config.metadata
        qos = qos_from_cgroup_parent(pod_config.linux.cgroup_parent)
        resources = self._resources(spec.cpu_request, spec.cpu_limit_milli, spec.memory_limit_bytes)
        resources.oom_score_adj = oom_score_adj(qos, spec.memory_request_bytes)
        resources.cpuset_cpus, resources.cpuset_mems = spec.cpuset_cpus, spec.cpuset_mems
        (Path(pod_config.log_directory) / spec.name).mkdir(parents=True, exist_ok=True)
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=spec.name, attempt=spec.attempt),
            # kubelet sends both; CRI-O's signature check refuses a request without the second.
            image=pb.ImageSpec(image=spec.image, user_specified_image=spec.image),
            command=spec.argv,
            envs=[pb.KeyValue(key=k, value=v) for k, v in spec.env.items()],
            labels={
                **spec.labels,
                "io.kubernetes.container.name": spec.name,
                "io.kubernetes.pod.name": meta.name,
                "io.kubernetes.pod.namespace": meta.namespace,
                "io.kubernetes.pod.uid": meta.uid,
            },
            annotations={
                "io.kubernetes.container.hash": f"{zlib.crc32(repr(spec).encode()):08x}",
                "io.kubernetes.container.restartCount": str(spec.attempt),
                "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
                "io.kubernetes.container.terminationMessagePolicy": "File",
                "io.kubernetes.pod.terminationGracePeriod": "30",
                **spec.annotations,
            },
            log_path=f"{spec.name}/{spec.attempt}.log",
            mounts=[
                pb.Mount(
                    host_path=m.host,
                    container_path=m.container,
                    readonly=m.readonly,
                    propagation=pb.MountPropagation.Value(m.propagation),
                )
                for m in spec.mounts
            ],
            linux=pb.LinuxContainerConfig(
                resources=resources,
                security_context=self._security(spec, pod_config.linux.security_context),
            ),
        )
        r = self.call(
            "CreateContainer",
            pb.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=config, sandbox_config=pod_config
            ),
        )
        return r.container_id

    def start(self, cid: str) -> None:
        self.call("StartContainer", self.pb.StartContainerRequest(container_id=cid))

    def stop(self, cid: str, timeout: int = 2) -> None:
        """StopContainer: SIGTERM, then SIGKILL after ``timeout`` seconds."""
        self.call(
            "StopContainer",
            self.pb.StopContainerRequest(container_id=cid, timeout=timeout),
            timeout=self.timeout + timeout,
        )

    def remove(self, cid: str) -> None:
        self.call("RemoveContainer", self.pb.RemoveContainerRequest(container_id=cid))

    def update_resources(
        self,
        cid: str,
        *,
        cpuset_cpus: str | None = None,
        cpuset_mems: str | None = None,
        cpu_request_milli: int | None = None,
        cpu_limit_milli: int | None = None,
        memory: int | str | None = None,
    ) -> None:
        """UpdateContainerResources with only the given fields set; containerd keeps every
        field left at zero/empty as it is."""
        r = self.pb.LinuxContainerResources()
        if cpu_request_milli is not None:
            r.cpu_shares = milli_to_shares(cpu_request_milli)
        if cpu_limit_milli is not None:
            r.cpu_period, r.cpu_quota = CFS_PERIOD_US, milli_to_quota(cpu_limit_milli)
        if memory is not None:
            r.memory_limit_in_bytes = memory_bytes(memory) or 0
        if cpuset_cpus is not None:
            r.cpuset_cpus = cpuset_cpus
        if cpuset_mems is not None:
            r.cpuset_mems = cpuset_mems
        self.call(
            "UpdateContainerResources",
            self.pb.UpdateContainerResourcesRequest(container_id=cid, linux=r),
        )

    def update_pod_resources(
        self,
        pod_id: str,
        *,
        cpu_request_milli: int | None = None,
        cpu_limit_milli: int | None = None,
        memory: int | str | None = None,
        timeout: float | None = None,
    ) -> None:
        """UpdatePodSandboxResources, as kubelet sends it after resizing a pod's pod-level
        cgroup (CRI since Kubernetes 1.33; containerd >= 2.2 relays it to NRI plugins as
        UpdatePodSandbox).  ``resources`` carries the pod's new totals, ``overhead`` is left
        empty (no RuntimeClass overhead here).

        Debian's cri-api 0.32.3, which the stubs come from, predates the call: the request is
        encoded here from the stub's own LinuxContainerResources, by field number
        (UpdatePodSandboxResourcesRequest: 1 pod_sandbox_id, 2 overhead, 3 resources), and
        sent over the same channel.  The response has no fields."""
        import grpc

        resources = self.pb.LinuxContainerResources()
        if cpu_request_milli is not None:
            resources.cpu_shares = milli_to_shares(cpu_request_milli)
        if cpu_limit_milli is not None:
            resources.cpu_period = CFS_PERIOD_US
            resources.cpu_quota = milli_to_quota(cpu_limit_milli)
        if memory is not None:
            resources.memory_limit_in_bytes = memory_bytes(memory) or 0
        request = _length_delimited(1, pod_id.encode()) + _length_delimited(
            3, resources.SerializeToString()
        )
        call = self._channel.unary_unary(
            "/runtime.v1.RuntimeService/UpdatePodSandboxResources",
            request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw,
        )
        try:
            call(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise CRIError("UpdatePodSandboxResources", e.code().name, e.details() or "") from None

    def container_status(self, cid: str) -> dict[str, Any]:
        """ContainerStatus(verbose) as a dict: ``status`` (CRI's view) and ``info``."""
        from google.protobuf import json_format

        r = self.call(
            "ContainerStatus", self.pb.ContainerStatusRequest(container_id=cid, verbose=True)
        )
        info = json.loads(r.info["info"]) if "info" in r.info else {}
        return {
            "status": json_format.MessageToDict(r.status, preserving_proto_field_name=True),
            "info": info,
        }

    def state(self, cid: str) -> str:
        """``CONTAINER_CREATED`` / ``_RUNNING`` / ``_EXITED`` / ``_UNKNOWN``."""
        r = self.call("ContainerStatus", self.pb.ContainerStatusRequest(container_id=cid))
        return self.pb.ContainerState.Name(r.status.state)

    def inspect(self, cid: str) -> Inspect:
        """``(pid, runtimeSpec)``: the spec is what runc got, NRI adjustments included."""
        info = self.container_status(cid)["info"]
        return Inspect(int(info.get("pid", 0)), info.get("runtimeSpec", {}))

    def cgroup_path(self, cid: str) -> str:
        """The container's cgroupfs path (``linux.cgroupsPath`` of its OCI spec)."""
        return self.inspect(cid).spec["linux"]["cgroupsPath"]

    def containers(
        self, pod_id: str | None = None, *, state: str | None = None
    ) -> list[ContainerRef]:
        """ListContainers, optionally of one pod and/or in one state (``"CONTAINER_RUNNING"``)."""
        request = self.pb.ListContainersRequest()
        if pod_id:
            request.filter.pod_sandbox_id = pod_id
        if state:
            request.filter.state.state = self.pb.ContainerState.Value(state)
        return [
            ContainerRef(
                c.id,
                c.pod_sandbox_id,
                c.metadata.name,
                self.pb.ContainerState.Name(c.state),
                dict(c.labels),
                dict(c.annotations),
            )
            for c in self.call("ListContainers", request).containers
        ]

    def exec_sync(
        self, cid: str, cmd: Sequence[str] | str, timeout: int = 10
    ) -> tuple[int, str, str]:
        """Run a command in the container: ``(exit code, stdout, stderr)``."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        r = self.call(
            "ExecSync",
            self.pb.ExecSyncRequest(container_id=cid, cmd=argv, timeout=timeout),
            timeout=self.timeout + timeout,
        )
        return r.exit_code, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")

    # -- logs ----------------------------------------------------------------------------

    def log_path(self, cid: str) -> Path:
        return Path(self.container_status(cid)["status"]["log_path"])

    def logs(self, cid: str, stream: str | None = "stdout") -> list[str]:
        """The container's output lines without the CRI ``<time> <stream> <P|F> `` prefix;
        ``stream=None`` gives stdout and stderr interleaved.  Partial (P) lines are joined."""
        path = self.log_path(cid)
        return parse_cri_log(path.read_text(errors="replace") if path.exists() else "", stream)

    def wait_logs(
        self,
        cid: str,
        until: int | str | Callable[[list[str]], bool] = 1,
        *,
        timeout: float = 10.0,
        stream: str | None = "stdout",
    ) -> list[str]:
        """Wait until the log has ``until`` lines (int), a line containing ``until`` (str), or
        ``until(lines)`` is true; return the lines.  Fails with the lines seen so far."""
        if isinstance(until, int):
            want = until

            def done(lines: list[str]) -> bool:
                return len(lines) >= want
        elif isinstance(until, str):
            text = until

            def done(lines: list[str]) -> bool:
                return any(text in line for line in lines)
        else:
            done = until
        path = self.log_path(cid)
        deadline = time.monotonic() + timeout
        while True:
            content = path.read_text(errors="replace") if path.exists() else ""
            lines = parse_cri_log(content, stream)
            if done(lines):
                return lines
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"container {cid[:12]}: log condition {until!r} not met in {timeout} s; "
                    f"lines so far: {lines!r}; state {self.state(cid)}"
                )
            time.sleep(0.05)

    def wait_state(self, cid: str, state: str = "CONTAINER_EXITED", timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.state(cid)) != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"container {cid[:12]} is {now}, not {state}, after {timeout} s")
            time.sleep(0.05)

    # -- whole pods ----------------------------------------------------------------------

    def run(
        self,
        pod: PodSpec | str,
        containers: Sequence[ContainerSpec],
        *,
        init_timeout: float = 30.0,
    ) -> RunningPod:
        """Start a pod like kubelet: init containers one by one (each must exit 0; sidecars are
        started and left running), then the app containers.  A pod given by name gets its QoS
        class and pod-level resources from the containers."""
        spec = pod if isinstance(pod, PodSpec) else PodSpec.for_containers(pod, containers)
        pod_id = self.run_pod(spec)
        ids: dict[str, str] = {}
        for c in [c for c in containers if c.kind != "app"] + [
            c for c in containers if c.kind == "app"
        ]:
            ids[c.name] = cid = self.create_container(pod_id, c)
            self.start(cid)
            if c.kind == "init":
                self.wait_state(cid, "CONTAINER_EXITED", init_timeout)
                code = self.container_status(cid)["status"].get("exit_code", 0)
                if code:
                    raise RuntimeError(
                        f"init container {c.name} exited {code}: {self.logs(cid, None)}"
                    )
        return RunningPod(pod_id, spec, MappingProxyType(ids))

    def remove_all(self, *, stop_timeout: int = 0, budget: float = 20.0) -> list[str]:
        """Stop and remove every container and pod (teardown); returns the errors met.  Gives
        up after ``budget`` seconds or when the runtime stops answering: whoever tears down
        must be able to fall back to killing processes instead of hanging here."""
        errors: list[str] = []
        deadline = time.monotonic() + budget
        saved, self.timeout = self.timeout, min(self.timeout, 5.0)
        try:
            steps: list[Callable[[], Any]] = []
            try:
                for c in self.containers():
                    steps += [partial(self.stop, c.id, stop_timeout), partial(self.remove, c.id)]
                for pod in self.pods():
                    steps += [partial(self.stop_pod, pod.id), partial(self.remove_pod, pod.id)]
            except CRIError as e:
                return [str(e)]  # not answering: leave it to process-level clean-up
            for step in steps:
                if time.monotonic() > deadline:
                    errors.append(f"CRI clean-up gave up after {budget} s")
                    break
                try:
                    step()
                except CRIError as e:
                    errors.append(str(e))
                    if e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                        break
        finally:
            self.timeout = saved
        return errors

    # -- internals -----------------------------------------------------------------------

    def _resources(self, request_milli: int, limit_milli: int | None, memory: int | None) -> Any:
        """LinuxContainerResources as kubelet computes them (period is always sent here; a zero
        quota means no CFS limit)."""
        return self.pb.LinuxContainerResources(
            cpu_shares=milli_to_shares(request_milli or (limit_milli or 0)),
            cpu_period=CFS_PERIOD_US,
            cpu_quota=milli_to_quota(limit_milli),
            memory_limit_in_bytes=memory or 0,
        )

    def _security(self, spec: ContainerSpec, pod_security: Any) -> Any:
        """The container's LinuxContainerSecurityContext: the pod's namespaces, and what its
        securityContext asks for."""
        pb = self.pb
        options = pod_security.namespace_options
        context = pb.LinuxContainerSecurityContext(
            namespace_options=self._namespaces(
                options.pid == pb.POD, options.network == pb.NODE, options.pid == pb.NODE
            )
        )
        wanted = spec.security
        if wanted is None:
            return context
        context.privileged = wanted.privileged
        context.readonly_rootfs = wanted.readonly_rootfs
        context.no_new_privs = wanted.no_new_privs
        if wanted.run_as_user is not None:
            context.run_as_user.value = wanted.run_as_user
        context.capabilities.add_capabilities.extend(wanted.add_capabilities)
        context.capabilities.drop_capabilities.extend(wanted.drop_capabilities)
        if wanted.seccomp_runtime_default:
            context.seccomp.profile_type = pb.SecurityProfile.RuntimeDefault
        return context

    def _pod_config(self, pod_id: str) -> Any:
        """The pod's PodSandboxConfig, which kubelet repeats in every CreateContainer.  Pods
        run by another client instance (e.g. before a restart) are rebuilt from the status."""
        if pod_id in self._pods:
            return self._pods[pod_id]
        from google.protobuf import json_format

        info = self.pod_status(pod_id)["info"]
        config = info.get("config")
        if not config:
            raise RuntimeError(f"pod {pod_id[:12]}: containerd reported no sandbox config")
        message = json_format.ParseDict(
            config, self.pb.PodSandboxConfig(), ignore_unknown_fields=True
        )
        self._pods[pod_id] = message
        return message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    """One protobuf field of wire type 2 (bytes, string, message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


_LOG_LINE = re.compile(r"^(\S+) (stdout|stderr) ([PF]) ?(.*)$")


def parse_cri_log(text: str, stream: str | None = "stdout") -> list[str]:
    """CRI log file -> lines of output.  Format: ``<RFC3339Nano> <stream> <P|F> <content>``."""
    lines: list[str] = []
    partial: dict[str, str] = {}
    for raw in text.splitlines():
        match = _LOG_LINE.match(raw)
        if not match or (stream is not None and match.group(2) != stream):
            continue
        _, which, tag, content = match.groups()
        partial[which] = partial.get(which, "") + content
        if tag == "F":
            lines.append(partial.pop(which))
    return lines
