"""The mutation check's hook (``scripts/mutation_check.py`` puts this folder first on
``PYTHONPATH``; Python imports ``sitecustomize`` at the start of every process, torchrun's
ranks included). Nothing happens unless ``LONGCTX_MUTATE`` is set.

``LONGCTX_MUTATE=DEST=JSON`` (for instance ``hidden_dropout=0.0`` or ``swiglu=false``): every
time Megatron-LM's ``parse_args`` returns, before ``validate_args`` derives anything from it,
``args.DEST`` is set to the JSON value, so the process runs as if the option had been left at
that value while every other flag is as given (a string names the member where the parsed
value is an enumeration's, as ``--attention-backend``'s). A golden launch's ``init`` and
``reference`` modes (``tests/distributed/golden_run.py``: the initial weights and the
single-process reference) keep the option: only the process under test loses it. A parse
without the option (Megatron-LM's ``pretrain`` first parses its own flags for its
fault-tolerance setup, ignoring the others) is left as parsed. Each reset is logged.
"""
import enum
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys

_TARGET = "megatron.training.arguments"
#: Golden modes that keep the option (the weights and the reference the run is compared with).
_KEPT = ("init", "reference")

log = logging.getLogger("mutation")
log.addHandler(logging.StreamHandler(sys.stderr))
log.propagate = False
log.setLevel(logging.INFO)


def _mutation():
    dest, sep, value = os.environ.get("LONGCTX_MUTATE", "").partition("=")
    if not dest:
        return None
    if not sep:
        raise SystemExit(f"LONGCTX_MUTATE={dest!r}: write DEST=JSON, for instance "
                         "hidden_dropout=0.0")
    return dest, json.loads(value)


def _resetting(parse_args, dest, value):
    def parse(*args, **kwargs):
        parsed = parse_args(*args, **kwargs)
        if getattr(parsed, "golden_mode", None) in _KEPT:
            return parsed
        if not hasattr(parsed, dest):
            # A parse without the training script's groups (Megatron-LM's fault-tolerance setup
            # parses its own flags only, ignoring the others): nothing to reset there.
            return parsed
        given = getattr(parsed, dest)
        reset = type(given)[value] if isinstance(given, enum.Enum) else value
        log.warning("mutation: %s reset from %r to %r", dest, given, reset)
        setattr(parsed, dest, reset)
        return parsed
    return parse


class _Loader(importlib.abc.Loader):
    """Runs the module's own loader, then wraps its ``parse_args``."""

    def __init__(self, loader, dest, value):
        self.loader, self.dest, self.value = loader, dest, value

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.parse_args = _resetting(module.parse_args, self.dest, self.value)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, dest, value):
        self.dest, self.value = dest, value

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _Loader(spec.loader, self.dest, self.value)
        return spec


_found = _mutation()
if _found is not None:
    sys.meta_path.insert(0, _Finder(*_found))
