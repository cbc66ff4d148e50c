"""``kvjax.axes``: its docstring's table and ``AXES`` agree, every "set by" field exists, the
einsum / einops strings of ``kvjax`` and ``pallas_kernels`` use only glossary letters, no
module keeps a shape legend of its own, and the shapes written in the modules that follow the
glossary use its letters."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import tokenize

from kvjax import axes
from kvjax.cache.layout import CacheLayout
from kvjax.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig
from kvjax.model.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {cls.__name__: cls for cls in (KvCacheConfig, SchedulerConfig, SpeculativeConfig, ModelConfig, CacheLayout)}
OWN_LETTERS = {
    "kvjax/model/recurrent.py": "its chunked scan names the query and key tokens of a chunk t and u, the value width e",
}
"""Modules whose einsums keep letters of their own, and why."""
EINOPS = ("rearrange", "repeat", "reduce")
GLOSSARY_SHAPES = (
    "kvjax/blend/fusor.py",
    "kvjax/blend/reposition.py",
    "kvjax/blend/scoring.py",
    "kvjax/blend/selection.py",
    "kvjax/cache/state_pool.py",
    "kvjax/distributed.py",
    "kvjax/engine/manager_v2/block_pool.py",
    "kvjax/engine/manager_v2/decode.py",
    "kvjax/metrics.py",
    "kvjax/model/recurrent.py",
    "kvjax/model/transformer.py",
    "kvjax/speculative/drafters.py",
    "kvjax/speculative/verify.py",
)
"""Modules whose shape comments and docstring shapes are written in the glossary's letters."""
LEGENDS = (
    re.compile(r"\bShapes\s*:"),
    re.compile(r"^\s*Glossary\s*:", re.MULTILINE),
    re.compile(r"\b[A-Za-z] = \w[\w ]*, [A-Za-z] = \w"),
)
"""What a module's own axis legend looks like: a "Shapes:" or "Glossary:" heading, or a run of
letter definitions ("S = sequences, T = tokens")."""
SHAPE = re.compile(r"\[([^\[\]\n]*)\]")
"""A bracketed shape on one line: ``[s, q, D]``, ``[..., h*d]``, ``[]``."""
SHAPE_CHARS = re.compile(r"[\w\s*+\-/().]*")
"""Characters of one entry of a shape: letters, names, integers, arithmetic, ``...``, ``(g q)``."""


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


def _known() -> set[str]:
    """Glossary letters and names."""
    return set(axes.AXES) | {axis.name for axis in axes.AXES.values()}


def _docstrings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring of a module: module, class, function and attribute ones."""
    return [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]


def _shape_comments(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, shape) of every bracketed shape in a comment that starts with one (``# [s, q, D]``)."""
    found = []
    with path.open() as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type != tokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            if text.startswith("["):
                found.extend((tok.start[0], match[1]) for match in SHAPE.finditer(text))
    return found


def test_no_module_keeps_its_own_legend():
    found, scanned = [], 0
    for top in ("kvjax", "pallas_kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, doc in _docstrings(path):
                scanned += 1
                matches = (legend.search(doc) for legend in LEGENDS)
                found += [f"{path.relative_to(ROOT)}:{line} {m[0]!r}" for m in matches if m]
    assert scanned > 500, "the scan found too few docstrings to mean anything"
    assert not found, "legends of their own (say \"Axis letters are ``kvjax/axes.py``'s.\"):\n" + "\n".join(found)


def test_shape_comments_use_glossary_letters():
    known, wrong, checked = _known(), [], 0
    for module in GLOSSARY_SHAPES:
        for line, shape in _shape_comments(ROOT / module):
            checked += 1
            for item in shape.split(","):
                unknown = sorted(set(re.findall(r"[A-Za-z_]\w*", item)) - known)
                if unknown or not SHAPE_CHARS.fullmatch(item):
                    wrong.append(f"{module}:{line} [{shape}]: {item.strip()!r}")
    assert checked > 40, "the scan found too few shape comments to mean anything"
    assert not wrong, "shape comments with entries that are no glossary letter, name or integer:\n" + "\n".join(wrong)


def test_docstring_shapes_use_glossary_letters():
    """Docstrings may also name a size by its argument (``[num_steps]``), but every one-letter
    entry is a glossary letter; indexing (``src[i]``) is no shape."""
    wrong, checked = [], 0
    for module in GLOSSARY_SHAPES:
        for line, doc in _docstrings(ROOT / module):
            for match in SHAPE.finditer(doc):
                if match.start() and re.match(r"[\w\])]", doc[match.start() - 1]):
                    continue
                checked += 1
                unknown = set(re.findall(r"\b[A-Za-z]\b", match[1])) - set(axes.AXES)
                if unknown:
                    wrong.append(f"{module}:{line} [{match[1]}] uses {sorted(unknown)}")
    assert checked > 150, "the scan found too few docstring shapes to mean anything"
    assert not wrong, "docstring shapes with letters outside the glossary:\n" + "\n".join(wrong)
