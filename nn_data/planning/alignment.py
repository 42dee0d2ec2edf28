"""The one alignment rule: which multiples a sequence and a packed microbatch must be (docs/planning.md,
"Parallelism: the one alignment rule").

:class:`Parallelism` names a run's parallelism and numerics and derives every multiple the packer, the planner
and the NeMo-RL-compatible layer use; nothing else in nn_data writes these products:

* ``sequence_multiple``: ``(2*cp if cp > 1 else 1) * (tp if tp > 1 and sequence_parallel else 1)``
  (NeMo-RL's ``minimum_pad_factor``). Example: tp 2 + SP, cp 2 -> 8.
* ``packed_multiple``: a recipe's divisor of the packed length (FP8 blockwise 128, MXFP8 32, other
  FP8 16, FP4 128, HybridEP 128; the largest that applies) times ``sequence_multiple``; 1 when no
  recipe asks for one. Example: FP8 blockwise, tp 2 + SP, cp 2 -> 128 * 8 = 1024.
* ``total_multiple``: what ``pad_full_seq_to`` must be a multiple of, the least common multiple of the two.
  Example: cp 2, no recipe -> 4; FP8 tensorwise, cp 2 -> 64."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

from nn_data._alias import renamed_method
from nn_data.layout import round_up
from nn_data.layout.internal import INT32_MAX, checks
from nn_data.errors import PackingError

_RECIPE_DIVISORS = {"blockwise": 128, "mxfp8": 32}  # any other FP8 recipe: 16 (NeMo-RL's rule)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PackingError(f"Parallelism {name}={value!r} is invalid; expected an int >= 1")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """A run's parallelism and numerics, and the multiples they impose (module docstring): ``dp`` (the planner's
    ranks), ``tp``, ``sequence_parallel``, ``cp``, ``pp``; ``fp8_recipe`` None or the recipe's name
    (``"blockwise"``, ``"mxfp8"``, any other: 16); ``fp4``, ``hybridep``; ``make_sequence_length_divisible_by``,
    the per-sequence multiple the run pads to (None: ``sequence_multiple``; else a multiple of it, checked)."""

    dp: int
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    pp: int = 1
    fp8_recipe: Optional[str] = None
    fp4: bool = False
    hybridep: bool = False
    make_sequence_length_divisible_by: Optional[int] = None

    def __post_init__(self):
        for name in ("dp", "tp", "cp", "pp"):
            _positive(name, getattr(self, name))
        for name in ("sequence_parallel", "fp4", "hybridep"):
            if not isinstance(getattr(self, name), bool):
                raise PackingError(f"Parallelism {name}={getattr(self, name)!r} is invalid; expected True or False")
        if self.fp8_recipe is not None and not isinstance(self.fp8_recipe, str):
            raise PackingError(f"Parallelism fp8_recipe={self.fp8_recipe!r} is invalid; expected None (no FP8) "
                               "or a recipe name such as 'tensorwise', 'mxfp8' or 'blockwise'")
        m = self.make_sequence_length_divisible_by
        if m is None:
            return
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PackingError(f"make_sequence_length_divisible_by={m!r} is invalid; expected an int >= 1 that is a "
                               f"multiple of {self.sequence_multiple}")
        factor = self.sequence_multiple
        if m % factor:
            raise PackingError(
                f"make_sequence_length_divisible_by ({m}) is not a multiple of "
                f"minimum_pad_factor ({factor}).\nPlease set policy.make_sequence_length_divisible_by to a "
                f"multiple of {factor} (2*cp_size={2 * self.cp} when CP > 1, times tp_size={self.tp} when "
                "TP > 1 with sequence parallelism)"
            )

    @property
    def sequence_multiple(self) -> int:
        """The minimum per-sequence multiple: ``2*cp`` (CP > 1) times ``tp`` (TP > 1 with SP)."""
        cp_factor = 2 * self.cp if self.cp > 1 else 1
        return cp_factor * (self.tp if self.tp > 1 and self.sequence_parallel else 1)

    @property
    def pad_multiple(self) -> int:
        """The multiple each sequence is padded to: ``make_sequence_length_divisible_by``, else
        ``sequence_multiple``."""
        m = self.make_sequence_length_divisible_by
        return self.sequence_multiple if m is None else m

    @property
    def recipe_divisor(self) -> int:
        """The numerics' divisor of the packed length per rank: FP8 blockwise 128, MXFP8 32,
        other FP8 16, FP4 128, HybridEP 128 (the largest that applies), else 1."""
        divisor = 1
        if self.fp8_recipe is not None:
            divisor = _RECIPE_DIVISORS.get(self.fp8_recipe, 16)
        if self.fp4 or self.hybridep:
            divisor = max(divisor, 128)
        return divisor

    @property
    def packed_multiple(self) -> int:
        """``recipe_divisor * sequence_multiple`` when a recipe asks for one, else 1."""
        divisor = self.recipe_divisor
        return divisor * self.sequence_multiple if divisor > 1 else 1

    @property
    def total_multiple(self) -> int:
        """What a fixed packed length must be a multiple of: lcm(sequence_multiple, packed_multiple)."""
        return math.lcm(self.sequence_multiple, self.packed_multiple)

    def check_fixed_total(self, value, name: str = "pad_full_seq_to") -> int:
        """``value`` if it is a valid fixed packed length for this parallelism (an int >= 1, a multiple of
        ``total_multiple``, within int32), else :class:`PackingError` naming ``name``. Example: cp 2, FP8 tensorwise
        (``total_multiple`` 64): 8192 passes; 8200 is refused, suggesting 8256."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PackingError(f"{name}={value!r} is invalid; expected an int >= 1, a multiple of "
                               f"{self.total_multiple}")
        checks.fixed_total_arg(name, value)  # cu_seqlens are int32
        unit = self.total_multiple
        if value % unit:
            raise PackingError(
                f"{name}={value} is not a multiple of {unit}, the alignment of this parallelism ({self.describe()}); "
                f"choose a multiple of {unit}, e.g. {round_up(value, unit)}"
            )
        return value

    check_packed_length = renamed_method("nn_data.planning:Parallelism.check_packed_length")
    round_packed_length = renamed_method("nn_data.planning:Parallelism.round_packed_length")

    def round_fixed_total(self, tokens: int) -> int:
        """The smallest valid fixed packed length that holds ``tokens``: ``round_up(tokens, total_multiple)``."""
        return round_up(tokens, self.total_multiple)

    def describe(self) -> str:
        """The factors behind the multiples, for messages: ``"cp=2, tp=2 with sequence parallelism, fp8 mxfp8"``."""
        parts = [f"cp={self.cp}"]
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + (" with sequence parallelism" if self.sequence_parallel else ""))
        if self.fp8_recipe is not None:
            parts.append(f"fp8 {self.fp8_recipe}")
        parts += [name for name in ("fp4", "hybridep") if getattr(self, name)]
        return ", ".join(parts) + f": sequence_multiple {self.sequence_multiple}, packed_multiple {self.packed_multiple}"

    @classmethod
    def from_megatron_cfg(cls, megatron_cfg: Mapping[str, Any], *, dp: int = 1,
                          make_sequence_length_divisible_by: Optional[int] = None) -> "Parallelism":
        """The parallelism of a NeMo-RL ``megatron_cfg`` (``tensor_model_parallel_size``, ``sequence_parallel``,
        ``context_parallel_size``, ``pipeline_model_parallel_size``, ``fp8_cfg``, the ``flex`` dispatcher with the
        ``hybridep`` backend, ``fp4`` / ``fp4_cfg``); ``dp`` changes no multiple, the planner needs it."""
        fp8_cfg = megatron_cfg.get("fp8_cfg", None) or {}
        fp8 = fp8_cfg.get("fp8_recipe", "tensorwise") if fp8_cfg.get("enabled", False) else None
        fp4 = bool(megatron_cfg.get("fp4")) or bool((megatron_cfg.get("fp4_cfg") or {}).get("enabled", False))
        hybridep = (megatron_cfg.get("moe_token_dispatcher_type") == "flex"
                    and megatron_cfg.get("moe_flex_dispatcher_backend") == "hybridep")
        return cls(dp=dp, tp=megatron_cfg["tensor_model_parallel_size"],
                   sequence_parallel=bool(megatron_cfg["sequence_parallel"]),
                   cp=megatron_cfg["context_parallel_size"], pp=megatron_cfg["pipeline_model_parallel_size"],
                   fp8_recipe=fp8 if fp8 is None else str(fp8), fp4=fp4, hybridep=hybridep,
                   make_sequence_length_divisible_by=make_sequence_length_divisible_by)
