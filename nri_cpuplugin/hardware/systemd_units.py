"""A container's cpuset as systemd keeps it: ``AllowedCPUs``/``AllowedMemoryNodes`` of its scope.

With the systemd cgroup driver a container's cgroup is a transient systemd unit
(``cri-containerd-<id>.scope``), and systemd writes the unit's cpuset properties back into
the cgroup whenever it re-applies them (``daemon-reload``, ``daemon-reexec``, a
``set-property`` of the unit): a cpuset written only to cgroupfs is lost then.  So every cpuset
change to such a container is also made on the unit, as runc does: one
``org.freedesktop.systemd1.Manager.SetUnitProperties(name, runtime=true, [AllowedCPUs,
AllowedMemoryNodes])`` call per unit (docs/cgroups-and-hooks.md §21 has the facts and their
sources).  systemd applies it to the cgroup before it answers and keeps it as a drop-in under
``/run/systemd/transient``; the caller still writes the cgroup files as before.

Many units are changed at once (every shared container when an exclusive one starts), so the
calls are pipelined on one connection, at most ``WINDOW`` unanswered at a time, and their
answers collected within one deadline; each unit gets its own ``UnitResult``.  The protocol
is a sans-I/O ``Conversation`` (bytes in, results out) under two thin clients: ``SystemdClient``
(blocking, for the OCI hook and the daemon's worker thread; it imports neither ``socket`` nor
``asyncio``) and ``AsyncSystemdClient`` (asyncio, one connection kept; the daemon does not use
it yet).

Unit names come from the runtime (a container's cgroupsPath) and are checked against systemd's
unit name rules before they go on the bus.
"""

from __future__ import annotations

import os
import time

from ..base.errors import PluginError
from . import dbus_wire as wire
from .dbus_auth import auth_external, auth_reply
from .dbus_unmarshal import MessageReader

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    import _socket
    import asyncio
    from collections.abc import Iterable, Sequence

    _ProtocolBase = asyncio.Protocol  # _Protocol implements it, without asyncio at run time
else:
    _ProtocolBase = object

SYSTEM_BUS = "/run/dbus/system_bus_socket"
# systemd's own socket (PID 1 only, root only, peer to peer: no dbus-daemon in the way, no Hello)
SYSTEMD_PRIVATE = "/run/systemd/private"
SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
# Calls in flight per connection: dbus-daemon refuses a connection's pending method calls past
# max_replies_per_connection (128 by default on the system bus, LimitsExceeded), so stay well
# below it; systemd answers in order anyway, so a deeper pipe gains nothing.
WINDOW = 64
# Replies are a few hundred bytes; a peer announcing a bigger message is not systemd.
MAX_REPLY = 1 << 20
MAX_UNIT_NAME = 255  # systemd's UNIT_NAME_MAX (256) counts the NUL
_UNIT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-_.\\")
MAX_CPU = 1 << 16  # a bitmask byte per 8 CPUs: a bound on what one call can carry

# outcomes of one unit's call
SET = "set"  # systemd applied it (cgroup written, drop-in kept)
GONE = "gone"  # no such unit: the container went away meanwhile
DENIED = "denied"  # systemd or the bus refused us
TIMEOUT = "timeout"  # no answer within the deadline
UNREACHABLE = "unreachable"  # no connection to systemd (socket, authentication, Hello)
FAILED = "failed"  # any other error answer

_GONE_ERRORS = frozenset({"org.freedesktop.systemd1.NoSuchUnit"})
_DENIED_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.AccessDenied",
        "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired",
        "org.freedesktop.DBus.Error.AuthFailed",
    }
)
_ABSENT_ERRORS = frozenset(
    {"org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner"}
)
PERMISSION_HINT = (
    "setting a unit's properties needs uid 0 (or polkit's org.freedesktop.systemd1.manage-units "
    "action), and the system bus's policy lets only root send to org.freedesktop.systemd1 "
    "(/usr/share/dbus-1/system.d/org.freedesktop.systemd1.conf): run nri-cpuplugin as root"
)


class SystemdError(PluginError):
    """A unit name that cannot be used, or systemd that could not be reached or refused."""

    code = "systemd"


# --- unit names and masks -------------------------------------------------------------------


def check_unit_name(name: str) -> str:
    """``name`` if systemd accepts it as a plain scope or slice name, else SystemdError.

    systemd's rules (src/basic/unit-name.c, ``unit_name_is_valid``): at most 255 characters,
    ASCII letters, digits and ``:-_.\\`` before the type suffix, a non-empty name; ``@``
    (templates) is refused here, as are types other than scopes and slices, which no container
    runtime makes."""
    if not isinstance(name, str):
        raise SystemdError(f"unit name {name!r} is not a string", "unit-name")
    stem, dot, suffix = name.rpartition(".")
    if (
        not 0 < len(name) <= MAX_UNIT_NAME
        or not dot
        or not stem
        or suffix not in ("scope", "slice")
        or not _UNIT_CHARS.issuperset(stem)
    ):
        raise SystemdError(
            f"{name[:300]!r} is not a systemd scope or slice name (at most 255 characters of "
            "A-Z a-z 0-9 : - _ . \\ ending in .scope or .slice)",
            "unit-name",
        )
    return name


def unit_name(cgroups_path: str) -> str | None:
    """The systemd unit of a container whose OCI ``linux.cgroupsPath`` is ``cgroups_path``, or
    None when the path is not in the systemd driver's ``slice:prefix:name`` notation (the
    cgroupfs driver's absolute paths).

    As runc derives it (libcontainer/specconv ``CreateCgroupConfig``, cgroups/systemd
    ``getUnitName``): ``<prefix>-<name>.scope``, or ``name`` itself when it ends in ``.slice``
    (the prefix is then unused).  A name already ending in ``.scope`` gets ``.scope`` appended
    all the same, as runc does."""
    if not cgroups_path or cgroups_path.startswith("/") or ":" not in cgroups_path:
        return None
    parts = cgroups_path.split(":")
    if len(parts) != 3:
        raise SystemdError(
            f"cgroupsPath {cgroups_path[:300]!r} is neither an absolute path nor slice:prefix:name",
            "unit-name",
        )
    _slice, prefix, name = parts
    if name.endswith(".slice"):
        return check_unit_name(name)
    return check_unit_name(f"{prefix}-{name}.scope")


def cpu_mask(cpus: Iterable[int]) -> bytes:
    """``cpus`` as systemd's ``ay`` bitmask: CPU ``n`` is bit ``n % 8`` (least significant
    first) of byte ``n // 8``, as few bytes as the highest CPU needs.  (runc's ``RangeToBits``;
    systemd's ``cpu_set_from_dbus`` reads it back the same way.)  An empty set is refused:
    systemd takes it as "no restriction" and leaves the old ``cpuset.cpus`` in place."""
    ids = cpus if isinstance(cpus, (set, frozenset)) else set(cpus)
    if not ids:
        raise SystemdError("an empty CPU set would lift the unit's restriction", "cpu-mask")
    try:
        low, high = min(ids), max(ids)
        if not (isinstance(low, int) and isinstance(high, int) and low >= 0 and high < MAX_CPU):
            raise TypeError
        bits = 0
        for cpu in ids:  # (a large int as the bit array: one shift and or per CPU)
            bits |= 1 << cpu
    except (TypeError, ValueError):
        raise SystemdError(
            f"{sorted(map(repr, ids))[:8]} are not CPU or memory node numbers (0 to {MAX_CPU - 1})",
            "cpu-mask",
        ) from None
    return bits.to_bytes(high // 8 + 1, "little")


def set_allowed_call(serial: int, unit: str, cpus: bytes, mems: bytes | None) -> bytes:
    """The SetUnitProperties call runc makes for a cpuset: runtime (not persistent) properties,
    AllowedCPUs and, when given, AllowedMemoryNodes, each an ``ay`` bitmask (``cpu_mask``) in a
    variant.  ``unit`` must have passed ``check_unit_name``."""
    properties = [("AllowedCPUs", wire.Variant("ay", cpus))]
    if mems is not None:
        properties.append(("AllowedMemoryNodes", wire.Variant("ay", mems)))
    return wire.method_call(
        serial,
        SYSTEMD,
        MANAGER_PATH,
        MANAGER,
        "SetUnitProperties",
        "sba(sv)",
        (unit, True, properties),
    )


def bus_path(setting: str) -> str | None:
    """The socket to reach systemd on for ``[systemd] bus``: "auto" (systemd's own private
    socket when systemd is PID 1 and we are root - no bus daemon in between - else the system
    bus, if there is one), "off", or a path.  None: nothing is changed through systemd."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    if os.geteuid() == 0 and os.path.exists(SYSTEMD_PRIVATE):
        return SYSTEMD_PRIVATE
    return SYSTEM_BUS if os.path.exists(SYSTEM_BUS) else None


# --- results --------------------------------------------------------------------------------


class UnitResult:
    """What became of one unit's call: ``outcome`` (SET, GONE, DENIED, TIMEOUT, UNREACHABLE,
    FAILED) and, unless it was set, ``error`` saying what went wrong and what to do."""

    __slots__ = ("error", "outcome", "unit")

    def __init__(self, unit: str, outcome: str, error: SystemdError | None = None) -> None:
        self.unit = unit
        self.outcome = outcome
        self.error = error

    @property
    def ok(self) -> bool:
        """Nothing to do for the caller: set, or the unit is gone (a container removed while
        its cpuset changed is no error)."""
        return self.outcome in (SET, GONE)

    def __repr__(self) -> str:
        return f"UnitResult({self.unit!r}, {self.outcome!r}, {self.error!s})"


def classify(unit: str, reply: wire.Message) -> UnitResult:
    """A unit's result from systemd's (or the bus's) answer to its call."""
    if reply.type == wire.METHOD_RETURN:
        return UnitResult(unit, SET)
    name = reply.error_name or ""
    text = reply.error_text()
    said = f"{name}: {text}" if text else name
    if name in _GONE_ERRORS:
        return UnitResult(unit, GONE, SystemdError(f"{unit}: no such unit ({said})", "gone"))
    if name in _DENIED_ERRORS:
        message = f"systemd refused to set AllowedCPUs of {unit} ({said}): {PERMISSION_HINT}"
        return UnitResult(unit, DENIED, SystemdError(message, "denied"))
    if name in _ABSENT_ERRORS:
        message = (
            f"cannot set AllowedCPUs of {unit}: nothing owns {SYSTEMD} on this bus ({said}); "
            "systemd is not the init system here, so the systemd cgroup driver cannot be in use"
        )
        return UnitResult(unit, UNREACHABLE, SystemdError(message, "unreachable"))
    if name in (
        "org.freedesktop.DBus.Error.PropertyReadOnly",
        "org.freedesktop.DBus.Error.UnknownMethod",
    ):
        message = (
            f"systemd cannot set AllowedCPUs of {unit} ({said}): AllowedCPUs and "
            "AllowedMemoryNodes need systemd 244 or later"
        )
        return UnitResult(unit, FAILED, SystemdError(message, "unsupported"))
    return UnitResult(unit, FAILED, SystemdError(f"setting AllowedCPUs of {unit}: {said}"))


# --- the conversation, sans I/O -------------------------------------------------------------


class Batch:
    """One ``set_allowed`` request: its calls (built, not yet sent), and a result per unit as
    the answers come.  ``done`` once every unit has one."""

    __slots__ = ("calls", "results", "waiting", "waker")

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, bytes | None]] = []  # (unit, masks) not yet sent
        self.waiting: dict[int, str] = {}  # serial -> unit, sent and unanswered
        self.results: dict[str, UnitResult] = {}
        self.waker: asyncio.Future[None] | None = None  # the async client's future

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
        "name",
        "pending",
        "reader",
        "serials",
        "uid",
    )

    def __init__(self, *, hello: bool, uid: int | None = None) -> None:
        self.hello = hello
        self.uid = os.geteuid() if uid is None else uid
        self.serials = wire.Serials()
        self.reader = MessageReader(MAX_REPLY)
        self.authenticated = False
        self.name: str | None = None  # our unique name on the bus, once Hello is answered
        self.in_flight: dict[int, Batch] = {}  # serial -> batch
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
            data += wire.method_call(
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
                call = (
                    check_unit_name(unit),
                    cpu_mask(cpus),
                    None if mems is None else cpu_mask(mems),
                )
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
        while self.batches and len(self.in_flight) < WINDOW:
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

    def _answer(self, message: wire.Message) -> None:
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
        if unit is not None:
            batch.results[unit] = classify(unit, message)

    def abandon(self, batch: Batch, outcome: str, error: SystemdError) -> None:
        """Give up on ``batch`` (its deadline passed): its unanswered units get ``outcome``;
        its calls already sent stay counted until answered, so the window stays honest."""
        if batch in self.batches:
            self.batches.remove(batch)
        for serial in batch.waiting:
            self.in_flight[serial] = _ABANDONED
        batch.settle(outcome, error)

    def fail(self, outcome: str, error: SystemdError) -> None:
        """The connection is unusable: every batch not yet answered gets ``outcome``."""
        self.error = error
        self.closed = True
        for batch in {*self.in_flight.values(), *self.batches}:
            batch.settle(outcome, error)  # (the markers _HELLO and _ABANDONED have no units)
        self.in_flight.clear()
        self.batches.clear()


_HELLO = Batch()  # in_flight marker of the Hello call
_ABANDONED = Batch()  # in_flight marker of calls whose batch gave up (answers dropped)


def _key(unit: object) -> str:
    return unit if isinstance(unit, str) else repr(unit)


def _order(batch: Batch, changes: Sequence[tuple]) -> list[UnitResult]:
    return [batch.results[_key(unit)] for unit, *_ in changes]


def _connect_error(path: str, error: OSError) -> SystemdError:
    if isinstance(error, FileNotFoundError):
        owner = "dbus" if path == SYSTEM_BUS else "systemd (as PID 1)"
        what = f"no socket at {path}: is {owner} running?"
    elif isinstance(error, PermissionError):
        what = f"{path} is not open to this user: {PERMISSION_HINT}"
    elif isinstance(error, ConnectionRefusedError):
        what = f"nothing listens on {path}"
    elif isinstance(error, TimeoutError):
        what = f"connecting to {path} took too long"
    else:
        what = f"{path}: {error}"
    return SystemdError(f"cannot reach systemd's D-Bus API: {what}", "unreachable")


def _timeout_error(timeout: float) -> SystemdError:
    return SystemdError(
        f"systemd did not answer SetUnitProperties within {timeout:g} s (it may be busy with "
        "a daemon-reload, or hung); the cgroup files were still written",
        "timeout",
    )


# --- blocking client ------------------------------------------------------------------------


class SystemdClient:
    """A blocking connection to systemd for callers that may wait: the OCI hook, the daemon's
    worker thread.  It uses the C core of the socket module only (importing ``socket`` costs
    the hook more than this whole client).  Not thread-safe: one user at a time."""

    __slots__ = ("conversation", "hello", "path", "sock")

    def __init__(self, path: str = SYSTEM_BUS, *, hello: bool | None = None) -> None:
        self.path = path
        self.hello = path != SYSTEMD_PRIVATE if hello is None else hello
        self.sock: _socket.socket | None = None
        self.conversation: Conversation | None = None

    def set_allowed(
        self, changes: Sequence[tuple[str, Iterable[int], Iterable[int] | None]], timeout: float
    ) -> list[UnitResult]:
        """Set AllowedCPUs (and AllowedMemoryNodes where given) of each ``(unit, cpus, mems)``,
        all calls pipelined, every answer awaited until ``timeout`` seconds from now; a result
        per change, in order.  Never raises for systemd's answers or a lost connection."""
        deadline = time.monotonic() + timeout
        conversation = self.conversation
        if conversation is None or conversation.closed:
            conversation = self._connect(deadline)
        batch = conversation.submit(changes)
        sock = self.sock
        try:
            while not batch.done:
                # units wait only on an open conversation, and _connect opened its socket
                assert sock is not None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    conversation.abandon(batch, TIMEOUT, _timeout_error(timeout))
                    break
                sock.settimeout(remaining)  # bounds the send too: a peer that stops reading
                out = conversation.outgoing()
                if out:
                    sock.sendall(out)
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue  # the loop's deadline check settles the batch
                if not data:
                    conversation.fail(
                        UNREACHABLE, SystemdError("systemd's D-Bus connection closed", "closed")
                    )
                    break
                conversation.feed(data)
        except OSError as e:
            error = SystemdError(f"systemd's D-Bus connection at {self.path} failed: {e}", "closed")
            conversation.fail(UNREACHABLE, error)
        if conversation.closed:
            self.close()
        return _order(batch, changes)

    def connect(self, timeout: float) -> SystemdError | None:
        """Open the connection and wait for the end of its handshake (authentication, Hello),
        so that later calls pay none of it: for a caller that can connect ahead of time, as
        the daemon at start-up.  None, or why systemd cannot be reached (``set_allowed``
        reconnects by itself in any case)."""
        deadline = time.monotonic() + timeout
        conversation = self.conversation
        if conversation is None or conversation.closed:
            conversation = self._connect(deadline)
        sock = self.sock
        try:
            while not conversation.closed and not conversation.ready:
                assert sock is not None  # an open conversation: _connect opened its socket
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return SystemdError(
                        f"no answer to the D-Bus handshake on {self.path} within {timeout:g} s",
                        "timeout",
                    )
                sock.settimeout(remaining)
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    closed = SystemdError(f"{self.path} closed the connection", "closed")
                    conversation.fail(UNREACHABLE, closed)
                    break
                conversation.feed(data)
        except OSError as e:
            conversation.fail(UNREACHABLE, _connect_error(self.path, e))
        if conversation.closed:
            self.close()
            return conversation.error
        return None

    def _connect(self, deadline: float) -> Conversation:
        """A new conversation, its socket connected and the greeting sent; or failed (closed,
        no socket) when the socket cannot be reached."""
        import _socket  # (the C core: see the class docstring)

        self.close()
        self.conversation = conversation = Conversation(hello=self.hello)
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(self.path)
            sock.sendall(conversation.greeting())
        except OSError as e:
            sock.close()
            conversation.fail(UNREACHABLE, _connect_error(self.path, e))
            return conversation
        self.sock = sock
        return conversation

    def close(self) -> None:
        """Drop the connection (the next ``set_allowed`` opens a new one)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.conversation = None

    def __enter__(self) -> SystemdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- asyncio client -------------------------------------------------------------------------


class AsyncSystemdClient:
    """One connection to systemd kept for the daemon's life, used from its event loop: calls
    from several ``set_allowed`` awaits share it (pipelined, in order: systemd handles a
    connection's calls one after the other, so the last cpuset sent for a unit is the one it
    keeps).  A timed-out batch leaves the connection open for that reason: reconnecting would
    let a late call on the old connection overtake a newer one.  It reconnects only once the
    connection is lost."""

    __slots__ = ("conversation", "handshake", "hello", "path", "transport", "waiting")

    def __init__(self, path: str = SYSTEM_BUS, *, hello: bool | None = None) -> None:
        self.path = path
        self.hello = path != SYSTEMD_PRIVATE if hello is None else hello
        self.conversation: Conversation | None = None
        self.transport: asyncio.Transport | None = None
        self.waiting: set[Batch] = set()  # batches awaited, not yet done (each with a waker)
        # connect()'s future, until the handshake is over
        self.handshake: asyncio.Future[None] | None = None

    async def set_allowed(
        self, changes: Sequence[tuple[str, Iterable[int], Iterable[int] | None]], timeout: float
    ) -> list[UnitResult]:
        """As ``SystemdClient.set_allowed``, without blocking the event loop."""
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conversation = self.conversation
        if conversation is None or conversation.closed:
            conversation = await self._connect(deadline)
        batch = conversation.submit(changes)
        if not batch.done:
            batch.waker = waker = loop.create_future()
            self.waiting.add(batch)
            self._flush()
            try:
                async with asyncio.timeout_at(deadline):
                    await waker
            except TimeoutError:
                conversation.abandon(batch, TIMEOUT, _timeout_error(timeout))
            finally:
                self.waiting.discard(batch)
        return _order(batch, changes)

    async def connect(self, timeout: float) -> SystemdError | None:
        """As ``SystemdClient.connect``: the handshake done ahead of the first calls."""
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conversation = self.conversation
        if conversation is None or conversation.closed:
            conversation = await self._connect(deadline)
        try:
            if not conversation.closed and not conversation.ready:
                self.handshake = handshake = loop.create_future()
                async with asyncio.timeout_at(deadline):
                    await handshake
        except TimeoutError:
            return SystemdError(
                f"no answer to the D-Bus handshake on {self.path} within {timeout:g} s", "timeout"
            )
        return conversation.error if conversation.closed else None

    async def _connect(self, deadline: float) -> Conversation:
        """As ``SystemdClient._connect``: a new conversation, connected and greeted, or failed."""
        import asyncio

        loop = asyncio.get_running_loop()
        self.close()
        self.conversation = conversation = Conversation(hello=self.hello)
        try:
            async with asyncio.timeout_at(deadline):
                transport, _ = await loop.create_unix_connection(lambda: _Protocol(self), self.path)
        except OSError as e:  # (the deadline's TimeoutError is an OSError too)
            conversation.fail(UNREACHABLE, _connect_error(self.path, e))
            return conversation
        self.transport = transport
        transport.write(conversation.greeting())
        return conversation

    def _flush(self) -> None:
        if self.transport is not None and self.conversation is not None:
            out = self.conversation.outgoing()
            if out:
                self.transport.write(out)

    def _received(self, data: bytes) -> None:
        conversation = self.conversation
        if conversation is None:
            return
        conversation.feed(data)
        self._flush()
        self._wake()
        if conversation.closed:
            self.close()

    def _lost(self, exc: Exception | None) -> None:
        if self.conversation is not None and not self.conversation.closed:
            reason = f": {exc}" if exc else ""
            self.conversation.fail(
                UNREACHABLE, SystemdError(f"systemd's D-Bus connection closed{reason}", "closed")
            )
            self._wake()
        self.transport = None

    def _wake(self) -> None:
        conversation = self.conversation
        handshake = self.handshake
        over = conversation is None or conversation.closed or conversation.ready
        if over and handshake is not None and not handshake.done():
            handshake.set_result(None)
        for batch in self.waiting:
            waker = batch.waker
            assert waker is not None  # set_allowed sets it before the batch waits
            if batch.done and not waker.done():
                waker.set_result(None)

    def close(self) -> None:
        """Drop the connection: batches still waiting are answered UNREACHABLE at once."""
        conversation, self.conversation = self.conversation, None
        if conversation is not None and not conversation.closed:
            conversation.fail(UNREACHABLE, SystemdError("the D-Bus client was closed", "closed"))
            self._wake()
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class _Protocol(_ProtocolBase):
    """asyncio's protocol interface for AsyncSystemdClient (duck-typed: no asyncio import at
    module level, so the hook, which imports this module, never loads asyncio; type checkers
    see it derive from asyncio.Protocol)."""

    __slots__ = ("client",)

    def __init__(self, client: AsyncSystemdClient) -> None:
        self.client = client

    def connection_made(self, transport: object) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.client._received(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost(exc)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass
