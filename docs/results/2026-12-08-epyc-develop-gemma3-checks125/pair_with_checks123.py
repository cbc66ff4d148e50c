"""This folder's selectors (checks at layers 1, 2, 5) paired with those of
``2026-12-07-epyc-develop-gemma3`` (checks at 1, 2, 3) on the training-split prompts both scored.

``experiments.cacheblend_report --against`` pairs runs whose configs differ only in the
policies swept; these two also differ in ``policy.check_layers``, so the pairing is made here
from the two folders' records with the same functions (``_ratios_needed``: the ratio for 95%
and 99% of full reuse's gold-answer likelihood loss, interpolated on the sweep; one set of
bootstrap resamples of the shared prompts for every selector, so differences are paired).

    PYTHONPATH=. python docs/results/2026-12-08-epyc-develop-gemma3-checks125/pair_with_checks123.py
"""

from __future__ import annotations

import pathlib

import numpy as np

from experiments.cacheblend_eval import LIKELIHOOD, _ratios_needed
from experiments.cacheblend_report import _read_run

HERE = pathlib.Path(__file__).parent
BASE = HERE.parent / "2026-12-07-epyc-develop-gemma3"


def main() -> None:
    (config, records), (base_config, base_records) = _read_run(HERE), _read_run(BASE)
    ratios = tuple(base_config.sweep.ratios)
    runs = (("1,2,5", records, config), ("1,2,3", base_records, base_config))
    swept = [(rs, f"{n}@{r:g}") for _, rs, c in runs for n in c.sweep.policies for r in ratios]
    shared = sorted(i for i in set(records) & set(base_records) if all(key in rs[i]["runs"] for rs, key in swept))
    sweep = {(f"{n} ({checks})", r): [rs[i]["runs"][f"{n}@{r:g}"] for i in shared]
             for checks, rs, c in runs for n in c.sweep.policies for r in ratios}
    ends = {n: [base_records[i]["runs"][n] for i in shared] for n in ("full_recompute", "full_reuse")}
    gap = max(abs(records[i]["runs"][n][LIKELIHOOD] - base_records[i]["runs"][n][LIKELIHOOD])
              for i in shared for n in ends)
    print(f"{len(shared)} shared prompts (indices {shared[0]}-{shared[-1]}); the runs' full recompute and full reuse "
          f"likelihoods differ by at most {gap:.2g} nats per token\n")
    idx = np.random.default_rng(config.seed).integers(0, len(shared), (config.eval.bootstrap, len(shared)))
    names = list(dict.fromkeys(name for name, _ in sweep))
    needed = {(n, s): _ratios_needed(sweep, ends, n, LIKELIHOOD, s, idx) for n in names for s in (0.95, 0.99)}
    print("| selector (checks) | ratio for 95% | ratio for 99% |\n|---|---|---|")
    for n in names:
        cells = [f"{needed[(n, s)][0]:.2f} [{lo:.2f}, {hi:.2f}]"
                 for s in (0.95, 0.99) for lo, hi in [np.nanquantile(needed[(n, s)][1], [0.025, 0.975])]]
        print(f"| {n} | {' | '.join(cells)} |")
    print("\n| difference at 95% (paired) | ratio | 95% CI |\n|---|---|---|")
    for ours in (n for n in names if n.endswith("(1,2,5)")):
        for other in (n for n in names if n != ours):
            (a, boot_a), (b, boot_b) = needed[(ours, 0.95)], needed[(other, 0.95)]
            lo, hi = np.nanquantile(boot_a - boot_b, [0.025, 0.975])
            print(f"| {ours} minus {other} | {a - b:+.2f} | [{lo:+.2f}, {hi:+.2f}] |")


if __name__ == "__main__":
    main()
