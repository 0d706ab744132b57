"""Another nri-cpuplugin process holding the state lock, as the OCI hook or the CLI would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_HOLD = (
    "import sys\n"
    "from nri_cpuplugin.storage.store import StateStore\n"
    "with StateStore(sys.argv[1]).locked(timeout=-1):\n"
    "    print('held', flush=True)\n"
    "    sys.stdin.readline()\n"
)


class LockHolder:
    """Holds ``state.lock`` in ``state_dir`` (storage/lock.py) from another process until
    ``release``."""

    def __init__(self, state_dir: str | Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD, str(state_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "held\n"

    def holding(self) -> bool:
        """Whether it still holds the lock (until ``release``)."""
        return self.proc.poll() is None

    def release(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(10)
