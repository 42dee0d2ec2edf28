"""What differs between the torch and transformers releases nn_data supports (pyproject.toml's ranges, each
end tested in CI: docs/testing.md, "The CI jobs"). Every branch on a release lives here, the release named.

* **transformers 5.6** (NeMo-RL's pin; 5.24 and 5.25 have neither method): the hybrid models' forward asks
  ``torch.all(attention_mask == 1)`` of the mask it is handed (Qwen3-Next's ``_update_linear_attn_mask``,
  Bamba's ``_update_mamba_mask``) to decide whether the recurrent layers zero padded positions: a host read
  (``__bool__``; ``Tensor.item()`` on meta tensors). nn_data hands transformers a placeholder, one True
  broadcast to ``[1, 1, Tq, T]`` (the adapter's ``_as_4d``), and masks attention through its own keyword, so the
  answer is known without a read: no mask for the recurrent layers, as on the later releases.
* **torch 2.11** (NeMo-RL's pin): inductor's compiled CPU flex-attention kernel corrupts the heap when OpenMP
  runs it on more than one thread (``malloc(): unaligned tcache chunk detected``, then ``Fatal Python error:
  Aborted``; measured with a document-causal block mask of 4 documents, T = 2820, 2 threads; one thread runs it
  exact). Flex on the CPU needs torch 2.13 (the release CI runs; 2.12 is not tested): before it,
  :func:`flex_on_cpu` is False, so ``kind="auto"`` keeps the dense mask and ``kind="block"`` on the CPU is refused
  by name (nn_data.masks.document_mask).
"""

from __future__ import annotations

import torch
from torch import nn

#: the first torch release whose compiled CPU flex attention nn_data runs (module docstring)
FLEX_CPU_TORCH = "2.13"

#: transformers 5.6's methods that read the mask on the host (module docstring)
_RECURRENT_MASK_METHODS = ("_update_linear_attn_mask", "_update_mamba_mask")


def _is_placeholder(mask) -> bool:
    """A 4-D bool mask, as the adapter's placeholder, known from its metadata alone. transformers 5.6 hands its
    recurrent layers a 2-D padding mask only (a 4-D one fails in their ``apply_mask_to_padding_states``)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool


def _without_host_read(original):
    def update(attention_mask, *args, **kwargs):
        if _is_placeholder(attention_mask):  # nn_data's: transformers would answer None after a read
            return None
        return original(attention_mask, *args, **kwargs)

    return update


def quiet_recurrent_masks(model: nn.Module) -> None:
    """On transformers 5.6, let ``model``'s recurrent-mask methods answer nn_data's placeholder mask without a
    host read (module docstring); any other mask goes to transformers' own method. Idempotent; nothing to do
    on a release without those methods."""
    for module in model.modules():
        for name in _RECURRENT_MASK_METHODS:
            if hasattr(type(module), name) and name not in vars(module):
                setattr(module, name, _without_host_read(getattr(module, name)))


def flex_on_cpu() -> bool:
    """Whether this torch runs compiled flex attention on the CPU (torch >= :data:`FLEX_CPU_TORCH`; module
    docstring)."""
    return torch.__version__ >= FLEX_CPU_TORCH  # TorchVersion compares by release: "2.11.0+cu130" < "2.13"
