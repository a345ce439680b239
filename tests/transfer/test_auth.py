"""Cluster-token challenge-response: refusals on both sides, no token on the wire, no residue."""

from __future__ import annotations

import asyncio
import base64

import pytest
import zmq
import zmq.asyncio
from transfer_helpers import D_SIDE, TOKEN, eventually, start_manager

from pd.transfer import KVPoll, TransferParams, auth
from pd.transfer.errors import AuthError, ProtocolError
from pd.transfer.messages import Auth, Challenge, Hello, Refused, decode, encode
from pd.transfer.peerproc import PoolSpec, pool_desc, pool_tensors

WRONG = "not-the-cluster-token-9876543210"


def leaked(frames: list[bytes], secret: str) -> bool:
    s = secret.encode()
    forms = [s, s.hex().encode(), base64.b64encode(s)]
    return any(f in frame for frame in frames for f in forms)


async def managers(p_token: str, d_token: str):
    p_wire, d_wire = [], []
    P = await start_manager("fake", token=p_token, wire_tap=p_wire.append)
    D = await start_manager("fake", token=d_token, **D_SIDE, wire_tap=d_wire.append)
    spec = PoolSpec("kv", 4, seed=3)
    P.register_pool(pool_desc(spec, pool_tensors(spec, fill=True)))
    keep = pool_tensors(spec, fill=False)
    D.register_pool(pool_desc(spec, keep))
    return P, D, p_wire, d_wire, keep


@pytest.mark.parametrize("who_is_wrong", ["decode", "prefill"])
async def test_wrong_token_refused_both_ways(who_is_wrong):
    p_token, d_token = (TOKEN, WRONG) if who_is_wrong == "decode" else (WRONG, TOKEN)
    P, D, p_wire, d_wire, _ = await managers(p_token, d_token)
    try:
        released = []
        s = P.create_sender({"kv": [1]}, lambda s, r: released.append(r), lease_ttl_s=30)
        rx = D.create_receiver(TransferParams.from_dict(s.params().to_dict()))
        rx.init({"kv": [2]})
        assert await asyncio.wait_for(rx.wait(), 5) is KVPoll.Failed
        assert "AuthError" in rx.failure_reason and "authentication" in rx.failure_reason
        # nothing about the refused peer on either side: no session, half-open handshake, link
        await eventually(lambda: P.state().pending_handshakes == 0 and D.state().connecting == 0)
        ps, ds = P.state(), D.state()
        assert (ps.sessions, ps.pending_handshakes) == (0, 0)
        assert (ds.links, ds.receivers, ds.backend.remote_agents) == (0, 0, 0)
        assert released == [] and s.poll() is KVPoll.WaitingForInput  # never renewed by a stranger
        assert p_wire and d_wire
        for t in (TOKEN, WRONG):
            assert not leaked(p_wire + d_wire, t), "a token crossed the wire"
    finally:
        await D.close()
        await P.close()


async def test_prefill_refuses_a_forged_proof_and_forgets_it():
    """A client that skips verifying P and answers with a bogus proof is refused by P."""
    P = await start_manager("fake")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{P.bootstrap_port}")
    try:
        await sock.send_multipart([encode(Hello("mallory", auth.new_nonce().hex()))])
        ch = decode((await asyncio.wait_for(sock.recv_multipart(), 5))[0])
        assert isinstance(ch, Challenge) and P.state().pending_handshakes == 1
        await sock.send_multipart([encode(Auth("00" * 32))])
        refused = decode((await asyncio.wait_for(sock.recv_multipart(), 5))[0])
        assert isinstance(refused, Refused) and "authentication" in refused.reason
        assert (P.state().sessions, P.state().pending_handshakes) == (0, 0)
        # session messages from an unauthenticated identity are refused too
        await sock.send_multipart([b'{"v":1,"t":"done","transfer_id":"x"}', b"0" * 16])
        assert isinstance(decode((await asyncio.wait_for(sock.recv_multipart(), 5))[0]), Refused)
    finally:
        sock.close(0)
        ctx.destroy(0)
        await P.close()


def test_proofs_and_messages():
    dn, pn = auth.new_nonce(), auth.new_nonce()
    a = auth.prefill_proof(b"t", dn, pn, "p", "d")
    assert a != auth.decode_proof(b"t", dn, pn, "p", "d")  # no reflection between roles
    assert a != auth.prefill_proof(b"u", dn, pn, "p", "d")
    with pytest.raises(ProtocolError, match="version"):
        decode(b'{"v":2,"t":"done","transfer_id":"x"}')
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(b'{"v":1,"t":"nope"}')
    with pytest.raises(ProtocolError):
        decode(b'{"v":1,"t":"done","bogus":1}')
    assert decode(encode(Hello("e", "ab"))) == Hello("e", "ab")
    with pytest.raises(AuthError):
        auth.resolve_token("")
