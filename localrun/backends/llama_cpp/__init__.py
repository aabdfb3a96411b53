"""llama.cpp through llama-cpp-python: everything localrun knows and does about this engine."""
