"""The engine's scheduler in virtual time (DESIGN.md 5.8: ``python -m minivllm.sim``). No vLLM
package: vLLM has no simulator; this one runs vLLM's own scheduling code, minivllm's mirror of it.

- ``cost_model.py``: a step's shape and its time (``StepShape``, ``CostModel``), fitted on this
  machine by ``profile.py`` (``python -m minivllm.sim profile``);
- ``worker.py``: ``SimulatedWorker``, the worker ``EngineCore`` builds when
  ``ParallelConfig.worker_cls`` names it: no model, a virtual clock;
- ``engine.py``: ``SimEngine``, the real ``EngineCore`` driven in virtual time;
- ``trace.py``: JSON-lines traces and their generators;
- ``transfer.py``: the KV pull between P and D as a time (``TransferCost``), its hub and the pull
  connector whose scheduler half runs unchanged;
- ``fleet.py``: the fleet on SimPy (replicas as simulated engines, the ingress with the fleet's own
  KV index and P/D decision), colocated serving as a configuration of it; ``cli_fleet.py``: ``sim
  fleet``;
- ``plan.py``: ``sim plan``, goodput per instance for colocated N and P/D counts under SLOs;
- ``validate.py``: ``sim validate``, the same trace through the real engine or fleet and the
  simulator, per request; the stored checks in ``validation/``, the fitted profile in ``profiles/``.

The engine never imports this package (pyproject.toml's import contract).
"""
