"""What :class:`~nn_data.adapters.HFCausalLMAdapter` keeps exact, as explicit lists; everything else refused.

Each road by which shape reaches a layer's attention (the attention call's keywords, the module's attributes,
the config, the ``attention_mask``, the rotary module, the position embeddings) either leads to nn_data's
document mask or refuses the model with a :class:`~nn_data.errors.PackingError` naming the model type, the
layer, the reason and what to do: attention variants (:func:`check_model`, when the adapter is built), each
layer's window (:func:`layer_window`, :func:`call_window`), attention keywords (:func:`check_call`, every
call: :data:`ATTENTION_KWARGS`, :data:`UNSUPPORTED`), mask kinds, rotary types (:data:`ROPE_TYPES`;
``longrope`` within its original length, :func:`check_longrope`), learned positions with a padding index, and
layer kinds (:mod:`nn_data.adapters.hf_layers`). The lists: docs/models.md, "Wrapping your model" (its
"Every family" paragraph)."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import NamedTuple, Optional

import torch
from torch import nn

from nn_data.errors import PackingError

#: Attention-call keywords the packed attention function accepts: nn_data's own boundaries, what it
#: applies (``sliding_window``, ``dropout``, ``scaling``, ``is_causal=True``), and what cannot change
#: attention (positions already applied by the rotary embedding, output flags, cache bookkeeping).
ATTENTION_KWARGS = frozenset({
    "dropout", "scaling", "sliding_window", "is_causal", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "seq_idx", "output_attentions", "output_hidden_states", "use_cache",
    "cache_position", "return_dict", "layer_idx", "head_mask", "output_router_logits",
})
#: ``config.use_bidirectional_attention`` values that leave a text-only model causal ("vision": image tokens only).
CAUSAL_SWITCHES = (None, False, "vision")
#: Attention features nn_data's mask does not apply: refused when a call sets them.
UNSUPPORTED = {"softcap": "soft-capped attention scores", "s_aux": "attention sinks", "sinks": "attention sinks",
               "position_bias": "a position bias added to the scores"}
#: Attention implementations the adapter replaces by its packed attention (or, without CP, keeps: flash).
ATTENTION_IMPLEMENTATIONS = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                                       "flash_attention_4"})
#: Rotary types whose frequencies are fixed when the model is built (``longrope``: see the module docstring).
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional", "longrope"})
#: What the source of an attention module's class holds when it calls transformers' attention interface.
INTERFACE_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "get_interface")
_LAYER_ATTR = "_nn_data_layer"  # a LayerInfo set on each attention module when the adapter is built


class LayerInfo(NamedTuple):
    """What :func:`check_model` found for one attention module: the model type, the module's name and its window."""

    model_type: str
    name: str
    window: Optional[int]


def _refuse(model_type: str, layer: str, reason: str, todo: str) -> PackingError:
    return PackingError(f"model_type={model_type!r}: layer {layer!r}: {reason}; {todo}")


def attention_modules(model: nn.Module) -> list:
    """``(name, module)`` of every attention module (class name ending in ``Attention``, not inside another)."""
    from nn_data.adapters.hf_layers import MIXERS

    named = dict(model.named_modules())
    out = []
    for name, module in named.items():
        cls = type(module).__name__
        if not cls.endswith("Attention") or cls in MIXERS:
            continue
        parts = name.split(".")
        if any(type(named[".".join(parts[:i])]).__name__.endswith("Attention") for i in range(1, len(parts))):
            continue
        out.append((name, module))
    return out


def layer_window(module: nn.Module, config) -> Optional[int]:
    """The sliding window a transformers attention layer applies (None: full attention): the module's
    ``sliding_window`` attribute where it has one, else its ``config.layer_types`` entry, else
    ``config.sliding_window`` (models with no layer types window every layer: Mistral, PhiMoE)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if types:
        return window if index is not None and index < len(types) and types[index] == "sliding_attention" else None
    return window


def check_model(model: nn.Module, model_type: str) -> Optional[int]:
    """The build-time checks (see the module docstring); returns the one sliding window of the model's
    layers (None: none) and marks each attention module with its own window for :func:`call_window`."""
    config = model.config
    _check_attention_function(model, model_type)
    _check_position_bias(model, model_type)
    _check_rotary(model, model_type)
    _check_positions(model, model_type)
    bidirectional = getattr(config, "use_bidirectional_attention", None) not in CAUSAL_SWITCHES
    if bidirectional or getattr(config, "is_causal", True) is False:
        raise _refuse(model_type, "(config)", "attention is not causal (use_bidirectional_attention / is_causal in "
                      "the config): nn_data's document mask is causal", "build the model causal, or run it unpacked")
    windows = {}
    for name, module in attention_modules(model):
        if getattr(module, "is_causal", True) is False:
            raise _refuse(model_type, name, f"{type(module).__name__}.is_causal is False: attention is not causal, "
                          "and nn_data's document mask is", "build the model causal (a decoder), or run it unpacked")
        if not any(_calls_interface(type(m)) for m in module.modules()):
            raise _refuse(model_type, name, f"{type(module).__name__} does not call transformers' attention interface, "
                          "so it would never see nn_data's document mask", "run its sequences unpacked")
        window = layer_window(module, config)
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise _refuse(model_type, name, f"sliding_window={window!r} is not a positive int", "run it unpacked")
        module.__dict__[_LAYER_ATTR] = LayerInfo(model_type, name, window)
        if window is not None:
            windows[name] = window
    if len(set(windows.values())) > 1:
        raise _refuse(model_type, ", ".join(windows), f"sliding windows {sorted(set(windows.values()))} differ "
                      "between layers; nn_data's mask applies one window", "run it unpacked")
    return next(iter(windows.values()), None)


@functools.lru_cache(maxsize=None)
def _calls_interface(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            return True  # no source to read (built at run time): the first call's count decides
        if any(marker in source for marker in INTERFACE_MARKERS):
            return True
    return False


def _check_attention_function(model: nn.Module, model_type: str) -> None:
    """The selected attention implementation is one of :data:`ATTENTION_IMPLEMENTATIONS`, with transformers'
    own function registered under its name: the adapter replaces it by its packed attention, which
    computes what those compute (softmax attention under the mask), and nothing else."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl is None:
        return
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise _refuse(model_type, "(config._attn_implementation)", f"attention implementation {impl!r} is not one "
                      f"nn_data routes through ({sorted(ATTENTION_IMPLEMENTATIONS)}): packed, the adapter would replace "
                      "it by its own attention function, which computes standard softmax attention, not this one",
                      "select one of those (attn_implementation=) if it computes standard attention, or run the "
                      "model unpacked")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS[impl] if impl in ALL_ATTENTION_FUNCTIONS else None
    if function is not None and not str(getattr(function, "__module__", "")).startswith("transformers."):
        raise _refuse(model_type, "(config._attn_implementation)", f"the function registered under {impl!r} "
                      f"({getattr(function, '__qualname__', function)!r} from {function.__module__!r}) is not "
                      "transformers' own: packed, the adapter would replace it by its own attention function",
                      f"register nothing under {impl!r}, or run the model unpacked")


def _check_position_bias(model: nn.Module, model_type: str) -> None:
    """ALiBi (or any bias added by position) is not in nn_data's mask: refused."""
    config = model.config
    flags = [getattr(config, name, None) for name in ("alibi", "use_alibi")]
    flags.append(getattr(getattr(config, "attn_config", None), "alibi", None))
    flags.append(getattr(config, "position_embedding_type", None) == "alibi" or None)
    flagged = any(f is True for f in flags)
    if not flagged and all(f is None for f in flags):  # no switch in the config: the modeling code decides
        namespace = vars(sys.modules.get(type(model).__module__, object()))
        flagged = any("alibi" in name.lower() and callable(obj) for name, obj in namespace.items())
    if flagged:
        raise _refuse(model_type, "(all)", "ALiBi adds a position bias to the attention scores, which nn_data's "
                      "document mask does not carry", "use a rotary model, or run it unpacked")


def _check_rotary(model: nn.Module, model_type: str) -> None:
    """Every rotary module's type is in :data:`ROPE_TYPES` (``longrope`` only below its original length)."""
    config = model.config
    for name, module in model.named_modules():
        rope = getattr(module, "rope_type", None)
        kinds = rope.values() if isinstance(rope, dict) else [rope]
        for kind in kinds:
            if not isinstance(kind, str):
                continue
            if kind not in ROPE_TYPES or (kind == "longrope" and _longrope_switches(config)):
                raise _refuse(model_type, name, f"rotary type {kind!r} computes its frequencies from the batch's "
                              "longest position (all sequences of a pack together), not per sequence", "use a "
                              f"rotary type of {sorted(ROPE_TYPES - {'longrope'})}, longrope with "
                              "max_position_embeddings <= original_max_position_embeddings, or run it unpacked")


def longrope_limit(model: nn.Module) -> Optional[tuple]:
    """``(name, original length)`` of the model's ``longrope`` rotary module with the shortest original
    length (None: no longrope): a call whose rows can hold a longer sequence is refused
    (:func:`check_longrope`)."""
    found = []
    for name, module in model.named_modules():
        rope = getattr(module, "rope_type", None)
        kinds = rope if isinstance(rope, dict) else {None: rope}
        for layer_type, kind in kinds.items():
            if kind != "longrope":
                continue
            params = getattr(getattr(module, "config", model.config), "rope_parameters", None) or {}
            params = params.get(layer_type, params) if layer_type is not None else params
            original = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
            found.append((name, original or getattr(model.config, "original_max_position_embeddings", None) or 0))
    return min(found, key=lambda item: item[1]) if found else None


def check_longrope(model_type: str, limit: tuple, packed) -> None:
    """transformers' ``longrope`` takes its long factors for every position of a call whose longest position
    passes the original length: refused when this microbatch's rows could hold such a sequence (the bound is
    the row length ``S`` and the longest padded segment, Python ints: no host read)."""
    name, original = limit
    total = packed.segment_ids.shape[0]
    bounds = [b for b in (packed.bounds.max_length, packed.bounds.row_len) if b is not None]
    longest = min(bounds) if bounds else total
    if longest > original:
        raise _refuse(model_type, name, f"rotary type 'longrope' switches every position of a call to its long "
                      f"factors once the call's longest position passes original_max_position_embeddings={original}, "
                      f"and this microbatch's rows can hold sequences of {longest} tokens (one long sequence would "
                      "change every other sequence packed with it)", f"pack sequences of at most {original} tokens "
                      f"(rows of at most {original}), or run it unpacked")


def _longrope_switches(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    original = original or getattr(config, "original_max_position_embeddings", None)
    return original is None or getattr(config, "max_position_embeddings", 0) > original


def _check_positions(model: nn.Module, model_type: str) -> None:
    """Learned position embeddings with a padding index count from it, not from the position ids' 0."""
    for name, module in model.named_modules():
        positional = "position" in name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and positional and module.padding_idx is not None:
            raise _refuse(model_type, name, f"learned positions with padding_idx={module.padding_idx}: the model "
                          "numbers a sequence's positions from it, not from 0 as the packed position ids do",
                          "run it unpacked")


def layer_info(module: nn.Module) -> Optional[LayerInfo]:
    """The :class:`LayerInfo` :func:`check_model` set on an attention module (None: not one it saw)."""
    return module.__dict__.get(_LAYER_ATTR)




def where(module: nn.Module) -> str:
    """``model_type='...': layer '...' (Class)`` for a call-time refusal."""
    info = layer_info(module)
    model_type = info.model_type if info else getattr(getattr(module, "config", None), "model_type", "?")
    name = f"{info.name!r} " if info else ""
    return f"model_type={model_type!r}: layer {name}({type(module).__name__})"


def call_window(module: nn.Module, kwargs: dict) -> Optional[int]:
    """The window this attention call applies: the layer's own (:func:`check_model`), whatever the call
    passes; a call passing another window is refused."""
    passed = kwargs.get("sliding_window")
    info = layer_info(module)
    if info is None or passed is None or info.window == passed:
        return passed if info is None or info.window is None else info.window
    if info.window is None:
        return passed  # the call windows a layer the config did not: the call's window applies
    raise PackingError(f"{where(module)} attends with sliding_window={passed!r}, but its layer's window is "
                       f"{info.window!r} (module.sliding_window / config); they must agree: set one window in the "
                       "config (PackedForward reads it again on its next call), or run it unpacked")


def check_call(module: nn.Module, attention_mask, kwargs: dict) -> None:
    """The attention call's keywords and mask are within the lists (see the module docstring); reads
    only Python-level metadata (no device value), on every call, compiled or not."""
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise PackingError(f"{where(module)}: {name}={_describe(kwargs[name])}: nn_data's packed attention "
                               f"supports causal attention with an optional sliding window only ({what} are not); "
                               "build the model without it, or run it unpacked")
    for name, value in kwargs.items():
        if name not in ATTENTION_KWARGS and name not in UNSUPPORTED and value is not None:
            raise PackingError(f"{where(module)} attends with keyword {name}={_describe(value)}, which is not in "
                               "nn_data's list of what keeps attention exact (hf_support.ATTENTION_KWARGS); run this "
                               "model unpacked")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise PackingError(f"{where(module)}: attention is not causal (is_causal=False), and nn_data's document "
                           "mask is; run this model unpacked")
    if attention_mask is not None and not _is_placeholder(attention_mask):
        raise PackingError(f"{where(module)} attends with its own attention mask ({_describe(attention_mask)}, "
                           f"{attention_mask.dtype}) instead of the adapter's: a mask the model computes from its "
                           "inputs (a dynamic mask) is not nn_data's document mask; run this model unpacked")


def _is_placeholder(mask) -> bool:
    """The adapter's 4-D placeholder, or a view of it: a broadcast bool (every stride 0; while compiling,
    where a traced view does not keep its strides, a bool: a model's own mask is an additive float one)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return False
    return torch.compiler.is_compiling() or all(s == 0 for s in mask.stride())


def _describe(value) -> str:
    return f"<tensor {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)
