"""lm-evaluation-harness itself against `python -m dcpjax.serve` at TP 8 / DCP 2, offline, on a
small local task: per-item loglikelihoods (local-completions: echo + prompt logprobs) and
greedy generations (local-chat-completions: the chat template) equal lm-eval's own
transformers backend on the same folder (tests/fixtures/lm_eval/expected.json, written by
tests/fixtures/make_lm_eval_fixtures.py; rerun live when torch is installed)."""

import json
import pathlib
import sys

import pytest

from dcpjax.serve.process.launch import start_server

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")  # lm-eval's tokenizer backend (no torch needed)
sys.path.insert(0, str(pathlib.Path(__file__).parent / "fixtures" / "lm_eval"))
from tasks import HERE, evaluate, make_model, make_tasks

EXPECTED = json.loads((HERE / "expected.json").read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    return make_model(root / "model"), make_tasks(root / "tasks")


@pytest.fixture(scope="module")
def served(folders):
    model, tasks = folders
    args = ["--model", str(model), "--num-cpu-devices", "8", "-tp", "8", "-dcp", "2", "--served-model-name", "m",
            "--max-model-len", "256", "--kv-cache-memory-bytes", str(4 << 20)]
    with start_server(args, timeout=180) as server:
        completions = (f"model=m,base_url={server.base_url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={model},tokenized_requests=True,num_concurrent=2,max_retries=1")
        chat = f"model=m,base_url={server.base_url}/v1/chat/completions,num_concurrent=2,max_retries=1"
        yield {"dcpjax_ll": evaluate(tasks, "local-completions", completions, "dcpjax_ll"),
               "dcpjax_gen": evaluate(tasks, "local-chat-completions", chat, "dcpjax_gen")}


def _assert_same(got, want):
    loglikelihoods = [[ll, greedy] for ll, greedy in got["dcpjax_ll"]]
    assert [g for _, g in loglikelihoods] == [g for _, g in want["dcpjax_ll"]]
    for (ll, _), (want_ll, _) in zip(loglikelihoods, want["dcpjax_ll"]):
        assert ll == pytest.approx(want_ll, abs=2e-3)  # sums over up to 70 tokens
    assert got["dcpjax_gen"] == want["dcpjax_gen"]


@pytest.mark.e2e
def test_lm_eval_through_the_server_equals_its_transformers_backend(served):
    assert len(served["dcpjax_ll"]) == len(EXPECTED["dcpjax_ll"]) == 12
    _assert_same(served, EXPECTED)


@pytest.mark.e2e
def test_fixture_is_what_the_transformers_backend_gives_today(folders, served):
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    model, tasks = folders
    args = f"pretrained={model},dtype=float32,device=cpu"
    live = {task: evaluate(tasks, "hf", args, task) for task in ("dcpjax_ll", "dcpjax_gen")}
    _assert_same(served, live)
