"""Schema-valid JSON through the official client: 20 JSON schemas (nested objects, arrays, enums, required and
optional fields, bounded numbers and strings, booleans, nulls, anyOf, $ref, patterns), sent concurrently as chat
``response_format`` json_schema; each answer must finish and validate against its schema."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.server.test_errors import BASE

NAME = {"type": "string", "maxLength": 10}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(required=None, **props):
    """A closed object of ``props``, all required unless ``required`` says which."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = {
    "person": obj(name=NAME, age={"type": "integer", "minimum": 0, "maximum": 120}),
    "nested": obj(name=NAME, address=obj(city=NAME, zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    "int_array": obj(scores={"type": "array", "items": SMALL, "minItems": 1, "maxItems": 3}),
    "enum": obj(colour={"enum": ["red", "green", "blue"]}),
    "boolean": obj(done={"type": "boolean"}, title=NAME),
    "null": obj(nothing={"type": "null"}, id=SMALL),
    "any_of": obj(value={"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}),
    "nullable": obj(count={"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
    "number_bounds": obj(ratio={"type": "number", "minimum": 0, "maximum": 1},
                         temp={"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 50}),
    "object_array": obj(items={"type": "array", "items": obj(sku=NAME, qty=SMALL), "maxItems": 2}),
    "const": obj(version={"const": 2}, kind={"const": "point"}, x=SMALL),
    "pattern": obj(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    "matrix": obj(rows={"type": "array", "minItems": 2, "maxItems": 2,
                        "items": {"type": "array", "items": SMALL, "minItems": 2, "maxItems": 2}}),
    "optional": obj(["id"], id=SMALL, note=NAME, tag={"enum": ["a", "b"]}),
    "refs": {"$defs": {"point": obj(x=SMALL, y=SMALL)}, **obj(start={"$ref": "#/$defs/point"},
                                                                 end={"$ref": "#/$defs/point"})},
    "top_array": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    "string_bounds": obj(word={"type": "string", "minLength": 2, "maxLength": 5}),
    "enum_array": obj(days={"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1,
                            "maxItems": 3}),
    "mixed": obj(name=NAME, active={"type": "boolean"}, level={"enum": [1, 2, 3]},
                 tags={"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}),
    "deep": obj(a=obj(b=obj(c=obj(d={"type": "boolean"})))),
}


def ask(client, name: str, schema: dict):
    return client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": f"Give an example {name.replace('_', ' ')} as JSON."}],
        max_tokens=160, temperature=0, response_format={"type": "json_schema",
                                                        "json_schema": {"name": name, "schema": schema}})


@pytest.mark.timeout(300)
def test_twenty_schemas_give_schema_valid_json(live):
    assert len(SCHEMAS) == 20
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    client = live.openai()
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        answers = dict(zip(SCHEMAS, pool.map(lambda item: ask(client, *item), SCHEMAS.items())))
    for name, r in answers.items():
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
