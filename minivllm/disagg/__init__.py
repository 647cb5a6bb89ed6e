"""Disaggregated prefill/decode serving: ``proxy`` (vLLM's example proxy) and ``launch`` (one KV
store, N prefill + M decode servers and the proxy on one machine)."""
