"""Scheduler: token budget, chunked prefill, FCFS admission, preemption, prefilled admission."""

from __future__ import annotations

from services.block_manager import BlockManager
from services.sampling_params import SamplingParams
from services.scheduler import SampledToken, Scheduler, SchedulerConfig
from services.sequence import FinishReason, Sequence, SequenceStatus


def make(num_blocks=8, block_size=4, max_num_seqs=4, max_tokens=16, caching=False):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens, 1024), bm, eos_token_ids=(2,)), bm


def seq(request_id, n, arrival, max_tokens=4):
    return Sequence(request_id, list(range(10, 10 + n)), n, SamplingParams(max_tokens=max_tokens), 0, arrival)


def step(sched, token=7):
    batch = sched.schedule()
    sampled = [SampledToken(token) if batch.samples(i) else None for i in range(len(batch.seqs))]
    sched.update(batch, sampled)
    return batch


def test_chunked_prefill_under_token_budget():
    sched, bm = make(max_tokens=8)
    a = seq("a", 20, 0)
    sched.add(a)
    batch = step(sched)
    assert [s.request_id for s in batch.seqs] == ["a"] and batch.num_new_tokens == [8]
    assert a.block_table == [0, 1] and a.num_computed_tokens == 8 and a.num_output_tokens == 0
    batch = step(sched)
    assert batch.num_new_tokens == [8] and a.block_table == [0, 1, 2, 3]
    batch = step(sched)
    assert batch.num_new_tokens == [4] and a.num_output_tokens == 1  # the prompt ends: one token sampled
    assert a.block_table == [0, 1, 2, 3, 4]
    batch = step(sched)  # feeds token 21: a sixth block
    assert batch.num_new_tokens == [1] and a.block_table == [0, 1, 2, 3, 4, 5]


def test_running_first_then_fcfs_admission_with_budget():
    sched, bm = make(max_tokens=6, num_blocks=16)
    a, b, c = seq("a", 3, 0), seq("b", 4, 1), seq("c", 2, 2)
    for s in (a, b, c):
        sched.add(s)
    batch = step(sched)
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [3, 3]
    batch = step(sched)  # a decodes (1), b finishes its prompt (1), c prefills (2)
    assert [s.request_id for s in batch.seqs] == ["a", "b", "c"] and batch.num_new_tokens == [1, 1, 2]


def test_preemption_frees_latest_and_recomputes_it():
    sched, bm = make(num_blocks=3, block_size=4, max_tokens=16)
    a, b = seq("a", 4, 0, max_tokens=6), seq("b", 4, 1, max_tokens=6)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 4 tokens each -> 1 block each, then one token each
    assert a.block_table == [0] and b.block_table == [1]
    batch = step(sched)  # both need a 2nd block; only one is free: b is preempted
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and a.block_table == [0, 2]
    assert b.num_output_tokens == 1  # its sampled token is kept and recomputed, not re-sampled


def test_eos_stop_token_and_length_finish_and_free():
    sched, bm = make()
    a = seq("a", 3, 0, max_tokens=3)
    sched.add(a)
    step(sched, token=2)
    assert a.finish_reason is FinishReason.STOP and bm.num_free_blocks == 8
    b = Sequence("b", [5, 6], 2, SamplingParams(max_tokens=2, ignore_eos=True), 0, 1)
    sched.add(b)
    step(sched, token=2)
    assert b.finish_reason is None
    step(sched, token=2)
    assert b.finish_reason is FinishReason.LENGTH and b.output_token_ids == [2, 2]


def test_prefilled_sequence_joins_running_batch_and_abort_frees():
    sched, bm = make()
    s = Sequence("p", [10, 11, 12, 13, 14, 40], 5, SamplingParams(max_tokens=4), 0, 0)
    s.kv_payload = object()  # stands for KV that arrived from a prefill worker
    sched.add(s)
    batch = sched.schedule()
    assert batch.kv_imports == [s] and batch.num_new_tokens == [1]
    assert s.num_computed_tokens == 5 and s.block_table == [0, 1]
    sched.update(batch, [SampledToken(41)])
    assert s.output_token_ids == [40, 41] and s.kv_payload is None
    assert sched.abort("p").finish_reason is FinishReason.ABORT
    assert bm.num_free_blocks == 8 and not sched.has_work
    assert sched.abort("missing") is None


def test_queue_time_is_recorded_once_per_prompt_computed_here():
    now = [100.0]  # a fake clock: the queue times are exact, however fast the host
    bm = BlockManager(8, 4, False)
    sched = Scheduler(SchedulerConfig(1, 16, 1024), bm, eos_token_ids=(2,), clock=lambda: now[0])
    a, b = seq("a", 4, 0), seq("b", 4, 1)
    a.arrival_time, b.arrival_time = 98.0, 99.5  # arrived two seconds and half a second ago
    sched.add(a)
    sched.add(b)
    step(sched)  # a runs; b waits for the one slot
    assert sched.queue_times == [2.0]
    now[0] = 103.0
    while sched.running:
        step(sched)
    step(sched)  # now b, admitted at 103.0
    assert sched.queue_times == [2.0, 3.5]
    prefilled = seq("p", 4, 2)
    prefilled.arrival_time = 90.0
    prefilled.kv_payload = object()  # KV computed elsewhere: its queue time is the prefill worker's
    sched.add(prefilled)
    step(sched)
    assert sched.queue_times == [2.0, 3.5]
