"""Our rtnetlink codec (nri_cpuplugin/rtnetlink.py) against pyroute2 on real kernel answers.

The kernel answers our own requests in a real network namespace holding a veth and a macvlan
stacked on the host's NIC (tests/netns_util.py), and in the host's namespace; pyroute2's
decoder (an independent implementation) reads the same bytes, and both must agree on every
field NIC locality uses.  Malformed bytes fail with NetlinkError, never anything else.
"""

from __future__ import annotations

import contextlib
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from netns_util import host_nic, leftover_test_namespaces, pod_netns

from nri_cpuplugin.hardware import netns_links, rtnetlink


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert leftover_test_namespaces() == []


def _exchange(netns: str | None, request: bytes, seq: int) -> list[bytes]:
    """Raw datagrams the kernel sends back for ``request`` (until DONE or a single answer)."""
    datagrams = []
    with contextlib.closing(netns_links.netlink_socket(netns)) as sock:
        sock.settimeout(2)
        sock.send(request)
        while True:
            data = sock.recv(1 << 16)
            datagrams.append(data)
            parts = [m for m in rtnetlink.parse(data) if m.seq == seq]
            if any(m.type == rtnetlink.NLMSG_DONE or not m.flags & 2 for m in parts):
                return datagrams


def _pyroute2_view(data: bytes) -> list[dict]:
    from pyroute2.netlink.rtnl.marshal import MarshalRtnl

    out = []
    for msg in MarshalRtnl().parse(data):
        if msg["header"]["type"] != rtnetlink.RTM_NEWLINK:
            continue
        out.append(
            {
                "index": msg["index"],
                "flags": msg["flags"],
                "name": msg.get_attr("IFLA_IFNAME"),
                "link": msg.get_attr("IFLA_LINK"),
                "netnsid": msg.get_attr("IFLA_LINK_NETNSID"),
                "kind": msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND"),
                "parent": msg.get_attr("IFLA_PARENT_DEV_NAME"),
                "bus": msg.get_attr("IFLA_PARENT_DEV_BUS_NAME"),
            }
        )
    return out


def _our_view(data: bytes) -> list[dict]:
    out = []
    for msg in rtnetlink.parse(data):
        if msg.type != rtnetlink.RTM_NEWLINK:
            continue
        out.append(
            {
                "index": msg.index,
                "flags": msg.link_flags,
                "name": msg.string(rtnetlink.IFLA_IFNAME),
                "link": msg.u32(rtnetlink.IFLA_LINK),
                "netnsid": msg.s32(rtnetlink.IFLA_LINK_NETNSID),
                "kind": msg.nested_string(rtnetlink.IFLA_LINKINFO, rtnetlink.IFLA_INFO_KIND),
                "parent": msg.string(rtnetlink.IFLA_PARENT_DEV_NAME),
                "bus": msg.string(rtnetlink.IFLA_PARENT_DEV_BUS_NAME),
            }
        )
    return out


def test_link_dumps_decode_as_pyroute2_decodes_them():
    lower = host_nic()
    with pod_netns() as ns:
        ns.add_veth("eth0")
        ns.add_macvlan(lower.name, "net1")
        for netns in (ns.path, None):
            datagrams = _exchange(netns, rtnetlink.get_links(7), 7)
            ours = [link for d in datagrams for link in _our_view(d)]
            theirs = [link for d in datagrams for link in _pyroute2_view(d)]
            assert ours == theirs
            names = {link["name"] for link in ours}
            if netns is not None:
                assert names == {"lo", "eth0", "net1"}
                kinds = {link["name"]: link["kind"] for link in ours}
                assert kinds["eth0"] == "veth" and kinds["net1"] == "macvlan"
                net1 = next(link for link in ours if link["name"] == "net1")
                assert net1["link"] == lower.index and net1["netnsid"] is not None
            else:
                assert lower.name in names
                host = next(link for link in ours if link["name"] == lower.name)
                assert host["parent"] and host["bus"]


def test_one_link_and_the_nsid_answers():
    lower = host_nic()
    [data] = _exchange(None, rtnetlink.get_link(9, lower.index), 9)
    [msg] = rtnetlink.parse(data)
    assert (msg.type, msg.index, msg.string(rtnetlink.IFLA_IFNAME)) == (
        rtnetlink.RTM_NEWLINK,
        lower.index,
        lower.name,
    )
    assert _our_view(data) == _pyroute2_view(data)
    # A missing ifindex is the kernel's error answer (ENODEV), decoded as such.
    [data] = _exchange(None, rtnetlink.get_link(10, 0x7FFFFFF0), 10)
    [msg] = rtnetlink.parse(data)
    assert msg.type == rtnetlink.NLMSG_ERROR and msg.error == 19  # ENODEV
    with pod_netns() as ns:
        ns.add_macvlan(lower.name, "net1")
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            [data] = _exchange(ns.path, rtnetlink.get_nsid(11, fd), 11)
        finally:
            os.close(fd)
        [msg] = rtnetlink.parse(data)
        assert msg.type == rtnetlink.RTM_NEWNSID
        nsid = msg.s32(rtnetlink.NETNSA_NSID)
        # The same id the pod's macvlan names its lower device's namespace by.
        links = [link for d in _exchange(ns.path, rtnetlink.get_links(12), 12) for link in
                 _our_view(d)]  # fmt: skip
        assert next(x["netnsid"] for x in links if x["name"] == "net1") == nsid


def test_requests_are_what_pyroute2_encodes():
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    msg = ifinfmsg()
    msg["header"]["type"] = rtnetlink.RTM_GETLINK
    msg["header"]["flags"] = rtnetlink.NLM_F_REQUEST | rtnetlink.NLM_F_DUMP
    msg["header"]["sequence_number"] = 5
    msg.encode()
    assert rtnetlink.get_links(5) == bytes(msg.data)
    msg = ifinfmsg()
    msg["header"]["type"] = rtnetlink.RTM_GETLINK
    msg["header"]["flags"] = rtnetlink.NLM_F_REQUEST
    msg["header"]["sequence_number"] = 6
    msg["index"] = 42
    msg.encode()
    assert rtnetlink.get_link(6, 42) == bytes(msg.data)


def _header(size: int, kind: int) -> bytes:
    return struct.pack("=IHHII", size, kind, 2, 1, 0)


@pytest.mark.parametrize(
    "data",
    [
        _header(8, rtnetlink.RTM_NEWLINK),  # length below the header's
        _header(64, rtnetlink.RTM_NEWLINK),  # length past the datagram
        _header(20, rtnetlink.RTM_NEWLINK) + b"\0" * 4,  # link message without its ifinfomsg
        _header(18, rtnetlink.NLMSG_ERROR) + b"\0\0",  # error without its errno
        # an attribute that claims more than its message holds
        _header(40, rtnetlink.RTM_NEWLINK) + b"\0" * 16 + struct.pack("=HH", 200, 3) + b"ab\0\0",
        _header(40, rtnetlink.RTM_NEWLINK) + b"\0" * 16 + struct.pack("=HH", 2, 3) + b"ab\0\0",
    ],
    ids=["short-length", "overrun", "no-ifinfomsg", "short-error", "attr-overrun", "attr-short"],
)
def test_malformed_answers_are_refused(data):
    with pytest.raises(rtnetlink.NetlinkError):
        rtnetlink.parse(data)


@given(st.binary(max_size=256))
def test_any_bytes_decode_or_fail_with_netlink_error(data):
    try:
        messages = rtnetlink.parse(data)
    except rtnetlink.NetlinkError:
        return
    for msg in messages:
        msg.string(rtnetlink.IFLA_IFNAME)
        msg.u32(rtnetlink.IFLA_LINK)
        with contextlib.suppress(rtnetlink.NetlinkError):
            msg.nested_string(rtnetlink.IFLA_LINKINFO, rtnetlink.IFLA_INFO_KIND)
