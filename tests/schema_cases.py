"""Seeded JSON schemas for the structured-output and tool-calling tests (no tests here): objects with required
fields, enums, bounded numbers, arrays and nested objects, each small enough that a small model finishes a valid
document in a few dozen tokens (strings and arrays are bounded, so a document cannot run to max_tokens on its own)."""

from __future__ import annotations

import random

WORDS = ("name", "city", "colour", "size", "count", "price", "tags", "owner", "level", "score", "kind", "items")


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(("string", "enum", "integer", "number", "boolean", "array"))
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(4, 12)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "number":
        low = rng.randint(0, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 50)}
    if kind == "boolean":
        return {"type": "boolean"}
    items = rng.choice(({"type": "integer", "minimum": 0, "maximum": 9},
                        {"type": "string", "enum": ["a", "b", "c"]}))
    return {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randint(1, 3)}


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 3))
    properties = {}
    for name in names:
        properties[name] = _object(rng, depth - 1) if depth > 0 and rng.random() < 0.3 else _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def schemas(count: int, seed: int = 2024) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        schema = _object(rng, depth=2 if i % 3 == 0 else 1)
        if i % 5 == 4:  # a top-level array of objects
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 2}
        out.append(schema)
    return out


FUNCTIONS = ("get_weather", "book_table", "search_items", "set_alarm", "convert_units", "send_message")


def function_tools(count: int, seed: int = 7) -> list[dict]:
    """`count` OpenAI tools with seeded parameters schemas (objects, as function parameters are)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        verb = FUNCTIONS[i % len(FUNCTIONS)]
        name = verb if i < len(FUNCTIONS) else f"{verb}_{i}"
        out.append({"type": "function", "function": {"name": name, "description": verb.replace("_", " "),
                                                      "parameters": _object(rng, depth=i % 2)}})
    return out
