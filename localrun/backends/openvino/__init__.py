"""OpenVINO GenAI: OpenVINO IR folders (and, unoptimized, some GGUF files) on CPU, GPU
and NPU. All that localrun knows and does about this engine is here, and nothing here is
imported until a model loads, but its facts:

- ``facts``: its table row, the formats it runs, its memory row, its options (pure data);
- ``session``: the Session (load, encode; LLMPipeline's one sequence at a time);
- ``batcher``: every sequence through ContinuousBatchingPipeline (CPU, GPU);
- ``engine``: the loaded pipeline, as the session hands it to the batcher, and the
  ``GenerationConfig`` a request's sampling becomes;
- ``devices``: device names, the NPU's static lengths, the CPU's precisions;
- ``text``: text pieces for many sequences' tokens at once;
- ``constraints``: structured output through XGrammar; ``embeddings``: the embedding mode.
"""
