"""Multi-step decode (kiln.models.step.decode_steps): several decode tokens per dispatch, each step's sampled tokens
fed back on the device. Its outputs must be exactly those of one token per step — for greedy, seeded sampling with
truncation, penalties (their history grows on the device), logprobs, stop tokens, stop strings, max_tokens that are
no multiple of the step count, min_tokens and the context length — through the jit path and through an artifact's
AOT-compiled decode programs."""

from __future__ import annotations

import numpy as np
import pytest
from server_harness import TINY_ENGINE_ARGS, tiny_folder

from kiln.serving.engine import Engine
from kiln.serving.llm import LLM, build_engine
from kiln.serving.params import SamplingParams

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # tiny models: compiling costs more than running

K = 4


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    """The tiny byte-level llama (T = 16 > S = 8 in its decode bucket) with one and with K tokens per dispatch."""
    one = build_engine(str(tiny_folder()), **TINY_ENGINE_ARGS, decode_steps=1)
    multi = build_engine(str(tiny_folder()), **TINY_ENGINE_ARGS, decode_steps=K)
    return one, multi


def requests(ref_text: str) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(0)

    def p(n: int) -> list[int]:
        return rng.integers(3, 256, n).tolist()

    stop = ref_text[9:11]  # two characters from the middle of a greedy output
    return {
        "greedy": (p(12), SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)),
        "seeded": (p(30), SamplingParams(max_tokens=21, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True)),
        "penalties": (p(5), SamplingParams(max_tokens=30, temperature=0.8, repetition_penalty=1.4,
                                           frequency_penalty=0.7, presence_penalty=0.3, seed=3, ignore_eos=True)),
        "logprobs": (p(9), SamplingParams(max_tokens=13, temperature=0.0, logprobs=3, ignore_eos=True)),
        "stop_string": (REF_PROMPT, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], ignore_eos=True)),
        "min_tokens": (p(7), SamplingParams(max_tokens=18, min_tokens=6, temperature=1.0, seed=11)),
        "context": (p(TINY_ENGINE_ARGS["max_model_len"] - 10), SamplingParams(max_tokens=None, temperature=0.0,
                                                                               ignore_eos=True)),
    }  # fmt: skip


REF_PROMPT = [72, 105, 32, 116, 104, 101, 114, 101]


def run(eng: Engine, reqs: dict) -> dict[str, dict]:
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params)
    got = {rid: {"ids": [], "text": "", "lps": []} for rid in reqs}
    while eng.has_unfinished():
        outs = eng.step()
        assert len({out.request_id for out in outs}) == len(outs)  # one update per request and step
        for out in outs:
            g = got[out.request_id]
            g["ids"] += out.new_token_ids
            g["text"] += out.new_text
            g["lps"] += [(lp.token_id, round(lp.logprob, 5), [t for t, _ in lp.top]) for lp in out.logprobs or []]
            if out.finished:
                g["reason"], g["usage"] = out.finish_reason, out.completion_tokens
    assert eng.scheduler.bm.num_free == eng.scheduler.bm.num_pages  # nothing leaked
    return got


def test_k_tokens_per_dispatch_give_the_outputs_of_one(engines):
    one, multi = engines
    [ref] = LLM(engine=one).generate([REF_PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    reqs = requests(ref.new_text)
    single_before, multi_before = one.runner.steps_run, multi.runner.steps_run
    want = run(one, reqs)
    got = run(multi, reqs)
    assert got == want
    assert want["stop_string"]["reason"] == "stop" and len(want["stop_string"]["ids"]) < 20
    assert want["context"]["reason"] == "length" and want["min_tokens"]["usage"] >= 6
    assert want["greedy"]["usage"] == 23 and len(want["logprobs"]["lps"]) == 13
    single, multi = one.runner.steps_run - single_before, multi.runner.steps_run - multi_before
    assert multi < 0.6 * single  # K-token dispatches ran (30 single steps against 16 dispatches when written)


def test_a_batch_that_is_not_all_decodes_takes_single_steps(engines):
    _, multi = engines
    multi.add_request("long", list(range(3, 200)), SamplingParams(max_tokens=2, temperature=0.0))
    assert multi.scheduler.schedule_decodes(K) is None  # a prompt waits
    while multi.has_unfinished():
        multi.step()


def test_an_artifact_carries_decode_programs(tmp_path, engines):
    """An AOT-compiled cpu artifact with --decode-steps K: decode_t<T> programs for the buckets T <= max_num_seqs,
    and the same tokens as the jit path."""
    from kiln.compile import ensure_artifact

    one, _ = engines
    path = ensure_artifact(str(tiny_folder()), "cpu", out=str(tmp_path / "art"), buckets=(4, 16), max_num_seqs=4,
                           max_model_len=128, decode_steps=K)  # fmt: skip
    llm = LLM(str(path))
    assert sorted(llm.engine.runner.decode) == [4] and llm.engine.decode_steps == K
    reqs = {k: v for k, v in requests("x" * 12).items() if k in ("greedy", "seeded", "penalties", "logprobs")}
    got = run(llm.engine, reqs)
    want = run(one, reqs)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}


def test_decode_programs_run_ahead(engines, monkeypatch):
    """While every sequence decodes, the next K-token program is dispatched before the tokens of the one in flight
    are read (Engine._run_ahead, Runner.dispatch_ahead): the outputs stay those of single steps, also where a stop
    string or the context length ends a sequence while a program runs ahead, and an abort then leaks no page."""
    one, multi = engines
    calls = []
    dispatch_ahead = multi.runner.dispatch_ahead
    monkeypatch.setattr(multi.runner, "dispatch_ahead", lambda *a: calls.append(1) or dispatch_ahead(*a))
    [ref] = LLM(engine=one).generate([REF_PROMPT], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    reqs = {k: v for k, v in requests(ref.new_text).items() if k in ("greedy", "seeded", "logprobs", "stop_string")}
    for rid, n in (("greedy", 41), ("seeded", 37), ("logprobs", 30)):
        reqs[rid][1].max_tokens = n
    assert run(multi, reqs) == run(one, reqs)
    assert len(calls) >= 5
    multi.add_request("aborted", REF_PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while multi._ahead is None:
        multi.step()
    multi.abort("aborted")
    while multi.has_unfinished():
        multi.step()
    after = {"after": (REF_PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))}
    assert run(multi, after) == run(one, after)
    # a step's tokens come back from the next call, which returns without waiting for the step it dispatched
    multi.add_request("first", REF_PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert multi.step() == [] and multi._inflight is not None  # the prefill, in flight
    [out] = multi.step()
    assert len(out.new_token_ids) == 1 and multi._inflight[0].steps == K  # the first decode program, in flight
    while multi.has_unfinished():
        multi.step()
