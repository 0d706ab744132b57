"""A test plugin on our Stub, for the transport e2e tests: it records every event it gets as a
JSON line and reacts as its settings say.  Settings (JSON) come from argv[1] when started as a
daemon, or from the runtime's Configure config when the runtime launched it.

    log          file to append event records to; besides one record per event, one per
                 request served ("rpc", with the NRI method that carried it) and the stub's
                 own log lines ("stub-log")
    subscribe    "all" (every event the stub serves; the runtime's NRI version decides which
                 it sends) or "create" (CreateContainer only)
    pin          cpuset to put in every CreateContainer adjustment ("" = no adjustment)
    big          bytes of annotation to add to each adjustment (to make big replies)
    refuse       container name whose creation is refused with an error
    retarget     {"trigger": name, "target": name, "cpus": list}: creating `trigger` updates the
                 running container `target` to `cpus` in the same reply
    unimplemented  NRI 0.12 per-event methods to answer UNIMPLEMENTED (Stub's parameter)
    name         the name to register under (default "transport"; index 50)
    stall        seconds CreateContainer blocks the whole process (a stalled plugin: not even
                 the stub's own deadline can answer)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time

from nri_cpuplugin.nri.handlers import EVENT_HANDLERS
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.stub import Stub


class Recorder:
    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.ids: dict[str, str] = {}  # container name -> id
        self.stub: Stub | None = None

    def _log(self, **record) -> None:
        path = self.settings.get("log")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")

    def configure(self, config, runtime, version):
        if config.strip():
            self.settings.update(json.loads(config))
        nri = self.stub.runtime_nri if self.stub is not None else None
        self._log(
            event="configure",
            runtime=runtime,
            version=version,
            launched_fd=os.environ.get("NRI_PLUGIN_SOCKET"),
            nri_version=nri.version if nri else None,
            nri_inferred=nri.inferred if nri else None,
        )

    def rpc(self, method: str, seconds: float) -> None:
        """The Stub's observer: which NRI method delivered each request."""
        self._log(event="rpc", method=method)

    def synchronize(self, pods, containers):
        self._log(
            event="synchronize",
            pods=sorted(p.name for p in pods),
            containers=sorted(c.name for c in containers),
        )
        for c in containers:
            self.ids[c.name] = c.id
        return []

    def create_container(self, pod, container):
        self.ids[container.name] = container.id
        self._log(event="create_container", pod=pod.name, container=container.name)
        if container.name == self.settings.get("refuse"):
            raise RuntimeError(f"refusing {container.name} on purpose (test)")
        if self.settings.get("stall"):
            time.sleep(float(self.settings["stall"]))  # blocks the event loop: no reply at all
        adjust = pb.ContainerAdjustment()
        if self.settings.get("pin"):
            adjust.linux.resources.cpu.cpus = self.settings["pin"]
        if self.settings.get("big"):
            adjust.annotations["test.nri/big"] = "x" * int(self.settings["big"])
        updates = []
        retarget = self.settings.get("retarget")
        if retarget and container.name == retarget["trigger"]:
            update = pb.ContainerUpdate(container_id=self.ids[retarget["target"]])
            update.linux.resources.cpu.cpus = retarget["cpus"]
            updates.append(update)
        return adjust, updates


def _event_handler(name: str):
    def handler(self, pod, container=None, resources=None):
        self._log(event=name, pod=pod.name, container=container.name if container else None)
        if container is not None:
            self.ids[container.name] = container.id
        return [] if name in ("update_container", "stop_container") else None

    return handler


def _update_pod_sandbox(self, pod, overhead, resources):
    cpu = resources.cpu
    self._log(
        event="update_pod_sandbox",
        pod=pod.name,
        container=None,
        shares=cpu.shares.value if cpu.HasField("shares") else None,
        quota=cpu.quota.value if cpu.HasField("quota") else None,
        period=cpu.period.value if cpu.HasField("period") else None,
        overhead_set=overhead.ByteSize() > 0,
    )


def build_plugin(settings: dict) -> Recorder:
    handlers = {}
    if settings.get("subscribe", "all") == "all":
        handlers = {
            name: _event_handler(name)
            for name in EVENT_HANDLERS.values()
            if name != "create_container"
        }
        handlers["update_pod_sandbox"] = _update_pod_sandbox
    return type("TestPlugin", (Recorder,), handlers)(settings)


class _StubLog(logging.Handler):
    """The stub's log lines (UNIMPLEMENTED answers, subscriptions) into the event log."""

    def __init__(self, plugin: Recorder) -> None:
        super().__init__(logging.DEBUG)
        self.plugin = plugin

    def emit(self, record: logging.LogRecord) -> None:
        self.plugin._log(event="stub-log", message=record.getMessage())


def main() -> None:
    settings = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    plugin = build_plugin(settings)
    logger = logging.getLogger("nri_cpuplugin.nri")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_StubLog(plugin))
    # Runtime-launched: stdio is /dev/null and the settings (log file) come with Configure.
    stub = Stub.from_environment(
        plugin,
        settings.get("name", "transport"),
        "50",
        socket_path=settings.get("socket"),
        observe=plugin.rpc,
        unimplemented=settings.get("unimplemented", ()),
    )
    plugin.stub = stub
    asyncio.run(stub.run())


if __name__ == "__main__":
    main()
