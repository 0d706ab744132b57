"""The links of a network namespace, listed over netlink from inside it (nic.py's step 1; the
reasons are in its docstring): the namespace file opened read-only and entered by a short-lived
thread just long enough to create a NETLINK_ROUTE socket there, a dump of its links, and for
stacked links (macvlan, ipvlan, vlan) their lower devices in our own namespace.  The messages
are rtnetlink.py's.

The C cores of socket, threading and ctypes are imported only when a namespace is read: the
OCI hook loads this module for every exclusive candidate.
"""

from __future__ import annotations

import errno
import os
import stat

from ..base.errors import PluginError
from ..base.value import Value
from . import rtnetlink

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    # socket and threading are imported when a namespace is inspected
    import _socket
    from typing import Any

MAX_LINKS = 4096
NETLINK_TIMEOUT = 1.0
CLONE_NEWNET = 0x40000000
# Link kinds whose NIC is their lower device (IFLA_LINK).  veth's IFLA_LINK is its peer, which
# is virtual too.
STACKED_KINDS = frozenset({"macvlan", "macvtap", "ipvlan", "ipvtap", "vlan"})


class NICError(PluginError):
    """The pod's network namespace could not be inspected; the message says why."""

    code = "nic"


# --- the socket -----------------------------------------------------------------------------------


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
