"""Structured output (structured_output.py): the sampler's allowed-token mask, the scheduler's constrained slots
beside unconstrained ones, and the request bodies refused (test_server.py drives it over HTTP)."""

import asyncio
import dataclasses
import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask

from jaxinfer import engine
from jaxinfer.sampling import SamplingParams, sample, unpack_allowed
from jaxinfer.scheduler import Job, Scheduler
from jaxinfer.serving import Parser, RequestError
from jaxinfer.synthetic import SyntheticSpec, write_model

SCHEMAS = [  # bounded, so that a random model's replies end within max_tokens
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"enum": ["a", "b", "hall"]}, "maxItems": 3}}, "required": ["ok", "tags"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return engine.load_model(write_model(str(tmp_path_factory.mktemp("structured") / "tiny.gguf"),
                                        SyntheticSpec(n_ctx=512)))


def test_the_mask_limits_every_draw_and_an_all_allowed_one_changes_nothing():
    vocab, batch = 70, 64
    logits = jax.random.normal(jax.random.key(1), (batch, vocab)) * 3
    recent = jnp.full((batch, 4), -1, jnp.int32)
    keys = jax.random.split(jax.random.key(2), batch)
    bits = allocate_token_bitmask(batch, vocab)  # llguidance's layout: bit t % 32 of word t // 32
    allowed_ids = [3, 40, 64, 69]
    bits[:] = 0
    for t in allowed_ids:
        bits[:, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    mask = unpack_allowed(jnp.asarray(bits), vocab)
    assert sorted(np.flatnonzero(np.asarray(mask[0]))) == allowed_ids
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=4)
    drawn = np.asarray(sample(logits, recent, keys, params, mask))
    assert set(drawn) <= set(allowed_ids) and len(set(drawn)) > 1
    greedy = dataclasses.replace(params, temperature=0.0)
    assert set(np.asarray(sample(logits, recent, keys, greedy, mask))) <= set(allowed_ids)
    everything = unpack_allowed(jnp.asarray(allocate_token_bitmask(batch, vocab)), vocab)
    for p in (params, greedy, SamplingParams(repeat_last_n=4)):
        assert np.array_equal(sample(logits, recent, keys, p, everything), sample(logits, recent, keys, p))


def drain(loop, job):
    loop.run_until_complete(asyncio.sleep(0))
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    return events


def test_seeded_generations_follow_their_schemas_beside_unchanged_free_ones(tiny):
    """At temperature 1, every reply of many seeds parses and validates against its schema (json_object: an
    object), chat and completion alike, a GBNF grammar's is one of its strings, and greedy requests without a grammar
    in the same batch give generate's text alone."""
    scheduler = Scheduler(tiny, n_slots=4, slot_ctx=512, max_waiting=64)
    scheduler.warm_up()
    loop = asyncio.new_event_loop()
    parser = Parser(tiny, "tiny.gguf", 512)
    constrained, free = [], []
    for seed in range(24):
        schema = SCHEMAS[seed % len(SCHEMAS)] if seed % 4 else None
        response_format = ({"type": "json_object"} if schema is None
                           else {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        body = {"temperature": 1.0, "seed": seed, "max_tokens": 400, "response_format": response_format}
        request = (parser.chat({**body, "messages": [{"role": "user", "content": f"give {seed}"}]}) if seed % 2
                   else parser.completion({**body, "prompt": f"the hall {seed}"}))
        constrained.append((schema, Job(request, loop)))
        if seed % 3 == 0:
            free.append(Job(parser.completion({"prompt": f"abc {seed} in the", "temperature": 0, "max_tokens": 12,
                                               "ignore_eos": True}), loop))
    answers = [Job(parser.completion({"prompt": f"yes or no {seed}", "temperature": 1.0, "seed": seed,
                                      "grammar": 'root ::= "yes" | "no"'}), loop) for seed in range(4)]
    for job in [job for _, job in constrained] + free + answers:
        scheduler.submit(job)
    for _ in range(3000):
        scheduler.run_round(wait=False)
        if not any(scheduler.slots) and scheduler.waiting.empty():
            break
    for schema, job in constrained:
        events = drain(loop, job)
        assert events[-1].error is None and events[-1].finish_reason == "stop", events[-1]
        reply = json.loads("".join(event.text for event in events))
        jsonschema.validate(reply, schema or {"type": "object"})
    for job in free:
        events = drain(loop, job)
        expected = engine.generate_tokens(tiny, job.request.prompt_ids, 12, 512, SamplingParams(temperature=0),
                                          seed=0, stop_ids=frozenset())
        assert "".join(event.text for event in events) == tiny.tokenizer.decode(list(expected))
    for job in answers:
        assert "".join(event.text for event in drain(loop, job)) in ("yes", "no")
    loop.close()


@pytest.mark.parametrize("fields, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}},
     "'response_format' is not a valid grammar: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}},
     "'response_format' is not a valid grammar: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "'response_format.json_schema.schema' must be a JSON schema"),
    ({"response_format": {"type": "xml"}}, "'response_format' must be an object whose 'type' is"),
    ({"response_format": "json"}, "'response_format' must be an object whose 'type' is"),
    ({"grammar": "root ::= foo"}, "'grammar' is not a valid grammar: "),
    ({"grammar": 3}, "'grammar' must be a non-empty string"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "either 'response_format' or"),
])
def test_a_bad_grammar_is_a_400_with_one_line(tiny, fields, fragment):
    parser = Parser(tiny, "tiny.gguf", 512)
    for parse, body in ((parser.completion, {"prompt": "hi"}),
                        (parser.chat, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(RequestError) as caught:
            parse({**body, **fields})
        assert caught.value.status == 400 and fragment in str(caught.value) and "\n" not in str(caught.value)


def test_the_text_format_asks_for_no_grammar(tiny):
    parser = Parser(tiny, "tiny.gguf", 512)
    assert parser.completion({"prompt": "hi", "response_format": {"type": "text"}}).grammar is None
