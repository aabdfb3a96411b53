"""Name → reference: what the user typed, read as a model.

``refs`` reads a name (a path, an alias, a Hub repo with a quant, an Ollama or LM Studio
model, the embedded default); ``catalog`` holds the aliases; ``stores`` the models already
on disk; ``embedded`` the default model's one download; ``presets`` and ``presetfile`` the
user's own names; ``identity`` which catalog model a local file is.
"""
