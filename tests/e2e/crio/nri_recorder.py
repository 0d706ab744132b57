"""The transport tests' recording plugin (e2e/nri_test_plugin.py), plus a record of every ttrpc
method the runtime calls and of the deadlines the runtime's Configure gave: how NRI 0.11
(CRI-O 1.36) delivers each event is what the CRI-O transport tests look at.

Run as ``python -m e2e.crio.nri_recorder SETTINGS_JSON`` with ``tests`` on PYTHONPATH; the
settings are nri_test_plugin's (``log``, ``socket``, ``subscribe``, ``pin``, ``big``, ...).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from e2e.nri_test_plugin import build_plugin
from nri_cpuplugin.nri.stub import Stub


def main() -> None:
    settings = json.loads(sys.argv[1])
    stub: Stub | None = None

    def log(**record: Any) -> None:
        with open(settings["log"], "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")

    class Timed(type(build_plugin(settings))):  # type: ignore[misc]
        """The recorder, also logging the deadlines the stub adopted from Configure."""

        def configure(self, config: str, runtime: str, version: str) -> None:
            super().configure(config, runtime, version)
            assert stub is not None
            log(
                event="timeouts",
                request=stub.request_timeout,
                registration=stub.registration_timeout,
            )

    stub = Stub(
        Timed(settings),
        "recorder",
        "50",
        settings["socket"],
        observe=lambda method, seconds: log(event="method", method=method),
    )
    asyncio.run(stub.run())


if __name__ == "__main__":
    main()
