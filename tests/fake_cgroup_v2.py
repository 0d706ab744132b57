"""A FAKE cgroup v2 mount (plain files in a temp directory), for the cgroup v2 code paths this
machine cannot run for real (its cgroup v1 hierarchy is not ours to move)."""

from __future__ import annotations

from pathlib import Path

from nri_cpuplugin.hardware import cgroupfs
from nri_cpuplugin.hardware.cgroupfs import CgroupFS


class FakeV2:
    """A fake cgroup2 mount: ``mk`` creates cgroup directories with their cpuset files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        for name, value in {
            "cgroup.controllers": "cpuset cpu memory",
            "cgroup.subtree_control": "cpuset cpu memory",
            "cpuset.cpus.effective": "0-3",
            "cpuset.mems.effective": "0-1",
        }.items():
            (root / name).write_text(value + "\n")

    def mk(
        self,
        path: str,
        cpus: str = "",
        mems: str = "",
        effective: str = "0-3",
        mems_effective: str = "0-1",
        populated: bool = True,
        cpu_max: str = "max 100000",
    ) -> Path:
        d = self.root / path.strip("/")
        parent = d.parent
        if not parent.exists():  # ancestors as a fresh v2 cgroup: empty (inheriting) values
            self.mk(str(parent.relative_to(self.root)))
        d.mkdir(exist_ok=True)
        files = {
            "cpuset.cpus": cpus,
            "cpuset.mems": mems,
            "cpuset.cpus.effective": effective,
            "cpuset.mems.effective": mems_effective,
            "cgroup.events": f"populated {int(populated)}\nfrozen 0",
            "cgroup.procs": "4242" if populated else "",
            "cpu.max": cpu_max,
        }
        for name, value in files.items():
            (d / name).write_text(value + "\n")
        return d

    def read(self, path: str, name: str) -> str:
        return (self.root / path.strip("/") / name).read_text().strip()

    def fs(self) -> CgroupFS:
        return CgroupFS(cgroupfs.detect(str(self.root)))


def on_generated_node(tmp_path: Path, name: str = "xeon-e5-2680v3-2s") -> tuple[Path, FakeV2]:
    """A generated sysfs tree (tests/topologies.py) with a FAKE cgroup2 mount where the daemon
    looks for one (``<sysfs>/fs/cgroup``), its root offering every CPU of the topology."""
    from topologies import build

    root, _ = build(name, tmp_path)
    (root / "fs").mkdir()
    fake = FakeV2(root / "fs" / "cgroup")
    online = (root / "devices" / "system" / "cpu" / "online").read_text()
    (fake.root / "cpuset.cpus.effective").write_text(online)
    return root, fake
