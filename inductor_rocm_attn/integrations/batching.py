"""Greedy generation for a batch of ragged prompts over a runner (continuous batching).

>>> result = generate(runner, [[5, 17, 3], [9, 4]], max_new_tokens=8)
>>> result.tokens            # the new tokens of each prompt
[[...], [...]]

Works with any runner that has the ``prepare(query_lens, context_lens, block_tables)`` /
``runner(input_ids, metadata) -> logits [num_tokens, vocab]`` API and attention layers whose
caches it fills: a ``PiecewiseRunner`` (``compile_piecewise``, ``compile_transformers``) or an
``EagerRunner``. Each step decodes one token of every sequence whose prompt is cached and
fills the rest of the step's token budget with prompt chunks (whole prompts, or the next
chunk of a long one on top of its cached part), so prefill and decode share steps until
every prompt is in; then decode-only steps follow, which a runner with whole-step graphs
replays as one graph each. Blocks come from a ``BlockAllocator`` over the layers' caches and
are freed when a sequence has its ``max_new_tokens``. A prompt is admitted only when the
blocks it will hold at its longest fit beside those of the running sequences, so the cache
never runs out mid-generation; prompts wait, in order, until enough blocks are freed.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import time
from typing import Callable, Sequence

import torch

from .. import cache_holds
from ..block_allocator import BlockAllocator
from ..validation import check_bool, check_positive_int, is_int, vocab_size_of

__all__ = ["GenerateResult", "StepRecord", "generate"]


@dataclasses.dataclass
class StepRecord:
    """What one step ran: sequences, real tokens (prefill chunks + decodes), wall time."""

    index: int
    num_seqs: int
    num_tokens: int
    num_decodes: int
    whole_step_graph: bool
    seconds: float

    @property
    def kind(self) -> str:
        if self.num_decodes == self.num_seqs:
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # per prompt: the generated tokens
    logits: list[list[torch.Tensor]] | None  # per prompt: the fp32 logits each token was chosen from
    steps: list[StepRecord]
    seconds: float

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.seconds if self.seconds else 0.0


@dataclasses.dataclass
class _Seq:
    rid: int
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    cached: int = 0  # tokens already in the cache
    blocks: int = 0  # cache blocks it holds at its longest (prompt + max_new_tokens - 1 tokens)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_len


def num_cache_blocks(runner) -> int:
    """The fewest blocks of the runner's layers' caches (every layer shares the block ids)."""
    return min(layer.kv_cache.shape[0] for layer in runner.layers.values())


_UNORDERED = (collections.abc.Set, collections.abc.Mapping)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _prompt_ids(i: int, prompt) -> list[int]:
    """Prompt ``i`` as a list of token ids: a sequence of ints or a 1-D integer tensor (a float
    or bool id is refused, not truncated to an int)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype not in _INT_DTYPES:
            raise TypeError(f"generate: prompt {i} must be a 1-D integer tensor of token ids, got "
                            f"{tuple(prompt.shape)} {prompt.dtype}")
        return prompt.tolist()
    if isinstance(prompt, _UNORDERED):  # its ids in hash order, or a mapping's keys
        raise TypeError(f"generate: prompt {i} is a {type(prompt).__name__}, which has no token order; give a list "
                        "of token ids or a 1-D integer tensor")
    try:
        ids = None if isinstance(prompt, (str, bytes)) else list(prompt)
    except TypeError:
        ids = None
    if ids is None:
        raise TypeError(f"generate: prompt {i} must be a list of token ids or a 1-D integer tensor, got "
                        f"{type(prompt).__name__} {prompt!r:.40} (prompts: a list of prompts)")
    for t in ids:
        if not is_int(t):
            raise TypeError(f"generate: prompt {i} holds {t!r} ({type(t).__name__}); token ids are ints")
    return [int(t) for t in ids]


@torch.no_grad()
def generate(runner, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int, *,
             max_tokens_per_step: int | None = None, max_seqs_per_step: int | None = None,
             return_logits: bool = False, on_step: Callable[[StepRecord], None] | None = None,
             num_blocks: int | None = None) -> GenerateResult:
    """Greedy ``max_new_tokens`` for every prompt (token id lists or 1-D tensors).

    ``max_tokens_per_step`` / ``max_seqs_per_step``: a step's budget (default the runner's
    ``max_num_tokens`` / ``max_num_seqs``). ``return_logits``: keep each generated token's
    logits (fp32, on the CPU). ``on_step``: called after every step. ``num_blocks``: blocks
    to hand out (default every block of the layers' caches).

    Refused before the first step: limits above the runner's, prompts or token ids in a set
    or dict (no order), token ids that are not ints or not in the vocabulary, a prompt whose
    tokens and ``max_new_tokens`` cannot fit the runner's ``max_model_len`` or the blocks
    handed out, and a generate while another one runs on the same caches. While it runs, a
    step on its caches from anyone else (``on_step``, another thread, another runner over
    the same caches) is refused by that runner's ``prepare``, and so is binding other caches
    to its layers (``cache_holds``)."""
    check_bool("generate", "return_logits", return_logits)
    with cache_holds.hold(runner.layers.values()):
        return _generate(runner, prompts, max_new_tokens, max_tokens_per_step=max_tokens_per_step,
                         max_seqs_per_step=max_seqs_per_step, return_logits=return_logits, on_step=on_step,
                         num_blocks=num_blocks)


def _generate(runner, prompts, max_new_tokens, *, max_tokens_per_step, max_seqs_per_step, return_logits,
              on_step, num_blocks) -> GenerateResult:
    """``generate`` while it holds the runner's caches."""
    if isinstance(prompts, _UNORDERED):  # results come back by position: a set has none, a dict gave its keys
        raise TypeError(f"generate: prompts must be a list of prompts (token id lists or 1-D integer tensors), got a "
                        f"{type(prompts).__name__}, which has no order to return the results in")
    try:
        prompts = list(prompts)  # iterated twice (a generator would be empty the second time)
    except TypeError:
        raise TypeError(f"generate: prompts must be a list of prompts (token id lists or 1-D integer tensors), "
                        f"got {type(prompts).__name__} {prompts!r:.40}") from None
    check_parameters = getattr(runner, "check_parameters", None)
    if check_parameters is not None:  # every compiled tensor, once (each step checks two)
        check_parameters()
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    # Every limit is checked against the runner's before the first step: a step the runner
    # cannot plan would fail only when the schedule reaches it, after the steps before it ran.
    limits = {"max_tokens_per_step": (max_tokens_per_step, runner.max_num_tokens,
                                      "the runner's max_num_tokens"),
              "max_seqs_per_step": (max_seqs_per_step, runner.max_num_seqs, "the runner's max_num_seqs"),
              "num_blocks": (num_blocks, num_cache_blocks(runner), "the blocks of the runner's caches")}
    for name, (value, most, what) in limits.items():
        if value is None:
            continue
        check_positive_int("generate", name, value)
        if value > most:
            raise ValueError(f"generate: {name} {value} is above {what} ({most})")
    budget = runner.max_num_tokens if max_tokens_per_step is None else max_tokens_per_step
    max_seqs = min(runner.max_num_seqs if max_seqs_per_step is None else max_seqs_per_step,
                   budget)  # every sequence decodes each step
    blocks = num_cache_blocks(runner) if num_blocks is None else num_blocks
    if on_step is not None and not callable(on_step):
        raise TypeError(f"generate: on_step must be callable or None, got {type(on_step).__name__}")
    waiting = []
    for i, p in enumerate(prompts):
        ids = _prompt_ids(i, p)
        waiting.append(_Seq(i, ids, len(ids)))
    empty = next((s.rid for s in waiting if s.prompt_len == 0), None)
    if empty is not None:
        raise ValueError(f"generate: prompt {empty} is empty; every prompt needs at least one token id")
    vocab = vocab_size_of(getattr(runner, "model", None))
    max_len = getattr(runner, "max_model_len", None)
    for s in waiting:  # the embedding's own error names no prompt and no vocabulary
        bad = next((t for t in s.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise ValueError(f"generate: prompt {s.rid} holds token id {bad}, outside the model's "
                             f"vocabulary [0, {vocab if vocab is not None else 'vocab_size'})")
        # the cache holds the prompt and every new token but the last
        need = s.prompt_len + max_new_tokens - 1
        if max_len is not None and need > max_len:
            raise ValueError(f"generate: prompt {s.rid} ({s.prompt_len} tokens) with max_new_tokens "
                             f"{max_new_tokens} reaches {need} cached tokens, above the runner's max_model_len "
                             f"{max_len}")
        s.blocks = -(-need // runner.block_size)
        if s.blocks > blocks:
            raise ValueError(f"generate: prompt {s.rid} ({s.prompt_len} tokens) with max_new_tokens "
                             f"{max_new_tokens} reaches {need} cached tokens, more than {blocks} blocks of "
                             f"{runner.block_size} hold")
    waiting.reverse()  # pop() admits prompts in order
    alloc = BlockAllocator(blocks, runner.block_size)
    out: list[list[int]] = [[] for _ in prompts]
    logits_out: list[list[torch.Tensor]] | None = [[] for _ in prompts] if return_logits else None
    running: list[_Seq] = []
    reserved = 0  # blocks the running sequences will hold at their longest
    steps: list[StepRecord] = []
    t_start = time.perf_counter()
    while running or waiting:
        t0 = time.perf_counter()
        chunks: list[tuple[_Seq, int]] = [(s, 1) for s in running if not s.prefilling]
        room = budget - len(chunks)
        for s in running:  # prompts partly cached continue first
            if s.prefilling and room > 0 and len(chunks) < max_seqs:
                n = min(s.prompt_len - s.cached, room)
                chunks.append((s, n))
                room -= n
        # Admission control: a prompt is admitted only when the blocks it will ever hold
        # (prompt and every new token) fit beside those the running sequences will hold, so a
        # running sequence never finds the cache full. First come, first served: a prompt
        # that does not fit yet waits, and so do the prompts behind it.
        while waiting and room > 0 and len(chunks) < max_seqs:
            if reserved + waiting[-1].blocks > blocks:
                break
            s = waiting.pop()
            reserved += s.blocks
            running.append(s)
            n = min(s.prompt_len, room)
            chunks.append((s, n))
            room -= n
        num_decodes = sum(1 for s, _ in chunks if not s.prefilling)
        qlens = [n for _, n in chunks]
        clens = [s.cached for s, _ in chunks]
        tables = [list(alloc.allocate(s.rid, n)) for s, n in chunks]
        ids = torch.tensor([t for s, n in chunks for t in s.tokens[s.cached:s.cached + n]], dtype=torch.long)
        with cache_holds.own_step():
            md = runner.prepare(qlens, clens, tables)
            whole = runner.replays_whole_step(md)
            logits = runner(ids.to(runner.device), md)
        # The last token of a sequence's chunk picks its next token once its prompt is cached.
        done = [(i, s) for i, (s, n) in enumerate(chunks) if s.cached + n >= s.prompt_len]
        ends = torch.tensor(qlens).cumsum(0) - 1
        rows = logits[ends[[i for i, _ in done]].to(logits.device)]
        next_tokens = rows.argmax(-1).tolist()
        kept = rows.float().cpu() if return_logits else None
        for (s, n) in chunks:
            s.cached += n
        for k, ((_, s), tok) in enumerate(zip(done, next_tokens)):
            s.tokens.append(tok)
            out[s.rid].append(tok)
            if kept is not None:
                logits_out[s.rid].append(kept[k])
        finished = [s for _, s in done if len(out[s.rid]) >= max_new_tokens]
        for s in finished:
            alloc.free(s.rid)
            reserved -= s.blocks
            running.remove(s)
        record = StepRecord(len(steps), len(chunks), sum(qlens), num_decodes, whole, time.perf_counter() - t0)
        steps.append(record)
        if on_step is not None:
            on_step(record)
    return GenerateResult(out, logits_out, steps, time.perf_counter() - t_start)
