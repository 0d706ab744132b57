"""The recording test plugin (nri_test_plugin.py) as a process next to a harness containerd,
and what it recorded."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

from e2e.daemon import wait_for

PLUGIN = Path(__file__).with_name("nri_test_plugin.py")


class PluginProcess:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.output: IO[bytes] | None = None

    def start(self, socket: Path, **settings: object) -> PluginProcess:
        config = json.dumps({"log": str(self.log), "socket": str(socket), **settings})
        self.output = open(self.log.with_suffix(".out"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(PLUGIN), config], stdout=self.output, stderr=subprocess.STDOUT
        )
        wait_for("the plugin to register", lambda: self.events("configure"))
        return self

    def events(self, *names: str) -> list[dict]:
        if not self.log.exists():
            return []
        records = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r for r in records if not names or r["event"] in names]

    def delivered(self) -> list[tuple[str, str | None, str]]:
        """(event, container name, NRI method that carried it) for every event handled: each
        handler's record is followed by the record of the request it served."""
        records = [r for r in self.events() if r["event"] not in ("stub-log", "configure")]
        out = []
        for record, following in itertools.pairwise(records):
            if record["event"] != "rpc" and following["event"] == "rpc":
                out.append((record["event"], record.get("container"), following["method"]))
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.output is not None:
            self.output.close()
            self.output = None
