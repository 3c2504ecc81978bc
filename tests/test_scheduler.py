"""scheduler.py's pieces of a prompt, and the scheduler run round by round in this process (the server's tests,
test_server.py, drive it end to end: slots, queue, cancellation, batched against alone)."""

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import engine, model
from jaxinfer.sampling import SamplingParams
from jaxinfer.prompt_cache import MIN_REUSE, PromptCache
from jaxinfer.scheduler import PREFILL_CHUNKS, Event, Job, Scheduler, cached_start, prefill_pieces
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


@pytest.mark.parametrize("common", [0, 1, 5, 16, 37, 299, 300, 996, 997, 1000])
@pytest.mark.parametrize("n_prompt", [300, 1000])
def test_a_cached_prefix_starts_the_prefill_where_its_pieces_fit(common, n_prompt):
    cache_len = 1008
    start = cached_start(common, n_prompt, cache_len)
    assert start <= min(common, n_prompt - 1) and start > min(common, n_prompt - 1) - PREFILL_CHUNKS[0]
    pieces = prefill_pieces(n_prompt, start, cache_len)
    assert pieces[0][0] == start and pieces[-1][0] + pieces[-1][1] <= cache_len
    if start % PREFILL_CHUNKS[0]:  # the whole prefix was reused: only where its pieces fit
        assert start == min(common, n_prompt - 1)


def test_a_request_goes_to_the_row_holding_its_longest_prefix_else_to_the_least_recently_used():
    cache = PromptCache(4)
    prompt = list(range(100, 100 + 2 * MIN_REUSE))
    cache.keep(2, prompt[:MIN_REUSE + 3] + [7, 7])
    cache.keep(0, [1] * 40)
    cache.keep(3, prompt[:MIN_REUSE - 1])  # too short a prefix to be worth its row
    assert cache.choose([0, 1, 2, 3], prompt) == 2 and cache.common(2, prompt) == MIN_REUSE + 3
    assert cache.choose([0, 1, 3], prompt) == 1  # never used
    assert cache.choose([0, 3], prompt) == 0  # used before row 3
    cache.swap(2, 1)
    assert cache.choose([0, 1, 2, 3], prompt) == 1 and cache.common(2, prompt) == 0
    cache.clear()
    assert cache.common(1, prompt) == 0


def test_a_prefill_from_a_cached_prefix_gives_the_logits_of_the_whole_prompt(tiny):
    """What keeps the prompt cache exact: a row holding a prompt's first tokens (prefilled in pieces of their own),
    prefilled from there, gives the logits that prefilling the whole prompt gives: to float rounding where the pieces
    fall elsewhere, bit for bit where they fall where the whole prompt's do."""
    ids = tiny.tokenizer.encode(" ".join(["the hall of 1 2 3"] * 6))
    cache_len = 256

    def prefill(ids, cache, start):
        cache = model.KVCache(cache.k, cache.v, jnp.array([start], jnp.int32))
        for offset, size in prefill_pieces(len(ids), start, cache_len):
            piece = np.zeros((1, size), np.int32)
            piece[0, :len(ids[offset:offset + size])] = ids[offset:offset + size]
            logits, cache = model.prefill(piece, len(ids[offset:offset + size]), tiny.weights, cache, tiny.config)
        return np.asarray(logits), cache

    whole, _ = prefill(ids, model.init_cache(tiny.config, 1, cache_len), 0)
    assert prefill_pieces(len(ids), 0, cache_len)[1][0] == 64
    for prefix in (20, 37, 64):
        _, cache = prefill(ids[:prefix], model.init_cache(tiny.config, 1, cache_len), 0)
        start = cached_start(prefix, len(ids), cache_len)
        assert start == prefix
        cached, _ = prefill(ids, cache, start)
        assert np.allclose(cached, whole, rtol=0, atol=1e-5) and (prefix != 64 or np.array_equal(cached, whole))


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


def test_the_prompt_cache_prefills_only_what_a_slot_does_not_hold_and_greedy_text_is_unchanged(tiny):
    """A slot keeps its row after a request: a prompt that continues one prefills only what follows its prompt (the
    reply's K/V, from decode steps, are not reused), even when the row was swapped to make room for a busy one
    (compaction) and after an unrelated request took the other slot; each greedy text is generate's alone, with the
    cache and without it (cache_prompt false)."""
    scheduler = Scheduler(tiny, n_slots=2, slot_ctx=256, max_waiting=4)
    scheduler.warm_up()
    loop = asyncio.new_event_loop()
    parser = Parser(tiny, "tiny.gguf", 256)
    encode = tiny.tokenizer.encode

    def run(*bodies) -> list[tuple[list[int], int]]:
        """Each body's reply (checked against generate's alone) and cached prompt tokens."""
        jobs = [Job(parser.completion({"max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}), loop)
                for body in bodies]
        for job in jobs:
            scheduler.submit(job)
        run_until_idle(scheduler)
        results = []
        for job in jobs:
            events = drain(loop, job)
            expected = list(engine.generate_tokens(tiny, job.request.prompt_ids, job.request.max_tokens, 256,
                                                   SamplingParams(temperature=0), seed=0, stop_ids=frozenset()))
            assert "".join(event.text for event in events) == tiny.tokenizer.decode(expected)
            assert events[-1].usage["completion_tokens"] == len(expected) == job.request.max_tokens
            results.append((expected, events[-1].usage["prompt_tokens_details"]["cached_tokens"]))
        return results

    first = encode(" ".join(["the hall of 1 2 3"] * 4))  # ~70 tokens
    (reply, cached), (_, cached_other) = run({"prompt": first, "max_tokens": 2},
                                             {"prompt": encode("abc in the"), "max_tokens": 30})
    assert cached == cached_other == 0
    # `first` ended in row 0, and the other request, still decoding, was swapped into it: row 1 holds `first` now.
    follow_up = first + reply + encode(" and the next turn")
    [(reply, cached)] = run({"prompt": follow_up})
    assert cached == len(first)
    [(_, cached)] = run({"prompt": encode("x y z w")})  # the least recently used row: the other request's
    assert cached == 0
    again = follow_up + reply + encode(" more")
    [(_, cached)] = run({"prompt": again})
    assert cached == len(follow_up)
    [(_, cached)] = run({"prompt": again, "cache_prompt": False})
    assert cached == 0
    [(_, cached)] = run({"prompt": again})
    assert cached == len(again) - 1  # all of it held: its last token is prefilled again for its logits
    expected = len(first) + len(follow_up) + len(again) - 1
    assert scheduler.metrics()["prompt_tokens_cached_total"] == expected
    loop.close()
