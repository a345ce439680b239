"""The planner's DES (pd/sim/cluster) on cases computed by hand from the cost model: one
request's TTFT and gaps, a decode batch's ITL, the KV-page cap, co-located interference, the
prefix cache; then determinism and page accounting under pressure."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pd.sim import CostModel, parse_profile
from pd.sim.cluster import ClusterSim, ClusterSpec, Limits, SimJob, SimTurn, simulate
from pd.sim.profile import Profile, device_preset, link_preset, model_preset

PROFILE = parse_profile("llama-3.1-8b:h100")  # tp1, rdma-400g
COST = CostModel(PROFILE)
PD = ClusterSpec.disaggregated(PROFILE, 1, 1, 1, 1)
BOTH = ClusterSpec.colocated(PROFILE, 1, 1)


def jobs_of(*turns: SimTurn) -> list[SimJob]:
    return [SimJob(f"j{i}", (t,)) for i, t in enumerate(turns)]


def small_kv(pages: int) -> Profile:
    """The 8B model on an H100 with just enough memory for `pages` pages of 16 tokens."""
    model = model_preset("llama-3.1-8b")
    memory = (model.weight_bytes + (pages * 16 + 0.5) * model.kv_bytes_per_token) / 0.9
    profile = Profile(model, replace(device_preset("h100"), memory_bytes=memory), 1,
                      link_preset("rdma-400g"))  # fmt: skip
    assert profile.kv_pages(16) == pages
    return profile


def test_batch_s_is_step_s_of_the_same_rows() -> None:
    rng = random.Random(0)
    table = replace(PROFILE, prefill_table=((512, 0.03), (4096, 0.2)),
                    decode_table=((1, 512, 0.01), (64, 512, 0.02), (1, 4096, 0.012)))  # fmt: skip
    for cost in (COST, CostModel(parse_profile("llama-3.1-70b:h100:tp4")), CostModel(table)):
        for _ in range(50):
            decode = [(rng.randint(1, 8000), 1) for _ in range(rng.randint(0, 40))]
            chunks = [
                (rng.randint(0, 4000), rng.randint(1, 3000)) for _ in range(rng.randint(0, 3))
            ]
            sampled = len(decode) + rng.randint(0, len(chunks))
            want = cost.step_s(decode + chunks, sampled) if decode or chunks else 0.0
            got = cost.batch_s(len(decode), sum(c for c, _ in decode), chunks, sampled)
            assert got == pytest.approx(want, rel=1e-12)


def test_one_request_through_p_and_d() -> None:
    """TTFT is P's prefill step; the next token waits for the pull and D's first decode step;
    then one decode step a token, each one token of context longer."""
    (r,) = simulate(PD, jobs_of(SimTurn(1000, 4)), [0.5]).requests
    prefill = COST.prefill_s(1000)
    assert r.ok and r.ttft_s == pytest.approx(prefill)
    t1 = 0.5 + prefill + COST.kv_transfer_s(1000) + COST.decode_s(1, 1000)
    assert r.token_times[1] == pytest.approx(t1)
    assert r.itl_s[1:] == pytest.approx([COST.decode_s(1, 1001), COST.decode_s(1, 1002)])
    assert r.tpot_s == pytest.approx((r.token_times[3] - r.token_times[0]) / 3)
    assert (r.prefill_worker, r.decode_worker, r.cached_tokens) == (0, 0, 0)


def test_a_decode_batch_gap_is_the_cost_models_decode_step() -> None:
    """Eight prompts at once: one prefill step of the eight, then each gap is one decode step of
    a batch of eight (context one longer each step)."""
    result = simulate(BOTH, jobs_of(*[SimTurn(500, 6)] * 8), [0.0] * 8)
    first = COST.step_s([(0, 500)] * 8)
    for r in result.requests:
        assert r.ttft_s == pytest.approx(first)
        assert r.itl_s == pytest.approx([COST.decode_s(8, 500 + k) for k in range(5)])
    assert result.workers[0].max_decode_rows == 8


def test_the_kv_pages_cap_the_decode_batch() -> None:
    """40 pages, prompts of 7 pages growing to 9: admission stops at 40 // 7 = 5 requests, and
    5 x 9 > 40 makes the batch preempt as it grows; all ten still finish."""
    spec = ClusterSpec.colocated(small_kv(40), 1, 1)
    result = ClusterSim(spec, check=True).run(jobs_of(*[SimTurn(100, 40)] * 10), [0.0] * 10)
    (w,) = result.workers
    assert w.max_decode_rows == 5
    assert w.preemptions >= 1
    assert all(r.ok for r in result.requests)
    big = simulate(BOTH, jobs_of(*[SimTurn(100, 40)] * 10), [0.0] * 10)
    assert big.workers[0].max_decode_rows == 10 and big.workers[0].preemptions == 0


def test_co_located_prefill_slows_decode_and_disaggregated_does_not() -> None:
    """A 4,000-token prompt (one output token: it never decodes) arriving while a request
    decodes: co-located, the step that carries its prefill is the decoding request's gap
    (DistServe's interference); on P + D, D's gaps stay decode steps."""
    a, b = SimTurn(100, 60), SimTurn(4000, 1)
    arrive_b = 0.2
    colo = simulate(BOTH, jobs_of(a, b), [0.0, arrive_b]).requests[0]
    j0 = next(j for j, t in enumerate(colo.token_times) if t >= arrive_b)
    # The gap to token j + 1 is the step computing token j, at context 100 + j.
    want = [COST.decode_s(1, 100 + j) for j in range(59)]
    want[j0] = COST.step_s([(100 + j0, 1), (0, 4000)])  # B's prefill in A's step
    assert colo.itl_s == pytest.approx(want)
    assert want[j0] > 5 * COST.decode_s(1, 100 + j0)

    disagg = simulate(PD, jobs_of(a, b), [0.0, arrive_b]).requests[0]
    assert disagg.itl_s[1:] == pytest.approx([COST.decode_s(1, 100 + j) for j in range(1, 59)])


def test_the_prefix_cache_serves_a_shared_system_prompt() -> None:
    """The second request finds the first's 1,500-token system prompt cached (whole pages, as
    pd matches them) and prefills the rest: 1,488 tokens cached, 44 computed."""
    system = ("system", 1500)
    t1 = SimTurn(1532, 2, (system, ("u1", 32)))
    t2 = SimTurn(1532, 2, (system, ("u2", 32)))
    first, second = simulate(BOTH, jobs_of(t1, t2), [0.0, 1.0]).requests
    assert (first.cached_tokens, second.cached_tokens) == (0, 1488)
    assert second.ttft_s == pytest.approx(COST.step_s([(1488, 44)]))
    off = replace(BOTH, limits=Limits(prefix_cache=False))
    assert simulate(off, jobs_of(t1, t2), [0.0, 1.0]).requests[1].cached_tokens == 0


def test_a_conversation_sends_its_next_turn_when_the_last_ends() -> None:
    conv = SimJob("c", (SimTurn(200, 3, (("c", 200),)), SimTurn(300, 3, (("c", 300),))))
    first, second = simulate(PD, [conv], [0.0]).requests
    assert second.arrival_s == first.token_times[-1]
    assert second.cached_tokens == 192  # turn 1's prompt, whole pages, from P's cache


def test_a_request_that_never_fits_fails_and_cuts_its_conversation() -> None:
    spec = ClusterSpec.colocated(small_kv(40), 1, 1)
    conv = SimJob("c", (SimTurn(1000, 4), SimTurn(10, 4)))
    first, second = simulate(spec, [conv], [0.0]).requests
    assert (first.error, second.error) == ("too_long", "conversation_cut")
    assert not first.ok and not second.ok


def test_round_robin_and_least_loaded() -> None:
    turns = [SimTurn(3000, 2), SimTurn(100, 2), SimTurn(100, 2), SimTurn(100, 2)]
    rr = ClusterSpec.disaggregated(PROFILE, 2, 1, 1, 1, policy="round-robin")
    ll = ClusterSpec.disaggregated(PROFILE, 2, 1, 1, 1)
    got = {s.policy: [r.prefill_worker for r in simulate(s, jobs_of(*turns), [0.0] * 4).requests]
           for s in (rr, ll)}  # fmt: skip
    # Least loaded: tokens to prefill; the 3,000-token prompt keeps P0 busier than the rest.
    assert got == {"round-robin": [0, 1, 0, 1], "least-loaded": [0, 1, 1, 1]}


def test_deterministic_and_pages_accounted_under_pressure() -> None:
    rng = random.Random(3)
    turns = [SimTurn(rng.randint(20, 300), rng.randint(1, 60)) for _ in range(120)]
    times = sorted(rng.uniform(0, 2) for _ in turns)
    profile = small_kv(60)
    limits = Limits(chunk_size=512, max_running=8)
    for spec in (ClusterSpec.disaggregated(profile, 2, 1, 1, 1, limits),
                 ClusterSpec.colocated(profile, 2, 1, limits)):  # fmt: skip
        a = ClusterSim(spec, check=True).run(jobs_of(*turns), times)
        b = simulate(spec, jobs_of(*turns), times)
        assert [r.token_times for r in a.requests] == [r.token_times for r in b.requests]
        assert all(r.ok and len(r.token_times) == r.output_tokens for r in a.requests)
        assert sum(w.preemptions for w in a.workers) > 0  # the pressure was real
        assert all(w.used == 0 and not w.running for w in a.workers)
