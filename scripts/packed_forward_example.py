"""Run a small causal LM on packed (and, with --cp, context-parallel) tokens with
nn_data.PackedForward, and compare every sequence with running it alone.

    python -m scripts.packed_forward_example                      # nn_data's TinyCausalLM, one process
    python -m scripts.packed_forward_example --cp 2               # two ranks over gloo on 127.0.0.1
    python -m scripts.packed_forward_example --model hf           # a tiny transformers Llama (--hf-kind qwen3_next, ...)
    python -m scripts.packed_forward_example --model megatron --cp 2   # a tiny megatron-core GPTModel

(Run from the repository root.) ``--model hf`` wraps a transformers causal LM built from a config
(nothing is downloaded) in ``nn_data.adapters.HFCausalLMAdapter``; ``--model megatron`` a
megatron-core ``GPTModel`` built with ``nn_data.adapters.megatron_gpt_layer_spec`` in
``MegatronGPTAdapter`` (it always runs under megatron-core's ``parallel_state``, so it spawns
``--cp`` processes, one included). "Alone" is each model's own unpacked path: TinyCausalLM's
``forward_single``, the transformers model on one sequence, megatron-core's stock attention
with a causal mask.

Prints, for each microbatch, the largest difference between the packed outputs and the
per-sequence outputs, and the time of three paths (wall clock on this machine): ``packed`` (one
``PackedForward`` with a constant ``T = pad_full_seq_to``, as a compiled or pipeline-parallel run
needs), ``fitted`` (``T`` = the microbatch's own padded tokens) and ``alone`` (each sequence by
itself). Each wrapper is built once for the stream and first called in an untimed warm-up, which
also runs its packing check (``verify``, several forwards of a small microbatch of its own: built
anew per microbatch, a wrapper would pay it on every call). ``packed`` runs all ``T`` positions,
padding included, and its attention computes every ``T x T`` score under the dense document mask
(the masked ones too), where the sequences alone compute ``sum L^2``: on the tiny CPU models that
can make it slower than ``alone``; ``fitted`` is the same packed forward without the padding. It
shows exactness, not the speed of a GPU kernel that skips masked blocks.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from nn_data.models.tiny_hf import KINDS as HF_KINDS
from nn_data.planning import Parallelism
from nn_data.testing.dist import free_port, init_gloo

MODELS = ("tiny", "hf", "megatron")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padding(args) -> tuple[int, int]:
    """``(pad_individual_seqs_to_multiple_of, pad_full_seq_to)``: ``--multiple`` rounded up to a multiple
    of the layout's ``sequence_multiple`` (``2 * cp`` under CP: every segment must split into ``2C``
    chunks), and a constant packed length that holds ``--rows`` full rows and is a multiple of it.
    Example: ``--multiple 8 --cp 3`` -> 12; ``--rows 8 --seq-len 64`` -> ``pad_full_seq_to = 8 * 72 = 576``."""
    multiple = _round_up(args.multiple, Parallelism(dp=1, cp=args.cp).sequence_multiple)
    return multiple, _round_up(args.rows * _round_up(args.seq_len, multiple), multiple)


def make_batches(args, gen: torch.Generator):
    """Microbatches ``(input_ids [B, S], seq_lengths [B])`` of random lengths, zero-length rows included."""
    for _ in range(args.microbatches):
        rows = int(torch.randint(1, args.rows + 1, (), generator=gen))
        lengths = torch.randint(0, args.seq_len + 1, (rows,), generator=gen)
        ids = torch.randint(1, args.vocab, (rows, args.seq_len), generator=gen)
        yield torch.where(torch.arange(args.seq_len) < lengths[:, None], ids, 0), lengths


def build(args):
    """``(PackedForward model, alone(ids [1, L]) -> [1, L, V], make_packed_seq_params)`` for ``--model``."""
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        from nn_data.models import TinyCausalLM

        torch.manual_seed(args.seed)
        model = TinyCausalLM(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers).to(dtype).eval()
        return model, model.forward_single, False
    if args.model == "hf":
        from nn_data.adapters import HFCausalLMAdapter
        from nn_data.models.tiny_hf import tiny_hf_model

        model = tiny_hf_model(args.hf_kind, vocab=args.vocab, hidden=args.dim, layers=args.layers, heads=args.heads,
                              kv_heads=max(1, args.heads // 2), ffn=2 * args.dim, dtype=dtype, seed=args.seed,
                              moe=dtype != torch.float64)  # Qwen3-Next's MoE refuses float64
        return HFCausalLMAdapter(model), lambda ids: model(input_ids=ids, use_cache=False).logits, False
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    config = tiny_gpt_config(layers=args.layers, hidden=args.dim, heads=args.heads, groups=max(1, args.heads // 2),
                             ffn=2 * args.dim, dtype=dtype)
    model = tiny_gpt_model(config, vocab=args.vocab, seed=args.seed).eval()
    return MegatronGPTAdapter(model), lambda ids: forward_alone(model, ids), True


def run(args, rank: int = 0, group=None) -> float:
    """Print the table (rank 0); returns the largest difference seen."""
    from nn_data.packed_forward import PackedForward

    model, alone, packed_seq_params = build(args)
    multiple, full = padding(args)
    common = dict(pad_individual_seqs_to_multiple_of=multiple, cp_group=group, make_packed_seq_params=packed_seq_params)
    wrappers = {"packed": PackedForward(model, pad_full_seq_to=full, **common),  # one T for the whole stream
                "fitted": PackedForward(model, pad_packed_seq_to_multiple_of=multiple, **common)}  # T per microbatch
    gen = torch.Generator().manual_seed(args.seed + 1)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"model {args.model} ({args.dtype}), C = {args.cp}, T = {full} (pad_full_seq_to)")
    say(f"{'mb':>3} {'rows':>4} {'tokens':>6} {'max |packed - alone|':>21} {'packed ms':>10} {'fitted ms':>10} "
        f"{'alone ms':>9}")
    overall = 0.0
    for i, (ids, lengths) in enumerate(make_batches(args, gen)):
        with torch.no_grad():
            if i == 0:  # warm-up: each wrapper's packing check, first-call allocations, gloo set-up; not timed
                for wrapped in wrappers.values():
                    wrapped(ids, lengths)
                alone(ids[:1, :1])
            outs, times = {}, {}
            for name, wrapped in wrappers.items():
                start = time.perf_counter()
                outs[name] = wrapped(ids, lengths)
                times[name] = time.perf_counter() - start
            start = time.perf_counter()
            worst = 0.0
            for b, n in enumerate(lengths.tolist()):
                if n:
                    one = alone(ids[b : b + 1, :n])[0]
                    worst = max([worst] + [(out[b, :n] - one).abs().max().item() for out in outs.values()])
            times["alone"] = time.perf_counter() - start
        overall = max(overall, worst)
        say(f"{i:>3} {len(lengths):>4} {int(lengths.sum()):>6} {worst:>21.2e} {times['packed'] * 1e3:>10.1f} "
            f"{times['fitted'] * 1e3:>10.1f} {times['alone'] * 1e3:>9.1f}")
    collectives = " ('packed' and 'fitted' include the CP collectives)" if group else ""
    say(f"packed: T = {full} positions per microbatch, padding included (one shape for the stream, as a compiled\n"
        "  or pipeline-parallel run needs); its attention computes every T x T score under the document mask")
    say("fitted: the same packed forward, T = the microbatch's own padded tokens")
    say("alone: each sequence separately" + collectives)
    return overall


def _rank_main(rank: int, args, port: int) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_gloo(rank, args.cp, port)
    parallel_state = None
    try:
        group = dist.group.WORLD
        if args.model == "megatron":  # megatron-core's rotary embedding reads the CP group from parallel_state
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(context_parallel_size=args.cp, create_gloo_process_groups=False)
            group = parallel_state.get_context_parallel_group()
        run(args, rank, group if args.cp > 1 else None)
    finally:
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="tiny", help="tiny (TinyCausalLM), hf or megatron")
    ap.add_argument("--hf-kind", choices=HF_KINDS, default="llama", help="with --model hf (hybrids too: qwen3_next, "
                    "mamba2, lfm2, ...)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks to spawn (gloo, CPU); default 1")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="most sequences per microbatch")
    ap.add_argument("--seq-len", type=int, default=64, help="row length S")
    ap.add_argument("--multiple", type=int, default=8, help="pad_individual_seqs_to_multiple_of (rounded up to a multiple of 2*cp)")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for flag in ("cp", "multiple", "rows", "microbatches"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}={getattr(args, flag)} is invalid; expected an int >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cp == 1 and args.model != "megatron":
        run(args)
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(args, free_port()), nprocs=args.cp, join=True)


if __name__ == "__main__":
    main()
