"""llama.cpp through llama-cpp-python: GGUF models on CPU, CUDA, Metal or Vulkan. All that
localrun knows and does about this engine is here, and nothing here is imported until a
model loads, but its facts:

- ``facts``: its table row, the formats it runs, its memory row, its options (pure data);
- ``session``: the Session (load, encode, one sequence at a time, KV reuse across calls);
- ``batcher``: many sequences at once in a second context over the same weights;
- ``engine``: the loaded model, as the session hands it to the batcher;
- ``devices``: where a model goes (device words, free VRAM, partial offload);
- ``sampling``: the sampler chains, in transformers' order;
- ``memory``: what the KV cache takes, and the batch slots that fit;
- ``reuse``: which cached cells a prompt may keep;
- ``constraints``: the structured-output mask; ``embeddings``: the embedding mode;
- ``openmp``: OpenMP worker pools given back by threads done with them.
"""
