"""The model on its device: KV-cache allocation, the packed input tensors of a step, CUDA graphs
for decode steps, and the forward + sampling of one scheduled batch.

KV cache: one tensor [2, layers, num_blocks, block_size, Hkv, d]; each attention layer gets its
k and v views. On CUDA it takes what gpu_memory_utilization leaves after the weights and the peak
activations of a profile step of max_num_batched_tokens tokens; on CPU a fixed 256 MiB (or
kv_cache_blocks).

CUDA graphs: a decode step (every sequence feeds one token) launches hundreds of small kernels
whose CPU launch cost exceeds their GPU time at small batches; replaying a captured graph launches
them all at once. Graphs are captured for a ladder of batch sizes up to max_num_seqs, against
static input buffers; a step with B sequences pads to the next captured size (padded rows write
nothing to the cache: slot -1) and copies its inputs into the buffers before the replay. The
attention op gets max_seqlen_k = max_model_len at capture, so one graph serves every length.

Tensor parallel (distributed.py): every rank builds a runner in lock step (the KV-cache size is the
smallest any rank can hold; each rank's cache holds its KV heads; every rank captures the same
graphs, NCCL all-reduces inside). Rank 0's execute() broadcasts each step's packed inputs and the
graph size it chose; the workers run the same forward on them in serve_steps(); the logits of the
sampled rows are gathered on rank 0, which samples.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .distributed import CMD_LOGITS, CMD_STEP, CMD_STOP, TensorParallel
from .layers import AttentionBatch, PagedAttention, paged_attention_ops
from .loader import model_length_limit
from .profiler import NULL
from .sampler import Sampler, apply_top_k_top_p, top_logprobs

CPU_KV_CACHE_BYTES = 256 << 20
_PROMPT_LOGPROB_ROWS = 512  # logits rows per chunk when scoring prompts ([rows, vocab] float32)


@dataclass
class StepResult:
    sampled: list  # [(seq, token_id, {token_id: logprob} | None)] for sequences that got a token
    prompt_logprobs: dict  # seq -> list of {token_id: logprob} for the prompt tokens scored this step
    pooled: list  # [(seq, float32 [hidden] on the host)] for embedding requests whose prompt ended


class StepHandle:
    """A launched step: its forward and sampling are enqueued, its sampled tokens (``tokens``,
    int64 [N] on the device) are on their way to pinned host memory. result() waits for them and
    builds the StepResult (logprobs and prompt logprobs, when asked, are read then)."""

    def __init__(self, runner: ModelRunner, scheduled, inputs: dict, hidden, logits):
        self.runner, self.scheduled, self.inputs = runner, scheduled, inputs
        self.sample_seqs = inputs["sample_seqs"]
        self.hidden, self.logits = hidden, logits
        self.tokens = self.host_tokens = self.ready = None
        self.pool_seqs, self.pooled = inputs["pool_seqs"], None
        if self.pool_seqs:  # gathered now: a graph's output buffer is overwritten by the next replay
            rows = _h2d(inputs["pool_rows"].numpy(), hidden.device)
            self.pooled = hidden.index_select(0, rows).float()  # [P, hidden]
        if self.sample_seqs:
            self.tokens = runner.sampler.sample(logits, self.sample_seqs)  # [N] on the device
            runner.profiler.record(2)
            if runner.device.type == "cuda":
                self.host_tokens = torch.empty(self.tokens.shape, dtype=torch.int64, pin_memory=True)
                self.host_tokens.copy_(self.tokens, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record()
            else:
                self.host_tokens = self.tokens
            if all(seq.params.logprobs is None for seq in self.sample_seqs):
                self.logits = None  # not read again: a step waiting ahead need not hold [N, vocab] floats

    @property
    def prompt_rows(self) -> list:
        return self.inputs["prompt_rows"]

    def result(self) -> StepResult:
        runner, sampled = self.runner, []
        if self.sample_seqs:
            if self.ready is not None:
                self.ready.synchronize()
            tokens = self.host_tokens.tolist()
            logprobs = ([None] * len(tokens) if self.logits is None
                        else runner.sampler.logprobs(self.logits, self.tokens, self.sample_seqs))
            sampled = list(zip(self.sample_seqs, tokens, logprobs))
        prompt_logprobs = {}
        for seq, rows, targets in self.prompt_rows:
            prompt_logprobs[seq] = runner._score(self.hidden, rows, targets, seq.params.prompt_logprobs)
        pooled = list(zip(self.pool_seqs, self.pooled.cpu())) if self.pool_seqs else []
        self.hidden = self.logits = self.pooled = None
        return StepResult(sampled, prompt_logprobs, pooled)


def _h2d(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without making the host wait for the stream (pinned
    memory, non-blocking copy; a pageable copy would wait for the work queued before it)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _check_kernel_support(head_dim: int, block_size: int) -> None:
    """tileattn's CUDA paged kernels cover some head dims and block sizes; say so at start-up
    rather than at the first forward. Raises ValueError naming the value."""
    from tileattn.api_paged import PAGED_HEAD_DIMS

    if head_dim not in PAGED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim}: tileattn's paged attention kernels support {PAGED_HEAD_DIMS}")
    if block_size & (block_size - 1) or not 16 <= block_size <= 256:
        raise ValueError(f"block_size={block_size}: the CUDA paged kernels need a power of two in 16..256")


class ModelRunner:
    """tp: this rank's TensorParallel (None: one GPU); with N > 1 every rank constructs its runner at
    the same time (they agree on the cache size). Raises ValueError when the KV cache cannot hold
    one sequence of max_model_len tokens."""

    def __init__(self, loaded, config, device: torch.device, max_model_len: int | None,
                 tp: TensorParallel | None = None):
        self.tp = tp or TensorParallel()
        self.model = loaded.model
        self.cfg = loaded.config
        self.device = device
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.sampler = Sampler(loaded.eos_token_ids)
        self.speculative = config.num_speculative_tokens > 0  # steps may carry drafts (speculative.py)
        self.pooling = False  # set by the engine while embedding requests are live (their rows are pooled)
        self.lora = None  # LoRAAdapters when the engine serves adapters (max_loras > 0)
        if config.max_loras:
            from .lora import LoRAAdapters

            self.lora = LoRAAdapters(self.model, config.max_loras, config.max_lora_rank, self.dtype, device)
        self.profiler = NULL  # LLMEngine.enable_profiling() sets a StepProfiler (rank 0)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        if device.type == "cuda":
            _check_kernel_support(self.cfg.head_dim, self.block_size)
        ops = paged_attention_ops(device)
        for layer in self.attention_layers:
            layer.ops = ops
        self.kv_heads = self.attention_layers[0].kv_heads  # this rank's

        self.num_blocks = self.tp.min_over_ranks(config.kv_cache_blocks or self._blocks_that_fit(config))
        capacity = self.num_blocks * self.block_size
        model_limit = model_length_limit(self.cfg)
        if max_model_len is not None and max_model_len > capacity:
            raise ValueError(f"the KV cache ({self.num_blocks} blocks x {self.block_size} tokens = {capacity} "
                             f"tokens) cannot hold one sequence of max_model_len={max_model_len}; lower "
                             "max_model_len or give the cache more memory (gpu_memory_utilization, kv_cache_blocks)")
        self.max_model_len = max_model_len or min(model_limit, capacity)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.kv_cache = torch.zeros(2, self.cfg.num_layers, self.num_blocks, self.block_size,
                                    self.kv_heads, self.cfg.head_dim, dtype=self.dtype, device=device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]  # [blocks, bs, Hkv, d]
        self.graphs: dict[int, tuple] = {}
        self._staging = _Staging(1 << 20) if device.type == "cuda" else None  # eager steps' inputs
        # (a model that cannot be captured, e.g. an MoE in fp16 whose experts size their GEMMs on the
        # host, runs every step eagerly; with LoRA adapters the graphs serve the steps without adapter tokens)
        if device.type == "cuda" and not config.enforce_eager and self.model.cuda_graphs_supported():
            self._capture_graphs()

    # ---- memory ---------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes of one block across all layers, k and v (this rank's KV heads)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.cfg.num_layers * self.block_size * self.kv_heads * self.cfg.head_dim * element

    def _blocks_that_fit(self, config) -> int:
        if self.device.type != "cuda":
            return max(CPU_KV_CACHE_BYTES // self.block_bytes(), 1)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_step()
        free, total = torch.cuda.mem_get_info(self.device)
        current = torch.cuda.memory_allocated(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        # Memory in use by anything (this process's weights, other processes, the CUDA context),
        # plus this process's activation peak above what stays allocated.
        budget = total * config.gpu_memory_utilization - (total - free) - (peak - current)
        blocks = int(budget // self.block_bytes())
        if blocks < 1:
            raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                             f"{config.gpu_memory_utilization} ({(total - free) / 2**30:.1f} GiB in use "
                             f"of {total / 2**30:.1f} GiB after loading the weights)")
        return blocks

    def _profile_step(self) -> None:
        """One forward of max_num_batched_tokens tokens (in max_num_seqs sequences) and the logits
        of max_num_seqs rows sampled with top-k and top-p, against a scratch cache just large enough,
        to measure peak memory."""
        tokens = self.max_num_batched_tokens
        seqs = min(self.max_num_seqs, tokens)
        per_seq = -(-tokens // seqs)
        blocks_per_seq = -(-per_seq // self.block_size)
        scratch = torch.zeros(2, seqs * blocks_per_seq, self.block_size, self.kv_heads,
                              self.cfg.head_dim, dtype=self.dtype, device=self.device)
        for layer in self.attention_layers:
            layer.k_cache, layer.v_cache = scratch[0], scratch[1]
        lengths = [per_seq] * (tokens // per_seq) + ([tokens % per_seq] if tokens % per_seq else [])
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        table = torch.arange(len(lengths) * blocks_per_seq, dtype=torch.int32).view(len(lengths), -1)
        batch = AttentionBatch(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            seqlens_k=torch.tensor(lengths, dtype=torch.int32, device=self.device),
            block_tables=table.to(self.device),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            max_seqlen_q=per_seq, max_seqlen_k=per_seq)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        with torch.inference_mode():
            hidden = self.model(ids, positions, batch)
            logits = self.model.compute_logits(hidden[:seqs])  # [seqs, vocab] (tensor parallel: rank 0)
            if logits is not None:
                # The sampler's largest transient: a full-vocabulary sort for top-k / top-p.
                apply_top_k_top_p(logits, [logits.shape[-1] // 2] * seqs, [0.9] * seqs).softmax(-1)
        torch.cuda.synchronize(self.device)
        del scratch, hidden, logits
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None

    # ---- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled) -> StepResult:
        """Run the model on [(seq, n)] (token_ids[computed:computed+n] of each) and sample the next
        token of every sequence whose chunk reaches its last token. Tensor parallel: rank 0 only."""
        return self.launch(scheduled).result()

    @torch.inference_mode()
    def launch(self, scheduled) -> StepHandle:
        """execute() without waiting: the step's forward and sampling are enqueued on the device
        and its tokens start their copy to the host; StepHandle.result() waits for them."""
        prof = self.profiler
        inputs = self.prepare_inputs(scheduled)
        graph = self._graph_for(scheduled)
        prof.lap("prepare")
        hidden, logits = self._run(inputs, graph)  # [T, hidden], [N, vocab] | None
        return StepHandle(self, scheduled, inputs, hidden, logits)

    @torch.inference_mode()
    def launch_decode_ahead(self, previous: StepHandle, seqs, rows) -> StepHandle:
        """Enqueue the decode step after ``previous`` before its tokens reach the host: each of
        ``seqs`` (sampled by previous, in its row ``rows[i]``; rows None: all of previous's rows in
        order) feeds the token previous sampled for it, read on the device, at the position it
        will take (len(token_ids): previous's token is not appended yet). The caller has made room
        for it in the cache. One sequence, one token; all are sampled. Not with tensor parallel."""
        prof = self.profiler
        starts = np.fromiter((len(seq.token_ids) for seq in seqs), np.int64, len(seqs))
        inputs = self._pack_inputs(seqs, np.ones(len(seqs), np.int64), starts, None)
        graph = self._graph_for([(seq, 1) for seq in seqs])
        ids = previous.tokens if rows is None else previous.tokens[_h2d(np.asarray(rows, np.int64), self.device)]
        prof.lap("prepare")
        hidden, logits = self._forward(inputs, graph, ids)
        return StepHandle(self, [(seq, 1) for seq in seqs], inputs, hidden, logits)

    @torch.inference_mode()
    def all_logits(self, scheduled) -> torch.Tensor:
        """float32 logits [T, vocab] of every token of [(seq, n)], eager (for tests and scoring);
        the blocks must be allocated. Tensor parallel: rank 0 only."""
        inputs = self.prepare_inputs(scheduled)
        inputs["sample_rows"] = torch.arange(inputs["input_ids"].shape[0])
        return self._run(inputs, 0)[1]

    def _run(self, inputs, graph: int):
        """Rank 0: send the step to the workers (tensor parallel), then run it here too."""
        if self.tp.size > 1:
            header, payload = _pack(inputs)
            self.tp.send([CMD_STEP, *header, graph], payload)
        return self._forward(inputs, graph)

    def _forward(self, inputs, graph: int, ids: torch.Tensor | None = None):
        """The step on this rank: (hidden [T, hidden], logits [N, vocab] of inputs' sample rows on
        rank 0, else None). graph: the captured batch size to replay, 0 for eager. ids: the input
        token ids already on the device (a decode step run ahead), replacing inputs' placeholders."""
        prof = self.profiler
        count = inputs["seqlens_k"].shape[0]
        if graph:
            self._stage_static(inputs, count, graph)
            if ids is not None:
                self.static["input_ids"][:count].copy_(ids)  # ordered after the staged copy
            prof.lap("h2d")
            prof.record(0)
            replay, out, _ = self.graphs[graph]
            replay.replay()
            hidden = out[:count]  # [B, hidden]
            rows = inputs["sample_rows"]
            rows = _h2d(rows.numpy(), self.device) if 0 < rows.shape[0] < count else None  # a budget cut
        else:
            dev = self._upload(inputs)
            if ids is not None:
                dev["input_ids"].copy_(ids)
            batch = AttentionBatch(cu_seqlens_q=dev["cu_seqlens_q"], seqlens_k=dev["seqlens_k"],
                                   block_tables=dev["block_tables"], slot_mapping=dev["slot_mapping"],
                                   max_seqlen_q=inputs["max_seqlen_q"], max_seqlen_k=inputs["max_seqlen_k"],
                                   lora=inputs.get("lora_groups"))
            prof.lap("h2d")
            prof.record(0)
            hidden = self.model(dev["input_ids"], dev["positions"], batch)  # [T, hidden]
            rows = dev["sample_rows"]
        logits = None
        if inputs["sample_rows"].shape[0]:
            # Every token sampled (decode): the sample rows are 0..T-1 in order, no gather needed.
            whole = inputs["sample_rows"].shape[0] == hidden.shape[0]
            logits = self.model.compute_logits(hidden if whole else hidden[rows])
        prof.record(1)
        prof.lap("forward")
        return hidden, logits

    def _upload(self, inputs) -> dict:
        """The step's index tensors on the device. On CUDA they are packed into a pinned staging
        buffer and cross PCIe in one copy (one DMA instead of seven, no pinned allocation per
        step); eager decode steps get the full-width block table the graphs use (see prepare_inputs)."""
        tables = inputs["block_tables"]
        if inputs["max_seqlen_q"] == 1 and tables.shape[1] < self.max_blocks_per_seq:
            wide = torch.zeros(tables.shape[0], self.max_blocks_per_seq, dtype=torch.int32)
            wide[:, :tables.shape[1]] = tables
            inputs = {**inputs, "block_tables": wide}
        if self.device.type != "cuda":
            return inputs
        arrays = [inputs[key].numpy() for key in _UPLOAD_KEYS]  # int64 ones first: offsets stay aligned
        nbytes = sum(a.nbytes for a in arrays)
        pinned, host = self._staging.take(nbytes)
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        out, offset = {}, 0
        for key, array in zip(_UPLOAD_KEYS, arrays):
            host[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)[...] = array
            out[key] = device[offset:offset + array.nbytes].view(_TORCH_DTYPES[array.dtype.char]).view(array.shape)
            offset += array.nbytes
        device.copy_(pinned[:nbytes], non_blocking=True)
        self._staging.copied()
        return out

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small tensor off the hot path (prompt-logprob rows) to the device."""
        return t.to(self.device)

    def _score(self, hidden, rows, targets, top_n) -> list[dict]:
        out = []
        for start in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            part = slice(start, start + _PROMPT_LOGPROB_ROWS)
            chunk = torch.tensor(rows[part], dtype=torch.int64)
            if self.tp.size > 1:
                self.tp.send([CMD_LOGITS, len(chunk)], chunk)
            logits = self.model.compute_logits(hidden[self._to_device(chunk)])
            chosen = torch.tensor(targets[part], device=self.device)
            out += top_logprobs(logits, chosen, [top_n] * len(rows[part]))
        return out

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Tensor-parallel workers: run the steps rank 0 broadcasts until it sends CMD_STOP."""
        hidden = None
        while True:
            (cmd, *header), payload = self.tp.receive(_payload_numel)
            if cmd == CMD_STOP:
                return
            if cmd == CMD_STEP:
                hidden, _ = self._forward(_unpack(header, payload), header[7])
            elif cmd == CMD_LOGITS:
                self.model.compute_logits(hidden[self._to_device(payload)])
            else:
                raise RuntimeError(f"tensor-parallel worker rank {self.tp.rank}: unknown command {cmd}")

    def prepare_inputs(self, scheduled) -> dict:
        """Packed inputs of a step as host tensors (built with numpy from a few per-sequence reads;
        _forward copies them to the device in one transfer), plus the sequences to sample and the
        prompt rows to score. The block table is as wide as the longest sequence's (used_blocks)."""
        count = len(scheduled)
        seqs = [seq for seq, _ in scheduled]
        counts = np.fromiter((n for _, n in scheduled), np.int64, count)  # [B]
        starts = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, count)  # [B]
        return self._pack_inputs(seqs, counts, starts, lambda seq, p: seq.token_ids[p])

    def _pack_inputs(self, seqs, counts: np.ndarray, starts: np.ndarray, token) -> dict:
        """prepare_inputs for sequences feeding counts[i] tokens from position starts[i]; token(seq, p)
        reads a one-token step's id (None: zeros, the ids arrive on the device)."""
        size, count = self.block_size, len(seqs)
        ends = starts + counts  # [B]
        cu = np.zeros(count + 1, np.int64)  # [B + 1]
        np.cumsum(counts, out=cu[1:])
        total, max_q = int(cu[-1]), int(counts.max())
        starts_list = starts.tolist()
        if max_q == 1:  # decode (or one-token chunks): token p of each sequence, at position p
            ids = (np.zeros(count, np.int64) if token is None
                   else np.fromiter((token(seq, p) for seq, p in zip(seqs, starts_list)), np.int64, count))
            positions, owner = starts, np.arange(count)
        else:
            ids = np.fromiter(itertools.chain.from_iterable(
                seq.token_ids[a:b] for seq, a, b in zip(seqs, starts_list, ends.tolist())), np.int64, total)
            owner = np.repeat(np.arange(count), counts)  # [T] the sequence of each token
            positions = np.arange(total) - (cu[:-1] - starts)[owner]  # [T]
        tables = self._block_tables(seqs)  # [B, used] int32
        slots = tables[owner, positions // size].astype(np.int64) * size + positions % size  # [T]
        if token is None:  # run ahead: every sequence samples
            sampled = np.ones(count, bool)
        else:
            sampled = ends == np.fromiter((len(seq.token_ids) for seq in seqs), np.int64, count)  # [B] at the end
        pool_rows, pool_seqs = None, []
        if self.pooling and token is not None:  # embedding requests at their last prompt token: pooled, not sampled
            pooled = sampled & np.fromiter((seq.request.pooling is not None for seq in seqs), bool, count)  # [B]
            if pooled.any():
                pool_rows, sampled = cu[1:][pooled] - 1, sampled & ~pooled
                pool_seqs = [seq for seq, p in zip(seqs, pooled.tolist()) if p]
        sample_rows = cu[1:][sampled] - 1  # [N]
        sample_seqs = seqs if sampled.all() else [seq for seq, s in zip(seqs, sampled.tolist()) if s]
        if self.speculative and token is not None and any(seq.drafts for seq in sample_seqs):
            # a sequence with k drafts samples its last 1 + k rows: the argmax after each input
            sample_rows, sample_seqs = self._verify_rows(sample_rows, sample_seqs)
        prompt_rows = []
        for row, seq in enumerate(seqs):
            scored = seq.request.prompt_logprobs  # position p scores prompt token p + 1
            if scored is None or seq.index != 0 or token is None:
                continue
            start, end = starts_list[row], int(ends[row])
            first, last = len(scored) - 1, min(end, seq.num_prompt_tokens - 1)
            if start <= first < last:  # positions first..last-1 are in this chunk, unscored
                base = int(cu[row]) - start
                prompt_rows.append((seq, list(range(base + first, base + last)), seq.token_ids[first + 1:last + 1]))
        return {"input_ids": torch.from_numpy(ids),  # [T] int64
                "positions": torch.from_numpy(positions),  # [T] int64
                "slot_mapping": torch.from_numpy(slots),  # [T] int64
                "cu_seqlens_q": torch.from_numpy(cu.astype(np.int32)),  # [B + 1]
                "seqlens_k": torch.from_numpy(ends.astype(np.int32)),  # [B]
                "block_tables": torch.from_numpy(tables),  # [B, used] int32
                "sample_rows": torch.from_numpy(sample_rows),  # [N] int64
                "max_seqlen_q": max_q, "max_seqlen_k": int(ends.max()),
                "used_blocks": tables.shape[1],  # columns of block_tables any sequence fills
                "sample_seqs": sample_seqs, "prompt_rows": prompt_rows,
                "pool_rows": None if pool_rows is None else torch.from_numpy(pool_rows),  # [P] int64
                "pool_seqs": pool_seqs,
                "lora_groups": None if self.lora is None else self.lora.groups(
                    np.fromiter((seq.request.lora_slot for seq in seqs), np.int64, count)[owner], self.device)}

    @staticmethod
    def _verify_rows(sample_rows: np.ndarray, sample_seqs: list):
        rows, owners = [], []
        for last, seq in zip(sample_rows.tolist(), sample_seqs):
            k = len(seq.drafts) if seq.drafts else 0
            rows.extend(range(last - k, last + 1))
            owners.extend([seq] * (k + 1))
        return np.asarray(rows, np.int64), owners

    def _block_tables(self, seqs) -> np.ndarray:
        """[B, used] int32 block tables (zero-padded), used = the longest table. Each sequence keeps
        its table as a numpy row (Sequence.table_row) updated only when blocks were added, so a
        step costs one stack instead of a list-to-array conversion per sequence."""
        used = max(len(seq.block_table) for seq in seqs)
        rows = []
        for seq in seqs:
            table, cached = seq.block_table, seq.table_row
            if cached is None or cached[0] is not table or cached[1] > len(table):
                cached = (table, 0, np.zeros(self.max_blocks_per_seq, np.int32))
            if cached[1] != len(table):
                cached[2][cached[1]:len(table)] = table[cached[1]:]
                cached = (table, len(table), cached[2])
            seq.table_row = cached
            rows.append(cached[2][:used])
        return np.stack(rows)

    # ---- CUDA graphs ----------------------------------------------------------------------------

    def graph_batch_sizes(self) -> list[int]:
        sizes = [b for b in (1, 2, 4, 8) if b < self.max_num_seqs]
        sizes += range(16, self.max_num_seqs, 16)
        return sorted(set(sizes) | {self.max_num_seqs})

    def _graph_for(self, scheduled) -> int:
        """The batch size of the captured graph for a pure decode step of this size, or 0 (eager)."""
        if not self.graphs or len(scheduled) > self.max_num_seqs:
            return 0
        if any(n != 1 for _, n in scheduled):
            return 0
        if self.lora is not None and any(seq.request.lora_slot for seq, _ in scheduled):
            return 0  # adapter tokens: the unfused path, eagerly (lora.py)
        return next(b for b in self.graph_batch_sizes() if b >= len(scheduled))

    def make_static_inputs(self) -> None:
        """The graphs' input buffers, sized for the largest; a graph of size b reads rows [:b].
        Padded rows keep slot -1 (no cache write) and key length 1 (a valid, ignored read).
        All of them are views of one byte buffer laid out as _static_layout says, block tables
        last, so a step's inputs for a graph of size b arrive in one copy of its first bytes."""
        layout, nbytes = self._static_layout()
        self.static_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.static = {name: self.static_bytes[offset:offset + nbytes].view(dtype).view(shape)
                       for name, dtype, shape, offset, nbytes in layout}
        self._static_tables_offset = layout[-1][3]
        if self.device.type == "cuda":
            # Two pinned copies of the buffer in turn, each starting as the initial state.
            self._static_staging = _Staging(nbytes)
            self._static_host = [_numpy_views(host, layout) for host in self._static_staging.arrays]
        else:  # the CPU writes the buffers themselves
            self._static_host = [_numpy_views(self.static_bytes.numpy(), layout)]
        for views in self._static_host:
            views["slot_mapping"][:] = -1
            views["seqlens_k"][:] = 1
            views["cu_seqlens_q"][:] = np.arange(self.max_num_seqs + 1)

    def _static_layout(self):
        """[(name, torch dtype, shape, byte offset, bytes)] of the static inputs, and their total."""
        largest, width = self.max_num_seqs, self.max_blocks_per_seq
        fields = [("input_ids", torch.int64, (largest,)), ("positions", torch.int64, (largest,)),
                  ("slot_mapping", torch.int64, (largest,)), ("seqlens_k", torch.int32, (largest,)),
                  ("cu_seqlens_q", torch.int32, (largest + 1,)), ("block_tables", torch.int32, (largest, width))]
        layout, offset = [], 0
        for name, dtype, shape in fields:
            element = torch.empty((), dtype=dtype).element_size()
            offset = -(-offset // 8) * 8
            nbytes = element * int(np.prod(shape))
            layout.append((name, dtype, shape, offset, nbytes))
            offset += nbytes
        return layout, offset

    def _stage_static(self, inputs, count: int, size: int) -> None:
        """Write a decode step of ``count`` sequences into the static inputs of the graph of
        ``size`` >= count rows: on CUDA into a pinned staging copy of them, then one H2D copy of
        the bytes that graph reads; on the CPU (tests) into the buffers themselves."""
        cuda = self.device.type == "cuda"
        if cuda:
            pinned, _ = self._static_staging.take(0)
            host = self._static_host[self._static_staging.turn]
        else:
            host = self._static_host[0]
        for key in ("input_ids", "positions", "slot_mapping", "seqlens_k"):
            host[key][:count] = inputs[key].numpy()
        host["slot_mapping"][count:size] = -1  # padded rows write nothing
        host["seqlens_k"][count:size] = 1
        tables = inputs["block_tables"].numpy()  # [B, used]; columns past a sequence's end are never read
        host["block_tables"][:count, :tables.shape[1]] = tables
        if cuda:
            nbytes = self._static_tables_offset + size * self.max_blocks_per_seq * 4
            self.static_bytes[:nbytes].copy_(pinned[:nbytes], non_blocking=True)
            self._static_staging.copied()

    def static_forward(self, size: int):
        """The model on the first ``size`` rows of the static inputs (what a graph captures)."""
        s = self.static
        batch = AttentionBatch(cu_seqlens_q=s["cu_seqlens_q"][:size + 1], seqlens_k=s["seqlens_k"][:size],
                               block_tables=s["block_tables"][:size], slot_mapping=s["slot_mapping"][:size],
                               max_seqlen_q=1, max_seqlen_k=self.max_model_len)
        return self.model(s["input_ids"][:size], s["positions"][:size], batch)  # [size, hidden]

    def _capture_graphs(self) -> None:
        self.make_static_inputs()
        pool = None
        for size in reversed(self.graph_batch_sizes()):  # largest first: later ones reuse its pool
            with torch.inference_mode():
                self.static_forward(size)  # warm-up: compiles and caches the kernels' launch plans
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                # Tensor parallel: the all-reduces are captured as NCCL kernels. torch's NCCL
                # watchdog thread polls the events of earlier collectives meanwhile; "global" mode
                # would make those calls fail the capture, "thread_local" confines the check to
                # this thread (the only one launching work into the graph).
                mode = "thread_local" if self.tp.size > 1 else "global"
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                    out = self.static_forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, out, size)
        torch.cuda.synchronize(self.device)

# ---- host -> device staging ---------------------------------------------------------------------

# The index tensors of a step in the order they are packed for the one H2D copy: the int64 ones
# first, so every tensor's byte offset is a multiple of its element size.
_UPLOAD_KEYS = ("input_ids", "positions", "slot_mapping", "sample_rows", "cu_seqlens_q", "seqlens_k", "block_tables")
_TORCH_DTYPES = {np.dtype(np.int64).char: torch.int64, np.dtype(np.int32).char: torch.int32}


class _Staging:
    """Pinned host buffers for a step's inputs, two used in turn. A buffer is written again only
    once the copy out of it (enqueued two steps earlier) has finished, which an event tells: with
    the host running ahead of the GPU, rewriting a buffer that a queued copy still reads would
    change that step's inputs. Grows (to the next power of two) when a step needs more bytes."""

    def __init__(self, nbytes: int):
        self.buffers, self.arrays, self.events = [], [], []
        self.turn = 1
        self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> None:
        for event in self.events:
            event.synchronize()
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.arrays = [buffer.numpy() for buffer in self.buffers]
        self.events = [torch.cuda.Event() for _ in range(2)]

    def take(self, nbytes: int):
        """(pinned uint8 tensor, its numpy view) to write the next step's inputs into."""
        if nbytes > self.buffers[0].shape[0]:
            self._allocate(1 << (nbytes - 1).bit_length())
        self.turn ^= 1
        self.events[self.turn].synchronize()  # an event never recorded returns at once
        return self.buffers[self.turn], self.arrays[self.turn]

    def copied(self) -> None:
        """The copy out of the buffer last taken is enqueued (on the current stream)."""
        self.events[self.turn].record()


def _numpy_views(array: np.ndarray, layout) -> dict:
    """{name: numpy view} of the static layout's fields in a uint8 host buffer."""
    return {name: array[offset:offset + nbytes].view(np.dtype(str(dtype).removeprefix("torch."))).reshape(shape)
            for name, dtype, shape, offset, nbytes in layout}


# ---- the step broadcast (tensor parallel) -------------------------------------------------------------

def _pack(inputs) -> tuple[list[int], torch.Tensor]:
    """Step inputs -> (header [T, B, W, U, max_q, max_k, N], one int64 payload). Only the U block
    table columns some sequence fills travel (a decode step's table is max_model_len / block_size
    wide for the graphs' sake, mostly padding), so a decode step fits in one message."""
    tables, used = inputs["block_tables"], inputs["used_blocks"]  # [B, W]
    header = [inputs["input_ids"].shape[0], tables.shape[0], tables.shape[1], used, inputs["max_seqlen_q"],
              inputs["max_seqlen_k"], inputs["sample_rows"].shape[0]]
    payload = torch.cat([inputs["input_ids"], inputs["positions"], inputs["slot_mapping"],
                         inputs["cu_seqlens_q"].long(), inputs["seqlens_k"].long(),
                         tables[:, :used].long().flatten(), inputs["sample_rows"]])
    return header, payload


def _payload_numel(header) -> int:
    """Payload length of a command, from its header (the command first)."""
    cmd, tokens, seqs, _, used, _, _, rows = header[:8]
    if cmd == CMD_STEP:
        return 3 * tokens + 2 * seqs + 1 + seqs * used + rows
    return header[1] if cmd == CMD_LOGITS else 0


def _unpack(header, payload) -> dict:
    tokens, seqs, width, used, max_q, max_k, rows = header[:7]
    ids, positions, slots, cu, seqlens, table_part, sample_rows = payload.split(
        [tokens, tokens, tokens, seqs + 1, seqs, seqs * used, rows])
    tables = torch.zeros(seqs, width, dtype=torch.int32)
    tables[:, :used] = table_part.view(seqs, used)
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots,
            "cu_seqlens_q": cu.int(), "seqlens_k": seqlens.int(), "block_tables": tables,
            "sample_rows": sample_rows, "max_seqlen_q": max_q, "max_seqlen_k": max_k}
