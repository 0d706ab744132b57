"""The network interfaces of Guaranteed pods, read when each pod's sandbox starts.

NIC locality (hardware/nic.py) lists the interfaces in a pod's network namespace before its
exclusive CPUs are chosen.  That takes a thread that enters the namespace and a netlink dump:
about 0.25 ms warm and 0.55 ms on a cold cache here, more while CNI plugins hold the kernel's
network lock for other pods - the largest single part of an exclusive creation's decision.
But the interfaces are known earlier: the runtime sends RunPodSandbox once the pod's network
is set up (CNI, Multus included, has run; containerd and CRI-O alike), and the first
container comes after its image is pulled.  So for pods that can hold exclusive containers
(Guaranteed, in a network namespace of their own), a background thread reads the
interfaces then, and the creation uses what was read.  It waits for a read still running, up
to ``WAIT``; then, and when the read failed, it goes on as after a failed read of its own (no
NIC preference, or a refusal where locality is strict), never reading again: a second read
could take as long as the first and cost the request its deadline.  It reads for itself when
there was no read (the daemon started after the pod did, or no thread could be started).

An interface moved into the pod's namespace after the sandbox started is not seen by its
containers' placement.  Entries are dropped with the pod (RemovePodSandbox) and when the
runtime no longer lists it (Synchronize); at most ``limit`` pods are kept, oldest dropped.
They are keyed by sandbox id, not pod uid: a pod whose sandbox is recreated (same uid) keeps
the new sandbox's read when the old sandbox's removal comes after it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from ..hardware import netns_links

Listing = tuple[list[netns_links.Link], dict[int, netns_links.Link] | None]

# How long a creation waits for its pod's read: as long as one netlink receive may take, so a
# read stalled by the kernel (CNI holding its network lock) leaves the creation within budget.
WAIT = netns_links.NETLINK_TIMEOUT


class _Read:
    def __init__(self, sandbox_id: str, netns: str) -> None:
        self.sandbox_id = sandbox_id
        self.netns = netns
        self.done = threading.Event()
        self.listing: Listing | None = None
        self.error = ""  # why the read failed: what a read at the creation would report


class PodNICs:
    """Sandbox id -> the interfaces of its network namespace, read ahead (see the module text)."""

    def __init__(
        self, lister: Callable[[str], Listing] = netns_links.list_links, limit: int = 4096
    ):
        self.lister = lister
        self.limit = limit
        self._reads: dict[str, _Read] = {}
        self._guard = threading.Lock()
        self._queue: queue.SimpleQueue[_Read] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._reads)

    def read_ahead(self, sandbox_id: str, netns: str) -> None:
        """Start reading the interfaces of ``netns`` for the pod; returns at once."""
        read = _Read(sandbox_id, netns)
        with self._guard:
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name="nri-cpuplugin-pod-nics", daemon=True
                )
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had (a pids limit): creations read
                    return
                self._thread = thread
            self._reads.pop(sandbox_id, None)  # (re-inserted last: the newest)
            self._reads[sandbox_id] = read
            while len(self._reads) > self.limit:
                del self._reads[next(iter(self._reads))]
        self._queue.put(read)

    def lister_for(
        self, sandbox_id: str, netns: str | None
    ) -> Callable[[str | None], Listing] | None:
        """A ``lister`` for nic.locality that gives what was read for the pod (waiting up to
        WAIT for a read still running) or raises as the read did; None when nothing was read
        for this namespace (None: the host's) or the read failed unexpectedly: the caller
        reads for itself."""
        with self._guard:
            read = self._reads.get(sandbox_id)
        if read is None or read.netns != netns:
            return None
        if not read.done.wait(WAIT):
            error = f"the read of its interfaces, started with the pod, took over {WAIT:g} s"
        elif read.listing is not None:
            listing = read.listing
            return lambda _netns: listing
        elif read.error:
            error = read.error
        else:
            return None

        def failed(_netns: str | None) -> Listing:
            raise netns_links.NICError(error)

        return failed

    def forget(self, sandbox_id: str) -> None:
        with self._guard:
            self._reads.pop(sandbox_id, None)

    def keep_only(self, sandbox_ids: Iterable[str]) -> None:
        keep = set(sandbox_ids)
        with self._guard:
            for sid in [s for s in self._reads if s not in keep]:
                del self._reads[sid]

    def _run(self) -> None:
        while True:
            read = self._queue.get()
            with self._guard:
                wanted = self._reads.get(read.sandbox_id) is read  # not gone with its pod
            try:
                if wanted:
                    read.listing = self.lister(read.netns)
            except (netns_links.NICError, OSError) as err:  # reported by the creation, as its own
                read.error = str(err) or type(err).__name__
            except Exception:  # unexpected: the creation reads again, and reports what fails
                pass
            finally:
                read.done.set()
