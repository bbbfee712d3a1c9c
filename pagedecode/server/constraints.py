"""A request's output constraint: OpenAI's response_format ({"type": "json_schema" |
"json_object" | "text"}) or vLLM's structured_outputs ({"json" | "regex" | "choice" | "grammar":
...}), as a StructuredOutput; a 400 naming the field otherwise."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import InvalidRequestError
from ..structured import StructuredOutput
from .errors import ApiError, bad

STRUCTURED_NAMES = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}


def structured_output(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The body's constraint, or None."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise bad("response_format", "give response_format or structured_outputs, not both")
    try:
        if rf is not None:
            return _response_format(rf)
        if so is not None:
            return _structured_outputs(so)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="response_format" if rf is not None else "structured_outputs",
                       code="invalid_value") from None
    except TypeError as e:
        raise bad("structured_outputs", str(e)) from None
    return None


def _response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format", 'type must be "text", "json_object" or "json_schema"')
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutput(json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise bad("response_format", "json_schema.schema must be a JSON schema object")
    return StructuredOutput(json_schema=spec["schema"])


def _structured_outputs(so: Any) -> StructuredOutput:
    if not isinstance(so, dict):
        raise bad("structured_outputs", "must be an object")
    given = {STRUCTURED_NAMES[k]: v for k, v in so.items() if k in STRUCTURED_NAMES and v is not None}
    if isinstance(given.get("json_schema"), str):     # a schema as JSON text is JSON: the body's checks
        from .jsonbody import load
        given["json_schema"] = load(given["json_schema"], "structured_outputs.json")
    json_object = so.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise bad("structured_outputs.json_object", f"must be true or false, got {json_object!r}")
    if json_object:
        given["json_object"] = True
    return StructuredOutput(**given)
