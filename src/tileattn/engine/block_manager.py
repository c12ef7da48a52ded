"""Paged KV-cache blocks: allocation, reference counts, and a prefix cache of full blocks.

A full block is keyed by a hash chained over every block before it (so equal hashes mean equal
prefixes, up to collisions) and verified against its token ids before it is shared. Freed blocks
keep their contents and hash until they are handed out again, in least-recently-freed order, so a
later request with the same prefix (or a preempted sequence coming back) finds them.
A sequence only ever writes into blocks it owns alone: shared blocks are full, and a cache hit
never covers a sequence's last token (its logits must be computed).
"""

from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = None         # chained hash once the block is full and its k/v computed
        self.token_ids = None    # the tuple of token ids that hash was made from


class BlockManager:
    """num_blocks blocks of block_size tokens. Raises nothing: methods that can run out of blocks
    return False and leave the sequence unchanged."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.prefix_cache_queries = 0     # prompt tokens looked up
        self.prefix_cache_hits = 0        # of those, found in the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    def allocate_prefix(self, seq, use_cache: bool = True) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix (full
        blocks before its last token); sets num_computed_tokens. Returns the tokens found.
        use_cache=False looks nothing up (a prompt whose logprobs are wanted is computed whole)."""
        assert not seq.block_table, "allocate_prefix on a sequence that holds blocks"
        size, tokens = self.block_size, seq.token_ids
        prev, hits = seq.hash_seed, []  # a LoRA request's blocks chain from its adapter (their k/v differ)
        for i in range((len(tokens) - 1) // size if use_cache else 0):
            chunk = tuple(tokens[i * size:(i + 1) * size])
            h = hash((prev, chunk))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            prev = h
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = hits
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = prev
        seq.num_computed_tokens = len(hits) * size
        return seq.num_computed_tokens

    def record_lookup(self, queried: int, hit: int) -> None:
        self.prefix_cache_queries += queried
        self.prefix_cache_hits += hit

    def ensure_slots(self, seq, num_tokens: int) -> bool:
        """Grow seq.block_table to hold num_tokens tokens. False (nothing changed) if too few free."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed > len(self.free_blocks):
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def register_full_blocks(self, seq) -> None:
        """Enter the sequence's newly completed blocks (k/v computed) into the prefix cache."""
        size = self.block_size
        full = min(seq.num_computed_tokens, seq.num_tokens) // size
        for i in range(seq.num_hashed_blocks, full):
            chunk = tuple(seq.token_ids[i * size:(i + 1) * size])
            h = hash((seq.last_block_hash, chunk))
            block = self.blocks[seq.block_table[i]]
            # A block whose chunk another block already holds in the cache (n > 1 forks, or requests
            # with one prefix admitted in the same step, each computed it) stays unhashed: nothing can
            # look it up, so on free it goes to the front of the free list instead of crowding out
            # blocks the cache can serve.
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, chunk
                self.cached[h] = block.block_id
            seq.last_block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free(self, seq) -> None:
        """Release all of a sequence's blocks. Cached (hashed) blocks go to the back of the free
        list, last block first, so a sequence's tail is reused before its head; blocks without a
        hash go to the front (nothing to keep in them)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None
        seq.num_computed_tokens = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its contents are about to be overwritten
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id
