"""LLM-judge win rate of policy answers against the human ones (No Robots evaluation, paper section 5,
appendix A.2, tables 1, 8, 9). Usage: below, `--help` and docs/reproducing.md.

    OPENAI_API_KEY=... python tasks/llm_judge.py runs/<run>/eval_completions/step_000100.jsonl \\
        --base_url https://api.openai.com/v1 --model gpt-4o --seed 1

Each input row {"step", "episode", "prompt", "completion", "reference"} is one question to any
OpenAI-compatible chat endpoint: which of two answers to `prompt` is better, the policy's
`completion` or the human `reference`, shown as A and B in a seeded random order (judges favour a
position, so the order is randomised and balanced). Next to each input file `<name>.jsonl` this writes
`<tag>_<name>.json` (summary: win rate over parseable verdicts, counts, average lengths) and
`<tag>_<name>.verdicts.jsonl` (one verdict per row, with the judge's raw answer); neither matches
`step_*.jsonl`, so a glob over the inputs never picks them up. The summary is printed too.

The paper judged with GPT-4o following Zheng et al. (2023) but does not give its prompt; the prompt
below is this project's own, in the pairwise style of that paper (verdict written as [[A]] or [[B]],
no ties: a win rate against the human answer needs a choice). `tasks/label_preferences.py`
judges its preference pairs with the same code.
"""

import json
import os
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import tyro

JUDGE_SYSTEM = "You are a careful and impartial judge of answers written by AI assistants and by people."

JUDGE_PROMPT = """Two answers to the same request follow. Decide which answer is better: which one is more helpful, more accurate and better at doing what the request asks, in the form the request asks for. Judge the content, not the length: a longer answer is not better for being longer. Neither the order of the answers nor their labels A and B say anything about their quality.

The request may be shown with the chat markup of the model that answered it; read past the markup.

[Request]
{request}

[Answer A]
{answer_a}

[Answer B]
{answer_b}

{verdict_instruction}"""

VERDICT_WITH_REASON = (
    'Explain your comparison in at most three sentences. Then, on the last line, write your verdict: exactly "[[A]]" '
    'if answer A is better or "[[B]]" if answer B is better. You must pick one.'
)
# with --constrained_verdict the endpoint can only answer one of VERDICTS, so no room for reasons
VERDICT_ONLY = 'Reply with your verdict only: exactly "[[A]]" if answer A is better or "[[B]]" if answer B is better. You must pick one.'
VERDICTS = ("[[A]]", "[[B]]")


class UsageError(ValueError):
    """Bad flags or input files: reported in one line, before any request is sent."""


@dataclass
class JudgeArgs:
    # judge endpoint (any OpenAI-compatible chat completions API)
    base_url: str = "https://api.openai.com/v1"
    """base URL of the OpenAI-compatible endpoint (e.g. http://127.0.0.1:8000/v1 for `vllm serve`)"""
    model: str = "gpt-4o"
    """judge model name as the endpoint knows it (the paper: GPT-4o)"""
    api_key_env: str = "OPENAI_API_KEY"
    """name of the environment variable holding the API key (the key itself is never a flag; set it to any
    non-empty value for a local server without authentication)"""
    judge_temperature: float = 0.0
    """judge sampling temperature (0: the most likely verdict)"""
    judge_max_tokens: int = 512
    """most tokens the judge may write per verdict"""
    constrained_verdict: bool = False
    """ask the endpoint to answer only "[[A]]" or "[[B]]" (vLLM's structured outputs `choice`, sent in
    `extra_body`; OpenAI's own API refuses it). Without it the judge explains first, then gives its verdict"""
    concurrency: int = 8
    """requests in flight at once"""
    max_retries: int = 5
    """retries of one request after a transient failure (connection error, timeout, HTTP 408, 409, 429, 5xx)"""
    retry_wait: float = 1.0
    """seconds before the first retry; doubled at each further one, up to --retry_wait_max"""
    retry_wait_max: float = 60.0
    """longest wait between two retries, in seconds"""
    request_timeout: float = 120.0
    """seconds before one request counts as timed out (a transient failure)"""


@dataclass
class Args(JudgeArgs):
    files: tyro.conf.Positional[list[str]] = field(default_factory=list)
    """eval_completions/step_NNNNNN.jsonl files written by the training scripts"""
    seed: int = 1
    """seed of the A/B order (and of the judge's sampling, where the endpoint supports seeds)"""
    tag: str = "judge"
    """outputs go to <tag>_<input name>.json (summary) and <tag>_<input name>.verdicts.jsonl, next to the input"""
    length_tokenizer: str | None = None
    """tokenizer (local folder or hub id) to also report average lengths in its tokens, as the paper's
    tables 8 and 9 do; lengths in words and characters are always reported"""


# ---------------------------------------------------------------------------------------------
# verdicts and the A/B order


def parse_verdict(text: str | None) -> str | None:
    """ "A" or "B", or None when the answer is unparseable: neither verdict in it, or both (a judge
    that names both has not chosen). A bare "A" or "B" (the whole answer) also counts."""
    if text is None:
        return None
    letters = set(re.findall(r"\[\[([AB])\]\]", text))
    if len(letters) == 1:
        return letters.pop()
    bare = text.strip().strip("\"'.*` ")
    return bare if not letters and bare in ("A", "B") else None


def swap_plan(n: int, seed: int) -> list[bool]:
    """Which of n pairs (left, right) are shown swapped (A = right, B = left): a seeded shuffle of
    ceil(n/2) False and floor(n/2) True, so each side is shown first equally often (to within one)."""
    swapped = [i % 2 == 1 for i in range(n)]
    random.Random(seed).shuffle(swapped)
    return swapped


def preferred_side(verdict: str | None, swapped: bool) -> str | None:
    """Map a verdict on the shown order back to the pair: "left", "right" or None (unparseable)."""
    if verdict is None:
        return None
    shown_first = "right" if swapped else "left"
    shown_second = "left" if swapped else "right"
    return shown_first if verdict == "A" else shown_second


def judge_messages(request: str, answer_a: str, answer_b: str, constrained: bool) -> list[dict]:
    instruction = VERDICT_ONLY if constrained else VERDICT_WITH_REASON
    prompt = JUDGE_PROMPT.format(request=request, answer_a=answer_a, answer_b=answer_b, verdict_instruction=instruction)
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": prompt}]


# ---------------------------------------------------------------------------------------------
# talking to the endpoint


def check_judge_args(args: JudgeArgs) -> None:
    if not os.environ.get(args.api_key_env):
        raise UsageError(
            f"the environment variable {args.api_key_env} (named by --api_key_env) is not set: put the judge's API key there"
        )
    if not re.match(r"https?://", args.base_url):
        raise UsageError(f"--base_url must start with http:// or https://, got {args.base_url!r}")
    for name, low in [("concurrency", 1), ("judge_max_tokens", 1), ("max_retries", 0)]:
        if getattr(args, name) < low:
            raise UsageError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    for name in ["judge_temperature", "retry_wait", "retry_wait_max"]:
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.request_timeout <= 0:
        raise UsageError(f"--request_timeout must be > 0, got {args.request_timeout}")


def make_client(args: JudgeArgs):
    import openai

    # retries are ours (ask_judge), so that the limit and the waits are visible in one place
    return openai.OpenAI(
        base_url=args.base_url, api_key=os.environ[args.api_key_env], max_retries=0, timeout=args.request_timeout
    )


def is_transient(exc: Exception) -> bool:
    import openai

    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):  # timeouts subclass connection errors
        return True
    return isinstance(exc, openai.APIStatusError) and (exc.status_code in (408, 409, 429) or exc.status_code >= 500)


def ask_judge(client, args: JudgeArgs, messages: list[dict], seed: int) -> dict:
    """One verdict request, retried on transient failures at most --max_retries times with doubling
    waits (a busy or restarting endpoint); any other failure, or the last transient one, stops the run."""
    extra_body = {"structured_outputs": {"choice": list(VERDICTS)}} if args.constrained_verdict else None
    for attempt in range(args.max_retries + 1):
        try:
            response = client.chat.completions.create(
                model=args.model,
                messages=messages,
                temperature=args.judge_temperature,
                max_tokens=args.judge_max_tokens,
                seed=seed,
                extra_body=extra_body,
            )
            choice = response.choices[0]
            return {
                "judge_response": choice.message.content,
                "finish_reason": choice.finish_reason,
                "attempts": attempt + 1,
            }
        except Exception as exc:
            if not is_transient(exc) or attempt == args.max_retries:
                raise RuntimeError(
                    f"judge request failed after {attempt + 1} attempt(s): {type(exc).__name__}: {exc}"
                ) from exc
            time.sleep(min(args.retry_wait * 2**attempt, args.retry_wait_max))


def judge_pairs(client, args: JudgeArgs, pairs: list[tuple[str, str, str]], seed: int) -> list[dict]:
    """Judge pairs (request, left, right), each shown in the order of swap_plan(len(pairs), seed).
    Returns per pair: swapped, verdict ("A" / "B" / None), preferred ("left" / "right" / None),
    the judge's raw answer, its finish reason and the attempts it took."""
    swapped = swap_plan(len(pairs), seed)

    def one(i: int) -> dict:
        request, left, right = pairs[i]
        a, b = (right, left) if swapped[i] else (left, right)
        reply = ask_judge(client, args, judge_messages(request, a, b, args.constrained_verdict), seed=seed + i)
        verdict = parse_verdict(reply["judge_response"])
        return {"swapped": swapped[i], "verdict": verdict, "preferred": preferred_side(verdict, swapped[i]), **reply}

    pool = ThreadPoolExecutor(args.concurrency)
    try:
        return list(pool.map(one, range(len(pairs))))
    finally:  # after a failure, send none of the requests still queued
        pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# eval_completions files


def read_completions(path: str) -> list[dict]:
    """Rows of one eval_completions file, checked: every line a JSON object with the contract's keys."""
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path} line {number}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path} line {number}: expected a JSON object")
            for key, kind in [
                ("prompt", str),
                ("completion", str),
                ("reference", str),
                ("step", int),
                ("episode", int),
            ]:
                if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
                    raise UsageError(f"{path} line {number}: {key!r} must be a {kind.__name__}, got {row.get(key)!r}")
            rows.append(row)
    if not rows:
        raise UsageError(f"{path}: no rows")
    return rows


def average_lengths(texts: list[str], tokenizer=None) -> dict:
    out = {"words": sum(len(t.split()) for t in texts) / len(texts), "chars": sum(len(t) for t in texts) / len(texts)}
    if tokenizer is not None:
        out["tokens"] = sum(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts) / len(texts)
    return out


def summarize(rows: list[dict], verdicts: list[dict], tokenizer=None) -> dict:
    """Win rate of the policy = policy wins / parseable verdicts; unparseable ones are counted apart."""
    parseable = [v for v in verdicts if v["verdict"] is not None]
    wins = sum(v["winner"] == "policy" for v in parseable)
    first = [v for v in parseable if v["policy_first"]]
    second = [v for v in parseable if not v["policy_first"]]
    rate = lambda vs: sum(v["winner"] == "policy" for v in vs) / len(vs) if vs else None  # noqa: E731
    steps, episodes = sorted({r["step"] for r in rows}), sorted({r["episode"] for r in rows})
    return {
        "step": steps[0] if len(steps) == 1 else steps,
        "episode": episodes[0] if len(episodes) == 1 else episodes,
        "n": len(rows),
        "n_parseable": len(parseable),
        "n_unparseable": len(rows) - len(parseable),
        "unparseable_rate": (len(rows) - len(parseable)) / len(rows),
        "policy_wins": wins,
        "win_rate": wins / len(parseable) if parseable else None,
        # position bias check: the two halves of the balanced order, separately
        "win_rate_policy_shown_first": rate(first),
        "win_rate_policy_shown_second": rate(second),
        "avg_length_policy": average_lengths([r["completion"] for r in rows], tokenizer),
        "avg_length_reference": average_lengths([r["reference"] for r in rows], tokenizer),
    }


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def output_paths(path: str, tag: str) -> tuple[Path, Path]:
    """Summary and verdicts files of one input."""
    path = Path(path)
    return path.with_name(f"{tag}_{path.stem}.json"), path.with_name(f"{tag}_{path.stem}.verdicts.jsonl")


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    try:  # every check of flags and inputs, before any request
        if not args.files:
            raise UsageError("give at least one eval_completions .jsonl file")
        check_judge_args(args)
        inputs = {path: read_completions(path) for path in args.files}
        tokenizer = None
        if args.length_tokenizer is not None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(args.length_tokenizer)
            except Exception as exc:
                raise UsageError(
                    f"--length_tokenizer {args.length_tokenizer}: cannot load it ({type(exc).__name__})"
                ) from None
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")

    client = make_client(args)
    for path, rows in inputs.items():
        start = time.time()
        try:
            results = judge_pairs(
                client, args, [(r["prompt"], r["completion"], r["reference"]) for r in rows], args.seed
            )
        except RuntimeError as exc:
            raise SystemExit(f"error: {path}: {exc}")
        verdicts = []
        for i, (row, result) in enumerate(zip(rows, results)):
            winner = {"left": "policy", "right": "reference", None: None}[result["preferred"]]
            verdicts.append(
                {
                    "index": i,
                    "step": row["step"],
                    "episode": row["episode"],
                    "policy_first": not result["swapped"],
                    "verdict": result["verdict"],
                    "winner": winner,
                    "judge_response": result["judge_response"],
                    "finish_reason": result["finish_reason"],
                    "attempts": result["attempts"],
                }
            )
        summary = {
            "file": path,
            "judge_model": args.model,
            "seed": args.seed,
            "constrained_verdict": args.constrained_verdict,
            **summarize(rows, verdicts, tokenizer),
            "length_units": ["words", "chars"] + (["tokens"] if tokenizer else []),
            "length_tokenizer": args.length_tokenizer,
            "seconds": round(time.time() - start, 2),
        }
        summary_path, verdicts_path = output_paths(path, args.tag)
        write_atomic(verdicts_path, "".join(json.dumps(v) + "\n" for v in verdicts))
        write_atomic(summary_path, json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary))
        sys.stdout.flush()
