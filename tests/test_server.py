"""End to end: a real uvicorn server on 127.0.0.1 around the real AsyncLLM on the embedded SmolLM2-135M, driven by the
official openai client (httpx for the raw SSE bytes and the non-OpenAI routes). The offline LLM on the same engine is
the oracle for what the server must return."""

from __future__ import annotations

import io
import json
import re

import httpx
import openai
import pytest
from server_harness import (
    SMOL_ENGINE_ARGS,
    TINY_COMPILES,
    TINY_REFERENCE_PROMPT,
    running_server,
    tiny_llm,
    wait_idle,
)

from kiln.serving import cli
from kiln.serving.app import ServerConfig, build_app
from kiln.serving.llm import LLM, AsyncLLM, build_engine
from kiln.serving.params import SamplingParams

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
MODEL = "smol"
TINY = "tiny"
HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def smol():
    """(openai client, base url, AsyncLLM, offline references). One engine with a single token bucket, in the SmolLM2
    group's geometry (server_harness.SMOL_ENGINE_ARGS: its programs compiled once per worker); the offline references
    are generated on it before the engine thread takes it over."""
    engine = build_engine(None, **SMOL_ENGINE_ARGS, buckets=(16,))
    tok = engine.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    offline = LLM(engine=engine).generate([chat_ids, tok.encode(PROMPT)], greedy)
    ref = {"chat": offline[0], "completion": offline[1], "chat_ids": chat_ids}
    llm = AsyncLLM(engine)
    try:
        with running_server(build_app(llm, ServerConfig(served_model_names=(MODEL, "smol-alias")))) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), url, llm, ref
    finally:
        llm.shutdown()


def test_warmed_jit_engine_compiles_nothing_at_its_first_request():
    """build_engine(warmup=True) on a checkpoint (the jit path) compiles every program a request can use, in the
    forms it is called with: its first cache committed to the device like every later one, and the multi-step decode
    also with token ids read on the device (dispatch_ahead). Each form was a compilation at the first request."""
    tiny_llm()
    assert TINY_COMPILES == []


def test_chat_matches_offline_llm(smol):
    client, _, llm, ref = smol
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert isinstance(r.created, int) and len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant"
    assert c.message.content == ref["chat"].new_text and c.message.content.strip()
    assert c.finish_reason == ref["chat"].finish_reason
    n = len(ref["chat"].new_token_ids)
    assert r.usage.prompt_tokens == len(ref["chat_ids"]) and r.usage.completion_tokens == n
    assert r.usage.total_tokens == r.usage.prompt_tokens + n

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref["chat"].new_text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref["chat"].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(ch.usage is None for ch in chunks[:-1])
    wait_idle(llm)


def test_sse_wire_format(smol):
    _, url, _, ref = smol
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref["completion"].new_text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)


def test_other_routes(smol):
    client, url, llm, ref = smol
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "smol-alias"] and models.data[0].object == "model"
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert tok["tokens"] == ref["chat_ids"] and tok["count"] == len(ref["chat_ids"]) and tok["max_model_len"] == 1024
    text = httpx.post(url + "/detokenize", json={"tokens": ref["completion"].new_token_ids}).json()["prompt"]
    assert text == ref["completion"].new_text
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    spec = httpx.get(url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(spec["paths"])
    assert "ChatCompletionRequest" in spec["components"]["schemas"]

    def scrape() -> tuple[str, float, float]:
        wait_idle(llm)  # the engine's counters are published once its loop is idle again
        text = httpx.get(url + "/metrics").text
        gen = re.search(r'^vllm:generation_tokens_total{model_name="smol"} (\S+)', text, re.M)
        done = re.findall(r'^vllm:request_success_total{finished_reason="\w+",model_name="smol"} (\S+)', text, re.M)
        return text, float(gen[1]), sum(map(float, done))

    _, gen0, done0 = scrape()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    metrics, gen1, done1 = scrape()
    assert gen1 == gen0 + 8 and done1 == done0 + 1 and gen1 == llm.stats().generation_tokens_total
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"]:  # fmt: skip
        assert re.search(rf'^{re.escape(name)}{{.*model_name="{MODEL}"', metrics, re.M), name
    ttft = re.search(r'^vllm:time_to_first_token_seconds_count{model_name="smol"} (\S+)', metrics, re.M)
    assert float(ttft[1]) >= 1


def test_chat_logprobs(smol):
    client, _, _, ref = smol
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == r.choices[0].message.content
    assert ref["chat"].new_text.startswith(r.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)  # greedy: the likeliest token
        assert bytes(t.bytes).decode() == t.token


def test_engine_stopped_is_503(smol):
    """Last of the SmolLM2 tests: once the engine thread is gone, health and new requests answer 503."""
    client, url, llm, _ = smol
    llm.shutdown()
    assert httpx.get(url + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "engine_dead"


# ---- the same server code on the tiny random model (fast steps) for the request fields ----------------------------


@pytest.fixture(scope="module")
def tiny():
    """(openai client, base url, AsyncLLM, offline greedy output of 24 tokens for TINY_REFERENCE_PROMPT)."""
    llm, ref = tiny_llm()
    with running_server(build_app(llm, ServerConfig(served_model_names=(TINY,)))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), url, llm, ref


def test_stream_text_is_the_offline_text(tiny):
    """Random weights emit arbitrary bytes, so multi-byte characters are split across tokens: the streamed pieces
    must still concatenate to exactly the offline text (no broken or doubled UTF-8 sequences)."""
    client, _, llm, ref = tiny
    stream = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=24, temperature=0,
                                       stream=True)  # fmt: skip
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == ref.new_text == llm.tokenizer.decode(ref.new_token_ids)
    assert all(p.encode("utf-8").decode("utf-8") == p for p in pieces)


def test_prompt_forms_and_echo(tiny):
    client, url, _, ref = tiny
    want = ref.new_text
    prompt_ids = httpx.post(url + "/tokenize", json={"prompt": TINY_REFERENCE_PROMPT}).json()["tokens"]
    r = client.completions.create(model=TINY, prompt=prompt_ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(ref.new_token_ids)
    r = client.completions.create(model=TINY, prompt=[TINY_REFERENCE_PROMPT, "x"], max_tokens=24, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == want
    r2 = client.completions.create(model=TINY, prompt=[prompt_ids, prompt_ids[:1]], max_tokens=24, temperature=0)
    assert [c.text for c in r2.choices][0] == want
    assert r2.usage.prompt_tokens == len(prompt_ids) + 1
    r = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=24, temperature=0, echo=True)
    assert r.choices[0].text == TINY_REFERENCE_PROMPT + want


def test_n_and_seed(tiny):
    client, _, _, _ = tiny
    kw = dict(model=TINY, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=1.0, n=3,
              seed=1234, extra_body={"ignore_eos": True})  # fmt: skip
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # the same seed gives the same samples
    assert len(set(texts)) == 3  # choice i samples with seed + i
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == b.usage.prompt_tokens
    assert [c.message.content for c in client.chat.completions.create(**{**kw, "seed": 99}).choices] != texts
    stream = client.completions.create(model=TINY, prompt="abc", max_tokens=5, n=2, seed=7, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    finished = sorted(c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_stream_usage_options(tiny):
    client, _, _, _ = tiny
    kw = dict(model=TINY, messages=[HI], max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(**kw, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": True}))  # fmt: skip
    assert all(c.usage is not None for c in chunks) and chunks[-1].choices == []
    assert [c.usage.completion_tokens for c in chunks][-1] == 6
    assert all(c.usage is None for c in client.chat.completions.create(**kw))  # no usage unless asked


def test_completion_logprobs(tiny):
    client, _, _, ref = tiny
    r = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 4  # the chosen token and its 3 alternatives (strings may collide)
        assert top[token] == chosen and max(top.values()) <= chosen + 1e-4  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_stop_strings_and_stop_token_ids(tiny):
    client, _, _, ref = tiny
    full = ref.new_text
    stop = full[8:10]  # two characters from the middle of the greedy continuation
    cut = full[: full.index(stop)]
    r = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=24, temperature=0,
                                  stop=[stop, "never-seen"])  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == cut
    stream = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=24, temperature=0,
                                       stop=stop, stream=True)  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == cut and chunks[-1].finish_reason == "stop"
    third = ref.new_token_ids[2]
    first = ref.new_token_ids.index(third)
    r = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [third]})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1


def test_max_tokens_min_tokens_ignore_eos(tiny):
    client, _, _, ref = tiny
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=TINY, messages=msgs, max_completion_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=TINY, messages=msgs, max_tokens=30, temperature=0.7, presence_penalty=1.5,
                                       frequency_penalty=-0.5, top_p=0.9, user="u1",
                                       extra_body={"ignore_eos": True, "min_tokens": 30, "top_k": 50, "min_p": 0.01,
                                                   "repetition_penalty": 1.2})  # fmt: skip
    assert r.usage.completion_tokens == 30 and r.choices[0].finish_reason == "length"
    # the greedy first token as a stop token ends the request at once, unless min_tokens holds it back
    stop_first = {"stop_token_ids": [ref.new_token_ids[0]]}
    r = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=20, temperature=0,
                                  extra_body=stop_first)  # fmt: skip
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=TINY, prompt=TINY_REFERENCE_PROMPT, max_tokens=20, temperature=0,
                                  extra_body={**stop_first, "min_tokens": 5})  # fmt: skip
    assert r.usage.completion_tokens >= 5


def test_kiln_chat_streams_the_reply(tiny, monkeypatch, capsys):
    client, url, _, _ = tiny
    want = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                          temperature=0).choices[0].message.content  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\n"))
    assert cli.main(["chat", "--base-url", url + "/v1", "--max-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == f"> {want}\n> " and f"Chatting with {TINY}" in out.err  # prompt, streamed reply, prompt


def test_message_forms_render_like_strings(tiny):
    """Text parts are joined, developer is system, tool and assistant tool-call messages reach the template."""
    _, url, _, _ = tiny
    tokenize = lambda messages: httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenize(parts) == tokenize([{"role": "user", "content": "a\nb"}])
    assert tokenize([{"role": "developer", "content": "x"}]) == tokenize([{"role": "system", "content": "x"}])
    convo = [HI,
             {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "42"}]  # fmt: skip
    text = httpx.post(url + "/detokenize", json={"tokens": tokenize(convo)}).json()["prompt"]
    assert text == "<user>hi\n<assistant>\n<tool>42\n<assistant>"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [HI], "max_tokens": 2, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def conforms(value, schema: dict, spec: dict, at: str = "$") -> None:
    """Assert that `value` validates against an OpenAPI (JSON Schema 2020-12) `schema` of `spec`, the subset pydantic
    writes; an object may only carry documented properties, so the documented and the sent shapes cannot drift."""
    if "$ref" in schema:
        return conforms(value, spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], spec, at)
    if "anyOf" in schema:
        failures = []
        for option in schema["anyOf"]:
            try:
                return conforms(value, option, spec, at)
            except AssertionError as e:
                failures.append(str(e))
        raise AssertionError(f"{at}: {value!r:.80} matches no allowed form ({'; '.join(failures)})")
    if "const" in schema:
        assert value == schema["const"], f"{at}: {value!r} is not {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{at}: {value!r} not in {schema['enum']}"
    kinds = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool,
             "null": type(None)}  # fmt: skip
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, kinds[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
        assert ok, f"{at}: {value!r:.80} is not of type {kind}"
    if kind == "object":
        props = schema.get("properties", {})
        missing = set(schema.get("required", ())) - set(value)
        assert not missing, f"{at}: missing {missing}"
        for k, v in value.items():
            if k in props:
                conforms(v, props[k], spec, f"{at}.{k}")
            else:
                extra = schema.get("additionalProperties")
                assert isinstance(extra, dict), f"{at}: undocumented field {k!r}"
                conforms(v, extra, spec, f"{at}.{k}")
    if kind == "array":
        for i, v in enumerate(value):
            conforms(v, schema.get("items", {}), spec, f"{at}[{i}]")


def test_every_response_validates_against_openapi(tiny):
    """Each route's answers (JSON bodies, every streamed event, errors) validate against /openapi.json's schemas."""
    _, url, _, _ = tiny
    spec = httpx.get(url + "/openapi.json").json()

    def check(method: str, path: str, r: httpx.Response) -> None:
        op = spec["paths"][path][method]
        if r.status_code != 200:
            schema = op["responses"]["default"]["content"]["application/json"]["schema"]
            return conforms(r.json(), schema, spec)
        content = op["responses"]["200"]["content"]
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]" and len(events) > 2
            for e in events[:-1]:
                assert "error" not in json.loads(e), e
                conforms(json.loads(e), content["text/event-stream"]["schema"], spec)
        else:
            conforms(r.json(), content["application/json"]["schema"], spec)

    chat = {"model": TINY, "messages": [HI], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    completion = {"model": TINY, "prompt": ["a", "b"], "max_tokens": 4, "logprobs": 2, "n": 2}
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for path, body in [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True, **usage}),
        ("/v1/completions", completion),
        ("/v1/completions", {**completion, "stream": True, **usage}),
        ("/v1/completions", {"prompt": "a", "max_tokens": 3, "echo": True, "stream": True}),
        ("/v1/completions", {"prompt": "a", "max_tokens": 10_000}),  # an error
        ("/tokenize", {"messages": [HI]}),
        ("/tokenize", {"prompt": "abc"}),
        ("/detokenize", {"tokens": [97, 98]}),
        ("/detokenize", {"tokens": [-1]}),
    ]:
        check("post", path, httpx.post(url + path, json=body, timeout=60))
    for path in ("/v1/models", "/version", "/health"):
        check("get", path, httpx.get(url + path))


def test_kiln_bench_drives_the_server_with_its_own_prompts_per_level(tiny, tmp_path, capsys):
    """`kiln bench` against the real server: one row a level, every request's tokens back. Each level's prompts come
    from (seed, level, its repeat): the same in every run with that seed, none shared between levels or a level's
    repeat (the server's prefix cache would answer them: benchmark figures of a c = 64 run after c = 1 were)."""
    from kiln.serving.bench_cmd import level_prompts

    _, url, _, _ = tiny
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--base-url", url + "/v1", "--vocab-size", "200", "--input-len", "8", "--output-len",
                     "4", "--concurrency", "1,2,2", "--num-prompts", "2", "--json", str(out)]) == 0  # fmt: skip
    assert "| 2 | 2 | 0 |" in capsys.readouterr().out
    levels = json.loads(out.read_text())["levels"]
    assert [(lv["concurrency"], lv["num_prompts"], lv["failed"]) for lv in levels] == [(1, 2, 0), (2, 2, 0), (2, 2, 0)]
    assert all(lv["output_tokens_per_s"] > 0 for lv in levels)
    drawn = [level_prompts(0, c, repeat, 2, 200, 8) for c, repeat in ((1, 0), (2, 0), (2, 1))]
    assert len({tuple(p) for level in drawn for p in level}) == 6 and level_prompts(0, 2, 0, 2, 200, 8) == drawn[1]
    assert all(len(p) == 8 and max(p) < 200 for level in drawn for p in level)
    assert cli.main(["bench", "--base-url", url + "/v1", "--vocab-size", "200", "--seed", "-1"]) == 1
    assert capsys.readouterr().err.endswith("kiln: error: --seed must be a non-negative integer, not -1.\n")
