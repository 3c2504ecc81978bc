"""Structured output: a request's `response_format` (OpenAI's json_object and json_schema) or llama-server's `grammar`
(GBNF) compiled by llguidance into a grammar, and per generated token the set of tokens the grammar allows next.

The set travels as llguidance's bitmask, int32 [ceil(V / 32)] per row (bit t of word t // 32 for token t): the
compiled sampler takes one row per slot (sampling.unpack_allowed turns it into a bool [B, V] mask), every bit set for
a slot without a grammar, so one program serves constrained and unconstrained slots alike; 6 KiB a row for a 49k
vocabulary rather than 48 KiB of bools. The grammar's state advances on the host (the scheduler's thread) with each
token its slot generates, so a constrained slot takes one decode step per round: its next mask needs that token.

Why llguidance: a Rust library with Python bindings (abi3 wheels, no dependencies: no torch) that takes JSON schemas,
Lark and GBNF; its masks cost microseconds a token for JSON (docs/serving.md has the figures), and its parser limits
(lexer fuel, grammar size) bound the work a hostile grammar can ask of the thread that generates for every slot."""

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from jaxinfer.errors import JaxinferError

# JSON in one line, as OpenAI's replies are: with llguidance's default flexible whitespace a small model may fill its
# whole budget with blank lines between two keys.
JSON_OPTIONS = {"whitespace_flexible": False}
JSON_OBJECT = {"type": "object"}


def words(n_vocab: int) -> int:
    """int32 words of a vocabulary's bitmask row."""
    return -(-n_vocab // 32)


def all_allowed(rows: int, n_vocab: int) -> np.ndarray:
    """The bitmask of rows that every token may follow (slots without a grammar)."""
    return np.full((rows, words(n_vocab)), -1, np.int32)


def grammar_of(body: dict) -> str | None:
    """The llguidance grammar a request body asks for (None: none): from `response_format` ({"type": "text"},
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {...}}}, or llama-server's
    {"type": "json_schema", "schema": {...}}) or `grammar` (GBNF or Lark text). Not checked against a tokenizer yet
    (Grammars.check). A JaxinferError says what is wrong, in one line (the server's 400)."""
    response_format, grammar = body.get("response_format"), body.get("grammar")
    if response_format is not None and grammar is not None:
        raise JaxinferError("give either 'response_format' or 'grammar', not both")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise JaxinferError("'grammar' must be a non-empty string (GBNF or Lark)")
        return _compiled(lambda: llguidance.grammar_from("grammar", grammar), "'grammar'")
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = JSON_OBJECT
    elif kind == "json_schema":
        outer = response_format.get("json_schema")
        schema = outer.get("schema") if isinstance(outer, dict) else response_format.get("schema")
        if not isinstance(schema, dict):
            raise JaxinferError("'response_format.json_schema.schema' must be a JSON schema (an object)")
    else:
        raise JaxinferError("'response_format' must be an object whose 'type' is 'text', 'json_object' or "
                            "'json_schema'")
    return _compiled(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS),
                     "'response_format'")


def _compiled(compile_grammar, what: str) -> str:
    try:
        return compile_grammar()
    except (ValueError, TypeError) as e:
        raise JaxinferError(f"{what} is not a valid grammar: {_one_line(e)}") from None


def _one_line(error) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


class Grammars:
    """llguidance's view of one model's vocabulary (built once: ~0.3 s for 49k tokens), and the matchers of the
    grammars requests give."""

    def __init__(self, tokenizer, n_vocab: int):
        # The model's vocabulary may be larger than the tokenizer's (padding): the rows' bits cover the model's.
        self.n_vocab = n_vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=n_vocab,
                                                eos_token=tokenizer.eos_id)

    def check(self, grammar: str | None, what: str = "'response_format'"):
        """A JaxinferError with llguidance's one-line reason for a grammar it cannot use (an unknown type, a bad
        reference)."""
        if grammar is None:
            return
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise JaxinferError(f"{what} is not a valid grammar: {_one_line(messages[0])}")

    def matcher(self, grammar: str) -> "Matcher":
        return Matcher(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))


class Matcher:
    """One request's grammar state: the tokens allowed next, advanced by each token generated."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill(self, bitmask: np.ndarray, row: int):
        """Row `row` of `bitmask` [B, words] := the tokens the grammar allows next."""
        fill_next_token_bitmask(self.matcher, bitmask, row)

    def advance(self, token: int) -> str | None:
        """Take `token` -> None, or why the grammar cannot (a bug: the mask allowed only what it takes)."""
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            return self.matcher.get_error() or f"token {token} is not allowed here"
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the reply ends, as at a stop token)."""
        return self.matcher.is_stopped()
