"""The paged, chunked, tensor-parallel forward against references, on the real default model."""

import pytest
import torch

from tests.model_fixtures import default_checkpoint, forward_chunk, greedy_generate, make_runner

pytestmark = pytest.mark.slow  # loads the real model

transformers = pytest.importorskip("transformers", reason="the reference forward is transformers'")

PROMPT = "The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed the ocean blue."


def hf_reference(ckpt):
    """transformers' Llama (eager attention, full sequence) with our loaded weights."""
    c = ckpt.config
    kw = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attn_implementation="eager",
    )
    try:
        cfg = transformers.LlamaConfig(
            **kw, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}
        )
    except TypeError:
        cfg = transformers.LlamaConfig(**kw, rope_theta=c.rope_theta)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(ckpt.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def test_paged_chunked_forward_matches_a_full_sequence_forward():
    ckpt = default_checkpoint()
    runner = make_runner(num_pages=16, page_size=16)
    prompt = ckpt.tokenizer.encode(PROMPT)
    tokens, rows = greedy_generate(runner, prompt, steps=21, chunk=7)  # prefill + 20 decode steps
    # Also every prompt position's logits, chunk by chunk (a fresh cache: pages reused).
    pages = list(range(16))
    prefill = torch.cat(
        [forward_chunk(runner, pages, prompt[s : s + 7], s) for s in range(0, len(prompt), 7)]
    )
    ours = torch.cat([prefill, torch.stack(rows[1:])])  # positions 0 .. len(prompt)+19
    full = prompt + tokens[:-1]
    with torch.inference_mode():
        ref = hf_reference(ckpt)(torch.tensor([full])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"max |logit difference| paged vs full-sequence forward: {diff:.3e}")
    assert ours.shape == ref.shape
    assert diff < 2e-3, f"paged forward differs from the full-sequence forward by {diff}"
    assert tokens == ref.argmax(-1)[len(prompt) - 1 :].tolist()  # same greedy continuation


def test_tp3_equals_tp1_in_fp32():
    ckpt = default_checkpoint()
    prompt = ckpt.tokenizer.encode("Write a haiku about the sea.")
    out1, rows1 = greedy_generate(make_runner(tp=1), prompt, steps=24)
    out3, rows3 = greedy_generate(make_runner(tp=3), prompt, steps=24)
    diff = (torch.stack(rows1) - torch.stack(rows3)).abs().max().item()
    print(f"TP=3 vs TP=1: max |logit difference| {diff:.3e}")
    print("TP=1:", repr(ckpt.tokenizer.decode(out1)))
    assert ckpt.tokenizer.decode(out1) == ckpt.tokenizer.decode(out3)
    assert diff < 1e-3


def test_a_tp_size_that_does_not_divide_the_kv_heads_is_refused():
    with pytest.raises(ValueError, match=r"--tp 2 .*valid TP sizes: 1, 3"):
        make_runner(tp=2)
