"""``python -m minivllm.bench fleet``: the P/D fleet (disagg/fleet.py) fixed at 1P+1D against
autoscaled, on one workload whose mix changes: a burst of long prompts, then long generations,
then idle. Every number comes from the client's streams and the fleet's own records.

``--workload multiturn``: the request routers (``round_robin``, ``serve``, ``kv``) compared on
multi-turn chats with fixed replica counts (2 prefill + 2 decode), so that only routing differs:
prompt tokens computed, prefix-cache hit rate against one engine with a cache big enough for
everything, remote prefills skipped, TTFT, failures, and whether greedy outputs agree.

On a 2-core machine more replicas add no compute: this shows the mechanism and its costs (how
long a new replica takes to serve after its load appears, how long a drain takes), not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import httpx

SLO_TTFT_S, SLO_ITL_S = 2.0, 0.25


def _stream(url: str, model: str, prompt: str, max_tokens: int, out: list) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0, times = time.perf_counter(), []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            ok = r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and '"choices"' in line:
                    times.append(time.perf_counter())
                elif '"error"' in line:
                    ok = False
    except httpx.HTTPError:
        ok = False
    gaps = [b - a for a, b in zip(times, times[1:])]
    out.append({"ok": ok and bool(times), "ttft": times[0] - t0 if times else None,
                "itl": statistics.mean(gaps) if gaps else None})


def _phase(url, model, seconds, clients, make_prompt, max_tokens, out):
    stop = time.monotonic() + seconds

    def client():
        while time.monotonic() < stop:
            _stream(url, model, make_prompt(), max_tokens, out)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_once(args, bounds: tuple[int, int]) -> dict:
    from minivllm.disagg.autoscale import FleetTargets
    from minivllm.disagg.fleet import FleetConfig, start_fleet
    targets = FleetTargets(1, bounds[0], 1, bounds[1], args.prefill_target_queued_tokens,
                           args.decode_target_running, upscale_delay_s=0.5,
                           downscale_delay_s=args.phase_s / 2)
    config = FleetConfig(model=args.model, replica_num_cpus=1, node_ip=False,
                         server_args=["--max-num-batched-tokens", "32", "--max-model-len", "1024"],
                         metrics_interval_s=0.25, look_back_period_s=0.5)
    fleet = start_fleet(config, targets)
    try:
        out: list = []
        t0 = time.time()
        _phase(fleet.url, args.model, args.phase_s, 6,
               lambda: f"{random.random()} " + "lorem ipsum dolor " * 110, 2, out)
        t1 = time.time()
        _phase(fleet.url, args.model, args.phase_s, 8, lambda: f"{random.random()} hi", 128, out)
        t2 = time.time()
        time.sleep(args.phase_s)                     # idle: the policy returns to min
        t3 = time.time()
        rec = fleet.records()
    finally:
        fleet.stop()
    ticks = [d for d in rec["metrics"] if t0 <= d["time"] <= t3]
    rs = {r: sum(a["running"][r] * (b["time"] - a["time"]) for a, b in zip(ticks, ticks[1:]))
          for r in ("prefill", "decode")}
    up = {}
    for role in ("prefill", "decode"):
        # The first decision to grow this role, timed from the start of the phase it fell in
        # (the load that caused it), to the first replica of the role serving after it.
        lo = getattr(targets, f"{role}_min")
        grown = [d["time"] for d in ticks if d[role] > lo]
        serving = [e["time"] for e in rec["events"] if e["role"] == role
                   and e["event"] == "serving" and grown and e["time"] > grown[0]]
        starts = {"burst": t0, "generations": t1, "idle": t2}
        cause = max((p for p, t in starts.items() if grown and t <= grown[0]),
                    key=starts.get, default="burst")
        up[role] = (serving[0] - starts[cause], cause) if serving else None
    drains = [e["drain_s"] for e in rec["events"] if e["event"] == "drained"]
    ttft = sorted(o["ttft"] for o in out if o["ttft"] is not None)
    itl = sorted(o["itl"] for o in out if o["itl"] is not None)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    return {"requests": len(out), "failed": sum(not o["ok"] for o in out),
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
            "slo_met": sum(1 for o in out if o["ok"] and o["ttft"] <= SLO_TTFT_S
                           and (o["itl"] or 0) <= SLO_ITL_S),
            "replica_s": rs, "scale_up_s": up, "drain_s": drains}


TOPICS = ["a lighthouse keeper", "a baker in a mountain village", "a ship's cat", "a young "
          "astronomer", "an old clockmaker", "a river ferryman", "a beekeeper", "a train driver",
          "a lost robot", "a street musician", "a fox in winter", "a librarian at night",
          "a fisherman's daughter", "a desert caravan", "a snow-covered inn", "a kite maker"]
FOLLOW_UPS = ["What happens next?", "Describe the place in more detail.", "Who else is there?",
              "How does it end?", "Tell me one surprising thing about it."]


def _conversation_turn(url: str, model: str, messages: list, max_tokens: int) -> dict:
    """One chat turn, streamed: the reply, TTFT, the decode replica's usage, the request id."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, usage, ok, rid = time.perf_counter(), None, "", None, False, None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            ok, rid = r.status_code == 200, r.headers.get("X-Request-Id")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    ok = False
                for c in chunk.get("choices") or []:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += c.get("delta", {}).get("content") or ""
                usage = chunk.get("usage") or usage
    except httpx.HTTPError:
        ok = False
    return {"ok": ok and usage is not None, "ttft": ttft, "text": text, "usage": usage,
            "request_id": rid}


def run_multiturn(args, router: str) -> dict:
    """16 conversations x 6 turns (each turn's prompt: the conversation so far plus a new
    message), all conversations at once, on a fleet fixed at 2 prefill + 2 decode replicas."""
    from minivllm.disagg.autoscale import FleetTargets
    from minivllm.disagg.fleet import FleetConfig, start_fleet
    config = FleetConfig(model=args.model, replica_num_cpus=0.5, node_ip=False, router=router,
                         pd_min_uncached_tokens=args.pd_min_uncached_tokens,
                         server_args=["--max-model-len", "2048"])
    t_start = time.perf_counter()
    fleet = start_fleet(config, FleetTargets(2, 2, 2, 2))
    startup_s = time.perf_counter() - t_start
    turns: dict = {}
    try:
        def conversation(c: int) -> None:
            messages = [{"role": "user", "content": f"Tell me a story about {TOPICS[c]}. "
                         f"Start with {TOPICS[c]} waking up early on a cold morning."}]
            for t in range(args.turns):
                out = _conversation_turn(fleet.url, args.model, messages, args.max_tokens)
                turns[(c, t)] = out
                if not out["ok"]:
                    return
                messages = messages + [{"role": "assistant", "content": out["text"]},
                                       {"role": "user", "content": FOLLOW_UPS[t % 5]}]
        threads = [threading.Thread(target=conversation, args=(c,))
                   for c in range(args.conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1.0)
        routes = {r["request_id"]: r for r in fleet.records()["routes"]}
    finally:
        fleet.stop()
    return {"turns": turns, "routes": routes, "startup_s": startup_s}


def multiturn_counts(run: dict) -> dict:
    """Per request and summed: prompt tokens, tokens a forward computed (neither a prefix-cache
    hit nor loaded through the connector), prefix-cache hits, remote prefills skipped."""
    rows = []
    for (c, t), out in sorted(run["turns"].items()):
        route = run["routes"].get(out["request_id"]) or {}
        usage = out["usage"] or {}
        prompt = usage.get("prompt_tokens", 0)
        cached_d = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        prefill = (route.get("prefill") or {}).get("usage") if route.get("remote_prefill") else None
        if prefill:     # P computed what its cache missed; D loaded the rest through the connector
            cached_p = (prefill.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            computed, hit = (prompt - cached_p) + (prompt - cached_d), cached_p
        else:           # D computed the prompt itself, less its own prefix-cache hit
            computed, hit = prompt - cached_d, cached_d
        rows.append({"conversation": c, "turn": t, "prompt": prompt, "computed": computed,
                     "hit": hit, "remote": bool(route.get("remote_prefill")),
                     "ttft": out["ttft"], "ok": out["ok"], "text": out["text"]})
    return {"rows": rows}


def ideal_hits(args, runs: dict) -> tuple[int, int]:
    """One engine with a cache big enough for everything, fed the same prompts in the same turn
    order (turn 1 of every conversation, then turn 2, ...): its prefix-cache hits and the
    prompt tokens, from its own ``num_cached_tokens``."""
    from minivllm import LLM, SamplingParams
    from minivllm.model_executor.model_loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(args.model))
    first = next(iter(runs.values()))["turns"]
    llm = LLM(model=args.model, max_model_len=2048)
    hits = total = 0
    for t in range(args.turns):
        prompts = []
        for c in range(args.conversations):
            messages = [{"role": "user", "content": f"Tell me a story about {TOPICS[c]}. "
                         f"Start with {TOPICS[c]} waking up early on a cold morning."}]
            for k in range(t):
                messages += [{"role": "assistant", "content": first[(c, k)]["text"]},
                             {"role": "user", "content": FOLLOW_UPS[k % 5]}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1),
                                use_tqdm=False):
            hits += out.num_cached_tokens
            total += len(out.prompt_token_ids)
    return hits, total


def _own_ray() -> object:
    """One Ray node for every router's run (a start costs about 30 s here), with fixed agent
    ports and no dashboard (another Ray on the machine may hold its port). Returns the
    ``Cluster`` (``shutdown()`` at the end)."""
    import ray
    from ray.cluster_utils import Cluster

    from minivllm.disagg.launch import free_port
    ports = {k: free_port("127.0.0.1") for k in ("metrics_agent_port", "metrics_export_port",
                                                 "dashboard_agent_listen_port",
                                                 "runtime_env_agent_port")}
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 4, "include_dashboard": False, **ports})
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def main_multiturn(args) -> None:
    import ray
    routers = args.routers.split(",")
    cluster = _own_ray()
    try:
        runs = {r: run_multiturn(args, r) for r in routers}
    finally:
        ray.shutdown()
        cluster.shutdown()
    counts = {r: multiturn_counts(run) for r, run in runs.items()}
    ideal_hit, ideal_total = ideal_hits(args, runs)
    ideal = ideal_hit / max(1, ideal_total)
    texts = {r: [row["text"] for row in c["rows"]] for r, c in counts.items()}
    same = all(t == texts[routers[0]] for t in texts.values())

    def pct(xs, q):
        xs = sorted(x for x in xs if x is not None)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    print(f"\n{args.conversations} conversations x {args.turns} turns, greedy, {args.max_tokens} "
          f"tokens a turn; 2 prefill + 2 decode replicas; --pd-min-uncached-tokens "
          f"{args.pd_min_uncached_tokens}. Ideal: one engine with a cache big enough for "
          f"everything, hit rate {ideal:.1%}. Greedy outputs identical across routers: {same}.")
    print("| router | requests (failed) | prompt tokens | prompt tokens computed | hit rate "
          "(ideal - it) | remote prefills skipped | TTFT p50 / p99 s | start-up s |")
    print("|---|---|---|---|---|---|---|---|")
    table = {}
    for r in routers:
        rows = counts[r]["rows"]
        prompt, computed = sum(x["prompt"] for x in rows), sum(x["computed"] for x in rows)
        hit = sum(x["hit"] for x in rows) / max(1, prompt)
        skipped = sum(not x["remote"] for x in rows)
        failed = sum(not x["ok"] for x in rows) + args.conversations * args.turns - len(rows)
        ttft = [x["ttft"] for x in rows]
        table[r] = {"requests": len(rows), "failed": failed, "prompt_tokens": prompt,
                    "computed": computed, "hit_rate": hit, "ideal_hit_rate": ideal,
                    "skipped": skipped, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
                    "startup_s": runs[r]["startup_s"],
                    "hit_rate_per_turn": [sum(x["hit"] for x in rows if x["turn"] == t) / max(
                        1, sum(x["prompt"] for x in rows if x["turn"] == t))
                        for t in range(args.turns)],
                    "computed_per_turn": [sum(x["computed"] for x in rows if x["turn"] == t)
                                          for t in range(args.turns)]}
        print(f"| {r} | {len(rows)} ({failed}) | {prompt} | {computed} | {hit:.1%} "
              f"({(ideal - hit) * 100:+.1f} pts) | {skipped} | {table[r]['ttft_p50']:.2f} / "
              f"{table[r]['ttft_p99']:.2f} | {runs[r]['startup_s']:.0f} |")
    # One request of the kv run whose decode pick held part of its prompt: the score's inputs,
    # for the lesson (notebook 06, "Why route by KV").
    kv_routes = list(runs.get("kv", {}).get("routes", {}).values())
    example = next((r for r in sorted(kv_routes, key=lambda r: r["time"])
                    if len(r["candidates"]) > 1 and any(c["cached_blocks"] for c in r["candidates"])),
                   None)
    result = {"table": table, "identical": same, "ideal_hit_rate": ideal,
              "example_route": example, "command": "python -m minivllm.bench fleet "
              f"--workload multiturn --conversations {args.conversations} --turns {args.turns} "
              f"--max-tokens {args.max_tokens} --pd-min-uncached-tokens "
              f"{args.pd_min_uncached_tokens} --routers {args.routers}"}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1)
    print("BENCH_FLEET_MULTITURN " + json.dumps(result))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None,
                    help="a small model directory (CPU); multiturn: default SmolLM2-135M-Instruct")
    ap.add_argument("--workload", default="mix", choices=("mix", "multiturn"),
                    help="mix: 1P+1D fixed against autoscaled on a changing mix; multiturn: "
                         "the routers compared on multi-turn chats, 2P+2D fixed")
    ap.add_argument("--routers", default="round_robin,serve,kv")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pd-min-uncached-tokens", type=int, default=64)
    ap.add_argument("--save", default="figures/fleet_multiturn.json",
                    help="multiturn: the table, per-turn series and one route, as JSON "
                         "(notebook 06 draws its figure from it); empty: not saved")
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds per workload phase")
    ap.add_argument("--max", type=int, default=2, help="the autoscaled fleet's max per role")
    ap.add_argument("--prefill-target-queued-tokens", type=int, default=1000)
    ap.add_argument("--decode-target-running", type=int, default=3)
    args = ap.parse_args(argv)
    if args.workload == "multiturn":
        from minivllm.entrypoints.openai.api_server import DEFAULT_MODEL
        args.model = args.model or DEFAULT_MODEL
        return main_multiturn(args)
    if args.model is None:
        ap.error("--model is required for --workload mix")
    rows = {"fixed 1P+1D": run_once(args, (1, 1)),
            f"autoscaled 1-{args.max}P, 1-{args.max}D": run_once(args, (args.max, args.max))}
    print(f"\nSLO: TTFT <= {SLO_TTFT_S} s and mean ITL <= {SLO_ITL_S} s. On this 2-core machine "
          "more replicas add no compute: the table shows the mechanism and its cost, not a speed-up.")
    print("| fleet | requests (failed) | TTFT p50 / p99 s | ITL p50 / p99 s | SLO met | "
          "replica-s P / D | new replica serving after its phase began, P / D s | drains s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        up = " / ".join("-" if r["scale_up_s"][k] is None else
                        f"{r['scale_up_s'][k][0]:.1f} ({r['scale_up_s'][k][1]})"
                        for k in ("prefill", "decode"))
        print(f"| {name} | {r['requests']} ({r['failed']}) | {r['ttft_p50']:.2f} / "
              f"{r['ttft_p99']:.2f} | {r['itl_p50']:.3f} / {r['itl_p99']:.3f} | {r['slo_met']} | "
              f"{r['replica_s']['prefill']:.0f} / {r['replica_s']['decode']:.0f} | {up} | "
              f"{', '.join(f'{d:.1f}' for d in r['drain_s']) or '-'} |")
    print("BENCH_FLEET " + json.dumps(rows))


if __name__ == "__main__":
    main()
