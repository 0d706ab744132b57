"""Fixtures for the tests that run a real CRI-O 1.36.3 (NRI 0.11) through CRI.

* ``crio`` - a started, private CRI-O per test (function scope: tests restart and kill it;
  start-up is well under a second).  Teardown removes every pod, process, mount and cgroup.
* ``make_crio`` - the same with options (NRI timeouts, plugins or hooks placed before start,
  ``nri=False``, config overrides); every instance made is torn down after the test.
* ``crio_cri`` - the CRI client of ``crio``.
* ``oci_runtime`` (tests/e2e/conftest.py): runc; ``e2e/runtimes.CRIO_BOTH`` runs a test on
  runc and on crun 1.8.1 as CRI-O's default runtime handler.

A CRI-O that cannot be prepared or started fails the test with its log's reason and tail;
nothing here ever skips.  Failing tests get the CRI-O log tail attached to their report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import crio as crio_harness
from harness.cri import CRIClient
from harness.crio import Crio


@pytest.fixture(scope="session")
def crio_lab(lab: Path) -> Path:
    """The containerd lab (packages, images, CRI stubs, stale instances reaped) plus CRI-O's
    verified binaries, conmon and runc, and the CRI-O instances killed runs left behind."""
    error = None
    try:
        crio_harness.prepare(lab)
    except Exception as e:
        error = f"preparing CRI-O {crio_harness.VERSION} in {lab} failed: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    if stale := crio_harness.reap_stale(lab):
        pytest.fail("leftovers of an earlier CRI-O run could not be removed:\n" + "\n".join(stale))
    return lab


@pytest.fixture
def make_crio(
    request: pytest.FixtureRequest, crio_lab: Path, oci_runtime: str
) -> Iterator[Callable[..., Crio]]:
    """``make_crio(start=True, **options)`` -> a Crio on ``oci_runtime`` (runc unless the test
    runs on both, e2e/runtimes.py); all are torn down after the test."""
    made: list[Crio] = []
    request.node._crios = made  # for the failure report below

    def make(*, start: bool = True, **options: Any) -> Crio:
        instance = Crio(lab=crio_lab, **{"runtime": oci_runtime, **options})
        made.append(instance)
        if start:
            try:
                instance.start()
                error = None
            except Exception as e:
                error = f"CRI-O {crio_harness.VERSION} ({oci_runtime}) did not start: {e}"
            if error:  # fail outside the except block: the message is the whole story
                pytest.fail(error, pytrace=False)
        return instance

    yield make
    problems = []
    for instance in made:
        problems += instance.teardown()
    if problems:
        pytest.fail("teardown left things behind:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture
def crio(make_crio: Callable[..., Crio]) -> Crio:
    return make_crio()


@pytest.fixture
def crio_cri(crio: Crio) -> CRIClient:
    return crio.cri()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for instance in getattr(item, "_crios", []):
            report.sections.append(
                (f"CRI-O {instance.version} log ({instance.dir.name})", instance.log_tail(60))
            )
