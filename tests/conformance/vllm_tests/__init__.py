"""vLLM 0.32's own unit tests for the components minivllm mirrors, run against minivllm (README there)."""
