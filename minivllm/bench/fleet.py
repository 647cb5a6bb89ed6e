"""``python -m minivllm.bench fleet``: the P/D fleet (disagg/fleet/) fixed at 1P+1D against
autoscaled, on one workload whose mix changes: a burst of long prompts, then long generations,
then idle. Every number comes from the client's streams and the fleet's own records.

``--workload multiturn``: the request routers compared on multi-turn chats (fleet_multiturn.py).

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
    from minivllm.disagg.fleet.app import FleetConfig
    from minivllm.disagg.fleet.autoscale import FleetTargets
    from minivllm.disagg.fleet.driver import start_fleet
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


def main(argv=None) -> None:
    from minivllm.disagg.fleet.kv_index import OVERLAP_SCORE_WEIGHT
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None,
                    help="a small model directory (CPU); multiturn: default SmolLM2-135M-Instruct")
    ap.add_argument("--workload", default="mix", choices=("mix", "multiturn"),
                    help="mix: 1P+1D fixed against autoscaled on a changing mix; multiturn: "
                         "the routers compared on multi-turn chats, 2P+2D fixed")
    ap.add_argument("--routers", default="round_robin,serve,kv")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="multiturn: tokens per reply. A chat's replies are most of its "
                    "conversation, and their KV lives only on the decode replica that wrote them; "
                    "32-token replies leave the prompts' few blocks to decide")
    ap.add_argument("--pd-min-uncached-tokens", type=int, default=64)
    ap.add_argument("--overlap-score-weight", type=float, default=OVERLAP_SCORE_WEIGHT,
                    help="multiturn, --router kv: Dynamo's weight (the fleet's default)")
    ap.add_argument("--save", default="figures/fleet_multiturn.json",
                    help="multiturn: the table, per-turn series and one route, as JSON "
                         "(notebook 06 draws its figure from it); empty: not saved")
    ap.add_argument("--ideal-only", action="store_true",
                    help="multiturn: replay only the one-engine ideal of the run saved in --save "
                         "(no fleet), and write its hit rate per turn there")
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds per workload phase")
    ap.add_argument("--max", type=int, default=2, help="the autoscaled fleet's max per role")
    ap.add_argument("--prefill-target-queued-tokens", type=int, default=1000)
    ap.add_argument("--decode-target-running", type=int, default=3)
    args = ap.parse_args(argv)
    if args.workload == "multiturn":
        from minivllm.entrypoints.openai.api_server import DEFAULT_MODEL
        from minivllm.bench.fleet_multiturn import main_ideal_only, main_multiturn
        args.model = args.model or DEFAULT_MODEL
        return main_ideal_only(args) if args.ideal_only else main_multiturn(args)
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
