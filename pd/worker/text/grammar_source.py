"""From a constraint to llguidance's grammar text, and the size limits checked before it compiles.

`grammar_text(kind, spec)` turns a `Constraint`'s kind and spec (JSON schema, any JSON object,
regex, choice, Lark/GBNF grammar) into llguidance's grammar, with schemas and regexes meaning
what they mean to vLLM users (`strict_schema`). It runs where grammars compile: in a grammar
child (`grammar_child`), never on a worker's event loop.

`check_limits(kind, spec)` is the cheap first guard, run on the loop before anything compiles:
llguidance compiles a schema's `$ref` chain and a grammar's rule chain recursively on the native
stack, and a chain some thousands of links long overflows an 8 MiB one (SIGSEGV:
docs/EXPERIMENTS.md §16, "Crash classes"). The bounds sit well below that and well above what
real schemas and grammars use (docs/security.md). What the limits miss (nesting inside one rule,
an inline `%json` schema) still compiles in a child first, under the same stack size.

Imports only llguidance and pure Python: the grammar child loads this module alone.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import llguidance

from pd.worker.text.strict_schema import ecma_regex, strict

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# llguidance's JSON options unless the schema says otherwise (its "x-guidance" key).
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}

MAX_REF_DEPTH = 128  # the longest chain of `$ref`s a JSON schema may resolve through
MAX_GRAMMAR_RULES = 1000  # rules (and terminals) a Lark or GBNF grammar may define

# A rule's definition at the start of a line: Lark's `name:` / `NAME.2:` (with `?` or `!`),
# GBNF's `name ::=`.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:::=|:)", re.MULTILINE)


class GrammarError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar), is over a size limit, or
    took too long."""


def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar for a constraint (not yet checked: building a matcher checks it)."""
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_DEFAULTS
            )
        if kind == "json_schema":
            schema = strict(json.loads(spec))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ecma_regex(spec))
        if kind == "choice":
            choices = json.loads(spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(s) for s in choices)
            )
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {kind}: {e}") from None
    except RecursionError:
        raise GrammarError(f"invalid {kind}: nested too deeply") from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


def new_tokenizer(tokenizer_json: str, n_vocab: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from a Hugging Face tokenizer.json (most of a first compile's
    time: docs/BENCHMARKS.md, "Structured outputs")."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos or None)


def build_matcher(tok: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher for llguidance's grammar text (the costly part: its lexer and parser tables);
    GrammarError naming the problem when it does not compile."""
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    if m.is_error():
        raise GrammarError(" ".join(m.get_error().split())[:500])
    return m


def check_limits(kind: str, spec: str) -> None:
    """Raise GrammarError when a constraint is over a size limit (before it compiles)."""
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except RecursionError:
            raise GrammarError("invalid json_schema: nested too deeply") from None
        except ValueError as e:
            raise GrammarError(f"invalid json_schema: {e}") from None
        depth = ref_depth(schema)
        if depth > MAX_REF_DEPTH:
            raise GrammarError(
                f"the json_schema resolves $ref chains {depth} deep; at most {MAX_REF_DEPTH}"
            )
    elif kind == "grammar":
        rules = len(_RULE.findall(spec))
        if rules > MAX_GRAMMAR_RULES:
            raise GrammarError(f"the grammar defines {rules} rules; at most {MAX_GRAMMAR_RULES}")


def ref_depth(schema: Any, most: int = MAX_REF_DEPTH) -> int:
    """The longest chain of local `$ref`s (`#/...` JSON pointers, or `#` the root) met resolving
    `schema` from its root: each reference target counts once on a chain (a recursive schema is
    not infinite), and each target's depth is computed once; the walk stops once a chain is
    past `most` (returning more than `most`). Iterative, and linear in the schema: each
    subschema's references are listed once, whatever points at it."""
    refs_of: dict[int, list[str]] = {}  # id(subschema) -> the local refs inside it

    def refs_in(node: Any) -> list[str]:
        key = id(node)
        if key not in refs_of:
            out: list[str] = []
            stack = [node]
            while stack:
                x = stack.pop()
                if isinstance(x, dict):
                    ref = x.get("$ref")
                    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                        out.append(ref)
                    stack.extend(x.values())
                elif isinstance(x, list):
                    stack.extend(x)
            refs_of[key] = list(dict.fromkeys(out))
        return refs_of[key]

    def resolve(pointer: str) -> Any:
        node: Any = schema
        for part in pointer[2:].split("/") if pointer != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    depth: dict[str, int] = {}  # finished targets
    on_chain: set[str] = {"#"}
    best: dict[str, int] = {"#": 0}
    # Each frame: a target and the references still to follow from it.
    frames: list[tuple[str, list[str]]] = [("#", list(refs_in(schema)))]
    while frames:
        name, pending = frames[-1]
        if len(frames) > most:
            return len(frames)  # past the limit: no need to go on
        if pending:
            ref = pending.pop()
            if ref in on_chain:
                continue  # a cycle: recursion, resolved lazily by llguidance
            if ref in depth:
                best[name] = max(best[name], depth[ref] + 1)
                continue
            on_chain.add(ref)
            best[ref] = 0
            target = resolve(ref)
            frames.append((ref, list(refs_in(target)) if target is not None else []))
            continue
        frames.pop()
        on_chain.discard(name)
        depth[name] = best[name]
        if frames:
            parent = frames[-1][0]
            best[parent] = max(best[parent], depth[name] + 1)
    return depth["#"]
