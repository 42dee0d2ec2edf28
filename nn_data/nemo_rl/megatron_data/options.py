"""The drop-in's configuration: nn_data's options (``cfg["nn_data"]``), their ``T`` buckets and one call's pack spec.

NeMo-RL's positional arguments reach nn_data once, in :func:`nemo_rl_spec`, which keeps the caller's spelling of
the fixed packed length (``pad_packed_seq_to`` or ``pad_full_seq_to``) for the messages; inside it is ``fixed_total``."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from nn_data.layout import PackSpec
from nn_data.extension import checks, layout_checks
from nn_data.nemo_rl.assertions import PackingAssertionError


class SharedPrefixKeys(NamedTuple):
    """The batch keys of a GRPO batch's ``[B]`` group ids and ``[B]`` prompt lengths (``cfg["nn_data"]["shared_prefix"]``)."""

    group_ids: str = "group_ids"
    prefix_lengths: str = "prefix_lengths"


def shared_prefix_keys(value, name: str = "cfg['nn_data']['shared_prefix']") -> Optional[SharedPrefixKeys]:
    """``value`` as :class:`SharedPrefixKeys`, None when off.

    Args:
        value: None / False (off), True (the default keys), a mapping with ``"group_ids_key"`` and / or
            ``"prefix_lengths_key"``, or a :class:`SharedPrefixKeys`.
        name: what the error names.

    Example: ``{"group_ids_key": "uid"}`` -> ``("uid", "prefix_lengths")``."""
    if value is None or value is False:
        return None
    if value is True:
        return SharedPrefixKeys()
    return _keys(value, SharedPrefixKeys, {"group_ids_key": "group_ids", "prefix_lengths_key": "prefix_lengths"},
                 name, "True (the batch keys 'group_ids' and 'prefix_lengths'), False / None (off) or a dict with "
                 "'group_ids_key' and / or 'prefix_lengths_key' naming the batch's keys")


class RolloutTreeKeys(NamedTuple):
    """The batch keys of a rollout tree's ``[B]`` parents and ``[B]`` shared token counts (``cfg["nn_data"]["rollout_tree"]``)."""

    parent: str = "parent"
    branch_at: str = "branch_at"


class FoundTreeKeys(RolloutTreeKeys):
    """:class:`RolloutTreeKeys` of ``rollout_tree = "find"``: the sharding planner writes the tree it found under them; a
    microbatch without them has its tree found from its token ids in ``process_microbatch``."""

    __slots__ = ()


#: ``cfg["nn_data"]["rollout_tree"] = FIND``: the sharding planner finds each global batch's tree from its token
#: ids (:func:`nn_data.planning.find_rollout_tree`) and writes it to the batch under :class:`RolloutTreeKeys`' keys.
FIND = "find"


def rollout_tree_keys(value, name: str = "cfg['nn_data']['rollout_tree']") -> Optional[RolloutTreeKeys]:
    """``value`` as :class:`RolloutTreeKeys`, None when off.

    Args:
        value: None / False (off), True or ``"find"`` (the default keys; :class:`FoundTreeKeys` for ``"find"``), a
            mapping with ``"parent_key"`` and / or ``"branch_at_key"``, or a :class:`RolloutTreeKeys`.
        name: what the error names.

    Example: ``{"parent_key": "up"}`` -> ``("up", "branch_at")``."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value == FIND:
        return FoundTreeKeys()
    if value is True:
        return RolloutTreeKeys()
    return _keys(value, RolloutTreeKeys, {"parent_key": "parent", "branch_at_key": "branch_at"}, name,
                 "True (the batch keys 'parent' and 'branch_at'), 'find' (the sharding planner finds the tree from "
                 "the token ids and writes those keys), False / None (off) or a dict with 'parent_key' and / or "
                 "'branch_at_key' naming the batch's keys")


def _keys(value, keys: type, fields: dict, name: str, valid: str):
    """The batch keys a mapping names (``fields``: its keys -> the NamedTuple's), else :class:`PackingError`."""
    if isinstance(value, keys):
        return value
    named = isinstance(value, Mapping) and all(isinstance(v, str) and v for v in value.values())
    if named and set(value) <= set(fields):
        return keys(**{fields[k]: v for k, v in value.items()})
    raise PackingAssertionError(f"{name}={value!r} is invalid; expected {valid}")


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """nn_data-only switches of the pack path, built from ``cfg["nn_data"]`` by :meth:`from_cfg` (docs/nemo-rl.md, "nn_data
    options").

    Args:
        compile: pack and CP-shard through ``torch.compile(fullgraph=True)``, rows padded to ``row_capacity``.
        row_capacity: the fixed row count of the compiled graph (default: the next power of two >= B).
        buckets: with no fixed packed length, ``T`` rounded up to the smallest bucket that holds it: sorted ints
            or ``"pow2"``.
        backend: passed to ``torch.compile``.
        mode: passed to ``torch.compile``.
        pad_full_seq_to: a run-level packed length in place of the call's (:meth:`fixed_total`); not with ``buckets``.
        shared_prefix: GRPO groups share their prompt (:func:`shared_prefix_keys`).
        rollout_tree: every shared prefix of a rollout tree packed once (:func:`rollout_tree_keys`); not with
            ``shared_prefix``.
        kv_capacity: the run's key/value buffer length at CP 1 (``TreeRecord.kv``); at least ``pad_full_seq_to``.

    Example: ``PackOptions.from_cfg({"nn_data": {"compile": True, "row_capacity": 8}})``."""

    compile: bool = False
    row_capacity: Optional[int] = None
    buckets: Optional[Union[tuple, str]] = None
    backend: Any = "inductor"
    mode: Optional[str] = None
    pad_full_seq_to: Optional[int] = None
    shared_prefix: Any = None
    rollout_tree: Any = None
    kv_capacity: Optional[int] = None

    def __post_init__(self):
        checks.positive_int("row_capacity", self.row_capacity, allow_none=True)
        checks.positive_int("kv_capacity", self.kv_capacity, allow_none=True)
        if self.rollout_tree is not None and self.rollout_tree is not False and self.shared_prefix not in (None, False):
            raise PackingAssertionError(f"cfg['nn_data']['shared_prefix']={self.shared_prefix!r} and cfg['nn_data']"
                                        f"['rollout_tree']={self.rollout_tree!r} are both set: a GRPO group is the "
                                        "depth-1 rollout tree, set one of them")
        object.__setattr__(self, "shared_prefix", shared_prefix_keys(self.shared_prefix))
        object.__setattr__(self, "rollout_tree", rollout_tree_keys(self.rollout_tree))
        layout_checks.fixed_total_arg("pad_full_seq_to", self.pad_full_seq_to)
        self._check_kv_capacity()
        if self.pad_full_seq_to is not None and self.buckets is not None:
            raise PackingAssertionError(f"pad_full_seq_to={self.pad_full_seq_to} and buckets={self.buckets!r} cannot both be "
                                        "set: buckets only choose T when there is no fixed packed length; drop one")
        b = self.buckets
        if b is None or b == "pow2":
            return
        if isinstance(b, str) or not isinstance(b, Sequence) or not b:
            raise PackingAssertionError(f"buckets={b!r} is invalid; expected None, 'pow2' or a non-empty list of ints")
        for v in b:
            layout_checks.fixed_total_arg("buckets entry", v)
        object.__setattr__(self, "buckets", tuple(sorted(set(b))))

    def _check_kv_capacity(self) -> None:
        k, run = self.kv_capacity, self.pad_full_seq_to
        if k is not None and self.tree is None:
            raise PackingAssertionError(f"cfg['nn_data']['kv_capacity']={k} sizes the key/value buffer of a shared-"
                                        "prefix or rollout-tree microbatch; set cfg['nn_data']['shared_prefix'] or "
                                        "['rollout_tree'], or drop kv_capacity")
        if k is not None and run is not None and k < run:
            raise PackingAssertionError(f"cfg['nn_data']['kv_capacity']={k} is below pad_full_seq_to={run}: the "
                                        "buffer holds every packed token's keys and the path tokens before each "
                                        f"node; set kv_capacity to at least {run}")

    @property
    def tree(self):
        """The rollout-tree spelling in use (:class:`SharedPrefixKeys` or :class:`RolloutTreeKeys`), or None."""
        return self.shared_prefix if self.shared_prefix is not None else self.rollout_tree

    def fixed_total(self, given: Optional[int], name: str = "pad_full_seq_to") -> Optional[int]:
        """The run-level ``pad_full_seq_to`` when set (a ``given`` above it raises), else ``given``.

        Example: run-level 8192, given 6144 or None -> 8192."""
        run = self.pad_full_seq_to
        if run is None:
            return given
        if given is not None and given > run:
            raise PackingAssertionError(f"{name}={given} exceeds the run-level packed length pad_full_seq_to={run} "
                                        f"(cfg['nn_data']['pad_full_seq_to'] or PackOptions); raise it to at least {given}")
        return run

    @classmethod
    def from_cfg(cls, cfg: Optional[dict]) -> "PackOptions":
        """``PackOptions(**cfg["nn_data"])`` minus ``device`` (the iterators' key); defaults when absent."""
        section = dict((cfg or {}).get("nn_data") or {})
        refuse_unknown_keys(section, [*(f.name for f in dataclasses.fields(cls)), "device"], "cfg['nn_data']")
        section.pop("device", None)
        return cls(**section)


def bucket_total(total: int, buckets, p: int, cp_size: int) -> int:
    """The smallest bucket that holds ``total`` (:attr:`PackOptions.buckets`; host ints).

    ``buckets`` is a sorted tuple of ints or ``"pow2"`` (``unit * 2**k`` with ``unit = lcm(p, 2C)``).
    Example: total 40, buckets ``(64, 128)`` -> 64; ``"pow2"`` with p 8, C 1 -> 8 * 2**3 = 64.
    """
    unit = math.lcm(p, 2 * cp_size) if cp_size > 1 else p
    if buckets == "pow2":
        return unit * (1 << max(0, math.ceil(math.log2(max(total, 1) / unit))))
    bad = [b for b in buckets if b % unit]
    if bad:
        raise PackingAssertionError(f"bucket {bad[0]} is not a multiple of {unit} (lcm of "
                                    f"pad_packed_seq_to_multiple_of={p} and 2*cp_size); every bucket must be one")
    for b in buckets:
        if b >= total:
            return b
    raise PackingAssertionError(f"the packed total {total} exceeds the largest bucket {buckets[-1]}; "
                                f"add a bucket of at least {total}")


def refuse_unknown_keys(given: Mapping, valid: Sequence[str], where: str) -> None:
    """:class:`PackingError` for the first key of ``given`` outside ``valid``, naming it, the nearest valid key and all.

    Example: ``{"paralelism": p}`` -> ``"sequence_packing_args has an unknown key 'paralelism' (did you mean
    'parallelism'?); valid keys: [...]"``."""
    for key in given:
        if key not in valid:
            near = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise PackingAssertionError(f"{where} has an unknown key {key!r}{hint}; valid keys: {sorted(valid)}")


@dataclasses.dataclass(frozen=True)
class DropInSpec(PackSpec):
    """The layout's :class:`~nn_data.layout.PackSpec` and the CP size the drop-in packs and shards for in one call."""

    _: dataclasses.KW_ONLY
    cp_size: int = 1

    def __post_init__(self):
        super().__post_init__()
        checks.check_cp(self.cp_size)


def nemo_rl_spec(m: int, p: int, *, fixed_total: Optional[int], cp_rank: int, cp_size: int, name: str) -> DropInSpec:
    """NeMo-RL's packing arguments as a :class:`DropInSpec`, checked once per distinct configuration.

    ``name`` is the caller's spelling of the fixed packed length (``pad_packed_seq_to`` or ``pad_full_seq_to``)."""
    checks.check_cp(cp_size, cp_rank)
    try:
        return _spec(m, p, fixed_total, cp_size, name)
    except TypeError:  # an unhashable argument: checked (and refused) uncached
        return _spec.__wrapped__(m, p, fixed_total, cp_size, name)


@functools.lru_cache(maxsize=64, typed=True)  # typed: True is not 1 (a bool multiple is refused)
def _spec(m, p, fixed_total, cp_size, name) -> DropInSpec:
    layout_checks.fixed_total_arg(name, fixed_total)
    checks.positive_int("pad_packed_seq_to_multiple_of", p)
    if fixed_total is not None and fixed_total % p:
        raise PackingAssertionError(f"{name}={fixed_total} is not a multiple of pad_packed_seq_to_multiple_of={p}; "
                                    f"choose a multiple of {p}")
    return DropInSpec(m, p, fixed_total=fixed_total, cp_size=cp_size)
