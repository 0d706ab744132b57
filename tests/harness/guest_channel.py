"""The host's end of the command channel to the guest agent (guest_agent.py describes the
protocol): QEMU exposes the guest's virtio-serial port as a unix socket on the host; requests
go out as JSON lines and a reader thread hands each answer to the caller waiting for its id.

Every wait has a deadline, and the caller learns why it ended: the guest answered, the time
ran out, or the connection (QEMU) went away.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ChannelError(RuntimeError):
    """The guest did not answer: timeout, or the connection to QEMU ended."""


class AgentError(RuntimeError):
    """The agent refused the request (bad request, file not found, ...)."""


@dataclass(frozen=True)
class Completed:
    """A command's outcome in the guest."""

    argv: list[str]
    rc: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def describe(self, limit: int = 3000) -> str:
        """For error messages: the command, how it ended, and its output's tail."""
        how = f"timed out after {self.seconds} s" if self.timed_out else f"exit {self.rc}"
        out = self.stdout.strip()[-limit:]
        err = self.stderr.strip()[-limit:]
        return f"guest: {' '.join(self.argv)}: {how}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


class Channel:
    """One connection to the agent's port (QEMU's ``-chardev socket,server=on``)."""

    def __init__(self, path: Path, connect_timeout: float = 30.0) -> None:
        self.path = path
        self._sock = self._connect(connect_timeout)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the table of waiting callers
        self._send_lock = threading.Lock()  # one line at a time on the socket
        self._waiting: dict[int, tuple[threading.Event, list[dict]]] = {}
        self._closed: str | None = None
        self._reader = threading.Thread(target=self._read, name="guest-channel", daemon=True)
        self._reader.start()

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.path))
                return sock
            except OSError as e:
                sock.close()
                if time.monotonic() > deadline:
                    raise ChannelError(f"cannot connect to the agent port {self.path}: {e}") from e
                time.sleep(0.05)

    def _read(self) -> None:
        pending = b""
        try:
            while data := self._sock.recv(1 << 16):
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._deliver(line)
        except OSError:
            pass
        self._closed = "the connection to QEMU ended (the VM exited or was killed)"
        with self._lock:
            for event, _ in self._waiting.values():
                event.set()

    def _deliver(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return  # noise from before the agent started (never expected; never fatal)
        with self._lock:
            waiter = self._waiting.get(message.get("id"))
        if waiter is not None:  # answers nobody waits for any more (timed out) are dropped
            waiter[1].append(message)
            waiter[0].set()

    def request(self, op: str, wait: float, **fields: Any) -> dict:
        """Send one request and wait up to ``wait`` seconds for its answer."""
        request_id = next(self._ids)
        event, box = threading.Event(), []
        with self._lock:
            self._waiting[request_id] = (event, box)
        try:
            if self._closed:
                raise ChannelError(self._closed)
            line = json.dumps({"id": request_id, "op": op, **fields}).encode() + b"\n"
            with self._send_lock:
                self._sock.sendall(line)
            if not event.wait(wait) and not box:
                raise ChannelError(f"no answer from the guest agent to {op!r} in {wait} s")
            if not box:
                raise ChannelError(self._closed or "no answer")
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
        answer = box[0]
        if not answer.get("ok"):
            raise AgentError(f"guest agent refused {op!r}: {answer.get('error')}")
        return answer

    def run(
        self,
        argv: list[str],
        *,
        timeout: float,
        input: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> Completed:
        """Run ``argv`` in the guest; the agent kills it after ``timeout`` seconds, and the
        host waits a little longer than that for the answer."""
        answer = self.request(
            "run",
            timeout + 30,
            argv=argv,
            input=input,
            env=env or {},
            cwd=cwd,
            timeout=timeout,
        )
        return Completed(
            argv,
            answer["rc"],
            answer["stdout"],
            answer["stderr"],
            answer["timed_out"],
            answer["seconds"],
        )

    def write(self, path: str, data: bytes, mode: int = 0o644, timeout: float = 60) -> None:
        self.request("write", timeout, path=path, data=base64.b64encode(data).decode(), mode=mode)

    def read(self, path: str, timeout: float = 60) -> bytes:
        return base64.b64decode(self.request("read", timeout, path=path)["data"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
