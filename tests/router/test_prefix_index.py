"""The router's prefix index: canonical prompts, chained blocks, LRU and TTL per worker."""

from __future__ import annotations

from pd.protocol import parse_request
from pd.router.prefix_index import (
    BLOCK_BYTES,
    PrefixIndex,
    PromptKey,
    TokenEstimate,
    answer_bytes,
    chain,
    prompt_bytes,
    salt_seed,
)


def prompt_of(body: dict) -> bytes:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return prompt_bytes(parse_request(path, body))


def test_a_continued_conversation_serializes_to_an_extension():
    turn1 = [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "q"}]
    a, b = prompt_of({"messages": turn1}), prompt_of({"messages": turn2})
    assert b.startswith(a)
    # The answer, as the router records it, is what the next turn carries.
    assert b.startswith(a + answer_bytes("hello", True))
    # Text parts read as their text; a completion prompt is its bytes; token ids 4 bytes each.
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    ]
    assert prompt_of({"messages": parts}) == prompt_of(
        {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert prompt_of({"prompt": "abc"}) == b"abc"
    assert len(prompt_of({"prompt": [1, 2, 3]})) == 12
    # The role is part of it: the same text from another role is another prompt.
    assert prompt_of({"messages": [{"role": "user", "content": "x"}]}) != prompt_of(
        {"messages": [{"role": "system", "content": "x"}]}
    )


def test_a_prompt_key_extended_by_its_answer_is_the_chain_of_both_under_its_salt():
    data = b"p" * (3 * BLOCK_BYTES + 10)
    for salt in (None, "tenant"):
        key = PromptKey.of(data, salt)
        seed = salt_seed(salt)
        assert key.extended(b"answer" * 20) == chain(data + b"answer" * 20, seed)
        assert PromptKey.of(data, salt, hashed=False).extended(b"a") == chain(data + b"a", seed)
    # Salted chains share no block with the unsalted one, nor with another salt's.
    plain, a, b = (set(PromptKey.of(data, s).blocks) for s in (None, "a", "b"))
    assert not plain & a and not a & b and not plain & b


def test_chains_count_full_blocks_and_share_exactly_the_common_prefix():
    a = b"a" * (3 * BLOCK_BYTES + 10)
    b = a[: 2 * BLOCK_BYTES] + b"b" * (2 * BLOCK_BYTES)
    ca, cb = chain(a), chain(b)
    assert len(ca) == 3 and len(cb) == 4
    assert ca[:2] == cb[:2] and ca[2] != cb[2]
    assert chain(b"x" * (BLOCK_BYTES - 1)) == []
    # A later block equal to an earlier one still hashes differently (it is chained).
    same = chain(b"z" * (2 * BLOCK_BYTES))
    assert same[0] != same[1]


def test_match_counts_leading_blocks_per_worker():
    index = PrefixIndex(max_blocks=100)
    blocks = chain(b"p" * (5 * BLOCK_BYTES))
    index.insert("w1", blocks[:3])
    assert index.match("w1", blocks) == 3
    assert index.match("w2", blocks) == 0
    assert index.match("w1", chain(b"q" * (5 * BLOCK_BYTES))) == 0
    index.insert("w1", blocks)
    assert index.match("w1", blocks) == 5 and index.blocks("w1") == 5 and index.size == 5


def test_lru_evicts_chains_from_their_tail_and_keeps_recent_ones():
    index = PrefixIndex(max_blocks=6)
    old = chain(b"o" * (4 * BLOCK_BYTES))
    new = chain(b"n" * (4 * BLOCK_BYTES))
    index.insert("w", old)
    index.insert("w", new)  # 8 blocks over a bound of 6: two of the old chain's go
    assert index.blocks("w") == 6
    assert index.match("w", new) == 4
    assert index.match("w", old) == 2  # its head stays matchable, its tail went first
    # Using the old chain again makes it the most recent: now the new one loses its tail.
    index.insert("w", old[:2])
    index.insert("w", chain(b"m" * (2 * BLOCK_BYTES)))
    assert index.match("w", old) == 2 and index.match("w", new) == 2
    # A cap below max_blocks (the worker's own KV capacity) bounds it further.
    index.insert("w", new, cap=3)
    assert index.blocks("w") == 3 and index.match("w", new) == 3


def test_entries_expire_after_the_ttl_and_forget_drops_a_worker():
    now = [0.0]
    index = PrefixIndex(max_blocks=100, ttl_s=10.0, clock=lambda: now[0])
    a = chain(b"a" * (2 * BLOCK_BYTES))
    index.insert("w", a)
    now[0] = 9.0
    assert index.match("w", a) == 2
    now[0] = 10.5
    assert index.match("w", a) == 0  # expired, even before a purge
    index.insert("w", chain(b"b" * BLOCK_BYTES))
    assert index.blocks("w") == 1  # the insert purged the expired ones
    index.forget("w")
    assert index.blocks("w") == 0 and index.size == 0
    off = PrefixIndex(max_blocks=0)
    off.insert("w", a)
    assert not off.enabled and off.match("w", a) == 0


def test_token_estimate_calibrates_towards_what_workers_report():
    est = TokenEstimate()
    assert est.tokens(400) == 100  # 4 bytes a token before any report
    est.observe(600, 100)
    assert est.bytes_per_token == 6.0  # the first report is taken as it is
    for _ in range(200):
        est.observe(500, 100)
    assert abs(est.bytes_per_token - 5.0) < 0.01
    est.observe(0, 10)
    est.observe(10, 0)  # nothing to learn from
    assert abs(est.bytes_per_token - 5.0) < 0.01
