"""fmoe.train.metrics and fmoe.train.plot: FLOPs by hand, MFU, expert load, JSONL logger."""

import dataclasses
import functools
import json
import math
import re
import subprocess
import sys

import pytest
import torch

from fmoe.train import metrics as M

CFG = dict(hidden=64, n_layers=4, n_dense=1, ffn_dense=256, ffn_expert=32, k=2, n_shared=1,
           n_heads=4, n_kv_heads=2, head_dim=16, vocab=1000, mtp_depth=1, n_avg_keys=10.0)


def test_flops_per_token_by_hand():
    """SPEC 8 plus the router (6 H E per MoE layer) and the MTP modules' blocks."""
    attention = 6 * (64 * (64 + 2 * 32) + 64 * 64) + 12 * 64 * 10  # q, k, v, o; scores, values (n_avg = 10)
    dense = 6 * 64 * 3 * 256
    moe = 6 * 64 * 3 * 32 * (2 + 1)  # k = 2 routed + 1 shared; no router with n_experts=0
    mtp = 6 * 2 * 64 * 64 + attention + moe  # its projection [2H, H] and its block, MoE like the trunk's
    head = 6 * 64 * 1000
    assert 4 * attention + dense + 3 * moe + mtp + 2 * head == 1961472
    assert M.flops_per_token(**CFG) == 1961472.0
    # the router: 2 H E forward, 4 H E backward, in the 3 MoE layers and the MTP block
    assert M.flops_per_token(**CFG, n_experts=8) == 1961472.0 + 4 * 6 * 64 * 8
    # no MTP: SPEC 8's terms only (1336320 before the MTP terms were counted too)
    assert M.flops_per_token(**dict(CFG, mtp_depth=0)) == 4 * attention + dense + 3 * moe + head == 1336320
    # an all-dense trunk: the MTP block is dense too, and there is no router to count
    all_dense = 4 * attention + 4 * dense + (6 * 2 * 64 * 64 + attention + dense) + 2 * head
    assert M.flops_per_token(**dict(CFG, n_dense=4), n_experts=8) == all_dense
    # no MTP, all layers dense: the dense transformer formula (Megatron's, n_avg = S/2)
    dense = dict(CFG, n_dense=4, mtp_depth=0, n_avg_keys=M.mean_attended_keys([0, 128]))
    H, L, S = 64, 4, 128
    assert M.flops_per_token(**dense) == 6 * H * 3 * 256 * L + L * 6 * (H * 128 + 64 * H) + L * 6 * 64 * S + 6 * H * 1000
    # sliding layers of their own query heads (Laguna's): grouped-query projections of local_heads, q and o both
    local = dict(hidden=64, n_layers=2, n_dense=2, ffn_dense=128, ffn_expert=0, k=0, n_shared=0, n_heads=4, n_kv_heads=2, head_dim=16,
                 vocab=100, n_avg_keys=8, n_sliding=1, n_avg_local_keys=4)
    extra_heads = 8 - 4  # over n_heads, 16 channels each: q and o of the one sliding layer, its scores and values over 4 keys
    assert M.flops_per_token(**local, local_heads=8) - M.flops_per_token(**local) == 6 * 2 * 64 * extra_heads * 16 + 12 * extra_heads * 16 * 4


def test_mean_attended_keys():
    assert M.mean_attended_keys([0, 8]) == 4.0  # one document: S / 2
    assert M.mean_attended_keys(torch.tensor([0, 2, 6, 8])) == (4 + 16 + 4) / 16
    assert M.mean_attended_keys([0, 4, 4, 8]) == 2.0  # an empty document counts nothing
    # a sliding window of 4: the 10-token document counts 4^2 / 2 + 6 x 4, the 3-token one 3^2 / 2
    assert M.mean_attended_keys([0, 10, 13], window=4) == (8 + 24 + 4.5) / 13
    assert M.mean_attended_keys([0, 10, 13], window=10) == M.mean_attended_keys([0, 10, 13])
    with pytest.raises(ValueError, match="window: expected >= 1, got 0"):
        M.mean_attended_keys([0, 8], window=0)
    # chunks of 4: the 10-token document is chunks of 4, 4 and 2 (16 / 2 + 16 / 2 + 4 / 2), the 3-token one 9 / 2
    assert M.mean_attended_keys([0, 10, 13], chunk=4) == (8 + 8 + 2 + 4.5) / 13
    assert M.mean_attended_keys([0, 10, 13], chunk=10) == M.mean_attended_keys([0, 10, 13])
    with pytest.raises(ValueError, match="chunk: expected >= 1, got 0"):
        M.mean_attended_keys([0, 8], chunk=0)
    with pytest.raises(ValueError, match=r"chunk: a sliding window or chunked attention, not both \(window = 4\)"):
        M.mean_attended_keys([0, 8], window=4, chunk=4)
    for bad in ([], [1, 4], [0, 4, 2], [0]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            M.mean_attended_keys(bad)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected offsets \[0, ..., T\] \(a tensor or a list of ints\), got NoneType"):
        M.mean_attended_keys(None)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected offsets \[0, ..., T\] \(at least 2\), got \[\]"):
        M.mean_attended_keys([])
    for fn in (M.mean_attended_keys, functools.partial(M.mean_compressed_entries, rate=2)):  # fractional offsets gave 1.25
        with pytest.raises(ValueError, match=r"cu_seqlens: expected dtype int32 or int64, got torch.float32"):
            fn([0.0, 2.5, 5.0])
    with pytest.raises(ValueError, match="n_avg_keys: expected a finite number >= 0, got inf"):  # the FLOPs came out NaN
        M.flops_per_token(**{**CFG, "n_avg_keys": math.inf})


def test_flops_bad_inputs():
    with pytest.raises(ValueError, match="n_dense"):
        M.flops_per_token(**dict(CFG, n_dense=5))
    with pytest.raises(ValueError, match="vocab"):
        M.flops_per_token(**dict(CFG, vocab=-1))
    with pytest.raises(TypeError):
        M.flops_per_token(64)
    # each accepted and counted before: a negative weight count, a negative value head dim, a hidden of -1
    with pytest.raises(ValueError, match="attention_weights: expected a finite number >= 0, got -5"):
        M.flops_per_token(**CFG, attention_weights=-5)
    with pytest.raises(ValueError, match="v_dim: expected a finite number >= 1, got -5"):
        M.flops_per_token(**CFG, v_dim=-5)
    # a model that cannot be, counted before: more experts chosen than there are, no hidden channel, half a channel
    with pytest.raises(ValueError, match="k: expected at most n_experts = 4 experts chosen per token, got 5"):
        M.flops_per_token(**dict(CFG, k=5), n_experts=4)
    with pytest.raises(ValueError, match="hidden: expected a finite number >= 1, got 0"):
        M.flops_per_token(**dict(CFG, hidden=0))
    for name in ("hidden", "n_heads", "vocab"):
        with pytest.raises(ValueError, match=f"{name}: expected a whole number, got 32.5"):
            M.flops_per_token(**dict(CFG, **{name: 32.5}))
    with pytest.raises(ValueError, match="n_experts: expected a whole number, got 2.5"):
        M.flops_per_token(**CFG, n_experts=2.5)
    assert M.flops_per_token(**dict(CFG, k=1.5), n_experts=8) > 0  # a mean k (a routing that may pick fewer) is taken
    from fmoe.layers import LinearAttentionConfig

    lin = LinearAttentionConfig(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=6)
    with pytest.raises(ValueError, match="hidden: expected >= 1, got -1"):
        M.linear_attention_flops(-1, lin)
    with pytest.raises(ValueError, match="hidden: expected an int, got 'x'"):
        M.linear_attention_flops("x", lin)
    with pytest.raises(ValueError, match="cfg: expected a LinearAttentionConfig, got dict"):
        M.linear_attention_flops(32, {})


def test_peaks_and_mfu():
    assert M.datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert M.datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert M.datasheet_peak_flops("NVIDIA H200") == 989e12
    assert M.datasheet_peak_flops("NVIDIA H200 NVL") == 835e12  # not the SXM part's
    assert M.datasheet_peak_flops("NVIDIA H100 NVL") == 835e12  # nor the H100 SXM's
    assert M.datasheet_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert M.datasheet_peak_flops("NVIDIA GeForce GTX 1080") is None
    assert M.peak_flops("cpu") is None
    if not torch.cuda.is_available():
        assert M.peak_flops() is None
    assert M.mfu(1e5, 1e9, 1e15) == pytest.approx(0.1)
    assert M.mfu(1e5, 1e9, None) is None
    with pytest.raises(ValueError, match="peak"):
        M.mfu(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="peak: expected finite FLOP/s > 0 or None, got inf"):  # an MFU of 0 before
        M.mfu(1.0, 1e9, math.inf)
    for bad in ("bogus", True):  # torch's RuntimeError / TypeError before
        with pytest.raises(ValueError, match="device: expected a torch.device, a device string or a CUDA index, got"):
            M.peak_flops(bad)


def test_layer_loads_are_load_stats_as_record_entries():
    rec = M.layer_loads(torch.tensor([[6, 2, 0, 4], [3, 3, 3, 3]]), slots=12)
    assert isinstance(rec["load_max_over_mean"], torch.Tensor)  # converted later, with the step's values
    rec = M.to_host(rec)
    assert rec["tokens_per_expert"] == [[6, 2, 0, 4], [3, 3, 3, 3]]
    assert rec["load_max_over_mean"] == pytest.approx([2.0, 1.0])
    assert rec["load_cv"] == pytest.approx([math.sqrt(5) / 3, 0.0])  # std = sqrt(20/4), mean 3
    assert rec["dropped_fraction"] == pytest.approx([0.0, 0.0])
    # from a MoE block that drops: the counts of its stats, the slots it was asked for
    from fmoe.layers import MoEConfig
    from fmoe.model import MoE

    block = MoE(16, 8, MoEConfig(n_experts=4, k=2, capacity_factor=0.5))
    _, stats = block(torch.randn(24, 16))
    rec = M.to_host(M.layer_loads(stats["tokens_per_expert"][None], slots=48))
    counts = stats["tokens_per_expert"].float()
    assert rec["dropped_fraction"] == pytest.approx([1 - counts.sum().item() / 48]) and rec["dropped_fraction"][0] > 0
    assert rec["load_max_over_mean"] == pytest.approx([(counts.max() / counts.mean()).item()])
    with pytest.raises(ValueError, match="counts"):
        M.layer_loads(torch.zeros(4), slots=4)
    # a list of each layer's tokens_per_expert, as the docstring says (torch.as_tensor raised a TypeError on it)
    rows = [torch.tensor([6, 2, 0, 4]), torch.tensor([3, 3, 3, 3])]
    assert M.to_host(M.layer_loads(rows, slots=12)) == M.to_host(M.layer_loads(torch.stack(rows), slots=12))
    with pytest.raises(ValueError, match=r"counts: expected \[E\] rows of one shape and device, got \[\(\(4,\), 'cpu'\), \(\(3,\), 'cpu'\)\]"):
        M.layer_loads([rows[0], rows[1][:3]], slots=12)


def test_layer_loads_with_zero_experts():
    """The last Z columns count zero experts' slots: max/mean and CV are the computing
    experts', the dropped share counts both kinds, zero_fraction the zero experts' share."""
    rec = M.to_host(M.layer_loads(torch.tensor([[6, 2, 0, 4, 4], [3, 3, 3, 3, 0]]), slots=20, zero_experts=1))
    assert rec["load_max_over_mean"] == pytest.approx([2.0, 1.0])  # over [6, 2, 0, 4] and [3, 3, 3, 3]
    assert rec["load_cv"] == pytest.approx([math.sqrt(5) / 3, 0.0])
    assert rec["zero_fraction"] == pytest.approx([4 / 20, 0.0])
    assert rec["dropped_fraction"] == pytest.approx([(20 - 16) / 20, (20 - 12) / 20])
    assert rec["zero_experts"] == 1  # which columns are the zero experts' (the plot leaves them out of the shares)
    assert not {"zero_fraction", "zero_experts"} & set(M.layer_loads(torch.tensor([[6, 2]]), slots=8))
    # the slots as a 0-D tensor (a token mask's sum times k): the same numbers, nothing read on the host
    with M.HostReads() as reads:
        on_device = M.layer_loads(torch.tensor([[6, 2, 0, 4, 4], [3, 3, 3, 3, 0]]), slots=torch.tensor(20), zero_experts=1)
    assert reads.count == 0, reads.sites
    assert M.to_host(on_device) == rec
    for bad in (torch.tensor([20]), torch.tensor(True)):
        with pytest.raises(ValueError, match="slots: expected a whole number >= 0 or a 0-D real tensor"):
            M.layer_loads(torch.tensor([[6, 2]]), slots=bad)
    for bad, message in ((-1, "expected 0..1, got -1"), (2, "expected 0..1, got 2"), (1.0, "expected an int, got 1.0"),
                         (True, "expected an int, got True")):
        with pytest.raises(ValueError, match=f"zero_experts: {message}"):
            M.layer_loads(torch.tensor([[6, 2]]), slots=8, zero_experts=bad)


def test_layer_loads_checks_its_own_arguments():
    """slots is a number of slots: a whole float is that count, as an int or a 0-D tensor; a
    fraction, a negative or a non-finite one is refused by its own name, as counts without
    expert columns is (not load_stats' n_slots, nor zero_experts' empty range)."""
    counts = torch.tensor([[10, 2, 6, 6]])
    expected = M.to_host(M.layer_loads(counts, 32))
    assert M.to_host(M.layer_loads(counts, 32.0)) == M.to_host(M.layer_loads(counts, torch.tensor(32.0))) == expected
    assert M.to_host(M.layer_loads(torch.tensor([[6, 2, 4]]), 16.0, zero_experts=1))["zero_fraction"] == pytest.approx([4 / 16])
    for bad in (32.5, -1, -1.0, float("inf"), float("nan"), True, "32", None):
        with pytest.raises(ValueError, match=r"slots: expected a whole number >= 0 or a 0-D real tensor, got "):
            M.layer_loads(counts, bad)
    for empty in (torch.zeros(1, 0, dtype=torch.long), [[]]):
        with pytest.raises(ValueError, match=r"counts: expected \[L, E\] counts with E >= 1 \(one row per MoE layer\), got shape \(1, 0\)"):
            M.layer_loads(empty, 4)


def test_to_host_one_transfer_per_device():
    from fmoe.train.metrics import HostReads

    values = {"loss": torch.tensor(2.5), "counts": torch.tensor([[1, 2], [3, 4]]), "norm": torch.tensor([0.5]), "step": 7, "v": torch.arange(3.0)}
    with HostReads() as reads:
        out = M.to_host(values)
    assert reads.count == 1  # one .tolist() for every tensor
    assert out == {"loss": 2.5, "counts": [[1, 2], [3, 4]], "norm": [0.5], "step": 7, "v": [0.0, 1.0, 2.0]}
    assert isinstance(out["counts"][0][0], int) and isinstance(out["loss"], float)
    # more dims than two nest as tolist() does; integers exact to 2**53 and float64 values exact (they travel as float64)
    cube = torch.arange(24).reshape(2, 3, 4)
    exact = {"cube": cube, "count": torch.tensor(2**53 - 1), "x": torch.tensor(0.1, dtype=torch.float64), "empty": torch.zeros(0, 3)}
    assert M.to_host(exact) == {"cube": cube.tolist(), "count": 2**53 - 1, "x": 0.1, "empty": []}
    with pytest.raises(ValueError, match="values"):
        M.to_host([1.0])


def test_host_reads_counts_every_way_of_reading_a_tensor():
    from fmoe.train.metrics import HostReads

    x = torch.arange(4.0)
    with HostReads() as reads:
        float(x[0]), int(x[1]), bool(x[2] > 0), x.tolist(), x.sum().item(), x.cpu(), x.numpy(), [0, 1][x[1].long()]
        y = x * 2 + 1  # computing reads nothing
    assert reads.count == 8 and sum(reads.sites.values()) == 8
    assert all(site.startswith(__file__) for site in reads.sites)
    assert y.sum().item() == 16.0 and torch.Tensor.item.__qualname__ == "TensorBase.item"  # restored on exit


def test_host_reads_counts_comparisons_read_on_the_host_and_no_copy_of_a_host_tensor():
    """torch.equal, allclose, is_nonzero and complex() give the host a Python value; a .to of
    a CPU tensor is no read (its device, often a variable, names the GPU on a GPU: a table
    built on the host and moved to the model's device), whatever it names (on CUDA a copy to
    the host counts: test_host_reads_counts_each_blocking_copy_to_the_host_cuda_reports)."""
    from fmoe.train.metrics import HostReads

    x = torch.arange(4.0)
    with HostReads() as reads:
        torch.equal(x, x), x.equal(x), torch.allclose(x, x), x.allclose(x), torch.is_nonzero(x[1]), x[1].is_nonzero(), complex(x[1])
        x.to("cpu"), x.to(device="cpu"), x.to("cpu", torch.float64), x.to(device="cpu:0", dtype=torch.float64), x.to(torch.float64)
        x.to(dtype=torch.int64), x.to(x), x.to(x.device), x.to(torch.device("cpu")), x.to("cpu", non_blocking=True)
        from fmoe.ops.rope import rope_inv_freq
        rope_inv_freq(8, device="cpu")  # a float64 table moved to the device asked for
    assert reads.count == 7 and all(site.startswith(__file__) for site in reads.sites), reads.sites
    assert torch.Tensor.to.__qualname__ == "TensorBase.to" and torch.equal.__name__ == "equal" and torch.equal is torch._C._VariableFunctions.equal
    assert torch.Tensor.equal.__qualname__ == "TensorBase.equal"  # restored on exit


@pytest.mark.gpu
def test_host_reads_counts_each_blocking_copy_to_the_host_cuda_reports():
    """On CUDA a .to the CPU (named, as a torch.device or another tensor's) and a comparison
    read on the host count once each, as torch's sync debug mode sees them; an asynchronous
    copy and a copy between devices count none."""
    from fmoe.train.metrics import HostReads

    # y: another tensor of x's values. torch.equal(x, x) answers without reading the device
    # (CUDA's equal returns at once for the same storage, offset and strides: seen on an H200,
    # torch 2.11, where it made no sync), so the comparisons take two tensors
    x, host = torch.arange(4.0, device="cuda"), torch.zeros(4)
    y = x.clone()
    cases = {"to('cpu')": lambda: x.to("cpu"), "to(torch.device('cpu'))": lambda: x.to(torch.device("cpu")),
             "to(host tensor)": lambda: x.to(host), "to(host.device)": lambda: x.to(host.device), "equal": lambda: torch.equal(x, y),
             "allclose": lambda: x.allclose(y), "is_nonzero": lambda: x[1].is_nonzero(), "complex": lambda: complex(x[1])}
    for name, read in cases.items():
        with HostReads(cuda=True) as reads:
            read()
        assert reads.count == 1 and reads.cuda_syncs >= 1, (name, reads.count, reads.cuda_syncs)
    with HostReads() as reads:
        x.to("cpu", non_blocking=True), x.to(torch.float64), x.to(x), x.to(device="cuda")
    torch.cuda.synchronize()
    assert reads.count == 0, reads.sites


def test_progress_line():
    line = M.format_progress(12, 100, {"loss": torch.tensor(3.21), "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 12345.0})
    assert line == "[##..................] step 12/100 loss 3.2100 lr 1.0e-03 gnorm 0.5 tok/s 12.3k"
    line = M.format_progress(3, 10, {"loss": 2.0, "load_max_over_mean": [1.2, 3.4], "eta_seconds": 125.0, "val_loss": float("nan")})
    assert line == "[######..............] step 3/10 loss 2.0000 val nan load 3.40 eta 2m05s"  # the worst layer; a NaN val said
    # a diverged step (--check_finite=False): its non-finite loss and norm shown, not left out; other fields' left out
    line = M.format_progress(4, 10, {"loss": torch.tensor(float("nan")), "grad_norm": float("inf"), "tokens_per_s": float("nan"), "eta_seconds": math.inf})
    assert line == "[########............] step 4/10 loss nan gnorm inf"
    assert M.format_progress(100, 100, {}) == "[####################] step 100/100"
    assert M.format_progress(150, 100, {}) == "[####################] step 150/100"  # past the end (--stop_at): a full bar
    for seconds, shown in ((3600, "1h00m"), (3 * 3600 + 5 * 60 + 29, "3h05m"), (50 * 3600 + 59 * 60, "50h59m"), (3599, "59m59s")):
        assert M.format_progress(1, 2, {"eta_seconds": seconds}) == f"[##########..........] step 1/2 eta {shown}", seconds
    # layer_loads' tensors (as MetricsLogger.log takes them), a read-back record's None, a NaN anywhere: the worst finite layer
    loads = M.layer_loads(torch.tensor([[10, 2, 6, 6], [8, 8, 8, 8]]), 32)
    for record in (loads, M.to_host(loads), {"load_max_over_mean": [None, 5 / 3]}, {"load_max_over_mean": [float("nan"), 5 / 3]},
                   {"load_max_over_mean": [5 / 3, float("nan")]}):
        assert M.format_progress(1, 10, record) == "[##..................] step 1/10 load 1.67", record
    assert M.format_progress(1, 10, {"load_max_over_mean": [None, float("inf")]}) == "[##..................] step 1/10"
    with pytest.raises(ValueError, match="total_steps: expected >= 1, got 0"):
        M.format_progress(1, 0, {})
    with pytest.raises(ValueError, match="record: expected a dict of the step's metrics, got NoneType"):  # an AttributeError before
        M.format_progress(1, 10, None)


def test_progress_line_picks_the_unit_of_the_rounded_value():
    """A value that rounds up to 1000 of a unit is 1.0 of the next: 999.96 is 1.0k, not 1000.0."""
    cases = {999.94: "999.9", 999.96: "1.0k", 12345.0: "12.3k", 999_949.0: "999.9k", 999_999.0: "1.0M", 999_999_999.0: "1.0G",
             999_999_999_999.0: "1.0T", 5e12: "5.0T", 0.0: "0.0"}
    for value, shown in cases.items():
        assert M.format_progress(1, 2, {"tokens_per_s": value}) == f"[##########..........] step 1/2 tok/s {shown}", value


def test_logger_jsonl_and_resume(tmp_path, capsys):
    log = M.MetricsLogger(tmp_path / "run", total_steps=10)
    for step in range(1, 6):
        log.log(step, {"loss": torch.tensor(4.0 - step / 10), "lr": 1e-3 * step, "tokens": 512 * step, "grad_norm": torch.tensor(0.5),
                       "tokens_per_s": 1000.0, "bad": float("nan"), **M.layer_loads([[1, 3], [2, 2]], slots=4)})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[-1].startswith("[##########..........] step 5/10 loss 3.5000 lr 5.0e-03")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON, one object per line
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    r = records[1]
    assert {"step", "loss", "lr", "tokens", "grad_norm", "tokens_per_s"} <= r.keys()
    assert r["loss"] == pytest.approx(3.8) and isinstance(r["tokens"], int) and r["grad_norm"] == 0.5
    assert r["bad"] is None and r["tokens_per_expert"] == [[1, 3], [2, 2]] and r["load_max_over_mean"] == [1.5, 1.0]

    # a killed run leaves a torn line; a resume at step 3 keeps steps 1-2 only
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:  # and lines that are JSON but no record: left out, as a torn one
        f.write('[1, 2]\n5\n{"loss": 1.0}\n{"step": 6, "lo')
    log = M.MetricsLogger(tmp_path / "run", total_steps=10, start_step=3)
    log.log(3, {"loss": 1.0})
    assert [r["step"] for r in M.read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    # other ranks write and print nothing
    M.MetricsLogger(tmp_path / "run", rank=1, total_steps=10).log(4, {"loss": 1.0})
    assert len(M.read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3
    # a fresh run starts an empty file
    M.MetricsLogger(tmp_path / "run", total_steps=10, print_progress=False)
    assert M.read_metrics(tmp_path / "run" / "metrics.jsonl") == []


def test_logger_bad_inputs(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="out_dir"):
        M.MetricsLogger(tmp_path / "f", total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        M.MetricsLogger(tmp_path, total_steps=0)
    log = M.MetricsLogger(tmp_path, total_steps=10)
    with pytest.raises(ValueError, match="record"):
        log.log(1, {"x": object()})
    with pytest.raises(ValueError, match="step"):
        log.log(-1, {})


def test_a_log_after_close_or_of_keys_that_write_alike_is_refused(tmp_path):
    """After close() the TensorBoard events stopped without a word while metrics.jsonl went on;
    keys 1 and "1" (a dict of counts keyed by ints beside strings) were both written as "1",
    the later value alone kept. Both are ValueErrors now, writing nothing."""
    log = M.MetricsLogger(tmp_path, total_steps=5, print_progress=False)
    log.log(1, {"loss": 2.0, "per_source": {1: 3, "two": 4}})
    for bad, match in [({"per_source": {1: 3, "1": 4}}, r"record: keys 1 and '1' would both be written as the JSON key '1'"),
                       ({1: 2.0, "1": 3.0}, r"record: keys 1 and '1'")]:
        with pytest.raises(ValueError, match=match):
            log.log(2, bad)
    log.close()
    log.close()  # a second close: nothing
    with pytest.raises(ValueError, match=r"MetricsLogger: log\(\) after close\(\)"):
        log.log(2, {"loss": 1.0})
    assert M.read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0, "per_source": {"1": 3, "two": 4}}]
    other = M.MetricsLogger(tmp_path, rank=1, total_steps=5)  # every rank calls log(): refused on each alike
    other.close()
    with pytest.raises(ValueError, match="after close"):
        other.log(2, {})


def test_a_resume_s_rewrite_of_the_log_is_whole_or_not_at_all(tmp_path, monkeypatch):
    """A resumed logger rewrites metrics.jsonl without the records from its start step on: a
    failure during the rewrite (a full disk, a kill) left it cut short, the run's history lost.
    It is written beside it and renamed over it: a failure leaves the file as it was, and
    the file itself is never written in place."""
    log = M.MetricsLogger(tmp_path, total_steps=5, print_progress=False)
    for step in (1, 2, 3):
        log.log(step, {"loss": float(step)})
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(M.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        M.MetricsLogger(tmp_path, total_steps=5, start_step=2, print_progress=False)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    monkeypatch.undo()
    real_write = type(tmp_path).write_text

    def write_text(path, *args, **kwargs):
        assert path.name != "metrics.jsonl", "metrics.jsonl written in place"
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "write_text", write_text)
    M.MetricsLogger(tmp_path, total_steps=5, start_step=2, print_progress=False)
    monkeypatch.undo()
    assert [r["step"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_logger_refuses_a_step_read_metrics_would_leave_out(tmp_path):
    """read_metrics keeps the records with an int step: log refuses any other step, so that no
    written record is dropped on reading."""
    log = M.MetricsLogger(tmp_path, total_steps=10, print_progress=False)
    log.log(1, {"loss": 2.0})
    for bad in (2.0, True, 2.5, "2", torch.tensor(2)):
        with pytest.raises(ValueError, match=r"step: expected an int, got "):
            log.log(bad, {"loss": 1.5})
    log.log(2, {"loss": 1.5})
    assert [r["step"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a hand-edited line: JSON's true is no step
        f.write('{"step": true, "loss": 9.0}\n')
    assert [r["step"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    # a record's own "step" overrode the argument: 2.0 was written (and left out on reading), 7 where the progress said 3
    for bad in (3.0, 7, True):
        with pytest.raises(ValueError, match=rf"record: its 'step' is the step logged, expected 3 \(or no 'step' key\), got {bad!r}"):
            log.log(3, {"step": bad, "loss": 1.0})
    log.log(3, {"step": 3, "loss": 1.0})  # the loop's records hold their own step
    assert [r["step"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    with open(tmp_path / "metrics.jsonl", "ab") as f:  # a byte that is not UTF-8 (a damaged disk, a hand edit): left out, not a crash
        f.write(b'{"step": 4, "loss": "\xff"}\n')
    assert [r["step"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    M.MetricsLogger(tmp_path, total_steps=10, start_step=4, print_progress=False)  # a resume reads it too
    assert [r["step"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def _synthetic_run(out_dir):
    log = M.MetricsLogger(out_dir, total_steps=40, print_progress=False)
    g = torch.Generator().manual_seed(0)
    for step in range(1, 41):
        counts = torch.randint(0, 20, (3, 8), generator=g)
        counts[1, 0] += 60 - step  # one hot expert that cools down
        record = {"loss": 5.0 * 0.97 ** step, "aux_loss": 0.01 + 0.001 * torch.rand((), generator=g).item(),
                  **M.layer_loads(counts, slots=int(counts.sum(1).max()))}
        if step % 10 == 0:
            record["val_loss"] = 5.2 * 0.97 ** step
        # run health: norms, zero gradients, energy, two data sources
        record.update(grad_norm=1.0 / step, param_norm=10.0 + 0.01 * step, zero_grads=step % 3, energy_j_per_token=0.002,
                      tokens_by_source={"code": 96 * (1 + step % 2), "prose": 96})
        log.log(step, record)


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots extra (matplotlib) is not installed")
    _synthetic_run(tmp_path)
    result = subprocess.run([sys.executable, "-m", "fmoe.train.plot", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path / n) for n in ("loss.png", "expert_load.png", "health.png")]
    for name in ("loss.png", "expert_load.png", "health.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_loss_plot_shows_each_sources_validation_loss(tmp_path, monkeypatch):
    """A blend's runs: a validation line per source beside the mean; one source: the mean only."""
    plot = _plot()

    drawn = []
    monkeypatch.setattr(plot, "_draw_panel", lambda ax, series, ylabel: drawn.append((ylabel, dict(series))))
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "val_loss": 2.6, "val_loss_by_source": {"docs": 3.2, "code": 2.4}}]
    assert plot.plot_losses(records, tmp_path / "loss.png", plot._pyplot())
    assert drawn == [("loss / val_loss", {"loss": ([1, 2], [3.0, 2.5]), "val_loss": ([2], [2.6]),
                                          "val_loss code": ([2], [2.4]), "val_loss docs": ([2], [3.2])})]
    drawn.clear()
    records[1]["val_loss_by_source"] = {"stdlib": 2.6}
    assert plot.plot_losses(records, tmp_path / "loss.png", plot._pyplot())
    assert list(drawn[0][1]) == ["loss", "val_loss"]


def test_loss_plot_shows_the_losses_the_default_run_logs(tmp_path, monkeypatch):
    """The loop logs lm loss, mtp_<d>_loss per depth and every balancing loss, a loss whose
    coefficient is 0 as 0: a panel per kind, each MTP depth in one, the all-zero ones left out."""
    plot = _plot()

    drawn = []
    monkeypatch.setattr(plot, "_draw_panel", lambda ax, series, ylabel: drawn.append((ylabel, dict(series))))
    records = [{"step": s, "loss": 4.0 / s, "lm_loss": 4.0 / s, "mtp_1_loss": 4.5 / s, "mtp_10_loss": 6.0 / s, "mtp_2_loss": 5.0 / s,
                "seq_aux_loss": 1.0 + s / 100, "aux_loss": 0.0, "z_loss": 0.0} for s in (1, 2)]
    assert plot.plot_losses(records, tmp_path / "loss.png", plot._pyplot())
    assert [(ylabel, list(series)) for ylabel, series in drawn] == [
        ("loss", ["loss"]), ("mtp_1_loss / mtp_2_loss / mtp_10_loss", ["mtp_1_loss", "mtp_2_loss", "mtp_10_loss"]),
        ("seq_aux_loss", ["seq_aux_loss"])]
    assert drawn[2][1]["seq_aux_loss"] == ([1, 2], [1.01, 1.02])
    drawn.clear()
    records[1]["z_loss"] = 1e-4  # logged, not all zero: its panel, the zero at step 1 kept
    assert plot.plot_losses(records, tmp_path / "loss.png", plot._pyplot())
    assert drawn[-1] == ("z_loss", {"z_loss": ([1, 2], [0.0, 1e-4])})
    # DeepSeek sparse attention's indexer loss, where the run logs it: a panel of its own
    drawn.clear()
    for s, record in enumerate(records, start=1):
        record["index_loss"] = 0.5 / s
    assert plot.plot_losses(records, tmp_path / "loss.png", plot._pyplot())
    assert drawn[-1] == ("index_loss", {"index_loss": ([1, 2], [0.5, 0.25])})


def test_expert_load_plot_draws_a_diverged_layers_null_load_as_a_gap(tmp_path):
    """A non-finite load is logged as null (strict JSON); the heatmap shows it as NaN (blank), not a TypeError."""
    plot = _plot()

    log = M.MetricsLogger(tmp_path, total_steps=2, print_progress=False)
    log.log(1, {"loss": 3.0, "load_max_over_mean": [1.5, float("nan")]})
    log.log(2, {"loss": float("inf"), "load_max_over_mean": [1.4, 1.2]})
    assert M.read_metrics(tmp_path / "metrics.jsonl")[0]["load_max_over_mean"] == [1.5, None]
    steps, mom, per_layer = plot._load_matrix(M.read_metrics(tmp_path / "metrics.jsonl"))
    assert steps == [1, 2] and per_layer is None
    assert mom[0] == [1.5, 1.4] and math.isnan(mom[1][0]) and mom[1][1] == 1.2
    assert plot.plot_run(tmp_path) == [tmp_path / "loss.png", tmp_path / "expert_load.png"]


def test_line_plots_mark_a_non_finite_step_and_keep_an_all_null_series(tmp_path):
    """metrics.jsonl writes a NaN or inf as null: the line breaks at that step (it was drawn straight across from the step
    before to the step after), a dotted vertical line marks the step, and the panel counts them; a loss null at every step
    keeps its panel with a note (it lost its panel without a word)."""
    plot = _plot()

    log = M.MetricsLogger(tmp_path, total_steps=4, print_progress=False)
    nan, inf = float("nan"), float("inf")
    for step, loss, grad_norm in ((1, 4.0, 1.0), (2, 3.0, inf), (3, nan, nan), (4, 1.0, 0.25)):
        log.log(step, {"loss": loss, "grad_norm": grad_norm, "param_norm": 40.0})
    log.close()
    records = M.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["grad_norm"] for r in records] == [1.0, None, None, 0.25] and records[2]["loss"] is None
    pyplot, Keeps, figures = _keeping_pyplot()

    def panel(fig, ylabel):
        (ax,) = [ax for ax in fig.axes if ax.get_ylabel() == ylabel]
        lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
        marks = sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("_") and line.get_linestyle() == ":")
        return lines, marks, [t.get_text() for t in ax.texts]

    assert plot.plot_losses(records, tmp_path / "loss.png", Keeps) and plot.plot_health(records, tmp_path / "health.png", Keeps)
    lines, marks, notes = panel(figures[0], "loss")
    assert list(lines["loss"].get_xdata()) == [1, 2, 3, 4] and math.isnan(lines["loss"].get_ydata()[2])  # a gap at step 3
    assert marks == [3] and notes == ["loss: 1 non-finite step (null)"]
    lines, marks, notes = panel(figures[1], "grad_norm / param_norm")
    assert math.isnan(lines["grad_norm"].get_ydata()[1]) and math.isnan(lines["grad_norm"].get_ydata()[2])
    assert marks == [2, 3] and notes == ["grad_norm: 2 non-finite steps (null)"]
    assert figures[1].axes[0].get_yscale() == "log"  # the finite norms decide the scale
    # a run whose loss is null at every step (--check_finite=False, diverged): the loss panel stays, said
    nulls = [{**r, "loss": None} for r in records]
    assert plot.plot_losses(nulls, tmp_path / "loss.png", Keeps)
    lines, marks, notes = panel(figures[2], "loss")
    assert marks == [1, 2, 3, 4] and notes == ["loss: all 4 steps non-finite (null)"]
    assert plot.plot_losses(nulls[:1], tmp_path / "loss.png", Keeps)  # one step: not "all 1 steps"
    assert panel(figures[3], "loss")[1:] == ([1], ["loss: 1 non-finite step (null)"])
    # a key a record does not log (val_loss between evaluations) is no gap and no mark
    assert plot._series([{"step": 1, "loss": 2.0}, {"step": 2, "val_loss": 1.0}], "val_loss") == ([2], [1.0])
    pyplot.close("all")


def test_expert_load_plot_names_the_moe_layers_as_logged(tmp_path):
    """The panels are titled by the logged moe_layers (block 1 and the MTP module here), not
    by their rows (which named block 1 "layer 0" and the MTP module "layer 1")."""
    plot = _plot()

    records = [{"step": s, "loss": 3.0, "tokens_per_expert": [[3, 1, 2, 2], [2, 2, 2, 2]], "moe_layers": ["layer_1", "mtp_1"]}
               for s in (1, 2)]
    pyplot, Keeps, figures = _keeping_pyplot()

    assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
    axes = [ax for ax in figures[0].axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["expert load max/mean per MoE layer", "layer_1: tokens per expert / uniform",
                                               "mtp_1: tokens per expert / uniform"]
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["layer_1", "mtp_1"]
    for names in (None, ["layer_1"], ["layer_1", "mtp_1", "mtp_2"]):  # a log without the names, or of another count: the rows' numbers
        for record in records:
            record.pop("moe_layers", None)
            if names is not None:
                record["moe_layers"] = names
        assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
        axes = [ax for ax in figures[-1].axes if ax.get_title()]
        assert [ax.get_title() for ax in axes][1:] == [f"layer {i}: tokens per expert / uniform" for i in (0, 1)], names
        assert [t.get_text() for t in axes[0].get_yticklabels()] == ["layer 0", "layer 1"], names
    pyplot.close("all")


def test_expert_load_shares_leave_the_zero_experts_out(tmp_path):
    """Zero experts' columns were drawn as experts and counted in the uniform share: a layer whose 4 computing experts
    were balanced, [2, 2, 2, 2] beside a zero expert's 8, showed them at 0.625 each; now at 1.0, the zero experts' share
    being zero_fraction (said in the title), and max/mean over the computing experts, as layer_loads logs it."""
    plot = _plot()

    logged = M.to_host(M.layer_loads(torch.tensor([[2, 2, 2, 2, 8], [4, 0, 2, 2, 0]]), slots=16, zero_experts=1))
    records = [{"step": 1, "tokens_per_expert": logged["tokens_per_expert"], "zero_experts": logged["zero_experts"]}]
    steps, mom, per_layer = plot._load_matrix(records)
    assert per_layer == [[[1.0]] * 4, [[2.0], [0.0], [1.0], [1.0]]]
    assert [row[0] for row in mom] == pytest.approx(logged["load_max_over_mean"]) == [1.0, 2.0]
    pyplot, Keeps, figures = _keeping_pyplot()
    assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
    titles = [ax.get_title() for ax in figures[0].axes if ax.get_title()]
    assert titles[1] == "layer 0: tokens per expert / uniform (the computing experts; the 1 zero experts' share: zero_fraction)"
    pyplot.close("all")
    for bad in (5, -1, 1.0, True, "1"):
        with pytest.raises(ValueError, match=rf"^records: zero_experts at step 1: expected an int from 0 to 4 \(fewer than the 5 "
                                             rf"columns of tokens_per_expert\), got {re.escape(repr(bad))}"):
            plot._load_matrix([{**records[0], "zero_experts": bad}])
    with pytest.raises(ValueError, match=r"^records: tokens_per_expert at step 2 has \[5, 5\] experts per layer \(2 zero experts\) "
                                         r"where step 1's has \[5, 5\] \(1 zero experts\): a changed model"):
        plot._load_matrix([records[0], {**records[0], "step": 2, "zero_experts": 2}])


def _plot():
    """fmoe.train.plot; the test skipped, with the reason, where matplotlib is not installed."""
    pytest.importorskip("matplotlib", reason="the plots extra (matplotlib) is not installed")
    from fmoe.train import plot

    return plot


def _keeping_pyplot():
    """(pyplot, a stand-in for it whose close keeps each figure to read, the figures kept)."""
    from fmoe.train import plot

    pyplot, figures = plot._pyplot(), []

    class Keeps:
        subplots = staticmethod(pyplot.subplots)

        @staticmethod
        def close(fig):
            figures.append(fig)

    return pyplot, Keeps, figures


def test_plot_missing_metrics(tmp_path, capsys):
    from fmoe.train import plot

    assert plot.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: out_dir: no metrics.jsonl in {str(tmp_path)!r}\n"
    # an empty file, or one of lines that are no records (a torn one, JSON of another kind): said, not an exit 0 that wrote nothing
    for text in ("", '{"step": 1, "lo', "[1, 2]\nhello\n"):
        (tmp_path / "metrics.jsonl").write_text(text)
        assert plot.main([str(tmp_path)]) == 1
        assert capsys.readouterr().err == f"error: out_dir: {str(tmp_path / 'metrics.jsonl')!r} holds no records (no step was logged yet)\n"


def test_expert_load_heatmap_draws_each_column_at_its_step(tmp_path):
    """Steps 1, 100, 200, 300: step 1's load drawn around x = 1 (it was spread over 0.5..75.5,
    the columns evenly between the first and last step), not under the loss panel's step 50."""
    plot = _plot()

    pyplot, Keeps, figures = _keeping_pyplot()

    # out of order and step 100 logged twice (a resumed run): a column per step, its last record's
    records = [{"step": s, "tokens_per_expert": [[c, 4 - c]]} for s, c in ((1, 4), (200, 2), (100, 0), (100, 2), (300, 2))]
    assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
    load, share = [ax for ax in figures[0].axes if ax.get_title()]

    def drawn_at(ax, x):  # the heatmap's column of values over x
        mesh = ax.collections[0]
        edges = list(mesh.get_coordinates()[0, :, 0])
        column = next(i for i in range(len(edges) - 1) if edges[i] <= x < edges[i + 1])
        return list(mesh.get_array().reshape(-1, len(edges) - 1)[:, column])

    assert drawn_at(load, 1) == [2.0] and drawn_at(load, 40) == [2.0]  # step 1: every token to expert 0
    assert drawn_at(load, 60) == drawn_at(load, 100) == drawn_at(load, 300) == [1.0]
    assert drawn_at(share, 1) == [2.0, 0.0] and drawn_at(share, 100) == [1.0, 1.0]
    assert list(load.collections[0].get_coordinates()[0, :, 0]) == [-48.5, 50.5, 150.0, 250.0, 350.0]
    pyplot.close("all")


def test_expert_load_refuses_records_whose_layers_or_experts_change():
    """A layer count that changes (records of two runs) was cut to the shortest by zip, a
    layer silently lost; now a ValueError naming the key and the step."""
    plot = _plot()

    with pytest.raises(ValueError, match=r"^records: load_max_over_mean at step 2 has 1 layer where step 1's has 2"):
        plot._load_matrix([{"step": 1, "load_max_over_mean": [1.5, 7.0]}, {"step": 2, "load_max_over_mean": [1.2]}])
    with pytest.raises(ValueError, match=r"^records: tokens_per_expert at step 3 has 3 layers where step 1's has 2"):
        plot._load_matrix([{"step": 1, "load_max_over_mean": [1.5, 7.0]}, {"step": 3, "tokens_per_expert": [[1, 2]] * 3}])
    with pytest.raises(ValueError, match=r"^records: tokens_per_expert at step 2 has \[3\] experts per layer where step 1's has \[2\]"):
        plot._load_matrix([{"step": 1, "tokens_per_expert": [[1, 2]]}, {"step": 2, "tokens_per_expert": [[1, 2, 3]]}])
    with pytest.raises(ValueError, match=r"^records: load_max_over_mean at step 1 has 2 layers, its tokens_per_expert 1"):
        plot._load_matrix([{"step": 1, "load_max_over_mean": [1.5, 7.0], "tokens_per_expert": [[1, 2]]}])


@pytest.mark.parametrize("records, error", [
    ([{"step": 1, "tokens_per_expert": [[1, 2], [3, 4]]}, {"step": 2, "tokens_per_expert": [[1, 2]]}],
     "records: tokens_per_expert at step 2 has 1 layer where step 1's has 2"),  # was an IndexError
    ([{"step": 1, "tokens_per_expert": [[1, 2]]}, {"step": 2, "tokens_per_expert": [[1, None]]}],
     "records: tokens_per_expert at step 2: expected a list of per-layer lists of expert counts"),  # TypeError
    ([{"step": 1, "load_max_over_mean": 1.5}], "records: load_max_over_mean at step 1: expected a list of per-layer numbers, got 1.5"),
    ([{"step": 1, "loss": 1.0, "tokens_by_source": {"a": None, "b": 3}}],
     "records: tokens_by_source at step 1: expected a token count (a number >= 0) per source, got {'a': None, 'b': 3}"),
    ([{"step": 1, "foo": 3.0}, {"step": 2, "foo": 2.0}], "out_dir: nothing to plot in "),  # was exit 0, nothing written or said
], ids=["layers_change", "null_count", "scalar_load", "null_source_count", "no_known_keys"])
def test_plot_cli_says_what_is_wrong_with_odd_records(tmp_path, capsys, records, error):
    """The CLI's error: line (exit 1, no file written), not a traceback or a silent exit 0."""
    plot = _plot()

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {error}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    if error.startswith("out_dir"):  # names the keys the plots look for, and those the records log
        assert "the plots draw loss, val_loss," in err and "tokens_per_expert" in err and err.endswith("its records log foo\n")


def test_active_parameters_from_the_routed_experts_shapes():
    """active = total - (E - k) x one expert's parameters per MoE layer (2 trunk + the MTP block's): a GLU expert holds 3
    matrices of H x F, a relu2 one 2, a latent MoE's 3 of L x F (train_moe printed total - (E - k) 3 H F for each, -2.18M
    "active" for a relu2 or latent model)."""
    from fmoe.model import Transformer, TransformerConfig

    base = dict(vocab_size=300, hidden=64, n_layers=3, n_dense=1, ffn_dense=128, n_experts=4, k=2, ffn_expert=32, n_shared=1,
                n_heads=4, n_kv_heads=2, head_dim=16, mtp_depth=1)
    one_expert = {"glu": 3 * 64 * 32, "relu2": 2 * 64 * 32, "latent": 3 * 16 * 32, "relu2_latent": 2 * 16 * 32,
                  "glu_biases": 3 * 64 * 32 + 2 * 32 + 64}
    over = {"glu": {}, "relu2": dict(mlp_act="relu2"), "latent": dict(moe_latent=16), "relu2_latent": dict(mlp_act="relu2", moe_latent=16),
            "glu_biases": dict(expert_biases=True)}
    for name, knobs in over.items():
        with torch.device("meta"):
            model = Transformer(TransformerConfig(**base, **knobs))
        assert len(model.moe_layers()) == 3
        total = sum(p.numel() for p in model.parameters())
        assert M.active_parameters(model) == total - 3 * (4 - 2) * one_expert[name], name
    # top-4 of 4: every parameter is active
    with torch.device("meta"):
        model = Transformer(TransformerConfig(**{**base, "k": 4}))
    assert M.active_parameters(model) == sum(p.numel() for p in model.parameters())
    for bad in (None, torch.nn.Linear(2, 2), model.cfg):  # AttributeErrors naming no argument
        with pytest.raises(ValueError, match=rf"model: expected a fmoe.model.Transformer \(or a module with its moe_layers\(\)\), got {type(bad).__name__}"):
            M.active_parameters(bad)


def test_model_flops_per_token_refuses_what_is_not_a_model_config():
    """None or a dict gave "'NoneType' object has no attribute 'n_dense'"."""
    for bad, lacking in ((None, "hidden, n_layers"), ({"hidden": 64}, "hidden, n_layers"),
                         (dataclasses.make_dataclass("C", ["hidden", "n_layers"])(64, 2), "without ffn_dense, ffn_expert")):
        with pytest.raises(ValueError, match=rf"cfg: expected a fmoe.model.TransformerConfig \(or an object with its fields\), "
                                             rf"got {type(bad).__name__} .*{lacking}.*n_shared"):
            M.model_flops_per_token(bad, n_avg_keys=10.0)


def test_model_flops_per_token_reads_the_model_config():
    from fmoe.model import TransformerConfig

    cfg = TransformerConfig(vocab_size=300, hidden=64, n_layers=3, n_dense=1, ffn_dense=128, n_experts=4, k=2,
                            ffn_expert=32, n_shared=1, n_heads=4, n_kv_heads=2, head_dim=16, mtp_depth=1)
    expected = M.flops_per_token(hidden=64, n_layers=3, n_dense=1, ffn_dense=128, ffn_expert=32, k=2, n_shared=1,
                                       n_heads=4, n_kv_heads=2, head_dim=16, vocab=300, mtp_depth=1, n_avg_keys=10.0, n_experts=4)
    assert M.model_flops_per_token(cfg, n_avg_keys=10.0) == expected
    # zero experts: the router scores 4 + 3 choices; k the step's mean computing experts per token
    zero = TransformerConfig(**{**cfg.__dict__, "zero_experts": 3})
    assert M.model_flops_per_token(zero, n_avg_keys=10.0) == expected + 3 * 6 * 64 * 3
    assert M.model_flops_per_token(zero, n_avg_keys=10.0, k=1.5) == expected + 3 * 6 * 64 * 3 - 3 * 6 * 64 * 3 * 32 * 0.5
    with pytest.raises(ValueError, match="k: expected a finite number >= 0"):
        M.model_flops_per_token(zero, n_avg_keys=10.0, k=-1.0)
    # shortcut pairs (4 blocks, n_dense 1): block 2 the only trunk MoE, its dense MLP of 128 beside it; blocks 0, 1 and 3 dense
    pairs = TransformerConfig(**{**cfg.__dict__, "n_layers": 4, "shortcut_moe": True})
    plain = TransformerConfig(**{**cfg.__dict__, "n_layers": 4, "moe_layers": (2,)})
    assert M.model_flops_per_token(pairs, n_avg_keys=10.0) == M.model_flops_per_token(plain, n_avg_keys=10.0) + 6 * 3 * 64 * 128
    # hyper-connections over 4 streams, without the MTP module: per block two weight projections [256 -> 24] (8 + 16
    # mixing) and sums over 4 streams, the mixing's 16 x 64; the head's projection [256 -> 4] and sum
    one = TransformerConfig(**{**cfg.__dict__, "mtp_depth": 0})
    hc = TransformerConfig(**{**cfg.__dict__, "mtp_depth": 0, "hyper_connections": 4})
    assert M.model_flops_per_token(hc, n_avg_keys=10.0) == M.model_flops_per_token(one, n_avg_keys=10.0) + 3 * 2 * 6 * (
        24 * 256 + 4 * 64 + 16 * 64) + 6 * (4 * 256 + 4 * 64)
    independent = TransformerConfig(**{**hc.__dict__, "hc_kind": "independent"})
    assert M.model_flops_per_token(independent, n_avg_keys=10.0) == M.model_flops_per_token(one, n_avg_keys=10.0) + 3 * 2 * 6 * (
        8 * 256 + 4 * 64) + 6 * (4 * 256 + 4 * 64)
    # by hand: 3 attention layers + the MTP block's, 1 dense MLP, 2 MoE layers + the MTP block's
    attention = 6 * (64 * (64 + 2 * 32) + 64 * 64) + 12 * 64 * 10.0
    moe = 6 * 64 * 3 * 32 * (2 + 1) + 6 * 64 * 4
    assert expected == 4 * attention + 6 * 64 * 3 * 128 + 3 * moe + 6 * 2 * 64 * 64 + 2 * 6 * 64 * 300
    # moe_layers decides the dense blocks; a trunk without MoE makes the MTP block dense
    dense = TransformerConfig(**{**cfg.__dict__, "moe_layers": ()})
    assert M.model_flops_per_token(dense, n_avg_keys=10.0) == 4 * attention + 4 * 6 * 64 * 3 * 128 + 6 * 2 * 64 * 64 + 2 * 6 * 64 * 300
    # blocks 0 and 2 over a sliding window: their scores and values over 3 keys per query, not 10
    sliding = TransformerConfig(**{**cfg.__dict__, "window": 4, "window_layers": (0, 2)})
    assert M.model_flops_per_token(sliding, n_avg_keys=10.0, n_avg_local_keys=3.0) == expected - 2 * 12 * 64 * (10.0 - 3.0)
    with pytest.raises(ValueError, match="n_avg_local_keys: 2 blocks attend over a sliding window of 4"):
        M.model_flops_per_token(sliding, n_avg_keys=10.0)
    # gated attention: each block's gate [H, N D] beside its projections (3 trunk blocks and the MTP block's)
    gated = TransformerConfig(**{**cfg.__dict__, "attn_gate": True})
    assert M.model_flops_per_token(gated, n_avg_keys=10.0) == expected + 4 * 6 * 64 * 64
    with pytest.raises(ValueError, match="attn_gate: expected a bool, got 1"):
        M.flops_per_token(hidden=64, n_layers=3, n_dense=1, ffn_dense=128, ffn_expert=32, k=2, n_shared=1, n_heads=4, n_kv_heads=2,
                          head_dim=16, vocab=300, n_avg_keys=10.0, attn_gate=1)
    # MiMo-V2-Flash's attention: values of 8 (not 16) per head, 4 kv heads (not 2) in the window's blocks 0 and 2: by hand,
    # q [64 -> 64], k [64 -> G 16], v [64 -> G 8], o [32 -> 64]; the scores over 16 channels and the values over 8
    mimo = TransformerConfig(**{**cfg.__dict__, "v_head_dim": 8, "window": 4, "window_layers": (0, 2), "local_kv_heads": 4})

    def mimo_attention(G, keys):
        return 6 * (64 * 64 + 64 * G * 16 + 64 * G * 8 + 32 * 64) + 6 * 4 * (16 + 8) * keys

    want = 2 * mimo_attention(4, 3.0) + 2 * mimo_attention(2, 10.0) + 6 * 64 * 3 * 128 + 3 * moe + 6 * 2 * 64 * 64 + 2 * 6 * 64 * 300
    assert M.model_flops_per_token(mimo, n_avg_keys=10.0, n_avg_local_keys=3.0) == want
    # Laguna's attention: 8 query heads (not 4) in the window's blocks 0 and 2, a per-head gate [64 -> N] in every block: by
    # hand, q [64 -> N 16], k, v [64 -> 32], o [N 16 -> 64], the gate 64 N; the scores and values over N heads
    laguna = TransformerConfig(**{**cfg.__dict__, "window": 4, "window_layers": (0, 2), "local_heads": 8, "attn_gate": True,
                                  "attn_gate_per_head": True})

    def laguna_attention(N, keys):
        return 6 * (64 * N * 16 + 2 * 64 * 32 + N * 16 * 64 + 64 * N) + 6 * N * (16 + 16) * keys

    want = 2 * laguna_attention(8, 3.0) + 2 * laguna_attention(4, 10.0) + 6 * 64 * 3 * 128 + 3 * moe + 6 * 2 * 64 * 64 + 2 * 6 * 64 * 300
    assert M.model_flops_per_token(laguna, n_avg_keys=10.0, n_avg_local_keys=3.0) == want
    with pytest.raises(ValueError, match="local_heads: expected a finite number >= 1, got 0"):
        M.flops_per_token(hidden=64, n_layers=3, n_dense=1, ffn_dense=128, ffn_expert=32, k=2, n_shared=1, n_heads=4, n_kv_heads=2,
                          head_dim=16, vocab=300, n_avg_keys=10.0, local_heads=0)
    # and chunked blocks (Llama 4) alike
    chunked = TransformerConfig(**{**cfg.__dict__, "chunk": 4, "chunk_layers": (0, 2)})
    assert M.model_flops_per_token(chunked, n_avg_keys=10.0, n_avg_local_keys=3.0) == expected - 2 * 12 * 64 * (10.0 - 3.0)
    with pytest.raises(ValueError, match="n_avg_local_keys: 2 blocks attend within chunks of 4"):
        M.model_flops_per_token(chunked, n_avg_keys=10.0)
    # Gated DeltaNet blocks 0 and 2 (2 key heads of 8, 4 value heads of 6, 4 taps), in place of
    # their attention: q, k [64 -> 16], v, z [64 -> 24], b, a [64 -> 4], out [24 -> 64]; the
    # taps of 16 + 16 + 24 channels; 3 products with 4 [8, 6] states
    linear = TransformerConfig(**{**cfg.__dict__, "linear_layers": (0, 2), "linear_k_heads": 2, "linear_v_heads": 4, "linear_k_dim": 8,
                                  "linear_v_dim": 6, "linear_conv": 4, "window": 4})
    layer = 6 * (64 * (2 * 16 + 2 * 24 + 2 * 4) + 24 * 64 + 4 * (2 * 16 + 24) + 3 * 4 * 8 * 6)
    assert M.linear_attention_flops(64, linear.linear_attention_config()) == layer
    # LFM2's short convolution over 16 channels (4 heads of 4), 3 taps: wb, wc, wv [64 -> 16], wo [16 -> 64], 3 taps per channel
    short = dataclasses.replace(linear.linear_attention_config(), n_k_heads=4, n_v_heads=4, k_head_dim=4, v_head_dim=4, conv=3, kind="short_conv")
    assert M.linear_attention_flops(64, short) == 6 * (3 * 64 * 16 + 16 * 64 + 3 * 16)
    # Kimi Delta Attention (2 heads of 8): q, k, v [64 -> 16], b [64 -> 2], the decay's 64 -> 8 -> 16, the gate's 64 -> 8 -> 16,
    # out [16 -> 64]; the taps of 3 x 16 channels; 3 products with 2 [8, 8] states
    kda = dataclasses.replace(linear.linear_attention_config(), n_v_heads=2, v_head_dim=8, kind="kda")
    kda_layer = 6 * (64 * (3 * 16 + 2) + 2 * (64 * 8 + 8 * 16) + 16 * 64 + 4 * 3 * 16 + 3 * 2 * 8 * 8)
    assert M.linear_attention_flops(64, kda) == kda_layer
    # MiniMax's lightning attention (2 heads of 8): q, k, v, the gate [64 -> 16], out [16 -> 64]; no taps; 2 products with
    # 2 [8, 8] states
    light = dataclasses.replace(kda, kind="lightning")
    assert M.linear_attention_flops(64, light) == 6 * (5 * 64 * 16 + 2 * 2 * 8 * 8)
    # Mamba-2's (2 groups of C and B of 8, 4 heads of x of 6, 4 taps): C, B [64 -> 16], x, z [64 -> 24], dt [64 -> 4],
    # out [24 -> 64]; the taps of 16 + 16 + 24 channels; 2 products with 4 [8, 6] states
    mamba = dataclasses.replace(linear.linear_attention_config(), kind="mamba2")
    assert M.linear_attention_flops(64, mamba) == 6 * (64 * (2 * 16 + 2 * 24 + 4) + 24 * 64 + 4 * (2 * 16 + 24) + 2 * 4 * 8 * 6)
    # Mamba-1's (128 channels of x, a state of 16 each, dt of rank 4, 4 taps): x, z [64 -> 128], dt's pair [128 -> 4 -> 128],
    # B, C [128 -> 16], out [128 -> 64]; the taps of 128 channels; 2 products with 128 [16, 1] states
    mamba1 = dataclasses.replace(linear.linear_attention_config(), kind="mamba1", n_k_heads=1, n_v_heads=128, k_head_dim=16, v_head_dim=1,
                                 dt_rank=4)
    assert M.linear_attention_flops(64, mamba1) == 6 * (2 * 64 * 128 + 2 * 4 * 128 + 2 * 128 * 16 + 128 * 64 + 4 * 128 + 2 * 128 * 16)
    # Falcon-H1's parallel hybrid: Mamba-2 mixers in blocks 0 and 2 beside their attention, which every block keeps
    hybrid = TransformerConfig(**{**cfg.__dict__, "linear_layers": (0, 2), "linear_kind": "mamba2", "linear_k_heads": 2, "linear_v_heads": 4,
                                  "linear_k_dim": 8, "linear_v_dim": 6, "linear_conv": 4, "parallel_hybrid": True})
    assert M.model_flops_per_token(hybrid, n_avg_keys=10.0) == M.model_flops_per_token(cfg, n_avg_keys=10.0) + 2 * M.linear_attention_flops(64, mamba)
    # block 1 slides over its window (3 keys); the MTP block attends over all
    assert M.model_flops_per_token(linear, n_avg_keys=10.0, n_avg_local_keys=3.0) == expected - 2 * attention + 2 * layer - 12 * 64 * (10.0 - 3.0)
    with pytest.raises(ValueError, match=r"n_dense / n_sliding \+ n_linear \+ n_mlp_only: expected at most n_layers=3, got 1 / 2 \+ 2 \+ 0"):
        M.flops_per_token(hidden=64, n_layers=3, n_dense=1, ffn_dense=128, ffn_expert=32, k=2, n_shared=1, n_heads=4, n_kv_heads=2,
                          head_dim=16, vocab=300, n_avg_keys=10.0, n_sliding=2, n_avg_local_keys=3.0, n_linear=2, linear_layer=1.0)


# (name, TransformerConfig overrides) of the counted-FLOPs check: MoE trunk with MTP, an
# all-dense trunk (its MTP block dense), multi-latent attention with low-rank q
COUNTED = {
    "moe, mtp": dict(),
    "dense, mtp": dict(moe_layers=()),
    "mla, mtp": dict(n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5),
    # LongCat-Flash's blocks: one shortcut pair (block 0's MoE beside its dense MLP), scaled latents
    "shortcut pair, mla": dict(n_dense=0, shortcut_moe=True, n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5,
                               mla_scales=True),
    # hyper-connections over 3 streams (no MTP beside them): DeepSeek-V4's mixed streams, HY-V4's independent ones
    "mhc": dict(hyper_connections=3, mtp_depth=0),
    "independent hc": dict(hyper_connections=3, hc_kind="independent", mtp_depth=0),
    # A.X-K2's: wq_b over the q latent normed and raw, the output gate over that input too, gated pre-norms (the
    # attention's in every block, the MLP's in the MoE blocks, the MTP block's both)
    "axk2": dict(n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5, q_latent_raw=True, attn_gate=True,
                 attn_gate_on_q=True, norm_gate_rank=3),
    # Gemma 4's: block 0 over a window with heads of 6 and 4 kv heads, block 1 global without wv; a dense MLP beside each
    # MoE (the MTP block's too), the router over its own norm
    # Arcee's: every MLP without a gate, relu(x w_up)^2 w_down (2 matrices), the MTP block's too
    "relu2, dense": dict(moe_layers=(), mlp_act="relu2"),
    # Nemotron 3's: routed and shared experts without a gate (2 matrices each), the MTP block's MoE too
    "relu2, moe": dict(mlp_act="relu2"),
    # ...and Nemotron 3 Super's latent MoE: the routed experts over 12 channels between the two latent projections
    "relu2, latent moe": dict(mlp_act="relu2", moe_latent=12),
    # Nemotron-H's: block 1 its attention alone (no MLP), the other MLPs without a gate
    "mlp-free block, relu2": dict(moe_layers=(), mlp_act="relu2", mlp_free_layers=(1,)),
    # ...and beside hyper-connections: no MLP, no MLP streams' weights in block 0 (block 1 MoE)
    "mlp-free block, mhc": dict(hyper_connections=3, mtp_depth=0, moe_layers=(1,), mlp_free_layers=(0,)),
    # Nemotron-H-47B's: block 0 its MLP alone (no attention), then an MoE block, a sliding window where there is attention
    "mixer-free block, window": dict(mixer_free_layers=(0,), window=4, mlp_act="relu2"),
    "mixer-free block, mhc": dict(hyper_connections=3, mtp_depth=0, mixer_free_layers=(1,)),
    # DeepSeek-V4's grouped output projection: 2 groups of 2 heads, each to 6 channels, then 12 -> H (batched products:
    # aten.bmm); over grouped-query attention, and over multi-latent attention with a v_head_dim of its own
    "o_groups": dict(o_groups=2, o_rank=6),
    # ...and its shared key-value heads: no wv, in every block
    "kv_shared": dict(kv_shared=True, window=4, window_layers=(0,)),
    "q latent, head_k": dict(q_rank=10, qk_norm="head_k", rope_dim=4, rope_last=True),  # DeepSeek-V4's queries: wq_a, wq_b in place of wq
    # heavily compressed attention in block 1 (runs of 4: 6 slots of the 24 tokens, every one scored by the math path)
    "hca": dict(n_kv_heads=1, kv_shared=True, qk_norm="head_k", window=6, compress_layers=(1,), compress_rate=4, attn_sinks=True),
    # compressed sparse attention in block 1 (overlapping runs of 4, each query's best 2 of the 6 slots by an indexer of 2 heads of
    # 8: its scores over every slot, its loss over the 2 chosen; the attention's math path over every slot too), and without the
    # loss (the indexer's forward alone)
    "csa": dict(n_kv_heads=1, kv_shared=True, qk_norm="head_k", q_rank=10, window=6, csa_layers=(1,), csa_rate=4, csa_topk=2, index_heads=2,
                index_head_dim=8, attn_sinks=True),
    "csa, frozen indexer": dict(n_kv_heads=1, kv_shared=True, qk_norm="head_k", q_rank=10, window=6, csa_layers=(1,), csa_rate=4, csa_topk=2,
                                index_heads=2, index_head_dim=8, attn_sinks=True, index_loss_coeff=0.0),
    # JetMoE's mixture of attention heads: each token's 2 of 3 experts' query and output projections (the per-expert loop
    # of impl "torch": aten.mm), its router [H, 3], in every attention block and the MTP's
    "jetmoe": dict(moa_experts=3, moa_topk=2, moe_out_bias=True),
    "o_groups, mla": dict(n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5, o_groups=2, o_rank=3),
    "gemma4": dict(qk_norm="head", post_norms=True, v_norm=True, global_k_eq_v=True, window=4, window_layers=(0,), local_head_dim=6,
                   local_kv_heads=4, local_rope_base=100.0, rope_proportion=0.5, n_dense=0, dense_beside_moe=True, router_norm=True,
                   router_expert_scale=True, layer_scalars=True, attn_gate=True),
    # ...without the local blocks' own heads: block 0 (a window, or chunks) keeps its wv, block 1 and the MTP block have none
    "k_eq_v, window": dict(global_k_eq_v=True, window=4, window_layers=(0,)),
    "k_eq_v, chunk": dict(global_k_eq_v=True, chunk=4, chunk_layers=(0,)),
    # the dense MLP beside the MoE without a gate (2 matrices): a shortcut pair's, Gemma 4's (the MTP block's too)
    "shortcut pair, relu2": dict(n_dense=0, shortcut_moe=True, mlp_act="relu2"),
    "dense beside moe, relu2": dict(dense_beside_moe=True, post_norms=True, mlp_act="relu2"),
}


@pytest.mark.parametrize("coeff", [1.0, 0.0], ids=["trained", "frozen"])
@pytest.mark.parametrize("knobs", [dict(mtp_depth=0), dict(mtp_depth=1, index_shared_layers=(1,))], ids=["every block", "shared, mtp"])
def test_sparse_attention_indexer_counts_what_runs(coeff, knobs):
    """DeepSeek sparse attention's indexer, counted as in test_flops_per_token_matches_counted_matmuls
    (CPU math path: every key scored and attended: n_avg_keys = n_avg_index_keys = T). Not
    trained (index_loss_coeff 0) the choice's forward alone runs: the formula counted 6 x it
    (8704 FLOPs a token of 154592 that never ran). Trained, its loss recomputes the queries and
    head weights (not the keys: their dW alone), runs over the index_topk chosen slots (not 6 x
    every key's products) and reads the attention's probabilities over the kept keys: the
    formula was 2432 FLOPs a token short of 165728. Blocks reusing an earlier choice
    (index_shared_layers) have none; the MTP block has one. k above the computing experts is
    refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.data import make_batch

    cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=2, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32, n_shared=1,
                            n_heads=4, n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5, index_topk=3,
                            index_heads=4, index_head_dim=6, index_loss_coeff=coeff, impl="torch", **knobs)
    T = 24
    model = Transformer(cfg)
    batch = make_batch(torch.randint(0, cfg.vocab_size, (T,)), torch.tensor([0, T]), cfg.mtp_depth)
    with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):  # the math path's products, counted
        losses, _ = model(batch, model.context(batch))
        sum(losses[key] for key in losses.keys() if key.endswith("_sum")).backward()
    assert counter.get_total_flops() == T * M.model_flops_per_token(cfg, n_avg_keys=T, n_avg_index_keys=T)
    with pytest.raises(ValueError, match="k: the mean computing experts per token, expected at most n_experts = 4, got 9"):
        M.model_flops_per_token(cfg, n_avg_keys=T, n_avg_index_keys=T, k=9)


@pytest.mark.parametrize("coeff", [1.0, 0.0], ids=["trained", "frozen"])
@pytest.mark.parametrize("layers", [None, (1,)], ids=["every block", "block 1"])
def test_block_sparse_attention_counts_its_indexer(coeff, layers):
    """MiniMax-M3's block-sparse attention (index_topk_blocks): its indexer was not counted at all
    (its projections, every key's products for the choice, and with its loss their recompute,
    backward and the target's probabilities: 24768 FLOPs a token of 293568 here, 8.4%), nor the keys the
    choice leaves out. Counted as torch.utils.flop_counter counts one forward + backward of the
    dense reference (every key scored and attended: n_avg_keys = n_avg_block_keys = T), the
    attention forced onto SDPA's math path (its fused CPU kernel with a 4-D mask escapes the
    counter), in the blocks index_block_layers names and the MTP block. The kept keys' share
    enters the attention's and the target's terms alone; without n_avg_block_keys the formula
    names it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.data import make_batch

    cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=2, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32, n_shared=1,
                            n_heads=4, n_kv_heads=2, head_dim=8, rope_dim=4, mtp_depth=1, impl="torch", index_topk_blocks=2, index_block_size=3,
                            index_heads=2, index_head_dim=6, index_loss_coeff=coeff, index_block_layers=layers)
    T = 24
    model = Transformer(cfg)
    batch = make_batch(torch.randint(0, cfg.vocab_size, (T,)), torch.tensor([0, 10, T]), cfg.mtp_depth)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        losses, _ = model(batch, model.context(batch))
        sum(losses[key] for key in losses.keys() if key.endswith("_sum")).backward()
    assert counter.get_total_flops() == T * M.model_flops_per_token(cfg, n_avg_keys=T, n_avg_block_keys=T)
    blocks = 3 if layers is None else 2  # with the MTP block
    kept = M.model_flops_per_token(cfg, n_avg_keys=T, n_avg_block_keys=T - 5) - M.model_flops_per_token(cfg, n_avg_keys=T, n_avg_block_keys=T)
    assert kept == -5 * blocks * (6 * 4 * (8 + 8) + (2 * 4 * 8 if coeff else 0))  # the scores and values, the target's probabilities
    with pytest.raises(ValueError, match=r"n_avg_block_keys: block-sparse attention attends to the keys of index_topk_blocks = 2 blocks of 3: "
                                         r"pass their mean \(mean_block_keys"):
        M.model_flops_per_token(cfg, n_avg_keys=T)
    with pytest.raises(ValueError, match="n_avg_block_keys"):
        M.model_flops_per_token(cfg, n_avg_keys=T, n_avg_block_keys=-1.0)


def test_mean_block_keys():
    """Each query attends to min(p + 1, (K - 1) b + p mod b + 1) keys (its own block's first p mod
    b + 1 and K - 1 full blocks), half a key less as mean_attended_keys counts: equal to it where
    every block is chosen, against a plain count over random documents."""
    import random

    rng = random.Random(0)
    assert M.mean_block_keys([0, 8], 2, 3) == sum(min(p + 1, 3 + p % 3 + 1) - 0.5 for p in range(8)) / 8 == (1 + 2 + 3 + 4 + 5 + 6 + 4 + 5 - 4) / 8
    for _ in range(200):
        K, b = rng.randint(1, 5), rng.randint(1, 6)
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 4))]
        if not sum(lengths):
            continue
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        want = sum(min(p + 1, (K - 1) * b + p % b + 1) - 0.5 for n in lengths for p in range(n)) / cu[-1]
        assert M.mean_block_keys(torch.tensor(cu), K, b) == pytest.approx(want, rel=1e-12, abs=0)
        if K * b >= max(lengths):
            assert M.mean_block_keys(cu, K, b) == M.mean_attended_keys(cu)
    for args, name in (((0, 3), "topk_blocks"), ((2, 0), "block_size"), ((2.0, 3), "topk_blocks"), ((2, True), "block_size")):
        with pytest.raises(ValueError, match=name):
            M.mean_block_keys([0, 8], *args)
    with pytest.raises(ValueError, match="cu_seqlens"):
        M.mean_block_keys([], 2, 3)


@pytest.mark.parametrize("name", list(COUNTED))
def test_flops_per_token_matches_counted_matmuls(name):
    """torch.utils.flop_counter.FlopCounterMode on one forward + backward of a tiny
    Transformer (impl="torch", CPU) counts the matmuls the formula is made of. What it
    counts: aten.mm (every projection, expert, router, MTP projection and head matmul,
    forward, dX and dW) and aten.bmm (attention: scaled_dot_product_attention with the
    dense mask on its math path, chosen here (torch's CPU flash kernel, which the model
    reaches otherwise, is not counted by FlopCounterMode): q k^T and p v over ALL T x T pairs,
    the mask applied but not exploited). So the count equals the formula with n_avg_keys = T (every key),
    exactly, and the mm part alone equals the formula without its score term. Every token
    has all k routes (no capacity), so the experts see T k rows. Hyper-connections' weighted
    sums of the streams (and mixing) are batched products too (aten.bmm), their weights'
    projections aten.mm; so are the grouped output projection's group products (wo_a)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.data import make_batch

    base = dict(vocab_size=64, hidden=32, n_layers=2, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32, n_shared=1,
                n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=1, impl="torch")
    cfg = TransformerConfig(**{**base, **COUNTED[name]})
    T = 24
    model = Transformer(cfg)
    batch = make_batch(torch.randint(0, cfg.vocab_size, (T,)), torch.tensor([0, 10, T]), cfg.mtp_depth)
    with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
        losses, _ = model(batch, model.context(batch))
        sum(losses[key] for key in losses.keys() if key.endswith("_sum")).backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(by_op) == {"aten.mm", "aten.bmm"}, by_op
    local = dict(n_avg_local_keys=T) if cfg.any_local else {}  # the math path scores every key there too
    if cfg.compress_layers:  # and every compressed entry's slot, T // m of them
        local["n_avg_compressed_keys"] = T // cfg.compress_rate
    if cfg.csa_layers:  # the indexer scores every slot, the math path attends to every one
        local.update(n_avg_csa_entries=T // cfg.csa_rate, n_avg_csa_chosen=T // cfg.csa_rate)
    assert counter.get_total_flops() == T * M.model_flops_per_token(cfg, n_avg_keys=T, **local)
    no_scores = M.model_flops_per_token(cfg, n_avg_keys=0, **{k: 0 for k in local})  # the score / value term is linear in n_avg_keys
    n, H = cfg.hyper_connections, cfg.hidden  # the streams' sums (and mixing) in each block's two, and the head's
    sums = 6 * ((2 * cfg.n_layers - len(cfg.mlp_free_layers or ()) - len(cfg.mixer_free_layers or ())) * (n * H + (n * n * H if cfg.hc_kind == "manifold" else 0)) + n * H) if n else 0
    # the grouped output projection's group products (wo_a), batched too: N Dv r per attention block (trunk and MTP)
    blocks = cfg.n_layers - len(cfg.mixer_free_layers or ()) + cfg.mtp_depth
    sums += 6 * blocks * cfg.n_heads * (cfg.v_head_dim or cfg.head_dim) * cfg.o_rank if cfg.o_groups else 0
    # the CSA indexer loss's products over each query's chosen slots (einsum: aten.bmm), not scaled by the counts above
    sums += len(cfg.csa_layers or ()) * 8 * cfg.index_heads * (cfg.index_head_dim + 1) * cfg.csa_topk if cfg.index_loss_coeff > 0 else 0
    assert by_op["aten.mm"] == T * (no_scores - sums)
    assert by_op["aten.bmm"] == T * (M.model_flops_per_token(cfg, n_avg_keys=T, **local) - no_scores + sums)



def test_saved_tensors_counts_each_kept_storage_once_without_the_parameters():
    from fmoe.train.metrics import SavedTensors

    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(16, 8, requires_grad=True)
    with SavedTensors(exclude=[w]) as saved:
        h = x @ w              # keeps x (and w: excluded)
        y = h.sin() * h.cos()  # keeps h twice (one storage) and sin(h), cos(h)
    y.sum().backward()
    assert saved.count == 4 and saved.nbytes == 16 * 8 * 4 + 3 * 16 * 4 * 4
    with SavedTensors() as none_kept:
        with torch.no_grad():
            x @ w
    assert none_kept.nbytes == 0 and none_kept.count == 0


def test_allocated_bytes_counts_live_and_peak_storages_once():
    from fmoe.train.metrics import AllocatedBytes

    before = torch.ones(256)  # existed before: never counted, not even when written in place
    with AllocatedBytes() as mem:
        a = torch.empty(1000)            # 4000 bytes
        b = torch.zeros(500)             # 2000
        view = a[10:20].view(2, 5)       # a view of a: nothing new
        before.add_(1.0)                 # in place on an old storage: nothing new
        del a                            # the view keeps a's storage alive
        held = mem.live
        del view                         # now it is freed
        c = b * 2                        # 2000 new
        with torch.device("meta"):
            torch.empty(10**9)           # meta: no memory
    assert (held, mem.live, mem.peak) == (6000, 4000, 6000)
    assert c.shape == (500,)


def test_allocated_bytes_follows_a_storage_resized_in_place():
    """resize_ reallocates a storage in place (the same storage, a new buffer): it counts at
    its new size, the old buffer freed; shrinking and regrowing holds one buffer, not one each."""
    from fmoe.train.metrics import AllocatedBytes

    before = torch.zeros(10)  # existed before: not counted, resized or not
    with AllocatedBytes() as mem:
        x = torch.zeros(10)              # 40 bytes
        x.resize_(1000)                  # 4000, the 40 freed
        assert (mem.live, mem.peak) == (4000, 4000) == (x.untyped_storage().nbytes(),) * 2
        for n in range(5):
            x.resize_(0)
            x.resize_(1001 + n)          # one buffer, grown to 4020 bytes
        x.untyped_storage().resize_(400)  # no op sees it: counted at the next one that does
        x.resize_(100)
        before.resize_(2000)
    assert (mem.live, mem.peak) == (400, 4020)
    del x
    assert mem.live == 0


def test_plot_health_needs_its_signals(tmp_path):
    plot = _plot()
    assert not plot.plot_health([{"step": 1, "loss": 2.0}], tmp_path / "health.png", plot._pyplot())
    assert not (tmp_path / "health.png").exists()


def test_plot_health_shows_the_sources_shares_of_a_blend_only(tmp_path):
    """One source has a share of 1 at every step: no panel for it (it drew a line hidden on the
    frame of an empty-looking panel). A blend's shares get theirs, with room above 1."""
    plot = _plot()

    class Spy:  # pyplot, noting the figures plot_health makes
        def __init__(self, plt):
            self.plt, self.figures = plt, []

        def subplots(self, *args, **kwargs):
            fig, axes = self.plt.subplots(*args, **kwargs)
            self.figures.append(axes[:, 0])
            return fig, axes

        def close(self, fig):
            self.plt.close(fig)

    base = [{"step": s, "grad_norm": 1.0 / s, "param_norm": 40.0, "zero_grads": 10 * s} for s in (1, 2, 3)]
    one = [{**r, "tokens_by_source": {"stdlib": 2048}} for r in base]
    blend = [{**r, "tokens_by_source": {"code": 1024 + 256 * r["step"], "prose": 1024 - 256 * r["step"]}} for r in base]
    spy = Spy(plot._pyplot())
    assert plot.plot_health(one, tmp_path / "one.png", spy) and plot.plot_health(blend, tmp_path / "blend.png", spy)
    (one_axes, blend_axes) = spy.figures
    assert [ax.get_ylabel() for ax in one_axes] == ["grad_norm / param_norm", "zero_grads"]
    assert [ax.get_yscale() for ax in one_axes] == ["log", "linear"]  # norms 40 and 1/3 apart: both readable
    assert [ax.get_ylabel() for ax in blend_axes] == ["grad_norm / param_norm", "zero_grads", "share of tokens"]
    shares = blend_axes[-1]
    assert [line.get_label() for line in shares.get_lines()] == ["code", "prose"] and shares.get_ylim() == (0, 1.05)
    assert list(shares.get_lines()[0].get_ydata()) == [0.625, 0.75, 0.875]


def test_tensorboard_gets_every_number_of_a_record(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = M.MetricsLogger(tmp_path, total_steps=3, print_progress=False, tensorboard=True)
    for step in (1, 2, 3):
        log.log(step, {"loss": torch.tensor(4.0 - step), "load_max_over_mean": [1.5, 2.0 + step], "tokens_by_source": {"code": 64 * step},
                       "moe_layers": ["layer_1", "layer_2"], "peak_memory_gib": None, "flag": True})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"loss", "load_max_over_mean/0", "load_max_over_mean/1", "tokens_by_source/code"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [e.value for e in events.Scalars("load_max_over_mean/1")] == [3.0, 4.0, 5.0]
    assert [e.value for e in events.Scalars("tokens_by_source/code")] == [64.0, 128.0, 192.0]
    # only rank 0 writes
    M.MetricsLogger(tmp_path / "r1", rank=1, total_steps=3, tensorboard=True).log(1, {"loss": 1.0})
    assert not (tmp_path / "r1").exists()


def test_tensorboard_without_its_package_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A resume refused for a missing tensorboard package kept the file cut back to start_step (8 records became 4)."""
    log = M.MetricsLogger(tmp_path, total_steps=8, print_progress=False)
    for step in range(1, 9):
        log.log(step, {"loss": 10.0 - step})
    log.close()
    before = (tmp_path / "metrics.jsonl").read_bytes()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import raises ImportError
    from fmoe.ops.checks import MissingExtra

    with pytest.raises(MissingExtra, match=r"pip install 'fmoe\[tensorboard\]'"):  # an ImportError the scripts say in one line
        M.MetricsLogger(tmp_path, total_steps=8, start_step=5, print_progress=False, tensorboard=True)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    with pytest.raises(ImportError, match="tensorboard"):  # a fresh run: no out_dir left behind
        M.MetricsLogger(tmp_path / "fresh", total_steps=8, tensorboard=True)
    assert not (tmp_path / "fresh").exists()


def test_tensorboard_keeps_one_record_per_step_after_a_resume(tmp_path):
    """A killed run logged steps 1..6, its newest checkpoint is step 4: the resumed run (start_step=5) re-logs 5 and 6;
    TensorBoard shows each step once, the resumed run's values (as metrics.jsonl), not the killed run's beside them."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = M.MetricsLogger(tmp_path, total_steps=6, print_progress=False, tensorboard=True)
    for step in range(1, 7):
        log.log(step, {"loss": 10.0 - step, "load_max_over_mean": [1.0 + step]})
    log.close()
    log = M.MetricsLogger(tmp_path, total_steps=6, start_step=5, print_progress=False, tensorboard=True)
    for step in (5, 6):
        log.log(step, {"loss": 100.0 + step, "load_max_over_mean": [9.0]})
    log.close()
    expected = [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 105.0), (6, 106.0)]
    assert [(r["step"], r["loss"]) for r in M.read_metrics(tmp_path / "metrics.jsonl")] == expected
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == expected
    assert [e.value for e in events.Scalars("load_max_over_mean/0")] == [2.0, 3.0, 4.0, 5.0, 9.0, 9.0]


# ---------------------------------------------------------------------------- energy


class _Counter:
    """A fake NVML energy counter (millijoules) that the test advances by hand."""

    def __init__(self, millijoules=5_000):
        self.millijoules, self.indices = millijoules, []

    def __call__(self, index):
        self.indices.append(index)
        return self.millijoules


def test_energy_meter_code_path_with_a_fake_counter(monkeypatch):
    """EnergyMeter's own code path (differences, units, the device index, a counter that
    restarts, a failing read) with a fake counter injected as `query`: this exercises no
    NVML and no GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    counter = _Counter()
    meter = M.EnergyMeter("cuda:1", query=counter)
    assert meter.available and meter.reason is None and meter.index == 1 and counter.indices == [1]
    counter.millijoules += 2500
    assert meter.joules_since_last() == 2.5
    assert meter.joules_since_last() == 0.0
    counter.millijoules = 10  # the driver reloaded: no answer for this interval, then on again
    assert meter.joules_since_last() is None and meter.available
    counter.millijoules += 4000
    assert meter.joules_since_last() == 4.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,2")  # cuda:1 is the machine's GPU 2
    assert M.EnergyMeter(torch.device("cuda", 1), query=counter).index == 2 and counter.indices[-1] == 2

    def unsupported(index):
        raise RuntimeError("Not Supported")

    meter = M.EnergyMeter(0, query=unsupported)  # an int is a CUDA index
    assert not meter.available and meter.reason == "NVML error: Not Supported" and meter.joules_since_last() is None
    flaky = _Counter()
    meter = M.EnergyMeter("cuda:0", query=lambda i: flaky(i) if flaky.millijoules < 10_000 else unsupported(i))
    flaky.millijoules = 20_000  # a later read fails: unavailable from then on
    assert meter.joules_since_last() is None and not meter.available and meter.reason == "NVML error: Not Supported"
    meter = M.EnergyMeter("cuda:2", query=counter)  # the visible list has two devices
    assert not meter.available and meter.reason.startswith("device: cuda_index: cuda:2 is not among CUDA_VISIBLE_DEVICES")


def test_energy_meter_unavailable_reasons(monkeypatch):
    import types

    meter = M.EnergyMeter("cpu")
    assert not meter.available and meter.reason == "CPU device" and meter.joules_since_last() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    meter = M.EnergyMeter("cuda:0")
    assert not meter.available and meter.reason == "pynvml not installed (pip install nvidia-ml-py)"
    assert meter.joules_since_last() is None

    # a stand-in pynvml module: the NVML calls the meter makes, and their errors
    class NVMLError(Exception):
        pass

    fake = types.ModuleType("pynvml")
    fake.NVMLError = NVMLError
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    fake.nvmlDeviceGetUUID = lambda handle: ["GPU-aaaa1111", "GPU-bbbb2222"][handle[1]]
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda handle: 1000 * (handle[1] + 1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")  # a UUID prefix: NVML's device 1
    meter = M.EnergyMeter("cuda:0")
    assert meter.available and meter.index == 1 and meter.joules_since_last() == 0.0

    def not_supported(handle):
        raise NVMLError("Not Supported")

    fake.nvmlDeviceGetTotalEnergyConsumption = not_supported
    meter = M.EnergyMeter("cuda:0")
    assert not meter.available and meter.reason == "NVML error: Not Supported"

    def no_driver():
        raise NVMLError("Driver Not Loaded")

    fake.nvmlInit = no_driver
    assert M.EnergyMeter("cuda:0").reason == "NVML error: Driver Not Loaded"


def test_nvml_index_maps_cuda_devices():
    uuids = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-abcd3333"]
    assert M.nvml_index(0) == 0 and M.nvml_index(3) == 3  # nothing hidden: CUDA's index
    assert M.nvml_index(1, visible="6,2") == 2 and M.nvml_index(0, visible=" 3 ") == 3
    assert M.nvml_index(1, visible="0,GPU-bbbb", nvml_uuids=uuids) == 1
    assert M.nvml_index(0, visible="abcd", nvml_uuids=uuids) == 2  # a UUID without its GPU- prefix
    # torch's UUID (bare) beats the environment, whatever it says
    assert M.nvml_index(0, visible="5", nvml_uuids=uuids, cuda_uuid="bbbb2222") == 1
    with pytest.raises(ValueError, match=r"cuda_index: cuda:2 is not among CUDA_VISIBLE_DEVICES='0,1'"):
        M.nvml_index(2, visible="0,1")
    with pytest.raises(ValueError, match="matches 2 of the NVML devices"):
        M.nvml_index(0, visible="GPU-a", nvml_uuids=uuids)
    with pytest.raises(ValueError, match="matches 0 of the NVML devices"):
        M.nvml_index(0, visible="MIG-1234", nvml_uuids=uuids)
    with pytest.raises(ValueError, match="cuda_index: expected an int >= 0"):
        M.nvml_index(-1)


# ---------------------------------------------------------------------------- memory

# 32032 parameters (vocab 64, H 32): embed, head 2048 each, final norm 32; block 0 (dense):
# norms 64, attention 32 x (32 + 16 + 16) + 32 x 32 = 3072, MLP 3 x 32 x 64 = 6144; block 1
# (MoE): norms 64, attention 3072, router 4 x 32 = 128, experts 3 x 4 x 32 x 32 = 12288,
# shared 3 x 32 x 32 = 3072; the expert_bias buffer: 4 float32
MEMORY_CFG = dict(vocab_size=64, hidden=32, n_layers=2, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32, n_shared=1,
                  n_heads=4, n_kv_heads=2, head_dim=8, impl="torch")
N_PARAMS, N_ROUTER, N_MUON = 32032, 128, 3072 * 2 + 6144 + 12288 + 3072  # Muon: the block matrices


def test_memory_plan_by_hand_one_process():
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.optim import AdamW, Muon, build_optimizers

    model = Transformer(TransformerConfig(**MEMORY_CFG))
    assert sum(p.numel() for p in model.parameters()) == N_PARAMS
    plan = M.memory_plan(model, AdamW(model.parameters(), impl="torch"))
    assert plan["params"] == plan["grads"] == 4 * N_PARAMS and plan["params_by_dtype"] == {"float32": 4 * N_PARAMS}
    assert plan["buffers"] == 16 and plan["optimizer"] == 2 * 4 * N_PARAMS  # exp_avg, exp_avg_sq
    assert plan["total"] == 4 * 4 * N_PARAMS + 16
    assert plan["by_mesh"] == {"replicated": {"params": 4 * N_PARAMS, "buffers": 16, "grads": 4 * N_PARAMS,
                                              "optimizer": 8 * N_PARAMS, "total": plan["total"]}}
    # bf16 moments: half the state; torch's AdamW: two float32 states, as fmoe's float32 ones
    assert M.memory_plan(model, AdamW(model.parameters(), state_dtype=torch.bfloat16, impl="torch"))["optimizer"] == 2 * 2 * N_PARAMS
    assert M.memory_plan([model], [torch.optim.AdamW(model.parameters())])["optimizer"] == 2 * 4 * N_PARAMS
    # Muon on the block matrices (one float32 momentum), AdamW on the rest
    optimizers = build_optimizers(model, adamw_cls=lambda groups, lr: AdamW(groups, lr=lr, impl="torch"))
    assert isinstance(optimizers[0], Muon) and sum(p.numel() for g in optimizers[0].param_groups for p in g["params"]) == N_MUON
    plan = M.memory_plan(model, optimizers)
    assert plan["optimizer"] == 4 * N_MUON + 2 * 4 * (N_PARAMS - N_MUON)
    # a bf16 model (the router stays float32) with float32 masters and bf16 moments, bf16 grads
    model = model.to(torch.bfloat16)
    opt = AdamW(model.parameters(), state_dtype=torch.bfloat16, master_weights=True, impl="torch")
    plan = M.memory_plan(model, opt, grad_dtype=None)
    assert plan["params_by_dtype"] == {"bfloat16": 2 * (N_PARAMS - N_ROUTER), "float32": 4 * N_ROUTER}
    assert plan["grads"] == plan["params"] == 2 * (N_PARAMS - N_ROUTER) + 4 * N_ROUTER
    assert plan["optimizer"] == 2 * 2 * N_PARAMS + 4 * (N_PARAMS - N_ROUTER)  # masters of the bf16 ones only
    assert M.memory_plan(model, opt)["grads"] == 4 * N_PARAMS  # float32 grads (the default)
    # the plan is made before the first step: no state exists yet, none is created
    assert not opt.state


def test_memory_plan_counts_a_shared_tensor_once_and_no_gradient_for_a_frozen_one():
    """A Linear(4, 2) held by two modules (a pipeline rank's chunks passed as a list) counts
    once; a frozen weight keeps its bytes and its optimizer's, and has no gradient."""
    linear = torch.nn.Linear(4, 2)
    alone = M.memory_plan(linear, torch.optim.AdamW(linear.parameters()))
    assert (alone["params"], alone["grads"], alone["optimizer"]) == (40, 40, 80)
    assert M.memory_plan([torch.nn.Sequential(linear), torch.nn.Sequential(linear)], torch.optim.AdamW(linear.parameters())) == alone
    linear.weight.requires_grad_(False)
    frozen = M.memory_plan(linear, torch.optim.AdamW(linear.parameters()))
    assert (frozen["params"], frozen["grads"], frozen["total"]) == (40, 8, 40 + 8 + frozen["optimizer"])


def test_memory_plan_refusals():
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"optimizers\[0\]: RMSprop is not an optimizer memory_plan knows"):
        M.memory_plan(linear, torch.optim.RMSprop(linear.parameters()))
    with pytest.raises(ValueError, match=r"modules\[1\]: expected an nn.Module"):
        M.memory_plan([linear, "x"])
    with pytest.raises(ValueError, match=r"optimizers\[0\]: expected a torch.optim.Optimizer"):
        M.memory_plan(linear, ["x"])
    with pytest.raises(ValueError, match="grad_dtype: expected a torch.dtype or None"):
        M.memory_plan(linear, grad_dtype="bf16")
    assert M.memory_plan(linear, torch.optim.SGD(linear.parameters(), lr=0.1))["optimizer"] == 0
    assert M.memory_plan(linear, torch.optim.SGD(linear.parameters(), lr=0.1, momentum=0.9))["optimizer"] == 24
    assert M.memory_plan(linear, torch.optim.Adam(linear.parameters(), amsgrad=True))["optimizer"] == 72


def test_mean_compressed_entries_counts_each_query_s_complete_runs():
    """Heavily compressed attention's mean entries per query against the count written out (a query at position p of its
    document sees floor((p + 1) / m) runs); model_flops_per_token needs it for a model with compressed blocks."""
    from fmoe.model import TransformerConfig

    cu = [0, 7, 9, 15, 31]
    for m in (2, 3, 5):
        want = sum((p + 1) // m for a, b in zip(cu, cu[1:]) for p in range(b - a)) / cu[-1]
        assert M.mean_compressed_entries(cu, m) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match=r"rate: expected >= 2, got 1"):
        M.mean_compressed_entries(cu, 1)
    cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=8, kv_shared=True, compress_layers=(1,),
                            compress_rate=4)
    with pytest.raises(ValueError, match=r"n_avg_compressed_keys: blocks \[1\] attend to compressed entries too"):
        M.model_flops_per_token(cfg, n_avg_keys=10.0)
    more = M.model_flops_per_token(cfg, n_avg_keys=10.0, n_avg_compressed_keys=3.0) - M.model_flops_per_token(cfg, n_avg_keys=10.0, n_avg_compressed_keys=1.0)
    assert more == 6 * cfg.n_heads * 2 * cfg.head_dim * 2.0  # the scores and values over two more entries per query


def test_compressed_sparse_attention_flops_count_the_chosen_entries_and_the_indexer_s_forward():
    """mean_compressed_entries with topk: each query's min(topk, its complete runs), against the count written out; a model
    with compressed sparse blocks needs both means (named), the chosen entries cost the attention's scores and values (fwd
    and bwd), each seen entry the indexer's forward scores alone, and each block adds its compressor's projections (fwd and
    bwd) and its indexer's (forward), and with the indexer's loss its backward and the csa_topk chosen slots' scores (twice
    forward, and backward)."""
    from fmoe.model import TransformerConfig

    cu = [0, 7, 9, 15, 31]
    for m, topk in ((2, 1), (2, 3), (3, 2), (5, 4)):
        want = sum(min(topk, (p + 1) // m) for a, b in zip(cu, cu[1:]) for p in range(b - a)) / cu[-1]
        assert M.mean_compressed_entries(cu, m, topk) == pytest.approx(want, rel=1e-12)
    assert M.mean_compressed_entries(cu, 2, 100) == M.mean_compressed_entries(cu, 2)
    with pytest.raises(ValueError, match=r"topk: expected >= 1, got 0"):
        M.mean_compressed_entries(cu, 2, 0)
    cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=8, kv_shared=True, q_rank=10, csa_layers=(1, 2),
                            csa_rate=2, csa_topk=2, index_heads=4, index_head_dim=8)
    with pytest.raises(ValueError, match=r"n_avg_csa_entries: blocks \[1, 2\] attend to compressed sparse entries: pass the mean entries a query sees"):
        M.model_flops_per_token(cfg, n_avg_keys=10.0, n_avg_csa_chosen=2.0)
    with pytest.raises(ValueError, match=r"n_avg_csa_chosen: .* \(mean_compressed_entries\(cu_seqlens, csa_rate = 2, csa_topk = 2\)\)"):
        M.model_flops_per_token(cfg, n_avg_keys=10.0, n_avg_csa_entries=3.0)

    def flops(entries, chosen):
        return M.model_flops_per_token(cfg, n_avg_keys=10.0, n_avg_csa_entries=entries, n_avg_csa_chosen=chosen)

    H, N, D, Ni, Di = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.index_heads, cfg.index_head_dim
    assert flops(3.0, 2.0) - flops(3.0, 1.0) == 2 * 6 * N * 2 * D  # two blocks, one more chosen entry each
    assert flops(4.0, 1.0) - flops(3.0, 1.0) == 2 * 2 * Ni * (Di + 1)  # one more scored entry: the indexer's forward
    plain = TransformerConfig(**{**{f: getattr(cfg, f) for f in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                                                   "kv_shared", "q_rank")}})
    per_block = 6 * 2 * H * 2 * D + 2 * (2 * H * 2 * Di + cfg.q_rank * Ni * Di + H * Ni)
    loss = 2 * 2 * H * 2 * Di + 6 * (cfg.q_rank * Ni * Di + H * Ni) + 8 * Ni * (Di + 1) * cfg.csa_topk
    assert flops(0.0, 0.0) - M.model_flops_per_token(plain, n_avg_keys=10.0) == 2 * (per_block + loss)
    frozen = dataclasses.replace(cfg, index_loss_coeff=0.0)  # the indexer's forward alone
    assert M.model_flops_per_token(frozen, n_avg_keys=10.0, n_avg_csa_entries=0.0, n_avg_csa_chosen=0.0) == flops(0.0, 0.0) - 2 * loss


def test_logger_writes_numpy_values_as_their_kind(tmp_path):
    """A numpy integer was written as a float (1000.0), a numpy bool refused as "a bool",
    an array refused; a bool tensor came back from to_host as [1, 0]."""
    import numpy as np

    log = M.MetricsLogger(tmp_path, total_steps=2, print_progress=False)
    log.log(1, {"tokens": np.int64(1000), "ok": np.bool_(True), "lr": np.float32(0.5), "bad": np.float64("nan"),
                "counts": np.array([1, 2]), "mask": torch.tensor([True, False])})
    record = M.read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record == {"step": 1, "tokens": 1000, "ok": True, "lr": 0.5, "bad": None, "counts": [1, 2], "mask": [True, False]}
    assert type(record["tokens"]) is int and type(record["ok"]) is bool
    host = M.to_host({"mask": torch.tensor([True, False]), "any": torch.tensor(True), "n": torch.tensor(3)})
    assert host == {"mask": [True, False], "any": True, "n": 3} and type(host["any"]) is bool and type(host["n"]) is int


def test_flops_per_token_refuses_fractional_sizes_and_counts():
    """flops_per_token checked hidden and n_heads as whole numbers, but ffn_dense, ffn_expert,
    the layer counts n_sliding, n_linear, n_mlp_only, and attention_weights, v_dim, the local
    blocks' weights, heads and head dim were taken fractional (ffn_expert 32.5, n_sliding
    1.5) and gave fractional FLOPs. A whole float is still that number."""
    local = dict(n_sliding=1, n_avg_local_keys=3.0)
    for name, value, extra in (("ffn_dense", 256.5, {}), ("ffn_expert", 32.5, {}), ("n_dense", 0.5, {}), ("n_sliding", 1.5, dict(n_avg_local_keys=3.0)),
                               ("n_linear", 0.5, dict(linear_layer=100.0)), ("n_mlp_only", 0.5, {}), ("v_dim", 16.5, {}),
                               ("attention_weights", 100.5, {}), ("local_attention_weights", 100.5, local),
                               ("local_heads", 1.5, local), ("local_head_dim", 8.5, local)):
        args = {**CFG, **extra, name: value}
        with pytest.raises(ValueError, match=f"^{name}: expected a whole number, got {value}$"):
            M.flops_per_token(**args)
        assert M.flops_per_token(**{**args, name: math.floor(value) + 1.0}) == M.flops_per_token(**{**args, name: math.floor(value) + 1})
    assert M.flops_per_token(**dict(CFG, k=1.5, n_shared=0.5), n_experts=8) > 0  # a mean k, a shared size in units of ffn_expert


def test_layer_loads_checks_a_lists_counts():
    """A list of rows with a negative count gave load metrics ([[-1, 2]]: max/mean 4.0, CV
    3.0), NaN gave NaNs, and string rows torch's "too many dimensions 'str'", naming no
    argument. A tensor's values are still not read on the host."""
    for bad, shown in (([[-1, 2]], "-1"), ([[-1.0, 2.0]], "-1.0"), ([[float("nan"), 2.0]], "nan"), ([[4.0, float("inf")]], "inf")):
        with pytest.raises(ValueError, match=f"^counts: expected finite counts >= 0, got {shown}$"):
            M.layer_loads(bad, 4)
    for bad in ([["a", "b"]], [[1, 2], [3]], None):
        with pytest.raises(ValueError, match=r"^counts: expected \[L, E\] counts \(a tensor or a list of \[E\] rows of numbers\)"):
            M.layer_loads(bad, 4)
    with pytest.raises(ValueError, match="^counts: expected counts"):
        M.layer_loads([[True, False]], 4)
    assert M.to_host(M.layer_loads([[1, 3], [2, 2]], 4)) == M.to_host(M.layer_loads(torch.tensor([[1, 3], [2, 2]]), 4))
    with M.HostReads() as reads:
        M.layer_loads(torch.tensor([[-1, 2]]), 4)  # a tensor: not read (its values are the caller's)
    assert reads.count == 0
    # more slots routed than requested (T passed for T k): dropped_fraction -1.0 before, without a word
    with pytest.raises(ValueError, match=r"^counts: layer 1's counts sum to 8 slots, more than slots=4 \(the slots requested: tokens times k\)$"):
        M.layer_loads([[1, 3], [5, 3]], 4)
    with pytest.raises(ValueError, match=r"^counts: layer 0's counts sum to 101 slots, more than slots=100 "):  # one slot over
        M.layer_loads([[50, 51]], 100)
    assert M.to_host(M.layer_loads([[1, 2]], 4))["dropped_fraction"] == [0.25]
    assert M.to_host(M.layer_loads([[0.1] * 10], 1))["dropped_fraction"][0] == pytest.approx(0.0, abs=1e-6)  # fractions summing to it


def test_format_progress_checks_step_and_width_and_shows_numpy_loads():
    """step and width were not checked: NaN, None and "3" gave unrelated errors, width 0 or
    -3 printed "[]", total_steps 1.5 printed "step 1/1.5"; a numpy load_max_over_mean (which
    MetricsLogger.log writes) was left out of the line; 2e12 tok/s printed 2000.0G. A loss of
    several values is refused by name (torch's error named no field); a 0-D numpy loss shows."""
    for name, args, want in (("step", (float("nan"), 10, {}), "expected an int, got nan"), ("step", (None, 10, {}), "expected an int"),
                             ("step", ("3", 10, {}), "expected an int"), ("step", (-1, 10, {}), "expected >= 0, got -1"),
                             ("total_steps", (1, 1.5, {}), "expected an int, got 1.5")):
        with pytest.raises(ValueError, match=f"^{name}: {want}"):
            M.format_progress(*args)
    for width, want in ((2.5, "expected an int, got 2.5"), (None, "expected an int, got None"), (0, "expected >= 1, got 0"), (-3, "expected >= 1")):
        with pytest.raises(ValueError, match=f"^width: {want}"):
            M.format_progress(5, 10, {}, width=width)
    assert M.format_progress(5, 10, {}, width=4) == "[##..] step 5/10"
    import numpy as np

    for loads in (np.array([1.2, 1.5]), np.float64(1.5), torch.tensor([1.2, 1.5])):
        assert M.format_progress(5, 10, {"load_max_over_mean": loads}) == "[##########..........] step 5/10 load 1.50", loads
    assert M.format_progress(5, 10, {"tokens_per_s": 2e12}) == "[##########..........] step 5/10 tok/s 2.0T"
    for loss, kind in ((torch.tensor([2.0, 3.0, 4.0]), r"Tensor of shape \[3\]"), (np.zeros((2, 1)), r"ndarray of shape \[2, 1\]")):
        with pytest.raises(ValueError, match=rf"^record\['loss'\]: expected a number or a one-element tensor, got a {kind}$"):
            M.format_progress(5, 10, {"loss": loss})  # torch's "a Tensor with 3 elements cannot be converted to Scalar"
    for loss in (torch.tensor([2.5]), np.array(2.5), np.float32(2.5)):
        assert M.format_progress(5, 10, {"loss": loss}, width=2) == "[#.] step 5/10 loss 2.5000"


def test_to_host_refuses_complex_values():
    """A complex tensor became the int of its real part (1.5+2j -> 1, [3+4j] -> [3]), with
    only torch's cast warning; MetricsLogger.log refuses complex values."""
    for value, shown in ((torch.tensor(1.5 + 2j), r"tensor \(torch.complex64\)"), (torch.tensor([3 + 4j]), "tensor"), (1 + 2j, r"number \(1\+2j\)")):
        with pytest.raises(ValueError, match=rf"^values\['c'\]: expected a real \(or bool\) tensor or number, got a complex {shown}"):
            M.to_host({"loss": torch.tensor(1.0), "c": value})
    assert M.to_host({"x": torch.tensor(2.5), "n": 3, "s": "text"}) == {"x": 2.5, "n": 3, "s": "text"}


def test_logger_takes_int_steps_and_read_metrics_a_file(tmp_path):
    """MetricsLogger took total_steps 2.5 and start_step 1.5 (checked as finite numbers, then
    records of step < 1.5 kept); read_metrics gave IsADirectoryError for a directory and a
    TypeError for None, naming no argument."""
    log = M.MetricsLogger(tmp_path, total_steps=10, print_progress=False)
    for step in range(3):
        log.log(step, {"loss": 1.0})
    for kwargs, want in ((dict(total_steps=2.5), "total_steps: expected an int, got 2.5"), (dict(total_steps=10.0), "total_steps: expected an int"),
                         (dict(total_steps=10, start_step=1.5), "start_step: expected an int, got 1.5"),
                         (dict(total_steps=10, start_step=-1), "start_step: expected >= 0, got -1")):
        with pytest.raises(ValueError, match=f"^{want}"):
            M.MetricsLogger(tmp_path, print_progress=False, **kwargs)
    assert [r["step"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]  # a refused logger rewrote nothing
    with pytest.raises(ValueError, match="^path: expected the path of a metrics.jsonl, got the directory"):
        M.read_metrics(tmp_path)
    with pytest.raises(ValueError, match=r"^path: expected the path of a metrics.jsonl \(str or os.PathLike\), got NoneType"):
        M.read_metrics(None)
    assert M.read_metrics(str(tmp_path / "none.jsonl")) == []


def test_series_leaves_out_values_of_another_kind():
    """_series keeps numbers and nulls (as NaN); a string, a bool or a list under the key is left out, as said."""
    plot = _plot()

    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": "2.5"}, {"step": 3, "loss": True}, {"step": 4, "loss": [1.0]},
               {"step": 5, "loss": 1}]
    assert plot._series(records, "loss") == ([1, 5], [2.0, 1])


def test_mtp_panel_takes_the_depths_keys_only():
    """mtp_*_loss matches a whole key: mtp_1_loss, not a key that merely starts like one."""
    plot = _plot()

    records = [{"step": 1, "mtp_1_loss": 2.0, "mtp_1_loss_tokens": 40.0, "mtp_2_loss_ema": 3.0}]
    assert plot._logged(records, ("mtp_*_loss",)) == ["mtp_1_loss"]


def test_loss_plot_draws_a_source_that_some_evaluations_lack(tmp_path, monkeypatch):
    """val_loss_by_source whose sources differ between evaluations (a source added to the blend):
    each source's line has the evaluations that name it (a KeyError otherwise)."""
    plot = _plot()

    drawn = []
    monkeypatch.setattr(plot, "_draw_panel", lambda ax, series, ylabel: drawn.append((ylabel, dict(series))))
    records = [{"step": 2, "loss": 3.0, "val_loss": 3.1, "val_loss_by_source": {"code": 3.0, "docs": 3.2}},
               {"step": 4, "loss": 2.0, "val_loss": 2.1, "val_loss_by_source": {"code": 2.1}}]
    assert plot.plot_losses(records, tmp_path / "loss.png", plot._pyplot())
    assert drawn[0][1]["val_loss code"] == ([2, 4], [3.0, 2.1]) and drawn[0][1]["val_loss docs"] == ([2], [3.2])


def test_a_panel_of_one_series_has_no_legend(tmp_path):
    """A legend only where a panel draws several lines (its y label names the one)."""
    plot = _plot()

    pyplot, Keeps, figures = _keeping_pyplot()
    records = [{"step": s, "loss": 3.0 / s, "val_loss": 3.5 / s, "z_loss": 0.1 * s} for s in (1, 2)]
    assert plot.plot_losses(records, tmp_path / "loss.png", Keeps)
    legends = {ax.get_ylabel(): ax.get_legend() is not None for ax in figures[0].axes}
    assert legends == {"loss / val_loss": True, "z_loss": False}
    pyplot.close("all")


def test_expert_load_ignores_empty_per_layer_lists():
    """A dense model logs load_max_over_mean = [] and tokens_per_expert = [] (no MoE layer): nothing to draw."""
    plot = _plot()

    records = [{"step": s, "loss": 3.0, "load_max_over_mean": [], "tokens_per_expert": []} for s in (1, 2)]
    assert plot._load_matrix(records) is None
    assert not plot.plot_expert_load(records, "unused.png", plot._pyplot())


def test_expert_load_refuses_negative_counts():
    plot = _plot()

    with pytest.raises(ValueError, match=r"^records: tokens_per_expert at step 3: expected a list of per-layer lists of expert counts "
                                         r"\(numbers >= 0\), got \[\[1, -2\]\]"):
        plot._load_matrix([{"step": 3, "tokens_per_expert": [[1, -2]]}])
    with pytest.raises(ValueError, match=r"^records: tokens_by_source at step 1: expected a token count \(a number >= 0\) per source"):
        plot._source_shares([{"step": 1, "tokens_by_source": {"code": -5, "docs": 10}}])


def test_expert_load_of_a_layer_that_routed_no_token():
    """A layer whose counts are all 0 (no token reached it at that step) draws shares of 0, not a ZeroDivisionError."""
    plot = _plot()

    steps, mom, per_layer = plot._load_matrix([{"step": 1, "tokens_per_expert": [[0, 0], [1, 3]]}])
    assert per_layer == [[[0.0], [0.0]], [[0.5], [1.5]]] and mom == [[0.0], [1.5]]


def test_expert_load_draws_the_logged_load_where_there_is_one():
    """The logged load_max_over_mean is drawn as logged (null: a gap); only a record without it takes max(share)."""
    plot = _plot()

    records = [{"step": 1, "load_max_over_mean": [1.25, None], "tokens_per_expert": [[1, 3], [2, 2]]},
               {"step": 2, "tokens_per_expert": [[1, 3], [2, 2]]}]
    steps, mom, _ = plot._load_matrix(records)
    assert mom[0] == [1.25, 1.5] and math.isnan(mom[1][0]) and mom[1][1] == 1.0


def test_expert_load_without_counts_at_every_step_draws_the_load_alone(tmp_path):
    """tokens_per_expert logged at some steps only (a resumed run that turned it on): the max/mean heatmap alone."""
    plot = _plot()

    records = [{"step": 1, "load_max_over_mean": [1.5]}, {"step": 2, "tokens_per_expert": [[1, 3]]}]
    steps, mom, per_layer = plot._load_matrix(records)
    assert steps == [1, 2] and mom == [[1.5, 1.5]] and per_layer is None
    pyplot, Keeps, figures = _keeping_pyplot()
    assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
    assert [ax.get_title() for ax in figures[0].axes if ax.get_title()] == ["expert load max/mean per MoE layer"]
    pyplot.close("all")


def test_expert_load_heatmap_cells_are_centred_on_their_step_and_row(tmp_path):
    """One logged step: its column spans step +- 0.5; each row r spans r +- 0.5, under its y tick."""
    plot = _plot()

    pyplot, Keeps, figures = _keeping_pyplot()
    records = [{"step": 5, "tokens_per_expert": [[1, 3, 2], [2, 2, 2]]}]
    assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
    load, share = [ax for ax in figures[0].axes if ax.get_title()][:2]
    coords = load.collections[0].get_coordinates()  # [rows + 1, columns + 1, (x, y)]
    assert list(coords[0, :, 0]) == [4.5, 5.5] and list(coords[:, 0, 1]) == [-0.5, 0.5, 1.5]
    assert list(load.get_yticks()) == [0, 1]
    assert list(share.collections[0].get_coordinates()[:, 0, 1]) == [-0.5, 0.5, 1.5, 2.5]
    pyplot.close("all")


def test_expert_load_names_the_layers_by_the_last_record_that_logs_them(tmp_path):
    """moe_layers from the latest record that carries it (an older record may lack or predate the names)."""
    plot = _plot()

    pyplot, Keeps, figures = _keeping_pyplot()
    records = [{"step": 1, "load_max_over_mean": [1.5], "moe_layers": ["layer 0"]},
               {"step": 2, "load_max_over_mean": [1.2], "moe_layers": ["layer_1"]}]
    assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
    assert [t.get_text() for t in figures[0].axes[0].get_yticklabels()] == ["layer_1"]
    pyplot.close("all")


def test_expert_share_heatmap_is_centred_on_uniform(tmp_path):
    """The shares' colour scale is fixed at [0, 2]: 1 (uniform) is the middle colour whatever the data's range."""
    plot = _plot()

    pyplot, Keeps, figures = _keeping_pyplot()
    records = [{"step": 1, "tokens_per_expert": [[1, 2, 3]]}]  # shares 0.5, 1, 1.5
    assert plot.plot_expert_load(records, tmp_path / "expert_load.png", Keeps)
    share = [ax for ax in figures[0].axes if ax.get_title()][1]
    assert share.collections[0].get_clim() == (0.0, 2.0)
    pyplot.close("all")


def test_source_shares_skip_steps_without_tokens_and_sources_a_step_lacks():
    """A step whose sources counted no token is left out (no share of 0 / 0); a source a step lacks has share 0 there."""
    plot = _plot()

    records = [{"step": 1, "tokens_by_source": {"code": 0, "docs": 0}}, {"step": 2, "tokens_by_source": {"code": 30, "docs": 10}},
               {"step": 3, "tokens_by_source": {"code": 20}}]
    assert plot._source_shares(records) == {"code": ([2, 3], [0.75, 1.0]), "docs": ([2, 3], [0.25, 0.0])}


def test_health_norms_panel_stays_linear_unless_every_finite_value_is_positive(tmp_path):
    """Log scale only when every finite value is > 0: a zero gradient norm (a frozen step), or no finite value at all
    (a diverged run's nulls), keeps the panel linear."""
    plot = _plot()

    pyplot, Keeps, figures = _keeping_pyplot()
    zero = [{"step": s, "grad_norm": 0.0 if s == 1 else 1.0 / s, "param_norm": 40.0} for s in (1, 2, 3)]
    nulls = [{"step": s, "grad_norm": None, "param_norm": None} for s in (1, 2)]
    assert plot.plot_health(zero, tmp_path / "health.png", Keeps) and plot.plot_health(nulls, tmp_path / "health.png", Keeps)
    assert [fig.axes[0].get_yscale() for fig in figures] == ["linear", "linear"]
    pyplot.close("all")


def test_health_panels_take_signals_logged_from_a_later_step_on(tmp_path):
    """energy_j_per_token (and any signal) first logged after step 1 still gets its panel."""
    plot = _plot()

    pyplot, Keeps, figures = _keeping_pyplot()
    records = [{"step": 1, "grad_norm": 1.0, "param_norm": 40.0},
               {"step": 2, "grad_norm": 0.5, "param_norm": 40.0, "energy_j_per_token": 0.002}]
    assert plot.plot_health(records, tmp_path / "health.png", Keeps)
    assert [ax.get_ylabel() for ax in figures[0].axes] == ["grad_norm / param_norm", "energy_j_per_token"]
    pyplot.close("all")
