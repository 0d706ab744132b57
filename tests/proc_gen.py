"""A generated /proc for interrupts (the FAKE kernel side of hardware/interrupts/affinity.py):
``irq/<n>/smp_affinity_list`` for each interrupt, ``irq/default_smp_affinity``, and the
``interrupts`` table naming each one's handlers.  Put beside a generated sysfs tree
(``Roots.beside``), it is what the daemon reads and writes instead of the host's."""

from __future__ import annotations

from pathlib import Path


def proc_tree(root: Path, irqs: dict[int, str], default: str = "ff", cpus: int = 8) -> Path:
    """A generated /proc with ``irqs`` (number -> smp_affinity_list), their /proc/interrupts
    rows for ``cpus`` CPUs, and the default affinity (a hex mask)."""
    (root / "irq").mkdir(parents=True)
    (root / "irq" / "default_smp_affinity").write_text(f"{default}\n")
    rows = ["           " + " ".join(f"CPU{i}" for i in range(cpus))]
    zeros = " ".join("0" for _ in range(cpus))
    for number, affinity in irqs.items():
        (root / "irq" / str(number)).mkdir()
        (root / "irq" / str(number) / "smp_affinity_list").write_text(f"{affinity}\n")
        rows.append(f" {number}: {zeros} PCI-MSIX 1-edge virtio{number}")
    (root / "interrupts").write_text("\n".join(rows) + "\n")
    return root


def affinities(root: Path) -> dict[int, str]:
    """Every interrupt's affinity list as the tree holds it now (-1: the default mask)."""
    found = {-1: (root / "irq" / "default_smp_affinity").read_text().strip()}
    for entry in (root / "irq").iterdir():
        if entry.name.isdigit():
            found[int(entry.name)] = (entry / "smp_affinity_list").read_text().strip()
    return found
