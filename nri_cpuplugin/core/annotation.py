"""The pod annotations we read: one table, one lookup rule, for the policy, NIC locality and
the hook's record of a container.

Annotations are written by pod authors, so they are untrusted: they may opt a container out of
exclusive CPUs or steer where its CPUs come from, never grant CPUs.  Each key may be set
pod-wide, or for one container with the suffix ``/container.<name>``, which wins.  A value we
cannot read is an error the pod author sees, never a silent guess.
"""

from __future__ import annotations

from .errors import PolicyError

TYPE_CHECKING = False  # collections.abc is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Mapping

DOMAIN = "nri-cpuplugin.io"
# "false" opts an eligible container out of exclusive CPUs.
EXCLUSIVE = f"exclusive-cpus.{DOMAIN}"
# "true" asks that an eligible container's exclusive CPUs come from the isolated CPUs.
ISOLATED = f"isolated-cpus.{DOMAIN}"
# "prefer" (default), "strict" or "off": place exclusive CPUs next to the pod's NICs.
NIC_LOCALITY = f"nic-locality.{DOMAIN}"
# Comma-separated interface names (in the pod's network namespace) that locality considers.
NICS = f"nics.{DOMAIN}"

# "true" keeps device interrupts off an exclusive container's CPUs while it holds them.
IRQ_FREE = f"irq-free.{DOMAIN}"

KEYS = (EXCLUSIVE, ISOLATED, NIC_LOCALITY, NICS, IRQ_FREE)

# Not ours: CRI-O's high-performance runtime handler lifts the CFS quota of a Guaranteed
# container with whole CPUs (pod cgroup and container cgroup, at StartContainer) when its pod
# carries this annotation with "disable" (or the deprecated "true") and the pod's runtime
# handler allows it.  Read, so that our decision and CRI-O's cannot disagree (policy.py).
CRIO_CPU_QUOTA = "cpu-quota.crio.io"
CRIO_QUOTA_LIFTED = ("disable", "true")
# Not ours either: CRI-O's high-performance handler keeps interrupts off a pod's CPUs when the
# pod says "disable" (or the deprecated "true"); honoured the same way as our own annotation.
CRIO_IRQ = "irq-load-balancing.crio.io"
CRIO_IRQ_OFF = ("disable", "true")
CONTAINER_SUFFIX = "/container."
# What a refusal echoes of a value: enough to recognise it, never a pod author's megabyte.
MAX_ECHO = 64
# The longest value of one of our annotations that is read at all (the longest valid one, a
# list of interface names, is far shorter); a longer one is refused like any bad value.
MAX_VALUE = 256


def lookup(
    annotations: Mapping[str, str], key: str, container_name: str, who: str = ""
) -> str | None:
    """The container-specific value of ``key`` if set, else the pod-wide one, else None.
    PolicyError ("bad-annotation") for a value longer than MAX_VALUE (``who``: the container,
    for the message)."""
    specific = f"{key}{CONTAINER_SUFFIX}{container_name}"
    name = specific if specific in annotations else key
    value = annotations.get(name)
    if value is not None and len(value) > MAX_VALUE:
        raise PolicyError(
            f"annotation {name}={echo(value)}{f' on {who}' if who else ''}: longer than the "
            f"{MAX_VALUE} characters accepted; set one of the documented values",
            "bad-annotation",
        )
    return value


def name_of(annotations: Mapping[str, str], key: str, container_name: str) -> str:
    """The annotation name ``lookup`` took its value from (for messages)."""
    specific = f"{key}{CONTAINER_SUFFIX}{container_name}"
    return specific if specific in annotations else key


def flag(annotations: Mapping[str, str], key: str, container_name: str, who: str) -> bool | None:
    """A true/false annotation; None when unset; PolicyError for anything else."""
    value = lookup(annotations, key, container_name, who)
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


def ours(annotations: Mapping[str, str], container_name: str) -> dict[str, str]:
    """What ``lookup`` can read for this container and nothing else (pods carry kilobytes of
    unrelated annotations, and its siblings' container-specific ones are not its own): at most
    eight keys.  Values are cut to MAX_VALUE + 1 characters: ``lookup`` refuses a cut value
    exactly as it refuses the whole one, so what is kept decides the same."""
    names = _names_for(container_name)
    return {k: annotations[k][: MAX_VALUE + 1] for k in names if k in annotations}


def read(annotations: Mapping[str, str], container_name: str) -> dict[str, str]:
    """Every annotation a decision reads for this container, whole: ``ours`` and CRI-O's quota
    one.  Looked up key by key, never iterated: a runtime's map of a pod's annotations is slow
    to walk, and the decision waits for this."""
    names = (*_names_for(container_name), CRIO_CPU_QUOTA, CRIO_IRQ)
    return {k: annotations[k] for k in names if k in annotations}


def _names_for(container_name: str) -> tuple[str, ...]:
    return (*KEYS, *(f"{key}{CONTAINER_SUFFIX}{container_name}" for key in KEYS))


def echo(value: str) -> str:
    """``value`` quoted for a message, cut (and saying so) when long."""
    if len(value) <= MAX_ECHO:
        return repr(value)
    return f"{value[:MAX_ECHO]!r}... ({len(value)} characters, cut)"
