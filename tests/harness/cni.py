"""The CNI test plugin (tests/e2e/cni_test_plugin.py) installed in a private containerd, so that
its pods get network namespaces of their own set up by a real CNI run: ``eth0`` (a veth) for
every pod, and ``net1`` (a macvlan on the host NIC ``lower``) for pods named ``nic-*``."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from .containerd import Containerd

PLUGIN = Path(__file__).resolve().parents[1] / "e2e" / "cni_test_plugin.py"
CRI_RUNTIME_PLUGIN = {
    "1.7": "io.containerd.grpc.v1.cri",
    "2.1": "io.containerd.cri.v1.runtime",
    "2.3": "io.containerd.cri.v1.runtime",
}


def overrides(version: str) -> dict[str, Any]:
    """containerd configuration for it: network namespaces below containerd's own state
    directory, so the harness's teardown unmounts whatever a failed run leaves."""
    return {"plugins": {CRI_RUNTIME_PLUGIN[version]: {"netns_mounts_under_state_dir": True}}}


def install(ctrd: Containerd, lower: str) -> None:
    """Install the plugin and its network config; call before ``ctrd.start()``."""
    bin_dir, conf_dir = ctrd.dir / "cni/bin", ctrd.dir / "cni/net.d"
    bin_dir.mkdir(parents=True, exist_ok=True)
    conf_dir.mkdir(parents=True, exist_ok=True)
    for name in ("nri-test-cni", "loopback"):
        script = bin_dir / name
        # Quoted: the checkout (and with it the interpreter) may have spaces in its path.
        script.write_text(f'#!/bin/sh\nexec {shlex.join([sys.executable, str(PLUGIN)])} "$@"\n')
        script.chmod(0o755)
    config = {
        "cniVersion": "1.0.0",
        "name": "nri-test",
        "plugins": [{"type": "nri-test-cni", "lower": lower}],
    }
    (conf_dir / "10-nri-test.conflist").write_text(json.dumps(config))
