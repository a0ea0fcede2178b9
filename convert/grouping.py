"""Which K/V heads share a group, and the whole-head permutation that makes each group contiguous.

HF's ``repeat_kv`` serves query head ``j`` from K/V head ``j // (H / G)``, so after conversion a group
is a run of consecutive heads. ``--grouping contiguous`` keeps the heads where they are; ``similarity``
chooses equal-sized groups by the merge's own reconstruction error and then reorders the heads::

    before (H = 4, K = 4)           groups {0, 2} {1, 3}          after (G = 2)
    q0 q1 q2 q3                     q0 q2 | q1 q3                 q0' q1' q2' q3'
    k0 k1 k2 k3          ->         k0 k2 | k1 k3       ->          \\  /    \\  /
                                                                     k0'     k1'

A permutation moves a K/V head together with every query head it serves (q_proj rows, their bias,
per-head query norms, o_proj columns), so by itself it changes no output
(tests/convert/test_grouping.py checks this on several families).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import combinations

import torch


def contiguous_groups(num_kv_heads: int, groups: int) -> list[list[int]]:
    """What ``repeat_kv`` implies: group ``g`` is heads ``g*r .. g*r + r - 1``."""
    r = num_kv_heads // groups
    return [list(range(g * r, (g + 1) * r)) for g in range(groups)]


def similarity_groups(
    cost: Callable[[Sequence[int]], float], num_kv_heads: int, groups: int
) -> list[list[int]]:
    """Equal-sized groups of K/V heads that merge with little error.

    Args:
        cost: the merge's reconstruction error for a candidate group of head indices (relative, so
            keys and values can be added).
        num_kv_heads: K/V heads now (K).
        groups: K/V heads wanted (G); ``K / G`` heads per group.

    Returns:
        ``G`` groups, each sorted, ordered by their first head.

    Greedy on pairwise costs (seed each group with the cheapest remaining pair, grow it by the head
    closest to its members), then swap heads between groups while the sum of within-group pair costs
    drops. Exhaustive search is out of reach for 32 heads; pairs are cheap and catch heads that are
    near copies of each other, which is what matters most.
    """
    r = num_kv_heads // groups
    if r == 1 or groups == 1:
        return contiguous_groups(num_kv_heads, groups)
    pair = torch.zeros(num_kv_heads, num_kv_heads, dtype=torch.float64)
    for i, j in combinations(range(num_kv_heads), 2):
        pair[i, j] = pair[j, i] = cost([i, j])

    remaining = set(range(num_kv_heads))
    result: list[list[int]] = []
    while remaining:
        if len(remaining) == r:
            result.append(sorted(remaining))
            break
        i, j = min(combinations(sorted(remaining), 2), key=lambda p: (float(pair[p[0], p[1]]), p))
        group = [i, j]
        while len(group) < r:
            group.append(min(sorted(remaining - set(group)), key=lambda h: float(pair[h, group].sum())))
        result.append(sorted(group))
        remaining -= set(group)

    def within(g: list[int]) -> float:
        return float(sum(pair[a, b] for a, b in combinations(g, 2)))

    improved, passes = True, 0
    while improved and passes < 20:
        improved, passes = False, passes + 1
        for ga, gb in combinations(range(len(result)), 2):
            for a in list(result[ga]):
                for b in list(result[gb]):
                    na = [h for h in result[ga] if h != a] + [b]
                    nb = [h for h in result[gb] if h != b] + [a]
                    if within(na) + within(nb) < within(result[ga]) + within(result[gb]) - 1e-12:
                        result[ga], result[gb] = sorted(na), sorted(nb)
                        improved = True
                        break
                else:
                    continue
                break
    return sorted(result)


def query_order(kv_order: Sequence[int], n_rep: int) -> list[int]:
    """Query heads in the order that follows ``kv_order`` (each K/V head keeps its ``n_rep`` queries)."""
    return [i * n_rep + t for i in kv_order for t in range(n_rep)]


def permute_rows(t: torch.Tensor, order: Sequence[int], d: int) -> torch.Tensor:
    """Reorder head blocks of ``d`` rows of ``[n * d, ...]``: block ``p`` becomes old block ``order[p]``."""
    rest = tuple(t.shape[1:])
    return t.reshape(-1, d, *rest)[list(order)].reshape(-1, *rest)


def permute_cols(w: torch.Tensor, order: Sequence[int], d: int) -> torch.Tensor:
    """Reorder head blocks of ``d`` columns of ``[out, n * d]`` (o_proj)."""
    return w.reshape(w.shape[0], -1, d)[:, list(order)].reshape(w.shape[0], -1)
