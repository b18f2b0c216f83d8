"""The request machine's dispatch: queue each request's next stage, bind waiting stages to workers, and
charge each worker what it was sent.

The request machine (coordinator/requests.py) owns one Dispatcher. `advance` queues a request's next
stage in the class queues (coordinator/stage_queues.py) while a step updates request state; then the
step's second phase, `schedule`, takes the queues stage by stage, best class first, routes each
request among the workers that can take it now (coordinator/routing.py), and returns the messages
that start those stages. An
ENCODE of several images that would miss the chosen encoder's caches is shared with idle encoders
(`spread_encode`): each encodes its part at the same time, and the prefill worker fetches every part.
With single-flight encodes on (coordinator/single_flight.py), an ENCODE whose image another request is
encoding right now is parked until that encode ends, and then reads the image back from its holder.
Before a request's ENCODE is queued, images whose placeholders the likely prefill worker's cached
prefix holds whole (Redis prefix index) are taken out of it (`_skip_covered_images`): the ENCODE
carries only the others (none: it is skipped), and the PREFILL goes to that worker, which fetches
nothing for them; if its blocks are gone by then, it fails the attempt and the re-run encodes all.

With `route_choices` N (power of N choices) a stage is routed among N workers of its role drawn at
random, plus every worker holding its cached images or prompt prefix, instead of among all of them.
Several coordinator shards routing on the same load reports would otherwise all pick the same
"least busy" worker until its next report (docs/scaling.md, herding); random draws spread them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mserve.common.hashing import host_member
from mserve.common.policy import request_blocks
from mserve.coordinator.recent_prefixes import SKIP_HORIZON_S
from mserve.coordinator.records import STAGE_ROLE, EncodePart, NoLookups, RequestState, Stage, ToWorker, stage_message
from mserve.coordinator.routing import (WorkerView, alive, pipeline_for, prefix_covered, route_decode, route_encode,
                                        route_lend_adaptive, route_local_prefill, route_prefill, route_unified,
                                        spread_encode)
from mserve.coordinator.single_flight import Parked
from mserve.coordinator.stage_queues import takers
from mserve.coordinator.telemetry import modality

if TYPE_CHECKING:
    from mserve.coordinator.admission import Admitted
    from mserve.coordinator.context import Context


class Dispatcher:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def advance(self, st: RequestState) -> None:
        """Queue the request's next stage; the step's `schedule` sends it once a worker can take it."""
        now, req = self.ctx.now, st.admitted.request
        st.stage, st.deadline = Stage.QUEUED, now + self.ctx.settings.stage_timeout_s  # a full stage timeout to find one
        if self.ctx.flights is not None and st.next_stage == Stage.START:  # a re-run: what it encoded is lost
            self._wake(self.ctx.flights.release(st.rid))
        self.ctx.queues.push(st.rid, st.next_stage, priority=req.priority, latency_class=req.latency_class, since=now)

    def forget(self, st: RequestState) -> None:
        """The request ended: it waits for no stage any more."""
        self.ctx.queues.discard(st.rid)
        if self.ctx.flights is not None:
            self._wake(self.ctx.flights.forget(st.rid))

    def images_encoded(self, hashes: list[str]) -> None:
        """An ENCODED came in: the flights of its images end, and whoever waited for them goes on."""
        if self.ctx.flights is not None:
            self._wake(self.ctx.flights.encoded(hashes))

    def poll_flights(self) -> None:
        """Renew this coordinator's encode leases; requests parked on another shard's look again."""
        if self.ctx.flights is not None:
            self._wake(self.ctx.flights.poll(self.ctx.now))

    def _wake(self, parked: list[Parked]) -> None:
        for p in parked:
            st = self.ctx.requests.get(p.rid)
            if st is not None and st.stage == Stage.QUEUED and st.next_stage == Stage.ENCODE:
                self._wait(st, Stage.ENCODE, since=p.since)

    def _wait(self, st: RequestState, stage: Stage, since: float) -> None:
        req = st.admitted.request
        self.ctx.queues.push(st.rid, stage, priority=req.priority, latency_class=req.latency_class, since=since)

    def schedule(self) -> list[ToWorker]:
        """The step's second phase: bind waiting stages to the workers that can take them now, best class
        first (coordinator/stage_queues.py), route each (coordinator/routing.py), and return the
        messages that start them, in send order."""
        now, sends = self.ctx.now, []
        for w in self.ctx.queues.ordered(Stage.START, now):  # no pipeline yet: choose one once its pools are up
            st = self.ctx.requests[w.rid]
            route = pipeline_for(self.ctx.members.routable(), st.has_images)
            if route == "unified" and st.admitted.keep_ratio is not None:
                route = None  # pruned at its own ratio (SLO-adaptive pruning): only encode workers can
            if route is not None:
                st.next_stage = Stage.RUN if route == "unified" else (Stage.ENCODE if st.has_images else Stage.PREFILL)
                if st.next_stage == Stage.ENCODE and self._skip_covered_images(st):
                    st.next_stage = Stage.PREFILL  # the prefix holds every image: nothing to encode
                self._wait(st, st.next_stage, since=w.since)
        cap = self.ctx.settings.max_stages_per_worker
        for stage in reversed(STAGE_ROLE):  # later stages first: their messages go out first
            # Every request of a stage routes among the same workers: when the best cannot go, none can.
            while (ws := takers(self.ctx.members.routable(), stage, cap)) and (w := self.ctx.queues.first(stage, now)):
                self.ctx.queues.discard(w.rid)
                st = self.ctx.requests[w.rid]
                holders = self._holders([im.hash for im in st.admitted.images]) if stage == Stage.ENCODE else {}
                if stage == Stage.ENCODE and self.ctx.flights is not None and not self.ctx.flights.may_encode(
                        st.rid, [im.hash for i, im in enumerate(st.admitted.images) if i not in st.skipped_images],
                        holders, since=w.since):  # the images it will encode: not those its prefix holds
                    continue  # parked until the encode of one of its images, in flight elsewhere, ends
                worker = self._route(st, ws, holders)
                if worker is not None and stage in (Stage.PREFILL, Stage.RUN):  # its blocks are there next turn
                    self.ctx.lookups.placed(st.admitted, self.ctx.members.block_size, worker.worker_id, now)
                if stage == Stage.ENCODE and self.ctx.flights is not None:
                    self.ctx.counters.count("encode_deduplicated", self.ctx.flights.deduplicated(st.rid, holders))
                assert worker is not None, (stage, ws)
                st.timings["queue_s"] += now - w.since
                self.ctx.telemetry.on_dispatch(stage.value, modality(st.admitted.images), now - w.since)
                st.stage, st.worker_id, st.stage_started = stage, worker.worker_id, now
                st.deadline = now + self.ctx.settings.stage_timeout_s
                sends += self._send_stage(st, stage, worker, ws, holders, queued_s=now - w.since)
        return sends

    def _skip_covered_images(self, st: RequestState) -> bool:
        """Plan which images need no encode: those the prefix blocks of the prefill worker this request
        will likely go to hold whole (workers/prefix_skip.py). True when that is every image."""
        a, block_size = st.admitted, self.ctx.members.block_size
        if st.prefix_skip_off or not self.ctx.settings.prefix_skip or not any(im.skippable for im in a.images):
            return False
        # What this coordinator sent a worker counts only within the horizon: it never hears of evictions
        hits = self._prefix_hits(a, block_size, sent_since=self.ctx.now - SKIP_HORIZON_S)
        prefill = hits and route_prefill(self._draw(alive(self.ctx.members.routable(), "prefill"), set(hits)),
                                         len(a.prompt_ids), hits, block_size)
        if not prefill:
            return False
        covered = prefix_covered([im.end if im.skippable else None for im in a.images], len(a.prompt_ids),
                                 hits.get(prefill.worker_id, 0), block_size)
        if covered:
            st.skipped_images, st.skip_prefill = covered, prefill.worker_id
            self._credit(st, prefill, hits)  # its PREFILL goes there (_route): credited from this lookup
        return len(covered) == len(a.images)

    def _send_stage(self, st: RequestState, stage: Stage, worker: WorkerView, ws: list[WorkerView],
                    holders: dict[str, set[str]], queued_s: float = 0.0) -> list[ToWorker]:
        shares: list[tuple[WorkerView, list[int] | None]] = [(worker, None)]
        if stage == Stage.ENCODE and st.skipped_images:  # only the images the prefix does not hold, as one part
            rest = [i for i in range(len(st.admitted.images)) if i not in st.skipped_images]
            st.parts = [EncodePart(worker.worker_id, rest)]
            shares = [(worker, rest)]
        elif stage == Stage.ENCODE and self.ctx.settings.spread_encode and len(st.admitted.images) > 1:
            spread = spread_encode(worker, ws, [im.hash for im in st.admitted.images], holders)
            if len(spread) > 1:
                st.parts = [EncodePart(w.worker_id, idx) for w, idx in spread]
                shares = list(spread)
                self.ctx.counters.count("spread_encodes")
        if stage == Stage.ENCODE:
            st.encode_started = self.ctx.now
        self.uncharge(st, keep={p.worker_id for p in st.parts if p.descriptor is None})  # parts still encoding
        trace = st.trace.stage_sent(str(stage), [w.worker_id for w, _ in shares], st.attempt, queued_s) \
            if st.trace is not None else None
        sends = []
        for w, part in shares:
            msg, tokens = stage_message(st, stage, hand_back=self.ctx.settings.kv_hand_back, part=part,
                                                  report_every=self.ctx.settings.token_report_every, trace=trace)
            if stage in (Stage.PREFILL, Stage.RUN):  # the cached prefix there is no work (routing's estimate)
                tokens = max(0, tokens - st.prefix_credit)
            self.ctx.members.charge(w.worker_id, tokens)
            st.charged.append((w.worker_id, tokens))
            sends.append(ToWorker(w.worker_id, msg))
        return sends

    def _holders(self, hashes: list[str]) -> dict[str, set[str]]:
        """Who holds each image's embeddings: encoders that sent them, and the Redis index (workers, hosts)."""
        out = {}
        for h in hashes:
            indexed = self.ctx.lookups.embedding_holders(h)
            self._looked_up("embedding", bool(indexed))
            out[h] = self.ctx.members.embedding_holders.get(h, set()) | indexed
        return out

    def _prefix_hits(self, a: Admitted, block_size: int, sent_since: float | None = None) -> dict[str, int]:
        hits = self.ctx.lookups.prefix_hits(a, block_size, sent_since=sent_since)
        self._looked_up("prefix", bool(hits))
        return hits

    def _looked_up(self, index: str, hit: bool) -> None:
        """Count a lookup in the cluster's Redis index (embedding holders, prefix blocks), and whether it found
        any holder: mserve_redis_{index}_lookups_total / _lookup_hits_total."""
        if not isinstance(self.ctx.lookups, NoLookups):
            self.ctx.telemetry.counters[f"redis_{index}_lookups"] += 1
            self.ctx.telemetry.counters[f"redis_{index}_lookup_hits"] += hit

    def _route(self, st: RequestState, ws: list[WorkerView], holders: dict[str, set[str]]) -> WorkerView | None:
        a = st.admitted
        if st.next_stage == Stage.RUN:
            hits = self._prefix_hits(a, self.ctx.members.block_size)
            chosen = route_unified(self._draw(ws, set(hits)), len(a.prompt_ids), hits, self.ctx.members.block_size)
            self._credit(st, chosen, hits)
            return chosen
        if st.next_stage == Stage.ENCODE:
            hashes = [im.hash for im in a.images]
            prefer = self.ctx.flights.prefer(st.rid, holders) if self.ctx.flights is not None else set()
            # It waited for another request's encode: read the image back from a holder, never encode it again.
            ws = [w for w in ws if w.worker_id in prefer or host_member(w.host_id) in prefer] or ws
            return route_encode(self._draw(ws, set().union(*holders.values())), hashes, holders)
        block_size = self.ctx.members.block_size
        if st.next_stage == Stage.PREFILL:
            pinned = next((w for w in ws if w.worker_id == st.skip_prefill), None)
            if pinned is not None:  # it holds the prefix the skipped images are in (elsewhere: a retry encodes them)
                return pinned  # credited when the skip was planned (_skip_covered_images)
            hits = self._prefix_hits(a, block_size)
            chosen = route_prefill(self._draw(ws, set(hits)), len(a.prompt_ids), hits, block_size)
            local = self._local_prefill(st, chosen)
            self._credit(st, local or chosen, hits)
            return local or chosen
        if st.next_stage == Stage.DECODE:
            need = request_blocks(len(a.prompt_ids), a.request.sampling.max_tokens, block_size)
            return route_decode(self._draw(ws), need)
        raise AssertionError(st.next_stage)

    def _local_prefill(self, st: RequestState, chosen: WorkerView | None) -> WorkerView | None:
        """A decode worker to prefill on instead of `chosen`, when the prefill pool is behind
        (routing.route_local_prefill): it decodes the request on where it prefilled it. Not for a
        request whose images are still encoding in parts (EMBEDDINGS follow only to prefill workers)
        or whose tokens the workers stream to the client themselves (a PREFILL carries no token route)."""
        n, adaptive = self.ctx.settings.local_prefill_tokens, self.ctx.settings.adaptive_lending
        if chosen is None or (n <= 0 and not adaptive) or st.parts or self.ctx.settings.token_report_every > 1:
            return None
        a = st.admitted
        need = request_blocks(len(a.prompt_ids), a.request.sampling.max_tokens, self.ctx.members.block_size)
        decoders = self._draw(alive(self.ctx.members.routable(), "decode"))
        local = (route_lend_adaptive(chosen, decoders, len(a.prompt_ids), need) if adaptive
                 else route_local_prefill(chosen, decoders, len(a.prompt_ids), need, n))
        if local is not None:
            self.ctx.counters.count("local_prefills")
        return local

    def _credit(self, st: RequestState, worker: WorkerView | None, hits: dict[str, int]) -> None:
        """The prompt tokens the chosen worker likely holds: its stage charges it only for the rest."""
        held = hits.get(worker.worker_id, 0) * self.ctx.members.block_size if worker is not None else 0
        st.prefix_credit = min(held, max(0, len(st.admitted.prompt_ids) - 1))

    def _draw(self, ws: list[WorkerView], keep: set[str] = frozenset()) -> list[WorkerView]:
        """The workers a stage is routed among: all, or `route_choices` drawn at random plus those in `keep`
        (cache holders, by worker id or host member: cache affinity is never traded for the draw)."""
        n = self.ctx.settings.route_choices
        if n < 2 or len(ws) <= n:
            return ws
        drawn = {w.worker_id for w in self.ctx.rng.sample(ws, n)}
        return [w for w in ws if w.worker_id in drawn or w.worker_id in keep or host_member(w.host_id) in keep]

    def prefill_done(self, st: RequestState) -> None:
        """A unified RUN gave its first token: its stage stays open (decoding), its prompt tokens no longer
        count as prefill work queued on the worker (route_unified weighs running sequences apart)."""
        for w, tokens in st.charged:
            self.ctx.members.uncharge_tokens(w, tokens)
        st.charged = [(w, 0) for w, _ in st.charged]

    def uncharge(self, st: RequestState, worker_id: str | None = None, keep: set[str] = frozenset()) -> None:
        """Take back what the request's open stages charged their workers: only `worker_id`'s share
        when given, never that of the workers in `keep`."""
        left = []
        for w, tokens in st.charged:
            if (worker_id is None or w == worker_id) and w not in keep:
                self.ctx.members.uncharge(w, tokens)
            else:
                left.append((w, tokens))
        st.charged = left
