"""The numerics judge's rules without a GPU (tests/numerics.py, Note [judging per decision]), NumPy alone:
the ways a wrong step passed the judge before (a ReLU flipped far from 0, or passed through an entry far
below 0; a window routed to an entry far below its maximum; a batch with no image left to judge), each
built on purpose, passed by the old rules (transcribed below) and failed by the new; and a step whose only
differing decisions are near-ties passes."""

from __future__ import annotations

import numpy as np

from numerics import MARGIN, MIN_AGREE, RTOL_AGREE, differing_decisions, host_windows, verdict

GOOD = {"conv1.weight": (3e-7, 5e-7), "fc2.bias": (1e-7, 2e-7)}   # the agreeing images' distances


def step(n: int, seed: int = 0):
    """A step on n images where ours agrees with float64 everywhere: one stage of 2x2 conv outputs per
    image (one window, its entries apart by 0.1 or more, its maximum 1.0 or more from 0), fc1 of 3 units."""
    rng = np.random.default_rng(seed)
    c = np.empty((n, 1, 2, 2))
    for i in range(n):
        top = rng.choice([-1.0, 1.0]) * rng.uniform(1.0, 2.0)
        c[i, 0] = (top - np.array([0.0, 0.1, 0.2, 0.3]))[rng.permutation(4)].reshape(2, 2)
    win = host_windows(c)
    chosen = win.argmax(-1)
    pooled = np.maximum(win.max(-1), 0).astype(np.float32)
    a3 = rng.choice([-1.0, 1.0], (n, 3)) * rng.uniform(0.5, 1.0, (n, 3))
    h1 = np.maximum(a3, 0).astype(np.float32)
    return [chosen], [c], [pooled], h1, a3


def judged(chosen, convs, pooled, h1, a3, agree=GOOD):
    differ, margins = differing_decisions(chosen, convs, pooled, h1, a3)
    kept = int((~differ).sum())
    worst = max((m for _, _, m in margins), default=0.0)
    return verdict(agree if kept else {}, kept, len(a3), worst), differ, margins


def old_rules(chosen, convs, pooled, h1, a3, agree=GOOD) -> bool:
    """The judge's rules before this change (scripts/numerics.py at ad74234), in NumPy: a window's margin its
    top two's gap, a ReLU's its float64 output after ReLU, and a pass when no image was left to judge."""
    n = len(a3)
    differ, margins = np.zeros(n, bool), []
    for arg, c, p32 in zip(chosen, convs, pooled):
        win, scale = host_windows(c), np.abs(c).max()
        p64 = np.maximum(win.max(-1), 0)
        top2 = -np.sort(-win, -1)[..., :2]
        wrong = (arg != win.argmax(-1)) & (p64 > 0)
        relu = (p32 > 0) != (p64 > 0)
        differ |= (wrong | relu).reshape(n, -1).any(1)
        margins += list((top2[..., 0] - top2[..., 1])[wrong] / scale) + list(np.abs(p64[relu]) / scale)
    fc1 = (h1 > 0) != (a3 > 0)
    differ |= fc1.any(1)
    margins += list(np.abs(a3[fc1]) / np.abs(a3).max())
    agree = agree if (~differ).any() else {}
    return all(v[0] <= RTOL_AGREE for v in agree.values()) and max(margins, default=0.0) <= MARGIN


def test_a_step_that_agrees_everywhere_passes():
    why, differ, margins = judged(*step(64))
    assert why is None and not differ.any() and margins == []


def test_a_relu_taken_the_other_way_far_from_zero_fails():
    """Float64's window maximum is -0.5 (ReLU off) and ours' pooled output 0.3 (on): a wrong decision 0.5
    from its tie. Its margin is |pre-activation|, not float64's output after ReLU (0, which passed)."""
    chosen, convs, pooled, h1, a3 = step(64)
    convs[0][0, 0] = [[-0.5, -0.6], [-0.7, -0.8]]
    chosen[0][0] = 0
    pooled[0][0] = 0.3
    assert old_rules(chosen, convs, pooled, h1, a3)
    why, differ, margins = judged(chosen, convs, pooled, h1, a3)
    assert differ.sum() == 1 and margins == [("relu", "stage 1", 0.5 / np.abs(convs[0]).max())]
    assert why is not None and "from a tie" in why, why


def test_a_relu_passed_through_an_entry_far_below_zero_fails_though_the_window_maximum_nearly_ties():
    """Float64's window is (-1e-9, -0.5, -0.6, -0.7): off, by a hair. Ours passed its second entry as positive:
    in float64 that entry is 0.5 below 0, and that is the decision's margin, not the maximum's 1e-9."""
    chosen, convs, pooled, h1, a3 = step(64)
    convs[0][0, 0] = [[-1e-9, -0.5], [-0.6, -0.7]]
    chosen[0][0] = 1
    pooled[0][0] = 0.4
    assert old_rules(chosen, convs, pooled, h1, a3)
    why, _, margins = judged(chosen, convs, pooled, h1, a3)
    assert [(k, round(m * np.abs(convs[0]).max(), 12)) for k, _, m in margins] == [("relu", 0.5)]
    assert why is not None and "from a tie" in why, why


def test_a_window_routed_far_below_its_maximum_fails_though_its_top_two_nearly_tie():
    """Float64's window is (1, 1 - 1e-9, 0.2, 0.1) and ours took the 0.1: the top two's gap is 1e-9, but ours'
    entry is 0.9 below the maximum."""
    chosen, convs, pooled, h1, a3 = step(64)
    convs[0][0, 0] = [[1.0, 1.0 - 1e-9], [0.2, 0.1]]
    chosen[0][0] = 3
    pooled[0][0] = 1.0
    assert old_rules(chosen, convs, pooled, h1, a3)
    why, _, margins = judged(chosen, convs, pooled, h1, a3)
    assert [k for k, _, _ in margins] == ["window"] and abs(margins[0][2] * np.abs(convs[0]).max() - 0.9) < 1e-12
    assert why is not None and "from a tie" in why, why


def test_a_batch_with_too_few_images_agreeing_fails_where_none_left_passed():
    """Every image's fc1 has one unit a hair (1e-9) on the other side of 0: each decision is a near-tie, but
    no image is left whose gradients can be judged; all([]) passed it."""
    chosen, convs, pooled, h1, a3 = step(64)
    a3[:, 0] = -1e-9
    h1[:, 0] = 1e-9
    assert old_rules(chosen, convs, pooled, h1, a3)
    why, differ, margins = judged(chosen, convs, pooled, h1, a3)
    assert differ.all() and max(m for _, _, m in margins) <= MARGIN
    assert why is not None and "0 of 64 images agree" in why, why
    # fewer than MIN_AGREE of the batch is too few as well; at MIN_AGREE it is judged
    a3[: int(64 * MIN_AGREE), 0] = 0.75
    h1[: int(64 * MIN_AGREE), 0] = 0.75
    assert judged(chosen, convs, pooled, h1, a3)[0] is None
    a3[0, 0], h1[0, 0] = -1e-9, 1e-9
    assert "too few to judge" in judged(chosen, convs, pooled, h1, a3)[0]


def test_near_ties_taken_the_other_way_pass_and_leave_their_images_out():
    """What float32 may do: a window whose top two are 1e-9 apart routed to the second, a ReLU 1e-9 from 0
    taken the other way; those images are left out, the rest judged, and the step passes."""
    chosen, convs, pooled, h1, a3 = step(64)
    convs[0][1, 0] = [[1.0, 1.0 - 1e-9], [0.2, 0.1]]
    chosen[0][1] = 1
    pooled[0][1] = 1.0
    convs[0][2, 0] = [[-1e-9, -0.6], [-0.7, -0.8]]
    chosen[0][2] = 0
    pooled[0][2] = 1e-9
    why, differ, margins = judged(chosen, convs, pooled, h1, a3)
    assert why is None and list(np.flatnonzero(differ)) == [1, 2] and len(margins) == 2
    assert verdict({"conv1.weight": (2e-6, 3e-6)}, 62, 64, 0.0) is not None   # the agreeing images still held


def test_host_windows_are_the_judges_windows_in_the_same_order():
    """The host's windows (NumPy) and float64_step's (torch) list a window's entries alike (a00, a01, a10,
    a11: q = 2 dy + dx, as our argmax bytes and cuDNN's first maximum)."""
    import pytest

    torch = pytest.importorskip("torch")
    from numerics import windows

    c = np.arange(2 * 3 * 4 * 6, dtype=np.float64).reshape(2, 3, 4, 6)
    assert np.array_equal(host_windows(c), windows(torch.from_numpy(c)).numpy())
    assert list(host_windows(c)[0, 0, 0, 1]) == [c[0, 0, 0, 2], c[0, 0, 0, 3], c[0, 0, 1, 2], c[0, 0, 1, 3]]
