"""``nri-cpuplugin run`` and ``status`` as real processes, against the FAKE runtime of
fake_runtime.py (the real-containerd version of these flows is in tests/e2e/)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

from builders import container, pod
from fake_runtime import FakeRuntime
from topologies import build

from nri_cpuplugin.nri.pb import nri_pb2 as pb

CLI = [sys.executable, "-m", "nri_cpuplugin.cli"]


def test_daemon_serves_the_runtime_and_status_reads_its_state(tmp_path):
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    state_dir = tmp_path / "state"
    socket_path = tmp_path / "nri.sock"

    async def scenario() -> None:
        runtime = FakeRuntime(socket_path)
        await runtime.start()
        daemon = await asyncio.create_subprocess_exec(
            *CLI,
            "run",
            "--socket",
            str(socket_path),
            "--state-dir",
            str(state_dir),
            "--sysfs",
            str(root),
            "--reserved-cpus",
            "0,24",
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.wait_for(runtime.registered.wait(), 15)
            # create, start, update, post-update, stop, remove container; run and remove pod
            events = runtime.configure_response.events
            assert events == 0x8 | 0x20 | 0x80 | 0x100 | 0x200 | 0x400 | 0x1 | 0x4
            db = pod("db")
            reply = await runtime.call(
                "CreateContainer",
                pb.CreateContainerRequest(pod=db, container=container("pg", db, 2000)),
            )
            adjust = pb.CreateContainerResponse.FromString(reply.payload).adjust
            assert adjust.linux.resources.cpu.cpus == "1,25"
        finally:
            daemon.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(daemon.communicate(), 10)
            await runtime.close()
        assert daemon.returncode == 0, stderr.decode()
        records = [
            json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")
        ]
        assert [r["ACTION"] for r in records if r["ACTION"] == "allocate"] == ["allocate"]

    asyncio.run(scenario())
    status = subprocess.run(
        [*CLI, "status", "--state-dir", str(state_dir), "--sysfs", str(root), "--json"],
        capture_output=True,
        text=True,
    )
    # The daemon is gone: its state is shown, and the exit status says it is not running.
    assert status.returncode == 3 and status.stderr.startswith("nri-cpuplugin: the daemon")
    report = json.loads(status.stdout)
    assert report["health"]["verdict"] == "not-running"
    assert report["reserved"] == "0,24" and report["exclusive"] == "1,25"
    assert report["assignments"][0]["pod_name"] == "db"
    assert report["assignments"][0]["numa"] == "0"
    assert report["numa"]["0"]["allocated"] == 2
    text = subprocess.run(
        [*CLI, "status", "--state-dir", str(state_dir), "--sysfs", str(root)],
        capture_output=True,
        text=True,
    ).stdout
    assert "1,25" in text and "ns/db" in text
    # What status cannot show is said on stderr, with the prefix, the state still shown.
    blind = subprocess.run(
        [*CLI, "status", "--state-dir", str(state_dir), "--sysfs", str(tmp_path / "no-sys")],
        capture_output=True,
        text=True,
    )
    assert "1,25" in blind.stdout
    assert "nri-cpuplugin: free CPUs per NUMA node not shown: " in blind.stderr


def test_invalid_config_is_rejected_at_start(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('policy_options = ["full-pcpus-only", "distribute-cpus-across-cores"]\n')
    result = subprocess.run(
        [*CLI, "run", "--config", str(config), "--socket", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "policy_options" in result.stderr and "cannot be used together" in result.stderr


def test_status_without_state_says_so(tmp_path):
    result = subprocess.run(
        [*CLI, "status", "--state-dir", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 1 and result.stderr.startswith("nri-cpuplugin: no state file")
