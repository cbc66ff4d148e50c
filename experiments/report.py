"""Writing run folders: resolved config, JSON results, markdown tables and summaries."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return f if math.isfinite(f) else str(f)
    if isinstance(value, pathlib.Path):
        return str(value)
    return value


def write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")


def write_config(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
    write_json(workdir / "config.json", config.to_dict())


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, floatfmt: str = ".4g") -> str:
    """Rows of dicts as a GitHub markdown table."""
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, (float, np.floating)):
            return format(float(v), floatfmt)
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: pathlib.Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> None:
    import csv

    columns = list(columns or (rows[0].keys() if rows else []))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows([{c: _jsonable(r.get(c)) for c in columns} for r in rows])


def write_summary(workdir: pathlib.Path, title: str, sections: Sequence[tuple[str, str]]) -> None:
    """``summary.md``: a title and (heading, markdown body) sections."""
    parts = [f"# {title}\n"] + [f"\n## {heading}\n\n{body}" for heading, body in sections]
    (workdir / "summary.md").write_text("".join(parts))
