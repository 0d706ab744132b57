"""The asyncio side of an NRI plugin: socket, registration, dispatch to handler methods.

A plugin is any object with some of these methods (sync or ``async``); the stub subscribes to
exactly the events it has handlers for, in the manner of containerd/nri's Go ``pkg/stub``:

    configure(config, runtime_name, runtime_version)           -> None | names | int mask
    synchronize(pods, containers)                              -> [ContainerUpdate]
    shutdown()                                                 -> None
    create_container(pod, container)                           -> (ContainerAdjustment | None,
                                                                   [ContainerUpdate])
    update_container(pod, container, linux_resources)          -> [ContainerUpdate]
    stop_container(pod, container)                             -> [ContainerUpdate]
    run_pod_sandbox / stop_pod_sandbox / remove_pod_sandbox(pod)                -> None
    post_create_container / start_container / post_start_container /
    post_update_container / remove_container(pod, container)                    -> None
    update_pod_sandbox(pod, overhead, resources)    (NRI >= 0.10)               -> None
    post_update_pod_sandbox(pod)                    (NRI >= 0.10)               -> None
    connection_lost()                                          -> None  (not an NRI event)

Arguments are the generated protobuf messages (``nri_cpuplugin.nri.pb.nri_pb2``).  A handler
that raises makes the stub answer with an error status, which fails the runtime operation
(fail closed) while the plugin stays connected.

Events are delivered however the runtime's NRI version sends them: NRI 0.12's own method per
event, or StateChange before it (and whenever a method is answered UNIMPLEMENTED, see
``unimplemented``).  The stub registers as speaking NRI 0.12 (``NRI_VERSION``) and subscribes
only to events the runtime's NRI knows: the pod-update events need NRI 0.10, which the runtime
says (0.12) or the stub infers from the runtime's name and release (``handlers.runtime_nri``);
``runtime_nri`` holds the result once Configure has arrived.

``configure`` may narrow the subscription for this connection, as the Go stub's Configure
handler can: return None (or the int 0, as in Go) to keep every handler's event, or the event
handler names (``["create_container", "remove_container"]``) or an int mask (bit
``1 << (event - 1)``) to subscribe to those only.  Asking for an event the plugin has no
handler for is an error, answered to the runtime, which then drops the connection.

The plugin object is checked when the Stub is built: a public callable whose name looks like a
handler but is none the stub calls (``create_containers``, ``stop_pod``, ``on_start``,
``Synchronize``) is a ValueError naming the closest handler, and a handler name bound to
something not callable is a TypeError - either would otherwise be a subscription that silently
never fires.  Helpers that must have such names take a leading underscore.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..base.errors import PluginError
from . import connection as wire
from .errors import ProtocolError
from .handlers import (
    EVENT_BITS,
    EVENT_HANDLERS,
    PER_EVENT_METHODS,
    POD_EVENTS,
    NRIVersion,
    SubscriptionError,
    check_handlers,
    describe_events,
    event_mask,
    narrowed_events,
    runtime_nri,
)
from .pb import nri_pb2 as pb

log = logging.getLogger("nri_cpuplugin.nri")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_SOCKET = "/var/run/nri/nri.sock"
SOCKET_ENV = "NRI_SOCKET_PATH"  # our own override; NRI defines none for external plugins
# The NRI protocol level this stub speaks, sent in RegisterPlugin (NRI 0.12 logs it; older
# runtimes skip the field): per-event methods, the pod-update events, the version exchange.
NRI_VERSION = "v0.12.0"
# Each per-event method's request message (docs/nri-wire.md §9.5).
PER_EVENT_REQUESTS: dict[str, Any] = {
    "RunPodSandbox": pb.RunPodSandboxRequest,
    "StopPodSandbox": pb.StopPodSandboxRequest,
    "RemovePodSandbox": pb.RemovePodSandboxRequest,
    "PostCreateContainer": pb.PostCreateContainerRequest,
    "StartContainer": pb.StartContainerRequest,
    "PostStartContainer": pb.PostStartContainerRequest,
    "PostUpdateContainer": pb.PostUpdateContainerRequest,
    "RemoveContainer": pb.RemoveContainerRequest,
    "PostUpdatePodSandbox": pb.PostUpdatePodSandboxRequest,
}

# Deadlines and what a miss costs: docs/nri-wire.md §12.
REGISTRATION_TIMEOUT = 5.0  # the runtime's default wait for RegisterPlugin
REQUEST_TIMEOUT = 2.0  # the runtime's default per-request timeout, until Configure says more
# Answer within this share of the runtime's deadline: a late answer is worse than an error,
# because the runtime then drops the plugin and creates the container unpinned (fail open).
# The last resort, for handlers that await: a plugin that can answer something better than
# an error keeps a budget of its own below it (the CPU plugin: daemon/deadline.py, 75 %).
DEADLINE_SHARE = 0.9
RECONNECT_MIN, RECONNECT_MAX = 0.05, 1.0

_in_handler: contextvars.ContextVar[bool] = contextvars.ContextVar("_in_handler", default=False)


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """The pause between connection attempts: ``seconds``, or until the stub is stopped (the
    stub's one use of the clock: tests record the pauses instead of waiting them out)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


class RegistrationError(PluginError):
    """The runtime refused or ignored our RegisterPlugin."""

    code = "registration"


class UpdateError(PluginError):
    """The runtime refused an unsolicited UpdateContainers."""

    code = "update"


class Stub:
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
        self.plugin = plugin
        self.name = name
        self.index = index
        self.socket_path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        self.launched_fd = launched_fd
        self.observe = observe  # (method, seconds) of every request served: for metrics
        check_handlers(plugin)
        self.handled_events = event_mask(plugin)
        # What this connection subscribed to: all handled events until Configure narrows it.
        self.events = self.handled_events
        if not self.events:
            # On the wire 0 means "everything", which would make us a validator of every
            # container on NRI >= 0.10.  A plugin without handlers is a mistake.
            raise ValueError("the plugin defines no event handlers; nothing to subscribe to")
        self.runtime_name = ""
        self.runtime_version = ""
        # Until Configure says otherwise: an old runtime, which accepts the fewest events.
        self.runtime_nri = NRIVersion("", since_0_10=False, inferred=True)
        self.request_timeout = REQUEST_TIMEOUT
        self.registration_timeout = REGISTRATION_TIMEOUT
        self.connected = asyncio.Event()
        self._stopping = asyncio.Event()
        self._conn: wire.Connection | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._write_lock = asyncio.Lock()
        self._pending: dict[int, asyncio.Future[wire.ResponseReceived]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._sync_pods: list[pb.PodSandbox] = []
        self._sync_containers: list[pb.Container] = []
        self._configured = False  # this connection's Configure was answered with success
        self._methods = self._method_table(plugin, set(unimplemented))

    def _method_table(self, plugin: object, refused: set[str]) -> dict[str, Callable[[bytes], Any]]:
        """The ttrpc methods served, by name: the NRI 0.6-0.11 set, and the NRI 0.12
        per-event methods the plugin handles (unless ``refused``)."""
        methods: dict[str, Callable[[bytes], Any]] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "Shutdown": self._shutdown,
            "CreateContainer": self._create_container,
            "UpdateContainer": self._update_container,
            "StopContainer": self._stop_container,
            "StateChange": self._state_change,
        }
        if refused - PER_EVENT_METHODS.keys():
            raise ValueError(
                f"unimplemented={sorted(refused - PER_EVENT_METHODS.keys())}: only NRI 0.12 "
                f"per-event methods fall back to StateChange ({', '.join(PER_EVENT_METHODS)})"
            )
        for method, handler in PER_EVENT_METHODS.items():
            if callable(getattr(plugin, handler, None)) and method not in refused:
                methods[method] = self._per_event(method, handler)
        if callable(getattr(plugin, "update_pod_sandbox", None)):
            # No StateChange form exists for it: served whenever the plugin handles it.
            methods["UpdatePodSandbox"] = self._update_pod_sandbox
        return methods

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
        if not fd.isdigit():
            raise ValueError(f"NRI_PLUGIN_SOCKET={fd!r} is not a file descriptor number")
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
        while not self._stopping.is_set():
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as err:
                log.debug(
                    "cannot connect to %s: %s; retrying in %.2fs", self.socket_path, err, delay
                )
                await pause(self._stopping, delay)
                delay = min(delay * 2, RECONNECT_MAX)
                continue
            await self._serve_connection(reader, writer)
            # A connection that ended before a Configure went through (a refused
            # subscription, say) backs off rather than retry the same failure 20 times a second.
            delay = RECONNECT_MIN if self._configured else min(delay * 2, RECONNECT_MAX)
            if not self._stopping.is_set():
                await pause(self._stopping, delay)

    def stop(self) -> None:
        self._stopping.set()
        if self._writer is not None:
            self._writer.close()

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._conn = wire.Connection()
        self._writer = writer
        self._sync_pods, self._sync_containers = [], []
        self._configured = False
        self.events = self.handled_events  # each connection's Configure narrows afresh
        reading = asyncio.create_task(self._read_loop(reader))
        try:
            await self._register()
            log.info("registered with the runtime as %s-%s", self.index, self.name)
            self.connected.set()
            await reading
        except (RegistrationError, ProtocolError, ConnectionError, TimeoutError) as err:
            if self._stopping.is_set():  # stop() closed it (SIGTERM): not the runtime's doing
                log.info("NRI connection closed: stopping")
            else:
                log.warning("NRI connection ended: %s", err)
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

    async def _call_plugin(self, name: str, *args: Any) -> Any:
        bit = EVENT_BITS.get(name)
        if bit is not None and not self.events & bit:
            # Narrowed out by configure(): the runtime should not send it, and if it does the
            # plugin still only sees what it subscribed to.
            return None
        handler = getattr(self.plugin, name, None)
        if not callable(handler):
            return None
        result = handler(*args)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _configure(self, payload: bytes) -> bytes:
        request = pb.ConfigureRequest.FromString(payload)
        self.runtime_name = request.runtime_name
        self.runtime_version = request.runtime_version
        if request.request_timeout > 0:  # milliseconds; only NRI >= 0.7 sends it
            self.request_timeout = request.request_timeout / 1000
        if request.registration_timeout > 0:
            self.registration_timeout = request.registration_timeout / 1000
        self.runtime_nri = runtime_nri(
            request.NRI_version, request.runtime_name, request.runtime_version
        )
        wanted = await self._call_plugin(
            "configure", request.config, request.runtime_name, request.runtime_version
        )
        try:
            events = narrowed_events(self.handled_events, wanted)
        except (SubscriptionError, TypeError) as err:
            # Answered as an error: the runtime then drops the connection, as it does for a
            # Go plugin whose Configure asks for events it cannot handle.
            log.error("refusing the plugin's subscription: %s", err)
            raise
        valid = self.runtime_nri.valid_events
        if events & ~valid:
            nri = self.runtime_nri.version or "unknown"
            log.info(
                "not subscribing to %s: %s %s (NRI %s) does not send them",
                describe_events(events & ~valid),
                request.runtime_name,
                request.runtime_version,
                nri,
            )
        self.events = events & valid
        if not self.events:
            # On the wire 0 would mean every event, validation included: refuse instead.
            raise SubscriptionError(
                f"none of the plugin's events ({describe_events(events)}) is one "
                f"{request.runtime_name} {request.runtime_version} can send"
            )
        if self.events != self.handled_events:
            log.info("subscribed to %s", describe_events(self.events))
        self._configured = True
        return pb.ConfigureResponse(events=self.events).SerializeToString()

    async def _synchronize(self, payload: bytes) -> bytes:
        request = pb.SynchronizeRequest.FromString(payload)
        self._sync_pods.extend(request.pods)
        self._sync_containers.extend(request.containers)
        if request.more:  # a chunk of a split sync: acknowledge, answer on the last one
            return pb.SynchronizeResponse(more=True).SerializeToString()
        pods, containers = self._sync_pods, self._sync_containers
        self._sync_pods, self._sync_containers = [], []
        updates = await self._call_plugin("synchronize", pods, containers) or []
        return pb.SynchronizeResponse(update=updates).SerializeToString()

    async def _shutdown(self, payload: bytes) -> bytes:
        await self._call_plugin("shutdown")
        return b""

    async def _create_container(self, payload: bytes) -> bytes:
        request = pb.CreateContainerRequest.FromString(payload)
        result = await self._call_plugin("create_container", request.pod, request.container)
        adjust, updates = result if result is not None else (None, [])
        response = pb.CreateContainerResponse(update=updates or [])
        if adjust is not None:
            response.adjust.CopyFrom(adjust)
        return response.SerializeToString()

    async def _update_container(self, payload: bytes) -> bytes:
        request = pb.UpdateContainerRequest.FromString(payload)
        updates = await self._call_plugin(
            "update_container", request.pod, request.container, request.linux_resources
        )
        return pb.UpdateContainerResponse(update=updates or []).SerializeToString()

    async def _stop_container(self, payload: bytes) -> bytes:
        request = pb.StopContainerRequest.FromString(payload)
        updates = await self._call_plugin("stop_container", request.pod, request.container)
        return pb.StopContainerResponse(update=updates or []).SerializeToString()

    async def _state_change(self, payload: bytes) -> bytes:
        request = pb.StateChangeEvent.FromString(payload)
        name = EVENT_HANDLERS.get(request.event)
        # UPDATE_POD_SANDBOX carries resources, which a StateChange cannot: never sent so.
        if name is not None and name != "update_pod_sandbox":
            await self._dispatch_event(name, request.pod, request.container)
        return b""

    def _per_event(self, method: str, name: str) -> Callable[[bytes], Any]:
        message = PER_EVENT_REQUESTS[method]

        async def serve(payload: bytes) -> bytes:
            request = message.FromString(payload)
            container = request.container if name not in POD_EVENTS else None
            await self._dispatch_event(name, request.pod, container)
            return b""  # every per-event response is an empty message

        return serve

    async def _update_pod_sandbox(self, payload: bytes) -> bytes:
        request = pb.UpdatePodSandboxRequest.FromString(payload)
        await self._call_plugin(
            "update_pod_sandbox",
            request.pod,
            request.overhead_linux_resources,
            request.linux_resources,
        )
        return b""  # UpdatePodSandboxResponse has no fields

    async def _dispatch_event(
        self, name: str, pod: pb.PodSandbox, container: pb.Container | None
    ) -> None:
        if name in POD_EVENTS:
            await self._call_plugin(name, pod)
        else:
            await self._call_plugin(name, pod, container)

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
