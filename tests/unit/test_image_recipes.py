"""The two recipes of the DaemonSet's image agree: packaging/Dockerfile (a container engine and a
registry) and packaging/image/image_build.py (``./dev image``, neither).  Same Debian packages
and versions (debian.lock), same wheels by hash (requirements.lock), same build backend, same
entrypoint, command, environment and labels; the Dockerfile's base is pinned by digest and its
build context (.dockerignore) holds what it copies and nothing else."""

from __future__ import annotations

import re
import shlex
import tomllib

import product_image
import pytest
from packaging.requirements import Requirement

REPO = product_image.REPO
LOCKS = ("debian.lock", "requirements.lock", "build-requirements.lock")


@pytest.fixture(scope="module")
def recipe():
    return product_image.recipe()


def steps() -> list[tuple[str, str]]:
    return product_image.dockerfile_steps()


def final_stage() -> list[tuple[str, str]]:
    all_steps = steps()
    last_from = max(i for i, (op, _) in enumerate(all_steps) if op == "FROM")
    return all_steps[last_from:]


def key_values(args: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(args))


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_base_is_debian_12_pinned_by_digest() -> None:
    args = [a for op, a in steps() if op == "ARG" and a.startswith("DEBIAN=")]
    assert len(args) == 1
    assert re.fullmatch(r"DEBIAN=debian:bookworm-slim@sha256:[0-9a-f]{64}", args[0])
    froms = [a.split()[0] for op, a in steps() if op == "FROM"]
    assert froms and set(froms) == {"${DEBIAN}"}


def test_dockerfile_installs_the_locked_debian_packages(recipe) -> None:
    run = " ".join(a for op, a in final_stage() if op == "RUN")
    assert (
        "apt-get install" in run
        and "$(awk '!/^#/ && NF {print $1 \"=\" $2}' /tmp/debian.lock)" in run
    )
    copies = [shlex.split(a) for op, a in final_stage() if op == "COPY"]
    assert ["packaging/image/debian.lock", "/tmp/debian.lock"] in copies
    debs = recipe.image_debs.read_lock(recipe.DEBIAN_LOCK)
    names = [d.name for d in debs]
    assert len(names) == len(set(names)) and set(recipe.ROOTS) <= set(names)
    assert "python3.11-minimal" in names and "libpython3.11-stdlib" in names


def test_both_recipes_install_the_locked_wheels_by_hash(recipe) -> None:
    runs = [a for op, a in steps() if op == "RUN"]
    assert any("-r /locks/build-requirements.lock" in r and "--require-hashes" in r for r in runs)
    assert any("-r /locks/requirements.lock" in r and "--require-hashes" in r for r in runs)
    assert any("-r /tmp/requirements.lock" in r and "--require-hashes" in r for r in runs)
    assert recipe.REQUIREMENTS.name == "requirements.lock"
    assert recipe.BUILD_REQUIREMENTS.name == "build-requirements.lock"


def test_requirements_lock_pins_each_runtime_dependency_within_its_range() -> None:
    text = (REPO / "packaging/image/requirements.lock").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            requirement, *hashes = line.split()
            name, _, version = requirement.partition("==")
            assert version and len(hashes) == 1, line  # exact version, one wheel's hash
            assert re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", hashes[0]), line
            pins[name] = version
    ranges = {Requirement(r).name: Requirement(r).specifier for r in project()["dependencies"]}
    assert pins.keys() == ranges.keys()
    for name, version in pins.items():
        assert ranges[name].contains(version), f"{name}=={version} is outside {ranges[name]}"
    backend = (REPO / "packaging/image/build-requirements.lock").read_text()
    build_system = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    [requires] = [Requirement(r) for r in build_system["requires"]]
    [pin] = re.findall(rf"^{requires.name}==(\S+)", backend, re.M)
    assert requires.specifier.contains(pin)


def test_entrypoint_command_environment_and_labels_are_the_same(recipe) -> None:
    final = final_stage()
    assert shlex.split(dict(final)["ENTRYPOINT"].strip("[]").replace(",", " ")) == recipe.ENTRYPOINT
    assert shlex.split(dict(final)["CMD"].strip("[]").replace(",", " ")) == recipe.CMD
    env = {}
    for op, args in final:
        if op == "ENV":
            env.update(key_values(args))
    assert [f"{k}={v}" for k, v in env.items()] == recipe.ENV
    assert dict(final)["USER"] == "0" and dict(final)["WORKDIR"] == "/"
    labels = key_values(dict(final)["LABEL"])
    meta = project()
    built = recipe.image_config(
        {k: meta[k] for k in ("name", "version", "description", "license")}, "${REVISION}", None
    )["Labels"]
    assert labels == built


def test_dockerignore_admits_exactly_what_the_dockerfile_copies() -> None:
    patterns = [
        line
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"  # everything out (.git, .venv, .lab, tests, caches) ...
    admitted = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    sources = set()
    for op, args in steps():
        words = shlex.split(args)
        if op == "COPY" and not words[0].startswith("--from="):
            sources.update(w.rstrip("/") for w in words[:-1])
    assert admitted == sources  # ... but what is copied
    for source in sources:
        assert (REPO / source).exists(), source
