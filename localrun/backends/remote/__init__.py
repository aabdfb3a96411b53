"""Any OpenAI-compatible server as an engine: everything localrun knows and does about it."""
