"""The compat layer's configuration: nn_data's options (``cfg["nn_data"]``) and one call's pack spec.

NeMo-RL's positional arguments reach nn_data here, once: :func:`nemo_rl_spec` turns
``(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of, <fixed packed length>,
cp_size)`` into the layout's :class:`~nn_data.layout.PackSpec` (checked when built; ``cp_rank``
checked against the size), keeping the caller's spelling of the fixed packed length (``pad_packed_seq_to`` or
``pad_full_seq_to``) for the messages. Inside, the fixed packed length has one name,
``fixed_total``, passed keyword-only; the packed length a layout resolves to is its ``total``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.layout import PackSpec
from nn_data.layout.internal import checks


class SharedPrefixKeys(NamedTuple):
    """Where a batch carries its GRPO groups for shared-prefix packing (``cfg["nn_data"]["shared_prefix"]``):
    ``group_ids`` the key of its ``[B]`` group ids (rollouts of a group share a prompt), ``prefix_lengths``
    the key of its ``[B]`` prompt lengths."""

    group_ids: str = "group_ids"
    prefix_lengths: str = "prefix_lengths"


def shared_prefix_keys(value, name: str = "cfg['nn_data']['shared_prefix']") -> Optional[SharedPrefixKeys]:
    """``value`` as :class:`SharedPrefixKeys`: None or False -> None (off); True -> the default keys
    (``"group_ids"``, ``"prefix_lengths"``); a mapping with ``"group_ids_key"`` and / or
    ``"prefix_lengths_key"`` -> those keys; a :class:`SharedPrefixKeys` as it is. Anything else:
    :class:`PackingError` naming ``name``. Example: ``{"group_ids_key": "uid"}`` -> ``("uid", "prefix_lengths")``."""
    if value is None or value is False:
        return None
    if value is True:
        return SharedPrefixKeys()
    if isinstance(value, SharedPrefixKeys):
        return value
    fields = {"group_ids_key": "group_ids", "prefix_lengths_key": "prefix_lengths"}
    named = isinstance(value, Mapping) and all(isinstance(v, str) and v for v in value.values())
    if named and set(value) <= set(fields):
        return SharedPrefixKeys(**{fields[k]: v for k, v in value.items()})
    raise PackingError(f"{name}={value!r} is invalid; expected True (the batch keys 'group_ids' and "
                       "'prefix_lengths'), False / None (off) or a dict with 'group_ids_key' and / or "
                       "'prefix_lengths_key' naming the batch's keys")


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """nn_data-only switches of the pack path (NeMo-RL has no equivalent).

    ``compile``: run packing + CP sharding through ``torch.compile(fullgraph=True)``.
        The batch is padded with empty rows to ``row_capacity`` rows (default: the next
        power of two >= B, so at most log2(B_max) graphs) and the row length ``S`` is an
        unbacked symbolic size (``S = 0`` and ``1`` included). With ``pad_full_seq_to`` set
        (PP > 1) and a fixed ``row_capacity`` a whole stream compiles once.
    ``row_capacity``: fixed row count ``R`` the compiled graph sees; a microbatch with
        more rows raises :class:`PackingError`.
    ``buckets``: only used when ``pad_full_seq_to`` is None (PP = 1). The packed length
        ``T`` is rounded up to the smallest bucket that holds it (the last sequence's
        segment absorbs the slack, exactly as with ``pad_full_seq_to``), so at most
        ``len(buckets)`` distinct shapes occur. A sorted tuple of ints (each a multiple of
        ``pad_packed_seq_to_multiple_of`` and, under CP, of ``2 * cp_size``) or ``"pow2"``
        (``unit * 2**k``, ``unit = lcm(p, 2C)``). Note that ``T`` then differs from what
        NeMo-RL would produce (it is larger); the valid tokens and their offsets do not.
    ``backend``/``mode``: passed to ``torch.compile`` (tests pass a compile counter).
    ``pad_full_seq_to``: a run-level packed length, in place of the call's (:meth:`fixed_total`),
        so every microbatch of the run has one shape (one graph; fixed PP receive buffers). Not
        with ``buckets``.
    ``shared_prefix``: GRPO groups share their prompt (:func:`shared_prefix_keys`: True or the batch
        keys of the group ids and prefix lengths); normalised to :class:`SharedPrefixKeys` or None.

    Built from a config with :meth:`from_cfg` (``cfg["nn_data"]``, docs/nemo-rl.md, "nn_data options").
    """

    compile: bool = False
    row_capacity: Optional[int] = None
    buckets: Optional[Union[tuple, str]] = None
    backend: Any = "inductor"
    mode: Optional[str] = None
    pad_full_seq_to: Optional[int] = None
    shared_prefix: Any = None

    def __post_init__(self):
        _checks.positive_int("row_capacity", self.row_capacity, allow_none=True)
        object.__setattr__(self, "shared_prefix", shared_prefix_keys(self.shared_prefix))
        checks.fixed_total_arg("pad_full_seq_to", self.pad_full_seq_to)
        if self.pad_full_seq_to is not None and self.buckets is not None:
            raise PackingError(f"pad_full_seq_to={self.pad_full_seq_to} and buckets={self.buckets!r} cannot both be "
                               "set: buckets only choose T when there is no fixed packed length; drop one")
        b = self.buckets
        if b is None or b == "pow2":
            return
        if isinstance(b, str) or not isinstance(b, Sequence) or not b:
            raise PackingError(f"buckets={b!r} is invalid; expected None, 'pow2' or a non-empty list of ints")
        for v in b:
            checks.fixed_total_arg("buckets entry", v)
        object.__setattr__(self, "buckets", tuple(sorted(set(b))))

    def fixed_total(self, given: Optional[int], name: str = "pad_full_seq_to") -> Optional[int]:
        """The run-level ``pad_full_seq_to`` when set (a ``given`` above it raises), else ``given``.
        Example: run-level 8192, given 6144 (a step's longest bin) or None -> 8192."""
        run = self.pad_full_seq_to
        if run is None:
            return given
        if given is not None and given > run:
            raise PackingError(f"{name}={given} exceeds the run-level packed length pad_full_seq_to={run} "
                               f"(cfg['nn_data']['pad_full_seq_to'] or PackOptions); raise it to at least {given}")
        return run

    @classmethod
    def from_cfg(cls, cfg: Optional[dict]) -> "PackOptions":
        """``PackOptions(**cfg["nn_data"])`` minus ``device`` (the iterators' key); defaults when absent."""
        section = dict((cfg or {}).get("nn_data") or {})
        section.pop("device", None)
        unknown = set(section) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise PackingError(f"cfg['nn_data'] has unknown keys {sorted(unknown)}; valid keys are "
                               f"{sorted(f.name for f in dataclasses.fields(cls))} and 'device'")
        return cls(**section)


def nemo_rl_spec(m: int, p: int, *, fixed_total: Optional[int], cp_rank: int, cp_size: int, name: str,
                 options: Optional[PackOptions] = None) -> PackSpec:
    """NeMo-RL's packing arguments as the layout's :class:`~nn_data.layout.PackSpec` (``name``: how the
    caller spelled the fixed packed length), with ``cp_rank`` checked against ``cp_size``; checked once
    per distinct configuration (a training run repeats a few), an unhashable argument uncached."""
    buckets = options.buckets if options is not None and fixed_total is None else None
    _checks.check_cp(cp_size, cp_rank)
    try:
        return _spec(m, p, fixed_total, cp_size, name, buckets)
    except TypeError:  # an unhashable argument: checked (and refused) uncached
        return _spec.__wrapped__(m, p, fixed_total, cp_size, name, buckets)


@functools.lru_cache(maxsize=64, typed=True)  # typed: True is not 1 (a bool multiple is refused)
def _spec(m, p, fixed_total, cp_size, name, buckets) -> PackSpec:
    return PackSpec(m, p, fixed_total=fixed_total, arg_name=name, buckets=buckets, cp_size=cp_size)
