"""The flags that give the model a command line prices: a preset (``--model``) whose sizes
the shape flags override, or ``--model custom`` with every shape flag. ``--num-layers`` is a
function of its own (:func:`add_num_layers`) so that schedules drawing a layer count share the
one flag (helix's drawing, and the elastic planner's model)."""
from __future__ import annotations

import argparse

from longctx.models import PRESETS, ModelConfig, get_model

SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "vocab_size")


def add_num_layers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-layers", type=int,
                        help="transformer layers (default: 2 x --pp for helix, the --model "
                             "preset's for a priced model)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and the shape flags but ``--num-layers`` (:func:`add_num_layers`)."""
    parser.add_argument("--model", default="gpt-13b",
                        help=f"{'|'.join(sorted(PRESETS))}, or 'custom' with the shape flags")
    for flag in SHAPE_FLAGS[1:]:
        parser.add_argument("--" + flag.replace("_", "-"), type=int,
                            help="model shape (overrides the preset's value)")


def missing_shape_flags(args: argparse.Namespace) -> list[str]:
    """The shape flags ``--model custom`` needs and was not given (none for a preset)."""
    if args.model != "custom":
        return []
    return [f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if not getattr(args, f)]


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The model the flags of :func:`add_model_arguments` and :func:`add_num_layers` give."""
    shape = {flag: getattr(args, flag) for flag in SHAPE_FLAGS if getattr(args, flag)}
    if args.model == "custom":
        missing = missing_shape_flags(args)
        if missing:
            raise ValueError(f"--model custom needs {' '.join(missing)}")
        base = {}
    else:
        try:
            preset = get_model(args.model)
        except ValueError as error:
            raise ValueError(f"{error}, or 'custom' with the shape flags") from None
        base = {"num_layers": preset.num_layers, "hidden_size": preset.hidden_size,
                "num_attention_heads": preset.num_heads,
                "ffn_hidden_size": preset.ffn_hidden_size, "vocab_size": preset.vocab_size}
    base.update(shape)
    name = args.model if not shape else f"{args.model}+custom"
    return ModelConfig(name, base["num_layers"], base["hidden_size"],
                       base["num_attention_heads"], base["ffn_hidden_size"], base["vocab_size"])
