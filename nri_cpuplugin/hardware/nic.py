"""NIC NUMA locality: which NUMA nodes a pod's network interfaces are attached to.

Kubelet cannot place CPUs next to a pod's NIC.  We can, because the runtime tells us the pod's
network namespace (NRI ``PodSandbox.linux.namespaces``, ``linux.namespaces`` in config.json on
the hook path), and the kernel describes every interface over netlink
(docs/cgroups-and-hooks.md §14):

1. List the links inside the pod's netns.  The namespace file is opened read-only and entered
   by a short-lived thread just long enough to create a netlink socket there: nothing is ever
   created (pyroute2's own netns helpers default to ``O_CREAT``, which would mount a fresh empty
   netns under a mistyped name), the daemon's threads stay in their namespace, and it costs
   ~0.3 ms where pyroute2's forked helper costs ~17 ms per container.  The messages are built
   and parsed by ``rtnetlink.py`` (not pyroute2: see there); netns_links.py takes this step.
2. Each interface's parent device: ``IFLA_PARENT_DEV_NAME`` / ``IFLA_PARENT_DEV_BUS_NAME``
   (Linux >= 5.14).  A macvlan/ipvlan/vlan has none; its lower device (``IFLA_LINK``, in the
   netns ``IFLA_LINK_NETNSID`` names) is looked up instead when it lives in our own netns.
   veth, bridges and the like are virtual: no preference.
3. ``<sysfs>/bus/<bus>/devices/<dev>/numa_node``, walking up the device path to the first
   device that has one (a virtio NIC's node is its PCI function's).  -1 means the firmware
   does not say: no preference.  ``local_cpulist`` is used when ``numa_node`` is absent.

Host-network pods get no NIC preference unless an annotation names interfaces (of the host).
Annotations are untrusted: they choose among the CPUs the container is entitled to, never more;
"strict" only lets a pod fail its own creation rather than run far from its NIC.

The OCI hook loads this module for every exclusive candidate: what reading a namespace needs
(the C cores of socket, threading and ctypes) netns_links.py imports only when one is read.
"""

from __future__ import annotations

import os

from ..base.value import Value
from ..core import annotation
from ..core.cpuset import CPUSet
from ..core.errors import PolicyError
from ..core.placement import NICPreference
from ..core.topology import Topology
from .netns_links import STACKED_KINDS, Link, NICError, list_links

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    # socket and threading are imported when a namespace is inspected
    from collections.abc import Mapping
    from typing import Any


# "net1,net2": only these interfaces count (default: every interface with a device).  On a
# host-network pod this is what turns locality on, naming host interfaces.
NICS_ANNOTATION = annotation.NICS
# "prefer" (default) | "strict" (fail rather than place elsewhere) | "off" (no preference).
LOCALITY_ANNOTATION = annotation.NIC_LOCALITY
MODES = ("prefer", "strict", "off")
# Bounds on untrusted input and on the work one creation may cause.
MAX_NAMED = 16
IFNAMSIZ = 16


class NIC(Value):
    """One interface of the pod and where its device sits."""

    name: str
    device: str = ""  # "<bus>/<device>" of the parent device; empty for virtual interfaces
    numa: int | None = None  # None: no preference (virtual, -1, or not described)
    via: str = ""  # the lower (host) interface it was resolved through

    def describe(self) -> str:
        if not self.device:
            return f"{self.name} (virtual: no NUMA preference)"
        via = f" via {self.via}" if self.via else ""
        where = f"NUMA {self.numa}" if self.numa is not None else "no NUMA preference"
        return f"{self.name} ({self.device}{via}, {where})"


class Request(Value):
    """What the pod's annotations ask for."""

    names: tuple[str, ...] | None = None  # None: every interface of the pod's netns
    mode: str = "prefer"


class Locality(Value):
    """The outcome for one container: the preference for the policy, and what to explain."""

    preference: NICPreference | None
    nics: tuple[NIC, ...]
    note: str  # one sentence for the audit trail

    @property
    def nodes(self) -> CPUSet:
        return self.preference.nodes if self.preference is not None else CPUSet()


# --- input: annotations and namespaces --------------------------------------------------------


def request(annotations: Mapping[str, str], container_name: str) -> Request:
    """The NIC request of a container; the container-specific annotation wins.  Raises
    PolicyError for values the pod author must fix (a silent guess would hide the typo)."""
    names_text = annotation.lookup(annotations, NICS_ANNOTATION, container_name)
    mode_text = annotation.lookup(annotations, LOCALITY_ANNOTATION, container_name)
    mode = "prefer"
    if mode_text is not None:
        mode = mode_text.strip().lower()
        if mode not in MODES:
            raise PolicyError(
                f"annotation {LOCALITY_ANNOTATION}={annotation.echo(mode_text)}: expected one "
                f"of {', '.join(MODES)}",
                "bad-annotation",
            )
    names = None
    if names_text is not None:
        names = tuple(n.strip() for n in names_text.split(",") if n.strip())
        if not names or len(names) > MAX_NAMED:
            raise PolicyError(
                f"annotation {NICS_ANNOTATION}={annotation.echo(names_text)}: expected 1 to "
                f"{MAX_NAMED} comma-separated interface names",
                "bad-annotation",
            )
        for name in names:
            bad = "/" in name or name in (".", "..") or not name.isprintable()
            if bad or len(name) >= IFNAMSIZ:
                raise PolicyError(
                    f"annotation {NICS_ANNOTATION}: {annotation.echo(name)} is not a valid "
                    "interface name",
                    "bad-annotation",
                )
    return Request(names, mode)


# --- sysfs ----------------------------------------------------------------------------------


def device_numa(sysfs: str, bus: str, device: str, topology: Topology | None = None) -> int | None:
    """NUMA node of ``<sysfs>/bus/<bus>/devices/<device>`` or of the nearest ancestor device
    that has one; None when nothing says (-1, absent, outside the sysfs root)."""
    for name in (bus, device):
        if not name or "/" in name or name in (".", ".."):
            return None
    root = os.path.realpath(sysfs)
    try:
        path = os.path.realpath(os.path.join(root, "bus", bus, "devices", device))
    except OSError:
        return None
    devices = os.path.join(root, "devices") + os.sep
    while path.startswith(devices):  # below <root>/devices/, never above
        node = _read_int(os.path.join(path, "numa_node"))
        if node is not None:
            return node if node >= 0 else None
        local = _read_text(os.path.join(path, "local_cpulist"))
        if local is not None and topology is not None:
            try:
                cpus = CPUSet.parse(local) & topology.online
            except ValueError:
                cpus = CPUSet()
            nodes = topology.numa_of(cpus)
            # All online CPUs is what the kernel prints when it knows nothing (-1).
            if len(nodes) == 1 and cpus != topology.online:
                return min(nodes)
        path = os.path.dirname(path)
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(4096).strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


# --- putting it together ------------------------------------------------------------------------


def resolve(
    links: list[Link], own: Mapping[int, Link] | None, sysfs: str, topology: Topology | None
) -> list[NIC]:
    """The NICs behind ``links`` (loopback skipped)."""
    nics = []
    for link in links:
        if link.loopback:
            continue
        device, via = "", ""
        bus, dev = link.parent_bus, link.parent_dev
        if not dev and link.kind in STACKED_KINDS and link.lower is not None and own is not None:
            lower = own.get(link.lower)
            if lower is not None:
                bus, dev, via = lower.parent_bus, lower.parent_dev, lower.name
        numa = None
        if dev:
            device = f"{bus or '?'}/{dev}"
            numa = device_numa(sysfs, bus, dev, topology) if bus else None
        nics.append(NIC(link.name, device, numa, via))
    return nics


def locality(
    netns: str | None,
    annotations: Mapping[str, str],
    container_name: str,
    sysfs: str,
    topology: Topology | None = None,
    lister: Any = None,
) -> Locality:
    """The NIC preference of one container (see the module docstring).  Raises PolicyError
    for bad annotations, and when locality is strict but the NICs cannot be inspected."""
    asked = request(annotations, container_name)
    if asked.mode == "off":
        return Locality(None, (), f"NIC locality turned off by {LOCALITY_ANNOTATION}")
    if netns is None and asked.names is None:
        return Locality(None, (), "host network: no NIC preference unless annotated")
    where = netns or "the host network namespace"
    try:
        links, own = (lister or list_links)(netns)
    except (NICError, OSError) as err:
        if asked.mode == "strict":
            raise PolicyError(
                f"NIC locality is strict but the interfaces in {where} cannot be read: {err}"
            ) from None
        return Locality(None, (), f"no NIC preference: cannot inspect {where}: {err}")
    nics = _chosen(resolve(links, own, sysfs, topology), asked, where)
    return _preference(nics, asked.mode == "strict", where, topology)


def _chosen(nics: list[NIC], asked: Request, where: str) -> list[NIC]:
    """The NICs the annotation names (all of them when strict), or every NIC with a device:
    virtual interfaces say nothing."""
    if asked.names is None:
        return [nic for nic in nics if nic.device]
    by_name = {nic.name: nic for nic in nics}
    missing = [n for n in asked.names if n not in by_name]
    if missing and asked.mode == "strict":
        raise PolicyError(
            f"NIC locality is strict but {', '.join(missing)} not found in {where} "
            f"(has: {', '.join(sorted(by_name)) or 'nothing'})"
        )
    return [by_name[n] for n in asked.names if n in by_name]


def _preference(nics: list[NIC], strict: bool, where: str, topology: Topology | None) -> Locality:
    """The NUMA nodes of ``nics`` as a preference (none when they say nothing)."""
    nodes = CPUSet(nic.numa for nic in nics if nic.numa is not None)
    if topology is not None:
        nodes &= CPUSet(topology.numa_nodes)
    described = tuple(nic.describe() for nic in nics)
    if not nodes:
        if not described:
            return Locality(None, (), f"no NIC preference in {where}: no interface with a device")
        # Kept (without nodes: no preference) so that status can show which NICs were seen.
        return Locality(
            NICPreference(CPUSet(), False, described),
            tuple(nics),
            f"no NIC preference in {where}: {'; '.join(described)}",
        )
    return Locality(
        NICPreference(nodes, strict, described),
        tuple(nics),
        f"NICs on NUMA {nodes}{' (strict)' if strict else ''}: {'; '.join(described)}",
    )
