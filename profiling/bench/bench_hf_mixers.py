"""What exactness costs on a CPU: a hybrid transformers model's packed forward through HFCausalLMAdapter
(its gated-delta-net / Mamba-2 / short-convolution layers run one sequence per row) against the same
packed row through transformers directly (fast, but it mixes the sequences) and one call per sequence.

    python -m profiling.bench.bench_hf_mixers                         # qwen3_next, mamba2, lfm2
    python -m profiling.bench.bench_hf_mixers --kinds lfm2 --reps 5 --total 2048

Tiny models from nn_data.models.tiny_hf (``--hidden``, ``--layers``; Qwen3-Next without its MoE),
float32, no grad, one microbatch of ``--seqs`` sequences of seeded random lengths in ``[1, --max-len]``
packed back to back (``--total``: pad the packed row to that many tokens instead; the transformers row
is never padded). The three modes run side by side, interleaved (profiling.timing); printed:
median ms, p10-p90, the ratio to the mixing packed row, and each mode's largest |logits - alone|.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from profiling.timing import machine_description, time_side_by_side

KINDS = ("qwen3_next", "mamba2", "lfm2")


def microbatch(seqs: int, max_len: int, vocab: int, seed: int = 0):
    """``(ids [B, S], lengths [B])``, seeded."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (seqs,), generator=gen)
    ids = torch.randint(1, vocab, (seqs, max_len), generator=gen)
    return torch.where(torch.arange(max_len) < lengths[:, None], ids, 0), lengths


def modes(model, ids, lengths, total: int) -> dict:
    """The three callables: ``nn_data`` (exact), ``packed_row`` (transformers on the row: mixes) and
    ``alone`` (one call per sequence); each returns the ``[n, V]`` logits of every sequence."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.packed_forward import PackedForward

    wrapped = PackedForward(HFCausalLMAdapter(model), pad_full_seq_to=total)
    ns = lengths.tolist()
    row = torch.cat([ids[b, :n] for b, n in enumerate(ns)])[None]  # [1, sum L]
    positions = torch.cat([torch.arange(n) for n in ns])[None]
    starts = [sum(ns[:b]) for b in range(len(ns))]

    def nn_data():
        out = wrapped(ids, lengths)
        return [out[b, :n] for b, n in enumerate(ns)]

    def packed_row():
        out = model(input_ids=row, position_ids=positions, use_cache=False).logits[0]
        return [out[a : a + n] for a, n in zip(starts, ns)]

    def alone():
        return [model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0] for b, n in enumerate(ns)]

    return {"nn_data": nn_data, "packed_row": packed_row, "alone": alone}


def run(kind: str, args) -> list[str]:
    from nn_data.models.tiny_hf import tiny_hf_model

    model = tiny_hf_model(kind, hidden=args.hidden, layers=args.layers, ffn=2 * args.hidden, moe=False)
    ids, lengths = microbatch(args.seqs, args.max_len, model.config.vocab_size)
    fns = modes(model, ids, lengths, args.total)
    with torch.no_grad():
        reference = fns["alone"]()
        errors = {name: max(float((a - b).abs().max()) for a, b in zip(fn(), reference)) for name, fn in fns.items()}
        timings = time_side_by_side(fns, warmup=1, reps=args.reps)
    base = timings["packed_row"].median_s
    lines = [f"{kind}: {args.seqs} sequences, {int(lengths.sum())} tokens packed to {args.total or 'their sum'}"]
    for name, t in timings.items():
        lines.append(f"  {name:<11} {t.median_s * 1e3:8.1f} ms  (p10-p90 {t.p10_s * 1e3:.1f}-{t.p90_s * 1e3:.1f})  "
                     f"{t.median_s / base:5.2f}x the packed row  max |logits - alone| {errors[name]:.1e}")
    return lines


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench.bench_hf_mixers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--total", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    lines = [machine_description()]
    for kind in args.kinds:
        lines += run(kind, args)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
