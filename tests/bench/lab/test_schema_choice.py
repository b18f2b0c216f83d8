"""lab.schema_choice's msgspec Structs read what today's encoder writes for its three messages, today's reader reads
what they write back (the same message), and a bad input is refused at the same field path by both."""

import msgpack
import pytest

pytest.importorskip("msgspec")  # not a dependency: the lab measurement's own

from lab.schema_choice import ACCEPTED, KINDS, bad_inputs, frame, samples, typed_decoder, verdict  # noqa: E402
from lab.schema_structs import msgspec_decoder, msgspec_schema  # noqa: E402
from mserve.common.protocol import MsgType, parse_message  # noqa: E402


def test_structs_and_typed_py_read_each_other_s_bytes_as_the_same_message():
    import msgspec

    structs, msgs = msgspec_schema(), samples(items=4)
    for kind in KINDS:
        decoded = msgspec_decoder(structs, kind)(frame(msgs[kind]))
        struct = decoded[0] if kind == "GENERATE" else decoded
        back = msgpack.unpackb(msgspec.msgpack.encode(struct), raw=False)
        assert parse_message(int(MsgType[kind]), back, ACCEPTED[kind]) == msgs[kind], kind


def test_a_bad_input_is_refused_at_the_same_field_path():
    structs, msgs = msgspec_schema(), samples(items=4)
    for what, kind, body in bad_inputs(msgs):
        today, ours = verdict(typed_decoder(kind), body), verdict(msgspec_decoder(structs, kind), body)
        if what in ("unknown key",):
            assert today == ours == "accepted"
        elif what == "out of bounds":  # the wire does not check sampling bounds today (admission does)
            assert today == "accepted" and ours.startswith("GENERATE.")
        elif what != "schema version":
            assert today.split(": ")[0] == ours.split(": ")[0], (today, ours)
