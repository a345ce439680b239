import math

import pytest
import torch

from pd.protocol import APIError, GenerationOptions, parse_request
from pd.worker.model import sampler as sampling
from pd.worker.model.sampler import Sampler, uniform_for_position

V = 64


def _logits(B: int, V: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[GenerationOptions], outputs=None):
    B = logits.shape[0]
    outputs = outputs if outputs is not None else [[] for _ in range(B)]
    return sampler.sample(logits, params, [[1, 2, 3] for _ in range(B)], outputs)


def test_greedy_is_argmax():
    logits = _logits(8)
    out = _sample(Sampler(), logits, [GenerationOptions(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8


def test_greedy_bf16_is_argmax():
    logits = _logits(4).to(torch.bfloat16)
    out = _sample(Sampler(), logits, [GenerationOptions(temperature=0.0)] * 4)
    assert out.token_ids == logits.float().argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(16)
    expected = logits.argmax(-1).tolist()
    sampler = Sampler(seed=1)
    for params in (
        GenerationOptions(temperature=1.5, top_k=1),
        GenerationOptions(temperature=1.5, top_p=1e-6),
        GenerationOptions(temperature=1.5, min_p=1.0),
        GenerationOptions(temperature=1.5, top_k=1, seed=3),
    ):
        for _ in range(5):
            assert _sample(sampler, logits, [params] * 16).token_ids == expected, params


def _empirical(probs: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    return counts


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    exp = expected_probs.double() * n
    keep = exp > 5  # merge small cells into one
    stat = ((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    rest_c, rest_e = counts[~keep].sum(), exp[~keep].sum()
    dof = int(keep.sum()) - 1
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
        dof += 1
    return float(stat), dof


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    assert counts[probs == 0].sum() == 0, "drew a token with probability 0"
    stat, dof = _chi_square(counts, probs)
    # Loose: mean is dof, sd is sqrt(2 dof); this fails only on a real mismatch.
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10, (stat, dof)


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_matches_softmax(seeded: bool):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    temperature = 0.7
    n = 10000
    logits = row.expand(n, -1).contiguous()
    if seeded:
        # One seeded request per row: the exponential race over independent streams.
        params = [GenerationOptions(temperature=temperature, seed=s) for s in range(2000)]
        logits = logits[:2000]
    else:
        params = [GenerationOptions(temperature=temperature)] * n
    out = _sample(Sampler(seed=0), logits, params)
    probs = torch.softmax(row / temperature, -1)
    _assert_matches(_empirical(probs, out.token_ids), probs)


def test_top_k_and_top_p_distribution():
    row = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -1.0])
    n = 10000
    logits = row.expand(n, -1).contiguous()
    probs = torch.softmax(row, -1)

    out = _sample(Sampler(seed=0), logits, [GenerationOptions(top_k=3)] * n)
    want = probs.clone()
    want[3:] = 0
    _assert_matches(_empirical(probs, out.token_ids), want / want.sum())

    # probs ~ [.61, .22, .08, ...]: top_p=0.8 keeps the first two (mass before #3 is .83 > .8).
    out = _sample(Sampler(seed=0), logits, [GenerationOptions(top_p=0.8)] * n)
    want = probs.clone()
    want[2:] = 0
    _assert_matches(_empirical(probs, out.token_ids), want / want.sum())

    # min_p=0.3: keep tokens with prob >= 0.3 * p_max, i.e. the first two.
    out = _sample(Sampler(seed=0), logits, [GenerationOptions(min_p=0.3)] * n)
    _assert_matches(_empirical(probs, out.token_ids), want / want.sum())


def _reference_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean keep-mask, the plain full-sort way (smallest prefix with mass >= p)."""
    vals, order = probs.sort(descending=True)
    keep_sorted = (vals.cumsum(-1) - vals) <= p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@pytest.mark.parametrize("candidates", [1024, 3])
def test_top_p_matches_reference(monkeypatch, candidates: int):
    # candidates=3 sends most rows through the full-sort fallback; both paths must agree.
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(0)
    logits = torch.cat(
        [torch.randn(6, 3000, generator=g) * 4, torch.randn(6, 3000, generator=g) * 0.1]
    )
    top_ps = [0.05, 0.3, 0.6, 0.9, 0.99, 1.0] * 2
    probs = torch.softmax(logits, -1)
    got = probs.clone()
    sampling._top_p(got, top_ps)
    for i, tp in enumerate(top_ps):
        want = _reference_top_p(probs[i], tp) if tp < 1 else torch.ones(3000, dtype=torch.bool)
        assert torch.equal(got[i] > 0, want), (i, tp)
        assert torch.equal(got[i][want], probs[i][want])


def test_inverse_cdf_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5)
    u = torch.tensor([0.0, 0.4999, 0.5, 0.75, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sampling._inverse_cdf(probs, u) == [1, 1, 3, 3, 3]


def test_same_seed_same_tokens_different_seeds_differ():
    logits = _logits(1, V=1000)
    flat = torch.zeros(1, 1000)  # uniform: tokens only depend on the noise

    def run(seed: int, sampler: Sampler) -> list[int]:
        outputs: list[int] = []
        for _ in range(20):
            out = _sample(sampler, flat, [GenerationOptions(temperature=1.0, seed=seed)], [outputs])
            outputs = outputs + out.token_ids
        return outputs

    a = run(7, Sampler())
    assert a == run(7, Sampler()) == run(7, Sampler(seed=123))
    assert a != run(8, Sampler())
    assert len(set(a)) > 10  # positions draw different noise
    assert uniform_for_position(7, 0) != uniform_for_position(7, 1) != uniform_for_position(8, 1)
    del logits


def test_seeded_row_independent_of_batch_and_history():
    logits = _logits(8, V=V, seed=5)
    row = logits[3:4].clone()
    params = GenerationOptions(temperature=0.9, top_p=0.95, seed=42)
    others = [
        GenerationOptions(temperature=0.0),
        GenerationOptions(temperature=1.3),
        GenerationOptions(temperature=0.5, top_k=5, seed=1),
        None,
        GenerationOptions(temperature=1.0, top_p=0.5, min_p=0.1),
        GenerationOptions(temperature=0.0, logprobs=True, top_logprobs=2),
        GenerationOptions(temperature=2.0, top_k=10),
        GenerationOptions(temperature=1.0, seed=42),
    ]
    batch_params = [params if p is None else p for p in others]
    history = [11, 12, 13, 14, 15]  # output position 5

    alone = Sampler().sample(row, [params], [[1, 2]], [history]).token_ids[0]
    # Earlier positions sampled by the same Sampler with the shared stream advanced.
    warm = Sampler(seed=9)
    for _ in range(3):
        _sample(warm, logits, [GenerationOptions(temperature=1.0)] * 8)
    outputs = [[5] * (i + 1) for i in range(8)]
    outputs[3] = history
    prompts = [[1, 2]] * 8
    in_batch = warm.sample(logits, batch_params, prompts, outputs).token_ids[3]
    assert alone == in_batch

    # Across many positions and a high temperature the two paths agree token for token.
    hot = GenerationOptions(temperature=5.0, seed=42)
    for pos in range(30):
        hist = list(range(pos))
        one = Sampler().sample(row, [hot], [[1]], [hist]).token_ids[0]
        batch = [hot if i == 3 else p for i, p in enumerate(batch_params)]
        outs = [o if i != 3 else hist for i, o in enumerate(outputs)]
        many = warm.sample(logits, batch, prompts, outs).token_ids[3]
        assert one == many, pos


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt = [[0, 4]]
    output = [[3, 3, 1]]
    params = GenerationOptions(
        temperature=0.0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logprobs=True,
        top_logprobs=5,
    )
    out = Sampler().sample(logits, [params], prompt, output)
    # repetition over prompt+output {0, 1, 3, 4}: 2/2, -1*2, 0.5 (unseen), 3/2, -2*2
    # then output counts {3: 2, 1: 1}: token 3 -= .25*2 + .5, token 1 -= .25*1 + .5
    expected = torch.tensor([1.0, -2.0 - 0.75, 0.5, 1.5 - 1.0, -4.0])
    want = torch.log_softmax(expected, -1)
    got = dict(out.top_logprobs[0])
    assert sorted(got) == [0, 1, 2, 3, 4]
    for t in range(5):
        assert got[t] == pytest.approx(want[t].item(), abs=1e-6)
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(want[0].item(), abs=1e-6)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])), "input modified"


def test_penalties_only_on_their_rows():
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]])
    params = [
        GenerationOptions(temperature=0.0, presence_penalty=1.0),
        GenerationOptions(temperature=0.0),
    ]
    out = Sampler().sample(logits, params, [[], []], [[0], [0]])
    assert out.token_ids == [1, 0]


def test_logprobs_match_log_softmax():
    logits = _logits(4)
    params = [
        GenerationOptions(temperature=0.0, logprobs=True, top_logprobs=3),
        GenerationOptions(temperature=0.8, top_k=5, logprobs=True),
        GenerationOptions(temperature=0.0),
        GenerationOptions(temperature=1.2, top_p=0.5, logprobs=True, top_logprobs=5, seed=3),
    ]
    out = _sample(Sampler(), logits, params)
    lp = torch.log_softmax(logits, -1)
    for i in (0, 1, 3):
        t = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(lp[i, t].item(), abs=1e-5)
        k = params[i].top_logprobs
        vals, ids = lp[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [tid for tid, _ in out.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-5)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[1] == []


def test_greedy_batch_does_no_extra_work(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("greedy batch without penalties or logprobs must not get here")

    for name in ("_apply_penalties", "_token_counts", "_inverse_cdf", "_fill_logprobs"):
        monkeypatch.setattr(sampling, name, forbidden)
    monkeypatch.setattr(torch, "softmax", forbidden)
    logits = _logits(8)
    out = _sample(Sampler(), logits, [GenerationOptions(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_ties_go_to_the_first_token():
    """As argmax: among equal largest logits the first token wins, alone in a batch of greedy
    rows or among sampled rows."""
    logits = torch.zeros(3, 50)
    logits[:, 7] = logits[:, 3] = 2.0
    for dtype in (torch.float32, torch.bfloat16):
        out = _sample(Sampler(), logits.to(dtype), [GenerationOptions(temperature=0.0)] * 3)
        assert out.token_ids == [3, 3, 3]
    mixed = [GenerationOptions(temperature=0.0), GenerationOptions(temperature=1.0, seed=1)] * 2
    out = _sample(Sampler(), torch.cat([logits, logits[:1]]), mixed)
    assert out.token_ids[0] == out.token_ids[2] == 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_validation_errors(kwargs, needle):
    """Options are validated once, at the edge: a bad value is a 400 naming it."""
    with pytest.raises(APIError, match=needle) as e:
        parse_request("/v1/completions", {"prompt": "hi", **kwargs})
    assert e.value.status == 400 and e.value.param == needle


def test_params_defaults_and_greedy():
    assert GenerationOptions(temperature=0.0).is_greedy
    assert GenerationOptions(temperature=1e-30).is_greedy  # logits / 1e-30 would overflow to inf
    assert not GenerationOptions().is_greedy
    assert not GenerationOptions().uses_penalties
    assert GenerationOptions(repetition_penalty=1.1).uses_penalties
    edge = parse_request(
        "/v1/completions",
        {"prompt": "x", "top_k": 0, "top_p": 1.0, "presence_penalty": -2.0, "frequency_penalty": 2},
    ).options
    assert edge.top_k == -1 and edge.frequency_penalty == 2.0
    assert parse_request("/v1/completions", {"prompt": "x", "stop": "###"}).options.stop == ("###",)
    listed = parse_request(
        "/v1/completions", {"prompt": "x", "stop": ["a", "b"], "stop_token_ids": [2]}
    ).options
    assert listed.stop == ("a", "b") and listed.stop_token_ids == (2,)


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=50),
        dict(top_p=0.9),
        dict(top_k=50, top_p=0.9),
        dict(top_p=0.5, min_p=0.05),
        dict(top_k=3, min_p=0.2),
    ],
)
def test_the_truncated_fast_path_draws_what_the_full_path_draws(monkeypatch, kw):
    """Seeded rows: the candidates-only path and the whole-vocabulary path pick the same tokens."""
    from pd.worker.model import sampler as sampler_mod

    torch.manual_seed(0)
    V = 5000
    ranks = torch.arange(1, V + 1).float()
    logits = torch.stack([(-3.3 * torch.log(ranks))[torch.randperm(V)] for _ in range(16)])
    params = [GenerationOptions(temperature=0.8, seed=11, **kw)] * 16
    outputs = [[1] * i for i in range(16)]  # a different output position, so another u, per row
    fast = Sampler(0).sample(logits, params, [[1]] * 16, outputs).token_ids
    monkeypatch.setattr(sampler_mod, "_truncated_draw", lambda *a, **k: None)
    full = Sampler(0).sample(logits, params, [[1]] * 16, outputs).token_ids
    assert fast == full


def test_a_tie_at_the_top_k_boundary_takes_the_full_path_which_keeps_every_tie():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]])  # top_k=2 cuts inside the tie at 3.0
    params = [GenerationOptions(temperature=1.0, top_k=2)]
    seen = {Sampler(s).sample(logits, params, [[1]], [[]]).token_ids[0] for s in range(200)}
    assert {1, 2, 3} <= seen and 4 not in seen  # every tied token, never the one below


MASK_PATHS = [
    GenerationOptions(temperature=0.0),
    GenerationOptions(temperature=1.0),
    GenerationOptions(temperature=1.0, seed=7),
    GenerationOptions(temperature=0.8, top_k=5),
    GenerationOptions(temperature=0.8, top_p=0.5),
    GenerationOptions(temperature=0.8, top_k=50, top_p=0.9),
    GenerationOptions(temperature=0.8, min_p=0.1),
    GenerationOptions(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5),
    GenerationOptions(temperature=0.0, logprobs=True, top_logprobs=3),
]


def _bitmask(allowed_rows: list[list[int]], V: int = V) -> torch.Tensor:
    masks = torch.zeros(len(allowed_rows), (V + 31) // 32, dtype=torch.int32)
    for r, ids in enumerate(allowed_rows):
        for t in ids:
            masks[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return masks


@pytest.mark.parametrize("params", MASK_PATHS, ids=lambda p: repr(p)[:60])
def test_the_allowed_token_mask_holds_in_every_sampling_path(params):
    # Structured outputs depend on it: a masked token is never drawn, whatever the path.
    sampler = Sampler(seed=3)
    allowed = [[5, 40, 63], [0], [31, 32]]  # across word boundaries, token 0, the last id
    logits = _logits(3, seed=11)
    logits[:, 5] = -50.0  # an allowed token the model dislikes
    for _ in range(30):
        out = sampler.sample(logits, [params] * 3, [[1]] * 3, [[2, 3]] * 3, _bitmask(allowed))
        assert all(t in ok for t, ok in zip(out.token_ids, allowed)), out.token_ids
        if params.wants_logprobs:  # reported over the allowed tokens only
            assert all(t in ok for top, ok in zip(out.top_logprobs, allowed) for t, lp in top
                       if lp > -math.inf)  # fmt: skip


def test_masks_leave_rows_without_rules_alone_and_logit_bias_adds():
    logits = _logits(2, seed=4)
    all_allowed = torch.full((2, 2), -1, dtype=torch.int32)
    plain = Sampler().sample(logits, [GenerationOptions(temperature=0.0)] * 2, [[1]] * 2, [[]] * 2)
    masked = Sampler().sample(
        logits, [GenerationOptions(temperature=0.0)] * 2, [[1]] * 2, [[]] * 2, all_allowed
    )
    assert masked.token_ids == plain.token_ids
    worst = int(logits[0].argmin())
    biased = GenerationOptions(temperature=0.0, logit_bias=((worst, 100.0), (999, 5.0)))
    out = Sampler().sample(logits[:1], [biased], [[1]], [[]])  # ids past V are ignored
    assert out.token_ids == [worst]
    assert not logits.isinf().any()  # the caller's logits are not modified
