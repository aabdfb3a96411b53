"""Presets (issue 31 item 2): `localrun create NAME --from MODEL ...` or `-f FILE`, used by
name in the CLI (`run`, `plan`) and Python (`localrun.load`), listed by `localrun list`,
removed by `localrun rm NAME` (the preset only). The preset's system prompt and context
reach the real engine (llama.cpp, the embedded SmolLM2-135M); its sampling values sit
between the caller's and the model's own. Names that already mean something are refused;
a bad preset file is one line naming its line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from localrun.naming import presetfile, presets
from tests.conftest import localrun_cmd, requires_llama

SYSTEM = ("You are Captain Hook, a pirate who answers every question in exactly one "
          "short sentence, always mentioning the sea.")


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private localrun home (presets.json) and Hugging Face cache."""
    h = tmp_path / "home"
    monkeypatch.setenv("LOCALRUN_HOME", str(h))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return h


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("LOCALRUN_DEBUG", None)
    return subprocess.run([*localrun_cmd(), *args], capture_output=True, text=True,
                          timeout=180, env=env, cwd=cwd)


def one_error(r: subprocess.CompletedProcess[str]) -> str:
    """The error line of a failed command that printed one line and a hint."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 2 and lines[1].lstrip().startswith("hint:"), r.stderr
    return lines[0]


# -- the file format --------------------------------------------------------------------

FULL = '''# a reviewer
FROM smollm2:135m
SYSTEM """
You review code.
Three bullet points, no more.
"""
PARAMETER temperature 0.2
parameter TOP_P 0.9
PARAMETER top_k 20
PARAMETER min_p 0.05
PARAMETER repeat_penalty 1.1
PARAMETER seed 7
PARAMETER stop "###"
PARAMETER stop "\\n\\nUser:"
PARAMETER num_predict 64
PARAMETER num_ctx 4096
PARAMETER backend llama.cpp
MESSAGE user Is 7 prime?
MESSAGE assistant """- Yes: only 1 and 7 divide it."""
'''


def test_a_file_with_every_field_reads_and_writes_back(home: Path) -> None:
    spec = presetfile.parse(FULL, "Presetfile")
    assert spec.model == "smollm2:135m"
    assert spec.system == "You review code.\nThree bullet points, no more."
    assert spec.sampling == {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                             "repetition_penalty": 1.1, "seed": 7,
                             "stop": ["###", "\n\nUser:"], "max_tokens": 64}
    assert (spec.context, spec.backend) == (4096, "llama.cpp")
    assert spec.messages == [("user", "Is 7 prime?"),
                             ("assistant", "- Yes: only 1 and 7 divide it.")]
    made = presets.make("reviewer", spec.model or "", system=spec.system,
                        sampling=spec.sampling, context=spec.context, backend=spec.backend,
                        messages=spec.messages)
    again = presetfile.parse(presetfile.format_preset(made))
    assert again == spec  # what `localrun show` prints, `create -f` reads back the same


@pytest.mark.parametrize(("text", "line", "needle"), [
    ("FROM smollm2:135m\nSYSTEM hi\nFOO bar\n", 3, "unknown instruction 'FOO'"),
    ("FROM smollm2:135m\nTEMPLATE {{ .Prompt }}\n", 2, "TEMPLATE is not supported: localrun "
     "renders the model's own chat template"),
    ("FROM smollm2:135m\n\nPARAMETER mirostat 2\n", 3, "unknown PARAMETER 'mirostat'"),
    ("FROM smollm2:135m\nPARAMETER top_k lots\n", 2, "PARAMETER top_k takes an integer, "
     "not 'lots'"),
    ("FROM smollm2:135m\nPARAMETER temperature -1\n", 2, "temperature"),
    ("FROM smollm2:135m\nPARAMETER num_ctx 8\n", 2, "16 tokens or more"),
    ("FROM smollm2:135m\nSYSTEM a\nSYSTEM b\n", 3, "SYSTEM again (first on line 2)"),
    ("FROM smollm2:135m\nPARAMETER num_ctx 512\nPARAMETER context 1024\n", 3,
     "again (first on line 2)"),
    ('FROM smollm2:135m\nSYSTEM """\nnever closed\n', 2, 'the """ opened here is never '
     'closed'),
    ("FROM smollm2:135m\nMESSAGE system be nice\n", 2, "use user or assistant"),
    ('FROM smollm2:135m\nPARAMETER stop "unclosed\n', 2, "not a closed JSON string"),
    ("# nothing but a comment\nSYSTEM hi\n", 2, "no FROM line"),
])
def test_a_bad_line_is_named_with_its_number(text: str, line: int, needle: str) -> None:
    with pytest.raises(presetfile.PresetFileError) as info:
        presetfile.parse(text, "Presetfile")
    assert info.value.line == line
    assert info.value.message.startswith(f"Presetfile line {line}: ")
    assert needle in info.value.message
    assert info.value.hint


def test_relative_paths_in_a_file_are_the_files_folder(home: Path, tmp_path: Path,
                                                       default_gguf: Path) -> None:
    folder = tmp_path / "presets"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(default_gguf)
    (folder / "style.gguf").write_bytes(b"GGUF")
    (folder / "Presetfile").write_text("FROM ./model.gguf\nADAPTER style.gguf:0.5\n")
    spec = presetfile.read(folder / "Presetfile")
    assert spec.model == str(folder / "model.gguf")
    assert spec.adapters == [presets.Adapter(str(folder / "style.gguf"), 0.5)]


# -- names ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "why"), [
    ("qwen2.5:0.5b", "it is the catalog alias of Qwen/Qwen2.5-0.5B-Instruct"),
    ("QWEN2.5:0.5B", "it is the catalog alias of"),
    ("qwen2.5:0.5b:Q8_0", "it is the catalog alias of"),
    ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "the shape of a Hub repo id (org/name)"),
    ("me/mybot", "the shape of a Hub repo id (org/name)"),
    ("./mybot", "it is a path"),
    ("~/mybot", "it is a path"),
    ("mybot.gguf", "it is a path"),
    ("smollm2:135m", "a name of the embedded default model"),
    ("default", "a name of the embedded default model"),
    ("ollama:llama3", "another store or on the Hub"),
    ("hf.co/org/x", "another store or on the Hub"),
    ("my bot", "may hold only letters, digits"),
    ("", "it is empty"),
    ("x" * 65, "at most 64"),
    ("folder-here", "a file or folder of that name is in the current folder"),
])
def test_a_name_that_means_something_else_is_refused(home: Path, tmp_path: Path, name: str,
                                                     why: str) -> None:
    (tmp_path / "folder-here").mkdir()
    with pytest.raises(presets.PresetError) as info:
        presets.make(name, "smollm2:135m")
    assert why in info.value.message
    assert not presets.presets_path().exists()  # nothing written


def test_a_preset_from_a_preset_copies_it_one_level(home: Path) -> None:
    presets.save(presets.make("base", "smollm2:135m", system="S", context=1024,
                              sampling={"temperature": 0.2}))
    child = presets.make("child", "base", sampling={"top_k": 5})
    assert (child.model, child.system, child.context) == ("smollm2:135m", "S", 1024)
    assert dict(child.sampling) == {"temperature": 0.2, "top_k": 5}
    presets.save(child)
    presets.save(presets.make("base", "child"))  # no cycle: base is now a copy of child
    assert presets.get("base").model == "smollm2:135m"  # type: ignore[union-attr]
    presets.remove("base")
    assert presets.get("child") == child  # a copy, not a link


def test_the_file_keeps_what_it_cannot_read_and_refuses_to_overwrite_damage(home: Path
                                                                            ) -> None:
    path = presets.presets_path()
    path.parent.mkdir(parents=True)
    future = {"name": "future", "from": "smollm2:135m", "backend": "warp-drive-engine"}
    path.write_text(json.dumps({"version": 9, "presets": [future]}))
    presets.save(presets.make("mine", "smollm2:135m"))
    kept = json.loads(path.read_text())["presets"]
    assert kept[0] == future and kept[1]["name"] == "mine"
    assert [p.name for p in presets.all_presets()] == ["mine"]
    path.write_text('{"presets": [')
    with pytest.raises(presets.PresetError, match="is damaged"):
        presets.save(presets.make("other", "smollm2:135m"))
    assert path.read_text() == '{"presets": ['
    assert presets.lookup("qwen2.5:0.5b") is None  # other names still work
    with pytest.raises(presets.PresetError, match="is damaged"):
        presets.lookup("mine")


def test_lookup_reads_nothing_for_paths_and_hub_ids(home: Path) -> None:
    presets.presets_path().parent.mkdir(parents=True)
    presets.presets_path().write_text("not json")  # would raise if it were read
    for name in ("/x/model.gguf", "./m", "org/name:Q4_K_M", "m.gguf", "smollm2:135m", None):
        assert presets.lookup(name) is None


# -- through the engine -----------------------------------------------------------------------

def _prompt_tokens(model: Any, messages: list[dict[str, str]]) -> int:
    return int(model.chat(messages, max_tokens=1, temperature=0).usage.prompt_tokens)


@requires_llama
def test_load_by_preset_name_reaches_the_engine(home: Path, llama_model: Any) -> None:
    import localrun

    presets.save(presets.make("hook", "smollm2:135m", system=SYSTEM, context=1024,
                              backend="llama.cpp",
                              sampling={"temperature": 0.6, "max_tokens": 3, "seed": 11},
                              messages=[("user", "Hello?"), ("assistant", "Ahoy.")]))
    with localrun.load("hook") as m:
        assert m.preset is not None and m.preset.name == "hook"
        assert (m.info.context_length, m.info.backend) == (1024, "llama.cpp")
        # the preset's values over the model's own (the embedded model's temperature 0.2)
        d = m.defaults
        assert (d.temperature, d.max_tokens, d.seed, d.top_p) == (0.6, 3, 11, 0.9)
        user = {"role": "user", "content": "Where is the gold?"}
        opened = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"},
                  {"role": "assistant", "content": "Ahoy."}, user]
        want = _prompt_tokens(llama_model, opened)
        assert _prompt_tokens(m, [user]) == want
        assert m.count_prompt_tokens([user]) == want  # type: ignore[list-item]
        assert m.batch(["Where is the gold?"], max_tokens=1)[0].usage.prompt_tokens == want
        # the caller's system prompt wins over the preset's
        own = [{"role": "system", "content": "Be brief."}, user]
        assert _prompt_tokens(m, own) == _prompt_tokens(
            llama_model, [own[0], *opened[1:3], user])
        # the caller's values win over the preset's: max_tokens 3 unless asked
        count = "1, 2, 3, 4, 5, 6,"
        assert m.complete(count, temperature=0).usage.completion_tokens == 3
        assert m.complete(count, temperature=0, max_tokens=8).usage.completion_tokens == 8
    with localrun.load("hook", context=512) as m:  # the caller's context wins too
        assert m.info.context_length == 512


@requires_llama
def test_a_preset_whose_adapter_file_is_no_adapter_is_refused_at_load(home: Path,
                                                                     tmp_path: Path) -> None:
    """Its adapters load with its model (tests/test_adapters.py); a file that is no LoRA
    adapter is refused with the reason, never run as the base model."""
    import localrun
    from localrun.adapters import AdapterError

    (tmp_path / "style.gguf").write_bytes(b"GGUF")
    presets.save(presets.make("styled", "smollm2:135m", adapters=[
        presets.parse_adapter(str(tmp_path / "style.gguf") + ":0.5")]))
    with pytest.raises(AdapterError, match=r"style\.gguf is not a LoRA adapter"):
        localrun.load("styled")


@requires_llama
def test_run_and_plan_take_a_preset_name(home: Path, llama_model: Any) -> None:
    r = cli("create", "hook", "--from", "smollm2:135m", "--system", SYSTEM, "--context",
            "1024", "--backend", "llama.cpp", "-t", "0", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Created preset hook: smollm2:135m · system ")
    user = {"role": "user", "content": "Where is the gold?"}
    r = cli("run", "hook", "Where is the gold?", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["info"]["context_length"] == 1024 and out["info"]["backend"] == "llama.cpp"
    assert out["usage"]["prompt_tokens"] == _prompt_tokens(
        llama_model, [{"role": "system", "content": SYSTEM}, user])
    assert out["usage"]["completion_tokens"] <= 4  # the preset's max_tokens
    r = cli("run", "hook", "Where is the gold?", "--json", "--system", "Be brief.", "-n", "6")
    out = json.loads(r.stdout)
    assert out["usage"]["prompt_tokens"] == _prompt_tokens(
        llama_model, [{"role": "system", "content": "Be brief."}, user])
    r = cli("plan", "hook", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["backend"] == "llama.cpp" and plan["format"] == "gguf"


# -- the CLI's other commands -----------------------------------------------------------------

def test_create_list_show_rm(home: Path, tmp_path: Path, default_gguf: Path) -> None:
    r = cli("create", "pirate", "--from", str(default_gguf), "--system", "Arr.",
            "--temperature", "0.3", "--stop", "###", "--context", "2048")
    assert r.returncode == 0, r.stderr
    shown = cli("show", "pirate")
    assert shown.stdout.splitlines()[1:] == [
        f"FROM {default_gguf}", "SYSTEM Arr.", "PARAMETER temperature 0.3",
        "PARAMETER stop ###", "PARAMETER context 2048"]
    (tmp_path / "Presetfile").write_text(shown.stdout)
    r = cli("create", "pirate2", "-f", str(tmp_path / "Presetfile"), "-t", "0.5")
    assert r.returncode == 0, r.stderr
    listed = cli("list", "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    got = {d["name"]: d for d in rows if d.get("kind") == "preset"}
    assert got["pirate"]["parameters"] == {"temperature": 0.3, "stop": ["###"]}
    assert got["pirate2"]["parameters"]["temperature"] == 0.5  # the flag over the file
    assert got["pirate"]["system"] == "Arr." and got["pirate"]["context"] == 2048
    table = cli("list").stdout
    assert "presets (localrun create)" in table and "pirate2" in table
    assert cli("list", "--path", "pirate").stdout == f"{default_gguf}\n"

    r = cli("rm", "pirate")
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("Removed preset pirate (")
    assert default_gguf.exists()  # the model's file stays
    names = {json.loads(line)["name"] for line in cli("list", "--json").stdout.splitlines()}
    assert "pirate" not in names and "pirate2" in names
    assert cli("show", "pirate").returncode == 1


def test_cli_refusals_are_one_line_and_a_hint(home: Path, tmp_path: Path) -> None:
    line = one_error(cli("create", "qwen2.5:0.5b", "--from", "smollm2:135m"))
    assert line == ("error: Cannot name a preset 'qwen2.5:0.5b': it is the catalog alias of "
                    "Qwen/Qwen2.5-0.5B-Instruct")
    line = one_error(cli("create", "org/bot", "--from", "smollm2:135m"))
    assert "the shape of a Hub repo id" in line
    (tmp_path / "Presetfile").write_text("FROM smollm2:135m\nPARAMETER num_gpu 99\n")
    line = one_error(cli("create", "bot", "-f", str(tmp_path / "Presetfile")))
    assert line == f"error: {tmp_path / 'Presetfile'} line 2: unknown PARAMETER 'num_gpu'"
    line = one_error(cli("create", "bot", "--from", "no-such-model-anywhere"))
    assert line.startswith("error: Preset 'bot' cannot be made from 'no-such-model-anywhere'")
    line = one_error(cli("create", "bot"))
    assert line == "error: Nothing to make the preset from"
    assert not presets.presets_path().exists()

