"""Run ``nri-cpuplugin run`` as a real process next to a harness containerd, and check that
the state file and the live cgroups agree."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness import host

from nri_cpuplugin.core.cpuset import CPUSet

REPO = Path(__file__).resolve().parents[2]


def wait_for(what: str, check: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Daemon:
    """The CPU plugin daemon; audit records (JSON lines on stderr, no journal here) tell what
    it decided."""

    def __init__(
        self,
        socket: Path,
        state_dir: Path,
        reserved: str = "0",
        journal: str = "/nonexistent",
        config: Path | None = None,
    ) -> None:
        self.socket = socket
        self.config = config
        self.journal = journal
        self.state_dir = state_dir
        self.reserved = reserved
        self.log = state_dir.parent / f"{state_dir.name}-daemon.log"
        self.proc: subprocess.Popen | None = None
        self._seen = 0

    def start(self, wait: bool = True) -> Daemon:
        self._output = open(self.log, "ab")  # noqa: SIM115
        self._seen = len(self.records())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nri_cpuplugin.cli",
                "run",
                "--socket",
                str(self.socket),
                "--state-dir",
                str(self.state_dir),
                "--reserved-cpus",
                self.reserved,
                "--log-level",
                "debug",
                *(["--config", str(self.config)] if self.config else []),
            ],
            stdout=self._output,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin", "NRI_CPUPLUGIN_JOURNAL_SOCKET": self.journal},
        )
        if wait:
            self.wait_synchronized()
        return self

    def wait_synchronized(self, timeout: float = 30.0) -> None:
        # Usually well under a second; 30 s leaves room for a machine busy with other work
        # (the daemon imports grpc and protobuf first).
        wait_for(
            "the daemon to synchronize with containerd",
            lambda: self.new_records("synchronize"),
            timeout,
        )

    def records(self, action: str | None = None) -> list[dict]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if action is None or record["ACTION"] == action:
                    out.append(record)
        return out

    def new_records(self, action: str) -> list[dict]:
        """Records of this daemon process (since the last start)."""
        return [r for r in self.records()[self._seen :] if r["ACTION"] == action]

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None:
            self._output.close()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        self.kill9()

    def state(self) -> dict:
        return settled_state(self.state_dir)

    def status(self, sysfs: str | None = None) -> dict:
        """`nri-cpuplugin status --json` once the daemon's commits have settled."""
        settled_state(self.state_dir)
        done = subprocess.run(
            [sys.executable, "-m", "nri_cpuplugin.cli", "status", "--state-dir",
             str(self.state_dir), "--json", *(["--sysfs", sysfs] if sysfs else [])],
            capture_output=True, text=True, check=False, cwd=REPO,
        )  # fmt: skip
        # 0, or the daemon's health (3 not running, 4 not connected, 5 stale): the report
        # says which; 1 and 2 (no state, bad usage) are failures here.
        assert done.returncode in (0, 3, 4, 5), done.stderr
        return json.loads(done.stdout)


def settled_state(state_dir: Path) -> dict:
    """state.json once a daemon's commits have settled: it commits a creation after its
    answer (the commit rule of daemon/statefile.py)."""
    path = state_dir / "state.json"
    text = path.read_text()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.05)
        text, last = path.read_text(), text
        if text == last:
            break
    return json.loads(text)


def check_agreement(daemon: Daemon, cri) -> dict[str, str]:
    """State file, live cgroups and the kernel's view of every running container agree; no CPU
    is assigned twice; the shared pool is what remains.  Returns container name -> cpus."""
    state = daemon.state()
    exclusive: dict[str, str] = {cid: a["cpus"] for cid, a in state["assignments"].items()}
    seen: set[int] = set()
    for cpus in exclusive.values():
        cpu_set = CPUSet.parse(cpus)
        assert not cpu_set & seen, f"CPU assigned twice: {state['assignments']}"
        seen |= cpu_set
    online = CPUSet(host.online_cpus())
    assert CPUSet.parse(state["shared"]) == online - seen, state
    result = {}
    for ref in cri.containers(state="CONTAINER_RUNNING"):
        want = exclusive.get(ref.id, state["shared"])
        live = host.read_cgroup(cri.cgroup_path(ref.id), "cpuset.cpus")
        pid = cri.inspect(ref.id).pid
        assert live == want, f"{ref.name}: cgroup has {live}, state says {want}"
        assert host.cpus_allowed_list(pid) == want, f"{ref.name}: kernel says otherwise"
        result[ref.name] = live
    running = {ref.id for ref in cri.containers(state="CONTAINER_RUNNING")}
    assert set(exclusive) <= running, f"stale assignments: {set(exclusive) - running}"
    return result
