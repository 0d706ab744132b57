"""OCI hook benchmarks: one createRuntime invocation, and many at once under the state lock.

The hook is measured as a node runs it: installed the way packaging/README.md says - a venv of
the distribution's ``/usr/bin/python3`` with the package pip-installed (not editable) - and
started as the runtime starts it: the program hooks/*.json names, the state JSON on stdin, the
environment of the hook entry (PATH only).  Two programs are compared, side by side with a bare
start of the same interpreter (``python -c pass``): the launcher ``nri-cpuplugin install-hook``
writes (the default) and pip's ``nri-cpuplugin-hook`` console script.

Containers are fake (a cgroup on the real cgroup v1 hierarchy and a ``sleep`` process each,
tests/harness/runc.py ``CgroupSandbox``) so that only the hook is timed, not runc.  Exclusive
containers belong to a pod with a real network namespace (a veth and a macvlan on the host's
NIC), which the hook inspects for NIC locality as it would on a CRI-O node, and the audit
records go to a real systemd-journald (tests/harness/journald.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import debs
from harness.journald import PrivateJournal
from harness.runc import CgroupSandbox, pod
from netns_util import host_nic, pod_netns

from .stats import percentile, summary

TESTS = Path(__file__).resolve().parents[1]

ROOT = TESTS.parent
SYSTEM_PYTHON = "/usr/bin/python3"
HOOK_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}  # hooks/*.json


class Install:
    """A production-style install of this checkout: venv, pip install, launcher."""

    def __init__(self, lab: Path = debs.LAB) -> None:
        self.dir = lab / "bench-install"
        self.python = self.dir / "venv" / "bin" / "python"
        self.console_script = self.dir / "venv" / "bin" / "nri-cpuplugin-hook"
        self.launcher = self.dir / "bin" / "nri-cpuplugin-hook"

    def build(self) -> Install:
        """(Re)install the current sources; the venv and pip's cache are kept between runs."""
        if not self.python.exists():
            _call([SYSTEM_PYTHON, "-m", "venv", str(self.python.parents[1])])
        # pip builds in the source tree: build from a copy of what the wheel is made of.
        src = self.dir / "src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "nri_cpuplugin", src / "nri_cpuplugin",
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        pip = [str(self.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _call([*pip, str(src)])  # dependencies, the first time
        _call([*pip, "--no-deps", "--force-reinstall", str(src)])  # this checkout's code
        self.launcher.parent.mkdir(exist_ok=True)
        cli = self.python.parent / "nri-cpuplugin"
        _call([str(cli), "install-hook", "--path", str(self.launcher)])
        return self


_built: dict[Path, Install] = {}


def installed(lab: Path = debs.LAB) -> Install:
    """The install of this checkout, built once per benchmark process."""
    if lab not in _built:
        _built[lab] = Install(lab).build()
    return _built[lab]


def _call(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr[-2000:]}")


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


def _args(box: CgroupSandbox) -> list[str]:
    return ["--state-dir", str(box.state_dir), "--reserved-cpus", "0", "createRuntime"]


def bench_hook_latency(samples: int = 200, lab: Path = debs.LAB) -> dict[str, Any]:
    """Wall time of one ``createRuntime`` invocation through each program, next to
    ``python -c pass``.  Each sample starts, for each program in turn, a new container: even
    samples ask for 1 exclusive CPU (the hook reads the pod's netns, pins the CPU and shrinks
    every shared container; the previous exclusive container was stopped first, so the run also
    finds and releases a stale entry), odd ones are burstable (shared pool).
    Returns {"launcher", "console_script", "bare": summary (ms: n, median_ms, p99_ms, max_ms),
    "ratio": {program: {"median", "p99"}}, "interpreter", "shared_containers", "samples"}."""
    install = installed(lab)
    programs = {"launcher": install.launcher, "console_script": install.console_script}
    times: dict[str, list[float]] = {name: [] for name in (*programs, "bare")}
    bare_argv = [str(install.python), "-c", "pass"]
    with CgroupSandbox(lab) as box, pod_netns() as ns, PrivateJournal() as journal:
        env = {**HOOK_ENV, "NRI_CPUPLUGIN_JOURNAL_SOCKET": journal.socket_path}
        ns.add_veth("eth0")
        ns.add_macvlan(host_nic().name, "net1")
        network = [{"type": "network", "path": ns.path}]
        args = _args(box)
        # A few shared containers that every exclusive placement has to rewrite.
        for i in range(4):
            c = box.add(pod(f"shared{i}", "burstable"), "app", millicores=250)
            _check(_run([str(install.launcher), *args], c.state_json(), env))
        previous = None
        for i in range(samples + 2):  # the first two rounds warm the page cache
            exclusive = i % 2 == 0
            took = {"bare": _run(bare_argv, b"", env)[0]}
            for name, program in programs.items():
                if exclusive:
                    if previous is not None:
                        box.stop(previous)  # the runtime removed it; the hook finds it stale
                    c = box.add(pod(f"x{i}{name[0]}"), "work", millicores=1000, limit=1000,
                                namespaces=network)  # fmt: skip
                    previous = c
                else:
                    c = box.add(pod(f"s{i}{name[0]}", "burstable"), "web", millicores=500)
                result = _run([str(program), *args], c.state_json(), env)
                _check(result)
                took[name] = result[0]
                if not exclusive:
                    box.stop(c)
            if i >= 2:
                for name, value in took.items():
                    times[name].append(value)
    result: dict[str, Any] = {name: summary(values) for name, values in times.items()}
    result["ratio"] = {
        name: {
            "median": result[name]["median_ms"] / result["bare"]["median_ms"],
            "p99": result[name]["p99_ms"] / result["bare"]["p99_ms"],
        }
        for name in programs
    }
    result.update(
        interpreter=f"{_in_lab(install.python, lab)} (venv of {SYSTEM_PYTHON} "
        f"{_version(install.python)})",
        shared_containers=4,
        samples=samples,
    )
    return result


def _in_lab(path: Path, lab: Path) -> str:
    """``path`` as the report shows it: relative to the lab (.lab, or NRI_LAB_DIR), so the
    committed docs/benchmarks.md names no directory of the machine it ran on."""
    try:
        return f"<lab>/{path.relative_to(lab)}"
    except ValueError:
        return str(path)


def _version(python: Path) -> str:
    out = subprocess.run([str(python), "-V"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


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
    install = installed(lab)
    env = HOOK_ENV
    totals: list[float] = []
    waits: list[float] = []
    walls: list[float] = []
    succeeded: list[int] = []
    refused: list[int] = []
    with CgroupSandbox(lab) as box:
        argv = [str(install.launcher), *_args(box)]
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
    """``PYTHONPATH=tests python -m bench.bench_hook [--quick]``: print both benchmarks as JSON."""
    quick = "--quick" in sys.argv
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
