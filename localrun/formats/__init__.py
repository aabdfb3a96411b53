"""Model formats: detect a model's format from its files alone, and who runs it."""

from localrun.formats.detect import DetectedModel, detect

__all__ = ["DetectedModel", "detect"]
