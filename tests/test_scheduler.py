"""scheduler.py's pieces of a prompt (the server's tests, test_server.py, drive the scheduler end to end: slots,
queue, cancellation, batched against alone)."""

import pytest

from jaxinfer.scheduler import PREFILL_CHUNKS, prefill_pieces


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
    assert sum(size for _, size in pieces) < 2 * n_prompt + PREFILL_CHUNKS[0]  # padding stays bounded


def test_a_prompt_near_the_end_of_the_cache_takes_smaller_pieces():
    # 1000 tokens in a 1008-position cache: 3 x 256, then 232 left, of which 256-token pieces would pass the end
    # and 64-token ones too from 960 on.
    assert prefill_pieces(1000, 0, 1008) == [(0, 256), (256, 256), (512, 256), (768, 64), (832, 64), (896, 64),
                                             (960, 16), (976, 16), (992, 16)]
    assert prefill_pieces(70, 0, 1024) == [(0, 64), (64, 16)]  # not one 256-token piece, 186 of them padding
