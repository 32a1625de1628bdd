"""Packaging for the long-context pipeline-parallel extension of Megatron.

``megatron/`` is a namespace portion: it adds ``megatron.plugin`` beside pip's
``megatron.core`` and therefore has no ``__init__.py``.
"""
from setuptools import find_namespace_packages, setup

setup(
    name="megatron-longctx-pipelines",
    version="0.1.0",
    description="Elastic, Helix and SPPO pipeline schedules for Megatron-LM (drop-in pretrain_gpt)",
    python_requires=">=3.12",
    packages=find_namespace_packages(
        include=["megatron.plugin", "megatron.plugin.*", "elastic_pipe", "elastic_pipe.*",
                 "helix", "helix.*", "sppo_offload", "sppo_offload.*", "ir_1f1b", "ir_1f1b.*",
                 "longctx", "longctx.*"]
    ),
    py_modules=["pretrain_gpt_elastic"],
    package_data={"longctx": ["profiles/*.json"]},
    # The schedules (megatron/plugin/schedule_spec.py), found by the registry through this group.
    entry_points={"megatron_longctx.schedules": [
        "1f1b-ir = ir_1f1b.schedule:SPEC",
        "elastic = elastic_pipe.spec:ELASTIC",
        "seq1f1b = elastic_pipe.spec:SEQ1F1B",
        "helix = helix.spec:SPEC",
        "sppo = sppo_offload.spec:SPEC",
    ]},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.17.0,<0.20",
        "ortools>=9.10",
        "numpy",
        "matplotlib",
        # megatron-core's checkpoint writer needs it (Megatron-LM lists it too).
        "psutil",
        # megatron.training imports yaml at start-up in 0.17 (its YAML argument files).
        "pyyaml",
        # megatron-core builds the groups of --num-distributed-optimizer-instances with it.
        "einops",
    ],
    extras_require={
        # tokenizers + transformers: the tests build a BPE tokenizer for Megatron-LM's
        # HuggingFace and GPT-2 BPE tokenizers (tests/e2e/test_megatron_examples.py).
        # tensorboard: Megatron-LM's TensorBoard writer (torch.utils.tensorboard) needs it; the
        # tests read its event files back (--tensorboard-dir is refused without it).
        # pytest-xdist: scripts/test.sh spreads the unit tier over the cores.
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "tokenizers", "transformers",
                 "tensorboard"],
        # On CUDA clusters. NVIDIA apex is built from source (see README); the PyPI package
        # named "apex" is an unrelated project and must never be installed. Transformer Engine
        # is not listed: the layer spec is Megatron's local one with the document attention,
        # and --transformer-impl transformer_engine is refused by name.
        "gpu": ["flash-attn"],
    },
)
