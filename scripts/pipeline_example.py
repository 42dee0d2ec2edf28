"""A real pipeline-parallel (PP = 2) run of a tiny megatron-core GPTModel on packed microbatches,
compared with the PP = 1 run and with every sequence run alone.

    python -m scripts.pipeline_example                      # from the repository root
    python -m scripts.pipeline_example --dtype float32
    python -m scripts.pipeline_example --vpp 2              # interleaved 1F1B, two virtual stages per rank
    python -m scripts.pipeline_example --vpp 2 --groups collection --experts 4   # Megatron-Bridge style

Two processes over gloo on 127.0.0.1 run megatron-core's own 1F1B schedule
(``get_forward_backward_func()`` with ``pipeline_model_parallel_size=2``): stage 0 holds the
embedding and the first half of the layers, stage 1 the rest and the output layer. With
``--vpp V`` each rank holds ``V`` model chunks of one layer each (virtual stage ``v`` of rank
``r`` is pipeline stage ``2v + r``) and megatron-core's interleaved 1F1B schedule runs them
(``batch_p2p_comm=False``: docs/pipeline.md); 8 microbatches then, the schedule wants a multiple
of PP. ``--groups collection`` builds the process groups as ``ProcessGroupCollection`` objects from a
``HyperCommGrid`` and hands them to the models, the schedule (with a ``P2PCommunicator``) and
nn_data (``pg_collection=``); megatron-core's ``parallel_state`` is never initialised.
``--experts E``: every MLP a mixture of ``E`` experts (megatron-core's MoE layer, its
``allgather`` token dispatcher; nn_data's padding mask goes to the router).
Microbatches with different numbers of sequences and lengths, one of them with no sequence at
all, are packed by nn_data (``PackedForward.prepare``, ``nn_data.adapters.pipeline_forward_step``)
to one constant ``T = pad_full_seq_to``, the shape every stage's receive buffer is allocated with. The same
processes then run the PP = 1 schedule on the whole model (same parameters, set from their
global names), and each sequence alone through megatron-core's stock unpacked path. The loss is
the sum of next-token cross-entropies over every valid token (``calculate_per_token_loss``).

Printed: per-microbatch losses of PP = 2 and PP = 1, and the largest differences of losses and
parameter gradients between PP = 2, PP = 1 and the per-sequence runs (float64 by default). It shows
exactness, not speed: nothing is timed.
"""

from __future__ import annotations

import argparse
import queue
import warnings
from datetime import timedelta

import torch
import torch.nn.functional as F

from nn_data.testing.dist import destroy_model_parallel_groups


VOCAB, SEQ_LEN = 97, 24
GROUPS = ("parallel_state", "collection")


def microbatches(count: int, multiple: int, seed: int = 1, empty: tuple = (3,)):
    """``count`` microbatches ``(input_ids [B, S], seq_lengths [B])`` of 1-4 rows, zero-length rows included;
    those at the positions in ``empty`` have no row at all (``B = 0``, as a PP stream may hold)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        if i in empty:
            out.append((torch.zeros(0, SEQ_LEN, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
            continue
        rows = 1 + i % 4
        lengths = torch.randint(0, SEQ_LEN + 1, (rows,), generator=gen)
        lengths[0] = max(int(lengths[0]), 2)  # at least one token pair per microbatch
        ids = torch.randint(1, VOCAB, (rows, SEQ_LEN), generator=gen)
        out.append((torch.where(torch.arange(SEQ_LEN) < lengths[:, None], ids, 0), lengths))
    return out


def token_loss(logits: torch.Tensor, input_ids: torch.Tensor, seq_lengths: torch.Tensor):
    """Sum of next-token cross-entropies over every valid pair of ``logits [B, S, V]``; ``(loss, pairs)``."""
    s = torch.arange(input_ids.shape[1] - 1)
    valid = s < (seq_lengths[:, None] - 1)  # [B, S-1]
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")  # [B, S-1]
    return (ce * valid.to(ce.dtype)).sum(), valid.sum()


def _schedule(chunks, mbs, total: int, multiple: int, groups=None):
    """megatron-core's schedule over ``mbs`` for this rank's model ``chunks`` (one per virtual stage;
    the interleaved 1F1B schedule for more than one): per-microbatch losses (last stage; [] elsewhere)
    and ``{global name: grad}``. ``groups``: a ``ProcessGroupCollection`` (the schedule then gets it and
    a ``P2PCommunicator`` over its ``pp`` group, as a program without ``parallel_state`` passes them),
    else megatron-core's ``parallel_state``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nn_data.adapters import MegatronGPTAdapter, pipeline_forward_step
    from nn_data.models.tiny_megatron import global_parameter_names
    from nn_data.packed_forward import PackedForward

    adapters = [MegatronGPTAdapter(m) for m in chunks]
    # Every chunk packs the same microbatches the same way; the pack carries no state between calls.
    packing = PackedForward(adapters[0], pad_individual_seqs_to_multiple_of=multiple, pad_full_seq_to=total,
                            make_packed_seq_params=True, pg_collection=groups)
    step = pipeline_forward_step(packing, token_loss, pg_collection=groups)
    for m in chunks:
        m.zero_grad(set_to_none=True)
    many = len(chunks) > 1
    kwargs = dict(forward_step_func=step, data_iterator=[iter(mbs) for _ in chunks] if many else iter(mbs),
                  model=adapters, num_microbatches=len(mbs), seq_length=total, micro_batch_size=1, forward_only=False)
    if groups is None:
        schedule = get_forward_backward_func()
    else:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        pp = groups.pp.size()
        schedule = get_forward_backward_func(pp_size=pp, vp_size=len(chunks) if many else None)
        kwargs.update(pg_collection=groups, p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=chunks[0].config))
    reduced = schedule(**kwargs)
    grads = {}
    for m in chunks:
        names = global_parameter_names(m)
        grads.update({names[n]: p.grad.detach().clone() for n, p in m.named_parameters()})
    return [r["loss"] for r in reduced], grads, schedule.__name__


def _alone(model, mbs):
    """Each sequence alone (stock megatron-core path): per-microbatch loss sums and ``{name: grad}``."""
    from nn_data.models.tiny_megatron import forward_alone

    model.zero_grad(set_to_none=True)
    losses = []
    for ids, lengths, *_ in mbs:  # (a shared-prefix microbatch's prefix lengths and group ids: each rollout alone)
        loss = torch.zeros((), dtype=next(model.parameters()).dtype)
        for b, n in enumerate(lengths.tolist()):
            if n:
                logits = forward_alone(model, ids[b : b + 1, :n])  # [1, n, V]
                loss = loss + token_loss(logits, ids[b : b + 1, :n], lengths[b : b + 1])[0]
        if loss.requires_grad:  # an empty microbatch has nothing to differentiate
            loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


class PipelineGroups:
    """The process groups of one run, from megatron-core's ``parallel_state`` (``groups="parallel_state"``)
    or from explicit ``ProcessGroupCollection`` objects built from a ``HyperCommGrid`` with ``parallel_state``
    never initialised (``groups="collection"``, what Megatron-Bridge does)."""

    def __init__(self, kind: str):
        if kind not in GROUPS:
            raise ValueError(f"groups={kind!r}; expected one of {GROUPS}")
        self.kind, self.made = kind, []

    def set(self, pp: int, vpp: int):
        """Groups for PP ``pp`` (``vpp`` virtual stages): ``(collection or None, pp rank)``."""
        from megatron.core import parallel_state

        if self.kind == "parallel_state":
            destroy_model_parallel_groups(parallel_state)
            parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, create_gloo_process_groups=False,
                                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
            return None, parallel_state.get_pipeline_model_parallel_rank()
        from nn_data.models.tiny_megatron import grid_process_groups

        groups = grid_process_groups(pp=pp)
        self.made.append(groups)
        return groups, groups.pp.rank()

    def close(self) -> bool:
        """Undo the groups; whether megatron-core's ``parallel_state`` was initialised at the end."""
        from megatron.core import parallel_state

        from nn_data.models.tiny_megatron import destroy_process_groups

        initialised = parallel_state.model_parallel_is_initialized()
        destroy_model_parallel_groups(parallel_state)
        for groups in self.made:
            destroy_process_groups(groups)
        return initialised


def _stage_chunks(config, pp: int, vpp: int, pp_rank: int, groups, seed: int) -> list:
    """This PP rank's model chunks: virtual stage ``v`` of rank ``r`` holds layers of pipeline stage
    ``v * pp + r``; the first stage has the embedding, the last the output layer."""
    from nn_data.models.tiny_megatron import tiny_gpt_model

    return [tiny_gpt_model(config, pre_process=pp_rank == 0 and v == 0, post_process=pp_rank == pp - 1 and v == vpp - 1,
                           seed=seed, pg_collection=groups, vp_stage=v if vpp > 1 else None) for v in range(vpp)]


def _max_diff(a: dict, b: dict, names) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in names)


def compare(dtype: torch.dtype = torch.float64, count: int = None, multiple: int = 4, total: int = 112, seed: int = 0,
            *, vpp: int = 1, groups: str = "parallel_state", experts: int = 0, batches: list = None):
    """Run on every rank of a group of 2 (or 4: two pipelines side by side) processes: PP = 2 (``vpp``
    virtual stages per rank: megatron-core's interleaved 1F1B), PP = 1 and per-sequence; returns this
    rank's figures (``pp2_losses``/``pp1_losses`` on the last stage, max differences, ``bitwise``).
    ``count`` microbatches (default 7, 8 with ``vpp > 1``: the interleaved schedule wants a multiple
    of PP), the fourth empty; ``experts`` > 0: MoE layers (:func:`tiny_gpt_config`). ``batches``: these
    microbatches instead, e.g. shared-prefix ones ``(input_ids, seq_lengths, prefix_lengths, group_ids)``."""
    import torch.distributed as dist

    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

    count = count or (8 if vpp > 1 else 7)
    layers = 2 * vpp  # one layer per (stage, virtual stage) with PP = 2
    mbs = batches if batches is not None else microbatches(count, multiple)
    groups_of_run = PipelineGroups(groups)
    try:
        pp2, pp_rank = groups_of_run.set(2, vpp)
        config = tiny_gpt_config(dtype=dtype, pipeline=2, layers=layers, experts=experts,
                                 virtual_stages=vpp if vpp > 1 else None)
        chunks = _stage_chunks(config, 2, vpp, pp_rank, pp2, seed)
        last = pp_rank == 1
        pp2_losses, pp2_grads, schedule = _schedule(chunks, mbs, total, multiple, pp2)
        pp1, _ = groups_of_run.set(1, 1)
        whole = tiny_gpt_model(tiny_gpt_config(dtype=dtype, layers=layers, experts=experts), seed=seed,
                               pg_collection=pp1)
        pp1_losses, pp1_grads, _ = _schedule([whole], mbs, total, multiple, pp1)
        alone_losses, alone_grads = _alone(whole, mbs)
    finally:
        parallel_state_initialised = groups_of_run.close()
    mine = sorted(pp2_grads)
    out = dict(
        rank=dist.get_rank(), stage_parameters=mine, dtype=str(dtype).replace("torch.", ""), T=total, vpp=vpp,
        schedule=schedule,
        groups=groups, experts=experts, parallel_state_initialised=parallel_state_initialised,
        rows=[int(m[1].shape[0]) for m in mbs], tokens=[int(m[1].sum()) for m in mbs],
        grads_pp2_vs_pp1=_max_diff(pp2_grads, pp1_grads, mine),
        grads_bitwise=all(torch.equal(pp2_grads[n], pp1_grads[n]) for n in mine),
        grads_pp1_vs_alone=_max_diff(pp1_grads, alone_grads, pp1_grads),
        pp1_losses=[float(x) for x in pp1_losses], alone_losses=[float(x) for x in alone_losses],
        losses_pp1_vs_alone=max(abs(float(a) - float(b)) for a, b in zip(pp1_losses, alone_losses)),
    )
    if last:
        out.update(pp2_losses=[float(x) for x in pp2_losses],
                   losses_pp2_vs_pp1=max(abs(float(a) - float(b)) for a, b in zip(pp2_losses, pp1_losses)),
                   losses_bitwise=all(torch.equal(a, b) for a, b in zip(pp2_losses, pp1_losses)))
    return out


def _rank_main(rank: int, port: int, options: dict, results) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        results.put(compare(getattr(torch, options["dtype"]), vpp=options["vpp"], groups=options["groups"],
                            experts=options["experts"]))
    finally:
        dist.destroy_process_group()


def report(per_rank: list) -> str:
    """The comparison as printed text."""
    last = next(r for r in per_rank if "pp2_losses" in r)
    schedule = "1F1B" if last["vpp"] == 1 else f"interleaved 1F1B, {last['vpp']} virtual stages per rank"
    lines = [f"PP=2 ({schedule}: megatron-core's {last['schedule']}), groups from {last['groups']}"
             + (f", MoE of {last['experts']} experts" if last["experts"] else "")
             + f"; parallel_state initialised: {last['parallel_state_initialised']}",
             f"{len(last['rows'])} microbatches packed to T = {last['T']} ({last['dtype']}); "
             f"rows {last['rows']}, real tokens {last['tokens']}",
             f"{'mb':>3} {'loss PP=2':>22} {'loss PP=1':>22} {'loss alone':>22}"]
    for i, (a, b, c) in enumerate(zip(last["pp2_losses"], last["pp1_losses"], last["alone_losses"])):
        lines.append(f"{i:>3} {a:>22.15f} {b:>22.15f} {c:>22.15f}")
    lines.append(f"losses   PP=2 vs PP=1: max |diff| {last['losses_pp2_vs_pp1']:.1e} "
                 f"(bit for bit: {last['losses_bitwise']}); PP=1 vs alone: {last['losses_pp1_vs_alone']:.1e}")
    for r in sorted(per_rank, key=lambda r: r["rank"]):
        lines.append(f"stage {r['rank']} ({len(r['stage_parameters'])} parameters) gradients PP=2 vs PP=1: max |diff| "
                     f"{r['grads_pp2_vs_pp1']:.1e} (bit for bit: {r['grads_bitwise']})")
    lines.append(f"all gradients PP=1 vs each sequence alone: max |diff| {last['grads_pp1_vs_alone']:.1e}")
    lines.append("shown: exactness (packed microbatches through megatron-core's PP=2 schedule give PP=1's losses and "
                 "gradients,\n  and each sequence's alone); nothing is timed: two CPU processes over gloo say nothing "
                 "of a GPU pipeline's speed")
    return "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--vpp", type=int, default=1, choices=(1, 2, 3),
                    help="virtual pipeline stages per rank (> 1: megatron-core's interleaved 1F1B; default 1)")
    ap.add_argument("--groups", choices=GROUPS, default="parallel_state",
                    help="where the process groups come from: megatron-core's parallel_state (default) or "
                         "ProcessGroupCollections built from a HyperCommGrid, parallel_state never initialised")
    ap.add_argument("--experts", type=int, default=0, help="MoE layers of this many experts (default 0: dense)")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    options = dict(dtype=args.dtype, vpp=args.vpp, groups=args.groups, experts=args.experts)
    procs = [ctx.Process(target=_rank_main, args=(r, port, options, results)) for r in range(2)]
    for p in procs:
        p.start()
    per_rank = []
    try:
        while len(per_rank) < len(procs):
            try:
                per_rank.append(results.get(timeout=2))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a rank failed (its traceback is above)") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    print(report(per_rank))
    return per_rank


if __name__ == "__main__":
    main()
