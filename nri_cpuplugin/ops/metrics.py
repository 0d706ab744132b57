"""Prometheus metrics, off unless ``[metrics] listen`` is set.

Names follow kubelet's CPU manager metrics under our prefix, so dashboards carry over:
``nri_cpuplugin_pinning_requests_total`` / ``_pinning_errors_total``,
``_shared_pool_size_millicores``, ``_exclusive_cpu_allocation_count``,
``_allocation_per_numa{numa_node}``; plus handler latency per NRI event, state commit latency,
requests answered without their decision (``_deadline_misses_total{event,reason}``),
whether the runtime connection is up, and the running build (``_build_info{version}``).

The endpoint is served from the daemon's own asyncio loop rather than prometheus_client's
HTTP server thread, whose accept loop wakes up every half second: an idle node agent should
not wake up at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .. import __version__
from ..core.state import NodeState
from ..core.topology import Topology
from .config import parse_listen

log = logging.getLogger("nri_cpuplugin")
PREFIX = "nri_cpuplugin"
# Handler latencies: well below the runtime's 2 s budget is what matters.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)

# The endpoint shares the daemon's file descriptors with the NRI path (state lock, state file,
# runtime socket): whatever clients do, it must hold only a fixed share of them.
MAX_CONNECTIONS = 64  # held at once; beyond that one is closed at once (see _Endpoint)
# Listen queue, and also how many connections asyncio accepts in one go before any of them is
# turned away: under a burst the endpoint's descriptors peak at MAX_CONNECTIONS plus a couple
# of such batches, for an instant (128 measured with 2,000 connections at once).
ACCEPT_BACKLOG = 32
REQUEST_TIMEOUT = 5.0  # seconds from accept to close; a scrape takes milliseconds
MAX_REQUEST = 8192  # bytes of request line and headers; Prometheus sends a few hundred


class NoMetrics:
    """Stands in when metrics are off: every call is a no-op."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_pinning_requests", "Containers that asked for exclusive CPUs.",
            registry=registry,
        )  # fmt: skip
        self.errors = Counter(
            f"{PREFIX}_pinning_errors", "Exclusive CPU requests that could not be met.",
            registry=registry,
        )  # fmt: skip
        self.shared_pool = Gauge(
            f"{PREFIX}_shared_pool_size_millicores",
            "CPUs in the shared pool, in millicores; best-effort may starve if 0.",
            registry=registry,
        )
        self.exclusive = Gauge(
            f"{PREFIX}_exclusive_cpu_allocation_count", "CPUs assigned exclusively.",
            registry=registry,
        )  # fmt: skip
        self.earmarked = Gauge(
            f"{PREFIX}_earmarked_cpu_count",
            "CPUs set aside for starting Guaranteed pods, not yet any container's.",
            registry=registry,
        )
        self.per_numa = Gauge(
            f"{PREFIX}_allocation_per_numa", "Exclusively assigned CPUs per NUMA node.",
            ["numa_node"], registry=registry,
        )  # fmt: skip
        self.handler = Histogram(
            f"{PREFIX}_nri_handler_duration_seconds", "Time to answer an NRI request.",
            ["event"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.commit = Histogram(
            f"{PREFIX}_state_commit_duration_seconds",
            "Time to commit the state file durably (write, fsync, rename, fsync directory).",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.deadline_misses = Counter(
            f"{PREFIX}_deadline_misses",
            "NRI requests answered without their decision, which was not made within the "
            "request budget (nri.request_budget).",
            ["event", "reason"], registry=registry,
        )  # fmt: skip
        self.connected = Gauge(
            f"{PREFIX}_runtime_connected", "1 while connected to the runtime over NRI.",
            registry=registry,
        )  # fmt: skip
        # Which build serves this endpoint (a rollout is confirmed by the version it reports).
        Gauge(
            f"{PREFIX}_build_info", "Always 1; its version label is the running build's.",
            ["version"], registry=registry,
        ).labels(version=__version__).set(1)  # fmt: skip

    def pinning_request(self) -> None:
        self.requests.inc()

    def pinning_error(self) -> None:
        self.errors.inc()

    def observe_state(self, state: NodeState, topology: Topology) -> None:
        self.shared_pool.set(len(state.shared) * 1000)
        exclusive = state.assigned
        self.exclusive.set(len(exclusive))
        self.earmarked.set(len(state.exclusive) - len(exclusive))
        for node, cpus in topology.numa_nodes.items():
            self.per_numa.labels(numa_node=str(node)).set(len(cpus & exclusive))

    def observe_handler(self, event: str, seconds: float) -> None:
        self.handler.labels(event=event).observe(seconds)

    def observe_commit(self, seconds: float) -> None:
        self.commit.observe(seconds)

    def deadline_missed(self, event: str, reason: str) -> None:
        self.deadline_misses.labels(event=event, reason=reason).inc()

    def set_connected(self, up: bool) -> None:
        self.connected.set(1 if up else 0)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def serve(self, listen: str) -> asyncio.Server:
        """A minimal HTTP/1.0 endpoint: GET /metrics, anything else 404.  OSError when the
        address cannot be bound (in use, not local, name not resolved); the caller decides
        what that means for the daemon."""
        host, port = parse_listen(listen)
        endpoint = _Endpoint(self.render)
        server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(endpoint), host or None, port, backlog=ACCEPT_BACKLOG
        )
        log.info("metrics on http://%s/metrics", listen)
        return server


class _Endpoint:
    """The connections of one listener, bounded in number.

    When the cap is reached, the connection that has waited longest for its request is closed
    to make room: a scraper sends its request the moment it connects, so idle connections -
    however many - cannot lock it out; only connections already being answered are never cut
    (if all are, the newcomer is closed instead)."""

    def __init__(self, render: Callable[[], tuple[bytes, str]]) -> None:
        self.render = render
        self.waiting: dict[_Connection, None] = {}  # insertion order: oldest first
        self.answering: set[_Connection] = set()

    def accept(self, connection: _Connection) -> bool:
        if len(self.waiting) + len(self.answering) >= MAX_CONNECTIONS:
            if not self.waiting:
                return False
            oldest = next(iter(self.waiting))
            self.release(oldest)  # counted out now: its socket closes on the next loop turn
            oldest.abort()
        self.waiting[connection] = None
        return True

    def answered(self, connection: _Connection) -> None:
        if connection in self.waiting:  # not if it was turned away meanwhile
            del self.waiting[connection]
            self.answering.add(connection)

    def release(self, connection: _Connection) -> None:
        self.waiting.pop(connection, None)
        self.answering.discard(connection)


class _Connection(asyncio.Protocol):
    """One exchange: read the request head (bounded in size and time), answer, close.

    A protocol rather than a stream handler task: every client behaviour - reset, half-close,
    garbage, silence - ends in connection_lost() with nothing raised, so nothing is logged."""

    def __init__(self, endpoint: _Endpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.request = bytearray()
        self.done = False  # answered or turned away: later bytes are not read
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.endpoint.accept(self):
            self.abort()
            return
        # One deadline for the whole exchange, not per read: a client trickling a byte at a
        # time, or never reading the answer, is cut off all the same.
        self.deadline = asyncio.get_running_loop().call_later(REQUEST_TIMEOUT, self.abort)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        self.request += data
        head = self.request[:MAX_REQUEST]
        if b"\r\n\r\n" in head or b"\n\n" in head:
            self.answer()
        elif len(self.request) >= MAX_REQUEST:
            self.abort()  # a scraper's request is a few hundred bytes

    def eof_received(self) -> bool:
        # Half-closed after a request line without the blank line: nothing more will come.
        if not self.done and b"\n" in self.request:
            self.answer()
        elif not self.done:
            self.abort()
        return False  # close once the answer is flushed

    def connection_lost(self, exc: Exception | None) -> None:
        # A reset or a broken pipe arrives here as exc: the client's business, not logged.
        self.done = True
        if self.deadline is not None:
            self.deadline.cancel()
        self.endpoint.release(self)

    def abort(self) -> None:
        self.done = True
        if self.transport is not None:
            self.transport.abort()

    def answer(self) -> None:
        assert self.transport is not None
        self.done = True
        self.endpoint.answered(self)
        line = bytes(self.request.split(b"\n", 1)[0]).rstrip(b"\r")
        words = line.split()
        if len(words) not in (2, 3) or not words[1].startswith(b"/"):
            body, content_type, status = b"bad request\n", "text/plain", "400 Bad Request"
        elif words[0] == b"GET" and words[1].split(b"?", 1)[0] == b"/metrics":
            (body, content_type), status = self.endpoint.render(), "200 OK"
        else:
            body, content_type, status = b"not found\n", "text/plain", "404 Not Found"
        head = (
            f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()  # after the answer is flushed; the deadline still applies
