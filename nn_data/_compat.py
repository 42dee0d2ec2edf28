"""What differs between the torch and transformers releases nn_data supports (pyproject.toml's ranges, each
end tested in CI: docs/testing.md, "The CI jobs"). Every branch on a release lives here, the release named.

* **transformers 5.6** (NeMo-RL's pin; 5.24 and 5.25 have neither method): the hybrid models' forward asks
  ``torch.all(attention_mask == 1)`` of the mask it is handed (Qwen3-Next's ``_update_linear_attn_mask``,
  Bamba's ``_update_mamba_mask``) to decide whether the recurrent layers zero padded positions: a host read
  (``__bool__``; ``Tensor.item()`` on meta tensors). nn_data hands transformers a placeholder, one True
  broadcast to ``[1, 1, Tq, T]`` (the adapter's ``_as_4d``), and masks attention through its own keyword, so the
  answer is known without a read: no mask for the recurrent layers, as on the later releases.
* **transformers 5.6** has no module-level chunked SSD (``mamba2_chunk_scan``, later releases' Mamba-2 and
  Bamba modules): its scan is written inside the mixer's ``torch_forward``, and the module holds mamba-ssm's
  ``mamba_chunk_scan_combined`` (the same call) only where that kernel loads. :func:`ssd_chunk_scan` answers
  the module's function where it has one, else the kernel, else :func:`_ssd_one_chunk` (the torch scan for
  the tree's chunk rows, one chunk each, on the module's own ``segment_sum``).
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


def ssd_chunk_scan(module):
    """The chunked SSD of a Mamba-2 family's ``module``, called as ``scan(x, dt, A, B, C, chunk_size=c,
    D=None, return_final_states=True)`` on rows of one chunk each (module docstring)."""
    scan = getattr(module, "mamba2_chunk_scan", None) or getattr(module, "mamba_chunk_scan_combined", None)
    if scan is not None:
        return scan

    def one_chunk(x, dt, A, B, C, chunk_size, D=None, return_final_states=True):
        if D is not None or not return_final_states:
            raise ValueError("the torch one-chunk scan takes D=None and return_final_states=True")
        return _ssd_one_chunk(module.segment_sum, x, dt, A, B, C, chunk_size)

    return one_chunk


def _ssd_one_chunk(segment_sum, x, dt, A, B, C, chunk_size):
    """The SSD of rows of one chunk each from a zero state: ``x [Nc, c, H, P]``, ``dt [Nc, c, H]``, ``A [H]``,
    ``B, C [Nc, c, G, N]`` -> ``y [Nc, c, H, P]``, final state ``[Nc, H, P, N]`` (float32, as the later
    releases' function). ``y_l = sum_{s<=l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s`` with ``a = A dt``;
    the final state ``sum_s exp(a_{s+1} + ... + a_c) dt_s x_s B_s^T``."""
    if x.shape[1] != chunk_size:
        raise ValueError(f"rows of {x.shape[1]} slots, chunk_size {chunk_size}: the scan takes one chunk a row")
    heads, groups = x.shape[2], B.shape[2]
    B, C = (t.float().repeat_interleave(heads // groups, dim=2, output_size=heads) for t in (B, C))  # [Nc, c, H, N]
    x = x.float() * dt.float()[..., None]  # [Nc, c, H, P]
    log_a = (A.float() * dt.float()).transpose(1, 2)  # [Nc, H, c]
    decay = segment_sum(log_a).exp()  # [Nc, H, c(l), c(s)]: 0 above the diagonal
    weights = torch.einsum("nlhk,nshk->nhls", C, B) * decay  # [Nc, H, c(l), c(s)]
    y = torch.einsum("nhls,nshp->nlhp", weights, x)  # [Nc, c, H, P]
    cum = log_a.cumsum(-1)  # [Nc, H, c]
    to_end = (cum[..., -1:] - cum).exp()  # [Nc, H, c]
    final = torch.einsum("nhs,nshk,nshp->nhpk", to_end, B, x)  # [Nc, H, P, N]
    return y, final


def flex_on_cpu() -> bool:
    """Whether this torch runs compiled flex attention on the CPU (torch >= :data:`FLEX_CPU_TORCH`; module
    docstring)."""
    return torch.__version__ >= FLEX_CPU_TORCH  # TorchVersion compares by release: "2.11.0+cu130" < "2.13"
