"""The n-gram proposer (prompt lookup): drafts copied from what followed the request's last n tokens earlier on.

For each request: find the longest suffix n-gram of its history (prompt + output so far), prompt_lookup_min <= n <=
prompt_lookup_max, that occurred earlier in that history, and propose the (up to) k tokens that followed it there.
The earlier occurrence may overlap the suffix itself, and the drafts stop at the end of the history, as in vLLM.

Which earlier occurrence: the latest (the nearest before the suffix). vLLM's ngram proposer takes the earliest
(vllm/v1/spec_decode/ngram_proposer.py keeps the leftmost match of the longest n). On the grounded workload
(pagedq/bench/engine/grounded.py: SmolLM2's greedy outputs for 16 prompts, replayed through greedy verification with no
model) the latest gave more tokens per step for every config tried (docs/benchmarks-log.md, "Which earlier
occurrence"). A copying answer continues from where it last copied; the earliest occurrence is often an older,
differently continued one.

Cost, incremental per request instead of a scan of the history each step:
- append: O(max_n) per token: the polynomial hashes of the last 1..max_n tokens roll forward from the previous
  token's (one multiply-add each); for each n in [min_n, max_n] the n-gram's latest end moves to this token and
  the one it replaces is linked from it (the occurrences of an n-gram form a chain, latest first);
- propose: O(max_n + k): per n, longest first, the previous occurrence of the suffix is its link, checked token
  by token (so a hash collision costs a draft, never a wrong match), then the k tokens sliced out;
- memory: per token 4 bytes, 4 bytes of link per n, and a dict entry per n whose n-gram is new
  (`pagedq bench ngram` measures it);
- fork: O(max_n): the child reads its parent's history up to the fork point by reference. Links never change,
  so where the parent's latest entry lies past the fork point, the child walks its chain back to before it (as
  many steps as the parent repeated that n-gram since the fork).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from pagedq.engine.config.speculative import SpeculativeConfig

# Polynomial hashing modulo the Mersenne prime 2**61 - 1: two different n-grams of one length share a hash with
# probability about n / 2**61. Tokens enter as id + 1, so a leading token 0 still counts.
_MODULUS = (1 << 61) - 1
_BASE = 0x1F3D5B79A2C4E68  # below the modulus; any fixed base far from 0 and 1 spreads the hashes


class _History:
    """One request's tokens and n-gram chains, on top of a parent's history up to `parent_len` (a fork)."""

    __slots__ = ("index", "links", "parent", "parent_len", "suffix", "tokens")

    def __init__(self, num_lengths: int, parent: _History | None = None) -> None:
        self.parent = parent  # read up to parent_len only: the parent keeps growing past the fork point
        self.parent_len = len(parent) if parent is not None else 0
        # the tokens at positions parent_len, parent_len + 1, ...: int32 (token ids are, pagedq/engine/limits.py),
        # packed, and not a container the garbage collector walks
        self.tokens = array("i")
        # index[n - min_n]: hash of an n-gram -> the position of its last token, where it occurred latest here
        self.index: list[dict[int, int]] = [{} for _ in range(num_lengths)]
        # links[n - min_n][t - parent_len]: the end of the previous occurrence of the n-gram ending at t, or -1
        self.links = [array("i") for _ in range(num_lengths)]
        # hashes of the last 1, 2, ... max_n tokens (fewer while the history is shorter)
        self.suffix: list[int] = list(parent.suffix) if parent is not None else []

    def __len__(self) -> int:
        return self.parent_len + len(self.tokens)

    def link(self, slot: int, end: int) -> int:
        if end >= self.parent_len or self.parent is None:
            return self.links[slot][end - self.parent_len]
        return self.parent.link(slot, end)

    def latest_before(self, slot: int, key: int, limit: int) -> int:
        """The end of the latest n-gram (n = min_n + slot) with this hash ending before `limit`, or -1."""
        end = self.index[slot].get(key)
        if end is None:
            if self.parent is None:
                return -1
            return self.parent.latest_before(slot, key, min(limit, self.parent_len))
        while end >= limit:  # a parent's entries past a fork point: back along the chain
            end = self.link(slot, end)
        return end

    def token_slice(self, start: int, stop: int) -> list[int]:
        own = self.parent_len
        if start >= own or self.parent is None:
            return self.tokens[start - own : stop - own].tolist()
        head = self.parent.token_slice(start, min(stop, own))
        return head + self.tokens[: stop - own].tolist() if stop > own else head


class NgramProposer:
    """Per-request histories and indexes, keyed by request id (the engine adds, appends, forks and removes)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._histories: dict[str, _History] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._histories

    def __len__(self) -> int:
        return len(self._histories)

    def add_request(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Start (or restart) a request from its full history: prompt + output so far."""
        history = _History(self.max_n - self.min_n + 1)
        self._histories[req_id] = history
        self._extend(history, token_ids)

    def append(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Tokens that became final this step (accepted drafts and the bonus or corrected token)."""
        self._extend(self._histories[req_id], token_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        """A sample that shares the parent's history as it stands now (n > 1); each proposes on its own after."""
        parent = self._histories[parent_id]
        self._histories[child_id] = _History(self.max_n - self.min_n + 1, parent)

    def remove(self, req_id: str) -> None:
        """Forget a request (finished or aborted); an unknown id is ignored. Forks of it keep what they share."""
        self._histories.pop(req_id, None)

    def propose(self, req_id: str, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) tokens that followed the latest earlier occurrence of the longest suffix
        n-gram; [] when no suffix of min_n..max_n tokens occurred before."""
        history = self._histories[req_id]
        limit = min(self.num_speculative_tokens, max_drafts)
        length = len(history)
        if limit <= 0:
            return []
        # an earlier occurrence ends at length - 2 at the latest, so n <= length - 1
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = history.link(n - self.min_n, length - 1)
            if end < 0:
                continue
            if history.token_slice(end + 1 - n, end + 1) != history.token_slice(length - n, length):
                continue  # a hash collision: no match at this n
            return history.token_slice(end + 1, min(end + 1 + limit, length))
        return []

    def _extend(self, history: _History, token_ids: Sequence[int]) -> None:
        min_n, max_n = self.min_n, self.max_n
        index, links, suffix, tokens = history.index, history.links, history.suffix, history.tokens
        position = len(history)
        for raw in token_ids:
            token = int(raw)  # numpy integers would overflow in the hash arithmetic
            value = token + 1
            suffix = [value, *[(h * _BASE + value) % _MODULUS for h in suffix[: max_n - 1]]]
            tokens.append(token)
            for n in range(min_n, max_n + 1):
                slot = n - min_n
                if n > len(suffix):  # the history is shorter than n
                    links[slot].append(-1)
                    continue
                key = suffix[n - 1]
                previous = index[slot].get(key)
                if previous is None and history.parent is not None:
                    previous = history.parent.latest_before(slot, key, history.parent_len)
                links[slot].append(-1 if previous is None else previous)
                index[slot][key] = position
            position += 1
        history.suffix = suffix
