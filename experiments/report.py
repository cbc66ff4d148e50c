"""Writing run folders (resolved config, JSON results, markdown tables, summaries), and
gathering the latest run of every experiment into one report:

    python -m experiments.report [--runs=runs] [--out=runs/REPORT.md]
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

if TYPE_CHECKING:  # the device machine has no ml_collections; the device checks import this module
    import ml_collections


def jsonable(value: Any, *, nan_as_text: bool = True) -> Any:
    """``value`` with NumPy arrays and scalars and paths as plain Python values; non-finite
    floats become the strings "nan" / "inf" (strict JSON) unless ``nan_as_text`` is False."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, nan_as_text=nan_as_text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, nan_as_text=nan_as_text) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist(), nan_as_text=nan_as_text)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return f if math.isfinite(f) or not nan_as_text else str(f)
    if isinstance(value, pathlib.Path):
        return str(value)
    return value


def write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(json.dumps(jsonable(data), indent=2, sort_keys=False) + "\n")


def write_config(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
    write_json(workdir / "config.json", config.to_dict())


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, floatfmt: str = ".4g"
) -> str:
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
        writer.writerows([{c: jsonable(r.get(c)) for c in columns} for r in rows])


def save_figure(fig: Figure, path: pathlib.Path, dpi: int = 120) -> None:
    """Lays ``fig`` out, writes it to ``path`` (PNG at ``dpi``) and releases it from pyplot."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_summary(workdir: pathlib.Path, title: str, sections: Sequence[tuple[str, str]], *,
                  name: str = "summary.md") -> None:
    """``workdir / name``: a title and (heading, markdown body) sections."""
    parts = [f"# {title}\n"] + [f"\n## {heading}\n\n{body}" for heading, body in sections]
    (workdir / name).write_text("".join(parts))


def latest_runs(runs_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """The newest complete run folder (one with results.json) per experiment."""
    latest: dict[str, tuple[float, pathlib.Path]] = {}
    for results in runs_dir.glob("*/results.json"):
        folder = results.parent
        config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
        name = config.get("experiment", folder.name)
        stamp = results.stat().st_mtime
        if name not in latest or stamp > latest[name][0]:
            latest[name] = (stamp, folder)
    return {name: folder for name, (_, folder) in sorted(latest.items())}


def gather(runs_dir: pathlib.Path, out: pathlib.Path) -> str:
    """One markdown report of the latest run of every experiment, with links to its plots."""
    parts = ["# kvjax results\n", f"\nLatest run of each experiment under `{runs_dir}`.\n"]
    for name, folder in latest_runs(runs_dir).items():
        parts.append(f"\n---\n\n<!-- {name}: {folder} -->\n")
        summary = folder / "summary.md"
        body = summary.read_text() if summary.is_file() else f"# {name}\n\n(no summary.md)\n"
        parts.append(re.sub(r"^(#+) ", r"#\1 ", body, flags=re.MULTILINE))
        for png in sorted(folder.glob("*.png")):
            parts.append(
                f"\n![{name}: {png.stem}]({png.relative_to(out.parent) if png.is_relative_to(out.parent) else png})\n"
            )
    text = "".join(parts)
    out.write_text(text)
    return text


def main(argv: list[str]) -> None:
    from absl import flags

    del argv
    runs_dir = pathlib.Path(flags.FLAGS.runs)
    out = pathlib.Path(flags.FLAGS.out or runs_dir / "REPORT.md")
    gather(runs_dir, out)
    print(f"report: {out}")


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("runs", "runs", "Folder holding the run folders.")
    flags.DEFINE_string("out", None, "Report path; default <runs>/REPORT.md.")
    app.run(main)


def commit_folder(folder: pathlib.Path, message: str) -> None:
    """Commits ``folder``'s files (nothing else) to the git repository holding it: a piece of a
    long run lands as soon as it ends.

    Raises:
      RuntimeError: ``folder`` is not inside a git work tree, or git failed (its message).
    """
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"piece.commit: git {' '.join(args)} failed in {folder}: {done.stderr.strip()}")
        return done.stdout.strip()

    git("add", "--", ".")
    git("commit", "--quiet", "-m", message, "--", ".")


def code_commit() -> str:
    """The checked-out commit of the code (``+dirty`` when tracked files differ), or "unknown"."""
    root = pathlib.Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode:
        return "unknown"
    dirty = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "kvjax", "experiments", "configs", "pallas_kernels"], cwd=root
    ).returncode
    return head.stdout.strip() + ("+dirty" if dirty else "")
