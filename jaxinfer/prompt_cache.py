"""The prompt cache of the server's slots (llama-server's cache_prompt): after a request a slot's row of the KV cache
still holds its prompt's keys and values, and a new request goes to the free slot whose row shares the longest prefix
with its prompt, which then prefills only the rest of it. This module keeps the books, which tokens each row holds;
scheduler.py moves the rows and runs the prefills (and says why a reply's tokens are not kept).

A row is chosen for its prefix only when that prefix is worth it (at least MIN_REUSE tokens: a short one such as a
lone BOS saves next to nothing); otherwise a request takes the free row used least recently, so that the rows of
conversations still going on are the last overwritten."""

import dataclasses

import numpy as np

MIN_REUSE = 16  # tokens of a cached prefix for which a request goes to that row rather than the least recently used


@dataclasses.dataclass
class Row:
    ids: np.ndarray  # int32: the tokens whose keys and values fill the row's first positions
    used: int = -1  # when the row's last request ended (PromptCache.clock); -1: never


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PromptCache:
    """What each of `n_rows` rows holds, as the scheduler's rounds leave it (every replica of the scheduler over
    several processes keeps the same books: they run the same rounds)."""

    def __init__(self, n_rows: int):
        self.rows = [Row(np.zeros(0, np.int32)) for _ in range(n_rows)]
        self.clock = 0

    def common(self, row: int, ids: list[int]) -> int:
        """The leading tokens of `ids` that row `row` holds."""
        return common_prefix(self.rows[row].ids, np.asarray(ids, np.int32))

    def choose(self, free: list[int], ids: list[int]) -> int:
        """The row of `free` for a request whose prompt is `ids`: the one holding its longest prefix if that is at
        least MIN_REUSE tokens, else the least recently used."""
        longest = max(free, key=lambda row: self.common(row, ids))
        if self.common(longest, ids) >= MIN_REUSE:
            return longest
        return min(free, key=lambda row: self.rows[row].used)

    def keep(self, row: int, ids: list[int]):
        """Row `row`'s request ended with the keys and values of `ids` in its first positions."""
        self.clock += 1
        self.rows[row] = Row(np.asarray(ids, np.int32), self.clock)

    def forget(self, row: int):
        """Row `row` holds nothing reusable (a request that failed in it)."""
        self.rows[row] = Row(np.zeros(0, np.int32))

    def clear(self):
        for row in range(len(self.rows)):
            self.forget(row)

    def swap(self, a: int, b: int):
        """Rows `a` and `b` of the KV cache were swapped."""
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
