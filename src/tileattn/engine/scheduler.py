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
A waiting sequence that finds no room (too few free blocks, or max_num_seqs running) preempts running
sequences of strictly lower priority, in that order, as many as it needs and only when they make room
(never one of its own priority or higher); those are not readmitted in the same step.
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
        victims: list[Sequence] = []  # preempted this step to admit a higher priority: not readmitted in it
        while not self._preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            full = len(self.running) >= self.max_num_seqs
            if (full and not (self.by_priority and self._outranks(seq))) or seq in victims:
                break
            scored = seq.request.prompt_logprobs
            cached = self.block_manager.allocate_prefix(
                seq, use_cache=scored is None or len(scored) >= seq.num_prompt_tokens)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if full or not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + n):
                preempted = self._preempt_for(seq, n, full)
                if preempted is None:
                    self.block_manager.free(seq)
                    break
                victims += preempted
                budget += sum(m for victim, m in scheduled if victim in preempted)
                scheduled = [(other, m) for other, m in scheduled if other not in preempted]
                room = self.block_manager.ensure_slots(seq, seq.num_computed_tokens + n)
                assert room, "preempted for a waiting sequence and still no room"
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

    def _outranks(self, seq: Sequence) -> bool:
        """Priority scheduling: waiting seq has a strictly higher priority than some running sequence."""
        return any(r.request.priority > seq.request.priority for r in self.running)

    def _preempt_for(self, seq: Sequence, n: int, full: bool) -> list[Sequence] | None:
        """Priority scheduling: make room for waiting seq (its prefix allocated) to compute n tokens
        by preempting running sequences of strictly lower priority, the lowest (latest arrival) first,
        only as many as needed. Returns those preempted; None, preempting nobody, when even all of
        them would not make room (too few blocks freed, or max_num_seqs still reached)."""
        if not self.by_priority:
            return None
        bm = self.block_manager
        short = -(-(seq.num_computed_tokens + n) // bm.block_size) - len(seq.block_table) - bm.num_free_blocks
        released: dict[int, int] = {}  # block id -> references the victims hold (shared blocks free with the last)
        victims = []
        for victim in sorted(self.running, key=_rank, reverse=True):
            if short <= 0 and not (full and not victims):
                break
            if victim.request.priority <= seq.request.priority:
                return None
            victims.append(victim)
            for block_id in victim.block_table:
                released[block_id] = released.get(block_id, 0) + 1
                if bm.blocks[block_id].ref_count == released[block_id]:
                    short -= 1
        if short > 0 or (full and not victims):
            return None
        for victim in victims:
            self.running.remove(victim)
            self._preempt(victim)
        return victims

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
