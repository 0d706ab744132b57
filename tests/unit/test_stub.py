"""The asyncio stub against the FAKE runtime of fake_runtime.py (races and corner cases that a
real containerd cannot be made to produce on demand; the real ones are in tests/e2e/)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from fake_runtime import FakeRuntime
from model_stall import until
from topologies import build

from nri_cpuplugin.daemon.service import Daemon
from nri_cpuplugin.nri import stub as stub_module
from nri_cpuplugin.nri.handlers import (
    SubscriptionError,
    check_handlers,
    event_mask,
    narrowed_events,
    runtime_nri,
)
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.stub import RECONNECT_MIN, LaunchError, Stub
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings


class Recorder:
    """A plugin with the handlers a CPU pinner needs, recording what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.stub: Stub | None = None

    def configure(self, config, runtime, version):
        self.seen.append(("configure", config, runtime, version))

    def synchronize(self, pods, containers):
        self.seen.append(("synchronize", len(pods), len(containers)))
        return [pb.ContainerUpdate(container_id=c.id) for c in containers[:1]]

    def create_container(self, pod, container):
        self.seen.append(("create", container.id))
        if container.name == "refuse":
            raise ValueError("not enough CPUs: asked 9, free 1")
        adjust = pb.ContainerAdjustment()
        adjust.linux.resources.cpu.cpus = "1"
        adjust.linux.resources.cpu.mems = "0"
        update = pb.ContainerUpdate(container_id="sibling")
        update.linux.resources.cpu.cpus = "0"
        return adjust, [update]

    async def stop_container(self, pod, container):
        self.seen.append(("stop", container.id))
        if container.name == "slow":
            await asyncio.sleep(10)
        if container.name == "greedy":
            await self.stub.update_containers([])  # must be refused: would deadlock
        return []

    def remove_container(self, pod, container):
        self.seen.append(("remove", container.id))

    def remove_pod_sandbox(self, pod):
        self.seen.append(("remove-pod", pod.id))


def record_pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The stub's pauses between connection attempts, recorded and not waited out (a test
    asserts the backoff, not the clock)."""
    pauses: list[float] = []

    async def pause(stopping: asyncio.Event, seconds: float) -> None:
        pauses.append(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(stub_module, "pause", pause)
    return pauses


def run(test: Callable[[Path], Awaitable[None]], tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(test(tmp_path / "nri.sock"), 20))


async def connected(
    path: Path, plugin=None, **kw
) -> tuple[FakeRuntime, Stub, Recorder, asyncio.Task]:
    runtime = FakeRuntime(path, **kw)
    await runtime.start()
    plugin = plugin or Recorder()
    stub = Stub(plugin, "cpuplugin", "50", socket_path=str(path))
    plugin.stub = stub
    task = asyncio.create_task(stub.run())
    await asyncio.wait_for(runtime.registered.wait(), 5)
    await asyncio.wait_for(stub.connected.wait(), 5)
    return runtime, stub, plugin, task


async def shutdown(runtime: FakeRuntime, stub: Stub, task: asyncio.Task) -> None:
    stub.stop()
    await runtime.close()
    await asyncio.wait_for(task, 5)


def req(name: str = "c", cid: str = "c1") -> pb.CreateContainerRequest:
    return pb.CreateContainerRequest(
        pod=pb.PodSandbox(id="pod1", name="p", uid="u1", namespace="ns"),
        container=pb.Container(id=cid, pod_sandbox_id="pod1", name=name),
    )


def test_mask_is_derived_from_handlers():
    assert event_mask(Recorder()) == 0x8 | 0x200 | 0x400 | 0x4
    with pytest.raises(ValueError, match="no event handlers"):
        Stub(object(), "x", "10")
    with pytest.raises(ValueError, match="two digits"):
        Stub(Recorder(), "x", "5")


@pytest.mark.parametrize("configure_first", [True, False])
def test_handshake_in_either_order(tmp_path, configure_first):
    async def test(path):
        runtime, stub, plugin, task = await connected(
            path, configure_before_register_reply=configure_first
        )
        assert runtime.register_request.plugin_name == "cpuplugin"
        assert runtime.register_request.plugin_idx == "50"
        assert runtime.register_request.NRI_version == "v0.12.0"
        assert runtime.configure_response.events == 0x60C
        assert plugin.seen[:2] == [("configure", "", "fake", "v0"), ("synchronize", 0, 0)]
        assert stub.request_timeout == 2.0
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_create_container_adjusts_and_updates_siblings(tmp_path):
    async def test(path):
        runtime, stub, _, task = await connected(path)
        reply = await runtime.call("CreateContainer", req())
        response = pb.CreateContainerResponse.FromString(reply.payload)
        assert reply.code == 0
        assert response.adjust.linux.resources.cpu.cpus == "1"
        assert [u.container_id for u in response.update] == ["sibling"]
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_handler_error_fails_the_operation_but_keeps_the_plugin(tmp_path):
    async def test(path):
        runtime, stub, _, task = await connected(path)
        reply = await runtime.call("CreateContainer", req(name="refuse"))
        assert reply.code == 2
        assert reply.message == "cpuplugin: not enough CPUs: asked 9, free 1"
        again = await runtime.call("CreateContainer", req(cid="c2"))
        assert again.code == 0 and stub.connected.is_set()
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_unknown_methods_and_services_are_unimplemented(tmp_path):
    async def test(path):
        runtime, stub, _, task = await connected(path)
        reply = await runtime.call("ValidateContainerAdjustment", b"")
        assert (reply.code, reply.message) == (12, "method ValidateContainerAdjustment")
        reply = await runtime.call("Foo", b"", service="nri.pkg.api.v1alpha1.Other")
        assert (reply.code, reply.message) == (12, "service nri.pkg.api.v1alpha1.Other")
        # a per-event method of NRI 0.12 the plugin has no handler for: UNIMPLEMENTED too,
        # so the runtime falls back to StateChange
        reply = await runtime.call("StartContainer", req())
        assert reply.code == 12
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_state_change_and_per_event_methods_reach_handlers(tmp_path):
    async def test(path):
        runtime, stub, plugin, task = await connected(path)
        event = pb.StateChangeEvent(event=11, pod=req().pod, container=req(cid="gone").container)
        assert (await runtime.call("StateChange", event)).code == 0
        assert (await runtime.call("RemoveContainer", req(cid="gone2"))).code == 0
        pod_event = pb.StateChangeEvent(event=3, pod=pb.PodSandbox(id="pod9"))
        assert (await runtime.call("StateChange", pod_event)).code == 0
        unsubscribed = pb.StateChangeEvent(event=6, pod=req().pod, container=req().container)
        assert (await runtime.call("StateChange", unsubscribed)).code == 0
        assert plugin.seen[-3:] == [("remove", "gone"), ("remove", "gone2"), ("remove-pod", "pod9")]
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_split_synchronize_is_accumulated(tmp_path):
    async def test(path):
        runtime, stub, plugin, task = await connected(path)
        pods = [pb.PodSandbox(id=f"p{i}") for i in range(4)]
        containers = [pb.Container(id=f"c{i}", pod_sandbox_id="p0") for i in range(10)]
        response = await runtime.synchronize(pods, containers, chunk=3)
        assert plugin.seen[-1] == ("synchronize", 4, 10)
        assert [u.container_id for u in response.update] == ["c0"]
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_slow_handler_gets_an_error_before_the_runtime_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(stub_module, "DEADLINE_SHARE", 0.1)  # 2 s * 0.1 = 0.2 s budget

    async def test(path):
        runtime, stub, _, task = await connected(path)
        stop = pb.StopContainerRequest(pod=req().pod, container=req(name="slow").container)
        reply = await runtime.call("StopContainer", stop)
        # The stub's guard answered (DEADLINE_EXCEEDED), not the handler (after its 10 s) nor
        # the runtime's own timeout (it raises).
        assert reply.code == 4 and "did not finish within 0.20s" in reply.message
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_a_stop_of_our_own_is_not_logged_as_the_runtime_closing_the_socket(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=stub_module.log.name)

    async def test(path):
        runtime, stub, _, task = await connected(path)
        stub.stop()  # what SIGTERM from the service manager does
        await asyncio.wait_for(task, 5)
        await runtime.close()

    run(test, tmp_path)
    messages = [r.getMessage() for r in caplog.records if r.name == stub_module.log.name]
    assert "NRI connection closed: stopping" in messages
    assert not [m for m in messages if m.startswith("NRI connection ended")]


def test_unsolicited_update_is_refused_inside_handler_and_sent_after(tmp_path):
    async def test(path):
        runtime, stub, _, task = await connected(path)
        stop = pb.StopContainerRequest(pod=req().pod, container=req(name="greedy").container)
        reply = await runtime.call("StopContainer", stop)
        assert reply.code == 2 and "would deadlock" in reply.message
        update = pb.ContainerUpdate(container_id="x")
        update.linux.resources.cpu.cpus = "0-1"
        assert await stub.update_containers([update]) == []
        done = asyncio.get_running_loop().create_future()
        stub.schedule_update_containers([update], done.set_result)
        assert await asyncio.wait_for(done, 5) == []
        assert [r.update[0].container_id for r in runtime.update_requests] == ["x", "x"]
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_daemon_reconnects_and_resynchronizes(tmp_path):
    async def test(path):
        runtime, stub, plugin, task = await connected(path)
        runtime.drop_connection()
        await asyncio.wait_for(runtime.disconnected.wait(), 5)
        await until(lambda: runtime.connections >= 2 and runtime.registered.is_set())
        assert [s for s in plugin.seen if s[0] == "synchronize"] == [("synchronize", 0, 0)] * 2
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_daemon_waits_for_a_runtime_that_is_not_there_yet(tmp_path, monkeypatch):
    async def test(path):
        plugin = Recorder()
        stub = Stub(plugin, "cpuplugin", "50", socket_path=str(path))
        pauses = record_pauses(monkeypatch)
        task = asyncio.create_task(stub.run())
        while len(pauses) < 3:  # nothing listens yet: the stub keeps retrying, backing off
            await asyncio.sleep(0)
        assert pauses[:3] == [RECONNECT_MIN, 2 * RECONNECT_MIN, 4 * RECONNECT_MIN]
        runtime = FakeRuntime(path)
        await runtime.start()
        await asyncio.wait_for(stub.connected.wait(), 5)
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_a_runtime_out_of_reach_is_a_warning_at_once_and_every_minute(
    tmp_path, monkeypatch, caplog
):
    """The retries were logged at debug only: a daemon with NRI off waited unseen."""
    caplog.set_level(logging.DEBUG, logger=stub_module.log.name)
    told: list[tuple[bool, str]] = []

    async def test(path):
        stub = Stub(Recorder(), "cpuplugin", "50", socket_path=str(path))
        stub.on_connection = lambda registered, detail: told.append((registered, detail))
        pauses = record_pauses(monkeypatch)
        task = asyncio.create_task(stub.run())
        while len(warnings()) < 3:
            await asyncio.sleep(0)
        stub.stop()
        await task
        # At once, then after each minute of retrying (pauses backing off to 1 s).
        every = stub_module.CONNECT_WARNING_EVERY
        assert 2 * every <= sum(pauses[:-1]) < 2 * every + 2

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    run(test, tmp_path)
    logged = warnings()
    assert len(logged) == 3
    assert logged[0].startswith(f"cannot connect to the runtime's NRI socket {tmp_path}/nri.sock")
    for hint in ("No such file or directory", "is NRI enabled", "enable_nri", "nri.socket"):
        assert hint in logged[0], hint
    assert told and all(not registered and "is NRI enabled" in why for registered, why in told)


def test_launched_mode_serves_the_inherited_socket_and_exits_when_it_closes(tmp_path):
    async def test(path):
        ours, theirs = socket.socketpair()
        runtime = FakeRuntime(path)
        reader, writer = await asyncio.open_unix_connection(sock=theirs)
        session = asyncio.create_task(runtime.accept(reader, writer))
        plugin = Recorder()
        stub = Stub(plugin, "cpuplugin", "50", launched_fd=ours.detach())
        task = asyncio.create_task(stub.run())
        await asyncio.wait_for(runtime.registered.wait(), 5)
        writer.close()  # the runtime goes away
        await asyncio.wait_for(task, 5)  # ... and the launched plugin is done
        session.cancel()

    run(test, tmp_path)


def test_from_environment_adopts_the_launched_socket(monkeypatch):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        monkeypatch.setenv("NRI_PLUGIN_SOCKET", str(ours.fileno()))
        monkeypatch.setenv("NRI_PLUGIN_NAME", "cpuplugin")
        monkeypatch.setenv("NRI_PLUGIN_IDX", "10")
        stub = Stub.from_environment(Recorder(), "ignored", "99")
        assert (stub.launched_fd, stub.name, stub.index) == (ours.fileno(), "cpuplugin", "10")


def test_a_launched_socket_that_is_none_is_refused_with_what_to_do(monkeypatch, tmp_path):
    """NRI_PLUGIN_SOCKET=x was a traceback (ValueError); a number that is no open socket
    failed later, deep in asyncio."""
    plain = open(tmp_path / "f", "w")  # noqa: SIM115 - closed below
    free = os.open(tmp_path, os.O_RDONLY)
    os.close(free)  # a descriptor number nothing holds
    for value, why in (
        ("x", "is not a file descriptor number"),
        (str(free), "no such open file descriptor"),
        (str(plain.fileno()), "is not a socket"),
    ):
        monkeypatch.setenv("NRI_PLUGIN_SOCKET", value)
        with pytest.raises(LaunchError) as err:
            Stub.from_environment(Recorder(), "x", "10")
        assert why in str(err.value) and "unset it to run as a daemon" in str(err.value)
    plain.close()


# --- narrowing the subscription in configure() ------------------------------------------------

# Recorder handles remove_pod_sandbox (3), create (4), stop (10) and remove_container (11).
RECORDER_EVENTS = 0x60C


class Narrowing(Recorder):
    """Subscribes to what ``wanted`` says on the first connection, to everything after."""

    def __init__(self, wanted: object) -> None:
        super().__init__()
        self.wanted = [wanted]

    def configure(self, config, runtime, version):
        super().configure(config, runtime, version)
        return self.wanted.pop() if self.wanted else None


@pytest.mark.parametrize("wanted", [["create_container", "remove_container"], 0x8 | 0x400])
def test_configure_narrows_the_subscription_for_its_connection(tmp_path, wanted):
    async def test(path):
        runtime, stub, plugin, task = await connected(path, Narrowing(wanted))
        assert runtime.configure_response.events == 0x8 | 0x400
        assert (await runtime.call("CreateContainer", req(cid="in"))).code == 0
        assert (await runtime.call("RemoveContainer", req(cid="in"))).code == 0
        # Narrowed out: a well-behaved runtime never sends these, and if one does, the plugin
        # does not see them (an empty, successful answer).
        stop = pb.StopContainerRequest(pod=req().pod, container=req(cid="out").container)
        reply = await runtime.call("StopContainer", stop)
        assert reply.code == 0 and reply.payload == b""
        pod_event = pb.StateChangeEvent(event=3, pod=pb.PodSandbox(id="out"))
        assert (await runtime.call("StateChange", pod_event)).code == 0
        assert plugin.seen[2:] == [("create", "in"), ("remove", "in")]
        # The next connection's Configure (returning None) subscribes to every handler again.
        runtime.drop_connection()
        await until(lambda: runtime.connections >= 2 and runtime.registered.is_set())
        assert runtime.configure_response.events == RECORDER_EVENTS
        assert (await runtime.call("StopContainer", stop)).code == 0
        assert plugin.seen[-1] == ("stop", "out")
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        (
            ["create_container", "start_container"],
            "configure() asked for events the plugin has no handlers for: start_container "
            "(event 6) (it handles remove_pod_sandbox (event 3), create_container (event 4), "
            "stop_container (event 10), remove_container (event 11))",
        ),
        (0x8 | 0x800, "no handlers for: update_pod_sandbox (event 12)"),
        (["create_containers"], "unknown events 'create_containers' (did you mean "),
    ],
)
def test_configure_asking_for_unhandled_events_is_refused(tmp_path, monkeypatch, wanted, message):
    async def test(path):
        runtime = FakeRuntime(path)
        await runtime.start()
        stub = Stub(Narrowing(wanted), "cpuplugin", "50", socket_path=str(path))
        stub.plugin.wanted = [wanted] * 100  # refuse on every connection
        pauses = record_pauses(monkeypatch)
        task = asyncio.create_task(stub.run())
        await until(lambda: runtime.configure_reply is not None)
        assert runtime.configure_reply.code == 2  # UNKNOWN: the runtime drops the plugin
        assert runtime.configure_reply.message.startswith("cpuplugin: ")
        assert message in runtime.configure_reply.message
        assert not runtime.registered.is_set()
        # The stub keeps trying (the runtime's config may change), backing off rather than
        # retrying the same failure every 50 ms: each refused connection doubles the pause.
        while len(pauses) < 3:
            await asyncio.sleep(0)
        assert pauses[:3] == [2 * RECONNECT_MIN, 4 * RECONNECT_MIN, 8 * RECONNECT_MIN]
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_narrowed_events_accepts_names_masks_and_none_and_refuses_the_rest():
    handled = RECORDER_EVENTS
    assert narrowed_events(handled, None) == handled
    assert narrowed_events(handled, 0) == handled  # the Go stub's "no narrowing"
    assert narrowed_events(handled, ("stop_container",)) == 0x200
    assert narrowed_events(handled, iter(["create_container"])) == 0x8
    assert narrowed_events(handled, 0x4) == 0x4
    with pytest.raises(SubscriptionError, match="returned no events; return None"):
        narrowed_events(handled, [])
    with pytest.raises(SubscriptionError, match=r"no handlers for: run_pod_sandbox \(event 1\)"):
        narrowed_events(handled, {"run_pod_sandbox", "create_container"})
    with pytest.raises(SubscriptionError, match="no handlers for: event 20"):
        narrowed_events(handled, 1 << 19)
    with pytest.raises(SubscriptionError, match="not an event mask"):
        narrowed_events(handled, -1)
    with pytest.raises(SubscriptionError, match="'stop_pod' \\(did you mean 'stop_pod_sandbox'"):
        narrowed_events(handled, ["stop_pod"])
    for wrong in ("create_container", True, 1.5):
        with pytest.raises(TypeError, match="return None, a list of event handler names"):
            narrowed_events(handled, wrong)


# --- misspelt handlers are refused at start-up ----------------------------------------------


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("create_containers", "did you mean 'create_container'?"),
        ("stop_pod", "did you mean 'stop_pod_sandbox'?"),
        ("post_stop_container", "did you mean 'post_start_container'?"),
        ("synchronise", "did you mean 'synchronize'?"),
        ("shutdwon", "did you mean 'shutdown'?"),
        ("CreateContainer", "did you mean 'create_container'?"),
        ("on_create_container", "did you mean 'create_container'?"),
        ("on_ready", "it matches no handler"),
        ("evict_pod", "it matches no handler"),
        ("update_pod_sandboxes", "did you mean 'update_pod_sandbox'?"),
        ("validate_container_adjustment", "an NRI >= 0.10 event this stub does not subscribe"),
    ],
)
def test_misspelt_handler_is_an_error_at_construction(name, hint):
    plugin = type("Typo", (Recorder,), {name: lambda self, *args: None})()
    with pytest.raises(ValueError, match="plugin methods the stub would never call") as err:
        Stub(plugin, "x", "10")
    assert f"\n  {name}: " in str(err.value) and hint in str(err.value)
    assert "leading underscore" in str(err.value)


def test_helpers_and_data_attributes_are_not_flagged():
    class Helpful(Recorder):
        def _stop_pod(self):  # private: never taken for a handler
            pass

        def start_metrics(self):
            pass

        def cpu_events(self, events):
            pass

    plugin = Helpful()
    plugin.last_container = "c1"  # handler-shaped, but data
    check_handlers(plugin)


def test_handler_name_that_is_not_callable_is_an_error():
    plugin = Recorder()
    plugin.shutdown = False  # a flag shadowing the handler: Shutdown would go unheard
    with pytest.raises(TypeError, match="'shutdown' is an NRI handler name but holds a bool"):
        Stub(plugin, "x", "10")


def test_the_daemons_adapter_is_not_flagged(tmp_path):
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    settings = Settings(sysfs=str(root), state_dir=str(tmp_path / "state"), reserved_cpu_count=2)
    daemon = Daemon(settings, Audit(lambda record: None))
    stub = Stub(daemon.adapter, "cpuplugin", "50")
    # create (4), start (6), update (8), post_update_container (9), stop (10),
    # remove_container (11), run_pod_sandbox (1), remove_pod_sandbox (3), update_pod_sandbox
    # (12; only where the runtime's NRI is >= 0.10)
    assert stub.events == 0x8 | 0x20 | 0x80 | 0x100 | 0x200 | 0x400 | 0x1 | 0x4 | 0x800


# --- NRI 0.10-0.12: the runtime's version, pod updates, per-event methods ---------------------


@pytest.mark.parametrize(
    ("nri", "runtime", "release", "since_0_10", "version"),
    [
        ("v0.12.0", "containerd", "v2.3.4", True, "v0.12.0"),  # said, not inferred
        ("v0.12.0", "fake", "v0", True, "v0.12.0"),
        ("v0.9.1-0.20250219030224-e597e7849f24", "cri-o", "1.33.0", False, "v0.9.1-0.2025"),
        ("", "containerd", "v2.2.0", True, ">= 0.10"),
        ("", "containerd", "2.2.1+unknown", True, ">= 0.10"),
        ("", "containerd", "2.1.9+unknown", False, "< 0.10"),
        ("", "containerd", "1.7.24~ds1", False, "< 0.10"),
        ("0.0.0-unknown", "containerd", "v2.3.0", True, ">= 0.10"),  # no module data: infer
        ("(devel)", "cri-o", "1.34.0", True, ">= 0.10"),
        ("", "cri-o", "1.33.5", False, "< 0.10"),
        ("", "fake", "v9", False, ""),  # unknown runtime: counted as old
        ("", "containerd", "", False, ""),
    ],
)
def test_runtime_nri_is_said_or_inferred(nri, runtime, release, since_0_10, version):
    found = runtime_nri(nri, runtime, release)
    assert found.since_0_10 is since_0_10
    assert found.version.startswith(version)
    assert found.inferred is (version in ("", ">= 0.10", "< 0.10"))
    assert found.valid_events == (0x3FFF if since_0_10 else 0x7FF)


class PodWatcher(Recorder):
    """Also handles the pod-update events of NRI >= 0.10 and a per-event method."""

    def update_pod_sandbox(self, pod, overhead, resources):
        self.seen.append(
            ("update-pod", pod.id, resources.cpu.quota.value, overhead.cpu.shares.value)
        )

    def post_update_pod_sandbox(self, pod):
        self.seen.append(("post-update-pod", pod.id))

    def start_container(self, pod, container):
        self.seen.append(("start", container.id))


def pod_update() -> pb.UpdatePodSandboxRequest:
    request = pb.UpdatePodSandboxRequest(pod=req().pod)
    request.linux_resources.cpu.quota.value = 150000
    request.overhead_linux_resources.cpu.shares.value = 10
    return request


@pytest.mark.parametrize(
    ("said", "runtime", "subscribed"),
    [
        ("v0.12.0", ("containerd", "v2.3.4"), 0x60C | 0x20 | 0x800 | 0x1000),
        ("", ("containerd", "v2.2.1"), 0x60C | 0x20 | 0x800 | 0x1000),
        ("", ("containerd", "2.1.9+unknown"), 0x60C | 0x20),  # 0x1800 would get us dropped
    ],
)
def test_pod_update_events_only_where_the_runtime_knows_them(tmp_path, said, runtime, subscribed):
    async def test(path):
        runtime_, stub, plugin, task = await connected(
            path, PodWatcher(), runtime=runtime, nri_version=said
        )
        assert runtime_.configure_response.events == subscribed
        assert stub.runtime_nri.since_0_10 is bool(subscribed & 0x800)
        if subscribed & 0x800:
            assert (await runtime_.call("UpdatePodSandbox", pod_update())).code == 0
            post = pb.PostUpdatePodSandboxRequest(pod=req().pod)
            assert (await runtime_.call("PostUpdatePodSandbox", post)).code == 0
            assert plugin.seen[-2:] == [
                ("update-pod", "pod1", 150000, 10),
                ("post-update-pod", "pod1"),
            ]
        await shutdown(runtime_, stub, task)

    run(test, tmp_path)


def test_a_plugin_with_only_pod_update_handlers_is_refused_by_an_old_runtime(tmp_path):
    class OnlyPodUpdates:
        def update_pod_sandbox(self, pod, overhead, resources):
            pass

    async def test(path):
        runtime = FakeRuntime(path, runtime=("containerd", "2.1.9+unknown"))
        await runtime.start()
        stub = Stub(OnlyPodUpdates(), "podonly", "50", socket_path=str(path))
        task = asyncio.create_task(stub.run())
        await until(lambda: runtime.configure_reply is not None)
        # A zero mask would subscribe to everything: the stub answers an error instead.
        assert runtime.configure_reply.code == 2
        assert "none of the plugin's events" in runtime.configure_reply.message
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_per_event_methods_and_their_state_change_fallback(tmp_path):
    async def test(path):
        runtime = FakeRuntime(path, nri_version="v0.12.0")
        await runtime.start()
        plugin = PodWatcher()
        stub = Stub(
            plugin, "cpuplugin", "50", socket_path=str(path), unimplemented={"StartContainer"}
        )
        task = asyncio.create_task(stub.run())
        await asyncio.wait_for(runtime.registered.wait(), 5)
        start = pb.StartContainerRequest(pod=req().pod, container=req(cid="s1").container)
        # Handled, but answered UNIMPLEMENTED on request: the runtime then sends StateChange.
        assert (await runtime.call("StartContainer", start)).code == 12
        event = pb.StateChangeEvent(event=6, pod=start.pod, container=start.container)
        assert (await runtime.call("StateChange", event)).code == 0
        removed = pb.RemoveContainerRequest(pod=req().pod, container=req(cid="r1").container)
        assert (await runtime.call("RemoveContainer", removed)).code == 0
        pod_removed = pb.RemovePodSandboxRequest(pod=pb.PodSandbox(id="pod7"))
        assert (await runtime.call("RemovePodSandbox", pod_removed)).code == 0
        # UPDATE_POD_SANDBOX has no StateChange form: one that arrives anyway is ignored.
        bogus = pb.StateChangeEvent(event=12, pod=req().pod)
        assert (await runtime.call("StateChange", bogus)).code == 0
        assert plugin.seen[-3:] == [("start", "s1"), ("remove", "r1"), ("remove-pod", "pod7")]
        await shutdown(runtime, stub, task)

    run(test, tmp_path)


def test_only_per_event_methods_can_be_unimplemented():
    with pytest.raises(ValueError, match=r"unimplemented=\['CreateContainer'\]"):
        Stub(Recorder(), "x", "10", unimplemented=["CreateContainer"])
