"""Disaggregated prefill/decode serving: ``proxy`` (vLLM's toy proxy,
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``), ``launch`` (one KV store, N
prefill + M decode servers and the proxy on one machine) and ``fleet/`` (the same on Ray Serve,
autoscaled and routed by where the KV is)."""
