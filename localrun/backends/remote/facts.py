"""The remote engine's facts: an OpenAI-compatible server elsewhere (vLLM, SGLang,
``localrun serve``). Nothing to install or plan here; its options say where the server
is. Pure data."""

from __future__ import annotations

from localrun.backends.spec import BackendSpec

SPEC = BackendSpec(
    name="remote", title="remote OpenAI-compatible server",
    module="localrun.backends.remote.session", dists=("httpx2",), extra=None,
    home="nowhere", formats=("remote",), loads=(), conditions={},
    quant=None, target_bpw=None,
    convert="none: the server has the model", min_compute=None,
    options={
        "base_url": ("text", "the server's address, e.g. http://127.0.0.1:8000/v1"),
        "api_key": ("text", "sent as 'Authorization: Bearer KEY'"),
        "timeout": ("number", "seconds to wait for the next byte of a reply "
                              "(default 600)"),
    },
    aliases=("openai", "sglang"), builds=(),
    memory={}, default_device="*",  # the server's memory, not this host's
    embedder=None,
)
