"""ONNX Runtime GenAI: GenAI model folders (genai_config.json + model.onnx) on CPU, CUDA
and DirectML. All that localrun knows and does about this engine is here, and nothing
here is imported until a model loads, but its facts:

- ``facts``: its table row, the formats it runs, its memory row, its GPU builds (pure data);
- ``session``: the Session (one kept Generator, localrun's sampler, settled replies);
- ``devices``: its device names and the build each needs;
- ``reuse``: which of the kept Generator's rows a new prompt may reuse.
"""
