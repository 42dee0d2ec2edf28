"""Tier: pure CPU, single process (stand-in modules, no transformers model).

nn_data._compat, what differs between the supported releases: transformers 5.6's recurrent-mask methods answer
the HF adapter's placeholder mask without a host read and hand any other mask to the model's own method. (On 5.6
itself: tests/models/test_hf_hybrids.py's meta-tensor and host-sync tests, in the NeMo-RL CI job.)
"""

from __future__ import annotations

import torch
from torch import nn

from nn_data._compat import quiet_recurrent_masks


class _Hybrid(nn.Module):
    """transformers 5.6's shape of the method: a host read of the mask."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def _update_linear_attn_mask(self, attention_mask, past_key_values):
        self.reads += 1
        return None if bool(torch.all(attention_mask == 1)) else attention_mask


def test_the_placeholder_is_answered_without_a_read_and_any_other_mask_goes_to_the_model():
    outer = nn.Sequential(_Hybrid())
    quiet_recurrent_masks(outer)
    quiet_recurrent_masks(outer)  # idempotent: one wrapper
    hybrid = outer[0]
    placeholder = torch.ones((), dtype=torch.bool, device="meta").expand(1, 1, 6, 9)  # no value to read
    assert hybrid._update_linear_attn_mask(placeholder, None) is None and hybrid.reads == 0
    padding = torch.tensor([[0, 1, 1]])
    assert hybrid._update_linear_attn_mask(padding, None) is padding and hybrid.reads == 1
    assert hybrid._update_linear_attn_mask(torch.ones(1, 3), None) is None and hybrid.reads == 2
    assert "_update_linear_attn_mask" not in vars(_Hybrid())  # the class is untouched


def test_a_model_without_the_methods_is_left_as_it_is():
    model = nn.Sequential(nn.Linear(2, 2))
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    quiet_recurrent_masks(model)
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before
