"""Fixtures for the tests that run on the guest node (harness/guest.py): a QEMU guest with
systemd as PID 1, cgroup v2, 2 sockets x 2 cores x 2 threads on 2 NUMA nodes, and the
runtimes on the systemd cgroup driver.

* ``guest`` (session) - booted when the first test that needs it starts (the image is built
  first if it is not cached), powered off at the end of the session.  One boot serves every
  guest test: a boot takes about a minute under emulation.  Bookworm's unless a test names
  trixie's (``ON_BOTH``: ``pytest.mark.parametrize("guest", ON_BOTH, indirect=True)``); the
  root conftest puts the trixie tests last, and pytest powers the bookworm guest off before it
  boots the trixie one (a session fixture is set up again when its parameter changes), so one
  guest runs at a time and each boots once.
* ``node`` (session) - the guest as a Kubernetes node (harness/guest_node.py).
* ``runtime_name`` / ``on_runtime`` - the node's runtime for one test: its pods are removed and
  the daemon stopped after the test, whatever happened.
* ``daemon_node`` / ``placing_runtime`` - containerd 2.3.4 with the daemon, or ``runtime_name``
  with the project placing containers (the daemon, or CRI-O's OCI hook), kept from one
  scenario to the next; the node is cleared after the module.

The root conftest runs these tests after every other test of the session: the guest keeps
both host CPUs busy, which timing-sensitive host tests must not share.  A guest or runtime
that cannot be started fails the test with the reason and the console's or the journal's
tail; nothing here skips.  A failing test's report carries the guest console's tail and the
journals of the runtime and the daemon.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import guest_image, guest_runtimes, guest_vm
from harness.guest import Guest
from harness.guest_node import DAEMON_UNIT, GuestNode
from harness.guest_runtimes import GuestRuntime

RUNTIMES = ("containerd-2.3", "containerd-1.7", "crio")
SCENARIO_RUNTIME = "containerd-2.3"  # test_pinning.py's and test_irq.py's runtime
# The ``guest`` fixture's parameter: its suite.  Bookworm's is None, as for the tests that do
# not parametrize it, so that both share one boot (pytest keeps a session fixture while the
# parameter it is asked for equals the cached one: None for an unparametrized request).
SUITE_PARAM = {"bookworm": None, "trixie": "trixie"}


def on_guest(suite: str, *values: object) -> Any:
    """One case of ``parametrize(("guest", ...), [...], indirect=["guest"], scope="session")``:
    the guest of ``suite`` and the other arguments' ``values``.  ``scope="session"`` is needed:
    with direct arguments beside the indirect one pytest takes the test's scope, and powers the
    guest off after the test when that test booted it."""
    return pytest.param(SUITE_PARAM[suite], *values, id="-".join(map(str, (suite, *values))))


ON_BOTH = (on_guest("bookworm"), on_guest("trixie"))

# The session's guest and node, for the failure reports below (fixtures are not reachable
# from a report hook).
_session: dict[str, object] = {}


def pytest_report_header(config: pytest.Config) -> str:
    _, reason = guest_vm.accelerator()
    return f"guest node: {reason}"


def _say(config: pytest.Config, text: str) -> None:
    """A line in the test output even without -s: which accelerator, how long things took."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(f"[guest] {text}")
        return
    with capture.global_and_fixture_disabled():  # output is captured while fixtures run
        reporter.write_line(f"[guest] {text}")


@pytest.fixture(scope="session")
def guest(request: pytest.FixtureRequest) -> Iterator[Guest]:
    if os.geteuid() != 0:
        pytest.fail("the guest node needs root (QEMU, debootstrap, 9p shares)", pytrace=False)
    recipe = guest_image.RECIPES[getattr(request, "param", None) or "bookworm"]
    say = lambda text: _say(request.config, f"{recipe.suite}: {text}")  # noqa: E731
    error = None
    try:
        if stale := guest_vm.reap_stale():
            error = "leftovers of an earlier guest could not be removed:\n" + "\n".join(stale)
        else:
            started = time.monotonic()
            guest_runtimes.prepare()
            say(f"runtimes and images prepared in the lab in {time.monotonic() - started:.1f} s")
    except Exception as e:
        error = f"preparing the guest node's lab failed: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    boot = Guest.boot(log=say, recipe=recipe)
    try:
        booted = boot.__enter__()
    except Exception as e:
        error = str(e)
    if error:
        pytest.fail(error, pytrace=False)
    _session["guest"] = booted
    try:
        yield booted
    finally:
        say(_budget_misses(_session.get("node")))
        _session.clear()
        boot.__exit__(None, None, None)
        say("guest powered off")


def _budget_misses(node: object) -> str:
    """The whole boot's count of requests the daemon did not decide within its budget (each
    test judges its own window; this line is the figure for a run of the suite)."""
    if not isinstance(node, GuestNode):
        return "no daemon ran on this boot"
    try:
        missed = node.daemon_records("deadline")
    except Exception as e:  # the guest may be what failed
        return f"the daemon's budget misses could not be counted: {e}"
    lines = "".join(f"\n  {r.get('MESSAGE')}" for r in missed)
    return f"{len(missed)} budget misses in the daemon's log on this boot{lines}"


@pytest.fixture(scope="session")
def node(guest: Guest) -> GuestNode:
    made = GuestNode(guest)
    _session["node"] = made
    return made


@pytest.fixture
def on_runtime(node: GuestNode, runtime_name: str) -> Iterator[GuestRuntime]:
    """``runtime_name`` running as the node's runtime; after the test its pods are gone and
    the daemon stopped (the next test starts from a clean node)."""
    error = None
    try:
        started = time.monotonic()
        runtime = node.use(runtime_name)
        ready = time.monotonic() - started
    except Exception as e:
        error = f"{runtime_name} could not be made the node's runtime: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    print(f"{runtime_name} ready in {ready:.1f} s")
    yield runtime
    if problems := node.clear():
        pytest.fail(f"removing the pods of {runtime_name} failed: {problems}", pytrace=False)


@pytest.fixture(scope="module")
def cleared_after_module(node: GuestNode) -> Iterator[None]:
    """The node cleared (pods removed, daemon stopped) once a module of scenarios is done."""
    yield
    if problems := node.clear():
        pytest.fail(f"removing the module's pods failed: {problems}", pytrace=False)


def _placing(node: GuestNode, name: str) -> GuestRuntime:
    error = None
    try:
        started = time.monotonic()
        runtime = node.placing(name)
        ready = time.monotonic() - started
    except Exception as e:
        error = f"{name} with the project placing containers could not be started: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    print(f"{name} and its placement ready in {ready:.1f} s")
    return runtime


@pytest.fixture
def daemon_node(node: GuestNode, cleared_after_module: None) -> GuestRuntime:
    """containerd 2.3.4 with the daemon, kept from one scenario to the next (a daemon start
    under emulation takes tens of seconds: one per module unless a scenario on another
    runtime came between); each scenario removes its own pods."""
    return _placing(node, SCENARIO_RUNTIME)


@pytest.fixture
def placing_runtime(node: GuestNode, cleared_after_module: None, runtime_name: str) -> GuestRuntime:
    """``runtime_name`` with the project placing its containers (``GuestNode.placing``: the
    daemon over NRI, or the OCI hook for ``crio-hooks``), kept like ``daemon_node``."""
    return _placing(node, runtime_name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed or "guest" not in item.keywords:
        return
    guest = _session.get("guest")
    node = _session.get("node")
    try:
        if isinstance(node, GuestNode):
            report.sections.append(("runtime journal", node.log()))
            report.sections.append(("daemon journal", node.journal(DAEMON_UNIT, 60)))
        if isinstance(guest, Guest):
            report.sections.append(("guest console", guest.console_tail(80)))
    except Exception as e:  # the guest may be what failed: the report must still be written
        report.sections.append(("guest", f"could not collect the guest's logs: {e}"))
