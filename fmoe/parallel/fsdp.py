"""FSDP2 that knows MoE, and the one call that parallelises fmoe's reference model.

    meshes = build_meshes(tp=2, ep=4)
    parallelize(model, meshes, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

Order (torchtitan's): tensor parallel with sequence parallelism (attention, dense MLPs,
shared experts split over tp; between them the residual stream, norms and MoE blocks on
each rank's T/tp tokens: fmoe.parallel.tensor) -> expert parallel (expert weights sharded
Shard(0) over ep and over F by etp, their optional biases with them; the MoE blocks get an
ExpertParallel dispatcher) ->
FSDP2. FSDP units, innermost first:

    MoE.experts   over the expert data mesh edp (the ranks holding the same experts)
    MoE.shared    over the dense data mesh
    MoE           (router, shared gate) over the dense data mesh, never cast: the router
                  stays float32 under mixed precision; the expert_bias buffer is left
                  alone by FSDP (float32, replicated, updated identically on every rank)
    HyperConnection  (hyper-connections' weights, the blocks' and the head's) and
    ResidualGate  (residual gates') over the dense data mesh, never cast: float32 like the router
    each Block    over the dense data mesh (attention, norms, dense MLP)
    the model     embedding, head, final norm, MTP projections: gathered from its forward
                  to its backward (torchtitan's root); a forward whose backward never
                  comes (a dropped loss) leaves it gathered until a step of an optimizer
                  of its parameters, which reshards it (a torch.optim global step
                  pre-hook per model; an update by hand, outside an optimizer's step,
                  does not). parameters() gives the gathered copies meanwhile;
                  state_dict() (and fmoe.train.checkpoint) reshards first.

Every unit is sharded by shard_unit, which first hooks its forward to pass on an output
that is an autograd view (DTensor's to_local at the edges of a tensor-parallel region, a
reshape) as a tensor of its own, with no copy: FSDP2's pre-backward hook on a view is lost to
any in-place op on it (and FSDP2 warns of every such output); on a tensor of its own it stays.
It also hooks the unit's pre-backward on the tensors of the TensorDicts it returns (the
model's outputs, a MoE layer's stats), as FSDP2 does on plain containers' (tuples, lists,
dicts), so that any order of backwards one process runs gathers a resharded unit again: a
backward after the root was resharded, a loss of a MoE layer's stats alone.

No unit casts its forward inputs (cast_forward_inputs=False): the model's only inputs are
token ids, every activation already comes out of a param_dtype computation, and the
float32 RoPE tables of the micro-batch's context and the float32 gate weights of the
routes must stay float32.

The dense data mesh is dp_shard, or (dp_replicate, dp_shard) for HSDP. Gradients are
summed, not averaged, over data ranks (gradient divide factor 1): the train loop divides
the loss by the step's global count of valid tokens, so gradients do not depend on how the
tokens are split over ranks and micro-batches (DESIGN.md). The train loop reduces every
micro-batch's gradients; a loop of your own that turns that off for some
(set_requires_gradient_sync(False), FSDP2's accumulation) with param_dtype bf16 and
reduce_dtype float32 must reach every parameter of a unit in each micro-batch's backward
(the LM loss with its MTP terms, not a stats loss alone): FSDP2 then holds float32 sums for
some and not for others, and its next reduce-scatter fails ("expects uniform gradient
dtype"), as plain fully_shard does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Iterator, Optional

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fmoe.layers import EXPERT_BIASES
from fmoe.model import Attention, Block, GroupedExperts, HyperConnection, LinearAttention, MoE, ResidualGate, Transformer
from fmoe.ops.backend import local_tensor
from fmoe.ops.checks import check_positive_int
from fmoe.parallel.context import ContextCapacityDrop, ContextParallel
from fmoe.parallel.expert import ExpertParallel
from fmoe.parallel.mesh import Meshes
from fmoe.parallel.tensor import tensor_parallel_plan


def dense_data_mesh(meshes: Meshes):
    """FSDP2's mesh for dense parameters: the ranks holding different tokens of the same
    dense shard, dp_shard (1-D), or (dp_replicate, dp_shard) for HSDP; with cp > 1 the cp
    ranks join the shard axis (dp_shard x cp flattened, "dp_shard_cp", as torchtitan does),
    so their partial gradients are summed too."""
    if meshes.cp == 1:
        return meshes.dense["dp_shard"] if meshes.dp_replicate == 1 else meshes.dp_mesh
    flat = meshes.dense["dp_shard", "cp"]._flatten("dp_shard_cp")
    return flat if meshes.dp_replicate == 1 else meshes.dense["dp_replicate", "dp_shard_cp"]


def shard_experts(moe: MoE, meshes: Meshes, *, max_tokens: Optional[int] = None) -> None:
    """Replace a MoE block's expert stacks by DTensors over the expert mesh's (ep, etp):
    experts Shard(0) over ep, the FFN dim over etp (w_gate / w_up dim 2, w_down dim 1; the
    optional expert biases Shard(0) over ep, b_gate / b_up dim 1 over etp, b_down
    replicated over etp), and
    give the experts an ExpertParallel dispatcher. Under tp > 1 the MoE block holds this
    rank's T/tp tokens already (sequence parallel, tensor_parallel_plan), and under cp > 1
    its cp share: the dispatcher splits nothing over tp (token_shards = tp cp sizes its
    capacity layout by the whole micro-batch); max_tokens: the dispatcher's (parallelize)."""
    E, ep, etp = moe.cfg.n_experts, meshes.ep, meshes.etp
    ffn = moe.experts.w_up.shape[-1]
    if E % ep:
        raise ValueError(f"ep: n_experts = {E} is not divisible by ep = {ep}")
    if ffn % etp:
        raise ValueError(f"etp: the expert FFN size {ffn} is not divisible by etp = {etp}")
    mesh = meshes.expert["ep", "etp"]
    # the biases go with their experts: b_gate / b_up with their F columns over etp, b_down
    # (added after the F-shards' partial sums) replicated over etp (ExpertParallel adds
    # b_down / etp on each etp rank and sums its gradient over them)
    biases = {n: dim for n, dim in zip(EXPERT_BIASES, (1, 1, None)) if getattr(moe.experts, n, None) is not None}
    for name, ffn_dim in (("w_gate", 2), ("w_up", 2), ("w_down", 1), *biases.items()):
        param = getattr(moe.experts, name)
        if param is None:  # experts without a gate (no w_gate)
            continue
        placements = [Shard(0), Replicate() if ffn_dim is None else Shard(ffn_dim)]
        sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
        moe.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    moe.experts.dispatcher = ExpertParallel(meshes.axis("ep"), etp_mesh=meshes.axis("etp"), token_shards=meshes.tp * meshes.cp,
                                            max_tokens=max_tokens)


class _Owned(torch.autograd.Function):
    """t's values as a tensor that is not an autograd view of t (t.detach(): the same storage,
    no copy); the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, t):
        return t.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _owned(out):
    """`out` (a tensor, or tuples of them: what fmoe's units return; anything else, e.g. their
    stats' TensorDicts, as it is) with every tensor that requires grad and is an autograd view
    replaced by _Owned's tensor of its own. Under torch.compile,
    `out` itself: the compiled graphs stay as they were (with the hook traced they were more),
    and what a compiled unit hands FSDP2 is the compiler's, not a view (no warning in the
    pipeline's compiled stages under tp)."""
    if torch.compiler.is_compiling():
        return out
    if isinstance(out, torch.Tensor):
        return _Owned.apply(out) if out.requires_grad and out._base is not None else out
    if type(out) is tuple:
        return tuple(map(_owned, out))
    return out


def shard_unit(module: nn.Module, **kwargs) -> nn.Module:
    """fully_shard(module, **kwargs), after a forward hook that passes on each output that is
    an autograd view as a tensor of its own (module docstring). The hook runs after the
    module's earlier forward hooks (a tensor-parallel region's) and before FSDP2's; a hook
    after FSDP2's hooks its pre-backward on the tensors of the TensorDicts the unit returns
    (_regather_for_backward)."""
    module.register_forward_hook(lambda m, args, out: _owned(out))
    fully_shard(module, **kwargs)
    module.register_forward_hook(_regather_for_backward)
    return module


def apply_fsdp(
    model: nn.Module, meshes: Meshes, *, param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = True,
) -> None:
    """fully_shard the model's units (module docstring) in place; gradients summed over ranks.

    With tp > 1 the routed experts' gradients are summed over edp, which holds the tp ranks:
    each MoE must run on its rank's T/tp token shard (tensor_parallel_plan applied first) and
    its experts must not sum over tp themselves (the plan's GroupedExperts entries left out,
    as parallelize leaves them); either way the sum would be tp times too large, so such a
    model is refused (ValueError)."""
    if meshes.tp > 1:
        for name, module in model.named_modules():
            if not isinstance(module, MoE):
                continue
            if module.sequence_parallel is None:
                raise ValueError(f"model: MoE {name!r} runs every token on each of the tp = {meshes.tp} ranks (no sequence-parallel plan "
                                 "on it), and FSDP2 sums its routed experts' gradients over edp, which holds the tp ranks: they would be "
                                 f"{meshes.tp} times too large; apply fmoe.parallel.tensor_parallel_plan first (each MoE then takes a T/tp "
                                 "token shard), call fmoe.parallel.parallelize, or build the meshes with tp = 1")
            if getattr(module.experts, "sequence_parallel", None) is not None:
                raise ValueError(f"model: {name}.experts sum their gradients over tp themselves (tensor_parallel_plan's entry for them), "
                                 "and FSDP2 sums them over edp, which holds the tp ranks: they would be "
                                 f"{meshes.tp} times too large; leave the GroupedExperts out of the plan, as fmoe.parallel.parallelize "
                                 "does (or call parallelize)")
    dense = dense_data_mesh(meshes)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    uncast = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    kw = dict(reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, MoE):
            shard_unit(module.experts, mesh=meshes.expert["edp"], mp_policy=mp, **kw)
            if module.shared is not None:
                shard_unit(module.shared, mesh=dense, mp_policy=mp, **kw)
            shard_unit(module, mesh=dense, mp_policy=uncast, **kw)
        elif isinstance(module, (HyperConnection, ResidualGate)):  # float32 weights, like the router's
            shard_unit(module, mesh=dense, mp_policy=uncast, **kw)
    for module in model.modules():
        if isinstance(module, Block):
            shard_unit(module, mesh=dense, mp_policy=mp, **kw)
    # the root stays gathered until backward, as torchtitan's (its backward begins at once);
    # its pre-backward is hooked on the TensorDicts' tensors its forward returns (shard_unit)
    shard_unit(model, mesh=dense, mp_policy=mp, reshard_after_forward=False)
    # ...and gathered after a forward with gradients whose backward never came (a loss dropped: a
    # skipped micro-batch, a metric of logits() read with gradients on): an optimizer step then
    # changed the shards, and the next forward ran on the gathered copies of before it.
    # Resharded at a step of an optimizer of its parameters, where still gathered
    register_optimizer_step_pre_hook(_resharding_before_steps(model))  # kept by torch (no attribute of the model's: one of one's own was overwritten)
    # ...but a forward without gradients has no backward to reshard it: left gathered, the
    # next forward read the root's parameters of before an optimizer step in between, and an
    # optimizer built after it took the gathered copies (never trained). Resharded after one.
    model.register_forward_hook(_reshard_without_backward)
    # the model's other entry points that use the root's own parameters (the embedding,
    # final norm and head): FSDP2 gathers them there as it does in forward
    for method in ("decode", "logits"):  # methods only (a submodule of that name was wrapped, and torch refused the assignment)
        if inspect.ismethod(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
            setattr(model, method, _resharding(model, getattr(model, method)))
    if isinstance(model, Transformer):  # its dtype for the context's tables (an attribute of that name of one's own is left alone)
        model.compute_dtype = param_dtype
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _regather_for_backward(module: nn.Module, args, output) -> None:
    """Hook a unit's pre-backward (which gathers its parameters again where they were
    resharded) on the tensors of the TensorDicts its forward returns, as FSDP2 hooks it on
    the tensors of plain containers (tuples, lists, dicts: those it hooks itself). Without
    it, a backward that reached a unit only through them read its freed parameters: the
    root's after it was resharded (a second backward of a retained graph, the first of two
    graphs after the second, a backward after an evaluation forward without gradients in
    between), a MoE unit's router through its stats (a z-loss's backward of its own). A
    unit's pre-backward does nothing when called again in the same backward. Not under
    torch.compile: the compiled graphs stay as they were (as _owned leaves them)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    pre_backward = module._get_fsdp_state()._pre_backward
    stack, tensors = [output], []
    while stack:
        value = stack.pop()
        if isinstance(value, TensorDictBase):
            tensors += value.values(include_nested=True, leaves_only=True)
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(pre_backward)


def _reshard_without_backward(module: nn.Module, args=None, output=None) -> None:
    """Reshard the root unit after a call made without gradients (no backward follows to do
    it), unless gathered() keeps it gathered."""
    if not torch.is_grad_enabled() and not getattr(module, "keep_gathered", False):
        module.reshard()


def _resharding_before_steps(root: nn.Module):
    """A hook for torch.optim's global step pre-hooks (registered once per root unit, never
    removed while torch runs them: that raised "OrderedDict mutated during iteration"): before
    a step of an optimizer of the root's parameters, the root is resharded where it is still
    gathered (a call with gradients whose backward never came; not inside gathered()), so that
    the next call gathers the stepped shards. A normal step finds it resharded by its backward
    and reads nothing more. Holds the root weakly: a dead model's hook does nothing."""
    root_ref = weakref.ref(root)

    def before_step(optimizer, args, kwargs) -> None:
        unit = root_ref()
        if unit is None or getattr(unit, "keep_gathered", False) or not any(group.is_unsharded for group in _param_groups(unit)):
            return
        shards = {id(fp.sharded_param) for group in _param_groups(unit) for fp in group.fsdp_params}
        if any(id(p) in shards for group in optimizer.param_groups for p in group["params"]):  # not another model's optimizer
            unit.reshard()

    return before_step


def _resharding(model: nn.Module, method):
    """method (the root's decode or logits, as FSDP2 wraps it), then _reshard_without_backward."""
    @functools.wraps(method)
    def call(*args, **kwargs):
        out = method(*args, **kwargs)
        _reshard_without_backward(model)
        return out

    return call


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, each FSDP2 unit of `model` keeps its parameters gathered after its
    first forward (or decode / logits) instead of resharding them: for inference, where a
    generation's steps would otherwise all-gather every block once per step. On exit every
    unit is resharded and its reshard_after_forward restored. The cost is memory: each rank
    holds its unsharded parameters (the whole model's, divided only by tp and ep x etp).

        with torch.no_grad(), gathered(model):
            for _ in range(steps):
                logits = model.decode(ids, cache)   # the first step gathers, the rest do not

    A model without FSDP2 units passes through unchanged. Not for training: a backward
    inside the block would reshard nothing until the exit."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    before = [_reshards_after_forward(unit) for unit in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.keep_gathered = True  # the root's own resharding after calls without gradients, off
    try:
        yield model
    finally:
        for unit, reshard in zip(units, before):
            unit.keep_gathered = False
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)


def _param_groups(unit: FSDPModule) -> list:
    """An FSDP2 unit's parameter groups (FSDP2's own state)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before 2.13 (2.11: the GPU machines'): one group or none
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


def _reshards_after_forward(unit: FSDPModule) -> bool:
    """Whether an FSDP2 unit reshards after forward (FSDP2 exposes the setter only)."""
    return any(group.post_forward_mesh_info is not None for group in _param_groups(unit))


def parallelize(
    model: Transformer, meshes: Meshes, *, param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None, reshard_after_forward: bool = True, max_tokens: Optional[int] = None,
) -> Transformer:
    """Tensor parallel, expert parallel, then FSDP2 over `meshes`, in place; returns model.

    The model may be built on the meta device (then `materialize` allocates and initialises
    each rank's shards only: the way for a model larger than one device), or built whole on
    every rank from the same seed (the shards are cut from each rank's own full copy,
    nothing is broadcast). With tp > 1 the model runs sequence parallel between its
    tensor-parallel regions (fmoe.parallel.tensor): a micro-batch's T must be divisible by
    tp, the head and losses stay replicated, and the MoE stats (logits, scores, counts)
    cover each rank's T/tp tokens, so balancing losses over them add up per-rank shares
    (fmoe.parallel.reduce; examples/train_moe.py). Build the optimizers afterwards, over
    model.parameters() (now DTensors). param_dtype /
    reduce_dtype: FSDP2's mixed precision (e.g. bf16 compute, float32 gradient reduction)
    for everything but the router.

    With cp > 1 the model runs context parallel (fmoe.parallel.context): each micro-batch
    is split by split_batch before the forward (its T a multiple of 2 cp, and of 2 cp tp
    with tp), model.context builds the attention over the split (the model's
    `context_parallel` is set here), dense gradients are summed over dp_shard x cp, and the
    MoE stats cover each rank's tokens (token_index). With a capacity factor each MoE's
    `capacity_drop` (ContextCapacityDrop) drops over the whole micro-batch, every cp rank's
    chunks (and tp slices), as one process does. Linear-attention blocks (Gated DeltaNet) run
    across the split too (fmoe.parallel.gated_delta_rule_cp: the states between chunks are
    exchanged, every rank's outputs equal one process's), and so does DeepSeek sparse
    attention (its indexer's keys gathered with K and V, its loss each rank's share).

    With ep x etp > 1 and a capacity factor, the experts' exchange sizes each expert's slots
    C from the micro-batch's tokens T, and every rank of an expert-parallel group must use
    the same C: ranks whose T differ (a short last batch, prompts of other lengths) pass
    max_tokens, the most tokens a MoE block of any of them holds (a micro-batch's T / (tp
    cp)), and C is sized from it on every rank (ExpertParallel's max_tokens); otherwise the
    exchange's buffers differ between ranks and the collective fails.
    """
    if not isinstance(meshes, Meshes):
        raise ValueError(f"meshes: expected fmoe.parallel.build_meshes(...)'s Meshes, got {type(meshes).__name__}")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("model: already parallelized (parallelize applies once, to a model built whole or on the meta device)")
    if max_tokens is not None:
        check_positive_int("max_tokens", max_tokens)
    moe_blocks = [m for m in model.modules() if isinstance(m, MoE)]
    if moe_blocks and meshes.expert is None:
        raise ValueError("meshes: the model has MoE blocks but the meshes were built with has_experts=False")
    # a pipeline chunk without MoE blocks may be one stage of a model with them: only a whole model is told
    if not moe_blocks and meshes.ep * meshes.etp > 1 and getattr(model, "pipeline_chunk", None) is None:
        raise ValueError(f"meshes: ep / etp: expert parallelism ({meshes.ep} x {meshes.etp}) needs a model with experts, and this one "
                         "has no MoE block (build the meshes with has_experts=False)")
    if meshes.cp > 1:
        for name, block in model.named_modules():
            for slot in ("attn", "attn_beside"):  # the token mixers: a rank holds 2 of the 2 x cp chunks of each sequence
                mixer = getattr(block, slot, None) if isinstance(block, Block) else None
                if mixer is not None and not isinstance(mixer, (Attention, LinearAttention)):
                    raise ValueError(f"model: {type(mixer).__name__} {f'{name}.{slot}' if name else slot!r} is an attention of one's own, "
                                     f"which context parallelism cannot split: each cp rank holds 2 of the {2 * meshes.cp} chunks of "
                                     "every sequence, and only fmoe.model's Attention and LinearAttention exchange keys, values or states "
                                     "between the ranks (it would attend within the rank's chunks, without a word); use them or cp = 1")
        if not hasattr(model, "context_parallel"):
            raise ValueError(f"cp: {type(model).__name__} has no context_parallel attribute (fmoe.model.Transformer has), so cp = {meshes.cp} cannot apply")
        model.context_parallel = ContextParallel(meshes.axis("cp"))
        for moe in moe_blocks:
            if moe.cfg.capacity_factor is not None:
                moe.capacity_drop = ContextCapacityDrop(meshes.axis("cp"), meshes.axis("tp"))
    if meshes.tp > 1:
        plan = tensor_parallel_plan(model)
        if not plan:  # a module tree of one's own: every tp rank held and ran the whole model, without a word
            raise ValueError(f"tp: {type(model).__name__} holds no fmoe.model Block (Attention, DenseMLP, MoE inside one) to split, so "
                             f"tp = {meshes.tp} cannot apply (apply your own plan with torch's parallelize_module, or build tp=1 meshes)")
        # the routed experts' gradients are summed over edp (which holds tp) by FSDP2 below: not over tp by the plan's style
        plan = {name: style for name, style in plan.items() if not isinstance(model.get_submodule(name), GroupedExperts)}
        parallelize_module(model, meshes.tp_mesh, plan)
    # ep = etp = 1: every rank holds every expert and runs its own tokens through them, the
    # gradients summed over the expert data mesh edp (every rank) by FSDP: no dispatcher
    if meshes.ep * meshes.etp > 1:
        for moe in moe_blocks:
            shard_experts(moe, meshes, max_tokens=max_tokens)
    apply_fsdp(model, meshes, param_dtype=param_dtype, reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward)
    return model


def materialize(model: nn.Module, device, *, seed: int) -> nn.Module:
    """Allocate a model built on the meta device (and parallelized) on `device`, and
    initialise it: model.to_empty(device=device), then model.reset_parameters(seed=seed).
    Each rank allocates only its own shards; the initial values are a function of the seed
    and the parameter names (Transformer.reset_parameters), the same on every mesh. A
    floating-point parameter or buffer that reset_parameters leaves unwritten (a buffer of a
    module of one's own, which fmoe.model.init_parameters does not know) would hold whatever
    memory to_empty gave it, another on each rank: they are NaN until written, and any left
    NaN is refused by name (ValueError).

        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize(model, meshes)
        materialize(model, "cuda", seed=0)

    Returns model."""
    reset = getattr(model, "reset_parameters", None)
    try:  # before to_empty: a reset_parameters without seed= (nn.Linear's) failed after the weights were emptied
        params = inspect.signature(reset).parameters if callable(reset) else {}
        takes_seed = "seed" in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())  # **kwargs may forward it
    except (TypeError, ValueError):  # no signature to read
        takes_seed = False
    if not takes_seed:
        raise ValueError(f"model: expected a module with reset_parameters(seed=) (fmoe.model.Transformer), got {type(model).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):  # None would take each rank's own torch seed: replicas apart
        raise ValueError(f"seed: expected an int, the same on every rank, got {seed!r}")
    model.to_empty(device=device)
    floating = [(name, t) for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_floating_point()]
    with torch.no_grad():  # each rank's own values (a DTensor's reduction would be a collective)
        for _, t in floating:
            local_tensor(t).fill_(float("nan"))
    model.reset_parameters(seed=seed)
    if floating:
        with torch.no_grad():  # one read on the host
            left = torch.stack([local_tensor(t).isnan().any() for _, t in floating]).tolist()
        unwritten = [name for (name, _), nan in zip(floating, left) if nan]
        if unwritten:
            raise ValueError(f"model: reset_parameters(seed=) left {', '.join(repr(n) for n in unwritten[:4])}"
                             f"{f' and {len(unwritten) - 4} more' if len(unwritten) > 4 else ''} unwritten (or NaN in part): they would "
                             "hold the memory to_empty gave them, another on each rank; initialise every parameter and buffer of one's "
                             "own there")
    return model
