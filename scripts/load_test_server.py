"""A bounded load test of a running OpenAI-compatible server (python -m jaxinfer.server, or llama-server): --rounds
rounds of --requests requests from --clients concurrent clients, of mixed prompt lengths and max_tokens, streaming
and not, completions and chat, every --cancel_every-th one given up by its client (a stream closed after its first
chunks, or a plain request abandoned after --cancel_after_s). It checks that

- every request that was not given up completes (a finish_reason; a stream ends with data: [DONE]) or is refused
  cleanly because the queue is full (503 with an OpenAI-style JSON error, counted apart); any other JSON error (a
  400 for a prompt longer than a slot's context, a 500) is counted and fails the test too, as does a broken exchange
  (no [DONE], a non-JSON error, a dropped connection, no answer within --timeout);
- after each round /metrics shows no busy slot and nothing queued within --settle_s (jaxinfer_busy_slots and
  jaxinfer_queue_length, or llama-server's llamacpp:requests_processing and requests_deferred);
- the server's resident memory (process_resident_memory_bytes from /metrics, else /proc/--pid) after the last round
  is at most --max_memory_growth_mb above what it was after the first.

    python scripts/load_test_server.py [--url http://127.0.0.1:8080] [--requests 200] [--clients 16]
        [--cancel_every 7] [--rounds 2] [--max_tokens 64] [--pid PID] [--json]

With --abuse (a server on this machine only) the first round runs while the server is probed as an attacker or a
careless client would: malformed, mistyped, oversized and invalid-Unicode bodies, a 400,000-character stop string, a
megabyte model name, a text/plain body, a foreign Host header, a path outside the routes, a missing API key (with
--api_key), and faults: an idle connection, half-sent headers and body, clients gone during their upload or mid-stream,
and another client's latency beside a request with the longest stop strings allowed. Each bad input must get its
clean JSON refusal, each stalled connection be closed within --abuse_wait_s, and the load round still pass.

Everything runs against the given URL and stops by itself. What /metrics does not report (no slots, no memory) is said
in the report and not checked. The longest prompts are 160 words (~200 tokens of a real tokenizer, ~900 of the
synthetic test models' characters), plus up to --max_tokens: each slot needs that much context. The exit status is 1
when a check fails (the reasons on stderr), 2 when the server cannot be reached; with --json the last line is the
report as one JSON object.
"""

import json
import pathlib
import sys
import threading
import time
import urllib.parse

from absl import app, flags

import abuse_probes
import server_client
from jaxinfer.cli import check_range, parse_flags
from jaxinfer.errors import JaxinferError, exit_on_error

flags.DEFINE_string("url", "http://127.0.0.1:8080", "the server's base URL")
flags.DEFINE_integer("requests", 200, "requests in each round")
flags.DEFINE_integer("clients", 16, "concurrent clients")
flags.DEFINE_integer("rounds", 2, "rounds of --requests (memory is compared between the first and the last)")
flags.DEFINE_integer("max_tokens", 64, "the largest max_tokens of a request (the mix: 1, 8, 32 and this)")
flags.DEFINE_integer("cancel_every", 7, "give up on every N-th request (0: none)")
flags.DEFINE_float("cancel_after_s", 0.05, "seconds after which a client gives up on a plain (not streamed) request "
                   "it means to cancel")
flags.DEFINE_float("settle_s", 10.0, "seconds /metrics may take after a round to show no busy slot and no queue")
flags.DEFINE_float("max_memory_growth_mb", 64.0, "resident memory the server may gain between the first round and "
                   "the last (MiB)")
flags.DEFINE_integer("pid", None, "the server's process id: its resident memory is read from /proc when /metrics "
                     "has no process_resident_memory_bytes")
flags.DEFINE_float("timeout", 300.0, "seconds a request may go without the server sending anything")
flags.DEFINE_bool("json", False, "print the report as JSON on the last line")
flags.DEFINE_string("api_key", None, "the server's API key, sent as 'Authorization: Bearer KEY' (with --abuse, a "
                    "request without it must get 401)")
flags.DEFINE_bool("abuse", False, "probe the server as an attacker would while the first round runs (loopback only)")
flags.DEFINE_float("abuse_wait_s", 20.0, "seconds the server may take to answer a probe or to close a stalled "
                   "connection")
check_range("abuse_wait_s", 0.0, low_open=True)
check_range("requests", 1)
check_range("clients", 1)
check_range("rounds", 1)
check_range("max_tokens", 1)
check_range("cancel_every", 0)
check_range("cancel_after_s", 0.0, low_open=True)
check_range("settle_s", 0.0)
check_range("max_memory_growth_mb", 0.0)
check_range("timeout", 0.0, low_open=True)
check_range("pid", 1)
FLAGS = flags.FLAGS

# /metrics names of requests generating now and waiting: ours, then llama-server's.
SLOT_METRICS = (("jaxinfer_busy_slots", "jaxinfer_queue_length"),
                ("llamacpp:requests_processing", "llamacpp:requests_deferred"))
MEMORY_METRIC = "process_resident_memory_bytes"


def request_mix(n: int, max_tokens: int, cancel_every: int, cancel_after_s: float) -> list[server_client.RequestSpec]:
    """`n` requests, the same every run: prompts of every length in PROMPT_WORDS, max_tokens from 1 to `max_tokens`,
    two in three streamed, one in five chat; every `cancel_every`-th asks for `max_tokens` (so it is still generating
    when its client gives up) and is given up after 1 to 3 chunks, or after `cancel_after_s` when not streamed."""
    lengths = sorted({min(t, max_tokens) for t in (1, 8, 32, max_tokens)})
    specs = []
    for i in range(n):
        words = server_client.PROMPT_WORDS[i % len(server_client.PROMPT_WORDS)]
        stream, cancel = i % 3 != 2, cancel_every > 0 and i % cancel_every == cancel_every - 1
        specs.append(server_client.RequestSpec(
            server_client.prompt(i, words), max_tokens if cancel else lengths[(i // 4) % len(lengths)], stream=stream,
            chat=i % 5 == 4, cancel_after_chunks=1 + i % 3 if cancel and stream else None,
            cancel_after_s=cancel_after_s if cancel and not stream else None))
    return specs


def settle(base: str, settle_s: float) -> dict:
    """Wait until /metrics shows no busy slot and an empty queue -> what it showed last and how long that took."""
    start = time.monotonic()
    while True:
        samples = server_client.metrics(base)
        if MEMORY_METRIC in samples:
            samples[MEMORY_METRIC] = int(samples[MEMORY_METRIC])
        names = next((pair for pair in SLOT_METRICS if all(name in samples for name in pair)), None)
        if names is None:
            return {"slots_reported": False, "memory_bytes": samples.get(MEMORY_METRIC)}
        busy, queued = samples[names[0]], samples[names[1]]
        waited = time.monotonic() - start
        if (busy == 0 and queued == 0) or waited > settle_s:
            return {"slots_reported": True, "busy_slots": busy, "queue_length": queued, "settle_s": round(waited, 2),
                    "memory_bytes": samples.get(MEMORY_METRIC)}
        time.sleep(0.1)


def resident_bytes(pid: int) -> int:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError as e:
        raise JaxinferError(f"cannot read the memory of process {pid} ({e.strerror})") from None
    kib = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), None)
    if kib is None:
        raise JaxinferError(f"/proc/{pid}/status has no VmRSS line")
    return int(kib) * 1024


def run_round(number: int, specs: list[server_client.RequestSpec]) -> tuple[dict, list[str]]:
    """One round -> (its report, the checks it failed)."""
    outcomes, wall = server_client.run_concurrently(FLAGS.url, specs, FLAGS.clients, FLAGS.timeout)
    broken = [(i, o) for i, o in enumerate(outcomes) if o.error is not None and not o.clean]
    refused = sum(o.clean and o.status == 503 for o in outcomes)
    # The requests are valid: an error other than a full queue's 503 is the server's fault (or too small a context).
    errors = [(i, o) for i, o in enumerate(outcomes) if o.clean and o.status != 503]
    state = settle(FLAGS.url, FLAGS.settle_s)
    if state["memory_bytes"] is None and FLAGS.pid is not None:
        state["memory_bytes"], state["memory_source"] = resident_bytes(FLAGS.pid), f"/proc/{FLAGS.pid}"
    elif state["memory_bytes"] is not None:
        state["memory_source"] = MEMORY_METRIC
    report = {"round": number, "wall_s": round(wall, 2), "requests": len(specs),
              "completed": sum(o.completed for o in outcomes),
              "cancelled": sum(o.cancelled for o in outcomes),
              "cancel_planned": sum(s.cancel_after_chunks is not None or s.cancel_after_s is not None for s in specs),
              "refused_503": refused, "other_clean_errors": len(errors), "broken": len(broken),
              "tokens": sum(o.tokens for o in outcomes if o.completed), **state}
    failures = []
    for what, failed in (("did not end cleanly", broken), ("failed", errors)):
        failures += [f"round {number}: request {i} ({'stream' if specs[i].stream else 'plain'}) {what}: {o.error}"
                     for i, o in failed[:3]]
        if len(failed) > 3:
            failures.append(f"round {number}: {len(failed) - 3} more requests {what}")
    if state["slots_reported"] and (state["busy_slots"] or state["queue_length"]):
        failures.append(f"round {number}: /metrics still shows {state['busy_slots']:g} busy slots and "
                        f"{state['queue_length']:g} queued {FLAGS.settle_s:g} s after the last answer")
    if report["completed"] == 0:
        failures.append(f"round {number}: no request completed")
    return report, failures


def settle_failures(number: int) -> list[str]:
    """After the abuse probes (which may outlast the round): no busy slot and nothing queued, as after a round."""
    state = settle(FLAGS.url, FLAGS.settle_s)
    if state["slots_reported"] and (state["busy_slots"] or state["queue_length"]):
        return [f"round {number}: /metrics still shows {state['busy_slots']:g} busy slots and "
                f"{state['queue_length']:g} queued {FLAGS.settle_s:g} s after the abuse probes"]
    return []


def memory_check(rounds: list[dict]) -> tuple[dict, list[str]]:
    first, last = rounds[0]["memory_bytes"], rounds[-1]["memory_bytes"]
    if first is None or last is None:
        return {"reported": False, "note": f"the server's /metrics has no {MEMORY_METRIC} (and no --pid): memory "
                                           f"not checked"}, []
    bound = int(FLAGS.max_memory_growth_mb * 2**20)
    report = {"reported": True, "source": rounds[0]["memory_source"], "after_first_round_bytes": first,
              "after_last_round_bytes": last, "growth_bytes": last - first, "bound_bytes": bound}
    if len(rounds) < 2:
        return report | {"note": "one round: nothing to compare"}, []
    if last - first > bound:
        return report, [f"resident memory grew by {(last - first) / 2**20:.1f} MiB from the first round to the last "
                        f"(bound {FLAGS.max_memory_growth_mb:g} MiB)"]
    return report, []


@exit_on_error
def main(argv):
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    FLAGS.url = FLAGS.url.rstrip("/")
    host = urllib.parse.urlsplit(FLAGS.url).hostname or ""
    if FLAGS.abuse and not abuse_probes.is_loopback(host):
        raise JaxinferError(f"--abuse probes only a server on this machine (127.0.0.1, ::1 or localhost), not {host}")
    server_client.use_api_key(FLAGS.api_key)
    model = server_client.check_server(FLAGS.url)
    specs = request_mix(FLAGS.requests, FLAGS.max_tokens, FLAGS.cancel_every, FLAGS.cancel_after_s)
    rounds, failures, probes = [], [], []
    for number in range(1, FLAGS.rounds + 1):
        prober = threading.Thread(target=lambda: probes.extend(abuse_probes.run_all(
            FLAGS.url, FLAGS.api_key, FLAGS.abuse_wait_s)), name="abuse")
        if FLAGS.abuse and number == 1:
            prober.start()
        report, failed = run_round(number, specs)
        if FLAGS.abuse and number == 1:
            prober.join()
            failures += [f"abuse: {p['probe']}: expected {p['expected']}, got {p['got']}" for p in probes
                         if not p["ok"]]
            report, failed = report | {"abused": True}, failed + settle_failures(number)
        rounds.append(report)
        failures += failed
        print(f"round {number}: {report['completed']} completed, {report['cancelled']} cancelled, "
              f"{report['refused_503']} refused (503), {report['other_clean_errors']} other clean errors, "
              f"{report['broken']} broken, in {report['wall_s']} s; busy slots after: "
              f"{report.get('busy_slots', 'not reported')}, memory: {report['memory_bytes'] or 'not reported'}",
              file=sys.stderr, flush=True)
    memory, failed = memory_check(rounds)
    failures += failed
    if not rounds[-1]["slots_reported"]:
        print("note: /metrics reports no busy slots or queue length: slot leaks not checked", file=sys.stderr)
    if not memory["reported"]:
        print(f"note: {memory['note']}", file=sys.stderr)
    abuse = abuse_probes.summary(probes, rounds[0]) if FLAGS.abuse else None
    if abuse:
        print(f"abuse: {abuse['line']}", file=sys.stderr)
    if FLAGS.json:
        print(json.dumps({"url": FLAGS.url, "model": model, "requests": FLAGS.requests, "clients": FLAGS.clients,
                          "cancel_every": FLAGS.cancel_every, "max_tokens": FLAGS.max_tokens, "rounds": rounds,
                          "memory": memory, "abuse": abuse, "failures": failures, "ok": not failures}))
    if failures:
        print("error: load test failed: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)
    print("load test passed", file=sys.stderr)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
