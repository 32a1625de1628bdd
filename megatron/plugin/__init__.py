"""Megatron plugin layer: schedule registry, arguments, CPU compatibility, attention,
the training loop behind ``pretrain_gpt_elastic.py``, data and tokenizer glue.

``megatron`` itself is a namespace package shared with pip's ``megatron.core``.
"""
