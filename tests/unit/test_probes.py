"""Probes and ``status`` against a real ``nri-cpuplugin run`` process: not ready while the
runtime's socket is absent, ready once registered (READY=1 on a notify socket of the test's
own, as systemd would get it), not live while its worker is stuck, live again after.

The FAKE runtime of fake_runtime.py plays the runtime's side.  Nothing here waits on time:
each step waits for what the daemon tells its notify socket (it publishes its health file
before it says anything), as systemd would hear it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from builders import container, pod
from fake_runtime import FakeRuntime
from lock_holder import LockHolder
from topologies import build

from nri_cpuplugin import __version__
from nri_cpuplugin.nri.pb import nri_pb2 as pb

CLI = [sys.executable, "-m", "nri_cpuplugin.cli"]
WAIT = 60  # seconds: a bound for a broken daemon, never reached by a working one


def status(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "status", "--state-dir", str(state_dir), *args],
        capture_output=True, text=True, timeout=WAIT, check=False,
    )  # fmt: skip


class Notifications:
    """What the daemon sends to $NOTIFY_SOCKET, datagram by datagram, read as it comes (as
    systemd does: the sender drops what a full queue cannot take)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.seen: list[str] = []
        self.read = 0  # how many of them until() has looked at
        self._arrived: asyncio.Event | None = None
        self._pump: asyncio.Task | None = None

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._pump = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._arrived is not None
        while True:
            self.seen.append((await loop.sock_recv(self.sock, 4096)).decode())
            self._arrived.set()

    async def until(self, text: str) -> str:
        """The first datagram not looked at yet that holds ``text``."""
        assert self._arrived is not None
        while True:
            while self.read < len(self.seen):
                self.read += 1
                if text in self.seen[self.read - 1]:
                    return self.seen[self.read - 1]
            self._arrived.clear()
            await asyncio.wait_for(self._arrived.wait(), WAIT)

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self.sock.close()


async def start_daemon(
    tmp_path: Path, notify: Notifications, *args: str, **env: str
) -> asyncio.subprocess.Process:
    root, _ = build("single-socket-no-smt", tmp_path)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), **env}
    return await asyncio.create_subprocess_exec(
        *CLI, "run", "--socket", str(tmp_path / "nri.sock"), "--state-dir",
        str(tmp_path / "state"), "--sysfs", str(root), "--reserved-cpus", "0", *args,
        env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def stop_daemon(daemon: asyncio.subprocess.Process) -> str:
    daemon.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(daemon.communicate(), WAIT)
    assert daemon.returncode == 0, stderr.decode()
    return stderr.decode()


def test_ready_only_once_registered_and_live_throughout(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    notify = Notifications(tmp_path / "notify")

    async def scenario() -> str:
        notify.start()
        daemon = await start_daemon(tmp_path, notify)
        runtime = FakeRuntime(tmp_path / "nri.sock")
        try:
            # No runtime socket yet: alive, not registered, and it says why.
            said = await notify.until("STATUS=not registered")
            assert "nri.sock" in said and "is NRI enabled" in said
            assert "READY=1" not in "".join(notify.seen[: notify.read])
            ready, live = status(state_dir, "--ready"), status(state_dir, "--live")
            assert ready.returncode == 4 and ready.stdout == ""
            assert ready.stderr.startswith("nri-cpuplugin: not ready: the daemon (pid ")
            assert "is NRI enabled" in ready.stderr
            assert live.returncode == 0 and live.stdout.startswith("live: ")
            assert status(state_dir).returncode == 4
            # The runtime appears: registered, READY=1, healthy.
            await runtime.start()
            said = await notify.until("READY=1")
            assert "STATUS=registered with fake v0" in said
            ready = status(state_dir, "--ready")
            assert (ready.returncode, ready.stderr) == (0, "")
            assert ready.stdout.startswith("ready: ") and "registered with fake v0" in ready.stdout
            full = status(state_dir, "--json")
            assert full.returncode == 0, full.stderr
            report = json.loads(full.stdout)
            assert report["version"] == report["health"]["daemon_version"] == __version__
            assert report["health"]["verdict"] == "healthy"
            text = status(state_dir).stdout
            assert f"(the daemon runs {__version__})" in text and "health      healthy" in text
        finally:
            stderr = await stop_daemon(daemon)
            await runtime.close()
            await notify.stop()
        return stderr

    stderr = asyncio.run(scenario())
    # The warning came at once, at warning level (not debug), with what to check.
    assert "WARNING nri_cpuplugin.nri: cannot connect to the runtime's NRI socket" in stderr
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    start = [r for r in records if r["ACTION"] == "start"]
    assert len(start) == 1 and start[0]["VERSION"] == __version__
    assert [r["VERSION"] for r in records if r["ACTION"] == "config"] == [__version__]
    # Stopped: not running, for status and both probes.
    for args in ((), ("--ready",), ("--live",)):
        result = status(state_dir, *args)
        assert result.returncode == 3 and "is not running" in result.stderr, args


def test_not_live_while_the_worker_is_stuck(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    notify = Notifications(tmp_path / "notify")
    config = tmp_path / "c.toml"
    # Stale after 3 s: enough that a busy machine does not make a healthy loop look stuck.
    config.write_text("[health]\ninterval = 1\n")

    async def scenario() -> None:
        notify.start()
        runtime = FakeRuntime(tmp_path / "nri.sock")
        await runtime.start()
        # systemd's watchdog (WatchdogSec=): pinged while the worker answers, not while stuck
        watchdog = {"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": ""}
        daemon = await start_daemon(tmp_path, notify, "--config", str(config), **watchdog)
        holder = None
        try:
            await notify.until("READY=1")
            await notify.until("WATCHDOG=1")
            assert status(state_dir, "--live").returncode == 0
            # Another process holds the state lock: the worker waits for it to commit a
            # Guaranteed container's CPUs, and answers no heartbeat meanwhile.
            holder = LockHolder(state_dir)
            db = pod("db")
            request = pb.CreateContainerRequest(pod=db, container=container("pg", db, 1000))
            await runtime.call("CreateContainer", request)  # answered by the budget
            said = await notify.until("STATUS=stuck")
            assert "CreateContainer" in said
            live, ready = status(state_dir, "--live"), status(state_dir, "--ready")
            assert live.returncode == ready.returncode == 5
            assert "its worker has not answered for" in live.stderr
            stuck_at = notify.read
            holder.release()
            await notify.until("STATUS=the worker answers again")
            assert not [m for m in notify.seen[stuck_at : notify.read] if "WATCHDOG=1" in m]
            assert status(state_dir, "--live").returncode == 0
            await notify.until("WATCHDOG=1")  # pinged again
        finally:
            if holder is not None:
                holder.release()
            await stop_daemon(daemon)
            await runtime.close()
            await notify.stop()

    asyncio.run(scenario())
