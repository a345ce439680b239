"""The scheduler over integers: budgets, chunking, admission, preemption, page accounting."""

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import GenerationOptions
from pd.worker.engine.request import SeqStatus, Sequence
from pd.worker.engine.scheduler import Scheduler

PAGE = 4


def make(num_pages=64, chunk=8, max_running=8) -> Scheduler:
    return Scheduler(KVCacheManager(num_pages, PAGE, prefix_cache=False), chunk, max_running)


def seq(name: str, prompt_len: int, max_tokens: int = 16) -> Sequence:
    return Sequence(
        name, list(range(prompt_len)), GenerationOptions(max_tokens=max_tokens), max_tokens
    )


def run_step(s: Scheduler, sample_token: int = 7):
    """Schedule one step and pretend the model ran: advance and append sampled tokens."""
    batch = s.schedule()
    s.advance(batch)
    for q, sampled in zip(batch.seqs, batch.sample):
        if sampled:
            q.output_ids.append(sample_token)
    s.check_integrity()
    return batch


def test_prefill_is_chunked_under_the_token_budget():
    s = make(chunk=8)
    a = seq("a", 20)
    s.add(a)
    steps = [run_step(s) for _ in range(3)]
    assert [b.num_new for b in steps] == [[8], [8], [4]]
    assert [b.sample for b in steps] == [[False], [False], [True]]
    assert a.num_computed == 20 and a.output_ids == [7]
    assert len(a.page_ids) == 5  # 20 tokens / 4 per page


def test_budget_counts_decode_and_prefill_together():
    s = make(chunk=8)
    a, b = seq("a", 3), seq("b", 30)
    s.add(a)
    run_step(s)  # a prefilled, first token sampled
    s.add(b)
    batch = run_step(s)
    assert batch.seqs == [a, b]
    assert batch.num_new == [1, 7]  # a decodes one token, b gets the rest of the budget
    assert s.queued_prefill_tokens == 30 - 7


def test_decode_runs_every_running_request_each_step():
    s = make(chunk=64)
    seqs = [seq(str(i), 5) for i in range(4)]
    for q in seqs:
        s.add(q)
    run_step(s)
    batch = run_step(s)
    assert batch.seqs == seqs and batch.num_new == [1] * 4 and all(batch.sample)


def test_max_running_limits_admission():
    s = make(chunk=64, max_running=2)
    for i in range(3):
        s.add(seq(str(i), 4))
    batch = run_step(s)
    assert len(batch) == 2 and len(s.waiting) == 1


def test_admission_stops_when_pages_run_out_and_never_preempts():
    s = make(num_pages=3, chunk=64)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    batch = run_step(s)
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING and not batch.preempted


def test_preemption_by_recompute_frees_pages_and_requeues_first():
    s = make(num_pages=4, chunk=64)
    a, b = seq("a", 8), seq("b", 8)  # 2 full pages each after prefill
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled, a first token sampled for each
    assert s.cache.num_free == 0
    batch = run_step(s)  # both need a third page for token 9: b (newest) is preempted
    assert batch.preempted == [b] and batch.seqs == [a]
    assert b.status is SeqStatus.WAITING and b.page_ids == [] and b.num_computed == 0
    assert s.waiting[0] is b and b.num_preemptions == 1
    assert b.output_ids == [7]  # kept: recompute covers prompt + output
    s.finish(a, "stop")
    batch = run_step(s)
    assert batch.seqs == [b] and batch.num_cached == [0] and batch.num_new == [9]
    assert batch.sample == [True]
    s.finish(b, "stop")
    assert s.cache.num_free == 4
    s.check_integrity()


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = make(num_pages=2, chunk=64)
    a = seq("a", 8)
    s.add(a)
    run_step(s)
    batch = run_step(s)  # a needs a third page, and a is the only (newest) request
    assert batch.preempted == [a] and batch.seqs == []
    assert s.cache.num_free == 2


def test_finish_and_abort_free_pages_exactly_once():
    s = make()
    a, b = seq("a", 10), seq("b", 10)
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(a, "abort")
    s.finish(a, "abort")  # idempotent
    s.finish(b, "stop")
    assert s.cache.num_free == s.cache.num_total
    assert a.finish_reason == "abort" and b.finish_reason == "stop"
    s.check_integrity()


def test_abort_of_a_waiting_request():
    s = make(max_running=1)
    a, b = seq("a", 4), seq("b", 4)
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(b, "abort")
    assert not s.waiting and b.is_finished
    s.check_integrity()


def test_token_slice_spans_prompt_and_output():
    q = seq("a", 3)
    q.output_ids = [10, 11]
    assert q.token_slice(0, 5) == [0, 1, 2, 10, 11]
    assert q.token_slice(2, 4) == [2, 10]
    assert q.token_slice(3, 5) == [10, 11]


def test_prefill_pins_pages_until_released():
    s = make(chunk=64)
    a = seq("a", 10)
    s.add(a)
    run_step(s)
    pages = s.lend(a, "t1")
    assert a.is_finished and a.finish_reason == "kv_lent" and not s.running
    assert len(pages) == 3 and s.cache.num_used == 3
    s.check_integrity()
    s.give_back("t1")
    s.give_back("t1")  # done, abort and lease expiry may race: freed once
    assert s.cache.num_used == 0
    s.check_integrity()


def test_decode_reserves_pages_then_runs_the_pulled_request():
    s = make(num_pages=8)
    b = seq("b", 10)
    b.output_ids = [7]
    b.status = SeqStatus.WAITING_FOR_KV
    pages = s.lend_free("t2", 3)
    assert pages == [0, 1, 2]
    s.check_integrity()
    b.num_computed = 10
    s.admit_arrived(b, "t2")
    batch = run_step(s)
    assert batch.seqs == [b] and batch.num_cached == [10] and batch.num_new == [1]
    s.finish(b, "stop")
    assert s.cache.num_used == 0


def test_decode_reservation_leaves_room_for_running_growth_and_max_running():
    s = make(num_pages=6, max_running=2)
    a = seq("a", 8)
    s.add(a)
    run_step(s)  # a holds 2 pages, 4 free
    assert s.lend_free("x", 4) is None  # would leave no page for a to grow
    assert s.lend_free("x", 3) == [2, 3, 4]
    assert s.lend_free("y", 1) is None  # max_running: a + one transfer
    s.give_back("x")
    s.finish(a, "stop")
    s.check_integrity()


def test_a_pull_is_not_starved_by_new_local_requests_only_by_preempted_ones():
    # D has streamed P's first token by the time it reserves: a new local request waiting for
    # admission must not hold the pull back (a page-wait timeout mid-stream cannot be retried).
    s = make(num_pages=1000, max_running=8)
    s.add(seq("new", 8))
    assert s.lend_free("pull", 3) is not None
    s.give_back("pull")
    victim = seq("preempted", 8)
    victim.num_preemptions = 1
    s.waiting.appendleft(victim)
    assert s.lend_free("pull", 3) is None  # a preempted request gets its pages back first
    s.check_integrity()


def forked(s: Scheduler, name: str, prompt_len: int, n: int) -> Sequence:
    """A request with n choices: a parent and n - 1 children to fork after its first token."""
    parent = seq(name, prompt_len)
    children = [seq(f"{name}.{i}", prompt_len) for i in range(1, n)]
    for c in children:
        c.status = SeqStatus.FORKING
    s.add(parent)
    s.add_children(parent, children)
    return parent


def test_each_choice_takes_a_running_slot_from_admission_on():
    """n counts against max_running: a request with 4 choices takes 4 slots when it is admitted
    (its children fork in later), so a third request waits though only two sequences run."""
    s = make(num_pages=200, chunk=64, max_running=8)
    a, b = forked(s, "a", 40, 4), forked(s, "b", 40, 4)
    c = seq("c", 6)
    s.add(c)
    batch = run_step(s)  # a prefilled and forked; b half prefilled, its children to come
    assert batch.seqs == [a, b] and list(s.waiting) == [c]
    assert len(s.running) == 5 and s.running_choices == 8
    run_step(s)  # b's children forked: 8 sequences run, c still waits
    assert len(s.running) == 8 and list(s.waiting) == [c]
    s.finish(a, "stop")
    run_step(s)
    assert c in s.running
    for q in list(s.running):
        s.finish(q, "stop")
    assert s.cache.num_used == 0
    s.check_integrity()


def test_pull_slots_are_kept_from_local_requests():
    """Decode: with 2 of 8 slots kept for pulls, local choices stop at 6, and a pull of 2
    choices is still reserved."""
    s = Scheduler(KVCacheManager(200, PAGE, prefix_cache=False), 64, 8, arrival_slots=2)
    local = forked(s, "local", 6, 4)
    more = forked(s, "more", 6, 4)  # 4 + 4 > 6: waits
    run_step(s)
    assert list(s.waiting) == [more] and s.running_choices == 4
    assert s.lend_free("pull", 2, choices=2) is not None and s.running_choices == 6
    assert s.lend_free("pull2", 2, choices=3) is None  # 6 + 3 > 8
    s.give_back("pull")
    assert s.running_choices == 4
    s.finish(local, "stop")
    s.finish(more, "stop")
    s.check_integrity()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prioritized(clock: FakeClock, chunk=64, max_running=1, aging_s=5.0) -> Scheduler:
    return Scheduler(
        KVCacheManager(64, PAGE, prefix_cache=False), chunk, max_running, aging_s=aging_s,
        clock=clock,
    )  # fmt: skip


def arriving(clock: FakeClock, name: str, priority: int, prompt_len: int = 5) -> Sequence:
    q = seq(name, prompt_len)
    q.priority, q.arrival_time = priority, clock.now
    return q


def test_a_later_higher_priority_request_is_taken_before_earlier_lower_ones():
    clock = FakeClock()
    s = prioritized(clock)
    running = arriving(clock, "running", 0)
    s.add(running)
    run_step(s)
    for name, priority in (("batch-1", 1), ("batch-2", 1), ("default", 0), ("interactive", -1)):
        clock.now += 0.1
        s.add(arriving(clock, name, priority))
    order = []
    s.finish(running, "stop")
    while s.has_work:
        clock.now += 0.1
        batch = run_step(s)
        (q,) = batch.seqs
        order.append(q.request_id)
        s.finish(q, "stop")  # one slot: the next waiting request is admitted next step
    assert order == ["interactive", "default", "batch-1", "batch-2"]


def test_equal_priorities_keep_arrival_order_and_nothing_waits_forever():
    clock = FakeClock()
    s = prioritized(clock, aging_s=5.0)
    running = arriving(clock, "running", 0)
    s.add(running)
    run_step(s)
    old_batch = arriving(clock, "old-batch", 1)  # waits 11 s: 1 - 11/5 < -1 + 0/5
    s.add(old_batch)
    clock.now += 11.0
    s.add(arriving(clock, "new-interactive", -1))
    s.finish(running, "stop")
    assert run_step(s).seqs == [old_batch]  # aged past the newcomer
    # all the same priority: arrival order, however they differ from 0
    s2 = prioritized(clock)
    firsts = [arriving(clock, f"b{i}", 3) for i in range(3)]
    for q in firsts:
        s2.add(q)
    assert [q.request_id for q in s2.waiting] == ["b0", "b1", "b2"]
    assert run_step(s2).seqs == [firsts[0]]


def test_prompts_prefilled_in_chunks_get_the_budget_by_priority():
    clock = FakeClock()
    s = prioritized(clock, chunk=8, max_running=4)
    low, high = arriving(clock, "low", 1, 40), arriving(clock, "high", -1, 40)
    s.add(low)
    run_step(s)  # low is admitted first (alone), prefilling
    s.add(high)
    batch = run_step(s)  # high is admitted before low's next chunk, and takes the budget
    assert batch.seqs == [high] and batch.num_new == [8]
    batch = run_step(s)  # both prefilling now: high first, low none until high is done
    assert batch.seqs == [high] and batch.num_new == [8]
    while high.num_remaining > 1:
        run_step(s)
    assert low.num_computed == 8  # its first chunk only, all along
    # an equal-priority pair shares as before: the older first


def test_the_request_preempted_for_pages_is_the_lowest_priority():
    clock = FakeClock()
    s = Scheduler(KVCacheManager(6, PAGE, prefix_cache=False), 64, 4, clock=clock)
    low, high = arriving(clock, "low", 2, 8), arriving(clock, "high", -1, 8)
    s.add(low)
    run_step(s)
    clock.now += 0.1
    s.add(high)
    run_step(s)  # both running, 2 pages each of 6; decode grows them
    grow = arriving(clock, "mid", 0, 4)
    s.add(grow)
    preempted = []
    for _ in range(12):
        preempted += run_step(s).preempted
        if preempted:
            break
    assert preempted and preempted[0] is low
