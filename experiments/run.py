"""Runs one experiment from a config file.

    python -m experiments.run --config=configs/cacheblend_rag.py \
        [--config.policy.recompute_ratio=0.2] [--workdir=runs/my_run]

The config's ``experiment`` field names a module ``experiments.<experiment>`` whose
``run(config, workdir) -> dict`` does the work. The run folder receives the resolved
config (``config.json``), ``results.json``, a markdown ``summary.md`` and any plots; the
run ends by printing the results' ``headline_text`` (when the experiment gives one) and
the path of ``summary.md``.
"""

from __future__ import annotations

import datetime
import importlib
import pathlib

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import report
from kvjax.paths import cache_dir

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/<name>.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder; default runs/<experiment>-<timestamp>.")


def enable_compilation_cache() -> None:
    """Persists XLA executables under the kvjax cache so a repeated run skips compilation."""
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    enable_compilation_cache()
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = pathlib.Path(_WORKDIR.value or f"runs/{config.experiment}-{stamp}")
    workdir.mkdir(parents=True, exist_ok=True)
    report.write_config(workdir, config)
    module = importlib.import_module(f"experiments.{config.experiment}")
    results = module.run(config, workdir)
    report.write_json(workdir / "results.json", results)
    logging.info("results written to %s", workdir)
    if isinstance(results.get("headline_text"), str):
        print(results["headline_text"])
    summary = workdir / "summary.md"
    print(f"summary: {summary}" if summary.is_file() else f"run folder: {workdir}")


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
