"""Tier: pure CPU, single process. profiling/bench/bench_hf_hidden_states.py end to end with tiny sizes: the
three paths agree (float64) and the hidden states' path allocates less than either logits path."""

from __future__ import annotations

from profiling.bench import bench_hf_hidden_states


def test_the_benchmark_runs_and_the_hidden_states_path_holds_no_logits():
    rows = bench_hf_hidden_states.main(["--tokens", "512", "--vocab", "4096", "--hidden", "32", "--rows", "4",
                                        "--reps", "1"])
    (_, difference), table = rows[0], rows[1:]
    assert difference < 1e-12
    peaks = {(mode, path): peak for mode, path, peak, _ in table}
    assert len(peaks) == 6
    for mode in ("forward", "forward+backward"):
        fused = peaks[mode, "hidden -> fused head"]
        assert fused < peaks[mode, "logits -> TokenLogProbs"] and fused < peaks[mode, "logits -> log_softmax"]
