"""irqbalance told of the CPUs kept free of interrupts (hardware/interrupts/irqbalance.py), over
restarts of irqbalance that load our environment file: irqbalance is tests/fake_irqbalance.py's
FAKE (its socket, its environment, its banned set), beside a generated sysfs."""

from __future__ import annotations

import pytest
from fake_irqbalance import FakeIrqbalance, short_root
from topologies import build

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware.interrupts import irqbalance

P = CPUSet.parse


@pytest.fixture(
    params=[
        ("single-socket-no-smt", {}),  # nothing of its own: nothing banned
        ("single-socket-no-smt", {"IRQBALANCE_BANNED_CPULIST": "7"}),  # the administrator's
        ("single-socket-no-smt", {"IRQBALANCE_BANNED_CPUS": "80"}),  # the older hex setting
        ("offline-isolcpus", {}),  # isolcpus=2-3,10-11: banned by irqbalance itself
    ],
    ids=["none", "cpulist", "hex", "isolated"],
)
def fake(request):
    name, unit_env = request.param
    with short_root() as root:
        sysfs, topology = build(name, root)
        fake = FakeIrqbalance(sysfs, unit_env)
        yield fake, topology.online
        fake.stop()


def ban(fake: FakeIrqbalance, keep: str) -> str | None:
    return irqbalance.ban(
        P(keep), str(fake.sysfs), str(fake.proc), str(fake.ours), str(fake.sockets)
    )


def test_bans_do_not_ratchet_over_restarts_and_a_lift_restores_its_own(fake):
    fake, online = fake
    own = fake.banned()
    assert ban(fake, "4") is None
    assert fake.banned() & online == own | P("4")
    fake.start()  # restarted: our file is in its environment now
    assert fake.banned() == own | P("4")
    assert ban(fake, "6-7") is None  # the pod on 4 is gone, another keeps 6-7 free
    assert fake.banned() & online == own | P("6-7")
    fake.start()
    assert fake.banned() & online == own | P("6-7")
    assert ban(fake, "") is None  # nothing kept free any more
    assert fake.banned() & online == own
    assert not irqbalance.banning(str(fake.ours))
    fake.start()
    assert fake.banned() == own


def test_a_lift_irqbalance_did_not_hear_is_owed(fake):
    fake, _ = fake
    assert ban(fake, "4") is None
    fake.stop()
    fake.sockets.mkdir(exist_ok=True)
    (fake.sockets / f"irqbalance{fake.pid}.sock").touch()  # a stale socket: nobody listens
    (fake.proc / str(fake.pid)).mkdir()
    assert "irqbalance's socket" in (ban(fake, "") or "")
    assert irqbalance.banning(str(fake.ours))  # tried again at the next look
