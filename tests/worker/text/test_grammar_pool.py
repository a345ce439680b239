"""A client's constraint compiles in a grammar child first: one that overflows the stack, the
memory cap or the deadline kills only its child (a GrammarError: the request's 400), the next
constraint compiles again, and one slow compile holds one child, never another client's."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pd.protocol import Constraint
from pd.worker.checkpoint import default_model_path, load_tokenizer
from pd.worker.text.grammar import MATCHER_BASE_BYTES, GrammarCompiler, GrammarError

pytestmark = pytest.mark.slow  # loads the default model's tokenizer, starts children

SMALL = Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def lark_chain(n: int) -> Constraint:
    """`n` rules, each naming the next: llguidance recurses once a link (within the rule limit
    for n < 1000, and ~3,000 links overflow an 8 MiB stack)."""
    rules = "\n".join(f"r{i}: r{i + 1}" for i in range(n - 1))
    return Constraint("grammar", f'start: r0\n{rules}\nr{n - 1}: "x"')


def choices(n: int) -> Constraint:
    return Constraint("choice", json.dumps([f"option number {i}" for i in range(n)]))


async def test_a_constraint_that_overflows_the_stack_kills_only_its_child(tok):
    """On a 256 KiB grammar stack, 900 chained rules (within the limits) overflow it: the child
    dies of SIGSEGV, the request gets a GrammarError, this process never builds the grammar, and
    the next constraint compiles on a new child."""
    compiler = GrammarCompiler(tok, tok.vocab_size, stack_bytes=256 << 10)
    await compiler.matcher(Constraint("regex", r"\\d{3}"))
    before, built = compiler.pool.pids(), compiler.compiles
    with pytest.raises(GrammarError, match="crashed the grammar compiler .killed by SIGSEGV"):
        await compiler.matcher(lark_chain(900))
    assert compiler.compiles == built and compiler.pool.crashes == 1
    await compiler.matcher(lark_chain(20))  # short chains still compile, on the new child
    assert compiler.compiles == built + 1
    after = compiler.pool.pids()
    assert len(after) == 2 and len(set(after) & set(before)) == 1, (before, after)
    await compiler.aclose()


async def test_the_memory_cap_and_the_deadline_kill_the_child_and_the_next_compiles(tok):
    compiler = GrammarCompiler(tok, tok.vocab_size, timeout_s=30, memory_mb=64, children=1)
    await compiler.matcher(SMALL)
    alternatives = "|".join(f"option number {i}" for i in range(150_000))
    with pytest.raises(GrammarError, match="crashed the grammar compiler .killed by SIGABRT"):
        await compiler.matcher(Constraint("regex", f"({alternatives})"))  # 300+ MiB to compile
    assert compiler.pool.crashes == 1
    await compiler.matcher(Constraint("regex", "[a-z]{3}"))  # on a new child
    await compiler.aclose()
    compiler = GrammarCompiler(tok, tok.vocab_size, timeout_s=1.0, children=1)
    await compiler.matcher(SMALL)
    t = time.perf_counter()
    with pytest.raises(GrammarError, match="did not compile within 1s"):
        await compiler.matcher(choices(100_000))  # ~17 s to compile
    assert time.perf_counter() - t < 2.0
    assert compiler.pool.timeouts == 1 and compiler.pool.crashes == 0
    await compiler.matcher(Constraint("regex", "[a-z]{3}"))  # on a new child
    await compiler.aclose()


async def test_a_slow_compile_holds_one_child_and_another_clients_schema_compiles_at_once(tok):
    compiler = GrammarCompiler(tok, tok.vocab_size, timeout_s=3)
    await compiler.matcher(Constraint("regex", "[a-z]{3}"))
    slow = asyncio.ensure_future(compiler.matcher(choices(100_000)))
    await asyncio.sleep(0.3)
    t = time.perf_counter()
    await compiler.matcher(SMALL)
    assert time.perf_counter() - t < 1.0
    assert not slow.done()
    with pytest.raises(GrammarError, match="did not compile within 3s"):
        await slow
    await compiler.aclose()


async def test_a_caller_that_leaves_mid_compile_leaves_its_child_to_finish(tok):
    compiler = GrammarCompiler(tok, tok.vocab_size, children=1)
    await compiler.matcher(SMALL)
    pids = compiler.pool.pids()
    gone = asyncio.ensure_future(compiler.matcher(choices(20_000)))
    await asyncio.sleep(0.2)
    gone.cancel()
    await compiler.matcher(Constraint("regex", "[0-9]{2}"))  # after the child's reply is read
    assert compiler.pool.pids() == pids and compiler.pool.crashes == compiler.pool.timeouts == 0
    await compiler.aclose()


def test_the_cache_is_bounded_by_the_matchers_reckoned_memory(tok):
    """LRU within `cache_bytes` of `matcher_bytes`: the oldest go first, and a grammar larger
    than the whole bound is compiled for its request and never kept."""
    compiler = GrammarCompiler(tok, tok.vocab_size, cache_bytes=MATCHER_BASE_BYTES * 3)
    small = [Constraint("regex", f"a{{{i}}}") for i in range(1, 6)]
    for c in small:
        compiler.matcher_now(c)
    assert len(compiler._cache) == 2 and compiler.cached_bytes <= compiler.cache_bytes
    assert list(compiler._cache) == [(c.kind, c.spec) for c in small[-2:]]  # the newest two
    built = compiler.compiles
    compiler.matcher_now(small[-1])  # a hit: nothing built
    assert compiler.compiles == built
    big = choices(2_000)  # ~45 KB of grammar: ~6 MB reckoned, more than the whole bound
    compiler.matcher_now(big)
    assert (big.kind, big.spec) not in compiler._cache and len(compiler._cache) == 2
    compiler.close()
