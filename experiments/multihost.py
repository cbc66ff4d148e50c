"""Greedy generation over one device mesh that spans several processes (multi-controller JAX).

The launcher (``run``) starts ``config.num_processes`` local processes, each with
``config.devices_per_process`` CPU devices, that join one job (``kvjax.distributed.
initialize_distributed``: the coordination service of process 0, gloo collectives on CPU).
Every process builds the same mesh over all processes' devices and the same engine over it
(``Engine(mesh=...)``: weights and page pool sharded, attention per device) and generates the
same request: the program is SPMD, each process feeding its own devices and running the same
host-side scheduler and manager. Each writes the tokens it generated;
the launcher checks that every process generated exactly the tokens of one process on one
device. If a process fails, the launcher ends the others at once and raises naming it, and a
whole run is bounded by ``config.timeout_s``.

    python -m experiments.run --config=configs/multihost.py            # 2 processes x 2 devices
    python -m experiments.run --config=configs/multihost.py --config.num_processes=4

On a multi-host TPU slice or GPU hosts, run the worker on every host instead of the launcher,
with the coordinator's address (see docs/distributed.md):

    python -m experiments.multihost --coordinator=host0:12345 --num_processes=N --process_id=i --out=tokens_i.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import ml_collections
import numpy as np

from experiments import report


def _engine(config: ml_collections.ConfigDict, mesh=None):
    """An engine over ``config.model`` whose pool (``config.num_pages`` pages, the null page
    included) splits over the mesh's ``pages`` axis; sharded over ``mesh`` if given."""
    from kvjax.config import KvCacheConfig, SchedulerConfig
    from kvjax.engine import Engine
    from kvjax.model.registry import load_model

    kv = KvCacheConfig(
        tokens_per_block=config.tokens_per_block, max_tokens=(config.num_pages - 1) * config.tokens_per_block
    )
    return Engine(load_model(config.model), kv, SchedulerConfig(max_num_tokens=256, prefill_chunk_size=256),
                  max_seq_len=config.prompt_tokens + config.new_tokens + config.tokens_per_block, mesh=mesh)


def generate(engine, config: ml_collections.ConfigDict) -> list[int]:
    """Greedy tokens of the config's prompt (random ids from ``config.seed``) through ``engine``."""
    from kvjax.sampling import SamplingParams

    prompt = (
        np.random.default_rng(config.seed).integers(3, engine.model.config.vocab_size, config.prompt_tokens).tolist()
    )
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True))
    return out.output


def single_device_tokens(config: ml_collections.ConfigDict) -> list[int]:
    """The tokens one process on one device generates (the reference)."""
    return generate(_engine(config), config)


def worker(config: ml_collections.ConfigDict, coordinator: str, num_processes: int, process_id: int,
           out: pathlib.Path) -> None:
    """One process of the job: joins it, runs the engine over the global mesh, writes its tokens."""
    import jax

    from kvjax import distributed

    distributed.initialize_distributed(coordinator, num_processes, process_id, initialization_timeout=config.timeout_s)
    mesh = distributed.make_mesh(_engine(config).model.config.num_kv_heads)
    engine = _engine(config, mesh)
    tokens = generate(engine, config)
    out.write_text(json.dumps({
        "process_id": process_id, "tokens": tokens, "mesh": dict(mesh.shape), "global_devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "pool_sharded": not engine.pool.k[0].is_fully_addressable,
    }))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> list[dict]:
    """Starts the processes and waits for all of them (at most ``config.timeout_s``).

    Raises:
      RuntimeError: a process exited with an error (the others are then terminated), naming
        it with the end of its output; or the run took longer than ``timeout_s``.
    """
    coordinator = f"localhost:{_free_port()}"
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={config.devices_per_process}",
           "JAX_PLATFORMS": "cpu"}
    procs, logs = [], []
    for i in range(config.num_processes):
        log = open(workdir / f"process_{i}.log", "w")  # noqa: SIM115 (closed in the finally below, after the process ends)
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "experiments.multihost", f"--coordinator={coordinator}",
             f"--num_processes={config.num_processes}", f"--process_id={i}", f"--out={workdir / f'tokens_{i}.json'}",
             f"--config_json={json.dumps(config.to_dict())}"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=pathlib.Path(__file__).resolve().parents[1],
        ))
    deadline = time.monotonic() + config.timeout_s
    killed_at = time.monotonic() + config.kill_after_s if config.kill_process >= 0 else None
    try:
        while None in [p.poll() for p in procs]:  # poll every process (a generator would stop early)
            if killed_at is not None and time.monotonic() >= killed_at:
                procs[config.kill_process].kill()
                killed_at = None
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                i, code = failed[0]
                raise RuntimeError(f"process {i} of {config.num_processes} exited with code {code}; the others were "
                                   f"stopped. Its output ends: {_tail(workdir / f'process_{i}.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {config.num_processes} processes did not finish within timeout_s="
                                   f"{config.timeout_s}; they were stopped")
            time.sleep(0.2)
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            i, code = failed[0]
            raise RuntimeError(f"process {i} exited with code {code}: {_tail(workdir / f'process_{i}.log')}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    return [json.loads((workdir / f"tokens_{i}.json").read_text()) for i in range(config.num_processes)]


def _tail(path: pathlib.Path, chars: int = 600) -> str:
    return path.read_text()[-chars:].strip() if path.is_file() else "(no output)"


def run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict:
    start = time.perf_counter()
    results = launch(config, workdir)
    wall_s = time.perf_counter() - start
    reference = single_device_tokens(config)
    rows = [{"process": r["process_id"], "mesh": str(r["mesh"]), "global_devices": r["global_devices"],
             "local_devices": r["local_devices"], "pool_spans_processes": r["pool_sharded"],
             "equal_to_one_device": r["tokens"] == reference} for r in results]
    summary = {
        "reference_tokens": reference,
        "processes": results,
        "all_equal": all(r["equal_to_one_device"] for r in rows),
        "wall_s": wall_s,
    }
    report.write_summary(
        workdir,
        f"multihost — {config.num_processes} processes x {config.devices_per_process} devices",
        [
            ("Processes", report.markdown_table(rows)),
            ("Tokens", f"one device: {reference}\n\nevery process equal: {summary['all_equal']} (wall {wall_s:.1f} s)"),
        ],
    )
    if not summary["all_equal"]:
        raise RuntimeError(f"a process generated other tokens than one device: {results} vs {reference}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description="One process of a multi-process generation (see the module docstring)."
    )
    parser.add_argument("--coordinator", required=True, help="host:port of process 0's coordination service")
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="where this process writes its tokens (JSON)")
    parser.add_argument(
        "--config_json", default="", help="the experiment config as JSON (default: configs/multihost.py)"
    )
    args = parser.parse_args()
    from configs import multihost as multihost_config

    config = multihost_config.get_config()
    if args.config_json:
        config.update(json.loads(args.config_json))
    worker(config, args.coordinator, args.num_processes, args.process_id, args.out)


if __name__ == "__main__":
    main()
