"""Real network namespaces and links for NIC-locality tests, always cleaned up.

Links are created with pyroute2 (as the daemon reads them): veth pairs (the usual CNI pod
interface: virtual, no device) and macvlans stacked on the host's own NIC (what a secondary
network such as Multus/macvlan gives a pod: its device is the host NIC's).  This machine's
kernel has no dummy driver, so "a NIC with a device" is always a macvlan over the host's NIC.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nri_cpuplugin.hardware import netns_links

NETNS_DIR = Path("/var/run/netns")


@dataclass
class PodNetns:
    name: str
    host_links: list[str] = field(default_factory=list)  # our ends, deleted at the end

    @property
    def path(self) -> str:
        return str(NETNS_DIR / self.name)

    def add_veth(self, inside: str = "eth0") -> str:
        """A veth pair: ``inside`` in the pod's netns, a uniquely named end on the host."""
        from pyroute2 import IPRoute

        outside = f"nrv{secrets.token_hex(4)}"
        with IPRoute() as ip:
            peer = {"ifname": inside, "net_ns_fd": self.name}
            ip.link("add", ifname=outside, kind="veth", peer=peer)
        self.host_links.append(outside)
        return outside

    def add_macvlan(self, lower: str, inside: str = "net1") -> None:
        """A macvlan on the host's ``lower`` NIC, created straight into the pod's netns (so
        nothing is left on the host: it goes away with the namespace)."""
        from pyroute2 import IPRoute

        staging = f"nrm{secrets.token_hex(4)}"
        with IPRoute() as ip:
            [index] = ip.link_lookup(ifname=lower)
            ip.link(
                "add",
                ifname=staging,
                kind="macvlan",
                link=index,
                macvlan_mode="bridge",
                net_ns_fd=self.name,
            )
        with IPRoute(netns=self.path, flags=0) as ip:  # flags=0: attach, never create
            [index] = ip.link_lookup(ifname=staging)
            ip.link("set", index=index, ifname=inside)


@contextlib.contextmanager
def pod_netns() -> Iterator[PodNetns]:
    from pyroute2 import IPRoute
    from pyroute2 import netns as pyroute2_netns

    ns = PodNetns(f"nri-test-{os.getpid()}-{secrets.token_hex(3)}")
    pyroute2_netns.create(ns.name)
    try:
        yield ns
    finally:
        with IPRoute() as ip:
            for name in ns.host_links:
                for index in ip.link_lookup(ifname=name):
                    with contextlib.suppress(Exception):
                        ip.link("del", index=index)
        pyroute2_netns.remove(ns.name)


def host_nic() -> netns_links.Link:
    """The host's first interface with a parent device (this machine: eth0 on virtio)."""
    links, _ = netns_links.list_links(None)
    for link in links:
        if link.parent_dev and link.parent_bus and not link.loopback:
            return link
    raise AssertionError(f"no host interface with a parent device: {links}")


def leftover_test_namespaces() -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith("nri-test-"))
