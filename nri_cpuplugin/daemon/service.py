"""The daemon as ``nri-cpuplugin run`` builds it: the parts and what connects them.

    runtime ─▶ nri.Stub ─▶ NRIAdapter ─▶ Deadline ─▶ worker ─▶ Node ─▶ CgroupWriter (cgroupfs,
                            (protobuf)   (budget)             (state)   systemd units)
    kernel uevents ─▶ _cpu_events ───┐
    timers (sweep, evictions) ───────┴▶ Deadline.submit

Sources only submit events; the node is the one owner of the state.  The NIC read-ahead is a
cache the adapter starts filling when a pod starts and the node reads (daemon/pod_nics.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from .. import __version__
from ..hardware import hotplug
from ..hardware.systemd.units import bus_path
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from ..ops.config import Settings, merge
from ..ops.metrics import Metrics
from . import events as ev
from .adapter import NRIAdapter
from .deadline import DRAIN_TIMEOUT, Deadline
from .heartbeat import Heartbeat
from .node import Later, Node
from .pod_nics import PodNICs
from .units import SystemdUnits
from .worker import Worker, _call_soon
from .writer import Units

log = logging.getLogger("nri_cpuplugin")


class Daemon:
    def __init__(
        self,
        settings: Settings,
        audit: Audit,
        flags: Mapping[str, Any] | None = None,
        units: Units | None = None,
        *,
        later: Later | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """``later``: the timers that submit the daemon's own events (sweep rounds, retries);
        by default the event loop's.  ``metrics``: what the daemon reports to; by default one
        made when /metrics is served (``start_metrics``)."""
        self.audit = audit
        self._metrics = metrics
        if units is None:
            merged = merge(settings, flags or {})
            path = bus_path(merged.systemd_bus)
            # (units.py fails safe, and says so, where no unit files are to be seen)
            if path is not None:
                units = SystemdUnits(audit, path, merged.unit_files_root, self._finish_hand_over)
        self.worker = Worker()
        self.pod_nics = PodNICs()
        self.node = Node(
            settings, audit, flags,
            progress=self.worker, units=units, pod_nics=self.pod_nics,
            later=later or self._later, background=self.worker, metrics=metrics,
        )  # fmt: skip
        self.deadline = Deadline(self.node, audit, self.worker)
        self.adapter = NRIAdapter(self.deadline, self.node, self.pod_nics, self)
        self.heartbeat = Heartbeat(
            self.worker,
            lambda: self.node.settings.state_dir,
            lambda: self.deadline.budget,
            merge(settings, flags or {}).health_interval,
        )
        self.hotplug: hotplug.UeventListener | None = None
        self._metrics_server: Any = None
        self._stub: Any = None

    @property
    def stub(self) -> Any:
        return self._stub

    @stub.setter
    def stub(self, stub: Any) -> None:
        """The stub that serves the adapter: its request timeout bounds the budget."""
        self._stub = stub
        self.adapter.stub = stub
        stub.on_connection = self.heartbeat.connection
        self.deadline.request_timeout = lambda: getattr(stub, "request_timeout", None)

    def observe_request(self, method: str, seconds: float) -> None:
        self.node.metrics.observe_handler(method, seconds)
        self.heartbeat.event_seen()

    def load_state(self) -> None:
        """Before the runtime connects (an external daemon is ready before its runtime is)."""
        self.node.load_state()

    # --- the runtime's connection -----------------------------------------------------------------

    async def connected(self, runtime: str, version: str) -> None:
        node = self.node
        self.audit.common["RUNTIME"] = f"{runtime} {version}".strip()
        self.start_hotplug()
        await self.start_metrics()
        node.metrics.set_connected(True)
        node.metrics.observe_state(node.state, node.policy.topology)
        # What the stub learnt of the runtime's NRI (said by NRI >= 0.12, else inferred).
        nri = getattr(getattr(self._stub, "runtime_nri", None), "version", "")
        policy = node.policy
        self.audit.record(
            "config",
            f"configured by {runtime} {version}{f' (NRI {nri})' if nri else ''}: reserved "
            f"{policy.reserved}, options {','.join(sorted(policy.options)) or 'none'}, "
            f"state in {node.settings.state_dir}",
            reserved_cpus=policy.reserved,
            shared_cpus=node.state.shared,
            nri_version=nri,
            version=__version__,  # which build took this configuration
        )
        self.audit.record("connect", f"connected to {runtime} {version}")

    def disconnected(self) -> None:
        self.deadline.submit(ev.Disconnected())
        self.node.metrics.set_connected(False)
        self.audit.record("disconnect", "lost the connection to the runtime", audit_mod.WARNING)

    async def drain(self, timeout: float = DRAIN_TIMEOUT) -> bool:
        """Before the daemon exits: work answered before it was done (a release behind a busy
        lock) is committed, if it can be soon; what cannot, the next start finds by itself."""
        return await self.deadline.drain(timeout)

    def release_claim(self) -> None:
        self.node.release_claim()

    # --- sources ----------------------------------------------------------------------------------

    def _finish_hand_over(self, delay: float) -> bool:
        """Follow up systemd units' hand-over (daemon/units.py) after ``delay`` seconds."""
        return self._later(delay, ev.FinishHandOver())

    def _later(self, delay: float, event: object) -> bool:
        """Submit ``event`` after ``delay`` seconds (called from the worker; timers live on the
        event loop); False when there is no loop to wait on."""
        job = self.worker.job_here()
        loop = job.loop if job is not None else _running_loop()
        if loop is None:
            return False
        _call_soon(loop, loop.call_later, delay, self.deadline.submit, event)
        return True

    def start_hotplug(self) -> None:
        """Listen to the kernel's CPU online/offline uevents on the running loop (once)."""
        if self.hotplug is not None:
            return
        loop = _running_loop()
        if loop is None:
            return
        listener = hotplug.UeventListener(self._cpu_events)
        try:
            listener.start(loop)
        except (OSError, ImportError) as err:
            self.audit.record(
                "hotplug",
                f"cannot listen to CPU hotplug uevents ({err}); CPUs going offline or online "
                "are only noticed at the next start",
                audit_mod.WARNING,
                reason=str(err),
            )
            return
        self.hotplug = listener

    def _cpu_events(self, events: list[hotplug.CPUEvent]) -> None:
        self.deadline.submit(ev.CPUsChanged(tuple(events)))

    def stop_hotplug(self) -> None:
        if self.hotplug is not None:
            self.hotplug.close()
            self.hotplug = None

    async def start_metrics(self) -> None:
        """Serve /metrics if configured (once).  Never raises: pinning matters more than being
        observed, so an address that cannot be bound gets one warning and the daemon runs
        without metrics."""
        listen = self.node.settings.metrics_listen
        if listen is None or self._metrics_server is not None:
            return
        metrics = Metrics() if self._metrics is None else self._metrics
        try:
            self._metrics_server = await metrics.serve(listen)
        except (OSError, ValueError) as err:
            # False: tried; not again at every reconnect (one warning, not one per runtime
            # restart).  Restart the daemon once the address is free.
            self._metrics_server = False
            reason = getattr(err, "strerror", None) or str(err)
            self.audit.record(
                "metrics-failed",
                f"cannot serve metrics on {listen}: {reason}; running without metrics",
                audit_mod.WARNING,
                reason=reason,
            )
            return
        self.node.metrics = metrics
        if self.node.state is not None:
            metrics.observe_state(self.node.state, self.node.policy.topology)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
