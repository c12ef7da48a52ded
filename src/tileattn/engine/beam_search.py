"""Beam search over the engine's one-token steps (LLM.beam_search, the server's use_beam_search).

Each step extends every live beam by its 2 x beam_width most likely next tokens (the model's raw
log-probabilities, which the engine reports as ``logprobs``), keeps the beam_width highest sums per
prompt, and sets aside the candidates that end with EOS (unless ignore_eos) as finished; the search
ends when no beam is live or after max_tokens steps, and the answers are ranked by sum /
length^length_penalty. A step is one engine request of one token per live beam, so the caller runs
them however it runs requests (the offline LLM synchronously, the server on its engine thread) and
the beams' shared prefixes come back from the prefix cache.
"""

from __future__ import annotations

import math

from .outputs import BeamSearchSequence
from .sampling_params import SamplingParams

MAX_BEAM_WIDTH = 10  # the candidates come from the engine's top-20 logprobs


class BeamSearch:
    """The search state of several prompts: pending() -> the beams to extend, advance(logprobs) with
    one {token: logprob} per pending beam, answers(decode) at the end. Raises ValueError for
    beam_width outside 1..MAX_BEAM_WIDTH, max_tokens < 1, a length_penalty that is not a finite number
    or an ignore_eos that is not a bool."""

    def __init__(self, prompts: list[list[int]], beam_width: int, max_tokens: int, eos_token_ids,
                 ignore_eos: bool = False, length_penalty: float = 1.0):
        if not isinstance(beam_width, int) or isinstance(beam_width, bool) or not 1 <= beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an int in [1, {MAX_BEAM_WIDTH}], got {beam_width!r}")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if (not isinstance(length_penalty, (int, float)) or isinstance(length_penalty, bool)
                or not math.isfinite(length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r}")
        self.prompts, self.width, self.steps_left = prompts, beam_width, max_tokens
        self.eos, self.ignore_eos, self.length_penalty = set(eos_token_ids), ignore_eos, length_penalty
        self.live = [[((), 0.0)] for _ in prompts]  # per prompt: (tokens, sum of logprobs)
        self.done: list[list] = [[] for _ in prompts]  # per prompt: (tokens, sum, ended with EOS)

    @property
    def step_params(self) -> SamplingParams:
        """The parameters of a step's requests: one token, the candidates' logprobs."""
        return SamplingParams(temperature=0, max_tokens=1, logprobs=2 * self.width, ignore_eos=True)

    def pending(self) -> list[list[int]]:
        """The token ids (prompt + beam) of every live beam, prompts in order; [] when the search ended."""
        if not self.steps_left:
            return []
        return [self.prompts[i] + list(tokens) for i, group in enumerate(self.live) for tokens, _ in group]

    def advance(self, logprobs: list[dict]) -> None:
        """One step: logprobs[j] = {token: logprob} after pending()[j]."""
        beams = [(i, tokens, total) for i, group in enumerate(self.live) for tokens, total in group]
        if len(logprobs) != len(beams):
            raise ValueError(f"{len(logprobs)} logprob rows for {len(beams)} beams")
        candidates: list[list] = [[] for _ in self.prompts]
        for (i, tokens, total), row in zip(beams, logprobs):
            candidates[i] += [(total + logprob, tokens + (token,)) for token, logprob in row.items()]
        for i, group in enumerate(candidates):
            self.live[i] = []
            for total, tokens in sorted(group, key=lambda c: -c[0]):
                if len(self.live[i]) == self.width:
                    break
                if tokens[-1] in self.eos and not self.ignore_eos:
                    self.done[i].append((tokens, total, True))
                else:
                    self.live[i].append((tokens, total))
        self.steps_left -= 1

    def answers(self, decode) -> list[list[BeamSearchSequence]]:
        """Per prompt the beam_width best answers, best first; decode(token_ids) -> text."""
        results = []
        for done, live in zip(self.done, self.live):
            ranked = sorted(done + [(tokens, total, False) for tokens, total in live],
                            key=lambda a: -a[1] / len(a[0]) ** self.length_penalty)[:self.width]
            results.append([BeamSearchSequence(list(tokens), decode(list(tokens)), total,
                                               total / len(tokens) ** self.length_penalty, finished)
                            for tokens, total, finished in ranked])
        return results
