"""``python -m minivllm.disagg.fleet.figure [PATH]``: the fleet's routing drawn from the code's
own names (figures/fleet_routing.png in the README): the ingress, the prefill pool, the decode
pool, the KV path between them, and the policy that reads both pools' KV events.

Every label is taken from the objects it names (``__qualname__``, the config's fields), so a
rename changes the figure when it is drawn again, and a removed name fails to draw it.
"""
from __future__ import annotations

import sys
from dataclasses import fields

DEFAULT_PATH = "figures/fleet_routing.png"


def names() -> dict:
    """The labels, read from the code."""
    from minivllm.core.kv_events_block_pool import KVEventsBlockPool
    from minivllm.disagg.fleet import app, ingress, kv_index
    from minivllm.disagg.fleet.replicas import EngineReplica
    from minivllm.distributed.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher
    config = {f.name for f in fields(app.FleetConfig)}
    assert {"router", "pd_min_uncached_tokens"} <= config
    return {
        "ingress": ingress.FleetIngress.__qualname__,
        "tokenize": ingress.FleetIngress.prompt_token_ids.__name__,
        "choose": "PoolView.choose",
        "score": kv_index.score.__name__, "pick": kv_index.pick.__name__,
        "decide": kv_index.needs_remote_prefill.__name__,
        "index": kv_index.KVIndex.__qualname__,
        "replica": EngineReplica.__qualname__, "generate": EngineReplica.generate.__name__,
        "pool": KVEventsBlockPool.__qualname__, "publisher": ZmqEventPublisher.__qualname__,
        "events": f"{BlockStored.__name__} / {BlockRemoved.__name__}",
        "threshold": "pd_min_uncached_tokens", "router": "router",
    }


def draw(path: str = DEFAULT_PATH) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    n = names()
    fig, ax = plt.subplots(figsize=(11, 5.6))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 5.6)
    ax.axis("off")

    def box(x, y, w, h, title, lines, color):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=color,
                                    ec="#333", lw=1.2))
        ax.text(x + w / 2, y + h - 0.25, title, ha="center", va="top", fontsize=11,
                fontweight="bold")
        for i, line in enumerate(lines):
            ax.text(x + w / 2, y + h - 0.65 - 0.33 * i, line, ha="center", va="top", fontsize=8.5,
                    family="monospace")

    def arrow(a, b, text="", style="-|>", ls="-", color="#333", rad=0.0, dy=0.12):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=14, lw=1.4,
                                     linestyle=ls, color=color,
                                     connectionstyle=f"arc3,rad={rad}"))
        if text:
            ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, text, ha="center", fontsize=8,
                    color=color)

    purple = "#7a3d8a"
    box(0.1, 2.2, 1.4, 1.2, "client", ["OpenAI API", "curl / openai"], "#eeeeee")
    box(1.9, 1.4, 3.9, 2.7, "ingress", [n["ingress"], f"{n['tokenize']}()",
                                         f"{n['choose']}: {n['score']}, {n['pick']}",
                                         f"{n['decide']}(",
                                         f"    {n['threshold']})",
                                         "DeploymentHandle(stream=True)"], "#dbe9f6")
    box(6.6, 3.3, 4.2, 2.0, "prefill pool", [f"{n['replica']} x N", f"{n['pool']}",
                                              f"-> {n['publisher']}"], "#fde2c8")
    box(6.6, 0.3, 4.2, 2.0, "decode pool", [f"{n['replica']} x M  .{n['generate']}()",
                                             f"{n['pool']}", f"-> {n['publisher']}"], "#d5efd5")
    box(2.4, 4.4, 2.9, 1.05, "policy", [f"{n['index']} per pool (--{n['router']} kv)"],
        "#f3e1f5")
    arrow((1.5, 2.8), (1.9, 2.8), "")
    arrow((5.8, 2.0), (6.6, 1.3), "decode first", dy=0.05)
    arrow((5.8, 3.5), (6.6, 4.1), "remote prefill\nonly if needed", dy=0.25)
    arrow((8.7, 3.3), (8.7, 2.3), "KV (connector)", color="#b35900", dy=0)
    arrow((6.6, 4.95), (5.3, 4.95), n["events"], ls="--", color=purple, dy=0.1)
    ax.plot([6.6, 6.2, 6.2], [0.8, 0.8, 4.75], ls="--", color=purple, lw=1.4)
    arrow((6.2, 4.75), (5.3, 4.75), "", ls="--", color=purple)
    arrow((3.85, 4.4), (3.85, 4.1), "", color=purple)
    ax.set_title("The fleet routes by what each replica holds (names from minivllm/disagg)",
                 fontsize=11)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(draw(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_PATH))
