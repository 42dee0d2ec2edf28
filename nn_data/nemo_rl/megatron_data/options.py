"""The compat layer's configuration: nn_data's options (``cfg["nn_data"]``) and one call's pack spec.

NeMo-RL's positional arguments reach nn_data here, once: :func:`nemo_rl_spec` turns
``(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of, <fixed packed length>,
cp_size)`` into a :class:`DropInSpec`, the layout's spec and ``cp_size`` (checked when built; ``cp_rank``
checked against the size), keeping the caller's spelling of the fixed packed length (``pad_packed_seq_to`` or
``pad_full_seq_to``) for the messages. Inside, the fixed packed length has one name,
``fixed_total``, passed keyword-only; the packed length a layout resolves to is its ``total``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from nn_data.layout import PackSpec
from nn_data.extension import checks, layout_checks
from nn_data.nemo_rl.assertions import PackingAssertionError


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
    return _keys(value, SharedPrefixKeys, {"group_ids_key": "group_ids", "prefix_lengths_key": "prefix_lengths"},
                 name, "True (the batch keys 'group_ids' and 'prefix_lengths'), False / None (off) or a dict with "
                 "'group_ids_key' and / or 'prefix_lengths_key' naming the batch's keys")


class RolloutTreeKeys(NamedTuple):
    """Where a batch carries its rollout tree (``cfg["nn_data"]["rollout_tree"]``): ``parent`` the key of its
    ``[B]`` parents (the earlier rollout of the same microbatch each one shares its beginning with, or -1),
    ``branch_at`` the key of its ``[B]`` shared token counts (``nn_data.layout.tree_layout``'s fields)."""

    parent: str = "parent"
    branch_at: str = "branch_at"


class FoundTreeKeys(RolloutTreeKeys):
    """:class:`RolloutTreeKeys` of ``cfg["nn_data"]["rollout_tree"] = "find"``: the keys the sharding planner
    writes the tree it found under; a microbatch without them (no sharding planner) has its tree found from its
    own token ids in ``process_microbatch``."""

    __slots__ = ()


#: ``cfg["nn_data"]["rollout_tree"] = FIND``: the sharding planner finds each global batch's tree from its token
#: ids (:func:`nn_data.planning.find_rollout_tree`) and writes it to the batch under :class:`RolloutTreeKeys`' keys.
FIND = "find"


def rollout_tree_keys(value, name: str = "cfg['nn_data']['rollout_tree']") -> Optional[RolloutTreeKeys]:
    """``value`` as :class:`RolloutTreeKeys`: None or False -> None (off); True or ``"find"`` -> the default keys
    (``"parent"``, ``"branch_at"``; with ``"find"`` :class:`FoundTreeKeys`: the sharding planner writes them,
    :data:`FIND`); a mapping
    with ``"parent_key"`` and / or ``"branch_at_key"`` -> those keys; a :class:`RolloutTreeKeys` as it is.
    Anything else: :class:`PackingError` naming ``name``. Example: ``{"parent_key": "up"}`` -> ``("up", "branch_at")``."""
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
        keys of the group ids and prefix lengths); normalised to :class:`SharedPrefixKeys` or None: the
        depth-1 spelling of ``rollout_tree``.
    ``rollout_tree``: every shared prefix of a rollout tree packed once, at any depth
        (:func:`rollout_tree_keys`: True, ``"find"`` or the batch keys of ``parent`` and ``branch_at``);
        normalised to :class:`RolloutTreeKeys` or None. Not with ``shared_prefix`` (one spelling).
    ``kv_capacity``: the run's length ``K`` of a shared-prefix or rollout-tree microbatch's key/value
        buffer at CP 1 (``TreeRecord.kv``, for TransformerEngine's THD attention), one int for every
        microbatch; required under a fixed packed length (``pad_full_seq_to``). Unset (no fixed ``T``), each
        microbatch's buffer is exactly its need. A microbatch needing more (``T`` plus the path tokens
        before its nodes) is refused naming its need. Needs ``shared_prefix`` or ``rollout_tree``; at least
        ``pad_full_seq_to``; unused under CP (no buffer).

    Built from a config with :meth:`from_cfg` (``cfg["nn_data"]``, docs/nemo-rl.md, "nn_data options").
    """

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
        """The rollout-tree spelling in use: :class:`SharedPrefixKeys` (the GRPO star), :class:`RolloutTreeKeys`, or
        None (no shared prefix)."""
        return self.shared_prefix if self.shared_prefix is not None else self.rollout_tree

    def fixed_total(self, given: Optional[int], name: str = "pad_full_seq_to") -> Optional[int]:
        """The run-level ``pad_full_seq_to`` when set (a ``given`` above it raises), else ``given``.
        Example: run-level 8192, given 6144 (a step's longest bin) or None -> 8192."""
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


def refuse_unknown_keys(given: Mapping, valid: Sequence[str], where: str) -> None:
    """:class:`PackingError` for the first key of ``given`` outside ``valid``, naming it, the nearest valid key
    (a misspelling or an old spelling would otherwise be ignored: the run goes on without the option) and the
    valid keys. Example: ``{"paralelism": p}`` in ``sequence_packing_args`` -> ``"sequence_packing_args has an
    unknown key 'paralelism' (did you mean 'parallelism'?); valid keys: [...]"``."""
    for key in given:
        if key not in valid:
            near = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise PackingAssertionError(f"{where} has an unknown key {key!r}{hint}; valid keys: {sorted(valid)}")


@dataclasses.dataclass(frozen=True)
class DropInSpec(PackSpec):
    """The layout's :class:`~nn_data.layout.PackSpec` and the CP size the drop-in packs and shards for in one
    call (``cp_size``; it checks each segment splits into ``2*cp_size`` chunks where it lays out the lengths)."""

    _: dataclasses.KW_ONLY
    cp_size: int = 1

    def __post_init__(self):
        super().__post_init__()
        checks.check_cp(self.cp_size)


def nemo_rl_spec(m: int, p: int, *, fixed_total: Optional[int], cp_rank: int, cp_size: int, name: str) -> DropInSpec:
    """NeMo-RL's packing arguments as a :class:`DropInSpec`, with ``cp_rank`` checked
    against ``cp_size`` and the fixed packed length checked under the caller's spelling of it (``name``:
    ``pad_packed_seq_to`` or ``pad_full_seq_to``); checked once per distinct configuration (a training run
    repeats a few), an unhashable argument uncached."""
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
