"""A minimal CNI plugin (spec 1.0.0) for the NIC-locality e2e tests, run by containerd itself.

Every pod gets ``eth0``, one end of a veth pair (virtual: what most CNIs give).  Pods whose name
starts with ``nic-`` also get ``net1``, a macvlan on the host's NIC named by the config key
``lower`` - the way SR-IOV or macvlan secondary networks give a pod an interface with a real
device behind it.  ``loopback`` (which containerd always runs) just brings ``lo`` up.  The
namespace is the runtime's (``CNI_NETNS``, a path); nothing is created on the host except the
veth's outer end, which DEL removes (the rest goes away with the namespace).

Installed by the test as ``<containerd dir>/cni/bin/{nri-test-cni,loopback}`` with this venv's
interpreter in the shebang; pyroute2 does the netlink work, as in the daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys


def result(version: str, interfaces: list[dict], ips: list[dict]) -> None:
    print(json.dumps({"cniVersion": version, "interfaces": interfaces, "ips": ips}))


def host_end(container_id: str) -> str:
    return "nrc" + hashlib.sha256(container_id.encode()).hexdigest()[:10]


def main() -> int:
    from pyroute2 import IPRoute

    command = os.environ.get("CNI_COMMAND", "")
    if command == "VERSION":
        print(json.dumps({"cniVersion": "1.0.0", "supportedVersions": ["0.4.0", "1.0.0"]}))
        return 0
    conf = json.load(sys.stdin)
    version = conf.get("cniVersion", "1.0.0")
    netns = os.environ.get("CNI_NETNS", "")
    ifname = os.environ.get("CNI_IFNAME", "eth0")
    cid = os.environ.get("CNI_CONTAINERID", "")
    args = dict(
        item.split("=", 1) for item in os.environ.get("CNI_ARGS", "").split(";") if "=" in item
    )
    if command == "DEL":
        with IPRoute() as ip:
            for index in ip.link_lookup(ifname=host_end(cid)):
                with contextlib.suppress(Exception):
                    ip.link("del", index=index)
        return 0
    if command != "ADD":
        return 0  # CHECK, STATUS, GC: nothing to verify here
    ns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if conf.get("type") == "loopback":
            with IPRoute(netns=netns, flags=0) as ip:  # flags=0: attach, never create
                ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
            result(version, [{"name": "lo", "sandbox": netns}], [
                {"address": "127.0.0.1/8", "interface": 0}
            ])  # fmt: skip
            return 0
        interfaces = [{"name": ifname, "sandbox": netns}]
        with IPRoute() as ip:
            ip.link(
                "add",
                ifname=host_end(cid),
                kind="veth",
                peer={"ifname": ifname, "net_ns_fd": ns_fd},
            )
            if args.get("K8S_POD_NAME", "").startswith("nic-"):
                [lower] = ip.link_lookup(ifname=conf["lower"])
                ip.link(
                    "add",
                    ifname="net1",
                    kind="macvlan",
                    link=lower,
                    macvlan_mode="bridge",
                    net_ns_fd=ns_fd,
                )
                interfaces.append({"name": "net1", "sandbox": netns})
        # An address on the test-only range nobody routes; nothing is ever sent to it.
        result(version, interfaces, [{"address": "192.0.2.2/24", "interface": 0}])
        return 0
    finally:
        os.close(ns_fd)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as err:  # the CNI way to fail: an error object on stdout, exit 1
        print(
            json.dumps({"cniVersion": "1.0.0", "code": 999, "msg": f"{type(err).__name__}: {err}"})
        )
        sys.exit(1)
