"""Plain runc bundles with our OCI hook in ``config.json``, and fake containers for hook tests.

Two levels, both inside one private top cgroup (``/nri-hook-<token>``) and one instance
directory under ``<lab>/run/``, so teardown can find everything they made:

* :class:`CgroupSandbox` - kubelet-shaped cgroup directories (``kubepods/pod<uid>/<id>`` and
  ``kubepods/burstable/...``) in the cpuset and cpu hierarchies, with a ``sleep`` process in each
  "container".  Enough to drive the hook program directly, fast, for unit-level tests and
  benchmarks.
* :class:`Runc` - real runc 1.1.5 (bookworm deb) running the busybox rootfs, with our hook as a
  ``createRuntime`` and ``poststop`` hook: what CRI-O and podman do, minus the daemon.

Teardown (``close``, also run by the context managers and by :func:`reap_stale`) deletes the
runc containers (that runs their poststop hooks), then kills every process of the instance by
pid, unmounts, removes the cgroup tree in every hierarchy and the instance directory - the same
plumbing the containerd harness uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import debs, host, image, shortpaths
from .containerd import _cleanup, _leftovers, reap_short_dirs
from .packages import RUNC

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = Path(sys.executable)
# A container that reports what it was given, then idles until killed.
REPORT_AND_SLEEP = (
    "grep Cpus_allowed_list /proc/self/status; cat /sys/fs/cgroup/cpuset/cpuset.cpus; "
    "exec sleep 100000"
)


class RuncError(RuntimeError):
    """runc (or the harness around it) failed; the message carries runc's own words."""


def hook_program(directory: Path, python: Path = VENV_PYTHON) -> Path:
    """The hook as installed: the launcher ``nri-cpuplugin install-hook`` writes (the absolute
    interpreter in its shebang, as runtimes give hooks no PATH; started with -I -S).

    The shebang names ``python`` through a short link (``shortpaths.interpreter``): a shebang
    cannot quote a space, older kernels cut it at 127 bytes, and the test interpreter lives in
    the checkout, whose path may be anything.  An operator does the same with ``--python``."""
    from nri_cpuplugin.hook import launcher as hook_launcher

    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "nri-cpuplugin-hook"
    hook_launcher.install(str(program), str(shortpaths.interpreter(python)))
    return program


def hook_env(lab: Path = debs.LAB) -> list[str]:
    """The hook's environment in tests.  Runtimes pass exactly ``hook.env``; this one only
    points Python's bytecode cache into the lab for hooks started without -I (the launcher
    ignores PYTHON* variables and keeps its bytecode next to the package, as installed)."""
    return [f"PYTHONPYCACHEPREFIX={lab / 'pycache'}"]


@dataclass(frozen=True)
class Pod:
    """A kubelet-shaped pod: its uid, QoS class and the cgroup kubelet would give it."""

    uid: str
    name: str
    namespace: str = "default"
    qos: str = "guaranteed"  # guaranteed | burstable | besteffort

    def cgroup(self, top: str) -> str:
        qos = "" if self.qos == "guaranteed" else f"/{self.qos}"
        return f"{top}/kubepods{qos}/pod{self.uid}"


def pod(name: str, qos: str = "guaranteed") -> Pod:
    return Pod(f"{secrets.token_hex(4)}-{name}", name, qos=qos)


def kubernetes_annotations(p: Pod, container: str) -> dict[str, str]:
    """What CRI-O puts in config.json for a kubelet container (the subset the hook reads, plus
    the container hash the hooks.d files select on)."""
    return {
        "io.kubernetes.pod.uid": p.uid,
        "io.kubernetes.pod.name": p.name,
        "io.kubernetes.pod.namespace": p.namespace,
        "io.kubernetes.container.name": container,
        "io.kubernetes.container.hash": secrets.token_hex(4),
        "io.kubernetes.cri-o.ContainerType": "container",
    }


def cpu_resources(millicores: int, limit: int | None = None) -> dict[str, int]:
    """``linux.resources.cpu`` as kubelet encodes a request/limit (cgroups-and-hooks.md §8)."""
    shares = max(2, millicores * 1024 // 1000) if millicores else 2
    resources = {"shares": shares, "period": 100000}
    if limit:
        resources["quota"] = limit * 100000 // 1000
    return resources


def _instance_dir(lab: Path, kind: str, token: str) -> Path:
    return lab / "run" / f"{kind}-{token}"


# --- fake containers: cgroups + a sleeping process ------------------------------------------------


@dataclass
class FakeContainer:
    id: str
    pod: Pod
    name: str
    cgroup: str
    pid: int
    bundle: Path

    def state_json(self, status: str = "creating") -> bytes:
        doc: dict[str, Any] = {
            "ociVersion": "1.0.2-dev",
            "id": self.id,
            "status": status,
            "bundle": str(self.bundle),
            "annotations": {},
        }
        if status != "stopped":
            doc["pid"] = self.pid
        return json.dumps(doc).encode()


@dataclass
class HookResult:
    returncode: int
    stderr: str

    @property
    def records(self) -> list[dict[str, str]]:
        """Audit records (JSON lines on stderr when there is no journal)."""
        return [json.loads(line) for line in self.stderr.splitlines() if line.startswith("{")]

    @property
    def reason_lines(self) -> list[str]:
        """Everything on stderr that is not an audit record: the one-line reason, if any."""
        return [line for line in self.stderr.splitlines() if not line.startswith("{")]

    def actions(self) -> list[str]:
        return [r["ACTION"] for r in self.records]


class CgroupSandbox:
    """A private cgroup tree with fake containers in it (cgroup v1 cpuset + cpu here)."""

    def __init__(self, lab: Path = debs.LAB, token: str | None = None) -> None:
        self.lab = lab
        self.token = token or secrets.token_hex(4)
        self.top = f"/nri-hook-{self.token}"
        self.dir = _instance_dir(lab, "hook", self.token)
        self.state_dir = self.dir / "state"
        self.containers: dict[str, FakeContainer] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        hierarchies = host.cgroup_hierarchies()
        if "cpuset" not in hierarchies:
            raise RuntimeError(f"no cgroup v1 cpuset hierarchy mounted ({sorted(hierarchies)})")
        self.cpuset_root = hierarchies["cpuset"]
        self.cpu_root = hierarchies.get("cpu")

    def __enter__(self) -> CgroupSandbox:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "owner.json").write_text(
            json.dumps({"owner": [os.getpid(), host.start_time(os.getpid())], "top": self.top})
        )
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = self.close()
        if leftovers and exc[0] is None:
            raise RuntimeError("teardown left things behind:\n  " + "\n  ".join(leftovers))

    def cpuset_dir(self, cgroup: str) -> Path:
        return self.cpuset_root / cgroup.lstrip("/")

    def cpu_dir(self, cgroup: str) -> Path:
        assert self.cpu_root is not None
        return self.cpu_root / cgroup.lstrip("/")

    def make_cgroup(self, cgroup: str) -> None:
        """Create ``cgroup`` and its parents; v1 cpusets start empty, so each gets its parent's
        CPUs and memory nodes (as runc does)."""
        parts = [p for p in cgroup.split("/") if p]
        for depth in range(1, len(parts) + 1):
            path = "/" + "/".join(parts[:depth])
            d = self.cpuset_dir(path)
            if not d.exists():
                d.mkdir()
                parent = d.parent
                for name in ("cpuset.mems", "cpuset.cpus"):
                    (d / name).write_text((parent / name).read_text().strip() or "\n")
            if self.cpu_root is not None:
                self.cpu_dir(path).mkdir(exist_ok=True)

    def add(
        self,
        p: Pod,
        name: str,
        millicores: int = 0,
        limit: int | None = None,
        annotations: Mapping[str, str] | None = None,
        cid: str | None = None,
        config_extra: Mapping[str, Any] | None = None,
        namespaces: Sequence[Mapping[str, str]] | None = None,
    ) -> FakeContainer:
        """A running fake container: cgroup, ``sleep`` in it, bundle with config.json
        (``namespaces``: its ``linux.namespaces``, e.g. the pod's network namespace)."""
        cid = cid or f"{name}-{secrets.token_hex(6)}"
        cgroup = f"{p.cgroup(self.top)}/{cid}"
        self.make_cgroup(cgroup)
        proc = subprocess.Popen(["sleep", "100000"], stdin=subprocess.DEVNULL)
        (self.cpuset_dir(cgroup) / "cgroup.procs").write_text(str(proc.pid))
        if self.cpu_root is not None:
            (self.cpu_dir(cgroup) / "cgroup.procs").write_text(str(proc.pid))
            if limit:
                (self.cpu_dir(cgroup) / "cpu.cfs_quota_us").write_text(str(limit * 100))
        bundle = self.dir / "bundles" / cid
        bundle.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "ociVersion": "1.0.2-dev",
            "annotations": {**kubernetes_annotations(p, name), **(annotations or {})},
            "linux": {
                "cgroupsPath": cgroup,
                "resources": {"cpu": cpu_resources(millicores, limit)},
            },
        }
        if namespaces is not None:
            config["linux"]["namespaces"] = [dict(ns) for ns in namespaces]
        if config_extra:
            config.update(config_extra)
        (bundle / "config.json").write_text(json.dumps(config))
        container = FakeContainer(cid, p, name, cgroup, proc.pid, bundle)
        self.containers[cid] = container
        self._procs[cid] = proc
        return container

    def stop(self, container: FakeContainer, remove_cgroup: bool = True) -> None:
        """What a runtime does when a container ends: its process dies, its cgroup goes."""
        proc = self._procs.pop(container.id, None)
        if proc is not None:
            proc.kill()
            proc.wait()
        if remove_cgroup:
            for root in (self.cpuset_root, self.cpu_root):
                if root is not None:
                    d = root / container.cgroup.lstrip("/")
                    deadline = time.monotonic() + 5
                    while d.exists():
                        try:
                            d.rmdir()
                        except OSError:
                            if time.monotonic() > deadline:
                                raise
                            time.sleep(0.01)

    def cpus(self, container: FakeContainer) -> str:
        return (self.cpuset_dir(container.cgroup) / "cpuset.cpus").read_text().strip()

    def affinity(self, container: FakeContainer) -> str:
        return host.cpus_allowed_list(container.pid)

    def quota(self, container: FakeContainer) -> str:
        return (self.cpu_dir(container.cgroup) / "cpu.cfs_quota_us").read_text().strip()

    # --- running the hook program against the sandbox ---------------------------------------

    @property
    def hook_program(self) -> Path:
        program = self.dir / "bin" / "nri-cpuplugin-hook"
        if not program.exists():
            hook_program(program.parent)
        return program

    def hook(
        self,
        stdin: bytes | FakeContainer,
        stage: str | None = "createRuntime",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
    ) -> HookResult:
        """Run the hook as a runtime does: the program, its args, exactly ``env`` (plus the
        bytecode cache), the state on stdin."""
        if isinstance(stdin, FakeContainer):
            stdin = stdin.state_json("stopped" if stage == "poststop" else "creating")
        argv = [
            str(self.hook_program),
            "--state-dir",
            str(self.state_dir),
            "--reserved-cpus",
            "0",
            *args,
            *([stage] if stage else []),
        ]
        environment = dict(item.split("=", 1) for item in hook_env(self.lab))
        environment.update(env or {})
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, env=environment, timeout=timeout, check=False
        )
        return HookResult(proc.returncode, proc.stderr.decode(errors="replace"))

    def running(self, container: FakeContainer) -> bool:
        return container.id in self._procs

    def problems(self, placed: Sequence[FakeContainer]) -> list[str]:
        """Where the state file, the hook's records and the live cgroups disagree.  ``placed``:
        the running containers the hook was (successfully) run for."""
        from nri_cpuplugin.storage.store import StateStore

        result = StateStore(self.state_dir).peek()
        if result.state is None:
            return [f"no valid state: {result.problem}"]
        state = result.state
        out = []
        expected = {c.id for c in placed if self.running(c)}
        known = set(state.assignments) | set(state.sharing)
        if known != expected:
            out.append(f"state names {sorted(known)}, running placed containers {sorted(expected)}")
        records_dir = self.state_dir / "hook-containers"
        records = {p.stem for p in records_dir.glob("*.json")} if records_dir.exists() else set()
        if records != known:
            out.append(f"records {sorted(records)} != state {sorted(known)}")
        for c in placed:
            if not self.running(c):
                continue
            held = state.assignments.get(c.id)
            want = str(held.cpus) if held is not None else str(state.shared)
            if self.cpus(c) != want:
                out.append(f"{c.id}: cpuset.cpus {self.cpus(c)} but state says {want}")
            if self.affinity(c) != want:
                out.append(f"{c.id}: affinity {self.affinity(c)} but state says {want}")
        seen: dict[int, str] = {}
        for cid, a in state.assignments.items():
            for cpu in a.cpus:
                if cpu in seen:
                    out.append(f"CPU {cpu} assigned to {seen[cpu]} and {cid}")
                seen[cpu] = cid
        return out

    def close(self) -> list[str]:
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._procs.clear()
        _cleanup(self.dir, self.dir, self.top, 10.0)
        return _leftovers(self.dir, self.dir, self.top)


@contextlib.contextmanager
def sandbox(min_cpus: int = 2, lab: Path = debs.LAB) -> Iterator[CgroupSandbox]:
    """A CgroupSandbox for a test, after removing what killed earlier runs left behind.
    Raises (the test fails, never skips) when this host cannot run it."""
    if os.geteuid() != 0:
        raise RuntimeError("these tests write cgroupfs and need root")
    if len(host.online_cpus()) < min_cpus:
        raise RuntimeError(f"these tests need {min_cpus} online CPUs, have {host.online_cpus()}")
    if stale := reap_stale(lab):
        raise RuntimeError("leftovers of an earlier run could not be removed:\n" + "\n".join(stale))
    with CgroupSandbox(lab) as box:
        yield box


# --- runc ------------------------------------------------------------------------------------


@dataclass
class RuncContainer:
    id: str
    bundle: Path
    cgroup: str
    create: subprocess.CompletedProcess[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def stdout_path(self) -> Path:
        return self.bundle / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return self.bundle / "stderr.log"

    def output(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def errors(self) -> str:
        return self.stderr_path.read_text(errors="replace")


class Runc:
    """runc 1.1.5 with a private state root, bundles in the instance directory, containers in
    a private top cgroup, our hook (or any) in each config.json."""

    def __init__(
        self,
        lab: Path = debs.LAB,
        token: str | None = None,
        hook_args: Sequence[str] = (),
        hook_timeout: int = 30,
    ) -> None:
        self.lab = lab
        self.token = token or secrets.token_hex(4)
        self.top = f"/nri-hook-{self.token}"
        self.dir = _instance_dir(lab, "runc", self.token)
        self.root = self.dir / "runc-root"
        self.state_dir = self.dir / "state"
        self.hook_args = list(hook_args)
        self.hook_timeout = hook_timeout
        self.containers: dict[str, RuncContainer] = {}
        self._template: dict[str, Any] | None = None

    @property
    def binary(self) -> Path:
        return debs.unpack(RUNC, self.lab) / "usr/sbin/runc"

    @property
    def hook(self) -> Path:
        return self.dir / "bin" / "nri-cpuplugin-hook"

    def __enter__(self) -> Runc:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = self.close()
        if leftovers and exc[0] is None:
            raise RuncError("teardown left things behind:\n  " + "\n  ".join(leftovers))

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "owner.json").write_text(
            json.dumps({"owner": [os.getpid(), host.start_time(os.getpid())], "top": self.top})
        )
        self.root.mkdir(exist_ok=True)
        hook_program(self.hook.parent)
        version = self._run(["--version"])
        if "1.1.5" not in version.stdout:
            raise RuncError(f"unexpected runc: {version.stdout.strip()}")

    def _run(
        self, args: Sequence[str], check: bool = True, timeout: float = 60, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.binary), "--root", str(self.root), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        if check and result.returncode:
            raise RuncError(
                f"runc {' '.join(args)} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    def template(self) -> dict[str, Any]:
        """runc's own default spec (``runc spec``), read once."""
        if self._template is None:
            scratch = self.dir / "spec-template"
            scratch.mkdir(parents=True, exist_ok=True)
            (scratch / "config.json").unlink(missing_ok=True)
            subprocess.run([str(self.binary), "spec", "--bundle", str(scratch)], check=True)
            self._template = json.loads((scratch / "config.json").read_text())
        return json.loads(json.dumps(self._template))

    def hook_entry(self, stage: str) -> dict[str, Any]:
        return {
            "path": str(self.hook),
            "args": ["nri-cpuplugin-hook", *self.hook_args, stage],
            "env": hook_env(self.lab),
            "timeout": self.hook_timeout,
        }

    def bundle(
        self,
        p: Pod,
        name: str,
        millicores: int = 0,
        limit: int | None = None,
        command: str = REPORT_AND_SLEEP,
        annotations: Mapping[str, str] | None = None,
        hooks: bool = True,
        cpuset: str | None = None,
        cid: str | None = None,
    ) -> RuncContainer:
        """Write a bundle for a kubelet-shaped container of pod ``p``."""
        cid = cid or f"{name}-{secrets.token_hex(6)}"
        bundle = self.dir / "bundles" / cid
        bundle.mkdir(parents=True, exist_ok=True)
        spec = self.template()
        spec["root"] = {"path": str(image.rootfs(self.lab)), "readonly": True}
        spec["process"].update(
            terminal=False, args=["/bin/sh", "-c", command], env=["PATH=/bin"], rlimits=[]
        )
        spec["hostname"] = cid[:60]
        cgroup = f"{p.cgroup(self.top)}/{cid}"
        cpu: dict[str, Any] = cpu_resources(millicores, limit)
        if cpuset is not None:
            cpu["cpus"] = cpuset
        spec["linux"]["cgroupsPath"] = cgroup
        spec["linux"]["resources"]["cpu"] = cpu
        spec["annotations"] = {**kubernetes_annotations(p, name), **(annotations or {})}
        if hooks:
            spec["hooks"] = {
                "createRuntime": [self.hook_entry("createRuntime")],
                "poststop": [self.hook_entry("poststop")],
            }
        (bundle / "config.json").write_text(json.dumps(spec, indent=1))
        container = RuncContainer(cid, bundle, cgroup)
        self.containers[cid] = container
        return container

    def create_command(self, c: RuncContainer) -> list[str]:
        return [
            str(self.binary),
            "--root",
            str(self.root),
            "create",
            "--bundle",
            str(c.bundle),
            c.id,
        ]

    def create(self, c: RuncContainer, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``runc create``: namespaces, cgroup, createRuntime hooks; the process then waits for
        ``start``.  Its stdio (and the container's) go to files in the bundle, because the
        container keeps them open long after runc returns."""
        with c.stdout_path.open("w") as out, c.stderr_path.open("w") as err:
            proc = subprocess.run(
                self.create_command(c),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                timeout=120,
                check=False,
            )
        result = subprocess.CompletedProcess(proc.args, proc.returncode, "", c.errors())
        c.create = result
        if check and result.returncode:
            raise RuncError(f"runc create {c.id} failed ({result.returncode}): {c.errors()}")
        return result

    def start_container(self, c: RuncContainer) -> None:
        self._run(["start", c.id])

    def state(self, c: RuncContainer) -> dict[str, Any]:
        return json.loads(self._run(["state", c.id]).stdout)

    def pid(self, c: RuncContainer) -> int:
        return int(self.state(c)["pid"])

    def delete(self, c: RuncContainer) -> subprocess.CompletedProcess[str]:
        """``runc delete --force``: kills the container and runs its poststop hooks."""
        return self._run(["delete", "--force", c.id], check=False)

    def list(self) -> list[dict[str, Any]]:
        out = self._run(["list", "--format", "json"]).stdout.strip()
        return json.loads(out) if out and out != "null" else []

    def wait_output(self, c: RuncContainer, lines: int, timeout: float = 10) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            got = [line for line in c.output().splitlines() if line.strip()]
            if len(got) >= lines or time.monotonic() > deadline:
                return got
            time.sleep(0.02)

    def cpuset_dir(self, c: RuncContainer) -> Path:
        return host.cgroup_dir(c.cgroup, "cpuset")

    def close(self) -> list[str]:
        with contextlib.suppress(Exception):
            for entry in self.list():
                self._run(["delete", "--force", entry["id"]], check=False, timeout=30)
        _cleanup(self.dir, self.dir, self.top, 10.0)
        return _leftovers(self.dir, self.dir, self.top)


def reap_stale(lab: Path = debs.LAB, kinds: Sequence[str] = ("hook", "runc")) -> list[str]:
    """Clean up instances (``<lab>/run/<kind>-*``, each with an owner.json naming its owner
    process, private top cgroup and maybe short directory) whose owning test process is gone,
    and instances of ``kinds`` found by their short directories alone (another lab's, or one
    since removed)."""
    problems: list[str] = []
    for meta_file in sorted(
        meta for kind in kinds for meta in (lab / "run").glob(f"{kind}-*/owner.json")
    ):
        try:
            meta = json.loads(meta_file.read_text())
            pid, started = meta["owner"]
            top = meta["top"]
        except (OSError, ValueError, KeyError):
            continue
        if host.start_time(pid) == started:
            continue
        inst = meta_file.parent
        short = Path(meta.get("short", inst))
        _cleanup(inst, short, top, 10.0)
        problems += _leftovers(inst, short, top)
    return problems + reap_short_dirs(*kinds)


def prepare(lab: Path = debs.LAB) -> None:
    """Everything slow, once: runc unpacked, the busybox rootfs built."""
    debs.unpack(RUNC, lab)
    image.rootfs(lab)
