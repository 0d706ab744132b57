"""The pod annotations we read: one table, one lookup rule, for the policy, NIC locality and
the hook's record of a container.

Annotations are written by pod authors, so they are untrusted: they may opt a container out of
exclusive CPUs or steer where its CPUs come from, never grant CPUs.  Each key may be set
pod-wide, or for one container with the suffix ``/container.<name>``, which wins.  A value we
cannot read is an error the pod author sees, never a silent guess.
"""

from __future__ import annotations

from collections.abc import Mapping

from .errors import PolicyError

DOMAIN = "nri-cpuplugin.io"
# "false" opts an eligible container out of exclusive CPUs.
EXCLUSIVE = f"exclusive-cpus.{DOMAIN}"
# "true" asks that an eligible container's exclusive CPUs come from the isolated CPUs.
ISOLATED = f"isolated-cpus.{DOMAIN}"
# "prefer" (default), "strict" or "off": place exclusive CPUs next to the pod's NICs.
NIC_LOCALITY = f"nic-locality.{DOMAIN}"
# Comma-separated interface names (in the pod's network namespace) that locality considers.
NICS = f"nics.{DOMAIN}"

KEYS = (EXCLUSIVE, ISOLATED, NIC_LOCALITY, NICS)

# Not ours: CRI-O's high-performance runtime handler lifts the CFS quota of a Guaranteed
# container with whole CPUs (pod cgroup and container cgroup, at StartContainer) when its pod
# carries this annotation with "disable" (or the deprecated "true") and the pod's runtime
# handler allows it.  Read, so that our decision and CRI-O's cannot disagree (policy.py).
CRIO_CPU_QUOTA = "cpu-quota.crio.io"
CRIO_QUOTA_LIFTED = ("disable", "true")
CONTAINER_SUFFIX = "/container."
# What a refusal echoes of a value: enough to recognise it, never a pod author's megabyte.
MAX_ECHO = 64


def lookup(annotations: Mapping[str, str], key: str, container_name: str) -> str | None:
    """The container-specific value of ``key`` if set, else the pod-wide one, else None."""
    specific = f"{key}{CONTAINER_SUFFIX}{container_name}"
    if specific in annotations:
        return annotations[specific]
    return annotations.get(key)


def name_of(annotations: Mapping[str, str], key: str, container_name: str) -> str:
    """The annotation name ``lookup`` took its value from (for messages)."""
    specific = f"{key}{CONTAINER_SUFFIX}{container_name}"
    return specific if specific in annotations else key


def flag(annotations: Mapping[str, str], key: str, container_name: str, who: str) -> bool | None:
    """A true/false annotation; None when unset; PolicyError for anything else."""
    value = lookup(annotations, key, container_name)
    if value is None:
        return None
    word = value.strip().lower()
    if word in ("true", "false"):
        return word == "true"
    raise PolicyError(
        f"annotation {name_of(annotations, key, container_name)}={echo(value)} on {who}: "
        "expected 'true' or 'false'",
        "bad-annotation",
    )


def ours(annotations: Mapping[str, str]) -> dict[str, str]:
    """Only the annotations this table names (pods carry kilobytes of unrelated ones)."""
    return {k: v for k, v in annotations.items() if k.split("/", 1)[0] in KEYS}


def echo(value: str) -> str:
    """``value`` quoted for a message, cut (and saying so) when long."""
    if len(value) <= MAX_ECHO:
        return repr(value)
    return f"{value[:MAX_ECHO]!r}... ({len(value)} characters, cut)"
