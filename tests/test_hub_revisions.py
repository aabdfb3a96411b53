"""Revisions (issue 18, item 4): a download fetches the commit its plan listed, and every
form of ``@revision`` the Hub resolves works: a tag, a short or full commit hash,
``refs/pr/N``. A missing revision or file is a one-line typed error. (Checksum
mismatches: tests/test_hub_faithful.py.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from localrun import hub
from localrun.errors import HubNotFoundError
from localrun.hub import pulls
from tests.hubserver import FakeFile, FakeRepo, HubFixture, gguf_bytes, start

REPO = "movers/Moving-1B-GGUF"
SHARDS = [f"moving-1b-q4_k_m-0000{i}-of-00002.gguf" for i in (1, 2)]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv(pulls.HOME_ENV, raising=False)
    yield from start(monkeypatch, tmp_path)


def _shards(seed: int) -> dict[str, FakeFile]:
    """Two shards of one GGUF; ``seed`` changes their bytes (another commit)."""
    return {name: FakeFile(gguf_bytes(quant="Q4_K_M", arch="llama", layers=16, heads=32,
                                      kv_heads=8, embedding=2048, pad=1500 + 97 * seed + i,
                                      extra={"split.no": i, "split.count": 2}), lfs=True)
            for i, name in enumerate(SHARDS)}


def _repo(fake: HubFixture) -> FakeRepo:
    return fake.hub.add(FakeRepo(REPO, {"main": _shards(1)}, tags=["gguf"]))


def _bytes(files: dict[str, FakeFile], name: str) -> bytes:
    data = files[name].data
    assert data is not None
    return data


def _one_line(e: BaseException) -> str:
    assert "\n" not in str(e), str(e)
    return str(e)


@pytest.mark.parametrize("renamed", [False, True], ids=["same-names", "renamed"])
def test_a_branch_that_moves_after_the_plan_does_not_mix_commits(fake: HubFixture,
                                                                 renamed: bool) -> None:
    """The Hub moves main between plan and download (new bytes under the same names, or
    other names): the download is the planned commit, whole."""
    repo = _repo(fake)
    planned = dict(repo.branches["main"])
    plan = hub.plan_fetch(REPO, backend="llama.cpp")
    assert plan.commit == repo.sha("main") and [f.path for f in plan.files] == SHARDS
    new = _shards(2)
    repo.move("main", {n.replace("moving", "moved"): f for n, f in new.items()}
              if renamed else new)
    path = hub.fetch(plan)
    assert path.parent.name == plan.commit  # snapshots/<the planned commit>/
    for name in SHARDS:
        assert (path.parent / name).read_bytes() == _bytes(planned, name)
    # What main was when planned is what the cache says it was (offline plans read it).
    refs = fake.home / "hub" / "models--movers--Moving-1B-GGUF" / "refs" / "main"
    assert refs.read_text() == plan.commit
    (rec,) = pulls.load(fake.home / "hub")
    assert (rec.revision, rec.commit) == ("main", plan.commit)
    fake.offline()
    assert hub.fetch(hub.plan_fetch(REPO, backend="llama.cpp")) == path


@pytest.mark.parametrize("form", ["tag", "short-hash", "full-hash", "pr"])
def test_every_revision_form_the_hub_resolves(fake: HubFixture, form: str) -> None:
    repo = _repo(fake)
    old = repo.tag("v1.0")
    old_files = dict(repo.branches["main"])
    repo.move("main", _shards(2))
    repo.prs[3] = _shards(3)
    expected, files = {
        "tag": ("v1.0", old_files), "short-hash": (old[:7], old_files),
        "full-hash": (old, old_files), "pr": ("refs/pr/3", repo.prs[3])}[form]
    sha = repo.lookup(expected)
    assert sha is not None
    name = f"{REPO}@{expected}"
    plan = hub.plan_fetch(name, backend="llama.cpp")
    assert (plan.commit, plan.revision) == (sha[0], expected)
    path = hub.fetch(plan)
    assert path.read_bytes() == _bytes(files, SHARDS[0])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == plan.files[0].sha256
    # The same name plans offline from what was pulled.
    fake.offline()
    again = hub.plan_fetch(name, backend="llama.cpp")
    assert again.source == "cache" and hub.fetch(again) == path


def test_a_revision_the_hub_lacks_is_one_line(fake: HubFixture) -> None:
    _repo(fake)
    with pytest.raises(HubNotFoundError) as err:
        hub.plan_fetch(f"{REPO}@v9.9", backend="llama.cpp")
    assert "v9.9" in _one_line(err.value) and err.value.revision == "v9.9"


def test_a_planned_commit_that_vanished_is_one_line(fake: HubFixture) -> None:
    """History rewritten between plan and download (a force-push): the planned commit is
    gone; the error names the branch and the commit, not a moved branch's files."""
    repo = _repo(fake)
    plan = hub.plan_fetch(REPO, backend="llama.cpp")
    old = repo.move("main", _shards(2))
    del repo.history[old]
    with pytest.raises(HubNotFoundError) as err:
        hub.fetch(plan)
    msg = _one_line(err.value)
    assert "main" in msg and (plan.commit or "?")[:12] in msg
    assert not list((fake.home / "hub").rglob("snapshots/*/*.gguf"))


def test_a_file_the_commit_lacks_is_one_line(fake: HubFixture) -> None:
    _repo(fake)
    plan = hub.plan_fetch(REPO, backend="llama.cpp")
    ghost = replace(plan, files=(hub.PlannedFile("ghost-q4_k_m.gguf", 10),),
                    primary="ghost-q4_k_m.gguf")
    with pytest.raises(HubNotFoundError) as err:
        hub.fetch(ghost)
    assert "ghost-q4_k_m.gguf" in _one_line(err.value) and err.value.filename
