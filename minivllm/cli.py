"""The ``minivllm`` console script (vllm/entrypoints/cli/main.py): ``minivllm serve [MODEL] ...``
starts the OpenAI-compatible server with vLLM's flag names."""
from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        print("usage: minivllm serve [MODEL] [--port P] [--host H] ... (minivllm serve --help)",
              file=sys.stderr)
        sys.exit(2)
    from minivllm.entrypoints.openai.api_server import main as serve_main
    serve_main(argv[1:])


if __name__ == "__main__":
    main()
