"""The conformance suite against the real vLLM 0.32 (a package, so its conftest does not shadow tests/conftest.py)."""
