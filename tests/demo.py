"""``./dev demo``: the foundation at work, through the real command line.

Shows this machine's topology, then what the static policy decides on it, then the same on a
generated 128-thread EPYC-like sysfs tree.  (The NRI daemon demo with real containerd replaces
this once the daemon exists.)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sysfs_gen import write_sysfs
from topologies import NAMED

CLI = [sys.executable, "-m", "nri_cpuplugin.cli"]


def run(*args: str) -> str:
    shown = " ".join(["nri-cpuplugin", *args])
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, check=False)
    print(f"$ {shown}")
    out = (result.stdout + result.stderr).rstrip()
    print("  " + out.replace("\n", "\n  ") + f"\n  (exit {result.returncode})\n")
    return result.stdout.strip()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="nri-cpuplugin-demo-") as tmp:
        print("== this machine ==")
        run("topology")
        topo_file = Path(tmp, "topology.json")
        topo_file.write_text(_json("/sys"))
        print(f"$ nri-cpuplugin topology --json > {topo_file.name}\n")
        online = _online("/sys")
        run(
            "allocate",
            "--topology",
            str(topo_file),
            "--available",
            online,
            "--reserved",
            "0",
            "--count",
            "1",
        )
        run(
            "allocate",
            "--topology",
            str(topo_file),
            "--available",
            online,
            "--reserved",
            "0",
            "--count",
            "2",
        )

        print("== a generated EPYC-like socket: 64 cores / 128 threads, 4 NUMA nodes, 8-core L3 ==")
        root = Path(tmp, "epyc")
        write_sysfs(NAMED["epyc-1s-4numa"], root)
        run("topology", "--sysfs", str(root))
        everything = "0-127"
        run("allocate", "--sysfs", str(root), "--available", everything, "--count", "16")
        run("allocate", "--sysfs", str(root), "--available", "2-127", "--count", "16")
        run(
            "allocate",
            "--sysfs",
            str(root),
            "--available",
            everything,
            "--count",
            "3",
            "--option",
            "full-pcpus-only",
        )


def _json(sysfs: str) -> str:
    return subprocess.run(
        [*CLI, "topology", "--sysfs", sysfs, "--json"], capture_output=True, text=True, check=True
    ).stdout


def _online(sysfs: str) -> str:
    return Path(sysfs, "devices/system/cpu/online").read_text().strip()


if __name__ == "__main__":
    main()
