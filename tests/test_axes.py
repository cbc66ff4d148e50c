"""``kvjax.axes``: its docstring's table and ``AXES`` agree, every "set by" field exists, and
the einsum / einops strings of ``kvjax`` and ``pallas_kernels`` use only glossary letters."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

from kvjax import axes
from kvjax.cache.layout import CacheLayout
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.model.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {cls.__name__: cls for cls in (KvCacheConfig, SchedulerConfig, ModelConfig, CacheLayout)}
OWN_LETTERS = {
    "kvjax/model/recurrent.py": "its chunked scan names the query and key tokens of a chunk t and u, the value width e",
}
"""Modules whose einsums keep letters of their own, and why."""
EINOPS = ("rearrange", "repeat", "reduce")


def _table_rows() -> list[tuple[str, str, str | None]]:
    """(letter, name, set by or None) of each row of the docstring's table."""
    rows = []
    for line in axes.__doc__.splitlines():
        match = re.fullmatch(r"(\S)\s{2,}(\w+)\s{2,}.*?(?:\s{2,}(\w+\.\w+))?", line)
        if match:
            rows.append((match[1], match[2], match[3]))
    return rows


def _patterns(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
    """(line, pattern, its axis names) of every einsum and einops call with a literal pattern."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func).split(".")[-1]
        for arg in node.args:
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "->" in arg.value):
                continue
            if func == "einsum":
                found.append((node.lineno, arg.value, re.findall(r"[A-Za-z]", arg.value)))
            elif func in EINOPS:
                found.append((node.lineno, arg.value, re.findall(r"[A-Za-z_]\w*", arg.value)))
    return found


def test_docstring_table_is_axes():
    assert _table_rows() == [(letter, axis.name, axis.set_by) for letter, axis in axes.AXES.items()]


def test_every_set_by_field_exists():
    for letter, axis in axes.AXES.items():
        if axis.set_by is None:
            continue
        cls, field = axis.set_by.split(".")
        assert field in {f.name for f in dataclasses.fields(CONFIGS[cls])}, f"{letter}: {axis.set_by} is no field"


def test_names_are_unique():
    names = [axis.name for axis in axes.AXES.values()]
    assert len(names) == len(set(names))


def test_einsum_and_einops_strings_use_glossary_letters():
    wrong, checked = [], 0
    for top in ("kvjax", "pallas_kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if str(path.relative_to(ROOT)) in OWN_LETTERS:
                continue
            for line, pattern, names in _patterns(path):
                checked += 1
                unknown = sorted(set(names) - set(axes.AXES))
                if unknown:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} {pattern!r} uses {unknown}")
    assert checked > 20, "the scan found too few patterns to mean anything"
    assert not wrong, "\n".join(wrong)


def test_own_letters_are_still_own():
    for module in OWN_LETTERS:
        names = {name for _, _, names in _patterns(ROOT / module) for name in names}
        assert names - set(axes.AXES), f"{module} now uses glossary letters only: drop it from OWN_LETTERS"
