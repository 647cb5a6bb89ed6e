"""Case j, vLLM side, the trees: arctic-inference's ``SuffixDecodingCache`` (what vLLM 0.32's
``method="suffix"`` calls) replays the test's operations (no engine).

Input: ``{"cases": [{"max_tree_depth", "max_cached_requests", "ops": [...]}]}``, each op one of
``["start", req, prompt]``, ``["add", req, tokens]``, ``["stop", req]``, ``["evict", req]``,
``["spec", req, context, max_spec_tokens, max_spec_factor, min_token_prob]``.
Output: ``{"drafts": [[[token_ids, probs, score, match_len] per "spec" op] per case]}``, or
``{"missing": "..."}`` when arctic-inference is not installed in this venv.
"""
from common import read_input, write_output

if __name__ == "__main__":
    cases = read_input()["cases"]
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        write_output({"missing": f"arctic-inference is not importable in the vLLM venv ({e})"})
        raise SystemExit(0)
    out = []
    for case in cases:
        cache = SuffixDecodingCache(max_tree_depth=case["max_tree_depth"],
                                    max_cached_requests=case["max_cached_requests"])
        drafts = []
        for op, req, *args in case["ops"]:
            if op == "start":
                cache.start_request(req, args[0])
            elif op == "add":
                cache.add_active_response(req, args[0])
            elif op == "stop":
                cache.stop_request(req)
            elif op == "evict":
                cache.evict_cached_response(req)
            else:
                context, max_spec_tokens, factor, min_prob = args
                d = cache.speculate(req, context, max_spec_tokens=max_spec_tokens,
                                    max_spec_factor=factor, min_token_prob=min_prob)
                drafts.append([list(d.token_ids), list(d.probs), d.score, d.match_len])
        out.append(drafts)
    write_output({"drafts": out})
