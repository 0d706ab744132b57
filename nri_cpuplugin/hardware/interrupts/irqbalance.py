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
CPUs) stays banned: our CPUs are added to it.  An irqbalance started with our file has our ban
of that time in its environment, which must not be taken for its own (or the CPUs of gone pods
would stay banned for good): the file also holds what irqbalance bans without us
(``OWN_BAN``), which such an irqbalance then has in its environment too.  A lift sends that
ban back to it explicitly, since ``settings cpus NULL`` would return to our old one.
"""

from __future__ import annotations

import os

from ...base.files import write_atomic
from ...core.cpuset import CPUSet
from .affinity import parse_mask

SOCKET_DIR = "/run/irqbalance"
ENV = "/run/nri-cpuplugin/irqbalance.env"
SEND_TIMEOUT = 0.5  # one local request; irqbalance answers settings with nothing
OWN_BAN = "NRI_CPUPLUGIN_OWN_BANNED_CPULIST"  # what irqbalance bans without us (ENV)


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


def own_ban(
    irqbalance: int | None, sysfs: str = "/sys", proc: str = "/proc", env: str = ENV
) -> CPUSet:
    """What irqbalance bans without us: as recorded in our environment file when it started
    with it (or, not running, as our file says), else its environment's setting, else isolated
    and nohz_full CPUs (its own order of precedence)."""
    if irqbalance is None:
        environ, recorded = {}, _env_file(env).get(OWN_BAN)
    else:
        environ = _environ(irqbalance, proc)
        recorded = environ.get(OWN_BAN)
    try:
        if recorded is not None:
            return CPUSet.parse(recorded)
        if environ.get("IRQBALANCE_BANNED_CPUS"):
            return parse_mask(environ["IRQBALANCE_BANNED_CPUS"])
        if environ.get("IRQBALANCE_BANNED_CPULIST"):
            return CPUSet.parse(environ["IRQBALANCE_BANNED_CPULIST"])
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
    lifted); None, or why it could not be told now (a lift is then owed: our file stays)."""
    running = pid(proc, sockets)
    base = own_ban(running, sysfs, proc, env)
    if keep:
        _write_env(env, base | keep, base)
    if running is not None:
        socket = os.path.join(sockets, f"irqbalance{running}.sock")
        why = _send(
            socket, f"settings cpus {base | keep}" if keep else _lift(running, base, sysfs, proc)
        )
        if why is not None:
            return why
    if not keep:
        _write_env(env, None, base)
    return None


def banning(env: str = ENV) -> bool:
    """Whether a ban of ours may be in force (our environment file is there: a lift is owed)."""
    return os.path.exists(env)


def _lift(running: int, base: CPUSet, sysfs: str, proc: str) -> str:
    """The request giving irqbalance back its own ban."""
    if OWN_BAN not in _environ(running, proc):
        return "settings cpus NULL"  # it started without our file: NULL is its own ban
    if base:
        return f"settings cpus {base}"
    # Nothing of its own to ban, but NULL would go back to our ban it started with: a CPU this
    # boot never has bans nothing that exists (irqbalance has no request for an empty set).
    try:
        with open(os.path.join(sysfs, "devices", "system", "cpu", "possible")) as f:
            return f"settings cpus {max(CPUSet.parse(f.read().strip())) + 1}"
    except (OSError, ValueError):
        return "settings cpus 8192"  # past any kernel's NR_CPUS


def _environ(irqbalance: int, proc: str) -> dict[str, str]:
    try:
        with open(os.path.join(proc, str(irqbalance), "environ"), "rb") as f:
            items = f.read().decode("ascii", "replace").split("\0")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in items if "=" in item)


def _env_file(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line)


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


def _write_env(path: str, banned: CPUSet | None, own: CPUSet) -> None:
    """The environment irqbalance's next start reads (no file: nothing of ours to add), with
    what it bans without us."""
    try:
        if banned is None:
            os.unlink(path)
            return
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        body = f"IRQBALANCE_BANNED_CPUS=\nIRQBALANCE_BANNED_CPULIST={banned}\n{OWN_BAN}={own}\n"
        directory, name = os.path.split(path)
        write_atomic(directory, name, body.encode(), mode=0o644, durable=False)
    except OSError:
        return  # a read-only /run: the socket still tells the running irqbalance
