"""The size limits checked before a constraint compiles: `$ref` chains and grammar rules."""

from __future__ import annotations

import json

import pytest

from pd.worker.text.grammar_source import (
    MAX_GRAMMAR_RULES,
    MAX_REF_DEPTH,
    GrammarError,
    check_limits,
    ref_depth,
)


def chain(n: int) -> dict:
    """A schema whose root resolves through `n` definitions, each naming the next."""
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_ref_depth_follows_chains_once_and_cuts_cycles():
    assert ref_depth({"type": "object"}) == 0
    assert ref_depth(chain(1)) == 1
    assert ref_depth(chain(5)) == 5
    assert ref_depth(chain(5000), most=10**6) == 5000  # iterative: no RecursionError
    assert MAX_REF_DEPTH < ref_depth(chain(5000)) <= MAX_REF_DEPTH + 1  # stops past the limit
    anchors = {f"a{i}": {"$ref": f"#a{i + 1}"} for i in range(4000)}  # not pointers: not followed
    assert ref_depth({"$defs": anchors, "$ref": "#a0"}) == 0
    tree = {  # a recursive schema: a node holds nodes
        "$defs": {"node": {"type": "object", "properties": {"kids": {
            "type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node",
    }  # fmt: skip
    assert ref_depth(tree) == 1
    assert ref_depth({"properties": {"a": {"$ref": "#"}}}) == 0  # the root itself
    # Two paths to one target: its depth counts once, on the longer one.
    diamond = {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"type": "null"}},
        "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/c"}],
    }
    assert ref_depth(diamond) == 3
    assert ref_depth({"$ref": "#/$defs/missing"}) == 1
    assert ref_depth({"$ref": "https://example.com/s.json"}) == 0  # not resolved here


def test_limits_refuse_deep_ref_chains_and_huge_grammars_with_their_numbers():
    check_limits("json_schema", json.dumps(chain(MAX_REF_DEPTH)))
    with pytest.raises(GrammarError, match=f"{MAX_REF_DEPTH + 1} deep; at most {MAX_REF_DEPTH}"):
        check_limits("json_schema", json.dumps(chain(MAX_REF_DEPTH + 1)))
    rules = [f"r{i}: r{i + 1}" for i in range(MAX_GRAMMAR_RULES - 2)]
    lark = "start: r0\n" + "\n".join(rules) + f'\nr{MAX_GRAMMAR_RULES - 2}: "x"'
    check_limits("grammar", lark)
    with pytest.raises(GrammarError, match=f"{MAX_GRAMMAR_RULES + 1} rules"):
        check_limits("grammar", lark + '\nextra: "y"')
    gbnf = "\n".join(f'r{i} ::= "a"' for i in range(MAX_GRAMMAR_RULES + 1))
    with pytest.raises(GrammarError, match="rules; at most"):
        check_limits("grammar", gbnf)
    with pytest.raises(GrammarError, match="nested too deeply"):
        check_limits("json_schema", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(GrammarError, match="invalid json_schema"):
        check_limits("json_schema", "{")
    check_limits("regex", "(" * 5000)  # no limit here: the child compiles it, or says why not
