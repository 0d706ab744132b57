"""What the policy needs to know about one container, whichever runtime path reported it.

The NRI plugin builds a Workload from a ``Container`` + ``PodSandbox``; the OCI hook builds one
from ``config.json``.  Both read Kubernetes intent the same way (docs/cgroups-and-hooks.md
§7-§8): QoS from the pod's cgroup parent, CPU request from ``cpu.shares``, limit from
quota/period.
"""

from __future__ import annotations

from types import MappingProxyType

from ..base.value import Value
from . import annotation

TYPE_CHECKING = False  # collections.abc is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Mapping

GUARANTEED = "guaranteed"
BURSTABLE = "burstable"
BESTEFFORT = "besteffort"
QOS_CLASSES = (GUARANTEED, BURSTABLE, BESTEFFORT)

# kubelet annotates each container with its kind in the pod spec: "init" (init containers,
# sidecars among them), "container", "ephemeral" (pkg/kubelet/kuberuntime/labels.go).  Older
# kubelets do not; such containers count as app containers.
CONTAINER_TYPE = "io.kubernetes.container.type"

# kubelet: shares = millicores * 1024 / 1000, never below 2 (pkg/kubelet/cm/helpers_linux.go).
SHARES_PER_CPU = 1024
MIN_SHARES = 2


class Workload(Value):
    container_id: str
    container_name: str
    pod_uid: str
    pod_name: str = ""
    pod_namespace: str = ""
    qos: str = BESTEFFORT
    cpu_request_milli: int = 0
    cpu_limit_milli: int | None = None
    annotations: Mapping[str, str] = MappingProxyType({})
    kind: str = "app"  # app | init | sidecar (a restartable init container)
    cgroup_path: str = ""

    def __post_init__(self) -> None:
        if self.qos not in QOS_CLASSES:
            raise ValueError(f"unknown QoS class {self.qos!r}; expected one of {QOS_CLASSES}")
        object.__setattr__(self, "annotations", MappingProxyType(dict(self.annotations)))

    def identity(self) -> dict[str, str]:
        """Who this container is, as audit record fields."""
        return {
            "container_id": self.container_id,
            "container_name": self.container_name,
            "pod_uid": self.pod_uid,
            "pod_name": self.pod_name,
            "pod_namespace": self.pod_namespace,
        }

    @property
    def integer_cpus(self) -> int | None:
        """Whole CPUs requested, or None when the request is fractional or zero."""
        if self.cpu_request_milli <= 0 or self.cpu_request_milli % 1000:
            return None
        return self.cpu_request_milli // 1000


def qos_from_cgroup_parent(cgroup_path: str) -> str:
    """kubelet nests Burstable and BestEffort pods under a cgroup named after the class;
    Guaranteed pods sit directly below ``kubepods``."""
    lowered = cgroup_path.lower()
    if "besteffort" in lowered:
        return BESTEFFORT
    if "burstable" in lowered:
        return BURSTABLE
    return GUARANTEED


def millicores_from_shares(shares: int) -> int:
    """Invert kubelet's ``floor(milli * 1024 / 1000)``: the ceiling below is exact for every
    request of 3 millicores or more.  The minimum (2 shares) stands for "no request"."""
    if shares <= MIN_SHARES:
        return 0
    return (shares * 1000 + SHARES_PER_CPU - 1) // SHARES_PER_CPU


def millicores_from_quota(quota: int | None, period: int | None) -> int | None:
    """CPU limit in millicores from CFS quota/period; None when unlimited."""
    if quota is None or quota <= 0 or not period:
        return None
    return quota * 1000 // period


def kind_of(annotations: Mapping[str, str]) -> str:
    """The Workload kind kubelet's container annotations say (see CONTAINER_TYPE)."""
    return "init" if annotations.get(CONTAINER_TYPE) == "init" else "app"


def _optional(message: object, field: str) -> int | None:
    """Value of an NRI Optional* wrapper field: None when the wrapper is absent."""
    return getattr(message, field).value if message.HasField(field) else None  # type: ignore[attr-defined]


def from_nri(pod: object, container: object) -> Workload:
    """Workload from NRI ``PodSandbox`` and ``Container`` messages.

    Duck-typed on the protobuf objects so this module does not import protobuf: the OCI hook
    imports it too and must start fast.
    """
    cpu = container.linux.resources.cpu  # type: ignore[attr-defined]
    shares = _optional(cpu, "shares")
    labels = container.labels  # type: ignore[attr-defined]
    name = container.name or labels.get("io.kubernetes.container.name", "")  # type: ignore[attr-defined]
    # Only what the policy reads, the container's own values over the pod's.
    annotations = annotation.read(pod.annotations, name)  # type: ignore[attr-defined]
    annotations.update(annotation.read(container.annotations, name))  # type: ignore[attr-defined]
    cgroup_parent = pod.linux.cgroup_parent  # type: ignore[attr-defined]
    return Workload(
        container_id=container.id,  # type: ignore[attr-defined]
        container_name=name,
        pod_uid=pod.uid or labels.get("io.kubernetes.pod.uid", ""),  # type: ignore[attr-defined]
        pod_name=pod.name,  # type: ignore[attr-defined]
        pod_namespace=pod.namespace,  # type: ignore[attr-defined]
        # Without a pod cgroup this is not a kubelet-managed pod: never exclusive.
        qos=qos_from_cgroup_parent(cgroup_parent) if cgroup_parent else BESTEFFORT,
        cpu_request_milli=millicores_from_shares(shares) if shares else 0,
        cpu_limit_milli=millicores_from_quota(_optional(cpu, "quota"), _optional(cpu, "period")),
        annotations=annotations,
        kind=kind_of(container.annotations),  # type: ignore[attr-defined]
        cgroup_path=container.linux.cgroups_path,  # type: ignore[attr-defined]
    )
