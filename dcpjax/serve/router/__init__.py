"""`python -m dcpjax.serve.router`: one OpenAI endpoint in front of prefill and decode servers.

Prefill/decode disaggregation as vLLM does it: a prefill server (`--kv-transfer-config
'{"kv_role": "kv_producer"}'`) runs each prompt once and keeps its KV; a decode server
(`kv_consumer`) pulls that KV and generates. The router hides the two hops from the client:
for each completion it asks a prefill server for one token with `kv_transfer_params:
{"do_remote_decode": true}`, hands the `kv_transfer_params` it answers to a decode server
along with the original request, and relays the decode server's answer (its status, its JSON,
or its server-sent events as they arrive), so a client sees what one server would send. The KV
itself is the servers' business: a decode server that refuses a request releases the handle on
the prefill server on its own, so the router needs no JAX, no engine and no KV wire (it starts in
well under a second).

    python -m dcpjax.serve.router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

`app.build_app` is the ASGI app (tests pass fake backends as an httpx transport); `proxy` the
two hops; `checks` what a P/D pair cannot do, refused up front; `metrics` the router's own
Prometheus counters.
"""

from dcpjax.serve.router.app import build_app

__all__ = ["build_app"]
