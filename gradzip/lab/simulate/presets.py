"""Named clusters and models for the projection, each with its numbers and where they come from.

Clusters are :class:`ClusterPreset` values in :data:`CLUSTERS`; models are built from
``transformers`` configs on the ``meta`` device (shapes only, no memory for weights) by
:func:`model_shapes`. Every figure that is an assumption rather than a datasheet value says so.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from gradzip.lab.simulate.collectives import Fabric, Link
from gradzip.lab.train.pretrained import SMOLLM2_SHAPE

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
GBYTE = 1e9


@dataclass(frozen=True)
class GPU:
    """One accelerator.

    Attributes:
        name: marketing name.
        peak_flops: dense BF16 tensor-core peak, FLOP/s (no structured sparsity).
        hbm_bytes_per_s: memory bandwidth, bytes per second.
        memory_bytes: device memory, bytes.
        source: where the figures come from.
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    source: str


H100_SXM = GPU(
    name="H100 SXM5 80GB",
    peak_flops=989e12,
    hbm_bytes_per_s=3.35e12,
    memory_bytes=80e9,
    source="NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB",
)

L40S = GPU(
    name="L40S 48GB",
    peak_flops=362e12,
    hbm_bytes_per_s=864e9,
    memory_bytes=48e9,
    source="NVIDIA L40S datasheet: 362 TFLOPS dense BF16 (733 with sparsity), 864 GB/s GDDR6, 48 GB",
)


@dataclass(frozen=True)
class ClusterPreset:
    """A cluster: identical nodes of ``gpus_per_node`` GPUs, joined by their NICs.

    Attributes:
        name: what ``--cluster`` takes.
        description: one line.
        gpu: the accelerator.
        gpus_per_node: GPUs per node.
        intra_gbyte_per_s: in-node bus bandwidth (nccl-tests busbw), GB/s.
        intra_latency_us: in-node latency per algorithm step, microseconds.
        nics_per_node: network interfaces per node used by the collectives.
        nic_gbit: line rate of one NIC, Gbit/s.
        nic_efficiency: fraction of the line rate a collective reaches (bus bandwidth / line rate).
        inter_latency_us: node-to-node latency per algorithm step, microseconds.
        codec_gbyte_per_s: assumed codec throughput on this GPU, GB/s of dense gradient encoded
            or decoded (elementwise codecs are memory-bound; see the source).
        source: where each figure comes from, and which are assumptions.
    """

    name: str
    description: str
    gpu: GPU
    gpus_per_node: int
    intra_gbyte_per_s: float
    intra_latency_us: float
    nics_per_node: int
    nic_gbit: float
    nic_efficiency: float
    inter_latency_us: float
    codec_gbyte_per_s: float
    source: str = field(repr=False)

    @property
    def node_nic_bytes_per_s(self) -> float:
        """All NICs of a node together, at the stated efficiency, bytes per second."""
        return self.nics_per_node * self.nic_gbit * GBIT * self.nic_efficiency

    def fabric(self) -> Fabric:
        """The two-level network of :mod:`gradzip.lab.simulate.collectives`."""
        return Fabric(
            gpus_per_node=self.gpus_per_node,
            intra=Link(self.intra_latency_us * 1e-6, self.intra_gbyte_per_s * GBYTE),
            inter=Link(self.inter_latency_us * 1e-6, self.node_nic_bytes_per_s),
        )


_NVLINK_SOURCE = (
    "NVLink 4 through NVSwitch gives each H100 SXM 450 GB/s per direction (NVIDIA DGX H100 "
    "datasheet); 360 GB/s bus bandwidth (80% of that) is an assumption within the range "
    "nccl-tests all_reduce_perf reports on 8xH100 nodes."
)
_H100_CODEC = (
    "Codec throughput 300 GB/s of dense gradient is an assumption: about ten passes over the "
    "tensor at the 3.35 TB/s HBM bandwidth, what element-wise PyTorch codecs (casts, signs, "
    "quantization, packing) cost; sort-based selection (torch.topk) is slower, so pass "
    "--codec-gbps for it."
)

CLUSTERS: dict[str, ClusterPreset] = {
    preset.name: preset
    for preset in (
        ClusterPreset(
            name="h100-400ib",
            description="8x H100 SXM per node, NVLink, 8x 400 Gbit/s InfiniBand per node",
            gpu=H100_SXM,
            gpus_per_node=8,
            intra_gbyte_per_s=360.0,
            intra_latency_us=2.0,
            nics_per_node=8,
            nic_gbit=400.0,
            nic_efficiency=0.9,
            inter_latency_us=5.0,
            codec_gbyte_per_s=300.0,
            source=(
                "NVIDIA DGX H100 datasheet: 8x H100 SXM5, 8x single-port ConnectX-7 400 Gb/s "
                "InfiniBand/Ethernet. " + _NVLINK_SOURCE + " 90% of line rate and 5 us per step "
                "across nodes are assumptions for NDR InfiniBand with GPUDirect RDMA. " + _H100_CODEC
            ),
        ),
        ClusterPreset(
            name="h100-100gbe",
            description="8x H100 SXM per node, NVLink, one 100 Gbit/s Ethernet NIC per node",
            gpu=H100_SXM,
            gpus_per_node=8,
            intra_gbyte_per_s=360.0,
            intra_latency_us=2.0,
            nics_per_node=1,
            nic_gbit=100.0,
            nic_efficiency=0.9,
            inter_latency_us=10.0,
            codec_gbyte_per_s=300.0,
            source=(
                "A scenario, not one vendor's instance: DGX-class nodes whose collectives share one "
                "100GBASE Ethernet port (IEEE 802.3, 100 Gbit/s line rate) with RoCE. " + _NVLINK_SOURCE
                + " 90% of line rate and 10 us per step are assumptions. " + _H100_CODEC
            ),
        ),
        ClusterPreset(
            name="l40s-25gbe",
            description="commodity: 8x L40S PCIe per node, no NVLink, one 25 Gbit/s Ethernet NIC",
            gpu=L40S,
            gpus_per_node=8,
            intra_gbyte_per_s=20.0,
            intra_latency_us=5.0,
            nics_per_node=1,
            nic_gbit=25.0,
            nic_efficiency=0.9,
            inter_latency_us=25.0,
            codec_gbyte_per_s=80.0,
            source=(
                "NVIDIA L40S datasheet (PCIe Gen4 x16, no NVLink). In-node bus bandwidth 20 GB/s "
                "(80% of PCIe Gen4 x16's 25 GB/s per direction), 25GBASE Ethernet at 90% of line "
                "rate over TCP with 25 us per step, and codec throughput 80 GB/s (about ten passes "
                "at 864 GB/s) are assumptions."
            ),
        ),
        ClusterPreset(
            name="h100-xregion-1gbit",
            description="8x H100 SXM nodes in different regions, 1 Gbit/s per node across the WAN",
            gpu=H100_SXM,
            gpus_per_node=8,
            intra_gbyte_per_s=360.0,
            intra_latency_us=2.0,
            nics_per_node=1,
            nic_gbit=1.0,
            nic_efficiency=0.9,
            inter_latency_us=30_000.0,
            codec_gbyte_per_s=300.0,
            source=(
                "A cross-region scenario: each node's share of a wide-area link is 1 Gbit/s, one-way "
                "latency 30 ms (about half of a US east-west round trip), both assumptions; the "
                "link is modelled per node, not as one shared pipe. " + _NVLINK_SOURCE + " " + _H100_CODEC
            ),
        ),
    )
}


def get_cluster(name: str) -> ClusterPreset:
    """The preset called ``name``.

    Raises:
        ValueError: naming ``cluster`` and the known presets.
    """
    if name not in CLUSTERS:
        raise ValueError(f"cluster must be one of {', '.join(CLUSTERS)}; got {name!r}")
    return CLUSTERS[name]


# Models ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShapes:
    """The trainable parameters of a model, in registration order (``model.parameters()``).

    Attributes:
        name: preset name.
        description: one line with the source of the configuration.
        params: ``(name, shape)`` of every parameter, tied weights once.
        lookup_params: names of parameters used only as embedding lookups (no matmul FLOPs).
        n_layer: transformer blocks.
        d_model: hidden size.
        seq_len: training sequence length, tokens.
    """

    name: str
    description: str
    params: tuple[tuple[str, tuple[int, ...]], ...]
    lookup_params: frozenset[str]
    n_layer: int
    d_model: int
    seq_len: int

    @property
    def numel(self) -> int:
        """Number of parameters."""
        return sum(math.prod(shape) for _, shape in self.params)

    @property
    def matmul_numel(self) -> int:
        """Parameters used in matrix multiplies (all but pure lookups)."""
        return sum(math.prod(shape) for name, shape in self.params if name not in self.lookup_params)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6 N + 12 L d T``.

        ``N`` counts matmul parameters, ``L d T`` the attention scores and values (PaLM,
        Chowdhery et al. 2022, arXiv 2204.02311, appendix B), forward plus backward.
        """
        return 6.0 * self.matmul_numel + 12.0 * self.n_layer * self.d_model * self.seq_len

    def block_of(self, param_name: str) -> int | None:
        """The transformer block a parameter belongs to (None for embeddings, final norm, head)."""
        match = _BLOCK.search(param_name)
        return int(match.group(1)) if match else None


_BLOCK = re.compile(r"\.(?:h|layers)\.(\d+)\.")


@dataclass(frozen=True)
class ModelPreset:
    """A ``transformers`` config and the sequence length it trains at."""

    name: str
    description: str
    config: dict
    kind: str  # "gpt2" or "llama"
    seq_len: int


MODELS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset(
            "gpt2", "GPT-2 124M (Radford et al. 2019; transformers GPT2Config defaults)", {}, "gpt2", 1024
        ),
        ModelPreset(
            "gpt2-xl",
            "GPT-2 1.5B (the 'gpt2-xl' configuration: 48 layers, d_model 1600, 25 heads)",
            {"n_embd": 1600, "n_layer": 48, "n_head": 25},
            "gpt2",
            1024,
        ),
        ModelPreset(
            "llama-7b",
            "Llama-2 7B shape (Touvron et al. 2023, arXiv 2307.09288): 32 layers, d_model 4096, "
            "MLP 11008, vocabulary 32000, untied head",
            {
                "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            },
            "llama",
            4096,
        ),
        ModelPreset(
            "llama-70b",
            "Llama-2 70B shape (arXiv 2307.09288): 80 layers, d_model 8192, MLP 28672, grouped-query "
            "attention with 8 key/value heads, vocabulary 32000",
            {
                "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
            },
            "llama",
            4096,
        ),
        ModelPreset(
            "smollm2-135m",
            "SmolLM2-135M (Allal et al. 2025, arXiv 2502.02737): 30 layers, d_model 576, MLP 1536, grouped-query "
            "attention with 3 key/value heads, vocabulary 49152, tied head; the model of 'gradzip finetune'",
            SMOLLM2_SHAPE,
            "llama",
            2048,
        ),
    )
}

#: sequence length assumed for a model folder, at most (its own limit may be far longer)
FOLDER_SEQ_LEN = 4096


@functools.cache
def model_shapes(name: str) -> ModelShapes:
    """Parameter shapes of the preset ``name``, or of the ``transformers`` model folder at path
    ``name`` (its ``config.json``; trained at its longest sequence, at most
    :data:`FOLDER_SEQ_LEN`), from the config on the meta device.

    No weights are allocated, read or downloaded: the model is instantiated under
    ``torch.device("meta")``, where tensors carry only shape and dtype.

    Raises:
        ValueError: naming ``model``, the known presets and the folder form.
    """
    import os

    if name not in MODELS and not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"model must be one of {', '.join(MODELS)} or a transformers model folder (holding "
                         f"config.json); got {name!r}")
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if name in MODELS:
        preset = MODELS[name]
        config = (GPT2Config if preset.kind == "gpt2" else LlamaConfig)(**preset.config)
        description, seq_len = preset.description, preset.seq_len
    else:
        from gradzip.lab.train.pretrained import load_config

        config = load_config(name)
        longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        seq_len = min(longest or FOLDER_SEQ_LEN, FOLDER_SEQ_LEN)
        description = f"the model folder {name} ({config.model_type}), at sequence length {seq_len}"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {id(p): n for n, p in model.named_parameters()}
    output = model.get_output_embeddings()
    output_weight = id(output.weight) if output is not None else None
    lookups = frozenset(
        names[id(module.weight)]
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and id(module.weight) != output_weight
    )
    params = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    d_model = getattr(config, "hidden_size", None) or config.n_embd
    n_layer = getattr(config, "num_hidden_layers", None) or config.n_layer
    return ModelShapes(
        name=name,
        description=description,
        params=params,
        lookup_params=lookups,
        n_layer=n_layer,
        d_model=d_model,
        seq_len=seq_len,
    )
