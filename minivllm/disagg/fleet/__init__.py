"""The P/D fleet on Ray Serve: N prefill and M decode engine replicas, autoscaled by the live
request mix and routed by where the KV is. A folder of its own, as Ray Serve LLM keeps its P/D
serving and its KV-aware routing apart (Ray 2.60's ``ray/llm/_internal/serve/serving_patterns/
prefill_decode/`` and ``routing_policies/kv_aware/``).

- driver.py: ``start_fleet``, ``Fleet`` and the command ``python -m minivllm.disagg.fleet``;
- app.py: the application Serve deploys (``FleetConfig``, ``app_config``, the builder);
- ingress.py: the proxy's two stages over ``DeploymentHandle``s;
- replicas.py: the engine replicas and ``FleetState``, the fleet's records;
- autoscale.py: one policy for both roles;
- kv_index.py, kv_pool.py, kv_router.py: the KV index, each pool's view of it, Serve's routers;
- figure.py: the routing figure drawn from these names.
"""
