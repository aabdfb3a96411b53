"""localrun: one Python API over the local LLM inference engines.

    import localrun
    with localrun.load("smollm2:135m") as model:
        print(model.chat("What is 2+2?", temperature=0).text)

Importing localrun imports no engine; engines load inside ``load()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localrun.adapters import Adapter, AdapterError
from localrun.errors import (
    ContextOverflowError,
    EngineNotInstalledError,
    FormatMismatchError,
    InvalidSamplingError,
    LocalrunError,
    ModelFileError,
    StructuredOutputError,
    UnknownModelError,
)
from localrun.structured.calls import ToolCall, ToolCallDelta
from localrun.types import CancelToken, Chunk, Completion, Message, ModelInfo, Timings, Usage

__version__ = "0.1.0"

if TYPE_CHECKING:
    from localrun.api import Model, Stream, load
    from localrun.backends.base import Footprint
    from localrun.batch import BatchError, BatchItem
    from localrun.hardware import HardwareProfile, detect_hardware
    from localrun.planning.plan import plan
    from localrun.planning.selection import Plan

__all__ = [
    "Adapter",
    "AdapterError",
    "BatchError",
    "BatchItem",
    "CancelToken",
    "Chunk",
    "Completion",
    "ContextOverflowError",
    "EngineNotInstalledError",
    "Footprint",
    "FormatMismatchError",
    "HardwareProfile",
    "InvalidSamplingError",
    "LocalrunError",
    "Message",
    "Model",
    "ModelFileError",
    "ModelInfo",
    "Plan",
    "Stream",
    "StructuredOutputError",
    "Timings",
    "ToolCall",
    "ToolCallDelta",
    "UnknownModelError",
    "Usage",
    "__version__",
    "detect_hardware",
    "load",
    "plan",
]

_LAZY = {"load": "localrun.api", "Model": "localrun.api", "Stream": "localrun.api",
         "plan": "localrun.planning.plan", "detect_hardware": "localrun.hardware",
         "HardwareProfile": "localrun.hardware", "Plan": "localrun.planning.selection",
         "BatchItem": "localrun.batch", "BatchError": "localrun.batch",
         "Footprint": "localrun.backends.base"}


def __getattr__(name: str) -> Any:
    # api pulls in jinja2 (templates) lazily too; keep `import localrun` minimal.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'localrun' has no attribute {name!r}")
