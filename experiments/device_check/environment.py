"""What the check ran on: interpreter, jax and its plugins, the platform, which Pallas GPU
backends import, and where the carried packages were found."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys

import jax

from experiments.device_check.machine import carried_wheels
from experiments.device_check.stages import error_text

PLUGINS = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")
CARRIED_MODULES = {"blake3": "blake3", "gguf": "gguf"}
"""Carried distribution -> the module it provides."""


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imports(module: str) -> str:
    """"yes", or the error that importing ``module`` raised."""
    try:
        importlib.import_module(module)
    except Exception as error:
        return error_text(error)
    return "yes"


def commit() -> str:
    """``$DEVICE_CHECK_COMMIT``, else the checkout's ``git rev-parse --short HEAD``, else "unknown"."""
    if os.environ.get("DEVICE_CHECK_COMMIT"):
        return os.environ["DEVICE_CHECK_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def describe() -> dict[str, str]:
    """Facts about this run's machine and software, as strings (one table row each)."""
    device = jax.devices()[0]
    facts = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "jax / jaxlib": f"{jax.__version__} / {_version('jaxlib')}",
        "jax plugins": ", ".join(f"{p} {_version(p)}" for p in PLUGINS if _version(p)) or "none",
        "backend": jax.default_backend(),
        "devices": f"{jax.device_count()} x {device.device_kind} ({device.platform})",
        "Pallas Triton (jax.experimental.pallas.triton)": _imports("jax.experimental.pallas.triton"),
        "Pallas Mosaic GPU (jax.experimental.pallas.mosaic_gpu)": _imports("jax.experimental.pallas.mosaic_gpu"),
        "commit": commit(),
    }
    for distribution, version in carried_wheels().items():
        spec = importlib.util.find_spec(CARRIED_MODULES.get(distribution, distribution))
        where = spec.origin if spec is not None else "MISSING"
        facts[f"carried {distribution}=={version}"] = f"{_version(distribution) or '?'} from {where}"
    return facts
