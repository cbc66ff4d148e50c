"""Greedy generation over one mesh spanning several local processes (``experiments/multihost.py``).

    python -m experiments.run --config=configs/multihost.py
    python -m experiments.run --config=configs/multihost.py --config.model=smollm2-135m --config.new_tokens=8
"""

import pathlib

import ml_collections

TINY_CHECKPOINT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf" / "qwen2"
"""A tiny random Qwen2 checkpoint (2 layers, GQA 4/2, q/k/v biases) kept with the tests."""


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    """Args:
      preset: "" only (the defaults are already small: a tiny checkpoint, 2 x 2 devices).
    """
    if preset:
        raise ValueError(f"unknown preset {preset!r}; allowed: '' (default)")
    config = ml_collections.ConfigDict()
    config.experiment = "multihost"  # module experiments.multihost
    config.model = str(TINY_CHECKPOINT)  # a registry name (smollm2-135m, gemma3-270m) or a Hugging Face folder
    config.num_processes = 2  # local processes joined into one job
    config.devices_per_process = 2  # CPU devices each process brings (XLA's host platform device count)
    config.prompt_tokens = 40  # prompt length, tokens (random ids from the seed)
    config.new_tokens = 12  # greedy tokens generated after the prompt
    config.tokens_per_block = 8  # tokens per page
    config.num_pages = 32  # pages of the pool (rounded up to a multiple of the mesh's pages axis)
    config.seed = 0  # seed of the prompt and of the sequence's page permutation
    config.timeout_s = 300  # seconds the whole run (and each process's join) may take
    config.kill_process = -1  # fault injection: the process the launcher kills (-1 = none)
    config.kill_after_s = 0.0  # ... this many seconds after starting the processes
    return config
