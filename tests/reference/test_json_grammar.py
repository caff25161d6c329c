#!/usr/bin/env python3
"""Structured output's grammar (model/json_grammar.h) against Python's json and jsonschema.

For every schema below:
  - random walks through the grammar (each byte drawn among those it allows) give documents that
    json.loads reads and jsonschema's Draft 2020-12 validator accepts: the grammar is sound;
    no walk reaches a point where nothing can come and the document cannot end;
  - documents written by hand that the schema accepts, compact and indented as json.dumps writes
    them (properties in the schema's order), are accepted whole: the grammar is not too narrow;
  - documents the schema rejects (checked with jsonschema first) are refused, and so are
    properties out of the schema's order (valid, but not what the grammar generates).
Schemas with assertions outside the subset are refused with the keyword's name.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import jsonschema

# Marks a refused document that is not checked against jsonschema first: one the schema accepts
# and the grammar refuses by design (properties out of the schema's order), or one jsonschema
# would take too long to judge.
ORDER = "unchecked:"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "email": {"type": ["string", "null"], "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest", 7, None]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

PYDANTIC = {
    "$defs": {
        "Address": {
            "properties": {"street": {"title": "Street", "type": "string"},
                           "zip": {"title": "Zip", "type": "integer"}},
            "required": ["street", "zip"], "title": "Address", "type": "object"},
    },
    "properties": {
        "id": {"title": "Id", "type": "integer"},
        "home": {"$ref": "#/$defs/Address"},
        "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "home", "score"],
    "title": "Customer", "type": "object",
}

TREE = {
    "type": "object",
    "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    },
    "required": ["value"],
}

# Each level requires the next (an empty array ends it): 40 levels, past the 32 that free-form
# values may nest, must still be accepted.
CHAIN = {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"},
                                                "maxItems": 1}}, "required": ["c"]}


def chain(levels):
    value = {"c": []}
    for _ in range(levels - 1):
        value = {"c": [value]}
    return value


# Thirty levels of unions, each of four references to the level below: shared $refs, whose
# paths number 4^30 (the grammar must follow the one integer they all lead to).
SHARED = {"$defs": {"a0": {"type": "integer"}}, "$ref": "#/$defs/a30"}
for level in range(1, 31):
    SHARED["$defs"][f"a{level}"] = {"anyOf": [{"$ref": f"#/$defs/a{level - 1}"}] * 4}

# "x" could never end (each level requires the next): only {} is a document.
ENDLESS_OPTIONAL = {"type": "object", "properties": {"x": {"$ref": "#/$defs/l"}},
                    "$defs": {"l": {"type": "object", "properties": {"y": {"$ref": "#/$defs/l"}},
                                    "required": ["y"]}}}

SCHEMAS = {
    "person": (PERSON,
               [{"name": "Ada", "age": 36},
                {"name": "Bo", "age": -1, "email": None, "tags": ["x", "é"], "role": "admin"},
                {"name": "Cy", "age": 0, "role": 7}, {"name": "D\"q\\\n", "age": 5, "role": None}],
               [ORDER + '{"age": 3, "name": "x"}', '{"name": "", "age": 1}', '{"name": "a"}',
                '{"name": "a", "age": 1.5}', '{"name": "a", "age": 1, "x": 1}',
                '{"name": "a", "age": 1, "tags": ["a","b","c","d"]}',
                '{"name": "a", "age": 01}', '{"name": "a", "age": 1, "role": "root"}']),
    "pydantic": (PYDANTIC,
                 [{"id": 1, "home": {"street": "Main", "zip": 12345}, "score": 1.5e3},
                  {"id": -7, "home": {"street": "", "zip": 0}, "work": None, "score": -0.25,
                   "ok": True},
                  {"id": 2, "home": {"street": "a", "zip": 1},
                   "work": {"street": "b", "zip": 2}, "score": 3, "ok": False}],
                 ['{"id": 1, "score": 2}', '{"id": 1, "home": {"street": "a"}, "score": 1}',
                  '{"id": true, "home": {"street": "a", "zip": 1}, "score": 1}']),
    "tree": (TREE,
             [{"value": 1}, {"value": 1, "children": [{"value": 2, "children": []},
                                                      {"value": 3, "children": [{"value": 4}]}]}],
             ['{"value": 1, "children": [{"value": 2}, {"value": 3}, {"value": 4}]}',
              '{"children": []}']),
    "map": ({"type": "object", "additionalProperties": {"type": "number"}},
            [{}, {"a": 1, "b": -2.5E-3, "": 0}],
            ['{"a": "x"}', '[1]']),
    "list": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
             [[1, 2], [1, 2, 3, 4]],
             ['[1]', '[1,2,3,4,5]', '[1, "a"]', '[]']),
    "scalars": ({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "number"},
                           {"const": {"k": [1, 2]}}, {"type": "boolean"}]},
                ["abc", 12.5, True, False, -0.0],
                ['"abcd"', 'null', '{"k": [1]}'], [{"k": [1, 2]}]),
    "any": (True, [None, 1, "x", [1, {"a": []}], {"b": {"c": None}}], []),
    "json_object": ("-object", [{}, {"a": [1, None, "z", {"b": True}]}], ['[1]', '"x"', '1']),
    # (The refused documents are not checked with jsonschema first: it would try all 4^30 paths.)
    "shared_refs": (SHARED, [0, -17, 123456], [ORDER + '"x"', ORDER + '1.5', ORDER + 'null'],
                    [], 5),
    "endless_optional": (ENDLESS_OPTIONAL, [{}], ['{"x": {}}'], [], 1),
    "one_of": ({"oneOf": [{"type": "string"}, {"type": "integer"}, {"const": None},
                          {"enum": [True]}]},
               ["a", 3, None, True], ['false', '1.5']),
    # (Deeper than 20 levels, json.dumps' indent passes the 20 indents the grammar allows: compact
    # only. The walks differ only in depth and whitespace: few distinct values.)
    "chain": (CHAIN, [chain(1), chain(3)], ['{"c": [{}]}', '{"c": [{"c": []}, {"c": []}]}'],
              [chain(40)], 3),
}

REFUSED = {
    "pattern": {"type": "string", "pattern": "^a"},
    "minimum": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "$ref": {"$ref": "https://example.com/schema"},
    "no finite document": {"type": "object", "properties": {"next": {"$ref": "#"}},
                           "required": ["next"]},
    "beside '$ref'": {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
    "beside 'anyOf'": {"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 3},
    "beside 'allOf'": {"allOf": [{"type": "string"}], "maxLength": 2},
    "beside 'const'": {"enum": ["a", "b"], "const": "a"},
    "could match both": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "no value has the type": {"type": "string", "enum": [1, 2]},
    "no value in between": {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
                            "$ref": "#/$defs/a"},
    "nested more than": {"enum": [json.loads("[" * 200 + "]" * 200)]},
}


def write_schema(workdir, name, schema):
    if schema == "-object":
        return "-object"
    path = os.path.join(workdir, name + ".json")
    with open(path, "w") as f:
        json.dump(schema, f)
    return path


def validates(schema, document):
    if schema == "-object":
        return isinstance(document, dict)
    try:
        jsonschema.Draft202012Validator(schema).validate(document)
        return True
    except jsonschema.ValidationError:
        return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--walk", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--walks", type=int, default=300)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    failures = []

    for name, (schema, good, bad, *extra) in SCHEMAS.items():
        compact_only = extra[:1]
        least_distinct = extra[1] if len(extra) > 1 else 20
        path = write_schema(args.workdir, name, schema)
        out = subprocess.run([args.walk, "walk", path, str(args.walks), "7"], check=True,
                             capture_output=True, text=True).stdout.splitlines()
        documents = [json.loads(line) for line in out]
        dead = sum(1 for d in documents if d is None)
        unfinished = sum(1 for d in documents if d == "")
        finished = [d for d in documents if d]
        invalid = []
        for text in finished:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                invalid.append((text, str(error)))
                continue
            if not validates(schema, value):
                invalid.append((text, "fails the schema"))
        shapes = len({json.dumps(json.loads(t), sort_keys=True) for t in finished
                      if (t, "fails the schema") not in invalid})
        print(f"{name}: {len(finished)} walks ended, {unfinished} too long, {dead} dead ends, "
              f"{len(invalid)} invalid, {shapes} distinct values")
        if dead:
            failures.append(f"{name}: {dead} walks reached a dead end")
        if invalid:
            failures.append(f"{name}: invalid documents, e.g. {invalid[:3]}")
        if len(finished) < 0.9 * args.walks:
            failures.append(f"{name}: only {len(finished)} of {args.walks} walks ended")
        if shapes < min(least_distinct, len(finished) // 4):
            failures.append(f"{name}: the walks gave only {shapes} distinct values")

        texts = []
        for value in good:
            assert validates(schema, value), (name, value)
            texts.append((json.dumps(value, separators=(",", ":"), ensure_ascii=False), True))
            texts.append((json.dumps(value, indent=2), True))
            texts.append((json.dumps(value), True))
        # A const or enum value that is an object or an array is matched as compact JSON.
        for value in compact_only[0] if compact_only else []:
            assert validates(schema, value), (name, value)
            texts.append((json.dumps(value, separators=(",", ":")), True))
        for text in bad:
            if text.startswith(ORDER):
                text = text[len(ORDER):]
            else:
                try:
                    assert not validates(schema, json.loads(text)), (name, text)
                except json.JSONDecodeError:
                    pass
            texts.append((text, False))
        lines = "".join(json.dumps(t) + "\n" for t, _ in texts)
        verdicts = subprocess.run([args.walk, "check", path], input=lines, check=True,
                                  capture_output=True, text=True).stdout.split()
        for (text, expected), verdict in zip(texts, verdicts):
            if (verdict == "1") != expected:
                failures.append(f"{name}: {text!r} was {'refused' if expected else 'accepted'}")

    for keyword, schema in REFUSED.items():
        path = write_schema(args.workdir, "refused", schema)
        result = subprocess.run([args.walk, "check", path], input="", capture_output=True,
                                text=True)
        if result.returncode != 2 or keyword not in result.stderr:
            failures.append(f"a schema with {keyword} was not refused by name: "
                            f"rc {result.returncode}, {result.stderr.strip()!r}")
        else:
            print(f"refused: {result.stderr.strip()}")

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
