"""ExLlamaV2 and ExLlamaV3: EXL2/EXL3 models on NVIDIA (and AMD) GPUs. Both engines live
here, with what they share, and nothing here imports either engine until a model loads.

Both engines need CUDA to import at all (``import exllamav2`` raises ``OSError:
CUDA_HOME environment variable is not set`` on a host without it), so everything that
can be decided without the engine lives in its own module and is tested on any machine.
One module a job; nothing here imports another on import of the package:

- :mod:`.facts`: both engines' table rows, formats, memory rows and options (pure data);
- :mod:`.v2`, :mod:`.v3`: each engine's loading and sampler code, and its ``BACKEND``;
- :mod:`.options`: the load options (``kv_cache``, ``gpu_split``, ``tensor_parallel``,
  ``paged``), their table (:data:`~.options.OPTIONS`) and validation;
- :mod:`.errors`: what a failed import, load or job means for the user;
- :mod:`.folder`: the model folder's special tokens, every end-of-sequence id, the
  quant label and the weights' size (the chat template itself is
  :func:`localrun.backends.hf_config.read_chat_template`);
- :mod:`.vram`: the context that fits the free VRAM (KV bytes from
  :mod:`localrun.memory`), and how the model is split across GPUs;
- :mod:`.probe`: the GPUs this host has and what torch sees free on them;
- :mod:`.jobs`: jobs on the engine: both engines' dynamic generators share ``enqueue /
  iterate / cancel`` and the result dicts they return, which become GenerationStats;
  ``JobBatcher`` is the session's Batcher;
- :mod:`.constraints`: both engines' structured-output filters;
- :mod:`.session`: :class:`~.session.ExLlamaSession`, both sessions but for the
  engine-specific loading and sampler code in :mod:`.v2` and :mod:`.v3`.

How localrun's sampling options map onto the engines:

====================  ==============================  ==================================
localrun              ExLlamaV2Sampler.Settings       exllamav3 ComboSampler
====================  ==============================  ==================================
temperature 0         temperature 1, top_k 1,         temperature 0 (argmax)
                      top_p 0 (the engine's greedy)
temperature > 0       temperature (< 0.01 is greedy   temperature
                      in the engine's kernel)
top_p (1 = off)       top_p                           top_p
top_k (0 = off)       top_k                           top_k
min_p (0 = off)       min_p                           min_p
repetition_penalty    token_repetition_penalty over   rep_p over the whole sequence
                      the whole sequence (range -1)
seed                  job seed (the driver's)         job seed (the driver's)
max_tokens            max_new_tokens (the driver      max_new_tokens
                      clamped it to the context)
every other filter    off (DRY, XTC, mirostat, ...)   off
EOS                   stop_conditions = every id of generation_config.json, config.json
                      and the tokenizer (``stop_conditions=None`` never stops on EOS)
stop strings          localrun's driver (the engine gets token ids only)
====================  ==============================  ==================================
"""
