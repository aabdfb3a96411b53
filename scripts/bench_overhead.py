"""What localrun adds on top of each engine: the same greedy generation, both ways.

For every engine that is installed, has a localrun backend and has a model here, this
runs the same prompt for the same number of tokens through the engine's own API and
through ``localrun`` (``Model.stream``, raw, greedy), alternating the two so drift on a
busy machine hits both alike, and prints per engine: TTFT and decode time (first token
to last) for both, the TTFT difference and the decode-time ratio.

Target: localrun adds under 3% to decode time and under 10 ms to TTFT.

    .venv/bin/python scripts/bench_overhead.py                 # every engine available
    .venv/bin/python scripts/bench_overhead.py --backend llama.cpp --tokens 128 --runs 9
    .venv/bin/python scripts/bench_overhead.py --profile       # cProfile of the localrun path
    .venv/bin/python scripts/bench_overhead.py --temperature 1 --top-p 0.9   # sampling

With ``--temperature`` (> 0) both paths sample, with the same options and seed: the
engine with its own samplers, localrun with what it does about them (ONNX: its own
top_p and min_p masks; llama.cpp and MLX: the temperature before the filters).

Models: llama.cpp uses the embedded SmolLM2-135M GGUF; the others the fixtures listed in
~/.cache/localrun/test-models/manifest.json (scripts/make_test_models.py makes them).
Each run uses a different prompt (a different first word), the same for both paths, so
no engine reuses the previous request's KV cache. Every prompt is raw text (no chat
template) in both paths. The process's load average is printed: on a shared machine
rerun when it is quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localrun.bench import GREEDY, exact_prompt

MANIFEST = Path(os.environ.get("LOCALRUN_TEST_MODELS") or "~/.cache/localrun/test-models"
               ).expanduser() / "manifest.json"
#: The seed of every sampled run, on both paths.
SEED = 1234
FIXTURE_KEYS = {"llama.cpp": "gguf-q4_1", "mlx": "mlx-4bit", "openvino": "openvino-int4",
                "onnx": "onnx-int4"}


@dataclass
class Timing:
    ttft: float
    decode: float  # first token to last token
    tokens: int

    @property
    def per_token(self) -> float:
        return self.decode / max(self.tokens - 1, 1)


def timed(stream: Iterator[object]) -> Timing:
    """Time an iterator of generated pieces: TTFT, decode time, count."""
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    for _ in stream:
        last = time.perf_counter()
        if not first:
            first = last
        n += 1
    return Timing(first - t0, last - first, n)


# -- each engine's own API -----------------------------------------------------------------

def direct_llama_cpp(path: str, n_ctx: int, threads: int, sampling: dict[str, Any]
                     ) -> Callable[[str, int], Timing]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                          n_gpu_layers=-1, verbose=False)
    eos = llm.token_eos()
    opts = {**GREEDY, **sampling}

    def pieces(text: str, n_tokens: int) -> Iterator[bytes]:
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        llm.set_seed(SEED)
        gen = llm.generate(tokens, top_k=int(opts["top_k"]), top_p=opts["top_p"],
                           min_p=opts["min_p"], typical_p=1.0, temp=opts["temperature"],
                           repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                           mirostat_mode=0)
        try:
            for n, tok in enumerate(gen, 1):
                if tok == eos:
                    break
                yield llm.detokenize([tok])
                if n >= n_tokens:
                    break
        finally:
            gen.close()

    return lambda text, n: timed(pieces(text, n))


def direct_openvino(path: str, n_ctx: int, threads: int, sampling: dict[str, Any]
                    ) -> Callable[[str, int], Timing]:
    import openvino_genai as ov

    # The same precision localrun's backend sets on CPU (f32 compute and KV cache), so
    # that only the wrapper differs (localrun runs it through ContinuousBatchingPipeline).
    pipe = ov.LLMPipeline(path, "CPU", KV_CACHE_PRECISION="f32",
                          INFERENCE_PRECISION_HINT="f32")

    def run(text: str, n_tokens: int) -> Timing:
        config = ov.GenerationConfig()
        config.max_new_tokens = n_tokens
        config.do_sample = bool(sampling)
        if sampling:
            config.temperature = sampling["temperature"]
            config.top_p = sampling["top_p"]
            config.top_k = int(sampling["top_k"]) or 2**64 - 1  # 0: no limit
            config.min_p = sampling["min_p"]
            config.rng_seed = SEED
        config.apply_chat_template = False
        stamps: list[float] = []

        def streamer(_piece: str) -> Any:
            stamps.append(time.perf_counter())
            return ov.StreamingStatus.RUNNING

        t0 = time.perf_counter()
        result = pipe.generate([text], config, streamer)
        tokens = len(result.perf_metrics.raw_metrics.m_new_token_times) or len(stamps)
        if not stamps:
            return Timing(time.perf_counter() - t0, 0.0, 0)
        return Timing(stamps[0] - t0, stamps[-1] - stamps[0], tokens)

    return run


def direct_onnx(path: str, n_ctx: int, threads: int, sampling: dict[str, Any]
                ) -> Callable[[str, int], Timing]:
    import onnxruntime_genai as og

    model = og.Model(path)
    tokenizer = og.Tokenizer(model)

    def pieces(text: str, n_tokens: int) -> Iterator[str]:
        ids = tokenizer.encode(text)
        params = og.GeneratorParams(model)
        # the engine's own top_p; it has no min_p
        params.set_search_options(max_length=len(ids) + n_tokens, do_sample=bool(sampling),
                                  **({"temperature": sampling["temperature"],
                                      "top_p": sampling["top_p"],
                                      "top_k": int(sampling["top_k"]), "random_seed": SEED}
                                     if sampling else {}))
        gen = og.Generator(model, params)
        stream = tokenizer.create_stream()
        gen.append_tokens(ids)
        n = 0
        while not gen.is_done() and n < n_tokens:
            gen.generate_next_token()
            n += 1
            yield stream.decode(int(gen.get_next_tokens()[0]))

    return lambda text, n: timed(pieces(text, n))


def direct_mlx(path: str, n_ctx: int, threads: int, sampling: dict[str, Any]
               ) -> Callable[[str, int], Timing]:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(path)
    opts = {**GREEDY, **sampling}
    sampler = make_sampler(temp=opts["temperature"], top_p=opts["top_p"],
                           min_p=opts["min_p"], top_k=int(opts["top_k"]))

    def pieces(text: str, n_tokens: int) -> Iterator[str]:
        mx.random.seed(SEED)
        for resp in mlx_lm.stream_generate(model, tokenizer, text, max_tokens=n_tokens,
                                           sampler=sampler):
            yield resp.text

    return lambda text, n: timed(pieces(text, n))


DIRECT = {"llama.cpp": direct_llama_cpp, "openvino": direct_openvino, "onnx": direct_onnx,
          "mlx": direct_mlx}


# -- localrun --------------------------------------------------------------------------------

def via_localrun(model: Any, sampling: dict[str, Any]) -> Callable[[str, int], Timing]:
    opts = {**GREEDY, **sampling, "seed": SEED}

    def run(text: str, n_tokens: int) -> Timing:
        t0 = time.perf_counter()
        first = last = 0.0
        with model.stream(text, raw=True, max_tokens=n_tokens, **opts) as stream:
            for chunk in stream:
                if chunk.text:
                    last = time.perf_counter()
                    if not first:
                        first = last
        # ONNX Runtime GenAI recomputes a finished reply's KV rows in the background (its
        # "settling", onnx_genai's docstring), wasted here (every run has a new prompt):
        # wait for it, so that it does not run while the engine's own path is timed
        settled = getattr(model._session, "_settled", None)
        if settled is not None:
            settled.wait(60)
        # Chunks are text pieces; the token count is the Completion's.
        return Timing(first - t0, last - first, stream.completion.usage.completion_tokens)

    return run


def model_path(backend: str) -> str | None:
    if backend == "llama.cpp":
        from localrun.naming.stores import default_model_path

        return str(default_model_path())
    try:
        models = json.loads(MANIFEST.read_text())["models"]
    except (OSError, ValueError, KeyError):
        return None
    p = models.get(FIXTURE_KEYS[backend])
    return p if p and Path(p).exists() else None


def available(backend: str) -> str | None:
    """Why this backend cannot be measured here, or None if it can."""
    import importlib.util

    from localrun.backends import BACKENDS, is_installed

    if not is_installed(backend):
        return "engine not installed"
    if importlib.util.find_spec(BACKENDS[backend].module) is None:
        return "no localrun backend module yet"
    if model_path(backend) is None:
        return f"no fixture model ({FIXTURE_KEYS[backend]} in {MANIFEST})"
    return None


def measure(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    import localrun
    from localrun.backends.llama_cpp.devices import default_threads

    path = model_path(backend)
    assert path is not None
    threads = args.threads or default_threads()
    n_ctx = args.prompt_tokens + args.tokens + 16
    # Both paths set n_threads and leave n_threads_batch at llama-cpp-python's default,
    # as localrun does (it takes no n_threads_batch engine option).
    opts: dict[str, Any] = {"threads": threads} if backend == "llama.cpp" else {}
    model = localrun.load(path, backend=backend, context=n_ctx, **opts)
    sampling: dict[str, Any] = {} if not args.temperature else {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "min_p": args.min_p}
    direct = DIRECT[backend](path, n_ctx, threads, sampling)
    ours = via_localrun(model, sampling)
    prompts = [exact_prompt(model.count_tokens, args.prompt_tokens, seed=1000 + i)
               for i in range(args.runs + args.warmup)]
    rows: dict[str, list[Timing]] = {"engine": [], "localrun": []}
    for i, text in enumerate(prompts):
        order = [("engine", direct), ("localrun", ours)]
        if i % 2:
            order.reverse()
        for name, fn in order:
            t = fn(text, args.tokens)
            if i >= args.warmup:
                rows[name].append(t)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for text in prompts[: max(2, args.runs // 2)]:
            ours(text, args.tokens)
        prof.disable()
        out = Path(args.profile_out or f"overhead-{backend}.prof")
        prof.dump_stats(str(out))
        print(f"\n[{backend}] cProfile of the localrun path (saved to {out}):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    model.close()

    def med(name: str, attr: str) -> float:
        return statistics.median(getattr(t, attr) for t in rows[name])

    def low(name: str, attr: str) -> float:
        return min(getattr(t, attr) for t in rows[name])

    return {
        "backend": backend, "engine_version": model.info.engine_version, "path": path,
        "threads": threads if backend == "llama.cpp" else None, "sampling": sampling or "greedy",
        "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "runs": args.runs,
        "tokens_engine": [t.tokens for t in rows["engine"]],
        "tokens_localrun": [t.tokens for t in rows["localrun"]],
        "ttft_engine_ms": med("engine", "ttft") * 1e3,
        "ttft_localrun_ms": med("localrun", "ttft") * 1e3,
        "ttft_added_ms": (med("localrun", "ttft") - med("engine", "ttft")) * 1e3,
        "ttft_added_min_ms": (low("localrun", "ttft") - low("engine", "ttft")) * 1e3,
        "decode_engine_ms": med("engine", "decode") * 1e3,
        "decode_localrun_ms": med("localrun", "decode") * 1e3,
        "decode_ratio": med("localrun", "per_token") / med("engine", "per_token"),
        "decode_ratio_min": low("localrun", "per_token") / low("engine", "per_token"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="all",
                    help="comma-separated: llama.cpp, openvino, onnx, mlx (default: all)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens to generate (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    ap.add_argument("--runs", type=int, default=7, help="measured runs per path (default 7)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (both paths)")
    ap.add_argument("--profile", action="store_true", help="cProfile the localrun path")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature on both paths (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature")
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="with --temperature (ONNX Runtime GenAI's own path has none)")
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--json", default=None, help="also write the results as JSON")
    args = ap.parse_args()
    wanted = list(DIRECT) if args.backend == "all" else [
        b.strip() for b in args.backend.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"{args.prompt_tokens} prompt tokens, {args.tokens} generated, {args.runs} runs "
          "(medians; 'min' columns compare the best runs); "
          + (f"sampling: temperature {args.temperature}, top_p {args.top_p}, top_k "
             f"{args.top_k}, min_p {args.min_p}, seed {SEED}" if args.temperature
             else "greedy"))
    results = []
    for backend in wanted:
        if backend not in DIRECT:
            print(f"{backend}: unknown backend (choose from {', '.join(DIRECT)})")
            return 2
        why = available(backend)
        if why:
            print(f"{backend:10s} skipped: {why}")
            continue
        r = measure(backend, args)
        results.append(r)
        ok = r["decode_ratio"] < 1.03 and r["ttft_added_ms"] < 10
        print(f"{backend:10s} {r['engine_version']:>10s}  TTFT engine {r['ttft_engine_ms']:7.2f} ms"
              f"  localrun {r['ttft_localrun_ms']:7.2f} ms  added {r['ttft_added_ms']:+6.2f} ms"
              f" (min {r['ttft_added_min_ms']:+6.2f})  | decode engine "
              f"{r['decode_engine_ms']:8.1f} ms  localrun {r['decode_localrun_ms']:8.1f} ms  "
              f"ratio {r['decode_ratio']:.4f} (min {r['decode_ratio_min']:.4f})  "
              f"tokens {r['tokens_engine'][0]}/{r['tokens_localrun'][0]}  "
              f"{'within target' if ok else 'OVER TARGET'}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
