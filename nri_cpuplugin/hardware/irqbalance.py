"""Keeping irqbalance off the CPUs we keep free of interrupts (docs/cgroups-and-hooks.md §22).

irqbalance re-places every interrupt at each of its rescans (on SIGHUP, CPU hotplug, new
interrupts, or a change of its settings): an interrupt we narrowed goes back onto our CPUs
unless they are in its banned set.  Two of its documented mechanisms keep them there:

* **now**: its control socket, ``/run/irqbalance/irqbalance<pid>.sock`` (root only, one
  request per connection): ``settings cpus <list>`` replaces its banned set, ``settings cpus
  NULL`` returns to what it started with.  Lost when irqbalance restarts, so it is sent again
  whenever its pid changed.
* **at its next start**: ``IRQBALANCE_BANNED_CPULIST`` in an environment file of ours (``ENV``),
  which a drop-in for irqbalance.service loads after its own (packaging/).  An empty
  ``IRQBALANCE_BANNED_CPUS`` beside it, since that older hex setting wins over the list.

What irqbalance bans by itself (its environment at start, else the isolated and nohz_full
CPUs) stays banned: our CPUs are added to it.
"""

from __future__ import annotations

import os

from ..base.files import write_atomic
from ..core.cpuset import CPUSet
from .irq import parse_mask

SOCKET_DIR = "/run/irqbalance"
ENV = "/run/nri-cpuplugin/irqbalance.env"
SEND_TIMEOUT = 0.5  # one local request; irqbalance answers settings with nothing


def pid(proc: str = "/proc", sockets: str = SOCKET_DIR) -> int | None:
    """irqbalance's pid, found by its control socket (one per running irqbalance)."""
    try:
        names = os.listdir(sockets)
    except OSError:
        return None
    for name in names:
        if name.startswith("irqbalance") and name.endswith(".sock"):
            number = name[len("irqbalance") : -len(".sock")]
            if number.isdigit() and os.path.isdir(os.path.join(proc, number)):
                return int(number)
    return None


def own_ban(irqbalance: int, sysfs: str = "/sys", proc: str = "/proc") -> CPUSet:
    """What irqbalance bans without us: its environment's setting, else isolated and
    nohz_full CPUs (its own order of precedence)."""
    try:
        with open(os.path.join(proc, str(irqbalance), "environ"), "rb") as f:
            env = dict(
                item.split("=", 1) for item in f.read().decode("ascii", "replace").split("\0")
                if "=" in item
            )  # fmt: skip
    except OSError:
        env = {}
    try:
        if env.get("IRQBALANCE_BANNED_CPUS"):
            return parse_mask(env["IRQBALANCE_BANNED_CPUS"])
        if env.get("IRQBALANCE_BANNED_CPULIST"):
            return CPUSet.parse(env["IRQBALANCE_BANNED_CPULIST"])
    except ValueError:
        pass
    found = CPUSet()
    for name in ("isolated", "nohz_full"):
        try:
            with open(os.path.join(sysfs, "devices", "system", "cpu", name)) as f:
                found |= CPUSet.parse(f.read().strip() or "")
        except (OSError, ValueError):
            continue
    return found


def ban(
    keep: CPUSet,
    sysfs: str = "/sys",
    proc: str = "/proc",
    env: str = ENV,
    sockets: str = SOCKET_DIR,
) -> str | None:
    """Make irqbalance leave ``keep`` alone, now and after its next start (empty: our ban
    lifted); None, or why it could not be told now."""
    running = pid(proc, sockets)
    base = own_ban(running, sysfs, proc) if running is not None else CPUSet()
    _write_env(env, base | keep if keep else None)
    if running is None:
        return None
    request = f"settings cpus {base | keep}" if keep else "settings cpus NULL"
    return _send(os.path.join(sockets, f"irqbalance{running}.sock"), request)


def _send(path: str, request: str) -> str | None:
    import _socket  # the C core: the OCI hook does not load the socket module

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(SEND_TIMEOUT)
        sock.connect(path)
        sock.sendall(request.encode())
    except OSError as err:
        return f"irqbalance's socket {path}: {err.strerror or err}"
    finally:
        sock.close()
    return None


def _write_env(path: str, banned: CPUSet | None) -> None:
    """The environment irqbalance's next start reads (no file: nothing of ours to add)."""
    try:
        if banned is None:
            os.unlink(path)
            return
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        body = f"IRQBALANCE_BANNED_CPUS=\nIRQBALANCE_BANNED_CPULIST={banned}\n"
        directory, name = os.path.split(path)
        write_atomic(directory, name, body.encode(), mode=0o644, durable=False)
    except OSError:
        return  # a read-only /run: the socket still tells the running irqbalance
