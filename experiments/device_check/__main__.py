"""The device check's main: ``python -m experiments.device_check [--dry-run] [--out DIR] [--stages ...]``.

Run it through ``experiments/device_check.sh``, which installs the carried wheels first.
Exits 2 without a GPU (unless ``--dry-run``), 1 when a stage failed (its error is in the
report), else 0.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pathlib
import sys
import time

import jax

from experiments.device_check import environment, report
from experiments.device_check.sizes import DRY_RUN, FULL
from experiments.device_check.stages import STAGES, Context, run_stage

log = logging.getLogger("device_check")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="experiments.device_check", description=__doc__)
    parser.add_argument(
        "--dry-run", action="store_true", help="every stage on the CPU at tiny sizes, kernels interpreted"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "device_check_out")),
                        help="folder for device_check.md and device_check.json (default $OUT or ./device_check_out)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="stages to run, in order")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() not in ("gpu", "cuda", "rocm"):
        log.error("the device check needs a GPU; jax sees %s (%s). Use --dry-run on a CPU.",
                  jax.default_backend(), jax.devices()[0].device_kind)
        return 2
    sizes = DRY_RUN if args.dry_run else FULL
    start = time.monotonic()
    context = Context(sizes, end=start + sizes.budget_s)
    facts = environment.describe()
    results = []
    for name in args.stages:
        log.info("stage %s", name)
        results.append(run_stage(name, context))
        log.info("stage %s: %s in %.1f s (%.1f s compiling)", name, results[-1].status, results[-1].wall_s,
                 results[-1].compile_s)
    mode = "interpreted on the CPU" if sizes.interpret else "compiled"
    paths = [{**entry, "mode": mode} for entry in context.kernel_paths.values()]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    title = (
        f"device_check{' --dry-run' if args.dry_run else ''}: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{stamp}, {time.monotonic() - start:.0f} s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(report.write(args.out, title, facts, paths, results))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
