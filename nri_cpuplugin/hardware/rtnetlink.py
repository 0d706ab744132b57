"""The few rtnetlink messages NIC locality needs, as bytes in and out (no socket here).

``netns_links.py`` asks the kernel for the links of a network namespace (RTM_GETLINK), one link by
index, and the id under which a namespace knows ours (RTM_GETNSID).  The messages are built and
parsed here rather than with pyroute2: the OCI hook, a new process per container start, needs these
answers for every exclusive container of a pod with a network namespace, and importing pyroute2
(~165 ms: its package imports every submodule) costs more than the rest of the hook. Only the
daemon's uevent listener (hotplug.py) uses pyroute2.  tests/system/test_rtnetlink.py checks this
decoder against pyroute2's on real kernel answers (docs/cgroups-and-hooks.md §14).

Layouts (linux/netlink.h, linux/rtnetlink.h, linux/if_link.h, linux/net_namespace.h), all in
host byte order: ``nlmsghdr`` {u32 len, u16 type, u16 flags, u32 seq, u32 pid}; ``ifinfomsg``
{u8 family, u8 pad, u16 type, s32 index, u32 flags, u32 change}; ``rtgenmsg`` {u8 family},
padded to 4; ``nlmsgerr`` {s32 error, nlmsghdr request}; attributes ``rtattr`` {u16 len,
u16 type} + payload, each padded to 4 bytes.
"""

from __future__ import annotations

import struct

from ..base.errors import PluginError

# message types and flags
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWNSID, RTM_GETNSID = 88, 90
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_DUMP = 0x1, 0x2, 0x300
# link attributes
IFLA_IFNAME, IFLA_LINK, IFLA_LINKINFO = 3, 5, 18
IFLA_LINK_NETNSID = 37
IFLA_PARENT_DEV_NAME, IFLA_PARENT_DEV_BUS_NAME = 56, 57
IFLA_INFO_KIND = 1  # nested in IFLA_LINKINFO
# namespace id attributes
NETNSA_NSID, NETNSA_FD = 1, 3
NLA_TYPE_MASK = 0x3FFF  # the top two bits of rtattr.type are the nested/byte-order flags

_HEADER = struct.Struct("=IHHII")
_IFINFO = struct.Struct("=BxHiII")
_RTATTR = struct.Struct("=HH")
_U32 = struct.Struct("=I")
_S32 = struct.Struct("=i")


class NetlinkError(PluginError, ValueError):
    """A reply that is not well-formed, or the kernel's error answer."""

    code = "netlink"


class Message:
    """One decoded reply.  ``error``: the errno of an NLMSG_ERROR (0 = acknowledgement)."""

    __slots__ = ("attrs", "error", "flags", "index", "link_flags", "seq", "type")

    def __init__(self, type: int, flags: int, seq: int) -> None:
        self.type = type
        self.flags = flags
        self.seq = seq
        self.error: int | None = None
        self.index = 0  # RTM_NEWLINK: the link's ifindex
        self.link_flags = 0  # RTM_NEWLINK: IFF_* flags
        self.attrs: dict[int, bytes] = {}  # attribute type -> raw payload (first one wins)

    def string(self, kind: int) -> str | None:
        raw = self.attrs.get(kind)
        return None if raw is None else raw.split(b"\0", 1)[0].decode(errors="replace")

    def u32(self, kind: int) -> int | None:
        raw = self.attrs.get(kind)
        return None if raw is None or len(raw) < 4 else _U32.unpack_from(raw)[0]

    def s32(self, kind: int) -> int | None:
        raw = self.attrs.get(kind)
        return None if raw is None or len(raw) < 4 else _S32.unpack_from(raw)[0]

    def nested_string(self, outer: int, inner: int) -> str | None:
        raw = self.attrs.get(outer)
        if raw is None:
            return None
        value = attributes(raw).get(inner)
        return None if value is None else value.split(b"\0", 1)[0].decode(errors="replace")


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attribute(kind: int, payload: bytes) -> bytes:
    size = _RTATTR.size + len(payload)
    return _RTATTR.pack(size, kind) + payload + b"\0" * (_align(size) - size)


def _message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return _HEADER.pack(_HEADER.size + len(body), kind, flags, seq, 0) + body


def get_links(seq: int) -> bytes:
    """RTM_GETLINK dump: every link of the socket's namespace."""
    return _message(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, _IFINFO.pack(0, 0, 0, 0, 0))


def get_link(seq: int, index: int) -> bytes:
    """RTM_GETLINK for one ifindex."""
    return _message(RTM_GETLINK, NLM_F_REQUEST, seq, _IFINFO.pack(0, 0, index, 0, 0))


def get_nsid(seq: int, netns_fd: int) -> bytes:
    """RTM_GETNSID: the id the socket's namespace gives the namespace open at ``netns_fd``."""
    body = b"\0" * 4 + _attribute(NETNSA_FD, _U32.pack(netns_fd))  # rtgenmsg, AF_UNSPEC
    return _message(RTM_GETNSID, NLM_F_REQUEST, seq, body)


def attributes(data: bytes) -> dict[int, bytes]:
    """rtattrs packed in ``data``, by type (flag bits cleared); the first of a type wins."""
    attrs: dict[int, bytes] = {}
    offset = 0
    while offset + _RTATTR.size <= len(data):
        size, kind = _RTATTR.unpack_from(data, offset)
        if size < _RTATTR.size or offset + size > len(data):
            raise NetlinkError(f"attribute of length {size} at offset {offset} overruns")
        attrs.setdefault(kind & NLA_TYPE_MASK, data[offset + _RTATTR.size : offset + size])
        offset += _align(size)
    return attrs


def parse(data: bytes) -> list[Message]:
    """Every message in one datagram from the kernel."""
    messages = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        size, kind, flags, seq, _pid = _HEADER.unpack_from(data, offset)
        if size < _HEADER.size or offset + size > len(data):
            raise NetlinkError(f"message of length {size} at offset {offset} overruns")
        body = data[offset + _HEADER.size : offset + size]
        message = Message(kind, flags, seq)
        if kind == NLMSG_ERROR:
            if len(body) < _S32.size:
                raise NetlinkError("truncated error message")
            message.error = -_S32.unpack_from(body)[0]
        elif kind == RTM_NEWLINK:
            if len(body) < _IFINFO.size:
                raise NetlinkError("truncated link message")
            _family, _type, message.index, message.link_flags, _change = _IFINFO.unpack_from(body)
            message.attrs = attributes(body[_IFINFO.size :])
        elif kind == RTM_NEWNSID:
            message.attrs = attributes(body[4:])
        messages.append(message)
        offset += _align(size)
    return messages
