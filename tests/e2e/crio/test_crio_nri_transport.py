"""Our NRI transport against CRI-O 1.36.3, i.e. NRI 0.11, which the containerd versions in the
matrix (NRI 0.6.1 and 0.8.0) do not exercise: how each event is delivered (the dedicated
RPCs CreateContainer, UpdateContainer and StopContainer, StateChange for the rest - no NRI
0.12 per-event RPCs), the deadlines its Configure sends, replies over 4 KiB, Synchronize after
a CRI-O restart, and UpdatePodSandbox (CRI UpdatePodSandboxResources), which exists since NRI
0.10 and never reaches a plugin that did not subscribe to it - ours cannot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.crio import Crio
from harness.k8s import ContainerSpec

from e2e.daemon import REPO, Daemon, check_agreement, wait_for

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
# What NRI 0.11's adaptation calls on a plugin with dedicated methods; everything else is a
# StateChange.  UpdatePodSandbox and ValidateContainerAdjustment only for subscribers.
NRI_011_METHODS = {
    "Configure", "Synchronize", "CreateContainer", "UpdateContainer", "StopContainer",
    "StateChange",
}  # fmt: skip


class Recorder:
    """e2e/crio/nri_recorder.py as an external plugin of one CRI-O."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, socket: Path, **settings: object) -> Recorder:
        config = json.dumps({"log": str(self.log), "socket": str(socket), **settings})
        self.output = open(self.log.with_suffix(".out"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "e2e.crio.nri_recorder", config],
            stdout=self.output,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO / "tests")},
        )
        wait_for("the recorder to register", lambda: self.events("configure"))
        return self

    def events(self, *names: str) -> list[dict]:
        if not self.log.exists():
            return []
        records = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r for r in records if not names or r["event"] in names]

    def methods(self) -> set[str]:
        return {r["method"] for r in self.events("method")}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None:
            self.output.close()


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[Recorder]:
    process = Recorder(tmp_path / "events.jsonl")
    yield process
    process.stop()


def test_configure_names_cri_o_and_its_deadlines(crio: Crio, recorder: Recorder) -> None:
    recorder.start(crio.nri_socket)
    [configure] = recorder.events("configure")
    assert (configure["runtime"], configure["version"]) == ("cri-o", "1.36.3")
    [timeouts] = recorder.events("timeouts")
    # NRI >= 0.7 sends both (in ms); the stub adopts them (docs/nri-wire.md §7.1, §12.1).
    assert (timeouts["request"], timeouts["registration"]) == (2.0, 5.0)
    wait_for("Synchronize", lambda: recorder.events("synchronize"))


def test_lifecycle_events_and_the_methods_that_carry_them(crio: Crio, recorder: Recorder) -> None:
    cri = crio.cri()
    recorder.start(crio.nri_socket)
    pod = cri.run("life", [ContainerSpec("work")])
    cri.update_resources(pod["work"], cpu_request_milli=300)
    cri.stop(pod["work"])
    cri.remove(pod["work"])
    cri.stop_pod(pod.id)
    cri.remove_pod(pod.id)
    expected = [
        ("run_pod_sandbox", None),
        ("create_container", "work"),
        ("post_create_container", "work"),
        ("start_container", "work"),
        ("post_start_container", "work"),
        ("update_container", "work"),
        ("post_update_container", "work"),
        ("stop_container", "work"),
        ("remove_container", "work"),
        ("stop_pod_sandbox", None),
        ("remove_pod_sandbox", None),
    ]

    def seen() -> list | None:
        got = [
            (e["event"], e.get("container"))
            for e in recorder.events()
            if e.get("pod") == "life" and e["event"] not in ("method", "timeouts")
        ]
        return got if len(got) >= len(expected) else None

    assert wait_for("the whole lifecycle", seen) == expected
    # NRI 0.11: three dedicated event methods, StateChange for everything else; never the
    # NRI 0.12 per-event methods (RunPodSandbox, StartContainer, ...).
    assert recorder.methods() == NRI_011_METHODS


def test_synchronize_after_a_crio_restart_lists_what_runs(crio: Crio, recorder: Recorder) -> None:
    cri = crio.cri()
    cri.run("early", [ContainerSpec("worker")])
    recorder.start(crio.nri_socket)
    [first] = wait_for("Synchronize", lambda: recorder.events("synchronize"))
    assert "early" in first["pods"] and "worker" in first["containers"]
    crio.restart()
    cri.reconnect()
    syncs = wait_for("a second Synchronize", lambda: recorder.events("synchronize")[1:])
    assert syncs[0]["pods"] == first["pods"] and syncs[0]["containers"] == first["containers"]
    # The same plugin process, reconnected: one Configure per connection.
    assert {e["pid"] for e in recorder.events("configure")} == {recorder.proc.pid}


@pytest.mark.parametrize("size", [5_000, 1_100_000], ids=["over-4KiB", "over-1MiB"])
def test_big_replies_get_through(crio: Crio, recorder: Recorder, size: int) -> None:
    cri = crio.cri()
    recorder.start(crio.nri_socket, subscribe="create", big=size)
    pod = cri.run("big", [ContainerSpec("large")])
    assert len(cri.inspect(pod["large"]).spec["annotations"]["test.nri/big"]) == size
    assert recorder.proc.poll() is None  # still connected, not dropped
    cri.create_container(pod.id, ContainerSpec("again"))
    assert [e["container"] for e in recorder.events("create_container")] == ["large", "again"]


def _update_pod_sandbox_resources(crio: Crio, pod_id: str, cpu_milli: int) -> None:
    """CRI UpdatePodSandboxResources (kubelet's in-place pod resize, CRI v1.33+), which the
    lab's CRI stubs (cri-api 0.32) predate: the request encoded by hand, resources from the
    stubs' LinuxContainerResources (the same message as in the newer API)."""
    import grpc

    cri = crio.cri()
    resources = cri.pb.LinuxContainerResources(
        cpu_shares=cpu_milli * 1024 // 1000, cpu_period=100000, cpu_quota=cpu_milli * 100
    ).SerializeToString()

    def field(number: int, data: bytes) -> bytes:
        length, out = len(data), b""
        while True:  # varint
            out += bytes([(length & 0x7F) | (0x80 if length > 0x7F else 0)])
            length >>= 7
            if not length:
                break
        return bytes([number << 3 | 2]) + out + data

    request = field(1, pod_id.encode()) + field(3, resources)
    with grpc.insecure_channel(f"unix://{crio.address}") as channel:
        call = channel.unary_unary(
            "/runtime.v1.RuntimeService/UpdatePodSandboxResources",
            request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw,
        )
        assert call(request, timeout=10) == b""


def test_update_pod_sandbox_reaches_our_plugins_and_changes_no_pinning(
    crio: Crio, recorder: Recorder, tmp_path: Path
) -> None:
    cri = crio.cri()
    recorder.start(crio.nri_socket)  # every event our stub can subscribe to
    daemon = Daemon(crio.nri_socket, tmp_path / "state")
    daemon.start()
    try:
        pod = cri.run("resize", [ContainerSpec.guaranteed("p", 1, command=FIRST_LINE)])
        assert cri.wait_logs(pod["p"], 1) == ["Cpus_allowed_list:\t1"]
        since = crio.log_size()
        _update_pod_sandbox_resources(crio, pod.id, 2000)
        crio.wait_log("UpdatePodSandboxResourcesResponse", since=since)
        # NRI 0.11 knows UPDATE_POD_SANDBOX (event 12): the stub subscribes to it for runtimes
        # whose NRI is 0.10 or newer, so it is delivered; both plugins answer and stay
        # connected, and the daemon re-asserts the pod's cpusets (ACTION=pod-update).
        assert "UpdatePodSandbox" in recorder.methods()
        assert recorder.proc.poll() is None and daemon.proc.poll() is None
        assert daemon.records("pod-update")
        assert check_agreement(daemon, cri) == {"p": "1"}
        pod2 = cri.run("after", [ContainerSpec("s", cpu_request_milli=100, memory="32Mi")])
        assert host.cpus_allowed_list(cri.inspect(pod2["s"]).pid) == "0"
    finally:
        daemon.stop()
