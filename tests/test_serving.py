"""serving.TextAssembler on the synthetic byte-level vocabulary, where every multi-byte character is split over
tokens (the server's own tests, test_server.py, cover requests, responses and the worker end to end)."""

import pytest

from jaxinfer import engine
from jaxinfer.serving import TextAssembler

TEXT = "héllo wörld ✓ the end"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from jaxinfer.synthetic import write_model

    return engine.load_model(write_model(str(tmp_path_factory.mktemp("serving") / "tiny.gguf"))).tokenizer


def assemble(tokenizer, text, stop):
    """(pieces released token by token, the tail released at the end, whether a stop string ended it)."""
    assembler = TextAssembler(tokenizer, stop)
    pieces = []
    for token in tokenizer.encode(text):
        pieces.append(assembler.add(token))
        if assembler.stopped:
            break
    return pieces, assembler.finish(), assembler.stopped


def test_released_text_is_the_whole_decode_and_never_half_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # é, ö and ✓ span several byte tokens
    pieces, tail, stopped = assemble(tokenizer, TEXT, [])
    assert "".join(pieces) + tail == TEXT and not stopped
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("stop, expected", [
    (["wörld"], "héllo "),  # spans tokens, and starts with a multi-byte character's word
    (["✓"], "héllo wörld "),  # a stop string that is itself split over tokens
    (["xyz", "ll"], "hé"),  # the earliest of several
    (["the"], "héllo wörld ✓ "),  # "the" is one merged token
])
def test_stop_strings_end_the_text_before_them(tokenizer, stop, expected):
    pieces, tail, stopped = assemble(tokenizer, TEXT, stop)
    assert stopped and "".join(pieces) + tail == expected


def test_a_possible_stop_string_start_is_held_back_until_decided(tokenizer):
    assembler = TextAssembler(tokenizer, ["end!"])
    released = "".join(assembler.add(t) for t in tokenizer.encode("the end"))
    assert released == "the "  # "end" could still become "end!"
    assert assembler.finish() == "end" and not assembler.stopped
