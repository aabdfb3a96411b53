"""A vision model's projector: the ``mmproj*.gguf`` (architecture ``clip``) that lies
beside a GGUF text model and turns images into its embeddings (llama.cpp's mtmd). The
model loads, is sized (:func:`localrun.memory.local_weights_bytes`) and is downloaded
(:mod:`localrun.hub.variants`) with it."""

from __future__ import annotations

import re
from pathlib import Path

#: a projector's file name (llama.cpp's converter writes ``mmproj-<model>-<type>.gguf``)
MMPROJ = re.compile(r"(?i)mmproj[^/]*\.gguf$")


def projector_beside(model: Path) -> Path | None:
    """The projector GGUF in ``model``'s folder (the first by name whose architecture is
    ``clip``), or None."""
    from localrun.formats.gguf import read_gguf

    here = model.resolve()
    for path in sorted(model.parent.glob("*.gguf")):
        if not MMPROJ.search(path.name) or path.resolve() == here:
            continue
        try:
            if read_gguf(path).architecture == "clip":
                return path
        except Exception:  # a damaged neighbour is not this model's problem
            continue
    return None


#: the files that make a folder a vision-language model for OpenVINO GenAI's VLMPipeline
OPENVINO_VLM_FILES = ("openvino_language_model.xml", "openvino_text_embeddings_model.xml",
                      "openvino_vision_embeddings_model.xml")


def sees_images(path: str | Path) -> bool:
    """Whether the model at ``path`` has a vision part localrun runs: a GGUF with its
    projector beside it, or an OpenVINO VLM folder (Ollama's "vision" capability)."""
    p = Path(path)
    if p.is_file():
        return p.suffix.lower() == ".gguf" and projector_beside(p) is not None
    return p.is_dir() and all((p / f).is_file() for f in OPENVINO_VLM_FILES)
