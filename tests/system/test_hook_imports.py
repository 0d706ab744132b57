"""The hook starts once per container: it must not load the NRI stack or other heavy modules.

The hook runs with protobuf, grpc, pyroute2, asyncio, orjson, dataclasses, inspect
and argparse made unimportable (``sys.modules[name] = None`` turns any import of them into
ImportError), and must not load typing, threading, socket or hashlib either, through both
entry points, on the allocate (of a container whose pod has a real network namespace, so NIC
locality reads it), refuse and release paths.  Its own program (the launcher and pip's
``nri-cpuplugin-hook``; not ``nri-cpuplugin hook``, whose CLI module needs more) must not load
json, re, enum, contextlib, collections, functools or ctypes either.  Timing is a benchmark
(tests/bench/bench_hook.py), not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.runc import CgroupSandbox, hook_env, pod, sandbox
from netns_util import host_nic, pod_netns

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = (
    "google.protobuf",
    "grpc",
    "pyroute2",
    "asyncio",
    "nri_cpuplugin.nri",
    # Each of these costs the hook more start-up time than its own work (docs/benchmarks.md).
    "orjson",
    "dataclasses",
    "inspect",
    "argparse",
)
# Lighter, but paid on every run if imported: typing (annotations only), threading and socket
# (their C cores _thread and _socket do), hashlib (OpenSSL; the built-in SHA-256 does).  Not
# blocked (the interpreter's own shutdown looks threading up): the run must not load them.
ABSENT = ("typing", "threading", "socket", "hashlib")
# Together these were about 40% of what the hook's program imported (tests/bench): json (the
# hook calls its C accelerator, base/jsonbytes.py), re (str methods and sets do), enum (re's),
# contextlib (base/errors.py ``suppress``, a class for the state lock), collections and
# functools (annotations only; base/value.py ``cached_property``) and ctypes (setns through
# _ctypes, hardware/nic.py).
ABSENT_HOOK = ("json", "re", "enum", "contextlib", "collections", "functools", "ctypes")

# Started as the launcher starts the hook (hook/launcher.py): -I -S, this checkout appended to
# sys.path.  (With site, a venv's .pth files import re, contextlib, collections, functools and
# enum before the hook runs, which would hide the hook's own imports of them.)
WRAPPER = """
import sys
sys.path.append({root!r})
before = set(sys.modules)
for name in {forbidden!r}:
    sys.modules[name] = None  # importing it now raises ImportError
entry = sys.argv.pop(1)
if entry == "cli":  # as the console script does, without importing the CLI's parser first
    from nri_cpuplugin.cli import main
    code = main(sys.argv[1:])
else:
    from nri_cpuplugin.hook.entry import main
    code = main(sys.argv[1:])
loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in
                {{"google", "grpc", "pyroute2", "asyncio"}})
loaded += sorted(m for m in {absent!r} if m in sys.modules and m not in before)
print("loaded:" + " ".join(loaded))  # (not json: the check would load it)
sys.exit(code)
"""


@pytest.fixture
def box() -> Iterator[CgroupSandbox]:
    with sandbox() as fake_node:
        yield fake_node


def _run(
    box: CgroupSandbox, entry: str, stdin: bytes, stage: str, cold: bool = False
) -> tuple[int, list[str], str]:
    absent = ABSENT if entry == "cli" or cold else ABSENT + ABSENT_HOOK
    wrapper = WRAPPER.format(root=str(ROOT), forbidden=FORBIDDEN, absent=absent)
    argv = [sys.executable, "-I", "-S", "-c", wrapper, entry]
    if entry == "cli":
        argv.append("hook")
    argv += ["--state-dir", str(box.state_dir), "--reserved-cpus", "0", stage]
    env = dict(item.split("=", 1) for item in hook_env(box.lab))
    proc = subprocess.run(argv, input=stdin, capture_output=True, env=env, check=False)
    lines = [x for x in proc.stdout.decode().splitlines() if x.startswith("loaded:")]
    loaded = lines[-1].removeprefix("loaded:").split() if lines else None
    return proc.returncode, loaded, proc.stderr.decode()


@pytest.mark.parametrize(
    "entry", ["cli", "hook"], ids=["nri-cpuplugin-hook-subcommand", "nri-cpuplugin-hook-script"]
)
def test_hook_paths_do_not_import_heavy_modules(box: CgroupSandbox, entry: str) -> None:
    if len(host.online_cpus()) < 2:
        pytest.fail("needs 2 CPUs")
    with pod_netns() as ns:
        ns.add_macvlan(host_nic().name, "net1")  # stacked: its lower device is looked up too
        network = [{"type": "network", "path": ns.path}]
        first = box.add(pod("a"), "a", millicores=1000, limit=1000, namespaces=network)
        second = box.add(pod("b"), "b", millicores=1000, limit=1000)
        # The first run on a node discovers the topology (through pathlib, which imports re
        # and more) and caches it for every later one (hook/topology_cache.py).
        warm = box.add(pod("w", "burstable"), "w", millicores=100)
        code, loaded, err = _run(box, entry, warm.state_json(), "createRuntime", cold=True)
        assert code == 0, err
        assert loaded == [], f"heavy modules loaded: {loaded}"
        for container, stage, want in (
            (first, "createRuntime", 0),  # allocate, reading the pod's netns
            (second, "createRuntime", 1),  # refuse
        ):
            code, loaded, err = _run(box, entry, container.state_json(), stage)
            assert code == want, err
            assert loaded == [], f"heavy modules loaded: {loaded}"
            if container is first:  # the namespace was read, net1 traced to its device
                [note] = [r for r in map(json.loads, err.splitlines()) if
                          r["ACTION"] == "nic-locality"]  # fmt: skip
                assert "net1" in note["MESSAGE"], note
    box.stop(first)
    code, loaded, err = _run(box, entry, first.state_json("stopped"), "poststop")
    assert code == 0, err
    assert loaded == []
