"""Any OpenAI-compatible server as an engine (vLLM, SGLang, another ``localrun serve``):
``facts`` (its table row: nothing to install, its options say where the server is),
``session`` (the client and the Session), ``streams`` (every sequence its own streaming
request: the Batcher), ``tools`` (tools through the server's own tool support). The vLLM
engine (:mod:`localrun.backends.vllm`) runs on top of it."""
