"""A `tokenizers` tokenizer rebuilt from the vocabulary stored in a GGUF file, matching llama.cpp's tokenization.

Two vocabulary kinds (`tokenizer.ggml.model`):
  gpt2   byte-level BPE with merges; the pre-tokenizer is chosen by `tokenizer.ggml.pre` as llama.cpp does.
  llama  SentencePiece-style BPE: pieces with scores, "▁" for spaces, <0xNN> byte fallback; merges are derived
         from the scores (a merge is ranked by the score of the piece it produces), as HF's converter does.
"""

import dataclasses

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from jaxinfer import metadata
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import GGUFFile

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3 split pattern.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# The chat template of a vocabulary whose GGUF carries none, by the turn markers the vocabulary holds: llama.cpp's
# built-in "gemma" format (llm_chat_apply_template; Gemma 3 270M's GGUF has no tokenizer.chat_template): system
# messages are joined to the next user turn, "assistant" is "model". No BOS: encode adds it.
GEMMA_TEMPLATE = (
    "{% set ns = namespace(system='') %}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] | trim %}{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% if ns.system and role != 'model' %}{{ ns.system + '\n\n' }}"
    "{% set ns.system = '' %}{% endif %}{{ message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {("<start_of_turn>", "<end_of_turn>"): GEMMA_TEMPLATE}


def _byte_level(add_prefix_space=False, use_regex=True):
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=use_regex)


GPT2_PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> pre-tokenizer
    "default": lambda: _byte_level(),
    "gpt2": lambda: _byte_level(),
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "llama-bpe": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), _byte_level(use_regex=False)]),
}


@dataclasses.dataclass
class GGUFTokenizer:
    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    stop_ids: frozenset[int]  # EOS and end-of-turn tokens
    chat_template: str | None  # the file's, else a built-in one for its turn markers (BUILTIN_TEMPLATES)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Special tokens written in the text (`<|im_start|>`) are parsed; BOS is prepended per the vocabulary."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)


def _gpt2_tokenizer(tokens, merges, pre):
    if pre not in GPT2_PRE_TOKENIZERS:
        raise JaxinferError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(sorted(GPT2_PRE_TOKENIZERS))})")
    vocab = {s: i for i, s in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = GPT2_PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens, scores):
    """Every split of a piece into two pieces of the vocabulary is a merge, ranked by the piece's score."""
    vocab = {s: i for i, s in enumerate(tokens)}
    ranked = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _spm_tokenizer(tokens, scores, unk_id, add_space_prefix):
    vocab = {s: i for i, s in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores), unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok


def load_tokenizer(gguf: GGUFFile) -> GGUFTokenizer:
    """The file's tokenizer; its metadata is checked for types, lengths and token ids (a JaxinferError names the
    file and key)."""
    try:
        return _load_tokenizer(gguf)
    except JaxinferError as e:
        raise JaxinferError(f"{gguf.path}: {e}") from None


def _token_id(meta: dict, key: str, n_vocab: int) -> int | None:
    token = metadata.integer(meta, key, None, minimum=0)
    if token is not None and token >= n_vocab:
        raise JaxinferError(f"metadata {key} is {token}, past the vocabulary of {n_vocab} tokens")
    return token


def _per_token(gguf: GGUFFile, key: str, item: type, n_vocab: int, default) -> list:
    values = gguf.array(key, item)
    if values is None:
        return [default] * n_vocab
    if len(values) != n_vocab:
        raise JaxinferError(f"metadata {key} has {len(values)} entries for {n_vocab} tokens")
    return values


def _load_tokenizer(gguf: GGUFFile) -> GGUFTokenizer:
    meta = gguf.metadata
    kind = metadata.string(meta, "tokenizer.ggml.model", None)
    tokens = gguf.array("tokenizer.ggml.tokens", str)
    if tokens is None:
        raise JaxinferError("no tokenizer vocabulary (tokenizer.ggml.tokens)")
    token_types = _per_token(gguf, "tokenizer.ggml.token_type", int, len(tokens), 1)
    try:
        if kind == "gpt2":
            merges = gguf.array("tokenizer.ggml.merges", str) or []
            if bad := next((m for m in merges if " " not in m), None):
                raise JaxinferError(f"metadata tokenizer.ggml.merges has {bad!r}, not two tokens separated by a space")
            tok = _gpt2_tokenizer(tokens, merges, metadata.string(meta, "tokenizer.ggml.pre", "default"))
            default_add_bos = False
        elif kind == "llama":
            scores = _per_token(gguf, "tokenizer.ggml.scores", float, len(tokens), 0.0)
            tok = _spm_tokenizer(tokens, scores, _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens)),
                                 metadata.boolean(meta, "tokenizer.ggml.add_space_prefix", True))
            default_add_bos = True
        else:
            raise JaxinferError(f"unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        tok.add_special_tokens([
            AddedToken(s, special=True, normalized=False)
            for s, kind_ in zip(tokens, token_types) if kind_ in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
        ])
    except JaxinferError:
        raise
    except Exception as e:  # the `tokenizers` library's own, on a vocabulary it cannot use
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise JaxinferError(f"the tokenizer cannot be built from its vocabulary ({reason})") from None
    eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", len(tokens))
    stop_ids = {i for i in (eos_id, _token_id(meta, "tokenizer.ggml.eot_token_id", len(tokens))) if i is not None}
    for end_of_turn in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        if (i := tok.token_to_id(end_of_turn)) is not None:
            stop_ids.add(i)
    return GGUFTokenizer(
        tokenizer=tok,
        bos_id=_token_id(meta, "tokenizer.ggml.bos_token_id", len(tokens)),
        eos_id=eos_id,
        add_bos=metadata.boolean(meta, "tokenizer.ggml.add_bos_token", default_add_bos),
        stop_ids=frozenset(stop_ids),
        chat_template=metadata.string(meta, "tokenizer.chat_template", None) or next(
            (template for markers, template in BUILTIN_TEMPLATES.items()
             if all(tok.token_to_id(marker) is not None for marker in markers)), None),
    )
