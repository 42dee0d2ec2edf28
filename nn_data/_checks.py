"""The argument and metadata checks that know nothing of the layout, each written once, with one wording.

Python ints, tensor kinds, shapes, dtypes and devices (``docs/design.md``, "Validation"): free, they
run in ``__init__`` or at trace time and never touch tensor data. Every check of a layout rule (the
packed-length limits, ``T`` divisible by ``2C``) and every data check is
:mod:`nn_data.layout.checks`'.
"""

from __future__ import annotations

from typing import Optional

import torch

from nn_data.errors import PackingError

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

def dims(t: torch.Tensor) -> tuple:
    """``t.shape`` as plain ints, for error messages. Error paths only: while ``torch.compile``
    traces, ``int()`` of a symbolic size specialises it, which is fine right before a raise (an
    f-string of the symbolic size itself is not supported by dynamo)."""
    return tuple(int(d) for d in t.shape)


def positive_int(name: str, value, *, allow_none: bool = False) -> Optional[int]:
    """Return ``value`` if it is an int >= 1 (or None when allowed), else raise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        valid = "an int >= 1" + (" or None" if allow_none else "")
        raise PackingError.about(name, f"{name}={value!r} is invalid; expected {valid}")
    return value


def row_length(name: str, value, *, allow_none: bool = False) -> Optional[int]:
    """Return ``value`` if it is an int >= 0 (a row length ``S``; 0 is an empty row), or None when
    allowed, else raise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        valid = "an int >= 0" + (" or None" if allow_none else "")
        raise PackingError(f"{name}={value!r} is invalid; expected {valid}")
    return value


def check_cp(cp_size, cp_rank=None) -> None:
    """Validate a context-parallel size and, when given, a rank in ``[0, cp_size)``."""
    positive_int("cp_size", cp_size)
    if cp_rank is None:
        return
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise PackingError(
            f"cp_rank={cp_rank!r} is invalid; expected an int in [0, {cp_size}) for cp_size={cp_size}"
        )


def check_int_vector(name: str, t, length: Optional[int] = None, why: str = "") -> None:
    """``t`` must be a 1-D integer tensor (of ``length`` entries when given; ``why`` says where that
    count comes from, for the message)."""
    if not isinstance(t, torch.Tensor):
        raise PackingError(f"{name} must be a 1-D integer torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype not in _INT_DTYPES:
        raise PackingError(f"{name} must be a 1-D integer tensor, got shape {dims(t)} and dtype {t.dtype}")
    if length is not None and t.shape[0] != length:
        raise PackingError(f"{name} has {int(t.shape[0])} entries; expected {int(length)}{why}")


def check_boundaries_for(lengths_name: str, lengths: torch.Tensor, name: str, bounds) -> None:
    """``bounds`` (``cu_seqlens_padded``) must have one entry more than ``lengths`` (``seq_lengths``);
    when it has two fewer, the two were most likely passed in each other's place, and the message says so.

    Example: seq_lengths ``[0, 4, 8]`` (3 entries) with cu_seqlens_padded ``[4, 4]`` -> "has 2 entries;
    expected 4 (B + 1 for the B = 3 entries of seq_lengths); seq_lengths has one entry more than
    cu_seqlens_padded: were the two swapped?".
    """
    rows = lengths.shape[0]
    hint = ""
    if isinstance(bounds, torch.Tensor) and bounds.dim() == 1 and bounds.shape[0] + 1 == rows:
        hint = f"; {lengths_name} has one entry more than {name}: were the two swapped?"
    check_int_vector(name, bounds, rows + 1, f" (B + 1 for the B = {int(rows)} entries of {lengths_name}){hint}")


def as_int_vector(name: str, value, length: Optional[int] = None) -> torch.Tensor:
    """``value`` (a tensor, list, tuple or numpy array) as a 1-D integer tensor, refusing anything
    that is not integers (``[1.5, 2, 3]`` is never truncated). A non-tensor becomes a CPU tensor.

    Raises :class:`PackingError` naming ``name`` and the value when it is not integers, not 1-D,
    or not ``length`` entries long.
    """
    if not isinstance(value, torch.Tensor):
        try:
            host = value.tolist() if hasattr(value, "tolist") else list(value)  # sync: none, host data (numpy/list)
            converted = torch.as_tensor(host)
        except (TypeError, ValueError, RuntimeError) as err:
            raise PackingError(f"{name}={value!r} is invalid; expected integer lengths ({err})") from None
        if converted.dtype not in _INT_DTYPES and converted.numel():
            raise PackingError(
                f"{name}={value!r} is invalid: not all integers; expected integer lengths (a 1-D integer "
                "tensor, or a list, tuple or numpy array of ints); nothing is rounded or truncated"
            )
        value = converted.to(torch.int64)
    check_int_vector(name, value, length)
    return value


def check_min_dims(name: str, t, ndim: int, shape: str) -> None:
    """``t`` must be a tensor with at least ``ndim`` dims (``shape`` names them: ``"[B, S, *]"``)."""
    if not isinstance(t, torch.Tensor):
        raise PackingError(f"{name} must be a torch.Tensor {shape}, got {type(t).__name__}")
    if t.dim() < ndim:
        raise PackingError(f"{name} must have at least {ndim} dims {shape}, got shape {dims(t)}")


def check_packed(name: str, t) -> None:
    """A packed tensor is ``[1, T, *]``."""
    check_min_dims(name, t, 2, "[1, T, *]")
    if t.shape[0] != 1:
        raise PackingError(f"{name} must be [1, T, *] (a leading dim of 1), got shape {dims(t)}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """Every given tensor must live on one device."""
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise PackingError(f"tensors must be on one device, got {where}")


def check_num_rows(num_rows, capacity: int) -> None:
    """``num_rows`` is None or a 0-d integer tensor (data, so compile does not specialise on it)."""
    if num_rows is None:
        return
    if not isinstance(num_rows, torch.Tensor) or num_rows.dim() != 0 or num_rows.dtype not in _INT_DTYPES:
        raise PackingError(
            f"num_rows={num_rows!r} is invalid; expected None or a 0-d integer tensor in [0, {capacity}] "
            "(a tensor, not a Python int, so a compiled op does not recompile for each row count)"
        )


#: Between the messages of the checks in the one string ``nn_data::device_check`` takes: printable ASCII that
#: no message holds (inductor's C++ wrapper writes the string into a C++ literal line by line, so no control
#: character: ``str.splitlines`` breaks at the ASCII separators too).
_SEPARATOR = " || "


def _device_check(flags: torch.Tensor, messages: str) -> None:
    """Raise ``RuntimeError`` with the message of the first False flag of ``flags [N]`` (one per check;
    ``messages``: theirs, joined by :data:`_SEPARATOR`, split only after a failure). An operator of its own
    (``nn_data::device_check``) so that inductor calls it from its wrapper, between kernels: never inside a
    generated kernel's parallel region (where a C++ throw ends the process); with the Python wrapper the
    messages travel as a Python string (any character; inductor's C++ wrapper, ``cpp_wrapper``, writes them
    into a C++ literal). Defined with ``torch.library.Library`` and one composite kernel rather than
    ``torch.library.custom_op``: a call then runs this function straight from the dispatcher, without the
    Python autograd and dispatch layers ``custom_op`` wraps around it (the op has no output to differentiate)."""
    if flags.device.type != "cpu":
        torch._assert_async(flags.all(), messages.replace(_SEPARATOR, "; "))
        return
    try:
        torch._assert_async(flags.all(), "")
    except RuntimeError:
        raise RuntimeError(messages.split(_SEPARATOR)[first_index(~flags)]) from None  # error path only


_LIBRARY = torch.library.Library("nn_data", "FRAGMENT")  # kept alive: the op lives as long as the module
_LIBRARY.define("device_check(Tensor flags, str messages) -> ()")
_LIBRARY.impl("device_check", _device_check, "CompositeExplicitAutograd")
torch.library.register_fake("nn_data::device_check", lambda flags, messages: None, lib=_LIBRARY)
torch.fx.node.has_side_effect(torch.ops.nn_data.device_check.default)  # kept without users (returns nothing)


class DeviceChecks:
    """The data checks of one call, folded into one validity flag per check and **one** check on the
    device: :meth:`add` each condition, then :meth:`check` once. Under ``torch.compile`` that is one
    ``nn_data::device_check`` call (a catchable ``RuntimeError`` on the CPU whatever the thread count);
    the message is the first failing check's, picked only after a failure. On CUDA a failed check is a
    device assert, fatal to the process by design (``docs/compile-contract.md``, "Device-side checks:
    catchable on the CPU, fatal on CUDA", says what to do instead).

    A message is built on every call of the compiled op, so it may format configuration ints but never a
    size taken from a tensor's shape: under ``torch.compile`` that size may be symbolic, and formatting it
    either guards on its value (one graph per value) or fails to trace. Name such sizes instead
    (``S = x.shape[1]``).

    Example::

        found = DeviceChecks()
        found.add(lengths >= 0, "nn_data.op: every seq_lengths value must be >= 0")   # [B] -> one flag
        found.add(total <= limit, "nn_data.op: the packed total exceeds pad_full_seq_to")
        found.check()   # one device check; raises the first failing message
    """

    def __init__(self):
        self.flags: list = []
        self.messages: list = []

    def add(self, cond: torch.Tensor, message: str) -> None:
        """``cond`` (a bool tensor of any shape) must hold everywhere; reduced to one 0-d flag here."""
        self.flags.append(cond if cond.dim() == 0 else cond.all())
        self.messages.append(message)

    def check(self) -> None:
        """One device check of every flag added (none: nothing runs)."""
        if self.flags:
            torch.ops.nn_data.device_check(torch.stack(self.flags), _SEPARATOR.join(self.messages))


def device_assert(cond: torch.Tensor, message: str, into: Optional[DeviceChecks] = None) -> None:
    """Assert ``cond`` (a bool tensor of any shape) on the device without a host sync: added to ``into``
    (a :class:`DeviceChecks` the caller checks once), or checked at once alone.

    Example: ``device_assert((lengths >= 0).all(), "nn_data.op: every seq_lengths value must be >= 0")``.
    """
    if into is not None:
        into.add(cond, message)
        return
    alone = DeviceChecks()
    alone.add(cond, message)
    alone.check()


def check_packed_ids(name: str, t) -> None:
    """Packed token ids are an integer ``[1, T]`` tensor."""
    check_packed(name, t)
    if t.dim() != 2 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise PackingError(f"{name} must be integer token ids [1, T], got shape {tuple(t.shape)} "
                                   f"and dtype {t.dtype}")


def check_row_capacity(rows: int, capacity: int, name: str = "capacity", where: Optional[str] = None) -> None:
    """A batch of ``rows`` rows must fit the row capacity the caller set as ``name`` (``where``: how to
    raise it, when not an argument, e.g. ``cfg['nn_data']['row_capacity']``)."""
    if rows > capacity:
        raise PackingError(f"the batch has {rows} rows, more than {name}={capacity}; raise {where or name} to at "
                           f"least {rows}")


def check_float_logits(name: str, t, shape: str, ndim: int) -> None:
    """``t`` must be a floating-point tensor with exactly ``ndim`` dims (``shape`` names them)."""
    if not isinstance(t, torch.Tensor) or t.dim() != ndim or not t.dtype.is_floating_point:
        got = f"shape {dims(t)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise PackingError(f"{name} must be floating-point logits {shape}, got {got}")


def check_vocab_range(vocab_start_index, vocab_end_index, columns: int, tp_rank: int, *,
                      against: str = "the logits", unit: str = "columns") -> None:
    """The vocabulary slice of a tensor-parallel rank: ``[tp_rank * Vt, (tp_rank + 1) * Vt)`` for
    ``Vt = columns``, the logits' last dim or the output weight's rows (megatron-core's vocab-parallel split)."""
    start, end = tp_rank * columns, (tp_rank + 1) * columns
    if (vocab_start_index, vocab_end_index) != (start, end):
        raise PackingError(
            f"vocab_start_index={vocab_start_index!r}, vocab_end_index={vocab_end_index!r} do not match "
            f"{against}: with {columns} vocabulary {unit} on tensor-parallel rank {tp_rank} they must be "
            f"{start} and {end} (tp_rank * V/TP and (tp_rank + 1) * V/TP)"
        )


def check_output_head(hidden_name: str, hidden, weight_name: str, weight, hidden_shape: str) -> None:
    """Hidden states (3-D, ``hidden_shape`` names the dims) and an output weight ``[V/TP, H]``: floating
    point, one dtype, one device, the weight's columns the hidden size."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.dtype.is_floating_point:
        got = f"shape {dims(hidden)} and dtype {hidden.dtype}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise PackingError(f"{hidden_name} must be floating-point hidden states {hidden_shape}, got {got}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        got = f"shape {dims(weight)} and dtype {weight.dtype}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise PackingError(f"{weight_name} must be the output layer's floating-point weight [V/TP, H], got {got}")
    if weight.shape[1] != hidden.shape[-1]:
        raise PackingError(
            f"{weight_name} has shape {dims(weight)} but {hidden_name} {dims(hidden)} have hidden size "
            f"H={hidden.shape[-1]}; pass the output layer's weight [V/TP, {hidden.shape[-1]}] (megatron-core's "
            "output_layer.weight, or the embedding weight when they are tied)"
        )
    if weight.dtype != hidden.dtype:
        raise PackingError(f"{weight_name} is {weight.dtype} but {hidden_name} are {hidden.dtype}; the output "
                           "layer's matmul takes one dtype (cast one of them)")
    check_same_device(**{hidden_name: hidden, weight_name: weight})


def check_token_share(name: str, rows: int, total: int, cp_size: int, tp_size: int, sequence_parallel: bool) -> None:
    """``rows`` hidden states must be this rank's share of the ``T = total`` packed tokens: ``T/C``, or
    ``T/(C*TP)`` with sequence parallelism."""
    split = cp_size * (tp_size if sequence_parallel else 1)
    if total % split or rows != total // split:
        share = "T/(C*TP)" if sequence_parallel and tp_size > 1 else "T/C"
        raise PackingError(
            f"{name} hold {rows} tokens but this rank's share of the T={total} packed tokens is {share} = "
            f"{total}/{split}{f' = {total // split}' if total % split == 0 else ' (not a whole number)'} "
            f"(cp_size={cp_size}, tp_size={tp_size}, sequence_parallel={sequence_parallel}); pass this rank's "
            "zigzag shard of the hidden states"
        )


def check_temperature(temperature) -> float:
    """A sampling temperature is a positive finite number (the logits are divided by it)."""
    value = float(temperature) if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) else None
    if value is None or not 0 < value < float("inf"):
        raise PackingError(f"temperature={temperature!r} is invalid; expected a number > 0 (the logits are divided "
                           "by it; 1.0 leaves them as they are)")
    return value


def check_top_k(top_k: Optional[int], vocab: int) -> None:
    """A top-k filter keeps at most the whole vocabulary."""
    if top_k is not None and top_k > vocab:
        raise PackingError(f"sampling_params.top_k={top_k} is invalid for a vocabulary of {vocab} tokens; "
                           f"expected top_k <= {vocab} (or None / -1 for no top-k filtering)")


def check_even_shard(name: str, local: int, cp_size: int, what: str) -> None:
    """A zigzag shard of one sequence is two equal chunks: ``local`` positions must be even under CP."""
    if cp_size > 1 and local % 2:
        raise PackingError(
            f"{name} holds {local} positions per {what} on this rank; a context-parallel shard is two equal "
            f"chunks (ranks r and 2*cp_size-1-r of 2*cp_size={2 * cp_size}), so it must be even"
        )


def check_logprob_target(target, pre_rolled: bool, local_total: int, total: int) -> None:
    """The packed log-prob target: the full packed ids ``[1, T]``, or pre-rolled this rank's ``[1, T/C]``."""
    want, what = (local_total, "this rank's rolled, CP-sharded targets") if pre_rolled else (total, "the packed ids")
    check_packed_ids("target", target)
    if target.shape[1] != want:
        raise PackingError(
            f"target has shape {dims(target)}; with target_is_pre_rolled={pre_rolled} it must be {what} "
            f"[1, {want}] (the logits cover T={total} packed positions, {local_total} on this rank)"
        )


def check_row_target(target, rows: int, padded_len: int) -> None:
    """Unpacked targets ``[B, S]`` (integer ids) for logits of ``B`` rows covering ``padded_len >= S`` positions."""
    if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.is_floating_point() \
            or target.is_complex() or target.dtype == torch.bool:
        got = f"shape {dims(target)} and dtype {target.dtype}" if isinstance(target, torch.Tensor) else type(target).__name__
        raise PackingError(f"target must be integer token ids [B, S], got {got}")
    if target.shape[0] != rows or target.shape[1] > padded_len:
        raise PackingError(
            f"target has shape {dims(target)}; the logits hold {rows} rows of {padded_len} positions over the "
            f"context-parallel group (S // CP * cp_size), so target must be [{rows}, S] with S <= {padded_len}"
        )


def first_index(mask: torch.Tensor) -> int:
    """Index of the first True in a 1-D bool tensor (error path only: syncs)."""
    return int(torch.argmax(mask.to(torch.int8)).item())  # sync: error path only
