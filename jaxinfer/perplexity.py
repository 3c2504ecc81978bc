"""Perplexity with llama-perplexity's exact convention, evaluated in jitted batches of windows.

Convention (llama.cpp tools/perplexity): the whole text is tokenized once (BOS first if the vocabulary adds one);
non-overlapping windows of n_ctx tokens, the tail dropped; the first token of each window is replaced by BOS when the
vocabulary adds BOS; only the second half is scored: the logits at positions n_ctx/2 .. n_ctx-2 predict tokens
n_ctx/2+1 .. n_ctx-1 (n_ctx - n_ctx/2 - 1 per window). NLL is accumulated in float64;
PPL = exp(mean NLL) ± PPL * sqrt(var(NLL) / (count - 1)).

KL divergence against a saved base run uses llama.cpp's logits file, so runs of either engine compare directly:
    "_logits_" | int32 n_ctx | int32 n_vocab | int32 n_chunk | int32 tokens[n_chunk * n_ctx] |
    per scored token: uint16[nv], nv = 2 * ((n_vocab + 1) / 2) + 4:
        [0:4]  two f32: scale, min_log_prob
        [4:]   q_i = round((logit_i - min_logit) / scale), min_logit = max(min logit, max logit - 16),
               scale = (max - min_logit) / 65535, so log p_i ~= min_log_prob + scale * q_i
"""

import os
import sys
import time

from jaxinfer.errors import JaxinferError, exit_on_error


def _cli_main(argv):
    from jaxinfer import cli

    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    tp, dp = cli.join_processes(evaluates=True)
    with cli.leader_prints():
        _evaluate(tp, dp)


def _evaluate(tp: int, dp: int):
    """The run of the CLI once JAX has started, the model cut over `tp` devices or windows spread over `dp`."""
    import numpy as np
    from absl import flags

    from jaxinfer import cli, engine, receipt, runtime, sidecar, sparsity
    from jaxinfer.evaluation import evaluate, leading_tokens, read_logits_file, write_logits_header

    f = flags.FLAGS
    receipt.check_path(f.receipt)  # before loading and evaluating, not after
    if f.kl_divergence and not f.kl_divergence_base:
        raise JaxinferError("--kl-divergence needs --kl-divergence-base FILE to compare against")
    saving = bool(f.kl_divergence_base) and not f.kl_divergence
    if saving:
        sidecar.check_writable_file(f.kl_divergence_base)  # before loading and evaluating, not after
    base = read_logits_file(f.kl_divergence_base) if f.kl_divergence else None
    spec = sparsity.parse_spec(f.sparsity)
    split = cli.split_requested()
    if split and dp > 1:
        raise JaxinferError(f"--dp {dp} does not combine with a hot/cold split (--vram-budget) yet")
    if f.num_processes == 1:  # over several, the others' programs would compile every run anyway (cli.build_model)
        runtime.enable_compilation_cache()
    # The split comes below, once the windows per batch are known: it is priced for the KV cache they allocate.
    m = engine.build_model(f.model, sparsity_spec=spec, down_t_type=sparsity.parse_down_t_type(f.down_t_type),
                           attn_max_batch_mib=f.attn_max_batch or None, cache_type=f.cache_type,
                           thresholds_file=f.thresholds, tp=tp, dp=dp, hot_first=not split,
                           activation_dir=f.activation_dir)
    print(f"{m.describe()}, --sparsity {spec}\n{m.describe_plan(split)}", file=sys.stderr)
    ctx_size = cli.capped_context(f.ctx_size, m.config.n_ctx_train)

    if base is not None:
        if base.n_vocab != m.config.n_vocab:
            raise JaxinferError(f"{f.kl_divergence_base} has a vocabulary of {base.n_vocab}, the model "
                                f"{m.config.n_vocab}")
        tokens, n_ctx, source = base.tokens, base.n_ctx, f.kl_divergence_base
        n_chunks = base.n_chunk if f.chunks < 0 else min(f.chunks, base.n_chunk)
    else:
        if not f.file:
            raise JaxinferError("-f/--file is required (the text to evaluate)")
        if not os.path.isfile(f.file):
            raise JaxinferError(f"text file not found: {f.file}")
        text = open(f.file, encoding="utf-8", errors="replace").read()
        if not text.strip():
            raise JaxinferError(f"{f.file} is empty")
        start = time.perf_counter()
        if f.chunks <= 0:
            tokens = np.asarray(m.tokenizer.encode(text), np.int32)
            what = f"{len(tokens)} tokens"
        else:  # only the text the windows asked for need (and two windows' worth: make_windows's least)
            tokens = leading_tokens(m.tokenizer.encode, text, max(f.chunks, 2) * ctx_size)
            what = f"the first {len(tokens)} tokens"
        print(f"tokenized {f.file}: {what} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
        n_ctx, n_chunks, source = ctx_size, f.chunks, f.file
    n_windows = len(tokens) // n_ctx if n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)  # those asked for
    n_seq = cli.windows_per_batch(f.batch_size, n_ctx, n_windows)
    print(f"evaluating {source}: n_ctx={n_ctx}, {n_seq} windows per batch", file=sys.stderr)
    if split:
        m = engine.split_model(m, f.vram_budget, n_ctx, f.activation_dir, f.reset_gpu_index, batch=n_seq)
        print(m.split.summary, file=sys.stderr)

    def run(save=None):
        return evaluate(m, tokens, n_ctx=n_ctx, n_chunks=n_chunks, n_seq=n_seq, ubatch=f.ubatch_size,
                        progress=True, base=base, save_logits=save)

    if saving:
        with sidecar.atomic_output(f.kl_divergence_base) as tmp, open(tmp, "wb") as save:  # never a half-written base
            n_max = len(tokens) // n_ctx
            write_logits_header(save, n_ctx, m.config.n_vocab,
                                tokens[: (n_max if n_chunks < 0 else min(n_chunks, n_max)) * n_ctx])
            result = run(save)
        print(f"saved logits to {f.kl_divergence_base}", file=sys.stderr)
    else:
        result = run()
    print(result.summary())
    kl = None if result.kl is None else {"mean": result.kl.mean, "error": result.kl.error,
                                          "same_top": result.kl.same_top, "base_ppl": result.kl.base_ppl,
                                          "ppl_clamped_as_base": result.kl.stored_ppl}
    receipt.write(f.receipt, m, {
        "load_seconds": m.load_seconds, "text": source, "tokens": len(tokens), "n_ctx": result.n_ctx,
        "chunks": result.n_chunks, "windows_per_batch": n_seq, "scored_tokens": result.n_scored, "ppl": result.ppl,
        "ppl_error": result.error, "seconds": result.seconds, "tokens_per_s": result.tokens_per_second,
        "compile_seconds": result.compile_seconds, "kl_divergence": kl})


def main():
    from absl import app, flags

    from jaxinfer import cli
    from jaxinfer.cli import DOWN_T_TYPE_HELP, THRESHOLDS_HELP, check_range, define_split_flags, parse_flags

    flags.DEFINE_string("model", None, "GGUF model (default: SmolLM2-135M-Instruct Q4_1)", short_name="m")
    flags.DEFINE_string("file", None, "text file to evaluate (e.g. wiki.test.raw)", short_name="f")
    flags.DEFINE_integer("ctx_size", 512, "tokens per window; capped at the model's training context",
                         short_name="c")
    flags.DEFINE_integer("chunks", -1, "evaluate only the first N windows; -1 for all")
    flags.DEFINE_integer("batch_size", 2048, "tokens per evaluation batch (a multiple of -c: that many windows "
                         "run in one compiled call, as llama-perplexity's -b)", short_name="b")
    flags.DEFINE_string("kl_divergence_base", None, "llama.cpp logits file: written by this run, or with "
                        "--kl-divergence read as the base to compare against")
    flags.DEFINE_float("attn_max_batch", 256, "MiB: compute attention in head groups whose K·Q scores stay under "
                       "this (ik_llama.cpp's -amb); 0: no limit", short_name="amb")
    flags.DEFINE_integer("ubatch_size", 512, "tokens of a window per micro-batch (through the KV cache)",
                         short_name="ub")
    flags.DEFINE_string("sparsity", "dense", "FFN activation sparsity: dense | predictor[:T] | gate:S | hidden:S")
    flags.DEFINE_string("thresholds", None, THRESHOLDS_HELP)
    flags.DEFINE_string("down_t_type", "same", DOWN_T_TYPE_HELP)
    flags.DEFINE_string("cache_type", "f32", "KV cache element type: f32 or f16")
    flags.DEFINE_bool("kl_divergence", False, "compare with --kl-divergence-base: mean KL divergence, top-1 agreement")
    define_split_flags()
    cli.define_tp_flag()
    cli.define_dp_flag()
    cli.define_process_flags()
    cli.define_receipt_flag()
    flags.adopt_module_key_flags(cli)
    check_range("ctx_size", cli.MIN_WINDOW)
    check_range("chunks", 1, sentinel=-1)
    check_range("batch_size", 1)
    check_range("attn_max_batch", 0)
    check_range("ubatch_size", 1)

    app.run(exit_on_error(_cli_main), flags_parser=parse_flags)


if __name__ == "__main__":
    main()
