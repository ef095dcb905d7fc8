"""The No Robots LLM judge (tasks/llm_judge.py) and the judge-labelled preference data
(tasks/label_preferences.py): hand-written cases, a scripted HTTP endpoint on loopback for the
request/retry logic, and a real vLLM OpenAI-compatible server serving a tiny random judge.

The server and the labelling run start when this module starts (one of each, killed at its end):
they boot while the fast tests run. The labelling run samples first, then waits for the server
through the judge's own retries on connection errors.
"""

import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, TINY, free_port, save_random_policy, small_config

sys.path.insert(0, str(ROOT / "tasks"))
import label_preferences  # noqa: E402
import llm_judge  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "judge"
EVAL_FILES = sorted((FIXTURES / "eval_completions").glob("step_*.jsonl"))
KEY_ENV, KEY = "TINY_JUDGE_KEY", "tiny-secret"
# the tiny policy's chat template: BOS, then every turn, each user (or system) turn ending with "->"
POLICY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }} {{ eos_token }}"
    "{% else %} {{ m['content'] }} ->{% endif %}{% endfor %}"
)
JUDGE_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
LABEL_FLAGS = [
    "--num_samples",
    "3",
    "--temperature",
    "0.7",
    "--max_prompt_length",
    "24",
    "--response_length",
    "8",
    "--seed",
    "1",
    "--vllm_dtype",
    "float32",
    "--vllm_enforce_eager",
]
JUDGE_FLAGS = [
    "--model",
    "tiny-judge",
    "--api_key_env",
    KEY_ENV,
    "--judge_temperature",
    "1.0",
    "--judge_max_tokens",
    "12",
    "--concurrency",
    "4",
]


def by_hand(text: str | None) -> str | None:
    """The verdict rule, the obvious way: exactly one of [[A]] / [[B]] in the answer, or a bare letter."""
    if text is None:
        return None
    has_a, has_b = "[[A]]" in text, "[[B]]" in text
    if has_a != has_b:
        return "A" if has_a else "B"
    return text.strip() if not has_a and text.strip() in ("A", "B") else None


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def run_main(script: str, argv: list[str], monkeypatch) -> None:
    """`python <script> <argv>` in this process, where torch and transformers are already imported (a few
    subprocess runs check the real command line)."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    runpy.run_path(str(ROOT / script), run_name="__main__")


def stop(proc: subprocess.Popen) -> None:
    """End a process started in its own session, and everything it started."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


# ---------------------------------------------------------------------------------------------
# one real server and one labelling run for the module


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    """vLLM's OpenAI-compatible server on loopback, serving a random 2-layer judge whose vocabulary is the
    tiny task's plus "[[A]]", "[[B]]", "A" and "B": its random answers are a mix of parseable and unparseable
    verdicts. The server checks the API key."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("judge")
    raw = json.loads((TINY / "sft" / "tokenizer.json").read_text())
    for word in ["[[A]]", "[[B]]", "A", "B"]:
        raw["model"]["vocab"][word] = len(raw["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    (folder / "tokenizer_config.json").write_text((TINY / "sft" / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(small_config(tokenizer, max_position_embeddings=1024)).save_pretrained(
        folder / "model"
    )
    tokenizer.save_pretrained(folder / "model")

    port, log = free_port(), folder / "server.log"
    cores = sorted(os.sched_getaffinity(0))
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder / "model"),
        "--served-model-name",
        "tiny-judge",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--seed",
        "0",
        "--chat-template",
        JUDGE_TEMPLATE,
    ]
    with open(log, "w") as out:
        # no separate worker process (the engine core runs the model itself): a faster start on a small CPU
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": str(cores[0])},
        )

    def wait(timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, f"the judge server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            assert time.time() < deadline, f"the judge server did not start in {timeout} s:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)

    try:
        yield SimpleNamespace(base_url=f"http://127.0.0.1:{port}/v1", wait=wait)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def labelling(judge_server, tmp_path_factory):
    """label_preferences.py on the 3 fixture prompts with a random tiny policy (vLLM in-process), judged by
    the module's server; started at once, so it samples while the server boots."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("labelling")
    tokenizer = AutoTokenizer.from_pretrained(TINY / "sft")
    tokenizer.chat_template = POLICY_TEMPLATE
    policy = save_random_policy(tokenizer, folder / "policy", seed=1)
    output = folder / "preferences" / "train.jsonl"
    argv = [
        sys.executable,
        "tasks/label_preferences.py",
        "--sft_model_path",
        str(policy),
        "--dataset_name",
        str(FIXTURES / "no_robots.jsonl"),
        "--output_path",
        str(output),
        *LABEL_FLAGS,
        "--base_url",
        judge_server.base_url,
        *JUDGE_FLAGS,
        "--retry_wait",
        "1",
        "--retry_wait_max",
        "3",
        "--max_retries",
        "200",
    ]
    cores = sorted(os.sched_getaffinity(0))
    env = {
        **os.environ,
        KEY_ENV: KEY,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": str(cores[-1]),
    }
    log = folder / "labelling.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def result(timeout: float = 300) -> SimpleNamespace:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise
        assert proc.returncode == 0, f"label_preferences.py failed ({proc.returncode}):\n{log.read_text()[-6000:]}"
        return SimpleNamespace(output=output, details=output.parent.parent / "preferences_details")

    try:
        yield result
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def start_early(judge_server, labelling):
    """Both start before the first test that needs either, whichever it is."""


# the tests on a real server: slow, and on one xdist worker, which starts the server and the labelling run once
real_server = [pytest.mark.slow, pytest.mark.xdist_group("judge_server"), pytest.mark.usefixtures("start_early")]


# ---------------------------------------------------------------------------------------------
# verdicts and the A/B order, by hand


def test_parse_verdict_on_hand_written_answers():
    cases = {
        "Answer A is more accurate.\n[[A]]": "A",
        "B follows the request; A does not. [[B]]": "B",
        "[[B]]": "B",
        " [[A]]": "A",
        "A is fine. Verdict: [[A]] ... as said, [[A]]": "A",  # the same verdict twice is still one verdict
        "B": "B",
        ' "A". ': "A",
        "I prefer [[A]] over [[B]]": None,  # both named: no choice made
        "Both are good.": None,
        "A is better": None,  # a letter inside a sentence is not a verdict
        "[[C]]": None,
        "[A]": None,
        "": None,
        None: None,
    }
    for text, expected in cases.items():
        assert llm_judge.parse_verdict(text) == expected, text


def test_swap_plan_is_seeded_and_balanced():
    for n in [1, 2, 7, 8, 501]:
        plan = llm_judge.swap_plan(n, seed=3)
        assert len(plan) == n and sum(plan) == n // 2  # policy shown first ceil(n/2) times, second floor(n/2) times
        assert plan == llm_judge.swap_plan(n, seed=3)
    plans = {tuple(llm_judge.swap_plan(40, seed)) for seed in range(20)}
    assert len(plans) == 20  # a different order for every seed
    long = llm_judge.swap_plan(1000, seed=0)
    assert 400 < sum(a != b for a, b in zip(long, long[1:])) < 600  # shuffled, not alternating or in blocks


def test_preferred_side_unswaps_the_shown_order():
    # not swapped: A = left, B = right; swapped: A = right, B = left
    assert llm_judge.preferred_side("A", swapped=False) == "left"
    assert llm_judge.preferred_side("B", swapped=False) == "right"
    assert llm_judge.preferred_side("A", swapped=True) == "right"
    assert llm_judge.preferred_side("B", swapped=True) == "left"
    assert llm_judge.preferred_side(None, swapped=True) is None


def test_summary_arithmetic_on_hand_written_verdicts(tokenizer):
    rows = [
        {"step": 4, "episode": 1024, "prompt": "p", "completion": c, "reference": r}
        for c, r in [
            ("ant ape cow", "a bb"),
            ("x", "yy zz"),
            ("one two", "three"),
            ("four", "five six seven"),
            ("eel", "fox"),
        ]
    ]
    # policy first?, verdict -> winner: A/True policy, B/False policy, B/True reference, None, A/False reference
    verdicts = [
        {"policy_first": first, "verdict": v, "winner": w}
        for first, v, w in [
            (True, "A", "policy"),
            (False, "B", "policy"),
            (True, "B", "reference"),
            (False, None, None),
            (False, "A", "reference"),
        ]
    ]
    s = llm_judge.summarize(rows, verdicts, tokenizer)
    assert (s["step"], s["episode"], s["n"], s["n_parseable"], s["n_unparseable"], s["policy_wins"]) == (
        4,
        1024,
        5,
        4,
        1,
        2,
    )
    assert s["unparseable_rate"] == 1 / 5 and s["win_rate"] == 2 / 4
    assert s["win_rate_policy_shown_first"] == 1 / 2 and s["win_rate_policy_shown_second"] == 1 / 2
    # words: (3+1+2+1+1)/5; chars: (11+1+7+4+3)/5; tiny word-level tokens = words
    assert s["avg_length_policy"] == {"words": 8 / 5, "chars": 26 / 5, "tokens": 8 / 5}
    assert s["avg_length_reference"] == {"words": 9 / 5, "chars": (4 + 5 + 5 + 14 + 3) / 5, "tokens": 9 / 5}
    assert llm_judge.summarize(rows[:1], verdicts[3:4])["win_rate"] is None  # nothing parseable: no win rate, not 0


def test_bad_eval_rows_name_the_file_and_line(tmp_path):
    good = {"step": 1, "episode": 2, "prompt": "p", "completion": "c", "reference": "r"}
    cases = [
        ("{not json\n", "line 1: not JSON"),
        (json.dumps([good]) + "\n", "line 1: expected a JSON object"),
        (json.dumps(good) + "\n" + json.dumps({**good, "reference": None}) + "\n", "line 2: 'reference' must be a str"),
        (json.dumps({**good, "step": "1"}) + "\n", "line 1: 'step' must be a int"),
        ("\n", "no rows"),
    ]
    for i, (text, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(text)
        with pytest.raises(llm_judge.UsageError, match=f"{path}.*{message}"):
            llm_judge.read_completions(str(path))
    with pytest.raises(llm_judge.UsageError, match="nowhere.jsonl: no such file"):
        llm_judge.read_completions(str(tmp_path / "nowhere.jsonl"))
    assert len(llm_judge.read_completions(str(EVAL_FILES[0]))) == 7


# ---------------------------------------------------------------------------------------------
# request logic against a scripted endpoint on loopback


class ScriptedEndpoint:
    """A chat-completions endpoint on loopback: answers the scripted HTTP statuses first, then as a judge
    that always prefers the answer containing "GOOD". Records every request body."""

    def __init__(self, statuses=()):
        self.statuses, self.requests = list(statuses), []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append(body)
                status = endpoint.statuses.pop(0) if endpoint.statuses else 200
                prompt = body["messages"][-1]["content"]
                answer_a = prompt.split("[Answer A]")[1].split("[Answer B]")[0]
                reply = {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "[[A]]" if "GOOD" in answer_a else "[[B]]"},
                        }
                    ],
                }
                data = json.dumps(reply if status == 200 else {"error": {"message": f"scripted {status}"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def judge_args(base_url: str, **overrides) -> llm_judge.JudgeArgs:
    return llm_judge.JudgeArgs(
        **{"base_url": base_url, "model": "m", "api_key_env": KEY_ENV, "retry_wait": 0.01, **overrides}
    )


def test_pairs_are_shown_in_the_planned_order_and_mapped_back(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    endpoint = ScriptedEndpoint()
    try:
        args = judge_args(endpoint.base_url, concurrency=3, constrained_verdict=True)
        pairs = [
            (f"request {i}", "GOOD left" if i % 3 else "plain left", "plain right" if i % 3 else "GOOD right")
            for i in range(9)
        ]
        results = llm_judge.judge_pairs(llm_judge.make_client(args), args, pairs, seed=5)
    finally:
        endpoint.close()
    plan = llm_judge.swap_plan(9, seed=5)
    assert [r["swapped"] for r in results] == plan
    assert [r["preferred"] for r in results] == ["left" if i % 3 else "right" for i in range(9)]
    assert [r["verdict"] for r in results] == [
        ("B" if plan[i] else "A") if i % 3 else ("A" if plan[i] else "B") for i in range(9)
    ]
    by_request = {
        body["messages"][-1]["content"].split("[Request]\n")[1].split("\n")[0]: body for body in endpoint.requests
    }
    for i, (request, left, right) in enumerate(pairs):
        body = by_request[request]
        shown_a = body["messages"][-1]["content"].split("[Answer A]\n")[1].split("\n")[0]
        assert shown_a == (right if plan[i] else left)
        assert body["seed"] == 5 + i and body["temperature"] == 0.0 and body["model"] == "m"
        assert body["structured_outputs"] == {"choice": ["[[A]]", "[[B]]"]}  # extra_body fields go top level
        assert body["messages"][0] == {"role": "system", "content": llm_judge.JUDGE_SYSTEM}
        assert llm_judge.VERDICT_ONLY in body["messages"][-1]["content"]


def test_transient_errors_are_retried_up_to_the_limit(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    messages = llm_judge.judge_messages("request", "GOOD", "plain", constrained=False)
    for statuses, max_retries, attempts, fails in [
        ([503, 502], 2, 3, False),
        ([429, 500], 1, 2, True),
        ([408, 409], 5, 3, False),
        ([400], 5, 1, True),
        ([404], 5, 1, True),
    ]:
        endpoint = ScriptedEndpoint(statuses)
        try:
            args = judge_args(endpoint.base_url, max_retries=max_retries)
            client = llm_judge.make_client(args)
            if fails:
                with pytest.raises(RuntimeError, match=rf"after {attempts} attempt\(s\)"):
                    llm_judge.ask_judge(client, args, messages, seed=0)
            else:
                reply = llm_judge.ask_judge(client, args, messages, seed=0)
                assert reply == {"judge_response": "[[A]]", "finish_reason": "stop", "attempts": attempts}
            assert len(endpoint.requests) == attempts, statuses
        finally:
            endpoint.close()
    # nothing listening: a connection error, retried like the others
    args = judge_args(f"http://127.0.0.1:{free_port()}/v1", max_retries=2)
    start = time.time()
    with pytest.raises(RuntimeError, match=r"after 3 attempt\(s\): APIConnectionError"):
        llm_judge.ask_judge(llm_judge.make_client(args), args, messages, seed=0)
    assert time.time() - start >= 0.01 + 0.02  # waits of retry_wait, then doubled


def test_bad_input_fails_in_one_line_before_any_request(tmp_path):
    endpoint = ScriptedEndpoint()
    bad = tmp_path / "step_000001.jsonl"
    bad.write_text('{"step": 1}\n')
    cases = [
        ([str(tmp_path / "missing.jsonl")], {KEY_ENV: KEY}, f"error: {tmp_path / 'missing.jsonl'}: no such file"),
        ([str(EVAL_FILES[0]), str(bad)], {KEY_ENV: KEY}, f"error: {bad} line 1: 'prompt' must be a str"),
        ([str(EVAL_FILES[0])], {}, f"error: the environment variable {KEY_ENV} (named by --api_key_env) is not set"),
        ([], {KEY_ENV: KEY}, "error: give at least one eval_completions .jsonl file"),
        ([str(EVAL_FILES[0]), "--concurrency", "0"], {KEY_ENV: KEY}, "error: --concurrency must be >= 1"),
    ]
    try:
        for files, env, message in cases:
            environ = {k: v for k, v in os.environ.items() if k != KEY_ENV}
            proc = subprocess.run(
                [
                    sys.executable,
                    "tasks/llm_judge.py",
                    *files,
                    "--base_url",
                    endpoint.base_url,
                    "--model",
                    "m",
                    "--api_key_env",
                    KEY_ENV,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                env={**environ, **env},
            )
            assert (
                proc.returncode == 1 and proc.stderr.strip().startswith(message) and "\n" not in proc.stderr.strip()
            ), proc.stderr[-2000:]
        assert endpoint.requests == []
        assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]
    finally:
        endpoint.close()


# ---------------------------------------------------------------------------------------------
# label_preferences.py helpers, by hand


def test_prompts_are_the_chat_template_before_the_last_answer():
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY / "sft")
    tokenizer.chat_template = POLICY_TEMPLATE
    dataset = label_preferences.load_conversations(str(FIXTURES / "no_robots.jsonl"), "train", None)
    items = label_preferences.prompts_and_references(dataset, tokenizer, 24, "fixture")
    assert [(i["prompt_id"], i["prompt"], i["reference"]) for i in items] == [
        ("f3b1c0de01", "<s> sort: cow ant ape ->", "ant ape cow"),
        ("f3b1c0de02", "<s> sort: dog -> sort: yak bee ->", "bee yak"),  # the system turn stays in the prompt
        (
            "f3b1c0de03",
            "<s> sort: cat bat -> bat cat </s> sort: emu elk eel fox ->",
            "eel elk emu fox",
        ),  # earlier turns too
    ]
    assert items[0]["token_ids"] == tokenizer.convert_tokens_to_ids(
        "<s> sort: cow ant ape ->".split()
    )  # one BOS, from the template
    assert [i["prompt_id"] for i in label_preferences.prompts_and_references(dataset, tokenizer, 8, "fixture")] == [
        "f3b1c0de01",
        "f3b1c0de02",
    ]
    with pytest.raises(llm_judge.UsageError, match="no prompt fits --max_prompt_length 5"):
        label_preferences.prompts_and_references(dataset, tokenizer, 5, "fixture")
    with pytest.raises(llm_judge.UsageError, match=r"--dataset_name .*step_000004.jsonl: no `messages` column"):
        label_preferences.load_conversations(str(EVAL_FILES[0]), "train", None)
    assert len(label_preferences.load_conversations(str(FIXTURES / "no_robots.jsonl"), "test", 2)) == 2
    unanswered = load_dataset("json", data_files=str(FIXTURES / "no_robots.jsonl"), split="train").map(
        lambda r: {"messages": r["messages"][:-1]}
    )
    with pytest.raises(llm_judge.UsageError, match="row 0's `messages` do not end with an assistant turn"):
        label_preferences.prompts_and_references(unanswered, tokenizer, 24, "fixture")


def test_all_pairs_and_preference_rows_by_hand():
    assert label_preferences.all_pairs(4) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    samples = [{"prompt": "P", "prompt_id": "id0", "completions": {"sft_0": "s0", "sft_1": "s1", "human": "h"}}]
    verdicts = [
        {
            "prompt_index": 0,
            "left": "sft_0",
            "right": "human",
            "preferred": "right",
            "verdict": "A",
            "swapped": True,
            "judge_response": "[[A]]",
        },
        {
            "prompt_index": 0,
            "left": "sft_0",
            "right": "sft_1",
            "preferred": "left",
            "verdict": "A",
            "swapped": False,
            "judge_response": "[[A]]",
        },
        {
            "prompt_index": 0,
            "left": "sft_1",
            "right": "human",
            "preferred": None,
            "verdict": None,
            "swapped": False,
            "judge_response": "?",
        },
    ]
    rows = label_preferences.preference_rows(samples, verdicts)
    assert [(r["prompt"], r["chosen"], r["rejected"], r["chosen_source"], r["rejected_source"]) for r in rows] == [
        ("P", "h", "s0", "human", "sft_0"),
        ("P", "s0", "s1", "sft_0", "sft_1"),
    ]


def test_the_sft_model_needs_a_chat_template_and_room_for_the_response(tmp_path):
    with pytest.raises(
        llm_judge.UsageError, match=f"--sft_model_path {TINY / 'sft'}: its tokenizer has no chat template"
    ):
        label_preferences.load_sft_tokenizer(str(TINY / "sft"), 24)
    with pytest.raises(llm_judge.UsageError, match=f"--sft_model_path {tmp_path / 'nowhere'}"):
        label_preferences.load_sft_tokenizer(str(tmp_path / "nowhere"), 24)
    from transformers import AutoTokenizer

    templated = AutoTokenizer.from_pretrained(TINY / "sft")
    templated.chat_template = POLICY_TEMPLATE
    policy = save_random_policy(templated, tmp_path / "policy")  # 128 positions
    assert label_preferences.load_sft_tokenizer(str(policy), 128).chat_template == POLICY_TEMPLATE
    with pytest.raises(
        llm_judge.UsageError, match=r"--max_prompt_length \+ --response_length = 129 exceed the 128-token context"
    ):
        label_preferences.load_sft_tokenizer(str(policy), 129)


def test_label_preferences_refuses_bad_input_before_loading_models(tmp_path, monkeypatch):
    common = [
        "--dataset_name",
        str(FIXTURES / "no_robots.jsonl"),
        "--output_path",
        str(tmp_path / "out" / "train.jsonl"),
        "--base_url",
        "http://127.0.0.1:1/v1",
        "--api_key_env",
        KEY_ENV,
    ]
    environ = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    proc = subprocess.run(
        [sys.executable, "tasks/label_preferences.py", *common, "--sft_model_path", str(TINY / "sft")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"error: the environment variable {KEY_ENV} (named by --api_key_env) is not set: put the judge's API key there"
    ), proc.stderr[-2000:]
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing the engine now fails: every refusal must come before it
    for flags, message in [
        (
            ["--sft_model_path", str(TINY / "sft")],
            f"--sft_model_path {TINY / 'sft'}: its tokenizer has no chat template",
        ),
        (
            ["--sft_model_path", str(TINY / "sft"), "--output_path", str(tmp_path / "x.json")],
            "--output_path .*x.json must end in .jsonl",
        ),
        ([], "--sft_model_path is required"),
        (["--sft_model_path", str(TINY / "sft"), "--temperature", "0"], "--temperature must be > 0"),
    ]:
        with pytest.raises(SystemExit, match=f"^error: {message}"):
            run_main("tasks/label_preferences.py", common + flags, monkeypatch)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# against the real server


def run_judge(judge_server, files: list[Path], flags: list[str], monkeypatch, capsys) -> list[dict]:
    judge_server.wait()
    monkeypatch.setenv(KEY_ENV, KEY)
    run_main(
        "tasks/llm_judge.py",
        [*map(str, files), "--base_url", judge_server.base_url, *JUDGE_FLAGS, *flags],
        monkeypatch,
    )
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def check_against_saved_verdicts(path: Path, summary: dict, tag: str, tokenizer=None) -> list[dict]:
    """The summary, recomputed by hand from the rows and the judge's saved raw answers."""
    rows, saved = read_jsonl(path), read_jsonl(path.with_name(f"{tag}_{path.stem}.verdicts.jsonl"))
    assert json.loads(path.with_name(f"{tag}_{path.stem}.json").read_text()) == summary
    assert not list(path.parent.glob("*.tmp"))
    verdicts = [by_hand(v["judge_response"]) for v in saved]
    assert [v["verdict"] for v in saved] == verdicts
    plan = llm_judge.swap_plan(len(rows), summary["seed"])
    assert [v["policy_first"] for v in saved] == [not s for s in plan]
    wins = sum((v == "A") == s["policy_first"] for v, s in zip(verdicts, saved) if v is not None)
    parseable = sum(v is not None for v in verdicts)
    assert summary["n"] == len(rows) and summary["step"] == rows[0]["step"] and summary["episode"] == rows[0]["episode"]
    assert summary["n_unparseable"] == len(rows) - parseable and summary["n_parseable"] == parseable
    assert summary["policy_wins"] == wins and summary["win_rate"] == (wins / parseable if parseable else None)
    for side, key in [("avg_length_policy", "completion"), ("avg_length_reference", "reference")]:
        lengths = {
            "words": statistics.mean(len(r[key].split()) for r in rows),
            "chars": statistics.mean(len(r[key]) for r in rows),
        }
        if tokenizer is not None:
            lengths["tokens"] = statistics.mean(
                len(tokenizer(r[key], add_special_tokens=False).input_ids) for r in rows
            )
        assert summary[side] == lengths
    return saved


@real_server[0]
@real_server[1]
@real_server[2]
def test_judge_counts_unparseable_verdicts_of_a_real_server(judge_server, tmp_path, monkeypatch, capsys):
    files = []
    for f in EVAL_FILES:
        files.append(tmp_path / f.name)
        files[-1].write_text(f.read_text())
    summaries = run_judge(judge_server, files, ["--seed", "3"], monkeypatch, capsys)
    assert [s["file"] for s in summaries] == [str(f) for f in files]
    unparseable = parseable = 0
    for path, summary in zip(files, summaries):
        saved = check_against_saved_verdicts(path, summary, "judge")
        unparseable += summary["n_unparseable"]
        parseable += summary["n_parseable"]
        assert all(v["attempts"] == 1 and isinstance(v["judge_response"], str) for v in saved)
    with capsys.disabled():
        print(f"\nreal random judge: {unparseable} unparseable, {parseable} parseable verdicts")
    assert unparseable > 0 and parseable > 0  # both paths of the count, on real answers


@real_server[0]
@real_server[1]
@real_server[2]
def test_constrained_verdicts_of_a_real_server_are_all_parseable(
    judge_server, tmp_path, tokenizer, monkeypatch, capsys
):
    path = tmp_path / EVAL_FILES[1].name
    path.write_text(EVAL_FILES[1].read_text())
    flags = ["--seed", "4", "--constrained_verdict", "--tag", "constrained", "--length_tokenizer", str(TINY / "sft")]
    (summary,) = run_judge(judge_server, [path], flags, monkeypatch, capsys)
    saved = check_against_saved_verdicts(path, summary, "constrained", tokenizer)
    assert summary["length_units"] == ["words", "chars", "tokens"]
    assert all(v["judge_response"].strip() in llm_judge.VERDICTS for v in saved)
    assert summary["n_unparseable"] == 0 and summary["n_parseable"] == 8 and summary["constrained_verdict"] is True
    with capsys.disabled():
        print(f"\nconstrained: win rate {summary['win_rate']} over {summary['n']}")


@real_server[0]
@real_server[1]
@real_server[2]
def test_a_wrong_api_key_is_refused_without_retries(judge_server, tmp_path, monkeypatch):
    judge_server.wait()
    path = tmp_path / EVAL_FILES[0].name
    path.write_text(EVAL_FILES[0].read_text())
    monkeypatch.setenv(KEY_ENV, "wrong")
    with pytest.raises(
        SystemExit, match=r"^error: .*step_000004.jsonl: judge request failed after 1 attempt\(s\): AuthenticationError"
    ):
        run_main("tasks/llm_judge.py", [str(path), "--base_url", judge_server.base_url, *JUDGE_FLAGS], monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing written


@real_server[0]
@real_server[1]
@real_server[2]
def test_label_preferences_end_to_end(labelling, tokenizer):
    from datasets import load_dataset

    run = labelling()
    summary = json.loads((run.details / "train.summary.json").read_text())
    samples = read_jsonl(run.details / "train.samples.jsonl")
    pairs = read_jsonl(run.details / "train.verdicts.jsonl")
    rows = read_jsonl(run.output)
    # 3 prompts x (3 samples + the human answer), all 6 pairs each
    conversations = read_jsonl(FIXTURES / "no_robots.jsonl")
    assert [s["prompt"] for s in samples] == [
        "<s> sort: cow ant ape ->",
        "<s> sort: dog -> sort: yak bee ->",
        "<s> sort: cat bat -> bat cat </s> sort: emu elk eel fox ->",
    ]
    assert [s["completions"]["human"] for s in samples] == [c["messages"][-1]["content"] for c in conversations]
    names = ["sft_0", "sft_1", "sft_2", "human"]
    for s in samples:
        assert list(s["completions"]) == names
        assert all(len(tokenizer(s["completions"][n], add_special_tokens=False).input_ids) <= 8 for n in names[:3])
    assert [(p["prompt_index"], p["left"], p["right"]) for p in pairs] == [
        (i, names[a], names[b]) for i in range(3) for a, b in [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    ]
    for p in pairs:
        texts = samples[p["prompt_index"]]["completions"]
        assert p["identical"] == (texts[p["left"]] == texts[p["right"]])
        assert (
            (p["attempts"] >= 1 and isinstance(p["judge_response"], str))
            if not p["identical"]
            else p["judge_response"] is None
        )
    judged = [p for p in pairs if not p["identical"]]
    # verdicts, the shown order and chosen/rejected, by hand from the judge's raw answers
    assert [p["swapped"] for p in judged] == llm_judge.swap_plan(len(judged), 1)
    expected = []
    for p in judged:
        verdict = by_hand(p["judge_response"])
        assert p["verdict"] == verdict
        if verdict is not None:
            shown_a, shown_b = (p["right"], p["left"]) if p["swapped"] else (p["left"], p["right"])
            winner, loser = (shown_a, shown_b) if verdict == "A" else (shown_b, shown_a)
            texts = samples[p["prompt_index"]]["completions"]
            expected.append((samples[p["prompt_index"]]["prompt"], texts[winner], texts[loser], winner, loser, verdict))
    assert [
        (r["prompt"], r["chosen"], r["rejected"], r["chosen_source"], r["rejected_source"], r["judge_verdict"])
        for r in rows
    ] == expected
    n_unparseable = sum(by_hand(p["judge_response"]) is None for p in judged)
    assert (
        summary["n_prompts"],
        summary["n_pairs"],
        summary["n_judged"],
        summary["n_unparseable"],
        summary["n_written"],
    ) == (3, 18, len(judged), n_unparseable, len(expected))
    assert summary["n_written"] > 0 and summary["n_unparseable"] > 0, summary  # both kinds on real answers
    assert len(judged) >= 15  # a random policy at T 0.7 rarely repeats itself
    # the output folder is a clean dataset for the reward-model script
    assert sorted(p.name for p in run.output.parent.iterdir()) == ["train.jsonl"]
    dataset = load_dataset(str(run.output.parent), split="train")
    assert {"prompt", "chosen", "rejected"} <= set(dataset.column_names) and len(dataset) == len(rows)
