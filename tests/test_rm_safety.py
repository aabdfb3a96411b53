"""`localrun rm` removes only what localrun pulled (issue 24, item 1; issue 25, item 4).

The Hugging Face cache is shared: transformers, llama-cpp-python's ``from_pretrained`` and
``huggingface_hub`` itself put repos there. ``rm NAME`` removes the files that NAME's pull
record lists (that revision only), keeps what another pulled name still needs and what
was in the cache before localrun pulled it, and lists everything it keeps with why and
the command that would remove it. A repo id named explicitly is removed as asked
(``@revision``: that revision only). Against the stand-in Hub (tests/hubserver.py), with
repos downloaded by ``huggingface_hub`` directly beside the ones localrun pulled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest

from localrun import hub
from localrun.errors import LocalrunError
from localrun.hub import pulls
from tests.hubserver import BASE, FakeFile, FakeRepo, HubFixture, gguf_bytes, start

ROOT = Path(__file__).resolve().parent.parent
GGUF_REPO = f"{BASE}-GGUF"
Q4 = "qwen2.5-0.5b-instruct-q4_k_m.gguf"
Q8 = "qwen2.5-0.5b-instruct-q8_0.gguf"
ALIAS = "qwen2.5:0.5b"
TINY = "tinyorg/Tiny-GGUF"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv(pulls.HOME_ENV, raising=False)
    yield from start(monkeypatch, tmp_path)


def _cli(fake: HubFixture, *args: str, input: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localrun.cli import main; main()", *args],
                          cwd=ROOT, env={**fake.env(), "COLUMNS": "200"}, capture_output=True,
                          text=True, timeout=120, input=input)


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links followed) -> the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _repo_dir(fake: HubFixture, repo: str) -> Path:
    return fake.home / "hub" / ("models--" + repo.replace("/", "--"))


def _names(fake: HubFixture) -> set[str]:
    return {r.display for r in pulls.load(fake.home / "hub")}


def _pull(name: str) -> Path:
    return hub.fetch(hub.plan_fetch(name, backend="llama.cpp"))


# --- the repro: an alias pulled, its base repo downloaded as transformers would ------

def test_rm_alias_removes_only_the_pulled_files(fake: HubFixture) -> None:
    profile = next(p for p in (ROOT / "localrun" / "hardware" / "profiles" / "epyc-cpu.json",
                               ROOT / "tests" / "profiles" / "epyc-cpu.json") if p.is_file())
    pulled = _cli(fake, "pull", ALIAS, "--memory-gb", "8", "--hardware", str(profile))
    assert pulled.returncode == 0, pulled.stderr
    gguf = Path(pulled.stdout.strip().splitlines()[-1])
    assert gguf.name == Q4 and gguf.is_file()
    # transformers: the whole base repo; llama-cpp-python's from_pretrained: another quant.
    base = Path(huggingface_hub.snapshot_download(BASE))
    q8 = Path(huggingface_hub.hf_hub_download(GGUF_REPO, Q8))
    base_before = _tree(_repo_dir(fake, BASE))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in base.iterdir()}

    done = _cli(fake, "rm", ALIAS, "--yes")
    assert done.returncode == 0, done.stderr
    assert not gguf.exists()
    assert _tree(_repo_dir(fake, BASE)) == base_before  # every file, every byte
    assert q8.is_file()
    # The output says what it kept, why, and how to remove it.
    assert BASE in done.stderr and f"localrun rm {BASE}" in done.stderr
    assert "Kept" in done.stderr and "not pulled as" in done.stderr
    (gone,) = [line for line in done.stderr.splitlines() if line.startswith("Removed")]
    assert gone.startswith("Removed 1 file from") and GGUF_REPO in gone and BASE + "," not in gone
    assert ALIAS not in _names(fake)


def test_rm_without_yes_shows_what_goes_and_what_stays_then_asks(fake: HubFixture) -> None:
    gguf = _pull(ALIAS)
    huggingface_hub.snapshot_download(BASE)
    before = _tree(fake.home / "hub")
    no = _cli(fake, "rm", ALIAS, input="n\n")
    assert no.returncode == 1
    assert _tree(fake.home / "hub") == before and ALIAS in _names(fake)
    out = no.stderr
    assert "Will remove" in out and str(gguf) in out, out
    assert out.index(str(gguf)) < out.index("Kept:") < out.index(f"  {BASE}@main (")
    assert out.index(f"  {BASE}@main (") < out.index("Proceed?")
    assert f"localrun rm {BASE}" in out


def test_rm_at_end_of_input_removes_nothing_and_says_how_to_answer(fake: HubFixture) -> None:
    """A script that pipes nothing into `localrun rm` gets one line and exit 1, not
    "interrupted" (click reads end of input as an abort)."""
    _pull(ALIAS)
    before = _tree(fake.home / "hub")
    eof = _cli(fake, "rm", ALIAS, input="")
    assert eof.returncode == 1
    assert _tree(fake.home / "hub") == before and ALIAS in _names(fake)
    assert "interrupted" not in eof.stderr and "Traceback" not in eof.stderr
    assert "no answer (end of input): nothing removed" in eof.stderr
    assert "--yes" in eof.stderr.splitlines()[-1]


# --- in process: the pull record decides -----------------------------------------------------

def test_alias_with_no_pull_record_removes_nothing_and_names_the_commands(
        fake: HubFixture) -> None:
    huggingface_hub.snapshot_download(BASE)
    huggingface_hub.hf_hub_download(GGUF_REPO, Q4)
    before = _tree(fake.home / "hub")
    with pytest.raises(LocalrunError) as err:
        hub.plan_removal(ALIAS)
    assert f"nothing pulled as {ALIAS}" in str(err.value).lower()
    hint = err.value.hint or ""
    assert f"localrun rm {BASE}" in hint and f"localrun rm {GGUF_REPO}" in hint
    assert _tree(fake.home / "hub") == before


def test_a_file_another_name_needs_is_kept(fake: HubFixture) -> None:
    gguf = _pull(BASE)  # the base repo id resolves to the GGUF repo's Q4_K_M file
    assert _pull(ALIAS) == gguf  # the alias to the same file
    removal = hub.plan_removal(ALIAS)
    assert removal.files == () and removal.freed_bytes == 0
    assert any(BASE in k.reason and str(gguf) == k.what for k in removal.kept), removal.kept
    hub.remove(removal)
    assert gguf.is_file()
    assert _names(fake) == {BASE}  # the alias is forgotten, the base still runs offline
    hub.remove(hub.plan_removal(BASE))
    assert not gguf.exists() and _names(fake) == set()


def test_a_file_cached_before_the_pull_is_kept(fake: HubFixture) -> None:
    # llama-cpp-python's Llama.from_pretrained put the file there; localrun found it.
    direct = Path(huggingface_hub.hf_hub_download(GGUF_REPO, Q4))
    assert _pull(ALIAS) == direct
    removal = hub.plan_removal(ALIAS)
    assert removal.files == ()
    (kept,) = [k for k in removal.kept if "already in the cache" in k.reason]
    assert kept.what == str(direct) and kept.command == f"localrun rm {GGUF_REPO}:Q4_K_M"
    hub.remove(removal)
    assert direct.is_file() and _names(fake) == set()


def test_a_gguf_pull_removes_its_quant_not_the_revision(fake: HubFixture) -> None:
    gguf = _pull(ALIAS)
    q8 = Path(huggingface_hub.hf_hub_download(GGUF_REPO, Q8))
    readme = Path(huggingface_hub.hf_hub_download(GGUF_REPO, "README.md"))
    removal = hub.plan_removal(ALIAS)
    assert removal.files == (str(gguf),)
    assert any(k.what.startswith(f"{GGUF_REPO}@main") and "2 other files" in k.reason
               for k in removal.kept), removal.kept
    hub.remove(removal)
    assert not gguf.exists() and not Path(gguf).resolve().exists()
    assert q8.is_file() and readme.is_file()


def test_an_explicit_repo_id_is_removed_as_asked(fake: HubFixture) -> None:
    """Downloaded by huggingface_hub, no pull record: the user named it, so it goes."""
    huggingface_hub.snapshot_download(BASE)
    removal = hub.plan_removal(BASE)
    assert removal.repos == (BASE,)
    hub.remove(removal)
    assert not _repo_dir(fake, BASE).exists()


# --- @revision ----------------------------------------------------------------------------------

def _two_revisions(fake: HubFixture) -> tuple[str, str]:
    """TINY with tag v1 on an old commit and main on a new one; returns (old, new) sha."""
    def files(q: str, pad: int) -> dict[str, FakeFile]:
        return {f"tiny-{q.lower()}.gguf": FakeFile(gguf_bytes(quant=q, pad=pad), lfs=True),
                "README.md": FakeFile(f"# tiny {q}".encode(), lfs=False)}
    repo = fake.hub.add(FakeRepo(TINY, {"main": files("Q4_K_M", 1000)},
                                 tags=["gguf", f"base_model:quantized:{BASE}"]))
    old = repo.tag("v1")
    repo.move("main", files("Q4_K_M", 1100))
    return old, repo.sha("main")


def test_rm_repo_at_revision_keeps_the_other_revision(fake: HubFixture) -> None:
    old, new = _two_revisions(fake)
    v1 = _pull(f"{TINY}@v1")
    main = _pull(TINY)
    assert old in str(v1) and new in str(main)
    removal = hub.plan_removal(f"{TINY}@v1")
    hub.remove(removal)
    assert not v1.exists() and main.is_file()
    assert any(k.what == f"{TINY}@main" for k in removal.kept), removal.kept
    assert _names(fake) == {TINY}


def test_rm_repo_at_revision_downloaded_directly(fake: HubFixture) -> None:
    old, _ = _two_revisions(fake)
    v1 = Path(huggingface_hub.snapshot_download(TINY, revision="v1"))
    main = Path(huggingface_hub.snapshot_download(TINY))
    main_before = _tree(main)
    hub.remove(hub.plan_removal(f"{TINY}@{old[:10]}"))
    assert not v1.exists() and _tree(main) == main_before


def test_rm_alias_at_revision_only_that_revision(fake: HubFixture) -> None:
    gguf = _pull(ALIAS)
    sha = fake.hub.repos[GGUF_REPO].sha("main")
    with pytest.raises(LocalrunError, match=r"(?i)nothing pulled as"):
        hub.plan_removal(f"{ALIAS}@0123456789abcdef")
    assert gguf.is_file()
    hub.remove(hub.plan_removal(f"{ALIAS}@{sha[:12]}"))
    assert not gguf.exists()


# --- messages (issue 25, item 4) ----------------------------------------------------------------

def test_rm_messages_say_not_in_the_cache(fake: HubFixture) -> None:
    _pull(f"{GGUF_REPO}:Q8_0")
    fake.hub.requests.clear()
    cases = {
        "nobody/Nothing": ("nobody/Nothing is not in the Hugging Face cache", "localrun list"),
        ALIAS: (f"Nothing pulled as {ALIAS}", f"localrun rm {GGUF_REPO}"),
        f"{GGUF_REPO}:Q2_K": ("no Q2_K file", "Q8_0"),
        f"{GGUF_REPO}@v9": (f"{GGUF_REPO}@v9 is not in the Hugging Face cache", "main"),
        "smollm2:135m": ("packaged with localrun", "localrun list"),
    }
    for name, (msg, hint) in cases.items():
        r = _cli(fake, "rm", name, "--yes")
        assert r.returncode == 1, (name, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("error:"), (name, r.stderr)
        assert msg in lines[0] and hint in lines[1], (name, r.stderr)
        for wrong in ("No Hub repo", "private", "takes a Hub repo id or an alias",
                      "Traceback"):
            assert wrong not in r.stderr, (name, r.stderr)
    assert fake.hub.requests == []  # the Hub was never asked


def test_rm_of_a_model_outside_the_hf_cache_says_where_it_is(fake: HubFixture,
                                                             tmp_path: Path) -> None:
    local = tmp_path / "m.gguf"
    local.write_bytes(gguf_bytes())
    for name, msg, hint in ((str(local), "a file or folder on disk", "delete your own files"),
                            ("ollama:qwen2.5:0.5b", "Ollama", "ollama rm qwen2.5:0.5b")):
        with pytest.raises(LocalrunError) as err:
            hub.plan_removal(name)
        assert msg.lower() in str(err.value).lower() and hint in (err.value.hint or "")
    assert local.is_file()


# --- _note_ref: a revision is a ref name, never a path ----------------------------------------

@pytest.mark.parametrize("rev", ["../../x", "../../../escaped", "<abs>", "a\x00b", "a\nb",
                                 "refs/../../x", "..", "v1/", "a//b", ".hidden", "x.lock",
                                 "a b", "a\\b"])
def test_note_ref_refuses_a_revision_that_is_not_a_ref_name(fake: HubFixture, tmp_path: Path,
                                                           rev: str) -> None:
    from localrun.hub import download

    plan = hub.plan_fetch(f"{GGUF_REPO}:Q8_0", backend="llama.cpp")
    hub.fetch(plan)
    absolute = tmp_path / "abs" / "x"
    rev = str(absolute) if rev == "<abs>" else rev
    before = _tree(tmp_path)
    bad = dataclasses.replace(plan, revision=rev, commit="a" * 40)
    with pytest.raises(LocalrunError, match="not a valid revision name"):
        download._note_ref(bad)
    assert _tree(tmp_path) == before
    assert not (tmp_path / "hf" / "escaped").exists() and not absolute.exists()


def test_note_ref_writes_a_valid_ref_inside_refs(fake: HubFixture) -> None:
    from localrun.hub import download

    plan = hub.plan_fetch(f"{GGUF_REPO}:Q8_0", backend="llama.cpp")
    hub.fetch(plan)
    assert plan.commit
    for rev in ("v1.0", "refs/pr/1", "release-2024_01"):
        download._note_ref(dataclasses.replace(plan, revision=rev))
        ref = _repo_dir(fake, GGUF_REPO) / "refs" / rev
        assert ref.read_text() == plan.commit
    with pytest.raises(LocalrunError, match="not a commit"):
        download._note_ref(dataclasses.replace(plan, revision="v2", commit="../x\n"))
