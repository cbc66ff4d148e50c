"""The prefix-reuse workload: seeded system prompts shared by single-turn questions, and
multi-turn chats whose history grows by the model's own answers, each request run on an engine
without reuse (cold) and one with reuse (warm). Shared by the prefix-reuse and the
speculative-decoding experiments.

    single-turn:  | system prompt s (shared) | question q |            s = 1..S, q = 1..Q
    multi-turn:   | system prompt | user 1 | answer 1 | ... | user t |  t = 1..T (answers: greedy output)

SmolLM2 prompts use its ChatML template; Gemma 3 (a base model) gets plain text
("User: ... / Assistant: ...").
"""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np
from tqdm import tqdm

from kvjax.engine import Engine, RequestOutput
from kvjax.model.model import Model
from kvjax.sampling import SamplingParams

_TOPICS = ["a city library", "a railway museum", "a mountain hotel", "a bicycle shop", "a dental clinic", "a bakery"]
_RULES = [
    "Answer politely and keep every reply short.",
    "Opening hours are from nine in the morning to six in the evening, Monday to Saturday.",
    "Never promise refunds; refer billing questions to the front desk.",
    "Members get a ten percent discount on every purchase.",
    "The building has step-free access through the east entrance.",
    "Parking is free for the first two hours behind the main building.",
    "Pets are welcome in the garden but not indoors.",
    "Group visits of more than twelve people must be booked a week ahead.",
    "Lost items are kept for thirty days at the reception.",
    "Wi-Fi is free; the password is printed on every receipt.",
    "In case of fire, leave through the nearest marked exit and gather in the square.",
    "The cafe on the ground floor serves soup, sandwiches and cakes until five.",
]
_QUESTIONS = [
    "When are you open on Saturday?",
    "Can I bring my dog inside?",
    "Is there a discount for members?",
    "Where can I park my car?",
    "How do I book a visit for a school class?",
    "I lost my umbrella yesterday. What should I do?",
    "Is the building accessible by wheelchair?",
    "What can I eat at the cafe?",
]


def system_prompts(cfg: ml_collections.ConfigDict) -> list[str]:
    """Seeded system prompts of ``cfg.system_sentences`` rules each."""
    rng = np.random.default_rng(cfg.seed)
    prompts = []
    for s in range(cfg.num_system_prompts + cfg.num_chats):
        rules = [_RULES[i] for i in rng.integers(len(_RULES), size=cfg.system_sentences)]
        prompts.append(f"You are the assistant of {_TOPICS[s % len(_TOPICS)]} (desk {s}). " + " ".join(rules))
    return prompts


def render(model: Model, system: str, turns: list[tuple[str, str | None]]) -> list[int]:
    """Token ids of a conversation ending with an open assistant turn.

    Args:
      turns: (user message, assistant answer) pairs; the last answer is None.
    """
    tok = model.tokenizer
    if tok.chat_format:
        messages = [{"role": "system", "content": system}]
        for user, answer in turns:
            messages.append({"role": "user", "content": user})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return tok.encode(tok.apply_chat_template(messages))
    text = system + "\n\n" + "".join(
        f"User: {user}\nAssistant:" + ("" if answer is None else f" {answer}\n") for user, answer in turns
    )
    return tok.encode(text)


@dataclasses.dataclass(frozen=True, slots=True)
class Pair:
    """One request run cold and warm."""

    cold: RequestOutput
    warm: RequestOutput


def run_pair(cold: Engine, warm: Engine, prompt: list[int], sampling: SamplingParams) -> Pair:
    [c] = cold.generate([prompt], sampling)
    [w] = warm.generate([prompt], sampling)
    return Pair(c, w)


def one_pass(cfg: ml_collections.ConfigDict, model: Model, cold: Engine, warm: Engine, desc: str) -> list[dict]:
    """The whole workload once; one row per request."""
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True, return_logits=True)
    systems = system_prompts(cfg)
    jobs: list[tuple[str, int, int]] = [
        ("shared-system", s, q) for s in range(cfg.num_system_prompts) for q in range(cfg.questions_per_system)
    ] + [("multi-turn", c, t) for c in range(cfg.num_chats) for t in range(cfg.turns)]
    histories: dict[int, list[tuple[str, str | None]]] = {}
    rows = []
    for kind, group, index in tqdm(jobs, desc=desc, leave=False):
        question = _QUESTIONS[(group * 3 + index) % len(_QUESTIONS)]
        if kind == "shared-system":
            system, turns = systems[group], [(question, None)]
        else:
            system = systems[cfg.num_system_prompts + group]
            turns = histories.setdefault(group, [])
            turns.append((question, None))
        prompt = render(model, system, turns)
        pair = run_pair(cold, warm, prompt, sampling)
        if kind == "multi-turn":
            turns[-1] = (question, model.tokenizer.decode(pair.warm.output).strip())
        first_cold, first_warm = np.asarray(pair.cold.logits[0]), np.asarray(pair.warm.logits[0])
        rows.append(
            {
                "kind": kind,
                "group": group,
                "index": index,
                "prompt_tokens": len(prompt),
                "reused_tokens": pair.warm.num_reused_tokens,
                "ttft_cold_s": pair.cold.ttft_s,
                "ttft_warm_s": pair.warm.ttft_s,
                "speedup": pair.cold.ttft_s / pair.warm.ttft_s,
                "outputs_agree": pair.cold.output == pair.warm.output,
                "logits_rel_err": float(np.max(np.abs(first_warm - first_cold)) / np.max(np.abs(first_cold))),
            }
        )
    return rows
