"""Stored responses for the Responses API (issue 27 item 2): localrun.server.responses_store.

A real SQLite file in a temporary folder for every test: round trip, restarts (a new store
on the same file, and one process writing while another reads later), owner isolation,
the bounds (count, age with an injected clock, size), OpenAI's input_items pagination,
16 threads and two processes writing at once, and the typed errors for a damaged file, a
folder that cannot be written, a newer schema and a lock held too long.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from localrun.errors import LocalrunError
from localrun.server import responses_store as rs
from localrun.server.responses_store import (
    DuplicateResponseError,
    InvalidListParamError,
    ResponseStore,
    ResponseTooLargeError,
    StoreBusyError,
    StoreDamagedError,
    StoreUnavailableError,
    new_response_id,
)
from tests.conftest import ROOT

KEY_A = "sk-alpha-secret-key"
KEY_B = "sk-bravo-secret-key"


def record(store: ResponseStore, owner: str, text: str = "hi", **kw: Any) -> str:
    """Put one response whose conversation is a user turn and the reply; its id."""
    rid = new_response_id()
    reply = {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": f"re: {text}"}]}
    store.put(rid, owner, {"id": rid, "object": "response", "output": [reply]},
              input_items=[{"role": "user", "content": text}],
              conversation=[{"role": "user", "content": text}, reply], model="m", **kw)
    return rid


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


def test_round_trip(tmp_path: Path) -> None:
    clock = Clock()
    with ResponseStore(tmp_path / "r.sqlite3", clock=clock) as store:
        owner = store.owner_for(KEY_A)
        rid = new_response_id()
        items = [{"role": "user", "content": "hello"},
                 {"type": "function_call_output", "call_id": "call_1", "output": "42",
                  "id": "fco_given"}]
        conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"}]
        stored = store.put(rid, owner, {"id": rid, "output_text": "hi ✓"}, input_items=items,
                           conversation=conv, model="smollm2:135m", created_at=clock.now - 5)
        assert re.fullmatch(r"msg_[0-9a-f]{48}", stored[0]["id"])  # an id is given
        assert stored[1]["id"] == "fco_given"  # a given id is kept
        assert "id" not in items[0]  # the caller's items are not changed

        got = store.get(rid, owner)
        assert got is not None
        assert (got.id, got.model, got.created_at) == (rid, "smollm2:135m", clock.now - 5)
        assert got.response == {"id": rid, "output_text": "hi ✓"}
        assert store.conversation(rid, owner) == conv
        page = store.input_items(rid, owner, order="asc")
        assert page is not None and page.data == stored and not page.has_more
        assert store.count() == 1

        assert store.delete(rid, owner) is True
        assert store.delete(rid, owner) is False
        assert store.get(rid, owner) is None and store.conversation(rid, owner) is None
        assert store.input_items(rid, owner) is None
        again = record(store, owner)
        with pytest.raises(DuplicateResponseError):
            store.put(again, owner, {}, input_items=[], conversation=[], model="m")
        assert store.get(again, owner).response["id"] == again  # the first one stays


def test_ids_look_like_openais() -> None:
    ids = {new_response_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"resp_[0-9a-f]{48}", i) for i in ids)
    assert rs.new_item_id("function_call").startswith("fc_")
    assert rs.new_item_id("message").startswith("msg_")


def test_survives_reopening_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    with ResponseStore(path) as first:
        owner = first.owner_for(KEY_A)
        rid = record(first, owner, "remember me")
    with ResponseStore(path) as second:
        assert second.owner_for(KEY_A) == owner  # the salt is kept in the file
        assert second.conversation(rid, owner)[0] == {"role": "user", "content": "remember me"}


WRITER = """
import sys
from localrun.server.responses_store import ResponseStore, new_response_id
store = ResponseStore(sys.argv[1])
rid = new_response_id()
store.put(rid, store.owner_for(sys.argv[2]), {"id": rid}, input_items=[],
          conversation=[{"role": "user", "content": "across processes"}], model="m")
print(rid)
"""
READER = """
import json, sys
from localrun.server.responses_store import ResponseStore
store = ResponseStore(sys.argv[1])
print(json.dumps(store.conversation(sys.argv[3], store.owner_for(sys.argv[2]))))
"""


def test_survives_a_restart_of_the_process(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite3")
    wrote = run_python(WRITER, path, KEY_A)
    assert wrote.returncode == 0, wrote.stderr
    rid = wrote.stdout.strip()
    read = run_python(READER, path, KEY_A, rid)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == [{"role": "user", "content": "across processes"}]
    other = run_python(READER, path, KEY_B, rid)
    assert json.loads(other.stdout) is None


def test_another_key_sees_nothing_and_deletes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    with ResponseStore(path) as store:
        a, b, local = store.owner_for(KEY_A), store.owner_for(KEY_B), store.owner_for(None)
        assert len({a, b, local}) == 3 and local == rs.LOCAL_OWNER == store.owner_for("")
        rid = record(store, a, "private")
        assert store.get(rid, b) is None
        assert store.conversation(rid, b) is None
        assert store.input_items(rid, b) is None
        assert store.get(rid, local) is None
        assert store.delete(rid, b) is False
        assert store.get(rid, a) is not None  # still there for its owner
        assert store.count(a) == 1 and store.count(b) == 0
    # Neither key is written anywhere in the files.
    for f in tmp_path.iterdir():
        data = f.read_bytes()
        assert KEY_A.encode() not in data and KEY_B.encode() not in data, f


def test_count_bound_keeps_the_newest(tmp_path: Path) -> None:
    with ResponseStore(tmp_path / "r.sqlite3", max_items=3) as store:
        owner = store.owner_for(None)
        ids = [record(store, owner, str(i)) for i in range(5)]
        assert [store.get(i, owner) is not None for i in ids] == [False, False, True, True, True]
        assert store.count() == 3


def test_age_bound_hides_then_deletes(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "r.sqlite3"
    with ResponseStore(path, max_age_seconds=60, clock=clock) as store:
        owner = store.owner_for(KEY_A)
        old = record(store, owner, "old")
        clock.now += 59
        assert store.get(old, owner) is not None
        clock.now += 2  # 61 s old: gone for reads at once, before any write
        assert store.get(old, owner) is None and store.count() == 0
        assert store.delete(old, owner) is False
        assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM responses").fetchone()[0] \
            == 0  # the delete's transaction removed it
        new = record(store, owner, "new")
        recent = record(store, owner, "backdated", created_at=clock.now - 120)
        assert store.get(new, owner) is not None and store.get(recent, owner) is None


def test_size_bounds(tmp_path: Path) -> None:
    with ResponseStore(tmp_path / "r.sqlite3", max_item_bytes=10_000,
                       max_bytes=25_000) as store:
        owner = store.owner_for(None)
        with pytest.raises(ResponseTooLargeError) as e:
            record(store, owner, "x" * 20_000)
        assert e.value.limit == 10_000 and e.value.size > 20_000
        assert "10,000-byte limit" in str(e.value) and "store: false" in str(e.value)
        assert store.count() == 0  # nothing half-written
        ids = [record(store, owner, "y" * 2_000) for _ in range(8)]  # ~8 KB each
        kept = [i for i in ids if store.get(i, owner) is not None]
        assert kept == ids[-len(kept):] and 2 <= len(kept) <= 3  # the newest within 25 KB


def test_input_items_pages_as_openai_documents(tmp_path: Path) -> None:
    with ResponseStore(tmp_path / "r.sqlite3") as store:
        owner = store.owner_for(None)
        rid = new_response_id()
        letters = "abcde"
        store.put(rid, owner, {"id": rid}, model="m", conversation=[],
                  input_items=[{"id": c, "role": "user", "content": c} for c in letters])

        def ids(**kw: Any) -> tuple[str, bool]:
            page = store.input_items(rid, owner, **kw)
            assert page is not None
            body = page.to_json()
            assert body["object"] == "list"
            assert (body["first_id"], body["last_id"]) == (
                (page.data[0]["id"], page.data[-1]["id"]) if page.data else (None, None))
            return "".join(i["id"] for i in page.data), page.has_more

        assert ids() == ("edcba", False)  # newest first, 20 at most
        assert ids(order="asc", limit=2) == ("ab", True)
        assert ids(order="asc", limit=2, after="b") == ("cd", True)
        assert ids(order="asc", limit=2, after="d") == ("e", False)
        assert ids(limit=2, after="c") == ("ba", False)  # desc: after c comes b
        assert ids(order="asc", limit=2, before="d") == ("bc", True)  # just before d
        assert ids(order="asc", before="b") == ("a", False)
        assert ids(order="asc", after="a", before="e") == ("bcd", False)
        assert ids(order="asc", after="e") == ("", False)
        for bad in ({"limit": 0}, {"limit": 101}, {"limit": True}, {"order": "up"},
                    {"after": "zz"}, {"before": "zz"}):
            with pytest.raises(InvalidListParamError) as e:
                store.input_items(rid, owner, **bad)
            assert e.value.param == next(iter(bad)), bad
        assert store.input_items(rid, owner, limit=100) is not None


def test_sixteen_threads_at_once(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    written: list[tuple[str, str]] = []
    lock = threading.Lock()
    with ResponseStore(tmp_path / "r.sqlite3") as store:
        start = threading.Barrier(16)

        def work(n: int) -> None:
            try:
                owner = store.owner_for(f"key-{n % 4}")
                start.wait(timeout=30)
                for i in range(20):
                    rid = record(store, owner, f"{n}-{i}")
                    assert store.conversation(rid, owner)[0]["content"] == f"{n}-{i}"
                    with lock:
                        written.append((rid, owner))
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert len(written) == 320 and store.count() == 320
        assert all(store.get(rid, owner) is not None for rid, owner in written)


CONCURRENT_WRITER = """
import os, sys, time
from pathlib import Path
from localrun.server.responses_store import ResponseStore, new_response_id
store = ResponseStore(sys.argv[1])
owner = store.owner_for(sys.argv[2])
Path(sys.argv[4]).touch()
deadline = time.monotonic() + 60
while not Path(sys.argv[3]).exists() and time.monotonic() < deadline:
    time.sleep(0.01)
for i in range(100):
    rid = new_response_id()
    store.put(rid, owner, {"id": rid}, input_items=[], conversation=[], model="m")
    print(rid, flush=True)
"""


def test_two_processes_write_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite3")
    ResponseStore(path).close()  # created once, so both children open an existing file
    go = tmp_path / "go"
    ready = [tmp_path / "ready-a", tmp_path / "ready-b"]
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_WRITER, path, key,
                               str(go), str(flag)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for key, flag in zip((KEY_A, KEY_B), ready, strict=True)]
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    with ResponseStore(path) as store:
        for key, (out, _) in zip((KEY_A, KEY_B), outs, strict=True):
            ids = out.split()
            assert len(ids) == 100
            owner = store.owner_for(key)
            assert all(store.get(rid, owner) is not None for rid in ids)
        assert store.count() == 200


def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    path.write_bytes(b"this is not SQLite\n" * 1000)
    with pytest.raises(StoreDamagedError) as e:
        ResponseStore(path)
    assert isinstance(e.value, LocalrunError) and e.value.path == path
    assert str(path) in e.value.message and "damaged" in e.value.message
    assert e.value.hint and f"mv '{path}'" in e.value.hint and "store: false" in e.value.hint
    path.rename(tmp_path / "aside")  # what the hint says: then a new store starts empty
    with ResponseStore(path) as store:
        assert store.count() == 0


def test_a_database_damaged_inside(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    with ResponseStore(path) as store:
        owner = store.owner_for(None)
        ids = [record(store, owner, "z" * 3000) for _ in range(20)]
    assert not Path(str(path) + "-wal").exists()  # checkpointed into the file on close
    page = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0]
    with open(path, "r+b") as f:  # every page after the schema page is garbage now
        f.seek(page)
        f.write(os.urandom(path.stat().st_size - page))
    with pytest.raises(StoreDamagedError) as e:  # when opening, or at the first read
        damaged = ResponseStore(path)
        for rid in ids:
            damaged.get(rid, owner)
    assert "mv" in (e.value.hint or "")


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_the_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "home" / "r.sqlite3"
    with ResponseStore(path) as store:
        record(store, store.owner_for(None))
        assert (path.parent.stat().st_mode & 0o777) == 0o700
        names = sorted(p.name for p in path.parent.iterdir())
        assert names == ["r.sqlite3", "r.sqlite3-shm", "r.sqlite3-wal"]
        assert all((p.stat().st_mode & 0o777) == 0o600 for p in path.parent.iterdir())


def test_a_home_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "home"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(StoreUnavailableError) as e:
        ResponseStore(blocker / "r.sqlite3")
    assert not isinstance(e.value, StoreDamagedError) and str(blocker) in e.value.message
    assert "LOCALRUN_HOME" in (e.value.hint or "")


READ_ONLY = """
import os, sys
from localrun.server.responses_store import ResponseStore, StoreUnavailableError
if os.geteuid() == 0:  # root writes anywhere: drop to 'nobody', for whom the folder is read-only
    os.setgid(65534)
    os.setuid(65534)
for path in sys.argv[1:]:
    try:
        store = ResponseStore(path)
        print("opened", store.get("resp_kept", "local") is not None, end=" ")
        store.put("resp_x", "local", {}, input_items=[], conversation=[], model="m")
        print("stored")
    except StoreUnavailableError as e:
        print(type(e).__name__, e.message)
"""


@pytest.mark.skipif(os.name != "posix", reason="file modes and users are POSIX")
def test_a_read_only_home() -> None:
    # Not under tmp_path: pytest makes its parents 0700, which 'nobody' cannot even cross.
    base = Path(tempfile.mkdtemp(prefix="localrun-ro-"))
    home = base / "home"
    try:
        base.chmod(0o755)
        with ResponseStore(home / "r.sqlite3") as store:
            store.put("resp_kept", "local", {}, input_items=[], conversation=[], model="m")
        home.chmod(0o755)
        if os.geteuid() == 0:
            os.chown(home / "r.sqlite3", 65534, 65534)  # nobody's file, in a folder it can't write
        (home / "r.sqlite3").chmod(0o600)
        home.chmod(0o555)
        out = run_python(READ_ONLY, str(home / "new" / "r.sqlite3"), str(home / "r.sqlite3"))
        assert out.returncode == 0, out.stderr
        new, existing = out.stdout.splitlines()
        # A new store cannot be made; an existing one cannot take a write (SQLite cannot
        # make its -wal/-shm files there): typed, naming the file, never a crash.
        assert new.startswith("StoreUnavailableError ") and str(home / "new") in new
        assert "StoreUnavailableError " in existing and str(home / "r.sqlite3") in existing
        assert "Damaged" not in out.stdout
    finally:
        home.chmod(0o755)
        shutil.rmtree(base)


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    ResponseStore(path).close()
    with sqlite3.connect(path) as con:
        con.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreUnavailableError) as e:
        ResponseStore(path)
    assert "schema 99" in e.value.message and "upgrade localrun" in (e.value.hint or "")


def test_a_lock_held_too_long_is_busy_and_reads_go_on(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    with ResponseStore(path, busy_timeout=0.2) as store:
        owner = store.owner_for(None)
        rid = record(store, owner)
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process writing
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreBusyError) as e:
                record(store, owner)
            assert time.monotonic() - t0 < 10
            assert "0.2 s" in e.value.message
            assert store.get(rid, owner) is not None  # WAL: readers don't wait
        finally:
            other.execute("ROLLBACK")
            other.close()
        record(store, owner)  # and the store works again


def test_the_default_place_is_localruns_home(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "lh"))
    assert rs.default_path() == tmp_path / "lh" / "responses.sqlite3"
    with rs.open_default() as store:
        assert store.path == tmp_path / "lh" / "responses.sqlite3" and store.path.exists()
    monkeypatch.delenv("LOCALRUN_HOME")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    assert rs.default_path() == tmp_path / "hf" / "localrun" / "responses.sqlite3"
