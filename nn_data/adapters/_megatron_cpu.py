"""The ONLY place nn_data patches megatron-core: what a CPU-only torch needs to run a ``GPTModel`` and the
pipeline schedules. Applied only where torch cannot use CUDA, for the releases in :data:`SUPPORTED_RELEASES`
(each tested); another release raises (:func:`unsupported_reason`) instead of being patched blindly.

Five megatron-core modules that allocate on or synchronise CUDA get their own ``torch`` name bound to
:class:`_TorchOnCpu` (``cuda.current_device()`` is the CPU, ``cuda.synchronize()`` does nothing,
``device="cuda"`` means the CPU); 0.16's ``moe_utils.te_general_gemm`` is bound to ``None``; the model-parallel
RNG tracker is megatron-core's own inference tracker. Nothing global changes. Each spot and why:
docs/models.md, "megatron-core on a CPU: what nn_data patches"."""

from __future__ import annotations

import importlib
import types

import torch

#: The megatron-core release series the patches are tested on: 0.16.x (Python 3.11, the main
#: test job) and 0.19.x (Python 3.12 and 3.13, the newest and NeMo-RL jobs: scripts/test_job.sh). The spots
#: above are the same in both.
SUPPORTED_RELEASES = ("0.16.", "0.19.")

_PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.moe.router",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand")


def needs_cpu_patches() -> bool:
    """True when this torch cannot use CUDA (a CPU-only build, or no GPU): megatron-core then
    needs :func:`apply_cpu_patches`."""
    return not torch.cuda.is_available()


class _CudaOnCpu:
    """``torch.cuda`` as the patched modules see it: the current device is the CPU."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*_args, **_kwargs) -> None:
        return None  # CPU work is synchronous

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return factory


class _TorchOnCpu(types.ModuleType):
    """The real ``torch`` with CUDA placement mapped to the CPU (module docstring)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_SHIM = _TorchOnCpu()


def megatron_version() -> str:
    """The installed megatron-core's version, e.g. ``"0.19.2"``: from its distribution metadata
    (no import of megatron-core), else from ``megatron.core.package_info``."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        from megatron.core import package_info

        return package_info.__shortversion__


def unsupported_reason() -> "str | None":
    """None when megatron-core can run here (torch can use CUDA, or the installed release is in
    :data:`SUPPORTED_RELEASES`), else the message :func:`apply_cpu_patches` raises."""
    if not needs_cpu_patches():
        return None
    version = megatron_version()
    if version.startswith(SUPPORTED_RELEASES):
        return None
    series = [f"{r}x" for r in SUPPORTED_RELEASES]
    tested = " and ".join([", ".join(series[:-1]), series[-1]] if len(series) > 1 else series)
    return (f"megatron-core {version} on a CPU-only torch: nn_data's CPU patches (nn_data/adapters/_megatron_cpu.py) "
            f"are tested on megatron-core {tested} only; run on a GPU or install megatron-core==0.16.1 "
            "(Python 3.11) or 0.19.2 (Python 3.12 or newer)")


def apply_cpu_patches() -> bool:
    """Patch megatron-core for a CPU-only torch (module docstring), idempotently: True when the patches are in place,
    False when torch can use CUDA (nothing patched). Raises ``RuntimeError`` on a CPU-only torch with a release not
    in :data:`SUPPORTED_RELEASES`, naming the installed version (:func:`unsupported_reason`)."""
    if not needs_cpu_patches():
        return False
    reason = unsupported_reason()
    if reason is not None:
        raise RuntimeError(reason)
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        if module.torch is not _SHIM:
            module.torch = _SHIM
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.x without TransformerEngine
        moe_utils.te_general_gemm = None
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is None or not getattr(tracker, "is_inference_rng_tracker", False):
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True
