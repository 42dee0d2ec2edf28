"""Precision of a sequence late in a long pack through MegatronGPTAdapter: rotated from position 0
(what the adapter does) vs by its packed position (megatron-core's THD RoPE with ``max_seqlen = T``).

    python -m profiling.bench.bench_rope_precision                    # T = 512, 4096, 32768
    python -m profiling.bench.bench_rope_precision --totals 512 4096 --probe 8

A tiny megatron-core GPTModel (2 layers, hidden 64, RoPE, inv_freq in float32 as megatron-core
keeps it) in float64, float32 and bf16, the same parameters. A probe sequence of ``--probe`` tokens
is the last of a pack of ``T`` tokens (filler sequences of 1024 tokens before it); its logits are
compared with the float64 model on the probe alone (megatron-core's stock unpacked path). The noise
floor is the probe alone in the same dtype against the same float64 logits. Printed per ``T``,
dtype and rotation: max and RMS of |packed - float64|, and the RMS ratio to the floor. One process,
a one-rank gloo group on 127.0.0.1 for megatron-core's parallel_state, 1 thread, no grad (so a long
pack's document mask is a flex BlockMask). Precision, not speed: nothing here is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from unittest import mock

import torch

VOCAB, FILLER = 97, 1024
DTYPES = (torch.float32, torch.bfloat16)


def probe_ids(length: int) -> torch.Tensor:
    """The probe sequence ``[1, length]`` (seeded)."""
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(7))


def packed_probe(model, total: int, probe: torch.Tensor) -> torch.Tensor:
    """``probe [1, L]``'s logits ``[L, V]`` (float64) as the last sequence of a pack of ``total``
    tokens through ``PackedForward(MegatronGPTAdapter(model))``: filler sequences of up to 1024
    tokens first, the probe ending at ``total``."""
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.packed_forward import PackedForward

    n = probe.shape[1]
    before = total - n
    lengths = [FILLER] * (before // FILLER) + ([before % FILLER] if before % FILLER else []) + [n]
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(total))
    ids[-1, :n] = probe[0]
    ids = torch.where(torch.arange(width) < torch.tensor(lengths)[:, None], ids, 0)  # [B, S]
    wrapped = PackedForward(MegatronGPTAdapter(model), pad_full_seq_to=total, make_packed_seq_params=True)
    with torch.no_grad():
        return wrapped(ids, torch.tensor(lengths))[-1, :n].double()  # [L, V]


def alone(model, probe: torch.Tensor) -> torch.Tensor:
    """``probe [1, L]``'s logits ``[L, V]`` (float64) run alone through megatron-core's stock path."""
    from nn_data.models.tiny_megatron import forward_alone

    with torch.no_grad():
        return forward_alone(model, probe)[0].double()


def by_packed_position():
    """For comparison only: the adapter hands megatron-core ``max_seqlen = T`` (its RoPE then
    rotates every token by its position in the pack, the behaviour before the adapter's fix)."""
    from nn_data.adapters import megatron_gpt

    return mock.patch.object(megatron_gpt, "rotary_from_sequence_start", lambda params, total: params)


def _errors(x: torch.Tensor, exact: torch.Tensor) -> tuple:
    return float((x - exact).abs().max()), float((x - exact).pow(2).mean().sqrt())


def measure(models: dict, totals, probe_len: int) -> list:
    """One row per ``(T, dtype, rotation)``: ``dict(T, dtype, rotation, max, rms, floor_max, floor_rms)``."""
    probe = probe_ids(probe_len)
    exact = alone(models[torch.float64], probe)
    floors = {d: _errors(alone(models[d], probe), exact) for d in DTYPES}
    rows = []
    for total in totals:
        for dtype in DTYPES:
            for rotation, context in (("from 0", contextlib.nullcontext), ("packed position", by_packed_position)):
                with context():
                    err_max, err_rms = _errors(packed_probe(models[dtype], total, probe), exact)
                rows.append(dict(T=total, dtype=str(dtype).replace("torch.", ""), rotation=rotation, max=err_max,
                                 rms=err_rms, floor_max=floors[dtype][0], floor_rms=floors[dtype][1]))
    return rows


def report(rows: list) -> str:
    lines = [f"{'T':>6} {'dtype':>8} {'rotation':>16} {'max |packed-f64|':>17} {'rms':>10} "
             f"{'floor max':>10} {'floor rms':>10} {'rms / floor':>11}"]
    for r in rows:
        lines.append(f"{r['T']:>6} {r['dtype']:>8} {r['rotation']:>16} {r['max']:>17.2e} {r['rms']:>10.2e} "
                     f"{r['floor_max']:>10.2e} {r['floor_rms']:>10.2e} {r['rms'] / r['floor_rms']:>10.2f}x")
    return "\n".join(lines)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_rope_precision",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--totals", type=int, nargs="+", default=[512, 4096, 32768], help="pack lengths T")
    ap.add_argument("--probe", type=int, default=32, help="tokens of the probe sequence")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model
    from nn_data.testing.dist import destroy_model_parallel_groups, free_port, init_gloo

    init_gloo(0, 1, free_port())
    try:
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        models = {d: tiny_gpt_model(tiny_gpt_config(dtype=d), vocab=VOCAB, max_len=max(args.totals) + 1).eval()
                  for d in (torch.float64, *DTYPES)}
        rows = measure(models, args.totals, args.probe)
    finally:
        destroy_model_parallel_groups(parallel_state)
        dist.destroy_process_group()
    print(report(rows))
    return rows


if __name__ == "__main__":
    main()
