"""One connection to systemd as a sans-I/O state machine: the handshake, the SetUnitProperties
calls of many units pipelined, and each answer turned into that unit's result.

Many units are changed at once (every shared container when an exclusive one starts), so the
calls are pipelined on one connection (on the system bus at most ``WINDOW`` unanswered at a
time) and their answers collected within one deadline; each unit gets its own ``UnitResult``.
A call sent on a working connection but unanswered at the deadline is *pending*, not failed:
systemd works through a connection's calls in order and will apply it; its answer, when it
comes, lands in ``late``, one per call in the order they came (a failure there is the
caller's to act on; a connection that breaks answers each call still pending UNREACHABLE).
Bytes go in and out and results land in batches: the client (client.py) only moves
the bytes and keeps the deadline.
"""

from __future__ import annotations

import os

from . import wire
from .auth import auth_external, auth_reply
from .message import Message, Serials, method_call
from .units import (
    FAILED,
    PENDING,
    TIMEOUT,
    UNREACHABLE,
    SystemdError,
    UnitResult,
    check_unit_name,
    classify,
    masks,
    set_allowed_call,
)
from .unmarshal import MessageReader

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

# Calls in flight per connection on the system bus: dbus-daemon refuses a connection's pending
# method calls past max_replies_per_connection (128 by default, LimitsExceeded), so stay well
# below it.  systemd's private socket has no bus daemon and no such limit: every call leaves
# at once, so none is left unsent when a slow systemd makes the deadline pass.
WINDOW = 64
# Replies are a few hundred bytes; a peer announcing a bigger message is not systemd.
MAX_REPLY = 1 << 20


class Batch:
    """One ``set_allowed`` request: its calls (built, not yet sent), and a result per unit as
    the answers come.  ``done`` once every unit has one."""

    __slots__ = ("calls", "results", "waiting")

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, bytes | None]] = []  # (unit, masks) not yet sent
        self.waiting: dict[int, str] = {}  # serial -> unit, sent and unanswered
        self.results: dict[str, UnitResult] = {}

    @property
    def done(self) -> bool:
        return not self.calls and not self.waiting

    def settle(self, outcome: str, error: SystemdError) -> None:
        """Give every unit still without an answer ``outcome`` (a timeout, a lost connection)."""
        for unit in [*self.waiting.values(), *(call[0] for call in self.calls)]:
            self.results.setdefault(unit, UnitResult(unit, outcome, error))
        self.calls.clear()
        self.waiting.clear()


class Conversation:
    """One connection to systemd as a state machine: ``greeting()`` and ``outgoing()`` give the
    bytes to send, ``feed()`` takes the bytes received; results land in the batches.

    Everything is pipelined: the SASL exchange, Hello (on the bus; systemd's private socket is
    peer to peer and has none) and the first calls leave in one write, so a fresh connection
    costs one round trip before the first answer."""

    __slots__ = (
        "authenticated",
        "batches",
        "closed",
        "error",
        "hello",
        "in_flight",
        "late",
        "late_answers",
        "name",
        "pending",
        "reader",
        "serials",
        "uid",
    )

    def __init__(self, *, hello: bool, uid: int | None = None) -> None:
        self.hello = hello
        self.uid = os.geteuid() if uid is None else uid
        self.serials = Serials()
        self.reader = MessageReader(MAX_REPLY)
        self.authenticated = False
        self.name: str | None = None  # our unique name on the bus, once Hello is answered
        self.in_flight: dict[int, Batch] = {}  # serial -> batch
        self.late = Batch()  # calls left pending by their batch (their answers: late_answers)
        self.late_answers: list[UnitResult] = []  # one per pending call, in the order they came
        self.batches: list[Batch] = []  # with calls not yet sent, in order
        self.pending = bytearray()  # received, not yet through authentication
        self.error: SystemdError | None = None
        self.closed = False

    @property
    def ready(self) -> bool:
        """The handshake is over: authenticated, and on a bus, Hello answered."""
        return self.authenticated and (not self.hello or self.name is not None)

    def greeting(self) -> bytes:
        data = auth_external(self.uid)
        if self.hello:
            serial = self.serials.next()
            self.in_flight[serial] = _HELLO
            data += method_call(
                serial, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                "Hello",
            )  # fmt: skip
        return data

    def submit(self, changes: Iterable[tuple[str, Iterable[int], Iterable[int] | None]]) -> Batch:
        """A batch for ``changes`` (unit, cpus, mems); a unit whose name or sets cannot be sent
        is answered FAILED at once.  Its calls leave through ``outgoing``."""
        batch = Batch()
        for unit, cpus, mems in changes:
            try:
                call = (check_unit_name(unit), *masks(cpus, mems))
            except SystemdError as e:
                batch.results[_key(unit)] = UnitResult(_key(unit), FAILED, e)
                continue
            batch.calls.append(call)
        batch.calls.reverse()
        if self.error is not None:
            batch.settle(UNREACHABLE, self.error)
        elif batch.calls:
            self.batches.append(batch)
        return batch

    def outgoing(self) -> bytes:
        """The calls that may leave now: at most WINDOW unanswered on the connection."""
        if self.closed:
            return b""
        out = bytearray()
        while self.batches and (not self.hello or len(self.in_flight) < WINDOW):
            batch = self.batches[0]
            unit, cpus, mems = batch.calls.pop()  # (submit stored them reversed: pop is O(1))
            serial = self.serials.next()
            out += set_allowed_call(serial, unit, cpus, mems)
            batch.waiting[serial] = unit
            self.in_flight[serial] = batch
            if not batch.calls:
                self.batches.pop(0)
        return bytes(out)

    def feed(self, data: bytes) -> None:
        """Bytes from the peer.  A malformed stream, a refused authentication or a failed
        Hello ends the conversation: ``fail`` settles every batch with the reason."""
        try:
            if not self.authenticated:
                self.pending += data
                reply = auth_reply(self.pending)
                if reply is None:
                    return
                self.authenticated = True
                data = bytes(self.pending[reply[1] :])
                self.pending.clear()
            self.reader.feed(data)
            for message in self.reader.messages():
                self._answer(message)
        except (wire.DBusWireError, SystemdError) as e:
            self.fail(UNREACHABLE, SystemdError(f"talking to systemd over D-Bus: {e}", "protocol"))

    def _answer(self, message: Message) -> None:
        if message.type not in (wire.METHOD_RETURN, wire.ERROR):
            return  # signals (NameAcquired), calls: nothing we asked for
        serial = message.reply_serial or 0
        batch = self.in_flight.pop(serial, None)
        if batch is None:
            return  # the answer to a call given up on (its batch timed out)
        if batch is _HELLO:
            if message.type == wire.ERROR:
                raise SystemdError(
                    f"the bus refused Hello ({message.error_name}: {message.error_text()})"
                )
            self.name = message.body[0] if message.body else None
            return
        unit = batch.waiting.pop(serial, None)
        if unit is None:
            return
        if batch is self.late:  # (one unit may have several calls pending: each is told)
            self.late_answers.append(classify(unit, message))
        else:
            batch.results[unit] = classify(unit, message)

    def abandon(self, batch: Batch, outcome: str, error: SystemdError) -> None:
        """Give up on ``batch`` (its deadline passed): its unanswered units get ``outcome``;
        its calls already sent stay counted until answered, so the window stays honest."""
        if batch in self.batches:
            self.batches.remove(batch)
        for serial in batch.waiting:
            self.in_flight[serial] = _ABANDONED
        batch.settle(outcome, error)

    def leave_pending(self, batch: Batch, error: SystemdError) -> None:
        """The deadline passed on a working connection: ``batch``'s calls already sent are
        PENDING (their answers go to ``late``), those never sent are TIMEOUT (``error``)."""
        if batch in self.batches:
            self.batches.remove(batch)
        for serial, unit in batch.waiting.items():
            batch.results[unit] = UnitResult(unit, PENDING)
            self.late.waiting[serial] = unit
            self.in_flight[serial] = self.late
        batch.waiting.clear()
        batch.settle(TIMEOUT, error)

    def take_late(self) -> list[UnitResult]:
        """The answers to pending calls that came since the last look, in the order they came
        (a lost connection answers every one still pending with UNREACHABLE)."""
        answers, self.late_answers = self.late_answers, []
        return answers

    def fail(self, outcome: str, error: SystemdError) -> None:
        """The connection is unusable: every batch not yet answered gets ``outcome``."""
        self.error = error
        self.closed = True
        lost = [self.late.waiting[serial] for serial in sorted(self.late.waiting)]
        self.late_answers += [UnitResult(unit, outcome, error) for unit in lost]
        self.late.waiting.clear()
        for batch in {*self.in_flight.values(), *self.batches}:
            batch.settle(outcome, error)  # (the markers _HELLO and _ABANDONED have no units)
        self.in_flight.clear()
        self.batches.clear()


_HELLO = Batch()  # in_flight marker of the Hello call
_ABANDONED = Batch()  # in_flight marker of calls whose batch gave up (answers dropped)


def _key(unit: object) -> str:
    return unit if isinstance(unit, str) else repr(unit)


def in_order(batch: Batch, changes: Sequence[tuple]) -> list[UnitResult]:
    """The batch's results in the order of the ``changes`` it was submitted for."""
    return [batch.results[_key(unit)] for unit, *_ in changes]
