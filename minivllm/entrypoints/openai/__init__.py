"""The OpenAI-compatible server (vllm/entrypoints/openai/): ``python -m minivllm.serve``."""
