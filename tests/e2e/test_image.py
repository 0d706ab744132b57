"""The DaemonSet's image as ``./dev image`` builds it (tests/product_image.py, built once per
commit and recipe): containerd's ``ctr images import`` and podman's ``load`` take the archive
with the digest the build printed, and a container of it runs the program under runc.

The container runs ``topology --json``: the console script, Debian's python3.11 and every wheel
it imports, reading the host's sysfs; its CPUs must be this machine's.
"""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import product_image
import pytest
from harness.podman import Podman

from nri_cpuplugin.core.topology import discover

VERSION = tomllib.loads((product_image.REPO / "pyproject.toml").read_text())["project"]["version"]
NAME = f"docker.io/library/nri-cpuplugin:{VERSION}"


@pytest.fixture(scope="module")
def image() -> product_image.Built:
    return product_image.cached()


def online_cpus(topology_json: str) -> set[int]:
    return {c["id"] for c in json.loads(topology_json)["cpus"] if c["online"]}


def test_ctr_imports_the_archive_and_runc_runs_the_program(make_containerd, image) -> None:
    ctrd = make_containerd()
    ctr = [str(ctrd.ctr), "--address", str(ctrd.address), "-n", "k8s.io"]

    def run(*args: str) -> str:
        result = subprocess.run(
            [*ctr, *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    run("images", "import", "--snapshotter", "overlayfs", "--platform", "linux/amd64",
        str(image.archive))  # fmt: skip
    listed = {line.split()[0]: line.split()[2] for line in run("images", "ls").splitlines()[1:]}
    assert listed[NAME] == image.digest
    assert ctrd.cri().image_known(NAME)  # what kubelet would ask for: the CRI sees it
    out = run(
        "run", "--rm", "--snapshotter", "overlayfs", "--runc-binary", str(ctrd.runc),
        "--cgroup", f"{ctrd.top_cgroup}/image-test", NAME, "image-test",
        "nri-cpuplugin", "topology", "--json",
    )  # fmt: skip
    assert online_cpus(out) == set(discover().online)


def test_podman_loads_the_archive_and_runs_its_entrypoint(tmp_path: Path, image) -> None:
    # podman refuses to load anything without a signature policy; the lab has none of its own.
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    (tmp_path / "hooks").mkdir()
    with Podman(hooks_dir=tmp_path / "hooks") as podman:
        loaded = podman.run(["load", "--signature-policy", str(policy), "-i", str(image.archive)])
        assert f"Loaded image: {NAME}" in loaded.stdout
        inspect = podman.run(["image", "inspect", "--format", "{{.Digest}}", NAME])
        assert inspect.stdout.strip() == image.digest
        # Arguments replace the image's Cmd (run) and keep its Entrypoint (nri-cpuplugin).
        ran = podman.run(
            ["run", "--rm", "--network", "host", "--read-only", NAME, "topology", "--json"]
        )
        assert online_cpus(ran.stdout) == set(discover().online)
