"""`import localrun` and `localrun --help` must import no engine and stay fast."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("llama_cpp", "mlx", "mlx_lm", "openvino", "openvino_genai", "onnxruntime_genai",
         "exllamav2", "exllamav3", "torch", "transformers", "numpy", "huggingface_hub")

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))
"""


def _loaded(body: str) -> list[str]:
    code = PROBE.format(body=body, heavy=set(HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_localrun_loads_no_engine() -> None:
    assert _loaded("import localrun") == []


def test_help_loads_no_engine() -> None:
    body = (
        "import sys, io, contextlib\n"
        "sys.argv = ['localrun', '--help']\n"
        "from localrun.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n        main()\n    except SystemExit:\n        pass\n"
        "assert 'chat' in buf.getvalue(), buf.getvalue()\n"
    )
    assert _loaded(body) == []


def test_subcommand_help_loads_no_engine() -> None:
    body = (
        "import sys, io, contextlib\n"
        "sys.argv = ['localrun', 'run', '--help']\n"
        "from localrun.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main()\n    except SystemExit:\n        pass\n"
    )
    assert _loaded(body) == []
