"""Kept importable: ``BatchedDataDict`` lives in :mod:`nn_data.megatron_data.batched_data_dict`."""

from nn_data.megatron_data.batched_data_dict import BatchedDataDict, SlicedDataDict  # noqa: F401
