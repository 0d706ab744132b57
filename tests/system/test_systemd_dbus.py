"""Our D-Bus client (hardware/systemd/units.py) against a real dbus-daemon and a FAKE systemd.

The bus is Debian's dbus-daemon, a private instance with the system bus's reply limit
(tests/fake_systemd.py); the FAKE systemd on it (NOT systemd: systemd cannot be PID 1 on this
host) records every SetUnitProperties call it gets, decoded by jeepney, and answers as systemd
does.  What only real systemd can show (the scope's AllowedCPUs, cpuset.cpus after a
daemon-reload, the drop-ins) is left to the guest node's tests (docs/cgroups-and-hooks.md §21).
Every wait is on a condition; timeouts are failure bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_systemd import DENY_SET_UNIT_PROPERTIES, FakeSystemd, PrivateBus

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware.systemd import units as su
from nri_cpuplugin.hardware.systemd.client import SystemdClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bus() -> Iterator[PrivateBus]:
    with PrivateBus() as private_bus:
        yield private_bus


@pytest.fixture
def fake(bus: PrivateBus) -> Iterator[FakeSystemd]:
    with FakeSystemd(bus, private=os.path.join(bus.dir.name, "private")) as systemd:
        yield systemd


def test_calls_arrive_with_the_unit_names_and_bitmasks(bus: PrivateBus, fake: FakeSystemd) -> None:
    paths = [
        "kubepods-burstable-pod1_2.slice:cri-containerd:" + "ab" * 32,
        "kubepods-pod3.slice:crio:" + "cd" * 32,
    ]
    changes = [
        (su.unit_name(paths[0]), CPUSet.parse("0,2-3,9"), CPUSet.parse("0")),
        (su.unit_name(paths[1]), CPUSet.parse("1-63"), None),
    ]
    with SystemdClient(bus.socket) as client:
        results = client.set_allowed(changes, 10)
    assert [r.outcome for r in results] == [su.SET, su.SET]
    calls = fake.wait_calls(2)
    assert calls[0]["unit"] == "cri-containerd-" + "ab" * 32 + ".scope"
    assert calls[0]["runtime"] is True
    assert calls[0]["properties"] == [
        ["AllowedCPUs", "ay", "0d02"],
        ["AllowedMemoryNodes", "ay", "01"],
    ]
    assert calls[1]["unit"] == "crio-" + "cd" * 32 + ".scope"
    assert calls[1]["properties"] == [["AllowedCPUs", "ay", "feffffffffffffff"]]


def test_hundreds_of_pipelined_calls_stay_under_the_bus_reply_limit(
    bus: PrivateBus, fake: FakeSystemd
) -> None:
    # dbus-daemon allows 128 pending calls per connection here, as on the system bus: 300 at
    # once would get LimitsExceeded without the client's window
    changes = [(f"crio-{i:04d}.scope", {i % 2}, {0}) for i in range(300)]
    with SystemdClient(bus.socket) as client:
        results = client.set_allowed(changes, 30)
        assert {r.outcome for r in results} == {su.SET}, [r for r in results if not r.ok][:3]
        calls = fake.wait_calls(300)
        assert [c["unit"] for c in calls] == [c[0] for c in changes]  # in order
        again = client.set_allowed(changes[:100], 30)  # the connection is kept
        assert {r.outcome for r in again} == {su.SET}


def test_answers_are_per_unit(bus: PrivateBus, fake: FakeSystemd) -> None:
    changes = [
        ("crio-a.scope", {1}, None),
        ("crio-b-gone.scope", {1}, None),  # the container went away meanwhile
        ("crio-c-denied.scope", {1}, None),  # refused as polkit refuses
        ("crio-d-oldsystemd.scope", {1}, None),  # systemd < 244
        ("../etc.scope", {1}, None),  # never put on the bus
        ("crio-e.scope", {1}, None),
    ]
    with SystemdClient(bus.socket) as client:
        results = client.set_allowed(changes, 10)
    assert [r.outcome for r in results] == [
        su.SET,
        su.GONE,
        su.DENIED,
        su.FAILED,
        su.FAILED,
        su.SET,
    ]
    assert [r.ok for r in results] == [True, True, False, False, False, True]
    assert "run nri-cpuplugin as root" in str(results[2].error)
    assert "systemd 244" in str(results[3].error)
    assert [c["unit"] for c in fake.wait_calls(5)] == [c[0] for c in changes if c[0][0] != "."]


def test_the_bus_policy_refusing_us_is_a_clear_error() -> None:
    with PrivateBus(DENY_SET_UNIT_PROPERTIES) as bus, FakeSystemd(bus) as fake:
        with SystemdClient(bus.socket) as client:
            [result] = client.set_allowed([("crio-a.scope", {1}, None)], 10)
        assert result.outcome == su.DENIED
        message = str(result.error)
        assert "org.freedesktop.DBus.Error.AccessDenied" in message
        assert "uid 0" in message and "org.freedesktop.systemd1.conf" in message
        assert fake.calls() == []  # the bus stopped it


def test_no_systemd_on_the_bus(bus: PrivateBus) -> None:
    with SystemdClient(bus.socket) as client:
        [result] = client.set_allowed([("crio-a.scope", {1}, None)], 10)
    assert result.outcome == su.UNREACHABLE
    assert "not the init system" in str(result.error)


def test_a_hung_systemd_leaves_the_calls_pending_within_the_deadline(
    bus: PrivateBus, fake: FakeSystemd
) -> None:
    with SystemdClient(bus.socket) as client:
        assert client.set_allowed([("crio-warm.scope", {1}, None)], 10)[0].outcome == su.SET
        fake.stall()
        try:
            started = time.monotonic()
            results = client.set_allowed([(f"crio-{i}.scope", {1}, None) for i in range(10)], 0.5)
            elapsed = time.monotonic() - started
            assert {r.outcome for r in results} == {su.PENDING}  # sent: not the runtime's
            assert elapsed < 0.5 + 2.0  # the deadline, plus scheduling on a busy machine
        finally:
            fake.resume()
        # the calls were queued, not lost: systemd applies them late, in order, and the
        # connection goes on; their answers are read while the next call waits for its own
        assert [c["unit"] for c in fake.wait_calls(11)[1:]] == [
            f"crio-{i}.scope" for i in range(10)
        ]
        assert client.set_allowed([("crio-after.scope", {2}, None)], 10)[0].outcome == su.SET
        late = client.take_late()
        assert [r.unit for r in late] == [f"crio-{i}.scope" for i in range(10)]
        assert {r.outcome for r in late} == {su.SET}


def test_systemds_private_socket_peer_to_peer(bus: PrivateBus, fake: FakeSystemd) -> None:
    path = os.path.join(bus.dir.name, "private")
    with SystemdClient(path, hello=False) as client:
        results = client.set_allowed([(f"crio-{i}.scope", {i}, None) for i in range(100)], 10)
    assert {r.outcome for r in results} == {su.SET}
    assert len(fake.wait_calls(100)) == 100


HOOK_LIKE = """
import sys
sys.path.append({root!r})
before = set(sys.modules)
from nri_cpuplugin.hardware.systemd.client import SystemdClient
with SystemdClient({socket!r}) as client:
    [result] = client.set_allowed([("crio-hook.scope", {{1}}, {{0}})], 10)
loaded = sorted(m for m in {absent!r} if m in sys.modules and m not in before)
print(result.outcome, "loaded:" + ",".join(loaded))
"""
# what tests/system/test_hook_imports.py keeps off the OCI hook's path
ABSENT = (
    "socket",
    "asyncio",
    "threading",
    "typing",
    "json",
    "re",
    "enum",
    "contextlib",
    "collections",
    "functools",
    "ctypes",
    "selectors",
)


def test_the_hooks_client_loads_nothing_the_hook_may_not(
    bus: PrivateBus, fake: FakeSystemd
) -> None:
    program = HOOK_LIKE.format(root=str(ROOT), socket=bus.socket, absent=ABSENT)
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", program], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["set", "loaded:"]


def test_connecting_ahead_waits_for_hello(bus: PrivateBus, fake: FakeSystemd) -> None:
    with SystemdClient(bus.socket) as client:
        assert client.connect(10) is None
        assert client.conversation.name.startswith(":")  # the bus's answer to Hello
        assert client.set_allowed([("crio-a.scope", {1}, None)], 10)[0].outcome == su.SET
