"""The structured-output fields of an OpenAI / vLLM request, read into one StructuredOutputsParams.

Accepted, on /v1/completions and /v1/chat/completions (one source per request):

* OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} (the schema is always enforced, strict or not);
* vLLM's `structured_outputs` object: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
* vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields.

`constrain(llm, req, jobs)` is the route's one call: it reads the constraint, compiles it once against the model's
tokenizer (a constraint llguidance cannot compile is a 400 with its reason, before any response starts) and sets it
on every job's SamplingParams.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.models.errors import KilnError
from kiln.serving.params import StructuredOutputsParams
from kiln.serving.schemas import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _extra(req: Any, name: str) -> Any:
    """A request field the schema may not declare (the request models keep unknown fields)."""
    value = getattr(req, name, None)
    if value is None and req.model_extra:
        value = req.model_extra.get(name)
    return value


def from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError("response_format must be an object with a type.", param="response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format json_schema needs a json_schema object.", param="response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict | str):
            raise APIError("response_format json_schema needs json_schema.schema (a JSON schema object).",
                           param="response_format")  # fmt: skip
        return StructuredOutputsParams(json=schema)
    raise APIError(f"response_format type {str(kind)[:50]!r} is not supported (text, json_object, json_schema).",
                   param="response_format")  # fmt: skip


def from_structured_outputs(obj: Any) -> StructuredOutputsParams | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise APIError("structured_outputs must be an object.", param="structured_outputs")
    if obj.get("structural_tag") is not None:
        raise APIError("structured_outputs.structural_tag is not supported.", param="structured_outputs")
    given = {k: obj[k] for k in SO_FIELDS if obj.get(k) not in (None, False)}
    if not given:
        return None
    flexible = obj.get("disable_any_whitespace") is False or obj.get("whitespace_pattern") is not None
    return StructuredOutputsParams(**given, whitespace_flexible=flexible)


def from_request(req: Any) -> StructuredOutputsParams | None:
    """The request's constraint, or None; an APIError (400) for a malformed or doubled one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    spec = from_response_format(_extra(req, "response_format"))
    if spec is not None:
        found.append(("response_format", spec))
    spec = from_structured_outputs(_extra(req, "structured_outputs"))
    if spec is not None:
        found.append(("structured_outputs", spec))
    for name, field in GUIDED.items():
        value = _extra(req, name)
        if value is not None:
            if field == "json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise APIError(f"{name} is not valid JSON.", param=name) from None
            found.append((name, StructuredOutputsParams(**{field: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(f"Give one structured-output constraint per request, not {names}.", param=found[1][0])
    if found and len(found[0][1].kinds()) != 1:
        raise APIError("Give exactly one of json, regex, choice, grammar and json_object.", param=found[0][0])
    return found[0][1] if found else None


def check(llm: Any, spec: StructuredOutputsParams, param: str) -> None:
    """Compile the constraint once against the model's tokenizer; a 400 with llguidance's reason if it cannot be."""
    try:
        llm.engine.guides().grammar(spec)
    except KilnError as e:
        raise APIError(str(e), param=param, code="invalid_structured_output") from None


def param_name(req: Any) -> str:
    for name in ("response_format", "structured_outputs", *GUIDED):
        if _extra(req, name) is not None:
            return name
    return "response_format"


def constrain(
    llm: Any, req: Any, jobs: list, spec: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """Read (unless the caller has: `spec`, from_request's), check and attach the request's constraint to every job
    (run off the event loop: compiling a large schema takes milliseconds)."""
    spec = spec if spec is not None else from_request(req)
    if spec is not None:
        check(llm, spec, param_name(req))
        for job in jobs:
            job.params.structured_outputs = spec
    return spec
