"""Constrained decoding over the default model's tokenizer, without the model: grammars from every
constraint kind, walked by drawing random allowed tokens, always give valid output; min_tokens,
allowed_token_ids and bad_words; compile errors, the cache and the deadline."""

from __future__ import annotations

import functools
import json
import random
import re
import time

import jsonschema
import numpy as np
import pytest

from pd.protocol import Constraint, GenerationOptions
from pd.worker.checkpoint import default_model_path, load_tokenizer
from pd.worker.text.grammar import GrammarCompiler, GrammarError
from pd.worker.text.token_rules import TokenRules, allowed_ids, rules_for

pytestmark = pytest.mark.slow  # loads the default model's tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
        "nick": {"type": "string", "maxLength": 5},
    },
    "required": ["name", "age", "tags", "address"],
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, tok.vocab_size)
    yield c
    c.close()


@functools.cache
def closer_ids(tok) -> np.ndarray:
    return np.array(
        [t for t in range(tok.vocab_size) if any(c in tok.decode([t]) for c in '}]"')]
    )


def walk(rules: TokenRules, tok, rng: random.Random, limit=400) -> list[int]:
    """Draw random allowed tokens until EOS or the grammar is complete: what sampling at any
    temperature could produce. Half the time EOS when allowed, else a token that closes
    something when one is allowed (so that walks end)."""
    out: list[int] = []
    eos = tok.eos_token_ids
    for _ in range(limit):
        row = np.full(rules.words, -1, np.int32)
        rules.fill_mask(row, out)
        ok = allowed_ids(row, tok.vocab_size)
        assert len(ok), "nothing allowed"
        stops = [t for t in ok if t in eos]
        closers = np.intersect1d(ok, closer_ids(tok))
        if stops and rng.random() < 0.5:
            ok = stops
        elif len(closers) and rng.random() < 0.5:
            ok = closers
        token = int(rng.choice(ok))
        if token in eos:
            return out
        assert rules.accept(token)
        out.append(token)
        if rules.complete:
            return out
    raise AssertionError("no end within the limit")


def test_random_walks_of_a_nested_schema_are_valid_json_of_it(tok, compiler):
    c = Constraint("json_schema", json.dumps(SCHEMA))
    for seed in range(5):
        rules = TokenRules(compiler.words, grammar=compiler.matcher_now(c))
        text = tok.decode(walk(rules, tok, random.Random(seed)))
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text.startswith('{"') and ": " not in text  # compact: no spaces spent


@pytest.mark.parametrize(
    "c, check",
    [
        (Constraint("regex", r"\d{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
        (Constraint("choice", json.dumps(["red", "green", "blue sky"])),
         lambda t: t in ("red", "green", "blue sky")),
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (Constraint("grammar", 'root ::= "yes" | "no" | "maybe"'), lambda t: t in ("yes", "no", "maybe")),
        (Constraint("grammar", 'start: "(" NUMBER ")"\nNUMBER: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"\(\d{1,3}\)", t)),
    ],
)  # fmt: skip
def test_each_constraint_kind_gives_only_matching_text(tok, compiler, c, check):
    for seed in range(5):
        rules = TokenRules(compiler.words, grammar=compiler.matcher_now(c))
        text = tok.decode(walk(rules, tok, random.Random(seed)))
        assert check(text), text


async def test_min_tokens_allowed_ids_and_bad_words(tok, compiler):
    eos = sorted(tok.eos_token_ids)
    opts = GenerationOptions(min_tokens=3, stop_token_ids=(17,))
    rules = await rules_for(opts, tok, compiler)
    assert rules is not None
    for n, forbidden in [(0, True), (2, True), (3, False)]:
        row = np.full(rules.words, -1, np.int32)
        rules.fill_mask(row, [5] * n)
        ok = set(allowed_ids(row, tok.vocab_size))
        assert (eos[0] not in ok and 17 not in ok) == forbidden
    rules = await rules_for(GenerationOptions(allowed_token_ids=(10, 11)), tok, compiler)
    row = np.full(rules.words, -1, np.int32)
    rules.fill_mask(row, [])
    assert set(allowed_ids(row, tok.vocab_size)) == {10, 11, *eos}  # and stopping
    word = tok.encode(" hippopotamus")
    assert len(word) >= 2
    rules = await rules_for(GenerationOptions(bad_words=("hippopotamus",)), tok, compiler)
    for prefix, banned in [(word[:-1], True), (word[:1], False)]:
        row = np.full(rules.words, -1, np.int32)
        rules.fill_mask(row, prefix)
        assert (word[-1] not in set(allowed_ids(row, tok.vocab_size))) == banned
    assert await rules_for(GenerationOptions(), tok, compiler) is None


async def test_bad_constraints_are_errors_naming_the_problem(compiler):
    for c, needle in [
        (Constraint("regex", "[a-z"), "unclosed character class"),
        (Constraint("json_schema", '{"type": "nope"}'), "Invalid type"),
        (Constraint("grammar", "start: ???"), "Expected"),
    ]:
        with pytest.raises(GrammarError, match=needle):
            await compiler.matcher(c)


async def test_compiled_grammars_are_cached(tok):
    compiler = GrammarCompiler(tok, tok.vocab_size)
    c = Constraint("regex", r"[0-9]{4}")
    await compiler.matcher(c)  # the first compile also starts the children
    t = time.perf_counter()
    await compiler.matcher(c)
    assert compiler.compiles == 1 and time.perf_counter() - t < 0.05  # a copy of the cached one
    await compiler.aclose()


def test_ecma_digits_and_closed_objects_in_declared_order(tok, compiler):
    """`\\d` is [0-9] (llguidance's own is any Unicode digit, "🯸"), an object admits only its
    declared properties, and they come in the declared order, at any temperature."""
    c = Constraint("regex", r"\d{3}-\d{4}")
    row = np.full(compiler.words, -1, np.int32)
    TokenRules(compiler.words, grammar=compiler.matcher_now(c)).fill_mask(row, [])
    first = [tok.decode([int(t)]) for t in allowed_ids(row, tok.vocab_size)]
    assert first and all(re.fullmatch(r"[0-9]{1,3}", s) for s in first if s), first
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string", "maxLength": 4},
                       "mid": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
    }  # fmt: skip
    c = Constraint("json_schema", json.dumps(schema))
    for seed in range(8):
        rules = TokenRules(compiler.words, grammar=compiler.matcher_now(c))
        value = json.loads(tok.decode(walk(rules, tok, random.Random(seed))))
        jsonschema.validate(value, {**schema, "additionalProperties": False})
        keys = list(value)
        assert keys == [k for k in schema["properties"] if k in value], keys
