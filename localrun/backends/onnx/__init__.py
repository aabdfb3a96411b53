"""ONNX Runtime GenAI: everything localrun knows and does about this engine."""
