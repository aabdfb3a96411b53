"""Which loaded model serves a request (issue 24, items 4-6): names are looked up on disk
boundedly and without the load lock, loaded models are keyed by file and effective
context (at most ``MAX_COPIES`` contexts of one file), and a model named on the command
line stays loaded whatever a request's keep_alive says."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from localrun.errors import ModelFileError
from localrun.formats.detect import WALK_DEPTH, WALK_ENTRIES, detect
from tests.conftest import requires_llama

#: What a refusal that reads nothing may take, on a loaded 2-core machine.
QUICK = 2.0


def _config(**kw: Any) -> Any:
    """A ServerConfig that lets API requests name local paths (the flag that allows
    them, where this version has one)."""
    from localrun.server.config import ServerConfig

    names = {f.name for f in fields(ServerConfig)}
    extra = {"allow_local_paths": True} if "allow_local_paths" in names else {}
    return ServerConfig(**extra, **kw)


class _Scans:
    """Counts what detection reads: folders opened and entries seen."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folders: list[str] = []
        self.entries = 0
        real = os.scandir
        scans = self

        class Counted:
            def __init__(self, path: Any) -> None:
                scans.folders.append(str(path))
                self._it = real(path)

            def __enter__(self) -> Counted:
                return self

            def __exit__(self, *exc: object) -> None:
                self._it.close()

            def __iter__(self) -> Iterator[os.DirEntry[str]]:
                for e in self._it:
                    scans.entries += 1
                    yield e

            def close(self) -> None:
                self._it.close()

        monkeypatch.setattr(os, "scandir", Counted)


# -- item 4: detection looks only where a model's files can be ---------------------------

def test_detection_of_a_huge_folder_stops_at_its_bound(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder with more files than a model folder has (within the levels detection
    looks at) is refused as not a model folder after reading at most WALK_ENTRIES
    entries, never the rest of the tree."""
    big = tmp_path / "big"
    per = WALK_ENTRIES // 3 + 200
    for sub in ("a", "b", "c"):
        (big / sub).mkdir(parents=True)
        for i in range(per):
            (big / sub / f"f{i}").touch()
    scans = _Scans(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(ModelFileError, match="does not look like a model folder") as e:
        detect(big)
    assert time.monotonic() - t0 < QUICK
    assert f"more than {WALK_ENTRIES:,} files and folders" in str(e.value)
    # the folder's own listing (3 entries), then the walk up to its bound: 4,698 there
    assert scans.entries <= 3 + WALK_ENTRIES + 1, scans.entries


def test_detection_of_a_deep_folder_looks_only_a_few_levels_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX files 30 levels down are not a model here: detection opens the folder and
    WALK_DEPTH levels below it, no more. Real layouts still get their way out: ONNX
    GenAI variants one or two levels down are named (pass one), a transformers.js
    export in onnx/ is told apart."""
    deep = tmp_path / "deep"
    bottom = deep.joinpath(*[f"d{i}" for i in range(30)])
    bottom.mkdir(parents=True)
    (bottom / "model.onnx").write_bytes(b"\x08")
    scans = _Scans(monkeypatch)
    with pytest.raises(ModelFileError, match="no model files found"):
        detect(deep)
    opened = [f for f in scans.folders if f.startswith(str(deep))]
    assert len(opened) <= WALK_DEPTH + 2, opened  # the listing, then each level walked
    repo = tmp_path / "phi3-onnx"
    for variant in ("cpu_and_mobile/cpu-int4-rtn-block-32", "cuda/cuda-fp16"):
        (repo / variant).mkdir(parents=True)
        (repo / variant / "genai_config.json").write_text("{}")
        (repo / variant / "model.onnx").write_bytes(b"\x08")
    with pytest.raises(ModelFileError, match="holds 2 ONNX Runtime GenAI models in "
                       "subfolders: cpu_and_mobile/cpu-int4-rtn-block-32, cuda/cuda-fp16"):
        detect(repo)


def test_the_root_folder_is_refused_quickly() -> None:
    """``/`` (the issue's name) is refused within seconds, not after walking the disk."""
    out: list[BaseException] = []

    def run() -> None:
        try:
            detect("/")
        except BaseException as e:
            out.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)  # bounded even before the fix (which walked the whole filesystem)
    took = time.monotonic() - t0
    assert not t.is_alive() and took < QUICK, f"detect('/') took {took:.1f} s"
    assert out and isinstance(out[0], ModelFileError), out


def test_folder_bytes_reads_as_far_as_detection_looks(tmp_path: Path) -> None:
    """A model folder's size (the server's memory estimate, /api/tags) counts the files
    detection would read, and refuses a tree that is no model folder."""
    from localrun.formats.detect import folder_bytes

    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"x" * 10)
    (d / "sub" / "b.bin").write_bytes(b"x" * 5)
    deep = d.joinpath("s1", "s2", "s3")
    deep.mkdir(parents=True)
    (deep / "far.bin").write_bytes(b"x" * 1000)
    assert folder_bytes(d) == 15
    assert folder_bytes(d / "a.bin") == 10
    huge = tmp_path / "huge"
    huge.mkdir()
    for i in range(WALK_ENTRIES + 1):
        (huge / f"f{i}").touch()
    with pytest.raises(ModelFileError, match="does not look like a model folder"):
        folder_bytes(huge)


def test_a_model_named_slash_is_refused_at_once_and_blocks_nothing() -> None:
    """``/api/show`` and a chat request for the model ``/`` answer 4xx within seconds,
    and 8 of them at once leave ``GET /v1/models`` answering within seconds."""
    from tests.serverutil import request, serve

    chat = {"model": "/", "messages": [{"role": "user", "content": "Hi"}]}
    with serve(_config()) as s:
        request("GET", s.v1 + "/models")  # its first listing of the disk, before timing
        for url, body in ((s.url + "/api/show", {"model": "/"}),
                          (s.v1 + "/chat/completions", chat),
                          (s.url + "/api/chat", {**chat, "stream": False})):
            t0 = time.monotonic()
            status, _, raw = request("POST", url, body, timeout=30)
            took = time.monotonic() - t0
            assert 400 <= status < 500 and took < QUICK, (url, status, took, raw[:300])
        took_each: list[float] = []
        statuses: list[int] = []

        def refused(url: str, body: dict[str, Any]) -> None:
            t0 = time.monotonic()
            status, _, _ = request("POST", url, body, timeout=30)
            took_each.append(time.monotonic() - t0)
            statuses.append(status)

        threads = [threading.Thread(target=refused, args=(
            (s.url + "/api/show", {"model": "/"}) if i % 2 else (s.v1 + "/chat/completions",
                                                                 chat))) for i in range(8)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        status, _, body = request("GET", s.v1 + "/models", timeout=30)
        listed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert status == 200 and listed < QUICK, (status, listed)
        assert len(statuses) == 8 and all(400 <= c < 500 for c in statuses), statuses
        assert max(took_each) < 3 * QUICK, took_each  # 8 at once on 2 cores
        assert not s.manager.models


# -- item 5: one copy per file and effective context, at most MAX_COPIES ----------------

class _FakeModel:
    """What the manager reads of a loaded chat model, without an engine: the context
    llama.cpp would report (padded to 256, capped at the trained context)."""

    max_concurrency = 1

    def footprint(self, slots: int | None = None) -> Any:
        """One sequence at a time, counted as its files' estimate (as an engine's)."""
        from localrun.backends.base import Footprint
        from localrun.server.sizing import estimate_loaded

        est = estimate_loaded(self.info, None)
        return Footprint(1, est.total_bytes if est is not None else 0, 0, 0)

    def __init__(self, path: str, context: int | None) -> None:
        from localrun.memory import context_window
        from localrun.types import ModelInfo

        n = -(-context_window(context, 8192) // 256) * 256
        self.info = ModelInfo(backend="llama.cpp", engine_version="test", format="gguf",
                              quantization="Q4_1", path=path, context_length=n,
                              trained_context_length=8192, device="cpu")
        self.closed = False

    def limit_concurrency(self, n: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture()
def gguf_spellings(tmp_path: Path) -> list[str]:
    """One GGUF file, five ways: its path, a folder holding a symlink to it, that
    folder with a trailing slash, the symlink, and the symlink through ``./``."""
    from tests.models import test_model

    real = test_model("gguf-q4_1")
    x = tmp_path / "x"
    x.mkdir()
    (x / "m.gguf").symlink_to(real)
    return [str(real), str(x), str(x) + "/", str(x / "m.gguf"), f"{x}/./m.gguf"]


def test_spellings_and_contexts_share_bounded_copies(gguf_spellings: list[str]) -> None:
    """Every spelling of one file is one copy; num_ctx values the engine rounds to one
    context share a copy; at most MAX_COPIES contexts of a file are loaded: past that
    a request takes the largest when it holds its context, else an idle copy makes
    way, else it is refused with the numbers and Retry-After."""
    from localrun.server.copies import MAX_COPIES
    from localrun.server.errors import APIError
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics

    loads: list[tuple[str, int | None]] = []

    def load(name: str, config: Any, context: int | None, target: Any = None) -> _FakeModel:
        loads.append((name, context))
        return _FakeModel(detect(name).path, context or config.context)

    def manager() -> ModelManager:
        # backend named: resolving the file needs no engine installed
        return ModelManager(_config(parallel=1, context=512, backend="llama.cpp"),
                            Metrics(), loader=load, available_memory=lambda: 2**40)

    async def shared() -> None:
        mgr = manager()
        await mgr.start()
        try:
            for name in gguf_spellings:
                (await mgr.acquire(name)).release()
            assert len(loads) == 1 and len(mgr.models) == 1, loads
            first = next(iter(mgr.models.values()))
            assert first.context == 512 and first.name == gguf_spellings[0]
            most = 0
            for name, ctx in zip(gguf_spellings[1:], (1024, 1025, 1026, 10**8), strict=True):
                (await mgr.acquire(name, context=ctx)).release()
                most = max(most, len(mgr.models))
            assert most == MAX_COPIES and len(loads) == 4, loads  # 1025, 1026: one copy
            assert sorted(m.context for m in mgr.models.values()) == [1280, 8192]
            # at the bound: a smaller context takes the largest copy, loading nothing
            (await mgr.acquire(gguf_spellings[2], context=700)).release()
            assert len(loads) == 4 and len(mgr.models) == MAX_COPIES
        finally:
            await mgr.stop()

    async def busy() -> None:
        loads.clear()
        mgr = manager()
        await mgr.start()
        try:
            held = [await mgr.acquire(gguf_spellings[0], context=c) for c in (1024, 2048)]
            with pytest.raises(APIError) as e:  # both copies busy: a third context waits
                await mgr.acquire(gguf_spellings[1], context=4096)
            assert e.value.status == 503 and "contexts 1024, 2048, all in use" in \
                e.value.message and f"at most {MAX_COPIES} contexts" in e.value.message
            assert e.value.headers and "Retry-After" in e.value.headers
            assert len(loads) == 2 and len(mgr.models) == MAX_COPIES
            small = held[0].loaded
            held[0].release()  # idle now: it makes way (closed) for the new context
            (await mgr.acquire(gguf_spellings[1], context=4096)).release()
            assert small.handle.closed and len(mgr.models) == MAX_COPIES
            assert sorted(m.context for m in mgr.models.values()) == [2048, 4096]
            held[1].release()
        finally:
            await mgr.stop()

    async def budget() -> None:
        """Each copy counts in the memory plan: where --max-memory holds one, a second
        context makes the idle one go, and waits (503) while that one is in use."""
        from localrun.server.sizing import estimate_bytes

        loads.clear()
        cfg = _config(parallel=1, context=512, backend="llama.cpp")
        small = estimate_bytes(gguf_spellings[0], 1024, cfg) or 0
        large = estimate_bytes(gguf_spellings[0], 2048, cfg) or 0
        assert 0 < small < large
        mgr = ModelManager(replace(cfg, max_memory=large + small // 2), Metrics(),
                           loader=load)
        await mgr.start()
        try:
            (await mgr.acquire(gguf_spellings[0], context=1024)).release()
            first = next(iter(mgr.models.values()))
            lease = await mgr.acquire(gguf_spellings[3], context=2048)
            assert first.handle.closed and list(mgr.models.values()) == [lease.loaded]
            with pytest.raises(APIError) as e:
                await mgr.acquire(gguf_spellings[1], context=1024)
            assert e.value.status == 503 and "Not enough memory" in e.value.message
            lease.release()
            assert len(loads) == 2
        finally:
            await mgr.stop()

    asyncio.run(shared())
    asyncio.run(busy())
    asyncio.run(budget())


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@requires_llama
def test_the_real_server_loads_one_copy_per_file_and_context(
        gguf_spellings: list[str]) -> None:
    """The issue's repro on the real server and engine: the same GGUF under five
    spellings, then four nearby num_ctx values. Loads: one for the spellings, one per
    context the engine rounds to, never more than MAX_COPIES loaded at once; responses
    call the model what the request called it; memory stays within the copies loaded."""
    from localrun.server.copies import MAX_COPIES
    from localrun.server.manager import ModelManager, _load_chat
    from localrun.server.metrics import Metrics
    from tests.serverutil import request, serve

    loads: list[str] = []

    def load(name: str, config: Any, context: int | None, target: Any = None) -> Any:
        loads.append(name)
        return _load_chat(name, config, context, target)

    config = _config(parallel=1, context=512)
    rss0 = _rss()
    with serve(config, manager=ModelManager(config, Metrics(), loader=load)) as s:
        most = 0

        def generate(name: str, num_ctx: int | None) -> dict[str, Any]:
            nonlocal most
            body: dict[str, Any] = {"model": name, "prompt": "Hi", "stream": False,
                                    "options": {"num_predict": 1, "temperature": 0}}
            if num_ctx is not None:
                body["options"]["num_ctx"] = num_ctx
            status, _, raw = request("POST", s.url + "/api/generate", body)
            assert status == 200, raw[:300]
            most = max(most, len(s.manager.models))
            out: dict[str, Any] = json.loads(raw)
            return out

        for name in gguf_spellings:
            assert generate(name, None)["model"] == name  # the name as sent
        assert len(loads) == 1 and len(s.manager.models) == 1, loads
        for name, ctx in zip(gguf_spellings[1:], (1024, 1025, 1026, 10**8), strict=True):
            assert generate(name, ctx)["model"] == name
        assert most <= MAX_COPIES and len(loads) <= 4, loads
        _, _, raw = request("GET", s.url + "/api/ps")
        contexts = sorted(m["context_length"] for m in json.loads(raw)["models"])
        assert contexts == [1280, 8192], contexts  # 10**8: the trained context
        held = sum(m.size for m in s.manager.models.values())
        grew = _rss() - rss0
        assert grew < held + 256 * 2**20, (grew, held)  # the copies loaded, not 8 of them


# -- item 6: the command line's models stay loaded ---------------------------------------

@requires_llama
def test_keep_alive_0_never_unloads_a_pinned_model(gguf_spellings: list[str]) -> None:
    """keep_alive 0 (Ollama's unload, with or without a prompt) leaves a model named on
    the command line loaded and pinned ("expires" forever in /api/ps), and a request
    for that file under another spelling, with no context of its own, gets that copy."""
    import localrun
    from localrun.server.manager import ModelManager, _load_chat
    from localrun.server.metrics import Metrics
    from tests.serverutil import MODEL, request, serve

    loads: list[str] = []

    def load(name: str, config: Any, context: int | None, target: Any = None) -> Any:
        loads.append(name)
        return _load_chat(name, config, context, target)

    config = _config(parallel=1)
    with localrun.load(gguf_spellings[0], backend="llama.cpp", context=1024,
                       threads=1) as model, \
            serve(config, manager=ModelManager(config, Metrics(), loader=load),
                  preload={MODEL: model}) as s:
        pinned = next(iter(s.manager.models.values()))
        for body in ({"model": MODEL, "keep_alive": 0},
                     {"model": MODEL, "prompt": "Hi", "stream": False, "keep_alive": 0,
                      "options": {"num_predict": 1}},
                     {"model": gguf_spellings[3], "keep_alive": 0},
                     {"model": gguf_spellings[4], "prompt": "Hi", "stream": False,
                      "keep_alive": 0, "options": {"num_predict": 1}}):
            status, _, raw = request("POST", s.url + "/api/generate", body)
            assert status == 200, raw[:300]
            assert json.loads(raw)["model"] == body["model"]
            time.sleep(0.6)  # past the reaper's tick and a scheduled unload
            assert list(s.manager.models.values()) == [pinned] and pinned.pinned
            _, _, ps = request("GET", s.url + "/api/ps")
            (entry,) = json.loads(ps)["models"]
            assert entry["name"] == MODEL and entry["expires_at"].startswith("2318-"), entry
        assert loads == []  # every spelling got the pinned copy


def test_the_command_line_names_a_file_once_whatever_its_spellings(
        gguf_spellings: list[str]) -> None:
    """``localrun serve FILE FOLDER`` (two spellings of one file) loads it once, pinned;
    a request under either spelling gets that copy, and keep_alive 0 leaves it."""
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics

    loads: list[str] = []

    def load(name: str) -> _FakeModel:
        loads.append(name)
        return _FakeModel(detect(name).path, None)

    config = _config(parallel=1, backend="llama.cpp")
    mgr = ModelManager(config, Metrics())
    (pinned,) = mgr.preload((gguf_spellings[1], gguf_spellings[4]), load=load)
    assert loads == [gguf_spellings[1]] and pinned.pinned

    async def requests() -> None:
        await mgr.start()
        try:
            for name in gguf_spellings:
                lease = await mgr.acquire(name, keep_alive=0)
                assert lease.loaded is pinned
                lease.release()
                assert not await mgr.unload(name)  # Ollama's unload: it stays
            await asyncio.sleep(0.6)  # past the reaper's tick
            assert list(mgr.models.values()) == [pinned] and pinned.expires_wall() is None
        finally:
            await mgr.stop()

    asyncio.run(requests())
