"""Structured outputs and tool calls through the HTTP API, with the official openai client against a real server
(uvicorn on a free port) over the embedded SmolLM2: response_format (a pydantic model through
client.chat.completions.parse, a nested json_schema), vLLM's structured_outputs and guided_* fields on chat and
completions, streaming or not, tool_choice required and a named function, streamed tool calls, and a bad schema's
400."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_harness import SMOL_ENGINE_ARGS, running_server

from kiln.serving.app import ServerConfig, build_app
from kiln.serving.llm import AsyncLLM, build_engine

MODEL = "smol"


@pytest.fixture(scope="module")
def served():
    # the SmolLM2 group's geometry (server_harness.SMOL_ENGINE_ARGS: programs compiled once per worker) and a 1-token
    # bucket: every request here is one sequence, and its decode steps on step_t16 cost several times those of step_t1
    engine = build_engine(None, **SMOL_ENGINE_ARGS, buckets=(1, 16))
    llm = AsyncLLM(engine)
    try:
        with running_server(build_app(llm, ServerConfig(served_model_names=(MODEL,)))) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return served[0]


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Pet(BaseModel):
    name: str
    species: Literal["cat", "dog", "bird"]
    legs: int


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"],
                    "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "role", "address", "skills"],
    "additionalProperties": False,
}  # fmt: skip


def test_parse_pydantic_and_nested_schema(client):
    r = client.chat.completions.parse(model=MODEL, messages=ask("Describe a pet."), response_format=Pet,
                                      max_tokens=100, temperature=0)  # fmt: skip
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for stream in (False, True):
        kw = dict(model=MODEL, messages=ask("Describe a user."), response_format=fmt, max_tokens=150, temperature=0)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)  # fmt: skip
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
    msgs = ask("Return a JSON object with your name.")  # SmolLM2 nests keys forever for vaguer asks
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_and_grammar_fields(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for extra in ({"structured_outputs": {"regex": phone}}, {"guided_regex": phone}):
        r = client.chat.completions.create(model=MODEL, messages=ask("A phone number?"), max_tokens=20, temperature=0,
                                           extra_body=extra)  # fmt: skip
        assert re.fullmatch(phone, r.choices[0].message.content)
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                      extra_body=extra)  # fmt: skip
        assert r.choices[0].text in ("yes", "no")
    stream = client.completions.create(model=MODEL, prompt="Count:", max_tokens=20, temperature=0, stream=True,
                                       extra_body={"guided_grammar": 'start: "1, 2, " N\nN: "3" | "4"'})  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("1, 2, 3", "1, 2, 4")
    r = client.completions.create(model=MODEL, prompt="A user:", max_tokens=150, temperature=0,
                                  extra_body={"guided_json": PERSON})  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        {"structured_outputs": {"regex": "[a-"}},
        {"guided_grammar": "start: undefined_rule"},
        {"guided_regex": "a", "guided_choice": ["a"]},
        {"response_format": {"type": "yaml"}},
    ],
)
def test_bad_constraint_is_400(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, extra_body=extra, stream=True)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_forced_tool_calls(client):
    msgs = ask("What is the weather in Paris?")
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=120,
                                       temperature=0)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=80,
                                       temperature=0)  # fmt: skip
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])

    # streamed: the client reassembles the calls from delta.tool_calls
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                            max_tokens=120, temperature=0, stream=True)  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"name": "", "arguments": ""})
                acc["name"] += d.function.name or ""
                acc["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls
    ]

    # the call and its result go back through the template
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [c.message.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=10, temperature=0)
    assert r.choices[0].message.content is not None


def test_tool_choice_errors(client):
    for choice, tools in (({"type": "function", "function": {"name": "nope"}}, TOOLS), ("required", None),
                          ("sometimes", TOOLS)):  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, tools=tools,
                                           tool_choice=choice)  # fmt: skip


def test_auto_tool_calls_and_reasoning_are_parsed(client):
    """The model's own syntax parsed out of free text (the output is pinned with a one-item choice so that the small
    model writes it): Hermes tool calls under tool_choice auto, and <think> reasoning with --reasoning-parser."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    kw = dict(model=MODEL, messages=ask("Weather in Paris?"), tools=TOOLS, max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"choice": ["Let me look.\n" + call]}})  # fmt: skip
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me look."
    [tc] = c.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {
        "city": "Paris",
        "unit": "celsius",
    }
    content, names, finish = "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            names += [d.function.name for d in ch.delta.tool_calls or []]
            finish = ch.finish_reason or finish
    assert (content.strip(), names, finish) == ("Let me look.", ["get_weather"], "tool_calls")
    none = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert none.choices[0].message.content == "Let me look.\n" + call and not none.choices[0].message.tool_calls


def test_reasoning_parser(served):
    """--reasoning-parser qwen3 (a second app over the same engine): <think> goes to reasoning_content, streamed too."""
    _, llm = served
    config = ServerConfig(served_model_names=(MODEL,), reasoning_parser="qwen3")
    with running_server(build_app(llm, config)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=MODEL, messages=ask("Capital of France?"), max_tokens=30, temperature=0,
                  extra_body={"structured_outputs": {"choice": ["<think>It is in Europe.</think>Paris."]}})  # fmt: skip
        msg = client.chat.completions.create(**kw).choices[0].message
        assert (msg.reasoning_content, msg.content) == ("It is in Europe.", "Paris.")
        reasoning = content = ""
        for chunk in client.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
        assert (reasoning, content) == ("It is in Europe.", "Paris.")
