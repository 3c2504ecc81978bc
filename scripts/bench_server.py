"""Serving speed under concurrency: N clients stream completions from a running OpenAI-compatible server (python -m
jaxinfer.server, or llama.cpp's llama-server on the same model) at once, each sending --requests requests one after
another; for each N of --clients: the aggregate generated tokens/s (all tokens over the wall time of the whole
measurement), time to first token, inter-token latency (gaps between streamed chunks) and time per output token
(a request's time from its first chunk to its last over its tokens after the first), p50 and p95.

    python scripts/bench_server.py [--url http://127.0.0.1:8080] [--clients 1,4,8] [--requests 4]
        [--max_tokens 128] [--endpoint completions|chat] [--warmup 4] [--json]

Requests are greedy (--temperature 0) with "ignore_eos": true, so that each generates exactly --max_tokens (llama-
server honours the field; a server that does not may stop early, which the finish_reasons show). Prompts are of mixed
lengths (4 to 160 words, cycling), each opening with its own number so that no server reuses another's cached prefix.
Tokens are counted from the usage each stream ends with (stream_options.include_usage), else one per chunk. With
--json the last line is one JSON object: {"url", "model", ..., "results": [one object per client count]}. The exit
status is 1 when any request failed (after the report), 2 when the server cannot be reached.
"""

import json
import sys

from absl import app, flags

import server_client
from jaxinfer.cli import check_list, check_range, parse_flags
from jaxinfer.errors import JaxinferError, exit_on_error

flags.DEFINE_string("url", "http://127.0.0.1:8080", "the server's base URL")
flags.DEFINE_list("clients", ["1", "4", "8"], "concurrent client counts, measured one after another")
flags.DEFINE_integer("requests", 4, "requests each client sends, one after another")
flags.DEFINE_integer("max_tokens", 128, "tokens each request generates")
flags.DEFINE_enum("endpoint", "completions", ["completions", "chat"], "/v1/completions or /v1/chat/completions")
flags.DEFINE_float("temperature", 0.0, "sampling temperature of every request")
flags.DEFINE_bool("ignore_eos", True, "send \"ignore_eos\": true (generate exactly --max_tokens)")
flags.DEFINE_integer("warmup", 4, "untimed requests sent first, one at a time (4: one of each prompt length, so that a "
                     "server that compiles per shape has done so)")
flags.DEFINE_float("timeout", 600.0, "seconds a request may go without the server sending anything")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
check_list("clients", 1)
check_range("requests", 1)
check_range("max_tokens", 1)
check_range("warmup", 0)
check_range("temperature", 0.0, 2.0)
check_range("timeout", 0.0, low_open=True)
FLAGS = flags.FLAGS


def spec(index: int) -> server_client.RequestSpec:
    words = server_client.PROMPT_WORDS[index % len(server_client.PROMPT_WORDS)]
    return server_client.RequestSpec(server_client.prompt(index, words), FLAGS.max_tokens, stream=True,
                                     chat=FLAGS.endpoint == "chat", temperature=FLAGS.temperature,
                                     ignore_eos=FLAGS.ignore_eos)


def measure(clients: int, first_index: int) -> tuple[dict, list[str]]:
    """One measurement at `clients` concurrent clients -> (its summary, the errors of its failed requests)."""
    specs = [spec(first_index + i) for i in range(clients * FLAGS.requests)]
    outcomes, wall = server_client.run_concurrently(FLAGS.url, specs, clients, FLAGS.timeout)
    done = [o for o in outcomes if o.completed]
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    gaps = [gap for o in done for gap in o.gaps_s]
    # Time per output token after the first, per request: unlike the gaps, the same whether a server streams each
    # token as it comes or several at once.
    tpots = [sum(o.gaps_s) / (o.tokens - 1) for o in done if o.tokens > 1 and o.gaps_s]
    tokens = sum(o.tokens for o in done)
    finish_reasons: dict[str, int] = {}
    for o in done:
        finish_reasons[o.finish_reason] = finish_reasons.get(o.finish_reason, 0) + 1
    return {"clients": clients, "requests": len(specs), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "ttft_ms_p50": server_client.percentile_ms(ttfts, 50),
            "ttft_ms_p95": server_client.percentile_ms(ttfts, 95), "itl_ms_p50": server_client.percentile_ms(gaps, 50),
            "itl_ms_p95": server_client.percentile_ms(gaps, 95), "tpot_ms_p50": server_client.percentile_ms(tpots, 50),
            "tpot_ms_p95": server_client.percentile_ms(tpots, 95), "errors": len(outcomes) - len(done),
            "finish_reasons": finish_reasons}, [o.error for o in outcomes if not o.completed]


def table(results: list[dict]) -> str:
    columns = ("clients", "requests", "tokens", "wall_s", "tokens_per_s", "ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50",
               "itl_ms_p95", "tpot_ms_p50", "tpot_ms_p95", "errors")
    rows = [columns] + [tuple("-" if r[c] is None else str(r[c]) for c in columns) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


@exit_on_error
def main(argv):
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    FLAGS.url = FLAGS.url.rstrip("/")
    model = server_client.check_server(FLAGS.url)
    warmup, _ = server_client.run_concurrently(FLAGS.url, [spec(-1 - i) for i in range(FLAGS.warmup)], 1,
                                               FLAGS.timeout)
    if any(not o.completed for o in warmup):
        raise JaxinferError(f"the warm-up request failed: {next(o.error for o in warmup if not o.completed)}")
    results, errors, first_index = [], [], 0
    for clients in map(int, FLAGS.clients):
        result, failed = measure(clients, first_index)
        first_index += result["requests"]
        results.append(result)
        errors += failed
        print(f"{clients} clients: {result['tokens_per_s']} tokens/s, TTFT p50 {result['ttft_ms_p50']} ms, "
              f"ITL p50 {result['itl_ms_p50']} ms, {result['errors']} errors", file=sys.stderr, flush=True)
    print(table(results))
    if FLAGS.json:
        print(json.dumps({"url": FLAGS.url, "model": model, "endpoint": FLAGS.endpoint, "max_tokens": FLAGS.max_tokens,
                          "requests_per_client": FLAGS.requests, "temperature": FLAGS.temperature,
                          "ignore_eos": FLAGS.ignore_eos, "results": results}))
    if errors:
        print(f"error: {len(errors)} requests failed (the first: {errors[0]})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
