"""The engine's hooks for the simworker (sim/engine.py): ``abort``, capped decode runs,
per-request reuse reports and token ids on ``BlockStored`` events."""

from __future__ import annotations

from scheduler.kv_events import BlockStored
from sim.engine import Engine, EngineRequest
from sim.step_time import StepTimeModel

BS = 4
MODEL = StepTimeModel(
    name="tiny", description="hand-made terms for tests",
    base_s=0.010, prefill_token_s=1e-4, seq_s=1e-3, context_token_s=1e-5,
    kv_capacity_tokens=10_000, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
)


def req(rid: str, prompt: int, output: int, *, hashes: list[int] | None = None,
        tokens: list[int] | None = None, report: bool = False) -> EngineRequest:
    if hashes is None:
        hashes = [sum(map(ord, rid)) * 1000 + i for i in range((prompt + output) // BS)]
    return EngineRequest(rid, f"s-{rid}", hashes, prompt, output, 0.0, 0.0, token_ids=tokens,
                         report_reuse=report)


def run_to_idle(engine: Engine, now: float = 0.0) -> float:
    while engine.has_work():
        end = engine.start(now)
        assert end is not None
        engine.complete()
        now = end
    return now


def test_abort_mid_decode_run_frees_the_blocks_and_the_run_ends_without_it():
    engine = Engine("w", MODEL, num_blocks=30)
    a, b = req("a", 8, 40), req("b", 8, 60)  # the run lasts until a would finish
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.0)
    now = engine.start(0.0)
    engine.complete()  # prefill both: each holds 3 blocks (8 prompt tokens + room for the next)
    end = engine.start(now)
    assert engine._run is not None and engine.pool.num_free < 29
    held_by_a = list(a.block_ids)
    assert engine.abort("a") is a
    assert a.block_ids == [] and a not in engine.running
    assert all(engine.pool.ref_cnt[block] == 0 for block in held_by_a)
    done = engine.complete()
    assert done == [] and a.num_output == 1  # nothing sampled for it after the abort
    assert b.num_output == 40
    run_to_idle(engine, end)
    assert b.finished and not a.finished
    assert engine.pool.num_free == 29 and engine.stats.finished == 1


def test_abort_mid_prefill_step_and_abort_of_a_waiting_request():
    engine = Engine("w", MODEL, num_blocks=30)
    a = req("a", 20, 4)
    engine.add_request(a, 0.0)
    engine.start(0.0)
    assert engine.abort("a") is a
    assert engine.complete() == [] and a.num_computed == 0
    assert engine.pool.num_free == 29
    waiting = req("w", 8, 4)
    engine.add_request(waiting, 0.0)
    assert engine.abort("w") is waiting and not engine.waiting
    assert engine.abort("w") is None and engine.abort("nobody") is None


def test_aborted_request_keeps_its_cached_prefix_for_the_next_one():
    engine = Engine("w", MODEL, num_blocks=30)
    shared = [7000 + i for i in range(4)]
    a = req("a", 16, 30, hashes=shared + [1, 2, 3, 4, 5, 6, 7])
    engine.add_request(a, 0.0)
    now = engine.start(0.0)
    engine.complete()
    engine.abort("a")
    b = req("b", 17, 2, hashes=shared)
    engine.add_request(b, now)
    engine.start(now)
    assert b.cached_tokens == 16


def test_start_caps_decode_runs_by_steps_and_by_time():
    engine = Engine("w", MODEL, num_blocks=60)
    a = req("a", 8, 100)
    engine.add_request(a, 0.0)
    now = engine.start(0.0)
    engine.complete()
    engine.start(now, max_run_steps=5)
    engine.complete()
    assert a.num_output == 1 + 5
    now = engine.busy_until or now
    start = now
    end = engine.start(start, max_run_s=0.05)
    engine.complete()
    steps = a.num_output - 6
    # the fewest steps that reach 50 ms: ~11 ms each here
    assert end - start >= 0.05 and steps == MODEL.decode_steps_within(1, 8 + 6, 0.05)


def test_token_ids_travel_on_stored_events_and_reuse_reports_are_per_request():
    engine = Engine("w", MODEL, num_blocks=30)
    tokens = list(range(100, 120))  # 16 prompt + 4 output
    shared = [5000 + i for i in range(5)]
    a = req("a", 16, 4, hashes=shared, tokens=tokens)
    engine.add_request(a, 0.0)
    now = engine.start(0.0)
    [stored] = engine.pool.take_events()
    assert isinstance(stored, BlockStored) and stored.token_ids == tokens[:16]
    engine.complete()
    now = run_to_idle(engine, now)
    engine.pool.take_events()

    quiet = req("q", 17, 1, hashes=shared[:4], tokens=tokens[:17])
    engine.add_request(quiet, now)
    now = engine.start(now)
    assert engine.pool.take_events() == []  # incremental (default): hits are not reported
    engine.complete()
    run_to_idle(engine, now)

    loud = req("l", 17, 1, hashes=shared[:4], tokens=tokens[:17], report=True)
    engine.add_request(loud, now + 1)
    engine.start(now + 1)
    [report] = engine.pool.take_events()
    assert report.block_hashes == shared[:4] and report.parent_block_hash is None
    assert report.token_ids == tokens[:16] and report.session_id == "s-l"
