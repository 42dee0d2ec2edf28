"""What proving the model costs: the packing check (once per model) and the fingerprint (every call) against
one packed forward of a 2,048-token microbatch.

    python -m profiling.bench.bench_model_check                        # the tiny Llama
    python -m profiling.bench.bench_model_check --kinds llama qwen3_next --reps 10

Tiny models from nn_data.models.tiny_hf (defaults: hidden 64, 2 layers; Qwen3-Next without its MoE), float32,
through ``PackedForward(HFCausalLMAdapter(model), verify=False)``, no grad. ``forward``: one microbatch of 8
sequences of 256 tokens (2,048 packed); ``check``: :func:`nn_data.model_check.check_packing` on the same
wrapper (its own small microbatch: its runs and the model's own unpacked path); ``fingerprint``:
:func:`nn_data.model_identity.fingerprint` of the adapter; ``first call`` / ``first call, checked``: a fresh
``PackedForward`` on the same model (``verify=False`` / the default) and its first call on 3 sequences
``[12, 5, 9]``, the check inside the second. They run side by side, interleaved
(profiling.timing); printed: median ms, p10-p90 and the ratio to ``forward``.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from profiling.timing import machine_description, time_side_by_side


def modes(kind: str, seqs: int, length: int) -> dict:
    """``{"forward", "check", "fingerprint"}``: the three callables for a tiny model of ``kind``."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.model_check import check_packing, document_lengths, runner
    from nn_data.model_identity import fingerprint
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.packed_forward import PackedForward

    model = tiny_hf_model(kind, **({"moe": False} if kind == "qwen3_next" else {}))
    wrapped = PackedForward(HFCausalLMAdapter(model), verify=False)
    gen = torch.Generator().manual_seed(0)
    ids, lengths = torch.randint(1, 97, (seqs, length), generator=gen), torch.full((seqs,), length)
    print(f"  {kind}: the check's documents {document_lengths(wrapped)}")

    def forward():
        with torch.no_grad():
            return wrapped(ids, lengths)

    def check():
        check_packing(wrapped, device=ids.device, run=runner(wrapped), row_width=0)

    def identity():
        return fingerprint(wrapped.model)

    small = batch_of(SMALL)

    def first_call(verify):
        def call():  # a fresh wrapper's first call: the check runs in it unless verify=False
            with torch.no_grad():
                return PackedForward(HFCausalLMAdapter(model), verify=verify)(*small)
        return call

    return {"forward": forward, "check": check, "fingerprint": identity, "first call": first_call(False),
            "first call, checked": first_call(True)}


SMALL = [12, 5, 9]  # the first microbatch of the first-call comparison (the tests' microbatch)


def batch_of(lengths: list) -> tuple:
    gen = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.randint(1, 97, (len(lengths), width), generator=gen)
    return torch.where(torch.arange(width) < torch.tensor(lengths)[:, None], ids, 0), torch.tensor(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["llama"])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(machine_description())
    print("| model | forward (2,048 tokens) | check | fingerprint | check / forward | fingerprint / forward | "
          "first call | first call, checked | checked / unchecked |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in args.kinds:
        times = time_side_by_side(modes(kind, args.seqs, args.length), reps=args.reps)
        f, c, p, u, v = (times[k].median_s for k in ("forward", "check", "fingerprint", "first call",
                                                      "first call, checked"))
        span = {k: f"{t.median_s * 1e3:.3g} ms ({t.p10_s * 1e3:.3g}-{t.p90_s * 1e3:.3g})" for k, t in times.items()}
        print(f"| {kind} | {span['forward']} | {span['check']} | {span['fingerprint']} | {c / f:.2f}x | "
              f"{100 * p / f:.2f}% | {span['first call']} | {span['first call, checked']} | {v / u:.2f}x |")


if __name__ == "__main__":
    main()
