"""Model management's shapes: Ollama's ``/api/create``, ``/api/copy``, ``/api/delete``, and
the load/unload routes of llama-server's router mode (``/models/load``,
``/models/unload``), which localrun also serves under ``/v1`` for clients whose base URL
ends there.

``/api/create`` takes Ollama's current request (``model``, ``from``, ``system``,
``parameters``, ``messages``) and its older one (``name`` and ``modelfile``, the
Modelfile's text, read as :mod:`localrun.naming.presetfile` reads a preset file). What makes a
new model out of files (``files``, ``quantize``), uploaded LoRA adapters (``adapters``:
adapters load from paths on the server, ``localrun create --adapter``), and a Go
``template`` are refused with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from localrun.server.protocol.common import Int, Shape, invalid
from localrun.server.protocol.ollama import UNSUPPORTED_OPTIONS

#: ``parameters`` names (Ollama's, and localrun's own for the same things) -> the preset
#: field or sampling option each sets
PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "min_p": "min_p", "repeat_penalty": "repetition_penalty",
              "repetition_penalty": "repetition_penalty", "seed": "seed", "stop": "stop",
              "num_predict": "max_tokens", "max_tokens": "max_tokens", "num_ctx": "context",
              "context": "context", "backend": "backend",
              "allow_unoptimized": "allow_unoptimized"}
NO_ADAPTERS = ("localrun takes no LoRA adapter uploads: an adapter loads from a path on the "
               "server (localrun create NAME --from MODEL --adapter PATH there, or "
               "localrun serve MODEL --lora PATH)")
NO_FILES = ("a preset is made from a model localrun can already load: name it in 'from' "
            "(localrun pull NAME downloads one on the server)")


class Parameters(Shape):
    """``/api/create``'s ``parameters``: Ollama's option names (``num_ctx``,
    ``num_predict``, ``repeat_penalty``) or localrun's for the same things."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    num_predict: Int | None = None
    max_tokens: Int | None = None
    num_ctx: Int | None = Field(default=None, ge=16)
    context: Int | None = Field(default=None, ge=16)
    backend: str | None = None
    allow_unoptimized: bool | None = None

    UNKNOWN: ClassVar = UNSUPPORTED_OPTIONS

    def refuse(self) -> None:
        super().refuse()
        seen: dict[str, str] = {}
        for name in type(self).model_fields:
            if getattr(self, name) is None:
                continue
            target = PARAMETERS[name]
            if target in seen:
                raise invalid(f"'{seen[target]}' and '{name}' both set {target}: send one",
                              name)
            seen[target] = name

    def values(self) -> dict[str, Any]:
        """Each value set, under the preset's names (``stop``: a list)."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:  # declared order: the same every run
            value = getattr(self, name)
            if value is None:
                continue
            if name == "stop":
                value = [value] if isinstance(value, str) else list(value)
            out[PARAMETERS[name]] = value
        return out


class CreateMessage(Shape):
    """An example turn (``MESSAGE`` in a Modelfile); a leading ``system`` one is the
    system prompt."""

    role: Literal["system", "user", "assistant"]
    content: str
    images: list[str] | None = None
    thinking: str | None = None

    REFUSED: ClassVar = {"images": ([], "a preset's example turns are text"),
                         "thinking": ("", "a preset's example turns are text")}


class CreateRequest(Shape):
    """``POST /api/create``: a preset (``model``) made from a model or another preset
    (``from``), with its system prompt, parameters and example turns; ``modelfile`` (the
    older request) is a Modelfile's text, whose values the other fields override."""

    model: str | None = None
    name: str | None = None  # the older spelling of ``model``
    from_: str | None = Field(default=None, alias="from")
    system: str | None = None
    parameters: Parameters | None = None
    messages: list[CreateMessage] | None = None
    modelfile: str | None = None
    stream: bool | None = None
    adapters: dict[str, str] | None = None
    files: dict[str, str] | None = None
    quantize: str | None = None
    quantization: str | None = None
    template: str | None = None
    license: str | list[str] | None = None
    path: str | None = None

    REFUSED: ClassVar = {
        "adapters": ({}, NO_ADAPTERS), "files": ({}, NO_FILES),
        "quantize": ("", "localrun does not quantize models; pick a quant when pulling "
                     "(localrun pull org/repo:Q4_K_M)"),
        "quantization": ("", "localrun does not quantize models"),
        "template": ("", "localrun renders the model's own chat template (from its files)"),
        "license": ("", "a preset keeps no license text"),
        "path": ("", "send the Modelfile's text in 'modelfile'")}


class CopyRequest(Shape):
    """``POST /api/copy``: a preset copied under another name; a model (not a preset)
    becomes a new preset that runs it."""

    source: str
    destination: str


class DeleteRequest(Shape):
    """``DELETE /api/delete``: a preset, or what localrun pulled under a name."""

    model: str | None = None
    name: str | None = None  # the older spelling of ``model``


class LoadRequest(Shape):
    """``POST /models/load`` (llama-server's router mode): load a model (or a preset's
    model) now, before any request for it; ``keep_alive`` as Ollama's (seconds or a
    duration such as "10m"; -1 keeps it loaded)."""

    model: str
    keep_alive: str | float | None = None


class UnloadRequest(Shape):
    """``POST /models/unload``: unload a model (a preset's name: its model)."""

    model: str


class Status(BaseModel):
    """``/api/create``'s answer, and each line of its stream."""

    status: str


class Loading(BaseModel):
    """What ``/models/load`` and ``/models/unload`` did (``success`` as llama-server
    answers): ``status`` "loaded", "unloaded", "unloading" (once its requests end) or
    "not loaded"."""

    success: bool
    model: str
    status: str
    context_length: int | None = None
    pinned: bool | None = None
    expires_at: str | None = None
    freed_bytes: int | None = None


def model_name(req: CreateRequest | DeleteRequest) -> str:
    """``model``, or its older spelling ``name``; 400 when neither is there."""
    from localrun.server.errors import bad_request

    name = req.model or req.name
    if not name:
        raise bad_request("Missing required parameter 'model'", "model")
    return name
