"""Continuous batching for the server: `-np` slots, one row each of one KV cache, advanced together by one
compiled decode program, with requests joining and leaving between its chunks.

    queue (bounded) -> free slot -> prefill, one chunk per round, of its own cache row (prefill_and_sample, row = slot)
                                    from the end of the prefix its row still holds (the prompt cache)
                                 -> decode: every decoding slot, 4 or 8 steps per round (decode_chunk)
                                 -> finished, cancelled or failed: the slot is free at once

One thread runs the rounds (the engine's programs are not shared between threads); HTTP handlers hand it Jobs and
wait for their Events. Per-slot sampling values, PRNG keys, step budgets and stop rules are rows of the decode
program's arrays, so a request never recompiles anything. A slot's tokens depend only on its own row: the decode
program's rows are computed independently, a prefill runs one slot alone, and rows that sit out a step neither
write nor advance. So a request gives the same tokens alone and in a full batch (tested at temperature 0).

The prompt cache (prompt_cache.py): a freed slot's row keeps the keys and values of its prompt, a request goes to the
free row holding the longest prefix of its prompt, and its prefill starts after that prefix (the row's length set
there). Only prefilled positions are reused, not the reply's: the logits are then those of the whole prompt
prefilled, to float rounding where the pieces fall elsewhere (1e-6; on the default model, a 1,000-token
conversation's next turn bit for bit), bit for bit where they fall alike (tested); the K/V that decode steps wrote
differ more (other kernels: a reply fed back that way moved the default model's next logits by up to 0.46), and a
reply is short next to the conversation before it.

Structured output (structured_output.py): a request's grammar is a matcher in its slot, advanced with each of its
tokens here; its mask of allowed tokens is a row of an input of the prefill and decode programs (every token allowed
in the other rows), valid for one step, so a slot with a grammar takes one decode step per round.

Over several processes (jax.distributed, the model cut over all their devices) every process runs a replica of the
scheduler, since each must issue the same programs in the same order: process 0, which serves HTTP, starts each
round by sharing what only it knows (the requests it admits into which slots, and the slots whose clients went away;
distributed.share), and then every replica runs the same round on the same tokens. The others only follow
(`follow`); with nothing to do, process 0 still shares an empty round every IDLE_ROUND_S, and a stop at shutdown."""

import asyncio
import dataclasses
import os
import queue
import sys
import threading
import time
import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import distributed, engine, model, programs, scoring, sharding, structured_output
from jaxinfer.prompt_cache import PromptCache
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving import REPEAT_LAST_N, Request, RequestError, TextAssembler, usage

# Prompts are prefilled in pieces of these sizes (each one compiled program): the largest that the rest of the prompt
# fills, the last padded to the smallest: less than 16 tokens of padding (a 70-token prompt is 64 + 16, 6 real).
PREFILL_CHUNKS = (16, 32, 64, 128, 256)
NO_STEP = -1  # decode_chunk's token where a row took no step
SAMPLING_VALUES = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "frequency_penalty",
                   "presence_penalty")  # per slot, traced
# One row's sampling values as the programs take them (the values of a slot with no request do not matter).
ROW_PARAMS = dataclasses.replace(SamplingParams(temperature=0.0), repeat_last_n=REPEAT_LAST_N).as_arrays()
# A scheduler waiting for requests looks again this often: for a stop, and over several processes to share an empty
# round, so that the other processes (waiting for process 0 in a collective) hear from it and a lost one is noticed.
IDLE_ROUND_S = 1.0


# The small operations between the programs, jitted with fixed argument types so that each compiles once, in the
# warm-up (as eager operations, a Python int here and a NumPy one there compiled anew in the first requests).

@partial(jax.jit, donate_argnames=("cache",))
def _swap_rows(cache: model.KVCache, state: engine.DecodeState, a, b):
    """Rows `a` and `b` of the cache (their K/V of every layer, and their lengths) and of the decode state swapped: a
    free row's cached prompt moves with it (the prompt cache)."""
    rows, swapped = jnp.stack([a, b]), jnp.stack([b, a])
    cache = model.KVCache(cache.k.at[:, rows].set(cache.k[:, swapped]), cache.v.at[:, rows].set(cache.v[:, swapped]),
                          cache.length.at[rows].set(cache.length[swapped]))
    return cache, jax.tree.map(lambda x: x.at[rows].set(x[swapped]), state)


@jax.jit
def _set_length(length, row, value):
    return length.at[row].set(value)


@jax.jit
def _start_row(state: engine.DecodeState, row, token, recent, key, steps_left, ignore_eos) -> engine.DecodeState:
    """The state with row `row` decoding from `token` after `recent`."""
    return engine.DecodeState(state.token.at[row].set(token), state.recent.at[row].set(recent),
                              state.keys.at[row].set(key), state.steps_left.at[row].set(steps_left),
                              state.stopped.at[row].set(False), state.ignore_eos.at[row].set(ignore_eos))


@jax.jit
def _stop_row(state: engine.DecodeState, row) -> engine.DecodeState:
    return dataclasses.replace(state, stopped=state.stopped.at[row].set(True))


def prefill_pieces(n_prompt: int, start: int, cache_len: int) -> list[tuple[int, int]]:
    """(offset, chunk size) of each prefill piece of a prompt of n_prompt tokens whose first `start` are in the cache
    already, none reaching past `cache_len` (a multiple of the smallest chunk)."""
    pieces, offset = [], start
    while offset < n_prompt:
        fits = [size for size in PREFILL_CHUNKS if offset + size <= cache_len]
        size = max([size for size in fits if size <= n_prompt - offset], default=PREFILL_CHUNKS[0])
        pieces.append((offset, size))
        offset += min(size, n_prompt - offset)
    return pieces


def cached_start(common: int, n_prompt: int, cache_len: int) -> int:
    """Where the prefill of a prompt of n_prompt tokens starts when its row holds its first `common`: at its last token
    at the latest (whose logits give the first new token), and where the pieces from there stay within the cache
    (else at the multiple of the smallest piece below: pieces from there always do)."""
    start = min(common, n_prompt - 1)
    if any(offset + size > cache_len for offset, size in prefill_pieces(n_prompt, start, cache_len)):
        start -= start % PREFILL_CHUNKS[0]
    return start


def steps_per_chunk(rows: int) -> int:
    """Decode steps per round over `rows` rows. A chunk's tokens reach their clients together and new requests join
    between chunks: ~40-75 ms of steps either way on the default model (8 steps of one row take 43 ms, 4 of eight rows
    75). Measured in the benchmark's mix at 8 slots: 4 steps gave 5% more tokens/s than 8 (requests join sooner)."""
    return engine.DECODE_CHUNK if rows < 4 else engine.DECODE_CHUNK // 2


@dataclasses.dataclass
class Event:
    """What the scheduler hands to the waiting HTTP handler: a piece of text, the end, or an error."""

    text: str = ""
    finish_reason: str | None = None  # set on the last event of a request that ended well
    usage: dict | None = None
    error: str | None = None  # set on the last event of a request that failed
    status: int = 500  # with `error`: the HTTP status it stands for
    scores: dict | None = None  # on the last event of an echo or logprobs request: Responder.complete's `scores`


class Job:
    """A queued request and the channel its events come back on, to the asyncio loop that waits for them."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None):
        self.request, self.loop = request, loop  # no loop: nobody waits (the scheduler's warm-up)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()  # the client went away: its slot is freed at the next round

    def send(self, event: Event):
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is waiting
            self.cancelled.set()


@dataclasses.dataclass
class Slot:
    """A request in a slot: prefilling while `pieces` remain, then decoding."""

    job: Job
    assembler: TextAssembler
    pieces: list[tuple[int, int]]
    recent: np.ndarray  # int32 [1, REPEAT_LAST_N]: the prompt's last tokens
    key: jax.Array  # the request's PRNG key after the prefill's subkey was split off
    prefill_key: jax.Array  # [1]
    limit: int  # tokens it may generate: max_tokens, within the slot's context
    deadline: float  # time.monotonic() past which it ends as if it had reached its limit (--request_timeout)
    cached: int  # prompt tokens its row held already (the prompt cache): not prefilled
    prefilled: int  # prompt tokens in its row so far
    matcher: structured_output.Matcher | None = None  # its grammar's state (structured output), advanced per token
    produced: int = 0

    @property
    def decoding(self) -> bool:
        return not self.pieces

    def prefix(self) -> list[int]:
        """The tokens whose prefilled K/V fill its row's first positions (the reply's, written by decode steps, are
        not reused: see the module's docstring)."""
        return self.job.request.prompt_ids[:self.prefilled]


class Scheduler:
    """`n_slots` slots of `slot_ctx` positions each; at most `max_waiting` requests wait for a free one; a request
    holds its slot for at most `max_request_s` seconds (None: no limit), then ends with finish_reason "length"."""

    def __init__(self, m: engine.LoadedModel, n_slots: int, slot_ctx: int, max_waiting: int,
                 on_lost_process=lambda error: None, max_request_s: float | None = None):
        """on_lost_process(error): over several processes, sharing a round failed (distributed.ProcessLost): the
        rounds cannot go on. Called from the scheduler's thread, which then ends."""
        self.model, self.n_slots, self.slot_ctx, self.max_waiting = m, n_slots, slot_ctx, max_waiting
        self.max_request_s = max_request_s
        self.on_lost_process = on_lost_process
        self.replicated = jax.process_count() > 1  # every process runs this scheduler (process 0 leads)
        self.stopping = threading.Event()
        self.ending = threading.Event()  # end_all(): every request ends now
        smallest = PREFILL_CHUNKS[0]
        self.cache_len = -(-slot_ctx // smallest) * smallest
        self.stop_ids = np.array(sorted(m.tokenizer.stop_ids) or [-1], np.int32)
        self.grammars = structured_output.Grammars(m.tokenizer, m.config.n_vocab)
        self.one_row_allowed = structured_output.all_allowed(1, m.config.n_vocab)  # a prefill without a grammar
        # A decode step over the first b rows costs what b rows do (the quantized products cost per token); with busy
        # slots kept first (_compact), one program per power of two covers them, a lone request at one row's cost.
        self.buckets = sorted({min(2**i, n_slots) for i in range(n_slots.bit_length() + 1)})
        self.waiting: queue.Queue[Job] = queue.Queue(max_waiting)
        self.slots: list[Slot | None] = [None] * n_slots
        self.prompts = PromptCache(n_slots)  # what each free row holds
        self.counters = dict.fromkeys(("requests_total", "prompt_tokens_total", "prompt_tokens_cached_total",
                                       "tokens_generated_total"), 0)
        self.busy_seconds = 0.0  # time spent in rounds with a slot busy
        self._lock = threading.Lock()  # counters and slots are read by the HTTP side while the scheduler writes them
        self.thread = threading.Thread(target=self._run, name="jaxinfer-scheduler", daemon=True)

    # ---- set-up ----

    def warm_up(self, on_compile=None):
        """Compile (or load) the prefill programs and the decode program now, so that no request waits for them;
        `on_compile()` is called before each program that is neither stored nor built yet (engine.prefill_function)."""
        m = self.model
        recent = np.full((1, REPEAT_LAST_N), -1, np.int32)
        self._reset()
        sizes = [size for size in PREFILL_CHUNKS if size <= self.cache_len]
        prefills = {size: partial(engine.prefill_function, m, np.zeros((1, size), np.int32), recent,
                                  engine.seed_keys(0)[1], params=ROW_PARAMS, on_compile=on_compile,
                                  allowed_bits=self.one_row_allowed) for size in sizes}
        decodes = {rows: partial(engine.decode_function, m, self.state, params=self.params, stop_ids=self.stop_ids,
                                 rows=rows, n_steps=steps_per_chunk(rows), on_compile=on_compile,
                                 allowed=(self.allowed, self.once)) for rows in self.buckets}
        # All compiled at once first (not run: each run takes the cache in turn), then each run once in turn.
        programs.build_at_once([partial(build, cache=self.cache, warm_up=False)
                                for build in [*prefills.values(), *decodes.values()]])
        self.prefill, self.decode = {}, {}  # decode: busy rows -> the program over the first that many rows
        for size, build in prefills.items():
            self.prefill[size], self.cache = build(cache=self.cache)
        for rows, build in decodes.items():
            self.decode[rows], self.cache = build(cache=self.cache)
        # Requests of two tokens, and a row moved onto itself: the small operations between the programs (a slot's
        # rows set, moved, freed) compile now too, not in the first requests (~0.2 s). Twice: the first run starts
        # from arrays that no program has returned yet, which a jit's cache tells apart.
        for _ in range(2):
            self._start(0, Job(Request(chat=False, prompt_ids=[0], max_tokens=2, params=SamplingParams(
                repeat_last_n=REPEAT_LAST_N), seed=0, stop=[], stream=False, include_usage=False), None))
            while self.slots[0] is not None:
                self._round(cancelled=[])
            self._swap(0, 0)
        self.counters = dict.fromkeys(self.counters, 0)
        self.prompts.clear()

    def _reset(self):
        """An empty cache and every slot's decode row stopped."""
        n = self.n_slots
        self.cache = model.init_cache(self.model.config, n, self.cache_len)
        self.prompts = PromptCache(n)
        self.params = dataclasses.replace(ROW_PARAMS, **{name: np.full(n, getattr(ROW_PARAMS, name))
                                                         for name in SAMPLING_VALUES})
        # Each row's allowed tokens (structured_output.py: every one, but in a slot with a grammar) and whether its
        # row takes one step per round (a grammar's next mask needs the token before).
        self.allowed = structured_output.all_allowed(n, self.model.config.n_vocab)
        self.once = np.zeros(n, bool)
        self.state = self._global(engine.DecodeState(
            jnp.zeros(n, jnp.int32), jnp.full((n, REPEAT_LAST_N), -1, jnp.int32),
            jax.random.split(jax.random.key(0), n), jnp.zeros(n, jnp.int32), jnp.ones(n, bool), jnp.zeros(n, bool)))

    def _global(self, values):
        """`values` (this process's own arrays) as the programs take them: over several processes, arrays on the
        model's mesh (sharding.on_mesh); unchanged in one."""
        return sharding.on_mesh(values, self.model.config.plan)

    def start(self):
        self.thread.start()

    def stop(self, timeout: float):
        """End the rounds (over several processes: the others' too) within about `timeout` seconds."""
        self.stopping.set()
        self.thread.join(timeout)

    # ---- what the HTTP side calls ----

    def submit(self, job: Job):
        """Queue `job`, or refuse it with 503 when the queue is full."""
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            raise RequestError(503, f"the server is busy: all {self.n_slots} slots are generating and "
                                    f"{self.max_waiting} requests are waiting (the queue's limit, --queue); try again "
                                    f"later", retry_after_s=1) from None
        with self._lock:
            self.counters["requests_total"] += 1

    def end_all(self):
        """End every request, generating or waiting, with a 503 error at the next round (a shutdown whose time for
        letting them finish is up)."""
        self.ending.set()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            busy = sum(slot is not None for slot in self.slots)
            generated, seconds = self.counters["tokens_generated_total"], self.busy_seconds
            return {**self.counters, "busy_seconds_total": round(seconds, 3), "slots": self.n_slots,
                    "busy_slots": busy, "queue_length": self.waiting.qsize(),
                    "tokens_per_second": round(generated / seconds, 2) if seconds else 0.0}

    # ---- the rounds ----

    def _run(self):
        try:
            while not self.stopping.is_set():
                self.run_round(wait=True)
            if self.replicated:
                distributed.share({"stop": True})
        except distributed.ProcessLost as e:
            self.on_lost_process(e)

    def run_round(self, wait: bool):
        """Admit waiting requests into free slots (first waiting for one, with `wait`, when no slot is busy), then
        one round: over several processes, shared with the others first."""
        if self.ending.is_set():
            waiting = iter(lambda: self._next_job(block=False), None)
            for job in [*(slot.job for slot in self.slots if slot is not None), *waiting]:
                job.send(Event(error="the server is shutting down", status=503))
                job.cancelled.set()  # freed below, as a client gone away
        admitted = self._admissions(block=wait and not any(self.slots))
        cancelled = [row for row, slot in enumerate(self.slots) if slot is not None and slot.job.cancelled.is_set()]
        now = time.monotonic()
        expired = [row for row, slot in enumerate(self.slots)
                   if slot is not None and row not in cancelled and slot.deadline <= now]
        if self.replicated:
            distributed.share({"admit": [[row, dataclasses.asdict(job.request)] for row, job in admitted],
                               "cancel": cancelled, "expire": expired})
        self._run_shared(admitted, cancelled, expired)

    def follow(self):
        """Run the rounds that process 0 shares, until it stops (over several processes, in every other process)."""
        while "stop" not in (shared := distributed.share(None)):
            admitted = [(row, Job(_request(fields), None)) for row, fields in shared["admit"]]
            self._run_shared(admitted, shared["cancel"], shared["expire"])

    def _run_shared(self, admitted: list[tuple[int, Job]], cancelled: list[int], expired: list[int]):
        """Start the admitted requests, then the round. A failure is a bug: logged with its traceback, and each
        request it cut short gets an error (every replica fails alike: they run the same programs)."""
        for row, job in admitted:
            try:
                self._start(row, job)
            except Exception as e:  # a bug: the request still gets its answer
                traceback.print_exc(file=sys.stderr)
                job.send(Event(error=f"internal error ({type(e).__name__})"))
        busy, started = any(self.slots), time.perf_counter()
        try:
            self._round(cancelled, expired)
        except Exception as e:  # a bug: logged with its traceback, one line to each client it cut short
            traceback.print_exc(file=sys.stderr)
            jobs = [slot.job for slot in self.slots if slot is not None]
            with self._lock:
                self.slots = [None] * self.n_slots
            self._reset()  # a program that failed may have consumed the donated cache: not touched again
            for job in jobs:
                job.send(Event(error=f"internal error ({type(e).__name__})"))
        with self._lock:
            self.busy_seconds += (time.perf_counter() - started) if busy else 0.0

    def _admissions(self, block: bool) -> list[tuple[int, Job]]:
        """Waiting jobs for the free slots, each with its row (waiting up to IDLE_ROUND_S for one when `block`:
        nothing else to do)."""
        admitted, free = [], [row for row, slot in enumerate(self.slots) if slot is None]
        while free:
            job = self._next_job(block)
            if job is None:
                break
            request = job.request
            row = self.prompts.choose(free, request.prompt_ids if request.cache_prompt else [])
            free.remove(row)
            admitted.append((row, job))
            block = False
        return admitted

    def _next_job(self, block: bool) -> Job | None:
        while True:
            try:
                job = self.waiting.get(block=block, timeout=IDLE_ROUND_S if block else None)
            except queue.Empty:
                return None
            if not job.cancelled.is_set():
                return job

    def _start(self, row: int, job: Job):
        request = job.request
        ids = request.prompt_ids
        recent = engine.recent_window(ids, REPEAT_LAST_N)
        key, prefill_key = engine.seed_keys(request.seed)
        start = cached_start(self.prompts.common(row, ids), len(ids), self.cache_len) if request.cache_prompt else 0
        slot = Slot(job, TextAssembler(self.model.tokenizer, request.stop),
                    prefill_pieces(len(ids), start, self.cache_len), recent, key, prefill_key,
                    limit=min(request.max_tokens, self.slot_ctx - len(ids) + 1),
                    deadline=time.monotonic() + (float("inf") if self.max_request_s is None else self.max_request_s),
                    cached=start, prefilled=start,
                    matcher=None if request.grammar is None else self.grammars.matcher(request.grammar))
        self.prompts.forget(row)  # its request writes the row from `start` on: the books are kept again when it ends
        self.cache = dataclasses.replace(self.cache, length=_set_length(self.cache.length, *self._global(
            (np.int32(row), np.int32(start)))))
        with self._lock:
            self.slots[row] = slot
            self.counters["prompt_tokens_total"] += len(ids)
            self.counters["prompt_tokens_cached_total"] += start

    def _round(self, cancelled: list[int], expired: list[int] = ()):
        """Free the `cancelled` slots, end the `expired` ones (their time is up) and move busy ones first; one
        prefill piece for each prefilling slot; one decode chunk for the decoding."""
        for row in cancelled:
            self._free(row)
        for row in expired:
            self._finish(row, self._last_event(self.slots[row], "length"))
        self._compact()
        for row, slot in enumerate(self.slots):
            if slot is not None and not slot.decoding:
                self._prefill(row, slot)
        if any(slot is not None and slot.decoding for slot in self.slots):
            self._decode()

    def _prefill(self, row: int, slot: Slot):
        request = slot.job.request
        offset, size = slot.pieces.pop(0)
        piece = request.prompt_ids[offset:offset + size]
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :len(piece)] = piece
        allowed = self.one_row_allowed
        if slot.matcher is not None and not slot.pieces:  # the last piece samples the first token
            allowed = allowed.copy()
            slot.matcher.fill(allowed, 0)
        token, self.cache = self.prefill[size](tokens, jnp.int32(len(piece)), jnp.int32(row), slot.recent,
                                               slot.prefill_key, request.params.as_arrays(), self.cache, allowed)
        slot.prefilled = offset + len(piece)
        if slot.pieces:
            return
        first = int(np.asarray(token)[0])
        self.state = _start_row(self.state, *self._global((np.int32(row), np.int32(first), slot.recent[0], slot.key,
                                                           np.int32(slot.limit - 1), np.bool_(request.ignore_eos))))
        p = request.params
        self.params = dataclasses.replace(self.params, **{
            name: _with(getattr(self.params, name), row, getattr(p, name)) for name in SAMPLING_VALUES})
        self.allowed = _with(self.allowed, row, -1)  # each round sets a grammar's (_decode)
        self.once = _with(self.once, row, slot.matcher is not None)
        self._take(row, first)

    def _compact(self):
        """Swap the last busy slots with free rows before them, so that the busy rows are the first."""
        while (busy := [row for row, slot in enumerate(self.slots) if slot is not None]) and busy[-1] >= len(busy):
            source, target = busy[-1], self.slots.index(None)
            self._swap(source, target)
            with self._lock:
                self.slots[target], self.slots[source] = self.slots[source], None
            self.state = _stop_row(self.state, self._global(np.int32(source)))

    def _swap(self, a: int, b: int):
        """Rows `a` and `b` of the cache, decode state, sampling values and prompt cache's books swapped."""
        self.cache, self.state = _swap_rows(self.cache, self.state, *self._global((np.int32(a), np.int32(b))))
        self.params = dataclasses.replace(self.params, **{
            name: _swapped(getattr(self.params, name), a, b) for name in SAMPLING_VALUES})
        self.allowed, self.once = _swapped(self.allowed, a, b), _swapped(self.once, a, b)
        self.prompts.swap(a, b)

    def _decode(self):
        rows = next(b for b in self.buckets if all(slot is None for slot in self.slots[b:]))
        constrained = [(row, slot.matcher) for row, slot in enumerate(self.slots[:rows])
                       if slot is not None and slot.decoding and slot.matcher is not None]
        if constrained:
            self.allowed = self.allowed.copy()  # see _with
            for row, matcher in constrained:
                matcher.fill(self.allowed, row)
        tokens, self.state, self.cache = self.decode[rows](self.state, self.params, self.cache,
                                                           *self._global((self.allowed, self.once)))
        tokens = np.asarray(tokens)
        for row, slot in enumerate(self.slots[:rows]):
            if slot is None or not slot.decoding:
                continue
            for token in tokens[:, row].tolist():
                if token == NO_STEP or self._take(row, token):
                    break

    # ---- a slot's tokens ----

    def _take(self, row: int, token: int) -> bool:
        """Hand `token` of the request in slot `row` to its client -> whether the request ended."""
        slot = self.slots[row]
        request = slot.job.request
        if token == engine.NONFINITE_LOGITS:
            position = len(request.prompt_ids) + slot.produced
            return self._finish(row, Event(error=f"the model's logits are NaN or infinite at position {position} "
                                                 f"(corrupt weights?)"))
        if token in self.stop_ids and not request.ignore_eos:
            return self._finish(row, self._last_event(slot, "stop"))
        if slot.matcher is not None and (error := slot.matcher.advance(token)) is not None:
            return self._finish(row, Event(error=f"the grammar refused token {token} ({error})"))
        slot.produced += 1
        with self._lock:
            self.counters["tokens_generated_total"] += 1
        if text := slot.assembler.add(token):
            slot.job.send(Event(text=text))
        if slot.assembler.stopped or (slot.matcher is not None and slot.matcher.done):
            return self._finish(row, self._last_event(slot, "stop"))
        if slot.produced >= slot.limit:
            return self._finish(row, self._last_event(slot, "length"))
        return False

    def _last_event(self, slot: Slot, finish_reason: str) -> Event:
        if tail := slot.assembler.finish():
            slot.job.send(Event(text=tail))
        request = slot.job.request
        scores = None
        if request.echo or request.logprobs is not None:
            ids = request.prompt_ids + slot.assembler.ids
            scores = {"ids": ids, "n_prompt": len(request.prompt_ids)}
            if request.logprobs is not None:  # the whole sequence scored again, on this thread (its programs)
                scores["token_logprobs"], scores["top"] = scoring.score(self.model, ids)
        return Event(finish_reason=finish_reason, usage=usage(len(request.prompt_ids), slot.produced, slot.cached),
                     scores=scores)

    def _finish(self, row: int, last: Event) -> bool:
        """End the request in slot `row` with `last`, sent once the slot is free: a client that has its answer sees
        /metrics without it."""
        job = self.slots[row].job
        self._free(row, keep=last.error is None)
        job.send(last)
        return True

    def _free(self, row: int, keep: bool = True):
        """Slot `row` free, its row's tokens kept in the prompt cache's books (`keep`: it did not fail)."""
        if keep:
            self.prompts.keep(row, self.slots[row].prefix())
        self.state = _stop_row(self.state, self._global(np.int32(row)))
        with self._lock:
            self.slots[row] = None


def _request(fields: dict) -> Request:
    """The Request whose dataclasses.asdict process 0 shared."""
    return Request(**{**fields, "params": SamplingParams(**fields["params"])})


def _with(values: np.ndarray, row: int, value) -> np.ndarray:
    """A copy of `values` with row `row` set: arrays handed to a program are never written again (on the CPU the
    program may read them in place while it runs)."""
    values = values.copy()
    values[row] = value
    return values


def _swapped(values: np.ndarray, a: int, b: int) -> np.ndarray:
    """A copy of `values` with rows a and b swapped (see _with)."""
    values = values.copy()
    values[[a, b]] = values[[b, a]]
    return values


def resident_memory_bytes() -> int | None:
    """This process's resident memory (Linux), for /metrics."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
