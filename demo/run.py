"""``./dev demo``: the plugin pinning real containers in a private containerd.

The product's first impression, so it lives beside the package, not among the tests; it
borrows the test suite's runtime lab (tests/harness: Debian packages unpacked under .lab,
private containerd instances), which ``./dev demo`` puts on the path.

Sets up containerd 2.1.9 and runc from Debian's archive (cached under .lab/ after the first
run), starts ``nri-cpuplugin run`` against it, and shows from inside the containers what the
plugin does: a Guaranteed 1-CPU container is born on its own CPU, a Burstable neighbour is
moved off that CPU in the same step and gets it back when the Guaranteed one stops.  Tears
everything down at the end, also on failure or Ctrl-C.

``--guest`` shows the same on a production-shaped node instead: the test harness's QEMU guest
with systemd, cgroup v2, 2 sockets and 2 NUMA nodes with SMT (demo/guest_demo.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e2e.daemon import Daemon
from harness.containerd import Containerd
from harness.k8s import ContainerSpec

BOLD, DIM, RESET = "\033[1m", "\033[2m", "\033[0m"


def say(text: str) -> None:
    print(f"\n{BOLD}== {text}{RESET}", flush=True)


def inside(cri, cid: str) -> str:
    """What a process started inside the container sees: its own allowed CPUs."""
    code, out, err = cri.exec_sync(cid, ["grep", "Cpus_allowed_list", "/proc/self/status"])
    if code:
        raise RuntimeError(f"exec in {cid[:12]} failed ({code}): {err.strip()}")
    return out.strip().split()[-1]


def show(cri, pods: dict[str, str]) -> None:
    for label, cid in pods.items():
        print(f"   {label:<34} Cpus_allowed_list (seen from inside): {inside(cri, cid)}")


def main() -> None:
    started = time.monotonic()
    say("containerd 2.1.9 + runc 1.1.5 from Debian's archive, private to this demo")
    with Containerd("2.1") as ctrd, tempfile.TemporaryDirectory() as tmp:
        cri = ctrd.cri()
        print(f"   containerd pid {ctrd.pid}, NRI socket {ctrd.nri_socket}")
        say("nri-cpuplugin run --reserved-cpus 0  (CPU 0 reserved and shared, CPU 1 exclusive)")
        daemon = Daemon(ctrd.nri_socket, Path(tmp) / "state").start()
        try:
            say("a Burstable pod (250m CPU)")
            web = cri.run(
                "web", [ContainerSpec("nginx-like", cpu_request_milli=250, memory="32Mi")]
            )
            show(cri, {"web/nginx-like (Burstable)": web["nginx-like"]})

            say("a Guaranteed pod with 1 CPU: pinned before its first instruction")
            db = cri.run(
                "db",
                [
                    ContainerSpec.guaranteed(
                        "postgres-like",
                        1,
                        command="grep Cpus_allowed_list /proc/self/status; exec sleep infinity",
                    )
                ],
            )
            first = cri.wait_logs(db["postgres-like"], 1)[0]
            print(f"   db/postgres-like's very first output line:  {first.split()[-1]}")
            show(
                cri,
                {
                    "db/postgres-like (Guaranteed, 1 CPU)": db["postgres-like"],
                    "web/nginx-like (Burstable)": web["nginx-like"],
                },
            )

            say("nri-cpuplugin status")
            status = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "nri_cpuplugin.cli",
                    "status",
                    "--state-dir",
                    str(daemon.state_dir),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            print("   " + status.stdout.strip().replace("\n", "\n   "))

            say("stop the Guaranteed container: the Burstable one grows back")
            cri.stop(db["postgres-like"])
            show(cri, {"web/nginx-like (Burstable)": web["nginx-like"]})

            say("audit trail (journald when present; here: JSON lines)")
            for record in daemon.records():
                if record["ACTION"] in ("allocate", "shared-resize", "release"):
                    print(f"   {DIM}ACTION={record['ACTION']:<14}{RESET} {record['MESSAGE']}")
        finally:
            daemon.stop()
        say("tearing down")
    print(f"   done in {time.monotonic() - started:.1f} s; nothing left behind")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="./dev demo",
        description="The plugin pinning real containers: in a private containerd on this "
        "host, or on the test harness's QEMU guest node.",
    )
    parser.add_argument(
        "--guest",
        action="store_true",
        help="run on the test harness's QEMU guest node (systemd, cgroup v2, 2 sockets, "
        "2 NUMA nodes, SMT; a few minutes under emulation)",
    )
    if parser.parse_args().guest:
        from demo.guest_demo import main as guest_main

        guest_main()
    else:
        main()
