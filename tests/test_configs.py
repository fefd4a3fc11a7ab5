"""Every ready deployment in configs/ passes the rules, and configs/README.md shows the library's numbers."""

import pathlib

import pytest

from dcpjax.plan.deployment import Deployment, compare_with_dcp1, markdown_rows

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.json"))


def test_there_are_the_seven_deployments():
    assert {p.stem for p in CONFIGS} == {
        "qwen3-235b-a22b-tp8-dcp2", "deepseek-v3-tp8-dcp8", "deepseek-v3.2-tp8-dcp8", "glm-5-tp8-dcp8",
        "kimi-k2-tp8-dcp8", "llama-3.1-70b-tp16-dcp2", "qwen3-next-80b-a3b-tp8-dcp4"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_deployment_is_valid_and_dcp_multiplies_capacity(path):
    deployment = Deployment.from_file(path)
    plan, base = compare_with_dcp1(deployment)  # validates the TP/DCP rules for the model
    assert plan["kv_cache_size_tokens"] > 0
    # where TP alone duplicates KV, DCP k holds k times the tokens in the same bytes
    assert (plan["kv_cache_size_tokens"] / base["kv_cache_size_tokens"]
            == pytest.approx(deployment.parallel.dcp, rel=1e-3))


def test_readme_table_is_what_the_library_computes():
    readme = (CONFIGS[0].parent / "README.md").read_text()
    assert "\n".join(markdown_rows(CONFIGS)) in readme
