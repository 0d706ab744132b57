"""One audit record per decision: who got which CPUs, when, and why.

Records are flat dictionaries of upper-case fields (journald's convention: MESSAGE, PRIORITY,
ACTION, CONTAINER_ID, CPUS, ...), so the same record can go to the journal or, where there is
none, to stderr as one JSON line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import orjson

IDENTIFIER = "nri-cpuplugin"
# syslog priorities
ERR, WARNING, NOTICE, INFO, DEBUG = 3, 4, 5, 6, 7

Sink = Callable[[dict[str, str]], None]


def stderr_sink(stream: TextIO | None = None) -> Sink:
    def write(record: dict[str, str]) -> None:
        out = stream or sys.stderr
        out.write(orjson.dumps(record).decode() + "\n")
        out.flush()

    return write


class Audit:
    def __init__(self, sink: Sink | None = None, **common: str) -> None:
        self.sink = sink if sink is not None else stderr_sink()
        self.common = {"SYSLOG_IDENTIFIER": IDENTIFIER, **common}

    def record(self, action: str, message: str, priority: int = INFO, **fields: Any) -> None:
        record = {
            **self.common,
            "MESSAGE": message,
            "PRIORITY": str(priority),
            "ACTION": action,
            "TIMESTAMP": f"{time.time():.6f}",
        }
        for key, value in fields.items():
            if value is not None and value != "":
                record[key.upper()] = str(value)
        self.sink(record)
