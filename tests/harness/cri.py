"""A small CRI client that drives containerd the way kubelet does, for the e2e tests.

The gRPC stubs are generated (once, cached in the lab directory) with grpcio-tools from the real
CRI ``api.proto`` in Debian's cri-api package, so requests are exactly what kubelet sends on
the wire.  The proto imports gogoproto only for Go code-generation options; those lines are
dropped before compiling.

Tests describe workloads with :class:`PodSpec` / :class:`ContainerSpec` in Kubernetes terms
(QoS class, millicores, memory quantities); :class:`CRIClient` turns them into the CRI values
kubelet would compute (cpu shares, CFS quota, cgroup parent per QoS class, kubelet labels and
annotations, OOM score).  Pods use the host network (no CNI) and a private PID namespace per
container.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, NamedTuple

from . import debs
from .image import BUSYBOX_IMAGE
from .packages import CRI_API

GUARANTEED = "guaranteed"
BURSTABLE = "burstable"
BESTEFFORT = "besteffort"
QOS_CLASSES = (GUARANTEED, BURSTABLE, BESTEFFORT)
CONTAINER_KINDS = ("app", "init", "sidecar")

# kubelet constants (pkg/kubelet/cm/helpers_linux.go, pkg/kubelet/qos/policy.go)
SHARES_PER_CPU = 1024
MIN_SHARES = 2
CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000
OOM_GUARANTEED = -997
OOM_BESTEFFORT = 1000

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


# --------------------------------------------------------------------------------------------
# Kubernetes-shaped workload descriptions

_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def memory_bytes(quantity: int | str | None) -> int | None:
    """``"64Mi"`` -> 67108864; ints are bytes already; None stays None."""
    if quantity is None or isinstance(quantity, int):
        return quantity
    match = _QUANTITY.match(quantity.strip())
    if not match:
        raise ValueError(f"memory quantity {quantity!r}: expected e.g. 67108864, '64Mi', '1G'")
    return int(match.group(1)) * _UNITS[match.group(2)]


def milli_to_shares(milli: int) -> int:
    """kubelet's MilliCPUToShares: floor(m * 1024 / 1000), never below 2."""
    return max(milli * SHARES_PER_CPU // 1000, MIN_SHARES)


def milli_to_quota(milli: int | None) -> int:
    """kubelet's MilliCPUToQuota for a 100 ms period; 0 (no quota) without a limit."""
    if not milli:
        return 0
    return max(milli * CFS_PERIOD_US // 1000, MIN_QUOTA_US)


@dataclass(frozen=True)
class ContainerSpec:
    """One container as a pod spec would declare it.

    As in Kubernetes, an unset request defaults to the limit.  ``kind`` says how kubelet would
    run it (``init`` runs to completion before the others; ``sidecar`` is a restartable init
    container) - the runtime itself is not told, exactly as with a real kubelet.
    ``cpuset_cpus`` is what kubelet's static CPU manager would put in the request; leave it
    empty for ``cpuManagerPolicy: none``.
    """

    name: str
    command: Sequence[str] | str = ("sleep", "infinity")
    cpu_request_milli: int | None = None
    cpu_limit_milli: int | None = None
    memory: int | str | None = None
    memory_request: int | str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    kind: str = "app"
    image: str = BUSYBOX_IMAGE
    cpuset_cpus: str = ""
    cpuset_mems: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONTAINER_KINDS:
            raise ValueError(f"container kind {self.kind!r}: expected one of {CONTAINER_KINDS}")
        for name in ("annotations", "labels", "env"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @classmethod
    def guaranteed(
        cls, name: str, cpus: float, memory: int | str = "64Mi", **kwargs: Any
    ) -> ContainerSpec:
        """Requests == limits, as a Guaranteed pod's container needs (``cpus`` may be 0.5)."""
        milli = round(cpus * 1000)
        return cls(name, cpu_limit_milli=milli, memory=memory, **kwargs)

    @property
    def argv(self) -> list[str]:
        if isinstance(self.command, str):
            return ["/bin/sh", "-c", self.command]
        return list(self.command)

    @property
    def cpu_request(self) -> int:
        if self.cpu_request_milli is not None:
            return self.cpu_request_milli
        return self.cpu_limit_milli or 0

    @property
    def memory_limit(self) -> int | None:
        return memory_bytes(self.memory)

    @property
    def memory_req(self) -> int:
        request = memory_bytes(self.memory_request)
        return request if request is not None else (self.memory_limit or 0)


def qos_class(containers: Iterable[ContainerSpec]) -> str:
    """Kubernetes' GetPodQOS over cpu and memory of all containers (init ones included)."""
    containers = list(containers)
    any_set = guaranteed = False
    guaranteed = bool(containers)
    for c in containers:
        cpu_limit, mem_limit = c.cpu_limit_milli, c.memory_limit
        if c.cpu_request or cpu_limit or c.memory_req or mem_limit:
            any_set = True
        if not (
            cpu_limit and mem_limit and c.cpu_request == cpu_limit and c.memory_req == mem_limit
        ):
            guaranteed = False
    if not any_set:
        return BESTEFFORT
    return GUARANTEED if guaranteed else BURSTABLE


@dataclass(frozen=True)
class PodSpec:
    """A pod: identity, QoS class and (optionally) the pod-level resources kubelet sends.

    ``qos=None`` derives the class from the pod-level resources.  Use :meth:`for_containers`
    to derive QoS and pod resources from the containers, as kubelet does.
    """

    name: str
    qos: str | None = None
    namespace: str = "default"
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    cpu_request_milli: int | None = None
    cpu_limit_milli: int | None = None
    memory: int | str | None = None

    def __post_init__(self) -> None:
        if self.qos is None:
            as_one = ContainerSpec(
                "pod", cpu_request_milli=self.cpu_request_milli,
                cpu_limit_milli=self.cpu_limit_milli, memory=self.memory,
            )  # fmt: skip
            object.__setattr__(self, "qos", qos_class([as_one]))
        if self.qos not in QOS_CLASSES:
            raise ValueError(f"QoS class {self.qos!r}: expected one of {QOS_CLASSES}")
        for name in ("annotations", "labels"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @classmethod
    def for_containers(
        cls, name: str, containers: Sequence[ContainerSpec], **kwargs: Any
    ) -> PodSpec:
        """QoS class and pod-level resources computed from the containers like kubelet does:
        requests = max(sum over app+sidecar, any init); limits only if every container has one."""
        regular = [c for c in containers if c.kind != "init"]
        inits = [c for c in containers if c.kind == "init"]
        cpu_req = max([sum(c.cpu_request for c in regular), *(c.cpu_request for c in inits)])
        cpu_limits = [c.cpu_limit_milli for c in containers]
        mem_limits = [c.memory_limit for c in containers]
        kwargs.setdefault("qos", qos_class(containers))
        return cls(
            name,
            cpu_request_milli=cpu_req,
            cpu_limit_milli=sum(x for x in cpu_limits if x) if all(cpu_limits) else None,
            memory=sum(x for x in mem_limits if x) if all(mem_limits) else None,
            **kwargs,
        )


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


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def oom_score_adj(qos: str, memory_request: int) -> int:
    """kubelet's GetContainerOOMScoreAdjust.  (containerd clamps it with
    ``restrict_oom_score_adj``; it is sent anyway so requests look like kubelet's.)"""
    if qos == GUARANTEED:
        return OOM_GUARANTEED
    if qos == BESTEFFORT:
        return OOM_BESTEFFORT
    adj = 1000 - (1000 * memory_request) // _mem_total()
    if adj < 1000 + OOM_GUARANTEED:
        return 1000 + OOM_GUARANTEED
    return min(adj, OOM_BESTEFFORT - 1)


# --------------------------------------------------------------------------------------------
# The client


class CRIClient:
    """CRI RuntimeService client bound to one containerd and one private top cgroup.

    ``top_cgroup`` (e.g. ``/nri-e2e-1a2b3c``) stands in for the root of kubelet's cgroup tree:
    pods go to ``<top>/kubepods[/burstable|/besteffort]/pod<uid>``.  Pod log directories are
    created below ``log_root``.
    """

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
        # Short reconnect backoff: containerd restarts within a second in these tests.
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ]
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
                # Host network: no CNI needed.  Per-container PID namespaces like kubelet's
                # default.  No hostname: the host UTS namespace cannot take one.
                namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
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
        r = self.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config))
        self._pods[r.pod_sandbox_id] = config
        return r.pod_sandbox_id

    def stop_pod(self, pod_id: str) -> None:
        self.call("StopPodSandbox", self.pb.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def remove_pod(self, pod_id: str) -> None:
        self.call("RemovePodSandbox", self.pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
        self._pods.pop(pod_id, None)

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
        qos = _qos_of(pod_config.linux.cgroup_parent)
        resources = self._resources(spec.cpu_request, spec.cpu_limit_milli, spec.memory_limit)
        resources.oom_score_adj = oom_score_adj(qos, spec.memory_req)
        resources.cpuset_cpus, resources.cpuset_mems = spec.cpuset_cpus, spec.cpuset_mems
        (Path(pod_config.log_directory) / spec.name).mkdir(parents=True, exist_ok=True)
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=spec.name, attempt=0),
            image=pb.ImageSpec(image=spec.image),
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
                "io.kubernetes.container.restartCount": "0",
                "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
                "io.kubernetes.container.terminationMessagePolicy": "File",
                "io.kubernetes.pod.terminationGracePeriod": "30",
                **spec.annotations,
            },
            log_path=f"{spec.name}/0.log",
            linux=pb.LinuxContainerConfig(resources=resources),
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
            text = path.read_text(errors="replace") if path.exists() else ""
            lines = parse_cri_log(text, stream)
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

    def remove_all(self, *, stop_timeout: int = 0) -> list[str]:
        """Stop and remove every container and pod (teardown); returns the errors met."""
        errors = []
        for c in self._safe(self.containers, errors) or []:
            with _collect(errors):
                self.stop(c.id, timeout=stop_timeout)
            with _collect(errors):
                self.remove(c.id)
        for p in self._safe(self.pods, errors) or []:
            with _collect(errors):
                self.stop_pod(p.id)
            with _collect(errors):
                self.remove_pod(p.id)
        return errors

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _safe(fn: Callable[[], Any], errors: list[str]) -> Any:
        with _collect(errors):
            return fn()
        return None

    def _resources(self, request_milli: int, limit_milli: int | None, memory: int | None) -> Any:
        """LinuxContainerResources as kubelet computes them (period is always sent here; a zero
        quota means no CFS limit)."""
        return self.pb.LinuxContainerResources(
            cpu_shares=milli_to_shares(request_milli or (limit_milli or 0)),
            cpu_period=CFS_PERIOD_US,
            cpu_quota=milli_to_quota(limit_milli),
            memory_limit_in_bytes=memory or 0,
        )

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


def _qos_of(cgroup_parent: str) -> str:
    if f"/{BESTEFFORT}/" in cgroup_parent:
        return BESTEFFORT
    if f"/{BURSTABLE}/" in cgroup_parent:
        return BURSTABLE
    return GUARANTEED


class _collect(contextlib.AbstractContextManager):
    """Record an exception's text instead of raising it (best-effort teardown steps)."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and isinstance(exc, Exception):
            self.errors.append(str(exc))
            return True
        return False


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
