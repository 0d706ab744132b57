"""The shipped DaemonSet on the production node: its pod, with the image `./dev image` builds,
run by the FAKE kubelet through kubelet's systemd driver on containerd 2.3.4 (runc's systemd
cgroup driver), every hostPath the guest node's own (tests/guest/daemonset.py runs it there).

The plugin in its container registers; a Guaranteed pod started afterwards is born pinned; the
shared pod is moved off its CPUs by direct writes - its scope handed over from systemd, with no
``runc update`` (which would give systemd a cpuset for it again) - and nothing reverts through
3 ``daemon-reload``s; the plugin's container killed and restarted moves nothing.  Then the
DaemonSet patched with packaging/kubernetes/node-features.yaml (real kubectl): the plugin in its
container keeps a pod's CPUs free of the node's device interrupts and gives them back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from harness.guest import Guest
from harness.guest_runtimes import GuestRuntime
from harness.host import parse_cpu_list
from harness.kubelet_pod import patched
from product_image import RELEASE_0_1_0, REPO, cached, manifest_of

from guest.conftest import SCENARIO_RUNTIME
from nri_cpuplugin import __version__

MANIFEST = REPO / "packaging/kubernetes/daemonset.yaml"
NODE_FEATURES = REPO / "packaging/kubernetes/node-features.yaml"


def _cpus(text: str) -> set[int]:
    return set(parse_cpu_list(text))


def _off(exclusive: set[int], shared: dict, handed_over: bool = True) -> None:
    """The shared container, its cgroup and every task of it off the exclusive CPUs; systemd
    holds no cpuset for its scope (handed over to the cgroup files: no runc update gave it
    one) - or, after a restart of the plugin (``handed_over=False``), at most the kernel's own
    set: the restarted plugin's Synchronize reply updates the runtime's stored specs that lag
    behind, and that ``runc update`` gives the scope the pool of now."""
    assert not exclusive & _cpus(shared["cpuset_cpus_effective"]), shared
    for tid, allowed in shared["tasks"].items():
        assert not exclusive & _cpus(allowed), f"shared task {tid} may run on {allowed}"
    held = shared["allowed_cpus"]
    if handed_over:
        assert held == "", f"systemd holds {held} for it"
    else:
        assert not held or _cpus(held) == _cpus(shared["cpuset_cpus_effective"]), held


@pytest.mark.parametrize("runtime_name", [SCENARIO_RUNTIME])
def test_the_daemonset_pod_pins_on_the_systemd_driver(
    guest: Guest, on_runtime: GuestRuntime
) -> None:
    archive = cached().archive
    node_features = patched(MANIFEST, NODE_FEATURES, guest.results / "node-features.yaml")
    started = time.monotonic()
    facts = guest.call(
        "guest.daemonset:run_daemonset",
        timeout=1800,
        address=on_runtime.cri_socket,
        import_command=[*on_runtime.import_images[0][:-1], str(archive)],
        manifest=str(MANIFEST),
        node_features=str(node_features),
    )
    print(f"run_daemonset: {time.monotonic() - started:.1f} s in the guest")
    print(json.dumps(facts, indent=1, sort_keys=True)[:20000])
    assert facts["import"]["rc"] == 0, facts["import"]
    assert facts["synchronized_after_s"] is not None, "the plugin in its pod never synchronized"
    assert [r["VERSION"] for r in facts["start_records"]] == [__version__]

    exclusive = set(facts["exclusive"])
    assert len(exclusive) == 2, facts["pinned_first_line"]
    assert _cpus(facts["pinned_before"]["cpuset_cpus_effective"]) == exclusive
    for after in facts["after_reloads"]:
        assert after["reload"]["rc"] == 0, after["reload"]
        assert _cpus(after["pinned"]["cpuset_cpus_effective"]) == exclusive
        _off(exclusive, after["shared"])

    assert facts["exited_after_s"] is not None and facts["restarted"] is True
    assert facts["resynchronized_after_s"] is not None, "the restarted plugin never synchronized"
    assert _cpus(facts["pinned_after_kill"]["cpuset_cpus_effective"]) == exclusive
    assert facts["pinned_after_kill"]["pid"] == facts["pinned_before"]["pid"]
    _off(exclusive, facts["shared_after_kill"], handed_over=False)

    # Patched with node-features.yaml: the plugin in its container moves interrupts.
    features = facts["node_features"]
    assert features["synchronized_after_s"] is not None, "the patched plugin never synchronized"
    cpus, managed = set(features["cpus"]), set(features["managed"])
    changeable = set(features["baseline"]) - managed
    on_them = {n: a for n, a in features["held"].items() if n in changeable and cpus & _cpus(a)}
    assert not on_them, f"interrupts still on the irq-free pod's CPUs {sorted(cpus)}: {on_them}"
    assert any(cpus & _cpus(features["baseline"][n]) for n in changeable)  # some were moved
    records = features["irq_records"]
    assert any(r["PRIORITY"] == "6" and int(r["NARROWED"]) > 0 for r in records), records
    assert not any("read-only" in r["MESSAGE"] for r in records), records
    not_back = {
        n: (features["baseline"][n], a)
        for n, a in features["released"].items()
        if n in changeable and a != features["baseline"][n]
    }
    assert not not_back, f"not given back when the pod went: {not_back}"


@pytest.mark.parametrize("runtime_name", [SCENARIO_RUNTIME])
def test_upgrade_and_rollback_on_the_systemd_driver(guest: Guest, on_runtime: GuestRuntime) -> None:
    """0.1.0 (its image built from its commit, its manifest as it shipped) -> this version ->
    0.1.0, as the DaemonSet controller rolls each on the node, with a Guaranteed pod and a
    shared one running: a sampler in the guest reads both scopes' effective cpusets
    throughout - the pinned one never moves, the shared one never holds its CPUs - and each
    version pins a new Guaranteed pod from the state the other wrote."""
    archives = [cached(revision=RELEASE_0_1_0).archive, cached().archive]
    old = on_the_node_network(manifest_of(RELEASE_0_1_0, guest.results))
    releases = [("0.1.0", str(old)), (__version__, str(MANIFEST)), ("0.1.0", str(old))]
    facts = guest.call(
        "guest.daemonset:run_upgrade",
        timeout=1800,
        address=on_runtime.cri_socket,
        import_commands=[[*on_runtime.import_images[0][:-1], str(a)] for a in archives],
        releases=releases,
    )
    print(json.dumps(facts, indent=1, sort_keys=True)[:20000])
    assert all(i["rc"] == 0 for i in facts["imports"]), facts["imports"]
    exclusive = set(facts["exclusive"])
    for step in facts["steps"]:
        assert step["synchronized_after_s"] is not None, f"{step['release']} never synchronized"
        this = step["release"] == __version__
        assert step["versions"] == ([__version__] if this else []), step  # 0.1.0 said none
        new = _cpus(step["new_first_line"])
        assert len(new) == 1 and not new & exclusive, step
    assert facts["samples"] > 10
    assert {_cpus(pinned) == exclusive for pinned, _ in facts["seen"]} == {True}, facts["seen"]
    assert not any(_cpus(shared) & exclusive for _, shared in facts["seen"]), facts["seen"]


def on_the_node_network(manifest: Path) -> Path:
    """0.1.0's manifest with its pod on the node's network (``hostNetwork``), as this
    version's: the guest node has no CNI plugin, and the network changes nothing the plugin
    does."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    for doc in docs:
        if doc["kind"] == "DaemonSet":
            doc["spec"]["template"]["spec"]["hostNetwork"] = True
    manifest.write_text(yaml.safe_dump_all(docs))
    return manifest
