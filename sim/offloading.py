"""One engine's connector to its host KV tier (vLLM's native CPU offloading, the scheduler side of
its ``OffloadingConnector``; docs/design-notes.md "Host KV tier").

It owns what moves between the engine's block pool and the tier (sim/host_tier.py): the
GPU→host copies of prompt blocks a step completes (offered after the step, one copy per
request), the host→GPU loads of a waiting request whose prefix continues in the tier past its
GPU hit (the request waits outside the batch meanwhile, vLLM's WAITING_FOR_REMOTE_KVS), the
two directions of the host link (copies overlap compute), and Sluice's directives on the
tier's side (park, favour, unfavour). The engine (sim/engine.py) decides when each happens
and admits the loaded requests.
"""

from __future__ import annotations

from collections import deque

from scheduler.kv_events import BlockHash, KVEvent
from sim.block_pool import BlockPool
from sim.engine_request import EngineRequest
from sim.host_tier import HostLink, HostTier
from sim.step_time import StepTimeModel


class OffloadingConnector:
    def __init__(self, pool: BlockPool, model: StepTimeModel, *, enable_events: bool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.model = model
        chunk_bytes = model.kv_bytes_per_token * self.block_size
        self.tier = HostTier(int(model.kv_offload_gib * (1 << 30)) // chunk_bytes, self.block_size,
                             enable_events=enable_events)
        self._to_host = HostLink(model.host_link_bytes_per_s)
        self._from_host = HostLink(model.host_link_bytes_per_s)
        # (done_at, keys) of GPU→host copies in flight; one link, so they end in order
        self._stores: deque[tuple[float, list[BlockHash]]] = deque()
        # requests waiting for a host→GPU load, and those whose load is done (the engine
        # admits them)
        self.loading: list[EngineRequest] = []
        self.loaded: list[EngineRequest] = []
        # prompt tokens loaded back from the tier, and chunks it evicted to make room
        self.loaded_tokens = 0
        self.evicted_blocks = 0

    @property
    def busy(self) -> bool:
        """Whether a request is loading or loaded and not yet admitted."""
        return bool(self.loading or self.loaded)

    def first_load_done(self) -> float | None:
        """When the first load in flight ends (None: none is)."""
        if not self.loading:
            return None
        return min(r.host_load_done_at for r in self.loading)

    def take_events(self) -> list[KVEvent]:
        return self.tier.take_events()

    def progress(self, now: float) -> None:
        """Complete the copies that have ended by ``now``: stores become loadable; loaded
        blocks are cached on the GPU (vLLM caches them when the load is reported) and their
        requests become admissible."""
        tier = self.tier
        tier.expire_favours(now)
        stores = self._stores
        while stores and stores[0][0] <= now:
            tier.complete_store(stores.popleft()[1])
        if not self.loading:
            return
        still = []
        for request in self.loading:
            if request.host_load_done_at > now:
                still.append(request)
                continue
            first = request.num_cached_blocks
            last = first + request.host_loading_blocks
            tier.complete_load(request.hashes[first:last])
            tokens = request.token_ids
            self.pool.cache_full_blocks(request.block_ids, request.hashes, first, last,
                                        session_id=request.session_id,
                                        continuation_id=request.continuation_id,
                                        token_ids=None if tokens is None
                                        else tokens[first * self.block_size:last * self.block_size])
            request.num_cached_blocks = last
            request.host_loading_blocks = 0
            self.loaded.append(request)
        self.loading = still

    def start_load(self, request: EngineRequest, hit: list[int], now: float) -> bool:
        """If the waiting head's prefix continues in the tier past its GPU hit, give it blocks
        for the GPU hit and the tier's part and start loading the latter (no tokens are
        scheduled for it meanwhile). Returns whether it did: the engine then takes it out of
        its queue."""
        tier = self.tier
        bs = self.block_size
        pool = self.pool
        # as for a GPU hit, at least the last token is computed
        limit = (request.seq_len - 1) // bs
        loadable = tier.loadable_prefix(request.hashes[len(hit):limit])
        if loadable == 0:
            return False
        free_hits = pool.count_free(hit)
        if loadable + free_hits > pool.num_free:
            return False
        pool.touch(hit)
        keys = request.hashes[len(hit):len(hit) + loadable]
        tier.prepare_load(keys, request.request_id, len(hit))
        request.block_ids = hit + pool.get_new_blocks(loadable, now)
        request.num_cached_blocks = len(hit)
        request.num_computed = (len(hit) + loadable) * bs
        # what was loaded is not offered back (vLLM's CHUNK_LEVEL store policy)
        request.host_offered_blocks = max(request.host_offered_blocks, len(hit) + loadable)
        request.host_loading_blocks = loadable
        request.host_load_done_at = self._from_host.transfer(
            now, loadable * bs * self.model.kv_bytes_per_token)
        self.loaded_tokens += loadable * bs
        self.loading.append(request)
        return True

    def offer(self, scheduled: list[tuple[EngineRequest, int]], step_end: float) -> None:
        """Offer the tier the prompt blocks this step completes (vLLM offloads prompt blocks
        only by default); new ones are copied after the step, one copy per request."""
        tier = self.tier
        bs = self.block_size
        for request, n in scheduled:
            storable = min(min(request.num_computed + n, request.prompt_tokens) // bs,
                           len(request.hashes))
            start = request.host_offered_blocks
            if storable <= start:
                continue
            outcome = tier.prepare_store(request.hashes[start:storable], request.request_id, start)
            if outcome is None:
                continue  # the tier cannot make room now: offered again next step
            request.host_offered_blocks = storable
            self.evicted_blocks += len(outcome.evicted)
            if outcome.stored:
                done = self._to_host.transfer(step_end, len(outcome.stored) * bs
                                              * self.model.kv_bytes_per_token)
                self._stores.append((done, outcome.stored))

    def request_finished(self, request_id: str) -> None:
        self.tier.request_finished(request_id)

    def abort(self, request_id: str) -> EngineRequest | None:
        """Drop a request that holds blocks for a load (in flight or done): its blocks are
        freed in reverse order. Returns it, or None if no load holds it."""
        for queue in (self.loading, self.loaded):
            for request in queue:
                if request.request_id == request_id:
                    break
            else:
                continue
            queue.remove(request)
            if request.host_loading_blocks:
                first = request.num_cached_blocks
                self.tier.complete_load(request.hashes[first:first + request.host_loading_blocks])
                request.host_loading_blocks = 0
            self.tier.forget_request(request.request_id)
            self.pool.free_blocks(reversed(request.block_ids), request.session_id)
            request.block_ids = []
            return request
        return None

    # -- Sluice's directives, the tier's side ----------------------------------------------

    def park(self, session_id: str) -> None:
        """``kv.offload``: park the session's blocks the tier holds (its prompt blocks are
        there already: stored as they were computed)."""
        pool = self.pool
        keys = [pool.block_hash[block_id] for block_id in pool.session_block_ids(session_id)]
        self.tier.park(session_id, [key for key in keys if key is not None])

    def favour(self, session_id: str, priority: int, deadline_s: float | None, now: float) -> None:
        """``kv.prefetch``: favour the session's parked blocks until the deadline (the load
        itself happens when its call arrives, as in vLLM)."""
        until = float("inf") if deadline_s is None else now + deadline_s
        self.tier.favour(session_id, priority, until)

    def unfavour(self, session_id: str) -> None:
        """``kv.release``: forget the session's bias in the tier."""
        self.tier.unfavour(session_id)
