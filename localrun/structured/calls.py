"""Tool calls as the API returns them: whole (:class:`ToolCall`) and streamed
(:class:`ToolCallDelta`), in OpenAI's shape."""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

_ALNUM = string.ascii_letters + string.digits


def new_call_id(length: int | None = None) -> str:
    """``call_`` + 24 random characters, or ``length`` alphanumerics (Mistral wants 9)."""
    if length:
        return "".join(secrets.choice(_ALNUM) for _ in range(length))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text (as OpenAI returns it),
    ``parsed`` the same as Python data (a dict, or the pydantic model the tool came
    from)."""

    id: str
    name: str
    arguments: str
    parsed: Any = field(default=None, compare=False)
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry; also what an assistant message takes back."""
        return {"id": self.id, "type": self.type,
                "function": {"name": self.name, "arguments": self.arguments}}

    def json_arguments(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a tool call.

    ``index`` is stable for a call; its first delta carries ``id`` and ``name`` (and no
    arguments), the following ones carry argument fragments whose concatenation is the
    call's ``arguments`` JSON.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's streamed ``delta.tool_calls`` entry."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out
