"""Random tool schemas from a seeded generator: nested objects, enums, arrays, required and
optional properties, strings holding quotes, braces and `</tool_call>` (in enum values, consts,
property names and descriptions). Bounded (maxLength, maxItems, integer ranges) so that a
random model's call ends within a few dozen tokens."""
import random

NASTY = ['say "hi"', "{braces}", "</tool_call>", "[TOOL_CALLS]", "a\\b", "}]", "é ü", '"}']
WORDS = ["city", "unit", "count", "tags", "when", "deep", "flag", "id_2", "x-y"]


def name(rng: random.Random) -> str:
    return rng.choice(WORDS) if rng.random() < 0.8 else rng.choice(WORDS) + rng.choice(NASTY)


def value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "number", "const", "null"]
    if depth < 1:
        kinds += ["object", "array", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(0, 6)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, s["maxLength"])
        return s
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10} if rng.random() < 0.5 else {"enum": [1.5, -2, 0]}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(NASTY + WORDS, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(NASTY)}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        return {"type": "array", "items": value_schema(rng, depth + 1), "maxItems": rng.randint(0, 2)}
    return object_schema(rng, depth + 1)


def object_schema(rng: random.Random, depth: int = 0) -> dict:
    props = {}
    for _ in range(rng.randint(0 if depth else 1, 3)):
        props[name(rng)] = value_schema(rng, depth)
    schema: dict = {"type": "object", "properties": props,
                    "required": [k for k in props if rng.random() < 0.6], "additionalProperties": False}
    if rng.random() < 0.3:
        schema["description"] = rng.choice(NASTY)
    return schema


def tool(rng: random.Random, i: int) -> dict:
    fn = {"name": f"tool_{i}", "parameters": object_schema(rng)}
    if rng.random() < 0.5:
        fn["description"] = "does " + rng.choice(NASTY)
    return {"type": "function", "function": fn}
