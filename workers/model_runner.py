"""Runs the checkpoint's own transformers modules: vision encoding, and one packed forward per engine step.

The runner owns the model and the KV pool tensors. It never decides what to run (the scheduler
does); it turns scheduled chunks into embeddings, positions and slot indices, calls the language
model with the paged attention function, and returns the logits of requests that need a new token.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from mserve.common.model import ModelFamily, load_family
from mserve.common.video import seconds_per_grid
from mserve.workers import fused_ops, packed_linear, paged_attention, paged_prefill, text_traits
from mserve.workers.deepstack import DeepstackRows, deepstack_layers, pack
from mserve.workers.image_bounds import bidirectional_spans
from mserve.workers.linear_state import LinearStates, linear_layers, wrap_linear_layers
from mserve.workers.model_loading import _cpu_bf16_matmuls, text_module_name, load_vlm
from mserve.workers.paged_attention import KVCache, PagedBatch
from mserve.workers.scheduler import ScheduledChunk
from mserve.workers.tiled_images import features_per_image

log = logging.getLogger(__name__)


@dataclass
class EncodedImage:
    """One image after the vision tower + projector: what prefill scatters into the prompt."""

    embeds: torch.Tensor  # [num_visual_tokens, hidden]; Qwen3-VL: DeepStack features as extra columns (deepstack.py)
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL patch grid; None for LLaVA


@dataclass(frozen=True)
class PreparedImage:
    """A decoded image and its family's image processor output for it alone (ModelRunner.prepare_image).
    A vision forward of that one image takes the output as it is; a batch of several processes them
    together again, as the processor batches them its own way (padding, tiles)."""

    image: Any
    inputs: dict


class ModelRunner:
    def __init__(self, model_dir: str | os.PathLike, *, device: str = "cpu", dtype: str | None = None,
                 num_blocks: int = 1024, block_size: int = 16, model: torch.nn.Module | None = None,
                 parts: str = "all", visual_token_pruning: float | None = None,
                 exact_attention: bool | None = None, compile_decode: bool = False) -> None:
        from mserve.common import pruning

        self.device = torch.device(device)
        self.family: ModelFamily = load_family(model_dir)
        # Checked before the weights load: a family that cannot prune is refused at once, naming the flag.
        ratio = pruning.apply(self.family, visual_token_pruning)
        self.model = model if model is not None else load_vlm(model_dir, device, dtype, parts)
        self.dtype = next(self.model.parameters()).dtype
        if self.dtype != torch.float32 and (why := self.family.rules.float32_only) is not None:
            from mserve.common.processor import UnsupportedModelError

            dtype_name = str(self.dtype).removeprefix("torch.")
            raise UnsupportedModelError(f"model_type {self.family.model_type!r} in {dtype_name}: {why}; "
                                        "serve it in float32 (--dtype float32)")
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not _cpu_bf16_matmuls():
            log.warning("bfloat16 on a CPU without AVX-512 (torch's CPU capability: %s): oneDNN cannot run its "
                        "bf16 matrix multiplies here, and torch's fallback was 6x slower than float32 on an "
                        "AVX2-only AMD EPYC (bench/lab/NOTEBOOK.md, \"An AVX2 host\"); float32, the CPU's default, is "
                        "the fast choice on this host", torch.backends.cpu.get_cpu_capability())
        self.exact_attention = bool(exact_attention)  # None (auto) is padded: paged_attention.exact_setting says why
        if (not self.exact_attention and self.dtype == torch.bfloat16 and self.device.type == "cpu"
                and paged_prefill.preferred()):  # read here: a bad MSERVE_PROMPT_KERNEL fails the start
            paged_prefill.use_for_vision(self.model)  # the vision tower's attention in the bf16 kernel too
        if self.device.type == "cpu" and not compile_decode:  # weights reordered once, not per call
            packed_linear.pack_linears(self.model, exact=self.exact_attention)
            if not self.exact_attention:  # bf16: RMSNorm, SiLU * up, rotary in one pass each; float32: fewer
                fused_ops.fuse(self.model, self.dtype)
        text = self.model.config.text_config
        self.hidden_size = text.hidden_size
        self.deepstack_layers = deepstack_layers(self.model)  # Qwen3-VL; 0 for every other family
        self.language_model = getattr(self.model.model, text_module_name(self.model))
        # Linear-attention layers (Qwen3.5's Gated DeltaNet) keep a state per sequence, not paged K/V.
        linear = set(linear_layers(text))
        self.linear_states: LinearStates | None = None
        self.attention_chunks: list[int | None] | None = None  # Llama 4's chunked local layers (text_traits.py)
        if self.language_model is None:  # an encoder: no KV pool, no text embeddings
            self.embed_tokens, self.kv = None, None
        else:
            self.embed_tokens = self.language_model.get_input_embeddings()
            shapes = text_traits.layer_kv_shapes(text)  # layers may differ (Gemma 4's global ones)
            sources = text_traits.kv_source_layers(text) or list(range(text.num_hidden_layers))
            sources = [None if i in linear else src for i, src in enumerate(sources)]  # a linear layer: no K/V
            kv_heads, head_dim = shapes[0]
            self.kv = KVCache(text.num_hidden_layers, num_blocks, kv_heads, block_size, head_dim,
                              dtype=self.dtype, device=self.device, layer_shapes=shapes, kv_sources=sources)
            # Llama 4: chunked local layers, and NoPE layers whose temperature tuning needs each token's position.
            self.attention_chunks = text_traits.attention_chunks(text)
            if text_traits.wrap_temperature_layers(self.language_model) and compile_decode:
                raise ValueError("compile: not for models with temperature-tuned attention layers (Llama 4: "
                                 "their scaling is switched per forward, outside a compiled graph); run without --compile")
            if linear:
                if compile_decode:
                    raise ValueError("compile: not for models with linear-attention layers (their per-sequence "
                                     "state runs outside the compiled graph); run without --compile")
                wrap_linear_layers(self.language_model)
                self.linear_states = LinearStates(text)
        self.model_dir = str(model_dir)
        self._compiled_decode = self._compile_decode() if compile_decode and self.language_model is not None else None
        self.pruner = None  # FasterVLM on the encode path (workers/pruning.py), when asked for
        if ratio is not None and getattr(self.model.model, "vision_tower", None) is not None:
            from mserve.workers.pruning import ClsAttentionPruner

            self.pruner = ClsAttentionPruner(self.model, self.family, ratio)
        self._adaptive_pruner = None  # made on the first request that brings its own keep ratio

    def pruner_for(self, keep_ratio: float | None):
        """The pruner for one vision forward: the worker's fixed one, or, for a request with its own keep
        ratio (SLO-adaptive pruning), one built on first use (PruningError for a family that cannot prune)."""
        if keep_ratio is None or self.pruner is not None:
            return self.pruner
        if self._adaptive_pruner is None:
            from mserve.common import pruning
            from mserve.workers.pruning import ClsAttentionPruner

            if (why := pruning.unsupported(self.family)) is not None:
                raise pruning.PruningError(f"a request asked for visual-token pruning: {why}")
            self._adaptive_pruner = ClsAttentionPruner(self.model, self.family, None)
        return self._adaptive_pruner

    # -- encode stage ------------------------------------------------------------------------
    @property
    def image_processor(self):
        """The PIL image processor inside the family's processor: the very object admission counted
        placeholders with (common/processor.py), so the two can never size an image differently."""
        return self.family.processor.image_processor

    @torch.inference_mode()
    def encode_images(self, images: Sequence, keep_ratio: float | None = None) -> list[EncodedImage]:
        """PIL images -> one embedding tensor per image, all images in one vision forward through the
        model's own get_image_features (given every input its image processor produced that it takes).
        `keep_ratio`: these images' own pruning ratio (SLO-adaptive pruning), else the worker's."""
        if not images:
            return []
        if len(images) == 1 and isinstance(images[0], PreparedImage):
            inputs = images[0].inputs  # processed off the loop (roles/unified.py)
        else:
            inputs = self.family.image_inputs([im.image if isinstance(im, PreparedImage) else im for im in images])
        kwargs = {k: v for k, v in inputs.items() if k in self._image_feature_inputs}
        # Pixels in the model's dtype, whatever the processor calls them (Video-LLaVA: pixel_values_images),
        # unless the vision tower casts them itself (FamilyRules.casts_own_pixels).
        pixels = self.family.rules.pixel_dtype(self.dtype)
        kwargs.update({k: v.to(self.device, pixels) if k.startswith("pixel_values") and v.is_floating_point()
                       else v.to(self.device) for k, v in kwargs.items() if torch.is_tensor(v)})
        pruner = self.pruner_for(keep_ratio)
        with pruner.capture() if pruner else contextlib.nullcontext() as scores:
            out = self.model.model.get_image_features(**kwargs, return_dict=True)
        grid = inputs.get("image_grid_thw")
        grids = [tuple(int(x) for x in g) for g in grid.tolist()] if grid is not None else [None] * len(images)
        embeds = features_per_image(out.pooler_output, inputs, self.hidden_size)
        if pruner is not None:  # keep each image's top tokens by [CLS] attention, in order
            embeds = pruner.select(embeds, scores, keep_ratio)
        embeds = pack(embeds, getattr(out, "deepstack_features", None))
        return [EncodedImage(e.contiguous(), g) for e, g in zip(embeds, grids)]

    def release(self, seq) -> None:
        """The scheduler dropped `seq`'s computed state (freed or preempted): its linear-layer state goes too."""
        if self.linear_states is not None:
            self.linear_states.drop(seq.request_id)

    def snapshot(self, seq, block_hash: str) -> None:
        self.linear_states.snapshot(seq.request_id, block_hash)

    def restore(self, seq, block_hash: str) -> None:
        self.linear_states.restore(seq.request_id, block_hash, self.device)

    def linear_state_bytes(self) -> int:
        """One sequence's linear-attention state in bytes (0 for a model without such layers)."""
        if self.linear_states is None:
            return 0
        from mserve.workers.linear_state import state_bytes_per_sequence

        return state_bytes_per_sequence(self.model.config.text_config, self.dtype)

    def weight_bytes(self) -> int:
        """The model's weights in memory: its parameters, and the linear weights packed into buffers
        (workers/packed_linear.py)."""
        tensors = [*self.model.parameters(), *(b for m in self.model.modules()
                                               if isinstance(m, packed_linear.PackedLinear) for b in m.buffers())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def prepare_image(self, image: Any) -> "PreparedImage":
        """A decoded image with its image processor's output, for encode_images to take as it is: the
        unified role runs this on an IO thread, so the model's thread only runs the model."""
        return PreparedImage(image, self.family.image_inputs([image]))

    @property
    def _image_feature_inputs(self) -> frozenset[str]:
        return frozenset(inspect.signature(self.model.model.get_image_features).parameters)

    @torch.inference_mode()
    def encode_visuals(self, items: Sequence, keep_ratio: float | None = None) -> list[EncodedImage]:
        """PIL images and videos (lists of PIL frames), in order -> one EncodedImage each. Qwen2-VL runs
        the videos through its video path (one forward for all of them); LLaVA encodes every frame as an
        image, in the images' forward, and a video's embeddings are its frames' one after another.
        `keep_ratio`: their own pruning ratio (LLaVA; SLO-adaptive pruning), else the worker's."""
        is_audio = [isinstance(x, np.ndarray) for x in items]  # audio clips (waveforms), beside images (Gemma 4)
        if any(is_audio):
            from mserve.workers.audio_encoding import encode_audio

            clips = iter(EncodedImage(e) for e in encode_audio(self.model, self.family,
                                                               [x for x, a in zip(items, is_audio) if a]))
            visuals = iter(self.encode_visuals([x for x, a in zip(items, is_audio) if not a], keep_ratio))
            return [next(clips) if a else next(visuals) for a in is_audio]
        is_video = [isinstance(x, list) for x in items]
        videos = [x for x, v in zip(items, is_video) if v]
        if self.family.video_as_frames:
            flat = [x for x, v in zip(items, is_video) if not v] + [f for video in videos for f in video]
            encoded = iter(self.encode_images(flat, keep_ratio))
            images = [next(encoded) for v in is_video if not v]
            encoded_videos = [EncodedImage(torch.cat([next(encoded).embeds for _ in video])) for video in videos]
        else:
            images = self.encode_images([x for x, v in zip(items, is_video) if not v], keep_ratio)
            encoded_videos = self.encode_videos(videos)
        image_iter, video_iter = iter(images), iter(encoded_videos)
        return [next(video_iter) if v else next(image_iter) for v in is_video]

    @torch.inference_mode()
    def encode_videos(self, videos: Sequence[Sequence]) -> list[EncodedImage]:
        """Qwen2-VL: videos (lists of PIL frames) -> one embedding tensor each, through get_video_features."""
        if not videos:
            return []
        from mserve.workers.video_processing import qwen_video_inputs

        inputs = qwen_video_inputs(self.image_processor, self.family, videos)
        grid = inputs["video_grid_thw"].to(self.device)
        pixels = inputs["pixel_values_videos"].to(self.device, self.dtype)
        out = self.model.model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grid, return_dict=True)
        grids = [tuple(int(x) for x in g) for g in grid.tolist()]
        embeds = pack([e.reshape(-1, self.hidden_size) for e in out.pooler_output],
                      getattr(out, "deepstack_features", None))
        return [EncodedImage(e.contiguous(), g) for e, g in zip(embeds, grids)]

    @torch.inference_mode()
    def mrope_positions(self, prompt_ids: Sequence[int], grids: Sequence[tuple[int, int, int]],
                        fps: Sequence[float | None] = ()) -> tuple[torch.Tensor, int]:
        """Qwen2-VL 3-D positions of the prompt [3, P] and the rope delta decode adds to text positions.

        `grids` has one (t, h, w) per placeholder run, in prompt order; the run's token says image or video.
        `fps`: each run's sampled frame rate (a video's), for rope indexes that space time by it (Qwen2.5-VL)."""
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        video_id = self.family.video_token_id
        types = (ids == self.family.image_token_id).int() + 2 * (ids == video_id).int() if video_id is not None \
            else (ids == self.family.image_token_id).int()
        kinds = self._item_kinds(prompt_ids, grids)
        image_grids = [g for g, v in zip(grids, kinds) if not v]
        video_grids = [g for g, v in zip(grids, kinds) if v]
        timing = {}
        if video_grids and "second_per_grid_ts" in inspect.signature(self.model.model.get_rope_index).parameters:
            tps = self.family.video_config["temporal_patch_size"]
            rates = [r for r, v in zip(list(fps) or [None] * len(grids), kinds) if v]
            # a float32 tensor, as the processor's BatchFeature hands it to generate()
            timing["second_per_grid_ts"] = torch.tensor([seconds_per_grid(tps, r) for r in rates])
        pos, delta = self.model.model.get_rope_index(
            ids, mm_token_type_ids=types, **timing,
            image_grid_thw=torch.tensor(image_grids, dtype=torch.long) if image_grids else None,
            video_grid_thw=torch.tensor(video_grids, dtype=torch.long) if video_grids else None)
        return pos[:, 0], int(delta.reshape(-1)[0])

    def _item_kinds(self, prompt_ids: Sequence[int], grids: Sequence[tuple[int, int, int]]) -> list[bool]:
        """Whether each item is a video, from its first placeholder run; an item covers the runs its grid's
        tokens fill (a Qwen3-VL video: one run per frame group)."""
        runs, kinds, r = self.family.image_spans(prompt_ids), [], 0
        merge = self.family.video_config["merge_size"] if self.family.video_config else self.family.merge_size
        for t, h, w in grids:
            start = runs[r][0]
            video = prompt_ids[start] == self.family.video_token_id
            need, covered = t * h * w // (merge if video else self.family.merge_size) ** 2, 0
            while covered < need and r < len(runs):
                covered, r = covered + runs[r][1], r + 1
            kinds.append(video)
        return kinds

    # -- prefill / decode step ---------------------------------------------------------------
    def _compile_decode(self):
        """The language model's forward compiled by inductor for decode steps (bench/lab/compile_step.py).

        Decode steps only: a step of single tokens is one attention group of one query each, so its
        graph depends on nothing but the batch size, which is symbolic (dynamic=True; dynamo still
        specialises a batch of 1): two graphs in all. Mixed and prefill steps vary the number and
        shapes of the groups and stay eager (compiled, they gained 1.1x and would recompile per shape).
        Exact-length attention calls SDPA once per distinct context length, a Python loop dynamo would
        specialise on every length: refused."""
        if self.exact_attention:
            raise ValueError("compile: the language model compiles only with padded attention "
                             f"(exact_attention is on for {self.dtype}); use float32 or exact_attention=False")
        return torch.compile(self.language_model.forward, dynamic=True)

    def _positions(self, chunk: ScheduledChunk) -> list[int] | list[list[int]]:
        seq, start, end = chunk.seq, chunk.start, chunk.end
        if not self.family.uses_mrope:
            return list(range(start, end))
        # Prompt tokens take their 3-D M-RoPE positions; generated tokens continue at index + delta.
        pos = [[p + seq.rope_delta for p in range(start, end)] for _ in range(3)]
        prompt_end = min(end, len(seq.prompt_ids))
        if seq.mrope_positions is not None and start < prompt_end:
            head = seq.mrope_positions[:, start:prompt_end].tolist()
            pos = [h + row[prompt_end - start :] for h, row in zip(head, pos)]
        return pos

    def _inputs(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Packed input embeddings [1, T, hidden] (images scattered in), position ids, and the text
        model's DeepStack inputs for the image rows of this step (Qwen3-VL; else {})."""
        ids: list[int] = []
        positions: list = []
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start : c.end])
            positions.append(self._positions(c))
        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        embeds = self.embed_tokens(text_traits.placeholders_as_pad(self.language_model, token_ids,
                                                                   self.family.placeholder_ids)
                                   if self.family.rules.placeholders_read_as_pad else token_ids)
        deepstack = DeepstackRows(self.hidden_size, self.deepstack_layers)
        offset = 0
        for c in chunks:
            for span, image in zip(c.seq.images, c.seq.image_embeds):
                lo, hi = max(c.start, span.start), min(c.end, span.end)
                if lo < hi:
                    dst = offset + lo - c.start
                    rows = image[lo - span.start : hi - span.start]
                    embeds[dst : dst + hi - lo] = rows[:, : self.hidden_size].to(embeds.dtype)
                    if self.deepstack_layers:
                        deepstack.add(dst, rows)
            offset += c.num_tokens
        if self.family.uses_mrope:
            pos = torch.tensor([sum((p[r] for p in positions), []) for r in range(3)], device=self.device)[:, None]
        else:
            pos = torch.tensor(sum(positions, []), device=self.device)[None]
        extra = deepstack.kwargs(len(ids), self.device, embeds.dtype)
        extra.update(text_traits.per_layer_inputs(self.language_model, token_ids, self.family.placeholder_ids))
        return embeds[None], pos, extra

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """One packed forward; returns logits [num completing chunks, vocab] in chunk order."""
        embeds, positions, visual = self._inputs(chunks)
        runs = ([[(span.start, span.end) for span in bidirectional_spans(c.seq.images, c.seq.prompt_ids,
                                                                         self.family.audio_token_id)]
                 for c in chunks] if self.family.bidirectional_images else None)
        batch = PagedBatch.build(self.kv, [(c.seq.block_table.block_ids, c.start, c.num_tokens) for c in chunks],
                                 self.device, image_runs=runs, exact=self.exact_attention,
                                 images_on_sliding_only=self.family.rules.bidirectional_images_sliding_only,
                                 layer_chunks=self.attention_chunks)
        if self.linear_states is not None:
            batch.linear = self.linear_states.rows([(c.seq.request_id, c.start, c.num_tokens) for c in chunks])
        decode = (self._compiled_decode is not None and all(c.num_tokens == 1 for c in chunks)
                  and "deepstack_visual_embeds" not in visual)
        forward = self._compiled_decode if decode else self.language_model
        hidden = forward(inputs_embeds=embeds, position_ids=positions, use_cache=False,
                                     mserve_batch=batch, **visual).last_hidden_state[0]
        last_rows, offset = [], 0
        for c in chunks:
            offset += c.num_tokens
            if c.completes_sequence:
                last_rows.append(offset - 1)
        if not last_rows:
            return hidden.new_empty((0, self.model.config.text_config.vocab_size))
        rows = hidden[torch.tensor(last_rows, device=self.device)]
        cap = getattr(self.model.config.text_config, "final_logit_softcapping", None)
        return text_traits.softcapped(self.model.lm_head(rows), cap).float()
