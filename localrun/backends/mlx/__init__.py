"""MLX through mlx-lm: MLX-quantized folders on Apple Silicon (Metal) or Linux (CPU). All
that localrun knows and does about this engine is here, and nothing here is imported
until a model loads, but its facts:

- ``facts``: its table row, the formats it runs, its memory row (pure data);
- ``session``: the Session (load, encode, one sequence through ``generate_step``);
- ``batcher``: many sequences at once through mlx-lm's ``BatchGenerator``;
- ``engine``: the loaded model, as the session hands it to the batcher, and the one mlx
  thread of the process;
- ``sampling``: each sequence's sampler and logits processors, with its own seed;
- ``reuse``: the prompt caches kept between calls (KV reuse);
- ``constraints``: the structured-output mask as a logits processor.
"""
