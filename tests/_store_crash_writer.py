"""Writer processes for the crash test in test_store.py: each kills itself with SIGKILL at a
step of its commit the test names, so every point between two system calls of a commit is
tried, deterministically, whatever the machine's load.

Run as a script, this is a small "zygote": it imports everything once, then forks one writer
per request, so each kill costs a fork instead of an interpreter start-up (~0.1 s).  Each
writer is an ordinary process running the real commit path (the lock, the temp file, its
writes, fsync, the rename, the directory's fsync); only the calls of ``os`` that the commit
makes are counted on their way through.

Protocol, one line per message on stdin/stdout:
  zygote -> test  "ready"                       imports done
  test -> zygote  "go <i> <mode> <step>"        fork a writer that commits iteration <i> and
                                                SIGKILLs itself before the commit's system
                                                call number <step> (0: before the first);
                                                past the last one, once the commit returned.
                                                <mode> is "store" (StateStore.commit) or
                                                "in-place" (see below)
  zygote -> test  "pid <pid>"                   the writer
  writer -> test  "begin <i>"                   its commit starts now
  writer -> test  "done <i>"                    its commit has fully returned
  zygote -> test  "exited <pid> <rc>"           the writer is dead and reaped (rc -9)
A "done i" therefore means "commit i is on disk"; no "done i" means the kill landed inside
commit i, which may or may not have reached its rename.  Each message is a single write(2) of
a few bytes to a pipe, so it is atomic.

Every state is a pure function of its iteration, with 1..200 assignments so document sizes
vary, which makes a torn or mixed file detectable as a checksum error or a wrong value.

The "in-place" mode is a broken store, for the test that proves the crash test can fail: it
rewrites state.json where it is (truncate, write half, fsync, write the rest), so a kill inside
its commit leaves a torn file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import sys
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.state import Assignment, NodeState, encode
from nri_cpuplugin.storage.store import StateStore

N_CPUS = 256
RESERVED = CPUSet({0, 1})
FINGERPRINT = "sha256:" + hashlib.sha256(b"crash-test-node").hexdigest()


def state_for(iteration: int) -> NodeState:
    """The state written at ``iteration``; its assignment count cycles through 1..200."""
    count = 1 + (iteration * 67) % 200  # 67 is coprime to 200: every count occurs
    assignments = {}
    for k in range(count):
        seed = f"{iteration}/{k}".encode()
        cid = hashlib.sha256(seed).hexdigest()
        assignments[cid] = Assignment(
            container_id=cid,
            cpus=CPUSet({2 + k}),
            pod_uid=str(uuid.UUID(bytes=hashlib.sha256(b"uid:" + seed).digest()[:16])),
            container_name=f"c{k}",
            pod_name=f"pod-{k}",
            pod_namespace=f"iter-{iteration}",
        )
    shared = CPUSet(range(2 + count, N_CPUS))
    return NodeState("static", FINGERPRINT, RESERVED, shared, assignments)


def iteration_of(state: NodeState) -> int:
    """Recover the iteration a state was written at (every state has >= 1 assignment)."""
    namespaces = {a.pod_namespace for a in state.assignments.values()}
    assert len(namespaces) == 1, f"assignments from different iterations: {sorted(namespaces)}"
    return int(namespaces.pop().removeprefix("iter-"))


def _commit_in_place(store: StateStore, state: NodeState) -> None:
    """The broken commit: no temp file, no rename."""
    data = encode(state)
    fd = os.open(store.state_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        half = len(data) // 2
        os.write(fd, data[:half])
        os.fsync(fd)
        os.write(fd, data[half:])
        os.fsync(fd)
    finally:
        os.close(fd)


# The calls of ``os`` a commit makes that change the file system or what is durable on it.
STEPS = ("open", "write", "fchmod", "fsync", "close", "replace", "rename", "unlink", "ftruncate")


class KillPoint:
    """SIGKILL this process before the commit's system call number ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.made = 0
        self.armed = False
        for name in STEPS:
            setattr(os, name, self._counted(getattr(os, name)))

    def _counted(self, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def step(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                if self.made == self.at:
                    os.kill(os.getpid(), signal.SIGKILL)
                self.made += 1
            return call(*args, **kwargs)

        return step


def _write_once(state_dir: str, iteration: int, mode: str, point: KillPoint) -> None:
    store = StateStore(state_dir)
    state = state_for(iteration)
    os.write(1, b"begin %d\n" % iteration)
    point.armed = True
    with store.locked():
        if mode == "in-place":
            _commit_in_place(store, state)
        else:
            store.commit(state)
    point.armed = False
    os.write(1, b"done %d\n" % iteration)
    os.kill(os.getpid(), signal.SIGKILL)


def main(state_dir: str) -> None:
    os.write(1, b"ready\n")
    while line := sys.stdin.buffer.readline():
        _, iteration, mode, step = line.split()
        pid = os.fork()
        if pid == 0:  # the writer: never returns into this loop
            try:
                _write_once(state_dir, int(iteration), mode.decode(), KillPoint(int(step)))
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            os._exit(1)
        os.write(1, b"pid %d\n" % pid)
        _, status = os.waitpid(pid, 0)
        os.write(1, b"exited %d %d\n" % (pid, os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    main(sys.argv[1])
