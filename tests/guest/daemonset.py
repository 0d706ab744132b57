"""Guest side of tests/guest/test_daemonset.py: the shipped DaemonSet's pod, with the image the
project builds, run on the guest node by the FAKE kubelet (harness/kubelet_pod.py) through
kubelet's systemd driver (harness/guest_kubelet.py), every hostPath the node's own.  Returns
what the kernel, systemd and the daemon's journal said; nothing here asserts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cri import ContainerSpec
from harness.guest_kubelet import SystemdKubelet
from harness.kubelet_pod import DaemonSetPod, kubelet_checkpoint
from harness.sampler import Sampler

from guest.irqs import interrupts, managed, pinned_pod, remove, settled
from guest.pinning import (
    _pinned_beside_shared,
    _systemctl,
    daemon_records,
    journal_cursor,
    scope_dir,
    tasks_allowed,
)
from guest.scenarios import FIRST_LINE, _first_line, container_facts

KUBELET_CHECKPOINT = Path("/var/lib/kubelet/cpu_manager_state")


def _until(check: Callable[[], object], timeout: float) -> float | None:
    """Seconds until ``check()`` held, None if it did not within ``timeout``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            return None
        time.sleep(0.5)
    return round(time.monotonic() - started, 1)


def _shared_facts(cri: SystemdKubelet, cid: str) -> dict[str, Any]:
    facts = container_facts(cri, cid)
    facts["tasks"] = tasks_allowed(scope_dir(cri, cid))
    return facts


def _node_features(cri: SystemdKubelet, manifest: Path) -> dict[str, Any]:
    """The plugin's pod replaced by one of the DaemonSet patched with node-features.yaml (as
    ``kubectl patch`` makes the controller replace it); a 2-CPU Guaranteed pod that asks for
    its CPUs free of interrupts, then its removal."""
    facts: dict[str, Any] = {}
    cursor = journal_cursor()
    plugin = DaemonSetPod(cri, manifest, Path(tempfile.mkdtemp(prefix="kubelet-")))
    plugin.start()
    facts["synchronized_after_s"] = _until(lambda: daemon_records("synchronize", cursor), 600)
    facts["managed"] = managed()
    facts["baseline"] = {n: i["affinity"] for n, i in interrupts().items()}
    pod, cpus = pinned_pod(cri, "irq-free", True)
    facts["cpus"] = sorted(cpus)
    facts["held"] = {n: i["affinity"] for n, i in settled(cpus, True, 300).items()}
    facts["irq_records"] = [
        {k: r.get(k) for k in ("MESSAGE", "NARROWED", "MANAGED", "FAILED", "PRIORITY")}
        for r in daemon_records("irq", cursor)
    ]
    remove(cri, pod)
    facts["released"] = {n: i["affinity"] for n, i in settled(cpus, False, 300).items()}
    plugin.delete(grace=15)
    return facts


def run_daemonset(
    address: str, import_command: list[str], manifest: str, node_features: str | None = None
) -> dict[str, Any]:
    """Import the image; run the DaemonSet's pod; a shared pod then a 2-CPU Guaranteed one;
    3 ``daemon-reload``s; the plugin's container killed and restarted as kubelet would; with
    ``node_features`` (the manifest patched with it), interrupts kept off a pod's CPUs."""
    result: dict[str, Any] = {}
    kubelet_checkpoint(KUBELET_CHECKPOINT)
    imported = subprocess.run(import_command, capture_output=True, text=True, check=False)
    result["import"] = {"rc": imported.returncode, "stderr": imported.stderr[-500:]}
    with SystemdKubelet(address) as cri:
        cursor = journal_cursor()
        plugin = DaemonSetPod(cri, Path(manifest), Path(tempfile.mkdtemp(prefix="kubelet-")))
        plugin.start()
        result["plugin_scope"] = container_facts(cri, plugin.container_id or "")["scope"]
        result["synchronized_after_s"] = _until(lambda: daemon_records("synchronize", cursor), 600)
        result["start_records"] = [
            {k: r.get(k) for k in ("VERSION", "PID", "MESSAGE")}
            for r in daemon_records("start", cursor)
        ]
        shared, pinned, exclusive = _pinned_beside_shared(cri, "ds", result)
        result["exclusive"] = sorted(exclusive)
        result["after_reloads"] = []
        for _ in range(3):
            reload = _systemctl("daemon-reload")
            time.sleep(1)
            result["after_reloads"].append(
                {
                    "reload": reload,
                    "shared": _shared_facts(cri, shared["app"]),
                    "pinned": container_facts(cri, pinned["app"]),
                }
            )
        killed = journal_cursor()
        os.kill(plugin.pid(), signal.SIGKILL)
        result["exited_after_s"] = _until(lambda: not plugin.running(), 120)
        result["restarted"] = plugin.sync()
        result["resynchronized_after_s"] = _until(
            lambda: daemon_records("synchronize", killed), 600
        )
        result["pinned_after_kill"] = container_facts(cri, pinned["app"])
        result["shared_after_kill"] = _shared_facts(cri, shared["app"])
        plugin.delete(grace=15)
        if node_features is not None:
            result["node_features"] = _node_features(cri, Path(node_features))
        cri.remove_all()
    return result


def run_upgrade(
    address: str, import_commands: list[list[str]], releases: list[tuple[str, str]]
) -> dict[str, Any]:
    """The DaemonSet's pod of each of ``releases`` ((name, manifest) in order: old, new, old)
    in turn, as the controller rolls it on one node (maxUnavailable 1: the old pod deleted,
    then the new one created), with a Guaranteed pod and a shared one running throughout; a
    new Guaranteed pod placed by each version from the state the other wrote."""
    result: dict[str, Any] = {"imports": []}
    for command in import_commands:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        result["imports"].append({"rc": done.returncode, "stderr": done.stderr[-500:]})
    kubelet_checkpoint(KUBELET_CHECKPOINT)
    steps: list[dict[str, Any]] = []
    with SystemdKubelet(address) as cri:
        cursor = journal_cursor()
        plugin: DaemonSetPod | None = None
        sampler: Sampler | None = None
        for number, (name, manifest) in enumerate(releases):
            if plugin is not None:
                plugin.delete(grace=15)
            plugin = DaemonSetPod(cri, Path(manifest), Path(tempfile.mkdtemp(prefix="kubelet-")))
            started = journal_cursor()
            plugin.start()
            step: dict[str, Any] = {"release": name}
            step["synchronized_after_s"] = _until(
                lambda n=number: len(daemon_records("synchronize", cursor)) > n, 600
            )
            step["versions"] = [r.get("VERSION") for r in daemon_records("start", started)]
            if sampler is None:
                shared, pinned, exclusive = _pinned_beside_shared(cri, "up", result)
                result["exclusive"] = sorted(exclusive)
                files = [
                    scope_dir(cri, c["app"]) / "cpuset.cpus.effective" for c in (pinned, shared)
                ]
                sampler = Sampler(lambda f=files: tuple(x.read_text().strip() for x in f), 0.01)
                sampler.__enter__()
            spec = ContainerSpec.guaranteed("app", 1, command=FIRST_LINE)
            new = cri.run(f"up-new-{number}", [spec])
            step["new_first_line"] = _first_line(cri, new["app"])
            remove(cri, new)
            steps.append(step)
        assert sampler is not None and plugin is not None
        sampler.__exit__()
        plugin.delete(grace=15)
        cri.remove_all()
    result["steps"] = steps
    result["seen"] = sorted(sampler.seen)
    result["samples"] = sampler.samples
    return result
