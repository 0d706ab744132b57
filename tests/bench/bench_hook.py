"""OCI hook benchmarks: one createRuntime invocation, and many at once under the state lock.

Measured on the real cgroup hierarchy of this machine with fake containers (a cgroup and a
``sleep`` process each, tests/harness/runc.py ``CgroupSandbox``) so that only the hook is
timed, not runc.  The hook is started as the runtime starts it: an executable whose shebang
names the interpreter, the state JSON on stdin, the environment given in the hook entry.

Bytecode: an installed package has its .pyc files; a developer shell often sets
PYTHONDONTWRITEBYTECODE, which would make every hook run compile the package.  Both the hook
and the bare interpreter run with PYTHONPYCACHEPREFIX pointing into the lab (warmed first),
and without PYTHONDONTWRITEBYTECODE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .stats import percentile, summary

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from harness import debs  # noqa: E402
from harness.runc import CgroupSandbox, hook_program, pod  # noqa: E402


def _env(lab: Path) -> dict[str, str]:
    env = {"PYTHONPYCACHEPREFIX": str(lab / "pycache")}
    return env


def _run(argv: list[str], stdin: bytes, env: dict[str, str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    proc = subprocess.run(argv, input=stdin, capture_output=True, env=env, check=False)
    return time.perf_counter() - started, proc.returncode, proc.stderr.decode(errors="replace")


def _lock_waits(stderr: str) -> list[float]:
    """LOCK_WAIT_MS of the hook's audit records (they go to stderr without a journal)."""
    waits = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "LOCK_WAIT_MS" in record:
                waits.append(float(record["LOCK_WAIT_MS"]) / 1000)
    return waits


def bench_hook_latency(samples: int = 200, lab: Path = debs.LAB) -> dict[str, Any]:
    """Wall time of one ``createRuntime`` invocation, next to ``python -c pass``.

    Each sample is a new container: even samples ask for 1 exclusive CPU (the hook pins it
    and shrinks every shared container), odd ones are burstable (shared pool).  The previous
    exclusive container is stopped first, so each run also finds and releases a stale entry.
    Returns {"hook": summary, "bare": summary, "ratio_median", "ratio_p99", "interpreter",
    "shared_containers", "samples"} (summaries in ms: n, median_ms, p99_ms, max_ms).
    """
    env = _env(lab)
    python = sys.executable
    hook_times: list[float] = []
    bare_times: list[float] = []
    with CgroupSandbox(lab) as box:
        program = hook_program(box.dir / "bin")
        argv = [
            str(program),
            "--state-dir",
            str(box.state_dir),
            "--reserved-cpus",
            "0",
            "createRuntime",
        ]
        # A few shared containers that every exclusive placement has to rewrite.
        for i in range(4):
            c = box.add(pod(f"shared{i}", "burstable"), "app", millicores=250)
            _check(_run(argv, c.state_json(), env))
        # Warm: bytecode cache written, page cache hot.
        for _ in range(3):
            _run([python, "-c", "pass"], b"", env)
        previous = None
        for i in range(samples + 2):
            exclusive = i % 2 == 0
            if exclusive:
                if previous is not None:
                    box.stop(previous)  # the runtime removed it; the hook finds it stale
                c = box.add(pod(f"x{i}"), "work", millicores=1000, limit=1000)
                previous = c
            else:
                c = box.add(pod(f"s{i}", "burstable"), "web", millicores=500)
            bare = _run([python, "-c", "pass"], b"", env)[0]
            took, code, err = _run(argv, c.state_json(), env)
            _check((took, code, err))
            if i >= 2:  # the first two runs are warm-up
                hook_times.append(took)
                bare_times.append(bare)
            if not exclusive:
                box.stop(c)
    hook = summary(hook_times)
    bare = summary(bare_times)
    return {
        "hook": hook,
        "bare": bare,
        "ratio_median": hook["median_ms"] / bare["median_ms"],
        "ratio_p99": hook["p99_ms"] / bare["p99_ms"],
        "interpreter": python,
        "shared_containers": 4,
        "samples": len(hook_times),
    }


def bench_hook_contention(
    concurrent: int = 32, rounds: int = 3, exclusive: bool = False, lab: Path = debs.LAB
) -> dict[str, Any]:
    """``concurrent`` hook invocations started at once, each for its own new container.

    ``exclusive=False``: burstable containers (every invocation succeeds and commits);
    ``exclusive=True``: each asks for 1 exclusive CPU, as the concurrency e2e test does (as
    many succeed as there are free CPUs, the rest are refused).  Per round: total wall time
    from the first start to the last exit, the longest lock wait any invocation reported, and
    per-invocation wall times.  Returns {"concurrent", "rounds", "exclusive", "total_ms":
    [per round], "total_median_ms", "longest_lock_wait_ms", "lock_wait": summary,
    "invocation": summary, "succeeded": [per round], "refused": [per round]}.
    """
    env = _env(lab)
    totals: list[float] = []
    waits: list[float] = []
    walls: list[float] = []
    succeeded: list[int] = []
    refused: list[int] = []
    with CgroupSandbox(lab) as box:
        program = hook_program(box.dir / "bin")
        argv = [
            str(program),
            "--state-dir",
            str(box.state_dir),
            "--reserved-cpus",
            "0",
            "createRuntime",
        ]
        _run([sys.executable, "-c", "pass"], b"", env)
        for r in range(rounds):
            containers = [
                box.add(
                    pod(f"r{r}c{i}", "guaranteed" if exclusive else "burstable"),
                    "app",
                    millicores=1000 if exclusive else 500,
                    limit=1000 if exclusive else None,
                )
                for i in range(concurrent)
            ]
            started = time.perf_counter()
            procs = [
                (
                    subprocess.Popen(
                        argv,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        env=env,
                    ),
                    c,
                    time.perf_counter(),
                )
                for c in containers
            ]
            for proc, c, _ in procs:
                proc.stdin.write(c.state_json())
                proc.stdin.close()
            ok = bad = 0
            for proc, _, t0 in procs:
                err = proc.stderr.read().decode(errors="replace")
                code = proc.wait()
                walls.append(time.perf_counter() - t0)
                waits.extend(_lock_waits(err))
                if code == 0:
                    ok += 1
                elif "nri-cpuplugin:" in err:
                    bad += 1
                else:
                    raise RuntimeError(f"hook failed unexpectedly ({code}): {err[-500:]}")
            totals.append(time.perf_counter() - started)
            succeeded.append(ok)
            refused.append(bad)
            for c in containers:
                box.stop(c)
    return {
        "concurrent": concurrent,
        "rounds": rounds,
        "exclusive": exclusive,
        "total_ms": [t * 1e3 for t in totals],
        "total_median_ms": percentile(totals, 50) * 1e3,
        "longest_lock_wait_ms": max(waits) * 1e3 if waits else 0.0,
        "lock_wait": summary(waits) if waits else None,
        "invocation": summary(walls),
        "succeeded": succeeded,
        "refused": refused,
    }


def _check(result: tuple[float, int, str]) -> None:
    took, code, err = result
    if code:
        raise RuntimeError(f"hook failed ({code}) after {took * 1e3:.0f} ms: {err[-800:]}")


def main() -> None:
    """``python -m tests.bench.bench_hook [--quick]``: print both benchmarks as JSON."""
    quick = "--quick" in sys.argv
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    latency = bench_hook_latency(samples=40 if quick else 200)
    shared = bench_hook_contention(rounds=1 if quick else 3)
    exclusive = bench_hook_contention(rounds=1 if quick else 3, exclusive=True)
    print(
        json.dumps(
            {"latency": latency, "contention_shared": shared, "contention_exclusive": exclusive},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
