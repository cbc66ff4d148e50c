"""A soak: the real engine serves a seeded mix of requests for a configured time while faults
arrive on a schedule, and every invariant is checked throughout (``configs/soak.py``).

Three engines share the model and serve the mix side by side:

- ``main`` (V1 manager, a small device cache under pressure, host and disk tiers, KV cache
  events): prefix-sharing chats with per-request retention priorities, and CacheBlend chunk
  prompts through a ``ChunkStore``;
- ``speculative``: n-gram speculative decoding of prompts that repeat themselves;
- ``quantized``: int8 pages with per-token scales, prefix-sharing prompts, a host tier.

Faults, one every ``faults.every_steps`` loop steps in turn (a fault with nothing to act on
waits for its chance): a corrupted disk page and a truncated disk file (bytes changed under
the page file), disk read errors (the page file's descriptor swapped for a write-only one for
``faults.read_error_steps`` steps, so every read fails with ``EBADF``), an abort mid-prefill
and an abort of a request whose prefix was onboarded from a tier before its prefill finished,
a snapshot saved or restored mid-stream (the main engine drained first), and a process
killed while it saves a snapshot, the main engine then restored from the last complete step.
Preemptions come from the memory pressure itself and are counted.

Checked throughout: every exact request (chats, speculative; greedy) equals a fault-free
reference engine's output for its prompt (no reuse, ample cache); every quantized request's
logits stay within ``checks.quantized_drift_fraction`` (2: the triangle inequality) times int8's
own error of an int8 reference engine's (no reuse, ample cache), int8's error being that
reference's largest |logit difference| from the float32 reference's over the steps whose tokens
agree; and its tokens equal the int8 reference's up to the first step where the reference's top
two logits lie closer than twice the logits' difference there (a near-tie the int8 rounding of KV
computed in another prefill chunk can flip: per-token scales make a page independent of the
order it was written in, not of the floating-point rounding of the computation that made it);
every blended request finishes; no request fails; each engine's manager is consistent after
every step; the main engine's events replayed give its radix tree (key and tier of every
block) after every step; at the end, with every engine drained, no page is leaked; the
resident memory stays flat after warm-up: in the steps that compiled no new program its
high-water mark rises at most ``checks.rss_growth_mb`` (compiled programs are bounded by the
shapes the engines meet, a leak is not; a step that fills heap a fault handed back, below the
mark, adds no memory the process had not held). Memory is sampled after every step and after
every injected fault, so the growth in steps that compiled and across faults (a snapshot
restore, a killed save) is reported apart from it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import matplotlib
import ml_collections
import numpy as np
import psutil

from experiments import report, timing
from experiments.workloads import datasets
from kvjax.blend.chunk_store import ChunkStore
from kvjax.blend.engine_blend import ChunkReuse
from kvjax.blend.loading_controller import cpu_name
from kvjax.blend.selection import SelectionConfig
from kvjax.config import (
    KvCacheConfig,
    KvCacheRetentionConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TokenRangeRetentionConfig,
)
from kvjax.engine import Engine, RequestOutput
from kvjax.manager import KVCacheManager, require_tiered
from kvjax.manager.tiers import Tier
from kvjax.model.model import Model
from kvjax.model.registry import load_model
from kvjax.sampling import SamplingParams
from kvjax.snapshot import restore_snapshot, save_snapshot
from kvjax.testing.tiny import tiny_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt

KINDS = ("chat", "chunks", "speculative", "quantized")
"""Request kinds of the mix: "chat" and "speculative" are exact (equal to the reference),
"quantized" within the near-tie rule (module docstring), "chunks" blended (approximate)."""
FAULTS = (
    "abort_mid_prefill",
    "snapshot_save_restore",
    "corrupt_disk_page",
    "abort_after_onboard",
    "truncate_disk_file",
    "disk_read_error",
    "killed_snapshot_save",
)
"""The scheduled faults, in the order they come round."""
CHECKS = ("exact_output", "quantized_output", "blended_finished", "no_error", "fault_survived", "consistency",
          "events_match_tree", "no_leak", "rss_flat")
TINY = "tiny"
"""``config.model`` of the test preset: ``kvjax.testing.tiny``'s model (seed 0), random token text."""


@dataclasses.dataclass
class Tally:
    """What the soak counted: requests served by kind, faults injected by kind, invariant checks
    by kind, and each violation (check, engine, request or step, what was seen)."""

    served: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    checks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    violations: list[dict] = dataclasses.field(default_factory=list)
    quantized_drift: list[float] = dataclasses.field(default_factory=list)
    """Each quantized request's largest logit difference from the int8 reference (common steps)."""
    quantized_error: list[float] = dataclasses.field(default_factory=list)
    """The int8 reference's own largest logit difference from the float32 one, per quantized request."""
    near_ties: int = 0
    """Quantized requests whose tokens left the reference's at a near-tie."""

    def check(self, name: str, ok: bool, **detail: object) -> None:
        self.checks[name] += 1
        if not ok:
            self.violations.append({"check": name, **detail})


def model_for(config: ml_collections.ConfigDict) -> Model:
    """The soak's model: a registry name, or ``TINY``."""
    if config.model == TINY:
        cfg, params = tiny_model(0)
        return Model(config=cfg, params=params, tokenizer=None, path=pathlib.Path(TINY))
    return load_model(config.model)


def engine_configs(config: ml_collections.ConfigDict, disk_dir: str) -> dict[str, tuple[KvCacheConfig, dict]]:
    """Each engine's cache config and its other arguments, by name (the child process of the
    killed-save fault builds ``main`` from this too)."""
    c, s = config.cache, config.scheduler
    tpb = c.tokens_per_block
    scheduler = SchedulerConfig(max_num_tokens=s.max_num_tokens, max_batch_size=s.max_batch_size,
                                prefill_chunk_size=s.prefill_chunk_size)
    ample = dict(tokens_per_block=tpb, max_tokens=c.reference_tokens, enable_block_reuse=False,
                 use_kv_cache_manager_v2="false")
    return {
        "main": (KvCacheConfig(tokens_per_block=tpb, max_tokens=c.device_tokens, host_cache_size=c.host_bytes,
                               disk_cache_size=c.disk_bytes, disk_cache_dir=disk_dir, event_buffer_max_size=1 << 20,
                               use_kv_cache_manager_v2="false"), {"scheduler_config": scheduler}),
        "speculative": (KvCacheConfig(tokens_per_block=tpb, max_tokens=c.device_tokens,
                                      use_kv_cache_manager_v2="false"),
                        {"scheduler_config": scheduler,
                         "speculative": SpeculativeConfig(method="ngram", num_draft_tokens=4)}),
        "quantized": (KvCacheConfig(tokens_per_block=tpb, max_tokens=c.device_tokens, dtype="int8",
                                    scale_granularity="token", host_cache_size=c.host_bytes,
                                    use_kv_cache_manager_v2="false"), {"scheduler_config": scheduler}),
        "reference": (KvCacheConfig(**ample), {"scheduler_config": scheduler}),
        "reference_quantized": (KvCacheConfig(**ample, dtype="int8", scale_granularity="token"),
                                {"scheduler_config": scheduler}),
    }


KEPT_RECORDS = 32
"""Finished requests each engine keeps readable by id (``max_finished_requests``): the soak
pops what it serves and reads the references' outputs from ``generate``, and an int8
reference's record holds its logits (16 tokens x 49,152 float32 for SmolLM2, 3 MiB), so the
engine's default of 1,024 kept records would hold up to 3 GiB of them per reference engine."""


def build_engine(model: Model, config: ml_collections.ConfigDict, disk_dir: str, name: str) -> Engine:
    kv, kwargs = engine_configs(config, disk_dir)[name]
    return Engine(model, kv, max_seq_len=config.max_seq_len, max_finished_requests=KEPT_RECORDS, **kwargs)


class Text:
    """Where prompts come from: a long stream of real text tokens (SQuAD v1.1 dev contexts),
    or random ids for ``TINY``; ``take(n)`` returns the next ``n`` tokens, cycling."""

    def __init__(self, model: Model, rng: np.random.Generator, num_tokens: int) -> None:
        if model.tokenizer is None:
            self.tokens = rng.integers(3, model.config.vocab_size, num_tokens).tolist()
        else:
            paragraphs = datasets.load_squad(datasets.fetch_squad_v11_dev())
            tokens: list[int] = []
            for p in paragraphs:
                tokens.extend(model.tokenizer.encode(p.context))
                if len(tokens) >= num_tokens:
                    break
            self.tokens = tokens
        self.rng = rng

    def take(self, n: int) -> list[int]:
        start = int(self.rng.integers(0, len(self.tokens) - n))
        return self.tokens[start : start + n]


@dataclasses.dataclass
class Pending:
    """A request in flight: its engine, kind, prompt and sampling (and its chat, for the next turn)."""

    engine: str
    kind: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    chat: int | None = None
    aborted: bool = False


class Soak:
    """The engines, the workload, the faults and the checks of one soak run."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
        unknown = sorted(set(config.faults.kinds) - set(FAULTS))
        if unknown:
            raise ValueError(f"faults.kinds: unknown {unknown}; allowed: {FAULTS}")
        self.config, self.workdir = config, workdir
        self.model = model_for(config)
        self.rng = np.random.default_rng(config.seed)
        self.tmp = tempfile.TemporaryDirectory(prefix="kvjax-soak-")
        self.disk_dir = str(pathlib.Path(self.tmp.name) / "disk")
        self.snapshot_dir = pathlib.Path(self.tmp.name) / "snapshots"
        pathlib.Path(self.disk_dir).mkdir()
        self.engines = {name: build_engine(self.model, config, self.disk_dir, name)
                        for name in ("main", "speculative", "quantized", "reference", "reference_quantized")}
        m = config.mix
        self.text = Text(self.model, self.rng, m.text_tokens)
        self.system = [tuple(self.text.take(m.system_tokens)) for _ in range(m.num_system_prompts)]
        self.store = ChunkStore(self.engines["main"], variant="system", prefix_tokens=self.system[0])
        self.passages = [tuple(self.text.take(m.chunk_tokens)) for _ in range(m.num_passages)]
        self.chats: list[list[int]] = [list(self.system[i % len(self.system)]) for i in range(m.num_chats)]
        self.pending: dict[str, Pending] = {}
        """Requests in flight by id; ids are unique across the engines (``ids``)."""
        self.ids = itertools.count()
        self.references: dict[tuple, list[int]] = {}
        """Exact reference outputs by (engine, prompt, max_new_tokens)."""
        self.tally = Tally()
        self.events: dict[tuple[int, bytes], str] = {}
        """The main engine's radix tree as its events tell it: (group, key) -> tier."""
        self.read_error: tuple[list[tuple[int, int]], int] | None = None
        """While disk reads fail: the (descriptor, saved duplicate) pairs and the step they end."""
        self.rss: list[tuple[float, float, int, int, str]] = []
        """(seconds, resident MiB, programs compiled so far, faults injected so far, the fault
        just injected or "") after every step and every injected fault."""
        self.injected = 0
        self.compiles = timing.compile_counter()
        self.step = 0
        self.blocked = False
        """The main engine takes no new request (a snapshot fault waits for it to drain)."""

    # ------------------------------------------------------------------ workload

    def _sampling(self, kind: str) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.config.mix.max_new_tokens, return_logits=kind == "quantized")

    def _retention(self, prefix_len: int) -> KvCacheRetentionConfig | None:
        if self.rng.random() >= self.config.mix.priority_fraction:
            return None
        return KvCacheRetentionConfig((TokenRangeRetentionConfig(0, prefix_len, 80),), decode_retention_priority=20)

    def _submit(self, engine: str, kind: str, prompt: list[int], chat: int | None = None, **kwargs: object) -> str:
        sampling = self._sampling(kind)
        rid = self.engines[engine].submit(prompt, sampling, request_id=f"{kind}-{next(self.ids)}", **kwargs)
        self.pending[rid] = Pending(engine, kind, tuple(prompt), sampling, chat)
        return rid

    def _in_flight(self, engine: str) -> int:
        return sum(p.engine == engine for p in self.pending.values())

    def top_up(self) -> None:
        """Submits new requests until each engine has ``mix.in_flight`` of them."""
        m, limit = self.config.mix, self.config.max_seq_len - self.config.mix.max_new_tokens
        weights = np.asarray([m.weights[k] for k in KINDS], float)
        for _ in range(4 * m.in_flight):
            kind = KINDS[int(self.rng.choice(len(KINDS), p=weights / weights.sum()))]
            engine = {"chat": "main", "chunks": "main"}.get(kind, kind)
            if self._in_flight(engine) >= m.in_flight or (engine == "main" and self.blocked):
                continue
            if kind == "chat":
                free = [i for i in range(m.num_chats) if all(p.chat != i for p in self.pending.values())]
                if not free:
                    continue
                i = free[int(self.rng.integers(len(free)))]
                chat = self.chats[i]
                chat.extend(self.text.take(m.turn_tokens))
                if len(chat) > limit:
                    chat[:] = list(self.system[i % len(self.system)]) + self.text.take(m.turn_tokens)
                self._submit("main", kind, chat, chat=i, retention=self._retention(len(self.system[0])))
            elif kind == "chunks":
                ranks = np.minimum(self.rng.zipf(m.zipf_alpha, m.chunks_per_prompt) - 1, len(self.passages) - 1)
                chunks = [self.passages[int(r)] for r in ranks]
                for chunk in chunks:
                    if "miss" in self.store.tiers(chunk):
                        self.store.put(chunk)
                prompt, spans = list(self.system[0]), []
                for chunk in chunks:
                    spans.append((len(prompt), len(prompt) + len(chunk)))
                    prompt.extend(chunk)
                prompt.extend(self.text.take(m.turn_tokens))
                selection = SelectionConfig(recompute_ratio=m.recompute_ratio, selector=m.selector)
                reuse = ChunkReuse(self.store, tuple(spans), selection)
                self._submit("main", kind, prompt, chunks=reuse)
            elif kind == "speculative":
                piece = self.text.take(m.turn_tokens)
                self._submit("speculative", kind, piece + self.text.take(m.turn_tokens // 2) + piece)
            else:
                system = self.system[int(self.rng.integers(len(self.system)))]
                self._submit("quantized", kind, list(system) + self.text.take(m.turn_tokens))

    # ------------------------------------------------------------------ serving and checks

    def serve_step(self) -> None:
        """One step of every engine with work; finished requests are checked and retired."""
        for name in ("main", "speculative", "quantized"):
            engine = self.engines[name]
            if not engine.has_work:
                continue
            engine.step()
            self._check_manager(name)
            if name == "main":
                self._check_events()
        for rid in [rid for rid, p in self.pending.items() if self.engines[p.engine].requests[rid].finished]:
            self._retire(rid)
        self.step += 1
        self._sample()

    def _sample(self, fault: str = "") -> None:
        rss = psutil.Process().memory_info().rss / 2**20
        self.rss.append((time.perf_counter(), rss, self.compiles.programs, self.injected, fault))

    def _check_manager(self, name: str) -> None:
        try:
            self.engines[name].manager.check_consistency()
            ok, seen = True, ""
        except Exception as err:  # any broken invariant is a violation, and the soak goes on
            ok, seen = False, f"{type(err).__name__}: {err}"
        self.tally.check("consistency", ok, engine=name, step=self.step, seen=seen)

    def _check_events(self) -> None:
        manager = require_tiered(self.engines["main"].manager, "the soak's event check")
        for event in manager.get_kv_cache_events():
            if event.kind == "all_cleared":
                self.events = {k: t for k, t in self.events.items() if k[0] != event.group}
            elif event.kind == "removed":
                self.events.pop((event.group, event.block_key), None)
            elif event.tier is not None:
                self.events[(event.group, event.block_key)] = event.tier
        tree = self._tree()
        dropped = isinstance(manager, KVCacheManager) and manager.num_dropped_events > 0
        self.tally.check("events_match_tree", tree == self.events and not dropped, engine="main", step=self.step,
                         seen=f"{len(set(tree.items()) ^ set(self.events.items()))} entries differ, dropped={dropped}")

    def _tree(self) -> dict[tuple[int, bytes], str]:
        manager = self.engines["main"].manager
        assert isinstance(manager, KVCacheManager)
        return {(pool.group, key): block.tier.label
                for pool in manager.pools for key, block in pool.tree.blocks.items()}

    def _reference(self, p: Pending) -> list[int]:
        """The fault-free reference output of an exact request."""
        key = ("reference", p.prompt, p.sampling.max_new_tokens)
        if key not in self.references:
            self.references[key] = self.engines["reference"].generate([list(p.prompt)], p.sampling)[0].output
        return self.references[key]

    def _check_quantized(self, rid: str, p: Pending, out: RequestOutput) -> None:
        """``quantized_output``: logits within ``checks.quantized_drift_fraction`` of int8's own
        error, tokens equal up to a near-tie (module docstring). The int8 and float32 references
        run now (their logits are not kept)."""
        ref = self.engines["reference_quantized"].generate([list(p.prompt)], p.sampling)[0]
        exact = self.engines["reference"].generate([list(p.prompt)], p.sampling)[0]
        drift, first = _logit_difference(out, ref)
        own_error, _ = _logit_difference(ref, exact)
        self.tally.quantized_drift.append(drift)
        self.tally.quantized_error.append(own_error)
        got, want = out.output, ref.output
        margin, near_tie = None, False
        if got != want and first < min(len(out.logits), len(ref.logits)):
            top_two = np.sort(ref.logits[first])[-2:]
            margin = float(top_two[1] - top_two[0])
            near_tie = margin <= 2 * float(np.max(np.abs(out.logits[first] - ref.logits[first])))
            self.tally.near_ties += near_tie
        ok = (got == want or near_tie) and drift <= self.config.checks.quantized_drift_fraction * own_error
        self.tally.check("quantized_output", ok, engine=p.engine, request=rid, kind=p.kind,
                         seen={"got": got, "want": want, "first_difference": first, "max_logit_difference": drift,
                               "int8_error": own_error, "reference_margin": margin})

    def _retire(self, rid: str) -> None:
        p = self.pending.pop(rid)
        engine = self.engines[p.engine]
        self.tally.faults["preemption"] += engine.requests[rid].num_preemptions
        out = engine.pop_output(rid)
        if p.aborted:
            return
        self.tally.served[p.kind] += 1
        self.tally.check("no_error", out.finish_reason in ("length", "stop"), engine=p.engine, request=rid,
                         kind=p.kind, seen=f"finish_reason={out.finish_reason} {out.error or ''}")
        if p.kind == "chunks":
            self.tally.check("blended_finished", out.finish_reason in ("length", "stop"), request=rid)
            return
        if out.finish_reason not in ("length", "stop"):
            return
        if p.kind == "quantized":
            self._check_quantized(rid, p, out)
            return
        want = self._reference(p)
        self.tally.check("exact_output", out.output == want, engine=p.engine, request=rid, kind=p.kind,
                         seen={"got": out.output, "want": want})
        if p.chat is not None:
            self.chats[p.chat].extend(out.output)

    # ------------------------------------------------------------------ faults

    def _disk_blocks(self) -> list[tuple[int, int]]:
        """(group, disk page) of every cached block on the main engine's disk tier."""
        manager = self.engines["main"].manager
        assert isinstance(manager, KVCacheManager)
        return [(pool.group, block.page) for pool in manager.pools for block in pool.tree.blocks.values()
                if block.tier is Tier.DISK]

    def inject(self, fault: str) -> bool:
        """Injects ``fault`` now if there is something for it to act on; returns whether it did."""
        main = self.engines["main"]
        page_files = main.host_pool.disk
        if fault in ("corrupt_disk_page", "truncate_disk_file"):
            on_disk = self._disk_blocks()
            if not on_disk:
                return False
            group, page = on_disk[int(self.rng.integers(len(on_disk)))]
            page_file = page_files[group]
            with open(page_file.path, "r+b") as f:
                if fault == "corrupt_disk_page":
                    f.seek(page * page_file.record_bytes + int(self.rng.integers(page_file.record_bytes)))
                    f.write(self.rng.integers(0, 256, 64, dtype=np.uint8).tobytes())
                else:
                    f.truncate(page * page_file.record_bytes + int(self.rng.integers(page_file.record_bytes)))
            return True
        if fault == "disk_read_error":
            if not self._disk_blocks() or self.read_error is not None:
                return False
            swapped = []
            for page_file in page_files:
                fd = _descriptor_of(page_file.path)
                write_only = os.open(page_file.path, os.O_WRONLY)
                swapped.append((fd, os.dup(fd)))
                os.dup2(write_only, fd)
                os.close(write_only)
            self.read_error = (swapped, self.step + self.config.faults.read_error_steps)
            return True
        if fault in ("abort_mid_prefill", "abort_after_onboard"):
            for rid, p in self.pending.items():
                if p.engine != "main" or p.aborted:
                    continue
                sched = main.scheduler.running.get(rid)
                if sched is None or not 0 < sched.num_computed_tokens < len(p.prompt):
                    continue
                if fault == "abort_after_onboard" and not main.manager.request_stats(rid).onboarded_pages:
                    continue
                p.aborted = main.abort(rid)
                return p.aborted
            if self._in_flight("main") < self.config.mix.in_flight + 1:
                self._long_request(onboard=fault == "abort_after_onboard")
            return False
        self.blocked = True  # the snapshot faults need the main engine idle
        if main.has_work:
            return False
        if fault == "snapshot_save_restore":
            if not self.snapshot_dir.is_dir() or self.rng.random() < 0.5:
                save_snapshot(main, self.snapshot_dir)
                self.tally.faults["snapshot_saved"] += 1
            else:
                restore_snapshot(main, self.snapshot_dir)
                self.tally.faults["snapshot_restored"] += 1
                self._reseed_events()
        else:
            if not self.snapshot_dir.is_dir():
                save_snapshot(main, self.snapshot_dir)
            step = self._kill_a_save()
            restored = restore_snapshot(main, self.snapshot_dir)
            self.tally.check("fault_survived", restored <= step, engine="main", step=self.step,
                             seen=f"restored step {restored} after a save of step {step} was killed")
            self._reseed_events()
        self.blocked = False
        return True

    def _try(self, fault: str) -> bool:
        """``inject``, counted; an exception it raises is a violation and the soak goes on."""
        try:
            done = self.inject(fault)
        except Exception as err:  # a fault the engine did not survive is what the soak looks for
            self.tally.check("fault_survived", False, fault=fault, step=self.step, seen=f"{type(err).__name__}: {err}")
            self.blocked = False
            return True
        if done:
            self.tally.faults[fault] += 1
            self.tally.check("fault_survived", True)
            self.injected += 1
            self._sample(fault)
        return done

    def _long_request(self, onboard: bool) -> None:
        """A chat turn longer than one prefill chunk; with ``onboard``, one whose cached prefix
        is on the host or disk tier (none is submitted if no chat's is)."""
        main = require_tiered(self.engines["main"].manager, "the soak's abort faults")
        busy = {p.chat for p in self.pending.values()}
        for i in self.rng.permutation(len(self.chats)):
            prefix = self.chats[int(i)][: self.config.max_seq_len // 2]
            if int(i) in busy or (onboard and not {"host", "disk"} & set(main.reusable_tiers(prefix))):
                continue
            prompt = prefix + self.text.take(2 * self.config.scheduler.prefill_chunk_size)
            self._submit("main", "chat", prompt[: self.config.max_seq_len - self.config.mix.max_new_tokens])
            return

    def _reseed_events(self) -> None:
        """After a restore the manager is another object: its drained events start from its tree."""
        manager = require_tiered(self.engines["main"].manager, "the soak's event check")
        manager.get_kv_cache_events()
        self.events = self._tree()

    def _kill_a_save(self) -> int:
        """Starts a process that restores the latest snapshot into a main engine of its own and
        saves it as the next step, and kills it (SIGKILL) after a random delay within the save;
        returns the step it was saving."""
        step = max(int(p.name) for p in self.snapshot_dir.iterdir() if p.name.isdigit()) + 1
        args = json.dumps({"config": self.config.to_dict(), "disk_dir": self.disk_dir,
                           "snapshots": str(self.snapshot_dir)})
        code = f"from experiments.soak import child_save; child_save({args!r})"
        with tempfile.TemporaryFile("w+") as log:
            child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True,
                                     cwd=pathlib.Path(__file__).resolve().parents[1])
            assert child.stdout is not None
            started = child.stdout.readline().strip() == "saving"
            if started:
                time.sleep(float(self.rng.uniform(0, self.config.faults.kill_within_s)))
            child.send_signal(signal.SIGKILL)
            child.wait()
            log.seek(0)
            self.tally.check("fault_survived", started, fault="killed_snapshot_save", step=self.step,
                             seen=f"the saving process never started its save: {log.read()[-2000:]}")
        return step

    def end_read_error(self, now: bool = False) -> None:
        """Gives the page files their readable descriptors back once the read-error window
        has passed (``now``: at once)."""
        if self.read_error is not None and (now or self.step >= self.read_error[1]):
            for fd, saved in self.read_error[0]:
                os.dup2(saved, fd)
                os.close(saved)
            self.read_error = None

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        """Serves the mix for ``config.minutes`` (or ``config.max_steps`` steps, if sooner),
        injecting faults; drains; checks the end state."""
        c = self.config
        due: Iterator[str] = itertools.cycle([f for f in FAULTS if f in c.faults.kinds])
        fault, since, started = None, 0, time.perf_counter()
        while time.perf_counter() - started < 60 * c.minutes and not (c.max_steps and self.step >= c.max_steps):
            self.top_up()
            self.serve_step()
            self.end_read_error()
            if fault is None and c.faults.kinds and self.step % c.faults.every_steps == 0:
                fault, since = next(due), self.step
            if fault is not None and self._try(fault):
                fault = None
            elif fault is not None and self.step - since > c.faults.patience_steps:
                self.tally.faults[f"{fault} (no chance)"] += 1
                fault, self.blocked = None, False
        self.blocked = True
        for _ in range(c.checks.drain_steps):
            if not self.pending:
                break
            self.serve_step()
        self.tally.check("no_error", not self.pending, seen=f"{len(self.pending)} requests still running after "
                                                             f"checks.drain_steps={c.checks.drain_steps} steps")
        self.end_read_error(now=True)
        for name in ("main", "speculative", "quantized"):
            manager = self.engines[name].manager
            leaked = [g for g in range(self.engines[name].layout.num_groups)
                      if manager.num_free_pages(g) != self.engines[name].layout.num_pages[g] - 1]
            self.tally.check("no_leak", not leaked, engine=name, seen=f"groups with pages held: {leaked}")
            self._check_manager(name)
        return self._results(time.perf_counter() - started)

    def _results(self, seconds: float) -> dict:
        c, t = self.config, self.tally
        *numbers, kinds = zip(*self.rss)
        times, mb, programs, faults = (np.asarray(column, dtype=np.float64) for column in numbers)
        times -= times[0]
        growth = memory_growth(times, mb, programs, faults, c.checks.rss_warmup_fraction)
        after = times >= c.checks.rss_warmup_fraction * times[-1]
        by_fault: dict[str, float] = collections.defaultdict(float)  # fault kind -> MiB after warm-up
        for i in np.flatnonzero(after[1:] & after[:-1]) + 1:
            if kinds[i]:
                by_fault[kinds[i]] += mb[i] - mb[i - 1]
        late = collections.Counter(self.compiles.functions[int(programs[np.argmax(after)]) : int(programs[-1])])
        t.check("rss_flat", growth.peak_without_compiles <= c.checks.rss_growth_mb,
                seen=f"high-water mark +{growth.peak_without_compiles:.0f} MiB after warm-up in steps that "
                     "compiled nothing")
        rows = [{"check": name, "checked": t.checks[name], "violations": sum(v["check"] == name for v in t.violations)}
                for name in CHECKS]
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot(times / 60, mb)
        compiled = np.flatnonzero(np.diff(programs) > 0) + 1
        ax.plot(times[compiled] / 60, mb[compiled], "|", color="tab:red", markersize=8, label="a program compiled")
        for n, kind in enumerate(sorted(set(kinds) - {""})):
            at = np.asarray([k == kind for k in kinds])
            ax.plot(times[at] / 60, mb[at], "v^<>osDP"[n % 8], markersize=5, fillstyle="none", label=kind)
        ax.axvline(c.checks.rss_warmup_fraction * times[-1] / 60, color="gray", linestyle=":", label="warm-up ends")
        ax.legend(loc="lower right")
        ax.set(xlabel="minutes", ylabel="resident memory (MiB)", title="Soak: resident memory")
        report.save_figure(fig, self.workdir / "rss.png")
        report.write_csv(self.workdir / "checks.csv", rows)
        report.write_csv(self.workdir / "rss.csv", [
            {"seconds": round(s, 3), "rss_mib": round(m, 1), "programs": int(n), "faults": int(f), "fault": k}
            for s, m, n, f, k in zip(times, mb, programs, faults, kinds)
        ])
        report.write_json(self.workdir / "violations.json", t.violations)
        served = dict(sorted(t.served.items()))
        faults = dict(sorted(t.faults.items()))
        drift = max(t.quantized_drift, default=0.0)
        error = np.asarray(t.quantized_error)
        ratio = np.asarray(t.quantized_drift) / np.maximum(error, np.finfo(np.float32).tiny)
        quantized = (f"{len(t.quantized_drift)} checked against a cold int8 run: largest logit difference "
                     f"{drift:.3g}, at most {ratio.max(initial=0.0):.2f}x the cold int8 run's own difference "
                     f"from float32 (bound {c.checks.quantized_drift_fraction}x; that difference "
                     f"{error.min(initial=0.0):.3g} to {error.max(initial=0.0):.3g}), {t.near_ties} left the "
                     "cold run's tokens at a near-tie")
        sections = [
            ("Run", f"{seconds / 60:.1f} minutes, {self.step} steps, model {c.model}, machine {cpu_name()} "
                    f"({os.cpu_count()} cores)"),
            ("Requests served", report.markdown_table([{"kind": k, "served": n} for k, n in served.items()])),
            ("Faults injected", report.markdown_table([{"fault": k, "injected": n} for k, n in faults.items()])),
            ("Invariant checks", report.markdown_table(rows)),
            ("Quantized requests", quantized),
            ("Resident memory", f"{mb[0]:.0f} MiB at the start, {mb[-1]:.0f} MiB at the end. After warm-up "
                                f"({c.checks.rss_warmup_fraction:.0%} of the run): {growth.total:+.0f} MiB in all, "
                                f"{growth.without_compiles:+.0f} MiB in the steps that compiled nothing, which "
                                f"raised the high-water mark {growth.peak_without_compiles:+.0f} MiB (bound "
                                f"{c.checks.rss_growth_mb} MiB), {growth.with_compiles:+.0f} MiB in the "
                                f"{growth.compiling_steps} steps that compiled {growth.programs} programs and "
                                f"{growth.with_faults:+.0f} MiB across the {growth.faults} faults injected; "
                                f"{int(programs[-1])} programs in the whole run; rss.png, rss.csv"),
            ("Memory by fault kind after warm-up",
             report.markdown_table([{"fault": k, "injected": sum(kinds[i] == k for i in np.flatnonzero(after)),
                                     "rss_change_mib": round(v, 1)} for k, v in sorted(by_fault.items())])),
            ("Programs compiled after warm-up",
             report.markdown_table([{"function": f, "programs": n} for f, n in late.most_common()])),
        ]
        report.write_summary(self.workdir, "Soak", sections)
        self.tmp.cleanup()
        return {"minutes": seconds / 60, "steps": self.step, "served": served, "faults": faults,
                "checks": dict(t.checks), "violations": len(t.violations), "rss_growth_mib": dataclasses.asdict(growth),
                "rss_change_by_fault_mib": dict(by_fault), "programs_after_warmup": dict(late),
                "quantized_max_logit_difference": drift, "quantized_max_drift_fraction": float(ratio.max(initial=0.0)),
                "quantized_near_ties": t.near_ties,
                "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), **timing.machine_limits()},
                "headline_text": f"soak: {sum(served.values())} requests, {sum(faults.values())} faults, "
                                 f"{sum(t.checks.values())} checks, {len(t.violations)} violations"}


def _logit_difference(out: RequestOutput, ref: RequestOutput) -> tuple[float, int]:
    """The largest |logit difference| between two runs of one prompt over the steps both saw the
    same context (through the first step whose tokens differ, inclusive), and that step (the
    common length if none differs)."""
    common = min(len(out.output), len(ref.output), len(out.logits), len(ref.logits))
    first = next((i for i in range(common) if out.output[i] != ref.output[i]), common)
    deltas = [float(np.max(np.abs(out.logits[i] - ref.logits[i]))) for i in range(min(first + 1, common))]
    return max(deltas, default=0.0), first


@dataclasses.dataclass(frozen=True)
class MemoryGrowth:
    """Resident memory's change after warm-up, split by whether a step compiled.

    Attributes:
      total: MiB, the last sample's minus the first after warm-up.
      without_compiles: MiB, summed over the steps that compiled no new program.
      peak_without_compiles: MiB, the rise of the high-water mark (the largest sample since
        warm-up ended) summed over those steps: a leak shows here, while a step that refills
        heap a fault handed back, below the mark, does not.
      with_compiles: MiB, summed over the steps that did.
      with_faults: MiB, summed over the injected faults (each sampled before the next step; a
        fault that compiles counts here). The three parts add up to ``total``.
      compiling_steps: steps after warm-up that compiled at least one program.
      programs: programs compiled after warm-up (outside faults).
      faults: faults injected after warm-up.
    """

    total: float
    without_compiles: float
    peak_without_compiles: float
    with_compiles: float
    with_faults: float
    compiling_steps: int
    programs: int
    faults: int


def memory_growth(
    times: np.ndarray, mb: np.ndarray, programs: np.ndarray, faults: np.ndarray, warmup_fraction: float
) -> MemoryGrowth:
    """Splits the resident memory's growth after warm-up into the steps that compiled nothing,
    the steps that compiled, and the injected faults.

    Args:
      times: [samples] seconds since the first sample, ascending (one sample after each step
        and after each injected fault).
      mb: [samples] resident MiB.
      programs: [samples] programs compiled by then (non-decreasing).
      faults: [samples] faults injected by then (non-decreasing).
      warmup_fraction: the share of the run's time, in [0, 1), before which nothing counts.

    Returns:
      ``MemoryGrowth`` over the samples at or after ``warmup_fraction * times[-1]``.
    """
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"checks.rss_warmup_fraction={warmup_fraction} must be in [0, 1)")
    after = times >= warmup_fraction * times[-1]
    step_mb, step_programs, step_faults = np.diff(mb[after]), np.diff(programs[after]), np.diff(faults[after])
    fault = step_faults > 0
    compiling = (step_programs > 0) & ~fault
    quiet = ~compiling & ~fault
    peak_rise = np.diff(np.maximum.accumulate(mb[after]))  # [steps] rise of the high-water mark
    return MemoryGrowth(
        total=float(step_mb.sum()),
        without_compiles=float(step_mb[quiet].sum()),
        peak_without_compiles=float(peak_rise[quiet].sum()),
        with_compiles=float(step_mb[compiling].sum()),
        with_faults=float(step_mb[fault].sum()),
        compiling_steps=int(compiling.sum()),
        programs=int(step_programs[compiling].sum()),
        faults=int(step_faults.sum()),
    )


def _descriptor_of(path: pathlib.Path) -> int:
    """The descriptor this process holds open on ``path`` (Linux: read from /proc/self/fd)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                return int(fd)
        except OSError:
            continue
    raise RuntimeError(f"no open descriptor on {path}")


def child_save(args: str) -> None:
    """The killed-save fault's process: restores the latest snapshot into a main engine of its
    own, prints "saving", then saves the next step (the soak kills it meanwhile)."""
    spec = json.loads(args)
    config = ml_collections.ConfigDict(spec["config"])
    engine = build_engine(model_for(config), config, spec["disk_dir"], "main")
    restore_snapshot(engine, spec["snapshots"])
    print("saving", flush=True)
    save_snapshot(engine, spec["snapshots"])


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    """Runs the soak (``Soak.run``) and writes its tables, plot and summary into ``workdir``."""
    return Soak(config, workdir).run()
