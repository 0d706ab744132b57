"""Whose NICs are read, and in which network namespace: the guard both front ends put before
NIC locality (nic.py).

Only an exclusive candidate's CPUs are chosen, so only its pod's interfaces are worth reading.
The check comes before nic.py is imported: the OCI hook, a new process per container, pays for
that import (and its netlink code) only for the containers it reads NICs for.
"""

from __future__ import annotations

from ..core.eligibility import eligibility
from ..core.topology import Topology
from ..core.workload import Workload

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from .netns_links import Link
    from .nic import Locality

    Lister = Callable[[str | None], tuple[list[Link], dict[int, Link] | None]]


NETWORK = "network"


def netns_path(namespaces: Iterable[Any]) -> str | None:
    """The network namespace path among NRI ``LinuxNamespace`` messages or OCI
    ``linux.namespaces`` entries (dicts); None for the host network (no such entry, or one
    without a path, which on a container means "a new one the runtime makes")."""
    for ns in namespaces:
        kind = ns.get("type") if isinstance(ns, dict) else getattr(ns, "type", None)
        path = ns.get("path") if isinstance(ns, dict) else getattr(ns, "path", None)
        if kind == NETWORK and isinstance(path, str) and path:
            return path
    return None


def candidate_locality(
    workload: Workload,
    netns: str | None,
    sysfs: str,
    topology: Topology,
    lister: Lister | None = None,
) -> Locality | None:
    """The NIC preference of an exclusive candidate; None for any other container.  Raises
    PolicyError for annotations that make the policy refuse the container, and as
    ``nic.locality`` does (bad NIC annotations, a strict locality that cannot be read)."""
    if eligibility(workload)[0] is None:
        return None
    from . import nic

    return nic.locality(
        netns, workload.annotations, workload.container_name, sysfs, topology, lister
    )
