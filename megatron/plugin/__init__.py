"""Megatron plugin layer: what ``pretrain_gpt_elastic.py`` hands Megatron-LM's training loop
(model provider with the document attention, document batches, schedule registry, the
project's flags and checks, schedule reports) and the CPU compatibility layer.

``megatron`` itself is a namespace package shared with pip's ``megatron.core``.
"""
