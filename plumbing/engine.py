"""4b. The engine: its processes, its calls, its failures (its GPUs: placement.py; its deadlines and the stop
signals: stops.py; the channel between the generation thread and the trainer: channel.py).

Engine is made before any model loads (the GPUs it gets, checked; the cores it runs on; the stop signals) and
started by rank 0 once the trainer's models are in memory, taking what the run leaves of the GPU
(engine_share). It is --vllm_num_engines vLLM engines, each over --vllm_tensor_parallel_size GPUs
(engine_placements): each generates its contiguous part of every batch, all at the same time (generate), and
each loads every policy version (push). vLLM runs in processes of its own, watched by a watchdog
(plumbing/watchdog.py) that ends them if the trainer dies; the generation thread, the algorithm file's, drives
it (channel.py). Every call to it, a push or a generation, has a deadline (stops.py): an engine that dies or
stops answering stops the run with a checkpoint and one line (failed). How the weights reach it:
plumbing/weights.py."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from plumbing.flags import REDUCE_OP_WARNING, RunArgs, UsageError
from plumbing.lora import engine_lora_settings
from plumbing.lora_push import drop_adapter, push_adapter, write_adapter
from plumbing.placement import (
    Placement,
    contiguous_parts,
    engine_line,
    engine_placements,
    engine_shares,
    on_cores,
    snapshot_memory,
    split_cores,
    trained_memory,
    visible_gpus,
)
from plumbing.stops import Deadlines, StopSignals
from plumbing.timings import numel
from plumbing.watchdog import (
    dead_processes,
    kill_process_trees,
    release_orphaned_shared_memory,
    release_shared_memory,
    remove_stale_weights_folders,
    shared_memory_files,
    start_watchdog,
    started_processes,
)
from plumbing.weights import (
    SnapshotPlace,
    WeightBucket,
    bucket_bytes,
    push_weights,
    snapshot_sizes,
    version_names,
)


class Engine:
    """The vLLM engines that generate the rollouts and the evaluations (module docstring), one or more, which
    rank 0 runs."""

    def __init__(self, args, processes, folder):
        """Before any model loads: the engines' GPUs (a placement that cannot be is a UsageError), their
        cores, the stop signals, which from now on stop the run cleanly, and the deadlines of the calls to
        them. The run's folder: a failure of an engine names the checkpoint to resume from."""
        self.args, self.processes, self.folder, accelerator = args, processes, folder, processes.accelerator
        gpus = visible_gpus() if processes.on_gpu else []
        # the engines run on rank 0's machine, whose GPUs decide; every process stops on a placement refused
        placements = None
        if processes.is_main:
            try:
                placements = engine_placements(
                    args.vllm_placement,
                    gpus,
                    accelerator.num_processes,
                    args.vllm_gpu_memory_utilization,
                    engines=args.vllm_num_engines,
                    tensor_parallel=args.vllm_tensor_parallel_size,
                )
            except UsageError as refused:
                placements = refused
        self.placements = processes.broadcast(placements)
        if isinstance(self.placements, UsageError):
            raise self.placements
        self.signals = StopSignals(speaks=processes.is_main)
        self.cores = split_cores(accelerator.device, accelerator.num_processes)
        self.deadlines = Deadlines(args.engine_timeout_minutes, processes.on_gpu)
        # The generation thread needs the interpreter lock at every decoding step; training hands it over
        # every switch interval (5 ms by default) while it runs Python. 0.5 ms: pipeline efficiency 92.5% ->
        # 96.1% (docs/speed.md).
        sys.setswitchinterval(0.0005)
        self.watchdog = self.weights_dir = self.snapshot_place = None
        self.llms, self.buckets, self.versions = [], [], []  # each engine's vLLM, push bucket, proven version
        self.engine_processes, self.shared_memory, self.started = [], [], 0.0
        self.failure, self.names = None, {}  # why an engine failed (died, froze); its processes' names
        self.engine_of: dict[int, int] = {}  # each engine process's engine, by pid
        self.busy: set[int] = set()  # the engines the call in flight waits on (on_each)
        # under LoRA (--lora_rank) the engines serve the policy's adapter, the LoRARequest of the version they
        # hold (none at version 0: the base model is the policy then)
        self.lora, self.adapter = args.lora_rank > 0, None

    @classmethod
    def around(cls, llms: list, buckets: list[WeightBucket], weights_dir: str | None = None) -> "Engine":
        """An Engine over LLMs already up, in one process with no signals: how benchmark/push_cost.py and the
        tests that share engines drive them (push, generate; with a Channel, the generation thread). With a
        `weights_dir` (RAM-backed), engines started with LoRA (lora.py's engine_lora_settings) are pushed
        adapters there."""
        engine = cls.__new__(cls)
        for name in ("args", "processes", "folder", "signals", "cores", "failure", "adapter"):
            setattr(engine, name, None)
        engine.llms, engine.buckets, engine.engine_processes, engine.names = llms, buckets, [], {}
        engine.engine_of, engine.busy = {}, set()
        engine.versions = [0] * len(llms)
        engine.deadlines = Deadlines(RunArgs.engine_timeout_minutes, on_gpu=False)
        engine.lora, engine.weights_dir = weights_dir is not None, weights_dir
        return engine

    def start(self, model, policy, path: str, max_model_len: int, async_level: int) -> None:
        """Rank 0 starts the engines on their cores, after a watchdog that ends their processes if the trainer
        dies, once the trainer's `model` is in memory: on GPUs each engine leaves room for what training
        allocates later there and for the push's bucket (engine_share), and says what it got. Each loads the
        policy from `path` and holds sequences of `max_model_len` tokens. The snapshots of `policy` (at most
        `async_level` + 2 alive: snapshot_memory) go to host memory beside them, at snapshot_place."""
        if not self.processes.is_main:
            return
        args, accelerator, dtype = self.args, self.processes.accelerator, self.processes.engine_dtype
        trained = sum(numel(p) for p in model.parameters() if p.requires_grad)  # under LoRA, the adapter
        bf16 = accelerator.mixed_precision == "bf16"
        trained = trained_memory(trained, self.processes.zero_stage, accelerator.num_processes, bf16)
        to_come = {part: trained[part] for part in ("gradients", "optimizer state")}  # the weights are loaded
        sizes = snapshot_sizes(version_names(policy))
        snapshot, bucket = sum(sizes.values()) * dtype.itemsize, bucket_bytes(sizes, dtype.itemsize)
        host = snapshot_memory(snapshot, async_level)
        given = args.vllm_gpu_memory_utilization is not None
        placements, totals = engine_shares(self.placements, to_come, bucket)
        for index, (placement, total) in enumerate(zip(placements, totals)):
            line = engine_line(placement, total, snapshot, bucket, host, given, args.vllm_enforce_eager)
            print(line if len(placements) == 1 else f"engine {index}: {line.removeprefix('engine: ')}")
        llm_kwargs = dict(seed=args.seed, dtype=str(dtype).removeprefix("torch."))
        llm_kwargs |= dict(trust_remote_code=args.trust_remote_code, max_model_len=max_model_len)
        llm_kwargs |= dict(tensor_parallel_size=args.vllm_tensor_parallel_size)
        # CUDA graphs on GPUs
        llm_kwargs["enforce_eager"] = placements[0].devices is None or args.vllm_enforce_eager
        if self.lora:
            llm_kwargs |= engine_lora_settings(args.lora_rank)
        self.watchdog = self.signals.watchdog = start_watchdog()
        with on_cores(self.cores):
            # the push's CUDA IPC handle is pickled, between our processes
            if placements[0].devices is not None:
                os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            print(self.deadlines.stated())
            for index, placement in enumerate(placements):  # one after the other: each sets the environment
                before = {p.pid for p in psutil.Process().children(recursive=True)}
                which = "the engine" if len(placements) == 1 else f"engine {index} of {len(placements)}"
                line = f"error: {self.deadlines.start_failed(which)}; {self.resume()}"
                with self.signals.start_deadline(self.deadlines.first, line):
                    self.llms.append(make_engine(path, placement, **llm_kwargs))
                started = started_processes(before)
                self.engine_processes += started
                self.names |= {process.pid: _process_name(process) for process in started}
                self.engine_of |= {process.pid: index for process in started}
            ram = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            remove_stale_weights_folders(ram)
            release_orphaned_shared_memory()  # what runs killed with their watchdog left
            self.weights_dir = tempfile.mkdtemp(prefix=f"policy-weights-{os.getpid()}-", dir=ram)
            self.signals.weights_dir = self.weights_dir
            self.watchdog.stdin.write(json.dumps({"folder": self.weights_dir}) + "\n")
            self.watchdog.stdin.flush()
        self.shared_memory = shared_memory_files(self.engine_processes)
        for placement in placements:  # one bucket for each engine, on its first GPU: they load at once
            device = torch.device("cuda", placement.engine_gpu) if placement.devices else None
            self.buckets.append(WeightBucket(device, self.weights_dir))
        self.versions = [0] * len(self.llms)
        self.snapshot_place = SnapshotPlace(pinned=self.processes.on_gpu, folder=self.weights_dir)
        self.started = time.perf_counter()  # the timeline's origin

    def died(self, wait: float = 0.0) -> bool:
        """Whether a process of the engines has died (seen within `wait` seconds): the engines' processes are
        then killed, and the reason kept (self.failure)."""
        dead = dead_processes(self.engine_processes, wait=wait)
        if dead:
            names = ", ".join(f"{self.names.get(pid, 'process')} (pid {pid})" for pid in dead)
            why = "a crash prints its traceback above; none: it was killed, e.g. by the out-of-memory killer"
            self.failure = f"{self.which(dead)} died: its process {names} ended ({why})"
            kill_process_trees(self.engine_processes)
        return bool(dead)

    def failed(self) -> str | None:
        """Why the engine failed, as the trainer sees it while it waits (Channel.get): a process of it died,
        or a call to it is past its deadline (Deadlines: it froze). Its processes are then killed, and the
        reason kept (self.failure)."""
        if self.failure is None and not self.died():
            if (call := self.deadlines.overdue(time.monotonic())) is not None:
                which = self.which_engines(sorted(self.busy))
                self.failure = f"{which} froze: {call.describe(time.monotonic())}"
                kill_process_trees(self.engine_processes)
        return self.failure

    def which(self, pids: list[int]) -> str:
        """The engine, or which of the engines, these processes belong to."""
        return self.which_engines(sorted({self.engine_of[pid] for pid in pids if pid in self.engine_of}))

    def which_engines(self, engines: list[int]) -> str:
        """The engine, or which `engines` of how many (all of them when none is known)."""
        if len(self.llms) <= 1:
            return "the engine"
        if not engines:
            return f"the {len(self.llms)} engines"
        which = " and ".join(str(engine) for engine in engines)
        return f"engine{'s' if len(engines) > 1 else ''} {which} of {len(self.llms)}"

    def resume(self) -> str:
        """What resumes the run now: the newest checkpoint on disk (the run folder's), or nothing."""
        checkpoint = self.folder.last_checkpoint if self.folder is not None else None
        return f"resume from {checkpoint} with --resume" if checkpoint else "no checkpoint: start it again"

    def failure_line(self) -> str:
        """The run's last line once the engine failed: why, and where to resume from."""
        return f"error: {self.failure}; {self.resume()}"

    def push(self, weights, keep_cache: bool = False) -> None:
        """Loads a policy version into every running engine, in place (push_weights, each through its own
        bucket, all at the same time), under one deadline; each engine proves it holds it (check_loaded).
        Under LoRA the version is an adapter, written once, which every engine serves (push_adapter) and
        proves it serves; then the previous version's goes. `keep_cache`: the prefix cache, the old version's
        KV, stays (in-flight updates' keep, inflight.py); else it is reset."""
        with self.deadlines.call("weight push", weights.version):
            every = list(range(len(self.llms)))
            if self.lora:
                path = write_adapter(self.weights_dir, weights)
                served = self.on_each(lambda llm, _: push_adapter(llm, weights, path), every, every)
                if self.adapter is not None:
                    self.on_each(lambda llm, _: drop_adapter(llm, self.adapter), every, every)
                    shutil.rmtree(self.adapter.lora_path, ignore_errors=True)
                self.adapter = served[0]
            else:

                def push(llm, bucket) -> None:
                    push_weights(llm, bucket, weights, reset_prefix_cache=not keep_cache)

                self.on_each(push, every, self.buckets)
        self.versions = [weights.version] * len(self.llms)

    def reset_prefix_cache(self) -> None:
        """Every engine forgets the KV its prefix cache holds (in-flight updates: a rollout that starts with
        nothing else in flight starts on an empty cache, as it does after --resume)."""
        every = list(range(len(self.llms)))
        self.on_each(lambda llm, _: llm.reset_prefix_cache(), every, every)

    @property
    def version(self) -> int:
        """The policy version every engine holds, each proven at its push (check_loaded): a batch is generated
        by one version, whichever engine generates each part of it (the staleness contract, paper section
        3)."""
        if len(set(self.versions)) != 1:
            raise RuntimeError(f"the engines hold different policy versions: {self.versions}")
        return self.versions[0]

    def generate(self, prompts: list, params: list, call: tuple[str, int]) -> list:
        """vLLM's LLM.generate over the engines, under the deadline of `call` (a Deadlines kind and its
        index: the step, or the policy version evaluated): the prompts and their sampling parameters (one
        each) cut into as many contiguous parts as there are engines, one each, generated at the same time and
        put back in the prompts' order. A prompt's sampling seed is its own, so its completions do not depend
        on which engine made them, up to the numerics of the batch it shares (docs/gpus.md, several
        engines)."""
        adapter = {} if self.adapter is None else {"lora_request": self.adapter}  # under LoRA, the version's
        with self.deadlines.call(*call):
            if len(self.llms) == 1:
                return self.llms[0].generate(prompts, params, use_tqdm=False, **adapter)
            parts = contiguous_parts(len(prompts), len(self.llms))
            engines = [i for i, part in enumerate(parts) if part.stop > part.start]
            parts = [parts[i] for i in engines]

            def generate_part(llm, part: slice) -> list:
                return llm.generate(prompts[part], params[part], use_tqdm=False, **adapter)

            return [output for outputs in self.on_each(generate_part, engines, parts) for output in outputs]

    def on_each(self, call, engines: list[int], arguments: list) -> list:
        """call(llm, argument) for each of these `engines` (their indices), their results in order: with
        several, at the same time, one daemon thread each (one stuck in a frozen engine does not keep the
        process alive), started from the calling thread, on its cores. Those that have not answered yet are
        `busy`, which a frozen call's line names. A call that raises is raised again, naming its engine."""
        self.busy = set(engines)
        if len(engines) == 1:
            try:
                return [call(self.llms[engines[0]], arguments[0])]
            finally:
                self.busy = set()
        results, errors = [None] * len(engines), [None] * len(engines)

        def run(position: int) -> None:
            try:
                results[position] = call(self.llms[engines[position]], arguments[position])
            except BaseException as error:
                errors[position] = error
            finally:
                self.busy.discard(engines[position])

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(engines))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for position, error in enumerate(errors):
            if error is None:
                continue
            if "EngineDeadError" in (kind.__name__ for kind in type(error).__mro__):
                raise error  # Engine.failed names the process that died
            engine = f"engine {engines[position]} of {len(self.llms)}"
            raise RuntimeError(f"{engine}: {type(error).__name__}: {error}") from error
        return results

    def shut_down(self) -> None:
        """Asks each engine to stop (Channel.stop: the generation thread then has seconds to end)."""
        for llm in self.llms:
            llm.llm_engine.engine_core.shutdown(timeout=1)

    def release(self) -> None:
        """What the stopped engines leave: the engine's worker outlives its scheduler process, killed after
        1 s, by seconds (a garbage collection), and their message queues stay in shared memory: end both; then
        the push's folder, and the watchdog, which has nothing left to clean up."""
        kill_process_trees(self.engine_processes)
        release_shared_memory(self.shared_memory)
        shutil.rmtree(self.weights_dir, ignore_errors=True)
        self.watchdog.stdin.write("done\n")  # nothing is left for it to clean up: it exits
        self.watchdog.stdin.close()
        try:
            self.watchdog.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


# == The engine's processes ===============================================================================
def make_engine(model: str, placement: Placement, **llm_kwargs):
    """The engine runs in its own processes (vLLM's default): generation does not share the trainer's
    interpreter lock, and models vLLM serves through its Transformers backend (GPTNeoX on CPUs) do not patch
    the trainer's classes. The children inherit the environment set here."""
    from vllm import LLM

    env = dict(os.environ)
    # an `accelerate launch`'s torch.distributed variables: the engine would join our group
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    # Spawned, never forked: a fork of a process that has touched CUDA (even torch.cuda.is_available() without
    # NVML) dies with "CUDA error: initialization error". vLLM forks unless it sees CUDA initialised; on CPUs
    # it spawns.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # the worker imports WeightReceiver from plumbing.receiver
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    )
    if placement.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.devices
        os.environ.update(sampler_settings(os.environ, importlib.util.find_spec("flashinfer") is not None))
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default reserves far more
        if not os.environ.get("ASYNC_RLHF_VERBOSE"):
            # vLLM's CPU worker binds its memory to its core's NUMA node, as the core split asks, and says so
            # in a C++ warning, which no Python filter reaches: the engine's processes log C++ errors only
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    # vLLM warns at every push that rotary caches are not pushed
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not os.environ.get("ASYNC_RLHF_VERBOSE"):  # quiet_known_noise's filters: its processes never run it
        ours = dict(
            PYTHONWARNINGS=f"ignore:{REDUCE_OP_WARNING}:FutureWarning", TORCH_LOGS="-torch._library.triton"
        )
        for name, value in ours.items():
            os.environ[name] = ",".join(filter(None, [env.get(name), value]))
    try:
        return LLM(
            model=model,
            gpu_memory_utilization=placement.memory_utilization,
            use_tqdm_on_load=False,
            logprobs_mode="processed_logprobs",  # logprobs after temperature, like the trainer's
            load_format="safetensors",
            worker_extension_cls="plumbing.receiver.WeightReceiver",
            **llm_kwargs,
        )
    finally:
        os.environ.clear()
        os.environ.update(env)


def sampler_settings(environ, flashinfer_installed: bool) -> dict[str, str]:
    """The engine's sampler on a GPU: vLLM (0.26) picks its FlashInfer top-k/top-p sampler unless
    VLLM_USE_FLASHINFER_SAMPLER=0 says otherwise, and an engine without the flashinfer package then fails as
    it starts; so the setting is 0 where flashinfer is not installed, unless the user set it."""
    if flashinfer_installed or "VLLM_USE_FLASHINFER_SAMPLER" in environ:
        return {}
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def _process_name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "process"
