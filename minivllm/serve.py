"""``python -m minivllm.serve [--model M] [--port P] ...``: the OpenAI-compatible server
(``vllm serve``). The code lives in minivllm/entrypoints/openai/api_server.py."""
from minivllm.entrypoints.openai.api_server import main

if __name__ == "__main__":
    main()
