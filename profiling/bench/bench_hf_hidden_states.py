"""A Hugging Face model's token log-probs from its packed hidden states (``HFCausalLMAdapter(output=
"hidden_states")`` into ``TokenLogProbsFromHidden``) against its logits and a log-softmax, side by side.

    python -m profiling.bench.bench_hf_hidden_states [--tokens 2048] [--vocab 32768] [--hidden 128] [--reps 5]

A tiny Llama built from a config (``nn_data.models.tiny_hf``: ``--hidden`` wide, 2 layers, untied output layer,
float32), one microbatch of ``--rows`` sequences packed to ``T = --tokens`` (lengths drawn in ``[S/2, S]``,
``S = T / rows``), one thread. Paths, each from ``PackedForward.prepare``'s packed row to the ``[B, S]``
log-probs ``log p(x[s] | x[:s])``:

* ``hidden -> fused head``: the adapter with ``output="hidden_states"`` (the model's base, ``[1, T, H]``),
  then ``TokenLogProbsFromHidden`` with the output layer's weight (chunks of 256 tokens, no ``[T, V]``);
* ``logits -> TokenLogProbs``: the adapter's logits ``[1, T, V]``, then nn_data's chunked log-softmax;
* ``logits -> log_softmax``: the logits, ``log_softmax`` over ``[1, T, V]``, the next token's value gathered,
  then unpacked (what a loop over a model's logits does).

Modes: ``forward`` (``torch.no_grad``) and ``forward+backward`` (the log-probs' sum, backward to every
parameter). Printed: the peak of bytes allocated during one call (profiler allocator events, inputs and
parameters excluded, parameter gradients included: the output layer's ``[V, H]`` gradient is allocated by
every path alike; after a first call, in which the adapter's flex attention compiles at this ``T``) and the
median wall time (paths interleaved, ``profiling.timing``); before that, the float64 check that the three
paths give the same log-probs.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from nn_data import TokenLogProbs, TokenLogProbsFromHidden
from nn_data.adapters import HFCausalLMAdapter
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from profiling.bench.bench_logprobs import peak_allocated
from profiling.timing import machine_description, reuse_freed_memory, time_side_by_side

MiB = 2**20
PATHS = ("hidden -> fused head", "logits -> TokenLogProbs", "logits -> log_softmax")


def build(args, dtype):
    """``(model, {path: fn() -> logprobs [B, S]})`` for one packed microbatch."""
    model = tiny_hf_model("llama", vocab=args.vocab, hidden=args.hidden, layers=2, heads=4, kv_heads=2,
                          ffn=2 * args.hidden, dtype=dtype)
    seq_len = args.tokens // args.rows
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (args.rows,), generator=gen)
    ids = torch.randint(1, args.vocab, (args.rows, seq_len), generator=gen)
    ids = torch.where(torch.arange(seq_len) < lengths[:, None], ids, 0)
    kwargs = dict(pad_full_seq_to=args.tokens, verify=False)
    hidden_fw = PackedForward(HFCausalLMAdapter(model, output="hidden_states"), **kwargs)
    logits_fw = PackedForward(HFCausalLMAdapter(model), **kwargs)
    inp = hidden_fw.prepare(ids, lengths)
    layout, packed_ids = inp.layout, inp.layout.pack(inp.row_ids)  # [1, T]
    weight = model.get_output_embeddings().weight  # [V, H]
    fused, from_logits = TokenLogProbsFromHidden(seq_len), TokenLogProbs(seq_len)

    def hidden_path():
        hidden = hidden_fw.model(inp.input_ids, inp.position_ids, inp.packed)  # [1, T, H]
        return fused(hidden, weight, packed_ids, layout=layout)

    def logits_path():
        logits = logits_fw.model(inp.input_ids, inp.position_ids, inp.packed)  # [1, T, V]
        return from_logits(logits, packed_ids, layout=layout)

    def log_softmax_path():
        logits = logits_fw.model(inp.input_ids, inp.position_ids, inp.packed)  # [1, T, V]
        lp = logits.log_softmax(-1)[0, :-1].gather(-1, packed_ids[0, 1:, None])  # [T-1, 1]: log p(next)
        shifted = torch.cat([lp.new_zeros(1, 1), lp]).T.unsqueeze(-1)  # [1, T, 1]: position t scores token t
        rows = logits_fw.finish(shifted, inp)[..., 0]  # [B, S]
        return rows * (torch.arange(seq_len) >= 1)  # a sequence's first token is not scored

    return model, dict(zip(PATHS, (hidden_path, logits_path, log_softmax_path)))


def check(args) -> float:
    """Largest difference of the three paths' log-probs (float64, a smaller microbatch)."""
    small = argparse.Namespace(**{**vars(args), "tokens": 256, "vocab": 512, "rows": 4})
    _, paths = build(small, torch.float64)
    with torch.no_grad():
        got = [fn() for fn in paths.values()]
    return max(float((g - got[0]).abs().max()) for g in got[1:])


def step(model, fn, backward: bool):
    def run():
        model.zero_grad(set_to_none=True)
        if backward:
            fn().sum().backward()
        else:
            with torch.no_grad():
                fn()

    return run


def main(argv=None) -> list:
    """Print the table; returns its rows ``(mode, path, peak MiB, median ms)`` and, first, the float64 check."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    reuse_freed_memory()
    print(machine_description())
    difference = check(args)
    print(f"float64 check: largest |difference| of the three paths' log-probs {difference:.1e}")
    rows = [("float64 check", difference)]
    model, paths = build(args, torch.float32)
    print(f"T {args.tokens}, V {args.vocab}, H {args.hidden}, float32; logits [T, V] = "
          f"{args.tokens * args.vocab * 4 / MiB:.0f} MiB")
    print("| mode | path | peak MiB | median ms | peak / fused | time / fused |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for mode, backward in (("forward", False), ("forward+backward", True)):
        fns = {name: step(model, fn, backward) for name, fn in paths.items()}
        for fn in fns.values():  # first calls (flex attention compiles on its first call) outside the peaks
            fn()
        peaks = {name: peak_allocated(fn) / MiB for name, fn in fns.items()}
        times = {name: t.median_s * 1e3 for name, t in time_side_by_side(fns, warmup=1, reps=args.reps).items()}
        base = PATHS[0]
        for name in PATHS:
            rows.append((mode, name, peaks[name], times[name]))
            print(f"| {mode} | {name} | {peaks[name]:.1f} | {times[name]:.0f} | {peaks[name] / peaks[base]:.1f}x | "
                  f"{times[name] / times[base]:.2f}x |")
    return rows


if __name__ == "__main__":
    main()
