"""Stored responses for the OpenAI Responses API, in SQLite (stdlib ``sqlite3``).

``store: true`` (OpenAI's default) keeps a response so that ``previous_response_id`` can
continue its conversation and ``GET``/``DELETE /v1/responses/{id}`` and
``/v1/responses/{id}/input_items`` can find it, across restarts of the server.

Where: ``responses.sqlite3`` in localrun's home: ``$LOCALRUN_HOME`` when set, else the
``localrun`` folder next to the Hugging Face cache (where ``pulls.json`` lives, see
:mod:`localrun.hub.pulls`). Stored responses are state a client expects back, not a cache:
``$LOCALRUN_CACHE`` holds what localrun can download again, and may be wiped. A folder
created here is 0700 and the file 0600 (it holds conversations); SQLite gives its
``-wal``/``-shm`` files the database file's mode.

One row per response: the response object, its input items (with ids, for
``input_items``), and the whole conversation up to and including its output, so a
continuation is one read and never needs an earlier response to be still stored. The
owner is an HMAC-SHA256 of the API key under a random salt kept in the database (never
the key itself); no key is the owner ``"local"``. Every read and delete matches id *and*
owner, so another key's id is exactly a missing id.

Bounds, kept by each write in its own transaction: age (a response older than
``max_age_seconds`` is deleted, and never returned meanwhile), count (the newest
``max_items``), total size (the newest rows within ``max_bytes``) and one response's size
(``max_item_bytes``: refused with :class:`ResponseTooLargeError`).

Concurrency: WAL (readers never wait for the writer), a busy timeout, a small pool of
connections shared by any threads, ``BEGIN IMMEDIATE`` for every write; several server
processes may share the file. Failures are typed: :class:`StoreUnavailableError` (cannot
open or write: a read-only folder, a full disk, a newer schema), :class:`StoreDamagedError`
(not a database, or a damaged one: move it aside), :class:`StoreBusyError` (locked past
the timeout). ``PRAGMA user_version`` is the schema version; ``_MIGRATIONS`` moves a file
forward.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from localrun.errors import LocalrunError

Order = Literal["asc", "desc"]
Json = dict[str, Any]

FILE_NAME = "responses.sqlite3"
SCHEMA_VERSION = 1
#: The owner of responses stored by a request without an API key (a server without one).
LOCAL_OWNER = "local"
DEFAULT_MAX_ITEMS = 10_000
DEFAULT_MAX_AGE_SECONDS = 30 * 24 * 3600  # OpenAI keeps stored responses 30 days
#: One response with its conversation and input items, as UTF-8 JSON. Twice the server's
#: default request body limit: a stored conversation holds earlier turns and the reply too.
DEFAULT_MAX_ITEM_BYTES = 32 * 2**20
DEFAULT_MAX_BYTES = 2**30
DEFAULT_BUSY_TIMEOUT = 10.0
#: OpenAI's ``input_items`` list: ``limit`` 1..100, default 20, newest first by default.
LIST_LIMIT_MAX = 100
LIST_LIMIT_DEFAULT = 20
LIST_ORDER_DEFAULT: Order = "desc"
_POOL_SIZE = 8  # idle connections kept; more threads at once open (and close) their own

#: Id prefixes by item type (OpenAI's: ``msg_``, ``fc_``, ``rs_``).
_ITEM_PREFIX: dict[str, str] = {"message": "msg", "function_call": "fc",
                                "function_call_output": "fco", "reasoning": "rs"}

#: ``_MIGRATIONS[n]`` takes a database from ``user_version`` n to n + 1.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    ("CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB NOT NULL)",
     # seq: insertion order, which the count and size bounds keep the newest of
     "CREATE TABLE responses (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE,"
     " owner TEXT NOT NULL, model TEXT NOT NULL, created_at REAL NOT NULL,"
     " size INTEGER NOT NULL, response TEXT NOT NULL, input_items TEXT NOT NULL,"
     " conversation TEXT NOT NULL)",
     "CREATE INDEX responses_created_at ON responses (created_at)",
     "CREATE INDEX responses_size ON responses (size)"),
)

# SQLite's primary result codes (sqlite.org/rescode.html), and the words of their messages
# for Pythons before 3.11, which don't carry the code.
_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED
_DAMAGED_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB
_FULL_CODE = 13
_BUSY_WORDS = ("database is locked", "database table is locked")
_DAMAGED_WORDS = ("not a database", "malformed")


class ResponseStoreError(LocalrunError):
    """A stored-responses failure; ``path`` is the database file."""

    def __init__(self, message: str, *, path: Path, hint: str | None = None) -> None:
        self.path = path
        super().__init__(message, hint=hint)


class StoreUnavailableError(ResponseStoreError, OSError):
    """The database cannot be opened or written (read-only folder, full disk, newer
    schema, closed store). Requests with ``store: false`` still work."""

    def __init__(self, path: Path, reason: str, *, hint: str | None = None) -> None:
        self.reason = reason
        super().__init__(
            f"Stored responses are unavailable: {path}: {reason}", path=path,
            hint=hint or "make that folder writable, or set LOCALRUN_HOME to a writable "
            "folder; requests with store: false work meanwhile")


class StoreDamagedError(StoreUnavailableError):
    """The file is not an SQLite database, or a damaged one."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            path, f"the database is damaged ({reason})",
            hint=f"move it aside (mv '{path}' '{path}.damaged'): localrun then starts an "
            "empty one; requests with store: false work meanwhile")


class StoreBusyError(ResponseStoreError, TimeoutError):
    """Another connection held the write lock past the busy timeout."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(
            f"The stored-responses database {path} stayed locked for {timeout:g} s",
            path=path, hint="another process is writing it (a second localrun serve?); "
            "retry the request")


class ResponseTooLargeError(LocalrunError, ValueError):
    """One response, with its conversation and input items, is over ``max_item_bytes``."""

    def __init__(self, response_id: str, size: int, limit: int) -> None:
        self.response_id = response_id
        self.size = size
        self.limit = limit
        super().__init__(
            f"Response {response_id} is too large to store: {size:,} bytes with its "
            f"conversation, over the {limit:,}-byte limit",
            hint="send store: false, or start a new conversation without "
            "previous_response_id")


class DuplicateResponseError(LocalrunError, ValueError):
    """``put`` of an id already stored (ids come from :func:`new_response_id`)."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        super().__init__(f"Response {response_id} is already stored",
                         hint="give each response a new id (new_response_id())")


class InvalidListParamError(LocalrunError, ValueError):
    """A bad ``input_items`` list parameter: ``limit`` out of 1..100, an unknown
    ``order``, or an ``after``/``before`` id that is not one of the response's items."""

    def __init__(self, param: str, value: object, reason: str) -> None:
        self.param = param
        self.value = value
        self.reason = reason
        super().__init__(f"Invalid {param} {value!r}: {reason}",
                         hint=f"send a valid {param}, or leave it out")


@dataclass(frozen=True)
class StoredResponse:
    """What ``get`` returns: the response object as it was stored."""

    id: str
    model: str
    created_at: float
    response: Json


@dataclass(frozen=True)
class ItemPage:
    """One page of a response's input items, as OpenAI's ``input_items`` list."""

    data: list[Json]
    has_more: bool

    @property
    def first_id(self) -> str | None:
        return str(self.data[0]["id"]) if self.data else None

    @property
    def last_id(self) -> str | None:
        return str(self.data[-1]["id"]) if self.data else None

    def to_json(self) -> Json:
        return {"object": "list", "data": self.data, "first_id": self.first_id,
                "last_id": self.last_id, "has_more": self.has_more}


def new_response_id() -> str:
    """A response id as OpenAI writes them: ``resp_`` and 48 random hex digits."""
    return "resp_" + secrets.token_hex(24)


def new_item_id(item_type: str = "message") -> str:
    """An item id for an item of this type: ``msg_…``, ``fc_…``, ``fco_…``, ``rs_…``."""
    return f"{_ITEM_PREFIX.get(item_type, 'item')}_" + secrets.token_hex(24)


def home_dir() -> Path:
    """localrun's home for its own state: ``$LOCALRUN_HOME``, else the ``localrun`` folder
    next to the Hugging Face cache (where the pull records are)."""
    from localrun.hub import pulls
    from localrun.hub.client import cache_dir

    return pulls.records_path(cache_dir()).parent


def default_path() -> Path:
    return home_dir() / FILE_NAME


def open_default(**kwargs: Any) -> ResponseStore:
    """The store at :func:`default_path`; raises StoreUnavailableError (or its
    StoreDamagedError) when it cannot be used."""
    return ResponseStore(default_path(), **kwargs)


def _dump(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _translate(path: Path, timeout: float, e: sqlite3.Error) -> ResponseStoreError:
    code = getattr(e, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    text = str(e)
    if primary in _BUSY_CODES or (primary is None and any(w in text for w in _BUSY_WORDS)):
        return StoreBusyError(path, timeout)
    if primary in _DAMAGED_CODES or (primary is None
                                     and any(w in text for w in _DAMAGED_WORDS)):
        return StoreDamagedError(path, text)
    if primary == _FULL_CODE:
        return StoreUnavailableError(path, text, hint="free space on that disk, or set "
                                     "LOCALRUN_HOME to a folder on a larger one")
    return StoreUnavailableError(path, text)


def _prepare_file(path: Path) -> None:
    """Create the folder (0700) and the file (0600) before SQLite does, with those modes."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.close(fd)  # an empty file is an empty database to SQLite


def _page(items: list[Json], after: str | None, before: str | None, limit: int,
          order: Order) -> ItemPage:
    """OpenAI's cursor semantics: ``after``/``before`` are item ids in the listed order;
    ``after`` pages forward from that id, ``before`` alone returns the ``limit`` items
    just before it. ``has_more``: more items lie beyond the page in that direction."""
    if isinstance(limit, bool) or not isinstance(limit, int) \
            or not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidListParamError("limit", limit, f"it must be 1 to {LIST_LIMIT_MAX}")
    if order not in ("asc", "desc"):
        raise InvalidListParamError("order", order, "it must be 'asc' or 'desc'")
    listed = items if order == "asc" else items[::-1]
    ids = [str(i.get("id")) for i in listed]

    def position(param: str, item_id: str) -> int:
        try:
            return ids.index(item_id)
        except ValueError:
            raise InvalidListParamError(param, item_id, "no input item of this response "
                                        "has that id") from None

    start = position("after", after) + 1 if after is not None else 0
    end = position("before", before) if before is not None else len(listed)
    window = listed[start:end]
    if before is not None and after is None:
        return ItemPage(window[-limit:], has_more=len(window) > limit)
    return ItemPage(window[:limit], has_more=len(window) > limit)


class ResponseStore:
    """Stored responses in one SQLite file; safe to share between threads and processes.

    Opening creates or migrates the file and raises StoreUnavailableError /
    StoreDamagedError / StoreBusyError when it cannot; every method may raise those too.
    Reads return None for an id that is missing, expired or another owner's.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 max_items: int = DEFAULT_MAX_ITEMS,
                 max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS,
                 max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
                 clock: Callable[[], float] = time.time) -> None:
        for name, value in (("max_items", max_items), ("max_age_seconds", max_age_seconds),
                            ("max_item_bytes", max_item_bytes), ("max_bytes", max_bytes),
                            ("busy_timeout", busy_timeout)):
            if not value > 0:
                raise ValueError(f"ResponseStore: {name} must be positive, not {value!r}")
        self.path = Path(path).expanduser()
        self.max_items = max_items
        self.max_age_seconds = max_age_seconds
        self.max_item_bytes = max_item_bytes
        self.max_bytes = max_bytes
        self.busy_timeout = busy_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: list[sqlite3.Connection] = []
        self._closed = False
        with self._guard():
            _prepare_file(self.path)
            with self._connection() as con:
                # WAL is a property of the file: set once, kept by every later connection.
                con.execute("PRAGMA journal_mode=WAL")
                self._salt = self._migrate(con)

    # -- owners and ids ---------------------------------------------------------------

    def owner_for(self, api_key: str | None) -> str:
        """The owner a request's API key stands for (never the key itself)."""
        if not api_key:
            return LOCAL_OWNER
        return hmac.new(self._salt, api_key.encode("utf-8"), hashlib.sha256).hexdigest()

    # -- the API the endpoint calls ---------------------------------------------------

    def put(self, response_id: str, owner: str, response: Mapping[str, Any], *,
            input_items: Sequence[Mapping[str, Any]],
            conversation: Sequence[Mapping[str, Any]], model: str,
            created_at: float | None = None) -> list[Json]:
        """Store one response atomically, then keep the bounds. ``conversation`` is every
        message up to and including this response's output (what a continuation
        starts from); ``input_items`` what ``input_items`` lists. Items without an
        ``id`` get one; the stored input items are returned."""
        items = [dict(i) if i.get("id") else {**i, "id": new_item_id(str(i.get("type",
                                                                          "message")))}
                 for i in input_items]
        blobs = (_dump(dict(response)), _dump(items), _dump([dict(m) for m in conversation]))
        size = sum(len(b.encode("utf-8")) for b in blobs)
        if size > self.max_item_bytes:
            raise ResponseTooLargeError(response_id, size, self.max_item_bytes)
        now = self._clock()
        created = now if created_at is None else float(created_at)
        with self._write() as con:
            self._expire(con, now)
            try:
                con.execute("INSERT INTO responses (id, owner, model, created_at, size,"
                            " response, input_items, conversation)"
                            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (response_id, owner, model, created, size, *blobs))
            except sqlite3.IntegrityError as e:
                raise DuplicateResponseError(response_id) from e
            self._keep_bounds(con)
        return items

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        row = self._one("SELECT model, created_at, response", response_id, owner)
        if row is None:
            return None
        return StoredResponse(response_id, row[0], row[1], json.loads(row[2]))

    def conversation(self, response_id: str, owner: str) -> list[Json] | None:
        """The messages a continuation (``previous_response_id``) starts from."""
        row = self._one("SELECT conversation", response_id, owner)
        return None if row is None else list(json.loads(row[0]))

    def input_items(self, response_id: str, owner: str, *, after: str | None = None,
                    before: str | None = None, limit: int = LIST_LIMIT_DEFAULT,
                    order: Order = LIST_ORDER_DEFAULT) -> ItemPage | None:
        """One page of the response's input items; None when the response is missing.
        Raises InvalidListParamError for a bad limit/order or an unknown cursor id."""
        row = self._one("SELECT input_items", response_id, owner)
        if row is None:
            return None
        return _page(list(json.loads(row[0])), after, before, limit, order)

    def delete(self, response_id: str, owner: str) -> bool:
        """Delete this owner's response; whether there was one (False for another's)."""
        with self._write() as con:
            self._expire(con, self._clock())
            cur = con.execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                              (response_id, owner))
            return cur.rowcount > 0

    def count(self, owner: str | None = None) -> int:
        """Live responses stored, in all or one owner's."""
        cutoff = self._clock() - self.max_age_seconds
        sql = "SELECT COUNT(*) FROM responses WHERE created_at >= ?"
        args: tuple[object, ...] = (cutoff,)
        if owner is not None:
            sql, args = sql + " AND owner = ?", (cutoff, owner)
        with self._guard(), self._connection() as con:
            return int(con.execute(sql, args).fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for con in idle:
            con.close()

    def __enter__(self) -> ResponseStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _one(self, select: str, response_id: str, owner: str) -> tuple[Any, ...] | None:
        # The same query for a missing id and another owner's: nothing tells them apart.
        cutoff = self._clock() - self.max_age_seconds
        with self._guard(), self._connection() as con:
            row = con.execute(f"{select} FROM responses WHERE id = ? AND owner = ?"
                              " AND created_at >= ?", (response_id, owner, cutoff)).fetchone()
        return None if row is None else tuple(row)

    def _expire(self, con: sqlite3.Connection, now: float) -> None:
        con.execute("DELETE FROM responses WHERE created_at < ?",
                    (now - self.max_age_seconds,))

    def _keep_bounds(self, con: sqlite3.Connection) -> None:
        # One scan of the small size index; then the oldest rows go, read from the start.
        count, total = con.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        if count > self.max_items:
            con.execute("DELETE FROM responses WHERE seq IN (SELECT seq FROM responses"
                        " ORDER BY seq LIMIT ?)", (count - self.max_items,))
            total = con.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        if total > self.max_bytes:  # the newest rows within max_bytes stay
            con.execute("DELETE FROM responses WHERE seq IN (SELECT seq FROM (SELECT seq,"
                        " SUM(size) OVER (ORDER BY seq DESC) AS kept FROM responses)"
                        " WHERE kept > ?)", (self.max_bytes,))

    def _migrate(self, con: sqlite3.Connection) -> bytes:
        if con.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            con.execute("BEGIN IMMEDIATE")  # another process may be migrating too
            try:
                version = con.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise StoreUnavailableError(
                        self.path, f"it was written by a newer localrun (schema {version}, "
                        f"this one reads up to {SCHEMA_VERSION})",
                        hint="upgrade localrun, or set LOCALRUN_HOME to another folder")
                for step in _MIGRATIONS[version:]:
                    for statement in step:
                        con.execute(statement)
                con.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('owner_salt', ?)",
                            (secrets.token_bytes(32),))
                con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        row = con.execute("SELECT value FROM meta WHERE key = 'owner_salt'").fetchone()
        if row is None or not isinstance(row[0], bytes) or len(row[0]) < 16:
            raise StoreDamagedError(self.path, "its owner salt is missing")
        return bytes(row[0])

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """SQLite's and the OS's errors -> this module's typed errors."""
        try:
            yield
        except LocalrunError:
            raise
        except sqlite3.Error as e:
            raise _translate(self.path, self.busy_timeout, e) from e
        except OSError as e:
            raise StoreUnavailableError(self.path, e.strerror or str(e)) from e

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._closed:
                raise StoreUnavailableError(self.path, "the store is closed",
                                            hint="open a new ResponseStore")
            con = self._idle.pop() if self._idle else None
        if con is None:
            # isolation_level=None: no implicit transactions; writes say BEGIN IMMEDIATE.
            con = sqlite3.connect(self.path, timeout=self.busy_timeout,
                                  isolation_level=None, check_same_thread=False)
            con.execute("PRAGMA synchronous = NORMAL")  # durable across crashes in WAL
        ok = False
        try:
            yield con
            ok = True
        finally:
            with self._lock:
                keep = ok and not self._closed and len(self._idle) < _POOL_SIZE \
                    and not con.in_transaction
                if keep:
                    self._idle.append(con)
            if not keep:
                con.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken at once (BEGIN IMMEDIATE: no lock upgrade that
        could fail half-way), committed or rolled back whole."""
        with self._guard(), self._connection() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")


__all__ = ["DEFAULT_MAX_AGE_SECONDS", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_ITEMS",
           "DEFAULT_MAX_ITEM_BYTES", "LOCAL_OWNER", "DuplicateResponseError",
           "InvalidListParamError", "ItemPage", "Order", "ResponseStore",
           "ResponseStoreError", "ResponseTooLargeError", "StoreBusyError",
           "StoreDamagedError", "StoreUnavailableError", "StoredResponse", "default_path",
           "home_dir", "new_item_id", "new_response_id", "open_default"]
