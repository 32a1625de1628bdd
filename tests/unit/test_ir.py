"""Schedule IR: every action kind round-trips through its text form; bad text is refused."""
import pytest

from megatron.plugin.pipeline.ir import Action, Kind, format_schedule, parse, parse_schedule

EXAMPLES = [
    Action(0, Kind.FORWARD, 3),
    Action(1, Kind.BACKWARD, 0),
    Action(0, Kind.WEIGHT, 3),
    Action(2, Kind.RECOMPUTE, 7, "[0:2]"),
    Action(0, Kind.FORWARD, 3, "[0:2]"),
    Action(2, Kind.FORWARD, 1, ".attn"),
    Action(0, Kind.SEND_F, 3, None, 1),
    Action(1, Kind.RECV_F, 3, None, 0),
    Action(1, Kind.SEND_B, 3, None, 0),
    Action(0, Kind.RECV_B, 3, None, 1),
    Action(0, Kind.SEND_F, 12, ".post", 3, "qkv_weight"),
    Action(0, Kind.OFFLOAD, 2),
    Action(0, Kind.RELOAD, 2, "[1:3]"),
    Action(1, Kind.ATTN_F, 0, ".l4", 2),
    Action(1, Kind.ATTN_B, 0, ".l4", 2),
]


def test_every_kind_has_an_example():
    assert {a.kind for a in EXAMPLES} == set(Kind)


@pytest.mark.parametrize("action", EXAMPLES, ids=str)
def test_text_form_round_trips(action):
    assert parse(str(action)) == action
    assert hash(parse(str(action))) == hash(action)


def test_text_forms_read_as_documented():
    assert str(Action(0, Kind.SEND_F, 3, None, 1)) == "0SEND_F3>1"
    assert str(Action(1, Kind.RECV_F, 3, None, 0)) == "1RECV_F3<0"
    assert str(Action(0, Kind.FORWARD, 3, "[0:2]")) == "0F3[0:2]"
    assert parse("0F3[0:2]").layer_range() == (0, 2)
    assert str(Action(0, Kind.WEIGHT, 3)) == "0W3" and parse("0W3").kind is Kind.WEIGHT


def test_schedule_round_trips():
    schedule = [[EXAMPLES[0], EXAMPLES[5]], [EXAMPLES[6], EXAMPLES[1]]]
    text = format_schedule(schedule)
    assert text.splitlines()[0].startswith("0: 0F3 ")
    assert parse_schedule(text) == schedule


@pytest.mark.parametrize("text", ["", "F3", "0X3", "0SEND_F3<1", "1RECV_F3>0", "0F3[a:b]",
                                  "0F-1"])
def test_bad_text_is_refused(text):
    with pytest.raises(ValueError):
        parse(text)


def test_bad_actions_are_refused():
    with pytest.raises(ValueError, match="needs a peer"):
        Action(0, Kind.SEND_F, 1)
    with pytest.raises(ValueError, match="only transfers"):
        Action(0, Kind.FORWARD, 1, None, 2)
    with pytest.raises(ValueError, match="part"):
        Action(0, Kind.FORWARD, 1, "0:2")


def test_transfer_key_pairs_send_and_receive():
    send, recv = parse("0SEND_F3>1"), parse("1RECV_F3<0")
    assert send.transfer_key() == recv.transfer_key()
    assert parse("1SEND_B3>0").transfer_key() != parse("1RECV_F3<0").transfer_key()
    with pytest.raises(ValueError):
        parse("0F3").transfer_key()
