"""LoRA adapters on a loaded llama.cpp model, switched per request without a reload.

Each adapter is read once at load (``llama_adapter_lora_init`` on the model: its
weights stay beside the base model's, and go with it); a context computes with the set
``llama_set_adapters_lora`` last put on it. The session's context and the batcher's
each carry a set, put on before a decode when the sequence's set differs
(:meth:`Loras.use`). KV cells computed under one set are not the cells of another: the
session drops its kept prompt cells when the set changes, and the batcher reuses a
slot's cells only for a sequence under the set they were computed with.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from localrun.adapters import Active, Adapter, check_gguf, default_set
from localrun.errors import GenerationError, ModelFileError


class Loras:
    """The adapters loaded on one model, and the set each context has on."""

    def __init__(self, lc: Any, model: Any, adapters: Sequence[Adapter], *,
                 model_path: str, architecture: str | None) -> None:
        self._lc = lc
        self.adapters = tuple(adapters)
        self._handles: dict[str, Any] = {}
        for a in self.adapters:
            check_gguf(a, model_path, architecture)  # before llama.cpp reads its tensors
            handle = lc.llama_adapter_lora_init(model, a.path.encode("utf-8"))
            if not handle:
                raise ModelFileError(a.path, "llama.cpp could not load it as a LoRA adapter "
                                     f"of {model_path} (its tensors do not fit the model's)")
            self._handles[a.label] = handle
        #: the set a request that names none runs under
        self.default: Active = default_set(self.adapters)
        self._on: dict[int, Active] = {}  # context address -> the set it has on

    def key(self, active: Active | None) -> Active:
        """The set a sequence runs under (None: the load-time one)."""
        return self.default if active is None else active

    def use(self, ctx: Any, active: Active | None) -> bool:
        """Put ``active`` on ``ctx``, unless it is on already; True when it changed."""
        key = self.key(active)
        addr = ctx if isinstance(ctx, int) else ctypes.cast(ctx, ctypes.c_void_p).value or 0
        if self._on.get(addr, ()) == key:
            return False
        lc = self._lc
        n = len(key)
        handles = (lc.llama_adapter_lora_p_ctypes * max(n, 1))(
            *[self._handles[name] for name, _ in key])
        scales = (ctypes.c_float * max(n, 1))(*[s for _, s in key])
        rc = lc.llama_set_adapters_lora(ctx, handles, n, scales)
        if rc != 0:
            self._on.pop(addr, None)
            raise GenerationError("llama.cpp", f"llama_set_adapters_lora returned {rc} for "
                                  f"{', '.join(n for n, _ in key) or 'no adapters'}")
        self._on[addr] = key
        return True

    def forget(self, ctx: Any) -> None:
        """A context freed: its address may be another's next."""
        addr = ctx if isinstance(ctx, int) else ctypes.cast(ctx, ctypes.c_void_p).value or 0
        self._on.pop(addr, None)


def load_loras(lc: Any, llm: Any, adapters: Sequence[Adapter], *, model_path: str,
               architecture: str | None) -> Loras | None:
    """The adapters of a load request on ``llm``, the default set put on its context;
    None without adapters."""
    if not adapters:
        return None
    loras = Loras(lc, llm._model.model, adapters, model_path=model_path,
                  architecture=architecture)
    loras.use(llm._ctx.ctx, None)
    return loras


def check_adapters(adapters: Sequence[Adapter], model_path: str,
                   architecture: str | None) -> None:
    """Each adapter's header against the model's, before the model loads."""
    for a in adapters:
        check_gguf(a, model_path, architecture)
