"""One model over two processes x 4 fake CPU devices (jax.distributed on 127.0.0.1); process 0 serves."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

import dcpjax


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_server():
    coordinator, http = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    common = [sys.executable, "-m", "dcpjax.serve", "--num-cpu-devices", "4", "-tp", "8", "-dcp", "2",
              "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2",
              "--kv-cache-memory-bytes", str(4 << 20), "--max-model-len", "256"]
    procs = [subprocess.Popen(common + ["--process-id", str(i)] + (["--port", str(http)] if i == 0 else []),
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in (1, 0)]
    base = f"http://127.0.0.1:{http}"
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=1)
            break
        except OSError:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("\n".join(p.stderr.read()[-2000:] for p in procs if p.poll() is not None))
            time.sleep(0.5)
    else:
        for p in procs:
            p.kill()
        raise RuntimeError("the two-process server did not start")
    yield base
    procs[1].terminate()  # process 0: tells process 1 to stop
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def test_two_processes_serve_what_one_process_computes(two_process_server):
    prompts = ["Hello", "Decode context parallelism " * 3]
    params = dcpjax.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    local = dcpjax.LLM("tiny-llama", tensor_parallel_size=8, decode_context_parallel_size=2,
                       kv_cache_memory_bytes=4 << 20, max_model_len=256)
    want = [o.outputs[0].text for o in local.generate(prompts, params)]
    client = openai.OpenAI(base_url=f"{two_process_server}/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny-llama", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    got = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert got == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[1], stream=True, **kw))
    assert streamed == want[1]
