"""Figures the docs quote from docs/benchmarks.md are the ones it holds.

``./dev bench`` regenerates docs/benchmarks.md; prose elsewhere quotes it and drifts when a
rerun changes a figure.  The rule checked here, for README.md, docs/*.md, hooks/README.md and
packaging/README.md:

* a paragraph, list item or table row that cites ``benchmarks.md`` and quotes a figure names
  the section it quotes (``docs/benchmarks.md, "OCI hook"``), a heading of benchmarks.md;
* every figure with a unit in it (``30.4 ms``, ``2.28x``, ``69 %``, ``38.6 MiB``, the ends of a
  range ``0.94-1.05x``) is one of that section's figures (subsections included), as written or
  rounded to the digits quoted; a ratio may be written there without its ``x``;
* README.md's status table says its figures are from benchmarks.md: each row is checked against
  the sections ``STATUS_ROWS`` names for it.

Figures measured elsewhere (an ad hoc run, a kernel floor) belong in a block that does not cite
benchmarks.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "docs" / "benchmarks.md"
QUOTING = sorted(
    {REPO / "README.md", REPO / "hooks" / "README.md", REPO / "packaging" / "README.md"}
    | set((REPO / "docs").glob("*.md")) - {BENCHMARKS}
)

# README.md's status table: the part (first column) -> the benchmarks.md sections it quotes.
STATUS_ROWS = {
    "policy decisions (allocator, static policy)": ["Decision latency"],
    "allocator quality": ["Churn quality", "In-place resize"],
    "durable state": ["State commit latency"],
    "NRI transport": ["NRI transport"],
    "daemon: an exclusive container created and started": ["The CPU plugin end to end"],
    "daemon: 16 pods started at once": ["Concurrent pod starts"],
    "isolation from a noisy neighbour": ["Isolation from a noisy neighbour"],
    "daemon footprint": ["Daemon footprint"],
    "OCI hook (CRI-O, podman)": ["OCI hook"],
    "audit trail to journald": ["Operations"],
    'dense nodes, `pin_at = "start"`': ["Dense nodes"],
    "dense nodes, deciding at CreateContainer (the default)": ["Dense nodes"],
    "CPU hotplug, NIC locality, in-place resize, update storm": [
        "Hardware awareness",
        "Update storm",
    ],
    "production node: systemd cgroup driver, cgroup v2, SMT, NUMA (QEMU guest)": [
        "Guest node (systemd driver, cgroup v2)"
    ],
    "requests under interrupt load": ["Requests under interrupt load"],
    "deployment: image and DaemonSet": [],
}

NUMBER = r"\d+(?:\.\d+)?"
# A unit after a number: a time, a size, a share, or a ratio's x (written on the number).
UNIT = r"(?:\s?(?P<unit>ms|us|s|MiB|MB)(?![\w])|\s?(?P<percent>%)|(?P<times>x)(?![\w]))"
# Quoted: a figure with its unit, or a range of them ("0.94-1.05x", "59-67 s").
QUOTED = re.compile(rf"(?<![\w.\-/])(?P<low>{NUMBER})(?:\s?-\s?(?P<high>{NUMBER}))?{UNIT}")
# In benchmarks.md: every number, with its unit when it has one (ratios mostly have none).
MEASURED = re.compile(rf"(?<![\w.])(?P<low>-?{NUMBER}){UNIT}?")
CITATION = re.compile(r'benchmarks\.md(?:\]\([^)]*\))?(?P<sections>(?:(?:,| and) "[^"]+")*)')
HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")


class Figure:
    """A number as written, with its unit: ``x`` for ratios, ``None`` for none."""

    def __init__(self, text: str, unit: str | None) -> None:
        self.text, self.unit, self.value = text, unit, float(text)
        self.decimals = len(text.partition(".")[2])

    def __repr__(self) -> str:
        return f"{self.text}{'' if self.unit in (None, 'x', '%') else ' '}{self.unit or ''}"

    def rounds_from(self, measured: Figure) -> bool:
        """Whether ``measured``, rounded to the digits written here, is this figure."""
        if not _same_kind(self.unit, measured.unit):
            return False
        return abs(measured.value - self.value) <= 0.5 * 10**-self.decimals + 1e-9


def _same_kind(quoted: str | None, measured: str | None) -> bool:
    if quoted == "x":  # benchmarks.md writes most ratios bare
        return measured in (None, "x")
    sizes = {"MiB", "MB"}  # its goal is in MB, its figures in MiB
    return quoted == measured or {quoted, measured} <= sizes


def _unit(match: re.Match[str]) -> str | None:
    if match["times"]:
        return "x"
    return match["percent"] or match["unit"]


def quoted(text: str) -> list[Figure]:
    figures = []
    for match in QUOTED.finditer(text):
        unit = _unit(match)
        figures.append(Figure(match["low"], unit))
        if match["high"]:
            figures.append(Figure(match["high"], unit))
    return figures


def blocks(text: str) -> list[str]:
    """Paragraphs, list items, table rows and headings, each joined into one line; code
    blocks left out."""
    out: list[str] = []
    current: list[str] = []
    fenced = False

    def close() -> None:
        if current:
            out.append(" ".join(line.strip() for line in current))
            current.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            close()
            fenced = not fenced
            continue
        if fenced:
            continue
        stripped = line.strip()
        if not stripped:
            close()
        elif stripped.startswith("|") or HEADING.match(line):
            close()
            out.append(stripped)
        elif re.match(r"(?:[*-]|\d+\.)\s", stripped):
            close()
            current.append(line)
        else:
            current.append(line)
    close()
    return out


def sections(text: str) -> dict[str, str]:
    """Each heading of benchmarks.md -> its text, subsections included."""
    lines = text.splitlines()
    found: dict[str, str] = {}
    for i, line in enumerate(lines):
        heading = HEADING.match(line)
        if not heading:
            continue
        level = len(heading[1])
        end = next(
            (
                j
                for j in range(i + 1, len(lines))
                if (h := HEADING.match(lines[j])) and len(h[1]) <= level
            ),
            len(lines),
        )
        found[heading[2]] = "\n".join(lines[i + 1 : end])
    return found


def measured(text: str) -> list[Figure]:
    return [Figure(m["low"].lstrip("-"), _unit(m)) for m in MEASURED.finditer(text)]


def mismatches(block: str, names: list[str], bench: dict[str, str]) -> list[str]:
    """What is wrong with one quoting block: unknown sections, figures not in them."""
    unknown = [name for name in names if name not in bench]
    if unknown:
        return [f"no section {name!r} in docs/benchmarks.md" for name in unknown]
    pool = [figure for name in names for figure in measured(bench[name])]
    return [
        f"{figure!r} is not in docs/benchmarks.md, {', '.join(map(repr, names))}"
        for figure in quoted(block)
        if not any(figure.rounds_from(m) for m in pool)
    ]


def problems(path: Path, text: str, bench: dict[str, str]) -> list[str]:
    found = []
    where = path.relative_to(REPO)
    for block in blocks(text):
        citations = list(CITATION.finditer(block))
        if citations:
            names = [n for c in citations for n in re.findall(r'"([^"]+)"', c["sections"])]
            if not names and quoted(block):
                found.append(f"{where}: names no section of benchmarks.md: {block[:120]}")
                continue
        elif path == REPO / "README.md" and (part := _status_row(block)) is not None:
            if part not in STATUS_ROWS:
                found.append(f"README.md: status row {part!r}: add its sections to STATUS_ROWS")
                continue
            names = STATUS_ROWS[part]
        else:
            continue
        found += [f"{where}: {m}: {block[:120]}" for m in mismatches(block, names, bench)]
    return found


def _status_row(block: str) -> str | None:
    """The part a row of README.md's status table is about (None: not such a row)."""
    cells = [cell.strip() for cell in block.strip("|").split("|")] if block.startswith("|") else []
    return cells[0] if len(cells) == 3 and cells[1] in ("done", "open") else None


def test_every_quoted_figure_is_in_benchmarks() -> None:
    bench = sections(BENCHMARKS.read_text())
    found = [p for path in QUOTING for p in problems(path, path.read_text(), bench)]
    assert not found, "\n".join(found)


BENCH_EXCERPT = """\
# Benchmarks

## OCI hook

| program | samples | median | p99 | ratio to `python -c pass` (median / p99) |
|---|---|---|---|---|
| launcher (`install-hook`) | 200 | 30.371 ms | 58.551 ms | **2.28** / 2.21 |

Goal: median <= 50 ms and ratio <= 2.5.

## Dense nodes

| containerd | create ratio |
|---|---|
| 2.1.9 | 23.161 ms |
"""


@pytest.mark.parametrize(
    ("quote", "wrong"),
    [
        # The drift this test was written for (architecture.md, operator-guide.md, hooks/README.md).
        ('start (22.9 ms, 2.13x: docs/benchmarks.md, "OCI hook"), so', ["22.9 ms", "2.13x"]),
        ('about 23 ms per container start (docs/benchmarks.md, "OCI hook")', ["23 ms"]),
        ('about 30 ms per start, 2.3x (docs/benchmarks.md, "OCI hook"), goal 50 ms', []),
        ('held to 2.5x: 30.37 ms, **2.28x** (docs/benchmarks.md, "OCI hook")', []),
        ('30.4 ms (docs/benchmarks.md, "Dense nodes")', ["30.4 ms"]),  # another section's
        ("about 23 ms per start (docs/benchmarks.md)", ["names no section"]),
        ('30.4 ms (docs/benchmarks.md, "Hook")', ["no section 'Hook'"]),
        ("in 12 rounds of 3 pods (docs/benchmarks.md)", []),  # no figure with a unit
        ("| OCI hook (CRI-O, podman) | done | 23 ms per start, 2.13x |", ["23 ms", "2.13x"]),
        ("| OCI hook (CRI-O, podman) | done | 30.4 ms per start, 2.28x |", []),
        ("| something new | done | 30.4 ms |", ["add its sections to STATUS_ROWS"]),
    ],
)
def test_the_check_catches_drift(quote: str, wrong: list[str]) -> None:
    found = problems(REPO / "README.md", quote, sections(BENCH_EXCERPT))
    assert len(found) == len(wrong), found
    for text, problem in zip(wrong, found, strict=True):
        assert text in problem, (text, found)
