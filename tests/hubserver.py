"""A local imitation of the Hugging Face Hub, for the real huggingface_hub client.

Serves on 127.0.0.1 (random ports) what huggingface_hub 1.x/2.x asks for, answered the
way the real Hub answers it (tests/test_hub_faithful.py has a test per behaviour):

- ``GET /api/models/{repo}[/revision/{rev}]``: id, sha, siblings, tags, gated, cardData,
  config. ``?expand=a&expand=b`` returns only those fields (and ``id``; an unknown one is
  a 400); ``?blobs=true`` gives the siblings their sizes and LFS checksums, which they
  otherwise lack
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: files with size, oid and ``lfs{oid,size}``
- ``GET /api/models/{repo}/refs``: branches, tags, and pull requests with ``include_prs=1``
- ``GET /api/models?filter=&search=&author=&sort=&limit=&expand=``: search (filters
  ANDed; by default the fields the real listing has: no ``gated``, no ``siblings``)
- listings are paginated: ``page_size`` entries a page, then ``Link: <…>; rel="next"``
- ``HEAD/GET /{repo}/resolve/{rev}/{path}``: X-Repo-Commit, ETag, and for LFS files
  X-Linked-Etag (the sha256) and X-Linked-Size with a 302 to a signed URL on the CDN, a
  second server on another port. The CDN refuses a request that also carries an
  Authorization header (400, as S3 presigned URLs do), answers 403 once the URL has
  expired, serves Range with 206 and a range beyond the end with 416. Small (non-LFS)
  files are served by the Hub itself.
- revisions: branch names, tags, full and short commit hashes, ``refs/pr/N``; a commit
  stays reachable by its hash after its branch moves on (:meth:`FakeRepo.move`)
- access: a missing or private repo answers 401 ``RepoNotFound`` to an anonymous caller
  and 404 to a token without access; a gated repo's files answer 401 ``GatedRepo``
  without a token and 403 to a token that was not granted; an unknown token is a 401
  "Invalid credentials in Authorization header" everywhere
- Xet: with ``FakeRepo.xet`` the LFS files' HEAD also carries ``X-Xet-Hash`` and the
  ``xet-auth`` link, and ``/api/models/{repo}/xet-read-token/{rev}`` answers the CAS
  connection headers (there is no CAS server: tests replace hf_xet's session)

Fault injection: ``drop_once`` (send half a file, then close the connection; with
``expire_on_drop`` its signed URL expires too), ``corrupt_once`` / ``corrupt_always``
(the right length, wrong bytes), ``truncated`` (the CDN holds fewer bytes than the Hub
lists), ``ignore_range`` (a 200 with the whole file in reply
to a Range request, as servers that do not do ranges answer), ``fail()`` (5xx or 429
with Retry-After, a number of times), ``fail_paths`` (paths answered 500, always).
Every request is recorded in ``requests`` (the CDN's with ``"host": "cdn"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

#: A token granted every gated and private repo.
GATED_TOKEN = "hf_test_token_granted"
#: A valid token that was granted nothing (403 on gated files, 404 on private repos).
NO_ACCESS_TOKEN = "hf_test_token_no_access"
#: What the real Hub says to an unknown token (huggingface_hub matches this text).
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"

# --- tiny valid GGUF files ----------------------------------------------------------------------

FILE_TYPE = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
             "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15,
             "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_XS": 30, "BF16": 32}


def gguf_bytes(*, quant: str = "Q4_K_M", arch: str = "qwen2", layers: int = 24,
               heads: int = 14, kv_heads: int = 2, embedding: int = 896,
               context: int = 32768, pad: int = 0, extra: dict[str, Any] | None = None) -> bytes:
    """A GGUF v3 file with metadata and no tensors (plus ``pad`` bytes of filler)."""
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": f"test {arch}",
        "general.file_type": FILE_TYPE.get(quant, 15),
        f"{arch}.block_count": layers,
        f"{arch}.context_length": context,
        f"{arch}.embedding_length": embedding,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        **(extra or {}),
    }
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta)))
    for k, v in meta.items():
        kb = k.encode()
        out += struct.pack("<Q", len(kb)) + kb
        if isinstance(v, str):
            vb = v.encode()
            out += struct.pack("<IQ", 8, len(vb)) + vb
        else:
            out += struct.pack("<II", 4, int(v))
    out += b"\0" * ((32 - len(out) % 32) % 32)
    return bytes(out) + bytes((i * 7 + len(quant)) % 251 for i in range(pad))


# --- repos ----------------------------------------------------------------------------------------

# --- repos ----------------------------------------------------------------------------------------

@dataclass
class FakeFile:
    data: bytes | None = None
    size: int | None = None  # declared size for virtual files (data None): never served
    lfs: bool | None = None
    # Hashes are asked for on every API call (commit shas): real models are 100+ MB.
    _sha256: str | None = field(default=None, repr=False, compare=False)
    _git_oid: str | None = field(default=None, repr=False, compare=False)

    @property
    def length(self) -> int:
        return len(self.data) if self.data is not None else int(self.size or 0)

    @property
    def is_lfs(self) -> bool:
        if self.lfs is not None:
            return self.lfs
        return self.length > 1024 or self.data is None

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            body = self.data if self.data is not None else f"virtual:{self.size}".encode()
            self._sha256 = hashlib.sha256(body).hexdigest()
        return self._sha256

    @property
    def git_oid(self) -> str:
        if self._git_oid is None:
            body = self.data if self.data is not None else str(self.size).encode()
            self._git_oid = hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()
        return self._git_oid

    @property
    def etag(self) -> str:
        """What the Hub's ETag / X-Linked-Etag say: the sha256 for LFS, else the git oid."""
        return self.sha256 if self.is_lfs else self.git_oid


Files = dict[str, FakeFile]
PR_REF = re.compile(r"^refs/pr/(\d+)$")
HEX = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass
class FakeRepo:
    id: str
    branches: dict[str, Files]
    tags: list[str] = field(default_factory=list)  # the Hub's tags (gguf, base_model:…)
    gated: str | bool = False
    config: dict[str, Any] | None = None
    card_data: dict[str, Any] | None = None
    downloads: int = 0
    private: bool = False
    git_tags: dict[str, str] = field(default_factory=dict)  # tag name -> commit sha
    prs: dict[int, Files] = field(default_factory=dict)  # refs/pr/N -> its files
    history: dict[str, Files] = field(default_factory=dict)  # commits no branch points at
    xet: bool = False  # LFS files are Xet-backed (HEAD carries the Xet headers)

    def _sha(self, label: str, files: Files) -> str:
        h = hashlib.sha1(f"{self.id}@{label}".encode())
        for path, f in sorted(files.items()):
            h.update(path.encode() + f.sha256.encode())
        return h.hexdigest()

    def sha(self, branch: str) -> str:
        """The commit a branch points at (derived from its files: tests edit them)."""
        return self._sha(branch, self.branches[branch])

    def pr_sha(self, number: int) -> str:
        return self._sha(f"refs/pr/{number}", self.prs[number])

    def commits(self) -> dict[str, Files]:
        out = dict(self.history)
        out.update({self.sha(b): files for b, files in self.branches.items()})
        out.update({self.pr_sha(n): files for n, files in self.prs.items()})
        return out

    def lookup(self, rev: str) -> tuple[str, Files] | None:
        """A branch, tag, ``refs/pr/N``, or full or short (7+ hex) commit hash ->
        (commit sha, files); None when the repo has no such revision."""
        if rev in self.branches:
            return self.sha(rev), self.branches[rev]
        commits = self.commits()
        if rev in self.git_tags:
            sha = self.git_tags[rev]
            return sha, commits[sha]
        m = PR_REF.match(rev)
        if m:
            n = int(m.group(1))
            return (self.pr_sha(n), self.prs[n]) if n in self.prs else None
        if HEX.match(rev):
            hits = [c for c in commits if c.startswith(rev)]
            if len(hits) == 1:
                return hits[0], commits[hits[0]]
        return None

    def default_branch(self) -> str:
        return "main" if "main" in self.branches else next(iter(self.branches))

    def move(self, branch: str, files: Files) -> str:
        """Point ``branch`` at a new commit with ``files``; the old commit stays
        reachable by its hash (as on the Hub). Returns the old commit's sha."""
        old = self.sha(branch)
        self.history[old] = dict(self.branches[branch])
        self.branches[branch] = files
        return old

    def tag(self, name: str, branch: str = "main") -> str:
        """Tag the commit ``branch`` points at now; return its sha."""
        sha = self.sha(branch)
        self.history.setdefault(sha, dict(self.branches[branch]))
        self.git_tags[name] = sha
        return sha


@dataclass
class Fault:
    """Answer requests whose path matches ``pattern`` with ``status``, ``times`` times
    (None: always); a 429/503 may carry Retry-After."""

    pattern: str
    status: int
    times: int | None
    retry_after: str | None = None
    method: str | None = None
    hits: int = 0


@dataclass
class _Signed:
    repo: str
    path: str
    file: FakeFile
    expired: bool = False


class FakeHub:
    """The repos, tokens, the request log and fault injection; serve with :class:`HubServer`."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[dict[str, Any]] = []
        # token -> the gated/private repos it was granted (None: all of them)
        self.tokens: dict[str, set[str] | None] = {GATED_TOKEN: None, NO_ACCESS_TOKEN: set()}
        self.page_size = 1000  # the real Hub's tree page; tests lower it
        self.drop_once: set[tuple[str, str]] = set()
        self.expire_on_drop = False
        self.corrupt_once: set[tuple[str, str]] = set()
        self.corrupt_always: set[tuple[str, str]] = set()
        self.ignore_range: set[tuple[str, str]] = set()
        # (repo, path) -> bytes the CDN really holds (fewer than the Hub lists)
        self.truncated: dict[tuple[str, str], int] = {}
        self.fail_paths: set[str] = set()
        self.faults: list[Fault] = []
        self.signed: dict[str, _Signed] = {}
        self.cdn_url = ""  # set by HubServer
        self.lock = threading.Lock()

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.id] = repo
        return repo

    def fail(self, pattern: str, status: int = 503, times: int | None = 1, *,
             retry_after: str | None = None, method: str | None = None) -> Fault:
        """Answer the next ``times`` requests matching ``pattern`` (a regular expression
        on the unquoted path) with ``status``."""
        fault = Fault(pattern, status, times, retry_after, method)
        self.faults.append(fault)
        return fault

    def expire_urls(self) -> None:
        """Every signed CDN URL handed out so far stops working (403)."""
        with self.lock:
            for s in self.signed.values():
                s.expired = True

    def sign(self, repo: str, path: str, f: FakeFile) -> str:
        token = uuid.uuid4().hex
        with self.lock:
            self.signed[token] = _Signed(repo, path, f)
        name = quote(path.rsplit("/", 1)[-1])
        return (f"{self.cdn_url}/lfs/{f.sha256}/{name}?X-Amz-Expires=3600"
                f"&X-Amz-Signature={token}")

    def resolve_requests(self, method: str | None = None) -> list[dict[str, Any]]:
        """Requests for file contents or metadata: the Hub's /resolve and the CDN's."""
        return [r for r in self.requests
                if ("/resolve/" in r["path"] or r.get("host") == "cdn")
                and (method is None or r["method"] == method)]

    def cdn_requests(self, method: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("host") == "cdn"
                and (method is None or r["method"] == method)]


#: What ``?expand=`` may name on /api/models (the real Hub refuses other names).
EXPANDABLE = frozenset({
    "author", "baseModels", "cardData", "childrenModelCount", "config", "createdAt",
    "disabled", "downloads", "downloadsAllTime", "gated", "gguf", "inference",
    "inferenceProviderMapping", "lastModified", "library_name", "likes", "mask_token",
    "model-index", "pipeline_tag", "private", "resourceGroup", "safetensors", "sha",
    "siblings", "spaces", "tags", "transformersInfo", "trendingScore", "widgetData",
    "usedStorage", "xetEnabled"})
#: The fields /api/models (the search) returns without ``expand``.
SEARCH_FIELDS = ("_id", "id", "likes", "trendingScore", "private", "downloads", "tags",
                 "pipeline_tag", "library_name", "createdAt", "modelId")


class _Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub  # set on the subclass
    host_label = "hub"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return None

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self) -> None:
        url = urlsplit(self.path)
        entry: dict[str, Any] = {"method": self.command, "headers": dict(self.headers.items())}
        if self.host_label == "cdn":
            entry.update(host="cdn", path=unquote(url.path), query=url.query)
        else:
            entry["path"] = self.path
        with self.hub.lock:
            self.hub.requests.append(entry)

    def do_HEAD(self) -> None:
        self._record()
        self._route()

    def do_GET(self) -> None:
        self._record()
        self._route()

    def _route(self) -> None:
        raise NotImplementedError

    def _error(self, status: int, code: str | None, message: str,
               headers: dict[str, str] | None = None) -> None:
        h = {"X-Error-Message": message, **(headers or {})}
        if code:
            h["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), h)

    def _fault(self, path: str) -> bool:
        if any(re.search(p, path) for p in self.hub.fail_paths):
            self._error(500, None, "Internal Error - We're working hard to fix this as soon "
                        "as possible!")
            return True
        with self.hub.lock:
            hit = next((f for f in self.hub.faults
                        if re.search(f.pattern, path) and (f.times is None or f.hits < f.times)
                        and (f.method is None or f.method == self.command)), None)
            if hit is not None:
                hit.hits += 1
        if hit is None:
            return False
        headers = {"Retry-After": hit.retry_after} if hit.retry_after is not None else {}
        message = {429: "You have exceeded our hourly quotas for action: api. We invite you "
                   "to retry later."}.get(hit.status, "Service Unavailable")
        self._error(hit.status, None, message, headers)
        return True


    def _serve_bytes(self, key: tuple[str, str], f: FakeFile, headers: dict[str, str],
                     on_drop: Any = None) -> None:
        """A file's bytes: Range -> 206 (416 beyond the end), faults applied."""
        if f.data is None:
            return self._send(500, b'{"error": "test bug: a virtual file was downloaded"}')
        data = f.data
        if self.host_label == "cdn" and key in self.hub.truncated:
            data = data[:self.hub.truncated[key]]
        headers = {**headers, "Accept-Ranges": "bytes"}
        if self.command == "HEAD":
            return self._send(200, data, headers, "application/octet-stream")
        with self.hub.lock:
            drop = key in self.hub.drop_once
            corrupt = key in self.hub.corrupt_once or key in self.hub.corrupt_always
            ignore_range = key in self.hub.ignore_range
            self.hub.drop_once.discard(key)
            self.hub.corrupt_once.discard(key)
        status = 200
        rng = self.headers.get("Range")
        if rng and not ignore_range:
            m = re.match(r"bytes=(\d+)-(\d*)$", rng)
            assert m, rng
            start = int(m.group(1))
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"},
                                  "text/plain")
            end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        if corrupt:
            data = bytes(b ^ 0xFF for b in data)
        if drop:
            # Promise the whole body, send half, hang up: the client must resume with Range.
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            if on_drop is not None:
                on_drop()
            return None
        return self._send(status, data, headers, "application/octet-stream")


class _Handler(_Base):
    """The Hub: API and /resolve."""

    # -- helpers
    def _json(self, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(obj).encode(), headers)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None

    def _granted(self, repo: FakeRepo) -> bool:
        token = self._token()
        if token is None or token not in self.hub.tokens:
            return False
        allowed = self.hub.tokens[token]
        return allowed is None or repo.id in allowed

    def _base_url(self) -> str:
        return f"http://{self.headers.get('Host')}"

    # -- routing
    def _route(self) -> None:
        url = urlsplit(self.path)
        raw = url.path
        path = unquote(raw)
        query = parse_qs(url.query)
        if self._fault(path):
            return None
        token = self._token()
        if token is not None and token not in self.hub.tokens:
            return self._error(401, None, INVALID_CREDENTIALS)
        if path == "/api/models":
            return self._search(query)
        parts = [unquote(p) for p in raw.split("/")]
        if len(parts) >= 4 and parts[1] == "api" and parts[2] == "models" and len(parts) >= 5:
            return self._api(f"{parts[3]}/{parts[4]}", parts[5:], query)
        if len(parts) >= 6 and parts[3] == "resolve":
            return self._resolve(f"{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:]))
        self._error(404, None, "Sorry, we can't find the page you are looking for.")

    def _repo(self, rid: str) -> FakeRepo | None:
        """The repo, or None after answering as the Hub does: 401 to an anonymous caller
        (a missing repo looks like a private one), 404 to a token without access."""
        repo = self.hub.repos.get(rid)
        if repo is not None and (not repo.private or self._granted(repo)):
            return repo
        status = 404 if self._token() is not None else 401
        self._error(status, "RepoNotFound", "Repository not found")
        return None

    def _info(self, repo: FakeRepo, sha: str, files: Files,
              query: dict[str, list[str]]) -> dict[str, Any] | None:
        blobs = query.get("blobs", ["false"])[0].lower() in ("true", "1")
        siblings: list[dict[str, Any]] = []
        for p, f in sorted(files.items()):
            s: dict[str, Any] = {"rfilename": p}
            if blobs:
                s.update(blobId=f.git_oid, size=f.length)
                if f.is_lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": f.length, "pointerSize": 134}
            siblings.append(s)
        info: dict[str, Any] = {
            "_id": repo.id, "id": repo.id, "modelId": repo.id, "author": repo.id.split("/")[0],
            "sha": sha, "private": repo.private, "gated": repo.gated,
            "disabled": False, "downloads": repo.downloads, "likes": 0, "tags": repo.tags,
            "library_name": next((t for t in repo.tags if t in ("gguf", "mlx", "openvino")),
                                 None),
            "cardData": repo.card_data or {}, "config": repo.config,
            "siblings": siblings, "xetEnabled": repo.xet,
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
        }
        return self._expanded(info, query)

    def _expanded(self, info: dict[str, Any], query: dict[str, list[str]]
                  ) -> dict[str, Any] | None:
        """Only the fields ``expand`` names (with id), as the real API; None after a 400."""
        expand = [e for v in query.get("expand", []) for e in v.split(",") if e]
        if not expand:
            return info
        bad = [e for e in expand if e not in EXPANDABLE]
        if bad:
            self._error(400, None, f'"expand" must be one of {sorted(EXPANDABLE)} ({bad[0]})')
            return None
        return {"_id": info["_id"], "id": info["id"],
                **{k: info[k] for k in expand if k in info}}

    def _page(self, items: list[Any], query: dict[str, list[str]], size: int) -> None:
        """One page of ``items`` and, when more follow, a Link to the next (GitHub style,
        an absolute URL carrying the query and a cursor)."""
        start = int((query.get("cursor") or ["0"])[0])
        page = items[start:start + size]
        headers = {}
        if start + size < len(items):
            nxt = {k: v for k, v in query.items() if k != "cursor"}
            nxt["cursor"] = [str(start + size)]
            link = f"{self._base_url()}{urlsplit(self.path).path}?{urlencode(nxt, doseq=True)}"
            headers["Link"] = f'<{link}>; rel="next"'
        self._json(page, headers)

    def _api(self, rid: str, rest: list[str], query: dict[str, list[str]]) -> None:
        repo = self._repo(rid)
        if repo is None:
            return None
        if not rest or rest == [""]:
            branch = repo.default_branch()
            info = self._info(repo, repo.sha(branch), repo.branches[branch], query)
            return None if info is None else self._json(info)
        if rest[0] == "revision" and len(rest) == 2:
            found = repo.lookup(rest[1])
            if found is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
            info = self._info(repo, *found, query)
            return None if info is None else self._json(info)
        if rest == ["refs"]:
            prs = query.get("include_prs", ["0"])[0].lower() in ("1", "true")
            return self._json({
                "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": repo.sha(b)}
                             for b in repo.branches],
                "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": sha}
                         for t, sha in repo.git_tags.items()],
                "converts": [],
                **({"pullRequests": [{"name": f"refs/pr/{n}", "ref": f"refs/pr/{n}",
                                      "targetCommit": repo.pr_sha(n)} for n in repo.prs]}
                   if prs else {})})
        if rest[0] == "tree" and len(rest) >= 2:
            found = repo.lookup(rest[1])
            if found is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
            under = "/".join(rest[2:]).strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            return self._page(self._tree(found[1], under, recursive), query,
                              self.hub.page_size)
        if rest[0] == "xet-read-token" and len(rest) == 2:
            return self._json({"casUrl": f"{self.hub.cdn_url}/cas", "exp": 4102444800,
                               "accessToken": "xet-test-token"}, {
                "X-Xet-Cas-Url": f"{self.hub.cdn_url}/cas", "X-Xet-Access-Token":
                "xet-test-token", "X-Xet-Token-Expiration": "4102444800"})
        self._error(404, None, "Sorry, we can't find the page you are looking for.")

    def _tree(self, files: Files, under: str, recursive: bool) -> list[Any]:
        prefix = f"{under}/" if under else ""
        out: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for path, f in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            rel = path[len(prefix):]
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and d not in dirs:
                    dirs.add(d)
                    out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(),
                                "size": 0, "path": d})
            if len(parts) > 1 and not recursive:
                continue
            entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.length,
                                     "path": path}
            if f.is_lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.length, "pointerSize": 134}
            out.append(entry)
        return out

    def _search(self, query: dict[str, list[str]]) -> None:
        filters = [f for v in query.get("filter", []) for f in v.split(",") if f]
        search = (query.get("search") or [""])[0].lower()
        author = (query.get("author") or [""])[0]
        limit = int((query.get("limit") or ["1000"])[0])
        found = []
        for repo in self.hub.repos.values():
            if repo.private and not self._granted(repo):
                continue
            if not all(f in repo.tags for f in filters):
                continue
            if search and search not in repo.id.lower():
                continue
            if author and repo.id.split("/")[0] != author:
                continue
            found.append(repo)
        if (query.get("sort") or [""])[0] == "downloads":
            found.sort(key=lambda r: -r.downloads)
        rows = []
        for r in found:
            full = {"_id": r.id, "id": r.id, "modelId": r.id, "tags": r.tags,
                    "downloads": r.downloads, "likes": 0, "trendingScore": 0,
                    "private": r.private, "gated": r.gated, "pipeline_tag": None,
                    "library_name": None, "createdAt": "2025-01-01T00:00:00.000Z"}
            if query.get("expand"):
                row = self._expanded(full, query)
                if row is None:
                    return None
            else:
                row = {k: full[k] for k in SEARCH_FIELDS if k in full}
            rows.append(row)
        self._page(rows, query, min(limit, self.hub.page_size))

    def _resolve(self, rid: str, rev: str, path: str) -> None:
        repo = self._repo(rid)
        if repo is None:
            return None
        found = repo.lookup(rev)
        if found is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        commit, files = found
        if repo.gated and not self._granted(repo):
            if self._token() is None:
                return self._error(401, "GatedRepo", f"Access to model {rid} is restricted. "
                                   "You must have access to it and be authenticated to access "
                                   "it. Please log in.", {"X-Repo-Commit": commit})
            return self._error(403, "GatedRepo", f"Access to model {rid} is restricted and you "
                               f"are not in the authorized list. Visit https://huggingface.co/"
                               f"{rid} to ask for access.", {"X-Repo-Commit": commit})
        f = files.get(path)
        if f is None:
            return self._error(404, "EntryNotFound", "Entry not found",
                               {"X-Repo-Commit": commit})
        headers = {"X-Repo-Commit": commit, "ETag": f'"{f.etag}"'}
        if not f.is_lfs:
            return self._serve_bytes((rid, path), f, headers)
        # LFS: the metadata here, the bytes on the CDN behind a signed URL.
        headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.length),
                        "Location": self.hub.sign(rid, path, f)})
        if repo.xet:
            headers["X-Xet-Hash"] = f.sha256
            headers["Link"] = (f'<{self._base_url()}/api/models/{rid}/xet-read-token/{commit}>;'
                               ' rel="xet-auth"')
        self._send(302, b"", headers, "text/plain")


class _CdnHandler(_Base):
    """The CDN: signed URLs only, no Authorization header, Range, expiry."""

    host_label = "cdn"

    def _route(self) -> None:
        url = urlsplit(self.path)
        if self._fault(unquote(url.path)):
            return None
        query = parse_qs(url.query)
        token = (query.get("X-Amz-Signature") or [""])[0]
        signed = self.hub.signed.get(token)
        if self.headers.get("Authorization"):
            # S3: a presigned URL and an Authorization header are two auth mechanisms.
            return self._send(400, b"<Error><Code>InvalidArgument</Code><Message>Only one "
                              b"auth mechanism allowed</Message></Error>", None,
                              "application/xml")
        if signed is None or signed.expired:
            return self._send(403, b"<Error><Code>AccessDenied</Code><Message>Request has "
                              b"expired</Message></Error>", None, "application/xml")

        def expire() -> None:
            if self.hub.expire_on_drop:
                signed.expired = True

        headers = {"ETag": f'"{signed.file.sha256}"', "Content-Disposition":
                   f'attachment; filename="{signed.path.rsplit("/", 1)[-1]}"'}
        self._serve_bytes((signed.repo, signed.path), signed.file, headers, on_drop=expire)


class HubServer:
    """Run a FakeHub (and its CDN, on another port) on 127.0.0.1 in threads:
    ``with HubServer(hub) as url: ...``."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0),
                                         type("Handler", (_Handler,), {"hub": hub}))
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0),
                                       type("CdnHandler", (_CdnHandler,), {"hub": hub}))
        for s in (self.httpd, self.cdn):
            s.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        hub.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True)
                        for s in (self.httpd, self.cdn)]

    def __enter__(self) -> str:
        for t in self.threads:
            t.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        for s in (self.httpd, self.cdn):
            s.shutdown()
            s.server_close()


# --- the standard fixture hub ---

GGUF_QUANTS = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_K_S", "Q4_K_M", "Q5_0",
               "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16"]
QUANT_BPW = {"Q2_K": 3, "Q3_K_S": 3.5, "Q3_K_M": 3.9, "Q3_K_L": 4.3, "Q4_0": 4.5,
             "Q4_K_S": 4.6, "Q4_K_M": 4.85, "Q5_0": 5.5, "Q5_K_S": 5.5, "Q5_K_M": 5.7,
             "Q6_K": 6.6, "Q8_0": 8.5, "F16": 16}

QWEN_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
               "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
               "hidden_size": 896, "max_position_embeddings": 32768}
BASE = "Qwen/Qwen2.5-0.5B-Instruct"


def _json_file(obj: Any) -> FakeFile:
    return FakeFile(json.dumps(obj, indent=1).encode(), lfs=False)


def _text(s: str) -> FakeFile:
    return FakeFile(s.encode(), lfs=False)


def _blob(n: int, seed: int = 1) -> FakeFile:
    return FakeFile(bytes((i * 31 + seed) % 256 for i in range(n)), lfs=True)


def standard_hub() -> FakeHub:
    hub = FakeHub()
    quantized = f"base_model:quantized:{BASE}"
    hub.add(FakeRepo(BASE, {"main": {
        "config.json": _json_file(QWEN_CONFIG), "README.md": _text("# Qwen2.5"),
        "model.safetensors": _blob(6000), "tokenizer.json": _json_file({"v": 1})}},
        tags=["transformers", "safetensors", "text-generation"], downloads=1000,
        config={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    # Official GGUF repo: lower-case file names, a dozen quants.
    official = {f"qwen2.5-0.5b-instruct-{q.lower()}.gguf":
                FakeFile(gguf_bytes(quant=q, pad=int(QUANT_BPW[q] * 1000)), lfs=True)
                for q in GGUF_QUANTS}
    official[".gitattributes"] = _text("*.gguf filter=lfs")
    official["README.md"] = _text("# GGUF")
    hub.add(FakeRepo(f"{BASE}-GGUF", {"main": official},
                     tags=["gguf", "base_model:" + BASE, quantized], downloads=500))
    # bartowski: other naming, with an imatrix file that must be ignored (a projector:
    # tests/test_hub.py::test_mmproj_and_imatrix_ignored adds one).
    bart = {f"Qwen2.5-0.5B-Instruct-{q}.gguf":
            FakeFile(gguf_bytes(quant=q, pad=int(QUANT_BPW[q] * 1000) + 7), lfs=True)
            for q in ("Q4_K_M", "Q6_K", "Q8_0")}
    bart["Qwen2.5-0.5B-Instruct.imatrix"] = _blob(2000, 3)
    hub.add(FakeRepo("bartowski/Qwen2.5-0.5B-Instruct-GGUF", {"main": bart},
                     tags=["gguf", quantized], downloads=900))
    # mlx-community 4-bit and 8-bit.
    for bits, dl in ((4, 300), (8, 200)):
        cfg = {**QWEN_CONFIG, "quantization": {"group_size": 64, "bits": bits},
               "quantization_config": {"group_size": 64, "bits": bits}}
        hub.add(FakeRepo(f"mlx-community/Qwen2.5-0.5B-Instruct-{bits}bit", {"main": {
            "config.json": _json_file(cfg), "model.safetensors": _blob(1500 * bits, bits),
            "tokenizer.json": _json_file({"v": 1}), "README.md": _text("mlx")}},
            tags=["mlx", "safetensors", quantized], downloads=dl))
    # OpenVINO org int4 / int8.
    for q in ("int4", "int8"):
        hub.add(FakeRepo(f"OpenVINO/Qwen2.5-0.5B-Instruct-{q}-ov", {"main": {
            "config.json": _json_file(QWEN_CONFIG), "openvino_model.xml": _text("<net/>"),
            "openvino_model.bin": _blob(3000 if q == "int4" else 6000, 5),
            "openvino_tokenizer.xml": _text("<t/>"), "openvino_tokenizer.bin": _blob(1100, 6),
            "openvino_detokenizer.xml": _text("<d/>"), "openvino_detokenizer.bin": _blob(1100, 7),
        }}, tags=["openvino", quantized], downloads=100))
    # A sharded Q4_K_M (official Qwen 7B naming) next to a single-file Q8_0.
    shard = {f"qwen2.5-7b-instruct-q4_k_m-0000{i}-of-00002.gguf":
             FakeFile(gguf_bytes(quant="Q4_K_M", layers=28, heads=28, kv_heads=4,
                                 embedding=3584, pad=3000 + i, extra={"split.no": i - 1,
                                                                      "split.count": 2}),
                      lfs=True) for i in (1, 2)}
    shard["qwen2.5-7b-instruct-q8_0.gguf"] = FakeFile(gguf_bytes(quant="Q8_0", pad=9000),
                                                      lfs=True)
    hub.add(FakeRepo("Qwen/Qwen2.5-7B-Instruct-GGUF", {"main": shard},
                     tags=["gguf", "base_model:quantized:Qwen/Qwen2.5-7B-Instruct"]))
    # EXL2 repo with bpw branches (bartowski style: README on main, weights on branches).
    exl = {"main": {"README.md": _text("exl2"), "measurement.json": _json_file({})}}
    for br, bits in (("4_25", 4.25), ("6_5", 6.5), ("8_0", 8.0)):
        exl[br] = {"config.json": _json_file({**QWEN_CONFIG, "quantization_config": {
            "quant_method": "exl2", "bits": bits}}),
            "output.safetensors": _blob(int(1000 * bits), int(bits)),
            "tokenizer.json": _json_file({"v": 1})}
    hub.add(FakeRepo("bartowski/Qwen2.5-7B-Instruct-exl2", exl, tags=["text-generation"]))
    # turboderp style: X.Ybpw branches.
    tdp = {"main": {"README.md": _text("exl2")}}
    for bits in (4.0, 6.0, 8.0):
        tdp[f"{bits}bpw"] = {"config.json": _json_file({**QWEN_CONFIG, "quantization_config": {
            "quant_method": "exl2", "bits": bits}}),
            "output.safetensors": _blob(int(1000 * bits), 9)}
    hub.add(FakeRepo("turboderp/Llama-3.2-1B-Instruct-exl2", tdp, tags=[]))
    # microsoft-style ONNX GenAI repo with variant folders.
    genai = {"model": {"type": "phi3", "context_length": 131072, "decoder": {
        "num_hidden_layers": 32, "num_key_value_heads": 32, "head_size": 96,
        "filename": "model.onnx"}}}
    onnx: dict[str, FakeFile] = {"README.md": _text("onnx")}
    for sub, n in (("cpu_and_mobile/cpu-int4-awq-block-128-acc-level-4", 4000),
                   ("gpu/gpu-int4-awq-block-128", 4100), ("cuda/cuda-fp16", 16000)):
        onnx[f"{sub}/genai_config.json"] = _json_file(genai)
        onnx[f"{sub}/model.onnx"] = _blob(1200, 2)
        onnx[f"{sub}/model.onnx.data"] = _blob(n, 3)
        onnx[f"{sub}/tokenizer.json"] = _json_file({"v": 1})
    hub.add(FakeRepo("microsoft/Phi-3.5-mini-instruct-onnx", {"main": onnx},
                     tags=["onnx", "base_model:quantized:microsoft/Phi-3.5-mini-instruct"]))
    # A gated GGUF repo.
    hub.add(FakeRepo("gatedorg/Gated-1B-GGUF", {"main": {
        "gated-1b-q4_k_m.gguf": FakeFile(gguf_bytes(quant="Q4_K_M", arch="llama", layers=16,
                                                    heads=32, kv_heads=8, embedding=2048,
                                                    pad=1500), lfs=True)}},
        tags=["gguf"], gated="manual"))
    # Too big for any test budget: declared sizes only (never downloaded).
    big = {f"huge-70b-{q.lower()}.gguf": FakeFile(None, size=int(70e9 * QUANT_BPW[q] / 8))
           for q in ("Q2_K", "Q4_K_M", "Q8_0")}
    hub.add(FakeRepo("bigorg/Huge-70B-GGUF", {"main": big}, tags=["gguf"]))
    return hub


# --- repos holding several models (issue 19) ---

DEEPSEEK_ONNX = "onnxruntime/DeepSeek-R1-Distill-ONNX"
DEEPSEEK_BASES = {"1.5B": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                  "7B": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"}


def add_deepseek_onnx(hub: FakeHub) -> FakeRepo:
    """The onnxruntime org's layout (its model card): one repo, a top folder per model,
    device variants below. Here the 1.5B has only the CPU build and the 7B also a GPU
    one, so a planner that looks at devices and not at models lands on the 7B."""
    shapes = {"1.5B": (28, 2, 128, 1536, 3000), "7B": (28, 4, 128, 3584, 9000)}
    layout = {"1.5B": ("cpu_and_mobile/cpu-int4-rtn-block-32-acc-level-4",),
              "7B": ("cpu_and_mobile/cpu-int4-rtn-block-32-acc-level-4",
                     "gpu/gpu-int4-rtn-block-32")}
    files: dict[str, FakeFile] = {"README.md": _text("# DeepSeek-R1-Distill ONNX")}
    for size, subs in layout.items():
        layers, kv, head, hidden, n = shapes[size]
        genai = {"model": {"type": "qwen2", "context_length": 131072, "decoder": {
            "num_hidden_layers": layers, "num_key_value_heads": kv, "head_size": head,
            "hidden_size": hidden, "filename": "model.onnx"}}}
        for sub in subs:
            root = f"deepseek-r1-distill-qwen-{size}/{sub}"
            files[f"{root}/genai_config.json"] = _json_file(genai)
            files[f"{root}/model.onnx"] = _blob(1200, 2)
            files[f"{root}/model.onnx.data"] = _blob(n, 3)
            files[f"{root}/tokenizer.json"] = _json_file({"v": 1})
    for base in DEEPSEEK_BASES.values():
        hub.add(FakeRepo(base, {"main": {"config.json": _json_file(QWEN_CONFIG),
                                         "model.safetensors": FakeFile(None, size=3 * 10**9)}},
                         tags=["transformers", "safetensors"]))
    return hub.add(FakeRepo(DEEPSEEK_ONNX, {"main": files}, tags=[
        "onnx", *(f"base_model:quantized:{b}" for b in DEEPSEEK_BASES.values())]))


def add_two_model_gguf(hub: FakeHub) -> FakeRepo:
    """A GGUF repo with a 1.5B and a 7B model in the same quants (one name scheme)."""
    files = {f"Multi-{size}-Instruct-{q}.gguf":
             FakeFile(gguf_bytes(quant=q, pad=int(QUANT_BPW[q] * (1000 if size == "1.5B"
                                                                    else 4000))), lfs=True)
             for size in ("1.5B", "7B") for q in ("Q4_K_M", "Q8_0")}
    for size in ("1.5B", "7B"):
        hub.add(FakeRepo(f"multiorg/Multi-{size}-Instruct", {"main": {
            "config.json": _json_file(QWEN_CONFIG)}}, tags=["transformers"]))
    return hub.add(FakeRepo("quantfolk/Multi-Instruct-GGUF", {"main": files}, tags=[
        "gguf", "base_model:quantized:multiorg/Multi-1.5B-Instruct",
        "base_model:quantized:multiorg/Multi-7B-Instruct"]))


# --- datacenter-size models (issue 16): original bf16 repos as the Hub lays them out ---

QWEN72B = "Qwen/Qwen2.5-72B-Instruct"
#: Its config.json (the shape that sizes the KV cache).
QWEN72B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
    "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
    "max_window_layers": 70, "rope_theta": 1000000.0, "sliding_window": 131072,
    "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-06, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0,
    "use_cache": True, "transformers_version": "4.43.1"}
#: 72.7 B parameters in bf16: the index's ``total_size`` (from the shape above).
QWEN72B_BYTES = 145_412_407_296
QWEN72B_SHARDS = 37

MIXTRAL = "mistralai/Mixtral-8x22B-Instruct-v0.1"
#: A name whose parameter count misleads: "8x22B" is 141 B parameters, not 22 B.
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 6144,
    "intermediate_size": 16384, "num_hidden_layers": 56, "num_attention_heads": 48,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32768, "max_position_embeddings": 65536, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-05}
#: 140.6 B parameters in bf16 (the Hub shows 261.9 GiB in 59 shards).
MIXTRAL_BYTES = 281_260_142_592


def _sharded_safetensors(total: int, shards: int) -> Files:
    """``model-0000i-of-0000N.safetensors`` with declared sizes summing to ``total`` (never
    served: a plan must not download them) and the index that lists them."""
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    each = total // shards
    sizes = [each] * (shards - 1) + [total - each * (shards - 1)]
    index = {"metadata": {"total_size": total},
             "weight_map": {f"model.layers.{i}.input_layernorm.weight": name
                            for i, name in enumerate(names)}}
    files: Files = {n: FakeFile(None, size=size) for n, size in zip(names, sizes, strict=True)}
    files["model.safetensors.index.json"] = _json_file(index)
    return files


def add_datacenter_models(hub: FakeHub) -> None:
    """Qwen2.5-72B-Instruct and Mixtral-8x22B-Instruct-v0.1 as their original bf16 repos:
    config, tokenizer, the safetensors index and the shards (declared sizes only)."""
    qwen = _sharded_safetensors(QWEN72B_BYTES, QWEN72B_SHARDS)
    qwen.update({
        "config.json": _json_file(QWEN72B_CONFIG),
        "generation_config.json": _json_file({"bos_token_id": 151643, "do_sample": True,
                                              "eos_token_id": [151645, 151643]}),
        "tokenizer.json": _json_file({"v": 1}), "tokenizer_config.json": _json_file({}),
        "vocab.json": _json_file({}), "merges.txt": _text("#version: 0.2"),
        "README.md": _text("# Qwen2.5-72B-Instruct"), "LICENSE": _text("Qwen LICENSE")})
    hub.add(FakeRepo(QWEN72B, {"main": qwen}, tags=[
        "transformers", "safetensors", "qwen2", "text-generation", "conversational"],
        downloads=300000, config={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    mixtral = _sharded_safetensors(MIXTRAL_BYTES, 59)
    mixtral.update({
        "config.json": _json_file(MIXTRAL_CONFIG), "tokenizer.json": _json_file({"v": 1}),
        "tokenizer_config.json": _json_file({}), "README.md": _text("# Mixtral-8x22B")})
    hub.add(FakeRepo(MIXTRAL, {"main": mixtral}, tags=[
        "transformers", "safetensors", "mixtral", "text-generation"], downloads=20000,
        config={"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}))


# --- pointing the real client at it ---


def hub_env(url: str, home: Path) -> dict[str, str]:
    """Environment for a subprocess using the fake Hub and a private HF_HOME."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING")) and k not in ("OLLAMA_MODELS",)}
    env.update({"HF_ENDPOINT": url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_XET": "1",
                "OLLAMA_MODELS": str(home / "no-ollama"),
                "LMSTUDIO_MODELS_DIR": str(home / "no-lmstudio")})
    return env


def patch_client(monkeypatch: Any, url: str, home: Path) -> None:
    """huggingface_hub reads these at import time: patch the module constants too."""
    from huggingface_hub import constants

    for k, v in hub_env(url, home).items():
        monkeypatch.setenv(k, v)
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    values: dict[str, Any] = {
        "ENDPOINT": url,
        "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_URL_HOSTS": frozenset({"127.0.0.1"}),
        "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"), "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored"),
        "AGENT_HARNESSES_PATH": str(home / "agents.json"),
        "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_XET": True, "HF_HUB_DISABLE_UPDATE_CHECK": True,
    }
    for k, v in values.items():
        if hasattr(constants, k):
            monkeypatch.setattr(constants, k, v)


class HubFixture:
    def __init__(self, hub: FakeHub, url: str, home: Path,
                 monkeypatch: Any) -> None:
        self.hub = hub
        self.url = url
        self.home = home
        self.monkeypatch = monkeypatch

    def offline(self, on: bool = True) -> None:
        from huggingface_hub import constants

        self.monkeypatch.setattr(constants, "HF_HUB_OFFLINE", on)

    def fresh_cache(self, name: str) -> None:
        from huggingface_hub import constants

        self.monkeypatch.setattr(constants, "HF_HUB_CACHE", str(self.home / name))

    def env(self) -> dict[str, str]:
        return hub_env(self.url, self.home)


def start(monkeypatch: Any, tmp_path: Path) -> Iterator[HubFixture]:
    hub = standard_hub()
    home = tmp_path / "hf"
    home.mkdir()
    with HubServer(hub) as url:
        patch_client(monkeypatch, url, home)
        yield HubFixture(hub, url, home, monkeypatch)


# --- standalone: `python3 -m tests.hubserver` (scripts/ci_fresh_install.sh) ---

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


#: Where the SmolLM2 OpenVINO / ONNX GenAI fixtures are served (names the planner finds
#: through the base model's tree: the OpenVINO org's ``-int4-ov`` naming, an ``onnx`` repo
#: with the model in a device folder as microsoft's and onnxruntime's repos have it).
SMOLLM2_OV = "OpenVINO/SmolLM2-135M-Instruct-int4-ov"
SMOLLM2_ONNX = "onnx-community/SmolLM2-135M-Instruct-onnx-genai"
SMOLLM2_ONNX_DIR = "cpu_and_mobile/cpu-int4-rtn-block-32"


#: What a model repo's .gitattributes sends to LFS (the Hub's default list, plus what
#: GGUF and ONNX repos add); anything over 10 MiB must be LFS on the Hub anyway.
LFS_SUFFIXES = (".bin", ".onnx", ".data", ".onnx_data", ".gguf", ".safetensors", ".model",
                ".pt", ".pth", ".msgpack", ".h5", ".npz")


def folder_files(folder: Path, under: str = "") -> Files:
    """Every file of a model folder (real bytes), as repo paths below ``under``."""
    prefix = f"{under}/" if under else ""
    out: Files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            lfs = p.name.lower().endswith(LFS_SUFFIXES) or len(data) > 10 * 2**20
            out[prefix + p.relative_to(folder).as_posix()] = FakeFile(data, lfs=lfs)
    return out


def add_smollm2(hub: FakeHub, gguf: Path, *, openvino: Path | None = None,
                onnx: Path | None = None) -> None:
    """SmolLM2-135M-Instruct as the Hub lays it out: the base repo (weights declared,
    never served) and a GGUF repo holding a real, runnable file; given the fixture
    folders, also an OpenVINO IR repo and an ONNX GenAI repo (real, runnable)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "hidden_size": 576, "max_position_embeddings": 8192}
    hub.add(FakeRepo(SMOLLM2, {"main": {
        "config.json": _json_file(config), "README.md": _text("# SmolLM2"),
        "model.safetensors": FakeFile(None, size=269_060_552),
        "tokenizer.json": _json_file({"v": 1})}},
        tags=["transformers", "safetensors", "text-generation"], downloads=800,
        config={"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    quant = gguf.stem.rsplit(".", 1)[-1].rsplit("-", 1)[-1].upper()  # "...Q4_1" -> Q4_1
    hub.add(FakeRepo(f"{SMOLLM2}-GGUF", {"main": {
        f"smollm2-135m-instruct-{quant.lower()}.gguf": FakeFile(gguf.read_bytes(), lfs=True),
        "README.md": _text("# GGUF")}},
        tags=["gguf", f"base_model:quantized:{SMOLLM2}"], downloads=400))
    if openvino is not None:
        hub.add(FakeRepo(SMOLLM2_OV, {"main": {
            **folder_files(openvino), "README.md": _text("# OpenVINO IR")}},
            tags=["openvino", "text-generation", f"base_model:quantized:{SMOLLM2}"],
            downloads=50))
    if onnx is not None:
        hub.add(FakeRepo(SMOLLM2_ONNX, {"main": {
            **folder_files(onnx, SMOLLM2_ONNX_DIR), "README.md": _text("# ONNX GenAI")}},
            tags=["onnx", "text-generation", f"base_model:quantized:{SMOLLM2}"],
            downloads=40))


def main(argv: list[str] | None = None) -> None:
    """Serve standard_hub() (plus SmolLM2, given a GGUF of it) on 127.0.0.1 until killed;
    the URL is printed on stdout and, with --url-file, written there once serving."""
    import argparse
    import contextlib
    import signal
    import sys

    ap = argparse.ArgumentParser(prog="python3 -m tests.hubserver", description=main.__doc__)
    ap.add_argument("--url-file", type=Path, help="write the URL here once serving")
    ap.add_argument("--smollm2-gguf", type=Path,
                    help=f"a SmolLM2-135M-Instruct GGUF to serve as {SMOLLM2}-GGUF")
    args = ap.parse_args(argv)
    hub = standard_hub()
    if args.smollm2_gguf:
        add_smollm2(hub, args.smollm2_gguf)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with HubServer(hub) as url:
        if args.url_file:
            tmp = args.url_file.with_name(args.url_file.name + ".tmp")
            tmp.write_text(url + "\n", encoding="utf-8")
            tmp.replace(args.url_file)  # whole or absent: the reader polls for it
        print(url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: shut down quietly
            threading.Event().wait()


if __name__ == "__main__":
    main()
