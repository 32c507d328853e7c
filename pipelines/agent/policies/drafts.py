"""Model-free drafts for speculative greedy decoding: token n-grams of the turns generated so far.

An agent's turns repeat themselves: the tiny SFT model's code is a handful of templates, its
reasoning a few phrasings, and the same holds, less strictly, for a real policy's tool calls
(SuffixDecoding, Oliaro et al. 2024, drafts from earlier outputs for exactly this reason; vLLM's
``ngram`` speculative method drafts from the prompt). :class:`NgramDrafts` remembers the
tokens of every finished turn and, given a row's last tokens, proposes what followed their
longest recent match (up to ``max_ngram`` tokens long) as a draft; ``decode.py`` checks a whole
draft with one forward pass and keeps the tokens the model would have chosen itself.

Measured offline on the demo's seed-2 SFT model (64 held-out image tasks, greedy, 12,062 tokens):
drafting from the same row's own context gave 1.45 tokens a pass, from earlier turns 5.3 (drafts
of 8) to 7.7 (drafts of 16). A draft only decides which tokens are checked together, never which
are kept.

Matches of up to 12 tokens, not 4: a longer match is a more specific context, so its draft is
wrong less often. On the seed-2 demo's held-out sets (328 image and video samples, drafts of 8),
the SFT model's evaluation took 1,606 forward passes instead of 1,796, checked 76.5k drafted
tokens instead of 90.0k and kept 59.0k instead of 57.4k (the RL model's: 1,217 instead of 1,348
passes, 63.6k instead of 76.4k drafted); every trajectory was the same.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramDrafts:
    """The tokens of recent finished turns, indexed by their n-grams (the latest occurrence of
    each wins). Deterministic: the same turns learnt in the same order give the same drafts."""

    def __init__(self, max_ngram: int = 12, keep_tokens: int = 32768) -> None:
        if max_ngram < 1 or keep_tokens < 1:
            raise ValueError("max_ngram and keep_tokens must be at least 1")
        self.max_ngram = max_ngram
        # Memory stays bounded: past twice this many tokens, only the most recent turns holding
        # at most this many are kept (2.1 kB a token at most, all n-grams distinct: 140 MB).
        self.keep_tokens = keep_tokens
        self._turns: list[list[int]] = []
        self._tokens = 0
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (turn, next pos)

    def __len__(self) -> int:
        """Tokens remembered."""
        return self._tokens

    def learn(self, tokens: Sequence[int]) -> None:
        """Remember one turn's tokens (with a few tokens of the context it followed in front,
        so that its opening can be drafted too)."""
        self._add(list(tokens))
        if self._tokens > 2 * self.keep_tokens:  # rebuild from the most recent turns
            kept, n = [], 0
            for turn in reversed(self._turns):
                if n + len(turn) > self.keep_tokens:
                    break
                kept.append(turn)
                n += len(turn)
            self._turns, self._tokens, self._index = [], 0, {}
            for turn in reversed(kept):
                self._add(turn)

    def _add(self, turn: list[int]) -> None:
        t = len(self._turns)
        self._turns.append(turn)
        self._tokens += len(turn)
        for n in range(1, self.max_ngram + 1):
            for s in range(len(turn) - n):
                self._index[tuple(turn[s: s + n])] = (t, s + n)

    def propose(self, tail: Sequence[int], limit: int) -> list[int]:
        """At most ``limit`` tokens that followed the longest n-gram ending ``tail`` the last
        time it was seen; empty when none was."""
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, len(tail)), 0, -1):
            hit = self._index.get(tuple(tail[-n:]))
            if hit is not None:
                turn, pos = hit
                return self._turns[turn][pos: pos + limit]
        return []
