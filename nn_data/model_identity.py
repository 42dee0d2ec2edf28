"""A model's identity as the packing check and the adapters' allow-lists saw it: a cheap fingerprint.

:func:`fingerprint` reads Python objects only (no tensor value, no sync): every module by type and identity,
the ``forward`` it runs, its hooks and parameter dicts, the attributes (:data:`MODULE_KEYS`) and config values
(:data:`CONFIG_KEYS`) the adapters read, the rotary module's state and the registered attention function. A
changed fingerprint means the model is not the one that was checked.

Example::

    seen = fingerprint(model)
    model.config.sliding_window = 5       # an edit after wrapping
    assert fingerprint(model) != seen"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

#: Config values an adapter's allow-list reads (windows, layer kinds, causality, rotary parameters).
CONFIG_KEYS = ("sliding_window", "use_sliding_window", "layer_types", "use_bidirectional_attention", "is_causal",
               "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
               "original_max_position_embeddings", "attention_chunk_size", "position_embedding_type", "alibi",
               "use_alibi", "_attn_implementation_internal", "_attn_implementation")
#: Attributes of a module (its instance ``__dict__``) that decide how it mixes tokens.
MODULE_KEYS = ("sliding_window", "is_sliding", "is_causal", "use_bidirectional_attention", "rope_type", "layer_type",
               "attention_type", "attention_chunk_size", "window_size", "max_seq_len_cached", "original_max_seq_len",
               "scaling", "config")
_BUFFERS = ("inv_freq", "original_inv_freq", "long_inv_freq")


def fingerprint(model: Any) -> tuple:
    """What the model is made of, as a tuple of Python values (see the module docstring); ``model`` is
    an ``nn.Module`` or any callable (a bound method's module and the modules a closure holds count)."""
    out = [type(model), id(model)]
    configs = {}
    for module in _roots(model):
        for sub in module.modules():
            state = sub.__dict__
            # a module re-initialised in place (its __init__ run again) has new parameter and hook dicts
            # the forward that runs: one set on the instance, else the class's (a class patched after wrapping);
            # the hooks by their handles' ids (a hook registered since), the dicts by identity (a new __init__)
            out += (type(sub), id(sub), id(state.get("forward") or getattr(type(sub), "forward", None)),
                    id(state.get("_parameters")), id(state.get("_forward_pre_hooks")),
                    tuple(state.get("_forward_pre_hooks") or ()), tuple(state.get("_forward_hooks") or ()))
            for key in MODULE_KEYS:
                value = state.get(key)
                if value is not None:
                    if key == "config":
                        configs[id(value)] = value
                        value = id(value)
                    out += (key, _frozen(value))
            buffers = state.get("_buffers")
            if buffers:
                out += tuple(id(buffers.get(name)) for name in _BUFFERS if name in buffers)
    for config in configs.values():
        out += _config_values(config)
    hooks = nn.modules.module  # hooks registered for every module (register_module_forward_hook)
    return tuple(out) + (_hook_code(hooks._global_forward_pre_hooks), _hook_code(hooks._global_forward_hooks))


def _hook_code(hooks: dict) -> tuple:
    """Hooks registered for every module, by the code they run: a hook of new code is an edit, while a tool that
    registers the same hook again on entry (torch's ``FlopCounterMode`` and profiler's module tracker: a new handle,
    the same method) changes nothing the model computes."""
    return tuple(id(getattr(getattr(hook, "__func__", hook), "__code__", hook)) for hook in hooks.values())


def _roots(model: Any) -> list:
    """The modules a callable runs: itself, a bound method's owner, the modules its closure holds."""
    if isinstance(model, nn.Module):
        return [model]
    found = [getattr(model, "__self__", None)]
    found += [cell.cell_contents for cell in (getattr(model, "__closure__", None) or ())
              if _filled(cell)]
    return [m for m in found if isinstance(m, nn.Module)]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _config_values(config) -> tuple:
    state = vars(config)
    out = tuple(_frozen(state.get(key)) for key in CONFIG_KEYS)
    impl = state.get("_attn_implementation_internal")
    for sub in ("text_config", "decoder"):  # a composite model's text part
        if sub in state and state[sub] is not None and hasattr(state[sub], "__dict__"):
            out += _config_values(state[sub])
    return out + (_registered(impl),)


def _registered(impl) -> int:
    """Identity of the function transformers would call for attention implementation ``impl`` (0: none)."""
    transformers = sys.modules.get("transformers.modeling_utils")
    if transformers is None or not isinstance(impl, str):
        return 0
    functions = getattr(transformers, "ALL_ATTENTION_FUNCTIONS", None)
    try:
        return id(functions[impl]) if functions is not None and impl in functions else 0
    except (KeyError, TypeError):
        return 0


def _frozen(value) -> Any:
    """A comparable copy of ``value``: lists and dicts (mutable in place) become tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return (type(value).__name__, id(value))
