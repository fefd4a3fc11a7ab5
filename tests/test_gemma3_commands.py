"""Gemma 3 270M through every command a user runs: plan, generate, serve and bench throughput, at TP 4 /
DCP 4 on fake CPU devices. One KV head, so DCP 4 holds four times DCP 1's tokens; its sliding layers
give back the blocks behind their 512-token windows (`models.kv_groups`). The text is the model's own
greedy continuation (tests/test_gemma3_parity.py proves the model against transformers)."""

import json
import pathlib
import subprocess
import sys

import openai
import pytest

NAME = "gemma3-270m"
ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUT = ["--num-cpu-devices", "4", "-tp", "4", "-dcp", "4", "--max-model-len", "2048",
          "--kv-cache-memory-bytes", "64M"]
PROMPT = "The capital of France is"
GREEDY = " the capital of the country of France. It is the largest city in France and"  # 16 tokens


def _run(*args) -> str:
    result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                            check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_plan_holds_four_times_the_tokens_at_dcp_4(gguf_path, capsys):
    """The planner at 16k: DCP 4 holds 4x DCP 1's tokens, and a step reads each sliding layer's window only."""
    from dcpjax.plan import command as plan

    assert plan.main(["--json", "--model", NAME, "--input-len", "16000", "--output-len", "64"]) == 0
    sizes = {row["dcp"]: row for row in json.loads(capsys.readouterr().out)["sizes"]}
    assert sizes[4]["kv_cache_size_tokens"] >= 3.96 * sizes[1]["kv_cache_size_tokens"]
    batch, per_token = sizes[1]["batch"], sizes[1]["kv_bytes_per_token_per_device"] / 3  # 3 full layers
    context = 16000 + 64 / 2
    assert sizes[1]["kv_read_bytes_per_step"] == pytest.approx(batch * per_token * (3 * context + 15 * 512))


@pytest.mark.oldest_jax  # the server's e2e test below runs the same text on the newest jax
def test_generate(gguf_path):
    out = _run("dcpjax.generate", "--model", NAME, *LAYOUT, "--max-tokens", "16", "--prompt", PROMPT)
    assert f"output: {GREEDY!r}" in out


@pytest.mark.e2e
def test_serve(gguf_path):
    from dcpjax.serve.process.launch import start_server

    with start_server(["--model", NAME, *LAYOUT, "--max-num-seqs", "4"], timeout=300) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0)
        assert reply.choices[0].text == GREEDY
        with pytest.raises(openai.BadRequestError, match="max_model_len"):
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4096, temperature=0)


@pytest.mark.e2e
def test_bench_throughput_reports_the_kv_cache_and_the_blocks_freed(gguf_path):
    """Prompts of 1,200 tokens in 256-token chunks: the sliding groups free blocks behind the window as they
    go, and DCP 4 holds 4x the tokens of the same bytes at DCP 1."""
    out = _run("dcpjax.bench", "throughput", "--model", NAME, *LAYOUT, "--num-prompts", "2", "--input-len", "1200",
               "--output-len", "4", "--num-iters", "1", "--no-breakdown", "--max-num-batched-tokens", "256", "--json")
    result = json.loads(out[out.index("{"):])
    assert result["kv_tokens_vs_dcp1"] >= 3.96 and result["sliding_blocks_freed"] > 0
    assert (result["kv_groups"], result["sliding_groups"], result["sliding_windows"]) == (6, 5, [512])
