"""The NRI Plugin service as a plugin object answers it: each method's request decoded, the
plugin's handler called, its answer encoded; and what Configure settles for the connection.

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
event, or StateChange before it (and whenever a method is answered UNIMPLEMENTED, see the
stub's ``unimplemented``).  Only events the runtime's NRI knows are subscribed: the pod-update
events need NRI 0.10, which the runtime says (0.12) or is inferred from the runtime's name and
release (``handlers.runtime_nri``); ``runtime_nri`` holds the result once Configure has arrived.

``configure`` may narrow the subscription for this connection, as the Go stub's Configure
handler can: return None (or the int 0, as in Go) to keep every handler's event, or the event
handler names (``["create_container", "remove_container"]``) or an int mask (bit
``1 << (event - 1)``) to subscribe to those only.  Asking for an event the plugin has no
handler for is an error, answered to the runtime, which then drops the connection.

The plugin object is checked when the service is built: a public callable whose name looks
like a handler but is none the service calls (``create_containers``, ``stop_pod``,
``on_start``, ``Synchronize``) is a ValueError naming the closest handler, and a handler name
bound to something not callable is a TypeError - either would otherwise be a subscription that
silently never fires.  Helpers that must have such names take a leading underscore.

The connection itself (registration, reconnects, deadlines) is the stub's (stub.py), which is
a PluginService.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

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

log = logging.getLogger("nri_cpuplugin.nri")  # the stub's logger: one name for the transport

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

# The runtime's defaults until its Configure says more (docs/nri-wire.md §12).
REGISTRATION_TIMEOUT = 5.0  # the runtime's default wait for RegisterPlugin
REQUEST_TIMEOUT = 2.0  # the runtime's default per-request timeout


class PluginService:
    """The methods of NRI's Plugin service for one plugin object, by name (``methods``), and
    what the current connection's Configure settled: the runtime, its NRI version and
    timeouts, the events subscribed.

    ``unimplemented`` names NRI 0.12 per-event methods (``"StartContainer"``, ...) left out of
    ``methods`` although the plugin handles the event, so that the runtime delivers it as
    StateChange instead (see ``Stub``).
    """

    def __init__(self, plugin: object, unimplemented: Iterable[str] = ()) -> None:
        self.plugin = plugin
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
        self._sync_pods: list[pb.PodSandbox] = []
        self._sync_containers: list[pb.Container] = []
        self._configured = False  # this connection's Configure was answered with success
        self._methods = self._method_table(plugin, set(unimplemented))

    def _new_connection(self) -> None:
        """Forget what the last connection settled: each Configure narrows afresh."""
        self._sync_pods, self._sync_containers = [], []
        self._configured = False
        self.events = self.handled_events

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
