"""A blocking client of systemd's D-Bus API: a ``Conversation`` (conversation.py) over a
unix socket, for callers that may wait - the OCI hook, the daemon's worker thread.

It uses the C core of the socket module only, and imports neither ``socket`` nor ``asyncio``:
importing ``socket`` costs the hook more than this whole client.
"""

from __future__ import annotations

import time

from .conversation import Conversation, in_order
from .units import (
    SYSTEM_BUS,
    SYSTEMD_PRIVATE,
    TIMEOUT,
    UNREACHABLE,
    SystemdError,
    UnitResult,
    connect_error,
    timeout_error,
)

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    import _socket
    from collections.abc import Callable, Iterable, Sequence


class SystemdClient:
    """A blocking connection to systemd, opened by the first call that needs it and kept until
    ``close``.  Not thread-safe: one user at a time."""

    __slots__ = ("conversation", "hello", "late", "path", "sock")

    def __init__(self, path: str = SYSTEM_BUS, *, hello: bool | None = None) -> None:
        self.path = path
        self.hello = path != SYSTEMD_PRIVATE if hello is None else hello
        self.sock: _socket.socket | None = None
        self.conversation: Conversation | None = None
        self.late: list[UnitResult] = []

    def set_allowed(
        self, changes: Sequence[tuple[str, Iterable[int], Iterable[int] | None]], timeout: float
    ) -> list[UnitResult]:
        """Set AllowedCPUs (and AllowedMemoryNodes where given) of each ``(unit, cpus, mems)``,
        all calls pipelined, every answer awaited until ``timeout`` seconds from now; a result
        per change, in order (PENDING: sent, systemd not done with it by then - see
        ``take_late``).  Never raises for systemd's answers or a lost connection."""
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
                    if conversation.ready:  # systemd will get to what was sent
                        conversation.leave_pending(batch, timeout_error(timeout))
                    else:
                        conversation.abandon(batch, TIMEOUT, timeout_error(timeout))
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
        self.late += conversation.take_late()
        if conversation.closed:
            self.close()
        return in_order(batch, changes)

    def take_late(self) -> list[UnitResult]:
        """What became of calls left PENDING by earlier ``set_allowed``s, as far as known (their
        answers are read while later calls wait for theirs, or by ``collect``): one result per
        call, in the order they came; each told once."""
        late, self.late = self.late, []
        return late

    def collect(self, timeout: float) -> None:
        """Read the answers to pending calls for at most ``timeout`` seconds, until none is
        left (``take_late`` gives them): for a caller with nothing new to send that must learn
        whether what it sent was applied - or lost with the connection."""
        conversation = self.conversation
        if conversation is None or conversation.closed or not conversation.late.waiting:
            return
        self._read(conversation, time.monotonic() + timeout, lambda: not conversation.late.waiting)
        self.late += conversation.take_late()
        if conversation.error is not None:  # (failed: closed)
            self.close()

    def _read(self, conversation: Conversation, deadline: float, done: Callable[[], bool]) -> None:
        """Receive into ``conversation`` until ``done()`` or the deadline; a closed or failing
        connection fails it."""
        sock = self.sock
        try:
            while not done() and not conversation.closed:
                assert sock is not None  # an open conversation: _connect opened its socket
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                sock.settimeout(remaining)
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    closed = SystemdError("systemd's D-Bus connection closed", "closed")
                    conversation.fail(UNREACHABLE, closed)
                    return
                conversation.feed(data)
        except OSError as e:
            error = SystemdError(f"systemd's D-Bus connection at {self.path} failed: {e}", "closed")
            conversation.fail(UNREACHABLE, error)

    def connect(self, timeout: float) -> SystemdError | None:
        """Open the connection and wait for the end of its handshake (authentication, Hello),
        so that later calls pay none of it: for a caller that can connect ahead of time, as
        the daemon at start-up.  None, or why systemd cannot be reached (``set_allowed``
        reconnects by itself in any case)."""
        deadline = time.monotonic() + timeout
        conversation = self.conversation
        if conversation is None or conversation.closed:
            conversation = self._connect(deadline)
        self._read(conversation, deadline, lambda: conversation.ready)
        if conversation.closed:
            self.close()
            return conversation.error
        if not conversation.ready:
            return SystemdError(
                f"no answer to the D-Bus handshake on {self.path} within {timeout:g} s",
                "timeout",
            )
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
            conversation.fail(UNREACHABLE, connect_error(self.path, e))
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
