"""Which layers of a transformers model mix tokens, and how each keeps packed sequences apart: **attention**
through transformers' attention interface (nn_data's document mask, or flash-attention's varlen kernel); a
**recognised non-attention mixer** (:data:`MIXERS`: one sequence per row, :mod:`nn_data.adapters.hf_mixers`,
or the GPU kernels given the boundaries); anything else **refused** with a :class:`PackingError` naming the
model type, the layer and what would make it work. Detection reads the module classes and
``config.layer_types``."""

from __future__ import annotations

import importlib.util
import re
from typing import NamedTuple, Optional

from torch import nn

from nn_data.errors import PackingError


class MixerKind(NamedTuple):
    """A family of non-attention token mixers: what it is, the import names of the kernels that honour
    packed boundaries for it (all needed), and their pip names."""

    family: str
    modules: tuple
    install: str


GATED_DELTA_NET = MixerKind("gated delta net (linear attention)", ("fla", "causal_conv1d"),
                            "flash-linear-attention and causal-conv1d")
MAMBA2 = MixerKind("Mamba-2 state-space mixer", ("mamba_ssm", "causal_conv1d"), "mamba-ssm and causal-conv1d")
SHORT_CONV = MixerKind("short causal convolution", ("causal_conv1d",), "causal-conv1d")

#: The non-attention mixers nn_data runs per sequence, by class name: each one's ``forward(hidden_states
#: [B, L, D], cache=None, attention_mask=None, **kwargs) -> [B, L, D]`` is causal and treats batch rows
#: independently, which is what running one sequence per row needs; each family is tested packed
#: against alone (tests/models/test_hf_hybrids.py).
MIXERS = {
    "Qwen3NextGatedDeltaNet": GATED_DELTA_NET,
    "Qwen3_5GatedDeltaNet": GATED_DELTA_NET,
    "Mamba2Mixer": MAMBA2,
    "BambaMixer": MAMBA2,
    "Lfm2ShortConv": SHORT_CONV,
}

#: ``config.layer_types`` values that are attention nn_data's mask handles.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
# Class names that suggest a token mixer nn_data does not know (checked only outside recognised mixers).
_SUSPECT = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|LinearAttention|Lightning|Recurrent|Rwkv|RWKV|Xlstm|xLSTM"
                      r"|Retention|Hyena|Ssm|SSM|Kda|KDA|Rglru|RgLru")
_NOT_MIXERS = re.compile(r"Norm|Embedding|MLP|Mlp|Experts|Router|Gate|Rotary|Cache|Model$|ForCausalLM$|Block$"
                         r"|DecoderLayer$|Layer$")


class LayerReport(NamedTuple):
    """What :func:`inspect_model` found: the model type, the recognised mixers ``(name, module, kind)``,
    the number of attention modules, and the sliding window of its sliding layers (None: none)."""

    model_type: str
    mixers: tuple
    attention_layers: int
    window: Optional[int]


def inspect_model(model: nn.Module) -> LayerReport:
    """Classify every token-mixing layer of ``model``; raises :class:`PackingError` for one nn_data
    cannot keep packed sequences apart in (see the module docstring)."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    named = dict(model.named_modules())
    mixers = tuple((name, m, MIXERS[type(m).__name__]) for name, m in named.items() if type(m).__name__ in MIXERS)
    inside = [name for name, _, _ in mixers]
    for name, module in named.items():
        if any(_related(name, other) for other in inside):
            continue
        cls = type(module).__name__
        if isinstance(module, nn.Conv1d) or (_SUSPECT.search(cls) and not _NOT_MIXERS.search(cls)):
            owner = name.rsplit(".", 1)[0] if isinstance(module, nn.Conv1d) and "." in name else name
            raise PackingError(
                f"model_type={model_type!r}: layer {owner!r} ({type(named.get(owner, module)).__name__}) mixes tokens "
                "in a way nn_data cannot keep packed sequences apart in (not a layer it knows: "
                f"{', '.join(sorted(MIXERS))}); run its sequences unpacked")
    _check_layer_types(config, model_type, inside)
    attention = sum(1 for name, m in named.items() if type(m).__name__.endswith("Attention")
                    and type(m).__name__ not in MIXERS and not _within_attention(name, named))
    return LayerReport(model_type, mixers, attention, _sliding_window(config))


def _related(name: str, other: str) -> bool:
    """``name`` is ``other``, inside it, or holds it (the decoder layer around a mixer)."""
    return name == other or name.startswith(other + ".") or other.startswith(name + ".") or name == ""


def _within_attention(name: str, named: dict) -> bool:
    parts = name.split(".")
    return any(type(named[".".join(parts[:i])]).__name__.endswith("Attention") for i in range(1, len(parts)))


def _check_layer_types(config, model_type: str, mixer_names: list) -> None:
    """Each ``config.layer_types`` entry is attention nn_data handles, or its layer holds a recognised mixer."""
    types = getattr(config, "layer_types", None) or ()
    for i, kind in enumerate(types):
        if kind in ATTENTION_LAYER_TYPES:
            continue
        if any(re.search(rf"(^|\.)layers\.{i}(\.|$)", name) for name in mixer_names):
            continue
        raise PackingError(
            f"model_type={model_type!r}: layer {i} has layer type {kind!r}, which nn_data's packed attention does "
            f"not handle (it handles {sorted(ATTENTION_LAYER_TYPES)} and the mixers {sorted(MIXERS)}); run its "
            "sequences unpacked")


def _sliding_window(config) -> Optional[int]:
    """The window of the sliding-attention layers: ``config.sliding_window`` when a layer type says
    ``sliding_attention``, or when the config has no layer types and sets one (Mistral)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(window, int) or isinstance(window, bool):
        return None
    if types is None or "sliding_attention" in types:
        return window
    return None


def kernels_importable(kind: MixerKind) -> bool:
    """Whether every kernel package that honours packed boundaries for ``kind`` is importable."""
    return all(importlib.util.find_spec(name) is not None for name in kind.modules)


MIXER_PATHS = ("auto", "per_sequence", "kernels")


def mixer_path(report: LayerReport, mode: str, device_type: str) -> str:
    """``"per_sequence"`` or ``"kernels"`` (the installed kernels get the boundaries) for ``mode`` in
    :data:`MIXER_PATHS`: ``"auto"`` takes the kernels when every mixer's are importable and the model is on CUDA;
    ``"kernels"`` raises :class:`PackingError` naming the layer and what to install otherwise."""
    if mode not in MIXER_PATHS:
        raise PackingError(f"mixers={mode!r} is invalid; expected one of {MIXER_PATHS}")
    if not report.mixers or mode == "per_sequence":
        return "per_sequence"
    missing = [(name, kind) for name, _, kind in report.mixers if not kernels_importable(kind)]
    if mode == "auto":
        return "kernels" if not missing and device_type == "cuda" else "per_sequence"
    if missing:
        name, kind = missing[0]
        raise PackingError(
            f"mixers='kernels': model_type={report.model_type!r}, layer {name!r} ({kind.family}) keeps packed "
            f"sequences apart only with {kind.install} installed (import names {', '.join(kind.modules)}); "
            "install them, or use mixers='per_sequence' (nn_data runs it one sequence per row)")
    if device_type != "cuda":
        raise PackingError(f"mixers='kernels' needs the model on CUDA (it is on {device_type}); use "
                           "mixers='per_sequence' or 'auto'")
    return "kernels"
