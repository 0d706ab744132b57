"""What a private runtime instance (containerd, CRI-O) does with its own process: stopped by
pid (SIGTERM, then SIGKILL), killed like a crash, restarted on the same storage, and one CRI
client reconnected across restarts.  Shims/conmon and the containers outlive the runtime
process in every case, as on a node."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import IO, Any

from .cri import CRIClient


class RuntimeProcess:
    """Mixed into an instance class that defines ``start``, ``address``, ``top_cgroup``,
    ``dir`` and ``lab``."""

    _proc: subprocess.Popen | None
    _log_file: IO[bytes] | None
    _cri: CRIClient | None
    address: str
    top_cgroup: str
    dir: Path
    lab: Path

    def start(self, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the runtime by pid, SIGKILL after ``timeout``; its containers keep running,
        as with a real runtime restart."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._release_process()

    def kill(self) -> None:
        """SIGKILL the runtime (a crash); its containers survive."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._release_process()

    def restart(self, timeout: float | None = None) -> None:
        """Stop and start again on the same storage and state; running containers survive."""
        self.stop()
        self.start(timeout)

    def _release_process(self) -> None:
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def cri(self) -> CRIClient:
        """The CRI client for this runtime (one object, reconnected across restarts)."""
        if self._cri is None:
            self._cri = CRIClient(
                self.address, top_cgroup=self.top_cgroup, log_root=self.dir / "logs", lab=self.lab
            )
        return self._cri
