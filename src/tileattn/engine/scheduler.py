"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a budget of max_num_batched_tokens tokens and max_num_seqs sequences. Running
sequences come first (a decode costs 1 token, an unfinished prefill its next chunk), then waiting
ones are admitted in arrival order with as much of their prompt as the budget leaves (chunked
prefill: long prompts are split over steps and mixed with other sequences' decodes). When a
running sequence needs a block and none is free, the most recently admitted sequence is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later (its
full blocks stay in the prefix cache, so the recompute is often mostly cache hits).

With ``priority`` scheduling (vLLM's policy) a request's priority (lower runs first; ties in arrival
order) orders the waiting queue, a preempted sequence goes back to its place in it, and the running
sequence preempted is the one that would be admitted last: the lowest priority, the latest arrival.
"""

from __future__ import annotations

import bisect
from collections import deque

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


SCHEDULING_POLICIES = ("fcfs", "priority")


def _rank(seq: Sequence) -> tuple:
    """Priority scheduling's order: (priority, arrival, sequence)."""
    return seq.request.priority, seq.request.arrival_index, seq.index


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs"):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.by_priority = policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._preempted = False  # in the current schedule() call

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._enqueue(seq)
        else:
            self.waiting.append(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue at its priority's place."""
        bisect.insort(self.waiting, seq, key=_rank)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """[(sequence, tokens to compute this step)]; the tokens are token_ids[computed:computed+n]."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        self._preempted = False
        if self.by_priority:  # running in admission order by priority: the back is preempted first
            self.running.sort(key=_rank)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n):
                break  # seq itself was preempted: it was the last running sequence
            scheduled.append((seq, n))
            budget -= n
            index += 1
        # Admit waiting sequences only when nothing was preempted: blocks are short right now.
        while (not self._preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            scored = seq.request.prompt_logprobs
            cached = self.block_manager.allocate_prefix(
                seq, use_cache=scored is None or len(scored) >= seq.num_prompt_tokens)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + n):
                self.block_manager.free(seq)
                break
            self.block_manager.record_lookup(seq.num_tokens, cached)
            if seq.num_cached_tokens is None:  # a preempted sequence's own blocks do not count
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Blocks for seq's next n tokens, preempting from the back of running as needed.
        False when seq itself had to go."""
        if seq.num_computed_tokens + n <= len(seq.block_table) * self.block_manager.block_size:
            return True  # the common case: room in its last block
        while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            self._preempted = True
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # also resets num_computed_tokens: recompute from the start
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            self._enqueue(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence from the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
