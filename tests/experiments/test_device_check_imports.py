"""A CPU dry run of ``experiments/device_check.sh``'s imports on a machine like the lent GPU one.

That machine has jax, flax, numpy, einops, matplotlib, psutil, PyYAML, tokenizers and
safetensors, but not ``blake3``, ``gguf`` or ``ml_collections``, and it cannot fetch packages. This
test imports every module the check's Python imports, in a subprocess where those three
cannot be imported, so a new dependency on them is caught here rather than there.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSENT_THERE = ("blake3", "gguf", "ml_collections")


def check_imports() -> list[str]:
    """The import statements of the Python program inside device_check.sh, as source lines."""
    script = (ROOT / "experiments" / "device_check.sh").read_text()
    (program,) = re.findall(r"python - <<'EOF'\n(.*?)\nEOF", script, re.DOTALL)
    imports = (node for node in ast.walk(ast.parse(program)) if isinstance(node, (ast.Import, ast.ImportFrom)))
    return sorted({ast.unparse(node) for node in imports})


def test_the_device_check_imports_nothing_the_gpu_machine_lacks():
    imports = check_imports()
    assert "from pallas_kernels.paged_attention import gpu as paged_gpu" in imports
    assert "from kvjax.testing.paged_inputs import TOLERANCE, make_inputs" in imports
    probe = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {ABSENT_THERE!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)")

        sys.meta_path.insert(0, Absent())
        """
    ) + "\n".join(imports) + f"\nprint('imported', {len(imports)})\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"imported {len(imports)}"
