"""A FAKE kubelet for one workload manifest: the pod template of a DaemonSet run through CRI the
way kubelet runs it, because no kubelet or API server can run here.

It reads the manifest's pod template and sends what kubelet would for it: RunPodSandbox with
the pod's namespaces, labels and annotations; CreateContainer with the container's image,
command and args, env, resources (kubelet's arithmetic, harness/k8s.py), volume mounts and
securityContext; StartContainer.  ``hostPath`` volumes are checked by their ``type`` as kubelet
checks them (``DirectoryOrCreate`` made, ``Directory``/``File``/``Socket`` required) and may be
mapped to other places on this machine (a private runtime's NRI socket directory, a state
directory of the test's); a ``configMap`` volume's keys are written as files and mounted
read-only, as kubelet's are.  ``restartPolicy: Always`` is kept by :meth:`DaemonSetPod.sync`
(the restart of an exited container, as the next attempt, without kubelet's back-off); an
``exec`` probe runs through ExecSync.  Not modelled: the scheduler, tolerations, priority,
service links, kubelet's back-off and its probes' periods (the test calls them when it wants
an answer).
:func:`patched` applies a strategic-merge patch to the manifest's DaemonSet with a real
``kubectl patch --local`` (Debian's kubernetes-client), as an operator's ``kubectl patch``
changes the DaemonSet.
"""

from __future__ import annotations

import json
import secrets
import stat
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from . import host_tools
from .cri import CRIClient
from .k8s import ContainerSpec, Mount, PodSpec, Security

# a volumeMount's mountPropagation -> CRI's MountPropagation
PROPAGATION = {
    "None": "PROPAGATION_PRIVATE",
    "HostToContainer": "PROPAGATION_HOST_TO_CONTAINER",
    "Bidirectional": "PROPAGATION_BIDIRECTIONAL",
}


class ManifestError(ValueError):
    """The manifest asks for something this fake kubelet (or a real one) cannot give."""


def documents(manifest: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(manifest.read_text()) if d]


def one(manifest: Path, kind: str) -> dict[str, Any]:
    found = [d for d in documents(manifest) if d.get("kind") == kind]
    if len(found) != 1:
        raise ManifestError(f"{manifest}: expected one {kind}, found {len(found)}")
    return found[0]


def patched(manifest: Path, patch: Path, out: Path) -> Path:
    """``manifest`` with its DaemonSet patched by ``patch`` (strategic merge, by kubectl),
    written to ``out``; the other documents as they are."""
    kubectl = host_tools.ensure("kubectl")["kubectl"]
    daemonset = out.with_suffix(".daemonset.yaml")
    daemonset.write_text(yaml.safe_dump(one(manifest, "DaemonSet")))
    result = subprocess.run(
        [str(kubectl), "patch", "--local", "-f", str(daemonset), "--type", "strategic",
         "--patch-file", str(patch), "-o", "yaml"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    if result.returncode:
        raise ManifestError(f"kubectl patch {patch} failed: {result.stderr.strip()}")
    rest = [d for d in documents(manifest) if d.get("kind") != "DaemonSet"]
    out.write_text(yaml.safe_dump_all([*rest, yaml.safe_load(result.stdout)]))
    return out


def kubelet_checkpoint(path: Path, policy: str = "none") -> Path:
    """kubelet's CPU manager checkpoint at ``path``, as kubelet writes it at its start whatever
    its policy (FAKE: no kubelet runs here); the manifest mounts it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"policyName": policy, "defaultCpuSet": "", "checksum": 1}))
    return path


def milli_cpu(quantity: str | int | None) -> int | None:
    """Kubernetes CPU quantity ("50m", "2", "0.5") in millicores."""
    if quantity is None:
        return None
    text = str(quantity)
    if text.endswith("m"):
        return int(text[:-1])
    return round(float(text) * 1000)


class DaemonSetPod:
    """The pod a DaemonSet's controller would create on this node, run as kubelet would run it.

    ``host_paths`` maps a hostPath volume's path to where it is on this machine (the rest are
    used as they are); ``image`` replaces the manifest's image (an upgrade is a new pod with
    the new image, as the DaemonSet controller makes it)."""

    def __init__(
        self,
        cri: CRIClient,
        manifest: Path,
        workdir: Path,
        *,
        host_paths: Mapping[str, str | Path] | None = None,
        image: str | None = None,
    ) -> None:
        self.cri = cri
        self.manifest = manifest
        self.workdir = workdir
        self.host_paths = {k: str(v) for k, v in (host_paths or {}).items()}
        self.daemonset = one(manifest, "DaemonSet")
        template = self.daemonset["spec"]["template"]
        self.meta = template.get("metadata", {})
        self.spec = template["spec"]
        if len(self.spec["containers"]) != 1:
            raise ManifestError("the fake kubelet runs pods of one container")
        self.container = self.spec["containers"][0]
        self.image = image or self.container["image"]
        self.pod_id: str | None = None
        self.container_id: str | None = None
        self.attempt = 0
        self.restarts = 0
        self._pod: PodSpec | None = None

    # -- what kubelet derives from the template --------------------------------------------

    def mounts(self) -> list[Mount]:
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        mounts = []
        for mount in self.container.get("volumeMounts", []):
            volume = volumes.get(mount["name"])
            if volume is None:
                raise ManifestError(f"volumeMount {mount['name']!r} names no volume")
            mounts.append(
                Mount(
                    self._volume_source(volume),
                    mount["mountPath"],
                    # kubelet mounts configMap volumes read-only whatever the mount says
                    readonly=bool(mount.get("readOnly")) or "configMap" in volume,
                    propagation=PROPAGATION[mount.get("mountPropagation", "None")],
                )
            )
        return mounts

    def _volume_source(self, volume: dict[str, Any]) -> str:
        if "hostPath" in volume:
            path = volume["hostPath"]["path"]
            here = Path(self.host_paths.get(path, path))
            kind = volume["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                here.mkdir(parents=True, exist_ok=True, mode=0o755)
            elif kind == "Directory" and not here.is_dir():
                raise ManifestError(f"hostPath {path} ({here}): not a directory")
            elif kind == "File" and not here.is_file():
                raise ManifestError(f"hostPath {path} ({here}): not a file")
            elif kind == "Socket" and not (here.exists() and stat.S_ISSOCK(here.stat().st_mode)):
                raise ManifestError(f"hostPath {path} ({here}): not a socket")
            return str(here)
        if "configMap" in volume:
            return str(self._config_map(volume["configMap"]["name"]))
        raise ManifestError(f"volume {volume['name']!r}: only hostPath and configMap are run")

    def _config_map(self, name: str) -> Path:
        maps = [d for d in documents(self.manifest) if d.get("kind") == "ConfigMap"]
        found = [m for m in maps if m["metadata"]["name"] == name]
        if not found:
            raise ManifestError(f"configMap {name!r} is not in {self.manifest}")
        directory = self.workdir / "configmaps" / name
        directory.mkdir(parents=True, exist_ok=True)
        for key, text in found[0].get("data", {}).items():
            (directory / key).write_text(text)
        return directory

    def security(self) -> Security:
        context = self.container.get("securityContext", {})
        capabilities = context.get("capabilities", {})
        seccomp = context.get("seccompProfile", {}).get("type")
        return Security(
            privileged=bool(context.get("privileged")),
            run_as_user=context.get("runAsUser"),
            readonly_rootfs=bool(context.get("readOnlyRootFilesystem")),
            # kubelet: allowPrivilegeEscalation false (and not privileged) -> no_new_privs
            no_new_privs=context.get("allowPrivilegeEscalation") is False,
            add_capabilities=tuple(capabilities.get("add", ())),
            drop_capabilities=tuple(capabilities.get("drop", ())),
            seccomp_runtime_default=seccomp == "RuntimeDefault",
        )

    def container_spec(self) -> ContainerSpec:
        resources = self.container.get("resources", {})
        requests, limits = resources.get("requests", {}), resources.get("limits", {})
        argv = [*self.container.get("command", ()), *self.container.get("args", ())]
        if not argv:
            raise ManifestError("the fake kubelet needs the container's command in the manifest")
        return ContainerSpec(
            self.container["name"],
            command=argv,
            cpu_request_milli=milli_cpu(requests.get("cpu")),
            cpu_limit_milli=milli_cpu(limits.get("cpu")),
            memory=limits.get("memory"),
            memory_request=requests.get("memory"),
            env={e["name"]: str(e.get("value", "")) for e in self.container.get("env", [])},
            image=self.image,
            mounts=self.mounts(),
            security=self.security(),
            attempt=self.attempt,
        )

    def pod_spec(self) -> PodSpec:
        name = f"{self.daemonset['metadata']['name']}-{secrets.token_hex(3)}"
        return PodSpec.for_containers(
            name,
            [self.container_spec()],
            namespace=self.daemonset["metadata"].get("namespace", "default"),
            uid=str(uuid.uuid4()),
            labels=self.meta.get("labels", {}),
            annotations=self.meta.get("annotations", {}),
            host_network=bool(self.spec.get("hostNetwork")),
            host_pid=bool(self.spec.get("hostPID")),
        )

    # -- running it ----------------------------------------------------------------------

    def start(self) -> str:
        """RunPodSandbox, CreateContainer, StartContainer; returns the container's id."""
        self._pod = self.pod_spec()
        self.pod_id = self.cri.run_pod(self._pod)
        return self._create_and_start()

    def _create_and_start(self) -> str:
        assert self.pod_id is not None
        self.container_id = self.cri.create_container(self.pod_id, self.container_spec())
        self.cri.start(self.container_id)
        return self.container_id

    def running(self) -> bool:
        return self.container_id is not None and self.cri.state(self.container_id) == (
            "CONTAINER_RUNNING"
        )

    def sync(self) -> bool:
        """kubelet's restartPolicy Always: an exited container is removed and created again as
        the next attempt (no back-off here).  Returns whether it restarted one."""
        if self.container_id is None or self.running():
            return False
        self.cri.remove(self.container_id)
        self.attempt += 1
        self.restarts += 1
        self._create_and_start()
        return True

    def pid(self) -> int:
        assert self.container_id is not None
        return self.cri.inspect(self.container_id).pid

    def logs(self) -> list[str]:
        assert self.container_id is not None
        return self.cri.logs(self.container_id, None)

    def probe(self, kind: str) -> int | None:
        """Run the container's ``readinessProbe``/``livenessProbe`` exec command once; its exit
        code (None: no such probe)."""
        probe = self.container.get(kind)
        if probe is None:
            return None
        if "exec" not in probe:
            raise ManifestError(f"{kind}: only exec probes are run")
        assert self.container_id is not None
        timeout = int(probe.get("timeoutSeconds", 1))
        code, _, _ = self.cri.exec_sync(self.container_id, probe["exec"]["command"], timeout)
        return code

    def delete(self, grace: int | None = None) -> None:
        """The pod deleted, as the DaemonSet controller deletes it in an update: its
        container stopped within the grace period, then the sandbox stopped and removed."""
        if self.pod_id is None:
            return
        if grace is None:
            grace = int(self.spec.get("terminationGracePeriodSeconds", 30))
        try:
            if self.container_id is not None:
                self.cri.stop(self.container_id, grace)
            self.cri.stop_pod(self.pod_id)
            self.cri.remove_pod(self.pod_id)
        finally:
            self.pod_id = self.container_id = None
