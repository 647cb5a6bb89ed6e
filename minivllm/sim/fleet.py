"""The fleet in virtual time: N prefill and M decode replicas (or N colocated ones) behind the
fleet's own router, each replica the real engine's scheduler on a simulated worker (engine.py
``SimEngine``), as a discrete-event simulation. No vLLM file (vLLM has no simulator; Vidur and
LLMServingSim simulate clusters the same way, at the scheduler's level). The article's
"Disaggregated P/D" as it runs in practice: "N vLLM prefill instances and M vLLM decode instances".

On SimPy (``simpy``, MIT licence), not salabim: its processes are plain Python generators
(``yield env.timeout(dt)``), so an engine replica's loop reads like the engine loop it stands for;
it has no GUI or animation dependencies, it is small, widely used and well kept, and its event loop
costs a few microseconds per event, far below one engine step's scheduling.

What runs for real, and what is simulated:
- **Arrivals** from a trace (trace.py: JSON lines, Poisson, multi-turn), streamed: a trace of
  100,000 requests is never held as a list, and a finished request's state is dropped. A
  conversation's next turn is sent once its previous turn finished (the multi-turn benchmark's
  closed loop, as ``SimEngine.run_trace``).
- **The ingress** (``SimIngress``) does what disagg/fleet/ingress.py does, with the same functions
  imported from disagg/fleet/kv_index.py: ``prompt_block_hashes`` of the prompt; the decode replica
  picked first (``KVIndex.prefix_blocks`` per replica -> ``Candidate`` -> ``pick``, Dynamo's score,
  the load term the prompt blocks the ingress has in flight there, counted as it places them);
  ``needs_remote_prefill`` decides whether a prefill replica, picked the same way, prefills first.
  Each pool's ``KVIndex`` is fed by the simulated engines' own ``BlockStored`` / ``BlockRemoved``
  events (core/kv_events_block_pool.py), applied when their step ends; ``kv_event_delay_s`` and
  ``kv_event_loss`` make them late or lost (a wrong index costs a cache miss, never a request).
- **The replicas**: ``SimEngine``s, each the real ``EngineCore`` (scheduler, KV cache manager,
  prefix cache) with a simulated worker whose step time comes from the cost model. A P/D replica's
  KV connector is ``SimPullConnector`` (transfer.py): its scheduler half is ``ZmqPullConnector``'s,
  unchanged (what D pulls, P holding its blocks until D has read them), its worker half runs in
  virtual time: a pull takes ``TransferCost.time_s(bytes)``, the bytes from the model's KV size.
- **Colocated serving** (``num_colocated``): N engines doing prefill and decode together (chunked
  prefill), behind the same router without the P/D split: the same simulator, so the comparison
  is fair.

Output: per request ``request_id``, ``ttft_s`` (arrival at the ingress to the first token from the
decode replica), ``itl_s`` (its mean inter-token latency), ``e2e_s``; the summary
(``engine.summarize``'s keys: TTFT and ITL p50 / p90, makespan, requests), plus the fleet's counts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import random
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import simpy

from minivllm.config import KVTransferConfig, VllmConfig
from minivllm.disagg.fleet.kv_index import (OVERLAP_SCORE_WEIGHT, Candidate, KVIndex,
                                            needs_remote_prefill, pick, prompt_block_hashes)
from minivllm.distributed.kv_transfer.base import KVConnectorOutput
from minivllm.sim.cost_model import CostModel
from minivllm.sim.engine import SimEngine
from minivllm.sim.trace import TraceRequest
from minivllm.sim.transfer import (TRANSFER_COSTS, KVTransferHub, TransferCost,
                                   sim_kv_transfer_config)
from minivllm.sim.worker import SimulatedWorker

ROUTERS = ("kv", "round_robin")
# The fleet's default (disagg/fleet/app.py FleetConfig.pd_min_uncached_tokens): decode computes
# a prompt itself when it holds all but this many of its tokens.
PD_MIN_UNCACHED_TOKENS = 64
PD_WORKER = "minivllm.sim.fleet.PDSimulatedWorker"


class PDSimulatedWorker(SimulatedWorker):
    """The simulated worker with a KV connector's worker half (``SimPullConnector``'s, in virtual
    time), built in ``init_device`` as the real worker builds its connector
    (worker/worker.py ``init_worker_distributed_environment``). Around each step it does what the
    real model runner's connector half does (worker/kv_connector_model_runner_mixin.py
    ``_get_kv_connector_output`` and ``finalize_kv_connector``): bind the step's metadata, start
    the loads, then ``wait_for_save``, the finished transfers into the step's
    ``KVConnectorOutput`` and ``clear_connector_metadata`` (the connector's stats are left out:
    no scheduler reads them)."""

    def init_device(self) -> None:
        super().init_device()
        from minivllm.distributed.kv_transfer import ensure_kv_transfer_initialized
        self.kv_connector = ensure_kv_transfer_initialized(self.vllm_config)
        self.last_reported = False     # the last step reported a finished transfer

    def execute_model(self, scheduler_output: Any) -> Any:
        connector = self.kv_connector
        if scheduler_output.kv_connector_metadata is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv(None)
        self._finished_req_ids = scheduler_output.finished_req_ids
        output = super().execute_model(scheduler_output)
        if output is not None:          # a step that scheduled nothing: no forward to wait for
            self._finalize_kv_connector(output, forward=False)
        return output

    def sample_tokens(self) -> Any:
        output = super().sample_tokens()
        self._finalize_kv_connector(output, forward=True)
        return output

    def _finalize_kv_connector(self, output: Any, forward: bool) -> None:
        connector = self.kv_connector
        kv_out = KVConnectorOutput()
        try:
            if forward:
                connector.wait_for_save()
            kv_out.finished_sending, kv_out.finished_recving = connector.get_finished(
                self._finished_req_ids)
            kv_out.invalid_block_ids = connector.get_block_ids_with_load_errors()
        finally:
            connector.clear_connector_metadata()
        output.kv_connector_output = kv_out
        self.last_reported = bool(kv_out.finished_sending or kv_out.finished_recving)


class FleetEngine(SimEngine):
    """A ``SimEngine`` whose worker is ``PDSimulatedWorker`` (P/D replicas)."""
    worker_cls = PD_WORKER


@dataclass
class SimFleetConfig:
    """One fleet: ``num_prefill`` + ``num_decode`` replicas (P/D), or ``num_colocated`` replicas
    doing both (then the P/D counts are ignored). ``router``: "kv" (the fleet's, by the KV each
    replica holds) or "round_robin". ``pd_min_uncached_tokens``, ``overlap_score_weight``: the
    fleet command's flags of the same names. ``transfer``: one pull's cost; ``num_pull_threads``:
    pulls one decode replica runs at once (the connector's default). ``kv_event_delay_s`` /
    ``kv_event_loss``: KV events applied late, or a fraction of the batches lost (seeded)."""
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    router: str = "kv"
    pd_min_uncached_tokens: int = PD_MIN_UNCACHED_TOKENS
    overlap_score_weight: float = OVERLAP_SCORE_WEIGHT
    transfer: TransferCost = TRANSFER_COSTS["zmq_pull"]
    num_pull_threads: int = 2
    kv_event_delay_s: float = 0.0
    kv_event_loss: float = 0.0
    seed: int = 0
    record_routes: bool = False

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}.")
        if self.num_colocated < 0 or self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("replica counts must be >= 0.")
        if not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a P/D fleet needs at least one prefill and one decode replica "
                             f"(got {self.num_prefill}P {self.num_decode}D); for one engine "
                             "doing both, num_colocated=1.")
        if not 0.0 <= self.kv_event_loss <= 1.0 or self.kv_event_delay_s < 0:
            raise ValueError("kv_event_loss must be in [0, 1] and kv_event_delay_s >= 0.")

    @property
    def colocated(self) -> bool:
        return self.num_colocated > 0

    @property
    def num_instances(self) -> int:
        return self.num_colocated or self.num_prefill + self.num_decode

    def label(self) -> str:
        return (f"colocated x{self.num_colocated}" if self.colocated
                else f"{self.num_prefill}P{self.num_decode}D")


@dataclass(slots=True)
class _Flight:
    """A request between the ingress and its last token (dropped then)."""
    index: int
    arrival_s: float
    prompt_token_ids: Optional[list[int]]      # kept until the decode replica has it
    output_tokens: int
    num_blocks: int
    conversation: Optional[str]
    decode: Any = None
    prefill: Any = None
    remote: bool = False


@dataclass
class RequestRecord:
    """What the fleet reports per request (seconds, virtual)."""
    index: int
    request_id: str
    arrival_s: float
    ttft_s: float
    itl_s: Optional[float]
    e2e_s: float
    num_output_tokens: int
    decode: str
    prefill: Optional[str]

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "ttft_s": self.ttft_s, "itl_s": self.itl_s,
                "e2e_s": self.e2e_s}


@contextlib.contextmanager
def fewer_collections(freeze: bool = False) -> Iterator[None]:
    """Python's cyclic garbage collector, run less often inside the block (and, with ``freeze``,
    blind to every object made before it), then as it was. A fleet's engines are long-lived
    objects by the hundred thousand (every replica's KV blocks): with the default thresholds the
    collector scans them over and over, half the simulation's time at 100 replicas. Nothing the
    engines decide depends on it."""
    old = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        gc.set_threshold(*old)


class SimReplica:
    """One engine replica as a SimPy process: step while there is work, each step taking the cost
    model's time; asleep while nothing can run (no request, or only transfers to wait for) until
    an arrival or a finished transfer wakes it."""

    def __init__(self, fleet: "SimFleet", name: str, role: str, engine: SimEngine) -> None:
        self.fleet, self.name, self.role, self.engine = fleet, name, role, engine
        self.env: simpy.Environment = fleet.env
        self.stepping = False
        self.num_steps = 0
        self.busy_s = 0.0
        self._wake: Optional[simpy.Event] = None
        self._poked = False
        self.process = self.env.process(self._run())

    def poke(self) -> None:
        """Something changed (an arrival, a finished transfer): step again if asleep."""
        if self._wake is not None:
            if not self._wake.triggered:
                self._wake.succeed()
        else:
            self._poked = True

    def add(self, request_id: str, prompt_token_ids: list[int], output_tokens: int,
            kv_transfer_params: Optional[dict] = None) -> None:
        if not self.stepping:      # idle: its clock catches up with the fleet's
            self.engine.worker.advance_clock_to(self.env.now)
        self.engine.add_request(request_id, prompt_token_ids, output_tokens,
                                arrival_s=self.env.now, kv_transfer_params=kv_transfer_params)
        self.poke()

    def _sleep(self) -> simpy.Event:
        if self._poked:
            self._poked = False
            return self.env.timeout(0)
        self._wake = self.env.event()
        return self._wake

    def _run(self) -> Iterator[simpy.Event]:
        engine, env, hub = self.engine, self.env, self.fleet.hub
        worker = engine.worker
        reports = isinstance(worker, PDSimulatedWorker)    # a connector's finished transfers
        while True:
            if not engine.has_requests():
                yield self._sleep()
                self._wake = None
                continue
            worker.advance_clock_to(env.now)
            self.stepping = True
            result = engine.step()
            dt = result.end_s - result.start_s
            if dt > 0:
                yield env.timeout(dt)
                self.busy_s += dt
            self.stepping = False
            self.num_steps += 1
            self.fleet.on_step(self, result)
            if hub is not None and hub.has_pending(self.name):
                continue                      # a finished transfer to report: step again
            so = result.scheduler_output
            if ((so is None or so.total_num_scheduled_tokens == 0)
                    and not (reports and worker.last_reported)) or \
                    not engine.has_unfinished_requests():
                # Nothing can run until an arrival or a finished transfer: a step now would
                # schedule nothing (a prefill replica holding blocks for a pull, a decode
                # replica whose requests wait for theirs). Asleep, it costs nothing.
                yield self._sleep()
                self._wake = None


class SimIngress:
    """The fleet's ingress (disagg/fleet/ingress.py ``FleetIngress.handle``) in virtual time."""

    def __init__(self, fleet: "SimFleet") -> None:
        self.fleet = fleet
        c = fleet.config
        self.pools = ("colocated",) if c.colocated else ("prefill", "decode")
        self.index = {pool: KVIndex() for pool in self.pools}
        # In flight per replica, as this ingress placed them: requests, and their prompt blocks.
        self.ongoing = {pool: Counter() for pool in self.pools}
        self.blocks_in_flight = {pool: Counter() for pool in self.pools}
        self._round_robin = {pool: itertools.cycle(sorted(fleet.replicas[pool]))
                             for pool in self.pools}
        self.routes: list[dict] = []
        self.num_remote_prefills = 0
        self.num_local_prefills = 0

    def choose(self, pool: str, hashes: list[bytes]) -> tuple[str, int]:
        """``PoolView.choose`` (disagg/fleet/kv_pool.py): every replica as a ``Candidate`` (its
        prefix of ``hashes`` in the pool's index, the blocks in flight there), Dynamo's score,
        the lowest wins. -> (replica, its cached blocks)."""
        index = self.index[pool]
        if self.fleet.config.router == "round_robin":
            name = next(self._round_robin[pool])
            return name, index.prefix_blocks(name, hashes)
        ongoing, blocks = self.ongoing[pool], self.blocks_in_flight[pool]
        candidates = [Candidate(name, index.prefix_blocks(name, hashes), blocks[name],
                                ongoing[name])
                      for name in self.fleet.replica_names[pool]]
        best = pick(candidates, len(hashes), self.fleet.config.overlap_score_weight)
        if self.fleet.config.record_routes:
            self._last_candidates = [(c.replica, c.cached_blocks, c.score) for c in candidates]
        return best.replica, best.cached_blocks

    def count(self, pool: str, replica: str, num_blocks: int, sign: int) -> None:
        self.ongoing[pool][replica] += sign
        self.blocks_in_flight[pool][replica] += sign * num_blocks

    def admit(self, flight: _Flight, request_id: str) -> None:
        """A request at the ingress: pick, decide, send (``FleetIngress.handle``)."""
        fleet, c = self.fleet, self.fleet.config
        ids = flight.prompt_token_ids
        hashes = prompt_block_hashes(ids, fleet.block_size)
        flight.num_blocks = len(hashes)
        route = None
        if c.colocated:
            name, cached = self.choose("colocated", hashes)
            flight.decode = name
            self.count("colocated", name, flight.num_blocks, +1)
            if c.record_routes:
                route = {"request_id": request_id, "pick": name, "cached_blocks": cached,
                         "candidates": self._last_candidates, "remote_prefill": False}
            fleet.replicas["colocated"][name].add(request_id, ids, flight.output_tokens)
            flight.prompt_token_ids = None
        else:
            name, cached = self.choose("decode", hashes)
            flight.decode = name
            flight.remote = needs_remote_prefill(len(ids), cached, fleet.block_size,
                                                 c.pd_min_uncached_tokens)
            if c.record_routes:
                route = {"request_id": request_id, "pick": name, "cached_blocks": cached,
                         "candidates": self._last_candidates, "remote_prefill": flight.remote,
                         "prefill": None}
            # The decode pick counts as in flight from now (through the prefill too).
            self.count("decode", name, flight.num_blocks, +1)
            if flight.remote:
                self.num_remote_prefills += 1
                pname, pcached = self.choose("prefill", hashes)
                flight.prefill = pname
                if route is not None:
                    route["prefill"] = {"pick": pname, "cached_blocks": pcached,
                                        "candidates": self._last_candidates}
                self.count("prefill", pname, flight.num_blocks, +1)
                # proxy.prefill_body: one token, and keep the KV for a remote decode.
                fleet.replicas["prefill"][pname].add(request_id, ids, 1,
                                                     {"do_remote_decode": True})
            else:
                self.num_local_prefills += 1
                fleet.replicas["decode"][name].add(request_id, ids, flight.output_tokens)
                flight.prompt_token_ids = None
        if route is not None:
            self.routes.append(route)

    def prefilled(self, flight: _Flight, request_id: str, kv_transfer_params: Optional[dict]
                  ) -> None:
        """The prefill replica answered: the decode call, with its ``kv_transfer_params`` (None
        when P could not hold the blocks: D then computes the prompt itself)."""
        self.count("prefill", flight.prefill, flight.num_blocks, -1)
        self.fleet.replicas["decode"][flight.decode].add(
            request_id, flight.prompt_token_ids, flight.output_tokens, kv_transfer_params)
        flight.prompt_token_ids = None

    def finished(self, flight: _Flight) -> None:
        pool = "colocated" if self.fleet.config.colocated else "decode"
        self.count(pool, flight.decode, flight.num_blocks, -1)

    def apply_events(self, replica: SimReplica, events: list) -> None:
        c, pool = self.fleet.config, replica.role
        if c.kv_event_loss and self.fleet.rng.random() < c.kv_event_loss:
            self.fleet.num_event_batches_lost += 1
            return
        if c.kv_event_delay_s:
            timer = self.fleet.env.timeout(c.kv_event_delay_s)
            timer.callbacks.append(lambda _: self.index[pool].apply(replica.name, events))
        else:
            self.index[pool].apply(replica.name, events)


class SimFleet:
    """One fleet in virtual time (module docstring). ``vllm_config``: every replica's engine
    configuration (``engine.make_vllm_config``); ``cost_model``: each replica's step times."""

    def __init__(self, config: SimFleetConfig, vllm_config: VllmConfig, cost_model: CostModel,
                 bytes_per_token: Optional[int] = None) -> None:
        self.config = config
        self.cost_model = cost_model
        self.env = simpy.Environment()
        self.rng = random.Random(config.seed)
        self.block_size = vllm_config.cache_config.block_size
        self.vocab_size = int(vllm_config.hf_config.vocab_size)
        self.num_event_batches_lost = 0
        self.hub: Optional[KVTransferHub] = None
        self.replicas: dict[str, dict[str, SimReplica]] = {}
        roles = ({"colocated": config.num_colocated} if config.colocated
                 else {"prefill": config.num_prefill, "decode": config.num_decode})
        if not config.colocated:
            probe = SimulatedWorker(vllm_config)
            self.hub = KVTransferHub(self.env, config.transfer,
                                     bytes_per_token or probe.kv_cache_bytes_per_token(),
                                     self.block_size, self._transfer_ready,
                                     config.num_pull_threads)
        self._by_name: dict[str, SimReplica] = {}
        with fewer_collections():
            for role, n in roles.items():
                self.replicas[role] = {}
                for i in range(n):
                    name = f"{role}-{i:02d}"
                    engine = self._make_engine(role, name, vllm_config)
                    replica = SimReplica(self, name, role, engine)
                    self.replicas[role][name] = self._by_name[name] = replica
        self.replica_names = {role: sorted(r) for role, r in self.replicas.items()}
        self.ingress = SimIngress(self)
        self.flights: dict[str, _Flight] = {}
        self.records: list[RequestRecord] = []
        self._later: dict[str, deque] = {}       # a conversation's turns waiting for its last
        self._busy_conversations: set[str] = set()
        self.num_admitted = 0

    def _make_engine(self, role: str, name: str, vllm_config: VllmConfig) -> SimEngine:
        cfg = dataclasses.replace(vllm_config,
                                  cache_config=dataclasses.replace(vllm_config.cache_config))
        if role == "colocated":
            return SimEngine(cfg, self.cost_model, kv_events=True, record_token_times=False)
        cfg = dataclasses.replace(cfg, kv_transfer_config=KVTransferConfig(
            **sim_kv_transfer_config(role, name, self.hub)))
        return FleetEngine(cfg, self.cost_model, kv_events=True, record_token_times=False)

    def _transfer_ready(self, engine_id: str) -> None:
        replica = self._by_name.get(engine_id)
        if replica is not None:
            replica.poke()

    # ------------------------------------------------------------------ the requests
    def _arrivals(self, requests: Iterable[TraceRequest]) -> Iterator[simpy.Event]:
        env = self.env
        for index, r in enumerate(requests):
            if r.arrival_s > env.now:
                yield env.timeout(r.arrival_s - env.now)
            conv = r.conversation
            if conv is not None and conv in self._busy_conversations:
                self._later.setdefault(conv, deque()).append((index, r))
                continue
            self._admit(index, r)

    def _admit(self, index: int, r: TraceRequest) -> None:
        if r.conversation is not None:
            self._busy_conversations.add(r.conversation)
        flight = _Flight(index, self.env.now, r.prompt_ids(self.vocab_size, self.config.seed),
                         r.output_tokens, 0, r.conversation)
        self.flights[r.request_id] = flight
        self.num_admitted += 1
        self.ingress.admit(flight, r.request_id)

    def on_step(self, replica: SimReplica, result: Any) -> None:
        """A replica's step ended: its KV events to the index, its finished requests onwards."""
        if result.kv_events:
            self.ingress.apply_events(replica, result.kv_events)
        if not result.finished:
            return
        engine = replica.engine
        if replica.role == "prefill":
            for req_id in result.finished:
                engine.pop_times(req_id)
                request = engine.scheduler.requests.get(req_id)   # kept while P holds its KV
                params = request.output_kv_transfer_params if request is not None else None
                self.ingress.prefilled(self.flights[req_id], req_id, params)
            return
        now = self.env.now
        for req_id in result.finished:
            times = engine.pop_times(req_id)
            flight = self.flights.pop(req_id)
            self.ingress.finished(flight)
            self.records.append(RequestRecord(
                flight.index, req_id, flight.arrival_s, times.first_token_s - flight.arrival_s,
                times.itl_s, now - flight.arrival_s, times.num_output_tokens, flight.decode,
                flight.prefill))
            conv = flight.conversation
            if conv is not None:
                waiting = self._later.get(conv)
                if waiting:
                    index, nxt = waiting.popleft()
                    self._release(index, nxt)
                else:
                    self._busy_conversations.discard(conv)
                    self._later.pop(conv, None)

    def _release(self, index: int, r: TraceRequest) -> None:
        """A conversation's next turn: sent at its own arrival, or now if that has passed."""
        delay = r.arrival_s - self.env.now
        if delay <= 0:
            self._admit(index, r)
        else:
            timer = self.env.timeout(delay)
            timer.callbacks.append(lambda _: self._admit(index, r))

    # ------------------------------------------------------------------ running
    def run(self, requests: Iterable[TraceRequest]) -> list[RequestRecord]:
        """Every request through the fleet, to the last finish; -> their records in trace order."""
        self.env.process(self._arrivals(requests))
        with fewer_collections(freeze=True):
            self.env.run()
        if self.flights:
            stuck = sorted(self.flights)[:5]
            raise RuntimeError(f"{len(self.flights)} requests never finished (first: {stuck}); "
                               "the fleet stopped with requests in flight.")
        self.records.sort(key=lambda rec: rec.index)
        return self.records

    def stats(self) -> dict[str, Any]:
        """The fleet's counts: replicas, steps, busy fraction per role, transfers, routing."""
        out: dict[str, Any] = {"fleet": self.config.label(),
                               "num_instances": self.config.num_instances}
        makespan = self.env.now or 1.0
        for role, replicas in self.replicas.items():
            out[f"{role}_steps"] = sum(r.num_steps for r in replicas.values())
            out[f"{role}_busy"] = (sum(r.busy_s for r in replicas.values())
                                   / (len(replicas) * makespan))
        if self.hub is not None:
            out.update(remote_prefills=self.ingress.num_remote_prefills,
                       local_prefills=self.ingress.num_local_prefills,
                       kv_pulls=self.hub.num_pulls, kv_bytes_pulled=self.hub.bytes_moved,
                       kv_pull_s_mean=self.hub.pull_time_s / max(1, self.hub.num_pulls),
                       transfer=self.config.transfer.describe())
        if self.num_event_batches_lost:
            out["kv_event_batches_lost"] = self.num_event_batches_lost
        return out


def summarize_records(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """``engine.summarize``'s keys (DESIGN.md 5.8) from the fleet's records: TTFT and ITL p50 and
    p90, makespan (first arrival to last finish), requests."""
    import numpy as np

    def pct(values: list, q: float) -> Optional[float]:
        return float(np.percentile(values, q)) if values else None
    ttft = [r.ttft_s for r in records]
    itl = [r.itl_s for r in records if r.itl_s is not None]
    makespan = (max(r.arrival_s + r.e2e_s for r in records) - min(r.arrival_s for r in records)
                if records else None)
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "itl_p50_s": pct(itl, 50), "itl_p90_s": pct(itl, 90),
            "makespan_s": makespan, "num_requests": len(records)}


def slo_attainment(records: Sequence[RequestRecord], ttft_s: float, itl_s: float) -> float:
    """DistServe's SLO attainment: the fraction of requests meeting both their TTFT and their
    ITL target (a request with one output token has no ITL to miss)."""
    if not records:
        return 0.0
    ok = sum(1 for r in records
             if r.ttft_s <= ttft_s and (r.itl_s is None or r.itl_s <= itl_s))
    return ok / len(records)


def run_fleet(config: SimFleetConfig, vllm_config: VllmConfig, cost_model: CostModel,
              requests: Iterable[TraceRequest]) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Build the fleet, run the trace. -> (records in trace order, summary + the fleet's counts +
    ``sim_wall_s``, ``sim_cpu_s`` and ``sim_wall_ms_per_request``: what the simulation itself
    cost)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fleet = SimFleet(config, vllm_config, cost_model)
    build_s = time.perf_counter() - t0
    records = fleet.run(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    summary = summarize_records(records)
    summary.update(fleet.stats())
    summary.update(sim_build_s=build_s, sim_wall_s=wall, sim_cpu_s=cpu,
                   sim_wall_ms_per_request=wall / max(1, len(records)) * 1e3)
    return records, summary


__all__ = ["FleetEngine", "PDSimulatedWorker", "RequestRecord", "SimFleet", "SimFleetConfig",
           "SimIngress", "SimReplica", "TRANSFER_COSTS", "TransferCost", "run_fleet",
           "slo_attainment", "summarize_records"]
