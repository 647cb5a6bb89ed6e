"""``python -m minivllm.bench fleet --workload multiturn``: the fleet's request routers
(``round_robin``, ``serve``, ``kv``) compared on multi-turn chats with fixed replica counts (2
prefill + 2 decode), so that only routing differs: prompt tokens computed, prefix-cache hit rate
against one engine with a cache big enough for everything, remote prefills skipped, TTFT, failures,
and whether greedy outputs agree. Every number comes from the client's streams (their usage) and
the fleet's own records (``routes``). ``--save FILE`` writes the table, the ideal's hit rate per
turn and one example route as JSON; ``plot_multiturn`` draws it (notebook 06), and
``--ideal-only`` replays only the ideal of a saved run, without the fleet.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Optional

import httpx

TOPICS = ["a lighthouse keeper", "a baker in a mountain village", "a ship's cat", "a young "
          "astronomer", "an old clockmaker", "a river ferryman", "a beekeeper", "a train driver",
          "a lost robot", "a street musician", "a fox in winter", "a librarian at night",
          "a fisherman's daughter", "a desert caravan", "a snow-covered inn", "a kite maker"]
FOLLOW_UPS = ["What happens next?", "Describe the place in more detail.", "Who else is there?",
              "How does it end?", "Tell me one surprising thing about it."]


def _messages(c: int, replies: list[str]) -> list[dict]:
    """Conversation ``c``'s messages for its next turn, after ``replies`` (one per earlier turn):
    the opening request, then each reply and the follow-up that came after it."""
    messages = [{"role": "user", "content": f"Tell me a story about {TOPICS[c]}. "
                 f"Start with {TOPICS[c]} waking up early on a cold morning."}]
    for k, reply in enumerate(replies):
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": FOLLOW_UPS[k % len(FOLLOW_UPS)]}]
    return messages


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
    from minivllm.disagg.fleet.app import FleetConfig
    from minivllm.disagg.fleet.autoscale import FleetTargets
    from minivllm.disagg.fleet.driver import start_fleet
    config = FleetConfig(model=args.model, replica_num_cpus=0.5, node_ip=False, router=router,
                         pd_min_uncached_tokens=args.pd_min_uncached_tokens,
                         overlap_score_weight=args.overlap_score_weight,
                         server_args=["--max-model-len", "2048"])
    t_start = time.perf_counter()
    fleet = start_fleet(config, FleetTargets(2, 2, 2, 2))
    startup_s = time.perf_counter() - t_start
    turns: dict = {}
    try:
        def conversation(c: int) -> None:
            replies: list[str] = []
            for t in range(args.turns):
                out = _conversation_turn(fleet.url, args.model, _messages(c, replies),
                                         args.max_tokens)
                turns[(c, t)] = out
                if not out["ok"]:
                    return
                replies.append(out["text"])
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


def ideal_hits(args, replies: Optional[dict] = None) -> tuple[list[int], list[int]]:
    """One engine with a cache big enough for everything, fed the same prompts in the same turn
    order (turn 1 of every conversation, then turn 2, ...) and generating the same replies, so it
    holds each reply's KV as a decode replica does: per turn, its prefix-cache hits and the prompt
    tokens, from its own ``num_cached_tokens``. At each turn that is the best any router can get:
    the engine holds every earlier turn of every conversation, as a router that always picks the
    replica holding the conversation would find it.

    ``replies``: ``{(conversation, turn): text}``, the fleet's replies; ``None``: the engine's own
    (greedy, the same ``max_tokens``: the fleet's, where greedy decoding agrees)."""
    from minivllm import LLM, SamplingParams
    from minivllm.model_executor.model_loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path(args.model))
    llm = LLM(model=args.model, max_model_len=2048)
    own: dict = {}
    hits, totals = [], []
    for t in range(args.turns):
        prompts = []
        for c in range(args.conversations):
            messages = _messages(c, [(replies or own)[(c, k)] for k in range(t)])
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        # Greedy and the same max_tokens as the fleet's turns: the replies the fleet gave (a
        # prompt-only replay would cache the earlier prompts but never the replies in them).
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                            use_tqdm=False)
        hits.append(sum(out.num_cached_tokens for out in outs))
        totals.append(sum(len(out.prompt_token_ids) for out in outs))
        own.update({(c, t): out.outputs[0].text for c, out in enumerate(outs)})
    return hits, totals


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
    first = next(iter(runs.values()))["turns"]
    ideal_hit, ideal_total = ideal_hits(args, {k: out["text"] for k, out in first.items()})
    ideal = sum(ideal_hit) / max(1, sum(ideal_total))
    ideal_per_turn = [h / max(1, n) for h, n in zip(ideal_hit, ideal_total)]
    texts = {r: [row["text"] for row in c["rows"]] for r, c in counts.items()}
    same = all(t == texts[routers[0]] for t in texts.values())

    def pct(xs, q):
        xs = sorted(x for x in xs if x is not None)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    print(f"\n{args.conversations} conversations x {args.turns} turns, greedy, {args.max_tokens} "
          f"tokens a turn; 2 prefill + 2 decode replicas; --pd-min-uncached-tokens "
          f"{args.pd_min_uncached_tokens} --overlap-score-weight {args.overlap_score_weight:g}. "
          f"Ideal: one engine with a cache big enough for everything, hit rate {ideal:.1%}. "
          f"Greedy outputs identical across routers: {same}.")
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
              "ideal_hit_rate_per_turn": ideal_per_turn,
              "ideal_prompt_tokens_per_turn": ideal_total,
              "example_route": example, "command": "python -m minivllm.bench fleet "
              f"--workload multiturn --conversations {args.conversations} --turns {args.turns} "
              f"--max-tokens {args.max_tokens} --pd-min-uncached-tokens "
              f"{args.pd_min_uncached_tokens} --overlap-score-weight {args.overlap_score_weight:g} "
              f"--routers {args.routers}"}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1)
    print("BENCH_FLEET_MULTITURN " + json.dumps(result))


def main_ideal_only(args) -> None:
    """``--ideal-only``: the one-engine ideal of a saved run (``--save``) again, per turn, without
    the fleet: the engine's own greedy replies stand for the fleet's, and must give the saved run's
    prompts (the same prompt tokens, and the same hit rate over all turns) before the per-turn
    numbers are written into the file."""
    with open(args.save) as f:
        result = json.load(f)
    hits, totals = ideal_hits(args)
    saved = {row["prompt_tokens"] for row in result["table"].values()}
    ideal = sum(hits) / max(1, sum(totals))
    if saved != {sum(totals)} or abs(ideal - result["ideal_hit_rate"]) > 1e-12:
        raise SystemExit(f"the replay's prompts are not the saved run's: {sum(totals)} prompt "
                         f"tokens (saved: {sorted(saved)}), hit rate {ideal:.6f} (saved: "
                         f"{result['ideal_hit_rate']:.6f}); run the whole benchmark again")
    result["ideal_hit_rate_per_turn"] = [h / max(1, n) for h, n in zip(hits, totals)]
    result["ideal_prompt_tokens_per_turn"] = totals
    with open(args.save, "w") as f:
        json.dump(result, f, indent=1)
    print("ideal hit rate per turn: " + ", ".join(
        f"{h:.1%}" for h in result["ideal_hit_rate_per_turn"]))


IDEAL_LABEL = "one big cache: the best at each turn"


def plot_multiturn(result: dict, path: Optional[str] = None):
    """Notebook 06's figure of a saved run (``--save``): per turn, each router's prefix-cache hit
    rate beside the ideal's at that turn (one engine holding every earlier turn: no router can do
    better at any turn), and the prompt tokens each router's fleet computed. Returns the figure,
    also saved to ``path`` if given."""
    import matplotlib.pyplot as plt
    table, ideal = result["table"], result["ideal_hit_rate_per_turn"]
    turns = range(1, len(ideal) + 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for router, row in table.items():
        axes[0].plot(turns, [100 * h for h in row["hit_rate_per_turn"]], marker="o", label=router)
    axes[0].plot(turns, [100 * h for h in ideal], ls="--", c="gray", label=IDEAL_LABEL)
    axes[0].set_xlabel("turn")
    axes[0].set_ylabel("prefix-cache hit rate, %")
    axes[0].legend(fontsize=8)
    width = 0.8 / len(table)
    for i, (router, row) in enumerate(table.items()):
        axes[1].bar([t + (i - (len(table) - 1) / 2) * width for t in turns],
                    row["computed_per_turn"], width, label=router)
    axes[1].set_xlabel("turn")
    axes[1].set_ylabel("prompt tokens computed")
    axes[1].legend(fontsize=8)
    fig.suptitle("Where a turn goes decides how much of its prompt is computed")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig
