"""lr_at (every style and edge), the LambdaLR adapter, batch-size schedules."""

import decimal
import math

import numpy
import pytest
import torch

from fmoe.optim.schedules import batch_size_at, lr_at, lr_scheduler, parse_batch_schedule

STYLES = ["constant", "linear", "cosine", "inverse_sqrt", "wsd"]
WSD_STYLES = ["linear", "cosine", "exponential", "minus_sqrt"]
# (warmup, total, wsd_decay, init_lr, min_lr): ordinary, no warmup, no decay phase (D == W),
# WSD decaying over the whole post-warmup span, WSD with no decay, nonzero init
CONFIGS = [
    (10, 100, 20, 0.0, 0.1),
    (0, 50, 10, 0.0, 0.0),
    (7, 7, 0, 0.05, 0.01),
    (5, 45, 40, 0.0, 0.2),
    (3, 30, 0, 0.0, 0.1),
    (12, 90, 1, 0.3, 0.05),
]


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def _reference(n, max_lr, total, warmup, min_lr, init_lr, style, wsd_decay, wsd_style):
    """SPEC.md section 7, written out piece by piece."""
    if warmup > 0 and n <= warmup:
        return init_lr + (max_lr - init_lr) * n / warmup
    if style == "constant":
        return max_lr
    if n > total:
        return min_lr
    if style == "inverse_sqrt":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    span = total - warmup
    r = 0.0 if span == 0 else (n - warmup) / span
    if style == "wsd":
        start = total - wsd_decay
        rw = 0.0 if n <= start else (n - start) / wsd_decay
        coeff = {
            "linear": lambda x: 1 - x,
            "cosine": lambda x: (math.cos(math.pi * x) + 1) / 2,
            "exponential": lambda x: 2 * 0.5**x - 1,
            "minus_sqrt": lambda x: 1 - x**0.5,
        }[wsd_style](rw)
    else:
        coeff = {"linear": 1 - r, "cosine": (math.cos(math.pi * r) + 1) / 2}[style]
    return min_lr + (max_lr - min_lr) * coeff


def _all_styles():
    yield from ((s, "linear") for s in STYLES if s != "wsd")
    yield from (("wsd", w) for w in WSD_STYLES)


# ---------------------------------------------------------------------------- lr_at values


def test_lr_spec_check_minus_sqrt():
    kw = dict(max_lr=1.0, min_lr=0.1, total=100, warmup=10, style="wsd", wsd_decay=20, wsd_style="minus_sqrt")
    assert [round(lr_at(n, **kw), 4) for n in (85, 90, 95)] == [0.55, 0.3636, 0.2206]
    assert lr_at(80, **kw) == 1.0 and lr_at(100, **kw) == pytest.approx(0.1, abs=1e-15)


# hand-computed: W=10, D=110 (so r = (n - 10) / 100), max 1, min 0.1, init 0
@pytest.mark.parametrize(
    "style, step, expected",
    [
        ("cosine", 0, 0.0),
        ("cosine", 5, 0.5),
        ("cosine", 10, 1.0),
        ("cosine", 35, 0.1 + 0.9 * 0.8535533906),  # r = 1/4: c = (cos(pi/4) + 1) / 2
        ("cosine", 60, 0.55),
        ("cosine", 110, 0.1),
        ("linear", 35, 0.775),
        ("linear", 60, 0.55),
        ("linear", 109, 0.109),
        ("constant", 60, 1.0),
        ("constant", 110, 1.0),
        ("constant", 111, 1.0),  # past the end: constant stays at max_lr
        ("inverse_sqrt", 40, 0.5),  # sqrt(10 / 40)
        ("inverse_sqrt", 90, 1 / 3),
        ("inverse_sqrt", 111, 0.1),
    ],
)
def test_lr_hand_computed(style, step, expected):
    got = lr_at(step, max_lr=1.0, min_lr=0.1, total=110, warmup=10, style=style)
    assert got == pytest.approx(expected, abs=1e-9)


# W=10, D=100, D_wsd=20, max 1, min 0.1: r_w = 1/4 at step 85 and 1/2 at step 90
@pytest.mark.parametrize(
    "wsd_style, at85, at90",
    [
        ("linear", 0.775, 0.55),
        ("cosine", 0.1 + 0.9 * 0.8535533906, 0.55),
        ("exponential", 0.1 + 0.9 * (2 * 0.8408964153 - 1), 0.1 + 0.9 * (2 * 0.7071067812 - 1)),
        ("minus_sqrt", 0.55, 0.1 + 0.9 * (1 - 0.7071067812)),
    ],
)
def test_lr_wsd_hand_computed(wsd_style, at85, at90):
    kw = dict(max_lr=1.0, min_lr=0.1, total=100, warmup=10, style="wsd", wsd_decay=20, wsd_style=wsd_style)
    assert lr_at(85, **kw) == pytest.approx(at85, abs=1e-9)
    assert lr_at(90, **kw) == pytest.approx(at90, abs=1e-9)
    assert [lr_at(n, **kw) for n in (11, 50, 80)] == [1.0, 1.0, 1.0]  # stable phase


def test_lr_constant_stays_at_max_after_warmup_and_past_total():
    """A constant schedule has no decay: max_lr from the end of the warmup on, past `total`
    too, whatever min_lr (Megatron Core's constant style); the warmup still applies."""
    assert lr_at(102, max_lr=1.0, min_lr=0.1, total=100, style="constant") == 1.0
    kw = dict(max_lr=3e-4, min_lr=3e-5, total=50, warmup=10, init_lr=1e-5, style="constant")
    assert lr_at(5, **kw) == pytest.approx(1e-5 + (3e-4 - 1e-5) / 2, rel=1e-12)
    assert [lr_at(n, **kw) for n in (10, 11, 50, 51, 10**6)] == [3e-4] * 5
    assert lr_at(1, max_lr=2.0, total=0, style="constant") == 2.0


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse_sqrt", "wsd"])
def test_lr_is_a_float_whatever_number_type_the_lrs_came_as(style):
    """DESIGN's lr_at(...) -> float: with int or numpy lrs every phase (warmup, decay, past
    total) returns a Python float (constant's max_lr and the floor past total came back as
    the int given)."""
    for max_lr, min_lr in ((1, 0), (numpy.int64(2), numpy.float32(0.5))):
        for step in (0, 5, 10, 50, 100, 101, 1000):
            lr = lr_at(step, max_lr=max_lr, min_lr=min_lr, init_lr=0, total=100, warmup=10, style=style, wsd_decay=20)
            assert type(lr) is float, (step, type(lr))
            assert 0 <= lr <= max_lr and (step <= 10 or lr >= min_lr)


def test_lr_is_exactly_max_lr_on_the_plateau_and_at_the_warmup_end():
    """min + c (max - min) rounds away from max_lr at c = 1 (1e-2 with min 1e-3 gave
    0.010000000000000002); the formula min (1 - c) + max c does not. At n = W every style
    gives max_lr exactly (inverse_sqrt's decay at W = 190 was one ulp off)."""
    for max_lr, min_lr in ((1e-2, 1e-3), (0.3, 0.1), (3e-4, 3e-5)):
        assert lr_at(50, max_lr=max_lr, min_lr=min_lr, total=100, warmup=10, style="wsd", wsd_decay=20) == max_lr
        for style in ("linear", "cosine", "inverse_sqrt", "wsd", "constant"):
            for W in (190, 195, 7):
                assert lr_at(W, max_lr=max_lr, min_lr=min_lr, total=1000, warmup=W, style=style, wsd_decay=10) == max_lr, (style, W)


def test_lr_inverse_sqrt_floor():
    kw = dict(max_lr=1.0, min_lr=0.2, total=1000, warmup=10, style="inverse_sqrt")
    assert lr_at(250, **kw) == pytest.approx(0.2)  # sqrt(10 / 250) = 0.2
    assert lr_at(640, **kw) == 0.2  # sqrt(10 / 640) = 0.125 is below the floor


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_lr_matches_reference_everywhere(config):
    warmup, total, wsd_decay, init_lr, min_lr = config
    for style, wsd_style in _all_styles():
        kw = dict(
            max_lr=2e-3, total=total, warmup=warmup, min_lr=min_lr * 2e-3, init_lr=init_lr * 2e-3,
            style=style, wsd_decay=wsd_decay, wsd_style=wsd_style,
        )
        for n in range(total + 6):
            assert lr_at(n, **kw) == pytest.approx(_reference(n, **kw), rel=1e-12, abs=1e-18), (style, wsd_style, n)


# ---------------------------------------------------------------------------- lr_at edges


@pytest.mark.parametrize("style, wsd_style", list(_all_styles()))
def test_lr_edges(style, wsd_style):
    kw = dict(max_lr=1.0, min_lr=0.1, init_lr=0.01, style=style, wsd_style=wsd_style)
    end = 1.0 if style == "constant" else 0.1  # constant never decays
    # step 0 with warmup: init_lr; n == W: max_lr; past the end: min_lr (constant: max_lr)
    assert lr_at(0, total=100, warmup=10, wsd_decay=20, **kw) == 0.01
    assert lr_at(10, total=100, warmup=10, wsd_decay=20, **kw) == 1.0
    for n in (101, 102, 10**6):
        assert lr_at(n, total=100, warmup=10, wsd_decay=20, **kw) == end
    # W == 0: no warmup, step 0 already at max_lr (init_lr unused), no division by zero
    assert lr_at(0, total=100, warmup=0, wsd_decay=20, **kw) == 1.0
    # D == W: max_lr at W, min_lr right after it
    assert lr_at(10, total=10, warmup=10, **kw) == 1.0
    assert lr_at(11, total=10, warmup=10, **kw) == end
    # D == W == 0
    assert lr_at(0, total=0, warmup=0, **kw) == 1.0
    assert lr_at(1, total=0, warmup=0, **kw) == end


@pytest.mark.parametrize("style, wsd_style", list(_all_styles()))
def test_lr_continuous_at_warmup_end_and_wsd_start(style, wsd_style):
    kw = dict(max_lr=1.0, min_lr=0.1, total=100, warmup=10, wsd_decay=20, style=style, wsd_style=wsd_style)
    eps = 1e-9  # minus_sqrt leaves the WSD start with an infinite slope: 0.9 sqrt(eps / 20)
    for point in (10, 80) if style == "wsd" else (10,):
        left, mid, right = (lr_at(point + d, **kw) for d in (-eps, 0, eps))
        assert mid == 1.0 and abs(left - mid) < 1e-5 and abs(right - mid) < 1e-5, point
    if style in ("linear", "cosine", "wsd"):  # the decaying styles land on min_lr at D
        assert lr_at(100, **kw) == pytest.approx(0.1, abs=1e-12)
        assert lr_at(100 - eps, **kw) == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_lr_monotonic(config):
    warmup, total, wsd_decay, init_lr, min_lr = config
    for style, wsd_style in _all_styles():
        kw = dict(max_lr=1.0, total=total, warmup=warmup, min_lr=min_lr, init_lr=init_lr,
                  style=style, wsd_decay=wsd_decay, wsd_style=wsd_style)
        rising = [lr_at(n, **kw) for n in range(warmup + 1)]
        falling = [lr_at(n, **kw) for n in range(warmup, total + 10)]
        assert all(a < b for a, b in zip(rising, rising[1:])), (style, wsd_style)
        assert all(a >= b for a, b in zip(falling, falling[1:])), (style, wsd_style)
        assert all(min_lr <= lr <= 1.0 for lr in falling)


def test_lr_bad_arguments():
    kw = dict(max_lr=1.0, total=100, warmup=10)
    _raises("step: expected a finite number >= 0", lr_at, -1, **kw)
    _raises("step:", lr_at, float("nan"), **kw)
    for style in ("cosine", "constant"):  # the schedule's end (or its top) without a word
        _raises(r"^step: expected a finite number >= 0, got inf$", lr_at, math.inf, **kw, style=style)
    assert lr_at(10**400, max_lr=1.0, total=10**401, warmup=0, style="linear") == pytest.approx(0.9)  # a huge int is finite
    _raises("step:", lr_at, "3", **kw)
    # a tensor step (an optimizer state's float32 step) gave a tensor lr in float32; a Decimal a TypeError inside
    for bad in (torch.tensor(5), torch.tensor(50.0), decimal.Decimal(5), numpy.True_):
        _raises(r"step: expected a finite number >= 0, got", lr_at, bad, **kw)
    assert lr_at(numpy.int64(50), **kw) == lr_at(50, **kw) and lr_at(numpy.float32(5.0), **kw) == 0.5  # numpy's numbers are numbers
    _raises(r"wsd_decay: expected at most total - warmup = 90, got 91", lr_at, 5, **kw, style="wsd", wsd_decay=91)
    _raises("wsd_decay:", lr_at, 5, **kw, wsd_decay=-1)
    assert lr_at(10, **kw, style="wsd", wsd_decay=90) == 1.0  # the whole span is allowed
    _raises("warmup: expected at most total=100", lr_at, 5, max_lr=1.0, total=100, warmup=101)
    _raises("warmup:", lr_at, 5, max_lr=1.0, total=100, warmup=-1)
    _raises("total:", lr_at, 5, max_lr=1.0, total=100.0)
    _raises("total:", lr_at, 5, max_lr=1.0, total=-5)
    _raises("max_lr: expected a positive", lr_at, 5, max_lr=0.0, total=100)
    _raises("min_lr:", lr_at, 5, max_lr=1.0, total=100, min_lr=2.0)
    _raises("min_lr:", lr_at, 5, max_lr=1.0, total=100, min_lr=-0.1)
    _raises("init_lr:", lr_at, 5, max_lr=1.0, total=100, init_lr=-0.1)
    for name in ("max_lr", "min_lr", "init_lr"):  # inf gave inf, a string a TypeError
        for bad in (math.inf, "1e-3", True, math.nan):
            _raises(f"^{name}: expected a finite number, got {bad!r}$", lr_at, 5, **{"max_lr": 1.0, "total": 100, "warmup": 10, name: bad})
    _raises("style: expected one of", lr_at, 5, **kw, style="cos")
    _raises("wsd_style: expected one of", lr_at, 5, **kw, style="wsd", wsd_style="sqrt")


def test_lr_wsd_decay_is_bounded_only_where_used():
    """wsd_decay is WSD's alone: another style ignores its value (a large one was refused),
    but not its type."""
    kw = dict(max_lr=1.0, min_lr=0.1, total=10, warmup=2)
    for style in ("constant", "linear", "cosine", "inverse_sqrt"):
        assert lr_at(5, **kw, style=style, wsd_decay=50) == lr_at(5, **kw, style=style)
        _raises("^wsd_decay: expected an integer >= 0", lr_at, 5, **kw, style=style, wsd_decay=-1)
        _raises("^wsd_decay: expected an integer >= 0", lr_at, 5, **kw, style=style, wsd_decay=2.5)
        _raises("^wsd_decay: expected an integer >= 0", lr_at, 5, **kw, style=style, wsd_decay=True)
    _raises(r"^wsd_decay: expected at most total - warmup = 8, got 50", lr_at, 5, **kw, style="wsd", wsd_decay=50)


# ---------------------------------------------------------------------------- LambdaLR adapter


def test_lr_scheduler_reproduces_lr_at():
    kw = dict(max_lr=0.02, min_lr=0.002, init_lr=0.001, total=40, warmup=8, style="wsd", wsd_decay=12,
              wsd_style="exponential")
    main = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.SGD([{"params": [main]}, {"params": [half], "lr": 0.01}], lr=0.02)
    sched = lr_scheduler(opt, **kw)
    for step in range(50):
        expected = lr_at(step, **kw)
        assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-14)
        assert opt.param_groups[1]["lr"] == pytest.approx(expected / 2, rel=1e-14)  # its own scale
        before = main.detach().clone()
        main.grad, half.grad = torch.ones_like(main), torch.ones_like(half)
        opt.step()  # SGD: p -= lr * 1, so the step really used lr_at(step)
        torch.testing.assert_close(before - main.detach(), torch.full_like(main, expected), rtol=1e-12, atol=0)
        sched.step()


def test_lr_scheduler_resumes_at_the_loaded_step_s_lr(tmp_path):
    """torch's LambdaLR.load_state_dict leaves the groups' lr alone: with the optimizer's state
    loaded without its knobs (checkpoint.load(knobs="held"), what train_moe passes), the first
    resumed step ran at the fresh scheduler's lr_at(0), 0 in the warmup. Now the loaded
    step's, each group's own scale kept; the steps after follow the uninterrupted run."""
    from fmoe.optim import AdamW
    from fmoe.train import checkpoint

    kw = dict(max_lr=1e-2, min_lr=1e-3, total=10, warmup=2, style="cosine")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 5e-3}], lr=1e-2)
        return model, opt, lr_scheduler(opt, **kw)

    def steps(model, opt, sched, n):
        lrs = []
        for _ in range(n):
            model(torch.ones(2, 4)).square().sum().backward()
            lrs.append([g["lr"] for g in opt.param_groups])
            opt.step()
            opt.zero_grad()
            sched.step()
        return lrs

    model, opt, sched = build()
    steps(model, opt, sched, 5)
    checkpoint.save(tmp_path, 5, model=model, optimizers=[opt], extra={"sched": sched.state_dict()})
    after = steps(model, opt, sched, 3)
    assert after[0] == pytest.approx([lr_at(5, **kw), lr_at(5, **kw) / 2], rel=1e-14)
    for knobs in ("held", "saved"):
        resumed, ropt, rsched = build()
        extra = checkpoint.load(tmp_path, model=resumed, optimizers=[ropt], knobs=knobs)
        rsched.load_state_dict(extra["sched"])
        assert steps(resumed, ropt, rsched, 3) == after and torch.equal(resumed.weight, model.weight), knobs


def test_lr_scheduler_checks_arguments_at_construction():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    _raises("wsd_decay:", lr_scheduler, opt, max_lr=1.0, total=10, warmup=5, style="wsd", wsd_decay=6)
    _raises("max_lr:", lr_scheduler, opt, max_lr=0.0, total=10)


# ---------------------------------------------------------------------------- batch size


def test_parse_batch_schedule_suffixes():
    assert parse_batch_schedule("0:32 50M:64 200M:128") == [(0, 32), (50_000_000, 64), (200_000_000, 128)]
    assert parse_batch_schedule("0:1 2K:2 3M:3 4B:4 5T:5") == [
        (0, 1), (2_000, 2), (3_000_000, 3), (4_000_000_000, 4), (5_000_000_000_000, 5),
    ]
    assert parse_batch_schedule(" 0:8\t1.5M:16\n2.25B:24 ") == [  # any whitespace separates
        (0, 8), (1_500_000, 16), (2_250_000_000, 24),
    ]
    assert parse_batch_schedule("0:4 .5K:8 1000:16") == [(0, 4), (500, 8), (1000, 16)]
    assert parse_batch_schedule("0:512") == [(0, 512)]


def test_batch_size_at_boundaries():
    schedule = "0:32 50M:64 200M:128"
    expected = {0: 32, 1: 32, 49_999_999: 32, 50_000_000: 64, 50_000_001: 64, 199_999_999: 64,
                200_000_000: 128, 10**13: 128, 1.5e8: 64}
    for tokens, batch in expected.items():
        assert batch_size_at(tokens, schedule) == batch, tokens
        assert batch_size_at(tokens, parse_batch_schedule(schedule)) == batch, tokens
    assert batch_size_at(10**15, "0:7") == 7


def test_batch_schedule_errors():
    for bad in ["", "   ", "0:32 x:64", "0:32 50M", "0-32", "0:32:64", ":32", "0:", "0:32 5m:64",
                "0:32 1X:64", "0:32K", "-1:4 0:32"]:
        _raises("schedule:", parse_batch_schedule, bad)
        _raises("schedule:", batch_size_at, 0, bad)
    _raises("schedule: expected THRESHOLD:BATCH pairs", batch_size_at, 0, "")
    _raises("schedule: cannot parse '50M'", batch_size_at, 0, "0:32 50M")
    _raises("schedule: the first threshold must be 0", batch_size_at, 0, "1:32 50M:64")
    _raises("schedule: thresholds must strictly increase", batch_size_at, 0, "0:32 50M:64 50M:128")
    _raises("schedule: thresholds must strictly increase", batch_size_at, 0, "0:32 50M:64 40M:128")
    _raises("schedule: thresholds must strictly increase", batch_size_at, 0, "0:32 0:64")
    _raises("schedule: batch sizes must be positive", batch_size_at, 0, "0:32 1K:0")
    _raises("schedule: cannot parse", batch_size_at, 0, "0:-1")
    _raises("schedule: cannot parse", batch_size_at, 0, "0:3.5")
    _raises("schedule: threshold '1.0000005K' is not a whole number", batch_size_at, 0, "0:2 1.0000005K:3")
    # exact however long (28 digits were rounded: this was 1000 tokens, the other ...790) and ASCII digits only
    _raises("schedule: threshold '1.00000000000000000000000000001K' is not a whole number", parse_batch_schedule,
            "0:1 1.00000000000000000000000000001K:2")
    assert parse_batch_schedule("0:1 12345678901234567890123456789:2")[1] == (12345678901234567890123456789, 2)
    _raises("schedule: cannot parse '\u0661\u0660:2'", parse_batch_schedule, "0:1 \u0661\u0660:2")
    _raises("schedule: cannot parse '5:\u0663'", parse_batch_schedule, "0:1 5:\u0663")
    # the list form is checked the same way
    _raises("schedule: expected THRESHOLD:BATCH pairs", batch_size_at, 0, [])
    _raises("schedule: the first threshold must be 0", batch_size_at, 0, [(1, 2)])
    _raises("schedule: thresholds must strictly increase", batch_size_at, 0, [(0, 2), (5, 3), (5, 4)])
    _raises("schedule: batch sizes must be positive", batch_size_at, 0, [(0, 0)])
    _raises("schedule: expected a string or a list", batch_size_at, 0, [(0, 2.5)])
    _raises("schedule: expected a string or a list", batch_size_at, 0, [(0,)])
    _raises("schedule: expected a string or a list", batch_size_at, 0, 32)
    _raises("schedule: expected a string", parse_batch_schedule, [(0, 32)])
    # tokens_consumed
    _raises("tokens_consumed: expected a finite number >= 0", batch_size_at, -1, "0:32")
    _raises("tokens_consumed:", batch_size_at, float("nan"), "0:32")
    _raises(r"^tokens_consumed: expected a finite number >= 0, got inf$", batch_size_at, math.inf, "0:32 1M:64")
    _raises("tokens_consumed:", batch_size_at, "5", "0:32")


def test_batch_schedule_list_refuses_bools():
    """A bool is not an integer here: (10, True) gave a batch of 1 (operator.index(True))."""
    _raises("^schedule: expected a string or a list", batch_size_at, 10, [(0, 4), (10, True)])
    _raises("^schedule: expected a string or a list", batch_size_at, 10, [(False, 4), (10, 8)])
    assert batch_size_at(10, [(0, 4), (10, 8)]) == 8
