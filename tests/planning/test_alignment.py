"""Tier: pure CPU, single process (no tensor op; the compat layer's parameter function is imported,
megatron-core is not).

nn_data.planning.Parallelism: the one alignment rule, its refusals, and every part that uses it.
"""

from __future__ import annotations

import itertools
import math

import pytest

from nn_data import PackSequences
from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import _get_pack_sequence_parameters_for_megatron
from nn_data.packed_forward import _check_cp_config
from nn_data.nemo_rl.megatron_data.options import bucket_total
from nn_data.planning import INT32_MAX, Parallelism
from tests.support.megatron_config import megatron_cfg


@pytest.mark.parametrize("kwargs, sequence, packed, total", [
    (dict(), 1, 1, 1),
    (dict(cp=2), 4, 1, 4),
    (dict(tp=2), 1, 1, 1),  # TP without sequence parallelism does not split the sequence
    (dict(tp=2, sequence_parallel=True), 2, 1, 2),
    (dict(tp=2, sequence_parallel=True, cp=2), 8, 1, 8),
    (dict(fp8_recipe="tensorwise"), 1, 16, 16),
    (dict(fp8_recipe="mxfp8", cp=2), 4, 128, 128),
    (dict(fp8_recipe="blockwise", tp=2, sequence_parallel=True, cp=2), 8, 1024, 1024),
    (dict(fp4=True), 1, 128, 128),
    (dict(hybridep=True, fp8_recipe="mxfp8", cp=4), 8, 1024, 1024),
    (dict(cp=3, fp8_recipe="tensorwise"), 6, 96, 96),
])
def test_multiples_of_each_layout(kwargs, sequence, packed, total):
    parallelism = Parallelism(dp=2, **kwargs)
    assert (parallelism.sequence_multiple, parallelism.packed_multiple, parallelism.total_multiple) == (sequence, packed, total)
    assert parallelism.pad_multiple == sequence


CFGS = [megatron_cfg(tp=tp, sp=sp, cp=cp, pp=pp, fp8=fp8, dispatcher=d, backend=b)
        for tp, sp, cp, pp, fp8, (d, b) in itertools.product(
            (1, 2, 4), (False, True), (1, 2, 3), (1, 2), (None, "tensorwise", "mxfp8", "blockwise"),
            ((None, None), ("flex", "hybridep"), ("flex", "deepep")))]


@pytest.mark.parametrize("cfg", CFGS[::7] + CFGS[-3:])
def test_the_compat_parameters_are_the_layouts_multiples(cfg):
    parallelism = Parallelism.from_megatron_cfg(cfg)
    m = parallelism.sequence_multiple * 3
    pad, packed, total = _get_pack_sequence_parameters_for_megatron(cfg, m, 1000)
    assert (pad, packed) == (m, parallelism.packed_multiple)
    assert total == (None if cfg["pipeline_model_parallel_size"] == 1 else -(-1000 // packed) * packed)
    if parallelism.sequence_multiple > 1:  # the same refusal from both
        with pytest.raises(PackingError, match=r"is not a multiple of minimum_pad_factor"):
            _get_pack_sequence_parameters_for_megatron(cfg, parallelism.sequence_multiple + 1, 1000)


def test_fp4_in_a_megatron_cfg_sets_the_packed_multiple():
    assert Parallelism.from_megatron_cfg({**megatron_cfg(cp=2), "fp4": "e2m1"}).packed_multiple == 512
    assert Parallelism.from_megatron_cfg({**megatron_cfg(), "fp4_cfg": {"enabled": True}}).packed_multiple == 128
    assert _get_pack_sequence_parameters_for_megatron({**megatron_cfg(), "fp4": "e2m1"}, 1, 100) == (1, 128, None)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 6, 8, 12])
def test_packed_forwards_cp_check_accepts_what_the_layout_accepts(cp, m):
    parallelism = Parallelism(dp=1, cp=cp)
    total = 48
    aligned = m % parallelism.sequence_multiple == 0 and total % parallelism.total_multiple == 0
    if aligned:
        _check_cp_config(cp, PackSequences(m, pad_full_seq_to=total))
    else:
        with pytest.raises(PackingError, match=rf"must be multiples of 2\*cp_size={2 * cp}"):
            _check_cp_config(cp, PackSequences(m, pad_full_seq_to=total))


@pytest.mark.parametrize("p, cp, unit", [(8, 1, 8), (1, 2, 4), (6, 2, 12), (8, 4, 8)])
def test_the_compat_buckets_round_to_the_layouts_multiple(p, cp, unit):
    def _bucket(natural, p, cp, buckets):
        return bucket_total(natural, buckets, p, cp)

    assert unit == math.lcm(p, Parallelism(dp=1, cp=cp).sequence_multiple)
    assert _bucket(1, p, cp, "pow2") == unit and _bucket(unit + 1, p, cp, "pow2") == 2 * unit
    with pytest.raises(PackingError, match=rf"^bucket {unit + 2} is not a multiple of {unit} "):
        _bucket(1, p, cp, (unit + 2,))


def test_a_bad_sequence_multiple_is_refused_when_the_layout_is_built():
    with pytest.raises(PackingError, match=r"^make_sequence_length_divisible_by \(6\) is not a multiple of "
                                           r"minimum_pad_factor \(8\)\.\nPlease set policy\.make_sequence_length_"
                                           r"divisible_by to a multiple of 8 \(2\*cp_size=4 when CP > 1, times "
                                           r"tp_size=2 when TP > 1 with sequence parallelism\)"):
        Parallelism(dp=4, tp=2, sequence_parallel=True, cp=2, make_sequence_length_divisible_by=6)
    assert Parallelism(dp=4, cp=2, make_sequence_length_divisible_by=12).pad_multiple == 12
    with pytest.raises(PackingError, match=r"make_sequence_length_divisible_by=0 is invalid; expected an int >= 1 "
                                           r"that is a multiple of 4"):
        Parallelism(dp=1, cp=2, make_sequence_length_divisible_by=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dp=0), r"Parallelism dp=0 is invalid; expected an int >= 1"),
    (dict(dp=2, cp=1.5), r"Parallelism cp=1.5 is invalid; expected an int >= 1"),
    (dict(dp=2, tp=True), r"Parallelism tp=True is invalid"),
    (dict(dp=2, sequence_parallel=1), r"Parallelism sequence_parallel=1 is invalid; expected True or False"),
    (dict(dp=2, fp8_recipe=16), r"Parallelism fp8_recipe=16 is invalid; expected None \(no FP8\) or a recipe"),
])
def test_bad_layout_fields_are_named(kwargs, match):
    with pytest.raises(PackingError, match=match):
        Parallelism(**kwargs)


def test_layout_is_keyword_only():
    with pytest.raises(TypeError):
        Parallelism(2)  # noqa: the dp must be named


def test_check_packed_length_names_the_argument_the_unit_and_a_valid_value():
    parallelism = Parallelism(dp=2, cp=2, fp8_recipe="tensorwise")
    assert parallelism.check_fixed_total(8192) == 8192
    with pytest.raises(PackingError, match=r"^pad_full_seq_to=8200 is not a multiple of 64, the alignment of this "
                                           r"parallelism \(cp=2, fp8 tensorwise: sequence_multiple 4, packed_multiple "
                                           r"64\); choose a multiple of 64, e.g\. 8256$"):
        parallelism.check_fixed_total(8200)
    with pytest.raises(PackingError, match=r"^T=0 is invalid; expected an int >= 1, a multiple of 64"):
        parallelism.check_fixed_total(0, "T")
    with pytest.raises(PackingError, match=rf"^pad_full_seq_to={2**31} exceeds {INT32_MAX} \(2\*\*31 - 1\), the largest "
                                           r"packed length or boundary that int32 cu_seqlens can hold"):
        Parallelism(dp=1).check_fixed_total(2**31)
    assert parallelism.round_fixed_total(8200) == 8256
