"""Tensor parallelism (Megatron-style) over torch.distributed: one process per GPU (NCCL), or per
CPU rank (gloo).

Processes. Rank 0 is the calling process: it schedules, samples and detokenizes as with one GPU.
Ranks 1..N-1 are workers started with torch.multiprocessing (spawn). Every rank loads its own shard
of the checkpoint and builds the same ModelRunner (KV cache, CUDA graphs) in lock step; afterwards
a worker waits in a broadcast from rank 0 for each step's inputs (`ModelRunner.serve_steps`), runs
the same forward on them and takes part in its collectives.

Layout (N ranks; the model checks divisibility with check_tensor_parallel before any work):
- qkv and gate/up projections are column-parallel: rank r holds heads [r H/N, (r+1) H/N), its KV
  heads, and rows [r F/N, (r+1) F/N) of gate and of up. Attention and the gated activation are
  then local to the rank.
- o and down projections are row-parallel: rank r holds the matching input columns; the partial
  products are summed by one all-reduce per projection (biases added once, after it).
- KV heads: Hkv/N per rank when N divides Hkv; when Hkv < N (N a multiple of Hkv) each rank holds
  the one KV head its query heads read, replicated on N/Hkv ranks. Each rank's paged KV cache holds
  only its heads, so the cache holds N times as many tokens per byte as with one GPU (Hkv >= N).
- Embedding and LM head are vocab-parallel: rank r holds rows [r V/N, (r+1) V/N); a token outside
  the rank's range embeds to zero and one all-reduce completes the lookup; each rank computes its
  slice of the logits and rank 0 gathers them for sampling.

Failure: a worker that exits (an exception, a signal) is seen by rank 0's monitor thread, which
stops the other workers (SIGTERM, then SIGKILL) and, on NCCL, aborts the communicators so that a
rank-0 wait on a dead peer returns; gloo ops fail as soon as a peer's sockets close. The step that
was running then raises TensorParallelError naming the rank and its traceback or signal.

NCCL's NVLink multicast (NVLS) and torch's symmetric-memory multicast stay off in every rank
(MULTICAST_OFF, set before any communicator exists): on shared multi-GPU hosts it can take GPUs
out of service.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time

import torch
import torch.distributed as dist

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# A worker waits in a broadcast for as long as the engine is idle (a server can idle for hours), so
# the collectives' timeout must not fire then; a dead peer is detected by process monitoring instead.
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
STARTUP_TIMEOUT_S = 600.0  # workers reaching the rendezvous (imports, CUDA context)
FAILURE_WAIT_S = 10.0      # after a collective fails: how long to wait for the monitor to see a dead worker
STOP_TIMEOUT_S = 10.0      # normal shutdown: how long workers get to exit before SIGTERM / SIGKILL

# Step protocol: rank 0 broadcasts one int64 message on the control group: a header of HEADER_LEN
# (the command and its sizes) and up to INLINE_PAYLOAD ints of payload; a larger payload follows in
# a second broadcast. One round trip per decode step: each is a TCP exchange whose latency the
# step pays in full, since the workers cannot start before it arrives.
CMD_STEP, CMD_LOGITS, CMD_STOP = 1, 2, 3
HEADER_LEN = 16
INLINE_PAYLOAD = 4096 - HEADER_LEN  # a 32 KiB message


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or raised; the message names its rank. The engine cannot
    continue (its workers are stopped); build a new one."""


def check_tensor_parallel(cfg, size: int) -> None:
    """Raise ValueError naming every model dimension that ``size`` ranks cannot split.

    cfg: ModelConfig. Requires num_heads, intermediate_size, vocab_size and an MoE's expert (and
    shared expert) ffn sizes divisible by size, and num_kv_heads divisible by size or dividing it
    (then KV heads are replicated)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by it")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} neither is divisible by it nor divides it")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by it")
    if cfg.vocab_size % size:
        problems.append(f"vocab_size={cfg.vocab_size} is not divisible by it")
    moe = cfg.extra.get("moe") or {}
    for name, key in (("the experts' ffn size", "expert_ffn"), ("the shared expert's ffn size", "shared_ffn")):
        if moe.get(key, 0) % size:
            problems.append(f"{name} ({moe[key]}) is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} cannot split {cfg.architecture}: " + "; ".join(problems))


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """The device of each rank: cuda:i, cuda:i+1, ... from ``device`` (cuda:i), or ``device`` for all
    on CPU. Raises ValueError when fewer GPUs are visible than asked for."""
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs from cuda:{first}, but torch sees "
                         f"{count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return [torch.device("cuda", first + r) for r in range(size)]


class TensorParallel:
    """One rank's place in the group and its communication. TensorParallel() is the single-GPU
    case: no process group, every collective the identity.

    group: the model's collectives (NCCL on CUDA, gloo on CPU); control: gloo, CPU tensors, for the
    step broadcast and start-up agreement."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, control=None):
        self.rank, self.size, self.group, self.control = rank, size, group, control

    def split(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's equal part of n (n divisible by size)."""
        count = n // self.size
        return self.rank * count, count

    def kv_heads(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads: an equal part, or when n < size the one head its
        query heads (an equal part of the query heads) read, shared with size / n - 1 other ranks."""
        if n >= self.size:
            return self.split(n)
        return self.rank * n // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (capturable in a CUDA graph on NCCL); returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor):
        """x [N, n] on every rank -> [N, size * n] (rank order) on rank 0, None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (all ranks call it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def send(self, header: list[int], payload: torch.Tensor | None) -> None:
        """Rank 0: broadcast a command: header (at most HEADER_LEN ints) and its int64 payload [n],
        in one message when n <= INLINE_PAYLOAD, else in two."""
        numel = 0 if payload is None else payload.numel()
        message = torch.zeros(HEADER_LEN + INLINE_PAYLOAD, dtype=torch.int64)
        message[:len(header)] = torch.tensor(header, dtype=torch.int64)
        if numel <= INLINE_PAYLOAD:
            message[HEADER_LEN:HEADER_LEN + numel] = payload if numel else 0
        dist.broadcast(message, 0, group=self.control)
        if numel > INLINE_PAYLOAD:
            dist.broadcast(payload.contiguous(), 0, group=self.control)

    def receive(self, payload_numel) -> tuple[list[int], torch.Tensor]:
        """Workers: the next command (blocks while rank 0 is idle): (header [HEADER_LEN] ints,
        payload int64 [payload_numel(header)])."""
        message = torch.empty(HEADER_LEN + INLINE_PAYLOAD, dtype=torch.int64)
        dist.broadcast(message, 0, group=self.control)
        header = message[:HEADER_LEN].tolist()
        numel = payload_numel(header)
        if numel <= INLINE_PAYLOAD:
            return header, message[HEADER_LEN:HEADER_LEN + numel]
        payload = torch.empty(numel, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.control)
        return header, payload


def _connect(store, rank: int, size: int, device: torch.device) -> TensorParallel:
    """Join the process group (all ranks call this in the same order)."""
    if device.type == "cuda":
        # device_id binds the rank to its GPU and creates the communicator now, not inside a capture.
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT,
                                device_id=device)
        control = dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT)
        control = dist.group.WORLD
    return TensorParallel(rank, size, dist.group.WORLD, control)


def _ready_key(rank: int) -> str:
    return f"tileattn/ready/{rank}"


def worker_main(index: int, config, port: int, devices: list[str], threads: int) -> None:
    """Entry of worker rank index + 1 (torch.multiprocessing passes index): join the group, load
    this rank's shard, build the runner in lock step with rank 0, then serve steps until told to stop.
    An exception propagates to torch.multiprocessing, which hands its traceback to rank 0."""
    os.environ.update(MULTICAST_OFF)
    # Ctrl-C in a terminal reaches every process of the foreground group; rank 0 decides when the
    # workers stop (its shutdown, or its death: torch.multiprocessing sets SIGINT as the
    # parent-death signal, so that path is kept by exiting on SIGINT only when the parent is gone).
    parent = os.getppid()

    def on_sigint(signum, frame):
        if os.getppid() != parent:
            os._exit(1)

    signal.signal(signal.SIGINT, on_sigint)
    rank, size = index + 1, len(devices)
    torch.set_num_threads(threads)
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(_ready_key(rank), "1")
    tp = _connect(store, rank, size, device)
    try:
        from .loader import load_model
        from .model_runner import ModelRunner

        loaded = load_model(config.model, device, config.dtype, max_model_len=config.max_model_len, tp=tp)
        runner = ModelRunner(loaded, config, device, config.max_model_len, tp=tp)
        runner.serve_steps()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class Workers:
    """Rank 0's side: starts ranks 1..N-1, joins the group with them, watches them, stops them.

    Construction raises TensorParallelError when a worker dies before the rendezvous and
    ValueError when a process group already exists in this process (one tensor-parallel engine
    per process; shut the other down first)."""

    def __init__(self, config, devices: list[torch.device]):
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise ValueError("this process already has a torch.distributed process group (another "
                             "tensor-parallel engine?); call its shutdown() first")
        self.size = len(devices)
        self.device = devices[0]
        self.failure: TensorParallelError | None = None
        self.started = False  # every rank finished building its runner (the step loop is running)
        self._stopping = False
        self._closed = False
        # Held while rank 0 works with the workers (a step, start-up), so that shutdown() from
        # another thread (a server's main thread) never interleaves its stop command with a step.
        self._busy = threading.Lock()
        # Inherited by the spawned workers; rank 0's own communicator reads them at creation too.
        os.environ.update(MULTICAST_OFF)
        # NCCL errors (a peer gone) abort the communicators and surface as exceptions in rank 0
        # (mode 2, "clean up only"), not torch's default of ending the process: rank 0 is the
        # user's process (a notebook, a server) and reports the dead rank instead.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self._context = mp.start_processes(
            worker_main, args=(config, self._store.port, [str(d) for d in devices], torch.get_num_threads()),
            nprocs=self.size - 1, join=False, start_method="spawn")
        self._processes = self._context.processes  # index i is rank i + 1
        try:
            self._await_workers()
            self.tp = _connect(self._store, 0, self.size, self.device)
        except BaseException:
            self._kill_all()
            raise
        self._monitor = threading.Thread(target=self._watch, name="tileattn-tp-monitor", daemon=True)
        self._monitor.start()

    # ---- start-up and monitoring ------------------------------------------------------------------

    def _await_workers(self) -> None:
        """Wait, interruptibly, until every worker is about to join the group: joining is a blocking
        C++ call that would wait for a worker that has already died."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [_ready_key(r) for r in range(1, self.size)]
        while not self._store.check(keys):
            for rank, process in enumerate(self._processes, 1):
                if not process.is_alive():
                    process.join()
                    raise self._describe(rank)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._processes]

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes, 1)}
        while sentinels and not self._stopping:
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
                if self._stopping:
                    return
                rank = sentinels.pop(sentinel)
                self._processes[rank - 1].join()
                self.failure = self._describe(rank)
                self._kill_all()
                if self.device.type == "cuda":
                    # A rank-0 wait on a kernel that waits on the dead peer returns once the NCCL
                    # communicators are aborted; gloo needs nothing (its sockets closed).
                    with contextlib.suppress(Exception):
                        self.tp.group.abort()
                return

    def _describe(self, rank: int) -> TensorParallelError:
        process = self._processes[rank - 1]
        error_file = self._context.error_files[rank - 1]
        how = f"exited with code {process.exitcode}"
        if process.exitcode is not None and process.exitcode < 0:
            try:
                how = f"was killed by signal {signal.Signals(-process.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-process.exitcode}"
        if os.access(error_file, os.R_OK):
            with open(error_file, "rb") as f:
                how = "raised:\n" + pickle.load(f).rstrip()
            os.unlink(error_file)
        return TensorParallelError(f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}; "
                                   f"the engine's {self.size - 1} worker(s) were stopped")

    def _kill_all(self, grace: float = 2.0) -> None:
        """SIGTERM every live worker, SIGKILL what is left after ``grace`` seconds."""
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + grace
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join()

    # ---- steps ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self):
        """Around rank 0's work with the workers (start-up, each step). A failure seen earlier is
        raised at once. A communication error (RuntimeError) becomes TensorParallelError when a
        worker has died. Any other exception (or one with no dead worker behind it: an OOM, a
        KeyboardInterrupt) propagates, but the workers may be waiting in a collective rank 0 will
        never join, so they are stopped and every later call raises TensorParallelError."""
        if self.failure is not None:
            raise self.failure
        try:
            with self._busy:
                yield
            if self.failure is not None:
                # The step returned, but a worker died during it: on NCCL its aborted collectives
                # return without data, so what the step computed cannot be used.
                raise self.failure
        except TensorParallelError:
            raise
        except BaseException as exc:
            if isinstance(exc, RuntimeError):  # what a collective with a dead peer raises
                deadline = time.monotonic() + FAILURE_WAIT_S
                while self.failure is None and self._monitor.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.02)
                if self.failure is not None:
                    raise self.failure from exc
            # Rank 0's own error (a worker that failed the same way, e.g. a KV cache too small
            # for max_model_len on every rank, is not the news).
            self._stopping = True  # the monitor must not report the workers stopped here as deaths
            if self.failure is None:
                self.failure = TensorParallelError(
                    f"rank 0 raised {type(exc).__name__} ({exc}) while working with its workers; they were "
                    "stopped, since they can no longer be in step with it: create a new engine")
            self._kill_all()
            raise

    def shutdown(self) -> None:
        """Stop the workers (a stop command when they serve steps and no step is running after
        STOP_TIMEOUT_S, else signals) and leave the group. Idempotent; takes at most about
        2 * STOP_TIMEOUT_S + 2 seconds."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        if self.started and self.failure is None and self._busy.acquire(timeout=STOP_TIMEOUT_S):
            try:
                with contextlib.suppress(Exception):
                    self.tp.send([CMD_STOP], None)
            finally:
                self._busy.release()
            for process in self._processes:
                process.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        if self.device.type == "cuda" and self.failure is not None:
            with contextlib.suppress(Exception):
                self.tp.group.abort()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self._store = None
