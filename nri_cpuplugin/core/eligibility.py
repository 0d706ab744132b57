"""Who is entitled to exclusive CPUs, read from the container alone.

Eligibility follows kubelet: a Guaranteed container with an integer CPU request.  Annotations
(set by any pod author, so untrusted) can opt a container *out*, steer an eligible one to
isolated CPUs, or ask its CPUs kept free of interrupts; they never grant CPUs to a container
that is not entitled to them.  Nothing here looks at the node: where the CPUs come from is
placement.py's, and whether they are free the policy's.
"""

from __future__ import annotations

from . import annotation
from .errors import PolicyError
from .workload import GUARANTEED, Workload


def eligibility(workload: Workload) -> tuple[int | None, str, bool]:
    """(exclusive CPU count or None, why, from isolated CPUs?)."""
    opt_out = _annotation_flag(workload, annotation.EXCLUSIVE)
    wants_isolated = _annotation_flag(workload, annotation.ISOLATED) is True
    _annotation_flag(workload, annotation.IRQ_FREE)  # a bad value is refused now
    if workload.qos != GUARANTEED:
        return None, f"{workload.qos} QoS shares", False
    count = workload.integer_cpus
    if count is None:
        return (
            None,
            f"guaranteed with {workload.cpu_request_milli}m (not whole CPUs) shares",
            False,
        )
    limit = workload.cpu_limit_milli
    if limit is not None and limit != workload.cpu_request_milli:
        # kubelet's Guaranteed means limit == request; an in-place update that breaks it
        # makes the container Burstable-shaped (its QoS class cannot change in place).
        return None, f"CPU limit {limit}m differs from request (Burstable-shaped) shares", False
    if opt_out is False:
        _refuse_lifted_quota(workload)
        return None, f"opted out by {annotation.EXCLUSIVE}", False
    return count, f"guaranteed with {count} whole CPUs", wants_isolated


def _refuse_lifted_quota(workload: Workload) -> None:
    lifted = workload.annotations.get(annotation.CRIO_CPU_QUOTA)
    if lifted in annotation.CRIO_QUOTA_LIFTED:
        # CRI-O would lift the quota of exactly such a container, and in the shared
        # pool a container without a quota can take the whole pool from the others.
        key = annotation.name_of(
            workload.annotations, annotation.EXCLUSIVE, workload.container_name
        )
        raise PolicyError(
            f"{describe(workload)} is opted out of exclusive CPUs ({key}=false) but "
            "its pod asks CRI-O to lift its CFS quota "
            f"({annotation.CRIO_CPU_QUOTA}={lifted}): a shared container without a "
            "quota could take the whole shared pool; drop one of the two annotations",
            "bad-annotation",
        )


def wants_irq_free(workload: Workload, node_wide: bool) -> bool:
    """Whether the container's exclusive CPUs are kept free of device interrupts: node-wide
    (``[irq] keep_off_exclusive``: ``node_wide``), or asked by its pod (our annotation, or
    CRI-O's)."""
    asked = _annotation_flag(workload, annotation.IRQ_FREE)
    if asked is not None:
        return asked
    crio = workload.annotations.get(annotation.CRIO_IRQ, "").strip().lower()
    return node_wide or crio in annotation.CRIO_IRQ_OFF


def describe(workload: Workload) -> str:
    """The container as a message names it."""
    pod = f"{workload.pod_namespace}/{workload.pod_name}" if workload.pod_name else workload.pod_uid
    return f"container {workload.container_name!r} of pod {pod}"


def _annotation_flag(workload: Workload, key: str) -> bool | None:
    return annotation.flag(workload.annotations, key, workload.container_name, describe(workload))
