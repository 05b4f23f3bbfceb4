"""The engine end to end on the CPU: a tiny random float32 Llama against transformers and against itself run alone
(chunked prefill, preemption, aborts, prefix caching, seeds, stop conditions, logprobs, AsyncLLM); the embedded
SmolLM2 with its real tokenizer for text: stop strings across token boundaries, LLM.generate and `kiln generate`.

One jitted step per model serves every engine of this module (engines differ only in host-side scheduling: page
pool, token budget, context length), so each bucket compiles once."""

from __future__ import annotations

import argparse
import asyncio
import random

import jax
import numpy as np
import pytest
import torch
from server_harness import SMOL_ENGINE_ARGS
from tiny_models import make_model

from kiln.models.batch import KVCache
from kiln.models.checkpoint import hf
from kiln.models.errors import KilnError
from kiln.models.step import jit_step
from kiln.serving import generate_cmd
from kiln.serving.block_manager import BlockManager
from kiln.serving.cli import COMMANDS
from kiln.serving.engine import Engine
from kiln.serving.llm import LLM, AsyncLLM, build_engine
from kiln.serving.params import SamplingParams
from kiln.serving.runner import Runner
from kiln.serving.scheduler import Scheduler

PAGE = 8
MAX_LEN = 128
SEQS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    model = make_model("llama", folder)
    cfg, weights = hf.load(folder)
    runner = Runner(
        jit_step(cfg),
        jax.device_put(weights),
        KVCache.create(cfg, num_pages=96, page_size=PAGE),
        page_size=PAGE,
        max_num_seqs=SEQS,
        max_pages_per_seq=MAX_LEN // PAGE,
        buckets=(16, 64),
    )
    return model, cfg, runner


def engine(tiny, *, num_pages=96, budget=64, max_len=MAX_LEN, caching=True) -> Engine:
    _, cfg, runner = tiny
    sched = Scheduler(
        BlockManager(num_pages, PAGE, enable_prefix_caching=caching),
        max_num_seqs=SEQS,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        eos_token_ids=cfg.eos_token_ids,
    )
    return Engine(runner, sched, cfg=cfg)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run_all(eng: Engine, requests: dict, on_step=None) -> dict[str, list[int]]:
    """Submit {id: (prompt, params)}, step to the end; returns the token ids per id, checking invariants."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    got = {rid: [] for rid in requests}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        eng.scheduler.bm.check(eng.scheduler.tables())
        if on_step:
            on_step(eng, steps)
        steps += 1
    assert eng.scheduler.bm.num_free == eng.scheduler.bm.num_pages  # nothing leaked
    return got


def prompts(seed: int, n: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


def test_greedy_matches_transformers_generate(tiny):
    model, _, _ = tiny
    ps = prompts(0, 4)
    got = run_all(engine(tiny), {f"r{i}": (p, greedy(24)) for i, p in enumerate(ps)})
    model.generation_config.eos_token_id = None
    for i, p in enumerate(ps):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
        assert got[f"r{i}"] == ref


def test_an_artifact_serves_through_the_same_runner(tmp_path, tiny):
    """The compile teammate's artifact (AOT-compiled programs per bucket) drives the same engine: same tokens as
    transformers, prompts longer than the one bucket are chunked."""
    from tiny_tokenizer import write_tokenizer

    from kiln.compile import ensure_artifact

    model, _, _ = tiny
    src = tmp_path / "src"
    model.save_pretrained(src, safe_serialization=True)
    write_tokenizer(src)
    path = ensure_artifact(str(src), "cpu", out=str(tmp_path / "art"), buckets=(16,), max_num_seqs=4,
                           max_model_len=128)  # fmt: skip
    llm = LLM(str(path))
    assert llm.engine.runner.buckets == (16,) and llm.tokenizer is not None
    ps = prompts(14, 3, 3, 40)
    outs = llm.generate(ps, greedy(10))
    model.generation_config.eos_token_id = None
    for p, out in zip(ps, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
        assert out.new_token_ids == ref
        assert out.new_text == llm.tokenizer.decode(ref)


def test_chunked_prefill_preemption_and_aborts_leave_outputs_unchanged(tiny):
    rng = random.Random(1)
    shared = prompts(1, 1, 40, 41)[0]
    ps = prompts(2, 10, 5, 70) + [shared[:33] + p for p in prompts(3, 3, 2, 10)]
    reqs = {f"r{i}": (p, greedy(rng.randrange(4, 40))) for i, p in enumerate(ps)}
    alone = {}
    big = engine(tiny)
    for rid, req in reqs.items():
        alone.update(run_all(big, {rid: req}))
    # 14 pages of 8 tokens for up to 8 sequences of up to 96 tokens; 24-token budget: prompts are chunked
    small = engine(tiny, num_pages=14, budget=24, max_len=96)
    victims = {"r3", "r7"}

    def abort_some(eng, step):
        if step == 5:
            for v in victims:
                eng.abort(v)

    got = run_all(small, reqs, abort_some)
    assert small.stats().num_preemptions > 0
    for rid in reqs:
        if rid not in victims:
            assert got[rid] == alone[rid], rid
    stats = small.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0.0


def test_queued_prefill_steps_give_the_tokens_of_unqueued_steps(tiny):
    """Engine.prefill_ahead: prompts of 90-120 tokens at a 64-token budget keep prompt work behind every step, so the
    next step is queued while one runs (decodes sit out the step after the one they sample in); greedy tokens, with
    an abort and a late arrival, are those of the engine with queueing off."""
    ps = prompts(15, 8, 90, 121)
    reqs = {f"r{i}": (p, greedy(12)) for i, p in enumerate(ps[:7])}
    got, queued = {}, {}
    for ahead in (False, True):
        eng = engine(tiny)
        eng.prefill_ahead = ahead
        queued[ahead] = 0

        def on_step(eng, step, ahead=ahead):
            queued[ahead] += eng._queued is not None
            if step == 3:
                eng.abort("r2")
                eng.add_request("late", ps[7], greedy(12))

        got[ahead] = run_all(eng, reqs, on_step)
    assert queued[False] == 0 and queued[True] >= 8, queued
    assert got[True] == got[False] and len(got[True]["late"]) == 12


def test_prefix_cache_serves_the_shared_prefix_once_with_identical_outputs(tiny):
    prefix = prompts(4, 1, 43, 44)[0]  # 43 tokens: 5 full pages
    tails = prompts(5, 4, 1, 6)
    outs = {}
    for caching in (True, False):
        eng = engine(tiny, caching=caching)
        eng.add_request("first", prefix + tails[0], greedy(8))
        eng.step()  # the first prompt is computed (and its pages registered) before the others arrive
        got = run_all(eng, {f"r{i}": (prefix + t, greedy(8)) for i, t in enumerate(tails[1:])})
        outs[caching] = got
        stats = eng.stats()
        assert stats.prefix_cache_hits == (3 * 40 if caching else 0)
        assert stats.prefix_cache_queries == sum(len(prefix + t) for t in tails)
    assert outs[True] == outs[False]


def test_a_seeded_request_is_the_same_alone_and_in_a_busy_batch(tiny):
    p = prompts(6, 1)[0]
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = run_all(engine(tiny), {"s": (p, seeded)})["s"]
    busy = {
        "s": (p, seeded),
        "g": (prompts(7, 1)[0], greedy(20)),
        "pen": (prompts(8, 1)[0], SamplingParams(max_tokens=20, temperature=1.0, repetition_penalty=1.3,
                                                 frequency_penalty=0.5, ignore_eos=True)),
        "x": (prompts(9, 1)[0], SamplingParams(max_tokens=20, temperature=0.5, min_p=0.1, seed=5, ignore_eos=True)),
        "long": (prompts(10, 1, 100, 101)[0], greedy(5)),
    }  # fmt: skip
    assert run_all(engine(tiny, budget=64), busy)["s"] == alone
    other_seed = SamplingParams(**{**seeded.__dict__, "seed": 99})
    assert run_all(engine(tiny), {"s": (p, other_seed)})["s"] != alone


def test_stop_token_ids_min_tokens_max_tokens_and_context_length(tiny):
    p = prompts(11, 1, 20, 21)[0]
    ref = run_all(engine(tiny), {"r": (p, greedy(12))})["r"]
    eng = engine(tiny, max_len=30)
    outs = {}
    for rid, params in {
        "stop": greedy(12, stop_token_ids=[ref[3]]),
        "min": greedy(12, stop_token_ids=[ref[0]], min_tokens=1),
        "max": greedy(5),
        "ctx": greedy(100),
        "none": SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
    }.items():
        eng.add_request(rid, p, params)
    while eng.has_unfinished():
        for out in eng.step():
            o = outs.setdefault(out.request_id, {"ids": [], "reason": None})
            o["ids"] += out.new_token_ids
            o["reason"] = out.finish_reason
    first_stop = ref.index(ref[3])
    assert outs["stop"] == {"ids": ref[: first_stop + 1], "reason": "stop"}
    assert outs["min"]["ids"][0] != ref[0]  # the stop id is blocked on the device for the first token
    assert outs["max"] == {"ids": ref[:5], "reason": "length"}
    assert outs["ctx"] == {"ids": ref[:10], "reason": "length"}  # 20 prompt + 10 = max_model_len 30
    assert outs["none"] == outs["ctx"]  # max_tokens None: up to the context


def test_logprobs_of_the_chosen_token_and_alternatives(tiny):
    p = prompts(12, 1)[0]
    eng = engine(tiny)
    eng.add_request("r", p, greedy(6, logprobs=5))
    lps = []
    while eng.has_unfinished():
        for out in eng.step():
            assert len(out.logprobs) == len(out.new_token_ids)
            lps += out.logprobs
    assert len(lps) == 6
    for lp in lps:
        assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id and abs(lp.top[0][1] - lp.logprob) < 1e-6
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False)) and lp.logprob <= 0


def test_bad_requests_are_one_sentence_errors(tiny):
    eng = engine(tiny, max_len=32)
    with pytest.raises(KilnError, match="context"):
        eng.add_request("a", list(range(3, 40)), greedy(4))
    with pytest.raises(KilnError, match="vocabulary"):
        eng.add_request("a", [1, 2, 999], greedy(4))
    with pytest.raises(KilnError, match="top_p"):
        eng.add_request("a", [5, 6], SamplingParams(top_p=0.0))
    with pytest.raises(KilnError, match="tokenizer"):
        eng.add_request("a", [5, 6], SamplingParams(stop=["x"]))
    eng.add_request("a", [5, 6], greedy(2))
    with pytest.raises(KilnError, match="already"):
        eng.add_request("a", [5, 6], greedy(2))
    eng.abort("a")
    assert [o.finish_reason for o in eng.step()] == ["abort"] and not eng.has_unfinished()


def test_async_llm_streams_and_aborts_when_the_consumer_leaves(tiny):
    ps = prompts(13, 3)
    expect = run_all(engine(tiny), {f"r{i}": (p, greedy(16)) for i, p in enumerate(ps)})
    llm = AsyncLLM(engine(tiny))

    async def consume(rid, prompt, stop_after=None):
        ids = []
        async for out in llm.generate(rid, prompt, greedy(16)):
            ids += out.new_token_ids
            if stop_after and len(ids) >= stop_after:
                break
        return ids

    async def main():
        results = await asyncio.gather(consume("r0", ps[0]), consume("r1", ps[1], stop_after=3), consume("r2", ps[2]))
        with pytest.raises(KilnError, match="top_p"):
            await anext(llm.generate("bad", ps[0], SamplingParams(top_p=2)))
        for _ in range(100):  # the abort reaches the engine thread
            if llm.stats().num_running == 0:
                break
            await asyncio.sleep(0.05)
        return results

    try:
        r0, r1, r2 = asyncio.run(main())
        assert r0 == expect["r0"] and r2 == expect["r2"] and r1 == expect["r1"][: len(r1)] and len(r1) < 16
        stats = llm.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0
        assert llm.is_alive()
    finally:
        llm.shutdown()
    assert not llm.is_alive()


# ---- the embedded SmolLM2 with its real tokenizer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    # float32 weights: the cpu default keeps the GGUF's blocks, whose int8 activations flip this near-tie to llama.cpp's
    # own answer (BENCHMARKS.md, issue 20); the SmolLM2 group's geometry (server_harness.SMOL_ENGINE_ARGS: the programs
    # of test_server, test_structured and test_agent_api, compiled once per worker)
    return LLM(engine=build_engine(None, **SMOL_ENGINE_ARGS, buckets=(1, 16)))


def test_kiln_generate_streams_the_same_text_as_llm_generate(smol, capsys, monkeypatch):
    """`kiln generate` asks build_engine for the plan of LLM(None, quantize="float") (the fixture's engine is handed
    back, its programs already compiled: a second SmolLM2 engine's compiles are not spent; test_plan checks that the
    jit path runs the artifact's plan) and streams the text LLM.generate gives for the chat-templated question."""
    from kiln.serving import llm as llm_module

    assert COMMANDS["generate"][0] == "kiln.serving.generate_cmd"
    tok = smol.tokenizer
    question = "What is the capital of France?"
    chat = tok.apply_chat_template([{"role": "user", "content": question}])
    [out] = smol.generate([tok.encode(chat, add_special_tokens=False)], SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in out.new_text
    asked = []
    monkeypatch.setattr(llm_module, "build_engine", lambda model, **kw: asked.append((model, kw)) or smol.engine)
    parser = argparse.ArgumentParser()
    generate_cmd.add_arguments(parser)
    args = parser.parse_args(["--quantize", "float", "--temperature", "0", "--max-tokens", "24", *question.split()])
    assert generate_cmd.run(args) == 0
    assert asked == [(None, {"target": "auto", "quantize": "float"})]
    assert capsys.readouterr().out == out.new_text + "\n"


def test_stop_strings_across_token_boundaries_are_trimmed(smol):
    tok = smol.tokenizer
    ids = tok.encode("Once upon a time, in a small village,", add_special_tokens=False)
    [ref] = smol.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    pieces = [tok.decode([t]) for t in ref.new_token_ids]
    assert "".join(pieces) == ref.new_text
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = ref.new_text.index(stop)
    eng = smol.engine
    eng.add_request("s", ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["zzzz", stop]))
    streamed, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            streamed.append(out.new_text)
            last = out
    assert "".join(streamed) == ref.new_text[:cut]
    assert last.finish_reason == "stop" and stop not in "".join(streamed)
    # the stop ends the request within the dispatch that completed it (decode_steps tokens at most)
    assert len(last.new_token_ids) <= eng.decode_steps and last.completion_tokens <= k + 2
    assert eng.scheduler.bm.num_free == eng.scheduler.bm.num_pages


def test_llm_generate_batches_text_prompts(smol):
    outs = smol.generate(["The sky is", "1, 2, 3, 4,"], SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.finished for o in outs] == [True, True] and all(o.completion_tokens == 8 for o in outs)
    assert "5" in outs[1].new_text
    again = smol.generate("1, 2, 3, 4,", SamplingParams(max_tokens=8, temperature=0.0))
    assert again[0].new_text == outs[1].new_text and again[0].cached_tokens == 0  # 7 tokens: no full page


def test_build_engine_rejects_a_missing_model():
    with pytest.raises(KilnError, match="does not exist"):
        build_engine("/nonexistent/model")
