"""FAKE runtime: the runtime side of NRI, played with our own codecs (test double).

Real containerd 1.7 and 2.1 are driven by the e2e tests; this fake exists for what a real
runtime cannot be made to do on demand - Configure racing ahead of the RegisterPlugin reply,
split Synchronize, malformed or unknown requests, a thousand containers in one sync - and for
benchmarks of the plugin side alone.  It speaks the real wire format (mux + ttrpc + protobuf).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from nri_cpuplugin.nri import connection as wire
from nri_cpuplugin.nri.pb import nri_pb2 as pb

PLUGIN = "nri.pkg.api.v1alpha1.Plugin"


class FakeRuntime:
    def __init__(
        self,
        socket_path: Path,
        configure_before_register_reply: bool = True,
        *,
        runtime: tuple[str, str] = ("fake", "v0"),
        nri_version: str = "",
    ) -> None:
        self.socket_path = socket_path
        self.configure_first = configure_before_register_reply
        # What Configure says about the runtime: name and release, and (as NRI >= 0.12 does)
        # its NRI version.
        self.runtime = runtime
        self.nri_version = nri_version
        self.registered = asyncio.Event()
        self.register_request: pb.RegisterPluginRequest | None = None
        self.update_requests: list[pb.UpdateContainersRequest] = []
        self.connections = 0
        self.configure_response: pb.ConfigureResponse | None = None
        self.configure_reply: wire.ResponseReceived | None = None  # the last, even an error
        self._server: asyncio.AbstractServer | None = None
        self._conn: wire.Connection | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self.disconnected = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self.accept, str(self.socket_path))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            # The session ends by itself once the socket is closed; cancelling it instead
            # would make asyncio's stream server log the cancellation as an error.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.disconnected.wait(), 5)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.socket_path.unlink(missing_ok=True)

    def drop_connection(self) -> None:
        """Close the plugin's connection, as a runtime restart would."""
        if self._writer is not None:
            self._writer.close()

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one plugin's connection (each one its socket accepts; or one made elsewhere,
        as a runtime launching its plugin hands it one end of a socket pair)."""
        self.connections += 1
        self.registered.clear()
        self.disconnected.clear()
        self._conn = wire.Connection(runtime=True)
        self._writer = writer
        try:
            while data := await reader.read(1 << 16):
                for event in self._conn.receive_data(data):
                    if isinstance(event, wire.RequestReceived):
                        task = asyncio.create_task(self._serve(event))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    elif isinstance(event, wire.ResponseReceived):
                        future = self._pending.pop(event.stream_id, None)
                        if future is not None and not future.done():
                            future.set_result(event)
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("plugin disconnected"))
            self._pending.clear()
            writer.close()
            self.disconnected.set()

    async def _serve(self, request: wire.RequestReceived) -> None:
        assert self._conn is not None and self._writer is not None
        if request.method == "RegisterPlugin":
            self.register_request = pb.RegisterPluginRequest.FromString(request.payload)
            if self.configure_first:  # the race real containerd 2.1 shows
                if not await self.configure():
                    return
                await self.synchronize([], [])
            self._writer.write(self._conn.send_response(request.stream_id))
            if not self.configure_first:
                if not await self.configure():
                    return
                await self.synchronize([], [])
            self.registered.set()
        elif request.method == "UpdateContainers":
            self.update_requests.append(pb.UpdateContainersRequest.FromString(request.payload))
            self._writer.write(self._conn.send_response(request.stream_id, b""))
        else:
            self._writer.write(
                self._conn.send_response(request.stream_id, b"", 12, f"method {request.method}")
            )

    async def call(
        self,
        method: str,
        message: bytes | object = b"",
        timeout: float = 5.0,
        service: str = PLUGIN,
    ) -> wire.ResponseReceived:
        assert self._conn is not None and self._writer is not None
        payload = message if isinstance(message, bytes) else message.SerializeToString()
        stream_id, data = self._conn.send_request(service, method, payload, int(2e9))
        future = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        self._writer.write(data)
        return await asyncio.wait_for(future, timeout)

    async def configure(self, config: str = "") -> bool:
        """False when the plugin answered with an error: then, like containerd, drop it."""
        request = pb.ConfigureRequest(
            config=config,
            runtime_name=self.runtime[0],
            runtime_version=self.runtime[1],
            request_timeout=2000,
            registration_timeout=5000,
            NRI_version=self.nri_version,
        )
        response = await self.call("Configure", request)
        self.configure_reply = response
        if response.code != 0:
            self.drop_connection()
            return False
        self.configure_response = pb.ConfigureResponse.FromString(response.payload)
        return True

    async def synchronize(
        self, pods: list, containers: list, chunk: int | None = None
    ) -> pb.SynchronizeResponse:
        """Send the state, split into chunks of ``chunk`` items with ``more`` as NRI >= 0.8."""
        items = [("pod", p) for p in pods] + [("ctr", c) for c in containers]
        size = chunk or max(1, len(items))
        batches = [items[i : i + size] for i in range(0, len(items), size)] or [[]]
        response = None
        for number, batch in enumerate(batches):
            request = pb.SynchronizeRequest(
                pods=[x for kind, x in batch if kind == "pod"],
                containers=[x for kind, x in batch if kind == "ctr"],
                more=number < len(batches) - 1,
            )
            reply = await self.call("Synchronize", request)
            assert reply.code == 0, reply.message
            response = pb.SynchronizeResponse.FromString(reply.payload)
            assert response.more == request.more  # "more" chunks are acknowledged, not answered
        return response
