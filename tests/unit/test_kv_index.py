"""The KV index (architecture.md §2): stored / removed / cleared semantics as kv_index.py documents.

Ends with a property test: after every step of a random event history, the index agrees
with a brute-force recount that replays the whole history from nothing.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from scheduler.kv_index import KVIndex, WorkerKV

BS = 16


def stored(hashes, session=None, parent=None, tokens=None, block_size=BS, continuation=None):
    """A BlockStored of full blocks unless ``tokens`` (the total) says otherwise."""
    n_tokens = len(hashes) * block_size if tokens is None else tokens
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=list(range(n_tokens)), block_size=block_size, lora_id=None,
                       medium="GPU", lora_name=None, session_id=session,
                       continuation_id=continuation)


def removed(hashes, continuation=None, num_tokens=None):
    """A BlockRemoved; ``continuation``/``num_tokens`` are the engine plugin's attribution."""
    return BlockRemoved(block_hashes=list(hashes), medium="GPU", continuation_id=continuation,
                        num_tokens=num_tokens)


def kv_with(*events) -> WorkerKV:
    kv = WorkerKV()
    for ev in events:
        kv.apply(ev)
    return kv


# -- admission -----------------------------------------------------------------------------


def test_stored_admits_blocks_with_their_tokens_and_admitter():
    kv = kv_with(stored([1, 2, 3], session="a", tokens=40, continuation="c-a"))
    assert set(kv.blocks) == {1, 2, 3}
    assert [kv.blocks[h].tokens for h in (1, 2, 3)] == [16, 16, 8]
    assert [kv.blocks[h].prefix_tokens for h in (1, 2, 3)] == [16, 32, 40]
    assert [kv.blocks[h].parent for h in (1, 2, 3)] == [None, 1, 2]
    assert all(kv.blocks[h].admitter == "a" for h in (1, 2, 3))
    assert kv.session_tokens == {"a": 40}
    assert kv.resident_tokens == 40
    assert kv.events_seen == 1


def test_stored_without_token_ids_counts_block_size_per_block():
    ev = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=32,
                     lora_id=None, medium=None, lora_name=None, session_id="a")
    kv = kv_with(ev)
    assert kv.session_tokens == {"a": 64}


def test_stored_continues_the_prefix_of_a_resident_parent():
    kv = kv_with(stored([1, 2], session="a"), stored([3], session="a", parent=2, tokens=5))
    assert kv.blocks[3].prefix_tokens == 37
    assert kv.blocks[3].parent == 2


def test_stored_with_a_parent_the_index_never_saw_starts_its_prefix_at_zero():
    kv = kv_with(stored([7], session="a", parent=999))
    assert kv.blocks[7].prefix_tokens == 16


def test_stored_without_session_is_resident_but_nobodys():
    kv = kv_with(stored([1, 2]))
    assert kv.resident_tokens == 32
    assert kv.session_tokens == {}
    assert kv.blocks[1].admitter is None


def test_restore_of_a_resident_hash_changes_nothing_but_the_touchers():
    kv = kv_with(stored([1, 2], session="a", continuation="c1"))
    # a prefix-cache hit reported as a store from block 0, another label, other token count
    kv.apply(stored([1, 2], session="a", tokens=20, continuation="c2"))
    assert kv.session_tokens == {"a": 32}
    assert kv.blocks[2].tokens == 16
    assert kv.blocks[1].admitter == "a"
    assert kv.blocks[1].continuation == "c1"
    assert "c2" not in kv.continuation_blocks
    assert kv.resident_tokens == 32


def test_a_duplicate_copy_is_not_counted_so_one_removal_drops_the_hash():
    # documented trade-off: under-report after evicting one of two copies, never over-report
    kv = kv_with(stored([1], session="a"), stored([1], session="b"), removed([1]))
    assert kv.blocks == {}
    assert kv.session_tokens == {}
    assert kv.unknown_removals == 0
    kv.apply(removed([1]))
    assert kv.unknown_removals == 1


def test_touch_by_a_second_session_counts_once_per_session():
    kv = kv_with(stored([1, 2], session="a"))
    kv.apply(stored([1, 2], session="b"))
    kv.apply(stored([1, 2], session="b"))
    kv.apply(stored([1], session="a"))
    assert kv.session_tokens == {"a": 32, "b": 32}
    assert list(kv.blocks[1].sessions) == ["a", "b"]
    assert kv.blocks[1].admitter == "a"
    assert kv.resident_tokens == 32  # residency is per block, not per session


def test_same_hash_twice_in_one_event_counts_once():
    kv = kv_with(stored([5, 5], session="a"))
    assert kv.session_tokens == {"a": 16}
    assert list(kv.blocks) == [5]


# -- removal -------------------------------------------------------------------------------


def test_removed_drops_the_block_from_every_session_that_touched_it():
    kv = kv_with(stored([1, 2, 3], session="a"), stored([1, 2], session="b"))
    kv.apply(removed([2]))
    assert set(kv.blocks) == {1, 3}
    assert kv.session_tokens == {"a": 32, "b": 16}
    kv.apply(removed([1]))
    assert kv.session_tokens == {"a": 16}
    assert "b" not in kv.shared_blocks


def test_removed_of_unknown_hashes_is_counted_not_fatal():
    kv = kv_with(stored([1], session="a"))
    kv.apply(removed([42, 1, 43]))
    assert kv.unknown_removals == 2
    assert kv.blocks == {}
    assert kv.events_seen == 2


def test_removed_then_stored_again_is_a_fresh_admission():
    kv = kv_with(stored([1], session="a", continuation="c1"), removed([1]),
                 stored([1], session="b", continuation="c2", tokens=4))
    assert kv.blocks[1].admitter == "b"
    assert kv.blocks[1].tokens == 4
    assert kv.session_tokens == {"b": 4}
    assert kv.continuation_tokens(["c1"]) == 0
    assert kv.continuation_tokens(["c2"]) == 4


# -- clearing ------------------------------------------------------------------------------


def test_all_blocks_cleared_empties_the_worker_but_keeps_counted_sessions():
    kv = kv_with(stored([1, 2], session="a", continuation="c"), stored([1, 2], session="b"))
    kv.set_counted("a", True)
    kv.set_counted("b", True)
    assert kv.shared_tokens == 32
    kv.apply(AllBlocksCleared())
    assert kv.blocks == {} and kv.session_tokens == {} and kv.shared_tokens == 0
    assert kv.continuation_tokens(["c"]) == 0
    assert set(kv.counted) == {"a", "b"}
    assert kv.events_seen == 3
    # counting still applies to what comes next
    kv.apply(stored([9], session="a"))
    kv.apply(stored([9], session="b"))
    assert kv.shared_tokens == 16


def test_reset_worker_forgets_its_blocks_and_events_but_keeps_counting():
    index = KVIndex()
    index.apply_events("w0", [stored([1, 2], session="a"), stored([1, 2], session="b")])
    index.apply_events("w1", [stored([1], session="a")])
    index.worker("w0").set_counted("a", True)
    index.worker("w0").set_counted("b", True)
    assert index.has_events("w0")
    index.reset_worker("w0")
    assert not index.has_events("w0")
    assert index.session_tokens("w0", "a") == 0
    assert index.sessions_on("w0") == []
    assert index.worker("w0").shared_tokens == 0
    assert set(index.worker("w0").counted) == {"a", "b"}
    # other workers are untouched
    assert index.session_tokens("w1", "a") == 16
    index.apply_events("w0", [stored([3], session="a"), stored([3], session="b")])
    assert index.has_events("w0")
    assert index.worker("w0").shared_tokens == 16


# -- queries -------------------------------------------------------------------------------


def test_prefix_tokens_is_the_longest_resident_prefix():
    kv = kv_with(stored([1, 2, 3], session="a", tokens=40))
    assert kv.prefix_tokens([1, 2, 3]) == 40
    assert kv.prefix_tokens([1, 2, 3, 4]) == 40
    assert kv.prefix_tokens([1, 2]) == 32
    assert kv.prefix_tokens([2, 3]) == 24  # hashes chain their parents, so this is a prefix
    assert kv.prefix_tokens([9, 1, 2]) == 0
    assert kv.prefix_tokens([]) == 0
    kv.apply(removed([2]))
    assert kv.prefix_tokens([1, 2, 3]) == 16


def test_continuation_tokens_is_the_longest_prefix_admitted_under_any_given_id():
    kv = kv_with(
        stored([1, 2], session="a", continuation="c-sys"),
        stored([3, 4], session="a", parent=2, continuation="c-turn1"),
        stored([5], session="b", parent=2, tokens=3, continuation="c-fork"),
    )
    assert kv.continuation_tokens(["c-sys"]) == 32
    assert kv.continuation_tokens(["c-turn1"]) == 64
    assert kv.continuation_tokens(["c-fork"]) == 35
    assert kv.continuation_tokens(["c-turn1", "c-sys", "c-fork"]) == 64
    assert kv.continuation_tokens(["unknown"]) == 0
    assert kv.continuation_tokens([]) == 0
    kv.apply(removed([4]))
    assert kv.continuation_tokens(["c-turn1"]) == 48
    kv.apply(removed([3]))
    assert kv.continuation_tokens(["c-turn1"]) == 0
    assert "c-turn1" not in kv.continuation_blocks


# -- shared tokens ---------------------------------------------------------------------------


def test_shared_tokens_count_blocks_of_counted_sessions_once():
    kv = kv_with(stored([1, 2, 3], session="a"), stored([1, 2], session="b"),
                 stored([1], session="c"))
    assert kv.shared_tokens == 0  # nobody counted yet
    kv.set_counted("a", True)
    assert kv.shared_tokens == 0
    kv.set_counted("b", True)
    assert kv.shared_tokens == 32  # blocks 1 and 2 held by a and b
    kv.set_counted("c", True)
    assert kv.shared_tokens == 48  # block 1 now held by three: counted twice extra
    kv.set_counted("c", True)  # idempotent
    assert kv.shared_tokens == 48
    kv.set_counted("a", False)
    assert kv.shared_tokens == 16  # block 1 held by counted b and c; block 2 by b alone
    kv.set_counted("a", False)  # idempotent
    assert kv.shared_tokens == 16
    kv.set_counted("b", False)
    assert kv.shared_tokens == 0


def test_shared_tokens_follow_touches_and_removals_of_counted_sessions():
    kv = WorkerKV()
    kv.set_counted("a", True)
    kv.set_counted("b", True)
    kv.apply(stored([1, 2], session="a"))
    assert kv.shared_tokens == 0
    kv.apply(stored([1], session="b"))
    assert kv.shared_tokens == 16
    kv.apply(stored([1, 2], session="uncounted"))
    assert kv.shared_tokens == 16
    kv.apply(removed([1]))
    assert kv.shared_tokens == 0
    kv.set_counted("ghost", True)  # a session with no blocks
    assert kv.shared_tokens == 0


def test_removing_a_block_three_counted_sessions_share_drops_both_extra_counts():
    kv = WorkerKV()
    for s in ("a", "b", "c"):
        kv.set_counted(s, True)
        kv.apply(stored([1, 2], session=s))
    assert kv.shared_tokens == 2 * 2 * 16
    kv.apply(removed([2]))
    assert kv.shared_tokens == 2 * 16
    kv.apply(removed([1]))
    assert kv.shared_tokens == 0


# -- contiguity: holes ---------------------------------------------------------------------


def test_continuation_prefix_stops_at_evicted_middle_block():
    kv = kv_with(stored([1, 2, 3, 4], session="a", continuation="c"))
    assert kv.continuation_tokens(["c"]) == 64
    kv.apply(removed([2]))
    # blocks 3 and 4 are resident, but the prefix from block 0 ends at block 1
    assert set(kv.blocks) == {1, 3, 4}
    assert kv.continuation_tokens(["c"]) == 16
    assert set(kv.holes) == {2}


def test_evicted_ancestor_under_another_label_cuts_a_continuation_off_entirely():
    kv = kv_with(stored([1, 2], session="a", continuation="c-sys"),
                 stored([3, 4], session="a", parent=2, continuation="c-turn1"))
    kv.apply(removed([1]))
    assert kv.continuation_tokens(["c-turn1"]) == 0
    assert kv.continuation_tokens(["c-turn1", "c-sys"]) == 0


def test_restoring_the_evicted_middle_block_makes_the_prefix_whole_again():
    kv = kv_with(stored([1, 2, 3, 4], session="a", continuation="c"), removed([2]))
    kv.apply(stored([1, 2], session="b", continuation="c-other"))
    assert not kv.holes
    assert kv.continuation_tokens(["c"]) == 64


def test_hole_is_forgotten_when_its_last_child_goes():
    kv = kv_with(stored([1, 2, 3], session="a", continuation="c"), removed([2]))
    assert set(kv.holes) == {2}
    kv.apply(removed([3]))
    assert not kv.holes
    # a later child of that hash starts a chain of its own, as any unknown parent does
    kv.apply(stored([5], session="a", parent=2, continuation="c2"))
    assert kv.continuation_tokens(["c2"]) == 16


def test_unknown_parent_removed_under_a_resident_child_is_a_hole():
    # block 7's parent 99 predates the subscription; the engine evicts it (unattributed)
    kv = kv_with(stored([7, 8], session="a", parent=99, continuation="c"))
    assert kv.continuation_tokens(["c"]) == 32
    kv.apply(removed([99]))
    assert kv.unknown_removals == 1
    assert kv.continuation_tokens(["c"]) == 0


def test_cut_answers_follow_later_holes_and_fills():
    # the cached contiguity must not outlive the hole it was computed under
    kv = kv_with(stored([1, 2, 3], session="a", continuation="c"),
                 stored([4], session="a", parent=3, continuation="d"), removed([3]))
    assert kv.continuation_tokens(["d"]) == 0
    assert kv.continuation_tokens(["c"]) == 32
    kv.apply(stored([3], session="a", parent=2, continuation="c"))
    assert kv.continuation_tokens(["d"]) == 64
    kv.apply(removed([1]))
    assert kv.continuation_tokens(["d"]) == 0
    assert kv.continuation_tokens(["c"]) == 0


# -- attribution: caps ---------------------------------------------------------------------


def test_attributed_removal_of_unknown_hash_caps_continuation_prefix():
    # c's first blocks predate the subscription: the index holds 3..5 (parent 2 never seen)
    kv = kv_with(stored([3, 4, 5], session="a", parent=2, continuation="c"))
    assert kv.continuation_tokens(["c"]) == 48
    kv.apply(removed([77], continuation="c", num_tokens=32))
    assert kv.unknown_removals == 1
    assert kv.attributed_removals == 1
    assert kv.caps == {"c": [32]}
    assert kv.continuation_tokens(["c"]) == 16
    assert kv.continuation_tokens(["c", "other"]) < 32
    kv.apply(removed([78], continuation="c", num_tokens=16))
    assert kv.caps == {"c": [16, 32]}
    assert kv.continuation_tokens(["c"]) == 0


def test_cap_leaves_other_continuations_alone():
    kv = kv_with(stored([1, 2], session="a", continuation="c"),
                 stored([3, 4], session="b", continuation="d"))
    kv.apply(removed([77], continuation="c", num_tokens=16))
    assert kv.continuation_tokens(["c"]) == 0
    assert kv.continuation_tokens(["d"]) == 32
    assert kv.continuation_tokens(["d", "c"]) == 32


def test_restore_after_attributed_removal_lifts_cap():
    kv = kv_with(stored([3, 4], session="a", parent=2, continuation="c"),
                 removed([77], continuation="c", num_tokens=32))
    assert kv.continuation_tokens(["c"]) == 16 and kv.caps == {"c": [32]}
    kv.apply(stored([10], session="a", continuation="c"))  # reaches 16: not far enough
    assert kv.caps == {"c": [32]}
    # the engine stores c's blocks through position 32 again: everything up to it is resident
    kv.apply(stored([11], session="a", parent=10, continuation="c"))
    assert kv.caps == {}
    assert kv.continuation_tokens(["c"]) == 32


def test_restore_below_a_deeper_cap_lifts_only_the_caps_it_reaches():
    # chunked prefill: the first chunk re-admits up to 32 tokens, the second would reach 64
    kv = kv_with(stored([5, 6, 7, 8], session="a", parent=4, continuation="c"),
                 removed([70], continuation="c", num_tokens=48),
                 removed([71], continuation="c", num_tokens=16))
    assert kv.caps == {"c": [16, 48]}
    kv.apply(stored([20, 21], session="a", continuation="c"))
    assert kv.caps == {"c": [48]}
    assert kv.continuation_tokens(["c"]) == 32
    kv.apply(stored([22, 23], session="a", parent=21, continuation="c"))
    assert kv.caps == {}
    assert kv.continuation_tokens(["c"]) == 64


def test_store_under_another_label_does_not_lift_a_cap():
    kv = kv_with(stored([3, 4], session="a", parent=2, continuation="c"),
                 removed([77], continuation="c", num_tokens=32))
    kv.apply(stored([10, 11, 12], session="b", continuation="c-child"))
    assert kv.caps == {"c": [32]}
    assert kv.continuation_tokens(["c"]) == 16


def test_cap_is_dropped_with_the_continuations_last_block():
    kv = kv_with(stored([3, 4], session="a", parent=2, continuation="c"),
                 removed([77], continuation="c", num_tokens=16))
    kv.apply(removed([3]))
    assert kv.caps == {"c": [16]}
    kv.apply(removed([4]))
    assert kv.caps == {}
    # attribution to a continuation with nothing resident leaves no cap behind
    kv.apply(removed([78], continuation="c", num_tokens=16))
    assert kv.caps == {} and kv.attributed_removals == 2


def test_attributed_removal_of_a_known_hash_needs_no_cap():
    kv = kv_with(stored([1, 2], session="a", continuation="c"))
    kv.apply(removed([2], continuation="c", num_tokens=32))
    assert kv.caps == {}
    assert kv.attributed_removals == 1 and kv.unknown_removals == 0
    assert kv.continuation_tokens(["c"]) == 16


def test_attribution_on_a_multi_hash_removal_is_counted_but_sets_no_cap():
    kv = kv_with(stored([3, 4], session="a", parent=2, continuation="c"))
    kv.apply(removed([77, 78], continuation="c", num_tokens=16))
    assert kv.attributed_removals == 2 and kv.unknown_removals == 2
    assert kv.caps == {}


def test_clear_drops_holes_and_caps_but_keeps_eviction_counters():
    kv = kv_with(stored([1, 2, 3], session="a", continuation="c"), removed([2]),
                 removed([77], continuation="c", num_tokens=16))
    assert kv.holes and kv.caps
    kv.apply(AllBlocksCleared())
    assert not kv.holes and kv.caps == {}
    assert (kv.evicted_tokens, kv.unknown_removals, kv.attributed_removals) == (16, 1, 1)


# -- eviction accounting -------------------------------------------------------------------


def test_evicted_tokens_counted_per_worker():
    index = KVIndex()
    index.apply_events("w0", [stored([1, 2, 3], session="a", tokens=40), removed([3]),
                              removed([1]), removed([99])])
    index.apply_events("w1", [stored([1], session="a"), removed([1], continuation="c",
                                                                num_tokens=16)])
    w0, w1 = index.worker("w0"), index.worker("w1")
    assert w0.evicted_tokens == 8 + 16  # the unknown hash adds no tokens
    assert w0.unknown_removals == 1 and w0.attributed_removals == 0
    assert w1.evicted_tokens == 16 and w1.attributed_removals == 1
    index.reset_worker("w0")
    assert w0.evicted_tokens == 24  # counters are monotonic across resets


def test_unknown_attributed_removal_counts_no_tokens():
    kv = kv_with(removed([5], continuation="c", num_tokens=4096))
    assert kv.evicted_tokens == 0
    assert kv.unknown_removals == 1 and kv.attributed_removals == 1


# -- the multi-worker facade ---------------------------------------------------------------


def test_apply_batch_returns_the_hashes_it_carried_and_keeps_workers_apart():
    index = KVIndex()
    batch = EventBatch(ts=1.0, events=[stored([1, 2], session="a"), removed([2, 77]),
                                       AllBlocksCleared(), stored([5], session="b")])
    assert index.apply_batch("w0", batch) == 5
    assert index.sessions_on("w0") == ["b"]
    assert index.session_tokens("w0", "b") == 16
    assert index.worker("w0").unknown_removals == 1
    assert index.session_tokens("w1", "b") == 0
    assert index.sessions_on("nowhere") == []
    assert not index.has_events("w1")
    assert index.has_events("w0")
    assert "nowhere" not in index.workers()


def test_workers_lists_every_worker_seen():
    index = KVIndex()
    index.apply_events("w1", [])
    index.worker("w2")
    assert index.workers() == ["w1", "w2"]
    assert not index.has_events("w1")


# -- property: the index equals a replay of the whole history --------------------------------

WORKERS = ["w0", "w1"]
SESSIONS = ["a", "b", "c"]
HASHES = [1, 2, 3, 4, b"\x01"]
CONTINUATIONS = ["c1", "c2"]

# One flat tuple per step (shrinks far better than a union of shapes); ``kind`` picks what the
# step does, weighted by hand: clears and resets wipe the state, so they stay rare.
step = st.tuples(
    st.integers(0, 23),  # kind
    st.sampled_from(WORKERS),
    st.lists(st.sampled_from(HASHES), min_size=1, max_size=4),
    st.sampled_from(SESSIONS + [None]),
    st.sampled_from(HASHES + [None, 99]),  # parent
    st.sampled_from([4, 16]),  # block size
    st.integers(0, 70),  # token ids sent; a removal's num_tokens
    st.sampled_from(CONTINUATIONS + [None]),  # a store's label; a removal's attribution
    st.integers(0, 3).map(bool),  # counted or not: mostly True, counting is what we test
)


def _op(raw: tuple) -> tuple:
    k, worker, hashes, session, parent, size, n_tokens, cont, flag = raw
    if k < 10:
        return ("store", worker, hashes, session, parent, size, n_tokens, cont)
    if k < 14:
        return ("count", worker, session or SESSIONS[0], flag)
    if k < 18:
        # mostly one hash per event, as vLLM sends them (and attribution needs one)
        return ("remove", worker, hashes if k == 17 else hashes[:1], cont,
                n_tokens if n_tokens % 5 else None)
    if k < 20:
        return ("clear", worker) if k == 18 else ("reset", worker)
    # the host tier (medium "CPU"): stores name a session or none (the tier's own events)
    if k < 22:
        return ("host_store", worker, hashes, session, size, n_tokens)
    return ("host_remove", worker, hashes)


ops = st.lists(step, min_size=12, max_size=30).map(lambda raws: [_op(r) for r in raws])


def _tokens_per_block(n_blocks: int, n_tokens: int, block_size: int) -> list[int]:
    if n_tokens == 0:
        return [block_size] * n_blocks
    ids = list(range(n_tokens))
    return [len(ids[i * block_size:(i + 1) * block_size]) for i in range(n_blocks)]


def _replay(history: list[tuple], worker: str, queries: list) -> dict:
    """Brute force: rebuild ``worker``'s state from the first event on."""
    blocks: dict = {}  # hash -> {"tokens", "prefix", "sessions": set, "cont", "parent"}
    counted: set = set()
    holes: set = set()
    caps: dict = {}  # continuation -> set of end positions
    unknown = attributed = evicted = 0

    def has_children(h) -> bool:
        return any(b["parent"] == h for b in blocks.values())

    def labelled(c) -> bool:
        return any(b["cont"] == c for b in blocks.values())

    for op in history:
        if op[1] != worker:
            continue
        kind = op[0]
        if kind == "store":
            _, _, hashes, session, parent, size, n_tokens, cont = op
            running = blocks[parent]["prefix"] if parent in blocks else 0
            for h, t in zip(hashes, _tokens_per_block(len(hashes), n_tokens, size)):
                running += t
                if h not in blocks:
                    blocks[h] = {"tokens": t, "prefix": running, "sessions": set(), "cont": cont,
                                 "parent": parent}
                    holes.discard(h)
                if session is not None:
                    blocks[h]["sessions"].add(session)
                parent = h
            if cont is not None:
                caps[cont] = {n for n in caps.get(cont, ()) if n > running}
        elif kind == "remove":
            _, _, hashes, cont, num_tokens = op
            if cont is not None:
                attributed += len(hashes)
            for h in hashes:
                if h in blocks:
                    evicted += blocks.pop(h)["tokens"]
                else:
                    unknown += 1
                    if (cont is not None and num_tokens is not None and len(hashes) == 1
                            and labelled(cont)):
                        caps.setdefault(cont, set()).add(num_tokens)
                if has_children(h):
                    holes.add(h)
                holes = {x for x in holes if has_children(x)}
        elif kind in ("clear", "reset"):
            blocks, holes, caps = {}, set(), {}
        elif kind == "count":
            (counted.add if op[3] else counted.discard)(op[2])
        caps = {c: ns for c, ns in caps.items() if ns and labelled(c)}

    def rooted(h) -> bool:
        seen = set()
        while h not in seen:  # a loop of resident blocks has no hole in it
            seen.add(h)
            parent = blocks[h]["parent"]
            if parent is None:
                return True
            if parent not in blocks:
                return parent not in holes
            h = parent
        return True

    per_session = {}
    for s in SESSIONS:
        mine = [b for b in blocks.values() if s in b["sessions"]]
        if mine:
            per_session[s] = sum(b["tokens"] for b in mine)
    shared = sum(b["tokens"] * max(0, len(b["sessions"] & counted) - 1) for b in blocks.values())
    prefixes = []
    for q in queries:
        total = 0
        for h in q:
            if h not in blocks:
                break
            total += blocks[h]["tokens"]
        prefixes.append(total)
    conts = {c: max((b["prefix"] for h, b in blocks.items()
                     if b["cont"] == c and rooted(h) and b["prefix"] < min(caps.get(c, [10**9]))),
                    default=0)
             for c in CONTINUATIONS}
    return {"per_session": per_session, "shared": shared, "counted": counted,
            "prefixes": prefixes, "conts": conts,
            "holes": {h: sum(1 for b in blocks.values() if b["parent"] == h) for h in holes},
            "caps": {c: sorted(ns) for c, ns in caps.items()},
            "counters": (unknown, attributed, evicted), "blocks": blocks}


def _replay_host(history: list[tuple], worker: str) -> dict:
    """Brute force for the host tier: a block belongs to the session its store names, else to
    the sessions holding the hash on the GPU right then; GPU events never touch it."""
    host: dict = {}  # hash -> (tokens, sessions)
    for i, op in enumerate(history):
        if op[1] != worker:
            continue
        if op[0] == "host_store":
            _, _, hashes, session, size, n_tokens = op
            gpu = _replay(history[:i], worker, [])["blocks"]
            for h, t in zip(hashes, _tokens_per_block(len(hashes), n_tokens, size)):
                if h not in host:
                    owners = {session} if session is not None else set(gpu.get(h, {}).get("sessions", ()))
                    host[h] = (t, owners)
        elif op[0] == "host_remove":
            for h in op[2]:
                host.pop(h, None)
        elif op[0] == "reset":
            host = {}
    return {s: sum(t for t, owners in host.values() if s in owners)
            for s in SESSIONS if any(s in owners for _, owners in host.values())}


@settings(max_examples=200, deadline=None)
@given(history=ops, queries=st.lists(st.lists(st.sampled_from(HASHES), max_size=4), max_size=3))
def test_index_matches_a_brute_force_replay_after_every_step(history, queries):
    index = KVIndex()
    for i, op in enumerate(history):
        kind, worker = op[0], op[1]
        if kind == "store":
            _, _, hashes, session, parent, size, n_tokens, cont = op
            ev = BlockStored(block_hashes=hashes, parent_block_hash=parent,
                             token_ids=list(range(n_tokens)), block_size=size, lora_id=None,
                             medium="GPU", lora_name=None, session_id=session,
                             continuation_id=cont)
            index.apply_batch(worker, EventBatch(ts=float(i), events=[ev]))
        elif kind == "remove":
            ev = removed(op[2], continuation=op[3], num_tokens=op[4])
            index.apply_batch(worker, EventBatch(ts=float(i), events=[ev]))
        elif kind == "clear":
            index.apply_batch(worker, EventBatch(ts=float(i), events=[AllBlocksCleared()]))
        elif kind == "reset":
            index.reset_worker(worker)
        elif kind == "host_store":
            _, _, hashes, session, size, n_tokens = op
            ev = BlockStored(block_hashes=hashes, parent_block_hash=None,
                             token_ids=list(range(n_tokens)), block_size=size, lora_id=None,
                             medium="CPU", lora_name=None, session_id=session)
            index.apply_batch(worker, EventBatch(ts=float(i), events=[ev]))
        elif kind == "host_remove":
            ev = BlockRemoved(block_hashes=op[2], medium="CPU")
            index.apply_batch(worker, EventBatch(ts=float(i), events=[ev]))
        else:
            index.worker(worker).set_counted(op[2], op[3])

        for w in WORKERS:
            want = _replay(history[: i + 1], w, queries)
            kv = index.worker(w)
            where = (w, history[: i + 1])
            assert kv.session_tokens == want["per_session"], where
            for s in SESSIONS:
                assert index.session_tokens(w, s) == want["per_session"].get(s, 0)
            assert sorted(index.sessions_on(w)) == sorted(want["per_session"])
            assert kv.shared_tokens == want["shared"], where
            assert kv.shared_blocks == {s: {h: None for h, b in kv.blocks.items()
                                           if s in b.sessions and len(b.sessions) > 1}
                                        for s in SESSIONS
                                        if any(s in b.sessions and len(b.sessions) > 1
                                               for b in kv.blocks.values())}, where
            assert set(kv.counted) == want["counted"]
            assert [kv.prefix_tokens(q) for q in queries] == want["prefixes"]
            assert kv.holes == want["holes"], where  # with how many children hang from each
            assert kv.caps == want["caps"], where
            for c, best in want["conts"].items():
                assert kv.continuation_tokens([c]) == best, (c, where)
            assert kv.continuation_tokens(CONTINUATIONS) == max(want["conts"].values()), where
            assert (kv.unknown_removals, kv.attributed_removals, kv.evicted_tokens) == \
                want["counters"], where
            # the host tier is its own: GPU events never change it, nor it the GPU's answers
            want_host = _replay_host(history[: i + 1], w)
            for s in SESSIONS:
                assert index.host_tokens(w, s) == want_host.get(s, 0), (s, where)


# -- media: the host tier (medium "CPU") is kept apart from the GPU ---------------------------

def _host_stored(hashes, session=None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                       block_size=16, lora_id=None, medium="CPU", lora_name=None,
                       session_id=session)


def test_a_host_store_counts_in_the_tier_not_on_the_gpu():
    index = KVIndex()
    index.apply_events("w", [stored([1, 2], session="a"), _host_stored([1, 2])])
    assert index.session_tokens("w", "a") == 32  # GPU only, unchanged by the tier's copy
    assert index.host_tokens("w", "a") == 32  # owners taken from the GPU copy


def test_a_host_removal_never_drops_a_gpu_block_nor_a_gpu_removal_a_host_one():
    index = KVIndex()
    index.apply_events("w", [stored([1, 2], session="a"), _host_stored([1, 2])])
    index.apply_events("w", [BlockRemoved(block_hashes=[2], medium="CPU")])
    assert index.session_tokens("w", "a") == 32
    assert index.host_tokens("w", "a") == 16
    index.apply_events("w", [removed([1, 2])])
    assert index.session_tokens("w", "a") == 0
    assert index.host_tokens("w", "a") == 16
    assert index.worker("w").unknown_removals == 0


def test_a_host_block_stored_after_its_gpu_copy_left_counts_for_nobody():
    index = KVIndex()
    index.apply_events("w", [_host_stored([7])])
    assert index.host(("w")).resident_tokens == 16
    assert index.host_tokens("w", "a") == 0


def test_clear_keeps_the_tier_and_reset_forgets_it():
    index = KVIndex()
    index.apply_events("w", [stored([1], session="a"), _host_stored([1])])
    index.apply_events("w", [AllBlocksCleared()])
    assert index.host_tokens("w", "a") == 16
    index.reset_worker("w")
    assert index.host_tokens("w", "a") == 0
