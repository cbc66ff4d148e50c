"""What every stage shares: the run's context, its output tables, and the guard that turns a
stage's failure into a recorded error so the next stage still runs."""

from __future__ import annotations

import dataclasses
import importlib
import time
import traceback

from experiments.device_check.sizes import Sizes
from experiments.timing import compile_counter

STAGES = ("correctness", "bandwidth", "engine_speed", "blend_speed")
"""Modules of ``experiments.device_check`` run in this order; each has ``run(context) -> list[Table]``.
A stage's module is imported inside its guard, so a package missing on the machine fails that
stage alone."""


@dataclasses.dataclass
class Context:
    """The run's settings and the facts one stage hands the next.

    Attributes:
      sizes: the problem sizes (``sizes.FULL`` or ``sizes.DRY_RUN``).
      end: ``time.monotonic()`` past which no stage starts (``sizes.budget_s`` after the start).
      deadline: ``time.monotonic()`` past which the running stage skips its remaining rows
        (set by ``run_stage`` from ``sizes.stage_budget_s``).
      kernel_paths: per kernel path ("paged decode, Pallas Triton", ...), the rows that ran and
        the first error met; filled by the stages that launch kernels.
    """

    sizes: Sizes
    end: float
    deadline: float = float("inf")
    kernel_paths: dict[str, dict] = dataclasses.field(default_factory=dict)

    @property
    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def record_path(self, path: str, error: str | None) -> None:
        """Counts one launch of ``path``, ok (``error`` None) or failed with ``error``."""
        entry = self.kernel_paths.setdefault(path, {"path": path, "ok": 0, "failed": 0, "first_error": ""})
        entry["failed" if error else "ok"] += 1
        if error and not entry["first_error"]:
            entry["first_error"] = error

    def skip_path(self, path: str, reason: str) -> None:
        """Records that ``path`` did not run here, and why."""
        self.kernel_paths.setdefault(path, {"path": path, "ok": 0, "failed": 0, "first_error": f"not run: {reason}"})


@dataclasses.dataclass
class Table:
    """One table of results: a title, a line saying what was measured, and rows of columns."""

    title: str
    note: str
    rows: list[dict]


@dataclasses.dataclass
class StageResult:
    """How one stage went.

    Attributes:
      name: the stage's module name.
      status: "ok", "failed" (raised; ``error``) or "skipped" (past the deadline).
      wall_s: the stage's wall seconds, compiles included.
      compile_s: seconds of JAX tracing, lowering and backend compiles inside it
        (``experiments.timing.compile_counter``), Triton's included.
      programs: programs traced inside it.
      error: the exception as "Type: message", then the last traceback lines.
      tables: what it measured (also when it failed part-way: the tables it finished).
    """

    name: str
    status: str
    wall_s: float = 0.0
    compile_s: float = 0.0
    programs: int = 0
    error: str = ""
    tables: list[Table] = dataclasses.field(default_factory=list)


SKIPPED = "skipped: the stage's time budget (sizes.stage_budget_s) was spent"


def error_text(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters (for table cells)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"[:limit]


def run_stage(name: str, context: Context) -> StageResult:
    """Imports and runs stage ``name``; any exception is recorded, never raised."""
    if time.monotonic() > context.end:
        return StageResult(name, "skipped", error="the check's time budget (sizes.budget_s) was spent")
    context.deadline = min(context.end, time.monotonic() + dict(context.sizes.stage_budget_s)[name])
    counter = compile_counter()
    before = dataclasses.replace(counter)
    start = time.perf_counter()
    result = StageResult(name, "ok")
    try:
        module = importlib.import_module(f"experiments.device_check.{name}")
        result.tables = module.run(context)
    except Exception as error:
        tail = "".join(traceback.format_exception(error)[-4:])
        result.status, result.error = "failed", f"{error_text(error, 1000)}\n{tail}"
    compiled = counter.since(before)
    result.wall_s, result.compile_s, result.programs = time.perf_counter() - start, compiled.seconds, compiled.programs
    return result
