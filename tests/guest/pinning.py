"""Guest side of tests/guest/test_pinning.py: pod scenarios on the guest node with the
project's daemon running, driven through CRI as kubelet's systemd driver would (run in the
guest by ``Guest.call``).  Each returns what the kernel and systemd showed, as JSON; nothing
here asserts, so a wrong value comes back to the host as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from harness.cri import ContainerSpec, CRIError, RunningPod
from harness.guest_kubelet import CGROUP_ROOT, SystemdError, SystemdKubelet, unit_property
from harness.host import parse_cpu_list
from harness.k8s import PodSpec

from guest.scenarios import FIRST_LINE, _first_line, _read, container_facts, unit_dir

DAEMON_UNIT = "nri-cpuplugin.service"


# -- what the kernel says ------------------------------------------------------------------


def scope_dir(cri: SystemdKubelet, cid: str) -> Path:
    """The container's cgroup directory (its scope), from its first process."""
    pid, _ = cri.inspect(cid)
    cgroup = next(
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if line.startswith("0::")
    )
    return CGROUP_ROOT / cgroup.lstrip("/")


def tasks_allowed(directory: Path) -> dict[str, str]:
    """``tid -> Cpus_allowed_list`` of every task in the cgroup (threads included): what the
    scheduler may use for each, whatever the cgroup files say."""
    found = {}
    for pid in _procs(directory):
        task_dir = Path(f"/proc/{pid}/task")
        try:
            tids = [p.name for p in task_dir.iterdir()]
        except OSError:
            continue  # exited meanwhile
        for tid in tids:
            try:
                status = (task_dir / tid / "status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    found[tid] = line.split(":", 1)[1].strip()
    return found


def _procs(directory: Path) -> list[str]:
    """The cgroup's processes; none once it is gone (not _read's error text split in words,
    which would count as processes)."""
    procs = _read(directory / "cgroup.procs")
    return [] if procs.startswith("<") else procs.split()


def node_topology() -> dict[str, Any]:
    """NUMA nodes' CPUs and SMT siblings as sysfs has them."""
    nodes = {
        d.name.removeprefix("node"): _read(d / "cpulist")
        for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    }
    cpus = Path("/sys/devices/system/cpu")
    siblings = sorted(
        {
            _read(d / "topology/thread_siblings_list")
            for d in cpus.glob("cpu[0-9]*")
            if (d / "topology").is_dir()
        }
    )
    return {"numa_nodes": nodes, "siblings": siblings, "online": _read(cpus / "online")}


def _systemctl(*args: str, timeout: float = 300.0) -> dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run(
        ["systemctl", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return {
        "command": " ".join(["systemctl", *args]),
        "rc": done.returncode,
        "stderr": done.stderr.strip()[-300:],
        "seconds": round(time.monotonic() - started, 2),
    }


def _wait_shared_off(
    cri: SystemdKubelet, cid: str, exclusive: set[int], timeout: float = 30.0
) -> tuple[dict[str, Any], float]:
    """The shared container's facts once it is off ``exclusive`` (or at the deadline), and
    how long that took (0: it already was)."""
    started = time.monotonic()
    first = True
    while True:
        facts = container_facts(cri, cid)
        if not exclusive & set(parse_cpu_list(facts["cpus_allowed_list"])):
            return facts, 0.0 if first else round(time.monotonic() - started, 1)
        first = False
        if time.monotonic() - started > timeout:
            return facts, -1.0
        time.sleep(0.5)


# -- (a) born pinned on a NUMA node, (c) the pool grows back -----------------------------


def numa_pod_then_stop(address: str, cpus: int = 4) -> dict[str, Any]:
    """A Burstable pod, then a ``cpus``-CPU Guaranteed pod: where each lands (the Guaranteed
    one from its first line: what its first instruction saw).  Then the Guaranteed pod is
    stopped and removed, and the Burstable one's CPUs are read until they grow back."""
    result: dict[str, Any] = {"topology": node_topology()}
    with SystemdKubelet(address) as cri:
        shared = cri.run(
            "numa-shared", [ContainerSpec("app", command=FIRST_LINE, cpu_request_milli=100)]
        )
        result["shared_first_line"] = _first_line(cri, shared["app"])
        result["shared_before"] = container_facts(cri, shared["app"])
        pinned = cri.run("numa-pinned", [ContainerSpec.guaranteed("app", cpus, command=FIRST_LINE)])
        result["pinned_first_line"] = first = _first_line(cri, pinned["app"])
        facts = container_facts(cri, pinned["app"])
        directory = scope_dir(cri, pinned["app"])
        facts["cpuset_mems"] = _read(directory / "cpuset.mems")
        facts["allowed_memory_nodes"] = unit_property(facts["scope"], "AllowedMemoryNodes")
        facts["mems_allowed_list"] = next(
            line.split(":", 1)[1].strip()
            for line in Path(f"/proc/{facts['pid']}/status").read_text().splitlines()
            if line.startswith("Mems_allowed_list:")
        )
        result["pinned"] = facts
        exclusive = set(parse_cpu_list(first))
        result["shared_while_pinned"], result["shared_moved_after_s"] = _wait_shared_off(
            cri, shared["app"], exclusive
        )
        result["shared_tasks_while_pinned"] = tasks_allowed(scope_dir(cri, shared["app"]))
        # Stop, then removal, as kubelet does when the pod is deleted.
        started = time.monotonic()
        cri.stop(pinned["app"], timeout=0)
        cri.remove(pinned["app"])
        cri.stop_pod(pinned.id)
        cri.remove_pod(pinned.id)
        result["pinned_removed_in_s"] = round(time.monotonic() - started, 1)
        # The pool grows back at the removal: a few seconds of polling tell late from never.
        deadline = time.monotonic() + 30
        while True:
            after = container_facts(cri, shared["app"])
            if exclusive <= set(parse_cpu_list(after["cpus_allowed_list"])):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        result["shared_after_stop"] = after
        result["shared_tasks_after_stop"] = tasks_allowed(scope_dir(cri, shared["app"]))
        result["shared_grew_after_s"] = round(time.monotonic() - deadline + 30, 1)
        cri.remove_all()
    return result


# -- (b) churn under daemon-reload, daemon-reexec and set-property -----------------------


class _Watch:
    """Containers the sampler looks at: shared (Burstable) and exclusive (Guaranteed) scopes
    by container id; updated by the churn thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shared: dict[str, Path] = {}
        self.exclusive: dict[str, Path] = {}

    def snapshot(self) -> tuple[dict[str, Path], dict[str, Path]]:
        with self.lock:
            return dict(self.shared), dict(self.exclusive)


def _sample(watch: _Watch, counts: dict[str, Any]) -> None:
    """One look at every watched container: the exclusive CPUs are those of Guaranteed
    containers that have a task (so their first instruction may have run); a shared scope's
    ``cpuset.cpus.effective`` or any of its tasks' ``Cpus_allowed_list`` meeting them is a
    violation."""
    shared, exclusive_scopes = watch.snapshot()
    exclusive: set[int] = set()
    for directory in exclusive_scopes.values():
        effective = _read(directory / "cpuset.cpus.effective")
        if _procs(directory) and not effective.startswith("<"):
            exclusive |= set(parse_cpu_list(effective))
    counts["samples"] += 1
    for cid, directory in shared.items():
        effective = _read(directory / "cpuset.cpus.effective")
        if effective.startswith("<"):
            continue  # the scope is gone (the churn removed it)
        counts["scopes_checked"] += 1
        if exclusive & set(parse_cpu_list(effective)):
            counts["violations"].append(
                {
                    "t": round(time.monotonic(), 2),
                    "id": cid[:12],
                    "effective": effective,
                    "exclusive": sorted(exclusive),
                }
            )
        for tid, allowed in tasks_allowed(directory).items():
            counts["tasks_checked"] += 1
            if exclusive & set(parse_cpu_list(allowed)):
                counts["violations"].append(
                    {
                        "t": round(time.monotonic(), 2),
                        "id": cid[:12],
                        "tid": tid,
                        "allowed": allowed,
                        "exclusive": sorted(exclusive),
                    }
                )


def _all_scopes() -> list[str]:
    """The container scopes there are now.  os.walk, not Path.rglob: the churn removes pod
    slices during the walk, and rglob raises for a directory gone between its listing and
    its walk, where os.walk passes over it."""
    found = []
    for _, directories, _ in os.walk(CGROUP_ROOT / "kubepods.slice"):
        found += [name for name in directories if name.endswith(".scope")]
    return sorted(found)


def _set_property(scope: str, assignment: str, timeout: float = 30.0) -> dict[str, Any]:
    """``systemctl set-property --runtime <scope> <assignment>``.  The scope may belong to a
    pod the churn removes meanwhile: systemd's answer for a unit it no longer has (``Unit
    <scope> not found.``; ``not loaded.`` on some versions), for a scope whose cgroup is then
    gone too (within ``timeout``), is marked ``gone``; any other failure stays one."""
    operation = _systemctl("set-property", "--runtime", scope, assignment)
    answers = (f"Unit {scope} not found.", f"Unit {scope} not loaded.")
    if operation["rc"] == 0 or not any(a in operation["stderr"] for a in answers):
        return operation
    deadline = time.monotonic() + timeout
    while scope in _all_scopes():
        if time.monotonic() > deadline:
            return operation  # systemd lost a unit whose cgroup is still there: a failure
        time.sleep(0.5)
    return {**operation, "gone": True}


def churn_under_reloads(
    address: str, reloads: int = 3, keep_shared: int = 2, pause: float = 4.0
) -> dict[str, Any]:
    """A 2-CPU Guaranteed pod pinned, then pod churn (Burstable pods started and removed, a
    1-CPU Guaranteed pod started and removed every other round) while ``reloads`` x
    ``systemctl daemon-reload``, one ``daemon-reexec`` and ``set-property <scope>
    CPUWeight=`` on every container scope are run; a sampler reads every shared container's
    scope and tasks throughout, and once more after everything settled."""
    counts: dict[str, Any] = {"samples": 0, "scopes_checked": 0, "tasks_checked": 0}
    counts["violations"] = []
    watch = _Watch()
    stop = threading.Event()
    errors: list[str] = []
    retried: list[str] = []
    operations: list[dict[str, Any]] = []
    churned = {"burstable_started": 0, "burstable_removed": 0, "guaranteed_started": 0}
    with SystemdKubelet(address) as cri:
        pinned = cri.run("churn-pinned", [ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)])
        pinned_first = _first_line(cri, pinned["app"])
        pinned_dir = scope_dir(cri, pinned["app"])
        watch.exclusive[pinned["app"]] = pinned_dir
        pinned_scope = unit_dir(pinned_dir).name

        def run(name: str, spec: ContainerSpec) -> Any:
            """A pod start, tried again once when systemd was away: runc's StartTransientUnit
            during a daemon-reexec gets "disconnected from message bus without replying",
            and kubelet retries such a start; so does kubelet's own creation of the pod's
            slice, which this harness plays (SystemdError)."""
            try:
                return cri.run(name, [spec])
            except (CRIError, SystemdError) as e:
                if "message bus" not in str(e):
                    raise
                retried.append(f"{name}: {str(e)[-120:]}")
                time.sleep(2)
                return cri.run(f"{name}-again", [spec])

        def churn() -> None:
            alive: list[tuple[str, str]] = []  # (pod id, container id) of Burstable pods
            round_ = 0
            try:
                while not stop.is_set():
                    round_ += 1
                    pod = run(
                        f"churn-b{round_}",
                        ContainerSpec("app", command=FIRST_LINE, cpu_request_milli=200),
                    )
                    directory = scope_dir(cri, pod["app"])
                    with watch.lock:
                        watch.shared[pod["app"]] = directory
                    alive.append((pod.id, pod["app"]))
                    churned["burstable_started"] += 1
                    if round_ % 2 == 0:
                        g = run(f"churn-g{round_}", ContainerSpec.guaranteed("app", 1))
                        with watch.lock:
                            watch.exclusive[g["app"]] = scope_dir(cri, g["app"])
                        churned["guaranteed_started"] += 1
                        cri.stop(g["app"], timeout=0)
                        with watch.lock:
                            watch.exclusive.pop(g["app"])
                        cri.remove(g["app"])
                        cri.stop_pod(g.id)
                        cri.remove_pod(g.id)
                    while len(alive) > keep_shared:
                        pod_id, cid = alive.pop(0)
                        with watch.lock:
                            watch.shared.pop(cid)
                        cri.stop(cid, timeout=0)
                        cri.remove(cid)
                        cri.stop_pod(pod_id)
                        cri.remove_pod(pod_id)
                        churned["burstable_removed"] += 1
            except Exception as e:  # reported, not raised: the threads must be joined
                errors.append(f"churn: {type(e).__name__}: {e}")

        def sampler() -> None:
            try:
                while not stop.is_set():
                    _sample(watch, counts)
            except Exception as e:
                errors.append(f"sampler: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=churn), threading.Thread(target=sampler)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        try:
            time.sleep(pause)
            for _ in range(reloads):
                operations.append(_systemctl("daemon-reload"))
                time.sleep(pause)
            operations.append(_systemctl("daemon-reexec"))
            time.sleep(pause)
            for number, scope in enumerate(_all_scopes()):
                operations.append(_set_property(scope, f"CPUWeight={50 + number}"))
            time.sleep(pause)
            # Churn enough for removals to happen meanwhile too (pod starts take seconds
            # under emulation).
            deadline = time.monotonic() + 300
            while churned["burstable_removed"] < 2 and time.monotonic() < deadline and not errors:
                time.sleep(1)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=600)
        churn_seconds = round(time.monotonic() - started, 1)
        # Settled: everything once more, the pinned pod's cpuset as systemd and the kernel
        # keep it.
        time.sleep(2)
        _sample(watch, counts)
        result = {
            "counts": counts,
            "operations": operations,
            "set_property_scopes": sum(
                op["command"].startswith("systemctl set-property") and op["rc"] == 0
                for op in operations
            ),
            "set_property_gone": [op["command"] for op in operations if op.get("gone")],
            "churn": churned,
            "churn_seconds": churn_seconds,
            "errors": errors,
            "retried": retried,
            "pinned_first_line": pinned_first,
            "pinned_after": {
                "cpuset_cpus_effective": _read(pinned_dir / "cpuset.cpus.effective"),
                "tasks": tasks_allowed(pinned_dir),
                "allowed_cpus": unit_property(pinned_scope, "AllowedCPUs"),
            },
        }
        cri.remove_all()
    return result


# -- (d) kill -9 of the daemon ------------------------------------------------------------


def journal_cursor() -> str:
    out = subprocess.run(
        ["journalctl", "--show-cursor", "-n", "0", "-q"], capture_output=True, text=True
    ).stdout
    return out.strip().removeprefix("-- cursor: ")


def daemon_records(action: str | None, after: str) -> list[dict[str, Any]]:
    """The daemon's audit records after ``after`` (filtered here: journalctl 252 finds
    nothing with --after-cursor and matches the cursor's entry lacks)."""
    out = subprocess.run(
        ["journalctl", "--no-pager", "-o", "json", f"--after-cursor={after}"],
        capture_output=True,
        text=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [
        r
        for r in records
        if r.get("SYSLOG_IDENTIFIER") == "nri-cpuplugin" and action in (None, r.get("ACTION"))
    ]


def kill_daemon(timeout: float = 300.0) -> dict[str, Any]:
    """SIGKILL to the daemon's main process; systemd restarts it (``Restart=always``).
    Returns once the new one has synchronized with the runtime."""
    cursor = journal_cursor()
    old = unit_property(DAEMON_UNIT, "MainPID")
    restarts = unit_property(DAEMON_UNIT, "NRestarts")
    started = time.monotonic()
    subprocess.run(
        ["systemctl", "kill", "--kill-who=main", "--signal=SIGKILL", DAEMON_UNIT], check=True
    )
    while not daemon_records("synchronize", cursor):
        if time.monotonic() - started > timeout:
            break
        time.sleep(0.5)
    return {
        "old_pid": old,
        "new_pid": unit_property(DAEMON_UNIT, "MainPID"),
        "restarts": [restarts, unit_property(DAEMON_UNIT, "NRestarts")],
        "synchronized_after_s": round(time.monotonic() - started, 1),
        "synchronized": bool(daemon_records("synchronize", cursor)),
    }


def _pinned_beside_shared(
    cri: SystemdKubelet, prefix: str, result: dict[str, Any]
) -> tuple[RunningPod, RunningPod, set[int]]:
    """A shared pod, then a 2-CPU Guaranteed one: both pods' containers and the pinned one's
    CPUs, once the shared one is off them; what each looked like then goes in ``result``."""
    shared = cri.run(
        f"{prefix}-shared", [ContainerSpec("app", command=FIRST_LINE, cpu_request_milli=100)]
    )
    pinned = cri.run(f"{prefix}-pinned", [ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)])
    result["pinned_first_line"] = _first_line(cri, pinned["app"])
    exclusive = set(parse_cpu_list(result["pinned_first_line"]))
    result["shared_before"], _ = _wait_shared_off(cri, shared["app"], exclusive)
    result["pinned_before"] = container_facts(cri, pinned["app"])
    return shared, pinned, exclusive


def daemon_killed(address: str) -> dict[str, Any]:
    """A pinned pod and a shared one; kill -9 of the daemon; after its restart: the pins and
    the pool as before, and a new Guaranteed pod still pinned, the shared one off both."""
    result: dict[str, Any] = {}
    with SystemdKubelet(address) as cri:
        shared, pinned, exclusive = _pinned_beside_shared(cri, "kill", result)
        result["kill"] = kill_daemon()
        result["pinned_after"] = container_facts(cri, pinned["app"])
        result["shared_after"] = container_facts(cri, shared["app"])
        second = cri.run("kill-second", [ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)])
        result["second_first_line"] = _first_line(cri, second["app"])
        both = exclusive | set(parse_cpu_list(result["second_first_line"]))
        result["shared_after_second"], result["shared_moved_after_s"] = _wait_shared_off(
            cri, shared["app"], both
        )
        result["shared_tasks_after_second"] = tasks_allowed(scope_dir(cri, shared["app"]))
        cri.remove_all()
    return result


# -- (e) pods started in parallel -----------------------------------------------------------


def parallel_starts(address: str, burstable: int = 4) -> dict[str, Any]:
    """``burstable`` Burstable pods and one 2-CPU Guaranteed pod started at once, each by its
    own CRI client (kubelet's pod workers run in parallel); every shared task's CPUs at once
    and 2 s later, and each shared container's first line."""
    results: dict[str, Any] = {}
    errors: list[str] = []
    refused: list[str] = []
    start_called: dict[str, float] = {}  # wall clock: compared with the journal's
    cursor = journal_cursor()

    def start(name: str, spec: ContainerSpec) -> None:
        try:
            with SystemdKubelet(address) as cri:
                pod_id = cri.run_pod(PodSpec.for_containers(name, [spec]))
                cid = cri.create_container(pod_id, spec)
                start_called[name] = time.time()
                try:
                    cri.start(cid)
                except CRIError as e:
                    # The daemon refuses a start it cannot make safe (a shared container it
                    # cannot move off new exclusive CPUs in time); kubelet then removes the
                    # container and creates it again, as here.
                    refused.append(f"{name}: {str(e)[-300:]}")
                    cri.remove(cid)
                    cid = cri.create_container(pod_id, spec)
                    start_called[name] = time.time()
                    cri.start(cid)
                results[name] = {"cid": cid, "first_line": _first_line(cri, cid)}
        except Exception as e:
            errors.append(f"{name}: {type(e).__name__}: {e}")

    specs = {f"par-b{i}": ContainerSpec("app", command=FIRST_LINE, cpu_request_milli=100)
             for i in range(burstable)}  # fmt: skip
    specs["par-g"] = ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)
    threads = [threading.Thread(target=start, args=item) for item in specs.items()]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    out: dict[str, Any] = {"errors": errors, "refused_then_retried": refused}
    out["started_in_s"] = round(time.monotonic() - started, 1)
    with SystemdKubelet(address) as cri:
        if "par-g" in results:
            out["pinned_first_line"] = results["par-g"]["first_line"]
            scopes = {
                name: scope_dir(cri, r["cid"]) for name, r in results.items() if name != "par-g"
            }
            for label, delay in (("at_once", 0.0), ("after_2s", 2.0)):
                time.sleep(delay)
                out[label] = {
                    name: {
                        "effective": _read(d / "cpuset.cpus.effective"),
                        "tasks": tasks_allowed(d),
                    }
                    for name, d in scopes.items()
                }
            out["shared_first_lines"] = {
                name: r["first_line"] for name, r in results.items() if name != "par-g"
            }
            # When the CPUs stopped being shared: the daemon's first record naming the pod
            # (its earmark at RunPodSandbox, or the allocation).  A shared container whose
            # start was asked for before then may begin on them (and must be moved: the
            # samples above); one asked for after must not.
            named = [
                r for r in daemon_records(None, cursor) if "default/par-g" in r.get("MESSAGE", "")
            ]
            since = min((int(r["__REALTIME_TIMESTAMP"]) / 1e6 for r in named), default=None)
            out["exclusive_since"] = since
            out["started_after_exclusive"] = sorted(
                n for n, t in start_called.items() if n != "par-g" and since and t > since
            )
        cri.remove_all()
    return out


# -- (f) runtime restart, CPU hotplug under a pinned container ------------------------------


def _set_online(cpu: int, online: bool) -> None:
    Path(f"/sys/devices/system/cpu/cpu{cpu}/online").write_text("1" if online else "0")


def _wait_pinned(
    cri: SystemdKubelet, cid: str, done: Any, timeout: float = 60.0
) -> tuple[dict[str, Any], float]:
    """The container's facts once ``done(facts)`` holds (or at the deadline: then -1 s)."""
    started = time.monotonic()
    while True:
        facts = container_facts(cri, cid)
        if done(facts):
            return facts, round(time.monotonic() - started, 1)
        if time.monotonic() - started > timeout:
            return facts, -1.0
        time.sleep(0.5)


def restart_and_hotplug(address: str, runtime_unit: str) -> dict[str, Any]:
    """A pinned pod and a shared one.  The runtime restarted (its shims and containers keep
    running): pins and pool as before, a new Guaranteed pod pinned.  Then one CPU of the
    first pinned container offlined for real and onlined again: where the container and the
    shared one are after each step."""
    result: dict[str, Any] = {}
    with SystemdKubelet(address) as cri:
        shared, pinned, exclusive = _pinned_beside_shared(cri, "rh", result)
        cursor = journal_cursor()
        result["restart"] = _systemctl("restart", runtime_unit)
    # A new connection: the runtime's socket was recreated.
    deadline = time.monotonic() + 300
    while not daemon_records("synchronize", cursor) and time.monotonic() < deadline:
        time.sleep(0.5)
    result["resynchronized"] = bool(daemon_records("synchronize", cursor))
    with SystemdKubelet(address) as cri:
        result["pinned_after_restart"] = container_facts(cri, pinned["app"])
        result["shared_after_restart"] = container_facts(cri, shared["app"])
        second = cri.run("rh-second", [ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)])
        result["second_first_line"] = _first_line(cri, second["app"])
        both = exclusive | set(parse_cpu_list(result["second_first_line"]))
        result["shared_after_second"], _ = _wait_shared_off(cri, shared["app"], both)
        # Hotplug: the pinned container's highest CPU goes offline, then comes back.
        victim = max(exclusive)
        result["offlined"] = victim
        started = time.monotonic()
        _set_online(victim, False)
        try:
            result["offline_s"] = round(time.monotonic() - started, 1)
            result["pinned_offline"], result["pinned_offline_after_s"] = _wait_pinned(
                cri,
                pinned["app"],
                lambda f: (
                    victim not in parse_cpu_list(f["cpus_allowed_list"])
                    and len(parse_cpu_list(f["cpuset_cpus_effective"])) == 2
                ),
            )
            time.sleep(2)
            result["pinned_offline"] = container_facts(cri, pinned["app"])
            result["second_offline"] = container_facts(cri, second["app"])
            result["shared_offline"] = container_facts(cri, shared["app"])
            result["shared_tasks_offline"] = tasks_allowed(scope_dir(cri, shared["app"]))
        finally:
            _set_online(victim, True)
        result["topology_back"] = node_topology()
        time.sleep(5)  # the daemon follows the uevent; its writes go through systemd
        result["pinned_online"] = container_facts(cri, pinned["app"])
        result["second_online"] = container_facts(cri, second["app"])
        result["shared_online"] = container_facts(cri, shared["app"])
        result["shared_tasks_online"] = tasks_allowed(scope_dir(cri, shared["app"]))
        result["hotplug_records"] = [
            {k: r.get(k) for k in ("ACTION", "REASON", "MESSAGE")}
            for r in daemon_records("hotplug", cursor)
        ][:10]
        cri.remove_all()
    return result
