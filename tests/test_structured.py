"""Structured outputs (kiln.serving.structured, llguidance): constrained requests on the embedded SmolLM2 produce
output that validates, every sampled token is one the grammar allowed (replayed on a host-side matcher), free rows
batched with constrained ones are unchanged, and a constrained request in a multi-step engine gets single steps."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from server_harness import SMOL_ENGINE_ARGS, TINY_ENGINE_ARGS, tiny_folder

from kiln.models.errors import KilnError
from kiln.serving.llm import LLM, build_engine
from kiln.serving.params import SamplingParams
from kiln.serving.params import StructuredOutputsParams as SO

OBJ = {"type": "object", "additionalProperties": False}
INT = {"type": "integer", "minimum": -9999, "maximum": 9999}  # SmolLM2-135M can write digits forever otherwise
NUM = {"type": "number", "minimum": -1000, "maximum": 1000}
SCHEMAS = [
    {**OBJ, "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {**OBJ, "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
    {**OBJ, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {**OBJ, "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
     "required": ["tags"]},
    {**OBJ, "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {**OBJ, "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 100}}, "required": ["n"]},
    {**OBJ, "properties": {"user": {**OBJ, "properties": {"id": INT, "email": {"type": "string", "maxLength": 40}},
     "required": ["id", "email"]}}, "required": ["user"]},
    {**OBJ, "properties": {"items": {"type": "array", "items": {**OBJ, "properties": {"sku": {"type": "string",
     "maxLength": 10}, "qty": INT}, "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 3}},
     "required": ["items"]},
    {"type": "array", "items": INT, "minItems": 2, "maxItems": 5},
    {"type": "string", "maxLength": 30},
    INT,
    {"enum": ["yes", "no", "maybe"]},
    {**OBJ, "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {**OBJ, "properties": {"kind": {"const": "point"}, "x": NUM, "y": NUM},
     "required": ["kind", "x", "y"]},
    {**OBJ, "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}},
     "required": ["value"]},
    {**OBJ, "properties": {"title": {"type": "string", "maxLength": 30}, "year": INT,
     "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action"]}, "maxItems": 3}},
     "required": ["title", "year", "genres"]},
    {**OBJ, "properties": {"note": {"type": ["string", "null"], "maxLength": 20}}, "required": ["note"]},
    {**OBJ, "properties": {"a": INT, "b": INT, "sum": INT},
     "required": ["a", "b", "sum"]},
    {**OBJ, "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 3},
     "maxItems": 3}}, "required": ["matrix"]},
    {**OBJ, "properties": {"name": {"type": "string", "maxLength": 20}, "address": {**OBJ, "properties": {
     "street": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["street", "zip"]}}, "required": ["name", "address"]},
    {"type": "object"},  # any object
]  # fmt: skip
QUESTIONS = [
    "Describe a person.",
    "Where do you live?",
    "Is the sky blue?",
    "Pick a color.",
    "Tag this photo of a cat.",
    "Rate this movie.",
    "Pick a number.",
    "Create a user.",
    "Make an order.",
    "List some numbers.",
    "Say something.",
    "How many legs has a spider?",
    "Will it rain?",
    "When was the moon landing?",
    "Give a point.",
    "Give a value.",
    "Describe a movie.",
    "Leave a note.",
    "Add 2 and 3.",
    "Give a small matrix.",
    "Give a name and address.",
    "Describe a dog.",
]


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(engine=build_engine(None, **SMOL_ENGINE_ARGS, buckets=(16,)))  # the group's programs (server_harness)


def chat(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def replay(llm: LLM, spec: SO, tokens: list[int]) -> None:
    """The host-side reference: a fresh matcher accepts every sampled token, each was in its mask, and it ends
    complete."""
    guide = llm.engine.guides().guide(spec)
    vocab = llm.engine.cfg.vocab_size
    for t in tokens:
        assert guide.allowed(vocab)[t], f"token {t} was not allowed"
        assert guide.accept(t)
    assert guide.matcher.is_accepting()


def test_json_schemas_validate(smol):
    assert len(SCHEMAS) >= 20
    specs = [SO(json=s) for s in SCHEMAS]
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=s) for s in specs]
    # two seeded sampled rows as well
    params += [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=specs[i]) for i in (0, 7)]
    schemas = [*SCHEMAS, SCHEMAS[0], SCHEMAS[7]]
    questions = [*QUESTIONS, QUESTIONS[0], QUESTIONS[7]]
    outs = smol.generate([chat(smol, q) for q in questions], params)
    assert not [(schema, o.new_text) for schema, o in zip(schemas, outs, strict=True) if o.finish_reason != "stop"]
    for schema, p, out in zip(schemas, params, outs, strict=True):
        jsonschema.validate(json.loads(out.new_text), schema)
        replay(smol, p.structured_outputs, out.new_token_ids)


def test_regex_choice_grammar_and_free_rows(smol):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    questions = ["What is the capital of France?", "Give a phone number.", "Name a fruit.", "Count to five."]
    solo = smol.generate([chat(smol, q) for q in questions], free)
    lark = 'start: "I like " FRUIT "."\nFRUIT: "apples" | "pears" | "plums"'
    specs = [SO(regex=r"The answer is [A-Z][a-z]{2,12}\."), SO(regex=r"\(\d{3}\) \d{3}-\d{4}"),
             SO(choice=["apple", "banana", "cherry"]), SO(grammar=lark)]  # fmt: skip
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=s) for s in specs]
    # constrained and free rows in one batch: the free rows give their solo (unconstrained) outputs
    outs = smol.generate([chat(smol, q) for q in questions * 2], params + [free] * 4)
    got, rest = outs[:4], outs[4:]
    assert re.fullmatch(r"The answer is [A-Z][a-z]{2,12}\.", got[0].new_text)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", got[1].new_text)
    assert got[2].new_text in ("apple", "banana", "cherry")
    assert re.fullmatch(r"I like (apples|pears|plums)\.", got[3].new_text)
    for spec, out in zip(specs, got, strict=True):
        assert out.finish_reason == "stop"
        replay(smol, spec, out.new_token_ids)
    assert [o.new_token_ids for o in rest] == [o.new_token_ids for o in solo]


@pytest.mark.parametrize(
    "spec, reason",
    [
        (SO(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
        (SO(regex="[a-"), "regex"),
        (SO(grammar="start: undefined_rule"), "undefined_rule"),
        (SO(json="{not json"), "json"),
        (SO(choice=[]), "choice"),
        (SO(regex="a", choice=["a"]), "exactly one"),
    ],
)
def test_bad_constraint_is_a_clear_error(smol, spec, reason):
    with pytest.raises(KilnError, match=f"(?i){reason}"):
        smol.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not smol.engine.has_unfinished()


def test_multi_step_engine_runs_constrained_rows_in_single_steps():
    engine = build_engine(str(tiny_folder()), **TINY_ENGINE_ARGS, decode_steps=4)
    llm = LLM(engine=engine)
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    solo = llm.generate(["abc", "xyz"], free)
    spec = SO(regex=r"[0-9]{12}")
    steps = []
    real_dispatch = engine.runner.dispatch
    engine.runner.dispatch = lambda sched: steps.append(sched.steps) or real_dispatch(sched)
    outs = llm.generate(["abc", "xyz", "hello"], [free, free, SamplingParams(max_tokens=30, structured_outputs=spec)])
    assert re.fullmatch(r"[0-9]{12}", outs[2].new_text) and outs[2].finish_reason == "stop"
    assert [o.new_token_ids for o in outs[:2]] == [o.new_token_ids for o in solo]
    assert 4 not in steps[: len(outs[2].new_token_ids)]  # single steps while the constrained row runs
    assert 4 in steps  # multi-step decode again once it finished


def test_llm_chat_offline(smol):
    convs = [[{"role": "user", "content": "Pick a color."}], [{"role": "user", "content": "Is water wet?"}]]
    params = [SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=SO(choice=["red", "green"])),
              SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=SO(choice=["yes", "no"]))]  # fmt: skip
    outs = smol.chat(convs, params)
    assert outs[0].new_text in ("red", "green") and outs[1].new_text in ("yes", "no")
    [one] = smol.chat(convs[0], params[0])
    assert one.new_token_ids == outs[0].new_token_ids
    assert one.prompt_tokens == len(chat(smol, "Pick a color."))
