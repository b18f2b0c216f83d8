"""lab.wire_codecs' messages round-trip to equal typed messages through today's codec, and the fast path of
typed.py's parse (a value of the field's exact type skips its check) still refuses what the check refuses."""

import pytest

from lab.wire_codecs import messages, today
from mserve.common.protocol.core import MsgType, ProtocolError
from mserve.common.protocol.to_coordinator import TO_COORDINATOR
from mserve.common.protocol.typed import parse_message


def test_each_message_comes_back_equal():
    for _name, msg, accepted, _to_struct in messages(image_kib=4):
        assert today(int(msg.KIND), msg, accepted)() == msg


@pytest.mark.parametrize("item, error", [
    ({"request_id": "r", "attempt": True, "token_ids": [1]}, "STEP_TOKENS.items[0].attempt: expected an integer"),
    ({"request_id": 7, "attempt": 1, "token_ids": [1]}, "STEP_TOKENS.items[0].request_id: expected a string"),
    ({"request_id": "r", "token_ids": [1]}, "STEP_TOKENS.items[0]: missing field attempt"),
    ({"request_id": "r", "attempt": 1, "token_ids": [1], "first": 1}, "STEP_TOKENS.items[0].first: expected a boolean"),
])
def test_a_wrong_field_is_named(item, error):
    with pytest.raises(ProtocolError, match=error.replace("[", r"\[").replace("]", r"\]")):
        parse_message(MsgType.STEP_TOKENS, {"v": 1, "items": [item]}, TO_COORDINATOR)
