"""The asyncio side of an NRI plugin: the socket, registration, reconnects, and each request
served within the runtime's deadline.

The stub connects a plugin object (any object with some of the event handlers that
plugin_service.py lists) to the runtime: it registers as speaking NRI 0.12 (``NRI_VERSION``),
reads the runtime's requests and hands each to its ``PluginService`` method under a guard - an
answer within ``DEADLINE_SHARE`` of the runtime's deadline, a handler's exception answered as
an error status - and writes the answers.  Whatever ends a connection, the stub reconnects
with backoff (or, launched by the runtime, stops), and tells the plugin (``connection_lost``).
It also carries the plugin's own calls to the runtime (``update_containers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable

from ..base.errors import PluginError
from . import connection as wire
from .errors import ProtocolError
from .pb import nri_pb2 as pb
from .plugin_service import PluginService

log = logging.getLogger("nri_cpuplugin.nri")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_SOCKET = "/var/run/nri/nri.sock"
SOCKET_ENV = "NRI_SOCKET_PATH"  # our own override; NRI defines none for external plugins
# The NRI protocol level this stub speaks, sent in RegisterPlugin (NRI 0.12 logs it; older
# runtimes skip the field): per-event methods, the pod-update events, the version exchange.
NRI_VERSION = "v0.12.0"

# Deadlines and what a miss costs: docs/nri-wire.md §12 (the runtime's own timeouts, until its
# Configure says more: plugin_service.REQUEST_TIMEOUT, REGISTRATION_TIMEOUT).
# Answer within this share of the runtime's deadline: a late answer is worse than an error,
# because the runtime then drops the plugin and creates the container unpinned (fail open).
# The last resort, for handlers that await: a plugin that can answer something better than
# an error keeps a budget of its own below it (the CPU plugin: daemon/deadline.py, 75 %).
DEADLINE_SHARE = 0.9
RECONNECT_MIN, RECONNECT_MAX = 0.05, 1.0
# A daemon that cannot reach its runtime says so at warning level at once and then this often
# (in seconds of retrying), with what to check: otherwise it would wait unseen.
CONNECT_WARNING_EVERY = 60.0

_in_handler: contextvars.ContextVar[bool] = contextvars.ContextVar("_in_handler", default=False)


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """The pause between connection attempts: ``seconds``, or until the stub is stopped (the
    stub's one use of the clock: tests record the pauses instead of waiting them out)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


class RegistrationError(PluginError):
    """The runtime refused or ignored our RegisterPlugin."""

    code = "registration"


class LaunchError(PluginError, ValueError):
    """NRI_PLUGIN_SOCKET does not name the socket a launching runtime passes."""

    code = "launch"


class UpdateError(PluginError):
    """The runtime refused an unsolicited UpdateContainers."""

    code = "update"


class Stub(PluginService):
    """Connects a plugin object to the runtime and serves it until stopped.

    Two modes: *daemon* (connect to ``socket_path``, reconnect with backoff whenever the
    runtime goes away) and *runtime-launched* (the runtime started us from its plugin
    directory and passed a connected socket as fd ``NRI_PLUGIN_SOCKET``; when it closes we
    are done, since a socketpair cannot be reopened).

    ``unimplemented`` names NRI 0.12 per-event methods (``"StartContainer"``, ...) to answer
    with UNIMPLEMENTED although the plugin handles the event: the runtime then delivers that
    event, and every later one on the connection, as StateChange - what an NRI 0.11 plugin
    gets.  For tests of that fallback, and for a plugin that must behave like an older one.
    """

    def __init__(
        self,
        plugin: object,
        name: str,
        index: str,
        socket_path: str | None = None,
        launched_fd: int | None = None,
        observe: Callable[[str, float], None] | None = None,
        unimplemented: Iterable[str] = (),
    ) -> None:
        if not (len(index) == 2 and index.isdigit()):
            raise ValueError(f"plugin index {index!r} must be two digits, 00-99")
        if not name:
            raise ValueError("plugin name must not be empty")
        super().__init__(plugin, unimplemented)
        self.name = name
        self.index = index
        self.socket_path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        self.launched_fd = launched_fd
        self.observe = observe  # (method, seconds) of every request served: for metrics
        self.connected = asyncio.Event()
        self._stopping = asyncio.Event()
        self._conn: wire.Connection | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._write_lock = asyncio.Lock()
        self._pending: dict[int, asyncio.Future[wire.ResponseReceived]] = {}
        self._tasks: set[asyncio.Task] = set()
        # Told (registered, detail) as the registration comes and goes: the runtime's name and
        # version, or why not (daemon/heartbeat.py publishes it for status and the probes).
        self.on_connection: Callable[[bool, str], None] | None = None

    @classmethod
    def from_environment(
        cls,
        plugin: object,
        name: str,
        index: str,
        socket_path: str | None = None,
        observe: Callable[[str, float], None] | None = None,
        unimplemented: Iterable[str] = (),
    ) -> Stub:
        """Runtime-launched when NRI_PLUGIN_SOCKET is set (name and index then come from the
        runtime too); otherwise a daemon on ``socket_path``."""
        fd = os.environ.get("NRI_PLUGIN_SOCKET")
        if fd is None:
            return cls(
                plugin, name, index, socket_path, observe=observe, unimplemented=unimplemented
            )
        _check_launched_fd(fd)
        return cls(
            plugin,
            os.environ.get("NRI_PLUGIN_NAME") or name,
            os.environ.get("NRI_PLUGIN_IDX") or index,
            launched_fd=int(fd),
            observe=observe,
            unimplemented=unimplemented,
        )

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until ``stop()``; in launched mode, until the runtime closes the socket."""
        if self.launched_fd is not None:
            sock = socket.socket(fileno=self.launched_fd)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            await self._serve_connection(reader, writer)
            return
        delay = RECONNECT_MIN
        unwarned = 0.0  # seconds retried since the last warning
        warned = False
        while not self._stopping.is_set():
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as err:
                why = connect_problem(self.socket_path, err)
                self._tell(False, why)
                if not warned or unwarned >= CONNECT_WARNING_EVERY:
                    log.warning("%s Retrying every %gs.", why, RECONNECT_MAX)
                    warned, unwarned = True, 0.0
                else:
                    log.debug("cannot connect to %s: %s", self.socket_path, err)
                await pause(self._stopping, delay)
                unwarned += delay
                delay = min(delay * 2, RECONNECT_MAX)
                continue
            warned = False
            await self._serve_connection(reader, writer)
            # A connection that ended before a Configure went through (a refused
            # subscription, say) backs off rather than retry the same failure 20 times a second.
            delay = RECONNECT_MIN if self._configured else min(delay * 2, RECONNECT_MAX)
            if not self._stopping.is_set():
                await pause(self._stopping, delay)

    def _tell(self, registered: bool, detail: str) -> None:
        if self.on_connection is not None:
            self.on_connection(registered, detail)

    def stop(self) -> None:
        self._stopping.set()
        if self._writer is not None:
            self._writer.close()

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._conn = wire.Connection()
        self._writer = writer
        self._new_connection()
        reading = asyncio.create_task(self._read_loop(reader))
        try:
            await self._register()
            log.info("registered with the runtime as %s-%s", self.index, self.name)
            self.connected.set()
            runtime = f"{self.runtime_name} {self.runtime_version}".strip()
            self._tell(True, runtime or "the runtime")
            await reading
        except (RegistrationError, ProtocolError, ConnectionError, TimeoutError) as err:
            if self._stopping.is_set():  # stop() closed it (SIGTERM): not the runtime's doing
                log.info("NRI connection closed: stopping")
            else:
                log.warning("NRI connection ended: %s", err)
                self._tell(False, f"the NRI connection ended: {err}")
        finally:
            self.connected.clear()
            reading.cancel()
            writer.close()
            self._pending.clear()
            self._conn = self._writer = None
            if not self._stopping.is_set():  # our own shutdown is not a lost connection
                await self._call_plugin("connection_lost")

    async def _register(self) -> None:
        request = pb.RegisterPluginRequest(
            plugin_name=self.name, plugin_idx=self.index, NRI_version=NRI_VERSION
        )
        response = await self._call(
            "RegisterPlugin", request.SerializeToString(), self.registration_timeout
        )
        if response.code != wire.OK:
            raise RegistrationError(f"runtime refused registration: {response.message}")

    # --- reading and writing -----------------------------------------------------------------

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            await self._read_events(reader)
        finally:
            # Whoever waits for an answer (RegisterPlugin, UpdateContainers) learns at once.
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the NRI connection closed"))

    async def _read_events(self, reader: asyncio.StreamReader) -> None:
        assert self._conn is not None
        while True:
            data = await reader.read(1 << 16)
            if not data:
                raise ConnectionError("the runtime closed the NRI socket")
            for event in self._conn.receive_data(data):
                if isinstance(event, wire.RequestReceived):
                    # Served right here, in the reader: the runtime sends one request at a
                    # time, and this task is independent of whoever awaits our own calls
                    # (so Configure is served while RegisterPlugin still waits for its reply).
                    # No task per request: it is the latency every container creation pays.
                    await self._serve_request(event)
                elif isinstance(event, wire.BadRequest):
                    await self._reply(event.stream_id, b"", event.code, event.message)
                else:
                    future = self._pending.pop(event.stream_id, None)
                    if future is not None and not future.done():
                        future.set_result(event)

    async def _write(self, data: bytes) -> None:
        async with self._write_lock:  # one writer: frames of two messages never interleave
            if self._writer is None:
                raise ConnectionError("not connected to the runtime")
            self._writer.write(data)
            await self._writer.drain()

    async def _reply(
        self, stream_id: int, payload: bytes, code: int = 0, message: str = ""
    ) -> None:
        if self._conn is None:
            return
        try:
            await self._write(self._conn.send_response(stream_id, payload, code, message))
        except ConnectionError as err:  # the runtime went away mid-request; nothing to answer
            log.debug("reply to stream %d lost: %s", stream_id, err)

    async def _call(self, method: str, payload: bytes, timeout: float) -> wire.ResponseReceived:
        if self._conn is None:
            raise ConnectionError("not connected to the runtime")
        stream_id, data = self._conn.send_request(
            RUNTIME_SERVICE, method, payload, int(timeout * 1e9)
        )
        future = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        await self._write(data)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(stream_id, None)

    # --- serving -------------------------------------------------------------------------------

    async def _serve_request(self, request: wire.RequestReceived) -> None:
        if request.service != PLUGIN_SERVICE:
            await self._reply(
                request.stream_id, b"", wire.UNIMPLEMENTED, f"service {request.service}"
            )
            return
        handler = self._methods.get(request.method)
        if handler is None:
            # NRI 0.12 then resends the event as StateChange (docs/nri-wire.md §9.5).
            log.debug("answering %s with UNIMPLEMENTED", request.method)
            await self._reply(
                request.stream_id, b"", wire.UNIMPLEMENTED, f"method {request.method}"
            )
            return
        budget = self.request_timeout
        if request.timeout_ns > 0:
            budget = min(budget, request.timeout_ns / 1e9)
        token = _in_handler.set(True)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(budget * DEADLINE_SHARE):
                payload = await handler(request.payload)
        except TimeoutError:
            await self._reply(
                request.stream_id,
                b"",
                wire.DEADLINE_EXCEEDED,
                f"{self.name}: {request.method} did not finish within "
                f"{budget * DEADLINE_SHARE:.2f}s",
            )
        except Exception as err:  # a handler's refusal: fail the operation, stay connected
            log.info("%s failed: %s", request.method, err)
            await self._reply(request.stream_id, b"", wire.UNKNOWN, f"{self.name}: {err}")
        else:
            await self._reply(request.stream_id, payload)
        finally:
            _in_handler.reset(token)
            if self.observe is not None:
                self.observe(request.method, time.perf_counter() - started)
        if request.method == "Shutdown":
            self.stop()

    # --- unsolicited updates -------------------------------------------------------------------

    async def update_containers(
        self, updates: Iterable[pb.ContainerUpdate], timeout: float | None = None
    ) -> list[pb.ContainerUpdate]:
        """Ask the runtime to update containers outside any event; returns the failed ones.

        Refused inside an event handler: the runtime holds its locks for the event we are
        serving, so waiting here would deadlock until the runtime drops us.  Return updates
        from the handler instead, or call ``schedule_update_containers``.

        Outside a handler it is no safer on containerd with an NRI before 0.12.1: served while
        CRI calls enter NRI, it deadlocks the runtime for good (docs/nri-wire.md §11.4).  The
        CPU plugin daemon never calls it; this is the transport's API for runtimes with the
        fix.
        """
        if _in_handler.get():
            raise RuntimeError(
                "update_containers() awaited inside an NRI event handler would deadlock; "
                "return the updates in the handler's reply or use schedule_update_containers()"
            )
        request = pb.UpdateContainersRequest(update=list(updates))
        response = await self._call(
            "UpdateContainers", request.SerializeToString(), timeout or self.request_timeout
        )
        if response.code != wire.OK:
            raise UpdateError(f"runtime refused UpdateContainers: {response.message}")
        return list(pb.UpdateContainersResponse.FromString(response.payload).failed)

    def schedule_update_containers(
        self,
        updates: Iterable[pb.ContainerUpdate],
        done: Callable[[list[pb.ContainerUpdate] | BaseException], None] | None = None,
    ) -> asyncio.Task:
        """Send UpdateContainers in the background, after the current event's reply."""
        updates = list(updates)

        async def send() -> list[pb.ContainerUpdate]:
            await asyncio.sleep(0)  # let the handler's reply go out first
            try:
                failed = await self.update_containers(updates)
            except Exception as err:
                if done is not None:
                    done(err)
                raise
            if done is not None:
                done(failed)
            return failed

        # A fresh context: the task must not inherit the "inside a handler" flag.
        task = asyncio.get_running_loop().create_task(send(), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def connect_problem(path: str, err: OSError) -> str:
    """Why the runtime's NRI socket cannot be reached, and what to check."""
    import errno

    base = f"cannot connect to the runtime's NRI socket {path}: {err.strerror or err}"
    if err.errno == errno.ENOENT:
        hint = (
            "is NRI enabled in the runtime's configuration (containerd: "
            '[plugins."io.containerd.nri.v1.nri"] disable = false, off by default in 1.7; '
            "CRI-O: enable_nri = true), and is this the socket path it uses (nri.socket, "
            "--socket)?"
        )
    elif err.errno in (errno.EACCES, errno.EPERM):
        hint = "run the daemon as root (the socket's directory is root's, mode 0700); SELinux?"
    elif err.errno == errno.ECONNREFUSED:
        hint = "the socket exists but nothing listens: is the runtime running?"
    else:
        hint = "is the runtime running with NRI enabled, and is this its socket path?"
    return f"{base} - {hint}"


def _check_launched_fd(value: str) -> None:
    """NRI_PLUGIN_SOCKET must name an open socket: the runtime sets it when it launches the
    plugin.  Raises LaunchError saying what to do otherwise."""
    import stat

    if not value.isdigit():
        raise LaunchError(
            f"NRI_PLUGIN_SOCKET={value!r} is not a file descriptor number; the runtime sets it "
            "when it launches the plugin: unset it to run as a daemon on the runtime's socket"
        )
    try:
        mode = os.fstat(int(value)).st_mode
    except OSError as err:
        raise LaunchError(
            f"NRI_PLUGIN_SOCKET={value}: no such open file descriptor ({err.strerror}); the "
            "runtime sets it when it launches the plugin: unset it to run as a daemon"
        ) from None
    if not stat.S_ISSOCK(mode):
        raise LaunchError(
            f"NRI_PLUGIN_SOCKET={value}: file descriptor {value} is not a socket; the runtime "
            "sets it when it launches the plugin: unset it to run as a daemon"
        )
