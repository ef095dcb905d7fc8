"""The GPU path on a real GPU: the weight push by CUDA IPC into an engine that shares the trainer's GPU and runs with
CUDA graphs, checked exactly after each of three pushes for GPTNeoX (Pythia-160m's shape), untied and tied Llama;
and each file's default run on one GPU. Skipped where there is no CUDA (CI); run on a GPU machine with
`pytest -q tests/test_gpu.py`. The engine starts as the scripts start it: the trainer's model is on the GPU first."""

import os
import shutil
import sys

import pytest
import torch
from conftest import perturbed_policy, read_metrics, run_script

import online_dpo_async as dpo
import plumbing

# This process may touch CUDA before an engine starts: the engine is spawned (plumbing.make_engine), never forked.
pytestmark = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")

PROMPT_LENGTH = 45  # prompts longer than one KV-cache block (16 tokens)


def engine_parameters(llm) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model, copied to the CPU (plumbing.WeightReceiver, in the worker)."""
    from safetensors.torch import load

    return load(llm.collective_rpc("parameter_copies")[0])


def engine_memory(llm) -> int:
    return llm.collective_rpc("cuda_memory_allocated")[0]


def reload_from_file(llm, model, folder) -> None:
    """vLLM's own checkpoint path: the model's safetensors file, reloaded in place."""
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
    llm.reset_prefix_cache()


@pytest.mark.parametrize("arch, tied", [("gptneox", False), ("llama", False), ("llama", True)])
def test_each_ipc_push_loads_exactly_what_a_checkpoint_would(arch, tied, tokenizer, tmp_path):
    """Three pushes of models whose every tensor differs (norms and biases perturbed too). After each, every engine
    parameter is bit for bit what vLLM's loader makes of the same weights from a safetensors file (q/k/v fusion,
    GPTNeoX's q/k/v reordering, the tied head) and differs from the previous version's; the same long prompt gives the
    new model's tokens and its logprobs at temperature 0.7 (the prefix cache was reset); GPU memory stays flat in
    both processes. CUDA graphs are captured before the first push."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    models = [perturbed_policy(tokenizer, arch, tied, seed, large=arch == "gptneox") for seed in range(4)]
    models[0].save_pretrained(tmp_path / "v0")
    tokenizer.save_pretrained(tmp_path / "v0")
    trainer = models[0].cuda()  # the trainer's model on the GPU before the engine starts, as in the scripts
    placement = plumbing.engine_placement("shared", plumbing.visible_gpus(), 1, 0.3)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # as the scripts set it: the push's handle is pickled
    llm = plumbing.make_engine(str(tmp_path / "v0"), placement, dtype="bfloat16", max_model_len=64, seed=0)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [
            [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (PROMPT_LENGTH,), generator=g).tolist()
            for _ in range(4)
        ]
        greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
        sampled = SamplingParams(temperature=0.7, max_tokens=8, logprobs=0, ignore_eos=True, seed=0)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(prompts, greedy, use_tqdm=False)  # CUDA graphs captured, the prefix cache full of version 0's KV
        before, memory = engine_parameters(llm), []
        for version, model in enumerate(models[1:], start=1):
            trainer.cpu()
            trainer = model.cuda()
            names = dpo.checkpoint_names(trainer)
            flat, layout = dpo.snapshot_weights(trainer.state_dict(), names, torch.bfloat16, torch.device("cuda"))
            dpo.push_weights(llm, dpo.Weights(version, flat, layout), "")
            pushed = engine_parameters(llm)
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            sampled_outputs = llm.generate(prompts, sampled, use_tqdm=False)
            memory.append((torch.cuda.memory_allocated(), engine_memory(llm)))
            reload_from_file(llm, trainer, tmp_path / f"v{version}")
            from_file = engine_parameters(llm)
            assert pushed.keys() == from_file.keys() == before.keys()
            for name in pushed:
                assert torch.equal(pushed[name], from_file[name]), (version, name)
                assert not torch.equal(pushed[name], before[name]), (version, name, "not pushed")
            before = pushed
            bf16 = trainer.to(torch.bfloat16).eval()
            for prompt, output, sample in zip((p["prompt_token_ids"] for p in prompts), outputs, sampled_outputs):
                with torch.no_grad():
                    logits = bf16(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
                assert output.outputs[0].token_ids[0] == int(
                    logits.argmax()
                )  # later tokens: near-ties of a random model
                tokens = list(sample.outputs[0].token_ids)
                with torch.no_grad():
                    ids = torch.tensor([prompt + tokens], device="cuda")
                    logp = (bf16(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7).log_softmax(-1)
                trainer_logprobs = logp.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1).cpu()
                engine_logprobs = torch.tensor([next(iter(lp.values())).logprob for lp in sample.outputs[0].logprobs])
                torch.testing.assert_close(engine_logprobs, trainer_logprobs, rtol=0, atol=0.05)
            del flat
            torch.cuda.empty_cache()
        print("GPU memory (trainer, engine) after each push:", memory)
        assert memory[-1][0] <= memory[0][0] and memory[-1][1] <= memory[0][1] + 2**20
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("script", ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"])
def test_default_run_learns_on_one_gpu(script, tmp_path):
    run_script([sys.executable, script, "--total_episodes", "3200", "--output_dir", str(tmp_path)], timeout=1200)
    _, evals = read_metrics(tmp_path)
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10, [e["eval/win_rate"] for e in evals]
    assert (tmp_path / "policy" / "model.safetensors").exists()
