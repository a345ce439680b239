"""The pairing contract at the handshake: P's Welcome carries its contract (compared) and its
runtime format (reported); D refuses a P whose contract differs from its own, naming both."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transfer_helpers import D_SIDE, eventually, start_manager

from pd.transfer import KVPoll, TransferConfig, TransferParams, whole_pool_from_tensors
from pd.transfer.messages import Welcome, decode, encode

CONTRACT = {"model_fingerprint": "aaaa1111", "page_size": "16", "kv_layout": "L", "dtype": "f32"}


def test_welcome_carries_contract_and_runtime_and_old_welcomes_still_decode():
    w = Welcome("e", "fake", "", [], 60.0, contract=CONTRACT, runtime={"quantization": "int8"})
    assert decode(encode(w)) == w
    old = b'{"v":1,"t":"welcome","engine_id":"e","backend":"fake","agent_metadata":"",'
    old += b'"pools":[],"session_timeout_s":60.0}'
    assert decode(old) == Welcome("e", "fake", "", [], 60.0)  # no contract, no runtime


def test_config_checks_contract_values():
    with pytest.raises(ValueError, match="contract"):
        TransferConfig(contract={"page_size": 16})  # type: ignore[dict-item]


async def _pair(p_cfg: dict, d_cfg: dict):
    P = await start_manager("fake", **p_cfg)
    D = await start_manager("fake", **{**D_SIDE, **d_cfg})
    src, dst = torch.arange(64, dtype=torch.float32).reshape(8, 8), torch.zeros(8, 8)
    P.register_pool(whole_pool_from_tensors("kv", [src]))
    D.register_pool(whole_pool_from_tensors("kv", [dst]))
    return P, D, src, dst


async def _pull(P, D, dst_slot: int = 0):
    released: list[str] = []
    s = P.create_sender({"kv": [3]}, lambda s, r: released.append(r))
    rx = D.create_receiver(TransferParams.from_dict(s.params().to_dict()))
    rx.init({"kv": [dst_slot]})
    state = await asyncio.wait_for(rx.wait(), 5)
    return s, rx, state, released


async def test_a_contract_mismatch_is_refused_at_the_handshake_naming_both_sides(caplog):
    theirs = {**CONTRACT, "model_fingerprint": "bbbb2222"}
    P, D, _, dst = await _pair({"contract": CONTRACT}, {"contract": theirs})
    try:
        with caplog.at_level(logging.WARNING, logger="pd.transfer"):
            s, rx, state, _ = await _pull(P, D)
        assert state is KVPoll.Failed
        reason = rx.failure_reason or ""
        assert "ContractMismatch" in reason and "model_fingerprint" in reason
        assert "'aaaa1111'" in reason and "'bbbb2222'" in reason  # P's and D's values
        assert "prefill" in reason and "decode" in reason
        assert f"127.0.0.1:{P.bootstrap_port}" in reason
        assert "page_size" not in reason  # only what differs
        assert not dst.any()  # nothing was read
        # D keeps no link; P drops the session at once (D told it why) and logs the reason.
        await eventually(lambda: P.state().sessions == 0, 2.0, "P dropped the session")
        assert D.state().links == 0
        assert any("bbbb2222" in r.getMessage() for r in caplog.records if "bootstrap" in r.name)
        s.abort("test over")
    finally:
        await D.close()
        await P.close()


@pytest.mark.parametrize("p_contract", [None, {"model_fingerprint": "aaaa1111"}])
async def test_a_prefill_without_the_contract_is_refused(p_contract):
    P, D, _, _ = await _pair({"contract": p_contract}, {"contract": CONTRACT})
    try:
        s, rx, state, _ = await _pull(P, D)
        assert state is KVPoll.Failed and "ContractMismatch" in (rx.failure_reason or "")
        assert "not reported" in (rx.failure_reason or "")  # what P lacks is named
        s.abort("test over")
    finally:
        await D.close()
        await P.close()


async def test_same_contract_other_runtime_pairs_and_the_runtime_is_logged_once(caplog):
    P, D, src, dst = await _pair(
        {"contract": CONTRACT, "runtime": {"quantization": "int8", "attention": "torch"}},
        {"contract": dict(CONTRACT), "runtime": {"quantization": "none", "attention": "torch"}},
    )
    try:
        with caplog.at_level(logging.INFO, logger="pd.transfer"):
            for slot in (0, 1):  # two pulls, one handshake
                _, rx, state, released = await _pull(P, D, slot)
                assert state is KVPoll.Success, rx.failure_reason
                await eventually(lambda: released == ["done"], 2.0, "done")
        assert torch.equal(dst[0], src[3]) and torch.equal(dst[1], src[3])
        reports = [r.getMessage() for r in caplog.records if "quantization" in r.getMessage()]
        assert len(reports) == 1, reports
        assert "int8" in reports[0] and f"127.0.0.1:{P.bootstrap_port}" in reports[0]
        assert "none" in reports[0]  # and ours beside it
        link = next(iter(D._links.values()))
        assert link.runtime == {"quantization": "int8", "attention": "torch"}
        assert link.contract == CONTRACT
    finally:
        await D.close()
        await P.close()


async def test_a_decode_side_without_a_contract_checks_nothing():
    P, D, src, dst = await _pair({"contract": CONTRACT}, {})
    try:
        _, rx, state, _ = await _pull(P, D)
        assert state is KVPoll.Success, rx.failure_reason
    finally:
        await D.close()
        await P.close()


async def test_set_contract_before_start_only():
    P = await start_manager("fake")
    try:
        with pytest.raises(Exception, match="before start"):
            P.set_contract(CONTRACT, {})
    finally:
        await P.close()
