import json
import pathlib

import gguf
import pytest

from jaxinfer.gguf_io import open_gguf
from jaxinfer.tokenizer import load_tokenizer

DATA = pathlib.Path(__file__).parent / "data"


def reference_rows():
    for line in (DATA / "llama_cpp_tokens.tsv").read_text().splitlines():
        text, ids = line.split("\t")
        yield json.loads(text), json.loads(ids)


@pytest.mark.parametrize("text,expected", list(reference_rows()))
def test_default_model_tokenizes_like_llama_cpp(default_model, text, expected):
    tok = default_model.tokenizer
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text


def test_default_model_stop_tokens(default_model):
    tok = default_model.tokenizer
    assert tok.token_id("<|im_end|>") in tok.stop_ids
    assert tok.eos_id in tok.stop_ids


def write_spm_vocab(path):
    """A SentencePiece-style vocabulary: ▁ for spaces, <0xNN> byte pieces, merges implied by scores."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scored = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
              "he": -3.0, "ll": -3.0, "hell": -4.0, "hello": -5.0, "▁hello": -6.0, "▁w": -7.0, "or": -7.5}
    pieces += list(scored)
    types += [gguf.TokenType.NORMAL] * len(scored)
    scores = [0.0] * 259 + list(scored.values())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {p: i for i, p in enumerate(pieces)}


def test_sentencepiece_vocabulary(tmp_path):
    ids = write_spm_vocab(tmp_path / "spm.gguf")
    tok = load_tokenizer(open_gguf(str(tmp_path / "spm.gguf")))
    assert tok.add_bos  # llama vocabularies add BOS unless the file says otherwise
    # "hello" merges all the way up by score; " world" has only ▁w and or; "!" falls back to its byte piece.
    expected = [ids["<s>"], ids["▁hello"], ids["▁w"], ids["or"], ids["l"], ids["d"], ids["<0x21>"]]
    assert tok.encode("hello world!") == expected
    assert tok.decode(expected[1:]) == "hello world!"
