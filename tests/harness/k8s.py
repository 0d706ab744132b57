"""Workloads described in Kubernetes terms, and the CRI values kubelet derives from them.

:class:`PodSpec` / :class:`ContainerSpec` carry what a pod manifest says (QoS class,
millicores, memory quantities, init/sidecar containers); the functions reproduce kubelet's
arithmetic (cpu shares, CFS quota, QoS class, OOM score) so that the requests the harness sends
are the ones a real kubelet would send.  Pure code: no runtime needed.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .image import BUSYBOX_IMAGE

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
class Mount:
    """A volume mount as kubelet sends it: a host path (a hostPath volume, or the directory
    kubelet writes a configMap's files into) at a path in the container; ``propagation`` by
    CRI's names (PROPAGATION_PRIVATE, PROPAGATION_HOST_TO_CONTAINER, ...)."""

    host: str
    container: str
    readonly: bool = False
    propagation: str = "PROPAGATION_PRIVATE"


@dataclass(frozen=True)
class Security:
    """A container's securityContext, in the CRI terms kubelet turns it into."""

    privileged: bool = False
    run_as_user: int | None = None
    readonly_rootfs: bool = False
    no_new_privs: bool = False
    add_capabilities: tuple[str, ...] = ()
    drop_capabilities: tuple[str, ...] = ()
    seccomp_runtime_default: bool = False


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
    mounts: Sequence[Mount] = ()
    security: Security | None = None
    # kubelet's restart count: each restart of a container is a new one with the next attempt
    attempt: int = 0

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
        """Effective CPU request in millicores (the limit when no request is given)."""
        if self.cpu_request_milli is not None:
            return self.cpu_request_milli
        return self.cpu_limit_milli or 0

    @property
    def memory_limit_bytes(self) -> int | None:
        return memory_bytes(self.memory)

    @property
    def memory_request_bytes(self) -> int:
        """Effective memory request (the limit when no request is given)."""
        request = memory_bytes(self.memory_request)
        return request if request is not None else (self.memory_limit_bytes or 0)


def qos_class(containers: Iterable[ContainerSpec]) -> str:
    """Kubernetes' GetPodQOS over cpu and memory of all containers (init ones included)."""
    containers = list(containers)
    any_set, guaranteed = False, bool(containers)
    for c in containers:
        cpu_limit, mem_limit = c.cpu_limit_milli, c.memory_limit_bytes
        if c.cpu_request or cpu_limit or c.memory_request_bytes or mem_limit:
            any_set = True
        if not (
            cpu_limit
            and mem_limit
            and c.cpu_request == cpu_limit
            and c.memory_request_bytes == mem_limit
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
    share_process_namespace: bool = False
    # False: the pod gets its own network namespace from the runtime's CNI plugins (the
    # containerd instance must then have a CNI configuration; see e2e/test_nic_locality.py).
    host_network: bool = True
    host_pid: bool = False
    # CRI RunPodSandbox's runtime_handler (a pod's RuntimeClass), e.g. a CRI-O handler that
    # allows its high-performance annotations; "" = the runtime's default.
    runtime_handler: str = ""

    def __post_init__(self) -> None:
        if self.qos is None:
            as_one = ContainerSpec(
                "pod",
                cpu_request_milli=self.cpu_request_milli,
                cpu_limit_milli=self.cpu_limit_milli,
                memory=self.memory,
            )
            object.__setattr__(self, "qos", qos_class([as_one]))
        if self.qos not in QOS_CLASSES:
            raise ValueError(f"QoS class {self.qos!r}: expected one of {QOS_CLASSES}")
        for name in ("annotations", "labels"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @classmethod
    def for_containers(
        cls, name: str, containers: Sequence[ContainerSpec], **kwargs: Any
    ) -> PodSpec:
        """QoS class and pod-level resources from the containers, as kubelet computes them:
        each value is max(sum over app + sidecar containers, largest init container); a limit
        only when every container has one (otherwise the pod has no such limit)."""

        def effective(values: list[int]) -> int:
            regular = sum(v for v, c in zip(values, containers, strict=True) if c.kind != "init")
            inits = [v for v, c in zip(values, containers, strict=True) if c.kind == "init"]
            return max([regular, *inits])

        cpu_limits = [c.cpu_limit_milli or 0 for c in containers]
        mem_limits = [c.memory_limit_bytes or 0 for c in containers]
        kwargs.setdefault("qos", qos_class(containers))
        return cls(
            name,
            cpu_request_milli=effective([c.cpu_request for c in containers]),
            cpu_limit_milli=effective(cpu_limits) if all(cpu_limits) else None,
            memory=effective(mem_limits) if all(mem_limits) else None,
            **kwargs,
        )


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


def qos_from_cgroup_parent(cgroup_parent: str) -> str:
    """kubelet nests Burstable and BestEffort pods under a cgroup named after the class: a
    directory with the cgroupfs driver (``.../burstable/pod<uid>``), a slice name part with
    the systemd driver (``kubepods-burstable-pod<uid>.slice``)."""
    for qos in (BESTEFFORT, BURSTABLE):
        if f"/{qos}/" in cgroup_parent or f"-{qos}-" in cgroup_parent:
            return qos
    return GUARANTEED
