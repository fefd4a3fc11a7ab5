"""One model over two processes x 4 fake CPU devices (jax.distributed on 127.0.0.1); process 0 serves.

The model is MLA + MoE (tiny-deepseek) at TP 8 / DCP 4 with default KV sizing: each process sizes
the cache from its own devices and the processes agree on the smallest.
"""

import openai
import pytest

import dcpjax
from dcpjax.serve.process.launch import free_port, start_server


@pytest.fixture(scope="module")
def two_process_server():
    common = ["--model", "tiny-deepseek", "--num-cpu-devices", "4", "-tp", "8", "-dcp", "4",
              "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2", "--max-model-len", "256"]
    with start_server(common + ["--process-id", "0"], followers=[common + ["--process-id", "1"]],
                      timeout=240) as server:  # stopping process 0 tells process 1 to stop
        yield server.base_url


def test_two_processes_serve_what_one_process_computes(two_process_server):
    prompts = ["Hello", "Decode context parallelism " * 3]
    params = dcpjax.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    local = dcpjax.LLM("tiny-deepseek", tensor_parallel_size=8, decode_context_parallel_size=4, max_model_len=256)
    want = [o.outputs[0].text for o in local.generate(prompts, params)]
    client = openai.OpenAI(base_url=f"{two_process_server}/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny-deepseek", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    got = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert got == want
    # the repeat reuses the first 64-token block (16 x DCP 4) from the prefix cache: both processes
    # must take the same blocks, or their steps would differ
    chunks = list(client.completions.create(prompt=prompts[1], stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == want[1]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
