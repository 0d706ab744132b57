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
   and parsed by ``rtnetlink.py`` (not pyroute2: see there).
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

The C cores of socket, threading and ctypes are imported only when a namespace is read: the
OCI hook loads this module for every exclusive candidate.
"""

from __future__ import annotations

import errno
import os
import stat

from ..base.errors import PluginError
from ..base.value import Value
from ..core import annotation
from ..core.cpuset import CPUSet
from ..core.errors import PolicyError
from ..core.placement import NICPreference
from ..core.topology import Topology
from . import rtnetlink

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    # socket and threading are imported when a namespace is inspected
    import _socket
    from collections.abc import Iterable, Mapping
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
MAX_LINKS = 4096
NETLINK_TIMEOUT = 1.0
CLONE_NEWNET = 0x40000000
# Link kinds whose NIC is their lower device (IFLA_LINK).  veth's IFLA_LINK is its peer, which
# is virtual too.
STACKED_KINDS = frozenset({"macvlan", "macvtap", "ipvlan", "ipvtap", "vlan"})
NETWORK = "network"


class NICError(PluginError):
    """The pod's network namespace could not be inspected; the message says why."""

    code = "nic"


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


# --- netlink ------------------------------------------------------------------------------------


def _libc() -> Any:
    """libc as ``ctypes.CDLL(None, use_errno=True)`` gives it, for ``setns`` (-1 and errno,
    for _errno(), on failure).  Built from _ctypes, the C core ctypes is made of, exactly as
    CDLL does: importing ctypes itself would cost the OCI hook more than a millisecond for
    each exclusive container of a pod with a network namespace, for this one function."""
    import _ctypes
    from types import SimpleNamespace

    class Function(_ctypes.CFuncPtr):  # returns a C int, as CDLL's functions do by default
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO

    # (dlopen(None) is the program itself; typeshed asks for a CDLL where any object with a
    # _handle will do.)
    libc = SimpleNamespace(_handle=_ctypes.dlopen(None, _ctypes.RTLD_LOCAL))  # type: ignore[arg-type]
    libc.setns = Function(("setns", libc))  # type: ignore[arg-type]
    return libc


def _open_netns(netns: str) -> int:
    """A descriptor of the network namespace file ``netns``."""
    try:
        # No O_CREAT, ever: attach to what exists or fail.  Never block (a FIFO planted there)
        # and never open a device: a namespace file is a regular file of the nsfs.
        if not stat.S_ISREG(os.stat(netns).st_mode):
            raise NICError(f"{netns} is not a network namespace (not a regular file)")
        ns_fd = os.open(netns, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise NICError(f"cannot open network namespace {netns}: {err.strerror}") from None
    if not stat.S_ISREG(os.fstat(ns_fd).st_mode):
        os.close(ns_fd)
        raise NICError(f"{netns} is not a network namespace (not a regular file)")
    return ns_fd


def netlink_socket(netns: str | None) -> _socket.socket:
    """A NETLINK_ROUTE socket in ``netns`` (a path; None: our own namespace)."""
    # The C cores of socket and threading: the OCI hook gets here for every exclusive container
    # of a pod with a network namespace, and importing the full modules costs it ~2 ms.
    import _socket
    import _thread

    flags = _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC
    if netns is None:
        return _socket.socket(_socket.AF_NETLINK, flags, 0)
    ns_fd = _open_netns(netns)
    result: dict[str, Any] = {}

    def enter() -> None:
        # setns(CLONE_NEWNET) changes only this thread, which ends right after: even if going
        # back failed, no other thread of the process would ever run in the pod's namespace.
        own = -1
        try:
            libc = _libc()
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            if libc.setns(ns_fd, CLONE_NEWNET) != 0:
                code = _errno()
                result["error"] = NICError(
                    f"cannot enter network namespace {netns}: {os.strerror(code)}"
                    + (" (not a network namespace?)" if code == errno.EINVAL else "")
                )
                return
            try:
                result["sock"] = _socket.socket(_socket.AF_NETLINK, flags, 0)
            finally:
                libc.setns(own, CLONE_NEWNET)
        except OSError as err:
            result["error"] = NICError(f"netlink socket in {netns}: {err.strerror}")
        except BaseException as err:  # whatever happens, the caller hears of it
            result["error"] = err
        finally:
            if own >= 0:
                os.close(own)
            done.release()  # always: the caller is waiting for it

    done = _thread.allocate_lock()
    done.acquire()
    try:
        _thread.start_new_thread(enter, ())
        done.acquire()  # released as the thread ends: a join
    finally:
        os.close(ns_fd)
    if "error" in result:
        raise result["error"]
    sock: _socket.socket = result["sock"]
    return sock


def _errno() -> int:
    import _ctypes  # (ctypes.get_errno is this function)

    return _ctypes.get_errno()


def _request(sock: _socket.socket, request: bytes, seq: int) -> list[rtnetlink.Message]:
    """Send one request, return the answers (all parts of a dump)."""
    sock.settimeout(NETLINK_TIMEOUT)
    sock.send(request)
    answers: list[rtnetlink.Message] = []
    while True:
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            raise NICError("the kernel did not answer a netlink request in time") from None
        try:
            parts = rtnetlink.parse(data)
        except rtnetlink.NetlinkError as err:
            raise NICError(f"netlink: {err}") from None
        for part in parts:
            if part.seq != seq:
                continue
            if part.error:
                raise NICError(f"netlink: {os.strerror(part.error)}")
            if part.type == rtnetlink.NLMSG_DONE:
                return answers
            answers.append(part)
            if len(answers) > MAX_LINKS:
                raise NICError(f"more than {MAX_LINKS} links: refusing to go on")
            if not part.flags & rtnetlink.NLM_F_MULTI:
                return answers


def _links(sock: _socket.socket) -> list[rtnetlink.Message]:
    return _request(sock, rtnetlink.get_links(1), 1)


def _link_by_index(sock: _socket.socket, index: int) -> rtnetlink.Message | None:
    try:
        answers = _request(sock, rtnetlink.get_link(3, index), 3)
    except NICError:
        return None  # gone meanwhile (ENODEV): nothing to say about it
    return answers[0] if answers else None


def _nsid_of_own_netns(sock: _socket.socket) -> int | None:
    """The id under which the namespace behind ``sock`` knows *our* network namespace."""
    fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        answers = _request(sock, rtnetlink.get_nsid(2, fd), 2)
    finally:
        os.close(fd)
    for answer in answers:
        nsid = answer.s32(rtnetlink.NETNSA_NSID)
        if nsid is not None and nsid >= 0:  # -1 means "no id assigned"
            return nsid
    return None


class Link(Value):
    """What netlink says about one interface (the part we use)."""

    index: int
    name: str
    kind: str
    parent_bus: str
    parent_dev: str
    lower: int | None  # IFLA_LINK
    lower_nsid: int | None  # IFLA_LINK_NETNSID
    loopback: bool


def _link(msg: rtnetlink.Message) -> Link:
    link = msg.u32(rtnetlink.IFLA_LINK)
    try:
        kind = msg.nested_string(rtnetlink.IFLA_LINKINFO, rtnetlink.IFLA_INFO_KIND) or ""
    except rtnetlink.NetlinkError as err:
        raise NICError(f"netlink: link {msg.index}: {err}") from None
    return Link(
        index=msg.index,
        name=msg.string(rtnetlink.IFLA_IFNAME) or "",
        kind=kind,
        parent_bus=msg.string(rtnetlink.IFLA_PARENT_DEV_BUS_NAME) or "",
        parent_dev=msg.string(rtnetlink.IFLA_PARENT_DEV_NAME) or "",
        lower=link if link and link != msg.index else None,
        lower_nsid=msg.s32(rtnetlink.IFLA_LINK_NETNSID),
        loopback=bool(msg.link_flags & 0x8),  # IFF_LOOPBACK
    )


def list_links(netns: str | None) -> tuple[list[Link], dict[int, Link] | None]:
    """(links of ``netns``, the lower devices of its stacked links that live in our own
    namespace, by index; None when there are none)."""
    # (try/finally, not contextlib.closing: the hook does not import contextlib.)
    sock = netlink_socket(netns)
    try:
        links = [_link(m) for m in _links(sock)]
        stacked = [x for x in links if x.kind in STACKED_KINDS and x.lower is not None]
        if not stacked:
            return links, None
        if netns is None:
            return links, {x.index: x for x in links}
        own_id = _nsid_of_own_netns(sock)
    finally:
        sock.close()
    wanted = {
        x.lower
        for x in stacked
        if x.lower is not None and own_id is not None and x.lower_nsid == own_id
    }
    return links, (_own_links(sorted(wanted)) if wanted else None)


def _own_links(indexes: list[int]) -> dict[int, Link]:
    """The links of our own namespace with these indexes (those that still exist)."""
    own: dict[int, Link] = {}
    sock = netlink_socket(None)
    try:
        for index in indexes:
            msg = _link_by_index(sock, index)
            if msg is not None:
                own[index] = _link(msg)
    finally:
        sock.close()
    return own


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
