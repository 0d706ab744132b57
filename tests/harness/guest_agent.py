#!/usr/bin/python3
"""The guest's end of the host <-> guest command channel (runs *in* the guest).

Started by the image's ``nri-guest-agent.service`` from the harness directory the host shares
(guest_image.py), under Debian's python3 with the standard library only.  It reads requests
from a virtio-serial port - no network needed - and answers each on the same port:

* one JSON object per line each way; every request has an ``id`` and an ``op``, every answer
  the same ``id`` and ``ok`` (false with ``error`` when the request itself was bad);
* ``run``: ``argv``, optional ``input`` (text), ``env`` (added to a plain root environment),
  ``cwd`` and ``timeout`` (seconds): the answer has ``rc``, ``stdout``, ``stderr``,
  ``timed_out`` and ``seconds``.  A command past its timeout is killed with its whole process
  group (it runs in a session of its own) and answered with ``timed_out``;
* ``write``: ``path``, ``data`` (base64), ``mode``: the file replaced atomically, parents made;
* ``read``: ``path``: ``data`` (base64);
* ``ping``: ``boot_id`` and ``uptime``, to tell that the guest is up (and which boot it is).

Requests run concurrently, each in a thread of its own, so a long command does not hold up a
``ping``.  The host's side is guest_channel.py.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PORT_NAME = "org.nri-cpuplugin.agent"
# Output past this is cut (and says so): an answer is one line held in memory on both sides.
MAX_OUTPUT = 8 << 20
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}


def find_port() -> Path:
    """The character device of our virtio-serial port (udev's /dev/virtio-ports links may not
    exist yet this early in the boot, sysfs names the port)."""
    while True:
        for entry in Path("/sys/class/virtio-ports").glob("*"):
            try:
                if (entry / "name").read_text().strip() == PORT_NAME:
                    device = Path("/dev") / entry.name
                    if device.exists():
                        return device
            except OSError:
                pass
        time.sleep(0.2)


class Agent:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.write_lock = threading.Lock()

    def serve(self) -> None:
        pending = b""
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:
                data = b""
            if not data:  # the host end is not connected: wait for it
                time.sleep(0.2)
                continue
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    threading.Thread(target=self.handle, args=(line,), daemon=True).start()

    def answer(self, message: dict) -> None:
        data = json.dumps(message).encode() + b"\n"
        with self.write_lock:
            view = memoryview(data)
            while view:
                written = os.write(self.fd, view)
                view = view[written:]

    def handle(self, line: bytes) -> None:
        request_id = None
        try:
            request = json.loads(line)
            request_id = request.get("id")
            handler = getattr(self, f"op_{request['op']}")
            answer = {"id": request_id, "ok": True, **handler(request)}
        except Exception as e:  # a bad request is answered, never the end of the agent
            answer = {"id": request_id, "ok": False, "error": f"{type(e).__name__}: {e}"}
        self.answer(answer)

    def op_ping(self, request: dict) -> dict:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return {"boot_id": boot_id, "uptime": uptime}

    def op_run(self, request: dict) -> dict:
        env = {**BASE_ENV, **request.get("env", {})}
        timeout = float(request.get("timeout", 60))
        started = time.monotonic()
        proc = subprocess.Popen(
            request["argv"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=request.get("cwd") or "/",
            env=env,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
        stdin = request.get("input")
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode() if stdin is not None else None, timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a grandchild holds the pipes open
                out, err = b"", b"(output lost: the pipes stayed open after the kill)"
        return {
            "rc": proc.returncode,
            "stdout": _text(out),
            "stderr": _text(err),
            "timed_out": timed_out,
            "seconds": round(time.monotonic() - started, 3),
        }

    def op_write(self, request: dict) -> dict:
        path = Path(request["path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(base64.b64decode(request["data"]))
        partial.chmod(int(request.get("mode", 0o644)))
        partial.rename(path)
        return {}

    def op_read(self, request: dict) -> dict:
        return {"data": base64.b64encode(Path(request["path"]).read_bytes()).decode()}


def _text(data: bytes) -> str:
    if len(data) > MAX_OUTPUT:
        data = data[:MAX_OUTPUT] + f"\n[agent: cut at {MAX_OUTPUT} bytes]".encode()
    return data.decode(errors="replace")


def main() -> int:
    port = find_port()
    print(f"nri guest agent: serving {port}", flush=True)
    Agent(os.open(port, os.O_RDWR)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
