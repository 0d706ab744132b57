"""The network interfaces of Guaranteed pods, read when each pod's sandbox starts.

NIC locality (hardware/nic.py) lists the interfaces in a pod's network namespace before its
exclusive CPUs are chosen.  That takes a thread that enters the namespace and a netlink dump:
about 0.25 ms warm and 0.55 ms on a cold cache here, more while CNI plugins hold the kernel's
network lock for other pods - the largest single part of an exclusive creation's decision.
But the interfaces are known earlier: the runtime sends RunPodSandbox once the pod's network
is set up (CNI, Multus included, has run; containerd and CRI-O alike), and the first
container comes after its image is pulled.  So for pods that can hold exclusive containers
(Guaranteed, in a network namespace of their own), a background thread reads the
interfaces then, and the creation uses what was read: it waits for a read still running, and
reads for itself when there was none (the daemon started after the pod did) or it failed.

An interface moved into the pod's namespace after the sandbox started is not seen by its
containers' placement.  Entries are dropped with the pod (RemovePodSandbox) and when the
runtime no longer lists it (Synchronize); at most ``limit`` pods are kept, oldest dropped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from ..hardware import nic

Listing = tuple[list[nic.Link], dict[int, nic.Link] | None]


class _Read:
    def __init__(self, pod_uid: str, netns: str) -> None:
        self.pod_uid = pod_uid
        self.netns = netns
        self.done = threading.Event()
        self.listing: Listing | None = None  # None when the read failed


class PodNICs:
    """Pod uid -> the interfaces of its network namespace, read ahead (see the module text)."""

    def __init__(self, lister: Callable[[str], Listing] = nic.list_links, limit: int = 4096):
        self.lister = lister
        self.limit = limit
        self._reads: dict[str, _Read] = {}
        self._guard = threading.Lock()
        self._queue: queue.SimpleQueue[_Read] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._reads)

    def read_ahead(self, pod_uid: str, netns: str) -> None:
        """Start reading the interfaces of ``netns`` for the pod; returns at once."""
        read = _Read(pod_uid, netns)
        with self._guard:
            self._reads.pop(pod_uid, None)  # (re-inserted last: the newest)
            self._reads[pod_uid] = read
            while len(self._reads) > self.limit:
                del self._reads[next(iter(self._reads))]
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="nri-cpuplugin-pod-nics", daemon=True
                )
                self._thread.start()
        self._queue.put(read)

    def lister_for(self, pod_uid: str, netns: str | None) -> Callable[[str], Listing] | None:
        """A ``lister`` for nic.locality that returns what was read for the pod (waiting for
        a read still running), or None: nothing read for this namespace (None: the host's),
        or the read failed."""
        with self._guard:
            read = self._reads.get(pod_uid)
        if read is None or read.netns != netns:
            return None
        read.done.wait()
        listing = read.listing
        if listing is None:
            return None
        return lambda _netns: listing

    def forget(self, pod_uid: str) -> None:
        with self._guard:
            self._reads.pop(pod_uid, None)

    def keep_only(self, pod_uids: Iterable[str]) -> None:
        keep = set(pod_uids)
        with self._guard:
            for uid in [u for u in self._reads if u not in keep]:
                del self._reads[uid]

    def _run(self) -> None:
        while True:
            read = self._queue.get()
            with self._guard:
                wanted = self._reads.get(read.pod_uid) is read  # not gone with its pod
            try:
                if wanted:
                    read.listing = self.lister(read.netns)
            except Exception:  # the creation reads again, and reports what fails
                read.listing = None
            finally:
                read.done.set()
