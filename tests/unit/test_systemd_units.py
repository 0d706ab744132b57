"""systemd units' cpusets over D-Bus (nri_cpuplugin/hardware/systemd/units.py), without a bus.

Unit names and bitmasks against runc's and systemd's rules; the sans-I/O conversation fed by
hand; both clients against a scripted peer on a unix socket in a temporary directory that
answers, says nothing, talks nonsense or hangs up.  Deadlines are failure bounds here: every
wait is on a condition.  (tests/system/test_systemd_dbus.py runs them against a real
dbus-daemon.)
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jeepney.low_level import Parser as JeepneyParser

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.daemon.units import SystemdUnits
from nri_cpuplugin.hardware.cpusets import Target
from nri_cpuplugin.hardware.systemd import handover, wire
from nri_cpuplugin.hardware.systemd import message as msg
from nri_cpuplugin.hardware.systemd import units as su
from nri_cpuplugin.hardware.systemd.auth import auth_external
from nri_cpuplugin.hardware.systemd.client import SystemdClient
from nri_cpuplugin.hardware.systemd.conversation import WINDOW, Conversation, in_order
from nri_cpuplugin.hardware.systemd.unit_config import holds_cpuset
from nri_cpuplugin.hardware.systemd.units import SystemdError
from nri_cpuplugin.hardware.systemd.unmarshal import MessageReader
from nri_cpuplugin.ops.audit import Audit

# --- unit names -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        (
            "kubepods-burstable-pod1234_ab.slice:cri-containerd:0123abcd",
            "cri-containerd-0123abcd.scope",
        ),
        ("kubepods-pod9.slice:crio:ffee", "crio-ffee.scope"),
        ("system.slice:docker:1234", "docker-1234.scope"),
        # runc: a name ending in .slice is the unit itself, the prefix unused
        ("-.slice:runc:machine-x.slice", "machine-x.slice"),
        # runc appends .scope whatever the name ends in
        ("kubepods.slice:crio:abc.scope", "crio-abc.scope.scope"),
        # and joins an empty prefix with its dash, as runc does
        (":: x", None),
    ],
)
def test_unit_name_from_cgroups_path(path: str, unit: str | None) -> None:
    if unit is None:
        with pytest.raises(SystemdError):
            su.unit_name(path)
    else:
        assert su.unit_name(path) == unit


@pytest.mark.parametrize("path", ["", "/kubepods/burstable/pod1/abc", "/a:b:c"])
def test_cgroupfs_paths_have_no_unit(path: str) -> None:
    assert su.unit_name(path) is None


@pytest.mark.parametrize(
    "path",
    [
        "a.slice:b",  # two parts
        "a.slice:b:c:d",
        "s.slice:p:../../etc",  # a path in the name
        "s.slice:p:x\ny",
        "s.slice:p:a b",
        "s.slice:p:a@b",  # templates are not containers
        "s.slice:p:é",
        "s.slice:p:" + "a" * 260,
        "s.slice::",  # "-.scope" would be fine for systemd; an empty name is not a container
    ],
)
def test_hostile_cgroups_paths_are_refused(path: str) -> None:
    if path == "s.slice::":
        assert su.unit_name(path) == "-.scope"
        return
    with pytest.raises(SystemdError) as error:
        su.unit_name(path)
    assert error.value.code == "unit-name"


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("cri-containerd-abc.scope", True),
        ("a:b_c\\x2d.slice", True),
        ("a" * 249 + ".scope", True),  # 255 characters
        ("a" * 250 + ".scope", False),
        (".scope", False),
        ("abc", False),
        ("abc.service", False),  # not a container's
        ("a@b.scope", False),
        ("a/b.scope", False),
        ("a b.scope", False),
        ("a.scope\0", False),
        (3, False),
    ],
)
def test_check_unit_name(name: object, ok: bool) -> None:
    if ok:
        assert su.check_unit_name(name) == name
    else:
        with pytest.raises(SystemdError):
            su.check_unit_name(name)


# --- bitmasks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "mask"),
    [
        ({0}, b"\x01"),
        ({7}, b"\x80"),
        ({8}, b"\x00\x01"),
        ({1, 2, 9}, b"\x06\x02"),
        (CPUSet.parse("0-63"), b"\xff" * 8),
        (CPUSet.parse("2-3,6-7"), b"\xcc"),
        ([3, 3], b"\x08"),
    ],
)
def test_cpu_mask_is_runcs_range_to_bits(cpus: object, mask: bytes) -> None:
    assert su.cpu_mask(cpus) == mask


@given(st.sets(st.integers(0, 2047), min_size=1))
def test_cpu_mask_reads_back_as_systemd_reads_it(cpus: set[int]) -> None:
    mask = su.cpu_mask(cpus)
    # systemd's cpu_set_from_dbus: bit i % 8 of byte i // 8
    assert {i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1} == cpus
    assert mask[-1] != 0  # as few bytes as the highest CPU needs


@pytest.mark.parametrize("cpus", [set(), [-1], [1 << 16], [1.5], ["1"], [None]])
def test_bad_cpu_sets_are_refused(cpus: object) -> None:
    with pytest.raises(SystemdError) as error:
        su.cpu_mask(cpus)
    assert error.value.code == "cpu-mask"


def test_set_allowed_call_is_what_runc_sends() -> None:
    data = su.set_allowed_call(7, "crio-1.scope", su.cpu_mask({1, 2}), su.cpu_mask({0}))
    [message] = JeepneyParser().feed(data)  # read by an independent implementation
    fields = {int(k): v for k, v in message.header.fields.items()}
    assert fields == {
        1: "/org/freedesktop/systemd1",
        2: "org.freedesktop.systemd1.Manager",
        3: "SetUnitProperties",
        6: "org.freedesktop.systemd1",
        8: "sba(sv)",
    }
    assert message.header.serial == 7
    assert message.body == (
        "crio-1.scope",
        True,
        [("AllowedCPUs", ("ay", b"\x06")), ("AllowedMemoryNodes", ("ay", b"\x01"))],
    )
    only_cpus = su.set_allowed_call(8, "crio-1.scope", b"\x06", None)
    assert JeepneyParser().feed(only_cpus)[0].body[2] == [("AllowedCPUs", ("ay", b"\x06"))]


# --- the conversation -------------------------------------------------------------------------

OK_LINE = b"OK 0123456789abcdef0123456789abcdef\r\n"


def _calls(data: bytes) -> list[msg.Message]:
    reader = MessageReader()
    reader.feed(data)
    return reader.messages()


def _reply(call: msg.Message, serial: int, error: str | None = None, text: str = "") -> bytes:
    if error:
        return msg.error(serial, call, error, text)
    return msg.method_return(serial, call)


def _greeted(hello: bool = True) -> tuple[Conversation, list[msg.Message]]:
    conversation = Conversation(hello=hello, uid=0)
    greeting = conversation.greeting()
    assert greeting.startswith(auth_external(0))
    return conversation, _calls(greeting[len(auth_external(0)) :])


def test_the_greeting_pipelines_auth_and_hello() -> None:
    conversation, sent = _greeted()
    [hello] = sent
    assert (hello.member, hello.destination) == ("Hello", "org.freedesktop.DBus")
    conversation.feed(OK_LINE + msg.method_return(1, hello, "s", (":1.42",)))
    assert conversation.authenticated and conversation.name == ":1.42"
    assert _greeted(hello=False)[1] == []  # peer to peer: no Hello


def test_calls_leave_at_most_a_window_at_a_time_and_answers_match_by_serial() -> None:
    conversation, [hello] = _greeted()
    batch = conversation.submit([(f"crio-{i}.scope", {i % 3}, {0}) for i in range(150)])
    first = _calls(conversation.outgoing())
    assert len(first) == WINDOW - 1  # Hello is in flight too
    assert conversation.outgoing() == b""  # nothing more until answers come
    # answers in reverse order, and the bus's NameAcquired signal in between
    replies = b"".join(_reply(call, 100 + i) for i, call in enumerate(reversed(first)))
    signal = msg.message(
        wire.SIGNAL, 99, {wire.PATH: "/a", wire.INTERFACE: "a.b", wire.MEMBER: "N"}
    )
    conversation.feed(OK_LINE + msg.method_return(98, hello, "s", (":1.1",)) + signal + replies)
    assert len(batch.results) == WINDOW - 1
    sent = first
    while not batch.done:
        more = _calls(conversation.outgoing())
        assert 0 < len(more) <= WINDOW
        sent += more
        conversation.feed(b"".join(_reply(call, 500 + call.serial) for call in more))
    assert [call.body[0] for call in sent] == [f"crio-{i}.scope" for i in range(150)]
    assert {r.outcome for r in batch.results.values()} == {su.SET}


@pytest.mark.parametrize(
    ("error", "text", "outcome", "code", "says"),
    [
        (
            "org.freedesktop.systemd1.NoSuchUnit",
            "Unit x.scope not loaded.",
            su.GONE,
            "gone",
            "no such unit",
        ),
        ("org.freedesktop.DBus.Error.AccessDenied", "Rejected send", su.DENIED, "denied", "uid 0"),
        (
            "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired",
            "",
            su.DENIED,
            "denied",
            "org.freedesktop.systemd1.manage-units",
        ),
        (
            "org.freedesktop.DBus.Error.ServiceUnknown",
            "",
            su.UNREACHABLE,
            "unreachable",
            "not the init",
        ),
        (
            "org.freedesktop.DBus.Error.PropertyReadOnly",
            "Cannot set property AllowedCPUs, or unknown property.",
            su.FAILED,
            "unsupported",
            "systemd 244",
        ),
        ("org.freedesktop.DBus.Error.LimitsExceeded", "too many", su.FAILED, "systemd", "too many"),
    ],
)
def test_error_answers_are_classified(
    error: str, text: str, outcome: str, code: str, says: str
) -> None:
    conversation, _ = _greeted(hello=False)
    batch = conversation.submit([("x.scope", {1}, None)])
    [call] = _calls(conversation.outgoing())
    conversation.feed(OK_LINE + _reply(call, 5, error, text))
    [result] = in_order(batch, [("x.scope",)])
    assert (result.outcome, result.error.code) == (outcome, code)
    assert says in str(result.error) and "x.scope" in str(result.error)
    assert result.ok == (outcome == su.GONE)


def test_units_that_cannot_be_sent_fail_alone() -> None:
    conversation, _ = _greeted(hello=False)
    changes = [("ok.scope", {1}, None), ("../x.scope", {1}, None), ("empty.scope", set(), None)]
    batch = conversation.submit(changes)
    [call] = _calls(conversation.outgoing())
    assert call.body[0] == "ok.scope"
    conversation.feed(OK_LINE + _reply(call, 2))
    assert [r.outcome for r in in_order(batch, changes)] == [su.SET, su.FAILED, su.FAILED]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"REJECTED DBUS_COOKIE_SHA1\r\n", "refused EXTERNAL"),
        (OK_LINE + b"x" * 16, "byte order flag"),
        (b"A" * 600, "longer than 512"),
        (b"\0" * 64, "unexpected authentication answer"),  # not a line of text: no waiting
    ],
)
def test_a_broken_peer_settles_every_unit_at_once(data: bytes, says: str) -> None:
    conversation, _ = _greeted()
    batch = conversation.submit([("a.scope", {1}, None), ("b.scope", {2}, None)])
    conversation.outgoing()
    conversation.feed(data)
    assert batch.done and conversation.closed
    assert {r.outcome for r in batch.results.values()} == {su.UNREACHABLE}
    assert all(says in str(r.error) for r in batch.results.values())
    later = conversation.submit([("c.scope", {1}, None)])
    assert later.done and later.results["c.scope"].outcome == su.UNREACHABLE


def test_a_refused_hello_is_unreachable() -> None:
    conversation, [hello] = _greeted()
    batch = conversation.submit([("a.scope", {1}, None)])
    conversation.outgoing()
    conversation.feed(OK_LINE + _reply(hello, 2, "org.freedesktop.DBus.Error.AccessDenied", "no"))
    assert batch.results["a.scope"].outcome == su.UNREACHABLE
    assert "refused Hello" in str(batch.results["a.scope"].error)


def test_an_abandoned_batch_keeps_the_window_honest_and_late_answers_are_dropped() -> None:
    conversation, [hello] = _greeted()  # the window is the bus's: only with Hello
    conversation.feed(OK_LINE + msg.method_return(98, hello, "s", (":1.1",)))
    slow = conversation.submit([(f"s{i}.scope", {1}, None) for i in range(WINDOW)])
    late_calls = _calls(conversation.outgoing())
    conversation.abandon(slow, su.TIMEOUT, SystemdError("late", "timeout"))
    assert {r.outcome for r in slow.results.values()} == {su.TIMEOUT}
    fresh = conversation.submit([("f.scope", {1}, None)])
    assert conversation.outgoing() == b""  # the abandoned calls still fill the window
    conversation.feed(b"".join(_reply(call, 1000 + call.serial) for call in late_calls))
    assert {r.outcome for r in slow.results.values()} == {su.TIMEOUT}  # unchanged
    assert conversation.take_late() == []  # abandoned, not pending: nobody asks
    [call] = _calls(conversation.outgoing())
    conversation.feed(_reply(call, 5000))
    assert fresh.results["f.scope"].outcome == su.SET


def test_peer_to_peer_every_call_leaves_at_once() -> None:
    """systemd's private socket has no bus daemon limiting replies owed: no window."""
    conversation, _ = _greeted(hello=False)
    conversation.submit([(f"crio-{i}.scope", {1}, None) for i in range(3 * WINDOW)])
    assert len(_calls(conversation.outgoing())) == 3 * WINDOW


def test_sent_calls_are_pending_at_the_deadline_and_their_answers_come_late() -> None:
    conversation, [hello] = _greeted()
    conversation.feed(OK_LINE + msg.method_return(98, hello, "s", (":1.1",)))
    batch = conversation.submit([(f"s{i}.scope", {1}, None) for i in range(WINDOW + 5)])
    sent = _calls(conversation.outgoing())  # the window's worth; 5 wait for room
    conversation.feed(_reply(sent[0], 200))
    conversation.leave_pending(batch, SystemdError("slow", "timeout"))
    outcomes = [r.outcome for r in in_order(batch, [(f"s{i}.scope",) for i in range(WINDOW + 5)])]
    # answered: set; sent, unanswered: pending; never sent: timeout (the caller's to apply)
    assert outcomes == [su.SET] + [su.PENDING] * (WINDOW - 1) + [su.TIMEOUT] * 5
    assert batch.done and conversation.outgoing() == b""  # the unsent ones are dropped
    conversation.feed(_reply(sent[1], 201) + _reply(sent[2], 202, "org.x.Error.Failed", "no"))
    late = conversation.take_late()
    assert [(r.unit, r.outcome) for r in late] == [("s1.scope", su.SET), ("s2.scope", su.FAILED)]
    assert conversation.take_late() == []  # each told once
    conversation.fail(su.UNREACHABLE, SystemdError("gone", "closed"))
    lost = conversation.take_late()  # the rest were lost with the connection, in order
    assert [r.unit for r in lost] == [f"s{i}.scope" for i in range(3, WINDOW)]
    assert {r.outcome for r in lost} == {su.UNREACHABLE}


def test_each_pending_call_of_a_unit_gets_its_own_late_answer() -> None:
    """A unit's set and release both pending: each is answered, in order - the set's answer
    does not stand for the release's, nor the release's loss hide behind the set's."""
    conversation, [hello] = _greeted()
    conversation.feed(OK_LINE + msg.method_return(98, hello, "s", (":1.1",)))
    batch = conversation.submit([("u.scope", {1}, None)])
    [set_call] = _calls(conversation.outgoing())
    conversation.leave_pending(batch, SystemdError("slow", "timeout"))
    release = conversation.submit([("u.scope", set(), set())])
    _calls(conversation.outgoing())
    conversation.leave_pending(release, SystemdError("slow", "timeout"))
    conversation.feed(_reply(set_call, 300))
    conversation.fail(su.UNREACHABLE, SystemdError("gone", "closed"))
    late = conversation.take_late()
    assert [(r.unit, r.outcome) for r in late] == [
        ("u.scope", su.SET),
        ("u.scope", su.UNREACHABLE),
    ]


# --- the clients against a scripted peer ------------------------------------------------------


class Peer:
    """A unix socket server in a thread: ``script(conn)`` plays the peer for each connection."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="nri-peer-")
        self.path = os.path.join(self.dir.name, "sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.script = script
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                self.script(conn)

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        self.listener.close()
        self.thread.join(5)
        self.dir.cleanup()


@pytest.fixture
def peer() -> Iterator[Callable[[Callable[[socket.socket], None]], Peer]]:
    peers: list[Peer] = []

    def make(script: Callable[[socket.socket], None]) -> Peer:
        peers.append(Peer(script))
        return peers[-1]

    yield make
    for p in peers:
        p.close()


def _systemd(
    conn: socket.socket, answer: Callable[[msg.Message, int], bytes] | None = None
) -> None:
    """A well-behaved peer-to-peer systemd: OK, then an answer per call."""
    reader = MessageReader()
    data = b""
    while b"BEGIN\r\n" not in data:
        data += conn.recv(4096)
    conn.sendall(OK_LINE)
    reader.feed(data.split(b"BEGIN\r\n", 1)[1])
    serial = 100
    while True:
        for call in reader.messages():
            serial += 1
            conn.sendall(answer(call, serial) if answer else msg.method_return(serial, call))
        chunk = conn.recv(65536)
        if not chunk:
            return
        reader.feed(chunk)


def _silent(conn: socket.socket) -> None:
    while conn.recv(65536):
        pass


def test_the_blocking_client_pipelines_and_matches(peer) -> None:
    p = peer(_systemd)
    with SystemdClient(p.path, hello=False) as client:
        changes = [(f"crio-{i}.scope", {i % 2}, {0}) for i in range(200)]
        results = client.set_allowed(changes, 10)
        assert [r.unit for r in results] == [c[0] for c in changes]
        assert {r.outcome for r in results} == {su.SET}
        assert client.set_allowed([("again.scope", {1}, None)], 10)[0].outcome == su.SET


@pytest.mark.parametrize(
    ("script", "outcome", "says"),
    [
        (_silent, su.TIMEOUT, "did not answer"),
        (lambda conn: conn.recv(100), su.UNREACHABLE, "connection"),  # hung up
        (lambda conn: conn.sendall(b"\x00" * 64) or _silent(conn), su.UNREACHABLE, "unexpected"),
        (
            lambda conn: conn.sendall(OK_LINE + b"Q" * 64) or _silent(conn),
            su.UNREACHABLE,
            "byte order",
        ),
        (
            # a reply announcing 100 MiB: refused from its header, not awaited
            lambda conn: (
                conn.sendall(
                    OK_LINE
                    + b"l\x02\x00\x01"
                    + (100 << 20).to_bytes(4, "little")
                    + b"\x01\0\0\0"
                    + b"\0" * 8
                )
                or _silent(conn)
            ),
            su.UNREACHABLE,
            "this reader takes",
        ),
    ],
)
def test_the_blocking_client_never_waits_past_its_deadline(peer, script, outcome, says) -> None:
    p = peer(script)
    with SystemdClient(p.path, hello=False) as client:
        [result] = client.set_allowed([("a.scope", {1}, None)], 0.5)
    # Given up at its deadline (TIMEOUT: the peer never answers) or at what it read.
    assert (result.outcome, says in str(result.error)) == (outcome, True), result


def test_the_blocking_client_leaves_a_slow_systemds_calls_pending(peer) -> None:
    """Answers held back until the client's deadline has passed: the calls are PENDING (systemd
    will apply them), and their answers are read while the next call waits for its own."""
    release = threading.Event()

    def slow(call: msg.Message, serial: int) -> bytes:
        if call.body[0].startswith("slow"):
            release.wait(10)
        return msg.method_return(serial, call)

    p = peer(lambda conn: _systemd(conn, slow))
    with SystemdClient(p.path, hello=False) as client:
        results = client.set_allowed(
            [("slow-1.scope", {1}, None), ("slow-2.scope", {1}, None)], 0.3
        )
        assert [r.outcome for r in results] == [su.PENDING, su.PENDING] and all(
            r.ok for r in results
        )
        release.set()
        assert client.set_allowed([("next.scope", {1}, None)], 10)[0].outcome == su.SET
        assert [(r.unit, r.outcome) for r in client.take_late()] == [
            ("slow-1.scope", su.SET),
            ("slow-2.scope", su.SET),
        ]
        assert client.take_late() == []


def test_the_blocking_client_says_why_it_cannot_connect(tmp_path) -> None:
    missing = str(tmp_path / "none")
    [result] = SystemdClient(missing).set_allowed([("a.scope", {1}, None)], 1)
    assert result.outcome == su.UNREACHABLE and "no socket at" in str(result.error)
    plain = tmp_path / "file"
    plain.write_text("")
    [result] = SystemdClient(str(plain)).set_allowed([("a.scope", {1}, None)], 1)
    assert result.outcome == su.UNREACHABLE and "cannot reach systemd" in str(result.error)


def test_closing_a_client_drops_its_connection(peer) -> None:
    p = peer(_systemd)
    client = SystemdClient(p.path, hello=False)
    assert client.set_allowed([("a.scope", {1}, None)], 5)[0].outcome == su.SET
    client.close()
    assert client.set_allowed([("b.scope", {1}, None)], 5)[0].outcome == su.SET  # reconnected
    client.close()


def test_connecting_ahead_of_the_calls(peer) -> None:
    p = peer(_systemd)
    silent = peer(_silent)
    with SystemdClient(p.path, hello=False) as client:
        assert client.connect(5) is None and client.conversation.ready
        assert client.set_allowed([("a.scope", {1}, None)], 5)[0].outcome == su.SET
    with SystemdClient(silent.path, hello=False) as client:
        error = client.connect(0.3)
        assert error.code == "timeout" and "handshake" in str(error)
    error = SystemdClient(p.path + ".missing").connect(1)
    assert error.code == "unreachable" and "no socket at" in str(error)


# --- the daemon's units (daemon/units.py) over a scripted client -----------------------------


class ScriptedClient:
    """The edge: answers each unit with the outcome the test gives (default SET), and hands out
    late answers as ``take_late`` would (in the order they came); the sets and the releases
    sent, batch by batch, and every call's (unit, cpus) in order ("" for a release).
    ``closes``: the next batch finds its connection closed by systemd (a re-exec): every call
    of it is unreachable, as is every call still pending."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.release_outcomes: dict[str, str] = {}
        self.late: list[su.UnitResult] = []
        self.sent: list[list[str]] = []
        self.released: list[list[str]] = []
        self.calls: list[tuple[str, str]] = []
        self.pending: list[str] = []  # units of calls answered PENDING, not yet answered late
        self.closes = 0
        self.collected = 0

    def set_allowed(self, changes, timeout):
        release = all(not cpus and mems is not None and not mems for _, cpus, mems in changes)
        (self.released if release else self.sent).append([unit for unit, *_ in changes])
        if self.closes:
            self.closes -= 1
            closed = SystemdError("systemd's D-Bus connection failed: Broken pipe", "closed")
            self.late += [su.UnitResult(u, su.UNREACHABLE, closed) for u in self.pending]
            self.pending = []
            return [su.UnitResult(u, su.UNREACHABLE, closed) for u, *_ in changes]
        self.calls += [(u, str(CPUSet(cpus))) for u, cpus, _ in changes]
        outcomes = {**self.outcomes, **self.release_outcomes} if release else self.outcomes
        results = [su.UnitResult(u, outcomes.get(u, su.SET)) for u, *_ in changes]
        self.pending += [r.unit for r in results if r.outcome == su.PENDING]
        return results

    def answer_late(self, outcome: str = su.SET, **errors: str) -> None:
        """systemd answers every pending call: ``outcome``, or an error for some units."""
        for unit in self.pending:
            said = errors.get(unit, outcome)
            error = None if said == su.SET else SystemdError(said, said)
            self.late.append(su.UnitResult(unit, said, error))
        self.pending = []

    def take_late(self):
        late, self.late = self.late, []
        return late

    def collect(self, timeout):
        self.collected += 1

    def close(self) -> None:
        pass


def _target(cid: str, cpus: str = "0-3") -> Target:
    return Target(cid, f"kubepods.slice:cri-containerd:{cid}", CPUSet.parse(cpus))


def _scopes(root: Path, cids: str, line: str = "AllowedCPUs=0-7") -> str:
    """A machine root whose transient scopes (runc's, one per container id) say ``line``."""
    transient = root / "run" / "systemd" / "transient"
    transient.mkdir(parents=True, exist_ok=True)
    for cid in cids:
        (transient / f"cri-containerd-{cid}.scope").write_text(f"[Scope]\n{line}\n")
    return str(root)


def _units(root: str, records: list[dict] | None = None) -> tuple[SystemdUnits, ScriptedClient]:
    sink = records.append if records is not None else (lambda record: None)
    units = SystemdUnits(Audit(sink), "/nonexistent", root)
    units.client = client = ScriptedClient()
    return units, client


def test_a_unit_is_set_then_released_once_and_written_directly_from_then_on(tmp_path) -> None:
    units, client = _units(_scopes(tmp_path, "a"))
    assert units.set_cpus([_target("a")]) == []
    assert (client.sent, client.released) == (
        [["cri-containerd-a.scope"]],
        [["cri-containerd-a.scope"]],
    )
    assert units.set_cpus([_target("a", "0-2")]) == []  # bare: the files are enough
    assert len(client.sent) == len(client.released) == 1
    units.forget("a")  # the runtime gave it a cpuset (runc update): systemd's again
    units.set_cpus([_target("a", "0-1")])
    assert len(client.sent) == len(client.released) == 2


def test_a_unit_that_holds_no_cpuset_is_never_asked(tmp_path) -> None:
    root = _scopes(tmp_path, "a", line="CPUWeight=10")  # created with none in its spec
    _scopes(tmp_path, "b")
    dropins = tmp_path / "run/systemd/transient/cri-containerd-b.scope.d"
    dropins.mkdir()  # b was handed over by an earlier run of the daemon
    (dropins / "50-AllowedCPUs.conf").write_text("[Scope]\nAllowedCPUs=\nAllowedCPUs=\n")
    units, client = _units(root)
    assert units.set_cpus([_target("a"), _target("b")]) == []
    assert client.sent == client.released == []


def test_a_refused_set_is_not_released_and_a_refused_release_is_tried_again(tmp_path) -> None:
    records: list[dict] = []
    units, client = _units(_scopes(tmp_path, "ab"), records)
    client.outcomes = {"cri-containerd-a.scope": su.DENIED}
    assert units.set_cpus([_target("a")]) == ["a"] and client.released == []
    client.outcomes = {}
    client.release_outcomes = {"cri-containerd-b.scope": su.FAILED}
    assert units.set_cpus([_target("b")]) == []  # set: the cpuset is right, and systemd's
    [warning] = [r for r in records if r.get("REASON") == "release-failed"]
    assert "asked again at the next change" in warning["MESSAGE"]
    client.release_outcomes = {}
    units.set_cpus([_target("b", "0-1")])
    assert client.sent[-1] == client.released[-1] == ["cri-containerd-b.scope"]
    assert len(client.released) == 2


A, B, C = (f"cri-containerd-{c}.scope" for c in "abc")


def _calls_for(client: ScriptedClient, unit: str) -> list[str]:
    """The cpusets asked of systemd for ``unit``, in order ("": a release)."""
    return [cpus for u, cpus in client.calls if u == unit]


def test_pending_units_are_not_the_runtimes_and_are_handed_over_once_answered(tmp_path) -> None:
    units, client = _units(_scopes(tmp_path, "ab"))
    client.outcomes = {A: su.PENDING, B: su.PENDING}
    assert units.set_cpus([_target("a"), _target("b")]) == []  # pending: systemd's to apply
    assert client.released == [[A, B]]  # released behind the sets: systemd applies in order
    client.outcomes = {}
    client.answer_late()
    units.set_cpus([_target("a", "0-2"), _target("b", "0-2")])  # answered: both bare
    assert client.sent == [[A, B]] and units.take_refused() == []


def test_a_pending_release_leaves_the_unit_systemds_until_it_is_answered(tmp_path) -> None:
    """Finding 1 of issue 40: a unit is bare only once systemd confirmed its release; until
    then every change to it is asked of systemd too."""
    units, client = _units(_scopes(tmp_path, "a"))
    client.release_outcomes = {A: su.PENDING}
    assert units.set_cpus([_target("a", "0-3")]) == []
    assert units.set_cpus([_target("a", "0-2")]) == []  # its release unanswered: asked again
    assert _calls_for(client, A) == ["0-3", "", "0-2", ""]
    client.release_outcomes = {}
    client.answer_late()
    units.set_cpus([_target("a", "0-1")])  # both releases confirmed: bare now
    assert _calls_for(client, A) == ["0-3", "", "0-2", ""]


def test_calls_lost_with_the_connection_are_sent_again_at_once_with_the_current_cpuset(
    tmp_path,
) -> None:
    """Findings 1, 2 and 5 of issue 40: systemd re-executes with a unit's set and release
    unread, and the pool changed twice since they were sent.  The loss is found at the next
    batch (a broken pipe): the connection is opened again and the unit is sent its cpuset of
    now, then released, in that batch; nothing is left to the runtime."""
    records: list[dict] = []
    units, client = _units(_scopes(tmp_path, "abc"), records)
    client.outcomes = {A: su.PENDING}
    client.release_outcomes = {A: su.PENDING}
    units.set_cpus([_target("a", "0-3")])
    units.set_cpus([_target("a", "0-2")])
    client.outcomes = client.release_outcomes = {}
    units.set_cpus([_target("b", "0-1")])  # a's calls still unanswered: not asked, not lost
    client.closes = 1  # daemon-reexec: the connection closed, its unread calls gone
    assert units.set_cpus([_target("c", "0-1")]) == []
    assert _calls_for(client, A) == ["0-3", "", "0-2", "", "0-2", ""]
    assert _calls_for(client, C) == ["0-1", ""]
    units.set_cpus([_target("a", "1"), _target("c", "1")])  # both handed over: bare
    assert _calls_for(client, A)[-1] == "" and _calls_for(client, C) == ["0-1", ""]
    assert units.take_refused() == []
    assert [r["REASON"] for r in records] == []  # a re-exec that was got over is no failure


def test_a_lost_release_is_sent_again_even_with_no_further_change(tmp_path) -> None:
    """Finding 2 of issue 40: the last change a unit gets leaves its release pending, and the
    connection is lost.  The follow-up (``finish``, on a timer) reads the loss and finishes
    the hand-over; no change to any container is needed."""
    units, client = _units(_scopes(tmp_path, "a"))
    woken: list[float] = []
    units.wake = lambda delay: woken.append(delay) or True
    client.release_outcomes = {A: su.PENDING}
    units.set_cpus([_target("a", "0-3")])
    assert len(woken) == 1  # something is left to finish: a follow-up is due
    client.release_outcomes = {}
    client.late = [su.UnitResult(A, su.UNREACHABLE, SystemdError("closed", "closed"))]
    client.pending = []
    assert units.finish() == []
    assert _calls_for(client, A) == ["0-3", "", "0-3", ""] and client.collected == 1
    assert len(woken) == 1  # handed over: nothing more to follow up


def test_the_follow_up_backs_off_and_ends(tmp_path) -> None:
    """Finding 5 of issue 40: a systemd that stays unreachable after a re-exec is tried again
    off the request path, ever less often (bounded), until it answers."""
    units, client = _units(_scopes(tmp_path, "a"))
    woken: list[float] = []
    units.wake = lambda delay: woken.append(delay) or True
    client.closes = 100
    assert units.set_cpus([_target("a")]) == ["a"]  # the runtime's meanwhile, as before
    for _ in range(10):
        units.finish()
    assert woken == sorted(woken) and woken[0] <= 0.5 and woken[-1] <= 10
    assert len(woken) == 11
    client.closes = 0
    units.finish()
    assert _calls_for(client, A)[-2:] == ["0-3", ""] and len(woken) == 11


def test_a_late_refusal_makes_the_unit_asked_again_by_the_change_that_reads_it(tmp_path) -> None:
    """Finding 3 of issue 40: a refusal read by the very batch that changes the unit again is
    not handed to the runtime as carried by that batch while the unit is skipped as bare: the
    unit is asked again, with its new cpuset."""
    records: list[dict] = []
    units, client = _units(_scopes(tmp_path, "ab"), records)
    client.release_outcomes = {A: su.PENDING}
    units.set_cpus([_target("a", "0-3")])
    client.release_outcomes = {}
    client.answer_late(su.DENIED)  # the release refused, late
    assert units.set_cpus([_target("a", "0-2")]) == []
    assert _calls_for(client, A) == ["0-3", "", "0-2", ""]
    assert units.take_refused() == []  # asked again (and taken): nothing for the runtime
    [warning] = [r for r in records if r.get("REASON") == "late-denied"]
    assert "after the daemon had moved on" in warning["MESSAGE"]
    # one that no change reads again is the runtime's, told once; the unit is asked again
    client.outcomes = {B: su.PENDING}
    units.set_cpus([_target("b")])
    client.outcomes = {}
    client.answer_late(su.FAILED)
    units.set_cpus([_target("a", "0-1")])
    assert units.take_refused() == ["b"] and units.take_refused() == []
    units.set_cpus([_target("b", "0-1")])
    assert _calls_for(client, B) == ["0-3", "", "0-1", ""]


def test_a_resent_call_that_fails_again_is_the_runtimes_and_a_late_gone_is_nobodys(
    tmp_path,
) -> None:
    units, client = _units(_scopes(tmp_path, "abc"))
    client.outcomes = {A: su.PENDING, B: su.PENDING}
    assert units.set_cpus([_target("a"), _target("b")]) == []
    client.outcomes = {}
    client.pending = []
    lost = su.UnitResult(A, su.UNREACHABLE, SystemdError("cannot connect", "unreachable"))
    gone = su.UnitResult(B, su.GONE, SystemdError("NoSuchUnit", "gone"))
    client.late = [lost, lost, gone, gone]
    client.outcomes = {A: su.DENIED}
    assert units.set_cpus([_target("c")]) == []  # c was set; a, sent again, was refused
    assert client.sent[-1] == [C, A]
    assert units.take_refused() == ["a"]  # b's container is gone: nothing to apply


def test_unit_files_that_cannot_be_seen_fail_safe_and_say_so(tmp_path) -> None:
    """Finding 4 of issue 40: no systemd unit files where the daemon looks (the host's /run
    not mounted, say): every unit is taken as holding a cpuset (set, then released), never
    as bare, and that is said once."""
    records: list[dict] = []
    units, client = _units(str(tmp_path / "no-host-root"), records)
    assert units.set_cpus([_target("a"), _target("b")]) == []
    assert client.sent == client.released == [[A, B]]
    [warning] = [r for r in records if r.get("REASON") == "unit-files"]
    assert "systemd.unit_root" in warning["MESSAGE"] and "no-host-root" in warning["MESSAGE"]
    units.set_cpus([_target("c")])
    assert len([r for r in records if r.get("REASON") == "unit-files"]) == 1


# --- what systemd holds for a unit (hardware/systemd/unit_config.py) --------------------------


def _write(root: Path, path: str, text: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)


UNIT = "cri-containerd-x.scope"
T = f"run/systemd/transient/{UNIT}"


@pytest.mark.parametrize(
    ("files", "held"),
    [
        ({}, None),  # no unit file: not seen (runc's scopes are transient units, all with one)
        ({"run/systemd/transient/other.scope": ""}, None),
        ({T: "[Scope]\nDelegate=yes\n"}, False),
        ({T: "[Scope]\nAllowedCPUs=0-3\n"}, True),
        (
            {T: "AllowedCPUs=0-3\n", f"{T}.d/50-AllowedCPUs.conf": "AllowedCPUs=\nAllowedCPUs=\n"},
            False,
        ),
        (
            {T: "AllowedCPUs=\n", f"{T}.d/50-AllowedMemoryNodes.conf": "AllowedMemoryNodes=0\n"},
            True,
        ),
        # drop-ins are read in name order, whatever their directory
        ({f"{T}.d/10-a.conf": "AllowedCPUs=1\n", f"{T}.d/90-b.conf": "AllowedCPUs=\n"}, False),
        # of two drop-ins of one name, the one of the directory first in precedence counts
        (
            {
                f"{T}.d/50-AllowedCPUs.conf": "AllowedCPUs=2\n",
                f"run/systemd/system.control/{UNIT}.d/50-AllowedCPUs.conf": "AllowedCPUs=\n",
            },
            False,
        ),
        ({f"etc/systemd/system.control/{UNIT}.d/50-AllowedCPUs.conf": "AllowedCPUs=4"}, True),
        ({f"{T}.d": "not a directory"}, None),  # unreadable: the caller assumes held
    ],
)
def test_what_systemd_holds_for_a_unit(tmp_path, files, held) -> None:
    for path, text in files.items():
        _write(tmp_path, path, text)
    assert holds_cpuset(UNIT, str(tmp_path)) is held


def test_a_release_is_two_empty_masks_and_an_empty_set_alone_is_refused() -> None:
    assert su.masks(CPUSet(), CPUSet()) == (b"", b"")
    assert su.masks(CPUSet.parse("0-3"), None) == (b"\x0f", None)
    with pytest.raises(SystemdError):
        su.masks(CPUSet(), None)


# --- the hand-over policy (hardware/systemd/handover.py) ------------------------------------------


class _Recorder:
    """A client that answers each unit's set as ``outcomes`` says (SET when unnamed)."""

    def __init__(self, outcomes: dict[str, str]) -> None:
        self.outcomes = outcomes
        self.batches: list[list[tuple]] = []

    def set_allowed(self, changes, timeout):
        self.batches.append(list(changes))
        return [su.UnitResult(c[0], self.outcomes.get(c[0], su.SET)) for c in changes]


def test_a_hand_over_releases_what_systemd_set_or_will_set_and_nothing_else() -> None:
    client = _Recorder({"b.scope": su.PENDING, "c.scope": su.DENIED, "d.scope": su.GONE})
    changes = [(f"{u}.scope", CPUSet.parse("2-3"), None) for u in "abcd"]
    results = handover.hand_over(client, changes, handover.TIMEOUT)
    assert [r.outcome for r in results] == [su.SET, su.PENDING, su.DENIED, su.GONE]
    sets, released = client.batches
    assert sets == changes
    assert released == [("a.scope", CPUSet(), CPUSet()), ("b.scope", CPUSet(), CPUSet())]


def test_only_a_unit_whose_configuration_holds_no_cpuset_is_not_asked(tmp_path) -> None:
    transient = tmp_path / "run" / "systemd" / "transient"
    (transient / "held.scope.d").mkdir(parents=True)
    (transient / "held.scope").write_text("[Scope]\nAllowedCPUs=0-3\n")
    (transient / "bare.scope").write_text("[Scope]\nAllowedCPUs=0-3\n")
    (transient / "bare.scope.d").mkdir()
    (transient / "bare.scope.d" / "50-AllowedCPUs.conf").write_text("[Scope]\nAllowedCPUs=\n")
    assert handover.asks_systemd("held.scope", str(tmp_path))
    assert not handover.asks_systemd("bare.scope", str(tmp_path))
    assert handover.asks_systemd("unseen.scope", str(tmp_path))  # no file: taken as held
