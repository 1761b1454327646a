"""roll_packed, positions_from_cu_seqlens, mtp_targets: kernel vs reference vs a per-sequence loop."""

import pytest
import torch

from fmoe.ops.packed import _roll_packed_op, mtp_targets, positions_from_cu_seqlens, roll_packed, sequence_ids

# cu_seqlens over T = 11 tokens: one sequence, empty sequences (leading, inner, trailing),
# length-1 sequences, and all-singletons
CUS = [
    [0, 11],
    [0, 3, 7, 11],
    [0, 0, 4, 4, 5, 11, 11],
    [0, 1, 2, 9, 10, 11],
    list(range(12)),
]
SHIFTS = [-3, -1, 1, 2, -12, 40]  # |shift| >= a sequence's (even T's) length fills it all
# (shape with T = 11 at the token dim, dim): 1-D, 2-D and 3-D, the token dim first, middle, last
LAYOUTS = [
    ((11,), 0),
    ((11, 5), 0),
    ((3, 11), 1),
    ((3, 11), -1),
    ((2, 11, 4), 1),
    ((2, 3, 11), -1),
    ((11, 2, 3), -3),
]
DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16]
FILLS = {torch.int64: -100, torch.int32: 7, torch.bool: True, torch.float32: -2.5, torch.bfloat16: 0.5}


def _sample(shape, dtype, device="cpu"):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(-50, 50, shape, device=device, dtype=dtype)


def _brute_force(x, cu, shift, dim, fill):
    """SPEC.md 5 as a loop over sequences and their tokens."""
    xt = x.movedim(dim, 0)
    out = torch.empty_like(xt)
    for s, e in zip(cu[:-1], cu[1:]):
        for i in range(s, e):
            j = i - shift
            out[i] = xt[j] if s <= j < e else fill
    return out.movedim(0, dim)


def test_spec_worked_example():
    x = torch.arange(1, 11)
    for cu_dtype in (torch.int32, torch.int64):
        cu = torch.tensor([0, 3, 7, 10], dtype=cu_dtype)
        for impl in ("torch", "triton"):
            once = roll_packed(x, cu, impl=impl)
            assert once.tolist() == [2, 3, 0, 5, 6, 7, 0, 9, 10, 0]
            assert roll_packed(once, cu, impl=impl).tolist() == [3, 0, 0, 6, 7, 0, 0, 10, 0, 0]
            assert roll_packed(x, cu, shift=1, fill=-1, impl=impl).tolist() == [-1, 1, 2, -1, 4, 5, 6, -1, 8, 9]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_reference_matches_brute_force(layout, dtype):
    shape, dim = layout
    x = _sample(shape, dtype)
    for cu in CUS:
        for shift in SHIFTS:
            out = roll_packed(x, torch.tensor(cu, dtype=torch.int32), shift=shift, dim=dim, fill=FILLS[dtype], impl="torch")
            assert out.dtype == dtype and out.shape == x.shape
            assert torch.equal(out, _brute_force(x, cu, shift, dim, FILLS[dtype])), (cu, shift)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_triton_matches_reference(layout, dtype, device):
    shape, dim = layout
    x = _sample(shape, dtype, device)
    fill = FILLS[dtype]
    for i, cu in enumerate(CUS):
        cu_t = torch.tensor(cu, dtype=(torch.int32, torch.int64)[i % 2], device=device)
        for shift in SHIFTS:
            out = roll_packed(x, cu_t, shift=shift, dim=dim, fill=fill, impl="triton")
            ref = roll_packed(x, cu_t, shift=shift, dim=dim, fill=fill, impl="torch")
            assert out.dtype == dtype and out.is_contiguous()
            assert torch.equal(out, ref), (cu, shift)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_unsigned_ids_of_a_token_file_roll(dtype, device):
    """torch.from_numpy of a .u16 / .u32 token file's slice: torch's index ops lack these
    dtypes ("index_select not implemented for 'UInt16'"); rolled as the signed type's bits,
    the largest ids and a fill past the signed range included."""
    signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}[dtype]
    top = {torch.uint16: 65535, torch.uint32: 2**32 - 1, torch.uint64: 2**63 + 5}[dtype]
    big = torch.full((1,), top, dtype=dtype, device=device)
    x = torch.cat([torch.tensor([5, 6, 0, 7], device=device).to(dtype), big])  # documents [5, 6, 0], [7, top]
    want = torch.cat([x[1:3], big, x[4:], big])  # each document's next ids, the fill after its last
    for impl in ("torch", "triton"):
        out = roll_packed(x, torch.tensor([0, 3, 5], device=device), fill=top, impl=impl)
        assert out.dtype == dtype and torch.equal(out.view(signed), want.view(signed)), impl


def test_random_cu_seqlens_and_wide_rows(device):
    # many sequences (a deep binary search), rows wider than one block (the loop over I),
    # a non-contiguous x, and the default fill
    T, H = 300, 1500
    lengths = torch.randint(0, 9, (60,))
    lengths[-1] += T - lengths.sum()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    x = torch.randn(H, T, device=device).t()
    for shift in (-1, 3):
        out = roll_packed(x, cu, shift=shift, impl="triton")
        assert torch.equal(out, roll_packed(x, cu, shift=shift, impl="torch"))
    assert torch.equal(out.cpu(), _brute_force(x.cpu(), cu.tolist(), 3, 0, 0.0))


def test_shifts_compose():
    # rolling by -1 k times is rolling by -k once
    cu = torch.tensor([0, 0, 4, 5, 12, 20])
    x = torch.randint(0, 100, (20,))
    for impl in ("torch", "triton"):
        y = x
        for k in range(1, 6):
            y = roll_packed(y, cu, impl=impl)
            assert torch.equal(y, roll_packed(x, cu, shift=-k, impl=impl))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", [((11, 5), 0), ((2, 11, 4), 1), ((2, 3, 11), -1)], ids=str)
@pytest.mark.parametrize("shift", [-2, 1])
def test_gradient_is_the_opposite_roll(layout, dtype, shift, device):
    shape, dim = layout
    cu = torch.tensor(CUS[2], device=device)
    x = _sample(shape, dtype, device)
    grad = torch.randn(shape, device=device).to(dtype)
    grads = {}
    for impl in ("torch", "triton"):
        xi = x.clone().requires_grad_()
        roll_packed(xi, cu, shift=shift, dim=dim, fill=3.0, impl=impl).backward(grad)
        grads[impl] = xi.grad
    expected = _brute_force(grad, CUS[2], -shift, dim, 0.0)
    assert grads["triton"].dtype == dtype
    assert torch.equal(grads["triton"], expected)
    assert torch.equal(grads["torch"], expected)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("cu", [[0, 5, 20], [-4, 5, 11]], ids=["ends past T", "starts below 0"])
@pytest.mark.parametrize("shift", [-2, 1])
def test_unchecked_cu_seqlens_never_read_outside_x(cu, shift, impl, device):
    """check=False trusts cu_seqlens, but a sequence bound past x (cu[-1] > T, cu[0] < 0)
    gives fill where t - shift leaves 0 .. T-1, in the forward and in the backward (which
    reads the upstream gradient by the opposite shift). x and the gradient are the middle
    rows of buffers holding 99 around them: a read outside them would fetch 99."""
    T = 11
    x_buf = torch.full((T + 8, 3), 99.0, device=device)
    x_buf[4:4 + T] = torch.arange(T, dtype=torch.float32, device=device)[:, None] + 1
    g_buf = torch.full((T + 8, 3), 99.0, device=device)
    g_buf[4:4 + T] = -torch.arange(T, dtype=torch.float32, device=device)[:, None] - 1
    x, g = x_buf[4:4 + T].requires_grad_(), g_buf[4:4 + T]
    cu_t = torch.tensor(cu, device=device)
    out = roll_packed(x, cu_t, shift=shift, fill=-7.0, check=False, impl=impl)
    (dx,) = torch.autograd.grad(out, x, g)

    def rolled(v, shift, fill):  # the definition, source also inside 0 .. T-1
        want = torch.full_like(v, fill)
        for t in range(T):
            j = max(i for i in range(len(cu) - 1) if cu[i] <= t)
            if max(cu[j], 0) <= t - shift < min(cu[j + 1], T):
                want[t] = v[t - shift]
        return want

    assert torch.equal(out, rolled(x.detach(), shift, -7.0))
    assert torch.equal(dx, rolled(g, -shift, 0.0))


def test_positions():
    assert positions_from_cu_seqlens(torch.tensor([0, 3, 7, 10])).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    pos = positions_from_cu_seqlens(torch.tensor([0, 0, 2, 2, 3, 3], dtype=torch.int32), n_tokens=3)
    assert pos.tolist() == [0, 1, 0] and pos.dtype == torch.int64
    assert positions_from_cu_seqlens(torch.tensor([0, 0])).tolist() == []
    for cu in CUS:
        assert positions_from_cu_seqlens(torch.tensor(cu)).tolist() == [i - s for s, e in zip(cu[:-1], cu[1:]) for i in range(s, e)]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mtp_targets_by_hand(impl):
    # two documents [10 11 12 13] [20 21 22]; token 11 is a prompt token (never a target)
    tokens = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    mask = torch.tensor([1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    main, mtp1, mtp2 = mtp_targets(tokens, cu, 2, loss_mask=mask, impl=impl)
    N = -100
    assert main["input_ids"].tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert main["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert main["labels"].tolist() == [11, 12, 13, N, 21, 22, N]
    assert main["loss_mask"].tolist() == [0, 1, 1, 0, 1, 1, 0]
    # the first MTP module embeds token t+1 and predicts t+2
    assert mtp1["input_ids"].tolist() == [11, 12, 13, 0, 21, 22, 0]
    assert mtp1["positions"].tolist() == [1, 2, 3, 0, 1, 2, 0]
    assert mtp1["labels"].tolist() == [12, 13, N, N, 22, N, N]
    assert mtp1["loss_mask"].tolist() == [1, 1, 0, 0, 1, 0, 0]
    assert mtp2["input_ids"].tolist() == [12, 13, 0, 0, 22, 0, 0]
    assert mtp2["positions"].tolist() == [2, 3, 0, 0, 2, 0, 0]
    assert mtp2["labels"].tolist() == [13, N, N, N, N, N, N]
    assert mtp2["loss_mask"].tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert main.batch_size == torch.Size([7]) and main["loss_mask"].dtype == torch.bool

    # defaults: mask all True, positions from cu_seqlens; given positions (int32) are rolled
    (only,) = mtp_targets(tokens, cu, 0, impl=impl)
    assert only["loss_mask"].tolist() == [1, 1, 1, 0, 1, 1, 0]
    pos = torch.arange(100, 107, dtype=torch.int32)
    _, d1 = mtp_targets(tokens.int(), cu, 1, positions=pos, loss_mask=mask.float(), ignore_index=-1, impl=impl)
    assert d1["positions"].tolist() == [101, 102, 103, 0, 105, 106, 0]
    assert d1["labels"].tolist() == [12, 13, -1, -1, 22, -1, -1] and d1["labels"].dtype == torch.int32
    assert d1["loss_mask"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_bad_inputs():
    x = torch.arange(10)
    cu = torch.tensor([0, 3, 7, 10])
    bad_cu = [
        (cu.float(), "dtype int32 or int64"),
        (cu.view(2, 2), "1-D"),
        (torch.tensor([0]), "at least 2"),
        (torch.tensor([1, 3, 7, 10]), "start at 0"),
        (torch.tensor([0, 7, 3, 10]), "non-decreasing"),
        (torch.tensor([0, 3, 7, 9]), "end at the token count 10"),
        ([0, 3, 7, 10], "expected a tensor"),
    ]
    for c, msg in bad_cu:
        with pytest.raises(ValueError, match=f"cu_seqlens.*{msg}"):
            roll_packed(x, c)
        with pytest.raises(ValueError, match=f"cu_seqlens.*{msg}"):
            mtp_targets(x, c, 1)
    with pytest.raises(ValueError, match="cu_seqlens.*end at the token count 4"):
        roll_packed(torch.zeros(2, 4), cu, dim=1)
    # offsets on the meta device beside tokens that hold values: nothing to copy (torch's "Cannot copy out of meta tensor")
    with pytest.raises(ValueError, match=r"^cu_seqlens: a meta tensor holds no offsets to copy to the device of x \(cpu\)"):
        roll_packed(x, cu.to("meta"))
    with pytest.raises(ValueError, match=r"^cu_seqlens: a meta tensor holds no offsets to copy to the device of tokens \(cpu\)"):
        mtp_targets(x, cu.to("meta"), 1)
    assert roll_packed(x.to("meta"), cu.to("meta")).is_meta and roll_packed(x.to("meta"), cu).is_meta  # shapes alone: as before
    with pytest.raises(ValueError, match="cu_seqlens.*start at 0"):
        positions_from_cu_seqlens(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="cu_seqlens.*end at the token count 5"):
        positions_from_cu_seqlens(cu, n_tokens=5)
    for d in (1, -2, 1.0, True):
        with pytest.raises(ValueError, match="dim"):
            roll_packed(x, cu, dim=d)
    with pytest.raises(ValueError, match="x: expected a tensor of rank >= 1"):
        roll_packed(torch.tensor(1), cu)
    for s in (1.0, True, None):
        with pytest.raises(ValueError, match="shift: expected an int"):
            roll_packed(x, cu, shift=s)
    for f, xx in (("0", x), (None, x), (torch.tensor(0), x), (1e20, x.int()), (float("nan"), x), (float("-inf"), x.int()), (300, x.to(torch.uint8)),
                  (1e39, x.float()), (128, x.to(torch.int8)), (-129, x.to(torch.int8)), (10**400, x.float()), (10**400, x.long())):
        with pytest.raises(ValueError, match="fill"):
            roll_packed(xx, cu, fill=f)
    with pytest.raises(ValueError, match="impl"):
        roll_packed(x, cu, impl="cuda")
    with pytest.raises(ValueError, match="tokens"):
        mtp_targets(x.float(), cu, 1)
    with pytest.raises(ValueError, match="depth"):
        mtp_targets(x, cu, -1)
    with pytest.raises(ValueError, match="loss_mask"):
        mtp_targets(x, cu, 1, loss_mask=torch.ones(9))
    with pytest.raises(ValueError, match="positions"):
        mtp_targets(x, cu, 1, positions=torch.arange(9))
    for bad in (2**40, "x"):  # the labels' fill is named as mtp_targets calls it
        with pytest.raises(ValueError, match="^ignore_index: .*(fit tokens's dtype torch.int32|expected a number)"):
            mtp_targets(x.int(), cu, 1, ignore_index=bad)


def test_roll_packed_compiles_with_dynamic_sizes_and_a_fill_argument():
    """roll_packed itself under torch.compile(fullgraph=True, dynamic=True), fill passed in or
    left at its default: the fill's range check read math.isfinite of a symbolic float and
    broke the graph. Equal to eager for three token counts; nan and inf fill a float tensor."""
    compiled = torch.compile(roll_packed, backend="aot_eager", fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for T, fill in ((10, 0.0), (13, 2.5), (17, float("nan")), (19, float("-inf"))):
        cu = torch.tensor([0, 3, 3, T - 2, T])
        x = torch.randn(T, 3)
        torch.testing.assert_close(compiled(x, cu, shift=-1, fill=fill), roll_packed(x, cu, shift=-1, fill=fill), equal_nan=True)
        assert torch.equal(compiled(x, cu, shift=-1), roll_packed(x, cu, shift=-1))


def test_opcheck(device):
    cu = torch.tensor(CUS[2], device=device)
    for x, fill in (
        (torch.randn(2, 11, 4, device=device, requires_grad=True), 1.5),
        (torch.randint(0, 9, (11,), device=device), -100),
        (torch.rand(11, 3, device=device) > 0.5, True),
    ):
        dim = 1 if x.ndim == 3 else 0
        torch.library.opcheck(_roll_packed_op, (x, cu, -1, dim, fill))


def test_compile_fullgraph(device):
    cu = torch.tensor(CUS[1], device=device)
    x = torch.randn(2, 11, 4, device=device)
    grad = torch.randn_like(x)

    def f(x, cu):
        return roll_packed(x, cu, shift=-2, dim=1, fill=0.5, impl="triton")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = compiled(x1, cu)
    out.backward(grad)
    ref = roll_packed(x2, cu, shift=-2, dim=1, fill=0.5, impl="torch")
    ref.backward(grad)
    assert torch.equal(out, ref)
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.gpu
def test_large_bf16_on_gpu():
    T, H = 65536, 2048
    lengths = torch.randint(1, 4096, (40,))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    cu = torch.cat([cu[cu < T], torch.tensor([T])]).to(torch.int32).cuda()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    out = roll_packed(x, cu)
    assert torch.equal(out, roll_packed(x, cu, impl="torch"))
    (dx,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(dx, roll_packed(grad, cu, shift=1, impl="torch"))
    ids = torch.randint(0, 50000, (T,), device="cuda")
    assert torch.equal(roll_packed(ids, cu, shift=-3, fill=-100), roll_packed(ids, cu, shift=-3, fill=-100, impl="torch"))


def test_sequence_ids_skip_empty_sequences():
    assert sequence_ids(torch.tensor([0, 3, 3, 5], dtype=torch.int32), 5).tolist() == [0, 0, 0, 2, 2]
    assert sequence_ids(torch.tensor([0, 0, 2]), 2).tolist() == [1, 1]
    # index=: given tokens only (a cp rank's global indices), any shape, as the whole lookup
    cu = torch.tensor([0, 3, 3, 5, 9])
    index = torch.tensor([[8, 0], [3, 4]])
    assert torch.equal(sequence_ids(cu, 9, index=index), sequence_ids(cu, 9)[index])
