"""Memory of the document-causal mask at a long packed length: a flex ``BlockMask`` vs a dense
boolean ``[T, T]`` mask (nn_data.masks), measured side by side in one run.

    python -m profiling.bench.bench_mask_memory                     # T = 32768, documents of ~1024 tokens
    python -m profiling.bench.bench_mask_memory --tokens 8192 --attention

For each form: the bytes the mask keeps alive for the whole forward (what every attention layer
reads), and the peak bytes the CPU allocator handed out while building it (torch.profiler memory
events: tensors only), plus the build time (the block mask's second build, after its one-time
compile). ``--attention`` also runs one compiled flex-attention forward with the block mask
(float32, no grad: the CPU flex backend has no backward) and checks a few query rows against a
dense reference computed row by row.
"""

from __future__ import annotations

import argparse

import torch

from nn_data.masks import document_block_mask, document_causal_mask
from profiling.timing import machine_description, timed_result

_MIB = 1024 * 1024


def document_segments(tokens: int, mean_len: int, seed: int) -> torch.Tensor:
    """``segment_ids [T]`` of documents with lengths uniform in ``[1, 2 * mean_len - 1]`` (the last
    one cut to fit), summing to T."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(1, 2 * mean_len, (), generator=gen)))
        lengths.append(n)
        left -= n
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths), output_size=tokens)


def peak_allocated(fn):
    """``(result, peak bytes allocated above the start, seconds)`` of ``fn()``: the highest "Total
    Allocated" of the profiler's CPU memory events (every tensor allocation and free), above the
    total just before the first one."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result, seconds = timed_result(fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0)
    if not memory:
        return result, 0, seconds
    base = memory[0][1] - memory[0][2]
    return result, max(total for _, total, _ in memory) - base, seconds


def block_mask_bytes(block) -> int:
    return sum(t.numel() * t.element_size() for t in block.as_tuple() if isinstance(t, torch.Tensor))


def check_attention(block, segment_ids: torch.Tensor, rows: int = 8, heads: int = 4, dim: int = 16) -> float:
    """One compiled flex-attention forward with ``block``; largest difference from a row-by-row
    dense reference on ``rows`` query rows."""
    from nn_data.masks import DocumentMask, document_attention

    tokens = segment_ids.shape[0]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, tokens, dim, generator=gen) for _ in range(3))
    with torch.no_grad():
        out, first = timed_result(lambda: document_attention(q, k, v, DocumentMask(None, block)))  # [1, H, T, D]
        out, second = timed_result(lambda: document_attention(q, k, v, DocumentMask(None, block)))
        worst = 0.0
        for i in torch.linspace(0, tokens - 1, rows).long().tolist():
            allowed = document_causal_mask(torch.tensor([i]), segment_ids)  # [1, T]
            ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, i : i + 1], k, v, attn_mask=allowed)
            worst = max(worst, float((out[:, :, i : i + 1] - ref).abs().max()))
    print(f"flex attention forward, T = {tokens}, {heads} heads x {dim}: first call (compiles) {first:.1f} s, "
          f"second {second * 1e3:.0f} ms; max |flex - dense| on {rows} rows: {worst:.1e}")
    return worst


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_mask_memory",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="packed length T (default 32768)")
    ap.add_argument("--mean-len", type=int, default=1024, help="mean document length (default 1024)")
    ap.add_argument("--skip-dense", action="store_true", help="do not build the dense mask (T^2 bytes, ~3x at peak)")
    ap.add_argument("--attention", action="store_true", help="also run one flex-attention forward with the block mask")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print(f"machine: {machine_description()}")
    segment_ids = document_segments(args.tokens, args.mean_len, args.seed)
    query_index = torch.arange(args.tokens)
    print(f"T = {args.tokens}, {int(segment_ids[-1]) + 1} documents (mean length {args.mean_len})")
    document_block_mask(query_index, segment_ids)  # compile once for this shape (not measured)
    block, block_peak, block_s = peak_allocated(lambda: document_block_mask(query_index, segment_ids))
    out = dict(tokens=args.tokens, block_bytes=block_mask_bytes(block), block_peak_bytes=block_peak, block_s=block_s,
               block_sparsity=float(block.sparsity()))
    print(f"{'mask':<18} {'kept MiB':>10} {'peak build MiB':>15} {'build ms':>9}")
    print(f"{'flex BlockMask':<18} {out['block_bytes'] / _MIB:>10.2f} {block_peak / _MIB:>15.2f} {block_s * 1e3:>9.0f}"
          f"   ({out['block_sparsity']:.1f}% of blocks skipped)")
    if not args.skip_dense:
        dense, dense_peak, dense_s = peak_allocated(lambda: document_causal_mask(query_index, segment_ids))
        out.update(dense_bytes=dense.numel() * dense.element_size(), dense_peak_bytes=dense_peak, dense_s=dense_s)
        print(f"{'dense bool [T, T]':<18} {out['dense_bytes'] / _MIB:>10.2f} {dense_peak / _MIB:>15.2f} "
              f"{dense_s * 1e3:>9.0f}")
        del dense
        print(f"dense / block: {out['dense_bytes'] / out['block_bytes']:.0f}x kept, "
              f"{dense_peak / max(block_peak, 1):.0f}x at peak")
    if args.attention:
        out["attention_max_diff"] = check_attention(block, segment_ids)
    return out


if __name__ == "__main__":
    main()
