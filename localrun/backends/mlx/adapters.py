"""An mlx-lm adapter folder on MLX, at load: ``mlx_lm.load(path, adapter_path=...)``
turns the targeted layers into LoRA layers with the folder's weights; a scale other
than 1 multiplies each layer's own (the folder's ``lora_parameters.scale``). One adapter,
for the life of the loaded model: MLX runs a batch through one set of weights, so a
request cannot choose another (``localrun.adapters.ENGINES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from localrun.adapters import Adapter, AdapterError


def adapter_path(adapters: Sequence[Adapter]) -> str | None:
    """The folder ``mlx_lm.load`` takes (None: none, or the one given at scale 0)."""
    on = [a for a in adapters if a.scale != 0]
    return on[0].path if on else None


def scale_layers(model: Any, adapters: Sequence[Adapter]) -> int:
    """Multiply each LoRA layer's scale by the adapter's; the number of layers."""
    on = [a for a in adapters if a.scale != 0]
    if not on:
        return 0
    n = 0
    for _, module in model.named_modules():
        if hasattr(module, "lora_a") and hasattr(module, "scale"):
            module.scale = module.scale * on[0].scale
            n += 1
    if n == 0:
        raise AdapterError(f"{on[0].path} changed no layer of the model",
                           hint="give an mlx-lm LoRA adapter folder (fine_tune_type lora)")
    return n


def load_error(adapter: str, model: str, error: Exception) -> AdapterError:
    """mlx-lm's refusal of an adapter whose tensors do not fit the model, in one line."""
    first = str(error).strip().splitlines()
    why = "; ".join(line.strip() for line in first[:3])[:300]
    return AdapterError(f"The adapter {adapter} does not fit the model {model} ({why})",
                        hint="load the adapter on the base model it was trained from")
