"""vllm/envs.py: the switches vLLM's test helpers read. minivllm is Model Runner V1."""
VLLM_USE_V2_MODEL_RUNNER = False
