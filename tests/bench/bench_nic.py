"""NIC locality on the creation path: pods in network namespaces of their own, set up by a
real CNI run (harness/cni.py: a veth ``eth0`` and a macvlan ``net1`` on this machine's NIC).

Three private containerd instances of one version side by side: the daemon as shipped, which
reads a Guaranteed pod's interfaces when its sandbox starts (``nic_read_ahead``), the daemon
with ``nic_read_ahead = false``, which reads them at each creation, and no plugin.  Each round
starts a new pod on each (RunPodSandbox, timed), creates its exclusive container (timed),
starts, stops and removes it, and removes the pod; who goes first rotates.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from e2e.daemon import Daemon
from harness import cni
from harness.containerd import Containerd
from harness.k8s import ContainerSpec, PodSpec
from netns_util import host_nic

from .bench_e2e import _ratio
from .stats import summary

READ_AT_START = "(interfaces read when the pod started)"


def bench_nic_read_ahead(version: str = "2.1", rounds: int = 30) -> dict:
    sides = ("ahead", "at-create", "none")
    lower = host_nic().name
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        runtimes = {}
        for side in sides:
            ctrd = Containerd(version, debug=False, config_overrides=cni.overrides(version))
            cni.install(ctrd, lower)
            runtimes[side] = stack.enter_context(ctrd)
        daemons = {}
        for side in ("ahead", "at-create"):
            config = Path(tmp) / f"{side}.toml"
            config.write_text(f"nic_read_ahead = {'true' if side == 'ahead' else 'false'}\n")
            daemon = Daemon(runtimes[side].nri_socket, Path(tmp) / side, config=config)
            daemons[side] = daemon.start()
            stack.callback(daemon.stop)
        create: dict[str, list[float]] = {side: [] for side in sides}
        sandbox: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(rounds + 2):
            for side in sides[i % 3 :] + sides[: i % 3]:
                cri = runtimes[side].cri()
                began = time.perf_counter()
                pod = cri.run_pod(PodSpec(f"nic-{i}", qos="guaranteed", host_network=False))
                ran = time.perf_counter()
                cid = cri.create_container(pod, ContainerSpec.guaranteed("fwd", 1))
                created = time.perf_counter()
                cri.start(cid)
                cri.stop(cid, timeout=0)
                cri.remove(cid)
                cri.stop_pod(pod)
                cri.remove_pod(pod)
                if i >= 2:  # the first rounds warm caches on every side
                    sandbox[side].append(ran - began)
                    create[side].append(created - ran)
        read_ahead = {
            side: sum(READ_AT_START in r["MESSAGE"] for r in daemon.records("nic-locality"))
            for side, daemon in daemons.items()
        }
    return {
        "version": version,
        "rounds": rounds,
        "create": {side: summary(v) for side, v in create.items()},
        "sandbox": {side: summary(v) for side, v in sandbox.items()},
        "create_ratio": {side: _ratio(create[side], create["none"]) for side in sides[:2]},
        "sandbox_ratio": {side: _ratio(sandbox[side], sandbox["none"]) for side in sides[:2]},
        "read_ahead_used": read_ahead,
    }
