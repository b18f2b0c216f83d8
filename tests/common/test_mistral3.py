"""Mistral 3 (Pixtral vision): an image is rows of [IMG] tokens with [IMG_BREAK] / [IMG_END] between and
after them, and admission, the prompt and the vision tower all agree with transformers on every size."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from mserve.common.prompt import PromptBuilder
from tests.helpers import chat, make_image

SIZES = [(64, 48), (300, 200), (500, 120), (120, 300), (168, 168), (1000, 30), (17, 301), (100, 90),
         (200, 3)]  # (w, h); 3 px high: channels must not be guessed from the shape


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["mistral3"])


@pytest.fixture(scope="module")
def builder(model_dir) -> PromptBuilder:
    return PromptBuilder(model_dir)


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def test_prompt_ids_are_the_processors_own_expansion(builder):
    """The whole prompt, rows and separators included, is what PixtralProcessor.__call__ makes of the
    rendered template (tokenized without special tokens, as apply_chat_template does)."""
    processor = builder.family.processor
    for k in range(3):
        images = [make_image(*SIZES[(k + j) % len(SIZES)], seed=10 * k + j) for j in range(k)]
        pp = builder.prepare(chat("Describe the picture.", images))
        ours = processor(text=[pp.text], images=[pil(b) for b in images] or None, add_special_tokens=False,
                         return_tensors="pt")["input_ids"][0].tolist()
        assert pp.prompt_ids == ours
        assert pp.prompt_ids[0] == builder.tokenizer.bos_token_id and pp.prompt_ids.count(builder.tokenizer.bos_token_id) == 1


def test_admission_count_is_the_processors_and_the_towers(builder, model_dir):
    """visual_token_count (admission, from the header) == [IMG] tokens the processor places == feature rows
    the model's own vision tower and projector give, for images of many shapes; the rows are image rows."""
    from transformers import AutoModelForImageTextToText

    family, processor = builder.family, builder.family.processor
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    counts = []
    for w, h in SIZES:
        image = pil(make_image(w, h))
        count = family.visual_token_count((w, h))
        ids = processor(text=["[IMG]"], images=[image], return_tensors="pt")["input_ids"][0].tolist()
        assert ids.count(family.image_token_id) == count
        with torch.inference_mode():
            features = model.model.get_image_features(**family.image_inputs([image]), return_dict=True)
        assert features.pooler_output[0].shape[0] == count
        placeholder = family.image_placeholder((w, h))
        rows = placeholder.count(processor.image_break_token_id) + 1
        assert placeholder[-1] == processor.image_end_token_id and count % rows == 0
        assert len(family.image_spans(placeholder)) == rows  # one run of [IMG] per row
        assert placeholder == ids[1:]  # the processor's own layout of this very image (after its BOS)
        counts.append(count)
    assert len(set(counts)) >= 6  # the sizes really exercise the resize rule


def test_multi_image_prompt_spans_cover_each_image_row_by_row(builder):
    from mserve.common.hashing import item_spans

    sizes = [(300, 200), (17, 301)]
    pp = builder.prepare(chat("Compare them.", [make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]))
    counts = [builder.family.visual_token_count(s) for s in sizes]
    spans = item_spans(builder.family.image_spans(pp.prompt_ids), [("a", counts[0]), ("b", counts[1])])
    assert [s.image_hash.split("/")[0] for s in spans] == ["a"] * 4 + ["b"] * 6  # 4 rows, then 6 rows
    assert sum(s.length for s in spans) == sum(counts) == pp.prompt_ids.count(builder.family.image_token_id)


def test_a_video_is_refused_naming_the_family(builder):
    from tests.helpers import make_frames

    video = [{"role": "user", "content": [{"type": "video", "video": make_frames(56, 56, 2)},
                                          {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(ValueError, match="model_type mistral3 takes no video"):
        builder.prepare(video)


# ---- admission: exact prompt length, and bad input named -----------------------------------------------

def _generate(content) -> dict:
    return {"request_id": "r1", "messages": [{"role": "user", "content": content}]}


def test_admission_counts_rows_and_separators_exactly(builder):
    """An image's visual tokens are its [IMG] tokens; the prompt length (what max_prompt_tokens limits)
    counts the [IMG_BREAK] / [IMG_END] tokens too, exactly as the processor places them."""
    from mserve.coordinator.admission import AdmissionError, Limits, admit

    content = [{"type": "image", "image": make_image(300, 200, seed=1)},
               {"type": "image", "image": make_image(17, 301, seed=2)}, {"type": "text", "text": "Compare."}]
    admitted = admit(builder, Limits(), _generate(content))
    assert [im.num_tokens for im in admitted.images] == [24, 6]  # 6x4 and 1x6 merged patches
    assert admitted.prompt_ids.count(builder.family.image_token_id) == admitted.visual_tokens == 30
    n = len(admitted.prompt_ids)
    assert admit(builder, Limits(max_prompt_tokens=n), _generate(content)).prompt_ids == admitted.prompt_ids
    with pytest.raises(AdmissionError, match=f"prompt is {n} tokens \\(30 visual\\), over the limit max_prompt_tokens={n - 1}"):
        admit(builder, Limits(max_prompt_tokens=n - 1), _generate(content))


def test_admission_refuses_too_many_images_and_a_video_naming_why(builder):
    from mserve.coordinator.admission import AdmissionError, Limits, admit
    from tests.helpers import make_frames

    three = [{"type": "image", "image": make_image(20, 20, seed=i)} for i in range(3)]
    with pytest.raises(AdmissionError, match="3 images is over the limit max_images_per_request=2"):
        admit(builder, Limits(max_images_per_request=2), _generate(three))
    video = [{"type": "video", "video": make_frames(56, 56, 2)}, {"type": "text", "text": "What happens?"}]
    with pytest.raises(AdmissionError, match=r"video 0: model_type mistral3 takes no video \(its processor"):
        admit(builder, Limits(), _generate(video))


def test_a_sliding_window_text_model_is_refused_at_load(model_dir, tmp_path):
    import json
    import shutil

    from mserve.common.model import load_family
    from mserve.common.processor import UnsupportedModelError

    for name in ("config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_dir}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["sliding_window"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"^model_type 'mistral3': this checkpoint needs sliding-window "
                                                    r"attention \(text_config.sliding_window=4096\)$"):
        load_family(tmp_path)
