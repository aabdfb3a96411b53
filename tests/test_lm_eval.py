"""lm-evaluation-harness against ``localrun serve`` (issue 28 item 2): its
``local-completions`` model runs a multiple-choice (loglikelihood) task with its defaults —
tokenized requests (token-id prompts from the model's Hugging Face tokenizer), ``echo``
with ``logprobs``, several prompts per request (``batch_size`` 4) — and its accuracy
equals the one computed from the same engine's log probabilities in process.

The task is written by the test: a tiny task YAML and a JSON-lines file of questions in
``tmp_path`` (lm-eval's ``--include_path``), nothing downloaded. lm-eval runs from its
own environment (``scripts/make_lmeval_env.py``: lm-eval's datasets and evaluate bring
pins of their own, so it never goes into localrun's) as a subprocess. Its tokenizer is
the Hugging Face folder of the test model (SmolLM2-135M-Instruct, tests/models.py: the
same tokenizer as the served GGUF).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from localrun.server.config import ServerConfig
from tests.conftest import requires_llama
from tests.models import test_model
from tests.serverutil import MODEL, Running, metric, server_fixtures

pytestmark = [requires_llama, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
TASK = "localrun_mc"
BATCH = 4
#: Each is (question, choices, index of the right one).
ITEMS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("Which planet is closest to the Sun?", ["Mars", "Jupiter", "Mercury", "Saturn"], 2),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What colour is the sky on a clear day?", ["green", "blue", "red", "purple"], 1),
    ("Which animal says 'moo'?", ["a cat", "a dog", "a cow", "a duck"], 2),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("How many days are in a week?", ["five", "seven", "nine", "twelve"], 1),
]
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

server_model, srv = server_fixtures(ServerConfig())


def lmeval_python() -> Path:
    """The Python of lm-eval's environment, or skip saying how to make it."""
    env = os.environ.get("LOCALRUN_LMEVAL_PYTHON")
    if env:
        return Path(env)
    folder = Path(os.environ.get("LOCALRUN_LMEVAL_ENV")
                  or Path.home() / ".cache" / "localrun" / "lmeval-env")
    py = folder / "bin" / "python"
    if not py.exists():
        pytest.skip(f"lm-eval's environment is not there ({folder}): run python "
                    "scripts/make_lmeval_env.py")
    return py


def _write_task(folder: Path) -> None:
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in ITEMS), encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=data), encoding="utf-8")


def _expected(model: Any, tokenizer_dir: Path) -> tuple[float, list[list[float]]]:
    """The accuracy and each choice's loglikelihood, from the engine's own log
    probabilities in process: each (context, " " + choice) tokenized as lm-eval does
    (the whole, then the context; the continuation is what follows), the prompt scored
    with ``echo`` and no reply."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    right = 0
    scores: list[list[float]] = []
    for question, choices, answer in ITEMS:
        context = f"Question: {question}\nAnswer:"
        ctx = tok(context, add_special_tokens=False).input_ids
        row = []
        for choice in choices:
            whole = tok(context + " " + choice, add_special_tokens=False).input_ids
            c = model.complete(whole, max_tokens=0, echo=True, logprobs=True)
            assert c.prompt_logprobs is not None
            row.append(sum(e.logprob for e in c.prompt_logprobs[len(ctx):]))
        scores.append(row)
        right += max(range(len(row)), key=row.__getitem__) == answer
    return right / len(ITEMS), scores


def test_lm_eval_multiple_choice_matches_the_engines_logprobs(
        srv: Running, server_model: Any, tmp_path: Path) -> None:
    py = lmeval_python()
    tokenizer_dir = test_model("hf")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_task(tasks)
    out = tmp_path / "out"
    args = ",".join([f"model={MODEL}", f"base_url={srv.v1}/completions",
                     f"tokenizer={tokenizer_dir}", "max_retries=1"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
           "TOKENIZERS_PARALLELISM": "false"}
    answered = metric(srv.url, "localrun_requests_total", endpoint="/v1/completions",
                      model=MODEL, status="200")
    run = subprocess.run(
        [str(py), "-m", "lm_eval", "run", "--model", "local-completions",
         "--tasks", TASK, "--include_path", str(tasks), "--batch_size", str(BATCH),
         "--model_args", args, "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # 32 (context, choice) pairs in requests of BATCH prompts each: batched for real
    requests = metric(srv.url, "localrun_requests_total", endpoint="/v1/completions",
                      model=MODEL, status="200") - answered
    pairs = sum(len(c) for _, c, _ in ITEMS)
    assert requests == -(-pairs // BATCH), requests
    results = json.loads(Path(glob.glob(str(out / "**" / "results_*.json"),
                                        recursive=True)[0]).read_text())
    acc = results["results"][TASK]["acc,none"]
    want_acc, want_scores = _expected(server_model, tokenizer_dir)
    assert acc == pytest.approx(want_acc, abs=1e-9)
    # and each choice's loglikelihood, as lm-eval read it from the server's answers
    samples = [json.loads(line) for line in Path(glob.glob(
        str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)[0]).read_text(
        ).splitlines()]
    assert len(samples) == len(ITEMS)
    for sample in samples:
        got = [float(r[0]) for r in sample["filtered_resps"]]
        assert got == pytest.approx(want_scores[sample["doc_id"]], abs=2e-3), sample["doc_id"]
