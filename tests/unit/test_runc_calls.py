"""The benchmarks' runc counting wrapper (tests/bench/runc_calls.py): it logs each call and
runs the real program with the same arguments; the log is read back by command and target."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench import runc_calls

ID_A = "a" * 64
ID_B = "b" * 64


def test_wrapper_logs_each_call_and_runs_the_real_program(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    real = tmp_path / "real"
    real.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/ran\nexit 3\n')
    real.chmod(0o755)
    wrapper = tmp_path / "runc"
    wrapper.write_text(runc_calls.wrapper(real, log))
    wrapper.chmod(0o755)

    argv = ["--root", "/run/r", "--log", "/x/log.json", "--systemd-cgroup", "update"]
    done = subprocess.run([wrapper, *argv, "--resources=-", ID_A], check=False)
    assert done.returncode == 3  # the real program's status, its arguments unchanged
    assert (tmp_path / "ran").read_text().split() == [*argv, "--resources=-", ID_A]
    middle = runc_calls.log_size(log)
    subprocess.run([wrapper, "--root", "/run/r", "state", ID_B], check=False)

    assert runc_calls.calls(log, 0) == [("update", ID_A), ("state", ID_B)]
    assert runc_calls.calls(log, middle) == [("state", ID_B)]
    assert runc_calls.calls(log, 0, middle) == [("update", ID_A)]


def test_updates_counted_by_target_role() -> None:
    logged = [("update", ID_A), ("update", ID_B), ("update", "c"), ("state", ID_A)]
    logged.append(("update", ID_A))
    roles = {ID_A: "shared", ID_B: "guaranteed"}
    assert runc_calls.updates_by_target(logged, roles) == {
        "shared": 2,
        "guaranteed": 1,
        "other": 1,
    }


def test_no_log_yet_means_no_calls(tmp_path: Path) -> None:
    assert runc_calls.log_size(tmp_path / "none") == 0
    assert runc_calls.calls(tmp_path / "none", 0) == []
