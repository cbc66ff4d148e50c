"""Every ```python block of the README and docs/ runs as written. A fragment that uses names it
does not define gets them from its file's setup below (a tiny model where the real one is not the
point); a block that loads the real model is marked ``real_model``."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

_TINY = """
import pathlib
from kvjax.config import KvCacheConfig, SchedulerConfig
from kvjax.engine import Engine
from kvjax.model.registry import Model
from kvjax.testing.tiny import tiny_model
cfg, _params = tiny_model(0)
model = Model(config=cfg, params=_params, tokenizer=None, path=pathlib.Path("tiny"))
"""
SETUP = {
    "docs/cache_manager.md": _TINY,
    "docs/hybrid.md": "from kvjax.config import KvCacheConfig\n",
    "docs/distributed.md": _TINY + """
import numpy as np
import jax.numpy as jnp
from kvjax.testing.paged import single_group_layout
layout = single_group_layout(cfg, 8, 16)
tokens = jnp.asarray(np.arange(1, 21, dtype=np.int32)[None])
positions = jnp.asarray(np.arange(20, dtype=np.int32)[None])
tables = (jnp.asarray(np.array([[1, 2]], np.int32)),)
lengths = jnp.asarray(np.array([20], np.int32))
""",
}
"""Per file (relative to the repository), code run before each of its blocks."""


def blocks() -> list:
    out = []
    for path in FILES:
        name = path.relative_to(ROOT).as_posix()
        for i, match in enumerate(BLOCK.finditer(path.read_text(encoding="utf-8"))):
            source = match.group(1)
            marks = [pytest.mark.real_model] if "load_model(" in source else []
            out.append(pytest.param(name, source, id=f"{name}[{i}]", marks=marks))
    return out


@pytest.mark.parametrize("name,source", blocks())
def test_python_block_runs(name: str, source: str):
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(SETUP.get(name, "") + source, f"{name} (python block)", "exec"), namespace)
