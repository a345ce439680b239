"""pd's internal fields (pd/signing.py): P's kv_transfer_params and the router's continuations
are checked under the cluster token; unsigned ones pass from loopback only."""

from __future__ import annotations

import pytest

from pd.protocol import APIError
from pd.signing import (
    CONTINUATION,
    FLAG,
    KV_PARAMS,
    SIG,
    Guard,
    continuation_payload,
    is_loopback,
    optional_token,
    sign,
    sign_continuation,
    sign_params,
    unsigned,
)

TOKEN = b"cluster-secret"
REMOTE = "192.0.2.7"
PARAMS = {"transfer_id": "t1", "prompt_token_ids": [1, 2, 3], "page_ids": {"kv": [4]}, "x": 0.5}


def refused(guard: Guard, field: str, remote: str, payload, sig) -> APIError:
    with pytest.raises(APIError) as e:
        guard.check(field, remote, payload, sig)
    assert e.value.status == 403 and e.value.code == "unsigned_internal_field"
    assert e.value.param == field
    return e.value


@pytest.mark.parametrize(
    "remote, loopback",
    [
        ("127.0.0.1", True), ("127.8.0.2", True), ("::1", True), ("::ffff:127.0.0.1", True),
        ("192.0.2.7", False), ("::ffff:10.0.0.1", False), ("fd00::2", False), (None, False),
        ("", False), ("not an address", False), ("fe80::1%eth0", False),
    ],
)  # fmt: skip
def test_loopback_is_told_from_the_address(remote, loopback):
    assert is_loopback(remote) is loopback


def test_signed_params_pass_from_anywhere_and_a_changed_field_is_refused():
    guard = Guard(TOKEN)
    params = sign_params(TOKEN, PARAMS)
    assert unsigned(params) == PARAMS and len(params[SIG]) == 64
    guard.check(KV_PARAMS, REMOTE, unsigned(params), params[SIG])
    # Key order does not matter (what a JSON round trip may change); a value does.
    reordered = dict(reversed(list(unsigned(params).items())))
    guard.check(KV_PARAMS, REMOTE, reordered, params[SIG])
    for changed in ({"page_ids": {"kv": [5]}}, {"x": 0.25}, {"extra": 1}):
        e = refused(guard, KV_PARAMS, REMOTE, {**PARAMS, **changed}, params[SIG])
        assert FLAG in e.message
    # Wrong too from loopback: a signature is checked wherever it comes from.
    refused(guard, KV_PARAMS, "127.0.0.1", {**PARAMS, "x": 1}, params[SIG])
    refused(Guard(b"another token"), KV_PARAMS, REMOTE, PARAMS, params[SIG])
    # A signature of one field is no signature of the other.
    refused(guard, CONTINUATION, REMOTE, PARAMS, params[SIG])


def test_unsigned_fields_pass_from_loopback_only_and_the_refusal_names_the_flag():
    for guard in (Guard(TOKEN), Guard(None)):
        guard.check(KV_PARAMS, "127.0.0.1", PARAMS, None)
        guard.check(CONTINUATION, "::1", {"output_token_ids": [1]}, None)
        e = refused(guard, KV_PARAMS, REMOTE, PARAMS, None)
        assert FLAG in e.message and "PD_CLUSTER_TOKEN" in e.message
        assert guard.refused == {f"{KV_PARAMS}:unsigned": 1}  # counted
    # A worker without a token cannot check a signature: from another host, refused.
    e = refused(Guard(None), KV_PARAMS, REMOTE, PARAMS, sign(TOKEN, KV_PARAMS, PARAMS))
    assert "no --cluster-token" in e.message


@pytest.mark.parametrize("sig", ["", "é" * 64, "0" * 64, 7, ["x"], {"a": 1}, "\udcff"])
def test_odd_signatures_are_a_403(sig):
    refused(Guard(TOKEN), KV_PARAMS, REMOTE, PARAMS, sig)


def test_a_payload_json_cannot_hold_is_a_403_not_a_crash():
    refused(Guard(TOKEN), KV_PARAMS, REMOTE, {"n": 2**70}, "0" * 64)


def test_a_continuation_is_bound_to_its_prompt():
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        CONTINUATION: {"output_token_ids": [5]},
    }
    signed = sign_continuation(TOKEN, body)
    assert CONTINUATION in body and SIG not in body[CONTINUATION]  # the caller's body unchanged
    sig = signed[CONTINUATION][SIG]
    guard = Guard(TOKEN)
    guard.check(CONTINUATION, REMOTE, continuation_payload(signed), sig)
    # Other fields may differ per leg (stream, max_tokens, kv_transfer_params): still valid.
    leg = {**signed, "stream": False, "max_tokens": 1, KV_PARAMS: {"do_remote_decode": True}}
    guard.check(CONTINUATION, REMOTE, continuation_payload(leg), sig)
    moved = {**signed, "messages": [{"role": "user", "content": "write me a novel"}]}
    refused(guard, CONTINUATION, REMOTE, continuation_payload(moved), sig)
    more = {**signed, CONTINUATION: {"output_token_ids": [5, 6], SIG: sig}}
    refused(guard, CONTINUATION, REMOTE, continuation_payload(more), sig)
    assert sign_continuation(None, body) is body  # no token: sent unsigned


def test_the_token_comes_from_the_flag_or_else_the_environment(monkeypatch):
    monkeypatch.delenv("PD_CLUSTER_TOKEN", raising=False)
    assert optional_token(None) is None and optional_token("") is None
    assert optional_token("abc") == b"abc"
    monkeypatch.setenv("PD_CLUSTER_TOKEN", "from-env")
    assert optional_token(None) == b"from-env" and optional_token("flag") == b"flag"
    assert "loopback only" in Guard(None).describe()
    assert "signed with the cluster token" in Guard(TOKEN).describe()
