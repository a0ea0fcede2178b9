"""What a serving engine adds to a model's result: the KV-cache capacity it allocates for a memory budget,
and whether its greedy text is transformers' text; and the report section that compares them.

A paged KV cache (vLLM's) holds ``budget / kv_bytes_per_token`` tokens, rounded down to whole blocks, so a
model with G K/V heads holds H/G times the tokens of its MHA original in the same memory: H/G times the
sequences at once. The throughput at each concurrency level is a :class:`~gqakit.eval.decode.DecodePoint`
(batch = concurrent sequences) with its rounds and spread, shown in the report's decode grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GreedyAgreement:
    """Greedy continuations of fixed prompts in the engine against transformers, token by token.

    Attributes:
        prompts: prompts compared.
        tokens_per_prompt: tokens generated for each.
        identical: tokens that match transformers' before each prompt's first divergence, summed.
        first_divergence: ``[prompt, position]`` of the first differing token; None when all match.
    """

    prompts: int
    tokens_per_prompt: int
    identical: int
    first_divergence: list[int] | None = None

    @classmethod
    def compare(cls, engine: list[list[int]], reference: list[list[int]]) -> GreedyAgreement:
        """Compare the engine's continuations with transformers' (same prompts, same lengths)."""
        identical, first = 0, None
        for i, (a, b) in enumerate(zip(engine, reference, strict=True)):
            same = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            identical += same
            if first is None and (same < len(b) or len(a) != len(b)):
                first = [i, same]
        return cls(len(reference), len(reference[0]) if reference else 0, identical, first)

    def describe(self) -> str:
        total = self.prompts * self.tokens_per_prompt
        text = f"{self.identical}/{total}"
        if self.first_divergence is not None:
            prompt, token = self.first_divergence
            text += f" (first divergence: prompt {prompt}, token {token})"
        return text


@dataclass
class ServingResult:
    """A model as a serving engine holds it.

    Attributes:
        engine: the engine and its version (``vllm 0.32.0``).
        kv_budget_bytes: the KV-cache memory budget on a CPU (None on a GPU, where vLLM sizes it from
            ``gpu_memory_utilization``).
        kv_tokens: tokens the engine's KV cache holds.
        block_size: tokens per KV-cache block.
        context: the sequence length ``max_sequences`` is counted at.
        max_sequences: sequences of ``context`` tokens the cache holds at once (whole blocks each).
        greedy: greedy agreement with transformers.
    """

    engine: str
    kv_budget_bytes: int | None
    kv_tokens: int | None
    block_size: int
    context: int
    max_sequences: int | None = None
    greedy: GreedyAgreement | None = None

    def __post_init__(self) -> None:
        if isinstance(self.greedy, dict):
            self.greedy = GreedyAgreement(**self.greedy)
        if self.kv_tokens is not None and self.max_sequences is None:
            blocks = -(-self.context // self.block_size)
            self.max_sequences = self.kv_tokens // (blocks * self.block_size)


def serving_table(models: list[Any], baseline: str | None) -> str:
    """The report's serving table: capacity, its ratio to the baseline beside H/G, greedy agreement.

    ``models`` are :class:`~gqakit.eval.results.ModelResult` with ``serving`` set.
    """
    base = next((m for m in models if m.label == baseline), None)
    context = models[0].serving.context
    header = [
        "model",
        "KV heads (G/H)",
        "KV cache / token",
        "KV capacity (tokens)",
        f"sequences of {context:,}",
        "capacity ratio",
        "bound (KV bytes)",
        "greedy tokens identical to transformers",
    ]
    rows = []
    for m in models:
        s = m.serving
        ratio = bound = "–"
        if base is not None and base.serving.kv_tokens and s.kv_tokens:
            ratio = f"{s.kv_tokens / base.serving.kv_tokens:.2f}×"
            bound = f"{base.kv_bytes_per_token / m.kv_bytes_per_token:.2f}×"
        rows.append(
            [
                m.label,
                f"{m.num_kv_heads}/{m.num_heads}",
                f"{m.kv_bytes_per_token / 1024:.1f} KiB",
                f"{s.kv_tokens:,}" if s.kv_tokens is not None else "–",
                f"{s.max_sequences:,}" if s.max_sequences is not None else "–",
                ratio,
                bound,
                s.greedy.describe() if s.greedy else "–",
            ]
        )
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


__all__ = ["GreedyAgreement", "ServingResult", "serving_table"]
