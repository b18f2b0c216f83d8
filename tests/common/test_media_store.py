"""The media store on its own: a shared transfer any receiver pulls again and again, the facts checked on
every pull, a released item refused clearly, and the GENERATE body that carries refs instead of bytes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from mserve.common.images import image_hash
from mserve.common.media_store import MediaError, MediaStore, pull_media
from mserve.common.security import CurveKeys
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
            assert pull_media(receiver, ref, 5.0) == image
        wait_for(lambda: store.stats()["served"] == 3, what="the three pulls counted (shm acks come async)")


def test_bytes_that_do_not_match_the_facts_fail_clearly(tmp_path):
    image = make_image(64, 48, seed=2)
    with MediaStore() as store, TransferEngine("enc") as enc:
        ref = store.put_image(image)
        for lie, said in (({"size": [32, 32]}, "size=32x32"), ({"hash": "0" * 32}, "their hash is")):
            with pytest.raises(MediaError, match=f"do not match its header facts.*{said}"):
                pull_media(enc, dataclasses.replace(ref, **lie), 5.0)
        with pytest.raises(MediaError, match=f"not a media store item of {len(image) + 1} bytes"):
            pull_media(enc, dataclasses.replace(ref, nbytes=len(image) + 1), 5.0)  # refused before pulling
        elsewhere = dataclasses.replace(ref, source={**ref.source, "host_id": "another-host/1"})
        with pytest.raises(MediaError, match="bound on a loopback address of another host: .*--media-store-host") as e:
            pull_media(enc, elsewhere, 5.0)  # a gateway's default store, seen by a worker on another host
        assert "holder is gone" not in str(e.value)  # each cause its own words: the holder is fine here
        with TransferEngine("enc-curve", curve=CurveKeys(*zmq.curve_keypair(), authorized=tmp_path)) as curve_enc:
            with pytest.raises(MediaError, match="the store has no CURVE keys.*--media-store-host none") as e:
                pull_media(curve_enc, ref, 5.0)
            assert "holder is gone" not in str(e.value)
        store.engine.release(ref.source["id"])  # the holder dropped it
        with pytest.raises(MediaError, match=f"image {ref.hash} in the media store at .* could not be pulled"):
            pull_media(enc, ref, 5.0)


def test_generate_carries_refs_not_bytes():
    image = make_image(512, 512, seed=3)
    inline = generate_body("r", chat("what is it?", [image]), False)
    with MediaStore() as store:
        stored = store.store_messages(inline)
    part = stored["messages"][0]["content"][0]
    assert part["type"] == "image" and set(part["media"]) >= {"hash", "nbytes", "size", "source"}
    assert len(msgpack.packb(inline)) > len(image) > 40 * len(msgpack.packb(stored))


def test_audio_and_video_files_carry_their_header_facts_and_are_checked_on_pull():
    """A clip's sample rate and samples, a video file's size, frames and rate: read once by the store,
    counted by admission, read again from the pulled bytes; a ref that says otherwise fails by the fact."""
    from tests.audio_clips import make_audio
    from tests.helpers import make_frames, make_video_file

    clip = make_audio(24000, 22050, "flac", seed=7)
    video = make_video_file(make_frames(64, 48, 3), fps=2)
    with MediaStore() as store, TransferEngine("enc") as enc:
        audio_ref, video_ref = store.put(clip, "audio"), store.put(video, "video")
        assert (audio_ref.kind, audio_ref.sample_rate, audio_ref.samples) == ("audio", 22050, 24000)
        assert (video_ref.kind, video_ref.size, video_ref.frames, video_ref.fps) == ("video", [64, 48], 3, 2.0)
        assert pull_media(enc, audio_ref, 5.0) == clip and pull_media(enc, video_ref, 5.0) == video
        with pytest.raises(MediaError, match="its samples is 24000, the request said samples=12000"):
            pull_media(enc, dataclasses.replace(audio_ref, samples=12000), 5.0)
        with pytest.raises(MediaError, match="its frames is 3, the request said frames=30"):
            pull_media(enc, dataclasses.replace(video_ref, frames=30), 5.0)
        body = store.store_messages(generate_body("r", [{"role": "user", "content": [
            {"type": "audio", "audio": clip}, {"type": "video", "video": video}, {"type": "text", "text": "?"}]}], False))
        assert [p.get("media", {}).get("kind") for p in body["messages"][0]["content"]] == ["audio", "video", None]
        assert store.published == 2  # the same bytes again: the held items' refs


OWNER = """
import json, sys, time
from mserve.common.media_store import MediaStore
from tests.helpers import make_image
store = MediaStore(backend=sys.argv[1])  # auto: each item in an shm segment named after this process
for seed in (9, 11):
    print(json.dumps(store.put_image(make_image(80, 60, seed=seed)).fields()), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def killable_owner(backend: str):
    """A process holding a store of two items: (kill -9 of it and its process group, the two items' refs)."""
    from mserve.common.protocol.client import MediaRef

    owner = subprocess.Popen([sys.executable, "-c", OWNER, backend], stdout=subprocess.PIPE, text=True,
                             start_new_session=True, cwd=os.path.dirname(__file__) + "/../..")

    def kill() -> None:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(10)
        wait_for(lambda: not os.path.exists(f"/proc/{owner.pid}"), what="the owner gone")

    try:
        yield kill, [MediaRef.from_body(json.loads(owner.stdout.readline())) for _ in range(2)]
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait(10)


def test_a_killed_stores_segments_are_swept():
    """kill -9 of a store's process (its resource tracker with it: the process group) leaves its segments
    in /dev/shm; a worker that pulls from it finds the owner gone and sweeps (the pull still gets the
    bytes), as the next transfer engine started on the host would (tests/common/test_transfer_pool.py); a
    live store's segment stays. The dead store's other item, swept with it, then fails at once by that
    cause, not after a timeout spent waiting for its tcp."""
    from tests.common.test_transfer_pool import on_disk

    with killable_owner("auto") as (kill, (ref, other)), MediaStore() as live, TransferEngine("enc") as enc:
        mine = live.put_image(make_image(32, 32, seed=10)).source["shm"]
        assert on_disk(ref.source["shm"]) and on_disk(other.source["shm"]) and on_disk(mine)
        kill()
        assert on_disk(ref.source["shm"]), "nothing unlinked it: the process was killed outright"
        assert pull_media(enc, ref, 5.0) == make_image(80, 60, seed=9)  # the bytes, then the sweep
        assert not on_disk(ref.source["shm"]) and not on_disk(other.source["shm"]) and on_disk(mine)
        t0 = time.monotonic()
        with pytest.raises(MediaError, match=f"image {other.hash} .* its sender's process is gone and its "
                                             "shared memory segment .* was swept"):
            pull_media(enc, other, 5.0)
        assert time.monotonic() - t0 < 1.0


def test_a_store_that_ran_out_a_pulls_timeout_fails_the_next_pulls_at_once():
    """A killed tcp store: the first pull waits out its timeout; the store's next item fails at once, naming
    why, instead of holding the worker for another timeout (a killed holder's requests, one after another)."""
    with killable_owner("tcp") as (kill, (ref, other)), TransferEngine("enc") as enc:
        kill()
        t0 = time.monotonic()
        with pytest.raises(MediaError, match=f"image {ref.hash} .* could not be pulled .*cannot connect"):
            pull_media(enc, ref, 1.0)
        t1 = time.monotonic()
        with pytest.raises(MediaError, match=f"image {other.hash} .*\\(its holder is gone\\?\\): a pull from its "
                                             "store ran out its timeout 0 s ago"):
            pull_media(enc, other, 1.0)
        assert t1 - t0 >= 0.9 and time.monotonic() - t1 < 0.2
