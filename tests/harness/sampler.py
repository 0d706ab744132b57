"""What a reader returns, read over and over from another thread while something changes (a
plugin replaced, say): every distinct value seen, and how many reads were made."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable


class Sampler:
    """``with Sampler(read): ...`` calls ``read()`` every ``interval`` seconds meanwhile."""

    def __init__(self, read: Callable[[], Hashable], interval: float = 0.005) -> None:
        self.read = read
        self.interval = interval
        self.seen: set[Hashable] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.seen.add(self.read())
            self.samples += 1

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
