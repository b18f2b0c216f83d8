"""The stage engine: encode, prefill and continuous-batch decode over a paged KV pool, in one object.

`step()` is schedule, run, `scheduler.postprocess`; the scheduler is the one place that knows which
sequences wait, run or hand their KV on, and the engine asks it. Workers of every role drive one
Engine: an encode worker calls `encode()`, a prefill worker adds requests with `prefill_only=True`
and exports their KV blocks, a decode worker imports blocks and steps; the unified role does all three.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

import torch

from mserve.common import sampling_rules as rules
from mserve.common.audio import AudioPart, decode_audio
from mserve.common.images import decode_image
from mserve.common.hashing import ImageSpan, item_spans
from mserve.common.histogram import STEP_BUCKETS_S, Histogram
from mserve.common.video import VideoPart, decode_video_file, visual_hash
from mserve.workers import prefix_skip
from mserve.workers.block_pool import BlockPool
from mserve.workers.engine_config import EngineConfig, RequestInput, StepOutput
from mserve.common.protocol.to_worker import KVState
from mserve.workers.hand_back import KVExport, adopt_blocks, reply_blocks
from mserve.workers.model_runner import EncodedImage, ModelRunner
from mserve.workers.sampler import sample
from mserve.workers.scheduler import Scheduler
from mserve.workers.sequence import SamplingParams, Sequence as Seq

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.runner = ModelRunner(config.model_dir, device=config.device, dtype=config.dtype,
                                  num_blocks=config.num_blocks, block_size=config.block_size, model=model,
                                  parts=config.parts, visual_token_pruning=config.visual_token_pruning,
                                  exact_attention=config.exact_attention, compile_decode=config.compile)
        self.family = self.runner.family
        states = self.runner.linear_states
        hybrid = states is not None and config.enable_prefix_caching and config.state_snapshots > 0
        if states is not None and config.enable_prefix_caching and not hybrid:
            # A prefix hit needs each linear layer's state at the end of the cached prefix: no snapshots, no reuse.
            log.info("prefix caching off: %s has linear-attention layers %s and state_snapshots is 0",
                     config.model_dir, states.layers)
            config = replace(config, enable_prefix_caching=False)
            self.config = config
        elif hybrid:
            states.max_snapshots = config.state_snapshots
            log.info("prefix caching with state snapshots: %s has linear-attention layers %s; a hit resumes from "
                     "a copy of their state at a block boundary (at most %d copies of %.1f KiB)", config.model_dir,
                     states.layers, config.state_snapshots, self.runner.linear_state_bytes() / 2**10)
        self.pool = BlockPool(config.num_blocks, config.block_size, prefix_end_ok=states.holds if hybrid else None)
        self.scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_tokens=config.max_prefill_tokens,
                                   reserve_tokens=config.reserve_tokens, class_aging_s=config.class_aging_s,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   whole_images=self.family.bidirectional_images,
                                   causal_token=self.family.audio_token_id, release=self.runner.release,
                                   snapshot=self.runner.snapshot if hybrid else None,
                                   restore=self.runner.restore if hybrid else None)
        gen = self.runner.model.generation_config
        eos = gen.eos_token_id if gen is not None else None
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.counters = {"encoded_images": 0, "visual_tokens": 0, "embedding_cache_hits": 0,
                         "embedding_l1_hits": 0, "embedding_l2_hits": 0, "prefill_tokens": 0,
                         "decode_tokens": 0, "steps": 0, "encodes_skipped_by_prefix": 0,
                         "prefix_skip_fallbacks": 0}
        # The embedding tiers (workers/embedding_tiers.py) the unified role reads before encoding; None: none.
        self.tiers: Any = None
        # Requests dropped because a deferred image's embeddings were needed and cannot be made here
        # (prefill, decode): the worker reports them (take_unresolved) so the coordinator encodes again.
        self._unresolved: list[str] = []
        self.last_batch_size = 0  # sequences in the latest step
        self.step_seconds = Histogram(STEP_BUCKETS_S)  # rides in the heartbeat's load (Worker.load)
        self.predecoded: dict[str, Any] = {}  # visual hash -> decoded image, for `encode` (roles/unified.py)

    # -- encode ---------------------------------------------------------------------------------
    def encode(self, images: Sequence[bytes | VideoPart], hashes: Sequence[str] | None = None) -> list[EncodedImage]:
        """Image bytes and videos -> embeddings; every image (frame) is checked against the limits before decoding.
        An item whose hash is in `predecoded` (decoded ahead, off the loop: roles/unified.py) is not decoded again."""
        for i, item in enumerate(images):
            if isinstance(item, AudioPart):  # its bytes and seconds were checked at admission (max_audio_*)
                continue
            for data in (item.frames or (item.data,)) if isinstance(item, VideoPart) else (item,):
                if len(data or b"") > self.config.max_image_bytes:
                    raise ValueError(f"image {i} is {len(data)} bytes, over the limit "
                                     f"max_image_bytes={self.config.max_image_bytes}")
        pil = [self.predecoded.pop(h) if h in self.predecoded else self.decode_visual(item)
               for item, h in zip(images, hashes or [None] * len(images))]
        self.counters["encoded_images"] += len(pil)
        encoded = self.runner.encode_visuals(pil)
        self.counters["visual_tokens"] += sum(int(enc.embeds.shape[0]) for enc in encoded)
        return encoded

    def decode_visual(self, item: bytes | VideoPart | AudioPart) -> Any:
        """An image (PIL) or a video (a list of PIL frames), decoded within the pixel limit; an audio clip
        (a waveform at the feature extractor's rate, held to its admitted length)."""
        if isinstance(item, AudioPart):
            return decode_audio(item.data, self.family.audio_features.sampling_rate, item.samples)
        limit = self.config.max_image_pixels
        if not isinstance(item, VideoPart):
            return decode_image(item, limit)
        if item.frames is not None:
            return [decode_image(f, limit) for f in item.frames]
        return decode_video_file(item.data or b"", item.indices or (), limit)

    def encode_cached(self, images: Sequence[bytes | VideoPart], hashes: Sequence[str]) -> tuple[list[EncodedImage], int]:
        """`encode`, reading the embedding tiers first and filling them after, when the engine has them;
        also how many images the tiers had."""
        out: list[EncodedImage | None] = [self.tiers.lookup(h) if self.tiers is not None else None for h in hashes]
        hits = sum(e is not None for e in out)
        self.counters["embedding_cache_hits"] += hits
        missing = [i for i, e in enumerate(out) if e is None]
        if missing:
            for i, enc in zip(missing, self.encode([images[i] for i in missing], [hashes[i] for i in missing])):
                out[i] = enc
                if self.tiers is not None:
                    self.tiers.put(hashes[i], enc)
        return out, hits  # type: ignore[return-value]

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Sequence[int], *, images: Sequence[bytes | VideoPart] = (),
                    encoded: Sequence[EncodedImage | None] | None = None, image_hashes: Sequence[str] | None = None,
                    sampling: SamplingParams | None = None, priority: int = rules.PRIORITY, prefill_only: bool = False,
                    output_ids: Sequence[int] = (), latency_class: str = "interactive",
                    item_tokens: Sequence[int] | None = None, item_fps: Sequence[float | None] | None = None,
                    deferred: dict[int, Any] | None = None, grids: Sequence[Any] | None = None) -> Seq:
        """Queue a request. Images come as bytes (encoded here) or already encoded elsewhere.

        An `encoded` entry may be None: that image is still being encoded elsewhere and comes later
        (`attach_embeddings`); `item_tokens` gives its visual tokens. The prompt is computed up to
        the first image still awaited, its KV blocks reserved on admission.
        `output_ids` resumes a request whose first tokens were already delivered (a re-run after a
        worker died): they are recomputed like a preempted request's, and generation continues.
        `item_fps`: each item's sampled frame rate (a video's; images None), for encoded items (taken
        from the VideoParts otherwise).
        Images given as bytes whose placeholders the cached prefix holds are not encoded
        (workers/prefix_skip.py); `deferred` lists the `encoded` None entries skipped so elsewhere
        (item -> None), with their `grids` for M-RoPE.
        """
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt (no token ids)")
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request {request_id}: already in this engine")
        runs = self.family.image_spans(prompt_ids)
        deferred, embedding_hits = dict(deferred or {}), 0
        known_grids = list(grids or [None] * len(encoded or images))
        if encoded is None:
            image_hashes = [visual_hash(d) for d in images]
            item_fps = [d.fps if isinstance(d, VideoPart) else None for d in images]
            skip = prefix_skip.covered_images(self.pool, self.family, prompt_ids, output_ids, runs, images, image_hashes) \
                if self.config.enable_prefix_caching else {}
            fresh, embedding_hits = self.encode_cached([d for i, d in enumerate(images) if i not in skip],
                                                       [h for i, h in enumerate(image_hashes) if i not in skip])
            encoded = [None if i in skip else fresh.pop(0) for i in range(len(images))]
            item_tokens = [runs[i][1] if i in skip else 0 for i in range(len(images))]
            deferred = {i: images[i] for i in skip}
            known_grids = [skip.get(i) for i in range(len(images))]
        self.counters["encodes_skipped_by_prefix"] += len(deferred)
        hashes = list(image_hashes or [f"anon-{request_id}-{i}" for i in range(len(encoded))])
        if any(e is None for e in encoded) and (item_tokens is None or len(item_tokens) != len(encoded)):
            raise ValueError(f"request {request_id}: images still to come need item_tokens, one per image")
        counts = [int(e.embeds.shape[0]) if e is not None else int(item_tokens[i]) for i, e in enumerate(encoded)]
        # An image or Qwen2-VL video fills one placeholder run; a video given to LLaVA as frames, one per frame.
        try:
            spans = item_spans(runs, list(zip(hashes, counts)))
        except ValueError as exc:
            raise ValueError(f"request {request_id}: prompt has {len(runs)} image placeholder runs but "
                             f"{len(encoded)} images ({exc})") from None
        embeds, awaiting = _run_embeds(spans, encoded, counts)
        seq = Seq(request_id=request_id, prompt_ids=list(prompt_ids), sampling=sampling or SamplingParams(),
                  images=spans, image_embeds=embeds, priority=priority, latency_class=latency_class,
                  eos_token_ids=self.eos_token_ids, prefill_only=prefill_only, output_ids=list(output_ids),
                  awaiting=awaiting, deferred=deferred, embedding_hits=embedding_hits,
                  item_grids=[e.grid_thw if e is not None else known_grids[i] for i, e in enumerate(encoded)],
                  item_fps=list(item_fps or [None] * len(encoded)))
        if self.family.uses_mrope:
            if any(seq.item_grids[i] is None for i in awaiting):
                seq.positions_pending = True  # computed once every grid is in (attach_embeddings)
            else:
                seq.mrope_positions, seq.rope_delta = self.runner.mrope_positions(seq.prompt_ids, seq.item_grids, seq.item_fps)
        self.scheduler.add(seq)
        return seq

    def attach_embeddings(self, request_id: str, item: int, encoded: EncodedImage) -> bool:
        """An awaited image's embeddings: its placeholder runs can be computed now. False when the
        request is gone or does not await that image; ValueError when its size does not fit."""
        seq = self.scheduler.get(request_id)
        if seq is None or item not in seq.awaiting:
            return False
        runs = seq.awaiting[item]
        if sum(seq.images[i].length for i in runs) != encoded.embeds.shape[0]:
            raise ValueError(f"request {request_id}: image {item} has {encoded.embeds.shape[0]} visual tokens, "
                             f"its placeholders {sum(seq.images[i].length for i in runs)}")
        del seq.awaiting[item]
        seq.deferred.pop(item, None)
        offset = 0
        for i in runs:
            n = seq.images[i].length
            seq.image_embeds[i] = encoded.embeds[offset : offset + n]
            offset += n
        seq.item_grids[item] = encoded.grid_thw
        if seq.positions_pending and all(seq.item_grids[i] is not None for i in seq.awaiting):
            seq.mrope_positions, seq.rope_delta = self.runner.mrope_positions(seq.prompt_ids, seq.item_grids, seq.item_fps)
            seq.positions_pending = False
        return True

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._resolve_deferred()
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        t0 = time.perf_counter()
        logits = self.runner.execute(chunks)
        completing = [c.seq for c in chunks if c.completes_sequence]
        tokens = sample(logits, [s.sampling for s in completing], [len(s.output_ids) for s in completing])
        self.counters["steps"] += 1
        self.step_seconds.observe(time.perf_counter() - t0)  # the forward and sampling of one step
        self.last_batch_size = len(chunks)
        for c in chunks:
            is_decode = c.num_tokens == 1 and c.start >= len(c.seq.prompt_ids)
            self.counters["decode_tokens" if is_decode else "prefill_tokens"] += c.num_tokens
        outputs: list[StepOutput] = []
        for seq, tok in zip(self.scheduler.postprocess(chunks, tokens), tokens):
            out = StepOutput(seq.request_id, [tok], seq.is_finished, seq.finish_reason)
            # A prefilled request keeps its blocks until export_kv hands them on; a reply to hand
            # back, until its full blocks are copied out here.
            if seq.is_finished and seq.hand_back and seq.finish_reason != "prefilled":
                # Nothing to hand back without prefix reuse, nor for a hybrid model: its state is not in the
                # blocks and a hit there resumes only from a snapshot this pool took.
                out.hand_back = (reply_blocks(self.pool, self.runner.kv, seq)
                                 if self.config.enable_prefix_caching and self.runner.linear_states is None else None)
                self.scheduler.free(seq)
            outputs.append(out)
        return outputs

    def _resolve_deferred(self) -> None:
        """Skipped images that are needed after all (their prefix blocks were evicted before admission,
        or the request was preempted): encode them here, or drop the request for the worker to report."""
        for seq in self.scheduler.waiting + self.scheduler.running:
            items = prefix_skip.needed(seq, self.pool)
            if not items:
                continue
            self.counters["encodes_skipped_by_prefix"] -= len(items)  # not skipped after all
            self.counters["prefix_skip_fallbacks"] += len(items)
            if any(seq.deferred[i] is None for i in items):
                self.scheduler.abort(seq)
                self._unresolved.append(seq.request_id)
                continue
            hashes = [seq.images[seq.awaiting[i][0]].image_hash for i in items]
            encoded, hits = self.encode_cached([seq.deferred[i] for i in items], hashes)
            seq.embedding_hits += hits
            for i, enc in zip(items, encoded):
                self.attach_embeddings(seq.request_id, i, enc)

    def take_unresolved(self) -> list[str]:
        """The requests dropped since the last call because embeddings they skipped are needed after all."""
        out, self._unresolved = self._unresolved, []
        return out

    def run_until_done(self) -> dict[str, list[int]]:
        """Step until every queued request is finished; returns output ids per request."""
        results: dict[str, list[int]] = {}
        while self.has_unfinished():
            for out in self.step():
                results.setdefault(out.request_id, []).extend(out.new_token_ids)
        return results

    def generate(self, requests: Iterable[RequestInput]) -> dict[str, list[int]]:
        for r in requests:
            self.add_request(r.request_id, r.prompt_ids, images=r.images, sampling=r.sampling, priority=r.priority)
        return self.run_until_done()

    # -- KV hand-off (prefill -> decode) ------------------------------------------------------------
    def export_kv(self, request_id: str, *, release: bool = True,
                  alloc: Callable[[dict[str, tuple[tuple[int, ...], torch.dtype]]], dict[str, torch.Tensor]] | None = None
                  ) -> KVExport:
        """A prefilled request ready to leave: its wire state plus its KV blocks and prompt inputs.

        `alloc` ({name: (shape, dtype)} -> {name: tensor}, e.g. a transfer engine's shared-memory
        allocation) provides the buffers the tensors are written to, so they are copied once, straight
        into what the decode side will read. Names: "kv", "mrope" (if any), "emb{i}" per image and, for a
        model with linear-attention layers, "lin{j}" per tensor of its state (LinearStates.export).
        """
        seq = self.scheduler.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id} is not in this engine")
        assert seq.num_computed_tokens > 0, f"request {request_id} has no computed KV to export"
        n_blocks = self.pool.blocks_needed(seq.num_computed_tokens)
        kv_cache = self.runner.kv
        block_ids = seq.block_table.block_ids[:n_blocks]
        kv, mrope, embeds = None, seq.mrope_positions, seq.image_embeds
        states = self.runner.linear_states
        linear = states.export(request_id) if states is not None else []
        if alloc is not None:
            spec = {"kv": (kv_cache.export_shape(n_blocks), kv_cache.dtype)}
            if mrope is not None:
                spec["mrope"] = (tuple(mrope.shape), mrope.dtype)
            spec.update({f"emb{i}": (tuple(e.shape), e.dtype) for i, e in enumerate(embeds) if e is not None})
            spec.update({f"lin{j}": (tuple(t.shape), t.dtype) for j, t in enumerate(linear)})
            out = alloc(spec)
            linear = [out[f"lin{j}"].copy_(t) for j, t in enumerate(linear)]
            kv = kv_cache.export_blocks(block_ids, out=out["kv"])
            if mrope is not None:
                mrope = out["mrope"].copy_(mrope)
            embeds = [out[f"emb{i}"].copy_(e) if e is not None else None for i, e in enumerate(embeds)]
        state = KVState(request_id=seq.request_id, prompt_ids=seq.prompt_ids, output_ids=seq.output_ids,
                        num_computed_tokens=seq.num_computed_tokens, block_size=self.pool.block_size,
                        images=[[s.start, s.length, s.image_hash] for s in seq.images],
                        sampling=seq.sampling.to_wire(), rope_delta=seq.rope_delta, priority=seq.priority,
                        latency_class=seq.latency_class)
        export = KVExport(state, kv if kv is not None else kv_cache.export_blocks(block_ids), mrope, list(embeds),
                          [t.clone() for t in linear] if alloc is None else linear)
        if release:
            self.scheduler.free(seq)
        return export

    def import_kv(self, export: KVExport, *, request_id: str | None = None) -> Seq:
        """Adopt a request prefilled elsewhere: copy its blocks into this pool and decode it here.

        `kv` may be a view of someone else's memory (it is copied here); `image_embeds` and
        `mrope_positions` are kept for the request's lifetime, so they must not be."""
        state = export.state
        if state.block_size != self.pool.block_size:
            raise ValueError(f"block size mismatch: sender {state.block_size}, receiver {self.pool.block_size}")
        rid = request_id or state.request_id
        seq = Seq(request_id=rid, prompt_ids=list(state.prompt_ids), sampling=SamplingParams.from_wire(state.sampling),
                  images=[ImageSpan(int(s), int(n), str(h)) for s, n, h in state.images],
                  image_embeds=list(export.image_embeds), mrope_positions=export.mrope_positions,
                  rope_delta=state.rope_delta, priority=state.priority, eos_token_ids=self.eos_token_ids,
                  latency_class=state.latency_class)
        seq.output_ids = list(state.output_ids)
        for i, e in enumerate(seq.image_embeds):  # skipped by the prefill's prefix hit: only a re-run can bring it
            if e is None:
                seq.awaiting[i], seq.deferred[i] = [i], None
        n_computed = state.num_computed_tokens
        self.pool.allocate(seq.block_table, max(n_computed, seq.num_tokens))
        kv = export.kv
        states = self.runner.linear_states
        if states is not None:  # the KV alone is not the prompt's state: the linear layers' must come with it
            if len(export.linear_state) != 2 * len(states.layers):
                self.pool.free(seq.block_table)
                raise ValueError(f"request {rid}: {len(export.linear_state)} linear-attention state tensors, "
                                 f"this model needs {2 * len(states.layers)} (conv + recurrent per linear layer)")
            states.adopt(rid, export.linear_state, self.runner.device)
        self.runner.kv.import_blocks(seq.block_table.block_ids[: kv.shape[2]], kv)
        seq.num_computed_tokens = n_computed
        if self.config.enable_prefix_caching:
            self.pool.commit_full_blocks(seq.block_table, seq.prompt_ids, min(n_computed, len(seq.prompt_ids)), seq.images)
        self.scheduler.add_running(seq)
        return seq

    def adopt_blocks(self, token_ids: Sequence[int], images: Sequence[Any], first_block: int, kv: torch.Tensor) -> int:
        """Keep KV blocks another engine computed as cached prefix blocks here (workers/hand_back.py)."""
        if not self.config.enable_prefix_caching or self.runner.linear_states is not None:
            return 0  # nothing would read them (see __init__; a hybrid model hits only at its own snapshots)
        n = adopt_blocks(self.pool, self.runner.kv, token_ids, images, first_block, kv)
        self.counters["adopted_blocks"] = self.counters.get("adopted_blocks", 0) + n
        return n

    def stats(self) -> dict[str, Any]:
        snapshots = self.runner.linear_states.snapshot_stats() if self.runner.linear_states is not None else {}
        return {**self.counters, **self.pool.stats(), **snapshots, "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running), "preemptions": self.scheduler.num_preemptions,
                "batch_size": self.last_batch_size}


def _run_embeds(spans: Sequence[Any], encoded: Sequence[EncodedImage | None],
                counts: Sequence[int]) -> tuple[list[torch.Tensor | None], dict[int, list[int]]]:
    """Each placeholder run's slice (a view) of its item's embeddings (None for an item still to
    come), and which runs each awaited item fills; `spans` come from item_spans."""
    out: list[torch.Tensor | None] = []
    awaiting: dict[int, list[int]] = {}
    runs = iter(enumerate(spans))
    for item, (enc, count) in enumerate(zip(encoded, counts)):
        offset = 0
        while offset < count:
            index, span = next(runs)
            if enc is None:
                out.append(None)
                awaiting.setdefault(item, []).append(index)
            else:
                out.append(enc.embeds[offset : offset + span.length])
            offset += span.length
    return out, awaiting
