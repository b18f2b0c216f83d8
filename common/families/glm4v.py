"""GLM-4.1V / GLM-4.6V: an image's patch grid by GLM's own smart_resize, and no video yet.

GLM's image processor sizes an image as a clip of temporal_patch_size frames (its pixel budget covers
both copies) and scales images smaller than one merged patch up, where Qwen's smart_resize does
neither: the same token count can come from another (h, w) split, and M-RoPE places the image's rows
and columns by that split. A grid read before decoding (a prefix-cache skip) is therefore computed
here by transformers' own glm4v smart_resize, with the processor's own settings, as its
get_number_of_image_patches does. A video becomes per-frame image-token runs with timestamps as text
(Glm4vProcessor.replace_video_token), which mserve does not build: videos are refused at admission.
"""

from __future__ import annotations

from typing import Any

from mserve.common.families import FamilyRules


def image_grid(processor: Any, image_size: tuple[int, int]) -> tuple[int, int, int]:
    """(t, h, w) patch grid of one image of (width, height), as Glm4vImageProcessorPil resizes it."""
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    ip = processor.image_processor
    width, height = image_size
    h, w = smart_resize(num_frames=ip.temporal_patch_size, height=height, width=width,
                        factor=ip.patch_size * ip.merge_size, min_pixels=ip.size["shortest_edge"],
                        max_pixels=ip.size["longest_edge"])
    return 1, h // ip.patch_size, w // ip.patch_size


RULES = FamilyRules(
    image_grid=image_grid,
    no_video="GLM-4V video (each frame an image-token run followed by its timestamp as text) is not built by "
             "mserve yet",
)
