"""scheduler.py's pieces of a prompt, and the scheduler run round by round in this process (the server's tests,
test_server.py, drive it end to end: slots, queue, cancellation, batched against alone)."""

import asyncio

import pytest

from jaxinfer import engine
from jaxinfer.sampling import SamplingParams
from jaxinfer.scheduler import PREFILL_CHUNKS, Event, Job, Scheduler, prefill_pieces
from jaxinfer.serving import Parser
from jaxinfer.synthetic import SyntheticSpec, write_model


@pytest.mark.parametrize("n_prompt", [1, 7, 8, 15, 16, 17, 40, 70, 255, 256, 300, 1000, 1007])
@pytest.mark.parametrize("cache_len", [1024, 1040, 1008])
def test_prefill_pieces_cover_the_prompt_in_compiled_sizes_within_the_cache(n_prompt, cache_len):
    pieces = prefill_pieces(n_prompt, 0, cache_len)
    offsets = [offset for offset, _ in pieces]
    assert offsets[0] == 0 and all(size in PREFILL_CHUNKS for _, size in pieces)
    assert all(b - a == size for (a, size), b in zip(pieces, offsets[1:]))  # consecutive, no gap or overlap
    last_offset, last_size = pieces[-1]
    assert last_offset < n_prompt <= last_offset + last_size  # the last piece ends the prompt, padded
    assert last_offset + last_size <= cache_len  # padding never reaches past the cache
    assert sum(size for _, size in pieces) < n_prompt + PREFILL_CHUNKS[0]  # less than one small piece of padding


def test_a_prompt_near_the_end_of_the_cache_takes_smaller_pieces():
    # 1000 tokens in a 1008-position cache: 3 x 256, then 232 left, of which a 256-token piece would pass the end,
    # and so on down.
    assert prefill_pieces(1000, 0, 1008) == [(0, 256), (256, 256), (512, 256), (768, 128), (896, 64), (960, 32),
                                             (992, 16)]
    assert prefill_pieces(70, 0, 1024) == [(0, 64), (64, 16)]  # not one 128-token piece, 58 of them padding


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return engine.load_model(write_model(str(tmp_path_factory.mktemp("scheduler") / "tiny.gguf"),
                                        SyntheticSpec(n_ctx=256)))


def drain(loop, job) -> list[Event]:
    """The events the scheduler has sent `job` so far (its sends are callbacks on `loop`)."""
    loop.run_until_complete(asyncio.sleep(0))
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    return events


def run_until_idle(scheduler: Scheduler):
    for _ in range(100):
        scheduler.run_round(wait=False)
        if not any(scheduler.slots) and scheduler.waiting.empty():
            return
    raise AssertionError("the scheduler did not finish its requests in 100 rounds")


@pytest.mark.slow
def test_a_failing_round_ends_its_requests_with_an_error_and_the_scheduler_serves_on(tiny, capsys):
    """A bug in a round (here the decode program raising) reaches each request in a slot as an error event, frees
    every slot, and the next request is served as if nothing happened."""
    scheduler = Scheduler(tiny, n_slots=2, slot_ctx=64, max_waiting=4)
    scheduler.warm_up()
    loop = asyncio.new_event_loop()
    parser = Parser(tiny, "tiny.gguf", 64)

    def job(prompt):
        return Job(parser.completion({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}), loop)

    def broken(*args):
        raise RuntimeError("the program failed")

    programs = scheduler.decode
    scheduler.decode = dict.fromkeys(programs, broken)
    cut_short = [job("hello the"), job("abc")]
    for one in cut_short:
        scheduler.submit(one)
    run_until_idle(scheduler)
    for one in cut_short:
        assert [event.error for event in drain(loop, one)][-1] == "internal error (RuntimeError)"
    assert "the program failed" in capsys.readouterr().err
    assert scheduler.metrics()["busy_slots"] == 0

    scheduler.decode = programs
    served = job("hello the")
    scheduler.submit(served)
    run_until_idle(scheduler)
    events = drain(loop, served)
    expected = list(engine.generate_tokens(tiny, served.request.prompt_ids, 8, 64, SamplingParams(temperature=0),
                                           seed=0, stop_ids=frozenset()))
    assert "".join(event.text for event in events) == tiny.tokenizer.decode(expected)
    assert events[-1].finish_reason == "length" and events[-1].usage["completion_tokens"] == 8
    loop.close()


def test_a_request_past_its_time_limit_ends_with_length_and_end_all_answers_503(tiny):
    """max_request_s (--request_timeout): a request that would generate for longer ends with finish_reason "length"
    and the text so far; end_all (a shutdown's time up) ends what generates and what waits with a 503 error."""
    scheduler = Scheduler(tiny, n_slots=1, slot_ctx=256, max_waiting=4, max_request_s=0.0)
    scheduler.warm_up()
    loop = asyncio.new_event_loop()
    parser = Parser(tiny, "tiny.gguf", 256)
    body = {"prompt": "abc", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    limited = Job(parser.completion(body), loop)
    scheduler.submit(limited)
    run_until_idle(scheduler)
    events = drain(loop, limited)
    assert events[-1].finish_reason == "length" and 0 < events[-1].usage["completion_tokens"] < 200

    scheduler.max_request_s = None
    generating, waiting = Job(parser.completion(body), loop), Job(parser.completion(body), loop)
    scheduler.submit(generating)
    scheduler.run_round(wait=False)
    scheduler.submit(waiting)
    scheduler.end_all()
    run_until_idle(scheduler)
    for job in (generating, waiting):
        last = drain(loop, job)[-1]
        assert (last.error, last.status) == ("the server is shutting down", 503)
    assert scheduler.metrics()["busy_slots"] == 0
    loop.close()
