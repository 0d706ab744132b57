"""An asyncio client of systemd's D-Bus API: one connection kept for the daemon's life, a
``Conversation`` (systemd_conversation.py) under asyncio's transport.  The daemon does not use
it yet; the blocking client is systemd_client.py.
"""

from __future__ import annotations

from .systemd_conversation import Batch, Conversation, in_order
from .systemd_units import (
    SYSTEM_BUS,
    SYSTEMD_PRIVATE,
    TIMEOUT,
    UNREACHABLE,
    SystemdError,
    UnitResult,
    connect_error,
    timeout_error,
)

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Iterable, Sequence

    _ProtocolBase = asyncio.Protocol  # _Protocol implements it, without asyncio at run time
else:
    _ProtocolBase = object


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
                conversation.abandon(batch, TIMEOUT, timeout_error(timeout))
            finally:
                self.waiting.discard(batch)
        return in_order(batch, changes)

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
            conversation.fail(UNREACHABLE, connect_error(self.path, e))
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
    """asyncio's protocol interface for AsyncSystemdClient (duck-typed: asyncio is imported only
    once a client runs, not with this module; type checkers see it derive from
    asyncio.Protocol)."""

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
