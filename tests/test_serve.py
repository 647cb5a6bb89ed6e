"""``python -m minivllm.serve`` as a real subprocess on 127.0.0.1, driven by the real ``openai``
client: completions and chat, streamed and not, stop strings, seeds, errors (HTTP 400/404 with
OpenAI's error JSON, nothing queued), overload (503, no hang), a client that disconnects (its
request is aborted and its blocks freed), /metrics. Greedy outputs equal ``LLM.generate``'s."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from server_utils import metric, start_server, stop

MAX_PENDING = 4
SERVER_ARGS = ["--max-model-len", "512", "--num-gpu-blocks-override", "96", "--num-threads", "1",
               "--max-pending-requests", str(MAX_PENDING), "--seed", "0",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
               '"prompt_lookup_max": 3, "prompt_lookup_min": 1}']
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
           "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def model_dir(tiny_chat_dir) -> str:
    return tiny_chat_dir


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve") / "server.log")
    url, proc = start_server(["--model", model_dir, "--served-model-name", "smol",
                              *SERVER_ARGS], log)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def llm(model_dir):
    from minivllm import LLM
    return LLM(model=model_dir, max_model_len=512, num_gpu_blocks_override=96, seed=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


def stream_text(stream) -> tuple[str, str]:
    text, reason = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += (c.delta.content or "") if hasattr(c, "delta") else c.text
            reason = c.finish_reason or reason
    return text, reason


def test_models_and_health(server, client):
    assert httpx.get(server + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_greedy_completions_equal_llm_generate(client, llm):
    from minivllm import SamplingParams
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    # All at once, so that the engine loop batches HTTP requests together.
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: client.completions.create(
            model="smol", prompt=p, max_tokens=12, temperature=0), PROMPTS))
        streamed = list(pool.map(lambda p: stream_text(client.completions.create(
            model="smol", prompt=p, max_tokens=12, temperature=0, stream=True)), PROMPTS))
    for w, g, s in zip(want, got, streamed):
        assert g.choices[0].text == w.outputs[0].text
        assert g.choices[0].finish_reason == w.outputs[0].finish_reason == "length"
        assert g.usage.prompt_tokens == len(w.prompt_token_ids)
        assert g.usage.completion_tokens == 12
        assert s == (w.outputs[0].text, "length")


def test_chat_equals_llm_generate_on_the_chat_template(client, llm):
    from minivllm import SamplingParams
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=False)
    want = llm.generate([text], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(model="smol", messages=messages, max_tokens=10,
                                         temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    streamed = stream_text(client.chat.completions.create(
        model="smol", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert streamed == (want.outputs[0].text, want.outputs[0].finish_reason)


def test_stop_strings_streamed_and_not(client):
    kw = dict(model="smol", prompt="List: apples, pears, plums, apples, pears,", max_tokens=24,
              temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**kw).choices[0].text
    stop_str = free[len(free) // 2:len(free) // 2 + 3]       # a piece from the middle of it
    assert len(stop_str) == 3
    full = client.completions.create(**kw, stop=[stop_str])
    c = full.choices[0]
    assert c.finish_reason == "stop" and stop_str not in c.text
    assert c.text == free[:free.index(stop_str)]
    assert stream_text(client.completions.create(**kw, stop=[stop_str], stream=True)) == \
        (c.text, "stop")


def test_seeds(client):
    kw = dict(model="smol", prompt="Write a word:", max_tokens=8, temperature=1.0)
    a = client.completions.create(**kw, seed=123).choices[0].text
    b = client.completions.create(**kw, seed=123).choices[0].text
    assert a == b
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds should not all give the same sample"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=2, temperature=0), "n"),                     # greedy n > 1, as vLLM
    (dict(max_tokens=600), "maximum context length"),
    (dict(max_tokens=512), "maximum context length"),     # 1 + 512 > 512: no clamp
    (dict(extra_body={"min_tokens": 8}), "min_tokens"),
    (dict(extra_body={"top_k": "many"}), "top_k"),
])
def test_bad_requests_are_400_with_nothing_queued(server, client, kwargs, needle):
    before = metric(server, "vllm:prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="Hi", **{"max_tokens": 4, **kwargs})
    assert e.value.status_code == 400 and needle in e.value.body["message"]
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "vllm:prompt_tokens_total") == before


def test_bad_chat_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages="not a list", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    r = httpx.post(client.base_url.join("completions").__str__(), content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


@pytest.mark.parametrize("body, param", [
    ({"messages": [{}], "max_tokens": 4}, "messages.0.role"),         # was a 500 (jinja)
    ({"messages": [{"role": "user"}]}, "messages.0.content"),         # was a 500 (jinja)
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 600}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}], "seed": 2 ** 64}, "seed"),
    ({"messages": [{"role": "user", "content": "Hi"}], "temperature": 2.5}, "temperature"),
])
def test_malformed_chat_is_400_naming_the_field(server, body, param):
    before = metric(server, "vllm:prompt_tokens_total")
    r = httpx.post(server + "/v1/chat/completions", content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})     # ASCII: \ud800 stays
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and param in err["message"]
    assert metric(server, "vllm:prompt_tokens_total") == before


def test_content_parts_and_unknown_fields(client, server):
    parts = client.chat.completions.create(
        model="smol", max_tokens=4, temperature=0, extra_body={"not_a_field": 1},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                {"type": "text", "text": "there"}]}])
    plain = client.chat.completions.create(
        model="smol", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "Hello\nthere"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    r = httpx.post(server + "/v1/completions", content=b"\xff\xfe",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_openapi_documents_every_status(server):
    spec = httpx.get(server + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "500", "503"}
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_overload_503_and_disconnect_aborts(server, client):
    """MAX_PENDING streams in flight: one more is a 503 at once. Closing the streams (the clients
    go away) aborts their requests: nothing runs and no KV block stays in use."""
    streams = []
    try:
        for i in range(MAX_PENDING):
            s = client.completions.create(model="smol", prompt=f"Count to a hundred: {i}",
                                          max_tokens=200, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            next(iter(s))                          # the request is in flight
            streams.append(s)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="smol", prompt="one more", max_tokens=2)
        assert e.value.status_code == 503 and "overloaded" in e.value.body["message"]
        assert time.monotonic() - t0 < 10
        assert metric(server, "vllm:num_requests_running") > 0
    finally:
        for s in streams:
            s.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (metric(server, "vllm:num_requests_running") == 0
                and metric(server, "vllm:kv_cache_usage_perc") == 0.0):
            break
        time.sleep(0.3)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0
    # Still serving.
    assert client.completions.create(model="smol", prompt="Hi", max_tokens=2).choices[0].text


def test_metrics_names(server):
    text = httpx.get(server + "/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_sum"]:
        assert name in text
    assert metric(server, "vllm:time_to_first_token_seconds_count") > 0
    assert metric(server, "vllm:generation_tokens_total") > 0


def test_spec_decode_counters(server, client):
    """The server runs n-gram speculative decoding (the greedy tests above compare it with plain
    ``LLM.generate``); its counters reach /metrics under vLLM's names."""
    client.completions.create(model="smol", prompt="a b c a b c a b c a b", max_tokens=16,
                              temperature=0, extra_body={"ignore_eos": True})
    assert metric(server, "vllm:spec_decode_num_drafts_total") > 0
    assert "vllm:spec_decode_num_accepted_tokens_total" in httpx.get(server + "/metrics").text


def test_console_script_and_serve_flags(capsys):
    from minivllm.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ["--model", "--host", "--port", "--max-num-seqs", "--block-size", "--dtype",
                 "--seed", "--speculative-config", "--kv-transfer-config"]:
        assert flag in out
    with pytest.raises(SystemExit) as e:
        main(["bogus"])
    assert e.value.code == 2


def test_bench_workload_and_summary():
    from minivllm.bench.serve_client import RequestResult, Workload, summarize
    wl = Workload(duration_s=30, chat_rate=1.0, burst_every_s=10, burst_size=2,
                  long_tokens=(100, 200), seed=3)
    reqs = wl.requests()
    assert reqs == wl.requests()                               # fixed by the seed
    longs = [r for r in reqs if r["kind"] == "long"]
    assert [r["t"] for r in longs] == [5, 5, 15, 15, 25, 25]
    assert all(100 <= len(r["body"]["prompt"]) <= 200 for r in longs)
    chat = RequestResult("chat", 1.0, [1.5, 1.6, 1.8], num_tokens=3)
    slow = RequestResult("chat", 2.0, [5.0, 6.0], num_tokens=2)
    s = summarize([chat, slow, RequestResult("long", 0.0, error="HTTP 503")], 1.0, 0.5)
    assert s["errors"] == 1 and s["requests"] == 3
    assert s["chat_ttft_p50"] == pytest.approx((0.5 + 3.0) / 2)
    assert chat.itls == pytest.approx([0.1, 0.2]) and chat.tpot == pytest.approx(0.15)
    assert s["slo_attained"] == 0.5                            # only `chat` meets both SLOs
    assert s["goodput_req_s"] == pytest.approx(1 / (6.0 - 1.0))


def test_sigterm_stops_quietly(model_dir, tmp_path):
    """SIGTERM: the server finishes and exits 0, and logs no traceback (once it logged the
    lifespan task's CancelledError, which read like a crash)."""
    log = str(tmp_path / "server.log")
    _, proc = start_server(["--model", model_dir, "--max-model-len", "128",
                            "--num-gpu-blocks-override", "32"], log)
    stop(proc)
    text = open(log).read()
    assert proc.returncode == 0, text[-2000:]
    assert "Traceback" not in text and "CancelledError" not in text, text[-2000:]
