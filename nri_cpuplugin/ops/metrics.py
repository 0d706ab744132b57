"""Prometheus metrics, off unless ``[metrics] listen`` is set.

Names follow kubelet's CPU manager metrics under our prefix, so dashboards carry over:
``nri_cpuplugin_pinning_requests_total`` / ``_pinning_errors_total``,
``_shared_pool_size_millicores``, ``_exclusive_cpu_allocation_count``,
``_allocation_per_numa{numa_node}``; plus handler latency per NRI event, state commit latency
and whether the runtime connection is up.

The endpoint is served from the daemon's own asyncio loop rather than prometheus_client's
HTTP server thread, whose accept loop wakes up every half second: an idle node agent should
not wake up at all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..core.state import NodeState
from ..core.topology import Topology

log = logging.getLogger("nri_cpuplugin")
PREFIX = "nri_cpuplugin"
# Handler latencies: well below the runtime's 2 s budget is what matters.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


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
        self.connected = Gauge(
            f"{PREFIX}_runtime_connected", "1 while connected to the runtime over NRI.",
            registry=registry,
        )  # fmt: skip

    def pinning_request(self) -> None:
        self.requests.inc()

    def pinning_error(self) -> None:
        self.errors.inc()

    def observe_state(self, state: NodeState, topology: Topology) -> None:
        self.shared_pool.set(len(state.shared) * 1000)
        exclusive = state.exclusive
        self.exclusive.set(len(exclusive))
        for node, cpus in topology.numa_nodes.items():
            self.per_numa.labels(numa_node=str(node)).set(len(cpus & exclusive))

    def observe_handler(self, event: str, seconds: float) -> None:
        self.handler.labels(event=event).observe(seconds)

    def observe_commit(self, seconds: float) -> None:
        self.commit.observe(seconds)

    def set_connected(self, up: bool) -> None:
        self.connected.set(1 if up else 0)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def serve(self, listen: str) -> asyncio.Server:
        """A minimal HTTP/1.0 endpoint: GET /metrics, anything else 404."""
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"metrics listen address {listen!r}: expected HOST:PORT")
        server = await asyncio.start_server(self._handle, host.strip("[]") or None, int(port))
        log.info("metrics on http://%s/metrics", listen)
        return server

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split()
            if method == "GET" and path.split("?")[0] == "/metrics":
                body, content_type = self.render()
                status = "200 OK"
            else:
                body, content_type, status = b"not found\n", "text/plain", "404 Not Found"
            head = (
                f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            pass  # a broken or slow client gets nothing; the daemon carries on
        finally:
            writer.close()
