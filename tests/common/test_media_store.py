"""The media store on its own: a shared transfer any receiver pulls again and again, the facts checked on
every pull, a released item refused clearly, and the GENERATE body that carries refs instead of bytes."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from mserve.common.images import image_hash
from mserve.common.media_store import MediaError, MediaStore, pull_image
from mserve.common.transfer.engine import TransferEngine
from mserve.coordinator.client_core import generate_body
from tests.helpers import chat, make_image, wait_for


@pytest.mark.parametrize("backend", ["auto", "tcp"])
def test_an_item_is_pulled_by_any_receiver_any_number_of_times(backend):
    image = make_image(64, 48, seed=1)
    with MediaStore(backend=backend) as store, TransferEngine("enc-a") as a, TransferEngine("enc-b") as b:
        ref = store.put_image(image)
        assert (ref.hash, ref.nbytes, ref.size) == (image_hash(image), len(image), [64, 48])
        assert store.put_image(image) is ref and store.published == 1  # a held item is not staged again
        for receiver in (a, b, a):  # a retry, another encoder, the first again
            assert pull_image(receiver, ref, 5.0) == image
        wait_for(lambda: store.stats()["served"] == 3, what="the three pulls counted (shm acks come async)")


def test_bytes_that_do_not_match_the_facts_fail_clearly():
    image = make_image(64, 48, seed=2)
    with MediaStore() as store, TransferEngine("enc") as enc:
        ref = store.put_image(image)
        for lie, said in (({"size": [32, 32]}, "size=32x32"), ({"hash": "0" * 32}, "their hash is")):
            with pytest.raises(MediaError, match=f"do not match its header facts.*{said}"):
                pull_image(enc, dataclasses.replace(ref, **lie), 5.0)
        with pytest.raises(MediaError, match=f"not a media store item of {len(image) + 1} bytes"):
            pull_image(enc, dataclasses.replace(ref, nbytes=len(image) + 1), 5.0)  # refused before pulling
        store.engine.release(ref.source["id"])  # the holder dropped it
        with pytest.raises(MediaError, match=f"image {ref.hash} in the media store at .* could not be pulled"):
            pull_image(enc, ref, 5.0)


def test_generate_carries_refs_not_bytes():
    image = make_image(512, 512, seed=3)
    inline = generate_body("r", chat("what is it?", [image]), False)
    with MediaStore() as store:
        stored = store.store_messages(inline)
    part = stored["messages"][0]["content"][0]
    assert part["type"] == "image" and set(part["media"]) >= {"hash", "nbytes", "size", "source"}
    assert len(msgpack.packb(inline)) > len(image) > 40 * len(msgpack.packb(stored))
