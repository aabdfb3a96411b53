"""vLLM as a managed child process: everything localrun knows and does about it."""
