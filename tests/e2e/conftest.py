"""Fixtures for tests that run real containerd (1.7, 2.1 and 2.3) through CRI, with NRI enabled.

* ``containerd`` - a started, private containerd per test, parametrized over every version
  (ids ``containerd-1.7`` / ``containerd-2.1`` / ``containerd-2.3``).  Function scope: a test
  may restart or kill it, and start-up is ~0.2 s.  Teardown removes every pod, process, mount
  and cgroup it made.
* ``make_containerd`` - the same, with options (NRI timeouts, plugins placed before start...).
* ``cri`` - the CRI client of ``containerd``.
* ``oci_runtime`` - the OCI runtime the instances run: runc.  The tests ``e2e/runtimes.py``'s
  marks parametrize run once more with crun 1.8.1 (harness/crun.py).

A runtime that cannot be prepared or started fails the test with the reason and the
containerd log tail; nothing here ever skips.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import cri as cri_mod
from harness import crun, debs, image
from harness.containerd import Containerd, bin_dir, reap_stale
from harness.packages import RUNC

from e2e.daemon import Daemon
from e2e.runtimes import CONTAINERD_VERSIONS


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: runs real container runtimes (root, Linux)")


@pytest.fixture(scope="session")
def lab() -> Path:
    """Everything slow, done once and cached on disk: packages unpacked, images built, CRI
    stubs generated.  Also cleans up after earlier runs that were killed mid-test."""
    if os.geteuid() != 0:
        pytest.fail("e2e tests run containerd and need root", pytrace=False)
    error = None
    try:
        for version in CONTAINERD_VERSIONS:
            bin_dir(version)  # unpacked and checked against the pins
        debs.unpack(RUNC)
        crun.binary()
        image.images_tar()
        cri_mod.stubs()
    except Exception as e:
        error = f"preparing the runtime lab in {debs.LAB} failed: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    if stale := reap_stale():
        pytest.fail("leftovers of an earlier run could not be removed:\n" + "\n".join(stale))
    return debs.LAB


@pytest.fixture(params=CONTAINERD_VERSIONS, ids=lambda v: f"containerd-{v}")
def containerd_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def oci_runtime() -> str:
    """runc: every test's OCI runtime; the ``crun`` marker parametrizes this fixture."""
    return "runc"


@pytest.fixture
def make_containerd(
    request: pytest.FixtureRequest, lab: Path, containerd_version: str, oci_runtime: str
) -> Iterator[Callable[..., Containerd]]:
    """``make_containerd(start=True, **options)`` -> a Containerd of this test's version;
    every instance made is torn down after the test, whatever happened."""
    made: list[Containerd] = []
    request.node._containerds = made  # for the failure report below

    def make(*, start: bool = True, **options: Any) -> Containerd:
        ctrd = Containerd(containerd_version, lab=lab, **{"runtime": oci_runtime, **options})
        made.append(ctrd)
        if start:
            try:
                ctrd.start()
                error = None
            except Exception as e:
                error = f"containerd {containerd_version} ({oci_runtime}) did not start: {e}"
            if error:  # fail outside the except block: the message is the whole story
                pytest.fail(error, pytrace=False)
        return ctrd

    yield make
    problems = []
    for ctrd in made:
        problems += ctrd.teardown()
    if problems:
        pytest.fail("teardown left things behind:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture
def containerd(make_containerd: Callable[..., Containerd]) -> Containerd:
    return make_containerd()


@pytest.fixture
def cri(containerd: Containerd) -> cri_mod.CRIClient:
    return containerd.cri()


@pytest.fixture
def daemon(containerd: Containerd, tmp_path: Path) -> Iterator[Daemon]:
    """``nri-cpuplugin run`` connected to ``containerd`` (reserved CPU 0), synchronized."""
    process = Daemon(containerd.nri_socket, tmp_path / "state")
    process.start()
    yield process
    process.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    # A failing e2e test is much easier to read with what containerd said meanwhile.
    if report.failed:
        for ctrd in getattr(item, "_containerds", []):
            report.sections.append(
                (f"containerd {ctrd.version} log ({ctrd.dir.name})", ctrd.log_tail(60))
            )
