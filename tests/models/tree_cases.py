"""Rollout-tree cases, run in one process (tests/models/test_tree_models.py, C = 1) and on every spawned
rank (tests/multiprocess/test_tree_models_multiprocess.py, C = 2 and 4, gloo).

Each case runs ``PackedForward(...)(ids, L, parent=, branch_at=)`` around an adapter (every shared prefix
of the tree packed once) and compares it with every rollout run alone through the model's own unpacked
path: logits and parameter gradients (:func:`tests.models.shared_prefix_cases.check_shared_equivalence`).
"""

from __future__ import annotations

import torch

from nn_data.groups import context_parallel_info
from tests.models import shared_prefix_cases as shared
from tests.models.adapter_cases import VOCAB
from tests.support.tree_reference import Tree, nodes

SEQ_LEN = shared.SEQ_LEN

#: Trees of depth 1 to 4: a chain, branches at several turns of one rollout (a rollout split twice), a
#: child sharing all of its parent's tokens, an empty rollout, a forest of two trees.
TREES = (
    Tree([8, 5, 11], [-1, 0, 0], [0, 5, 5]),  # depth 1 (the shared prompt)
    Tree([12, 14, 10], [-1, 0, 1], [0, 5, 8]),  # depth 3 chain
    Tree([9, 13, 15, 16, 6], [-1, 0, 1, 2, 0], [0, 4, 9, 13, 2]),  # depth 4, rollout 0 split at 2 and 4
    Tree([16, 10, 12, 8, 5, 0], [-1, 0, 0, -1, 3, -1], [0, 3, 7, 0, 5, 0]),  # a forest, a fully shared child
)


def tree_ids(tree: Tree, gen: torch.Generator, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """``[B, S]``: random tokens, each rollout's first ``branch_at`` its parent's; 0 past ``L``."""
    ids = torch.randint(1, VOCAB, (len(tree.lengths), seq_len), generator=gen)
    for b, (p, a) in enumerate(zip(tree.parent, tree.branch_at)):
        if p >= 0:
            ids[b, :a] = ids[p, :a]
    return torch.where(torch.arange(seq_len) < torch.tensor(tree.lengths)[:, None], ids, 0)


def tree_total(tree: Tree, multiple: int) -> int:
    """A fixed ``T``: every node rounded up to ``multiple``, plus two more."""
    capacity = max(3 * len(tree.lengths) - 2, 2 * len(tree.lengths))
    return sum(-(-(hi - lo) // multiple) * multiple for _, lo, hi in nodes(tree, capacity)) + 2 * multiple


def tree_batches(multiple: int, trees=TREES):
    gen = torch.Generator().manual_seed(3)
    for tree in trees:
        call = dict(parent=torch.tensor(tree.parent), branch_at=torch.tensor(tree.branch_at))
        yield tree_ids(tree, gen), torch.tensor(tree.lengths), call, tree_total(tree, multiple)


def case_hf(kind: str = "llama", exact_norms: bool = True) -> dict:
    """HFCausalLMAdapter on a tiny ``kind`` model (float64, dense mask), trees, against each rollout alone."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model

    cp = context_parallel_info()
    model = tiny_hf_model(kind, dtype=torch.float64, moe=False)
    with shared.norms_in_model_dtype(model) if exact_norms else shared.contextlib.nullcontext():
        return shared.check_shared_equivalence(lambda m: HFCausalLMAdapter(m, mask_kind="dense"), model,
                                               lambda ids: model(input_ids=ids, use_cache=False).logits, cp,
                                               batches=tree_batches(2 * cp.size))


def case_hf_flex_forward() -> dict:
    """The tiny Llama (float32) with ``mask_kind="block"`` (flex attention's mask_mod with the path rule;
    forward only on a CPU) under this rank's CP group, no grad: the largest difference from each rollout alone."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.packed_forward import PackedForward

    cp = context_parallel_info()
    model = tiny_hf_model("llama")
    worst = 0.0
    with torch.no_grad():
        for ids, lens, call, total in tree_batches(2 * cp.size, TREES[1:3]):
            wrapped = PackedForward(HFCausalLMAdapter(model, mask_kind="block"), pad_full_seq_to=total,
                                    pad_individual_seqs_to_multiple_of=2 * cp.size, cp_group=cp.group)
            out = wrapped(ids, lens, **call)
            for b, n in enumerate(lens.tolist()):
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                worst = max(worst, float((out[b, :n] - alone).abs().max()))
    return dict(worst=worst)


def case_megatron() -> dict:
    """MegatronGPTAdapter on the tiny GPTModel (float64), trees, against each rollout through megatron-core's
    stock unpacked path."""
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    cp = context_parallel_info()
    model = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64))
    return shared.check_shared_equivalence(MegatronGPTAdapter, model, lambda ids: forward_alone(model, ids), cp,
                                           batches=tree_batches(2 * cp.size), make_packed_seq_params=True)
