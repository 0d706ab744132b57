"""The preconditions every hooks.d e2e test shares: checked up front, failing (never skipping)
with the reason when this host cannot run the test."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from harness import host


def ready_or_fail(
    what: str, prepare: Callable[[], object], reap: Callable[[], list[str]], min_cpus: int = 2
) -> None:
    """Root, ``min_cpus`` online CPUs, ``prepare()`` (unpacking packages, building a rootfs)
    succeeds, and ``reap()`` (what runs killed earlier left behind) leaves nothing."""
    if os.geteuid() != 0:
        pytest.fail(f"{what} e2e tests need root", pytrace=False)
    cpus = host.online_cpus()
    if len(cpus) < min_cpus:
        pytest.fail(f"needs at least {min_cpus} online CPUs, have {cpus}", pytrace=False)
    try:
        prepare()
    except Exception as e:
        pytest.fail(f"preparing {what} failed: {e}", pytrace=False)
    if stale := reap():
        pytest.fail("leftovers of an earlier run could not be removed:\n" + "\n".join(stale))
