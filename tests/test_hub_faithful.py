"""The stand-in Hub behaves as the real one where localrun could get it wrong, and
localrun copes: each test names the Hub behaviour, and fails on a localrun that mishandles
it. (What tests/hubserver.py answers, and why, is in its docstring; what is not tested
against the real Hub is listed in tests/README.md.)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from localrun import hub
from localrun.errors import (
    ChecksumError,
    HubAuthError,
    HubNotFoundError,
    HubUnavailableError,
    ModelGatedError,
)
from tests.hubserver import (
    BASE,
    GATED_TOKEN,
    NO_ACCESS_TOKEN,
    FakeFile,
    FakeRepo,
    HubFixture,
    gguf_bytes,
    start,
)

GGUF_REPO = f"{BASE}-GGUF"
Q4 = "qwen2.5-0.5b-instruct-q4_k_m.gguf"
GATED = "gatedorg/Gated-1B-GGUF"
GATED_FILE = "gated-1b-q4_k_m.gguf"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    # Retries wait RETRY_BACKOFF, 2x, 4x...: short here (Retry-After is still honoured).
    monkeypatch.setattr(hub.client, "RETRY_BACKOFF", 0.05)
    yield from start(monkeypatch, tmp_path)


def _data(fake: HubFixture, repo: str, path: str) -> bytes:
    data = fake.hub.repos[repo].branches["main"][path].data
    assert data is not None
    return data


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _get(fake: HubFixture, path: str, token: str | None = None, **headers: str
         ) -> httpx2.Response:
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx2.get(fake.url + path, headers=headers, follow_redirects=False)


def _header(request: dict[str, Any], name: str) -> str | None:
    """A header of a recorded request, whatever the case the client sent it in."""
    return next((v for k, v in request["headers"].items() if k.lower() == name.lower()), None)


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _monotonic(seen: list[hub.DownloadProgress]) -> None:
    assert seen, "no progress reported"
    assert all(p.delta > 0 for p in seen), [p.delta for p in seen]
    assert seen[-1].done == seen[-1].total


# --- the stand-in answers as the Hub does --------------------------------------------------------

def test_the_stand_in_answers_like_the_hub(fake: HubFixture) -> None:
    """The statuses and headers huggingface_hub and localrun rely on (a change here
    would make the other tests prove less)."""
    # Missing and private repos: 401 to anonymous callers, 404 to a token without access.
    fake.hub.add(FakeRepo("secret/Private-GGUF", {"main": {"a.gguf": FakeFile(
        gguf_bytes(pad=2000), lfs=True)}}, private=True))
    for rid in ("nobody/NoSuchModel", "secret/Private-GGUF"):
        r = _get(fake, f"/api/models/{rid}")
        assert (r.status_code, r.headers["X-Error-Code"]) == (401, "RepoNotFound")
        r = _get(fake, f"/api/models/{rid}", NO_ACCESS_TOKEN)
        assert (r.status_code, r.headers["X-Error-Code"]) == (404, "RepoNotFound")
    assert _get(fake, "/api/models/secret/Private-GGUF", GATED_TOKEN).status_code == 200
    # An unknown token is refused everywhere, with the message huggingface_hub matches.
    r = _get(fake, f"/api/models/{BASE}", "hf_not_a_token")
    assert r.status_code == 401 and "X-Error-Code" not in r.headers
    assert r.headers["X-Error-Message"] == "Invalid credentials in Authorization header"
    # Gated files: 401 without a token, 403 with one that was not granted.
    path = f"/{GATED}/resolve/main/{GATED_FILE}"
    assert (_get(fake, path).status_code, _get(fake, path, NO_ACCESS_TOKEN).status_code) == (
        401, 403)
    assert _get(fake, path, NO_ACCESS_TOKEN).headers["X-Error-Code"] == "GatedRepo"
    assert _get(fake, f"/api/models/{GATED}").status_code == 200  # its listing is public
    # LFS files: a 302 to a signed URL on another host, which refuses the Hub's token,
    # serves ranges, answers 416 beyond the end, and expires.
    r = _get(fake, f"/{GGUF_REPO}/resolve/main/{Q4}")
    assert r.status_code == 302 and r.headers["X-Linked-Etag"].strip('"') == _sha(
        _data(fake, GGUF_REPO, Q4))
    cdn = r.headers["Location"]
    assert not cdn.startswith(fake.url) and cdn.startswith("http://127.0.0.1:")
    assert httpx2.get(cdn, headers={"Authorization": f"Bearer {GATED_TOKEN}"}).status_code == 400
    size = len(_data(fake, GGUF_REPO, Q4))
    part = httpx2.get(cdn, headers={"Range": "bytes=10-19"})
    assert (part.status_code, part.headers["Content-Range"]) == (206, f"bytes 10-19/{size}")
    assert httpx2.get(cdn, headers={"Range": f"bytes={size}-"}).status_code == 416
    fake.hub.expire_urls()
    assert httpx2.get(cdn).status_code == 403
    # Small files come from the Hub itself.
    assert _get(fake, f"/{BASE}/resolve/main/config.json").status_code == 200
    # Listings: names only unless blobs=true; expand= keeps only what it names; pages.
    info = _get(fake, f"/api/models/{GGUF_REPO}").json()
    assert "size" not in info["siblings"][0]
    blobs = _get(fake, f"/api/models/{GGUF_REPO}?blobs=true").json()["siblings"]
    assert all("size" in s for s in blobs) and any("lfs" in s for s in blobs)
    assert set(_get(fake, f"/api/models/{GGUF_REPO}?expand=sha").json()) == {"_id", "id", "sha"}
    assert _get(fake, f"/api/models/{GGUF_REPO}?expand=nonsense").status_code == 400
    search = _get(fake, "/api/models?filter=gguf").json()
    assert search and "gated" not in search[0] and "siblings" not in search[0]
    fake.hub.page_size = 2
    page = _get(fake, f"/api/models/{GGUF_REPO}/tree/main?recursive=true")
    assert len(page.json()) == 2 and 'rel="next"' in page.headers["Link"]


# --- redirects to the CDN -----------------------------------------------------------------------

def test_the_token_never_reaches_the_cdn(fake: HubFixture) -> None:
    """A gated repo with a token: the header read (plan) and the download both go through
    the 302 to the CDN, which answers 400 to a request that carries the Hub's token."""
    fake.monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    plan = hub.plan_fetch(GATED, backend="llama.cpp")
    assert plan.memory.kv_known  # the Range read followed the redirect
    path = hub.fetch(plan)
    assert path.read_bytes() == _data(fake, GATED, GATED_FILE)
    cdn = fake.hub.cdn_requests("GET")
    assert len(cdn) >= 2 and not any(_header(r, "Authorization") for r in cdn)
    at_hub = [r for r in fake.hub.resolve_requests() if r.get("host") != "cdn"]
    assert at_hub and all(_header(r, "Authorization") == f"Bearer {GATED_TOKEN}"
                          for r in at_hub)


def _big_header_gguf() -> bytes:
    """A GGUF whose metadata (a long chat template) does not fit the first header read."""
    return gguf_bytes(quant="Q8_0", layers=7, heads=6, kv_heads=3, embedding=384, context=4096,
                      extra={"tokenizer.chat_template": "{# pad #}" * 900}, pad=3000)


@pytest.mark.parametrize("ignores_range", [False, True], ids=["206", "200-to-range"])
def test_the_header_read_continues_where_the_first_read_stopped(
        fake: HubFixture, ignores_range: bool) -> None:
    """The second header read asks for the bytes after the first; a server that answers
    a Range with 200 sends the whole file, from which those bytes must be cut."""
    fake.hub.add(FakeRepo("big/Header-GGUF", {"main": {
        "header-q8_0.gguf": FakeFile(_big_header_gguf(), lfs=True)}}, tags=["gguf"]))
    if ignores_range:
        fake.hub.ignore_range.add(("big/Header-GGUF", "header-q8_0.gguf"))
    fake.monkeypatch.setattr(hub.fit, "GGUF_HEADER_READS", (4096, 16384))
    plan = hub.plan_fetch("big/Header-GGUF", backend="llama.cpp", context=1024)
    assert plan.memory.kv_known, plan.reasons
    # 7 layers x 3 KV heads x 64 dims (384 / 6) x 2 (K, V) x 2 bytes, from the header
    assert plan.memory.kv_cache_bytes == 7 * 3 * 64 * 2 * 2 * 1024
    ranges = [_header(r, "Range") for r in fake.hub.cdn_requests("GET")]
    assert ranges == ["bytes=0-4095", "bytes=4096-16383"], ranges


def test_a_download_continues_after_its_signed_url_expired(fake: HubFixture) -> None:
    """The connection drops half way and the URL expires with it (a slow line, an hour-old
    link): the next try asks the Hub for a fresh URL and continues from the bytes it has."""
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    fake.hub.drop_once.add((GGUF_REPO, Q4))
    fake.hub.expire_on_drop = True
    fake.hub.requests.clear()
    seen: list[hub.DownloadProgress] = []
    path = hub.fetch(plan, progress=seen.append)
    data = _data(fake, GGUF_REPO, Q4)
    assert path.read_bytes() == data
    gets = fake.hub.cdn_requests("GET")
    assert len(gets) == 2 and gets[0]["query"] != gets[1]["query"]  # a fresh signed URL
    assert _header(gets[1], "Range") == f"bytes={len(data) // 2}-"
    heads = [r for r in fake.hub.resolve_requests("HEAD")]
    assert len(heads) >= 2  # asked the Hub again
    _monotonic(seen)


def _partial(fake: HubFixture, repo: str, path: str, content: bytes) -> Path:
    data = _data(fake, repo, path)
    blobs = Path(fake.home) / "hub" / ("models--" + repo.replace("/", "--")) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    partial = blobs / (_sha(data) + hub.PARTIAL_SUFFIX)
    partial.write_bytes(content)
    return partial


def test_a_later_process_continues_a_cut_download(fake: HubFixture) -> None:
    """What an earlier, killed download left is continued, not fetched again."""
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    data = _data(fake, GGUF_REPO, Q4)
    partial = _partial(fake, GGUF_REPO, Q4, data[:3000])
    fake.hub.requests.clear()
    seen: list[hub.DownloadProgress] = []
    assert hub.fetch(plan, progress=seen.append).read_bytes() == data
    (get,) = fake.hub.cdn_requests("GET")
    assert _header(get, "Range") == "bytes=3000-"
    assert seen[0].file_done == 3000 and not partial.exists()
    _monotonic(seen)


def test_a_200_in_reply_to_a_range_restarts_the_file(fake: HubFixture) -> None:
    """A server that ignores Range sends the whole file: written from the start, and the
    progress taken back by what had been counted."""
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    data = _data(fake, GGUF_REPO, Q4)
    _partial(fake, GGUF_REPO, Q4, data[:3000])
    fake.hub.ignore_range.add((GGUF_REPO, Q4))
    seen: list[hub.DownloadProgress] = []
    assert hub.fetch(plan, progress=seen.append).read_bytes() == data
    assert [p.delta for p in seen if p.delta < 0] == [-3000]
    assert seen[-1].done == seen[-1].total == len(data)


def test_a_partial_with_wrong_bytes_is_not_trusted(fake: HubFixture) -> None:
    """A leftover of full length whose bytes are wrong fails the checksum before it
    enters the cache, and the file is fetched again."""
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    data = _data(fake, GGUF_REPO, Q4)
    _partial(fake, GGUF_REPO, Q4, bytes(len(data)))
    assert hub.fetch(plan).read_bytes() == data


def test_storage_that_serves_less_than_listed_is_a_typed_error(fake: HubFixture) -> None:
    """The CDN object is shorter than X-Linked-Size: tries, a 416 when continuing past its
    end, a fresh start, then one line that says what failed, never a hang."""
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    size = len(_data(fake, GGUF_REPO, Q4))
    fake.hub.truncated[(GGUF_REPO, Q4)] = size - 100
    with pytest.raises(HubUnavailableError) as err:
        hub.fetch(plan)
    assert f"byte {size - 100} of {size}" in _one_line(err.value)
    assert f"after {hub.HUB_ATTEMPTS} tries" in str(err.value)
    statuses = [_header(r, "Range") for r in fake.hub.cdn_requests("GET")]
    assert any(s is not None for s in statuses) and statuses.count(None) >= 2


def test_a_checksum_mismatch_is_fetched_again_then_typed(fake: HubFixture) -> None:
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    fake.hub.corrupt_always.add((GGUF_REPO, Q4))
    fake.hub.requests.clear()
    with pytest.raises(ChecksumError) as err:
        hub.fetch(plan)
    assert plan.files[0].sha256 and plan.files[0].sha256[:16] in _one_line(err.value)
    assert len(fake.hub.cdn_requests("GET")) == 2
    repo_dir = Path(fake.home) / "hub" / ("models--" + GGUF_REPO.replace("/", "--"))
    assert not [p for p in repo_dir.rglob("*") if p.is_file() and p.suffix != ".lock"
                and p.parent.name == "blobs"]  # nothing corrupt entered the cache


# --- access: missing, private, gated, bad tokens ---------------------------------------------

def test_missing_and_private_repos(fake: HubFixture) -> None:
    fake.hub.add(FakeRepo("secret/Private-1B-GGUF", {"main": {
        "private-1b-q4_k_m.gguf": FakeFile(gguf_bytes(pad=2000), lfs=True)}},
        tags=["gguf"], private=True))
    for name in ("nobody/NoSuchModel-GGUF", "secret/Private-1B-GGUF"):
        with pytest.raises(HubNotFoundError) as err:
            hub.plan_fetch(name, backend="llama.cpp")
        assert "set HF_TOKEN" in (err.value.hint or "") and name in _one_line(err.value)
    fake.monkeypatch.setenv("HF_TOKEN", NO_ACCESS_TOKEN)
    with pytest.raises(HubNotFoundError) as err:
        hub.plan_fetch("secret/Private-1B-GGUF", backend="llama.cpp")
    assert "has no access" in (err.value.hint or "")
    fake.monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    assert hub.fetch(hub.plan_fetch("secret/Private-1B-GGUF", backend="llama.cpp")).is_file()


def test_gated_without_token_and_with_a_token_not_granted(fake: HubFixture) -> None:
    plan = hub.plan_fetch(GATED, backend="llama.cpp")
    with pytest.raises(ModelGatedError) as err:
        hub.fetch(plan)
    assert not err.value.token_sent and "HF_TOKEN" in (err.value.hint or "")
    fake.monkeypatch.setenv("HF_TOKEN", NO_ACCESS_TOKEN)
    with pytest.raises(ModelGatedError) as err:
        hub.fetch(plan)
    assert err.value.token_sent and "403" in _one_line(err.value)
    assert "request access" in (err.value.hint or "")


def test_an_invalid_token_is_a_typed_error(fake: HubFixture) -> None:
    fake.monkeypatch.setenv("HF_TOKEN", "hf_revoked_long_ago")
    with pytest.raises(HubAuthError) as err:
        hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    assert "401" in _one_line(err.value) and "Invalid credentials" in str(err.value)
    assert "HF_TOKEN" in (err.value.hint or "")


# --- listings: expand, blobs, pages ----------------------------------------------------------

def test_plans_read_every_page(fake: HubFixture) -> None:
    """One entry a page: the repo's files (13 quants) span pages, and so does the search
    for variants (by downloads bartowski's repo comes first, the model's own org's second,
    and the own org wins)."""
    fake.hub.page_size = 1
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q8_0", backend="llama.cpp")
    assert plan.files[0].path == "qwen2.5-0.5b-instruct-q8_0.gguf" and plan.files[0].sha256
    assert plan.files[0].size == len(_data(fake, GGUF_REPO, plan.files[0].path))
    base = hub.plan_fetch(BASE, backend="llama.cpp")
    assert base.repo == GGUF_REPO
    cursors = [r["path"] for r in fake.hub.requests if "cursor=" in r["path"]]
    assert any("/tree/" in p for p in cursors) and any(p.startswith("/api/models?")
                                                       for p in cursors)


# --- 5xx and 429 ---------------------------------------------------------------------------------

def test_a_5xx_on_the_model_listing_is_tried_again(fake: HubFixture) -> None:
    fault = fake.hub.fail(f"^/api/models/{GGUF_REPO}$", 503, times=2)
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    assert plan.quant == "Q4_K_M" and fault.hits == 2


def test_a_429_waits_as_long_as_retry_after_says(fake: HubFixture) -> None:
    fake.hub.fail(f"^/api/models/{GGUF_REPO}$", 429, times=1, retry_after="1")
    t0 = time.monotonic()
    hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    assert time.monotonic() - t0 >= 1.0


def test_a_hub_that_stays_down_is_one_line(fake: HubFixture) -> None:
    fake.hub.fail(f"^/api/models/{GGUF_REPO}$", 503, times=None)
    with pytest.raises(HubUnavailableError) as err:
        hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    assert "503" in _one_line(err.value) and f"{hub.HUB_ATTEMPTS} tries" in str(err.value)
    assert err.value.status == 503 and "run the same command again" in (err.value.hint or "")
    fake.hub.faults.clear()
    fake.hub.fail(f"^/api/models/{GGUF_REPO}$", 429, times=None, retry_after="3600")
    with pytest.raises(HubUnavailableError) as err:  # not an hour's wait: said at once
        hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    assert "429" in str(err.value) and "wait 3600 s" in (err.value.hint or "")


@pytest.mark.parametrize("where", ["hub-head", "cdn-get"])
def test_a_5xx_or_429_during_a_download_is_tried_again(fake: HubFixture, where: str) -> None:
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    if where == "hub-head":
        fault = fake.hub.fail(f"/resolve/.*/{Q4}$", 502, times=2, method="HEAD")
    else:
        fault = fake.hub.fail(f"^/lfs/.*/{Q4}$", 429, times=1, retry_after="0")
    seen: list[hub.DownloadProgress] = []
    assert hub.fetch(plan, progress=seen.append).read_bytes() == _data(fake, GGUF_REPO, Q4)
    assert fault.hits == fault.times
    _monotonic(seen)


# --- Xet-backed files: the same progress and retries through hf_xet ------------------------------

class _Report:
    """What hf_xet hands the progress callback (the attributes huggingface_hub's
    XetDownloadProgressReporter reads)."""

    def __init__(self, done: int, total: int) -> None:
        self.total_bytes = total
        self.total_bytes_completed = done
        self.total_bytes_completion_rate = None
        self.total_transfer_bytes_completed = done // 2  # compressed, deduplicated
        self.total_transfer_bytes_completion_rate = None


class _FakeXetSession:
    """Stands in for hf_xet's session (there is no CAS server here): writes the file the
    Xet hash names, reporting progress as hf_xet does; ``fail_once`` breaks off the first
    download half way, as a dropped CAS connection does."""

    def __init__(self, fake: HubFixture, fail_once: bool) -> None:
        self.by_hash = {f.sha256: f.data for r in fake.hub.repos.values()
                        for files in r.branches.values() for f in files.values()}
        self.fail_once = fail_once
        self.groups: list[dict[str, Any]] = []

    def new_file_download_group(self, **kwargs: Any) -> _FakeXetSession:
        self.groups.append(kwargs)
        return self

    def __enter__(self) -> _FakeXetSession:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start_download_file(self, info: Any, dest: str) -> None:
        data = self.by_hash[info.hash]
        assert data is not None
        report = self.groups[-1]["progress_callback"]
        half = len(data) // 2
        report(_Report(half, len(data)), {})
        if self.fail_once:
            self.fail_once = False
            raise httpx2.RemoteProtocolError("CAS connection dropped")
        Path(dest).write_bytes(data)
        report(_Report(len(data), len(data)), {})


@pytest.mark.parametrize("fail_once", [False, True], ids=["ok", "dropped-once"])
def test_xet_downloads_report_progress_and_retry_like_http(fake: HubFixture,
                                                           fail_once: bool) -> None:
    """Tests otherwise force Xet off: here the repo is Xet-backed and hf_xet is on, so
    huggingface_hub takes its Xet path (xet_get) with localrun's progress bar class."""
    pytest.importorskip("hf_xet", reason="hf_xet is not installed")
    from huggingface_hub import constants
    from huggingface_hub.utils import _xet

    fake.hub.repos[GGUF_REPO].xet = True
    fake.monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    session = _FakeXetSession(fake, fail_once)
    fake.monkeypatch.setattr(_xet, "get_xet_session", lambda: session)
    plan = hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp")
    fake.hub.requests.clear()
    seen: list[hub.DownloadProgress] = []
    path = hub.fetch(plan, progress=seen.append)
    data = _data(fake, GGUF_REPO, Q4)
    assert path.read_bytes() == data
    assert fake.hub.cdn_requests("GET") == []  # no byte came over plain HTTP
    assert len(session.groups) == (2 if fail_once else 1)
    assert seen[-1].done == seen[-1].total == len(data)
    # Reconstructed file bytes are counted (not the compressed transfer); a failed try
    # takes back what it had counted.
    assert [p.file_done for p in seen] == (
        [len(data) // 2, 0, len(data) // 2, len(data)] if fail_once
        else [len(data) // 2, len(data)])
