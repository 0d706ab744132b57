"""Device interrupts' CPU affinity, as the kernel shows it under /proc (docs/cgroups-and-hooks.md
§22 has the facts).

* ``/proc/irq/<n>/smp_affinity_list``: the CPUs an interrupt may be delivered to, as a list;
  a write refused with EIO (kernels up to 6.11) or EPERM (later ones: the file is then
  read-only) means the kernel manages that interrupt itself (blk-mq queue vectors) or it
  cannot be moved at all (the timer, per-CPU interrupts) - ``Refused``, left alone.  A set
  with no online CPU is EINVAL: never written.
* ``/proc/irq/default_smp_affinity``: the affinity interrupts requested from now on start
  with, as a hex mask (32-bit groups, most significant first, comma-separated).
* ``/proc/interrupts``: one column of counts per online CPU, then the chip, the hardware
  interrupt and the handlers' names: those last fields tell a device's interrupt from another
  device's that got the same number after a driver rebind.
"""

from __future__ import annotations

import errno
import os

from ...base.errors import PluginError
from ...core.cpuset import CPUSet
from ...core.irq import DEFAULT, Irq

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import NoReturn

# The largest /proc/interrupts (or mask file) read: a node with thousands of interrupts and
# hundreds of CPUs stays far below it.
MAX_READ = 16 << 20
# How the kernel refuses one interrupt (managed, per-CPU): EIO, EPERM from kernel 6.12, whose
# files of such interrupts are 0444 (EACCES without CAP_DAC_OVERRIDE, as in a container).
REFUSED = (errno.EIO, errno.EPERM, errno.EACCES)


class IrqError(PluginError):
    """An interrupt's affinity could not be read or written; the message says which and why."""

    code = "irq"


class Refused(IrqError):
    """The kernel does not let anyone change this interrupt's affinity (managed, per-CPU)."""


class ReadOnly(IrqError):
    """/proc/irq is mounted read-only here (a container's default, a sandbox's
    ProtectKernelTunables=): no interrupt's affinity can change, whatever the kernel allows."""


def interrupts(proc: str = "/proc") -> list[Irq]:
    """Every numbered interrupt with an affinity file, and the default (``DEFAULT``)."""
    return sorted(reading(proc), key=lambda irq: irq.number)


def reading(proc: str = "/proc") -> Iterator[Irq]:
    """``interrupts`` one at a time (in no order; the default last), for a reader that stops
    between them (thousands on a large node: tens of milliseconds in all)."""
    names = _names(proc)
    base = os.path.join(proc, "irq")
    try:
        entries = os.listdir(base)
    except OSError as err:
        raise IrqError(f"cannot list {base}: {err.strerror}") from None
    for entry in entries:
        if not entry.isdigit():
            continue
        number = int(entry)
        try:
            text = _read(os.path.join(base, entry, "smp_affinity_list"))
            requested = CPUSet.parse(text)
        except (OSError, ValueError):
            continue  # gone meanwhile, or nothing a set can be made of: not ours to touch
        yield Irq(number, requested, names.get(number, ""))
    yield Irq(DEFAULT, default_affinity(proc), "default")


def write(proc: str, number: int, cpus: CPUSet) -> None:
    """Set one interrupt's affinity (``DEFAULT``: the default affinity of new ones)."""
    if number == DEFAULT:
        path = os.path.join(proc, "irq", "default_smp_affinity")
        data = mask_text(cpus, _groups(path))
    else:
        path = os.path.join(proc, "irq", str(number), "smp_affinity_list")
        data = str(cpus)
    try:
        # (O_TRUNC as a shell's redirection: ignored by procfs, needed by a plain-file tree)
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        _raise(err, path, cpus)
    try:
        os.write(fd, f"{data}\n".encode())
    except OSError as err:
        _raise(err, path, cpus)
    finally:
        os.close(fd)


def default_affinity(proc: str = "/proc") -> CPUSet:
    path = os.path.join(proc, "irq", "default_smp_affinity")
    try:
        return parse_mask(_read(path))
    except (OSError, ValueError) as err:
        raise IrqError(f"cannot read {path}: {err}") from None


def parse_mask(text: str) -> CPUSet:
    """A kernel hex CPU mask (``ff,ffffffff``) as a set; ValueError for anything else."""
    digits = text.strip().replace(",", "")
    if not digits or len(digits) > 4096 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        raise ValueError(f"not a hex CPU mask: {text[:40]!r}")
    bits = int(digits, 16)
    return CPUSet(i for i in range(bits.bit_length()) if bits >> i & 1)


def mask_text(cpus: CPUSet, groups: int) -> str:
    """``cpus`` as the kernel writes a mask: ``groups`` 32-bit hex groups (as many as the
    kernel's own, so it is not refused as too long), most significant first."""
    bits = 0
    for cpu in cpus:
        bits |= 1 << cpu
    groups = max(groups, (max(cpus, default=0) // 32) + 1)
    return ",".join(f"{bits >> (32 * i) & 0xFFFFFFFF:08x}" for i in reversed(range(groups)))


def counts(proc: str = "/proc") -> dict[str, dict[int, int]]:
    """Interrupt counts per online CPU, by the interrupt's number and handlers (for tests and
    operators: which CPUs take a device's interrupts)."""
    path = os.path.join(proc, "interrupts")
    lines = _read(path).splitlines()
    if not lines:
        return {}
    words = lines[0].split()
    if not words or any(not w.startswith("CPU") or not w[3:].isdigit() for w in words):
        # Not the kernel's header (one CPU<n> per online CPU): no column can be trusted.
        raise IrqError(
            f"{path}: its first line should name one CPU<n> column per online CPU, not "
            f"{lines[0].strip()[:80]!r}; interrupts are left as they are until it does"
        )
    cpus = [int(word[3:]) for word in words]
    found = {}
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        fields = rest.split()
        if not label.strip().isdigit() or len(fields) < len(cpus):
            continue
        key = f"{label.strip()} {' '.join(fields[len(cpus) :])}"
        found[key] = {cpu: int(n) for cpu, n in zip(cpus, fields, strict=False) if n.isdigit()}
    return found


def _names(proc: str) -> dict[int, str]:
    """Interrupt number -> what /proc/interrupts says after its counts (chip, hardware
    interrupt, handlers)."""
    try:
        table = counts(proc)
    except OSError:
        return {}
    return {int(key.split(" ", 1)[0]): key.split(" ", 1)[1] for key in table if " " in key}


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, MAX_READ).decode("ascii", "replace")
    finally:
        os.close(fd)


def _groups(path: str) -> int:
    try:
        return _read(path).strip().count(",") + 1
    except OSError:
        return 1


def _raise(err: OSError, path: str, cpus: CPUSet) -> NoReturn:
    if err.errno == errno.EROFS:
        raise ReadOnly(
            f"cannot write {path}: /proc/irq is read-only here, so no interrupt can be moved. "
            "Run the plugin where it is writable (the DaemonSet with its node-features.yaml "
            "patch, the unit with its irq.conf drop-in: docs/operator-guide.md section 5)"
        ) from None
    if err.errno in REFUSED:
        raise Refused(
            f"{path}: the kernel does not let its affinity change ({err.strerror}): a managed "
            "or per-CPU interrupt"
        ) from None
    raise IrqError(f"cannot write {cpus} to {path}: {err.strerror}") from None
