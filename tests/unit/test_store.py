"""StateStore: atomic durable commits, locking, and a load that never raises.

The crash test at the end is the proof of atomic commits: a real writer process is SIGKILLed
before each system call of its commit in turn, and after it, and every reload must find a
whole document it could have written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from nri_cpuplugin.base import files
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.state import Assignment, NodeState, checksum, encode, to_document
from nri_cpuplugin.storage import store as store_module
from nri_cpuplugin.storage.store import (
    QUARANTINE_KEEP,
    CommitTiming,
    Expected,
    LoadResult,
    StateDirError,
    StateLockTimeout,
    StateStore,
)

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
WRITER = TESTS / "_store_crash_writer.py"


def _load_writer_module():
    # Loaded by file path so this works whatever pytest's import mode and sys.path are.
    spec = importlib.util.spec_from_file_location("_store_crash_writer", WRITER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


crash_writer = _load_writer_module()


def make_state(n: int = 3, policy: str = "static", fingerprint: str = "fp-A") -> NodeState:
    assignments = {
        f"{k:064x}": Assignment(f"{k:064x}", CPUSet({4 + k}), f"uid-{k}", f"c{k}") for k in range(n)
    }
    return NodeState(policy, fingerprint, CPUSet({0, 1}), CPUSet({2, 3}), assignments)


def expected_for(state: NodeState, **changes: object) -> Expected:
    fields = {"policy": state.policy, "fingerprint": state.fingerprint, "reserved": state.reserved}
    fields.update(changes)
    return Expected(**fields)


def commit(store: StateStore, state: NodeState) -> CommitTiming:
    with store.locked():
        return store.commit(state)


def bad_files(state_dir: Path) -> list[Path]:
    return sorted(state_dir.glob("state.json.bad-*"))


def temp_files(state_dir: Path) -> list[Path]:
    return sorted(state_dir.glob(".state.json.*"))


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


# --- round trip ------------------------------------------------------------------------------


def test_constructor_touches_nothing(state_dir: Path) -> None:
    StateStore(state_dir)
    assert not state_dir.exists()


def test_round_trip(state_dir: Path) -> None:
    store = StateStore(state_dir)
    state = make_state(5)
    timing = commit(store, state)

    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert (state_dir / "state.json").read_bytes() == encode(state)
    assert (state_dir / "state.lock").is_file()
    assert timing.bytes_written == len(encode(state))
    assert 0 <= timing.fsync_seconds <= timing.total_seconds
    assert store.load() == LoadResult(state, None, None)
    assert store.load(expected_for(state)) == LoadResult(state, None, None)
    assert store.peek() == LoadResult(state, None, None)
    assert temp_files(state_dir) == []


def test_commit_replaces_previous_state_and_keeps_lock_file(state_dir: Path) -> None:
    store = StateStore(state_dir)
    commit(store, make_state(1))
    lock_inode = (state_dir / "state.lock").stat().st_ino
    commit(store, make_state(7))
    assert store.load().state == make_state(7)
    assert (state_dir / "state.lock").stat().st_ino == lock_inode
    assert sorted(p.name for p in state_dir.iterdir()) == ["state.json", "state.lock"]


# --- load failures: reported, moved aside, kept, never raised --------------------------------


def test_missing_file_is_reported_and_nothing_is_created(state_dir: Path) -> None:
    result = StateStore(state_dir).load()
    assert result.state is None and result.quarantined is None
    assert result.problem.startswith("no state file at ")
    assert not state_dir.exists()


def test_missing_file_in_existing_dir(state_dir: Path) -> None:
    store = StateStore(state_dir)
    with store.locked():
        result = store.load()
    assert result.problem.startswith("no state file") and result.quarantined is None
    assert sorted(p.name for p in state_dir.iterdir()) == ["state.lock"]


def _document(**changes: object) -> bytes:
    doc = to_document(make_state(3))
    doc.update(changes)
    doc["checksum"] = checksum(doc)
    return orjson.dumps(doc)


def test_a_document_names_the_build_that_wrote_it_and_reads_without_it() -> None:
    from nri_cpuplugin import __version__
    from nri_cpuplugin.core.state import decode

    state = make_state(3)
    doc = orjson.loads(encode(state))
    assert doc["written_by"] == f"nri-cpuplugin {__version__}"
    # What 0.1.0 wrote (no such field) still loads; so does a field a later build adds.
    del doc["written_by"]
    doc["checksum"] = checksum(doc)
    assert decode(orjson.dumps(doc)) == state
    assert decode(_document(written_by="nri-cpuplugin 9.9", later_field={"x": 1})) == state


def _overlapping() -> bytes:
    doc = to_document(make_state(3))
    first, second = list(doc["assignments"])[:2]
    doc["assignments"][second]["cpus"] = doc["assignments"][first]["cpus"]
    doc["checksum"] = checksum(doc)
    return orjson.dumps(doc)


def _bad_checksum() -> bytes:
    doc = to_document(make_state(3))
    doc["policy"] = "edited-by-hand"
    return orjson.dumps(doc)


CORRUPT = {
    "garbage": (b"\x00\xffnot json at all", "not valid JSON"),
    "truncated": (encode(make_state(50))[:1000], "not valid JSON"),
    "empty": (b"", "is empty (0 bytes)"),
    "whitespace": (b"  \n", "not valid JSON"),
    "not an object": (b"[1, 2, 3]", "not a JSON object"),
    "foreign version": (_document(version=2), "format version 2"),
    "bad checksum": (_bad_checksum(), "checksum mismatch"),
    "inconsistent": (_overlapping(), "is assigned to both"),
    "malformed field": (_document(reserved=17), "malformed field"),
}


@pytest.mark.parametrize("name", CORRUPT)
def test_corrupt_file_is_moved_aside_and_kept(state_dir: Path, name: str) -> None:
    data, expected_text = CORRUPT[name]
    state_dir.mkdir()
    (state_dir / "state.json").write_bytes(data)
    store = StateStore(state_dir)

    peeked = store.peek()
    assert peeked.state is None and peeked.quarantined is None
    assert expected_text in peeked.problem
    assert (state_dir / "state.json").read_bytes() == data  # peek never moves anything

    with store.locked():
        result = store.load()
    assert result.state is None
    assert expected_text in result.problem and str(state_dir / "state.json") in result.problem
    assert result.quarantined is not None and Path(result.quarantined).parent == state_dir
    assert Path(result.quarantined).name.startswith("state.json.bad-")
    assert Path(result.quarantined).read_bytes() == data
    assert not (state_dir / "state.json").exists()
    # The next load simply finds no state, and a commit starts afresh.
    assert store.load().problem.startswith("no state file")
    commit(store, make_state(2))
    assert store.load().state == make_state(2)
    assert bad_files(state_dir) == [Path(result.quarantined)]


def test_quarantine_name_is_a_utc_timestamp(state_dir: Path) -> None:
    state_dir.mkdir()
    (state_dir / "state.json").write_bytes(b"{")
    result = StateStore(state_dir).load()
    stamp = Path(result.quarantined).name.removeprefix("state.json.bad-")
    assert time.strptime(stamp.split(".")[0], "%Y%m%dT%H%M%S")
    assert len(stamp.split(".")[1]) == len("123456Z") and stamp.endswith("Z")


def test_load_without_lock_still_quarantines_under_the_lock(state_dir: Path) -> None:
    state_dir.mkdir()
    (state_dir / "state.json").write_bytes(b"{")
    store = StateStore(state_dir)
    result = store.load()  # takes the lock itself
    assert result.quarantined is not None and Path(result.quarantined).exists()
    assert not store.holds_lock()


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("policy", "numa-aware", ["policy changed from 'static' to 'numa-aware'"]),
        ("fingerprint", "fp-B", ["CPU topology changed", "fp-A", "fp-B"]),
        ("reserved", CPUSet({0, 1, 2}), ["reserved CPUs changed from '0-1' to '0-2'"]),
    ],
)
def test_expectation_mismatch_is_moved_aside(
    state_dir: Path, field: str, value: object, words: list[str]
) -> None:
    store = StateStore(state_dir)
    state = make_state(3)
    commit(store, state)
    expect = expected_for(state, **{field: value})

    peeked = store.peek(expect)
    assert peeked.state is None and peeked.quarantined is None
    assert (state_dir / "state.json").exists()

    with store.locked():
        result = store.load(expect)
    assert result.state is None
    assert "does not match this node" in result.problem
    for word in words:
        assert word in result.problem
    other_fields = {"policy", "fingerprint", "reserved"} - {field}
    assert not any(f"{other} " in result.problem.split(": ", 1)[1] for other in other_fields)
    assert Path(result.quarantined).read_bytes() == encode(state)


def test_all_mismatches_are_named_at_once(state_dir: Path) -> None:
    store = StateStore(state_dir)
    commit(store, make_state())
    result = store.load(Expected("other", "fp-B", CPUSet()))
    assert "policy changed" in result.problem
    assert "CPU topology changed" in result.problem
    assert "reserved CPUs changed from '0-1' to '(none)'" in result.problem


# --- hostile and odd inputs ------------------------------------------------------------------


def test_state_dir_is_a_file(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "state"
    not_a_dir.write_text("hello")
    store = StateStore(not_a_dir)
    for result in (store.load(), store.peek()):
        assert result.state is None and result.quarantined is None
        assert "is not a directory" in result.problem
    with pytest.raises(StateDirError, match="exists but is not a directory"):
        commit(store, make_state())
    assert not_a_dir.read_text() == "hello"


def reads_of(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the reads (os.read) made from now on."""
    reads: list[int] = []
    read = os.read

    def noted(fd: int, size: int) -> bytes:
        reads.append(size)
        return read(fd, size)

    monkeypatch.setattr(os, "read", noted)
    return reads


def test_state_file_is_a_directory(state_dir: Path) -> None:
    (state_dir / "state.json").mkdir(parents=True)
    (state_dir / "state.json" / "inner").write_text("x")
    result = StateStore(state_dir).load()
    assert result.state is None and "is a directory" in result.problem
    moved = Path(result.quarantined)
    assert moved.is_dir() and (moved / "inner").read_text() == "x"


def test_state_file_is_symlink_to_dev_zero(state_dir: Path, monkeypatch) -> None:
    state_dir.mkdir()
    (state_dir / "state.json").symlink_to("/dev/zero")
    reads = reads_of(monkeypatch)
    result = StateStore(state_dir).load()
    assert reads == []  # refused unread, not read up to the cap
    assert result.state is None and "symbolic link" in result.problem
    assert "/dev/zero" in result.problem
    assert Path(result.quarantined).is_symlink() and os.readlink(result.quarantined) == "/dev/zero"


def test_state_file_is_symlink_to_valid_document(state_dir: Path, tmp_path: Path) -> None:
    # We only ever write regular files, so a symlink is foreign even if its target looks fine.
    target = tmp_path / "elsewhere.json"
    target.write_bytes(encode(make_state()))
    state_dir.mkdir()
    (state_dir / "state.json").symlink_to(target)
    result = StateStore(state_dir).load()
    assert result.state is None and "symbolic link" in result.problem
    assert target.read_bytes() == encode(make_state())


def test_state_file_is_a_fifo_does_not_hang(state_dir: Path) -> None:
    state_dir.mkdir()
    os.mkfifo(state_dir / "state.json")
    result = StateStore(state_dir).load()
    assert result.state is None and "not a regular file" in result.problem
    assert stat.S_ISFIFO(Path(result.quarantined).lstat().st_mode)


def test_huge_file_is_not_read(state_dir: Path, monkeypatch) -> None:
    state_dir.mkdir()
    with open(state_dir / "state.json", "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB apparent size, no disk used
    reads = reads_of(monkeypatch)
    result = StateStore(state_dir).load()
    assert reads == []  # not a byte of it
    assert result.state is None and "too large" in result.problem
    assert str(1 << 30) in result.problem
    assert Path(result.quarantined).stat().st_size == 1 << 30


def test_file_just_over_the_cap_is_too_large(state_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(store_module, "MAX_STATE_BYTES", 1000)
    state_dir.mkdir()
    (state_dir / "state.json").write_bytes(b" " * 1001)
    assert "too large" in StateStore(state_dir).peek().problem
    (state_dir / "state.json").write_bytes(b" " * 1000)
    assert "not valid JSON" in StateStore(state_dir).peek().problem


def test_unreadable_file(state_dir: Path, monkeypatch) -> None:
    # As root, mode 000 does not stop reads; simulate what an LSM or a non-root caller sees.
    store = StateStore(state_dir)
    commit(store, make_state())
    real_open = os.open

    def deny(path, *args, **kwargs):
        # Opened by name relative to the state directory's handle.
        if os.fspath(path) == "state.json" and kwargs.get("dir_fd") is not None:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    peeked = store.peek()
    assert peeked.state is None and "Permission denied" in peeked.problem
    with store.locked():
        result = store.load()
    monkeypatch.undo()
    assert "cannot read state file" in result.problem and "Permission denied" in result.problem
    assert Path(result.quarantined).read_bytes() == encode(make_state())  # kept for inspection


def test_load_never_raises_even_on_internal_errors(state_dir: Path, monkeypatch) -> None:
    store = StateStore(state_dir)
    commit(store, make_state())

    def explode(*args, **kwargs):
        raise RuntimeError("decoder bug")

    monkeypatch.setattr(store_module, "decode", explode)
    result = store.load()
    assert result.state is None and "RuntimeError: decoder bug" in result.problem
    assert result.quarantined is not None

    monkeypatch.setattr(files, "read_bounded", explode)  # a bug below the reader
    for result in (store.load(), store.peek()):
        assert result.state is None and "decoder bug" in result.problem


# --- quarantine cap ------------------------------------------------------------------------------


def test_at_most_ten_quarantined_files_newest_kept(state_dir: Path) -> None:
    store = StateStore(state_dir)
    state_dir.mkdir()
    old = [state_dir / f"state.json.bad-2001010{d}T000000.000000Z" for d in range(1, 10)]
    old += [state_dir / f"state.json.bad-2001011{d}T000000.000000Z" for d in range(4)]
    for path in old:
        path.write_text(path.name)
    (state_dir / "state.json.bad-notes").mkdir()  # directories are not ours to delete

    seen = []
    for k in range(3):
        (state_dir / "state.json").write_bytes(b"corrupt %d" % k)
        result = store.load()
        seen.append(Path(result.quarantined))
        assert Path(result.quarantined).read_bytes() == b"corrupt %d" % k

    files = [p for p in bad_files(state_dir) if p.is_file()]
    assert len(files) == QUARANTINE_KEEP == 10
    assert files[-3:] == seen  # the newest are always kept
    assert files[:-3] == sorted(old)[-7:]
    assert (state_dir / "state.json.bad-notes").is_dir()


def test_quarantine_never_overwrites(state_dir: Path) -> None:
    frozen = datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC).timestamp()
    store = StateStore(state_dir, clock=lambda: frozen)
    state_dir.mkdir()
    names = []
    for k in range(3):
        (state_dir / "state.json").write_bytes(b"bad %d" % k)
        names.append(Path(store.load().quarantined).name)
    assert names == [
        "state.json.bad-20240102T030405.678901Z",
        "state.json.bad-20240102T030405.678901Z-1",
        "state.json.bad-20240102T030405.678901Z-2",
    ]
    assert [(state_dir / n).read_bytes() for n in names] == [b"bad 0", b"bad 1", b"bad 2"]


# --- commit ------------------------------------------------------------------------------------


def test_commit_without_lock_raises(state_dir: Path) -> None:
    store = StateStore(state_dir)
    with pytest.raises(RuntimeError, match="without holding the state lock"):
        store.commit(make_state())
    assert not (state_dir / "state.json").exists()


def test_commit_from_a_thread_that_does_not_hold_the_lock_raises(state_dir: Path) -> None:
    store = StateStore(state_dir)
    errors = []

    def other_thread() -> None:
        try:
            store.commit(make_state())
        except RuntimeError as err:
            errors.append(err)

    with store.locked():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert len(errors) == 1


def test_stale_temp_files_removed_on_commit(state_dir: Path) -> None:
    store = StateStore(state_dir)
    commit(store, make_state(1))
    stale = [state_dir / ".state.json.abc123", state_dir / ".state.json.zzz"]
    for path in stale:
        path.write_bytes(b'{"half": ')
    (state_dir / "state.json.bad-20240101T000000.000000Z").write_text("kept")
    assert store.load().state == make_state(1)  # loading ignores and keeps them
    assert temp_files(state_dir) == stale

    commit(store, make_state(2))
    assert temp_files(state_dir) == []
    assert (state_dir / "state.json.bad-20240101T000000.000000Z").read_text() == "kept"
    assert store.load().state == make_state(2)


def test_failed_commit_removes_temp_and_keeps_old_state(state_dir: Path, monkeypatch) -> None:
    store = StateStore(state_dir)
    commit(store, make_state(1))

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space left"), store.locked():
        store.commit(make_state(2))
    monkeypatch.undo()
    assert temp_files(state_dir) == []
    assert store.load().state == make_state(1)


# --- locking -----------------------------------------------------------------------------------


def _hold_lock_in_subprocess(state_dir: Path) -> subprocess.Popen:
    code = (
        "import sys\n"
        "from nri_cpuplugin.storage.store import StateStore\n"
        "with StateStore(sys.argv[1]).locked():\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(state_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(),
    )
    assert holder.stdout.readline() == b"held\n"
    return holder


def _release(holder: subprocess.Popen) -> None:
    holder.stdin.close()
    holder.wait(timeout=10)
    holder.stdout.close()


def test_lock_timeout_names_lock_file_and_what_to_do(state_dir: Path) -> None:
    holder = _hold_lock_in_subprocess(state_dir)
    try:
        store = StateStore(state_dir, lock_timeout=0.2)
        with pytest.raises(StateLockTimeout) as info, store.locked():
            pass
        assert holder.poll() is None  # given up while the holder still holds it
        message = str(info.value)
        assert str(state_dir / "state.lock") in message
        assert "0.2s" in message
        assert "another nri-cpuplugin process" in message
        assert "retry" in message
        with pytest.raises(StateLockTimeout, match=r"after 0\.05s"), store.locked(timeout=0.05):
            pass
    finally:
        _release(holder)
    with store.locked(timeout=5):  # released with the holder
        pass


def test_load_without_lock_leaves_bad_file_when_lock_is_busy(state_dir: Path) -> None:
    state_dir.mkdir()
    (state_dir / "state.json").write_bytes(b"{")
    holder = _hold_lock_in_subprocess(state_dir)
    try:
        result = StateStore(state_dir, lock_timeout=0.1).load()
    finally:
        _release(holder)
    assert result.state is None and result.quarantined is None
    assert "not valid JSON" in result.problem and "left in place" in result.problem
    assert (state_dir / "state.json").read_bytes() == b"{"


def test_lock_timeout_between_threads_of_one_process(state_dir: Path) -> None:
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with StateStore(state_dir).locked():
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert holding.wait(10)
        other = StateStore(state_dir)
        with (
            pytest.raises(StateLockTimeout, match="another thread of this process"),
            other.locked(timeout=0.1),
        ):
            pass
    finally:
        release.set()
        thread.join()


def test_two_stores_in_one_process_exclude_each_other(state_dir: Path) -> None:
    # Each thread has its own StateStore on the same directory and does an unprotected-looking
    # read-modify-write of a counter (kept in the fingerprint); lost updates or overlap would
    # show up as a wrong final count or as two threads inside at once.
    threads, rounds = 4, 15
    inside = []
    overlaps = []
    errors = []
    commit(StateStore(state_dir), make_state(fingerprint="0"))

    def worker() -> None:
        store = StateStore(state_dir)
        try:
            for _ in range(rounds):
                with store.locked():
                    inside.append(1)
                    if len(inside) > 1:
                        overlaps.append(len(inside))
                    count = int(store.load().state.fingerprint)
                    os.sched_yield()  # the others run meanwhile, if they ignore the lock
                    store.commit(make_state(fingerprint=str(count + 1)))
                    inside.pop()
        except Exception as err:
            errors.append(err)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == [] and overlaps == []
    assert StateStore(state_dir).load().state.fingerprint == str(threads * rounds)


def test_lock_is_reentrant_in_the_holding_thread_across_stores(state_dir: Path) -> None:
    first, second = StateStore(state_dir), StateStore(str(state_dir) + "/../state")
    with first.locked(timeout=1), second.locked(timeout=1), first.locked(timeout=1):
        assert first.holds_lock() and second.holds_lock()
        second.commit(make_state())
    assert not first.holds_lock() and not second.holds_lock()
    # And it was really released: another process can take it at once.
    _release(_hold_lock_in_subprocess(state_dir))


def test_lock_excludes_another_process(state_dir: Path) -> None:
    store = StateStore(state_dir)
    with store.locked():
        code = (
            "import sys\n"
            "from nri_cpuplugin.storage.store import StateStore, StateLockTimeout\n"
            "try:\n"
            "    with StateStore(sys.argv[1]).locked(timeout=0.1): print('acquired')\n"
            "except StateLockTimeout: print('timeout')\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(state_dir)], capture_output=True, env=_env()
        )
    assert out.stdout == b"timeout\n", out.stderr


# --- crash test: SIGKILL a real writer at each step of its commit -------------------------------


def _env() -> dict[str, str]:
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


class _Zygote:
    """Drives tests/_store_crash_writer.py: forks writers on request, reports their progress."""

    def __init__(self, state_dir: Path, mode: str = "store") -> None:
        # stderr is inherited, so a writer's traceback shows up in pytest's captured output.
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(state_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(),
        )
        self.mode = mode
        self.writer_pid: int | None = None  # forked and not yet reported reaped
        assert self._message() == ["ready"]

    def _message(self) -> list[str]:
        line = self.proc.stdout.readline()
        if not line.endswith(b"\n"):
            self.proc.wait(10)
            raise AssertionError(f"writer zygote died (exit {self.proc.returncode})")
        return line.decode().split()

    def run(self, iteration: int, step: int) -> tuple[list[tuple[str, int]], int]:
        """Fork a writer that commits ``iteration`` and kills itself before the commit's
        system call number ``step``; wait until it is reaped.  (Its messages, in order:
        ("begin" | "done", iteration); its exit code.)"""
        self.proc.stdin.write(b"go %d %s %d\n" % (iteration, self.mode.encode(), step))
        self.proc.stdin.flush()
        progress: list[tuple[str, int]] = []
        while True:
            kind, *values = self._message()
            if kind == "pid":
                self.writer_pid = int(values[0])
            elif kind == "exited":
                self.writer_pid = None
                return progress, int(values[1])
            else:
                progress.append((kind, int(values[0])))

    def close(self) -> None:
        # Kill the writer before the zygote: an orphaned writer would go on committing.
        if self.writer_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.writer_pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def _crash_kills(state_dir: Path, mode: str, rounds: int = 3) -> dict:
    """Kill writers before each system call of a commit in turn, then once it has returned,
    ``rounds`` times over (so documents of several sizes), checking after each kill that the
    state on disk is one complete version and that no committed version is lost.  Raises
    AssertionError saying which kill otherwise."""
    store = StateStore(state_dir, lock_timeout=10)
    state_for, iteration_of = crash_writer.state_for, crash_writer.iteration_of
    last_loaded: int | None = None  # iteration of the state on disk after the previous kill
    next_iteration = 0
    made = inside = left_temp = 0
    zygote = _Zygote(state_dir, mode)
    try:
        for _ in range(rounds):
            step, completed = 0, None
            while completed is None:
                assert step < 100, f"a commit of {step} system calls ({mode})?"
                progress, exit_code = zygote.run(next_iteration, step)
                made += 1
                where = f"kill #{made}, before system call {step} of commit {next_iteration}"
                assert exit_code == -signal.SIGKILL, f"{where}: writer exited with {exit_code}"
                assert progress[0] == ("begin", next_iteration), f"{where}: {progress}"
                completed = next_iteration if ("done", next_iteration) in progress else None
                inside += completed is None
                step += 1
                left_temp += bool(temp_files(state_dir))
                assert len(temp_files(state_dir)) <= 1, f"{where}: stale temps are not cleaned up"

                # Like a restarting daemon: the dead writer's lock must be free at once.
                with store.locked(timeout=5):
                    result = store.load()
                # Nothing torn: the file is one whole document, never set aside.
                assert result.quarantined is None, f"{where}: {result.problem}"
                assert bad_files(state_dir) == [], where
                if result.state is None:
                    # Legitimate only if no commit ever reached the rename.
                    assert last_loaded is None and completed is None, f"{where}: {result.problem}"
                    assert result.problem.startswith("no state file"), f"{where}: {result.problem}"
                    continue
                assert result.problem is None, f"{where}: {result.problem}"
                # One complete version: exactly the state of one iteration.
                loaded = iteration_of(result.state)
                assert result.state == state_for(loaded), f"{where}: state {loaded} differs"
                # No committed version lost: the one that returned; inside a commit, the one
                # before it (not renamed yet) or it (renamed).
                allowed = {next_iteration} | ({last_loaded} if completed is None else set())
                assert loaded in allowed, f"{where}: loaded {loaded}, expected one of {allowed}"
                last_loaded, next_iteration = loaded, loaded + 1
    finally:
        zygote.close()
    return {"kills": made, "inside": inside, "after_commit": rounds,
            "left_temp": left_temp, "reached": last_loaded}  # fmt: skip


def test_sigkill_at_each_step_of_a_commit_always_leaves_old_or_new_state(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"  # one directory for all kills: old -> new transitions
    seen = _crash_kills(state_dir, mode="store")
    # Kills inside a commit both before and after its rename, and a temp file left behind by
    # some: the kills reached the points that matter.
    assert seen["inside"] >= 3 * 6 and seen["left_temp"] > 0, seen
    store = StateStore(state_dir)
    with store.locked():
        store.commit(crash_writer.state_for(seen["reached"] + 1))
    assert temp_files(state_dir) == []
    print(seen)


def test_the_crash_test_catches_a_store_that_rewrites_the_file_in_place(tmp_path: Path) -> None:
    # The same kills against a broken commit (truncate and rewrite state.json where it is):
    # a kill inside it leaves a torn file, which the checks above must report.
    with pytest.raises(AssertionError, match=r"state file .* (empty|not a valid state document)"):
        _crash_kills(tmp_path / "state", mode="in-place")
