"""Request traces for the simulator: JSON lines, one request a line (DESIGN.md 5.8)::

    {"arrival_s": 0.42, "prompt_tokens": 512, "output_tokens": 128}
    {"arrival_s": 0.0, "prompt_token_ids": [...], "output_tokens": 128, "conversation": "3"}

No vLLM file (vLLM's benchmarks read datasets, not traces; Vidur's traces carry the same three
numbers). A request's output length comes from its line, as in Vidur: the simulated worker emits
that many tokens and the scheduler's own length check stops it.

- ``read_trace`` / ``write_trace``; every line checked, errors name the file and line.
- ``poisson_trace``: Poisson arrivals at a rate, prompt and output lengths uniform in ranges.
- ``multiturn_trace``: ``bench fleet --workload multiturn``'s chats (its messages, from
  ``minivllm.bench.fleet_multiturn``), each turn's prompt the conversation so far.
- Token ids: a line with ``prompt_tokens`` only gets ids drawn from ``(seed, line)``, made when the
  request enters an engine (a trace of 100,000 requests holds counts, not lists).
  ``reply_token_ids`` is what the simulated worker answers a prompt with, a function of the prompt
  alone, so that the next turn of a chat, built here from it, finds the reply's blocks in the prefix
  cache of the engine that produced them, as a real decode replica holds them.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

_MASK64 = (1 << 64) - 1
_KNOWN_KEYS = {"arrival_s", "prompt_tokens", "prompt_token_ids", "output_tokens", "conversation",
               "request_id"}


def token_range(vocab_size: int) -> tuple[int, int]:
    """The ids synthetic tokens are drawn from: the top 7/8 of the vocabulary (the lowest ids are
    the special and byte tokens in most tokenizers)."""
    return vocab_size // 8, vocab_size


def prompt_key(prompt_token_ids: Sequence[int]) -> int:
    """A prompt's key for ``reply_token``: the hash of its ids (of ints, the same in every
    process)."""
    return hash(tuple(prompt_token_ids)) & _MASK64


def reply_token(key: int, position: int, vocab_size: int) -> int:
    """Output token ``position`` of the reply to the prompt whose ``prompt_key`` is ``key``
    (splitmix64 of the two, into ``token_range``)."""
    lo, hi = token_range(vocab_size)
    x = (key + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return lo + (x ^ (x >> 31)) % (hi - lo)


def reply_token_ids(prompt_token_ids: Sequence[int], num_tokens: int, vocab_size: int) -> list[int]:
    """The first ``num_tokens`` tokens the simulated worker answers this prompt with."""
    key = prompt_key(prompt_token_ids)
    return [reply_token(key, i, vocab_size) for i in range(num_tokens)]


@dataclass
class TraceRequest:
    """One line of a trace. ``prompt_token_ids`` is None when the line gives only a length."""
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_token_ids: Optional[list[int]] = None
    conversation: Optional[str] = None

    def prompt_ids(self, vocab_size: int, seed: int = 0) -> list[int]:
        """The prompt's token ids: the line's own, else drawn from ``(seed, request_id)``."""
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        import numpy as np
        lo, hi = token_range(vocab_size)
        rng = np.random.default_rng([seed, prompt_key([ord(c) for c in self.request_id])])
        return rng.integers(lo, hi, self.prompt_tokens).tolist()

    def to_json(self, with_id: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"arrival_s": self.arrival_s}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        else:
            out["prompt_tokens"] = self.prompt_tokens
        out["output_tokens"] = self.output_tokens
        if self.conversation is not None:
            out["conversation"] = self.conversation
        if with_id:
            out["request_id"] = self.request_id
        return out


def parse_line(obj: Any, index: int, where: str = "") -> TraceRequest:
    """One trace line (a decoded JSON object) -> ``TraceRequest``; ``ValueError`` naming the
    problem (``where``: file and line, for the message)."""
    def bad(msg: str) -> ValueError:
        return ValueError(f"{where}{msg}")
    if not isinstance(obj, dict):
        raise bad(f"a trace line must be a JSON object, got {type(obj).__name__}.")
    unknown = set(obj) - _KNOWN_KEYS
    if unknown:
        raise bad(f"unknown key(s) {sorted(unknown)}; a line has {sorted(_KNOWN_KEYS)}.")
    arrival = obj.get("arrival_s")
    if (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
            or not math.isfinite(arrival) or arrival < 0):
        raise bad(f"arrival_s must be a number >= 0, got {arrival!r}.")
    ids = obj.get("prompt_token_ids")
    n = obj.get("prompt_tokens")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise bad("prompt_token_ids must be a non-empty list of token ids (ints >= 0).")
        if n is not None and n != len(ids):
            raise bad(f"prompt_tokens ({n}) differs from len(prompt_token_ids) ({len(ids)}).")
        n = len(ids)
    elif isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise bad(f"a line needs prompt_tokens (an int >= 1) or prompt_token_ids, got "
                  f"prompt_tokens={n!r}.")
    out = obj.get("output_tokens")
    if isinstance(out, bool) or not isinstance(out, int) or out < 1:
        raise bad(f"output_tokens must be an int >= 1, got {out!r}.")
    conv = obj.get("conversation")
    if conv is not None and (isinstance(conv, bool) or not isinstance(conv, (str, int))):
        raise bad(f"conversation must be a string or an int, got {conv!r}.")
    rid = obj.get("request_id", str(index))
    return TraceRequest(str(rid), float(arrival), n, out, ids,
                        None if conv is None else str(conv))


def read_trace(path: str) -> list[TraceRequest]:
    """A JSON-lines trace, sorted by arrival (ties keep the file's order). Request ids are the
    line numbers from 0 (blank lines skipped), or a line's own ``request_id``."""
    requests: list[TraceRequest] = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}: "
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}not JSON ({e.msg}).") from None
            requests.append(parse_line(obj, len(requests), where))
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: request ids repeat.")
    return sorted(requests, key=lambda r: r.arrival_s)


def write_trace(path: str, requests: Iterable[TraceRequest]) -> str:
    """One line per request; ``request_id`` is written only where it is not the line's index."""
    with open(path, "w") as fh:
        for i, r in enumerate(requests):
            fh.write(json.dumps(r.to_json(with_id=r.request_id != str(i))) + "\n")
    return path


def _length_range(name: str, value: Union[int, tuple[int, int]]) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must be an int >= 1 or a range (lo, hi) with 1 <= lo <= hi, "
                         f"got {value!r}.")
    return int(lo), int(hi)


def poisson_trace(num_requests: int, rate: float,
                  prompt_tokens: Union[int, tuple[int, int]] = (64, 1024),
                  output_tokens: Union[int, tuple[int, int]] = (32, 256),
                  seed: int = 0, start_s: float = 0.0) -> list[TraceRequest]:
    """``num_requests`` arrivals of a Poisson process of ``rate`` per second (exponential gaps,
    the first one after ``start_s``); prompt and output lengths uniform in their inclusive
    ranges. The same arguments give the same trace."""
    import numpy as np
    if num_requests < 0 or not rate > 0:
        raise ValueError(f"need num_requests >= 0 and rate > 0, got {num_requests}, {rate}.")
    p_lo, p_hi = _length_range("prompt_tokens", prompt_tokens)
    o_lo, o_hi = _length_range("output_tokens", output_tokens)
    rng = np.random.default_rng(seed)
    arrivals = start_s + np.cumsum(rng.exponential(1.0 / rate, num_requests))
    prompts = rng.integers(p_lo, p_hi + 1, num_requests)
    outputs = rng.integers(o_lo, o_hi + 1, num_requests)
    return [TraceRequest(str(i), float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


_REPLY = "\x00REPLY\x00"   # stands for an assistant reply in a rendered chat, then replaced by ids


def multiturn_trace(conversations: int = 16, turns: int = 6,
                    output_tokens: Union[int, tuple[int, int]] = 128,
                    vocab_size: int = 49152, tokenizer: Any = None, seed: int = 0,
                    arrival_s: float = 0.0) -> list[TraceRequest]:
    """``bench fleet --workload multiturn``'s chats as a trace: conversation ``c``'s turn ``t``
    asks ``_messages(c, replies)`` (that benchmark's own messages: a story opening, then its
    follow-ups), its prompt the whole conversation so far. Each earlier reply is
    ``reply_token_ids`` of its turn's prompt, the answer the simulated worker gives it, so a turn
    shares every earlier turn's prompt and reply as a prefix.

    The messages are rendered by ``tokenizer``'s chat template and encoded by it when one is given
    (the benchmark's prompts, up to the joins around the replies, which are encoded apart);
    without one, words become ids by a hash. Every turn's ``arrival_s`` is ``arrival_s``: as in
    the benchmark, all conversations start at once and a turn is sent when the previous turn of
    its conversation has finished (the simulator keeps that order by ``conversation``)."""
    import random
    import zlib

    from minivllm.bench.fleet_multiturn import TOPICS, _messages
    if not 1 <= conversations <= len(TOPICS):
        raise ValueError(f"conversations must be in 1..{len(TOPICS)} (the benchmark's topics), "
                         f"got {conversations}.")
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}.")
    o_lo, o_hi = _length_range("output_tokens", output_tokens)
    rng = random.Random(seed)
    lo, hi = token_range(vocab_size)

    def encode(text: str) -> list[int]:
        if tokenizer is not None:
            return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
        return [lo + zlib.crc32(w.encode()) % (hi - lo) for w in text.split()]

    def render(messages: list[dict]) -> str:
        if tokenizer is not None:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        return "".join(f"<{m['role']}> {m['content']} </{m['role']}> " for m in messages) + \
            "<assistant> "

    out: list[TraceRequest] = []
    for t in range(turns):          # turn by turn, as ideal_hits feeds its engine
        for c in range(conversations):
            prev = [r for r in out if r.conversation == str(c)]
            replies = [reply_token_ids(r.prompt_token_ids, r.output_tokens, vocab_size)
                       for r in prev]
            pieces = render(_messages(c, [_REPLY] * t)).split(_REPLY)
            ids = encode(pieces[0])
            for reply, piece in zip(replies, pieces[1:]):
                ids += reply + encode(piece)
            out.append(TraceRequest(str(len(out)), arrival_s, len(ids),
                                    rng.randint(o_lo, o_hi), ids, str(c)))
    return out


def length_range(text: str) -> tuple[int, int]:
    """A length flag of the sim commands (``--prompt-tokens``, ``--output-tokens``):
    ``"64,1024"`` -> (64, 1024); ``"128"`` -> (128, 128)."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LO,HI or N, got {text!r}")
    return parts[0], parts[1]
