"""A local imitation of the Hugging Face Hub, for the real huggingface_hub client.

Serves on 127.0.0.1 (random port) what huggingface_hub 1.x/2.x asks for:

- ``GET /api/models/{repo}[/revision/{rev}]``: id, sha, siblings, tags, gated, cardData, config
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: files with size, oid and ``lfs{oid,size}``
- ``GET /api/models/{repo}/refs``: branches (EXL2 bpw branches)
- ``GET /api/models?filter=&search=&author=&sort=&limit=``: search (filters ANDed)
- ``HEAD/GET /{repo}/resolve/{rev}/{path}``: X-Repo-Commit, ETag / X-Linked-Etag (the
  sha256 for LFS files), X-Linked-Size, Content-Length, Accept-Ranges; Range -> 206
- errors through ``X-Error-Code``: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo

Fault injection: ``drop_once`` (send half a file, then close the connection) and
``corrupt_once`` (send the right length with wrong bytes), each for one (repo, path);
``fail_paths``: request paths (regular expressions) answered with a 500.
Every request is recorded in ``requests`` for assertions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

GATED_TOKEN = "hf_test_token_granted"


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


@dataclass
class FakeRepo:
    id: str
    branches: dict[str, dict[str, FakeFile]]
    tags: list[str] = field(default_factory=list)
    gated: str | bool = False
    config: dict[str, Any] | None = None
    card_data: dict[str, Any] | None = None
    downloads: int = 0

    def sha(self, branch: str) -> str:
        h = hashlib.sha1(f"{self.id}@{branch}".encode())
        for path, f in sorted(self.branches[branch].items()):
            h.update(path.encode() + f.sha256.encode())
        return h.hexdigest()

    def resolve(self, rev: str) -> str | None:
        """A branch name or commit sha -> branch name."""
        if rev in self.branches:
            return rev
        for b in self.branches:
            if self.sha(b) == rev:
                return b
        return None


class FakeHub:
    """The repos, the request log, and fault injection; serve with :class:`HubServer`."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[dict[str, Any]] = []
        self.drop_once: set[tuple[str, str]] = set()
        self.corrupt_once: set[tuple[str, str]] = set()
        self.fail_paths: set[str] = set()
        self.lock = threading.Lock()

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.id] = repo
        return repo

    def resolve_requests(self, method: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.requests if "/resolve/" in r["path"]
                and (method is None or r["method"] == method)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub  # set on the subclass

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return None

    # -- helpers
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

    def _json(self, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(obj).encode(), headers)

    def _error(self, status: int, code: str, message: str,
               headers: dict[str, str] | None = None) -> None:
        h = {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})}
        self._send(status, json.dumps({"error": message}).encode(), h)

    def _record(self) -> None:
        with self.hub.lock:
            self.hub.requests.append({"method": self.command, "path": self.path,
                                      "headers": dict(self.headers.items())})

    def do_HEAD(self) -> None:
        self._record()
        self._route()

    def do_GET(self) -> None:
        self._record()
        self._route()

    # -- routing
    def _route(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        if any(re.search(p, path) for p in self.hub.fail_paths):
            return self._error(500, "InternalError", "injected failure")
        if path == "/api/models":
            return self._search(query)
        m = re.match(r"^/api/models/([^/]+/[^/]+)(/.*)?$", path)
        if m:
            return self._api(m.group(1), m.group(2) or "", query)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3))
        self._error(404, "NotFound", "no such endpoint")

    def _repo(self, rid: str) -> FakeRepo | None:
        repo = self.hub.repos.get(rid)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        return repo

    def _info(self, repo: FakeRepo, branch: str) -> dict[str, Any]:
        files = repo.branches[branch]
        return {
            "id": repo.id, "_id": repo.id, "modelId": repo.id, "author": repo.id.split("/")[0],
            "sha": repo.sha(branch), "private": False, "gated": repo.gated,
            "disabled": False, "downloads": repo.downloads, "likes": 0, "tags": repo.tags,
            "library_name": next((t for t in repo.tags if t in ("gguf", "mlx", "openvino")),
                                 None),
            "cardData": repo.card_data or {}, "config": repo.config,
            "siblings": [{"rfilename": p} for p in sorted(files)],
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
        }

    def _api(self, rid: str, rest: str, query: dict[str, list[str]]) -> None:
        repo = self._repo(rid)
        if repo is None:
            return
        if rest in ("", "/"):
            return self._json(self._info(repo, "main" if "main" in repo.branches
                                         else next(iter(repo.branches))))
        m = re.match(r"^/revision/([^/]+)$", rest)
        if m:
            branch = repo.resolve(m.group(1))
            if branch is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            return self._json(self._info(repo, branch))
        if rest == "/refs":
            return self._json({
                "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": repo.sha(b)}
                             for b in repo.branches],
                "tags": [], "converts": []})
        m = re.match(r"^/tree/([^/]+)(?:/(.*))?$", rest)
        if m:
            branch = repo.resolve(m.group(1))
            if branch is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            under = (m.group(2) or "").strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            return self._json(self._tree(repo.branches[branch], under, recursive))
        self._error(404, "NotFound", "no such endpoint")

    def _tree(self, files: dict[str, FakeFile], under: str, recursive: bool) -> list[Any]:
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
            if not all(f in repo.tags for f in filters):
                continue
            if search and search not in repo.id.lower():
                continue
            if author and repo.id.split("/")[0] != author:
                continue
            found.append(repo)
        if (query.get("sort") or [""])[0] == "downloads":
            found.sort(key=lambda r: -r.downloads)
        self._json([{"id": r.id, "_id": r.id, "modelId": r.id, "tags": r.tags,
                     "downloads": r.downloads, "likes": 0, "private": False,
                     "gated": r.gated}
                    for r in found[:limit]])

    def _resolve(self, rid: str, rev: str, path: str) -> None:
        repo = self._repo(rid)
        if repo is None:
            return
        branch = repo.resolve(unquote(rev))
        if branch is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        commit = repo.sha(branch)
        if repo.gated and self.headers.get("Authorization") != f"Bearer {GATED_TOKEN}":
            return self._error(401, "GatedRepo",
                               "Access to model is restricted. You must have access to it "
                               "and be authenticated to access it. Please log in.",
                               {"X-Repo-Commit": commit})
        f = repo.branches[branch].get(path)
        if f is None:
            return self._error(404, "EntryNotFound", "Entry not found",
                               {"X-Repo-Commit": commit})
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes",
                   "ETag": f'"{f.sha256 if f.is_lfs else f.git_oid}"'}
        if f.is_lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(f.length)
        if f.data is None:
            if self.command == "HEAD":
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(f.length))
                self.end_headers()
                return None
            return self._error(500, "VirtualFile", "test bug: a virtual file was downloaded")
        data = f.data
        rng = self.headers.get("Range")
        if self.command == "HEAD":
            return self._send(200, data, headers, "application/octet-stream")
        key = (rid, path)
        if rng:
            m = re.match(r"bytes=(\d+)-(\d*)", rng)
            assert m, rng
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(data) - 1
            end = min(end, len(data) - 1)
            part = data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(206, part, headers, "application/octet-stream")
        with self.hub.lock:
            drop = key in self.hub.drop_once
            corrupt = key in self.hub.corrupt_once
            self.hub.drop_once.discard(key)
            self.hub.corrupt_once.discard(key)
        if drop:
            # Promise the whole file, send half, hang up: the client must resume with Range.
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return None
        if corrupt:
            data = bytes(b ^ 0xFF for b in data)
        return self._send(200, data, headers, "application/octet-stream")


class HubServer:
    """Run a FakeHub on 127.0.0.1 in a thread: ``with HubServer(hub) as url: ...``."""

    def __init__(self, hub: FakeHub) -> None:
        handler = type("Handler", (_Handler,), {"hub": hub})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


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
    # bartowski: other naming, with imatrix and mmproj files that must be ignored.
    bart = {f"Qwen2.5-0.5B-Instruct-{q}.gguf":
            FakeFile(gguf_bytes(quant=q, pad=int(QUANT_BPW[q] * 1000) + 7), lfs=True)
            for q in ("Q4_K_M", "Q6_K", "Q8_0")}
    bart["Qwen2.5-0.5B-Instruct.imatrix"] = _blob(2000, 3)
    bart["mmproj-Qwen2.5-0.5B-Instruct-f16.gguf"] = FakeFile(gguf_bytes(quant="F16", pad=50))
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


def add_smollm2(hub: FakeHub, gguf: Path) -> None:
    """SmolLM2-135M-Instruct as the Hub lays it out: the base repo (weights declared,
    never served) and a GGUF repo holding a real, runnable file."""
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
