"""4d. In-flight weight updates (--inflight_updates, issue 54), the engine's side: sequences decoded a segment
of tokens at a time, so that a new policy version can reach the engine between two segments of the sequences
in flight, and every token records the version that sampled it, with the engine's own logprob of it (the
behaviour policy of that token); and the flags' checks. Which rollout joins when, and so which version samples
which token, is the method's: each algorithm file's inflight_generation_thread.

Why segments, and not vLLM's own decoding loop, paused at a step: vLLM's engine runs its decoding steps in a
process of its own, ahead of its client, so the step at which a push lands there depends on the clock; a
segment ends at a fixed count of tokens, so where each version begins in each sequence is a function of the
run alone, and a run (and its resume) is reproducible. Both vLLM versions the project runs (0.26 on GPUs, 0.32
on CPUs) take the segments as ordinary requests (the prompt with the tokens decoded so far), which plumbing's
Engine cuts among its engines.

What a sequence's keys and values are computed with after a push, which the push decides:
- "keep" (PipelineRL's choice): those of the tokens before it stay as the old version computed them; the new
  version computes only the next tokens'. A segment reads them back from vLLM's prefix cache, under its
  sequence's cache salt (its batch's: no other batch's blocks are read), so the push leaves the cache as it is
  (push_weights(..., reset_prefix_cache=False); the probe reads no cache); the cache holds whole blocks
  only, so the tokens of a sequence's last, partial block (at most a block's size less one) are computed
  again, by the new version.
- "recompute": the push resets the prefix cache, as every push does, so the next segment computes the whole
  prefix with the new version: every token's logprob is then exactly the new policy's given its prefix, at a
  prefill's cost.
"""

from dataclasses import dataclass, field

from plumbing.flags import RunArgs, UsageError

# in-flight updates' flags but their switch, with their defaults: set without --inflight_updates, they
# would do nothing
_SETTINGS = {name: getattr(RunArgs, name) for name in ("inflight_segment_tokens", "inflight_kv")}


def check_inflight_flags(args: RunArgs) -> None:
    """In-flight updates' flags before any model loads: its settings need its switch; `keep` needs one
    engine without LoRA: vLLM's prefix cache keys each block by the adapter that computed it (under LoRA a
    version is an adapter of its own, so no block would be found), and Engine.generate cuts each segment's
    sequences among several engines by their count, so a sequence's next segment may land on an engine that
    holds none of its blocks."""
    if not args.inflight_updates:
        given = [f"--{name}" for name, default in _SETTINGS.items() if getattr(args, name) != default]
        if given:
            raise UsageError(
                f"{', '.join(given)} set in-flight updates, which only --inflight_updates turns on"
            )
        return
    if args.inflight_kv == "keep" and args.lora_rank:
        raise UsageError(
            "--inflight_kv keep under --lora_rank: vLLM's prefix cache keys each block by its adapter, a "
            "version's own, so no sequence would keep its KV; use --inflight_kv recompute"
        )
    if args.inflight_kv == "keep" and args.vllm_num_engines > 1:
        raise UsageError(
            "--inflight_kv keep with --vllm_num_engines > 1: a sequence's next segment may go to an engine "
            "that holds none of its KV; use --inflight_kv recompute"
        )


@dataclass
class Sequence:
    """One completion in flight: its prompt and sampling seed, and what the segments decoded so far, each
    token with the engine's logprob of it (after temperature) and the policy version that sampled it."""

    prompt: list[int]
    seed: int
    max_tokens: int
    salt: str  # its prefix-cache salt (its batch's): no other batch's blocks are read for it
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False  # it sampled EOS or reached max_tokens


def segment_seed(seed: int, decoded: int) -> int:
    """The sampling seed of a sequence's segment that starts after `decoded` tokens: vLLM seeds a request's
    sampler afresh, so each segment gets its own, and no two segments of a sequence draw the same random
    numbers."""
    return (seed * 1_000_003 + decoded) % 2**63


def decode_segment(
    engine, sequences: list[Sequence], tokens: int, version: int, temperature: float, eos: int, call
) -> None:
    """Each unfinished sequence decodes up to `tokens` more tokens (fewer where it samples EOS or reaches its
    max_tokens) under the policy `version` the engine holds, through plumbing's Engine.generate (the sequences
    cut among the engines, under the deadline of `call`); each new token is recorded with its logprob and
    `version`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    live = [sequence for sequence in sequences if not sequence.done]
    if not live:
        return
    prompts = [TokensPrompt(prompt_token_ids=s.prompt + s.tokens, cache_salt=s.salt) for s in live]
    params = [
        SamplingParams(
            n=1,
            temperature=temperature,
            max_tokens=min(tokens, s.max_tokens - len(s.tokens)),
            stop_token_ids=[eos],
            seed=segment_seed(s.seed, len(s.tokens)),
            logprobs=0,
            detokenize=False,
        )
        for s in live
    ]
    outputs = engine.generate(prompts, params, call)
    for sequence, output in zip(live, outputs):
        completion = output.outputs[0]
        new = list(completion.token_ids)
        sequence.tokens += new
        sequence.logprobs += [at[token].logprob for token, at in zip(new, completion.logprobs)]
        sequence.versions += [version] * len(new)
        sequence.done = completion.finish_reason == "stop" or len(sequence.tokens) >= sequence.max_tokens
