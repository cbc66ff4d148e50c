"""What the lent GPU machine (``nvidia-h200``) holds, and what the check carries to it.

The machine reaches no package registry: its Python (3.12.3, jax 0.11.2 with the
jax-cuda13 plugin) has the distributions of ``DEVICE_DISTRIBUTIONS`` and nothing else. The
few the check needs beyond them travel as wheels: ``wheels.txt`` beside this file pins them,
``experiments/device_wheels.sh`` downloads them (cp312, manylinux x86-64) into
``WHEEL_DIR``, and ``experiments/device_check.sh`` installs them offline before anything is
imported. Names are normalized as ``normalize`` writes them (PEP 503).
"""

from __future__ import annotations

import pathlib
import re

DEVICE_PYTHON = "3.12.3"
DEVICE_JAX = "0.11.2"
WHEEL_DIR = ".device_wheels"
"""Folder, relative to the repository root, that holds the carried wheels (gitignored; name it
in the device call's ``carry``)."""
WHEELS_FILE = pathlib.Path(__file__).with_name("wheels.txt")

DEVICE_DISTRIBUTIONS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
"""Distributions of the machine's image ('cuda'), as read on one running it on 2026-11-17."""


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def carried_wheels() -> dict[str, str]:
    """The pinned wheels of ``wheels.txt``: normalized name -> version."""
    pins = {}
    for line in WHEELS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[normalize(name)] = version.strip()
    return pins
