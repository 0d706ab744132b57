"""Coexistence with kubelet's CPU manager: only one of us may own a node's CPUs.

kubelet's static policy pins Guaranteed containers itself and records its assignments in its
checkpoint, ``/var/lib/kubelet/cpu_manager_state`` (JSON: ``policyName``, ``defaultCpuSet``,
``entries``).  With it, kubelet and the plugin would each hand out the same CPUs, and kubelet
rewrites every container's cpuset behind our back (its reconcile loop).  So the daemon refuses
to start while that file says ``static``: a configuration error (exit 2) whose message names
the migration (docs/operator-guide.md section 2.6).  With ``none`` (or no file, or a node
without kubelet) the plugin may own the CPUs.
"""

from __future__ import annotations

import logging

from ..base import files, jsonbytes
from .config import ConfigError

log = logging.getLogger("nri_cpuplugin")

MAX_SIZE = 1 << 20  # a checkpoint of thousands of containers is far below this


class KubeletOwnsCPUs(ConfigError):
    """kubelet's static CPU manager policy owns this node's CPUs."""

    code = "kubelet-static"


def check(path: str) -> None:
    """Raise KubeletOwnsCPUs when kubelet's checkpoint at ``path`` names the static policy.
    A missing file is no kubelet policy; an unreadable one is logged, not refused (the
    operator set the path: a wrong one must not keep the node unpinned)."""
    if not path:
        return
    try:
        doc = jsonbytes.loads(files.read_bounded(path, MAX_SIZE))
    except files.FileError as err:
        if err.code != "missing":
            log.warning("cannot tell kubelet's CPU manager policy: %s", err)
        return
    except jsonbytes.DecodeError as err:
        log.warning("cannot tell kubelet's CPU manager policy from %s: %s", path, err)
        return
    policy = doc.get("policyName") if isinstance(doc, dict) else None
    if policy == "static":
        raise KubeletOwnsCPUs(
            f"kubelet's static CPU manager policy owns this node's CPUs ({path} says "
            '"policyName": "static"); both would pin the same CPUs. Drain the node, set '
            "kubelet's cpuManagerPolicy to none, remove that file, restart kubelet, then start "
            "nri-cpuplugin (docs/operator-guide.md, section 2.6)"
        )
