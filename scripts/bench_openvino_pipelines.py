"""OpenVINO GenAI: one multi-turn chat through the engine's pipelines, for KV reuse.

The options weighed for reusing a conversation's KV cache (docs/results/kv_reuse.md, "The
options measured"), each driven directly through openvino_genai (not through localrun),
on the ``openvino-int4`` fixture (scripts/make_test_models.py):

- ``llm``: ``LLMPipeline`` with SDPA attention and an f32 KV cache, a whole prompt a call
  (what localrun ran before it took the batching pipeline);
- ``chat``: ``LLMPipeline`` chat mode (``start_chat``): only the new part of a prompt that
  extends the history goes in, any other prompt restarts the chat;
- ``cb-prefix``: ``ContinuousBatchingPipeline`` with prefix caching, driven by
  ``add_request``/``step`` as localrun drives it (the path localrun takes);
- ``cb``: the same without prefix caching.

A system prompt and six user turns, greedy replies of ``--reply`` tokens, the replies
fed back as the assistant's turns. Per path and round it prints "prompt tokens:TTFT ms"
for each turn and the median decode time per token; at the end, whether the paths'
replies were the same text turn by turn. Compute is the engine's default on the CPU
(bf16 where the CPU has AVX-512 BF16 or AMX; the CB paths with a bf16 KV cache);
``--f32`` computes and caches in f32 everywhere.

    .venv/bin/python scripts/bench_openvino_pipelines.py                       # all four
    .venv/bin/python scripts/bench_openvino_pipelines.py --paths llm cb-prefix --rounds 2
    .venv/bin/python scripts/bench_openvino_pipelines.py --reply 8 --f32

Not a test: the numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PATHS = ("llm", "chat", "cb-prefix", "cb")
SYSTEM = "You are a helpful assistant. Answer in a few plain sentences."
TURNS = ["Tell me about the sea.", "Why is it salty?", "What lives at the bottom?",
         "How deep is the deepest part?", "Who first went down there?", "What did they see?"]

#: one call's result: the reply's token ids, TTFT, decode seconds per token
Timed = tuple[list[int], float, float]


class Engine:
    """One way of running a prompt (token ids) to a greedy reply through openvino_genai."""

    def __init__(self, og: Any, path: str, reply: int, eos: set[int]) -> None:
        self.og, self.path, self.reply, self.eos = og, path, reply, eos

    def config(self) -> Any:
        g = self.og.GenerationConfig()
        g.max_new_tokens = self.reply
        g.do_sample = False
        g.num_beams = 1
        g.stop_token_ids = set(self.eos)
        return g

    def tensor(self, ids: list[int]) -> Any:
        import numpy as np
        import openvino

        return openvino.Tensor(np.asarray([ids], dtype=np.int64))

    def run(self, ids: list[int]) -> Timed:
        raise NotImplementedError


def timed(stamps: list[float], tokens: list[int], t0: float) -> Timed:
    return tokens, stamps[0] - t0, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)


class LLM(Engine):
    def __init__(self, og: Any, path: str, reply: int, eos: set[int],
                 props: dict[str, Any]) -> None:
        super().__init__(og, path, reply, eos)
        self.pipe = og.LLMPipeline(path, "CPU", **props)

    def streamer(self, stamps: list[float], tokens: list[int]) -> Any:
        og = self.og

        class Stamps(og.StreamerBase):  # type: ignore[misc, name-defined]
            def write(self, token: int | list[int]) -> Any:
                for t in token if isinstance(token, list) else [token]:
                    stamps.append(time.perf_counter())
                    tokens.append(t)
                return og.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        return Stamps()

    def generate(self, ids: list[int]) -> tuple[Timed, Any]:
        stamps: list[float] = []
        tokens: list[int] = []
        t0 = time.perf_counter()
        result = self.pipe.generate(self.tensor(ids), self.config(),
                                    self.streamer(stamps, tokens))
        return timed(stamps, tokens, t0), result

    def run(self, ids: list[int]) -> Timed:
        return self.generate(ids)[0]


class Chat(LLM):
    """Chat mode: only the part past the history when the prompt extends it, else a restart."""

    history: list[int] | None = None

    def run(self, ids: list[int]) -> Timed:
        if self.history is not None and ids[:len(self.history)] == self.history:
            delta = ids[len(self.history):]
        else:
            with warnings.catch_warnings():  # deprecated for ChatHistory: measured as it is
                warnings.simplefilter("ignore", DeprecationWarning)
                self.pipe.finish_chat()
                self.pipe.start_chat()
            delta = ids
        out, result = self.generate(delta)
        self.history = ids + list(result.tokens[0])
        return out


class CB(Engine):
    def __init__(self, og: Any, path: str, reply: int, eos: set[int], prefix: bool,
                 props: dict[str, Any]) -> None:
        super().__init__(og, path, reply, eos)
        sc = og.SchedulerConfig()
        sc.max_num_batched_tokens = 1024  # as localrun's (openvino_batch.open_pipeline)
        sc.dynamic_split_fuse = True
        sc.enable_prefix_caching = prefix
        self.pipe = og.ContinuousBatchingPipeline(path, sc, "CPU", props)
        self.calls = 0

    def run(self, ids: list[int]) -> Timed:
        self.calls += 1
        stamps: list[float] = []
        tokens: list[int] = []
        t0 = time.perf_counter()
        handle = self.pipe.add_request(self.calls, self.tensor(ids), self.config())
        while True:
            self.pipe.step()
            while handle.can_read():
                for res in handle.read().values():
                    for t in res.generated_ids:
                        stamps.append(time.perf_counter())
                        tokens.append(t)
            if handle.get_status() != self.og.GenerationStatus.RUNNING:
                return timed(stamps, tokens, t0)


def make(og: Any, kind: str, path: str, reply: int, eos: set[int], f32: bool) -> Engine:
    compute = {"INFERENCE_PRECISION_HINT": "f32"} if f32 else {}
    if kind in ("llm", "chat"):
        props = {"KV_CACHE_PRECISION": "f32", "ATTENTION_BACKEND": "SDPA", **compute}
        return (LLM if kind == "llm" else Chat)(og, path, reply, eos, props)
    props = {"KV_CACHE_PRECISION": "f32" if f32 else "bf16", **compute}
    return CB(og, path, reply, eos, kind == "cb-prefix", props)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--reply", type=int, default=32, help="greedy tokens a reply")
    ap.add_argument("--rounds", type=int, default=1, help="conversations per path")
    ap.add_argument("--f32", action="store_true", help="f32 compute and KV cache everywhere")
    args = ap.parse_args()
    from bench_batch import fixture_or_exit

    path = fixture_or_exit("openvino")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import openvino_genai as og

    tok = og.Tokenizer(path)
    eos = {tok.get_eos_token_id()}
    engines = {k: make(og, k, path, args.reply, eos, args.f32) for k in args.paths}

    def render(messages: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        return [int(t) for t in tok.encode(text, add_special_tokens=False).input_ids.data[0]]

    print(f"load average {os.getloadavg()[0]:.1f}; replies of {args.reply} tokens; "
          f"{'f32' if args.f32 else 'engine-default'} compute", flush=True)
    for engine in engines.values():  # warm-up: first-call costs off the clock
        engine.run(render([{"role": "user", "content": "Hello."}]))
    texts: dict[str, list[str]] = {}
    for _ in range(args.rounds):
        for kind, engine in engines.items():
            messages = [{"role": "system", "content": SYSTEM}]
            cells, per_token, texts[kind] = [], [], []
            for turn in TURNS:
                messages.append({"role": "user", "content": turn})
                ids = render(messages)
                tokens, ttft, per = engine.run(ids)
                text = tok.decode([t for t in tokens if t not in eos])
                messages.append({"role": "assistant", "content": text})
                cells.append(f"{len(ids)}:{ttft * 1000:.0f}")
                per_token.append(per)
                texts[kind].append(text)
            print(f"{kind:10} {' '.join(cells)}  decode "
                  f"{statistics.median(per_token) * 1000:.1f} ms/token", flush=True)
    for i in range(len(TURNS)):
        replies = [texts[k][i] for k in engines]
        print(f"turn {i + 1}: " + ("same replies" if len(set(replies)) == 1 else
                                   "differ: " + " | ".join(repr(r[:60]) for r in replies)))


if __name__ == "__main__":
    main()
