"""The check's outputs: ``device_check.md`` (tables) and ``device_check.json`` (the same data)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from experiments.device_check.stages import StageResult


def cell(value: object) -> str:
    """A table cell: floats to 4 significant digits, None and NaN as "-", pipes escaped."""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict]) -> str:
    """Rows of one table (the union of their keys, in first-seen order) as GitHub markdown."""
    if not rows:
        return "(no rows)\n"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render(title: str, facts: dict[str, str], kernel_paths: list[dict], stages: list[StageResult]) -> str:
    """The markdown report: environment, kernel paths, stage summary, then every stage's tables."""
    parts = [f"# {title}\n", "## Environment\n", markdown_table([{"what": k, "value": v} for k, v in facts.items()]),
             "## Kernel paths that ran\n", markdown_table(kernel_paths),
             "## Stages\n", markdown_table([dict(stage=s.name, status=s.status, wall_s=s.wall_s, compile_s=s.compile_s,
                                                  programs=s.programs, error=s.error.splitlines()[0] if s.error else "")
                                             for s in stages])]
    for stage in stages:
        for table in stage.tables:
            parts += [f"## {table.title}\n", f"{table.note}\n", markdown_table(table.rows)]
        if stage.error:
            parts += [f"## {stage.name} failed\n", "```\n" + stage.error.rstrip() + "\n```\n"]
    return "\n".join(parts)


def _finite(value: object) -> object:
    """NaN and infinities as None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write(
    out: pathlib.Path, title: str, facts: dict[str, str], kernel_paths: list[dict], stages: list[StageResult]
) -> str:
    """Writes ``out/device_check.md`` and ``out/device_check.json``; returns the markdown."""
    text = render(title, facts, kernel_paths, stages)
    (out / "device_check.md").write_text(text)
    data = dict(
        title=title, environment=facts, kernel_paths=kernel_paths, stages=[dataclasses.asdict(s) for s in stages]
    )
    (out / "device_check.json").write_text(json.dumps(_finite(data), indent=1))
    return text
