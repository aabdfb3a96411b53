"""The GPU verification kit: run.py (on the GPU machine), its runner, spec and helpers."""
