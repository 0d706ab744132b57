"""Sizes of product code: no module over 450 lines, no function over 60 lines or over cyclomatic
complexity 15 (radon's measure), so that each module holds one idea and each function reads as
one step of something larger."""

from __future__ import annotations

import ast
from pathlib import Path

from radon.complexity import cc_visit

PACKAGE = Path(__file__).resolve().parents[2] / "nri_cpuplugin"
MAX_MODULE_LINES = 450
MAX_LINES = 60
MAX_COMPLEXITY = 15


def product_modules() -> list[Path]:
    """Every module of the package but the generated protobuf code."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[:2] != ("nri", "pb"):
            found.append(path)
    return found


def functions(blocks: list) -> list:
    """radon's functions and methods, closures and methods of nested classes included."""
    found = []
    for block in blocks:
        if hasattr(block, "methods"):  # a class
            found += functions([*block.methods, *block.inner_classes])
        else:
            found += [block, *functions(block.closures)]
    return found


def test_no_module_is_longer_than_450_lines() -> None:
    long = []
    for path in product_modules():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(PACKAGE)}: {lines}")
    assert long == []


def test_no_function_is_longer_than_60_lines() -> None:
    long = []
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines}")
    assert long == []


def test_no_function_is_more_complex_than_15() -> None:
    tangled = [
        f"{path.relative_to(PACKAGE)}:{function.lineno} {function.fullname}: {function.complexity}"
        for path in product_modules()
        for function in functions(cc_visit(path.read_text()))
        if function.complexity > MAX_COMPLEXITY
    ]
    assert tangled == []
