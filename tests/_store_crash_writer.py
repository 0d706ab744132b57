"""Writer processes for the crash test in test_store.py, which kills them with SIGKILL.

Run as a script, this is a small "zygote": it imports everything once, then forks one writer
per request, so each of the many kills costs a fork instead of an interpreter start-up (~0.1 s)
and the random kill delay measures time spent committing.  Each writer is an ordinary process
running the real commit path; the test SIGKILLs it by pid.

Protocol, one line per message on stdin/stdout:
  zygote -> test  "ready"              imports done
  test -> zygote  "go <first> <mode>"  fork a writer starting at iteration <first>; <mode> is
                                       "store" (StateStore.commit) or "in-place" (see below)
  zygote -> test  "pid <pid>"          the writer to kill
  writer -> test  "begin <i> <ns>"     commit i starts now (its state is built; the lock, the
                                       write, fsync, rename and the directory's fsync follow)
  writer -> test  "done <i> <ns>"      commit i has fully returned (written after commit())
(<ns>: time.monotonic_ns() when the message was written, the same clock in every process.)
  zygote -> test  "exited <pid> <rc>"  the writer is dead and reaped (rc -9 for SIGKILL)
A "done i" therefore means "commit i is on disk"; a "begin i" with no "done i" after it means
the kill landed inside commit i, which may or may not have reached its rename.  Each message
is a single write(2) of a few bytes to a pipe, so it is atomic: a kill cannot leave half a
line.

Every state is a pure function of its iteration, with 1..200 assignments so document sizes
vary, which makes a torn or mixed file detectable as a checksum error or a wrong value.

The "in-place" mode is a broken store, for the test that proves the crash test can fail: it
rewrites state.json where it is (truncate, write half, fsync, write the rest), so a kill inside
its commit leaves a torn file.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback
import uuid

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


def _write_forever(state_dir: str, first: int, mode: str) -> None:
    store = StateStore(state_dir)
    iteration = first
    while True:
        state = state_for(iteration)
        os.write(1, b"begin %d %d\n" % (iteration, time.monotonic_ns()))
        with store.locked():
            if mode == "in-place":
                _commit_in_place(store, state)
            else:
                store.commit(state)
        os.write(1, b"done %d %d\n" % (iteration, time.monotonic_ns()))
        iteration += 1


def main(state_dir: str) -> None:
    os.write(1, b"ready\n")
    while line := sys.stdin.buffer.readline():
        _, first, mode = line.split()
        pid = os.fork()
        if pid == 0:  # the writer: never returns into this loop
            try:
                _write_forever(state_dir, int(first), mode.decode())
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            os._exit(1)
        os.write(1, b"pid %d\n" % pid)
        _, status = os.waitpid(pid, 0)
        os.write(1, b"exited %d %d\n" % (pid, os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    main(sys.argv[1])
