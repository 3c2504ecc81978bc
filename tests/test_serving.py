"""serving.TextAssembler on the synthetic byte-level vocabulary, where every multi-byte character is split over
tokens (the server's own tests, test_server.py, cover requests, responses and the worker end to end)."""

import random
import time

import pytest

from jaxinfer import engine
from jaxinfer.serving import MAX_STOP_CHARS, MAX_STOP_STRINGS, StopMatcher, TextAssembler

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


def naive_stop(text: str, stop: list[str]) -> tuple[int | None, int]:
    """(the start of the earliest stop string in `text`, the longest end of it that begins one), the slow way."""
    found = [i for s in stop if (i := text.find(s)) >= 0]
    held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return min(found, default=None), held


def test_stop_matcher_agrees_with_a_naive_search_on_random_texts():
    """Fed piece by piece, the matcher finds what str.find finds on the whole text (while nothing was found before)
    and holds back what the slow check would."""
    rng = random.Random(0)
    for _ in range(500):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        matcher, end = StopMatcher(stop), 0
        while end < len(text):
            end = min(len(text), end + rng.randint(1, 4))
            found = matcher.feed(text[:end])
            expected_found, expected_held = naive_stop(text[:end], stop)
            # Matches ending in this piece: the earliest start among them is the earliest of the whole text.
            assert found == expected_found, (stop, text[:end])
            if found is not None:
                break
            assert matcher.held == expected_held, (stop, text[:end])


def test_the_longest_stop_strings_cost_each_token_little(tokenizer):
    """MAX_STOP_STRINGS stop strings of MAX_STOP_CHARS characters that the text keeps almost matching: the check
    runs on the thread that generates for every slot, and used to cost the square of their length per token (a
    400,000-character one: seconds per token, for every client)."""
    stop = ["a" * (MAX_STOP_CHARS - 1) + "b"] * MAX_STOP_STRINGS
    ids = tokenizer.encode("a" * 3000)
    assembler = TextAssembler(tokenizer, stop)
    start = time.perf_counter()
    released = "".join(assembler.add(token) for token in ids)
    elapsed = time.perf_counter() - start
    assert released + assembler.finish() == "a" * 3000 and not assembler.stopped
    assert len(released) == 3000 - (MAX_STOP_CHARS - 1)  # a possible start of the stop string is held back
    assert elapsed < 1.0, f"{len(ids)} tokens took {elapsed:.2f} s"
